"""What sits between the HTTP handlers and the engine (an `EngineClient`): starting one or more
engine requests, mapping the engine's errors to HTTP errors, metrics per request, and aborting
every request the response did not see finish.

A call's requests start in `start_jobs`, before the response does, so a refusal (bad input, a
full queue, a dead engine) is an HTTP status and not an error inside a 200 stream. Whatever ends
the response (done, client gone, cancelled, error), `abort_unfinished` aborts what is left.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Sequence

from fastapi import Request

from paxengine.client import EngineClient, ModelInfo
from paxengine.errors import EngineDead, EngineError, EngineOverloaded, InvalidRequest, StepFailed
from paxengine.sampling_params import SamplingParams
from paxengine.validation import check_token_ids
from serving import generation_config
from serving.config import ServerConfig
from serving.drain import Drain
from serving.errors import ApiError
from serving.metrics import ServerMetrics, cache_config_labels

log = logging.getLogger("serving")


@dataclass
class ServerState:
    engine: EngineClient
    config: ServerConfig
    info: ModelInfo
    metrics: ServerMetrics
    drain: Drain
    # --generation-config's default SamplingParams fields (a request's own values win)
    defaults: dict = field(default_factory=dict)
    # the engine's tokenizer rendering chats with --chat-template's template; None: the engine's
    templated: object = None
    _bg: set = field(default_factory=set)
    # --trust-request-chat-template: tokenizers rendering with the requests' own templates, by
    # their text (compiling one takes milliseconds; the last few are kept)
    _request_templates: dict = field(default_factory=dict)
    _templates_lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def create(cls, engine: EngineClient, config: ServerConfig) -> "ServerState":
        info = engine.model_info()
        metrics = ServerMetrics(
            config.metrics_prefix,
            info.name,
            engine.stats,
            info.max_model_len,
            cache_config_labels(getattr(engine, "config", None)),
        )
        mode, model = (
            config.generation_config,
            getattr(getattr(engine, "config", None), "model", None),
        )
        override = config.override_generation_config
        values, path = generation_config.defaults(mode, model, override)
        log.info("%s", generation_config.describe(values, path, mode, override))
        state = cls(engine, config, info, metrics, Drain(config.shutdown_timeout), values)
        template = config.chat_template_text()
        if template is not None:
            state.templated = engine.tokenizer.with_chat_template(template)
            log.info("chat template: --chat-template's, not the model's")
        return state

    def request_templated(self, template: str):
        """The engine's tokenizer rendering chats with a request's own `chat_template`
        (ValueError naming the fault where Jinja cannot parse it)."""
        with self._templates_lock:
            tok = self._request_templates.pop(template, None)
        if tok is None:
            tok = self.engine.tokenizer.with_chat_template(template)
        with self._templates_lock:  # the most recent last; the oldest goes past 16
            self._request_templates[template] = tok
            while len(self._request_templates) > 16:
                self._request_templates.pop(next(iter(self._request_templates)))
        return tok

    def draining_error(self) -> ApiError:
        return ApiError(
            503,
            "the server is shutting down; retry on another replica",
            code="server_draining",
            headers={"Retry-After": str(self.config.retry_after_s)},
        )

    @property
    def model_name(self) -> str:
        return self.info.name

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def tokenizer(self):
        return self.templated if self.templated is not None else self.engine.tokenizer

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.info.name and name not in self.info.aliases:
            raise ApiError(
                404,
                f"The model `{name}` does not exist. Available: {self.model_name!r}.",
                param="model",
                code="model_not_found",
            )

    def check_tokens(self, ids: Sequence[int], param: str = "prompt") -> None:
        try:
            check_token_ids(ids, self.vocab_size, param)
        except InvalidRequest as e:
            raise self.api_error(e) from None

    def api_error(self, e: EngineError) -> ApiError:
        """The one mapping of the engine's errors to HTTP."""
        if isinstance(e, InvalidRequest):
            return ApiError(400, str(e), param=e.param, code=e.code)
        if isinstance(e, EngineOverloaded):
            self.metrics.rejected("overloaded")
            return ApiError(
                503,
                f"server overloaded: {e}",
                code="server_overloaded",
                headers={"Retry-After": str(self.config.retry_after_s)},
            )
        if isinstance(e, EngineDead):
            self.metrics.rejected("unhealthy")
            return ApiError(503, f"the engine is not running: {e}", code="engine_unhealthy")
        return ApiError(500, f"engine error: {e}")

    def spawn_abort(self, request_id: str) -> None:
        """engine.abort on a task of its own, so it runs even from a cancelled scope."""

        async def _abort():
            try:
                await self.engine.abort(request_id)
            except Exception:  # already finished / unknown id: nothing to free
                log.debug("abort(%s) failed", request_id, exc_info=True)

        try:
            task = asyncio.get_running_loop().create_task(_abort())
        except RuntimeError:
            return
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)


@dataclass
class Job:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: Optional[AsyncIterator] = None  # engine.generate's outputs, once started
    finished: bool = False
    prompt: Optional[str] = None  # the prompt's text, where there is one (--enable-log-requests)
    engine: str = "0"  # the `engine` label of its metrics: the replica that serves it


def start_jobs(state: ServerState, jobs: list[Job]) -> None:
    """Hand every job to the engine, or none: a refusal aborts the ones already started. While
    the server drains, none."""
    if state.drain.draining:
        state.metrics.rejected("draining")
        raise state.draining_error()
    for i, job in enumerate(jobs):
        if state.config.enable_log_requests:
            log_inputs(state.config, job)
        try:
            job.stream = state.engine.generate(job.request_id, job.prompt_ids, job.params)
        except EngineError as e:
            abort_unfinished(state, jobs[:i], count=False)
            raise state.api_error(e) from None
        index = getattr(state.engine, "engine_index", None)  # several engines: which one
        if index is not None:
            job.engine = str(index(job.request_id) or 0)
        state.drain.track(job.request_id)


def _cut(x, n: Optional[int]):
    return x if n is None or x is None else x[:n]


def log_inputs(cfg: ServerConfig, job: Job) -> None:
    """--enable-log-requests (vLLM's RequestLogger): a line per engine request, its prompt's
    text and token ids cut to --max-log-len, its sampling parameters."""
    log.info(
        "Received request %s: prompt: %r, prompt_token_ids: %s, params: %s",
        job.request_id,
        _cut(job.prompt, cfg.max_log_len),
        _cut(list(job.prompt_ids), cfg.max_log_len),
        job.params,
    )


def log_outputs(cfg: ServerConfig, request_id: str, out) -> None:
    """--enable-log-outputs (vLLM's): a line per finished output, its text cut to --max-log-len;
    its token ids at debug level."""
    for o in out.outputs:
        name = request_id if len(out.outputs) == 1 else f"{request_id} (choice {o.index})"
        log.info(
            "Generated response %s: output: %r, finish_reason: %s",
            name,
            _cut(o.text, cfg.max_log_len),
            o.finish_reason,
        )
        log.debug(
            "Generated response %s: output_token_ids: %s",
            name,
            _cut(list(o.token_ids), cfg.max_log_len),
        )


def log_delta(cfg: ServerConfig, request_id: str, index: int, n: int, text: str) -> None:
    """--enable-log-deltas (vLLM's, on by default under --enable-log-outputs): a line per
    streamed chunk that carries text (content, else a tool call's arguments), cut to
    --max-log-len."""
    if text:
        name = request_id if n == 1 else f"{request_id} (choice {index})"
        log.info(
            "Generated response %s (streaming delta): output: %r", name, _cut(text, cfg.max_log_len)
        )


def abort_unfinished(state: ServerState, jobs: list[Job], count: bool = True) -> None:
    for job in jobs:
        if job.stream is not None and not job.finished:
            job.finished = True
            state.drain.untrack(job.request_id)
            state.spawn_abort(job.request_id)
            if count:
                for _ in range(job.params.n):
                    state.metrics.finished("abort", job.engine)


async def _tracked(state: ServerState, job: Job) -> AsyncIterator:
    """The job's outputs, observing TTFT, ITL and the finished request's histograms."""
    m, t0 = state.metrics, time.monotonic()
    e = m.engine(job.engine)
    first, last_t, last_n = True, t0, 0
    async with aclosing(job.stream) as stream:
        try:
            async for out in stream:
                now = time.monotonic()
                ntok = max((len(o.token_ids) for o in out.outputs), default=0)
                if ntok > last_n:
                    if first:
                        em = out.metrics
                        e.ttft.observe(
                            em.first_token_time - em.arrival_time
                            if em.first_token_time is not None
                            else now - t0
                        )
                        first = False
                    else:
                        k = ntok - last_n
                        for _ in range(k):
                            e.itl.observe((now - last_t) / k)
                    last_t, last_n = now, ntok
                if out.finished:
                    job.finished = True
                    state.drain.untrack(job.request_id)
                    if state.config.enable_log_outputs:
                        log_outputs(state.config, job.request_id, out)
                    m.observe_request(
                        out.metrics,
                        len(job.prompt_ids),
                        [len(o.token_ids) for o in out.outputs],
                        job.params.max_tokens,
                        job.engine,
                    )
                    for o in out.outputs:
                        m.finished(o.finish_reason, job.engine)
                yield out
        except StepFailed:  # the engine ended it (a 500): vLLM's finished reason "error"
            if not job.finished:
                job.finished = True
                state.drain.untrack(job.request_id)
                for _ in range(job.params.n):
                    m.finished("error", job.engine)
            raise


async def run_requests(state: ServerState, jobs: list[Job]) -> AsyncIterator[tuple[int, object]]:
    """Run started jobs concurrently; yield (job index, cumulative RequestOutput) as they come.
    The queue is bounded: while the consumer waits (a slow client), the pumps wait too and the
    engine's outputs coalesce in its mailbox (AsyncEngine), so memory stays bounded."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(jobs))
    _DONE = object()

    async def pump(i: int, job: Job):
        try:
            async with aclosing(_tracked(state, job)) as it:
                async for out in it:
                    await queue.put((i, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # handed to the consumer
            await queue.put((i, e))
            return
        await queue.put((i, _DONE))

    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(pump(i, j)) for i, j in enumerate(jobs)]
    # --request-timeout: the engine aborts what is still running then, and each job ends with
    # its last output (finish_reason "abort"), as a client's own abort would
    limit = state.config.request_timeout
    timer = (
        loop.call_later(
            limit, lambda: [state.spawn_abort(j.request_id) for j in jobs if not j.finished]
        )
        if limit
        else None
    )
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, EngineError):
                raise state.api_error(item) from item
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        if timer is not None:
            timer.cancel()
        for t in tasks:
            t.cancel()


class ClientDisconnected(Exception):
    pass


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, coro):
    """Await `coro` unless the client goes away first (then it is cancelled)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    try:
        await task
    except BaseException:
        pass
    raise ClientDisconnected()
