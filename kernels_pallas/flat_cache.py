"""The KV caches as the kernels address them, and the operands every kernel launch shares.

A cache [L, Hkv, NB, bs, D] is reshaped (a bitcast: nothing is copied) to rows
[L * Hkv * NB * bs, D] (the Triton kernels) or pages [L * Hkv * NB, bs, D] (the Mosaic ones).
V pages stored [D, bs] (layout.v_transposed) are viewed as [L * Hkv * NB * D, bs]: row
page * D + d holds dimension d of the page's bs positions.
Page p of (layer, KV head h) is then page (layer * Hkv + h) * NB + p, so a traced `layer` is an
offset a kernel adds (`layer_base`), never a slice of the cache. In the Triton kernels, rows a
program must not touch are pointed past the end of the ref: a masked lane is never touched on
the GPU, and its write is dropped in interpret mode (where a masked lane aliasing a live row
could otherwise write back a stale value).
"""

from __future__ import annotations

import jax.numpy as jnp


def layer_base(layer, num_kv_heads: int):
    """[1] int32 = layer * Hkv: the first (layer, head) page group of `layer` (may be traced)."""
    return (jnp.asarray(layer, jnp.int32) * num_kv_heads).reshape(1)


def kv_scales(k_scale, v_scale):
    """[2] fp32 = (k_scale, v_scale), the per-tensor scales of fp8 caches; 1.0 where None."""
    return jnp.stack(
        [
            jnp.asarray(1.0 if k_scale is None else k_scale, jnp.float32).reshape(()),
            jnp.asarray(1.0 if v_scale is None else v_scale, jnp.float32).reshape(()),
        ]
    )


def row_index(rows, D):
    """(row, col) index arrays [n, D] selecting whole rows of a 2-D ref (gather / scatter)."""
    n = rows.shape[0]
    return (
        jnp.broadcast_to(rows[:, None], (n, D)),
        jnp.broadcast_to(jnp.arange(D, dtype=jnp.int32)[None, :], (n, D)),
    )


def t_row_index(rows, bs, D, d0=0, width=None):
    """(row, col) index arrays [n, width] scattering dimensions [d0, d0 + width) (default all D)
    of rows (numbered as in [.., bs, D] pages; past the end for masked ones, which stay past the
    end) into a [D, bs]-paged V cache viewed as [pages * D, bs]."""
    n = rows.shape[0]
    width = D - d0 if width is None else width
    d = d0 + jnp.arange(width, dtype=jnp.int32)[None, :]
    return (
        jnp.broadcast_to((rows // bs * D)[:, None] + d, (n, width)),
        jnp.broadcast_to((rows % bs)[:, None], (n, width)),
    )
