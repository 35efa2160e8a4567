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
  blocks and writes un-normalised partials (acc, m, l); a small jnp combine merges them.

Why Triton and not Mosaic GPU: the Triton lowering runs unchanged on jax 0.10.2 (CPU CI,
interpret mode) and 0.11.2 (the H200), supports gathers through ref indexing (`ref[row_vec]`)
which is exactly what a block table needs, and its CUDA lowering can be checked on a CPU (see
`lowering.py`). Mosaic GPU's API moves weekly and needs M >= 64 for wgmma; decode tiles have
M = 16. The kernel is behind `ragged_paged_attention`, so a Mosaic version can replace it.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.metadata import AttentionMetadata, count_le, token_to_seq

LOG2E = 1.4426950408889634
MASK_VALUE = -1e30


def next_pow2(x: int) -> int:
  return 1 << max(int(x) - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class Tuning:
  block_q: int      # query tokens per tile (M = block_q * next_pow2(G) rows)
  block_k: int      # KV positions per inner step (a multiple of the page size is best)
  k_splits: int     # split-K partitions
  num_warps: int
  num_stages: int
  pv_split: bool = True   # P as bf16 hi + lo parts in the PV product (see _rpa_kernel)


def default_tuning(T: int, S: int, Hq: int, Hkv: int, D: int, block_size: int,
                   num_sms: int = 132) -> Tuning:
  """Static choice from the bucket shape (the engine may override any field)."""
  g_pad = next_pow2(Hq // Hkv)
  decode_like = T <= 2 * S
  if decode_like:
    block_q = max(1, 16 // g_pad)
    programs = Hkv * max(S, 1)
    k_splits = 1
    while programs * k_splits < 2 * num_sms and k_splits < 16:
      k_splits *= 2
    # H200 sweep (benchmarks/results/kernels_h200.json): block_k 128, 4 warps, 2 stages best.
    return Tuning(block_q, max(128, block_size), k_splits, 4, 2)
  block_q = max(1, 64 // g_pad)
  return Tuning(block_q, max(64, block_size), 1, 4, 2)


def tile_metadata(md: AttentionMetadata, num_tokens: int, block_q: int, num_tiles: int):
  """[num_tiles, 8] int32: seq, first token, tokens in tile, first position, kv_len, 0, 0, 0."""
  qsl = md.query_start_loc
  S = md.seq_lens.shape[0]
  live = jnp.arange(S, dtype=jnp.int32) < md.num_seqs[0]
  q_lens = jnp.where(live, qsl[1:] - qsl[:-1], 0)
  n_tiles = (q_lens + block_q - 1) // block_q
  cum = jnp.cumsum(n_tiles)
  j = jnp.arange(num_tiles, dtype=jnp.int32)
  s = jnp.minimum(count_le(cum, j), S - 1)
  local = j - (cum[s] - n_tiles[s])
  valid = j < cum[-1]
  q_start = qsl[s] + local * block_q
  q_len = jnp.where(valid, jnp.clip(qsl[s] + q_lens[s] - q_start, 0, block_q), 0)
  kv_len = md.seq_lens[s]
  pos0 = kv_len - q_lens[s] + local * block_q
  q_start = jnp.where(valid, q_start, 0)
  z = jnp.zeros_like(j)
  return jnp.stack([s, q_start, q_len, pos0, kv_len, z, z, z], axis=1).astype(jnp.int32)


def _row_index(rows, D):
  """(row, col) index arrays [n, D] selecting whole rows of a 2-D ref (gather / scatter)."""
  n = rows.shape[0]
  return (jnp.broadcast_to(rows[:, None], (n, D)),
          jnp.broadcast_to(jnp.arange(D, dtype=jnp.int32)[None, :], (n, D)))


def _rpa_kernel(meta_ref, bt_ref, scal_ref, fscal_ref, q_ref, k_ref, v_ref, *out_refs,
                T, Hq, Hkv, G, G_pad, NB, bs, P, block_q, block_k, k_splits, sm_scale,
                sliding_window, soft_cap, compute_dtype, pv_split):
  h = pl.program_id(0)
  j = pl.program_id(1)
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

  def body(b, carry):
    acc, m_prev, l_prev = carry
    kv = b * block_k + jnp.arange(block_k, dtype=jnp.int32)      # absolute KV positions
    kv_ok = kv < kv_len
    page = bt_ref[seq * P + jnp.minimum(kv // bs, P - 1)]
    rows = (head_base + page) * bs + kv % bs
    k = k_ref[rows].astype(compute_dtype)                         # [block_k, D]
    # V rows past kv_len may hold anything (NaN bit patterns too): zero them, since p == 0
    # there would still give 0 * NaN = NaN in the PV product.
    v = jnp.where(kv_ok[:, None], v_ref[rows].astype(compute_dtype), 0)
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32, precision=precision)
    if soft_cap is not None:
      s = jnp.tanh(s * (scale / soft_cap)) * (soft_cap * LOG2E)
    else:
      s = s * (scale * LOG2E)
    mask = (kv[None, :] <= q_pos[:, None]) & kv_ok[None, :]
    if sliding_window is not None:
      mask &= kv[None, :] > (q_pos[:, None] - sliding_window)
    s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
    alpha = jnp.exp2(m_prev - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l_new = l_prev * alpha + jnp.sum(p, axis=1)
    p_hi = p.astype(compute_dtype)
    pv = jnp.dot(p_hi, v, preferred_element_type=jnp.float32, precision=precision)
    if pv_split and compute_dtype != jnp.float32:
      # P = hi + lo in two 16-bit parts: the PV product keeps ~16 mantissa bits of P instead of
      # 8 (a bf16 P alone costs ~1e-3 relative error on averaged, cancelling V rows).
      p_lo = (p - p_hi.astype(jnp.float32)).astype(compute_dtype)
      pv += jnp.dot(p_lo, v, preferred_element_type=jnp.float32)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_new

  acc = jnp.zeros((M, D), jnp.float32)
  m_i = jnp.full((M,), MASK_VALUE, jnp.float32)
  l_i = jnp.zeros((M,), jnp.float32)
  acc, m_i, l_i = lax.fori_loop(b0, b1, body, (acc, m_i, l_i))

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
                           num_warps=None, num_stages=None, pv_split=None, num_sms=132):
  """Pallas ragged paged attention. q [T, Hq, D]; caches [L, Hkv, NB, bs, D] -> [T, Hq, D].

  `layer` may be a traced int32 scalar. fp8 caches are dequantized in-kernel with the
  per-tensor `k_scale` / `v_scale` (Python floats or scalar arrays). Tuning fields left None
  come from `default_tuning`.
  """
  T, Hq, D = q.shape
  L, Hkv, NB, bs, Dk = k_cache.shape
  assert Dk == D and v_cache.shape == k_cache.shape and Hq % Hkv == 0
  S, P = md.block_tables.shape
  G = Hq // Hkv
  G_pad = next_pow2(G)
  tun = default_tuning(T, S, Hq, Hkv, D, bs, num_sms)
  tun = Tuning(block_q or tun.block_q, block_k or tun.block_k, k_splits or tun.k_splits,
               num_warps or tun.num_warps, num_stages or tun.num_stages,
               tun.pv_split if pv_split is None else bool(pv_split))
  num_tiles = max(1, min(T, -(-(T + S * (tun.block_q - 1)) // tun.block_q)))

  compute_dtype = jnp.float32 if q.dtype == jnp.float32 else q.dtype
  meta = tile_metadata(md, T, tun.block_q, num_tiles)
  bt_flat = md.block_tables.reshape(S * P).astype(jnp.int32)
  scal = (jnp.asarray(layer, jnp.int32) * Hkv).reshape(1)
  fscal = jnp.stack([jnp.asarray(1.0 if k_scale is None else k_scale, jnp.float32).reshape(()),
                     jnp.asarray(1.0 if v_scale is None else v_scale, jnp.float32).reshape(())])
  q2 = q.reshape(T * Hq, D)
  k2 = k_cache.reshape(L * Hkv * NB * bs, D)
  v2 = v_cache.reshape(L * Hkv * NB * bs, D)

  kernel = functools.partial(
      _rpa_kernel, T=T, Hq=Hq, Hkv=Hkv, G=G, G_pad=G_pad, NB=NB, bs=bs, P=P,
      block_q=tun.block_q, block_k=tun.block_k, k_splits=tun.k_splits, sm_scale=float(sm_scale),
      sliding_window=None if sliding_window is None else int(sliding_window),
      soft_cap=None if soft_cap is None else float(soft_cap), compute_dtype=compute_dtype,
      pv_split=tun.pv_split)
  if tun.k_splits == 1:
    out_shape = [jax.ShapeDtypeStruct((T * Hq, D), q.dtype)]
  else:
    n = tun.k_splits * T * Hq
    out_shape = [jax.ShapeDtypeStruct((n, D), jnp.float32),
                 jax.ShapeDtypeStruct((n,), jnp.float32),
                 jax.ShapeDtypeStruct((n,), jnp.float32)]
  outs = pl.pallas_call(
      kernel,
      grid=(Hkv, num_tiles, tun.k_splits),
      out_shape=out_shape,
      compiler_params=plt.CompilerParams(num_warps=tun.num_warps, num_stages=tun.num_stages),
      interpret=interpret,
      name=f"ragged_paged_attention_q{tun.block_q}_k{tun.block_k}_s{tun.k_splits}",
  )(meta, bt_flat, scal, fscal, q2, k2, v2)

  if tun.k_splits == 1:
    out = outs[0].reshape(T, Hq, D)
  else:
    acc, m, l = (x.reshape(tun.k_splits, T, Hq, *x.shape[1:]) for x in outs)
    m_max = jnp.max(m, axis=0)
    c = jnp.exp2(m - m_max[None])
    den = jnp.sum(c * l, axis=0)
    out = jnp.sum(c[..., None] * acc, axis=0) / jnp.where(den > 0, den, 1.0)[..., None]
    out = out.astype(q.dtype)
  _, _, valid = token_to_seq(md, T)
  return jnp.where(valid[:, None, None], out, jnp.zeros((), q.dtype))
