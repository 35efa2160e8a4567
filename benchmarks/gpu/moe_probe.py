"""How fast a step's routed experts run, by how the grouped GEMMs lower: `models/moe.
grouped_experts` (gate_up, SwiGLU, down, the weighted scatter back) at Qwen3-30B-A3B's expert
shapes for T tokens of random routing, under jit, several layers' distinct weights a call (no L2
reuse). Variants: XLA's ragged_dot as compiled by default; the same with XLA's cuDNN ragged-dot
fusion asked for (`xla_gpu_experimental_use_ragged_dot_fusion`); the Pallas grouped kernel
(`PAXENGINE_KERNEL_MOE=pallas`, kernels_pallas/moe_gemm.py). Each row: device-bound us a layer,
the distinct experts hit, the TB/s of their weight bytes, the kinds of kernel in the optimized
HLO (a ragged dot XLA expanded into dense dots over all E experts reads every expert's weights
each step), or the error a variant met (an unknown option, out of memory).

    python3 -m benchmarks.gpu.moe_probe [--tokens 1 8 64 512] [--json OUT]
    python3 -m benchmarks.gpu.moe_probe --tiny   (CPU smoke: tiny shapes, the kernel interpreted)

Issue #55: `pax-offline-qwen3moe` has not run on a GPU yet; this says which lowering to take first.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from benchmarks.gpu.gemm_probe import kinds

SHAPES = {  # experts, top-k, hidden, expert intermediate
    "qwen3_30b_a3b": dict(E=128, k=8, H=2048, I=768),
    "tiny": dict(E=8, k=2, H=64, I=32),
}
VARIANTS = {  # name: (PAXENGINE_KERNEL_MOE, XLA options)
    "xla": ("xla", {}),
    "xla_cudnn_fusion": ("xla", {"xla_gpu_experimental_use_ragged_dot_fusion": True}),
    "pallas": ("pallas", {}),
}


def probe(shape: dict, T: int, variant: str, interpret: bool = False, layers: int = 4) -> dict:
    import jax
    import jax.numpy as jnp

    from paxengine.models import moe

    E, k, H, I = shape["E"], shape["k"], shape["H"], shape["I"]
    mode, opts = VARIANTS[variant]
    os.environ["PAXENGINE_KERNEL_MOE"] = "interpret" if interpret and mode == "pallas" else mode
    keys = jax.random.split(jax.random.key(0), 2 * layers + 2)
    dt = jnp.float32 if interpret else jnp.bfloat16
    ws = [
        {
            "e_gate_up": jax.random.normal(keys[2 * i], (E, H, 2 * I), dt) * 0.02,
            "e_down": jax.random.normal(keys[2 * i + 1], (E, I, H), dt) * 0.02,
        }
        for i in range(layers)
    ]
    x = jax.random.normal(keys[-2], (T, H), dt)
    router = jax.random.normal(keys[-1], (H, E), dt)
    weights, ids = moe.route(x, router, k, True)

    def f(x, weights, ids, ws):
        return [moe.grouped_experts(x, weights, ids, w) for w in ws]

    exe = jax.jit(f).lower(x, weights, ids, ws).compile(opts or None)
    for _ in range(2):
        jax.block_until_ready(exe(x, weights, ids, ws))
    reps = 3 if interpret else 20
    t = time.perf_counter()
    for _ in range(reps):
        out = exe(x, weights, ids, ws)
    jax.block_until_ready(out)
    us = (time.perf_counter() - t) / reps / layers * 1e6
    hit = len(set(ids.reshape(-1).tolist()))
    nbytes = hit * 3 * H * I * jnp.dtype(dt).itemsize
    row = {"us": round(us, 1), "experts_hit": hit, "tb_s": round(nbytes / us / 1e6, 3)}
    if variant != "xla":  # the same products as the default lowering's
        os.environ["PAXENGINE_KERNEL_MOE"] = "xla"
        want = jax.jit(moe.grouped_experts)(x, weights, ids, ws[0])
        row["max_abs_diff_vs_xla"] = float(jnp.max(jnp.abs(out[0] - want)))
    return {**row, **kinds(exe.as_text())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 2048])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), help=", ".join(VARIANTS))
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes, interpreted")
    p.add_argument("--json")
    a = p.parse_args(argv)
    name = "tiny" if a.tiny else "qwen3_30b_a3b"
    rows = []
    for T in [8] if a.tiny else a.tokens:
        for v in a.variants:
            r = {"shape": name, "T": T, "variant": v}
            try:
                r.update(probe(SHAPES[name], T, v, interpret=a.tiny))
            except Exception as e:  # an unknown option, out of memory: recorded, not fatal
                r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            rows.append(r)
            print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
