"""Keep the cyclic garbage collector's full passes short while the engine runs.

A full (generation 2) collection walks every tracked object. After start-up that is the whole
heap: JAX, the model's pytrees, the tokenizer, the server's modules (~0.25 M objects in a CPU
test engine, a ~100 ms pass; on the H200 server a 280-430 ms stall of one step in the middle of
a concurrency-64 run, every stream waiting behind it: benchmarks/results/gpu_2026-12-01_packed's
step traces, `process_ms`). `gc.freeze()` moves the objects alive now into a permanent
generation that collections skip; objects made later (requests, outputs) are collected as
before. vLLM freezes its heap after start-up for the same reason.

`frozen_heap()` freezes on entry and unfreezes when the outermost holder leaves, so a process
that builds and drops engines (the tests, a notebook) gets its old objects back into reach.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager

_lock = threading.Lock()
_holders = 0


@contextmanager
def frozen_heap(collect: bool = False):
    """collect: run a full collection first, so today's garbage is not frozen with the rest
    (a server, once at start-up; not per LLM.generate call, where it would cost a full pass)."""
    global _holders
    with _lock:
        if _holders == 0:
            if collect:
                gc.collect()
            gc.freeze()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                gc.unfreeze()
