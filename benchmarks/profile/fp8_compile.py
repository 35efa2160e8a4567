"""Why does an FP8 engine compile so slowly on the GPU, and what do XLA's options cost at run time?

The first H200 FP8 run (9f6a8dc) compiled 22 of 65 step buckets in 6 minutes (bf16: all 56 in
~2). This compiles a few buckets of a shortened Llama-3.1-8B (same matmul shapes, fewer layers)
under several compiler options, each variant in a fresh process (XLA's in-memory autotune cache
would carry over otherwise), and times each compiled step.

    python3 -m benchmarks.profile.fp8_compile --out DIR [--layers 4] [--variants a,b]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "bf16": {"quant": None, "options": {}},
    "fp8": {"quant": "fp8", "options": {}},
    "fp8_no_triton_gemm": {"quant": "fp8", "options": {"xla_gpu_enable_triton_gemm": False}},
    "fp8_autotune0": {"quant": "fp8", "options": {"xla_gpu_autotune_level": 0}},
}
BUCKETS = [(1, 8), (16, 8), (64, 64), (320, 512), (2048, 64)]


def child(name: str, layers: int, per_bucket_s: float, buckets) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import kernels_pallas
    from benchmarks.measure import time_calls
    from paxengine.attention import PagedAttend
    from paxengine.kv_memory import allocate_kv_cache
    from paxengine.models import llama
    from paxengine.models.config import PRESETS
    from paxengine.models.loader import load_model
    from paxengine.models.weights import unstack_layers

    v = VARIANTS[name]
    PRESETS["l8b-short"] = dataclasses.replace(PRESETS["llama-3.1-8b"], num_layers=layers)
    m = load_model("dummy:l8b-short", "bfloat16", quantization=v["quant"], progress=False)
    cfg, params = m.config, unstack_layers(m.params)
    kv_dtype = jnp.float8_e4m3fn if v["quant"] else jnp.bfloat16
    NB, bs, P = 8192, 16, 128
    kv = allocate_kv_cache(cfg, NB, bs, kv_dtype, "unroll")

    def fwd(params, kv, tokens, positions, md):
        attend = PagedAttend(md, "pallas", cfg)
        h, kv = llama.forward_hidden(params, cfg, tokens, positions, kv, attend)
        return kv, h

    step = jax.jit(fwd, donate_argnums=(1,))
    res = {"variant": name, "options": v["options"], "layers": layers, "buckets": []}
    for T, S in buckets:
        q = T // S if T >= S else 1
        S_live = min(S, T)
        ctx = 1024
        starts = np.zeros(S + 1, np.int32)
        starts[1 : S_live + 1] = np.arange(1, S_live + 1) * q
        starts[S_live + 1 :] = starts[S_live]
        lens = np.zeros(S, np.int32)
        lens[:S_live] = ctx
        tables = (np.arange(S * P, dtype=np.int32).reshape(S, P)) % NB
        slots = np.arange(T, dtype=np.int32) * 7 % (NB * bs)
        md = kernels_pallas.AttentionMetadata(
            jnp.asarray(slots),
            jnp.asarray(tables),
            jnp.asarray(lens),
            jnp.asarray(starts),
            jnp.asarray([S_live], jnp.int32),
        )
        tokens = jnp.asarray(np.random.randint(0, cfg.vocab_size, T), jnp.int32)
        positions = jnp.full((T,), ctx - 1, jnp.int32)
        t0 = time.perf_counter()
        lowered = step.lower(params, kv, tokens, positions, md)
        exe = lowered.compile(compiler_options=v["options"] or None)
        compile_s = time.perf_counter() - t0
        txt = exe.as_text() or ""
        row = {
            "T": T,
            "S": S,
            "compile_s": round(compile_s, 2),
            "cublas_f8": txt.count("lt$matmul$f8"),
            "triton_gemm_fusions": txt.count("__triton_gemm"),
            "cublas_calls": txt.count("__cublas$"),
        }
        holder = {"kv": kv}

        def run():
            holder["kv"], h = exe(params, holder["kv"], tokens, positions, md)
            return h

        row["step_ms"] = round(time_calls(run, n=20, reps=3) * 1e3, 3)
        kv = holder["kv"]
        print(json.dumps(row), flush=True)
        res["buckets"].append(row)
        if compile_s > per_bucket_s:
            res["stopped"] = f"bucket compile {compile_s:.0f}s > {per_bucket_s}s"
            break
    return res


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/fp8_compile")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--per-bucket-s", type=float, default=60.0)
    p.add_argument("--variant-timeout", type=float, default=150.0)
    p.add_argument("--buckets", default=",".join(f"{T}x{S}" for T, S in BUCKETS))
    p.add_argument("--_child", default=None)
    a = p.parse_args()
    buckets = [tuple(int(x) for x in b.split("x")) for b in a.buckets.split(",")]
    if a._child:
        print(
            "RESULT " + json.dumps(child(a._child, a.layers, a.per_bucket_s, buckets)), flush=True
        )
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in a.variants.split(","):
        cmd = [sys.executable, "-m", "benchmarks.profile.fp8_compile", "--_child", name]
        cmd += [
            "--layers",
            str(a.layers),
            "--per-bucket-s",
            str(a.per_bucket_s),
            "--buckets",
            a.buckets,
        ]
        t = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.variant_timeout)
            text = r.stdout + r.stderr
        except subprocess.TimeoutExpired as e:
            text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            text += "\nTIMEOUT"
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        res = json.loads(lines[-1][7:]) if lines else {"variant": name, "error": text[-1500:]}
        res["wall_s"] = round(time.perf_counter() - t, 1)
        results.append(res)
        print(name, json.dumps(res), flush=True)
    doc = {
        "benchmark": "fp8_compile",
        "command": " ".join(sys.argv),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "results": results,
    }
    (out / "fp8_compile.json").write_text(json.dumps(doc, indent=1))
    print(f"\n{'variant':22s} " + " ".join(f"{T}x{S}".rjust(16) for T, S in buckets))
    for r in results:
        cells = {
            (b["T"], b["S"]): f"{b['compile_s']:.0f}s/{b['step_ms']:.2f}ms"
            for b in r.get("buckets", [])
        }
        print(f"{r['variant']:22s} " + " ".join(cells.get(k, "-").rjust(16) for k in buckets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
