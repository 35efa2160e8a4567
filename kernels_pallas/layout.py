"""What a KV cache stores: the dtype of its V pages and the value kept for each K/V value.

Production policy, not oracle math: the runner allocates its caches by it, the write kernel and
the oracle's write store by it, and the attention kernels read pages laid out by it.
"""

from __future__ import annotations

import jax.numpy as jnp

# The largest bf16 value that fp16 holds exactly: values are clamped to it before they are
# stored in an fp16 cache, so an outlier saturates instead of becoming inf.
FP16_SAFE_MAX = 65280.0


def value_cache_dtype(kv_dtype):
    """The dtype of the V pages of a KV cache of `kv_dtype`: fp16 for bf16 caches, else the same.

    Same size; fp16 holds every bf16 value in [6e-5, 65280] exactly (3 more mantissa bits),
    clamps larger ones and keeps fewer bits of smaller ones (none below 3e-8), but the PV
    product can then take P in fp16 (11 significant bits; a bf16 P misses the 2e-3 bar) straight
    from the cache: the Mosaic prefill kernel otherwise converts every V block in shared memory,
    which cost it ~12% on the H200."""
    return jnp.dtype(jnp.float16) if jnp.dtype(kv_dtype) == jnp.bfloat16 else jnp.dtype(kv_dtype)


def quantize_kv(x, cache_dtype, scale=None):
    """What is stored for x in a cache of `cache_dtype` (fp8 caches divide by the scale and
    saturate at +-448, where a plain cast would give NaN; fp16 caches clamp to
    +-FP16_SAFE_MAX)."""
    if scale is not None:
        x = x.astype(jnp.float32) / jnp.asarray(scale, jnp.float32)
    dt = jnp.dtype(cache_dtype)
    if dt == jnp.float16 and x.dtype in (jnp.bfloat16, jnp.float32):
        x = jnp.clip(x, -FP16_SAFE_MAX, FP16_SAFE_MAX)  # (fp8's range is inside fp16's)
    elif dt == jnp.float8_e4m3fn:
        fp8_max = float(jnp.finfo(dt).max)
        x = jnp.clip(x, -fp8_max, fp8_max)
    return x.astype(cache_dtype)


# fp8 pages of this many tokens store V transposed (see v_transposed).
V_TRANSPOSED_BLOCK = 64


def v_transposed(kv_dtype, block_size: int) -> bool:
    """Whether the V pages of a cache of `kv_dtype` with pages of `block_size` tokens are stored
    [D, block_size] (positions contiguous) instead of [block_size, D]: fp8 caches with pages of
    64 tokens (the engine's default page for fp8 KV). The Triton kernel then loads a whole page
    as one tile (a KV block is a page) with the PV product's contraction axis contiguous, as the
    fp8 MMA wants its B operand. H200, decode attention over fp8 pages, 16-token pages (gathered
    rows) -> these, us (gpu_2026-12-04_fp8_pages/page_blocks.json): B=300 ctx 1536 349.2 ->
    286.9; B=256 ctx 1024 212.5 -> 173.7; B=64 ctx 2048 115.1 -> 101.3; 60 decodes + a 448
    chunk 157.0 -> 139.7; long contexts at small batch too, with twice the split-K
    (tuning.default_tuning; page_blocks_splits.json: B=8 ctx 8192 73.0 -> 63.6, B=1 25.1 ->
    24.4); the engine's 300 x (1000, 1000) went 13,177 -> 14,669 tok/s in that lease.
    The exploration before it (gpu_2026-12-03f_page_blocks/): gathered rows of [bs, D] pages at
    64 tokens were no better than 16-token pages, and bf16 / fp16 pages no faster either way
    (so they keep [bs, D]); 128-token pages decoded a little faster still (B=300: 274.7 us), but
    a KV block of 128 slowed the 2,048-token prefill 185.9 -> 266.6 us, so they keep [bs, D]
    and gathered rows too."""
    return jnp.dtype(kv_dtype) == jnp.float8_e4m3fn and block_size == V_TRANSPOSED_BLOCK


def value_page_shape(kv_dtype, block_size: int, head_dim: int) -> tuple[int, int]:
    """The trailing two axes of a V cache (after [L, Hkv, NB])."""
    if v_transposed(kv_dtype, block_size):
        return (head_dim, block_size)
    return (block_size, head_dim)


def cache_v_transposed(k_cache, v_cache) -> bool:
    """v_transposed of a (k_cache [L, Hkv, NB, bs, D], v_cache) pair, its V shape checked."""
    _, _, _, bs, D = k_cache.shape
    t = v_transposed(k_cache.dtype, bs)
    want = tuple(k_cache.shape[:3]) + value_page_shape(k_cache.dtype, bs, D)
    assert tuple(v_cache.shape) == want, ("V cache layout", k_cache.shape, v_cache.shape, want)
    return t
