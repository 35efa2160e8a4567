"""N-gram speculative decoding on the CPU (embedded SmolLM2-135M-Instruct): output tokens/s and
acceptance, with and without speculation, on a copy-heavy workload (repeat or edit a given text)
and a free-form one, one request at a time (latency) and all at once (a small batch). Greedy,
so the two engines' texts must be identical. The machine may be shared: each measurement is
repeated (--repeats, the engines alternating, so each pair runs side by side in time): the
speed-up reported is the median of the pairs' ratios, next to the fastest run of each and the
ratio of engine steps (deterministic: how many fewer forwards speculation needed).

    python -m benchmarks.spec_decode --result-file benchmarks/results/cpu_X_spec_decode/r.json

--draft-model SOURCE adds a draft-model engine (speculative_config {"model": SOURCE}; any
source --model takes: "default" is the embedded SmolLM2 drafting for itself, a sanity check:
every draft is accepted, and each verify step costs k draft forwards of the same size, so it
cannot be faster); --no-ngram leaves the n-gram engine out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.record import environment, finite

PASSAGE = (
    "The library opens at nine in the morning and closes at six in the evening. Members may "
    "borrow up to five books at a time for three weeks. Late returns cost ten cents a day. "
    "The reading room on the second floor is reserved for quiet study."
)
CODE = (
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
    "    total = 0\n    for v in values:\n        total += (v - m) ** 2\n"
    "    return total / len(values)\n"
)
COPY = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite this code with the function `mean` renamed to `average`, and nothing else "
    f"changed. Output the whole code.\n\n{CODE}",
    f"Copy this paragraph, replacing 'library' with 'museum':\n\n{PASSAGE}",
    f"Add a docstring to each function and output the full code:\n\n{CODE}",
]
FREE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give three tips for learning a new language.",
    "Describe your ideal weekend in a few sentences.",
]


def run(llm, prompts, params, batch: bool) -> dict:
    stats0 = llm.engine.stats()
    drafter = getattr(llm.engine, "drafter", None)
    fwd0 = drafter.draft_steps if drafter is not None else 0
    t0 = time.perf_counter()
    if batch:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, False)
    else:
        outs = [llm.chat([{"role": "user", "content": p}], params, False)[0] for p in prompts]
    dt = time.perf_counter() - t0
    st = llm.engine.stats()
    d = {k: st[k] - stats0[k] for k in st if k.startswith("spec_decode") and "per_pos" not in k}
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "seconds": dt,
        "output_tokens": n_out,
        "output_tokens_per_s": n_out / dt,
        "steps": st["steps"] - stats0["steps"],
        # the draft model's forwards (k per verify step, more for a first speculation's prefill)
        "draft_forwards": (drafter.draft_steps if drafter is not None else 0) - fwd0,
        "draft_tokens": d.get("spec_decode_num_draft_tokens", 0),
        "accepted_tokens": d.get("spec_decode_num_accepted_tokens", 0),
        "acceptance_rate": d.get("spec_decode_num_accepted_tokens", 0)
        / max(d.get("spec_decode_num_draft_tokens", 0), 1),
        "mean_accepted_per_draft": d.get("spec_decode_num_accepted_tokens", 0)
        / max(d.get("spec_decode_num_drafts", 0), 1),
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--result-file", default=None)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt-lookup-min", type=int, default=1)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--draft-model", default=None, help="also run a draft-model engine")
    ap.add_argument("--no-ngram", action="store_true", help="leave the n-gram engine out")
    a = ap.parse_args(argv)

    from paxengine import LLM, SamplingParams

    base = dict(
        max_model_len=1024,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        show_progress=False,
    )
    spec_cfg = {
        "method": "ngram",
        "num_speculative_tokens": a.k,
        "prompt_lookup_min": a.prompt_lookup_min,
        "prompt_lookup_max": a.prompt_lookup_max,
    }
    configs = {} if a.no_ngram else {"ngram": spec_cfg}
    if a.draft_model:
        configs["draft"] = {"model": a.draft_model, "num_speculative_tokens": a.k}
    engines = {"plain": LLM(**base)}
    engines.update({name: LLM(**base, speculative_config=c) for name, c in configs.items()})
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    for llm in engines.values():  # warm the host paths (tokenizer, detokenizer)
        llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)
    results = {}
    for wl, prompts in (("copy", COPY), ("free", FREE)):
        for mode in ("one_at_a_time", "batch"):
            runs = {name: [] for name in engines}
            for i in range(a.repeats):  # alternate which engine goes first
                order = list(engines) if i % 2 == 0 else list(engines)[::-1]
                for name in order:
                    runs[name].append(run(engines[name], prompts, params, mode == "batch"))
            row = {
                name: {
                    **max(rs, key=lambda r: r["output_tokens_per_s"]),
                    "all_tokens_per_s": [r["output_tokens_per_s"] for r in rs],
                }
                for name, rs in runs.items()
            }
            for name in configs:
                same = row["plain"]["token_ids"] == row[name]["token_ids"]
                pairs = [
                    n["output_tokens_per_s"] / p["output_tokens_per_s"]
                    for p, n in zip(runs["plain"], runs[name])
                ]
                r = row[name]
                r.update(
                    identical_greedy_outputs=same,
                    paired_speedups=pairs,
                    speedup=float(np.median(pairs)),
                    steps_ratio=row["plain"]["steps"] / max(r["steps"], 1),
                )
                print(
                    f"{wl:5s} {mode:14s} plain {row['plain']['output_tokens_per_s']:7.1f} tok/s  "
                    f"{name} {r['output_tokens_per_s']:7.1f} tok/s  "
                    f"x{r['speedup']:.2f} (paired median; steps x{r['steps_ratio']:.2f})  "
                    f"acceptance {r['acceptance_rate']:.2f} "
                    f"({r['mean_accepted_per_draft']:.2f}/draft)  identical={same}",
                    flush=True,
                )
            for r in row.values():
                del r["token_ids"]
            results[f"{wl}/{mode}"] = row
    res = {
        "benchmark": "spec_decode",
        "model": "embedded SmolLM2-135M-Instruct (float32)",
        "engine": base,
        "speculative_configs": configs,
        "max_tokens": a.max_tokens,
        "repeats": a.repeats,
        "results": results,
        "env": environment(),
    }
    if a.result_file:
        path = Path(a.result_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(finite(res), indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
