"""A few calls of the attention kernel on one harness shape, nothing else: the program to run
under Nsight Compute (the device's `ncu`), which then reads one launch's hardware counters.

  ncu --clock-control none -k regex:ragged_paged_attention --launch-skip 2 --launch-count 1 \\
      --section SpeedOfLight --section WarpStateStats --section Occupancy \\
      python3 -m benchmarks.kernels.one_call decode_b256_ctx1024 --kv-dtype fp8 [--tuning JSON]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from benchmarks.kernels.harness import SHAPES, build, ours_fn


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.one_call")
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--tuning", default="{}", help="Tuning overrides as JSON")
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args(argv)
    seqs, T, S = SHAPES[args.shape]
    kv = jnp.float8_e4m3fn if args.kv_dtype == "fp8" else jnp.bfloat16
    q, kc, vc, md = build(seqs, T, S, 0, kv_dtype=kv)
    f = ours_fn(**json.loads(args.tuning))
    for _ in range(args.calls):
        out = jax.block_until_ready(f(q, kc, vc, md))
    print(args.shape, args.kv_dtype, args.tuning, out.shape, flush=True)


if __name__ == "__main__":
    main()
