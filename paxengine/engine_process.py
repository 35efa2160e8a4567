"""ProcessEngine: EngineCore in a process of its own, behind the `EngineClient` interface.

Why: in one process the server's event loop (HTTP parsing, pydantic, tokenizing, SSE) and the
step loop share one GIL. On the H200 a burst of 61 requests held one step's launch back 179 ms
while the GPU idled (~2.9 ms of event-loop work a request). vLLM runs its engine core in a
process of its own for the same reason. The child runs the step loop (core_loop.run); this
process keeps the tokenizer, validation and the streams (`Frontend`), and never touches JAX.

The wire is one multiprocessing Pipe. Down: core_loop's messages (add, abort, reset, stop), sent
by a thread of their own so that a full pipe never blocks the event loop. Up: ("ready", ...) or
("failed", ...) once, then ("out", items, stats, taken, waiting tokens) after each step or batch
of messages (and every 0.5 s of idling while a counter moves: the background's builds),
("reply", token, value, error) for a reset, and ("dead", text) if the loop dies.
Outputs go up without their prompt, which this side holds (a 1,024-id prompt in every output of
every step would be most of the bytes), and as deltas (paxengine/output_delta.py): each item is
(request id, what is new in its output since the last message, None) or (request id, None, an
exception as `_to_wire` values); this side rebuilds the cumulative outputs the streams expect.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import multiprocessing
import queue
import signal
import threading
from concurrent.futures import Future
from typing import Sequence

from paxengine import core_loop
from paxengine.async_engine import Frontend
from paxengine.client import ModelInfo
from paxengine.config import EngineConfig
from paxengine.errors import EngineDead, EngineError, EngineOverloaded, InvalidRequest, StepFailed
from paxengine.output_delta import DeltaDecoder, DeltaEncoder
from paxengine.outputs import RequestOutput
from paxengine.sampling_params import SamplingParams
from paxengine.validation import check_request, prompt_and_ids

log = logging.getLogger("paxengine")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # serving.cli's
SHUTDOWN_TIMEOUT_S = 30.0
# the errors a failed start-up raises again on this side (serving.cli reports them as such)
_START_ERRORS = {e.__name__: e for e in (ValueError, FileNotFoundError, NotImplementedError)}
_ERRORS = {e.__name__: e for e in (EngineOverloaded, EngineDead)}


def _to_wire(e: BaseException) -> tuple:
    """An exception as plain values: ours take keyword arguments that pickle would drop."""
    return (type(e).__name__, str(e), getattr(e, "param", None), getattr(e, "code", None))


def _from_wire(w: tuple) -> BaseException:
    name, message, param, code = w
    if name == "InvalidRequest":
        return InvalidRequest(message, param=param, code=code)
    if name == "StepFailed":
        return StepFailed(message, [])
    if name in _ERRORS:
        return _ERRORS[name](message)
    return EngineError(f"{name}: {message}")


# -- the child ----------------------------------------------------------------------------------
class _ChildTransport:
    """core_loop's Transport over the pipe, in the engine's process."""

    def __init__(self, core, conn):
        self.core, self.conn = core, conn
        self._seqs = self._tokens = 0  # adds taken since the last message up
        self._unsent = False
        self._delta = DeltaEncoder()
        self._stats_sent: dict | None = None
        self._built_behind = core.runner.builder.background is not None

    def take(self, block: bool) -> list[tuple]:
        if self._unsent:  # adds taken and nothing sent since: the front end's count waits
            self._send([])
        items = []
        if self.conn.poll(0.5 if block else 0):
            items.append(self.conn.recv())
            while self.conn.poll():
                items.append(self.conn.recv())
        elif block:
            if self._built_behind and self.core.pending_executables() == 0:
                self._built_behind = False
                freeze_heap()  # what the background's tracing left, once, while idle
            if self.core.stats() != self._stats_sent:
                self._send([])  # a counter moved (the background's builds): scrapes see it
        return items

    def deliver(self, items) -> None:
        self._send(items)

    def taken(self, num_seqs: int, num_tokens: int) -> None:
        self._seqs += num_seqs
        self._tokens += num_tokens
        self._unsent = True

    def reply(self, reply_to, value=None, error: BaseException | None = None) -> None:
        self.conn.send(("reply", reply_to, value, None if error is None else _to_wire(error)))

    def other(self, kind: str, rid: str, payload) -> None:
        raise ValueError(f"unknown engine message {kind!r}")

    def _send(self, items) -> None:
        up = []
        for rid, x in items:
            if isinstance(x, RequestOutput):
                up.append((rid, self._delta.encode(rid, x), None))
            else:  # the request ends with it
                self._delta.drop(rid)
                up.append((rid, None, _to_wire(x)))
        waiting_tokens = 0
        if self.core.config.max_waiting_tokens is not None:
            waiting_tokens = sum(r.num_prompt_tokens for r in self.core.scheduler.waiting)
        taken = (self._seqs, self._tokens)
        self._stats_sent = self.core.stats()
        self.conn.send(("out", up, self._stats_sent, taken, waiting_tokens))
        self._seqs = self._tokens = 0
        self._unsent = False


def freeze_heap() -> None:
    """Collects, then moves every object left into the GC's permanent generation, as vLLM does
    after its start-up: the engine's start-up (tracing, compiling) leaves a large live heap, and
    a full collection while serving scans all of it (H200, 8B model, after the background's
    builds: one 390 ms pass during a c=16 run, every stream stalled). Only in the engine's own
    process, whose engine lives as long as it: frozen objects are never collected."""
    gc.collect()
    gc.freeze()


def _child_main(config: EngineConfig, conn, log_level: int) -> None:
    # The server's process owns the signals: it drains on SIGTERM / SIGINT and then stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    from paxengine.engine import EngineCore

    try:
        core = EngineCore(config)
    except BaseException as e:
        log.debug("the engine did not start", exc_info=True)
        conn.send(("failed", type(e).__name__, str(e)))
        return
    grammar_args = (core.grammars.vocab_size, core.grammars.eos_token_ids)
    freeze_heap()
    conn.send(("ready", core.config, core.info, core.tokenizer, grammar_args, core.stats()))
    try:
        core_loop.run(core, _ChildTransport(core, conn))
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the server's process is gone
        return
    except BaseException as e:
        log.exception("engine loop died")
        try:
            conn.send(("dead", repr(e)))
        except OSError:
            pass


# -- the server's side --------------------------------------------------------------------------
class ProcessEngine(Frontend):
    """An `EngineClient` running EngineCore in a child process. Builds it (model load, compile)
    in the constructor, as AsyncEngine does, and raises what a failed start-up raised there."""

    def __init__(self, config: EngineConfig | None = None, **overrides):
        super().__init__()
        cfg = (config or EngineConfig()).replace(**overrides)
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold threads
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=_child_main,
            args=(cfg, child_conn, logging.getLogger().getEffectiveLevel()),
            name="paxengine-core",
            daemon=True,
        )
        self._proc.start()
        child_conn.close()  # ours: so that the child's death reads as EOF here
        try:
            msg = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(
                f"the engine process exited during start-up (exit code {self._proc.exitcode})"
            ) from None
        if msg[0] == "failed":
            self._proc.join(SHUTDOWN_TIMEOUT_S)
            raise _START_ERRORS.get(msg[1], RuntimeError)(msg[2])
        _, self.config, self._info, self._tokenizer, grammar_args, self._stats = msg
        self._grammars = None
        if self.config.structured_outputs:
            from paxengine.structured import GrammarCompiler

            self._grammars = GrammarCompiler(self._tokenizer, *grammar_args)
        self._waiting_tokens = 0
        self._prompts: dict[str, dict] = {}  # request id -> its prompt, until its final output
        self._delta = DeltaDecoder()  # each request's cumulative output, until its final one
        self._replies: dict[int, Future] = {}
        self._reply_ids = itertools.count()
        self._outbox: queue.Queue = queue.Queue()
        self._reader: threading.Thread | None = None
        self._sender: threading.Thread | None = None
        self._stopping = False

    # -- EngineClient ---------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self._tokenizer

    def model_info(self) -> ModelInfo:
        return self._info

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        return prompt_and_ids(self._tokenizer, prompt)

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        check_request(
            prompt_token_ids,
            params,
            self._info.limits,
            self.config,
            self._grammars,
            self._tokenizer,
        )

    def stats(self) -> dict:
        return dict(self._stats)  # as of the engine's last message: a scrape never waits

    def is_healthy(self) -> bool:
        return (
            self.error is None
            and self._reader is not None
            and self._reader.is_alive()
            and self._proc.is_alive()
        )

    async def start(self) -> None:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, name="paxengine-read", daemon=True)
            self._sender = threading.Thread(target=self._send, name="paxengine-send", daemon=True)
            self._reader.start()
            self._sender.start()

    async def shutdown(self) -> None:
        self._stopping = True
        self._post("stop", None, None)
        await asyncio.get_running_loop().run_in_executor(None, self._stop_child)

    async def reset_prefix_cache(self) -> bool:
        self._check_alive()
        token, done = next(self._reply_ids), Future()
        self._replies[token] = done
        self._post("reset", None, token)
        return await asyncio.wrap_future(done)

    # -- Frontend -------------------------------------------------------------------------------
    def _post(self, kind: str, rid: str | None, payload) -> None:
        if kind == "add":
            self._prompts[rid] = payload[0]
        self._outbox.put((kind, rid, payload))

    def _queued(self) -> int:
        return self._stats["num_requests_waiting"]

    def _queued_tokens(self) -> int:
        return self._waiting_tokens

    # -- the threads ----------------------------------------------------------------------------
    def _send(self) -> None:
        try:
            while True:
                item = self._outbox.get()
                self._conn.send(item)
                if item[0] == "stop":
                    return
        except OSError:  # the child is gone: the reader says so
            return

    def _read(self) -> None:
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "out":
                    _, items, self._stats, (seqs, tokens), self._waiting_tokens = msg
                    if seqs or tokens:
                        self._taken(seqs, tokens)
                    self._deliver_all([(rid, self._restore(rid, d, e)) for rid, d, e in items])
                elif msg[0] == "reply":
                    _, token, value, error = msg
                    done = self._replies.pop(token)
                    if error is None:
                        done.set_result(value)
                    else:
                        done.set_exception(_from_wire(error))
                elif msg[0] == "dead":
                    raise EngineDead(f"the engine process's loop died: {msg[1]}")
        except BaseException as e:
            if not (self._stopping and isinstance(e, EOFError)):
                log.error("the engine process stopped: %r (exit code %s)", e, self._proc.exitcode)
            self.error = (
                e if not isinstance(e, EOFError) else EngineDead("the engine process exited")
            )
            self._end_all(self.error)
            self._delta.state.clear()  # no more outputs come: neither state is needed
            self._prompts.clear()
            for done in list(self._replies.values()):
                if not done.done():
                    done.set_exception(EngineDead(f"engine loop died: {self.error!r}"))
            self._replies.clear()

    def _restore(self, rid: str, delta, error):
        """The cumulative output, with its prompt back, or the exception the engine raised."""
        if error is not None:
            self._prompts.pop(rid, None)
            self._delta.drop(rid)
            return _from_wire(error)
        x = self._delta.decode(rid, delta)
        prompt = self._prompts.pop(rid, None) if x.finished else self._prompts.get(rid)
        if prompt is not None:
            x.prompt, x.prompt_token_ids = prompt["prompt"], prompt["prompt_token_ids"]
        return x

    def _stop_child(self) -> None:
        self._proc.join(SHUTDOWN_TIMEOUT_S)
        if self._proc.is_alive():  # it ignores SIGTERM (the server owns the signals)
            log.warning("the engine process did not stop in %.0f s: killing it", SHUTDOWN_TIMEOUT_S)
            self._proc.kill()
            self._proc.join(5)
