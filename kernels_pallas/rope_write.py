"""RoPE on q and k, the fp8 / fp16 quantization of k and v and their KV-cache write, fused into
one small Pallas (Triton) kernel for a decoder layer's step.

XLA runs this as ~5 small kernels between the fused QKV projection and attention (rotate q,
rotate k, quantize, two scatters); at batch 1 a decode step is bound by launches, so one kernel
a layer instead of five matters.

Addressing. Every array is viewed (a bitcast) as rows of *half* a head, D // 2 wide, so the two
halves of a head that RoPE rotates into each other are two plain row gathers and the rotation
needs no shuffle:
- qkv [T, (Hq + 2 Hkv) * D] -> [T * Htot * 2, D // 2] (Htot = Hq + 2 Hkv): half j of head h of
  token t is row (t * Htot + h) * 2 + j; k heads follow the q heads, v heads the k heads.
- q_rot [T, Hq, D] -> [T * Hq * 2, D // 2], same scheme.
- the caches [L, Hkv, NB, bs, D] -> [L * Hkv * NB * bs * 2, D // 2]: row
  ((layer * Hkv + h) * NB * bs + slot) * 2 + j (kv_write.py's row, times two, plus the half);
  V pages stored [D, bs] (layout.v_transposed) -> [L * Hkv * NB * D, bs] (flat_cache.py).
- cos / sin [T, D // 2] are gathered by token.

Each program takes `block_t` tokens: block_t * Hq_pad q rows and block_t * Hkv_pad k and v rows
(head counts padded to powers of two, padded heads and tokens >= T masked). q_rot is written for
every token < T; k / v rows with slot < 0 (padding) are masked and never touched; masked rows
point past the end of the ref they store into (see flat_cache.py). The caches are aliased to the
outputs, so under `jax.jit(..., donate_argnums=...)` nothing is copied.

Rounding, as the oracle (`reference.ref_rope_write_kv`) and models/llama.py's `apply_rope`: the
rotation in f32, rounded to qkv's dtype (q_rot and k alike); k and v are then stored by
`layout.quantize_kv` (fp8: times 1 / scale in f32 as kv_write.py does it, clamp to +-448 and
cast; fp16 V pages: clamp to +-65280 and cast).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.flat_cache import kv_scales, layer_base, row_index, t_row_index
from kernels_pallas.layout import cache_v_transposed, quantize_kv
from kernels_pallas.tuning import next_pow2


def _rope_write_kernel(
    slot_ref,
    scal_ref,
    fscal_ref,
    cos_ref,
    sin_ref,
    qkv_ref,
    kc_in,
    vc_in,
    q_out,
    kc_out,
    vc_out,
    *,
    T,
    Hq,
    Hkv,
    Hq_pad,
    Hkv_pad,
    NBbs,
    block_t,
    quantize,
    v_t,
    bs,
):
    del kc_in, vc_in  # aliased to kc_out / vc_out
    i = pl.program_id(0)
    Htot = Hq + 2 * Hkv
    dtype = q_out.dtype

    def rows(H, H_pad):
        r = jnp.arange(block_t * H_pad, dtype=jnp.int32)
        t = i * block_t + r // H_pad
        h = r % H_pad
        ok = (t < T) & (h < H)
        tc = jnp.minimum(t, T - 1)  # loads stay in bounds; stores are masked
        return ok, tc, jnp.minimum(h, H - 1)

    def load_halves(src):  # src: [R] head rows of the qkv view -> two [R, D/2] halves
        return qkv_ref[src * 2], qkv_ref[src * 2 + 1]

    def rotate(x1, x2, tc):
        c = cos_ref[tc]
        s = sin_ref[tc]
        x1 = x1.astype(jnp.float32)
        x2 = x2.astype(jnp.float32)
        return (x1 * c - x2 * s).astype(dtype), (x2 * c + x1 * s).astype(dtype)

    def store_halves(ref, dst, ok, y1, y2, transposed=False):
        """dst: [R] head rows, masked ones past the end; transposed: into [D, bs] V pages
        viewed as [pages * D, bs], half j at dimensions [j * D/2, (j + 1) * D/2) of the page."""
        mask = jnp.broadcast_to(ok[:, None], y1.shape)
        w = y1.shape[1]
        for j, y in enumerate((y1, y2)):
            idx = t_row_index(dst, bs, 2 * w, j * w, w) if transposed else row_index(dst * 2 + j, w)
            plt.store(ref.at[idx], y, mask=mask)

    # q: rotated, written for every token < T
    ok, tc, hc = rows(Hq, Hq_pad)
    q1, q2 = rotate(*load_halves(tc * Htot + hc), tc)
    n_q = q_out.shape[0] // 2
    store_halves(q_out, jnp.where(ok, tc * Hq + hc, n_q), ok, q1, q2)

    # k (rotated) and v: scattered to the caches at the token's slot, none where slot < 0
    ok, tc, hc = rows(Hkv, Hkv_pad)
    slot = slot_ref[tc]
    ok &= slot >= 0
    n_rows = kc_out.shape[0] // 2
    dst = jnp.where(ok, (scal_ref[0] + hc) * NBbs + jnp.maximum(slot, 0), n_rows)
    k1, k2 = rotate(*load_halves(tc * Htot + Hq + hc), tc)
    v1, v2 = load_halves(tc * Htot + Hq + Hkv + hc)
    if quantize:
        inv_k = 1.0 / fscal_ref[0]
        inv_v = 1.0 / fscal_ref[1]
        k1, k2 = k1.astype(jnp.float32) * inv_k, k2.astype(jnp.float32) * inv_k
        v1, v2 = v1.astype(jnp.float32) * inv_v, v2.astype(jnp.float32) * inv_v
    # quantize_kv without a scale (applied above): the cast, fp16 pages clamped first.
    store_halves(kc_out, dst, ok, quantize_kv(k1, kc_out.dtype), quantize_kv(k2, kc_out.dtype))
    v1, v2 = quantize_kv(v1, vc_out.dtype), quantize_kv(v2, vc_out.dtype)
    store_halves(vc_out, dst, ok, v1, v2, transposed=v_t)


def rope_write_kv(
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
    interpret=False,
    block_t=None,
    num_warps=4,
    num_stages=1,
):
    """RoPE on q and k of the fused projection, and the write of k and v into the paged caches.

    qkv [T, (Hq + 2 Hkv) * D] (bf16 / f16 / f32; q columns first, then k, then v, each head's D
    contiguous); cos / sin [T, D // 2] f32 (cos / sin of position * inv_freq); caches
    [L, Hkv, NB, bs, D] (V pages per layout.value_cache_dtype; fp8 e4m3 caches with per-tensor
    k_scale / v_scale); layer an int32 scalar (may be traced); slot_mapping [T] int32 (-1: write
    nothing). D must be even with D // 2 a power of two (Triton block shapes).
    -> (q_rot [T, Hq, D] in qkv's dtype, k_cache, v_cache). The oracle is
    `reference.ref_rope_write_kv`.

    block_t: tokens per program (a power of two; default ~32 q-head rows a program).
    """
    L, Hkv, NB, bs, D = k_cache.shape
    T = qkv.shape[0]
    Hq = num_heads
    assert Hkv == num_kv_heads, (k_cache.shape, num_kv_heads)
    v_t = cache_v_transposed(k_cache, v_cache)
    Htot = Hq + 2 * Hkv
    assert qkv.shape == (T, Htot * D), (qkv.shape, Hq, Hkv, D)
    assert D % 2 == 0 and next_pow2(D // 2) == D // 2, f"D // 2 must be a power of two: {D}"
    half = D // 2
    assert cos.shape == (T, half) and sin.shape == (T, half), (cos.shape, sin.shape, T, D)
    Hq_pad, Hkv_pad = next_pow2(Hq), next_pow2(Hkv)
    if block_t is None:
        block_t = max(1, 32 // Hq_pad)
    assert next_pow2(block_t) == block_t, f"block_t must be a power of two: {block_t}"
    quantize = k_scale is not None or v_scale is not None
    cache2 = (L * Hkv * NB * bs * 2, half)
    v_cache2 = (L * Hkv * NB * D, bs) if v_t else cache2
    kernel = functools.partial(
        _rope_write_kernel,
        T=T,
        Hq=Hq,
        Hkv=Hkv,
        Hq_pad=Hq_pad,
        Hkv_pad=Hkv_pad,
        NBbs=NB * bs,
        block_t=block_t,
        quantize=quantize,
        v_t=v_t,
        bs=bs,
    )
    q_rot, kc, vc = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(T, block_t),),
        out_shape=[
            jax.ShapeDtypeStruct((T * Hq * 2, half), qkv.dtype),
            jax.ShapeDtypeStruct(cache2, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache2, v_cache.dtype),
        ],
        input_output_aliases={6: 1, 7: 2},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="rope_write_kv",
    )(
        slot_mapping.astype(jnp.int32),
        layer_base(layer, Hkv),
        kv_scales(k_scale, v_scale),
        cos.astype(jnp.float32),
        sin.astype(jnp.float32),
        qkv.reshape(T * Htot * 2, half),
        k_cache.reshape(cache2),
        v_cache.reshape(v_cache2),
    )
    return q_rot.reshape(T, Hq, D), kc.reshape(k_cache.shape), vc.reshape(v_cache.shape)
