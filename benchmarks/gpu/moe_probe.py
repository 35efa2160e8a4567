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
    python3 -m benchmarks.gpu.moe_probe --sweep [--tokens 1 8 64]   (the kernel's tunings)

--sweep times the Pallas kernel alone (`moe_gemm.grouped_matmul`) on each projection (gate_up in
the engine's glu mode, down) at each step size over SWEEP's grid of (block_m, block_n, block_k,
num_warps, num_stages) (--small: SMALL_SWEEP's 12), and prints the fastest beside the default
(16, 64, 64, 4, 3): what `models/moe.DECODE_TUNING` should be.

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


# 48 tunings a projection and step size (~1 s each to compile on the GPU); 16-row tiles (the
# 64-row ones are models/moe.tile_rows' A/B, the probe's main mode). block_n 256: vLLM's tuned
# fused-MoE config for these experts on an H100 (E=128, N=768) takes it at 64 and 128 tokens,
# with block_k 128 and 8 warps; at 8 tokens 64 / 64 / 4 warps / 5 stages.
SWEEP = dict(block_m=(16,), block_n=(32, 64, 128, 256), block_k=(64, 128, 256), num_warps=(4, 8),
             num_stages=(3, 4))  # fmt: skip
TINY_SWEEP = dict(block_m=(16,), block_n=(16, 32), block_k=(32,), num_warps=(4,), num_stages=(3,))
# --small: 12 tunings (~1 min for two step sizes): a lease's quick pick, around vLLM's choices
SMALL_SWEEP = dict(block_m=(16,), block_n=(64, 128, 256), block_k=(64, 128), num_warps=(4, 8),
                   num_stages=(3,))  # fmt: skip


def sweep(shape: dict, T: int, grid: dict, interpret: bool = False, layers: int = 4) -> list:
    """-> a row per (projection, tuning): us per call (several layers' distinct weights a
    timed call, no L2 reuse), or the error that tuning met."""
    import itertools

    import jax
    import jax.numpy as jnp

    from kernels_pallas.moe_gemm import grouped_matmul, max_tiles, tile_layout

    E, k, H, I = shape["E"], shape["k"], shape["H"], shape["I"]
    dt = jnp.float32 if interpret else jnp.bfloat16
    key = jax.random.key(1)
    ids = jnp.sort(jax.random.randint(key, (T * k,), 0, E))  # (random routing; pairs sorted)
    rows = []
    # gate_up in the engine's glu mode (moe.kernel_glu: its SwiGLU in the kernel)
    for proj, (K, N, glu) in {"gate_up": (H, 2 * I, True), "down": (I, H, False)}.items():
        ws = [jax.random.normal(jax.random.fold_in(key, i), (E, K, N), dt) for i in range(layers)]
        for combo in itertools.product(*grid.values()):
            tune = dict(zip(grid, combo))
            bm = tune["block_m"]
            row = {"T": T, "proj": proj, **tune}
            try:
                te, _, _ = tile_layout(ids, E, bm)
                x = jnp.ones((max_tiles(T * k, E, bm) * bm, K), dt)

                def f(x, te, ws, tune=tune, glu=glu):
                    return [
                        grouped_matmul(x, w, te, interpret=interpret, glu=glu, **tune) for w in ws
                    ]

                exe = jax.jit(f).lower(x, te, ws).compile()
                jax.block_until_ready(exe(x, te, ws))
                reps = 2 if interpret else 20
                t = time.perf_counter()
                for _ in range(reps):
                    out = exe(x, te, ws)
                jax.block_until_ready(out)
                row["us"] = round((time.perf_counter() - t) / reps / layers * 1e6, 1)
            except Exception as e:  # a tiling Triton cannot take, out of shared memory
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 2048])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), help=", ".join(VARIANTS))
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes, interpreted")
    p.add_argument("--sweep", action="store_true", help="the kernel's tunings (module doc)")
    p.add_argument("--small", action="store_true", help="--sweep over SMALL_SWEEP's 12 tunings")
    p.add_argument("--json")
    a = p.parse_args(argv)
    name = "tiny" if a.tiny else "qwen3_30b_a3b"
    rows = []
    for T in [8] if a.tiny else a.tokens:
        if a.sweep:
            grid = TINY_SWEEP if a.tiny else SMALL_SWEEP if a.small else SWEEP
            got = sweep(SHAPES[name], T, grid, interpret=a.tiny)
            rows += got
            for proj in ("gate_up", "down"):
                timed = [r for r in got if r["proj"] == proj and "us" in r]
                best = min(timed, key=lambda r: r["us"], default=None)
                default = next((r for r in timed if _is_default(r)), None)
                print(json.dumps({"T": T, "proj": proj, "best": best, "default": default}))
            _dump(a.json, rows)  # (each step size's rows kept if a later one runs out of time)
            continue
        for v in a.variants:
            r = {"shape": name, "T": T, "variant": v}
            try:
                r.update(probe(SHAPES[name], T, v, interpret=a.tiny))
            except Exception as e:  # an unknown option, out of memory: recorded, not fatal
                r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            rows.append(r)
            print(json.dumps(r), flush=True)
    _dump(a.json, rows)
    return 0


def _dump(path, rows: list) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def _is_default(r: dict) -> bool:
    return (r["block_m"], r["block_n"], r["block_k"], r["num_warps"], r["num_stages"]) == (
        16,
        64,
        64,
        4,
        3,
    )


if __name__ == "__main__":
    raise SystemExit(main())
