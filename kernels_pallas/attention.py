"""Ragged paged attention as a Pallas kernel (Triton lowering), and its split-K merge.

One launch serves a flat ragged batch: prefill chunks (with cached context) and decode tokens
of many sequences, causal within each sequence, GQA, optional sliding window, soft cap and fp8
KV pages with per-tensor scales. Which launches a call makes, and which of them go to the
Mosaic GPU kernels instead, is `dispatch.py`'s.

Work decomposition (all static shapes; the data decides which programs do work):

* A *tile* is up to `block_q` consecutive query tokens of ONE sequence (`tiles.py`: its
  metadata, computed with a few jnp ops outside the kernel; the number of tiles is bounded
  statically by min(T, cdiv(T + S * (block_q - 1), block_q)); unused tiles have 0 tokens and
  exit at once).
* grid = (num_kv_heads, num_tiles, k_splits). A program owns one KV head and all of its
  G = Hq / Hkv query heads for the tile's tokens: its query block has M = block_q * G_pad rows
  (row r = token r // G_pad, head r % G_pad), so every K/V page it loads serves all G heads.
* It walks the tile's causal KV range [window start, last query position] in blocks of
  `block_k` positions, gathering rows of the flattened cache
  `[L * Hkv * num_blocks * block_size, D]` through the block table (layer offset included, so a
  traced `layer` costs nothing and the cache is never sliced or copied; `flat_cache.py`), with
  an online softmax in fp32 (exp2 domain; `softmax.py`).
* page_block (block_k == block_size): a KV block is one page, its id read once and K / V
  loaded as contiguous tiles. fp8 caches of 64-token pages store V pages [D, bs]
  (layout.v_transposed), viewed as `[L * Hkv * num_blocks * D, bs]`, and are read this way
  only: the PV product's contraction (positions) is then contiguous, as 8-bit MMA operands
  want it.
* Split-K (flash-decoding): with k_splits > 1 each program takes 1/k_splits of the tile's KV
  blocks and writes un-normalised partials (acc, m, l); a small kernel merges them
  (merge_splits).
* split_mask: the KV blocks that no row of the tile masks run in a mask-free loop (V loaded
  straight into the dot); the diagonal, last and window-edge blocks in a masked one.
* reverse_tiles: programs take tiles last-first (longest causal ranges first).
* Padding tokens are covered by padding tiles (kv_len 0) that store zeros: the kernel writes
  every output row, no masking pass follows.

Why Triton first: the Triton lowering runs unchanged on jax 0.10.2 (CPU CI, interpret mode) and
0.11.2 (the H200), supports gathers through ref indexing (`ref[row_vec]`) which is exactly what
a block table needs, and its CUDA lowering can be checked on a CPU (see `lowering.py`). Decode
stays here: within 2% of FlashAttention-3 or faster on the H200 (kernels_pallas/README.md, run
9). Where the Mosaic GPU kernels take over (prefill and mixed buckets of 512+ tokens on jax
0.11): `dispatch.py`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.flat_cache import kv_scales, row_index
from kernels_pallas.layout import cache_v_transposed, quantize_kv
from kernels_pallas.metadata import AttentionMetadata
from kernels_pallas.softmax import LOG2E, MASK_VALUE, P_LOG2_GAIN
from kernels_pallas.tuning import next_pow2


def _rpa_kernel(
    meta_ref,
    bt_ref,
    scal_ref,
    fscal_ref,
    q_ref,
    k_ref,
    v_ref,
    *out_refs,
    T,
    Hq,
    Hkv,
    G,
    G_pad,
    NB,
    bs,
    P,
    block_q,
    block_k,
    k_splits,
    sm_scale,
    sliding_window,
    soft_cap,
    compute_dtype,
    pv_split,
    split_mask,
    reverse_tiles,
    pv_fp16,
    page_block,
    v_dn,
    num_tiles,
    has_out_in,
):
    if has_out_in:  # the output buffer passed in (aliased): rows this launch does not own
        out_refs = out_refs[1:]
    h = pl.program_id(0)
    j = pl.program_id(1)
    if reverse_tiles:
        j = num_tiles - 1 - j
    sp = pl.program_id(2)
    M = block_q * G_pad

    seq = meta_ref[j, 0]
    q_start = meta_ref[j, 1]
    q_len = meta_ref[j, 2]
    pos0 = meta_ref[j, 3]
    kv_len = meta_ref[j, 4]
    head_base = (scal_ref[0] + h) * NB  # first page of (layer, head) in the flat cache
    k_scale = fscal_ref[0]
    v_scale = fscal_ref[1]

    D = q_ref.shape[1]
    r = jnp.arange(M, dtype=jnp.int32)
    tok = r // G_pad
    g = r % G_pad
    row_ok = (tok < q_len) & (g < G)
    q_rows = jnp.where(row_ok, (q_start + tok) * Hq + h * G + jnp.minimum(g, G - 1), 0)
    q = q_ref[q_rows]  # [M, D]
    q = quantize_kv(jnp.where(row_ok[:, None], q, 0), compute_dtype)  # (fp16: clamped)
    q_pos = pos0 + tok  # [M]

    # KV range of the tile: causal end at its last query, sliding-window start at its first.
    kv_hi = jnp.where(q_len > 0, jnp.minimum(kv_len, pos0 + q_len), 0)
    if sliding_window is not None:
        kv_lo = jnp.maximum(pos0 - (sliding_window - 1), 0)
    else:
        kv_lo = 0
    blk_lo = kv_lo // block_k
    blk_hi = (kv_hi + block_k - 1) // block_k
    n_blk = jnp.maximum(blk_hi - blk_lo, 0)
    if k_splits > 1:
        per = (n_blk + k_splits - 1) // k_splits
        b0 = blk_lo + sp * per
        b1 = jnp.minimum(b0 + per, blk_hi)
    else:
        b0, b1 = blk_lo, blk_hi

    scale = sm_scale * k_scale
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    # The PV product's operand dtype: fp16 when asked for (pv_fp16) or when the V pages are fp16
    # already (bf16 models' caches, layout.value_cache_dtype): P then keeps 11 significant
    # bits in one dot, with no conversion of V.
    if compute_dtype == jnp.float32:
        pv_dtype = jnp.float32
    elif pv_fp16 or v_ref.dtype == jnp.float16:
        pv_dtype = jnp.float16
    else:
        pv_dtype = compute_dtype
    pv_two_parts = pv_split and not pv_fp16 and pv_dtype != jnp.float32
    k_is_compute = k_ref.dtype == compute_dtype
    v_is_fp8 = v_ref.dtype.itemsize == 1

    def body(b, carry, masked):
        acc, m_prev, l_prev = carry
        kv = b * block_k + jnp.arange(block_k, dtype=jnp.int32)  # absolute KV positions
        kv_ok = kv < kv_len
        if page_block:
            # block_k == bs: a block is one page, its id a scalar, K / V contiguous tiles.
            page = (head_base + bt_ref[seq * P + jnp.minimum(b, P - 1)]) * bs
            k = k_ref[pl.ds(page, bs), :]
        else:
            page = bt_ref[seq * P + jnp.minimum(kv // bs, P - 1)]
            rows = (head_base + page) * bs + kv % bs
            k = k_ref[rows]  # [block_k, D]
        if not k_is_compute:
            k = k.astype(compute_dtype)
        if page_block:
            if v_dn:  # V pages stored [D, bs]: positions (the PV contraction) contiguous
                v = v_ref[pl.ds(page // bs * D, D), :]
            else:
                v = v_ref[pl.ds(page, bs), :]
            if masked:
                v = jnp.where(
                    (kv_ok[None, :] if v_dn else kv_ok[:, None]),
                    v.astype(compute_dtype) if v_is_fp8 else v,
                    0,
                )
            if v_dn:
                v = v.T
        elif masked:
            # V rows past kv_len may hold anything (NaN bit patterns too): load zeros there, since
            # p == 0 would still give 0 * NaN = NaN in the PV product.
            # (fp8: the Triton lowering cannot make an fp8 `other`, so zero after the upcast.)
            if v_is_fp8:
                v = jnp.where(kv_ok[:, None], v_ref[rows].astype(compute_dtype), 0)
            else:
                v = plt.load(
                    v_ref.at[row_index(rows, D)],
                    mask=jnp.broadcast_to(kv_ok[:, None], (block_k, D)),
                    other=0.0,
                )
        else:
            v = v_ref[rows]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32, precision=precision)
        if soft_cap is not None:
            s = jnp.tanh(s * (scale / soft_cap)) * (soft_cap * LOG2E)
        else:
            s = s * (scale * LOG2E)
        if masked:
            mask = (kv[None, :] <= q_pos[:, None]) & kv_ok[None, :]
            if sliding_window is not None:
                mask &= kv[None, :] > (q_pos[:, None] - sliding_window)
            s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_prev - m_new)
        p = jnp.exp2(s - (m_new - P_LOG2_GAIN)[:, None])  # (softmax.P_LOG2_GAIN)
        l_new = l_prev * alpha + jnp.sum(p, axis=1)
        if v.dtype != pv_dtype:
            # (fp16 has 11 significant bits, bf16 8: P's rounding error drops 8x in one dot. A bf16
            # V is clamped first, so an outlier cannot become inf.)
            v = quantize_kv(v, pv_dtype)
        p_hi = p.astype(pv_dtype)
        pv = jnp.dot(p_hi, v, preferred_element_type=jnp.float32, precision=precision)
        if pv_two_parts:
            # P = hi + lo in two 16-bit parts: the PV product keeps ~16 (bf16) or ~22 (fp16)
            # mantissa bits of P (a bf16 P alone costs ~1e-3 relative error on averaged, cancelling
            # V rows).
            p_lo = (p - p_hi.astype(jnp.float32)).astype(pv_dtype)
            pv += jnp.dot(p_lo, v, preferred_element_type=jnp.float32)
        acc = acc * alpha[:, None] + pv
        return acc, m_new, l_new

    masked_body = functools.partial(body, masked=True)
    carry = (
        jnp.zeros((M, D), jnp.float32),
        jnp.full((M,), MASK_VALUE, jnp.float32),
        jnp.zeros((M,), jnp.float32),
    )
    if split_mask:
        # Blocks [i0, i1) need no mask: every kv < pos0 + 1 <= kv_len is causal-visible to all
        # rows (full_hi), and (window) every kv > last query position - window (full_lo).
        # Padding rows of the tile (q = 0) see finite K/V there and are never stored.
        full_hi = (pos0 + 1) // block_k
        if sliding_window is not None:
            x = pos0 + q_len - 1 - sliding_window
            full_lo = jnp.where(x >= 0, jnp.maximum(x, 0) // block_k + 1, 0)
            i0 = jnp.minimum(jnp.maximum(full_lo, b0), b1)
            carry = lax.fori_loop(b0, i0, masked_body, carry)
        else:
            i0 = b0
        i1 = jnp.minimum(jnp.maximum(full_hi, i0), b1)
        carry = lax.fori_loop(i0, i1, functools.partial(body, masked=False), carry)
        carry = lax.fori_loop(i1, b1, masked_body, carry)
    else:
        carry = lax.fori_loop(b0, b1, masked_body, carry)
    acc, m_i, l_i = carry

    # Masked-out rows point past the end: never touched on the GPU, dropped in interpret mode
    # (where a masked lane aliasing a live row could otherwise write back a stale value).
    store_mask = jnp.broadcast_to(row_ok[:, None], (M, D))
    if k_splits == 1:
        (o_ref,) = out_refs
        o = acc * (v_scale / jnp.where(l_i > 0, l_i, 1.0))[:, None]
        out_rows = jnp.where(row_ok, q_rows, o_ref.shape[0])
        plt.store(o_ref.at[row_index(out_rows, D)], o.astype(o_ref.dtype), mask=store_mask)
    else:
        o_ref, m_ref, l_ref = out_refs
        part_rows = jnp.where(row_ok, sp * (T * Hq) + q_rows, o_ref.shape[0])
        plt.store(o_ref.at[row_index(part_rows, D)], acc * v_scale, mask=store_mask)
        plt.store(m_ref.at[part_rows], m_i, mask=row_ok)
        plt.store(l_ref.at[part_rows], l_i, mask=row_ok)


def compute_dtype_for(q_dtype, kv_dtype):
    """The dtype of the kernel's dot operands: f32 for f32 queries, fp16 over fp8 pages, else the
    queries' own. An e4m3 value converts to fp16 in one instruction per pair (sm89+: cvt
    f16x2.e4m3x2) but to bf16 only through f32: on the H200 the bf16 path read fp8 pages at
    ~1.5 TB/s where bf16 pages go at ~4 (gpu_2026-12-01_fp8_engine). fp16 holds every e4m3
    value exactly, and bf16 queries beyond its range are clamped (layout.quantize_kv)."""
    if jnp.dtype(q_dtype) == jnp.float32:
        return jnp.dtype(jnp.float32)
    if jnp.dtype(kv_dtype).itemsize == 1:
        return jnp.dtype(jnp.float16)
    return jnp.dtype(q_dtype)


def triton_attention(
    q,
    k_cache,
    v_cache,
    md: AttentionMetadata,
    bt_flat,
    kv_base,
    tun,
    meta,
    num_tiles: int,
    *,
    sm_scale,
    sliding_window=None,
    soft_cap=None,
    k_scale=None,
    v_scale=None,
    interpret=False,
    out_in=None,
):
    """One launch of the kernel over the tiles of `meta` ([num_tiles, 8], `tiles.py`) with the
    static choices of `tun` (a `Tuning`). q [T, Hq, D]; caches [L, Hkv, NB, bs, D]; bt_flat
    [S * P] int32 block tables; kv_base [1] (`flat_cache.layer_base`).

    Returns a list: k_splits == 1, [out [T * Hq, D]] (rows of no tile unwritten, or, with
    `out_in` [T * Hq, D], kept from it: the launch writes into that buffer in place); else the
    partials [acc [k * T * Hq, D], m, l [k * T * Hq]] (fp32) for `merge_splits`.
    """
    T, Hq, D = q.shape
    L, Hkv, NB, bs, _ = k_cache.shape
    P = md.block_tables.shape[1]
    G = Hq // Hkv
    v_dn = cache_v_transposed(k_cache, v_cache)  # V pages [D, bs] (layout.v_transposed)
    assert not tun.page_block or tun.block_k == bs, "page_block needs block_k == block_size"
    assert tun.page_block or not v_dn, "[D, bs] V pages are read a page per block (page_block)"
    kernel = functools.partial(
        _rpa_kernel,
        T=T,
        Hq=Hq,
        Hkv=Hkv,
        G=G,
        G_pad=next_pow2(G),
        NB=NB,
        bs=bs,
        P=P,
        block_q=tun.block_q,
        block_k=tun.block_k,
        k_splits=tun.k_splits,
        sm_scale=float(sm_scale),
        sliding_window=None if sliding_window is None else int(sliding_window),
        soft_cap=None if soft_cap is None else float(soft_cap),
        compute_dtype=compute_dtype_for(q.dtype, k_cache.dtype),
        pv_split=bool(tun.pv_split),
        split_mask=bool(tun.split_mask),
        reverse_tiles=bool(tun.reverse_tiles),
        pv_fp16=bool(tun.pv_fp16),
        page_block=bool(tun.page_block),
        v_dn=bool(v_dn),
        num_tiles=num_tiles,
        has_out_in=out_in is not None,
    )
    if tun.k_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((T * Hq, D), q.dtype)]
    else:
        n = tun.k_splits * T * Hq
        out_shape = [
            jax.ShapeDtypeStruct((n, D), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.float32),
        ]
    rows = L * Hkv * NB * bs
    args = (
        meta,
        bt_flat,
        kv_base,
        kv_scales(k_scale, v_scale),
        q.reshape(T * Hq, D),
        k_cache.reshape(rows, D),
        v_cache.reshape(rows // bs * D, bs) if v_dn else v_cache.reshape(rows, D),
    )
    if out_in is not None:
        args += (out_in,)
    return pl.pallas_call(
        kernel,
        grid=(Hkv, num_tiles, tun.k_splits),
        out_shape=out_shape,
        input_output_aliases={7: 0} if out_in is not None else {},
        compiler_params=plt.CompilerParams(num_warps=tun.num_warps, num_stages=tun.num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_q{tun.block_q}_k{tun.block_k}_s{tun.k_splits}",
    )(*args)


def merge_splits(acc, m, l, dtype, interpret=False, rows=None):
    """Split-K partials -> output rows: acc [k, R, D] (un-normalised), m and l [k, R] (running
    max and sum, exp2 domain; an empty split has m = MASK_VALUE, l = 0) -> [R, D] in dtype.

    One small Pallas kernel: as jnp, XLA took 2-4 kernels a call for it (H200, decode B=1 ctx
    8192: 4.6 us a layer beside an 11.5 us attention kernel, as a max-then-weighted-sum or as
    one variadic reduction). `rows` per program: by default 1 on the GPU, where a program per
    (row, 32 columns) in one warp has each thread load its k values at once (the merge is
    latency-bound: a program per 32 rows took 13.6 us at B=1, this 1.65 us); in interpret mode
    the largest power of two dividing R up to 256, with whole rows (interpret mode runs the
    programs one by one, each copying the buffers, so many small ones cost seconds)."""
    k, R, D = acc.shape
    if rows is None:
        rows = math.gcd(R, 256) if interpret else 1
    cols = 32 if rows == 1 and D % 32 == 0 else D
    return pl.pallas_call(
        functools.partial(_merge_kernel, k=k),
        grid=(R // rows, D // cols),
        in_specs=[
            pl.BlockSpec((k, rows, cols), lambda i, j: (0, i, j)),
            pl.BlockSpec((k, rows), lambda i, j: (0, i)),
            pl.BlockSpec((k, rows), lambda i, j: (0, i)),
        ],
        out_specs=pl.BlockSpec((rows, cols), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((R, D), dtype),
        compiler_params=plt.CompilerParams(num_warps=1 if rows == 1 else 4, num_stages=1),
        interpret=interpret,
        name="merge_splits",
    )(acc, m, l)


def _merge_kernel(acc_ref, m_ref, l_ref, o_ref, *, k):
    m = m_ref[0, :]
    l = l_ref[0, :]
    acc = acc_ref[0, :, :]
    for s in range(1, k):  # the online-softmax merge, split by split (k is small)
        m_s = m_ref[s, :]
        m_new = jnp.maximum(m, m_s)
        a, b = jnp.exp2(m - m_new), jnp.exp2(m_s - m_new)
        l = l * a + l_ref[s, :] * b
        acc = acc * a[:, None] + acc_ref[s, :, :] * b[:, None]
        m = m_new
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
