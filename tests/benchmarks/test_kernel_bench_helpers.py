"""The attention benchmark's shared harness, on the CPU (interpret mode, a tiny batch)."""

import jax.numpy as jnp

from benchmarks.kernels import harness as K
from kernels_pallas import ref_ragged_paged_attention


def test_batch_oracle_and_our_kernel_agree():
    """A random paged batch in the engine's page dtypes; the jitted oracle equals the reference
    called eagerly, and our kernel (interpret mode) matches it."""
    seqs = [(1, 40), (1, 17)]
    data = K.build(seqs, 2, 2, 3)
    assert data[2].dtype == jnp.float16 and data[1].dtype == K.DT  # the engine's V pages
    ref = K.oracle(*data)
    eager = ref_ragged_paged_attention(
        data[0].astype(jnp.float32), data[1], data[2], 0, data[3], sm_scale=K.D**-0.5
    )
    assert bool(jnp.allclose(ref, eager, rtol=1e-5, atol=1e-6))
    ours = K.ours_fn()(*data).astype(jnp.float32)
    assert float(jnp.max(jnp.abs(ours[:2] - ref[:2]))) < 2e-2
    assert K.kv_bytes(seqs) == 2 * (40 + 17) * K.HKV * K.D * 2
