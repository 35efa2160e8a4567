"""Priority scheduling end to end: an engine with scheduling_policy "priority" runs a later,
higher-priority request first; an fcfs engine refuses a priority; a bad policy fails at start."""

import pytest

from paxengine import SamplingParams
from paxengine.engine import EngineCore
from paxengine.errors import InvalidRequest


def _core(policy):
    return EngineCore(
        model="dummy:tiny",
        max_model_len=64,
        max_num_seqs=1,  # one at a time: the order is the policy's
        max_num_batched_tokens=16,
        token_buckets=[16],
        seq_buckets=[1],
        num_kv_blocks=32,
        block_size=4,
        show_progress=False,
        scheduling_policy=policy,
    )


def _finish_order(core, priorities):
    for rid, p in priorities:
        params = SamplingParams(max_tokens=3, ignore_eos=True, priority=p)
        core.add_request(rid, {"prompt_token_ids": [1, 2, 3]}, params)
    order = []
    while core.has_unfinished():
        order += [o.request_id for o in core.step() if o.finished]
    return order


def test_priority_engine_runs_the_higher_priority_first():
    core = _core("priority")
    assert _finish_order(core, [("late", 3), ("soon", 0), ("first", -2)]) == [
        "first",
        "soon",
        "late",
    ]


def test_fcfs_engine_refuses_a_priority_and_bad_policy_fails():
    core = _core("fcfs")
    with pytest.raises(InvalidRequest, match="priority"):
        core.add_request("x", {"prompt_token_ids": [1, 2]}, SamplingParams(priority=1))
    assert _finish_order(core, [("a", 0), ("b", 0)]) == ["a", "b"]
    with pytest.raises(ValueError, match="scheduling_policy"):
        _core("lottery")
