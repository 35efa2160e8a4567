"""The pieces the Gated DeltaNet kernels share (gated_delta.py, gated_delta_chunk.py): the
state pools' [dk, block_v] blocks, the l2 norm and the dots of a chosen precision."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.gated_delta_ref import L2NORM_EPS

HIGHEST = lax.Precision.HIGHEST


def pow2(x: int) -> bool:
    return x >= 1 and not x & (x - 1)


def l2norm(x):
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1)[..., None] + L2NORM_EPS)


PRECISIONS = ("ieee", "tf32", "bf16")


def mixed_dot(a, b, precision="ieee"):
    """a @ b in f32: IEEE f32 dots, TF32 tensor-core dots, or bf16 operands (as FLA's kernels)."""
    if precision == "bf16":
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        return jnp.dot(a, b, preferred_element_type=jnp.float32)
    p = HIGHEST if precision == "ieee" else lax.Precision.DEFAULT
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=p)


def load_state(st_ref, slot, h, vb, *, Hv, dk, block_v):
    """The [dk, block_v] f32 block of (slot, value head h) from the flat pool [N Hv dk, dv];
    zeros where slot < 0."""
    row = (jnp.maximum(slot, 0) * Hv + h) * dk
    mask = jnp.broadcast_to(slot >= 0, (dk, block_v))
    blk = st_ref.at[pl.ds(row, dk), pl.ds(vb * block_v, block_v)]
    return plt.load(blk, mask=mask, other=0.0).astype(jnp.float32)


def store_state(st_ref, slot, h, vb, value, ok, *, Hv, dk, block_v):
    row = (jnp.maximum(slot, 0) * Hv + h) * dk
    mask = jnp.broadcast_to(ok & (slot >= 0), (dk, block_v))
    blk = st_ref.at[pl.ds(row, dk), pl.ds(vb * block_v, block_v)]
    plt.store(blk, value.astype(st_ref.dtype), mask=mask)
