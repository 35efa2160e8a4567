"""One FP8 transformer layer's projections at prefill sizes, per variant of the W8A8 path: where
the fusions around XLA's FP8 GEMMs go (issue #17: an 8,192-token FP8 prefill step spends 32.5 ms
in fusions where bf16 spends 15).

    python3 -m benchmarks.kernels.fp8_mlp [--ms 2048,8192] [--quick] [--hlo]

A layer here is the model's own ops (`paxengine.models.llama.rms_norm`, `quant.linear`,
`quant.linear_glu`) on Llama-3.1-8B shapes, with the attention replaced by its queries (the
projections, norms, GLU and residuals are what differs between variants): RMSNorm, QKV, O on the
query slice, residual, RMSNorm, gate|up, GLU, down, residual. One jit runs L distinct layers in
a row (their weights >> L2). Variants:
  bf16              bf16 weights (the reference)
  w8a8_f32          FP8 weights, W8A8, the GEMMs' unscaled products in f32, XLA's GLU fusions
  w8a8_model        the products in bf16 (PAXENGINE_KERNEL_FP8_GEMM_OUT=model)
  fused_f32         w8a8_f32 with the GLU and its quantization in one kernel (`glu_quant`,
                    PAXENGINE_KERNEL_FP8_GLU_QUANT=1; the gate | up product in bf16)
  fused_model       both
Per variant: milliseconds per layer (median of reps), the device's kernel time per layer by
kernel (GPU: one traced run), and the output's error against an f32 evaluation of the same
quantized layer. --hlo writes each variant's optimized HLO to $OUT. --glu-sweep also times
`glu_quant` alone at each M over its block shapes and warps (device time, traced).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.device_trace import kernel_times, trace_device
from benchmarks.record import environment, write_to_out
from kernels_pallas import glu_quant, ref_glu_quant
from kernels_pallas.glu_quant import default_blocks
from paxengine.models.llama import rms_norm
from paxengine.models.quant import dequantize, gated_mlp, linear, quantize_fp8, xla_options

_OUT, _GLU = "PAXENGINE_KERNEL_FP8_GEMM_OUT", "PAXENGINE_KERNEL_FP8_GLU_QUANT"
VARIANTS = {
    "bf16": None,
    "w8a8_f32": {_OUT: "f32", _GLU: "0"},
    "w8a8_model": {_OUT: "model", _GLU: "0"},
    "fused_f32": {_OUT: "f32", _GLU: "1"},
    "fused_model": {_OUT: "model", _GLU: "1"},
}


def make_layers(L: int, H: int, I: int, Q: int, KV: int, key):
    def w(i, name, shape):
        k = jax.random.fold_in(key, i * 16 + hash(name) % 16)
        return (jax.random.normal(k, shape, jnp.float32) * shape[0] ** -0.5).astype(jnp.bfloat16)

    return [
        {
            "wqkv": w(i, "qkv", (H, Q + 2 * KV)),
            "wo": w(i, "o", (Q, H)),
            "w_gate_up": w(i, "gu", (H, 2 * I)),
            "w_down": w(i, "d", (I, H)),
            "n1": jnp.ones((H,), jnp.bfloat16),
            "n2": jnp.ones((H,), jnp.bfloat16),
        }
        for i in range(L)
    ]


def layer(x, w, Q: int):
    h = rms_norm(x, w["n1"], 1e-5)
    qkv = linear(h, w["wqkv"])
    x = x + linear(qkv[:, :Q], w["wo"])
    h = rms_norm(x, w["n2"], 1e-5)
    return x + gated_mlp(h, w["w_gate_up"], w["w_down"])


def run(f, x, layers, reps: int) -> float:
    jax.block_until_ready(f(x, layers))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(x, layers))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def glu_sweep(m: int, I: int, key) -> list[dict]:
    """glu_quant alone on an [m, 2I] bf16 product: device us per call by (block_rows,
    block_cols, num_warps, IEEE or fast silu), 5 calls traced, each checked against the oracle
    (share of equal e4m3 codes, scale error); the first two configs are the default blocks."""
    y = jax.random.normal(key, (m, 2 * I), jnp.float32).astype(jnp.bfloat16) * 100
    rs, cs = jnp.full((m,), 1e-2), jnp.full((2 * I,), 1e-2)
    whole = 1 << max(I - 1, 0).bit_length()
    configs = [(*default_blocks(m, I), fast) for fast in (False, True)]
    configs += [(1, whole, w, fast) for w in (8, 16, 32) for fast in (False, True)]
    configs += [
        (br, bc, nw, fast)
        for br in (2, 4)
        for bc in (512, 1024)
        for nw in (4, 8)
        for fast in (False, True)
    ]
    qr, sr = jax.jit(ref_glu_quant)(y, rs, cs)
    codes_ref = np.asarray(qr.astype(jnp.float32))
    rows = []
    for br, bc, nw, fast in configs:
        f = jax.jit(
            lambda y, rs, cs, br=br, bc=bc, nw=nw, fast=fast: glu_quant(
                y, rs, cs, block_rows=br, block_cols=bc, num_warps=nw, fast=fast
            )
        )
        cfg = [br, bc, nw, "fast" if fast else "ieee"]
        try:
            q, s = jax.block_until_ready(f(y, rs, cs))
        except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
            rows.append({"M": m, "config": cfg, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        # against the oracle: the share of e4m3 codes that differ (a rounding flip), the scales
        same = float((np.asarray(q.astype(jnp.float32)) == codes_ref).mean())
        s_err = float(np.max(np.abs(np.asarray(s) / np.asarray(sr) - 1)))

        def five(f=f):
            for _ in range(5):
                out = f(y, rs, cs)
            jax.block_until_ready(out)

        times, _ = kernel_times(trace_device(five))
        us = sum(v for k, v in times.items() if "glu_quant" in k) / 5
        gbps = (m * 2 * I * 2 + m * I) / us / 1e3  # HBM bytes a call must move / time
        rows.append(
            {
                "M": m,
                "config": cfg,
                "us": round(us, 1),
                "GBps": round(gbps),
                "codes_equal": same,
                "scale_rel_err": s_err,
            }
        )
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="2048,8192")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke test)")
    ap.add_argument("--hlo", action="store_true")
    ap.add_argument("--glu-sweep", action="store_true")
    ap.add_argument("--glu-only", action="store_true", help="the GLU sweep alone, no layers")
    args = ap.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    H, I, Q, KV = (64, 128, 64, 16) if args.quick else (4096, 14336, 4096, 1024)
    ms = [64] if args.quick else [int(m) for m in args.ms.split(",")]
    L = 2 if args.quick else args.layers
    key = jax.random.PRNGKey(0)
    dense = make_layers(L, H, I, Q, KV, key)
    lin = ("wqkv", "wo", "w_gate_up", "w_down")
    fp8 = [{k: jax.jit(quantize_fp8)(v) if k in lin else v for k, v in d.items()} for d in dense]
    # the quantized layers' dense form in f32: the oracle the FP8 variants are measured against
    ref_w = [{k: dequantize(v) if k in lin else v for k, v in d.items()} for d in fp8]
    res = {**environment({"benchmark": "fp8_mlp"}), "command": " ".join(["fp8_mlp", *(argv or [])])}
    res["rows"] = []
    for m in ms:
        x = jax.random.normal(jax.random.fold_in(key, m), (m, H), jnp.float32).astype(jnp.bfloat16)
        want = x.astype(jnp.float32)
        for w in () if args.glu_only else ref_w:
            want = jax.jit(lambda x, w: layer(x, w, Q))(want, w)
        want = np.asarray(want) if not args.glu_only else None
        for name, env in () if args.glu_only else VARIANTS.items():
            for k in (_OUT, _GLU):
                os.environ.pop(k, None)
            os.environ.update(env or {})
            layers = dense if env is None else fp8

            def stack(x, layers):
                for w in layers:
                    x = layer(x, w, Q)
                return x

            # compiled with the XLA options the engine gives a bucket of m rows (quant.xla_options)
            opts = xla_options(m) if env is not None else {}
            f = jax.jit(stack).lower(x, layers).compile(compiler_options=opts or None)
            got = np.asarray(f(x, layers), np.float32)
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            sec = run(f, x, layers, args.reps)
            row = {"M": m, "variant": name, "ms_per_layer": round(1e3 * sec / L, 4)}
            row["rel_err_vs_f32"] = float(f"{err:.3g}")
            if on_gpu:
                times, counts = kernel_times(
                    trace_device(lambda: jax.block_until_ready(f(x, layers)))
                )
                top = sorted(times.items(), key=lambda kv: -kv[1])[:16]
                row["kernel_ms_per_layer"] = round(sum(times.values()) / 1e3 / L, 4)
                row["top_kernels_us_per_layer"] = [[k, round(v / L, 1), counts[k]] for k, v in top]
            if args.hlo and os.environ.get("OUT"):
                text = f.as_text()
                with open(
                    os.path.join(os.environ["OUT"], f"fp8_mlp_{name}_M{m}.hlo.txt"), "w"
                ) as fh:
                    fh.write(text)
            print(row, flush=True)
            res["rows"].append(row)
        if (args.glu_sweep or args.glu_only) and on_gpu:
            res.setdefault("glu_sweep", []).extend(glu_sweep(m, I, key))
    for k in (_OUT, _GLU):
        os.environ.pop(k, None)
    write_to_out(res, "fp8_mlp", quiet=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
