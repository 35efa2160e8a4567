"""The gated activation quantized for the FP8 down projection (kernels_pallas/glu_quant.py): the
oracle against float64 numpy, the kernel (interpret mode) against the oracle on random ragged
shapes, input checks, and CUDA lowering (Triton's rules are only enforced there)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import glu_quant, ref_glu_quant
from kernels_pallas.lowering import lower_for_cuda

E4M3 = jnp.float8_e4m3fn


def _operands(rng, M, I, dtype=jnp.bfloat16):
    """A product of fp8 x fp8 magnitudes (|y| up to ~1e4), row and column scales that spread the
    scaled values over ~4 decades, and a row of zeros (its scale must be 1, its values 0)."""
    y = rng.standard_normal((M, 2 * I)) * 10.0 ** rng.uniform(0, 4, (M, 1))
    y[M // 2] = 0.0
    rs = 10.0 ** rng.uniform(-4, -2, M)
    cs = 10.0 ** rng.uniform(-3, -1, 2 * I)
    return (
        jnp.asarray(y, jnp.float32).astype(dtype),
        jnp.asarray(rs, jnp.float32),
        jnp.asarray(cs, jnp.float32),
    )


def _codes(q):
    return np.asarray(q.astype(jnp.float32))


@pytest.mark.parametrize("M,I", [(1, 64), (2, 64), (7, 200), (16, 96)])
def test_oracle_against_float64(M, I):
    rng = np.random.default_rng(M * 1000 + I)
    y, rs, cs = _operands(rng, M, I)
    q, s = ref_glu_quant(y, rs, cs)
    z = np.asarray(y.astype(jnp.float32), np.float64) * np.asarray(rs)[:, None] * np.asarray(cs)
    g, u = z[:, :I], z[:, I:]
    a = g / (1.0 + np.exp(-g)) * u
    amax = np.abs(a).max(axis=1)
    want_s = np.where(amax > 0, amax / 448.0, 1.0)
    np.testing.assert_allclose(np.asarray(s), want_s, rtol=1e-5)
    assert np.asarray(s)[M // 2] == 1.0 and not _codes(q)[M // 2].any()
    # q * s recovers a to e4m3's rounding (3 mantissa bits: half an ulp is 2^-4 relative; values
    # below e4m3's normal range are absolute-rounded at 2^-9 of s)
    got = _codes(q) * np.asarray(s)[:, None]
    tol = 2.0**-4 * np.abs(a) + 2.0**-9 * want_s[:, None] * 1.01
    assert np.all(np.abs(got - a) <= tol)
    live = amax > 0  # every non-zero row's max maps to e4m3's max
    assert np.all(np.abs(_codes(q)).max(axis=1)[live] == 448.0)


# ragged M off block_rows, ragged I off block_cols, several blocks a row, 1-row programs
CASES = [
    (5, 200, 2, 64, jnp.bfloat16),
    (8, 128, 4, 128, jnp.bfloat16),
    (3, 96, 1, 32, jnp.float32),
    (9, 1000, 2, 256, jnp.float16),
    (64, 192, 8, 64, jnp.bfloat16),
    (5, 200, 1, 256, jnp.bfloat16),  # a whole (ragged) row a program: the one-pass path
]


@pytest.mark.parametrize("fast", [False, True], ids=["ieee", "fast"])
@pytest.mark.parametrize("M,I,br,bc,dtype", CASES)
def test_kernel_against_oracle(M, I, br, bc, dtype, fast):
    """fast: the sigmoid as 1 / (1 + 2^(-g log2 e)) (interpret mode: that formula in jnp; on
    the GPU with approximate ex2 / rcp, checked against the oracle by benchmarks.kernels.fp8_mlp
    at 5f74b6d)."""
    rng = np.random.default_rng(M + I + br + bc)
    y, rs, cs = _operands(rng, M, I, dtype)
    q, s = glu_quant(y, rs, cs, block_rows=br, block_cols=bc, fast=fast, interpret=True)
    qr, sr = ref_glu_quant(y, rs, cs)
    assert q.shape == (M, I) and q.dtype == E4M3 and s.shape == (M,) and s.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(s), np.asarray(sr), rtol=1e-6)
    # the same f32 math: codes equal but where exp's last bit tips a rounding boundary
    assert (_codes(q) == _codes(qr)).mean() > 0.999
    np.testing.assert_allclose(_codes(q), _codes(qr), rtol=2.0**-3, atol=2.0**-9)


def test_under_jit_with_default_blocks():
    rng = np.random.default_rng(3)
    y, rs, cs = _operands(rng, 6, 1536)  # SmolLM2-135M's intermediate size
    q, s = jax.jit(lambda *a: glu_quant(*a, interpret=True))(y, rs, cs)
    qr, sr = ref_glu_quant(y, rs, cs)
    assert (_codes(q) == _codes(qr)).mean() > 0.999
    np.testing.assert_allclose(np.asarray(s), np.asarray(sr), rtol=1e-6)


def test_input_checks():
    y = jnp.zeros((4, 10), jnp.bfloat16)
    ok_r, ok_c = jnp.ones((4,)), jnp.ones((10,))
    with pytest.raises(ValueError, match=r"\[M, 2I\]"):
        glu_quant(jnp.zeros((4, 9)), ok_r, jnp.ones((9,)))
    with pytest.raises(ValueError, match="row_scales"):
        glu_quant(y, jnp.ones((3,)), ok_c)
    with pytest.raises(ValueError, match="row_scales"):
        glu_quant(y, ok_r, jnp.ones((5,)))
    with pytest.raises(ValueError, match="block_cols must be a power of 2"):
        glu_quant(y, ok_r, ok_c, block_cols=48)


@pytest.mark.parametrize("fast", [False, True], ids=["ieee", "fast"])
@pytest.mark.parametrize("M,I", [(8192, 14336), (320, 14336), (64, 1536), (100, 200)])
def test_lowers_for_cuda(M, I, fast):
    specs = (
        jax.ShapeDtypeStruct((M, 2 * I), jnp.bfloat16),
        jax.ShapeDtypeStruct((M,), jnp.float32),
        jax.ShapeDtypeStruct((2 * I,), jnp.float32),
    )
    txt = lower_for_cuda(lambda *a: glu_quant(*a, fast=fast), *specs).mlir_module()
    assert "triton" in txt
    # the approximate instructions are in the kernel exactly when asked for
    assert ("ex2.approx.ftz.f32" in txt) == fast, "inline asm"
