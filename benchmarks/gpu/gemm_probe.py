"""Which GEMM XLA picks for the decode step's bf16 projections, and how fast each choice is:
x [M, K] @ w [K, N] under jit, several distinct weights a call (no L2 reuse), compiled with
XLA's defaults and with its Triton GEMMs off; prints device-bound us a GEMM, TB/s of weight
bytes and the kind of kernel in the optimized HLO (cuBLAS custom call or Triton fusion).

    python3 -m benchmarks.gpu.gemm_probe [--json OUT] [--m 1 8] [--shapes out ...] [--skinny]

Shapes: the Qwen3.5-9B decode projections (benchmarks/gpu/models/qwen35_9b.json) and its LM
head. Issue #54: the step profile showed every projection as an XLA Triton GEMM at ~2.0 TB/s.
"""

from __future__ import annotations

import argparse
import json
import re
import time

SHAPES = {  # name: (K, N)
    "gate_up": (4096, 24576),
    "down": (12288, 4096),
    "la_qkvz": (4096, 12288),
    "out": (4096, 4096),
    "attn_qkv": (4096, 10240),
    "lm_head": (4096, 248320),
}
VARIANTS = {"default": {}, "no_triton_gemm": {"xla_gpu_enable_triton_gemm": False}}


def kinds(txt: str) -> dict:
    return {
        "cublas": len(re.findall(r'custom_call_target="__cublas', txt)),
        # cuDNN fusions: where XLA (cuDNN >= 9.22) lowers a ragged dot (the MoE experts) to
        # cuDNN's grouped GEMM; without it its RaggedDotRewriter expands the ragged dot into
        # dense dots over every expert (each step then reads all E experts' weights)
        "cudnn": len(re.findall(r'custom_call_target="__cudnn', txt)),
        "ragged_dot": len(re.findall(r"ragged-dot\(", txt)),
        # XLA's Triton GEMM fusions (their kind string changed between versions: the name)
        "triton_gemm": len(re.findall(r"calls=%?gemm_fusion", txt)),
        "triton_configs": sorted(set(re.findall(r'"triton_gemm_config":\{[^}]*\}', txt)))[:3],
    }


def probe(
    K: int, N: int, M: int, opts: dict, layout: str = "kn", f32_out=False, skinny=None
) -> dict:
    """layout "kn": w [K, N] (the engine's), x @ w; "nk": w [N, K] (HF's), x @ w.T. f32_out:
    the product in f32 (`preferred_element_type`, as llama.compute_logits asks for the LM
    head; in the step the LM head took 0.9-1.7 ms against 0.65 alone in bf16). skinny: a
    kernels_pallas.skinny_gemm.SkinnyTuning: the product through that kernel."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas.skinny_gemm import skinny_matmul

    n = max(2, min(8, int(1.6e9 // (K * N * 2))))  # ~1.6 GB of weights a call
    shape = (K, N) if layout == "kn" else (N, K)
    ws = [jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) for i in range(n)]
    x = jnp.ones((M, K), jnp.bfloat16)
    pref = jnp.float32 if f32_out else None

    def f(x, ws):
        if skinny is not None:
            return [skinny_matmul(x, w, tuning=skinny) for w in ws]
        return [jnp.dot(x, w if layout == "kn" else w.T, preferred_element_type=pref) for w in ws]

    exe = jax.jit(f).lower(x, ws).compile(opts or None)
    for _ in range(3):
        jax.block_until_ready(exe(x, ws))
    reps = 30
    t = time.perf_counter()
    for _ in range(reps):
        out = exe(x, ws)
    jax.block_until_ready(out)
    us = (time.perf_counter() - t) / reps / n * 1e6
    return {"us": round(us, 1), "tb_s": round(K * N * 2 / us / 1e6, 2), **kinds(exe.as_text())}


def skinny_tunings(M: int, K: int, N: int) -> list:
    """The default, then a sweep around it (block_n, block_k, K slices, warps, stages)."""
    from kernels_pallas.skinny_gemm import SkinnyTuning, default_tuning, fits

    out = [default_tuning(M, K, N)]
    for bn, bk, sp, nw, ns in (
        (64, 128, 2, 4, 3),
        (64, 128, 8, 4, 3),
        (64, 256, 4, 4, 3),
        (64, 64, 4, 4, 4),
        (128, 128, 2, 4, 3),
        (128, 128, 4, 8, 3),
        (128, 64, 4, 4, 4),
        (32, 128, 4, 4, 3),
        (32, 256, 2, 4, 3),
        (64, 128, 1, 4, 3),
        (32, 128, 1, 2, 4),
    ):
        t = SkinnyTuning(block_n=bn, block_k=bk, k_splits=sp, num_warps=nw, num_stages=ns)
        if fits(M, K, N, t) and t not in out:
            out.append(t)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--m", type=int, nargs="+", default=[1, 8])
    p.add_argument("--json")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="of " + ", ".join(SHAPES))
    p.add_argument("--skinny", action="store_true", help="the skinny GEMM kernel's tunings")
    a = p.parse_args(argv)
    rows = []
    for name in a.shapes:
        K, N = SHAPES[name]
        pairs = [(m, t) for m in a.m for t in skinny_tunings(m, K, N)] if a.skinny else []
        for M, tun in pairs:
            r = {"shape": name, "K": K, "N": N, "M": M, "variant": "skinny", **vars(tun)}
            try:
                r.update(probe(K, N, M, VARIANTS["no_triton_gemm"], skinny=tun))
            except Exception as e:  # a tiling over the GPU's shared memory: recorded, not fatal
                r["error"] = str(e).splitlines()[0][:200]
            rows.append(r)
            print(json.dumps(r), flush=True)
        for M in a.m:
            for v, opts in VARIANTS.items():
                r = {"shape": name, "K": K, "N": N, "M": M, "variant": v, **probe(K, N, M, opts)}
                rows.append(r)
                print(json.dumps(r), flush=True)
        extra = {"default_nk": dict(layout="nk")}
        if name == "lm_head":
            extra["f32_out"] = dict(f32_out=True)
            extra["f32_out_no_triton_gemm"] = dict(f32_out=True, opts=VARIANTS["no_triton_gemm"])
        for v, kw in extra.items():
            r = {"shape": name, "K": K, "N": N, "M": 1, "variant": v}
            r.update(probe(K, N, 1, kw.pop("opts", {}), **kw))
            rows.append(r)
            print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
