"""The batch-1 decode step's fused kernels, compiled on the GPU, against their oracles: the
RoPE + KV-write kernel (`kernels_pallas.rope_write`) and the FP8 GEMV with the gated-MLP input
(`fp8_matmul(..., glu=True)`), at Llama-3.1-8B shapes. Interpret mode (the CPU tests) does not
compile them; this does, so a kernel that lowers but computes wrong on the GPU shows here.

  python -m benchmarks.kernels.fused_decode_check [--out DIR]     (GPU; on a CPU: interpret mode)

Prints one line per case (max |kernel - oracle| relative to the oracle's largest value) and
writes DIR/fused_decode_check.json. Exit 1 if any case is off (relative error > 1e-2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import fp8_matmul, ref_fp8_matmul, rope_write_kv
from kernels_pallas.layout import value_cache_dtype
from kernels_pallas.reference import ref_rope_write_kv

HQ, HKV, D, L, NB, BS = 32, 8, 128, 2, 64, 16
TOL = 1e-2


def rel(a, b) -> float:
    a, b = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (a, b))
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def rope_case(T: int, kv_dtype, interpret: bool) -> dict:
    key = jax.random.split(jax.random.PRNGKey(T), 3)
    qkv = jax.random.normal(key[0], (T, (HQ + 2 * HKV) * D), jnp.float32).astype(jnp.bfloat16)
    pos = jax.random.randint(key[1], (T,), 0, 4000)
    inv = 1.0 / (500000.0 ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
    ang = pos.astype(jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    shape = (L, HKV, NB, BS, D)
    kc = jnp.zeros(shape, kv_dtype)
    vc = jnp.zeros(shape, value_cache_dtype(kv_dtype))
    slots = jax.random.permutation(key[2], NB * BS)[:T].astype(jnp.int32)
    slots = slots.at[T - 1].set(-1) if T > 1 else slots  # a padding row writes nothing
    scales = (
        dict(k_scale=jnp.float32(0.5), v_scale=jnp.float32(0.02))
        if kv_dtype != jnp.bfloat16
        else {}
    )
    args = (qkv, cos, sin, kc, vc, jnp.int32(1), slots)
    heads = dict(num_heads=HQ, num_kv_heads=HKV)
    got = jax.jit(lambda *a: rope_write_kv(*a, **heads, **scales, interpret=interpret))(*args)
    want = ref_rope_write_kv(*args, **heads, **scales)
    errs = {name: rel(g, w) for name, g, w in zip(("q", "k_cache", "v_cache"), got, want)}
    return {"case": f"rope_write T={T} {jnp.dtype(kv_dtype).name}", **errs}


def glu_case(M: int, interpret: bool) -> dict:
    K, N = 14336, 4096
    key = jax.random.split(jax.random.PRNGKey(M), 3)
    x = (3 * jax.random.normal(key[0], (M, 2 * K), jnp.float32)).astype(jnp.bfloat16)
    v = (jax.random.normal(key[1], (N, K), jnp.float32) * 64).astype(jnp.float8_e4m3fn)
    s = jax.random.uniform(key[2], (N,), jnp.float32, 1e-3, 1e-2)
    got = jax.jit(lambda x, v, s: fp8_matmul(x, v, s, glu=True, interpret=interpret))(x, v, s)
    return {"case": f"fp8 glu GEMV M={M} {K}x{N}", "y": rel(got, ref_fp8_matmul(x, v, s, glu=True))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    rows = [
        rope_case(T, dt, interpret) for T in (1, 16) for dt in (jnp.bfloat16, jnp.float8_e4m3fn)
    ]
    rows += [glu_case(M, interpret) for M in (1, 2)]
    bad = 0
    for r in rows:
        errs = {k: v for k, v in r.items() if k != "case"}
        ok = all(e <= TOL for e in errs.values())
        bad += not ok
        print(
            f"{'ok ' if ok else 'BAD'} {r['case']:<36} "
            + "  ".join(f"{k} {v:.2e}" for k, v in errs.items())
        )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        rec = {
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            "tolerance": TOL,
            "rows": rows,
        }
        with open(os.path.join(args.out, "fused_decode_check.json"), "w") as f:
            json.dump(rec, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
