"""Qwen3.5-9B shapes (dummy bf16 weights) through `LLM` on a GPU: that the hybrid model compiles
and runs there, and its first batch-1 / batch-8 ITL and offline rate. A first look, not the
`pax-offline-qwen35` stage (issue #54): buckets are narrowed so the start fits one device call.

    python3 -m benchmarks.gpu.qwen35_smoke --config ../shared/gpu/models/qwen35_9b/config.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--json")
    a = p.parse_args(argv)
    from paxengine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=f"dummy:{a.config}",
        max_model_len=4096,
        max_num_seqs=64,
        max_num_batched_tokens=512,
        token_buckets=[1, 64, 512],
        seq_buckets=[8, 64],
        show_progress=False,
    )
    res = {"startup_s": time.perf_counter() - t0}
    print(json.dumps(res), flush=True)
    rng = np.random.default_rng(0)

    def gen(b, n_in, n_out):
        prompts = [rng.integers(10, 240000, n_in).tolist() for _ in range(b)]
        sp = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == b * n_out
        return time.perf_counter() - t

    for b in (1, 8):
        gen(b, 128, 16)  # warm
        vals = [(gen(b, 128, 80) - gen(b, 128, 16)) / 64 for _ in range(2)]
        res[f"itl_batch{b}_ms"] = 1e3 * min(vals)
        print(json.dumps(res), flush=True)
    dt = gen(64, 512, 64)
    res["64x(512,64)_out_tok_s"] = 64 * 64 / dt
    print(json.dumps(res), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
