"""Decode attention against the KV page size: the engine's default tuning at each page size,
fp8 pages and the bf16 engine's pages side by side. fp8 pages of 64 tokens store V [D, bs] and
are read a page per KV block (kernels_pallas.layout.v_transposed, tuning `page_block`); 16-token
pages gather rows through the block table.

    python -m benchmarks.kernels.page_blocks [--page-sizes 16,64] [--kv-dtype fp8,bf16]
        [--only a,b] [--rounds 3] [--out DIR]

Why: fp8 pages read at ~2.5 TB/s where bf16 pages go at ~3.7 (gpu_2026-12-01_fp8_decode/), and
Nsight Compute put the fp8 kernel's issue gaps on its gathered loads. The experiment that chose
the layout (gathered rows / a page per block / V [bs, D] or [D, bs], at 16, 64 and 128 tokens)
is gpu_2026-12-03f_page_blocks/. Each variant is a jitted loop of 20 chained calls (median of 5
runs a round, rounds interleaved), checked against the oracle first. Writes
$OUT/page_blocks.json.
"""

from __future__ import annotations

import argparse
import os

import jax.numpy as jnp

import benchmarks.kernels.harness as K
from kernels_pallas.layout import v_transposed
from kernels_pallas.tuning import default_tuning

SHAPES = {
    "decode_b256_ctx1024": ([(1, 1024)] * 256, 256, 256),
    # the 300 x (1000, 1000) row's decode step halfway through
    "decode_b300_ctx1536": ([(1, 1536)] * 300, 320, 320),
    "decode_b64_ctx2048": ([(1, 2048)] * 64, 64, 64),
    "decode_b8_ctx8192": ([(1, 8192)] * 8, 8, 8),
    "decode_b1_ctx8192": ([(1, 8192)], 1, 1),
    "mixed_60dec2048_448pf": ([(1, 2048)] * 60 + [(448, 1024)], 512, 64),
    "prefill_2048": ([(2048, 2048)], 2048, 1),
}


def variants(kv_dtype, bs, T, S):
    """(name, tuning overrides) at pages of bs tokens: the default, and for [D, bs] V pages
    the decode pipeline depths it was chosen from, twice its split-K (a 64-position block
    halves a program's work between loads: long contexts at small batch may want more) and
    2 / 8 warps a program (fp8 pages cost conversions a byte, not only bandwidth)."""
    out = [("default", {})]
    if v_transposed(kv_dtype, bs):
        itemsize = jnp.dtype(kv_dtype).itemsize
        d = default_tuning(T, S, K.HQ, K.HKV, K.D, bs, kv_itemsize=itemsize, v_t=True)
        out += [
            ("2stages", dict(num_stages=2)),
            ("3stages", dict(num_stages=3)),
            ("2x_splits", dict(k_splits=2 * d.k_splits)),
            ("2warps", dict(num_warps=2)),
            ("8warps", dict(num_warps=8)),
            ("2warps_2stages", dict(num_warps=2, num_stages=2)),
            ("2warps_3stages", dict(num_warps=2, num_stages=3)),
        ]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--page-sizes", default="16,64")
    ap.add_argument("--kv-dtype", default="fp8,bf16")
    ap.add_argument("--only", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="", help="comma list of variant names (default all)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    rows, loops = [], {}
    for kv_name in args.kv_dtype.split(","):
        kv_dtype = jnp.float8_e4m3fn if kv_name == "fp8" else K.DT
        itemsize = jnp.dtype(kv_dtype).itemsize
        for bs in (int(x) for x in args.page_sizes.split(",")):
            K.BS = bs  # build() reads the page size at call time
            for name in args.only.split(","):
                seqs, T, S = {**SHAPES, **K.QUICK_SHAPES}[name]
                n = sum(ql for ql, _ in seqs)
                q, kc, vc, md = K.build(seqs, T, S, 11, kv_dtype=kv_dtype)
                ref = K.oracle(q, kc, vc, md)
                for var, tun in variants(kv_dtype, bs, T, S):
                    if var != "default" and not name.startswith("decode"):
                        continue
                    if args.variants and var not in args.variants.split(","):
                        continue
                    row = dict(
                        shape=name,
                        kv_dtype=kv_name,
                        page_size=bs,
                        variant=var,
                        overrides=tun,
                        v_pages=list(vc.shape[3:]),
                        kv_bytes=K.kv_bytes(seqs, itemsize),
                    )
                    f = K.timed_variant(row, tun, (q, kc, vc, md), ref, n)
                    if f is not None:
                        loops[len(rows)] = (f, (q, kc, vc, md))
                    rows.append(row)
                    print(row, flush=True)
    K.more_rounds(rows, loops, args.rounds - 1)
    print(
        "\n| kv | page | shape | variant | us | KV TB/s | rel err |\n|---|---|---|---|---|---|---|"
    )
    for r in rows:
        head = f"| {r['kv_dtype']} | {r['page_size']} | {r['shape']} | {r['variant']} |"
        if "us" in r:
            r["TBps"] = r["kv_bytes"] / r["us"] / 1e6
            print(f"{head} {r['us']:.1f} | {r['TBps']:.2f} | {r['rel_err']:.1e} |")
        else:
            print(f"{head} {r.get('error', '?')[:100]} | | |")
    K.write_rows(args.out, "page_blocks", rows)


if __name__ == "__main__":
    main()
