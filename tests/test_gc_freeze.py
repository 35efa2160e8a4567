"""The heap is frozen out of the cyclic GC's full passes while the engine runs (gc_freeze.py):
in LLM.generate and for a server's life, and back in reach afterwards; the step trace records
the collector's passes."""

from __future__ import annotations

import gc
import json
import sys
import weakref
from pathlib import Path

from fastapi.testclient import TestClient

from paxengine import LLM, SamplingParams
from paxengine.gc_freeze import frozen_heap
from paxengine.step_trace import StepTrace
from serving.app import build_app
from serving.config import ServerConfig

sys.path.insert(0, str(Path(__file__).parent / "serving"))
from fake_engine import FakeEngine  # noqa: E402


class _Node:
    pass


def _cycle() -> weakref.ref:
    """A garbage reference cycle only the cyclic collector can free."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_frozen_heap_nests_and_gives_the_objects_back():
    assert gc.get_freeze_count() == 0
    kept = _cycle()
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert kept() is not None  # frozen: full passes skip it
        with frozen_heap():
            pass
        assert gc.get_freeze_count() > 0  # the inner holder left, the outer still holds
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert kept() is None  # back in reach


def test_collect_first_frees_todays_garbage():
    dropped = _cycle()
    with frozen_heap(collect=True):
        assert dropped() is None
    assert gc.get_freeze_count() == 0


def test_generate_steps_with_the_heap_frozen():
    llm = LLM(
        model="dummy:tiny",
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        token_buckets=[16],
        seq_buckets=[2],
        num_kv_blocks=32,
        structured_outputs=False,
        store_executables=False,
        show_progress=False,
    )
    real, frozen = llm.engine.step, []

    def step():
        frozen.append(gc.get_freeze_count())
        return real()

    llm.engine.step = step
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert frozen and all(n > 0 for n in frozen)
    assert gc.get_freeze_count() == 0


def test_server_runs_with_the_heap_frozen():
    with TestClient(build_app(FakeEngine(), ServerConfig())) as client:
        assert gc.get_freeze_count() > 0
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
    assert gc.get_freeze_count() == 0


def test_step_trace_records_the_collectors_passes(tmp_path):
    path = tmp_path / "trace.jsonl"
    tr = StepTrace(str(path))
    try:
        tr.begin()
        gc.collect(0)
        tr.end(running=0, waiting=0)
        tr.begin()
        gc.collect()
        tr.end(running=0, waiting=0)
        tr.flush()
    finally:
        gc.callbacks.remove(tr._on_gc)
    young, full = [json.loads(line) for line in path.read_text().splitlines()]
    assert young["gc_ms"] >= 0 and "gc_full" not in young
    assert full["gc_full"] == 1 and full["gc_ms"] > 0
