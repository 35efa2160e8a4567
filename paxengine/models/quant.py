"""FP8 linear weights: e4m3 values with one scale per output channel, and the one `linear`
the model calls for every projection.

A quantized weight is a pytree (`Fp8Weight`), so it travels through jit, scan and the executable
store like any array. Per-output-channel scales commute with the matmul: x @ (v * s) equals
(x @ v) * s column by column, so the scale is applied to the product's columns. Fused
projections (wqkv, w_gate_up) keep their slices' scales, since a slice is a set of columns.
Today's path upcasts the values inside the jit (W8A16): half the weight memory, exact to the
quantized weights, but not faster; FP8 GEMMs and a GEMV kernel are to come (issue #17).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448

# Per-layer projection weights ([in, out], or [L, in, out] stacked); embeddings, norms, biases
# and the LM head stay in the model dtype.
LINEAR_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "wqkv", "w_gate_up")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Fp8Weight:
    values: jax.Array  # [..., in, out] float8_e4m3fn
    scales: jax.Array  # [..., 1, out] float32: weight = values * scales

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


def quantize_fp8(w: jax.Array) -> Fp8Weight:
    """Per output channel (the last axis): the scale maps the channel's largest |w| to 448."""
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=-2, keepdims=True)
    scales = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    values = jnp.clip(wf / scales, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return Fp8Weight(values, scales)


def dequantize(w: Fp8Weight, dtype=jnp.float32) -> jax.Array:
    return (w.values.astype(jnp.float32) * w.scales).astype(dtype)


def linear(x: jax.Array, w) -> jax.Array:
    """x @ w for a plain weight or an Fp8Weight (values upcast to x's dtype in the matmul)."""
    if isinstance(w, Fp8Weight):
        y = jnp.dot(x, w.values.astype(x.dtype), preferred_element_type=jnp.float32)
        return (y * w.scales[..., 0, :]).astype(x.dtype)
    return x @ w


def quantize_params(params: dict) -> dict:
    """The model's projection weights as Fp8Weight, in either layer layout; each source array
    is dropped as soon as its quantized form exists (the peak is one layer's weights more)."""
    quantize = jax.jit(quantize_fp8)

    def layer(d: dict) -> dict:
        return {k: quantize(v) if k in LINEAR_WEIGHTS else v for k, v in d.items()}

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
