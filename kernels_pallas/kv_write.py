"""KV-cache write as a small Pallas (Triton) kernel, in place through input_output_aliases.

Each program takes `block_t` tokens x all KV heads (rows r = token r // Hkv_pad, head
r % Hkv_pad), gathers their K and V rows and scatters them to
`flat_cache[((layer * Hkv + h) * num_blocks * block_size) + slot]`; rows with slot < 0
(padding) are masked out and never touched. The caches are reshaped (a bitcast) to
`[L * Hkv * num_blocks * block_size, D]` and aliased to the outputs, so under
`jax.jit(..., donate_argnums=...)` (and inside `lax.scan` carrying the cache) nothing is copied.
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


def _write_kernel(
    slot_ref,
    scal_ref,
    fscal_ref,
    k_ref,
    v_ref,
    kc_in,
    vc_in,
    kc_out,
    vc_out,
    *,
    T,
    Hkv,
    H_pad,
    NBbs,
    block_t,
    quantize,
    v_t,
    bs,
):
    del kc_in, vc_in  # aliased to kc_out / vc_out
    i = pl.program_id(0)
    R = block_t * H_pad
    r = jnp.arange(R, dtype=jnp.int32)
    t = i * block_t + r // H_pad
    h = r % H_pad
    ok = (t < T) & (h < Hkv)
    tc = jnp.minimum(t, T - 1)
    hc = jnp.minimum(h, Hkv - 1)
    slot = slot_ref[tc]
    ok &= slot >= 0
    src = tc * Hkv + hc
    # masked rows point past the end (see flat_cache.py)
    dst = jnp.where(ok, (scal_ref[0] + hc) * NBbs + jnp.maximum(slot, 0), kc_out.shape[0])
    D = k_ref.shape[1]
    mask = jnp.broadcast_to(ok[:, None], (R, D))
    k = k_ref[src]
    v = v_ref[src]
    if quantize:
        k = k.astype(jnp.float32) * (1.0 / fscal_ref[0])
        v = v.astype(jnp.float32) * (1.0 / fscal_ref[1])
    idx = row_index(dst, D)
    # quantize_kv without a scale (applied above): the cast, fp16 pages clamped first.
    plt.store(kc_out.at[idx], quantize_kv(k, kc_out.dtype), mask=mask)
    v_idx = t_row_index(dst, bs, D) if v_t else idx  # (past the end stays past the end)
    plt.store(vc_out.at[v_idx], quantize_kv(v, vc_out.dtype), mask=mask)


def write_kv(
    k_cache,
    v_cache,
    layer,
    k,
    v,
    slot_mapping,
    *,
    k_scale=None,
    v_scale=None,
    interpret=False,
    impl="auto",
    block_t=None,
    num_warps=4,
    num_stages=1,
):
    """Writes k/v [T, Hkv, D] into the caches [L, Hkv, NB, bs, D] at `slot_mapping` (-1 = skip)
    (V pages [D, bs] where layout.v_transposed says so).

    impl: "pallas", "xla" (the in-place XLA scatter of `ref_write_kv`) or "auto": on the H200
    (jitted loop, donated 1 GiB caches) the scatter took 12.9 us at T=64 against 17.6 us for the
    kernel, and 43.6 us against 24.9 us at T=2048, so "auto" picks XLA for T <= 256 and the
    kernel above; in interpret mode "auto" always runs the kernel (that is what it is there for).
    """
    L, Hkv, NB, bs, D = k_cache.shape
    v_t = cache_v_transposed(k_cache, v_cache)
    T = k.shape[0]
    if impl == "xla" or (impl == "auto" and not interpret and T <= 256):
        from kernels_pallas.reference import ref_write_kv

        return ref_write_kv(
            k_cache, v_cache, layer, k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale
        )
    H_pad = next_pow2(Hkv)
    if block_t is None:
        block_t = max(1, 32 // H_pad)
    quantize = k_scale is not None or v_scale is not None
    kv_base = layer_base(layer, Hkv)
    scales = kv_scales(k_scale, v_scale)
    shape2 = (L * Hkv * NB * bs, D)
    v_shape2 = (L * Hkv * NB * D, bs) if v_t else shape2
    kernel = functools.partial(
        _write_kernel,
        T=T,
        Hkv=Hkv,
        H_pad=H_pad,
        NBbs=NB * bs,
        block_t=block_t,
        quantize=quantize,
        v_t=v_t,
        bs=bs,
    )
    kc, vc = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(T, block_t),),
        out_shape=[
            jax.ShapeDtypeStruct(shape2, k_cache.dtype),
            jax.ShapeDtypeStruct(v_shape2, v_cache.dtype),
        ],
        input_output_aliases={5: 0, 6: 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="write_kv",
    )(
        slot_mapping.astype(jnp.int32),
        kv_base,
        scales,
        k.reshape(T * Hkv, D),
        v.reshape(T * Hkv, D),
        k_cache.reshape(shape2),
        v_cache.reshape(v_shape2),
    )
    return kc.reshape(k_cache.shape), vc.reshape(v_cache.shape)
