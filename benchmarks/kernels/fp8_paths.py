"""Which matmul an FP8 weight should take at each token bucket: bf16 x bf16 (the reference),
W8A16 (values upcast in the jit), W8A8 (per-token activation scales, fp8 x fp8) and the Pallas
GEMV, on Llama-3.1-8B projection shapes, each checked against the dequantized product.

    python3 -m benchmarks.kernels.fp8_paths --out DIR [--quick]

Timing: one jit applies the path to L distinct weights in a row, as the layers of a model do
(no weight stays in the 50 MB L2 between uses, nothing is loop-invariant for XLA to hoist), and
reduces each product (the same extra read for every path); microseconds per matmul, median of
repetitions. Also records whether XLA lowered W8A8 to cuBLASLt's FP8 GEMM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from paxengine.models.quant import dequantize, matmul_fp8, quantize_fp8

FULL_SHAPES = [(4096, 6144), (4096, 28672), (14336, 4096), (4096, 4096)]  # qkv, gate_up, down, o
FULL_MS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 8192]
QUICK_SHAPES, QUICK_MS = [(64, 96)], [1, 16, 64]


def paths(on_gpu: bool, m: int) -> list[str]:
    out = ["bf16", "w8a16", "w8a8"]
    if on_gpu and m <= 64:
        out.append("gemv")
    return out


def apply(path: str, x, w):
    if path == "bf16":
        return x @ w
    return matmul_fp8(x, w, path)


def run_shape(K: int, N: int, ms: list[int], on_gpu: bool, min_bytes: int, reps: int):
    key = jax.random.PRNGKey(K * 7 + N)
    L = int(min(16, max(2, -(-min_bytes // (K * N)))))
    dense = [
        (jax.random.normal(jax.random.fold_in(key, i), (K, N), jnp.float32) * 0.02).astype(
            jnp.bfloat16
        )
        for i in range(L)
    ]
    q = [jax.jit(quantize_fp8)(w) for w in dense]
    rows = []
    for m in ms:
        x = jax.random.normal(jax.random.fold_in(key, 1000 + m), (m, K), jnp.bfloat16)
        want = np.asarray(x.astype(jnp.float32) @ dequantize(q[0]))
        row = {"K": K, "N": N, "M": m, "layers": L}
        for path in paths(on_gpu, m):
            ws = dense if path == "bf16" else q
            f = jax.jit(lambda x, ws, path=path: [jnp.sum(apply(path, x, w)) for w in ws])
            try:
                y = np.asarray(jax.jit(lambda x, w, p=path: apply(p, x, w))(x, ws[0]), np.float32)
                jax.block_until_ready(f(x, ws))
                per = []
                for _ in range(reps):
                    t = time.perf_counter()
                    for _ in range(10):
                        out = f(x, ws)
                    jax.block_until_ready(out)
                    per.append((time.perf_counter() - t) / (10 * L))
            except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
                row[f"{path}_error"] = f"{type(e).__name__}: {e}"[:300]
                continue
            us = 1e6 * statistics.median(per)
            wbytes = K * N * (2 if path == "bf16" else 1)
            row[f"{path}_us"] = round(us, 2)
            row[f"{path}_weight_TBps"] = round(wbytes / us / 1e6, 3)
            row[f"{path}_TFLOPs"] = round(2 * m * K * N / us / 1e6, 1)
            if path != "bf16":
                err = np.linalg.norm(y - want) / max(np.linalg.norm(want), 1e-30)
                row[f"{path}_rel_err"] = float(f"{err:.3g}")
        fastest = min(
            (p for p in paths(on_gpu, m) if f"{p}_us" in row), key=lambda p: row[f"{p}_us"]
        )
        row["fastest_fp8"] = min(
            (p for p in paths(on_gpu, m) if p != "bf16" and f"{p}_us" in row),
            key=lambda p: row[f"{p}_us"],
        )
        row["fastest"] = fastest
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def cublas_fp8_used(K: int, N: int, m: int) -> bool:
    w = jax.jit(quantize_fp8)(jnp.ones((K, N), jnp.bfloat16))
    x = jnp.ones((m, K), jnp.bfloat16)
    text = jax.jit(lambda x, w: matmul_fp8(x, w, "w8a8")).lower(x, w).compile().as_text()
    return "cublas$lt$matmul$f8" in text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="directory for fp8_paths.json")
    p.add_argument("--quick", action="store_true", help="CPU-sized shapes")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    shapes, ms = (QUICK_SHAPES, QUICK_MS) if args.quick else (FULL_SHAPES, FULL_MS)
    min_bytes = 1 << 20 if args.quick else 256 << 20  # >> the H200's 50 MB L2
    rec = {
        "benchmark": "fp8_paths",
        "device": str(jax.devices()[0].device_kind),
        "jax_version": jax.__version__,
        "command": "python3 -m benchmarks.kernels.fp8_paths" + (" --quick" if args.quick else ""),
        "cublas_fp8_w8a8": {f"M={m}": cublas_fp8_used(4096, 6144, m) for m in (16, 64, 512)}
        if on_gpu
        else None,
        "rows": [],
    }
    print(json.dumps({k: v for k, v in rec.items() if k != "rows"}), flush=True)
    for K, N in shapes:
        rec["rows"] += run_shape(K, N, ms, on_gpu, min_bytes, args.reps)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fp8_paths.json").write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
