"""Scheduler unit tests: a step is shortened to a compiled token bucket when that is cheaper
than padding, and the deferred prompt tokens follow in the next step."""

import pytest

from paxengine.kv_cache import KVCacheManager
from paxengine.request import Request
from paxengine.sampling_params import SamplingParams
from paxengine.scheduler import Scheduler


def make(prompt_len: int, name: str) -> Request:
    return Request(name, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=4), seed=0)


def scheduler(buckets):
    kv = KVCacheManager(256, 16, enable_prefix_caching=False)
    return Scheduler(
        kv, max_num_seqs=64, max_num_batched_tokens=256, max_model_len=1024, token_buckets=buckets
    )


def decode_step(sched, out):
    """Finish a step: every request that completed its prompt gets a token."""
    sched.update_from_output(out, {rid: [7] for rid in out.sampling})


def test_prefill_chunk_trimmed_to_bucket_and_resumed():
    sched = scheduler([16, 64, 256])
    decoders = [make(8, f"d{i}") for i in range(3)]
    for r in decoders:
        sched.add(r)
    decode_step(sched, sched.schedule())  # 3 x 8 = 24 tokens: the last 8 cannot shrink to 16
    late = make(70, "late")
    sched.add(late)
    out = sched.schedule()  # 3 decodes + 70 = 73 tokens: 64 fills exactly
    assert out.total_tokens == 64
    assert out.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "late": 61}
    decode_step(sched, out)
    assert late.num_computed_tokens == 61 and not late.output_token_ids
    out = sched.schedule()  # the deferred 9 follow
    assert out.num_scheduled_tokens["late"] == 9
    decode_step(sched, out)
    assert late.output_token_ids == [7]  # its prompt is complete: it sampled


def test_no_trim_when_padding_is_cheaper_or_chunk_too_short():
    sched = scheduler([16, 64, 256])
    sched.add(make(200, "a"))  # 200 -> 256 pads 56; trimming would defer 136
    assert sched.schedule().total_tokens == 200
    sched2 = scheduler([16, 64, 256])
    for i in range(17):  # 17 decodes: nothing to shorten
        sched2.add(make(1, f"r{i}"))
    decode_step(sched2, sched2.schedule())
    assert sched2.schedule().total_tokens == 17


def test_without_buckets_nothing_changes():
    sched = scheduler(None)
    sched.add(make(70, "a"))
    assert sched.schedule().total_tokens == 70


def test_block_array_follows_allocation_and_free():
    kv = KVCacheManager(8, 16, enable_prefix_caching=False)
    req = make(20, "a")
    other = make(40, "b")
    assert kv.allocate(req, 20)
    first = req.block_array().tolist()
    assert first == req.block_ids and len(first) == 2
    assert kv.allocate(other, 40)  # takes 3 of the remaining blocks
    req.num_computed_tokens = 20
    assert kv.allocate(req, 16)  # one more block: the array grows with the list
    before = req.block_array().tolist()
    assert before == req.block_ids and len(before) == 3
    kv.free_request(req)  # preempted: a re-grown list of the same length
    kv.free_request(other)  # must not meet the stale copy
    kv.allocate(make(1, "c"), 1)
    req.num_computed_tokens = 0
    assert kv.allocate(req, 36)
    assert len(req.block_ids) == 3 and req.block_ids != before
    assert req.block_array().tolist() == req.block_ids


def _prio(name: str, priority: int, prompt_len: int = 16) -> Request:
    params = SamplingParams(max_tokens=64, priority=priority)
    return Request(name, list(range(1, prompt_len + 1)), params, seed=0)


def test_priority_policy_orders_waiting_and_preempts_the_lowest():
    kv = KVCacheManager(6, 16, enable_prefix_caching=False)  # 6 blocks of 16 tokens
    sched = Scheduler(
        kv, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256, policy="priority"
    )
    for name, p in [("low", 5), ("high", -1), ("mid", 0), ("high2", -1)]:
        sched.add(_prio(name, p))
    assert [r.request_id for r in sched.waiting] == ["high", "high2", "mid", "low"]
    out = sched.schedule()  # two sequences at most: the two high ones
    assert [r.request_id for r in out.requests] == ["high", "high2"]
    decode_step(sched, out)
    sched.add(_prio("urgent", -9))  # waits (2 seqs run) but heads the queue
    assert sched.waiting[0].request_id == "urgent"
    # grow both until blocks run out: the victim is the lower-ranked running one (high2,
    # same priority as high, later arrival), which goes back in rank order
    while not sched.waiting or sched.waiting[1].request_id != "high2":
        out = sched.schedule()
        decode_step(sched, out)
        assert len(out.requests) >= 1
    assert [r.request_id for r in sched.running] == ["high"]
    assert [r.request_id for r in sched.waiting][:3] == ["urgent", "high2", "mid"]


def test_fcfs_policy_keeps_arrival_order():
    kv = KVCacheManager(16, 16, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)
    for name, p in [("low", 5), ("high", -1)]:
        sched.add(_prio(name, p))
    assert [r.request_id for r in sched.waiting] == ["low", "high"]
    with pytest.raises(ValueError, match="scheduling_policy"):
        Scheduler(kv, 8, 256, 256, policy="lottery")


def test_bad_words_rows_take_the_unchained_path():
    """A chained verify step builds its rows on the device without a token mask: a request with
    bad words (a mask row, and for a longer word one that follows its output) is never chained,
    as allowed_token_ids; the same request without them is."""
    from paxengine.spec_decode import parse_speculative_config

    spec = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    )
    for params, chains in (
        (SamplingParams(max_tokens=64), True),
        (SamplingParams(max_tokens=64, bad_words_token_ids=[[5]]), False),
        (SamplingParams(max_tokens=64, bad_words_token_ids=[[5, 6]]), False),
    ):
        kv = KVCacheManager(64, 4, enable_prefix_caching=False)
        sched = Scheduler(kv, 8, 64, 256, spec=spec, max_sample_rows=8)
        sched.add(Request("a", [1, 2, 3, 1, 2], params, seed=0))
        out = sched.schedule()  # the prompt: its first sample pending
        assert sched.can_chain(out) is chains
