"""What sits between the HTTP handlers and `AsyncEngine`: admission checks, running one or more
engine requests concurrently, metrics per request, and aborting on every early exit.

Abort paths: a handler that stops consuming `run_requests` (client gone, server shutdown, error)
cancels the per-request pump tasks; each pump's `finally` schedules `engine.abort(request_id)` on a
fresh task (so it runs even inside a cancelled scope), and closing `engine.generate` aborts too.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence

from fastapi import Request

from serving.config import ServerConfig
from serving.errors import ApiError, from_value_error
from serving.metrics import ServerMetrics

log = logging.getLogger("serving")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def is_overload_error(e: BaseException) -> bool:
    name = type(e).__name__.lower()
    return "overload" in name or "queuefull" in name


def is_dead_error(e: BaseException) -> bool:
    return "dead" in type(e).__name__.lower()


@dataclass
class ServerState:
    engine: Any
    config: ServerConfig
    model_name: str
    accepted_names: set[str]
    max_model_len: int
    vocab_size: int
    metrics: ServerMetrics
    _bg: set = field(default_factory=set)

    @classmethod
    def create(cls, engine, config: ServerConfig) -> "ServerState":
        ec = engine.config
        name = ec.served_model_name or (str(ec.model) if ec.model else DEFAULT_MODEL_NAME)
        accepted = {name} | ({str(ec.model)} if ec.model else set())
        max_len = int(getattr(engine, "max_model_len", None) or ec.max_model_len or 8192)
        core = getattr(engine, "core", None)  # AsyncEngine keeps the model's vocab on its core
        vocab = (getattr(engine, "vocab_size", None)
                 or getattr(getattr(core, "model_config", None), "vocab_size", None)
                 or engine.tokenizer.vocab_size)
        metrics = ServerMetrics(config.metrics_prefix, name, engine.stats, max_len)
        return cls(engine, config, name, accepted, max_len, int(vocab), metrics)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ------------------------------------------------------------------ admission
    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name not in self.accepted_names:
            raise ApiError(404, f"The model `{name}` does not exist. Available: {self.model_name!r}.",
                           param="model", code="model_not_found")

    async def check_admission(self, num_requests: int) -> None:
        """`num_requests` sequences want in; refuse them when the waiting queue is at its bound.
        (engine.stats() may wait for the engine's step lock: ask from a worker thread.)"""
        if not self.engine.is_healthy():
            self.metrics.rejected("unhealthy")
            raise ApiError(503, "the engine is not healthy", code="engine_unhealthy")
        bound = getattr(self.engine.config, "max_waiting_requests", None)
        bound = 1024 if bound is None else int(bound)
        try:
            waiting = int((await asyncio.to_thread(self.engine.stats) or {}).get("num_requests_waiting", 0))
        except Exception:
            waiting = 0
        if waiting >= bound:
            raise self.overloaded(f"server overloaded: {waiting} requests waiting (bound {bound}); retry later")
        if num_requests > bound:
            raise ApiError(400, f"request asks for {num_requests} sequences (prompts x n); at most "
                           f"{bound} are accepted at once", param="n")
        if waiting + num_requests > bound:
            raise self.overloaded(f"server overloaded: {waiting} requests waiting (bound {bound}); retry later")

    def overloaded(self, message: str) -> ApiError:
        self.metrics.rejected("overloaded")
        return ApiError(503, message, code="server_overloaded",
                        headers={"Retry-After": str(self.config.retry_after_s)})

    def check_tokens(self, ids: Sequence[int], param: str = "prompt") -> None:
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise ApiError(400, f"token id {t} is outside the vocabulary [0, {self.vocab_size})", param=param)

    def check_prompt(self, ids: Sequence[int], params) -> None:
        """Context-length checks, then SamplingParams.validate and engine.validate (ValueError -> 400)."""
        n, limit = len(ids), self.max_model_len
        if n == 0:
            raise ApiError(400, "prompt is empty", param="prompt")
        if n >= limit:
            raise ApiError(400, f"prompt has {n} tokens but the context is {limit} tokens (at most "
                           f"{limit - 1} prompt tokens leave room for one generated token)",
                           param="prompt", code="context_length_exceeded")
        if isinstance(params.max_tokens, int) and n + params.max_tokens > limit:
            raise ApiError(400, f"max_tokens ({params.max_tokens}) plus the prompt ({n} tokens) exceeds "
                           f"the context of {limit} tokens", param="max_tokens",
                           code="context_length_exceeded")
        try:
            params.validate(self.vocab_size)
            self.engine.validate(list(ids), params)
        except ValueError as e:
            raise from_value_error(e) from None

    # ------------------------------------------------------------------ aborts
    def spawn_abort(self, request_id: str) -> None:
        async def _abort():
            try:
                r = self.engine.abort(request_id)
                if inspect.isawaitable(r):
                    await r
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
    params: Any


async def _tracked(state: ServerState, job: Job) -> AsyncIterator[Any]:
    """engine.generate with TTFT/ITL/e2e metrics; aborts unless the request finished."""
    m, t0 = state.metrics, time.monotonic()
    finished, refused, first, last_t, last_n = False, False, True, t0, 0
    try:
        gen = state.engine.generate(job.request_id, job.prompt_ids, job.params)
        async with aclosing(gen):
            async for out in gen:
                now = time.monotonic()
                ntok = max((len(o.token_ids) for o in out.outputs), default=0)
                if ntok > last_n:
                    if first:
                        em = getattr(out, "metrics", None)
                        a, b = getattr(em, "arrival_time", None), getattr(em, "first_token_time", None)
                        m.ttft.observe(b - a if a is not None and b is not None else now - t0)
                        first = False
                    else:
                        k = ntok - last_n
                        for _ in range(k):
                            m.itl.observe((now - last_t) / k)
                    last_t, last_n = now, ntok
                if out.finished:
                    finished = True
                    m.observe_request(getattr(out, "metrics", None), len(job.prompt_ids),
                                      sum(len(o.token_ids) for o in out.outputs))
                    for o in out.outputs:
                        m.finished(o.finish_reason)
                yield out
    except ValueError:
        refused = True  # the engine refused the input: nothing ran
        raise
    finally:
        if not finished:
            state.spawn_abort(job.request_id)
            if not refused:
                for _ in range(getattr(job.params, "n", 1) or 1):
                    m.finished("abort")


async def run_requests(state: ServerState, jobs: list[Job]) -> AsyncIterator[tuple[int, Any]]:
    """Run jobs concurrently; yield (job index, cumulative RequestOutput) as they come."""
    queue: asyncio.Queue = asyncio.Queue()
    _DONE = object()

    async def pump(i: int, job: Job):
        try:
            async with aclosing(_tracked(state, job)) as it:
                async for out in it:
                    queue.put_nowait((i, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # handed to the consumer
            queue.put_nowait((i, e))
            return
        queue.put_nowait((i, _DONE))

    tasks = [asyncio.get_running_loop().create_task(pump(i, j)) for i, j in enumerate(jobs)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                if isinstance(item, ValueError):
                    raise from_value_error(item) from item
                if is_overload_error(item):
                    raise state.overloaded(str(item) or "server overloaded") from item
                if is_dead_error(item):
                    raise ApiError(503, f"the engine is not running: {item}", code="engine_unhealthy") from item
                raise item
            else:
                yield i, item
    finally:
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
    """Await `coro` unless the client goes away first (then it is cancelled: requests abort)."""
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
