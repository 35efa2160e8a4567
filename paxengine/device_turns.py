"""Turns on the device between the engine's steps and the background's compiles.

XLA's GPU compiler autotunes a step's GEMMs and fusions on the device, with scratch and operand
buffers from the same allocator pool as the steps' temporaries: up to ~4 GiB a try for
Qwen3.5-9B on an H100. The KV plan keeps an activation reserve for the steps' temporaries only,
so a `paxengine serve` cold start (its first buckets primed while the others compiled behind
them) ran out of memory, fused DeltaNet or not (benchmarks/results/gpu_2026-12-07c_qwen35_ratio/).
So background compiles take the device only when no step is queued or in flight: one waits for
the steps dispatched so far to finish, and a step waits for the compiles under way. Compiles
share their turn (the foreground's autotune side by side within the reserve too). Steps go
first: no compile starts while a step waits. Only while the background builds (the first
minutes of a cold start) does a step wait at all; start-up and idle priming are steps too.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import jax


class DeviceTurns:
    def __init__(self):
        self._cond = threading.Condition()
        self._compiling = 0  # compiles under way
        self._steps = 0  # steps running or waiting to (re-entrant: a prime's runs are steps)
        self._last = None  # the latest step's last output: done once it is ready

    @contextmanager
    def step(self):
        """Around a step's dispatch; `dispatched` records its output."""
        with self._cond:
            self._steps += 1
            while self._compiling:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._steps -= 1
                self._cond.notify_all()

    def dispatched(self, last_output) -> None:
        """The output a step computes last (its sampled tokens): a compile waits for it."""
        self._last = last_output

    @contextmanager
    def compile(self):
        """Around a background compile: once no step waits or runs, and the device is done
        with the steps dispatched before (other compiles may run beside it)."""
        with self._cond:
            while self._steps:
                self._cond.wait()
            self._compiling += 1
            last = self._last  # each compile waits for it: the one before may still be waiting
        try:
            if last is not None:
                try:
                    jax.block_until_ready(last)
                except RuntimeError:  # deleted (donated on): the step that took it ran first
                    pass
            yield
        finally:
            with self._cond:
                self._compiling -= 1
                self._cond.notify_all()


TURNS = DeviceTurns()  # one a process: its runners share the devices
