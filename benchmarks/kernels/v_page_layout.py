"""The V pages' layout: [bs, D] (as stored today) against [D, bs] (`v_dn`: positions contiguous,
the PV product's contraction axis), the Triton kernel on fp8 and on the bf16 engine's pages,
side by side in one run on the GPU.

    python -m benchmarks.kernels.v_page_layout [--only a,b] [--kv-dtype fp8] [--rounds 3] [--out DIR]

Why: 16-bit V reaches the MMA through `ldmatrix.trans`; 8-bit V has no such instruction on
Hopper, and the fp8 decode kernel reads its pages at ~2.5 TB/s where bf16 pages go at ~3.7.
Each variant is a jitted loop of 20 chained calls (median of 5 runs per round, rounds
interleaved), checked against the oracle (fed the [bs, D] pages) first. Writes
$OUT/v_page_layout_<kv dtype>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

import benchmarks.kernels.harness as K

SHAPES = ("decode_b256_ctx1024", "decode_b64_ctx2048", "decode_b8_ctx8192", "decode_b1_ctx8192")
# (name, tuning overrides, V in [D, bs]); {} = the default tuning
VARIANTS = [
    ("nd", {}, False),
    ("dn", {}, True),
    ("dn_3stages", dict(num_stages=3), True),
    ("dn_bk64_4stages", dict(block_k=64, num_stages=4), True),
    ("dn_8warps", dict(num_warps=8), True),
    ("dn_bk256_8warps", dict(block_k=256, num_warps=8), True),
    ("dn_one_loop", dict(split_mask=False), True),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(SHAPES))
    ap.add_argument("--kv-dtype", default="fp8", choices=["bf16", "fp8"])
    ap.add_argument("--variants", default="", help="comma list of VARIANTS names (default all)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    kv_dtype = jnp.float8_e4m3fn if args.kv_dtype == "fp8" else K.DT
    itemsize = jnp.dtype(kv_dtype).itemsize
    keep = set(args.variants.split(",")) if args.variants else None
    rows, fns = [], {}
    for name in args.only.split(","):
        seqs, T, S = {**K.SHAPES, **K.QUICK_SHAPES}[name]
        n = sum(ql for ql, _ in seqs)
        q, kc, vc, md = K.build(seqs, T, S, 11, kv_dtype=kv_dtype)
        ref = K.oracle(q, kc, vc, md)
        vc_dn = jnp.swapaxes(vc, -1, -2)
        for var, tun, dn in VARIANTS:
            if keep is not None and var not in keep:
                continue
            row = dict(
                shape=name,
                variant=var,
                kv_dtype=args.kv_dtype,
                overrides=tun,
                v_dn=dn,
                kv_bytes=K.kv_bytes(seqs, itemsize),
            )
            data = (q, kc, vc_dn if dn else vc, md)
            f = K.timed_variant(row, dict(tun, v_dn=dn), data, ref, n)
            if f is not None:
                fns[len(rows)] = (f, data)
            rows.append(row)
            print(row, flush=True)
    K.more_rounds(rows, fns, args.rounds - 1)
    print("\n| shape | variant | us | KV TB/s | rel err |\n|---|---|---|---|---|")
    for r in rows:
        if "us" in r:
            r["TBps"] = r["kv_bytes"] / r["us"] / 1e6
            print(
                f"| {r['shape']} | {r['variant']} | {r['us']:.1f} | {r['TBps']:.2f} | "
                f"{r['rel_err']:.1e} |"
            )
        else:
            print(f"| {r['shape']} | {r['variant']} | {r.get('error', '?')[:80]} | | |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"v_page_layout_{args.kv_dtype}.json"), "w") as fh:
        json.dump(
            dict(
                device=jax.devices()[0].device_kind,
                jax=jax.__version__,
                command=" ".join(["python -m benchmarks.kernels.v_page_layout"] + sys.argv[1:]),
                rows=rows,
            ),
            fh,
            indent=1,
            default=str,
        )


if __name__ == "__main__":
    main()
