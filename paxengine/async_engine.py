"""AsyncEngine: EngineCore on a background thread, behind the `EngineClient` interface.

The event loop side (generate, abort, reset_prefix_cache) only validates and posts messages; the
engine thread alone touches the core: it runs the step loop (paxengine/core_loop.py), which takes
the messages between steps, runs steps while there is work, and hands each output to the event
loop of the request it belongs to. `Frontend` is that event-loop side, shared with ProcessEngine
(paxengine/engine_process.py), which runs the same loop in a process of its own.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from typing import AsyncIterator, Sequence

from paxengine import core_loop
from paxengine.beam_search import BeamSearches
from paxengine.client import ModelInfo
from paxengine.config import EngineConfig
from paxengine.engine import EngineCore
from paxengine.errors import EngineDead, EngineOverloaded, InvalidRequest
from paxengine.outputs import RequestOutput
from paxengine.sampling_params import SamplingParams
from paxengine.validation import truncate_prompt

log = logging.getLogger("paxengine")


def _put_all(items) -> None:
    for box, item in items:
        box.put(item)


class _Mailbox:
    """One request's undelivered outputs, on its event loop. Outputs are cumulative, so an
    unread one is replaced by the next: a consumer that reads slowly (a slow SSE client) holds
    at most one output here, however many steps ran meanwhile, and reads the latest. The final
    output (cumulative too), or an error, ends the stream."""

    def __init__(self):
        self._latest = None
        self._end = None
        self._ready = asyncio.Event()

    def put(self, item) -> None:
        if isinstance(item, BaseException) or item.finished:  # it supersedes an unread one
            self._end, self._latest = self._end or item, None
        else:
            self._latest = item
        self._ready.set()

    async def get(self):
        while self._latest is None and self._end is None:
            self._ready.clear()
            await self._ready.wait()
        if self._latest is not None:
            item, self._latest = self._latest, None
            return item
        return self._end


class Frontend(BeamSearches):
    """The event-loop side of an `EngineClient` whose step loop runs elsewhere: admission,
    one mailbox per request, and delivery onto each request's event loop. A subclass posts
    messages (`_post`) and says how many requests wait (`_queued`, `_queued_tokens`)."""

    config: EngineConfig

    def __init__(self):
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _Mailbox]] = {}
        self._posted = 0  # adds posted to the loop and not yet taken by it
        self._posted_tokens = 0  # and their prompt tokens
        self._posted_lock = threading.Lock()
        self.error: BaseException | None = None

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        raise NotImplementedError

    def _post(self, kind: str, rid: str | None, payload) -> None:
        raise NotImplementedError

    def _queued(self) -> int:
        raise NotImplementedError

    def _queued_tokens(self) -> int:
        raise NotImplementedError

    def generate(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Checks and admits at once (raising InvalidRequest, EngineOverloaded or EngineDead
        here, before any output), then returns the outputs' iterator. Call it from the event
        loop that will consume the outputs."""
        self._check_alive()
        text, ids = self.tokenize_prompt(prompt)
        keep = getattr(
            params, "truncate_prompt_tokens", None
        )  # not a SamplingParams: validate says
        text, ids = truncate_prompt(text, ids, keep, self.model_info().max_model_len)
        self.validate(ids, params)  # bad input fails here, alone
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        self._admit(params.n, len(ids) * params.n)
        q = _Mailbox()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._post("add", request_id, ({"prompt": text, "prompt_token_ids": ids}, params))
        return self._outputs(request_id, q)

    async def _outputs(self, request_id: str, q: _Mailbox) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the consumer went away (disconnect, cancel): free its blocks
                self._post("abort", request_id, None)

    async def abort(self, request_id: str) -> None:
        self._post("abort", request_id, None)
        for step_id in self.beam_steps(request_id):  # a beam search's requests in flight
            self._post("abort", step_id, None)

    # -- admission ------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if not self.is_healthy():
            raise EngineDead(f"the engine loop is not running ({self.error!r})")

    def _admit(self, num_seqs: int, num_tokens: int) -> None:
        """The one admission check: a request is refused while the waiting queue (and what is on
        its way there) is at max_waiting_requests, or its prompts at max_waiting_tokens. The
        request itself may overshoot a bound: a valid request is never refused for good."""
        bound, token_bound = self.config.max_waiting_requests, self.config.max_waiting_tokens
        with self._posted_lock:
            waiting = self._queued() + self._posted
            if waiting >= bound:
                raise EngineOverloaded(
                    f"{waiting} requests are waiting (bound {bound}); retry later"
                )
            if token_bound is not None:
                tokens = self._posted_tokens + self._queued_tokens()
                if tokens and tokens + num_tokens > token_bound:
                    raise EngineOverloaded(
                        f"{tokens} prompt tokens are waiting (bound {token_bound}); retry later"
                    )
            self._posted += num_seqs
            self._posted_tokens += num_tokens

    def _taken(self, num_seqs: int, num_tokens: int) -> None:
        with self._posted_lock:
            self._posted -= num_seqs
            self._posted_tokens -= num_tokens

    # -- delivery (from the loop's thread) ------------------------------------------------------
    def _deliver_all(self, items) -> None:
        """(request id, output or error) pairs, in one wake-up per event loop (not one per
        request: at 64 streams the per-call wake-ups cost the loop thread more than the outputs)."""
        by_loop: dict = {}
        for rid, item in items:
            entry = self._streams.get(rid)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], item))
        for loop, pairs in by_loop.items():
            loop.call_soon_threadsafe(_put_all, pairs)

    def _end_all(self, e: BaseException) -> None:
        """The loop died: every open stream ends with EngineDead."""
        self._deliver_all(
            [(rid, EngineDead(f"engine loop died: {e!r}")) for rid in list(self._streams)]
        )


class AsyncEngine(Frontend):
    """An `EngineClient` running EngineCore on a thread of this process."""

    def __init__(self, config: EngineConfig | None = None, *, core=None, **overrides):
        """core: an EngineCore built elsewhere (disaggregated prefill runs its two roles,
        paxengine/disagg/roles.py, each on an AsyncEngine of its own)."""
        super().__init__()
        self.core = core if core is not None else EngineCore(config, **overrides)
        self.config = self.core.config
        self._inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- EngineClient ---------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.core.tokenizer

    def model_info(self) -> ModelInfo:
        return self.core.info

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        return self.core.tokenize_prompt(prompt)

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.core.validate(prompt_token_ids, params)  # static limits only: safe off-thread

    def stats(self) -> dict:
        # No lock: plain reads of counters between steps; a scrape must not wait for a step.
        return self.core.stats()

    def is_healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    async def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="paxengine-loop", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("stop", None, None))
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)

    async def reset_prefix_cache(self) -> bool:
        self._check_alive()
        done: Future = Future()
        self._post("reset", None, done)
        return await asyncio.wrap_future(done)

    # -- Frontend -------------------------------------------------------------------------------
    def _post(self, kind: str, rid: str | None, payload) -> None:
        self._inbox.put((kind, rid, payload))

    def _queued(self) -> int:
        return len(self.core.scheduler.waiting)

    def _queued_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in list(self.core.scheduler.waiting))

    # -- the engine thread (core_loop's Transport) ----------------------------------------------
    def take(self, block: bool) -> list[tuple]:
        items = []
        try:
            items.append(self._inbox.get(block=block, timeout=0.5 if block else None))
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return items

    def deliver(self, items) -> None:
        self._deliver_all(items)

    def taken(self, num_seqs: int, num_tokens: int) -> None:
        self._taken(num_seqs, num_tokens)

    def reply(self, reply_to: Future, value=None, error: BaseException | None = None) -> None:
        if error is not None:
            reply_to.set_exception(error)
        else:
            reply_to.set_result(value)

    def other(self, kind: str, rid: str, payload) -> None:
        raise ValueError(f"unknown engine message {kind!r}")

    def _loop(self) -> None:
        try:
            if not self._stop.is_set():
                core_loop.run(self.core, self)
        except BaseException as e:  # a dead loop must be visible, and nobody left waiting
            self.error = e
            log.exception("engine loop died")
            self._end_all(e)
            self._fail_pending_resets(e)

    def _fail_pending_resets(self, e: BaseException) -> None:
        while True:
            try:
                kind, _, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "reset" and not payload.done():
                payload.set_exception(EngineDead(f"engine loop died: {e!r}"))
