"""copy_rows (kernels_pallas/slot_rows.py) against numpy: the rows with a destination land,
the others (dst -1 or past the pool) leave the pool as it was; and its CUDA lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gated_delta_ref import scatter_slots
from kernels_pallas.lowering import lower_for_cuda
from kernels_pallas.slot_rows import copy_rows


@pytest.mark.parametrize(
    "row_shape,dtype",
    [((8, 3), jnp.float32), ((5, 3), jnp.bfloat16), ((1024, 3), jnp.bfloat16)],
)
def test_copy_rows_equals_numpy(row_shape, dtype):
    rng = np.random.default_rng(0)
    N, V = 12, 7
    pool = rng.normal(size=(N,) + row_shape).astype(np.float32)
    values = rng.normal(size=(V,) + row_shape).astype(np.float32)
    src = np.array([0, 3, 3, 6, 1, 2, 5, 4], np.int32)
    dst = np.array([4, -1, 11, 0, 12, 7, -5, 2], np.int32)  # -1, -5, 12 (= N): skipped
    want = pool.astype(dtype).astype(np.float32)
    for s, d in zip(src, dst):
        if 0 <= d < N:
            want[d] = np.asarray(jnp.asarray(values[s], dtype), np.float32)
    got = copy_rows(jnp.asarray(pool, dtype), jnp.asarray(values, dtype), src, dst, interpret=True)
    assert got.shape == pool.shape and got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    # the same writes as the oracle's scatter of the rows whose dst is in the pool
    ok = (dst >= 0) & (dst < N)
    ref = scatter_slots(jnp.asarray(pool, dtype), jnp.asarray(dst), jnp.asarray(values[src]), ok)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))


def test_copy_rows_checks_shapes():
    pool = jnp.zeros((4, 6))
    with pytest.raises(ValueError, match="values rows"):
        copy_rows(pool, jnp.zeros((2, 5)), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="src and dst"):
        copy_rows(pool, jnp.zeros((2, 6)), jnp.zeros(2, jnp.int32), jnp.zeros(3, jnp.int32))


def test_copy_rows_lowers_for_cuda():
    """Qwen3.5-9B's conv pool (1,024 slots of [8,192, 3] bf16) and 1,024 row copies, donated."""
    sd = jax.ShapeDtypeStruct
    fn = jax.jit(lambda p, v, s, d: copy_rows(p, v, s, d), donate_argnums=(0,))
    args = (
        sd((1024, 8192, 3), jnp.bfloat16),
        sd((512, 8192, 3), jnp.bfloat16),
        sd((1024,), jnp.int32),
        sd((1024,), jnp.int32),
    )
    txt = lower_for_cuda(fn, *args).mlir_module()
    assert "triton" in txt and "copy_rows" in txt
