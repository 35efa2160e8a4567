"""PAXENGINE_STEP_TRACE: one record per engine iteration, with the host phases and what the step
held, and the summary benchmarks.step_trace makes of a file."""

import json

from benchmarks import step_trace as report
from paxengine import LLM, SamplingParams
from paxengine.step_trace import ENV


def _tiny_llm() -> LLM:
    return LLM(
        model="dummy:tiny",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        token_buckets=[8, 32],
        seq_buckets=[4],
        num_kv_blocks=64,
        structured_outputs=False,
        store_executables=False,
        show_progress=False,
    )


def test_records_every_iteration_and_summarises(tmp_path, monkeypatch):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(ENV, str(path))
    llm = _tiny_llm()
    prompts = [list(range(3, 3 + n)) for n in (5, 20, 40)]  # 40 tokens: two prefill chunks
    llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    steps = llm.engine.steps
    llm.engine.trace.flush()
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    dispatched = [r for r in recs if "T" in r]
    assert len(dispatched) == steps
    for r in dispatched:
        assert r["T"] in (8, 32) and r["S"] == 4 and 0 < r["tokens"] <= r["T"]
        assert r["decode_rows"] + (r["prompt_tokens"] > 0) <= r["rows"] <= 4
        assert r["schedule_ms"] >= 0 and r["build_ms"] >= 0 and r["launch_ms"] >= 0
    # every prompt token was scheduled once (no preemption here), every decode token too
    assert sum(r["prompt_tokens"] for r in dispatched) == sum(map(len, prompts))
    assert sum(r["decode_rows"] for r in dispatched) == 3 * 5  # each output after the first
    reads = [r for r in recs if "read_at" in r]
    assert len(reads) == steps and all(r["wait_ms"] >= 0 for r in reads)
    assert [r["read_at"] for r in reads] == sorted(r["read_at"] for r in reads)

    s = report.summarise(recs)
    assert s["steps"] == steps and s["iterations"] == len(recs)
    assert s["tokens"]["sum"] == sum(r["tokens"] for r in dispatched)
    kinds = s["step_interval_ms"]
    assert sum(v["n"] for v in kinds.values()) == steps - 1  # the last one has no next read
    assert any(k.startswith("prefill") or k.startswith("mixed") for k in kinds)
    assert any(k.startswith("decode") for k in kinds)
    # one busy stretch; an idle gap longer than the cut starts another
    assert len(report.segments(recs, min_steps=1)) == 1
    gapped = recs[:5] + [{**recs[5], "gap_ms": 10_000.0}] + recs[6:]
    assert len(report.segments(gapped, min_steps=1)) == 2


def test_off_by_default(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    from paxengine.step_trace import StepTrace

    assert StepTrace.from_env() is None


def test_stable_inputs_probe_knob_keeps_outputs(monkeypatch):
    """PAXENGINE_STABLE_INPUTS (runner.py, a probe's knob): the step's inputs copied into buffers
    kept across steps give the same greedy tokens, with the buffers really reused."""
    import paxengine.runner as runner_mod

    llm = _tiny_llm()
    prompts = [list(range(3, 3 + n)) for n in (5, 20, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(runner_mod, "_STABLE_INPUTS", True)
    llm.engine.reset_prefix_cache()
    staged = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert staged == plain
    runner = llm.engine.runner
    assert ("fwd", 8, 4) in runner._staged and "prev" in runner._staged
    before = runner._staged["prev"].unsafe_buffer_pointer()
    llm.generate(prompts[:1], params, use_tqdm=False)
    assert runner._staged["prev"].unsafe_buffer_pointer() == before  # the same device buffer


def test_records_the_garbage_collectors_passes(tmp_path):
    """gc_ms and gc_full: a stall in `process_ms` (280-430 ms once in a c=64 run on the H200)
    can be told apart from a full collection."""
    import gc

    from paxengine.step_trace import StepTrace

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
