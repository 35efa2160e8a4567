"""KVTransfer (disaggregated prefill's page copies) on one CPU device, for each page layout the
engine allocates: pages land where the destination's block ids say, every other page of the
destination stays as it was, in the stacked (scan) and per-layer (unroll) caches."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxengine.disagg.transfer import KVTransfer, dtype_groups
from paxengine.kv_memory import allocate_kv_cache
from paxengine.models.config import PRESETS

CFG = PRESETS["tiny"]  # head_dim 16: [D, 64] and [64, D] V pages differ in shape


def _random_cache(rng, cache):
    return jax.tree_util.tree_map(
        lambda a: jnp.asarray(rng.standard_normal(a.shape), jnp.float32).astype(a.dtype), cache
    )


@pytest.mark.parametrize(
    "kv_dtype,bs,groups",
    [
        (jnp.bfloat16, 16, 2),  # K bf16, V fp16 pages
        (jnp.float8_e4m3fn, 16, 1),  # K and V alike
        (jnp.float8_e4m3fn, 64, 2),  # V pages [D, bs] (layout.v_transposed)
    ],
)
@pytest.mark.parametrize("layer_loop", ["scan", "unroll"])
def test_pages_land_at_the_destination_blocks(kv_dtype, bs, groups, layer_loop):
    rng = np.random.default_rng(0)
    src = SimpleNamespace(
        kv_cache=_random_cache(rng, allocate_kv_cache(CFG, 8, bs, kv_dtype, layer_loop))
    )
    dst = SimpleNamespace(
        kv_cache=_random_cache(rng, allocate_kv_cache(CFG, 10, bs, kv_dtype, layer_loop))
    )
    before = [np.asarray(a.astype(jnp.float32)) for a in jax.tree_util.tree_leaves(dst.kv_cache)]
    assert len(dtype_groups(jax.tree_util.tree_leaves(src.kv_cache))) == groups
    t = KVTransfer(src, dst, max_blocks_per_copy=2)
    src_blocks, dst_blocks = [5, 1, 7], [0, -1, 9]  # -1: the destination holds that page
    t.receive(t.send(src_blocks), dst_blocks)
    s_leaves = jax.tree_util.tree_leaves(src.kv_cache)
    for a, b, old in zip(s_leaves, jax.tree_util.tree_leaves(dst.kv_cache), before):
        a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
        want = old.copy()
        for s, d in zip(src_blocks, dst_blocks):
            if d >= 0:
                want[:, :, d] = a[:, :, s]
        np.testing.assert_array_equal(b, want)
    assert t.stats.pages == 3 and t.stats.copies == 2  # 2 + 1
