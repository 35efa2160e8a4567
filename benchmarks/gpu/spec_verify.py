"""Issue #20 on the H200: what a speculative verify step costs against a decode step.

    python3 -m benchmarks.gpu.spec_verify [--quick] [--out DIR]

One engine on the dummy Llama-3.1-8B (the GPU run's engine settings, `workloads.FULL`) with
n-gram speculation configured, and the proposer replaced by one that always drafts exactly k
tokens (the last token repeated; what is accepted does not change a verify step's cost). For each
batch size B and k = 0..6: B prompts of 1,024 random tokens are prefilled (untimed), then 40
engine steps in which every row decodes or verifies are timed: ms a step and tokens a step.
k = 0 is the plain engine (speculation off, its overlapped decode); k >= 1 runs as the engine
speculates (each step read before the next).

From the step times: the acceptance rate at which a verify step of k breaks even (its expected
tokens, (1 - a^(k+1)) / (1 - a) for a per-position acceptance a, equal its cost in decode steps),
and the effective ITL for a given mean of accepted drafts per verify step (--accepted-per-step,
e.g. the CPU copy-heavy workload's): the step's cost over the 1 + that many tokens it yields.
Results: spec_verify_h200.json in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks.bench.datasets import random_dataset
from benchmarks.gpu.workloads import FULL, QUICK
from benchmarks.record import environment

SETTINGS = {
    "full": {
        "batches": [1, 8, 64],
        "ks": [0, 1, 2, 3, 4, 5, 6],
        "input_len": 1024,
        "steps": 40,
    },
    "quick": {"batches": [1, 4], "ks": [0, 2], "input_len": 16, "steps": 6},
}


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verify step of k drafts yields when each draft is accepted with probability a
    (until the first rejection), the bonus or correction token included."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/spec_verify"))
    p.add_argument("--accepted-per-step", type=float, help="mean accepted drafts, e.g. from CPU")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    spec, s = (QUICK, SETTINGS["quick"]) if a.quick else (FULL, SETTINGS["full"])

    import paxengine.scheduler as scheduler_mod
    from benchmarks.bench.throughput import token_prompts
    from paxengine import LLM, SamplingParams
    from paxengine.config import EngineConfig
    from paxengine.models.config import PRESETS

    k_now = {"k": 1}
    # exactly k drafts whenever the scheduler asks (it caps k by budget and max_tokens itself)
    scheduler_mod.propose_ngram = lambda tokens, lo, hi, k: [int(tokens[-1])] * min(k, k_now["k"])
    cfg = EngineConfig(
        model=f"dummy:{spec['preset']}",
        dtype=spec["dtype"],
        **spec["engine"],
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": max(s["ks"]),
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
        room = spec["engine"]["max_model_len"] - s["input_len"]
        most = min((max(s["ks"]) + 1) * (steps + 80), room)
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
        before, t = generated(), time.perf_counter()
        for _ in range(steps):
            eng.step()
        el = time.perf_counter() - t
        tokens = generated() - before
        for r in ids:
            eng.abort(r)
        while eng.has_unfinished():
            eng.step()
        return 1e3 * el / steps, tokens / steps

    decode_steps(2, 4)  # warm-up
    rows = []
    for b in s["batches"]:
        base = None
        for k in s["ks"]:
            sched.spec = spec_cfg if k else None  # k = 0: the plain, overlapped engine
            k_now["k"] = k
            before = llm.engine.stats()
            step_ms, tokens_per_step = decode_steps(b, s["steps"])
            after = llm.engine.stats()
            drafts = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
            accepted = (
                after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
            )
            if k == 0:
                base = step_ms
            row = {
                "batch": b,
                "k": k,
                "step_ms": round(step_ms, 3),
                "vs_decode_step": round(step_ms / base, 3),
                "tokens_per_step": round(tokens_per_step, 3),
                "draft_tokens": drafts,
                "accepted": accepted,
            }
            if k:
                row["break_even_acceptance"] = break_even(step_ms / base, k)
                if a.accepted_per_step is not None:
                    tokens = 1 + min(a.accepted_per_step, k)
                    row["effective_itl_vs_plain"] = round(step_ms / base / tokens, 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out / "spec_verify_h200.json").write_text(
                json.dumps(
                    {
                        "what": __doc__.split("\n")[0],
                        "command": "python3 -m benchmarks.gpu.spec_verify"
                        + (" --quick" if a.quick else "")
                        + (
                            f" --accepted-per-step {a.accepted_per_step}"
                            if a.accepted_per_step is not None
                            else ""
                        ),
                        "settings": s,
                        "startup_s": startup,
                        "rows": rows,
                        "environment": environment(),
                    },
                    indent=1,
                )
            )
    sched.spec = spec_cfg
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
