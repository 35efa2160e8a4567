"""Issue #20 on the H200: what a speculative verify step costs against a decode step.

    python3 -m benchmarks.gpu.spec_verify [--quick] [--out DIR]

One engine on the dummy Llama-3.1-8B (the GPU run's engine settings, `workloads.FULL`) with
n-gram speculation configured, and the proposer replaced by one that always drafts exactly k
tokens (the last token repeated; what is accepted does not change a verify step's cost). For each
batch size B and k = 0..6: B prompts of 1,024 random tokens are prefilled (untimed), then 40
engine steps in which every row decodes or verifies are timed: ms a step and tokens a step.
k = 0 is the plain engine (speculation off, its overlapped decode); k >= 1 runs as the engine
speculates (each step read before the next); "0s" is a decode step read before the next, as
speculation runs it but with no drafts: the overlap's share of a verify step's cost; "4c" is k = 4
in chained verify steps (spec_decode/chain.py: built while the previous one runs; their drafts
come from the device's lookup, which finds none in random prompts, and every row still verifies
k tokens: the same step cost).

Per case, besides the wall clock: the engine's step trace (PAXENGINE_STEP_TRACE's phases,
medians over the timed steps: where the host's time went) and 10 steps under jax.profiler (the
device's kernel time a step, and its idle time a step: what the host costs the device).

From the step times: the acceptance rate at which a verify step of k breaks even (its expected
tokens, (1 - a^(k+1)) / (1 - a) for a per-position acceptance a, equal its cost in decode steps),
and the effective ITL for a given mean of accepted drafts per verify step (--accepted-per-step,
e.g. the CPU copy-heavy workload's, measured at --accepted-at-k drafts): that mean gives a
per-position acceptance, which gives each k's expected tokens; the step's cost over those.
Then (--offline-64) issue #20's high-load goal: 64 prompts of (1024, 128) through
LLM.generate with n-gram speculation as a user configures it (k = 4, prompt lookup 1..3, the
default off switch) against speculation off, alternating, --reps times each: output tokens/s.
Results: spec_verify_h200.json in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.bench.datasets import random_dataset
from benchmarks.device_trace import kernel_times, span_of, trace_device
from benchmarks.gpu.workloads import FULL, QUICK
from benchmarks.profile.step_trace import PHASES
from benchmarks.profile.step_trace import load as load_trace
from benchmarks.record import environment

SETTINGS = {
    "full": {
        "batches": [1, 8, 16, 64],
        "ks": [0, "0s", 1, 2, 3, 4, 5, 6],
        "input_len": 1024,
        "steps": 40,
    },
    "quick": {"batches": [1, 4], "ks": [0, "0s", 2], "input_len": 16, "steps": 6},
}


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verify step of k drafts yields when each draft is accepted with probability a
    (until the first rejection), the bonus or correction token included."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def per_position(accepted: float, k: int) -> float:
    """The per-position acceptance at which a verify step of k drafts accepts `accepted` of them
    on average (expected_tokens - 1): how a measured mean carries over to another k."""
    if accepted >= k:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) - 1 < accepted else (lo, mid)
    return round(hi, 4)


def break_even(cost: float, k: int) -> float | None:
    """The per-position acceptance at which expected_tokens(a, k) == cost (in decode steps)."""
    if cost <= 1:
        return 0.0
    if cost > k + 1:
        return None  # never pays
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < cost else (lo, mid)
    return round(hi, 4)


def _k(case) -> int:
    """The drafts a case verifies: 4 for "4" and "4c", 0 for 0 and "0s"."""
    return 0 if case == "0s" else int(str(case).rstrip("c"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/spec_verify"))
    p.add_argument("--accepted-per-step", type=float, help="mean accepted drafts, e.g. from CPU")
    p.add_argument("--accepted-at-k", type=int, default=4, help="the k that mean was measured at")
    p.add_argument("--offline-64", action="store_true", help="also the 64-request comparison")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument(
        "--inputs",
        default="default",
        help="comma-separated: default, stable (PAXENGINE_STABLE_INPUTS's path, set per case)",
    )
    p.add_argument(
        "--engine",
        type=json.loads,
        default={},
        help='EngineConfig overrides, e.g. {"layer_loop": "scan"}',
    )
    p.add_argument(
        "--ks", help="comma-separated k values (0s: a decode step read first; 4c: chained k = 4)"
    )
    p.add_argument("--batches", help="comma-separated batch sizes (default: the settings')")
    a = p.parse_args(argv)
    argv_used = list(sys.argv[1:] if argv is None else argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    spec, s = (QUICK, SETTINGS["quick"]) if a.quick else (FULL, SETTINGS["full"])
    if a.batches:
        s = {**s, "batches": [int(b) for b in a.batches.split(",")]}
    if a.ks:
        s = {**s, "ks": [k if k[-1] in "sc" else int(k) for k in a.ks.split(",")]}
    trace_file = out / "spec_verify_step_trace.jsonl"
    trace_file.unlink(missing_ok=True)
    os.environ["PAXENGINE_STEP_TRACE"] = str(trace_file)  # read by the engine when it starts

    import paxengine.scheduler as scheduler_mod
    from benchmarks.bench.throughput import token_prompts
    from paxengine import LLM, SamplingParams
    from paxengine.config import EngineConfig
    from paxengine.models.config import PRESETS

    real_propose = scheduler_mod.propose_ngram
    k_now = {"k": 1}
    # exactly k drafts whenever the scheduler asks (it caps k by budget and max_tokens itself)
    scheduler_mod.propose_ngram = lambda tokens, lo, hi, k: [int(tokens[-1])] * min(k, k_now["k"])
    cfg = EngineConfig(
        model=f"dummy:{spec['preset']}",
        dtype=spec["dtype"],
        **{**spec["engine"], **a.engine},
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": max(_k(k) for k in s["ks"]),
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 1,
            "disable_by_batch_size": max(s["batches"]),
        },
    )
    t = time.perf_counter()
    llm = LLM(config=cfg)
    startup = time.perf_counter() - t
    print(f"engine started in {startup:.1f} s", flush=True)
    sched = llm.engine.scheduler
    spec_cfg = sched.spec
    vocab = PRESETS[spec["preset"]].vocab_size
    seed = [0]

    def decode_steps(b: int, steps: int) -> tuple[float, float]:
        """B requests, prefilled first (untimed); then `steps` engine steps in which every row
        decodes (or verifies). -> (ms a step, tokens a step). The requests are aborted after."""
        eng = llm.engine
        seed[0] += 1
        reqs = random_dataset(b, s["input_len"], 1, vocab_size=vocab, seed=seed[0])
        # long enough that no request ends inside the run at k + 1 tokens a step, the prefill's
        # mixed steps included (the first H200 run ended b=64, k=4 that way: KeyError)
        room = cfg.max_model_len - s["input_len"]
        most = min((max(_k(k) for k in s["ks"]) + 1) * (steps + 90), room)
        params = SamplingParams(temperature=0, max_tokens=most, ignore_eos=True)
        ids = [f"v{seed[0]}_{i}" for i in range(b)]
        for rid, prompt in zip(ids, token_prompts(reqs)):
            eng.add_request(rid, prompt, params, final_only=True)

        def generated() -> int:
            return sum(len(eng.seq_of[r][1].req.output_token_ids) for r in ids)

        while eng.scheduler.waiting or any(not eng.seq_of[r][1].req.output_token_ids for r in ids):
            eng.step()
        for _ in range(2):  # past the prefill's last mixed step
            eng.step()
        eng.trace.flush()
        first = len(load_trace(trace_file))
        before, t = generated(), time.perf_counter()
        for _ in range(steps):
            eng.step()
        el = time.perf_counter() - t
        tokens = generated() - before
        eng.trace.flush()
        phases = {
            ph: round(statistics.median(r.get(ph, 0.0) for r in load_trace(trace_file)[first:]), 3)
            for ph in PHASES
        }
        events = trace_device(lambda: [eng.step() for _ in range(10)])
        kernels, _ = kernel_times(events)
        _, idle = span_of(events)
        device = {
            "kernels_ms_per_step": round(sum(kernels.values()) / 1e4, 3),
            "device_idle_ms_per_step": round(idle / 1e4, 3),
        }
        for r in ids:
            eng.abort(r)
        while eng.has_unfinished():
            eng.step()
        return 1e3 * el / steps, tokens / steps, phases, device

    decode_steps(2, 4)  # warm-up
    import paxengine.runner as runner_mod

    rows = []
    for b, inputs in [(b, i) for b in s["batches"] for i in a.inputs.split(",")]:
        runner_mod._STABLE_INPUTS = inputs == "stable"
        base = None
        for k in s["ks"]:
            sched.spec = spec_cfg if k else None  # k = 0: the plain, overlapped engine
            k_now["k"] = _k(k)
            llm.engine.chain_verify = str(k).endswith("c")
            before, chained = llm.engine.stats(), llm.engine.chained_steps
            step_ms, tokens_per_step, phases, device = decode_steps(b, s["steps"])
            after = llm.engine.stats()
            drafts = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
            accepted = (
                after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
            )
            if k == 0:
                base = step_ms
            row = {
                "batch": b,
                "inputs": inputs,
                "k": k,
                "step_ms": round(step_ms, 3),
                "vs_decode_step": round(step_ms / base, 3),
                "tokens_per_step": round(tokens_per_step, 3),
                "draft_tokens": drafts,
                "accepted": accepted,
                "chained_steps": llm.engine.chained_steps - chained,
                "host_phases_ms_p50": phases,
                **device,
            }
            if _k(k):
                row["break_even_acceptance"] = break_even(step_ms / base, _k(k))
                if a.accepted_per_step is not None:
                    acc = per_position(a.accepted_per_step, a.accepted_at_k)
                    tokens = expected_tokens(acc, _k(k))
                    row["effective_itl_vs_plain"] = round(step_ms / base / tokens, 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out / "spec_verify_h200.json").write_text(
                json.dumps(
                    {
                        "what": __doc__.split("\n")[0],
                        "command": "python3 -m benchmarks.gpu.spec_verify " + " ".join(argv_used),
                        "settings": s,
                        "startup_s": startup,
                        "rows": rows,
                        "environment": environment(),
                    },
                    indent=1,
                )
            )
    if a.offline_64:
        llm.engine.chain_verify = llm.engine.runner.chain is not None  # as users run it
        offline_64(llm, spec_cfg, a.reps, vocab, out / "spec_offline64_h200.json", a.quick)
        scheduler_mod.propose_ngram = real_propose
    sched.spec = spec_cfg
    return 0


def offline_64(llm, spec_cfg, reps: int, vocab: int, path: Path, quick: bool) -> None:
    """64 x (1024, 128) with the n-gram proposer as users run it against speculation off."""
    import dataclasses

    import paxengine.scheduler as scheduler_mod
    from benchmarks.bench.throughput import greedy_params, token_prompts
    from paxengine.spec_decode.config import DEFAULT_DISABLE_BY_BATCH_SIZE
    from paxengine.spec_decode.ngram import propose_ngram

    scheduler_mod.propose_ngram = propose_ngram
    user = dataclasses.replace(
        spec_cfg,
        num_speculative_tokens=4,
        prompt_lookup_min=1,
        prompt_lookup_max=3,
        disable_by_batch_size=DEFAULT_DISABLE_BY_BATCH_SIZE,
    )
    # output lengths 64..192: the batch drains gradually, and below the off switch's batch size
    # the engine speculates again, as a served run's tail does
    n, inp, outl = (8, 16, 8) if quick else (64, 1024, 128)
    reqs = random_dataset(n, inp, outl, range_ratio=0.5, vocab_size=vocab, seed=64)
    runs = []
    llm.engine.scheduler.spec = user  # a warm-up run of each, not recorded
    llm.generate(token_prompts(reqs[:16]), greedy_params(reqs[:16]), use_tqdm=False)
    for rep in range(reps):
        for name, cfg in (("off", None), ("ngram", user)):
            llm.engine.scheduler.spec = cfg
            llm.engine.reset_prefix_cache()  # every run prefills its prompts
            before = llm.engine.stats()
            t = time.perf_counter()
            outs = llm.generate(token_prompts(reqs), greedy_params(reqs), use_tqdm=False)
            el = time.perf_counter() - t
            after = llm.engine.stats()
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            run = {
                "rep": rep,
                "speculation": name,
                "output_tok_s": round(toks / el, 1),
                "seconds": round(el, 3),
                "draft_tokens": after["spec_decode_num_draft_tokens"]
                - before["spec_decode_num_draft_tokens"],
                "accepted": after["spec_decode_num_accepted_tokens"]
                - before["spec_decode_num_accepted_tokens"],
            }
            runs.append(run)
            print(json.dumps(run), flush=True)
    mean = {
        name: statistics.fmean(r["output_tok_s"] for r in runs if r["speculation"] == name)
        for name in ("off", "ngram")
    }
    res = {
        "what": f"{n} x ({inp}, {outl} +-50%), n-gram speculation {dataclasses.asdict(user)} vs off",
        "runs": runs,
        "mean_output_tok_s": mean,
        "ngram_vs_off": round(mean["ngram"] / mean["off"], 4),
        "environment": environment(),
    }
    print(json.dumps(res["mean_output_tok_s"]), res["ngram_vs_off"], flush=True)
    path.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
