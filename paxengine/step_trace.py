"""Per-step timing records, for finding where a served step's time goes (benchmarks only).

`PAXENGINE_STEP_TRACE=FILE` makes every EngineCore of the process append one JSON line per
engine iteration to FILE: the host's time in each phase (schedule, build the step's arrays,
launch it, wait for the step before it, process that step's outputs) and what the step held
(token and sequence bucket, decode rows, prompt tokens, running and waiting requests). The
wait is the device's share: an iteration whose wait is near zero had the device idle behind the
host. Unset (the default), the engine keeps no records and pays one `is None` test a phase.
`python -m benchmarks.step_trace FILE` summarises a file.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import threading
import time

ENV = "PAXENGINE_STEP_TRACE"
_FLUSH_EVERY = 256  # lines kept before a write: a server killed mid-run loses at most these


class StepTrace:
    def __init__(self, path: str):
        self.path = path
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._t = time.perf_counter()
        self._last_end = None
        self.rec: dict = {}
        self._gc_start = None
        gc.callbacks.append(self._on_gc)
        atexit.register(self.flush)

    def _on_gc(self, phase: str, info: dict) -> None:
        """The garbage collector's passes, in whatever thread ran them (every thread waits):
        gc_ms and the full passes (gc_full) of the iteration they fell in."""
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            rec = self.rec
            rec["gc_ms"] = round(
                rec.get("gc_ms", 0.0) + (time.perf_counter() - self._gc_start) * 1e3, 4
            )
            if info.get("generation") == 2:
                rec["gc_full"] = rec.get("gc_full", 0) + 1
            self._gc_start = None

    @classmethod
    def from_env(cls) -> "StepTrace | None":
        path = os.environ.get(ENV, "").strip()
        return cls(path) if path else None

    def begin(self) -> None:
        """A new iteration: its phases are timed from here. gap_ms: since the last one ended
        (the caller's work between iterations: a server's inbox and output delivery)."""
        self._t = time.perf_counter()
        self.rec = {"t": round(self._t, 6)}
        if self._last_end is not None:
            self.rec["gap_ms"] = round((self._t - self._last_end) * 1e3, 4)

    def mark(self, phase: str) -> None:
        """Add the time since the last mark to `phase` (milliseconds)."""
        now = time.perf_counter()
        self.rec[phase] = round(self.rec.get(phase, 0.0) + (now - self._t) * 1e3, 4)
        self._t = now

    def stamp(self, name: str) -> None:
        """An absolute time (perf_counter seconds), e.g. when the previous step's samples were
        read: consecutive reads are one step apart when the device is the bottleneck."""
        self.rec[name] = round(time.perf_counter(), 6)

    def step(self, out, T: int, S: int) -> None:
        """What the dispatched step holds (a SchedulerOutput and its bucket)."""
        # a decode row computes its last token and its drafts; anything else is a prompt chunk
        decode = [
            n
            for r in out.requests
            if (n := out.num_scheduled_tokens[r.request_id])
            == 1 + len(out.drafts.get(r.request_id, ()))
        ]
        self.rec.update(
            T=T,
            S=S,
            tokens=out.total_tokens,
            rows=len(out.requests),
            decode_rows=len(decode),
            prompt_tokens=out.total_tokens - sum(decode),
        )

    def end(self, running: int, waiting: int) -> None:
        self.rec.update(running=running, waiting=waiting)
        self._last_end = time.perf_counter()
        line = json.dumps(self.rec)
        with self._lock:
            self._lines.append(line)
            full = len(self._lines) >= _FLUSH_EVERY
        if full:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
        if lines:
            with open(self.path, "a") as f:
                f.write("\n".join(lines) + "\n")
