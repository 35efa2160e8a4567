"""The V pages' dtype under a bf16 model: bf16 (as stored before) against fp16 (the engine's
layout now, kernels_pallas.value_cache_dtype), our kernels at their default tuning, side by side
in one run on the GPU, with the bf16 matmul rate measured in the same run.

    python -m benchmarks.kernels.v_page_dtype [--only a,b] [--rounds 3] [--out DIR]

The Mosaic prefill kernel converts bf16 V blocks to fp16 in shared memory (its PV product takes
P in fp16); fp16 pages skip that. Each variant is a jitted loop of 20 chained calls (median of 5
runs per round, rounds interleaved), checked against the oracle first. Writes
$OUT/v_page_dtype.json. Decode shapes also run the opt-in Mosaic decode kernel on fp16 pages.
"""

from __future__ import annotations

import argparse
import os

import jax.numpy as jnp

import benchmarks.kernels.harness as K
from benchmarks.measure import matmul_rate

SHAPES = (
    "prefill_8192",
    "prefill_4x2048",
    "prefill_2048",
    "prefill_512",
    "chunk_512_ctx4096",
    "mixed_60dec2048_1988pf",
    "engine_8x1000_s256",
    "decode_b64_ctx2048",
    "decode_b8_ctx8192",
    "decode_b256_ctx512",
    "decode_b1_ctx8192",
)


def variants(name):
    out = {"v_bf16": (jnp.bfloat16, {}), "v_fp16": (jnp.float16, {})}
    if name.startswith("decode"):
        out["v_fp16_mosaic_decode"] = (jnp.float16, dict(mosaic_decode=True, mosaic_persistent=132))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    # bf16 8192^3 matmul rate, measured as the roofline stage does, in this call: what the
    # "% matmul" column divides by
    rate = matmul_rate(8192, dtype=jnp.bfloat16) if K.ON_GPU else float("nan")
    print(f"bf16 matmul rate {rate / 1e12:.0f} TFLOP/s", flush=True)
    rows, fns = [], {}
    for name in args.only.split(","):
        seqs, T, S = K.SHAPES[name]
        n = sum(ql for ql, _ in seqs)
        refs = {}
        for var, (v_dtype, tun) in variants(name).items():
            q, kc, vc, md = K.build(seqs, T, S, 11, v_dtype=v_dtype)
            if v_dtype not in refs:  # (V rounds differently in bf16 and fp16: an oracle each)
                refs[v_dtype] = K.oracle(q, kc, vc, md)
            ref = refs[v_dtype]
            row = dict(
                shape=name,
                variant=var,
                v_dtype=jnp.dtype(v_dtype).name,
                overrides=tun,
                T=T,
                S=S,
                kv_bytes=K.kv_bytes(seqs),
                flops=K.attn_flops(seqs),
            )
            f = K.timed_variant(row, tun, (q, kc, vc, md), ref, n)
            if f is not None:
                fns[len(rows)] = (f, (q, kc, vc, md))
            rows.append(row)
            print(row, flush=True)
    K.more_rounds(rows, fns, args.rounds - 1)
    print(
        "\n| shape | V pages | variant | us | TFLOP/s | % matmul | KV TB/s | rel err |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        if "us" in r:
            r["TFLOPs"] = r["flops"] / r["us"] / 1e6
            r["pct_matmul"] = 100 * r["TFLOPs"] * 1e12 / rate
            r["TBps"] = r["kv_bytes"] / r["us"] / 1e6
            print(
                f"| {r['shape']} | {r['v_dtype']} | {r['variant']} | {r['us']:.1f} | "
                f"{r['TFLOPs']:.0f} | {r['pct_matmul']:.1f} | {r['TBps']:.2f} | "
                f"{r['rel_err']:.1e} |"
            )
    K.write_rows(args.out, "v_page_dtype", rows, matmul_flops_per_s=rate)


if __name__ == "__main__":
    main()
