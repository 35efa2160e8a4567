"""Graceful drain: what the server does between a stop signal and its exit.

On the first SIGTERM / SIGINT the server drains: `/health` answers 503 at once (an orchestrator
stops routing here), new generation requests get 503 with Retry-After, and the requests in
flight run to their end for up to `shutdown_timeout` seconds. Those still running then are
aborted through the engine, so each response still ends properly (`finish_reason: "abort"`, the
final SSE event and `[DONE]`), never by a cut connection. Then uvicorn stops and the process
exits 0. A second signal aborts what is left at once. An engine that dies takes the process
down with status 1 the same way (`draining_server`'s watch).
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("serving")

# after the aborts, how long the aborted responses get to send their last events
FLUSH_S = 5.0
WATCH_S = 0.5  # how often the server checks that its engine is alive


class Drain:
    def __init__(self, timeout_s: float):
        self.timeout_s = float(timeout_s)
        self.draining = False
        self.live: set[str] = set()  # engine request ids in flight (serving.generation)
        self._loop: asyncio.AbstractEventLoop | None = None  # set by run(), on the server's loop
        self._hurry: asyncio.Event | None = None

    def track(self, request_id: str) -> None:
        self.live.add(request_id)

    def untrack(self, request_id: str) -> None:
        self.live.discard(request_id)

    def hurry(self) -> None:
        """A second signal: stop waiting for the requests in flight (any thread)."""
        self.timeout_s = 0.0
        if self._loop is not None and self._hurry is not None:
            self._loop.call_soon_threadsafe(self._hurry.set)

    async def run(self, engine, on_done) -> None:
        """Drain, abort what is left after the timeout, wait for the aborted responses to end,
        then call `on_done()` (which stops the server)."""
        self._loop, self._hurry = asyncio.get_running_loop(), asyncio.Event()
        self.draining = True
        t0 = time.monotonic()
        log.warning(
            "draining: %d requests in flight, waiting up to %.0f s for them (a second signal "
            "aborts them)",
            len(self.live),
            self.timeout_s,
        )
        try:
            await self._until_idle(t0 + self.timeout_s)
            if self.live:
                log.warning("shutdown timeout: aborting %d requests in flight", len(self.live))
                for rid in list(self.live):
                    try:
                        await engine.abort(rid)
                    except Exception:  # finished meanwhile, or the engine is gone
                        log.debug("abort(%s) during drain failed", rid, exc_info=True)
                await self._until_idle(time.monotonic() + FLUSH_S, hurry=False)
            log.warning(
                "drained in %.1f s (%d requests left); stopping",
                time.monotonic() - t0,
                len(self.live),
            )
        finally:
            on_done()

    async def _until_idle(self, deadline: float, hurry: bool = True) -> None:
        while self.live and time.monotonic() < deadline:
            if hurry and self._hurry.is_set():
                return
            await asyncio.sleep(0.02)


def draining_server(app, engine, drain: Drain, **uvicorn_kw):
    """A uvicorn server whose stop signals drain first (see the module's docstring)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        _drain_task = None
        _loop = None
        exit_code = 0

        async def startup(self, sockets=None):
            self._loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)
            self._watch_task = self._loop.create_task(self._watch())

        async def _watch(self):
            """An engine that died (its loop ended on an error it could not contain) takes the
            process down with a non-zero status, for the orchestrator to restart it: never a
            server that answers 503 forever."""
            while not self.should_exit:
                if not engine.is_healthy():
                    log.error("the engine is not running; exiting with status 1")
                    self.exit_code = 1
                    drain.timeout_s = 0.0
                    self._begin_drain()
                    return
                await asyncio.sleep(WATCH_S)

        def handle_exit(self, sig, frame):
            # Not uvicorn's own: that stops at once and re-raises the signal after shutdown, so
            # in-flight streams were cut and the process ended by the signal instead of 0.
            if self._loop is None:  # still starting: nothing in flight yet
                self.should_exit = True
            elif self._drain_task is None:
                self._begin_drain()
            else:
                drain.hurry()

        def _begin_drain(self):
            if self._drain_task is None:
                self._drain_task = self._loop.create_task(drain.run(engine, self._stop))

        def _stop(self):
            self.should_exit = True

    return DrainingServer(uvicorn.Config(app, **uvicorn_kw))
