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
