"""The scheduler as the one owner of a request's tokens: pending samples of an overlapped step,
1..k+1 tokens per request per step, token-level stops, and blocks returned on every ending.
Pure Python: no model, no JAX."""

from paxengine.batch import build_step
from paxengine.kv_cache import KVCacheManager
from paxengine.request import Request, Status
from paxengine.sampling_params import SamplingParams
from paxengine.scheduler import Scheduler

EOS = 2


def setup(num_blocks=64, **params):
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=False)
    sched = Scheduler(
        kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, eos_token_ids=[EOS]
    )
    req = Request("r", [10, 11, 12, 13, 14], SamplingParams(**params), seed=0)
    sched.add(req)
    return kv, sched, req


def test_overlapped_step_feeds_the_pending_sample_from_the_device():
    kv, sched, req = setup(max_tokens=8)
    first = sched.schedule()  # the prompt: 5 tokens, then a sample
    assert first.sampling == {"r"} and req.num_pending_tokens == 1
    assert req.num_tokens == 6 and req.num_known_tokens == 5 and not req.output_token_ids
    second = sched.schedule()  # before the first step's sample is read
    assert second.num_scheduled_tokens == {"r": 1} and req.num_pending_tokens == 2
    arrays = build_step(second, 4, 16, 4, 16, prev_rows={"r": 0})
    assert arrays.positions[0] == 5 and arrays.prev_index[0] == 0 and arrays.tokens[0] == 0
    assert arrays.seq_lens[0] == 6
    sched.update_from_output(first, {"r": [21]})
    assert req.output_token_ids == [21] and req.num_pending_tokens == 1
    sched.update_from_output(second, {"r": [22]})
    assert req.output_token_ids == [21, 22] and req.num_pending_tokens == 0
    third = sched.schedule()  # read in between: the id comes from the host
    arrays = build_step(third, 4, 16, 4, 16)
    assert arrays.tokens[0] == 22 and arrays.prev_index[0] == -1 and arrays.positions[0] == 6


def test_several_tokens_a_step_stop_at_a_stop_token_and_free_the_blocks():
    kv, sched, req = setup(max_tokens=10, stop_token_ids=[30])
    out = sched.schedule()
    updated = sched.update_from_output(out, {"r": [21, 22, 30, 23, 24]})  # 30 stops: 23, 24 dropped
    assert updated == [req] and req.output_token_ids == [21, 22, 30]
    assert req.status == Status.FINISHED and (req.finish_reason, req.stop_reason) == ("stop", 30)
    assert kv.num_free_blocks == kv.num_blocks and not sched.running


def test_max_tokens_cuts_a_multi_token_step():
    kv, sched, req = setup(max_tokens=3)
    sched.update_from_output(sched.schedule(), {"r": [21, 22, 23, 24]})
    assert req.output_token_ids == [21, 22, 23] and req.finish_reason == "length"
    assert kv.num_free_blocks == kv.num_blocks


def test_eos_counts_only_after_min_tokens_and_not_with_ignore_eos():
    _, sched, req = setup(max_tokens=10, min_tokens=2)
    sched.update_from_output(sched.schedule(), {"r": [EOS, 21, EOS, 22]})
    assert req.output_token_ids == [EOS, 21, EOS] and req.finish_reason == "stop"
    assert req.stop_reason is None
    _, sched, req = setup(max_tokens=3, ignore_eos=True)
    sched.update_from_output(sched.schedule(), {"r": [EOS, EOS, EOS]})
    assert req.output_token_ids == [EOS] * 3 and req.finish_reason == "length"


def test_a_last_pending_sample_gets_no_second_row():
    _, sched, req = setup(max_tokens=1)
    first = sched.schedule()
    assert not sched.schedule()  # its one token is on the device: nothing to run
    sched.update_from_output(first, {"r": [21]})
    assert req.finish_reason == "length" and req.output_token_ids == [21]


def test_abort_while_in_flight_drops_the_sample():
    kv, sched, req = setup(max_tokens=8)
    out = sched.schedule()
    sched.finish(req, "abort")
    assert kv.num_free_blocks == kv.num_blocks and req.num_pending_tokens == 0
    assert sched.update_from_output(out, {"r": [21]}) == [] and req.output_token_ids == []


def test_preempted_with_a_pending_sample_waits_for_it():
    kv = KVCacheManager(3, 4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    a = Request("a", [1] * 4, SamplingParams(max_tokens=8), seed=0)
    b = Request("b", [1] * 7, SamplingParams(max_tokens=8), seed=0)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()  # a: 1 block, b: 2 blocks: the pool is full
    assert first.sampling == {"a", "b"}
    second = sched.schedule()  # a needs a 2nd block: b, the newest, goes
    assert second.preempted == [b] and b.status == Status.PREEMPTED and b.num_pending_tokens == 1
    assert list(second.num_scheduled_tokens) == ["a"]
    sched.update_from_output(first, {"a": [5], "b": [6]})
    assert b.output_token_ids == [6] and b.num_pending_tokens == 0  # kept for its recompute
    assert b.num_computed_tokens == 0 and b.num_tokens == 8


def _decoding(sched, *names_and_lens):
    """Requests admitted and past their prompts (one sampled token each)."""
    reqs = [
        Request(n, list(range(1, k + 1)), SamplingParams(max_tokens=50), seed=0)
        for n, k in names_and_lens
    ]
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    sched.update_from_output(out, {rid: [7] for rid in out.sampling})
    return reqs


def _backlog_sched(kv):
    return Scheduler(
        kv,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=512,
        decode_step_token_budget=8,
        backlog_step_token_budget=32,
    )


def test_the_step_budget_grows_with_the_backlog_of_prompts():
    kv = KVCacheManager(1024, 4, enable_prefix_caching=False)
    sched = _backlog_sched(kv)
    _decoding(sched, ("a", 3), ("b", 3))
    for i in range(3):  # 3 x 30 = 90 prompt tokens waiting >= 2 x 32
        sched.add(Request(f"w{i}", list(range(1, 31)), SamplingParams(max_tokens=4), seed=0))
    sizes = []
    for _ in range(4):
        out = sched.schedule()
        assert sum(out.num_scheduled_tokens[r] for r in ("a", "b")) == 2  # decodes first
        sizes.append(out.total_tokens)
        sched.update_from_output(out, {rid: [7] for rid in out.sampling})
    # 90 waiting: 32; 60 left (>= 2 x 16): 16; 46: 16; 32: 16; then 18 (< 2 x 16): 8
    assert sizes == [32, 16, 16, 16]
    assert sched.schedule().total_tokens == 8


def test_the_jump_rule_keeps_the_small_budget_below_twice_the_large(monkeypatch):
    import paxengine.scheduler as scheduler

    monkeypatch.setattr(scheduler, "BACKLOG_STEPS", "jump")
    kv = KVCacheManager(1024, 4, enable_prefix_caching=False)
    sched = _backlog_sched(kv)
    _decoding(sched, ("a", 3), ("b", 3))
    for i in range(3):
        sched.add(Request(f"w{i}", list(range(1, 31)), SamplingParams(max_tokens=4), seed=0))
    out = sched.schedule()
    assert out.total_tokens == 32  # 2 decodes + 30 prompt tokens
    sched.update_from_output(out, {rid: [7] for rid in out.sampling})
    out = sched.schedule()  # 60 prompt tokens left, under 2 x 32: the small budget again
    assert out.total_tokens == 8


def _running(kv, sched, name, prompt_len, computed, outputs=()):
    """A request in the running list with `computed` tokens in the cache."""
    r = Request(name, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=50), seed=0)
    r.output_token_ids = list(outputs)
    assert kv.allocate(r, computed)
    r.num_computed_tokens, r.status = computed, Status.RUNNING
    sched.running.append(r)
    return r


def test_decode_rows_come_first_and_a_prompt_chunk_cannot_crowd_them_out():
    kv = KVCacheManager(256, 4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=40, max_model_len=512)
    _running(kv, sched, "long", 100, 40)  # admitted first, still in its prompt
    _running(kv, sched, "a", 5, 5, [7])  # admitted later, decoding
    _running(kv, sched, "b", 5, 5, [7])
    out = sched.schedule()
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("long", 38)]


def test_step_budget_while_decoding_bounds_the_prefill_chunk():
    kv = KVCacheManager(256, 4, enable_prefix_caching=False)
    sched = Scheduler(
        kv,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=512,
        decode_step_token_budget=16,
    )
    alone = Request("alone", list(range(1, 101)), SamplingParams(max_tokens=4), seed=0)
    sched.add(alone)
    assert sched.schedule().num_scheduled_tokens == {"alone": 64}  # nobody decodes: full budget
    _decoding(sched, ("a", 3), ("b", 3), ("c", 3))
    late = Request("late", list(range(1, 101)), SamplingParams(max_tokens=4), seed=0)
    sched.add(late)
    out = sched.schedule()
    assert out.total_tokens == 16  # 3 decodes + 13 prompt tokens
    assert [out.num_scheduled_tokens[r] for r in ("a", "b", "c")] == [1, 1, 1]
    assert out.num_scheduled_tokens.get("alone", 0) + out.num_scheduled_tokens.get("late", 0) == 13


def test_a_full_step_of_decodes_does_not_starve_a_waiting_prompt():
    # 10 decoding rows against a cap of 8: the waiting prompt still gets half the cap a step
    kv = KVCacheManager(1024, 4, enable_prefix_caching=False)
    sched = Scheduler(
        kv,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=512,
        decode_step_token_budget=8,
    )
    _decoding(sched, *((f"d{i}", 3) for i in range(10)))
    sched.add(Request("w", list(range(1, 31)), SamplingParams(max_tokens=4), seed=0))
    out = sched.schedule()
    assert out.num_scheduled_tokens.get("w") == 4 and out.total_tokens == 14
