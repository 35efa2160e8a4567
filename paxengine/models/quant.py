"""FP8 linear weights: e4m3 values with one scale per output channel, and the one `linear`
the model calls for every projection.

A quantized weight is a pytree (`Fp8Weight`), so it travels through jit, scan and the executable
store like any array. Its values are stored [out, in] (the checkpoint layout), the layout FP8
tensor-core GEMMs want for the weight operand and the one a GEMV streams row by row.
Per-output-channel scales commute with the matmul: x @ (v * s).T equals (x @ v.T) * s column by
column, so the scale is applied to the product's columns; fused projections (wqkv, w_gate_up)
keep their slices' scales, since a slice is a set of output channels.

`linear` picks a matmul per call from the number of rows, which is static (a token bucket), so
the choice is made once per compiled bucket: see `fp8_path`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448

# Per-layer projection weights (dense: [in, out], or [L, in, out] stacked); embeddings, norms,
# biases and the LM head stay in the model dtype.
LINEAR_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "wqkv", "w_gate_up")
# a hybrid's Gated DeltaNet projections FP8 quantizes too (models/qwen3_5.py); its per-head b
# and a projections (the gates, [H, Hv]) stay dense
LINEAR_WEIGHTS += ("la_qkv", "la_z", "la_out")
# an MoE layer's experts ([E, in, out] stacks: values [E, out, in], scales [E, out]) and its
# shared expert (models/moe.py); the routers stay dense
LINEAR_WEIGHTS += ("e_gate", "e_up", "e_down", "e_gate_up", "s_gate", "s_up", "s_down", "s_gate_up")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Fp8Weight:
    values: jax.Array  # [..., out, in] float8_e4m3fn
    scales: jax.Array  # [..., out] float32: weight[o, i] = values[o, i] * scales[o]

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense weight's shape, [..., in, out], as the model and shape checks see it."""
        *lead, out, inp = self.values.shape
        return (*lead, inp, out)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes


def quantize_fp8(w: jax.Array) -> Fp8Weight:
    """A dense [..., in, out] weight -> per output channel e4m3: the scale maps the channel's
    largest |w| to 448."""
    wf = jnp.swapaxes(w.astype(jnp.float32), -1, -2)  # [..., out, in]
    amax = jnp.max(jnp.abs(wf), axis=-1)
    scales = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    values = jnp.clip(wf / scales[..., None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return Fp8Weight(values, scales)


def dequantize(w: Fp8Weight, dtype=jnp.float32) -> jax.Array:
    """The dense [..., in, out] weight the quantized one stands for."""
    dense = w.values.astype(jnp.float32) * w.scales[..., None]
    return jnp.swapaxes(dense, -1, -2).astype(dtype)


def array_module(a):
    """numpy for host arrays, jax.numpy for device ones: the weight layout changes (fusions,
    KV-head copies, channel orders, vocabulary padding) run on either; under tensor parallelism
    the weights stay on the host until each device takes its shards (parallel.shard_params)."""
    return np if isinstance(a, np.ndarray) else jnp


def concat_out(parts: list[Fp8Weight]) -> Fp8Weight:
    """Projections fused along their output channels (wqkv, w_gate_up), scales kept per slice;
    host parts (numpy) stay on the host."""
    xp = array_module(parts[0].values)
    return Fp8Weight(
        xp.concatenate([p.values for p in parts], axis=-2),
        xp.concatenate([p.scales for p in parts], axis=-1),
    )


# -- the matmul per bucket -----------------------------------------------------------------------
# Measured on the H200 (jax 0.11.2, Llama-3.1-8B projections, device time a matmul;
# benchmarks/results/gpu_2026-12-01_fp8/):
# - M = 1: the Pallas GEMV (kernels_pallas.fp8_gemv) streams the 8-bit weights: 4096 x 28672 in
#   33.8 us (3.48 TB/s) against 45.5 us for XLA's upcast and 60.6 us for bf16; faster on all four
#   shapes. From M = 8 on, XLA's upcast of [out, in] values is the faster (8-16 rows: 4096 x
#   28672 in 33-37 us, 1.6x bf16's 58 us; the kernel 47-49 us).
# - M >= 64: fp8 x fp8 with per-token activation scales (cuBLASLt's FP8 GEMM): 4096 x 6144 at
#   M=64 18.6 us against 30.2 upcast, at M=256 (x 28672) 72 us against 153 (issue #17's probe,
#   per-tensor activation scales; per-token scales apply after the dot, to be confirmed there).
GEMV_MAX_ROWS = 1
W8A8_MIN_ROWS = 64
# Steps of up to this many rows may take the W8A8 GEMV instead (PAXENGINE_KERNEL_FP8_W8A8_GEMV_
# MAX_ROWS): the activation rows quantized per token as on the W8A8 path (the norm kernel hands
# them over quantized), then fp8 x fp8 tensor-core dots that stream the weights with no
# conversion a weight (kernels_pallas.fp8_gemv, x_scales). The same numerics as the W8A8
# buckets, at every row count. 0, the default: on an H100 (2026-12-05,
# benchmarks/results/gpu_2026-12-05_w8a8_gemv) 16 made batch-1 ITL 4.04 ms against 3.49 and
# batch-8 4.28 against 4.13, with its tuning unswept.
W8A8_GEMV_MAX_ROWS = 0


def w8a8_gemv_max_rows() -> int:
    return int(os.environ.get("PAXENGINE_KERNEL_FP8_W8A8_GEMV_MAX_ROWS", W8A8_GEMV_MAX_ROWS))


def fp8_units(device=None) -> bool:
    """Whether the GPU has FP8 tensor cores and fp8 loads (NVIDIA compute capability 8.9+:
    Ada, Hopper, Blackwell). An A100 (8.0) has neither."""
    d = device if device is not None else jax.devices()[0]
    try:
        return d.platform == "gpu" and float(d.compute_capability) >= 8.9
    except (AttributeError, TypeError, ValueError):
        return False


def fp8_path(rows: int, on_gpu: bool, has_fp8_units: bool = True) -> str:
    """ "w8a8" | "w8a8_gemv" | "gemv" | "w8a16" for a matmul of `rows` activation rows. A GPU
    without FP8 units upcasts every matmul (the CPU still takes the FP8 paths' math, so tests
    cover it)."""
    if on_gpu and not has_fp8_units:
        return "w8a16"
    if rows >= W8A8_MIN_ROWS:
        return "w8a8"
    if on_gpu and rows <= w8a8_gemv_max_rows():
        return "w8a8_gemv"
    if on_gpu and rows <= GEMV_MAX_ROWS:
        return "gemv"
    return "w8a16"


def xla_options(rows: int) -> dict:
    """XLA options for compiling a step of `rows` token rows with FP8 weights on the GPU. XLA
    autotunes every fp8 x fp8 dot against its Triton GEMMs, and that grows with M: on the H200
    (jax 0.11.2, `benchmarks.profile.fp8_compile` at 5f74b6d, 2 layers of Llama-3.1-8B) a
    2048-row bucket compiled in 52 s, and a whole 8B engine's 65 executables did not finish in 7 minutes. With
    XLA's Triton GEMMs off the W8A8 buckets take cuBLASLt's FP8 GEMM as before, at the same step
    time (64 / 320 / 2048 rows: 0.42 / 1.21 / 2.45 ms either way), compiled in 2-4 s. The W8A16
    buckets keep them on: there the upcast fuses into a Triton GEMM (16 rows 0.25 ms; without it
    0.90 ms)."""
    on_gpu = jax.default_backend() == "gpu"
    if on_gpu and fp8_path(rows, on_gpu, fp8_units()) == "w8a8":
        return {"xla_gpu_enable_triton_gemm": False}
    return {}


def dense_xla_options(rows: int, cublas_max_tokens: int = 0) -> dict:
    """XLA options for compiling a step of `rows` token rows with 16-bit weights on the GPU:
    steps of up to `cublas_max_tokens` tokens (a model family's CUBLAS_MAX_TOKENS, or
    PAXENGINE_KERNEL_CUBLAS_MAX_TOKENS, part of the executables' key) without XLA's Triton
    GEMMs, so their skinny GEMMs are cuBLAS's. XLA autotunes each GEMM fusion against cuBLAS
    while it compiles, and its pick varied between two compiles of one program; on the H100 a
    lone GEMM is as fast either way except [4096, 4096] (cuBLAS 37.5 against 13.4 us)
    (benchmarks/results/gpu_2026-12-06b_qwen35_gemm/)."""
    return {"xla_gpu_enable_triton_gemm": False} if cublas_step(rows, cublas_max_tokens) else {}


def cublas_step(rows: int, cublas_max_tokens: int) -> bool:
    """Whether a GPU step of `rows` token rows compiles without XLA's Triton GEMMs
    (dense_xla_options)."""
    n = int(os.environ.get("PAXENGINE_KERNEL_CUBLAS_MAX_TOKENS", cublas_max_tokens))
    return jax.default_backend() == "gpu" and rows <= n


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dynamic per-token activation scales: x [M, K] -> (e4m3 values, [M] f32 scales)."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scales = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return jnp.clip(xf / scales[:, None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE), scales


class Fp8Rows(NamedTuple):
    """Activation rows already quantized for a W8A8 GEMM (`quantize_rows`'s output, e.g. from
    the fused add + RMSNorm kernel, models/norm.py): `linear` and `gated_mlp` take them in
    place of x on the W8A8 path. dtype: the model dtype the product is returned in."""

    values: jax.Array  # [M, K] e4m3
    scales: jax.Array  # [M] f32
    dtype: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


_CONTRACT_IN = (((1,), (1,)), ((), ()))  # x [M, in] . values [out, in]


def w8a8_product_dtype():
    """The dtype the W8A8 GEMM writes its unscaled product in, before the per-token and
    per-channel scales: the model's ("model", the default) or f32 where
    PAXENGINE_KERNEL_FP8_GEMM_OUT=f32 (an A/B knob, in the executables' key). In the model
    dtype the product is rounded twice, before the scales and after (~1 ulp of bf16 more), and
    the kernels after the GEMM read half the bytes: on the H200 the 256 x (1024, 128) FP8 run's
    steps took 33.84 against 34.48 ms (benchmarks/results/gpu_2026-12-04c_defaults/, call 1)."""
    return os.environ.get("PAXENGINE_KERNEL_FP8_GEMM_OUT", "model")


def _unscaled_dot(xq, w: Fp8Weight, dtype, product: str | None = None) -> jax.Array:
    """xq @ w.values: the fp8 x fp8 GEMM (cuBLASLt on the GPU), its product in f32 or ("model")
    `dtype`, no scales applied."""
    product = product or w8a8_product_dtype()
    if product not in ("f32", "model"):
        raise ValueError(f"W8A8 product dtype must be 'f32' or 'model', got {product!r}")
    acc = jnp.float32 if product == "f32" else dtype
    return jax.lax.dot_general(xq, w.values, _CONTRACT_IN, preferred_element_type=acc)


def _scaled_dot(xq, xs, w: Fp8Weight, dtype, product: str | None = None) -> jax.Array:
    """(xq * xs[:, None]) @ w in `dtype`, both scales applied after the GEMM."""
    y = _unscaled_dot(xq, w, dtype, product)
    return (y.astype(jnp.float32) * xs[:, None] * w.scales[None, :]).astype(dtype)


def matmul_w8a8(x: jax.Array, w: Fp8Weight, product: str | None = None) -> jax.Array:
    """fp8 x fp8 with dynamic per-token activation scales."""
    xq, xs = quantize_rows(x)
    return _scaled_dot(xq, xs, w, x.dtype, product)


def matmul_fp8(x: jax.Array, w: Fp8Weight, path: str) -> jax.Array:
    """x [M, in] @ the weight, in x's dtype, by one of `fp8_path`'s paths."""
    if isinstance(x, Fp8Rows):
        if path == "w8a8_gemv":
            return _gemv8(x.values, x.scales, w, x.dtype)
        if path != "w8a8":
            raise ValueError(f"quantized activation rows take the W8A8 path, not {path!r}")
        return _scaled_dot(x.values, x.scales, w, x.dtype)
    if path == "w8a8":
        return matmul_w8a8(x, w)
    if path == "w8a8_gemv":
        return _gemv8(*quantize_rows(x), w, x.dtype)
    if path == "gemv":
        return _gemv(x, w)
    if path == "w8a16":
        v = w.values.astype(x.dtype)
        y = jax.lax.dot_general(x, v, _CONTRACT_IN, preferred_element_type=jnp.float32)
        return (y * w.scales[None, :]).astype(x.dtype)
    raise ValueError(f"unknown fp8 matmul path {path!r}")


def _gemv(x: jax.Array, w: Fp8Weight, glu: bool = False, x_scales=None, dtype=None) -> jax.Array:
    """The Pallas GEMV in `dtype` (x's): x 16-bit, or (the W8A8 GEMV) e4m3 rows with their
    scales x_scales."""
    from kernels_pallas import fp8_matmul

    interpret = jax.default_backend() != "gpu"  # (tests pin this path on the CPU)
    out_dtype = dtype or x.dtype
    return fp8_matmul(
        x, w.values, w.scales, x_scales=x_scales, out_dtype=out_dtype, glu=glu, interpret=interpret
    )


def _gemv8(xq, xs, w: Fp8Weight, dtype) -> jax.Array:
    """The W8A8 GEMV: e4m3 rows xq with their scales xs @ the weight, in dtype."""
    return _gemv(xq, w, x_scales=xs, dtype=dtype)


def _path_for(x: jax.Array) -> str:
    return _path_for_rows(x.shape[0])


def _path_for_rows(rows: int) -> str:
    on_gpu = jax.default_backend() == "gpu"
    return fp8_path(rows, on_gpu, on_gpu and fp8_units())


def row_dot(x: jax.Array, w: jax.Array, preferred_element_type=None) -> jax.Array:
    """x [M, in] @ w [in, out]; on the GPU a one-row x goes in as two rows (the second zero),
    an optimization barrier on either side of the dot. Why: XLA rewrites a vector-matrix dot as
    a multiply + reduce, and for Qwen3-30B-A3B's batch-1 step it wrote each layer's whole
    [4096, 2048] out-projection product (and the router's [2048, 128] in f32) to memory and read
    it back: 0.67 ms of multiplies and most of 1.15 ms of reductions a 5.67 ms step on the H100
    (benchmarks/results/gpu_2026-12-07e_moe/, call P); XLA 0.11's flag for it is gone. Two rows
    are a GEMM (each weight read once); the barriers keep XLA from slicing the row back out."""
    dot = lambda a: jnp.dot(a, w, preferred_element_type=preferred_element_type)  # noqa: E731
    if x.ndim != 2 or x.shape[0] != 1 or jax.default_backend() != "gpu":
        return dot(x)
    x2 = jax.lax.optimization_barrier(jnp.pad(x, ((0, 1), (0, 0))))
    return jax.lax.optimization_barrier(dot(x2))[:1]


def linear(x: jax.Array, w) -> jax.Array:
    """x [M, in] (or Fp8Rows, for an Fp8Weight on the W8A8 path) @ w for a plain [in, out]
    weight or an Fp8Weight."""
    if isinstance(w, Fp8Weight):
        return matmul_fp8(x, w, _path_for(x))
    return x @ w


def takes_fp8_rows(rows: int, weights) -> bool:
    """Whether every weight in `weights` is an Fp8Weight on a W8A8 path at `rows` rows: then
    the input can come pre-quantized (Fp8Rows)."""
    path = _path_for_rows(rows)
    return path in ("w8a8", "w8a8_gemv") and all(isinstance(w, Fp8Weight) for w in weights)


def linear_parts(x: jax.Array, w) -> tuple:
    """x @ w as (y, row_scales, col_scales) with y * row_scales[:, None] * col_scales[None, :]
    the product: a W8A8 GEMM's unscaled product and its scales (so the next kernel applies
    them, models/norm.py), else (x @ w, None, None)."""
    if isinstance(w, Fp8Weight) and _path_for(x) == "w8a8":
        xq, xs = quantize_rows(x)
        return _unscaled_dot(xq, w, x.dtype), xs, w.scales
    return linear(x, w), None, None


def linear_glu(gate_up: jax.Array, w) -> jax.Array:
    """(silu(gate) * up) @ w for a gated MLP's fused [gate | up] product [M, 2 I].
    PAXENGINE_KERNEL_FP8_GLU=1: on the FP8 GEMV path the kernel forms silu(gate) * up as it
    loads its input (one kernel fewer a layer). Off by default: on the H200 the batch-1 FP8 step
    took 4.87 ms with it against 4.59 without (benchmarks/results/gpu_2026-12-01_b1_fused/), the
    prologue costs the GEMV more than the launch it saves."""
    fused = os.environ.get("PAXENGINE_KERNEL_FP8_GLU", "0") == "1"  # (in the executables' key)
    if fused and isinstance(w, Fp8Weight) and _path_for(gate_up) == "gemv":
        return _gemv(gate_up, w, glu=True)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return linear(jax.nn.silu(gate) * up, w)


def fused_glu_quant() -> bool:
    """Whether W8A8 MLPs form and quantize silu(gate) * up in one kernel (`glu_quant`);
    PAXENGINE_KERNEL_FP8_GLU_QUANT=0 gives XLA's fusions instead (an A/B knob, in the
    executables' key)."""
    return os.environ.get("PAXENGINE_KERNEL_FP8_GLU_QUANT", "1") == "1"


def gated_mlp(x: jax.Array, w_gate_up, w_down) -> jax.Array:
    """silu(gate) * up of x @ w_gate_up ([gate | up] along its output channels), @ w_down.

    W8A8 buckets with both weights in FP8 take the gate | up GEMM's unscaled product (in x's
    dtype) straight to `glu_quant`, which applies the scales, forms silu(gate) * up and
    quantizes it per row for the down GEMM in one pass; XLA made that two fusions each reading
    the whole product (benchmarks/kernels/fp8_mlp.py at 5f74b6d). Buckets on the W8A8 GEMV path
    take the same kernel between the two GEMVs (their product comes scaled: its scales are ones). On a CPU
    the kernel's jnp oracle runs instead (the same f32 math; interpret mode would take seconds a
    prefill bucket)."""
    fp8 = isinstance(w_gate_up, Fp8Weight) and isinstance(w_down, Fp8Weight)
    path = _path_for(x) if fp8 and fused_glu_quant() else None
    if path == "w8a8_gemv":
        # the GEMV applies the gate | up scales itself: the GLU kernel's scales are ones
        y = linear(x, w_gate_up)
        ones_r, ones_c = jnp.ones(y.shape[:1], jnp.float32), jnp.ones(y.shape[1:], jnp.float32)
        aq, a_scales = _glu_quant(y, ones_r, ones_c)
        return _gemv8(aq, a_scales, w_down, y.dtype)
    if path == "w8a8":
        xq, xs = (x.values, x.scales) if isinstance(x, Fp8Rows) else quantize_rows(x)
        y = jax.lax.dot_general(xq, w_gate_up.values, _CONTRACT_IN, preferred_element_type=x.dtype)
        aq, a_scales = _glu_quant(y, xs, w_gate_up.scales)
        return _scaled_dot(aq, a_scales, w_down, x.dtype)
    return linear_glu(linear(x, w_gate_up), w_down)


def _glu_quant(y, row_scales, col_scales):
    from kernels_pallas import glu_quant, ref_glu_quant

    if jax.default_backend() == "gpu":
        return glu_quant(y, row_scales, col_scales, fast=glu_fast_math())
    return ref_glu_quant(y, row_scales, col_scales)


def glu_fast_math() -> bool:
    """The GLU kernel's silu from the GPU's approximate exp2 and reciprocal (1 ulp-level
    error, a flipped e4m3 rounding in ~4e-7 of the codes): H200, the kernel alone at 8,192 /
    2,048 rows 293 / 86 us against 331 / 102; the FP8 engine's 300 x (1000, 1000) 14,585
    against 14,537 output tok/s, 256 x (1024, 128) 5,960 against 5,852, one lease
    (benchmarks/results/gpu_2026-12-04d_f16_gemv/, calls 2-3). PAXENGINE_KERNEL_FP8_GLU_FAST=0
    gives expf and an IEEE division back (an A/B knob, in the executables' key)."""
    return os.environ.get("PAXENGINE_KERNEL_FP8_GLU_FAST", "1") == "1"


def quantize_params(params: dict) -> dict:
    """The model's dense projection weights as Fp8Weight, in either layer layout (weights
    already in FP8, from a pre-quantized checkpoint, stay as they are); each source array is
    dropped as soon as its quantized form exists (the peak is one layer's weights more)."""
    quantize = jax.jit(quantize_fp8)

    def layer(d: dict) -> dict:
        return {
            k: quantize(v) if k in LINEAR_WEIGHTS and not isinstance(v, Fp8Weight) else v
            for k, v in d.items()
        }

    layers = params["layers"]
    if isinstance(layers, list):
        out = []
        while layers:
            out.append(layer(layers.pop(0)))
        return {**params, "layers": out}
    return {**params, "layers": layer(layers)}


def weight_dtype(params: dict) -> str:
    """The name of what the projections hold: "fp8_e4m3" or their array dtype."""
    layers = params["layers"]
    first = layers[0] if isinstance(layers, list) else layers
    w = next(v for k, v in first.items() if k in LINEAR_WEIGHTS)
    return "fp8_e4m3" if isinstance(w, Fp8Weight) else str(w.dtype)
