"""Ragged paged attention in plain XLA ops: the engine's fast path where there is no GPU.

The oracle (`reference.py`) gathers a sequence's whole block-table row for every query token,
so its cost grows with max_model_len. This version follows the kernel's plan instead: query
tokens are cut into tiles of one sequence each (`tile_metadata`), and a loop walks the KV in
chunks of pages only as far as the longest tile's causal end, with an online softmax. The cost
follows the real context, and each gathered page serves a whole tile of queries.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kernels_pallas.layout import cache_v_transposed
from kernels_pallas.metadata import AttentionMetadata
from kernels_pallas.tiles import tile_count, tile_metadata

_HI = lax.Precision.HIGHEST


def xla_ragged_paged_attention(
    q,
    k_cache,
    v_cache,
    layer,
    md: AttentionMetadata,
    *,
    sm_scale,
    sliding_window=None,
    soft_cap=None,
    k_scale=None,
    v_scale=None,
    block_q: int | None = None,
    pages_per_chunk: int = 8,
    **unused,
):
    T, Hq, D = q.shape
    _, Hkv, _, bs, _ = k_cache.shape
    v_t = cache_v_transposed(k_cache, v_cache)
    G = Hq // Hkv
    S, P = md.block_tables.shape
    if block_q is None:  # decode-shaped buckets hold one token per sequence: tiles of one
        block_q = 1 if T <= 2 * S else 16
    NT = tile_count(T, S, block_q)  # enough tiles for any ragged batch
    meta = tile_metadata(md, T, block_q, NT)
    seq, q_start, q_len, pos0, kv_len = (meta[:, i] for i in range(5))
    i = jnp.arange(block_q, dtype=jnp.int32)
    q_ok = i[None, :] < q_len[:, None]  # [NT, Q]
    rows = jnp.where(q_ok, q_start[:, None] + i[None, :], T)  # T = out of range
    qt = q.at[rows].get(mode="fill", fill_value=0).astype(jnp.float32)
    qt = qt.reshape(NT, block_q, Hkv, G, D) * sm_scale
    q_pos = pos0[:, None] + i[None, :]  # [NT, Q]
    kv_hi = jnp.where(q_len > 0, jnp.minimum(kv_len, pos0 + q_len), 0)  # causal end per tile

    C = pages_per_chunk * bs
    n_chunks = (jnp.max(kv_hi) + C - 1) // C
    tables = jnp.pad(md.block_tables, ((0, 0), (0, pages_per_chunk)))[seq]  # [NT, P + ppc]
    ks = 1.0 if k_scale is None else jnp.asarray(k_scale, jnp.float32)
    vs = 1.0 if v_scale is None else jnp.asarray(v_scale, jnp.float32)

    def chunk(c, carry):
        m, l, acc = carry
        pages = lax.dynamic_slice_in_dim(tables, c * pages_per_chunk, pages_per_chunk, axis=1)
        # [NT, ppc, Hkv, bs, D] straight from the whole cache (no per-layer copy)
        k = k_cache[layer, :, pages].astype(jnp.float32) * ks
        v = v_cache[layer, :, pages].astype(jnp.float32) * vs
        v = v.swapaxes(3, 4) if v_t else v  # [D, bs] pages (layout.v_transposed)
        k = k.transpose(0, 2, 1, 3, 4).reshape(NT, Hkv, C, D)
        v = v.transpose(0, 2, 1, 3, 4).reshape(NT, Hkv, C, D)
        s = jnp.einsum("tqhgd,thkd->thgqk", qt, k, precision=_HI)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kpos = c * C + jnp.arange(C, dtype=jnp.int32)
        mask = (kpos[None, None, :] <= q_pos[:, :, None]) & (
            kpos[None, None, :] < kv_len[:, None, None]
        )
        if sliding_window is not None:
            mask &= kpos[None, None, :] > q_pos[:, :, None] - sliding_window
        mask &= q_ok[:, :, None]
        s = jnp.where(mask[:, None, None], s, -jnp.inf)  # [NT, Hkv, G, Q, C]
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - safe[..., None])
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - safe, -jnp.inf))
        l = alpha * l + jnp.sum(p, axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("thgqk,thkd->thgqd", p, v, precision=_HI)
        return m_new, l, acc

    init = (
        jnp.full((NT, Hkv, G, block_q), -jnp.inf, jnp.float32),
        jnp.zeros((NT, Hkv, G, block_q), jnp.float32),
        jnp.zeros((NT, Hkv, G, block_q, D), jnp.float32),
    )
    _, l, acc = lax.fori_loop(0, n_chunks, chunk, init)
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [NT, Hkv, G, Q, D]
    o = o.transpose(0, 3, 1, 2, 4).reshape(NT * block_q, Hq, D)
    out = jnp.zeros((T, Hq, D), jnp.float32).at[rows.reshape(-1)].set(o, mode="drop")
    return out.astype(q.dtype)
