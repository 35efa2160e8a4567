"""Ragged paged attention as a Pallas kernel (Triton lowering).

One call serves a flat ragged batch: prefill chunks (with cached context) and decode tokens of
many sequences, causal within each sequence, GQA, optional sliding window, soft cap and fp8 KV
pages with per-tensor scales.

Work decomposition (all static shapes; the data decides which programs do work):

* A *tile* is up to `block_q` consecutive query tokens of ONE sequence. Tile metadata
  (sequence, first token, token count, first position, KV length) is computed with a few jnp
  ops outside the kernel; the number of tiles is bounded statically by
  min(T, cdiv(T + S * (block_q - 1), block_q)); unused tiles have 0 tokens and exit at once.
* grid = (num_kv_heads, num_tiles, k_splits). A program owns one KV head and all of its
  G = Hq / Hkv query heads for the tile's tokens: its query block has M = block_q * G_pad rows
  (row r = token r // G_pad, head r % G_pad), so every K/V page it loads serves all G heads.
* It walks the tile's causal KV range [window start, last query position] in blocks of
  `block_k` positions, gathering rows of the flattened cache
  `[L * Hkv * num_blocks * block_size, D]` through the block table (layer offset included, so a
  traced `layer` costs nothing and the cache is never sliced or copied), with an online
  softmax in fp32 (exp2 domain).
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
a block table needs, and its CUDA lowering can be checked on a CPU (see `lowering.py`). On jax
0.11, prefill and mixed buckets of 512+ tokens go through the Mosaic GPU kernel
(attention_mgpu.py, FA3-style, persistent), which measured 1.15-1.9x faster there; decode
stays here: within 2% of FlashAttention-3 or faster on the H200 (kernels_pallas/README.md, run
9); the Mosaic decode kernel, attention_mgpu_decode.py, is opt-in (it measured 0-11% slower at
B >= 8).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas import attention_mgpu
from kernels_pallas import attention_mgpu_decode as mgpu_decode
from kernels_pallas.layout import quantize_kv, value_cache_dtype
from kernels_pallas.metadata import AttentionMetadata, count_le, live_query_lens
from kernels_pallas.softmax import LOG2E, MASK_VALUE, P_LOG2_GAIN
from kernels_pallas.tuning import is_decode_bucket, next_pow2, plan_launches


def tile_count(T: int, S: int, block_q: int) -> int:
  """Tiles of up to block_q tokens of one sequence that any ragged batch of T tokens in S
  sequence slots can need (see tile_metadata)."""
  return max(1, min(T, -(-(T + S * (block_q - 1)) // block_q)))


def tile_metadata(md: AttentionMetadata, num_tokens: int, block_q: int, num_tiles: int,
                  pad_tiles: bool = False, min_q_len: int = 1):
  """[num_tiles, 8] int32: seq, first token, tokens in tile, first position, kv_len, 0, 0, 0.

  Unused tiles have 0 tokens. Sequences with fewer than `min_q_len` query tokens get no tile.
  pad_tiles=True (the kernel): tiles past the live sequences' tiles cover the padding tokens
  [qsl[num_seqs], T) with kv_len 0: their programs run no KV step and store zeros, so every
  output row is written by the kernel (no masking pass afterwards). There are always enough of
  them: with
  num_tiles = cdiv(T + S (block_q - 1), block_q) the unused tiles span >= T - live tokens rows;
  with num_tiles = T, each used tile holds >= 1 live token.
  """
  qsl = md.query_start_loc
  S = md.seq_lens.shape[0]
  q_lens = live_query_lens(md, min_q_len)
  n_tiles = (q_lens + block_q - 1) // block_q
  cum = jnp.cumsum(n_tiles)
  j = jnp.arange(num_tiles, dtype=jnp.int32)
  s = jnp.minimum(count_le(cum, j), S - 1)
  local = j - (cum[s] - n_tiles[s])
  valid = j < cum[-1]
  q_start = qsl[s] + local * block_q
  q_len = jnp.clip(qsl[s] + q_lens[s] - q_start, 0, block_q)
  kv_len = md.seq_lens[s]
  pos0 = kv_len - q_lens[s] + local * block_q
  if not pad_tiles:
    q_start = jnp.where(valid, q_start, 0)
    q_len = jnp.where(valid, q_len, 0)
    z = jnp.zeros_like(j)
    return jnp.stack([s, q_start, q_len, pos0, kv_len, z, z, z], axis=1).astype(jnp.int32)
  n_live = qsl[md.num_seqs[0]]
  pad_start = n_live + (j - cum[-1]) * block_q
  q_start = jnp.where(valid, q_start, jnp.minimum(pad_start, num_tokens))
  q_len = jnp.where(valid, q_len, jnp.clip(num_tokens - pad_start, 0, block_q))
  pos0 = jnp.where(valid, pos0, 0)
  kv_len = jnp.where(valid, kv_len, 0)
  z = jnp.zeros_like(j)
  return jnp.stack([s, q_start, q_len, pos0, kv_len, z, z, z], axis=1).astype(jnp.int32)


def decode_tile_metadata(md: AttentionMetadata, block_q: int):
  """[S, 8] like tile_metadata: one tile per sequence slot holding all of its query tokens if
  it has at most block_q of them (decode), else none (0 tokens)."""
  qsl = md.query_start_loc
  S = md.seq_lens.shape[0]
  s = jnp.arange(S, dtype=jnp.int32)
  q_lens = live_query_lens(md)
  q_len = jnp.where(q_lens <= block_q, q_lens, 0)
  z = jnp.zeros_like(s)
  return jnp.stack([s, qsl[:-1], q_len, md.seq_lens - q_lens, md.seq_lens, z, z, z],
                   axis=1).astype(jnp.int32)


def _row_index(rows, D):
  """(row, col) index arrays [n, D] selecting whole rows of a 2-D ref (gather / scatter)."""
  n = rows.shape[0]
  return (jnp.broadcast_to(rows[:, None], (n, D)),
          jnp.broadcast_to(jnp.arange(D, dtype=jnp.int32)[None, :], (n, D)))


def _rpa_kernel(meta_ref, bt_ref, scal_ref, fscal_ref, q_ref, k_ref, v_ref, *out_refs,
                T, Hq, Hkv, G, G_pad, NB, bs, P, block_q, block_k, k_splits, sm_scale,
                sliding_window, soft_cap, compute_dtype, pv_split, split_mask, reverse_tiles,
                pv_fp16, num_tiles, has_out_in):
  if has_out_in:       # the output buffer passed in (aliased): rows this launch does not own
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
  head_base = (scal_ref[0] + h) * NB            # first page of (layer, head) in the flat cache
  k_scale = fscal_ref[0]
  v_scale = fscal_ref[1]

  D = q_ref.shape[1]
  r = jnp.arange(M, dtype=jnp.int32)
  tok = r // G_pad
  g = r % G_pad
  row_ok = (tok < q_len) & (g < G)
  q_rows = jnp.where(row_ok, (q_start + tok) * Hq + h * G + jnp.minimum(g, G - 1), 0)
  q = q_ref[q_rows]                                              # [M, D]
  q = jnp.where(row_ok[:, None], q, 0).astype(compute_dtype)
  q_pos = pos0 + tok                                             # [M]

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
    kv = b * block_k + jnp.arange(block_k, dtype=jnp.int32)      # absolute KV positions
    page = bt_ref[seq * P + jnp.minimum(kv // bs, P - 1)]
    rows = (head_base + page) * bs + kv % bs
    k = k_ref[rows]                                               # [block_k, D]
    if not k_is_compute:
      k = k.astype(compute_dtype)
    if masked:
      # V rows past kv_len may hold anything (NaN bit patterns too): load zeros there, since
      # p == 0 would still give 0 * NaN = NaN in the PV product.
      # (fp8: the Triton lowering cannot make an fp8 `other`, so zero after the upcast.)
      kv_ok = kv < kv_len
      if v_is_fp8:
        v = jnp.where(kv_ok[:, None], v_ref[rows].astype(compute_dtype), 0)
      else:
        v = plt.load(v_ref.at[_row_index(rows, D)],
                     mask=jnp.broadcast_to(kv_ok[:, None], (block_k, D)), other=0.0)
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
    p = jnp.exp2(s - (m_new - P_LOG2_GAIN)[:, None])          # (softmax.P_LOG2_GAIN)
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
  carry = (jnp.zeros((M, D), jnp.float32), jnp.full((M,), MASK_VALUE, jnp.float32),
           jnp.zeros((M,), jnp.float32))
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
    plt.store(o_ref.at[_row_index(out_rows, D)], o.astype(o_ref.dtype), mask=store_mask)
  else:
    o_ref, m_ref, l_ref = out_refs
    part_rows = jnp.where(row_ok, sp * (T * Hq) + q_rows, o_ref.shape[0])
    plt.store(o_ref.at[_row_index(part_rows, D)], acc * v_scale, mask=store_mask)
    plt.store(m_ref.at[part_rows], m_i, mask=row_ok)
    plt.store(l_ref.at[part_rows], l_i, mask=row_ok)


def ragged_paged_attention(q, k_cache, v_cache, layer, md: AttentionMetadata, *, sm_scale,
                           sliding_window=None, soft_cap=None, k_scale=None, v_scale=None,
                           interpret=False, block_q=None, block_k=None, k_splits=None,
                           num_warps=None, num_stages=None, pv_split=None, split_mask=None,
                           reverse_tiles=None, pv_fp16=None, mixed_split=None, mosaic=None,
                           mosaic_block_k=None, mosaic_stages=None, mosaic_persistent=None,
                           mosaic_schedule=None, mosaic_decode=None, mosaic_decode_wgs=None,
                           num_sms=132):
  """Pallas ragged paged attention. q [T, Hq, D]; caches [L, Hkv, NB, bs, D] -> [T, Hq, D].

  `layer` may be a traced int32 scalar. fp8 caches are dequantized in-kernel with the
  per-tensor `k_scale` / `v_scale` (Python floats or scalar arrays). Tuning fields left None
  come from `default_tuning`.
  """
  T, Hq, D = q.shape
  L, Hkv, NB, bs, Dk = k_cache.shape
  assert Dk == D and v_cache.shape == k_cache.shape and Hq % Hkv == 0
  # V pages are K's dtype or the engine's choice for it (fp16 under bf16), never another mix.
  assert v_cache.dtype in (k_cache.dtype, value_cache_dtype(k_cache.dtype)), (k_cache.dtype,
                                                                             v_cache.dtype)
  S, P = md.block_tables.shape
  G = Hq // Hkv
  G_pad = next_pow2(G)
  tun, dtun = plan_launches(T, S, Hq, Hkv, D, bs, num_sms, block_q=block_q, block_k=block_k,
                            k_splits=k_splits, num_warps=num_warps, num_stages=num_stages,
                            pv_split=pv_split, split_mask=split_mask,
                            reverse_tiles=reverse_tiles, pv_fp16=pv_fp16,
                            mixed_split=mixed_split, mosaic=mosaic,
                            mosaic_block_k=mosaic_block_k, mosaic_stages=mosaic_stages,
                            mosaic_persistent=mosaic_persistent,
                            mosaic_schedule=mosaic_schedule, mosaic_decode=mosaic_decode,
                            mosaic_decode_wgs=mosaic_decode_wgs)
  num_tiles = tile_count(T, S, tun.block_q)

  compute_dtype = jnp.float32 if q.dtype == jnp.float32 else q.dtype
  bt_flat = md.block_tables.reshape(S * P).astype(jnp.int32)
  scal = (jnp.asarray(layer, jnp.int32) * Hkv).reshape(1)
  fscal = jnp.stack([jnp.asarray(1.0 if k_scale is None else k_scale, jnp.float32).reshape(()),
                     jnp.asarray(1.0 if v_scale is None else v_scale, jnp.float32).reshape(())])
  q2 = q.reshape(T * Hq, D)
  k2 = k_cache.reshape(L * Hkv * NB * bs, D)
  v2 = v_cache.reshape(L * Hkv * NB * bs, D)

  def launch(tun, meta, num_tiles, out_in=None):
    kernel = functools.partial(
        _rpa_kernel, T=T, Hq=Hq, Hkv=Hkv, G=G, G_pad=G_pad, NB=NB, bs=bs, P=P,
        block_q=tun.block_q, block_k=tun.block_k, k_splits=tun.k_splits,
        sm_scale=float(sm_scale),
        sliding_window=None if sliding_window is None else int(sliding_window),
        soft_cap=None if soft_cap is None else float(soft_cap), compute_dtype=compute_dtype,
        pv_split=bool(tun.pv_split), split_mask=bool(tun.split_mask),
        reverse_tiles=bool(tun.reverse_tiles), pv_fp16=bool(tun.pv_fp16), num_tiles=num_tiles,
        has_out_in=out_in is not None)
    if tun.k_splits == 1:
      out_shape = [jax.ShapeDtypeStruct((T * Hq, D), q.dtype)]
    else:
      n = tun.k_splits * T * Hq
      out_shape = [jax.ShapeDtypeStruct((n, D), jnp.float32),
                   jax.ShapeDtypeStruct((n,), jnp.float32),
                   jax.ShapeDtypeStruct((n,), jnp.float32)]
    args = (meta, bt_flat, scal, fscal, q2, k2, v2)
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

  # Interpret mode takes a Mosaic kernel only when asked for by name: GPU interpret mode is
  # slow, and needs more CPU threads than a small machine has (tests/kernels/conftest.py).
  def decode_by_mosaic(t):
    return (t.mosaic_decode and (mosaic_decode or not interpret)
            and mgpu_decode.decode_eligible(q.dtype, k_cache.dtype, v_cache.dtype, Hq, Hkv, D,
                                            bs, t.mosaic_block_k, t.mosaic_stages,
                                            t.mosaic_decode_wgs, t.k_splits,
                                            sliding_window=sliding_window,
                                            soft_cap=soft_cap, k_scale=k_scale,
                                            v_scale=v_scale))

  mosaic_decode_args = (q, k_cache, v_cache, md, scal, bt_flat)
  if is_decode_bucket(T, S) and decode_by_mosaic(tun):
    return _mosaic_decode_launch(*mosaic_decode_args, tun, per_slot=False,
                                 sm_scale=sm_scale, interpret=interpret).reshape(T, Hq, D)
  if (tun.mosaic and (mosaic or not interpret) and tun.k_splits == 1
      and attention_mgpu.mosaic_eligible(q.dtype, k_cache.dtype, v_cache.dtype, D, bs,
                                         tun.mosaic_block_k,
                                         sliding_window=sliding_window, soft_cap=soft_cap,
                                         k_scale=k_scale, v_scale=v_scale)):
    return _mosaic_main_launch(q, k_cache, v_cache, md, scal, bt_flat, tun, dtun, launch,
                               sm_scale=sm_scale, interpret=interpret)
  if dtun is not None:
    if decode_by_mosaic(dtun):
      o = _mosaic_decode_launch(*mosaic_decode_args, dtun, per_slot=True, sm_scale=sm_scale,
                                interpret=interpret)
      decode_q = mgpu_decode.decode_block_q(Hq, Hkv)
    else:
      o = launch(dtun, decode_tile_metadata(md, dtun.block_q), S)[0]
      decode_q = dtun.block_q
    meta = tile_metadata(md, T, tun.block_q, num_tiles, pad_tiles=True,
                         min_q_len=decode_q + 1)
    outs = launch(tun, meta, num_tiles, out_in=o)
  else:
    outs = launch(tun, tile_metadata(md, T, tun.block_q, num_tiles, pad_tiles=True), num_tiles)

  if tun.k_splits == 1:
    out = outs[0].reshape(T, Hq, D)
  else:
    acc, m, l = (x.reshape(tun.k_splits, T * Hq, *x.shape[1:]) for x in outs)
    out = merge_splits(acc, m, l, q.dtype, interpret=interpret).reshape(T, Hq, D)
  # Padding tokens: written as zeros by the kernel's padding tiles (see tile_metadata).
  return out


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
      in_specs=[pl.BlockSpec((k, rows, cols), lambda i, j: (0, i, j)),
                pl.BlockSpec((k, rows), lambda i, j: (0, i)),
                pl.BlockSpec((k, rows), lambda i, j: (0, i))],
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
  for s in range(1, k):       # the online-softmax merge, split by split (k is small)
    m_s = m_ref[s, :]
    m_new = jnp.maximum(m, m_s)
    a, b = jnp.exp2(m - m_new), jnp.exp2(m_s - m_new)
    l = l * a + l_ref[s, :] * b
    acc = acc * a[:, None] + acc_ref[s, :, :] * b[:, None]
    m = m_new
  o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def _mosaic_main_launch(q, k_cache, v_cache, md, scal, bt_flat, tun, dtun, launch, *, sm_scale,
                        interpret):
  """The main launch through attention_mgpu; a mixed bucket's decode rows then go through the
  Triton decode launch (`dtun`), which writes them into the Mosaic kernel's output in place."""
  T, Hq, D = q.shape
  L, Hkv, NB, bs, _ = k_cache.shape
  S, P = md.block_tables.shape
  nt = attention_mgpu.mosaic_num_tiles(T, S)
  meta = attention_mgpu.mosaic_tile_metadata(md, T, nt,
                                             min_q_len=1 if dtun is None else dtun.block_q + 1)
  out = attention_mgpu.mosaic_prefill_attention(
      q, k_cache.reshape(L * Hkv * NB, bs, D), v_cache.reshape(L * Hkv * NB, bs, D), meta,
      bt_flat, scal, num_tiles=nt, NB=NB, P=P, Hkv=Hkv, sm_scale=sm_scale,
      block_kv=tun.mosaic_block_k, stages=tun.mosaic_stages, persistent=tun.mosaic_persistent,
      schedule=tun.mosaic_schedule,
      interpret=interpret)
  if dtun is not None:
    out = launch(dtun, decode_tile_metadata(md, dtun.block_q), S,
                 out_in=out.reshape(T * Hq, D))[0].reshape(T, Hq, D)
  return out


def _mosaic_decode_launch(q, k_cache, v_cache, md, scal, bt_flat, tun, *, per_slot, sm_scale,
                          interpret):
  """A decode launch through attention_mgpu_decode -> [T * Hq, D]. per_slot: a mixed bucket's
  first launch (one tile per sequence slot with at most decode_block_q query tokens; the other
  rows are left for the main launch), else every token's tile (a decode bucket)."""
  T, Hq, D = q.shape
  L, Hkv, NB, bs, _ = k_cache.shape
  S, P = md.block_tables.shape
  bq = mgpu_decode.decode_block_q(Hq, Hkv)
  if per_slot:
    meta, nt, k_splits = decode_tile_metadata(md, bq), S, 1
  else:
    nt = tile_count(T, S, bq)
    meta, k_splits = tile_metadata(md, T, bq, nt, pad_tiles=True), tun.k_splits
  out = mgpu_decode.mosaic_decode_attention(
      q.reshape(T * Hq, D), k_cache.reshape(L * Hkv * NB, bs, D),
      v_cache.reshape(L * Hkv * NB, bs, D), meta, bt_flat, scal, num_tiles=nt, NB=NB, P=P,
      Hq=Hq, Hkv=Hkv, sm_scale=float(sm_scale), block_kv=tun.mosaic_block_k,
      stages=tun.mosaic_stages, k_splits=k_splits, compute_wgs=tun.mosaic_decode_wgs,
      persistent=tun.mosaic_persistent, interpret=interpret)
  if k_splits > 1:
    out = mgpu_decode.combine_splits(*out, k_splits, q.dtype)
  return out
