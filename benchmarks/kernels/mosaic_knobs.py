"""The Mosaic GPU prefill kernel's own knobs (attention_mgpu.mosaic_prefill_attention: KV block,
pipeline depth, schedule barrier, register split) against the Triton kernel, on the GPU.

    python -m benchmarks.kernels.mosaic_knobs '[{"block_kv": 128, "stages": 2}, {"schedule": 8}]'

Each variant runs as a jitted loop of 20 calls (median of 3 x 5 runs), checked against the
oracle first; writes $OUT/mosaic_knobs.json. The Tuning-level choices (Triton vs Mosaic, which
buckets) are `benchmarks.kernels.tune`'s job; this is for what sits below them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels import harness
from benchmarks.kernels.harness import BS, D, attn_flops, build, oracle
from benchmarks.measure import chained_calls, time_loop
from kernels_pallas import attention_mgpu, ragged_paged_attention
from kernels_pallas.testing import rel_err

SHAPES = {  # name: (seqs [(q_len, kv_len)], T, S): harness's prefill shapes, 16 short prompts
    **{
        n: harness.SHAPES[n]
        for n in (
            "prefill_512",
            "prefill_2048",
            "chunk_512_ctx4096",
            "prefill_8192",
            "prefill_4x2048",
        )
    },
    "prefill_16x512": ([(512, 512)] * 16, 8192, 16),
    "engine_8x1000_s256": harness.SHAPES["engine_8x1000_s256"],  # 8 prompts, engine bucket
}


def variant_fn(var, T, S, NB, P):
    """One attention call: the Triton kernel ({"triton": true}) or the Mosaic kernel with `var`."""

    def one(q, kc, vc, md):
        if var.get("triton"):
            return ragged_paged_attention(
                q, kc, vc, jnp.int32(0), md, sm_scale=D**-0.5, mosaic=False
            )
        nt = attention_mgpu.mosaic_num_tiles(T, S)
        meta = attention_mgpu.mosaic_tile_metadata(md, T, nt)
        return attention_mgpu.mosaic_prefill_attention(
            q,
            kc.reshape(-1, BS, D),
            vc.reshape(-1, BS, D),
            meta,
            md.block_tables.reshape(-1),
            jnp.zeros((1,), jnp.int32),
            num_tiles=nt,
            NB=NB,
            P=P,
            Hkv=kc.shape[1],
            sm_scale=D**-0.5,
            **var,
        )

    return chained_calls(one, 20)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", help="JSON list of mosaic_prefill_attention keyword dicts")
    ap.add_argument("--only", default="", help="comma list of shape names")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    variants = [{"triton": True}] + json.loads(args.variants)
    res = dict(
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
        command="python -m benchmarks.kernels.mosaic_knobs " + " ".join(argv or sys.argv[1:]),
        rows=[],
    )
    for name, (seqs, T, S) in SHAPES.items():
        if args.only and name not in args.only.split(","):
            continue
        q, kc, vc, md = build(seqs, T, S, 7)
        n = sum(ql for ql, _ in seqs)
        ref = oracle(q, kc, vc, md)
        NB, P = kc.shape[2], md.block_tables.shape[1]
        for var in variants:
            row = dict(shape=name, variant=var)
            try:
                f = variant_fn(var, T, S, NB, P)
                row["rel_err"] = rel_err(jax.block_until_ready(f(q, kc, vc, md)), ref, n)
                t = float(np.median([time_loop(f, (q, kc, vc, md), 5, 20) for _ in range(3)]))
                row.update(us=t * 1e6, TFLOPs=attn_flops(seqs) / t / 1e12)
                print(
                    f"{name:18s} {str(var):64s} {t * 1e6:8.1f} us {row['TFLOPs']:6.1f} TFLOP/s "
                    f"err={row['rel_err']:.2e}",
                    flush=True,
                )
            except Exception as e:  # noqa: BLE001 -- a variant that does not compile is recorded
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                print(f"{name:18s} {str(var):64s} {row['error'][:160]}", flush=True)
            res["rows"].append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mosaic_knobs.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
