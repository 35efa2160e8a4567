"""The real Scheduler against a step-cost model: how a scheduling policy moves served throughput
and tail latency, on the CPU, before a GPU lease measures it.

    python -m benchmarks.profile.sched_sim [--concurrency 16,64] [--budgets 512,none]
        [--backlog-budgets none,4096] [--rates 4,8,16 --range-ratio 0.9 --output-len 256]
    python -m benchmarks.profile.sched_sim --offline 300x1000x1000 --num-blocks 23040,28123

A closed-loop client (vLLM `bench serve --max-concurrency C`, random 1024/128 prompts, as the
GPU run's serve stage) or Poisson arrivals (`--rates`, as its poisson stage) drive
paxengine.scheduler.Scheduler and its KVCacheManager; each step's time comes from `step_ms`, a model of an 8B bf16 step on the H200 fitted to the step traces of
benchmarks/results/gpu_2026-12-01_packed/ (decode step of 63 rows 7.3 ms, 2,048-token mixed
steps ~26 us a prompt token, 8,192-token steps ~23.5 us). It ranks policies; it does not
replace measuring them: against the H200 runs of benchmarks/results/gpu_2026-12-02_serve_budget/
it put budgets of 512 and 1,024 at c=64 where they measured (3,344 / 3,257 tok/s against 3,317 /
3,164) and over-predicted 2,048 (3,387 against 3,062).

`--offline NxINxOUT`: `LLM.generate` of N prompts at once (the GPU run's offline workloads) for
each KV pool size of `--num-blocks`, with the steps, the preemptions and where the time goes
(prefill, decode-only steps, steps beside recomputed prompts). On the H100 offline 300 x (1000,
1000) of benchmarks/results/gpu_2026-12-05c_kv_share/ (23,040 blocks) it gave 1,820 steps and
116 preemptions where the engine counted 1,821 and 116.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random

import numpy as np

from benchmarks.bench.datasets import random_dataset
from paxengine.batch import pick
from paxengine.kv_cache import KVCacheManager
from paxengine.request import Request
from paxengine.sampling_params import SamplingParams
from paxengine.scheduler import Scheduler

# H200, Llama-3.1-8B bf16 (ms, us): a step's fixed cost, the weights' read (16 GB at ~4 TB/s),
# the GEMMs' time a padded token (by bucket: small M runs below the tensor cores' peak), a decode
# row's KV read a context token (131 kB at ~3.5 TB/s), a prompt chunk's attention a (query, key)
# pair (4 * 4096 * 32 flops at ~400 TFLOP/s)
FIXED_MS, WEIGHTS_MS, KV_US, PAIR_US = 0.6, 4.0, 0.0374, 1.31e-6
GEMM_US = {512: 26.0, 1024: 24.6, 2048: 23.6, 4096: 22.6}
ENGINE = {  # the GPU run's serve engine (workloads.FULL)
    "max_num_seqs": 512,
    "max_num_batched_tokens": 8192,
    "max_model_len": 4096,
    "token_buckets": [1, 16, 64, 256, 320, 384, 512, 1024, 2048, 4096, 8192],
    "num_blocks": 20000,
    "block_size": 16,
}


def gemm_us(T: int) -> float:
    for bound in sorted(GEMM_US):
        if T <= bound:
            return GEMM_US[bound]
    return GEMM_US[max(GEMM_US)]


def step_ms(out, buckets: list[int]) -> float:
    """The modelled time of one scheduled step (its tokens padded to their bucket)."""
    T = pick(buckets, out.total_tokens)
    ms = FIXED_MS + max(WEIGHTS_MS, T * gemm_us(T) / 1e3)
    for req in out.requests:
        n = out.num_scheduled_tokens[req.request_id]
        end = req.num_computed_tokens  # _count_scheduled has added n already
        if n == 1 and end > req.num_prompt_tokens:
            ms += end * KV_US / 1e3
        else:
            ms += n * (end - n / 2) * PAIR_US / 1e3
    return ms


def simulate(
    concurrency: int,
    num_prompts: int,
    input_len: int,
    output_len: int,
    budget: int | None,
    engine: dict = ENGINE,
    client_ms: float = 1.0,
    seed: int = 0,
    lag_steps: int = 2,
    backlog_budget: int | None = None,
    rate: float | None = None,
    range_ratio: float = 0.0,
) -> dict:
    """Runs `num_prompts` requests through a closed loop of `concurrency` clients, or with
    `rate` as Poisson arrivals of that many a second (bench serve --request-rate); lengths
    uniform within `range_ratio` around the means, as bench serve's random dataset. Returns
    bench serve's summary (output tok/s, TTFT / TPOT / ITL percentiles in ms).

    lag_steps: the steps that start between a request's last step and its client's next
    request reaching the scheduler. The engine reads step N after dispatching N+1, and N+2 is
    scheduled as N is read, before the client (answered from N's outputs) sends again: the
    replacement first runs in N+3, so 2 steps start in between (0: the next step)."""
    rng = random.Random(seed)
    reqs = random_dataset(num_prompts, input_len, output_len, range_ratio, 128_000, seed=seed)
    kv = KVCacheManager(engine["num_blocks"], engine["block_size"])
    sched = Scheduler(
        kv,
        engine["max_num_seqs"],
        engine["max_num_batched_tokens"],
        engine["max_model_len"],
        engine["token_buckets"],
        decode_step_token_budget=budget,
        backlog_step_token_budget=backlog_budget,
    )
    clock, sent, arrivals = 0.0, 0, []  # arrivals: (time, id) not yet added
    lagging: list[tuple[int, int]] = []  # (the step it may join, id): sent, not yet seen
    at = 0.0
    for _ in range(num_prompts if rate else min(concurrency, num_prompts)):
        heapq.heappush(arrivals, (at, sent))
        sent += 1
        at += rng.expovariate(rate) if rate else 0.0
    token_times: dict[str, list[float]] = {}
    start: dict[str, float] = {}
    steps = 0
    # modelled seconds of steps that recompute a preempted request's tokens, or prefill a new
    # one, or only decode
    phase_s = {"recompute": 0.0, "prefill": 0.0, "decode": 0.0}
    while arrivals or lagging or sched.has_work():
        for k, i in [x for x in lagging if x[0] <= steps]:
            heapq.heappush(arrivals, (clock, i))
            lagging.remove((k, i))
        while arrivals and arrivals[0][0] <= clock:
            t, i = heapq.heappop(arrivals)
            rid = f"r{i}"
            params = SamplingParams(max_tokens=reqs[i].output_len, ignore_eos=True)
            sched.add(Request(rid, reqs[i].prompt, params, seed=i))
            start[rid], token_times[rid] = t, []
        if not sched.has_work():
            if arrivals:
                clock = arrivals[0][0]
            else:  # the engine idles: what its clients send joins the next step
                lagging = [(steps, i) for _, i in lagging]
            continue
        out = sched.schedule()
        dt = step_ms(out, engine["token_buckets"]) / 1e3
        clock += dt
        steps += 1
        chunks = [r for r in out.requests if out.num_scheduled_tokens[r.request_id] > 1]
        phase = "decode" if not chunks else "prefill"
        if any(r.num_preemptions for r in chunks):
            phase = "recompute"
        phase_s[phase] += dt
        sampled = {rid: [1] for rid in out.sampling}
        for req in sched.update_from_output(out, sampled):
            token_times[req.request_id].append(clock)
            if req.is_finished and sent < num_prompts:
                if lag_steps:
                    lagging.append((steps + lag_steps, sent))
                else:
                    heapq.heappush(arrivals, (clock + client_ms / 1e3, sent))
                sent += 1
    ttft = [1e3 * (token_times[r][0] - start[r]) for r in start]
    tpot = [1e3 * (ts[-1] - ts[0]) / (len(ts) - 1) for ts in token_times.values() if len(ts) > 1]
    itl = np.concatenate([np.diff(ts) * 1e3 for ts in token_times.values()])
    first = min(start.values())
    last = max(ts[-1] for ts in token_times.values())

    def pct(xs, q):
        return round(float(np.percentile(xs, q)), 2)

    return {
        "concurrency": concurrency,
        "budget": budget,
        "backlog_budget": backlog_budget,
        "steps": steps,
        "preemptions": sched.num_preemptions,
        "seconds_by_step_kind": {k: round(v, 2) for k, v in phase_s.items()},
        "rate": rate,
        "output_tok_s": round(sum(r.output_len for r in reqs) / (last - first), 1),
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "tpot_p50": pct(tpot, 50),
        "tpot_p99": pct(tpot, 99),
        "itl_p50": pct(itl, 50),
        "itl_p99": pct(itl, 99),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--budgets", default="2048,4096,none", help="decode_step_token_budget values")
    ap.add_argument(
        "--backlog-budgets", default="none", help="backlog_step_token_budget values, each run"
    )
    ap.add_argument("--prompts-per-concurrency", type=int, default=4)
    ap.add_argument(
        "--rates", default=None, help="Poisson arrival rates (req/s) instead of --concurrency"
    )
    ap.add_argument("--seconds", type=float, default=30, help="a rate's arrivals (at least 32)")
    ap.add_argument("--range-ratio", type=float, default=0.0)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument(
        "--offline", default=None, help="NxINxOUT: N prompts at once, as LLM.generate (no client)"
    )
    ap.add_argument("--num-blocks", default=str(ENGINE["num_blocks"]), help="KV pool sizes")
    a = ap.parse_args(argv)
    if a.offline:
        n, inp, outp = (int(x) for x in a.offline.split("x"))
        for nb in a.num_blocks.split(","):
            engine = dict(ENGINE, num_blocks=int(nb))
            r = simulate(n, n, inp, outp, None, engine=engine, lag_steps=0)
            print(json.dumps({"num_blocks": int(nb), **r}))
        return
    loads = (
        [(None, float(r)) for r in a.rates.split(",")]
        if a.rates
        else [(int(c), None) for c in a.concurrency.split(",")]
    )
    for c, rate in loads:
        n = max(32, round(rate * a.seconds)) if rate else c * a.prompts_per_concurrency
        for b in a.budgets.split(","):
            for k in a.backlog_budgets.split(","):
                budget, backlog = (None if x == "none" else int(x) for x in (b, k))
                if backlog is not None and (budget is None or backlog < budget):
                    continue  # the engine refuses it
                r = simulate(
                    c or 0,
                    n,
                    a.input_len,
                    a.output_len,
                    budget,
                    backlog_budget=backlog,
                    rate=rate,
                    range_ratio=a.range_ratio,
                )
                print(json.dumps(r))


if __name__ == "__main__":
    main()
