"""The residual add and RMSNorm before a layer's projections, in one pass where it pays.

`norm_into(h, delta, weight, eps, next_weights)` -> (h + delta, rms_norm(h + delta)), the normed
rows handed over as FP8 rows (quant.Fp8Rows) when every next weight takes the W8A8 path, so the
GEMM does not quantize them again. delta: None (the norm alone), an array, or a W8A8 GEMM's
(unscaled product, row scales, column scales) from `quant.linear_parts`, whose scales are
applied here.

On the GPU, in steps of at most ADD_NORM_MAX_ROWS token rows and in every step whose rows go
on to W8A8 GEMMs, this is one Pallas kernel
(`kernels_pallas.add_rms_norm`): XLA launches up to four kernels for it (the scaling and add,
the norm's reduction, the quantization's row max and its convert), each reading the [T, H]
stream again, and a small step pays for each launch. Elsewhere its jnp oracle runs: the model's
own ops, so the CPU's numbers are those of `llama.rms_norm` and `quant.quantize_rows`.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from paxengine.models.quant import Fp8Rows, takes_fp8_rows

# Measured on the H200 (Llama-3.1-8B shapes, each variant an engine in its own process on one
# machine; benchmarks/results/gpu_2026-12-04c_defaults/, call 2): with the kernel in every step,
# FP8 batch-1 / batch-8 ITL 2.95 / 3.30 ms against 3.04 / 3.37 without and bf16 batch-8 4.45
# against 4.52, but bf16 300 x (1000, 1000)'s steps (320 rows) 30.71 against 30.14 ms and FP8's
# 19.73 against 19.79 (even): the kernel in the small buckets, XLA's fusions from there.
# PAXENGINE_KERNEL_ADD_NORM_MAX_ROWS overrides it (0: never; part of the executables' key).
ADD_NORM_MAX_ROWS = 16
# Where the normed rows feed W8A8 GEMMs (they are quantized too: XLA's fusions then also take a
# row max and a convert), the kernel runs at every row count: H200, FP8 weights + KV, one lease,
# each variant its own process (benchmarks/results/gpu_2026-12-04d_f16_gemv/, call 3):
# 300 x (1000, 1000) 14,655 against 14,537 output tok/s, 256 x (1024, 128) 6,010 against 5,852.
# PAXENGINE_KERNEL_ADD_NORM_W8A8=0 gives those steps ADD_NORM_MAX_ROWS' rule back.


def add_norm_kernel(rows: int, hidden: int = 0, quantize: bool = False) -> bool:
    """Whether a step of `rows` token rows of `hidden` features takes the kernel (quantize: the
    rows go on quantized, to W8A8 GEMMs)."""
    from kernels_pallas.add_norm import MAX_WIDTH

    if jax.default_backend() != "gpu" or hidden > MAX_WIDTH:
        return False
    if quantize and os.environ.get("PAXENGINE_KERNEL_ADD_NORM_W8A8", "1") == "1":
        return True
    return rows <= int(os.environ.get("PAXENGINE_KERNEL_ADD_NORM_MAX_ROWS", ADD_NORM_MAX_ROWS))


def norm_into(h: jax.Array, delta, weight: jax.Array, eps: float, next_weights) -> tuple:
    """-> (h', x): h' = h + delta (h itself when delta is None), x = rms_norm(h') as an array or,
    when every weight of `next_weights` takes FP8 rows at h's row count, as Fp8Rows."""
    from kernels_pallas import add_rms_norm, ref_add_rms_norm

    y, rs, cs = delta if isinstance(delta, tuple) else (delta, None, None)
    quantize = takes_fp8_rows(h.shape[0], next_weights)
    fn = add_rms_norm if add_norm_kernel(*h.shape, quantize=quantize) else ref_add_rms_norm
    out = fn(h, y, weight, eps=eps, row_scales=rs, col_scales=cs, quantize=quantize)
    if not quantize:
        return out
    h, q, s = out
    return h, Fp8Rows(q, s, jnp.result_type(weight.dtype, h.dtype))
