"""ragged_paged_attention: the public entry point. Plans a call's launches (`tuning.py`) and
sends each one to the kernel that serves it:

* the Triton kernel (`attention.py`): every launch on jax 0.10, decode launches by default,
  and whatever a Mosaic kernel is not eligible for (fp8, sliding window, soft cap, ...);
* the Mosaic GPU prefill kernel (`attention_mgpu.py`) for a call whose tuning says `mosaic`
  (on jax 0.11, prefill and mixed buckets of 512+ tokens: 1.15-1.9x faster than Triton on the
  H200); a mixed bucket's decode rows still go through a Triton decode launch;
* the Mosaic GPU decode kernel (`attention_mgpu_decode.py`) where the tuning says
  `mosaic_decode` (opt-in: it measured 0-11% slower than Triton at B >= 8).

A mixed bucket (`mixed_split`) makes two launches: decode tiles first, then the prefill tiles
writing into that output in place. Split-K partials of the Triton kernel are merged by
`attention.merge_splits`.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from kernels_pallas import attention_mgpu
from kernels_pallas import attention_mgpu_decode as mgpu_decode
from kernels_pallas.attention import merge_splits, triton_attention
from kernels_pallas.flat_cache import layer_base
from kernels_pallas.layout import cache_v_transposed, value_cache_dtype
from kernels_pallas.metadata import AttentionMetadata
from kernels_pallas.tiles import decode_tile_metadata, tile_count, tile_metadata
from kernels_pallas.tuning import is_decode_bucket, plan_launches


def ragged_paged_attention(
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
    block_q=None,
    block_k=None,
    k_splits=None,
    num_warps=None,
    num_stages=None,
    pv_split=None,
    split_mask=None,
    reverse_tiles=None,
    pv_fp16=None,
    mixed_split=None,
    mosaic=None,
    mosaic_block_k=None,
    mosaic_stages=None,
    mosaic_persistent=None,
    mosaic_schedule=None,
    mosaic_decode=None,
    mosaic_decode_wgs=None,
    page_block=None,
    num_sms=132,
):
    """Ragged paged attention through the Pallas kernels.
    q [T, Hq, D]; caches [L, Hkv, NB, bs, D] (V pages [D, bs] where layout.v_transposed says
    so: fp8 caches of 64-token pages) -> [T, Hq, D].

    `layer` may be a traced int32 scalar. fp8 caches are dequantized in-kernel with the
    per-tensor `k_scale` / `v_scale` (Python floats or scalar arrays). Tuning fields left None
    come from `default_tuning`.
    """
    T, Hq, D = q.shape
    _, Hkv, _, bs, Dk = k_cache.shape
    v_t = cache_v_transposed(k_cache, v_cache)  # (checks V's shape; Triton kernel only)
    assert Dk == D and Hq % Hkv == 0
    # V pages are K's dtype or the engine's choice for it (fp16 under bf16), never another mix.
    assert v_cache.dtype in (k_cache.dtype, value_cache_dtype(k_cache.dtype)), (
        k_cache.dtype,
        v_cache.dtype,
    )
    S, P = md.block_tables.shape
    tun, dtun = plan_launches(
        T,
        S,
        Hq,
        Hkv,
        D,
        bs,
        num_sms,
        kv_itemsize=jnp.dtype(k_cache.dtype).itemsize,
        v_t=v_t,
        block_q=block_q,
        block_k=block_k,
        k_splits=k_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        pv_split=pv_split,
        split_mask=split_mask,
        reverse_tiles=reverse_tiles,
        pv_fp16=pv_fp16,
        mixed_split=mixed_split,
        mosaic=mosaic,
        mosaic_block_k=mosaic_block_k,
        mosaic_stages=mosaic_stages,
        mosaic_persistent=mosaic_persistent,
        mosaic_schedule=mosaic_schedule,
        mosaic_decode=mosaic_decode,
        mosaic_decode_wgs=mosaic_decode_wgs,
        page_block=page_block,
    )
    num_tiles = tile_count(T, S, tun.block_q)

    bt_flat = md.block_tables.reshape(S * P).astype(jnp.int32)
    kv_base = layer_base(layer, Hkv)
    # launch(tun, meta, num_tiles, out_in=None): one Triton launch of this call.
    launch = functools.partial(
        triton_attention,
        q,
        k_cache,
        v_cache,
        md,
        bt_flat,
        kv_base,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        interpret=interpret,
    )

    # Interpret mode takes a Mosaic kernel only when asked for by name: GPU interpret mode is
    # slow, and needs more CPU threads than a small machine has (tests/kernels/conftest.py).
    def decode_by_mosaic(t):
        return (
            t.mosaic_decode
            and not v_t
            and (mosaic_decode or not interpret)
            and mgpu_decode.decode_eligible(
                q.dtype,
                k_cache.dtype,
                v_cache.dtype,
                Hq,
                Hkv,
                D,
                bs,
                t.mosaic_block_k,
                t.mosaic_stages,
                t.mosaic_decode_wgs,
                t.k_splits,
                sliding_window=sliding_window,
                soft_cap=soft_cap,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        )

    mosaic_decode_args = (q, k_cache, v_cache, md, kv_base, bt_flat)
    if is_decode_bucket(T, S) and decode_by_mosaic(tun):
        return _mosaic_decode_launch(
            *mosaic_decode_args, tun, per_slot=False, sm_scale=sm_scale, interpret=interpret
        ).reshape(T, Hq, D)
    if (
        tun.mosaic
        and not v_t
        and (mosaic or not interpret)
        and tun.k_splits == 1
        and attention_mgpu.mosaic_eligible(
            q.dtype,
            k_cache.dtype,
            v_cache.dtype,
            D,
            bs,
            tun.mosaic_block_k,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    ):
        return _mosaic_main_launch(
            q,
            k_cache,
            v_cache,
            md,
            kv_base,
            bt_flat,
            tun,
            dtun,
            launch,
            sm_scale=sm_scale,
            interpret=interpret,
        )
    if dtun is not None:
        if decode_by_mosaic(dtun):
            o = _mosaic_decode_launch(
                *mosaic_decode_args, dtun, per_slot=True, sm_scale=sm_scale, interpret=interpret
            )
            decode_q = mgpu_decode.decode_block_q(Hq, Hkv)
        else:
            o = launch(dtun, decode_tile_metadata(md, dtun.block_q), S)[0]
            decode_q = dtun.block_q
        meta = tile_metadata(md, T, tun.block_q, num_tiles, pad_tiles=True, min_q_len=decode_q + 1)
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


def _mosaic_main_launch(
    q, k_cache, v_cache, md, kv_base, bt_flat, tun, dtun, launch, *, sm_scale, interpret
):
    """The main launch through attention_mgpu; a mixed bucket's decode rows then go through the
    Triton decode launch (`dtun`), which writes them into the Mosaic kernel's output in place."""
    T, Hq, D = q.shape
    L, Hkv, NB, bs, _ = k_cache.shape
    S, P = md.block_tables.shape
    nt = attention_mgpu.mosaic_num_tiles(T, S)
    meta = attention_mgpu.mosaic_tile_metadata(
        md, T, nt, min_q_len=1 if dtun is None else dtun.block_q + 1
    )
    out = attention_mgpu.mosaic_prefill_attention(
        q,
        k_cache.reshape(L * Hkv * NB, bs, D),
        v_cache.reshape(L * Hkv * NB, bs, D),
        meta,
        bt_flat,
        kv_base,
        num_tiles=nt,
        NB=NB,
        P=P,
        Hkv=Hkv,
        sm_scale=sm_scale,
        block_kv=tun.mosaic_block_k,
        stages=tun.mosaic_stages,
        persistent=tun.mosaic_persistent,
        schedule=tun.mosaic_schedule,
        interpret=interpret,
    )
    if dtun is not None:
        out = launch(
            dtun, decode_tile_metadata(md, dtun.block_q), S, out_in=out.reshape(T * Hq, D)
        )[0].reshape(T, Hq, D)
    return out


def _mosaic_decode_launch(
    q, k_cache, v_cache, md, kv_base, bt_flat, tun, *, per_slot, sm_scale, interpret
):
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
        q.reshape(T * Hq, D),
        k_cache.reshape(L * Hkv * NB, bs, D),
        v_cache.reshape(L * Hkv * NB, bs, D),
        meta,
        bt_flat,
        kv_base,
        num_tiles=nt,
        NB=NB,
        P=P,
        Hq=Hq,
        Hkv=Hkv,
        sm_scale=float(sm_scale),
        block_kv=tun.mosaic_block_k,
        stages=tun.mosaic_stages,
        k_splits=k_splits,
        compute_wgs=tun.mosaic_decode_wgs,
        persistent=tun.mosaic_persistent,
        interpret=interpret,
    )
    if k_splits > 1:
        out = mgpu_decode.combine_splits(*out, k_splits, q.dtype)
    return out
