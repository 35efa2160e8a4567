"""A step that fails on the device (fault injected into the runner) ends the requests of that
step with StepFailed; the engine restores its device state, recomputes the others (whose
outputs match a run without the fault) and runs on; repeated failures make it give up."""

import pytest

from paxengine import SamplingParams
from paxengine.engine import MAX_FAILURES, EngineCore
from paxengine.errors import StepFailed

PROMPTS = {"a": [5, 9, 2, 7, 11, 3], "b": [8, 1, 4, 4, 6, 10, 12, 2], "c": [3, 3, 5]}
MAX_TOKENS = {"a": 3, "b": 12, "c": 6}


@pytest.fixture(scope="module", params=[False, True], ids=["inline", "dispatch_thread"])
def core(request):
    return EngineCore(
        model="dummy:tiny",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        token_buckets=[4, 32],
        seq_buckets=[4],
        num_kv_blocks=64,
        block_size=4,
        show_progress=False,
        dispatch_thread=request.param,
    )


def _run(core, ids, sync=False):
    """Greedy outputs of `ids` (the prompts' keys), and the ids whose step failed. sync: with a
    penalty, which makes the engine read each step before it dispatches the next."""
    for rid in ids:
        params = SamplingParams(
            temperature=0,
            max_tokens=MAX_TOKENS[rid],
            ignore_eos=True,
            presence_penalty=0.5 if sync else 0.0,
        )
        core.add_request(rid, {"prompt_token_ids": PROMPTS[rid]}, params)
    texts, failed = {}, []
    for _ in range(200):  # bounded: a stuck request fails the test instead of hanging it
        if not core.has_unfinished():
            break
        try:
            outs = core.step()
        except StepFailed as e:
            failed += e.request_ids
            outs = e.outputs
        for out in outs:
            if out.finished:
                texts[out.request_id] = out.outputs[0].token_ids
    assert not core.has_unfinished()
    assert core.kv.usage == 0  # nothing leaked, failed requests included
    return texts, failed


@pytest.mark.parametrize("sync", [False, True], ids=["overlapped", "read_first"])
@pytest.mark.parametrize("where", ["execute", "fetch"])
def test_failed_step_ends_its_requests_and_recomputes_the_rest(core, where, sync, monkeypatch):
    ref, failed = _run(core, ["a", "b"], sync)
    assert not failed and [len(ref[k]) for k in "ab"] == [3, 12]
    (ref_c,) = _run(core, ["c"], sync)[0].values()

    # execute: fail the step dispatched while a's last sample is still on the device. b runs in
    # it, a does not (it needs no more rows), so b fails and a's pending sample is lost with
    # the device state: a is recomputed from its prompt and known tokens.
    # fetch: fail reading the step that holds a's last sample: a and b were in it, both fail.
    original = getattr(core.runner, where)
    fired = []

    def faulty(*args):
        if where == "execute":  # (on the dispatch thread there: judged from the step alone)
            hit = int(args[0].num_seqs[0]) == 1  # a and b ran together until b ran alone
        else:
            a = core.seq_of["a"][1].req if "a" in core.seq_of else None
            hit = a is not None and a.num_output_tokens == 3 and a.num_pending_tokens == 1
        if hit and not fired:
            fired.append(core.steps)
            raise RuntimeError("injected device fault")
        return original(*args)

    monkeypatch.setattr(core.runner, where, faulty)
    monkeypatch.setattr(core, "_failures", [])  # (the module's engine saw other tests' faults)
    before = core.stats()["failed_steps"]
    texts, failed = _run(core, ["a", "b"], sync)
    if where == "execute":
        assert fired and failed == ["b"]
        assert texts == {"a": ref["a"]}  # recomputed, same tokens
    else:
        assert fired and failed == ["a", "b"] and texts == {}
    assert core.stats()["failed_steps"] == before + 1
    # the engine runs on, on a fresh device state, with the same results
    assert _run(core, ["c"], sync)[0] == {"c": ref_c}


def test_repeated_failures_give_up(core, monkeypatch):
    def broken(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(core.runner, "execute", broken)
    monkeypatch.setattr(core, "_failures", [])
    for i in range(MAX_FAILURES):
        core.add_request(f"x{i}", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))
        with pytest.raises(StepFailed) as e:
            while core.has_unfinished():
                core.step()
        assert e.value.request_ids == [f"x{i}"]
    core.add_request("last", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="giving up"):
        while core.has_unfinished():
            core.step()
