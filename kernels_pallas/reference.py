"""Pure-jnp oracles: the KV write (plain and fused with RoPE), ragged paged attention and the
FP8-weight matmul.

Written to be obviously right, and cheap enough under jit on a CPU to serve as the engine's
`attention_backend: reference`: every token gathers the pages of its own sequence from its
block-table row and attends over them with a position mask. Tokens are processed in batches
(`lax.map(..., batch_size=...)`) so a long prefill chunk does not materialise T copies of the
context at once. What a cache stores (page dtypes, clamping, fp8 scales) is `layout.py`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.layout import cache_v_transposed, quantize_kv
from kernels_pallas.metadata import AttentionMetadata, token_to_seq

_HI = lax.Precision.HIGHEST


def ref_write_kv(
    k_cache, v_cache, layer, k, v, slot_mapping, *, k_scale=None, v_scale=None, **unused
):
    """cache[layer, h, slot // bs, slot % bs] = k[t, h] for every token t with slot >= 0 (V at
    [layer, h, slot // bs, :, slot % bs] where its pages are [D, bs]: layout.v_transposed)."""
    _, _, num_blocks, bs, _ = k_cache.shape
    v_t = cache_v_transposed(k_cache, v_cache)
    valid = slot_mapping >= 0
    blk = jnp.where(valid, slot_mapping // bs, num_blocks)  # out of range -> dropped
    off = jnp.where(valid, slot_mapping % bs, 0)
    # advanced indices (layer, blk, off) split by a slice: the indexed shape is [T, Hkv, D]
    k_cache = k_cache.at[layer, :, blk, off].set(
        quantize_kv(k, k_cache.dtype, k_scale), mode="drop"
    )
    v_new = quantize_kv(v, v_cache.dtype, v_scale)
    if v_t:  # (the advanced indices go first either way: [T, Hkv, D])
        v_cache = v_cache.at[layer, :, blk, :, off].set(v_new, mode="drop")
    else:
        v_cache = v_cache.at[layer, :, blk, off].set(v_new, mode="drop")
    return k_cache, v_cache


def ref_rope(x, cos, sin):
    """Rotate-half RoPE of x [T, H, D] by cos/sin [T, D // 2] (f32), rounded to x's dtype: the
    math of models/llama.py's `apply_rope` with the angles computed by the caller."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c = jnp.asarray(cos, jnp.float32)[:, None, :]
    s = jnp.asarray(sin, jnp.float32)[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def ref_rope_write_kv(
    qkv,
    cos,
    sin,
    k_cache,
    v_cache,
    layer,
    slot_mapping,
    *,
    num_heads,
    num_kv_heads,
    k_scale=None,
    v_scale=None,
    **unused,
):
    """The oracle of `rope_write.rope_write_kv`: splits the fused projection qkv
    [T, (Hq + 2 Hkv) * D] into q, k, v, applies RoPE to q and k (rounded to qkv's dtype) and
    writes k and v with `ref_write_kv`. -> (q_rot [T, Hq, D], k_cache, v_cache)."""
    T = qkv.shape[0]
    D = k_cache.shape[-1]
    nq, nkv = num_heads * D, num_kv_heads * D
    assert qkv.shape[1] == nq + 2 * nkv, (qkv.shape, num_heads, num_kv_heads, D)
    q = qkv[:, :nq].reshape(T, num_heads, D)
    k = qkv[:, nq : nq + nkv].reshape(T, num_kv_heads, D)
    v = qkv[:, nq + nkv :].reshape(T, num_kv_heads, D)
    q_rot = ref_rope(q, cos, sin)
    k_rot = ref_rope(k, cos, sin)
    k_cache, v_cache = ref_write_kv(
        k_cache, v_cache, layer, k_rot, v, slot_mapping, k_scale=k_scale, v_scale=v_scale
    )
    return q_rot, k_cache, v_cache


def ref_ragged_paged_attention(
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
    interpret=False,
    max_batch_elems=1 << 24,
    **unused,
):
    """Causal GQA attention of every query token over its sequence's paged KV. -> [T, Hq, D]."""
    del interpret
    T, Hq, D = q.shape
    _, Hkv, _, bs, _ = k_cache.shape
    v_t = cache_v_transposed(k_cache, v_cache)
    G = Hq // Hkv
    S, P = md.block_tables.shape
    seq, pos, valid = token_to_seq(md, T)
    kv_pos = jnp.arange(P * bs, dtype=jnp.int32)
    ks = 1.0 if k_scale is None else jnp.asarray(k_scale, jnp.float32)
    vs = 1.0 if v_scale is None else jnp.asarray(v_scale, jnp.float32)

    def attend(args):
        q_t, s, p, ok = args  # [Hq, D], (), (), ()
        pages = md.block_tables[s]  # [P]
        # One gather straight from the whole cache: slicing out the layer first would copy it.
        k = k_cache[layer, :, pages].swapaxes(0, 1).reshape(Hkv, P * bs, D).astype(jnp.float32) * ks
        v = v_cache[layer, :, pages]  # [P, Hkv, bs, D] ([P, Hkv, D, bs] transposed)
        v = (v.swapaxes(2, 3) if v_t else v).swapaxes(0, 1).reshape(Hkv, P * bs, D)
        v = v.astype(jnp.float32) * vs
        qg = q_t.reshape(Hkv, G, D).astype(jnp.float32)
        logits = jnp.einsum("hgd,hkd->hgk", qg, k, precision=_HI) * sm_scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        in_seq = kv_pos < md.seq_lens[s]
        v = jnp.where(in_seq[None, :, None], v, 0.0)  # slots past the length may hold garbage
        mask = (kv_pos <= p) & in_seq
        if sliding_window is not None:
            mask &= kv_pos > p - sliding_window
        mask &= ok
        logits = jnp.where(mask, logits, -jnp.inf)
        m = jnp.max(logits, axis=-1, keepdims=True)
        e = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
        denom = jnp.sum(e, axis=-1, keepdims=True)
        o = jnp.einsum("hgk,hkd->hgd", e, v, precision=_HI) / jnp.where(denom > 0, denom, 1.0)
        return o.reshape(Hq, D)

    per_token = Hkv * P * bs * D
    batch = int(max(1, min(T, max_batch_elems // max(per_token, 1))))
    out = lax.map(attend, (q, seq, pos, valid), batch_size=batch)
    out = jnp.where(valid[:, None, None], out, 0.0)
    return out.astype(q.dtype)


def ref_fp8_matmul(x, w_values, w_scales, out_dtype=None, glu=False, x_scales=None):
    """y = x @ (w_values * w_scales[:, None]).T in f32 (HIGHEST precision), as out_dtype
    (default x's). x [M, K]; w_values [N, K] fp8 (the [out, in] layout); w_scales [N] f32:
    weight[n, k] = w_values[n, k] * w_scales[n]. The oracle of `fp8_matmul.fp8_matmul`.
    glu: x is [M, 2K] = [gate | up] and the product is taken of silu(gate) * up, each op
    rounded to x's dtype (as the model's separate elementwise step computes it).
    x_scales [M]: x (e4m3) stands for x * x_scales[:, None]."""
    if glu:
        gate, up = jnp.split(x, 2, axis=-1)
        silu = (gate.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)
        x = (silu.astype(jnp.float32) * up.astype(jnp.float32)).astype(x.dtype)
    w = w_values.astype(jnp.float32) * jnp.asarray(w_scales, jnp.float32)[:, None]
    xf = x.astype(jnp.float32)
    if x_scales is not None:
        xf = xf * jnp.asarray(x_scales, jnp.float32)[:, None]
    y = jnp.dot(xf, w.T, precision=_HI)
    return y.astype(out_dtype or x.dtype)


def ref_glu_quant(y, row_scales, col_scales):
    """The oracle of `glu_quant.glu_quant`: y [M, 2I] (the gate | up product before its scales),
    row_scales [M], col_scales [2I] -> (e4m3 q [M, I], f32 s [M]) with a = silu(g) * u of the
    scaled halves, s = max|a| / 448 per row (1 where 0), q = a / s; all in f32."""
    f32 = jnp.float32
    z = y.astype(f32) * jnp.asarray(row_scales, f32)[:, None] * jnp.asarray(col_scales, f32)[None]
    g, u = jnp.split(z, 2, axis=-1)
    a = g / (1.0 + jnp.exp(-g)) * u
    fmax = float(jnp.finfo(jnp.float8_e4m3fn).max)
    amax = jnp.max(jnp.abs(a), axis=-1)
    s = jnp.where(amax > 0, amax / fmax, 1.0)
    q = jnp.clip(a * (1.0 / s)[:, None], -fmax, fmax).astype(jnp.float8_e4m3fn)
    return q, s


def ref_add_rms_norm(h, y, weight, *, eps, row_scales=None, col_scales=None, quantize=False):
    """The oracle of `add_norm.add_rms_norm`, in the model's own steps and roundings: the
    scaled product rounded to h's dtype, h' = h + d in h's dtype, x = weight * (h' * rsqrt(
    mean(h'^2) + eps) rounded to h's dtype), then per-row e4m3 values and f32 scales
    (max|x| / 448, 1 where 0) when quantize. -> (h', x) or (h', q, s)."""
    f32 = jnp.float32
    if y is not None:
        d = y.astype(f32)
        if row_scales is not None:
            d = d * jnp.asarray(row_scales, f32)[:, None] * jnp.asarray(col_scales, f32)[None]
        h = h + d.astype(h.dtype)
    hf = h.astype(f32)
    hf = hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps)
    x = weight * hf.astype(h.dtype)
    if not quantize:
        return h, x
    fmax = float(jnp.finfo(jnp.float8_e4m3fn).max)
    xf = x.astype(f32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    s = jnp.where(amax > 0, amax / fmax, 1.0)
    return h, jnp.clip(xf / s[:, None], -fmax, fmax).astype(jnp.float8_e4m3fn), s
