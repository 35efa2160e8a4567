"""benchmarks.profile.sched_sim: the real Scheduler in a closed loop against the step-cost model."""

import json

from benchmarks.profile import sched_sim


def test_every_request_completes_and_a_budget_bounds_the_itl_tail():
    common = dict(concurrency=12, num_prompts=24, input_len=1024, output_len=32)
    free = sched_sim.simulate(budget=None, **common)
    capped = sched_sim.simulate(budget=512, **common)
    for r in (free, capped):
        assert r["output_tok_s"] > 0 and r["steps"] > 32  # 32 tokens each, one a step at most
        assert r["ttft_p50"] <= r["ttft_p99"] and r["itl_p50"] <= r["itl_p99"]
    # the first 8 prompts fill an 8,192-token step; the next 4 then stall their decodes for a
    # ~90 ms step without a budget, for a 512-token chunk (~15 ms) with one
    assert free["itl_p99"] > 60 and capped["itl_p99"] < 20


def test_step_cost_model_matches_the_h200_fit():
    """A 64-row decode step ~7.3 ms and an 8,192-token prefill ~23.5 us a token (the fit)."""

    class Req:
        def __init__(self, rid, n, end, prompt):
            self.request_id, self.num_computed_tokens, self.num_prompt_tokens = rid, end, prompt
            self.n = n

    class Out:
        def __init__(self, reqs):
            self.requests = reqs
            self.num_scheduled_tokens = {r.request_id: r.n for r in reqs}
            self.total_tokens = sum(r.n for r in reqs)

    buckets = sched_sim.ENGINE["token_buckets"]
    decode = Out([Req(f"d{i}", 1, 1100, 1024) for i in range(64)])
    assert 6.5 < sched_sim.step_ms(decode, buckets) < 8.0
    prefill = Out([Req(f"p{i}", 1024, 1024, 1024) for i in range(8)])
    assert 22.0 < 1e3 * sched_sim.step_ms(prefill, buckets) / 8192 < 25.0


def test_poisson_arrivals_with_random_lengths():
    """Open loop: the arrivals set the output rate (every request runs once, lengths vary
    within the range ratio), and a larger step budget lengthens the ITL tail."""
    common = dict(concurrency=0, num_prompts=120, input_len=1024, output_len=64, rate=16.0)
    small = sched_sim.simulate(budget=512, range_ratio=0.9, **common)
    large = sched_sim.simulate(budget=4096, range_ratio=0.9, **common)
    fixed = sched_sim.simulate(budget=512, **common)
    for r in (small, large, fixed):
        assert r["rate"] == 16.0 and r["output_tok_s"] > 0
    # ~16 requests a second of ~64 tokens: the output rate is the arrivals', not the capacity
    assert 500 < fixed["output_tok_s"] < 1500
    assert small["tpot_p50"] != fixed["tpot_p50"]  # the lengths differ with a range ratio
    assert large["itl_p99"] > 2 * small["itl_p99"]


def test_offline_batch_preempts_only_when_the_pool_cannot_hold_it(capsys):
    """LLM.generate of a whole batch at once (--offline): a pool that holds every sequence to
    its end never preempts; one that holds half of the final contexts preempts, recomputes
    the preempted requests' tokens, and so takes more steps and more time for the same
    output; the step kinds' seconds add up to the run."""
    sched_sim.main(["--offline", "16x64x64", "--num-blocks", "256,64"])
    big, small = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert big["num_blocks"] == 256 and small["num_blocks"] == 64
    # 16 x (64 + 64) tokens = 128 blocks of 16 at the end: 256 hold them, 64 hold half
    assert big["preemptions"] == 0 and big["seconds_by_step_kind"]["recompute"] == 0
    assert small["preemptions"] > 0 and small["seconds_by_step_kind"]["recompute"] > 0
    assert small["steps"] > big["steps"] >= 64
    assert small["output_tok_s"] < big["output_tok_s"]
    for r in (big, small):
        seconds = sum(r["seconds_by_step_kind"].values())
        assert abs(seconds - 16 * 64 / r["output_tok_s"]) < 0.05 * seconds
