"""The residual add + RMSNorm (+ FP8 rows) kernel (kernels_pallas/add_norm.py): the oracle against
float64 numpy and against the model's own ops, the kernel (interpret mode) against the oracle on
random ragged shapes in every mode, input checks, and CUDA lowering (Triton's rules are only
enforced there)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import add_rms_norm, ref_add_rms_norm
from kernels_pallas.lowering import lower_for_cuda

E4M3 = jnp.float8_e4m3fn


def _operands(rng, M, H, dtype=jnp.bfloat16, scaled=False):
    """A residual stream, a delta (with scales: an fp8 x fp8 product of magnitude up to ~1e4 and
    scales that bring it to the stream's size), a norm weight around 1; one row of h + d is
    zero (its norm is eps-bound, its FP8 scale must be 1)."""
    h = rng.standard_normal((M, H)) * 10.0 ** rng.uniform(-1, 1, (M, 1))
    if scaled:
        y = rng.standard_normal((M, H)) * 10.0 ** rng.uniform(2, 4, (M, 1))
        rs = 10.0 ** rng.uniform(-3, -2, M)
        cs = 10.0 ** rng.uniform(-2, -1, H)
    else:
        y, rs, cs = rng.standard_normal((M, H)), None, None
    h[M // 2], y[M // 2] = 0.0, 0.0
    w = 1.0 + 0.2 * rng.standard_normal(H)
    as_ = functools.partial(jnp.asarray, dtype=jnp.float32)
    return (
        as_(h).astype(dtype),
        as_(y).astype(dtype),
        as_(w).astype(dtype),
        None if rs is None else as_(rs),
        None if cs is None else as_(cs),
    )


def _f(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def test_oracle_against_float64():
    rng = np.random.default_rng(0)
    M, H, eps = 7, 200, 1e-5
    h, y, w, rs, cs = _operands(rng, M, H, jnp.float32, scaled=True)
    h2, q, s = ref_add_rms_norm(h, y, w, eps=eps, row_scales=rs, col_scales=cs, quantize=True)
    hh = _f(h) + _f(y) * _f(rs)[:, None] * _f(cs)[None]
    np.testing.assert_allclose(_f(h2), hh, rtol=1e-6, atol=1e-6)
    x = _f(w) * hh / np.sqrt((hh * hh).mean(axis=1, keepdims=True) + eps)
    amax = np.abs(x).max(axis=1)
    want_s = np.where(amax > 0, amax / 448.0, 1.0)
    np.testing.assert_allclose(_f(s), want_s, rtol=1e-5)
    assert _f(s)[M // 2] == 1.0 and not _f(q)[M // 2].any()
    got = _f(q) * _f(s)[:, None]  # e4m3's rounding: 2^-4 relative, 2^-9 of s below normals
    assert np.all(np.abs(got - x) <= 2.0**-4 * np.abs(x) + 2.0**-9 * want_s[:, None] * 1.01)


def test_oracle_is_the_models_ops():
    """What the model computed before the kernel: h + the scaled product, llama.rms_norm, then
    quant.quantize_rows; bit for bit."""
    from paxengine.models.llama import rms_norm
    from paxengine.models.quant import quantize_rows

    rng = np.random.default_rng(1)
    h, y, w, rs, cs = _operands(rng, 6, 64, scaled=True)
    delta = (y.astype(jnp.float32) * rs[:, None] * cs[None, :]).astype(h.dtype)
    hh = h + delta
    q0, s0 = quantize_rows(rms_norm(hh, w, 1e-6))
    h2, q, s = ref_add_rms_norm(h, y, w, eps=1e-6, row_scales=rs, col_scales=cs, quantize=True)
    assert (_f(h2) == _f(hh)).all() and (_f(q) == _f(q0)).all() and (_f(s) == _f(s0)).all()
    _, x = ref_add_rms_norm(h, None, w, eps=1e-6)
    assert (_f(x) == _f(rms_norm(h, w, 1e-6))).all()


# (M, H, block_rows, dtype): ragged M off block_rows, H off a power of two, several rows a program
CASES = [
    (5, 200, 1, jnp.bfloat16),
    (9, 128, 4, jnp.bfloat16),
    (3, 96, 2, jnp.float32),
    (17, 576, 8, jnp.float16),  # SmolLM2-135M's hidden size
    (8, 256, 2, jnp.bfloat16),  # no mask at all
]
MODES = [  # (y, scales, quantize)
    (False, False, False),
    (False, False, True),
    (True, False, False),
    (True, False, True),
    (True, True, False),
    (True, True, True),
]


@pytest.mark.parametrize("M,H,br,dtype", CASES)
@pytest.mark.parametrize("has_y,scaled,quantize", MODES)
def test_kernel_against_oracle(M, H, br, dtype, has_y, scaled, quantize):
    rng = np.random.default_rng(M * 7 + H + br)
    h, y, w, rs, cs = _operands(rng, M, H, dtype, scaled)
    y = y if has_y else None
    kw = dict(eps=1e-5, row_scales=rs, col_scales=cs, quantize=quantize)
    got = add_rms_norm(h, y, w, block_rows=br, interpret=True, **kw)
    want = ref_add_rms_norm(h, y, w, **kw)
    assert len(got) == len(want) == (3 if quantize else 2)
    for g, r in zip(got, want):
        assert g.shape == r.shape and g.dtype == r.dtype
    # h' and x: the same ops in the same order (XLA may contract f32 products differently),
    # and the row's sum of squares summed in another order: the last bit may differ
    ulp = {jnp.float32: 2.0**-22, jnp.float16: 2.0**-9, jnp.bfloat16: 2.0**-7}[dtype]
    if dtype != jnp.float32:  # (in f32 the rounding of an FMA shows in most last bits)
        assert (_f(got[0]) == _f(want[0])).mean() > 0.99
    np.testing.assert_allclose(_f(got[0]), _f(want[0]), rtol=ulp, atol=1e-6)
    if quantize:
        np.testing.assert_allclose(_f(got[2]), _f(want[2]), rtol=1e-5)
        assert (_f(got[1]) == _f(want[1])).mean() > 0.99
        np.testing.assert_allclose(_f(got[1]), _f(want[1]), rtol=2.0**-3, atol=2.0**-9)
    else:
        np.testing.assert_allclose(_f(got[1]), _f(want[1]), rtol=ulp, atol=1e-6)
    if not has_y:
        assert got[0] is h  # nothing written back


def test_under_jit_with_default_blocks():
    rng = np.random.default_rng(3)
    h, y, w, rs, cs = _operands(rng, 6, 576, scaled=True)
    kw = dict(eps=1e-5, row_scales=rs, col_scales=cs, quantize=True)
    got = jax.jit(lambda *a: add_rms_norm(*a, interpret=True, **kw))(h, y, w)
    want = ref_add_rms_norm(h, y, w, **kw)
    assert (_f(got[0]) == _f(want[0])).all()
    assert (_f(got[1]) == _f(want[1])).mean() > 0.99


def test_input_checks():
    h = jnp.zeros((4, 8), jnp.bfloat16)
    w = jnp.ones((8,), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"\[M, H\]"):
        add_rms_norm(jnp.zeros((8,)), None, w, eps=1e-5)
    with pytest.raises(ValueError, match="y must be"):
        add_rms_norm(h, jnp.zeros((4, 9)), w, eps=1e-5)
    with pytest.raises(ValueError, match="weight must be"):
        add_rms_norm(h, None, jnp.ones((9,)), eps=1e-5)
    with pytest.raises(ValueError, match="come together"):
        add_rms_norm(h, h, w, eps=1e-5, row_scales=jnp.ones((4,)))
    with pytest.raises(ValueError, match="come together"):
        add_rms_norm(h, None, w, eps=1e-5, row_scales=jnp.ones((4,)), col_scales=jnp.ones((8,)))
    with pytest.raises(ValueError, match="row_scales must be"):
        add_rms_norm(h, h, w, eps=1e-5, row_scales=jnp.ones((3,)), col_scales=jnp.ones((8,)))
    with pytest.raises(ValueError, match="block_rows must be a power of 2"):
        add_rms_norm(h, None, w, eps=1e-5, block_rows=3)
    with pytest.raises(ValueError, match="wider than"):
        add_rms_norm(jnp.zeros((1, 16385)), None, jnp.ones((16385,)), eps=1e-5)


@pytest.mark.parametrize("M,H", [(8192, 4096), (320, 4096), (1, 4096), (100, 576), (5, 4096)])
@pytest.mark.parametrize("mode", ["norm", "add_quant_scaled"])
def test_lowers_for_cuda(M, H, mode):
    bf16, f32 = jnp.bfloat16, jnp.float32
    hs = jax.ShapeDtypeStruct((M, H), bf16)
    ws = jax.ShapeDtypeStruct((H,), bf16)
    if mode == "norm":
        args = (hs, ws)

        def fn(h, w):
            return add_rms_norm(h, None, w, eps=1e-5)
    else:

        def fn(h, y, w, rs, cs):
            return add_rms_norm(h, y, w, eps=1e-5, row_scales=rs, col_scales=cs, quantize=True)

        args = (
            hs,
            hs,
            ws,
            jax.ShapeDtypeStruct((M,), f32),
            jax.ShapeDtypeStruct((H,), f32),
        )
    assert "triton" in lower_for_cuda(fn, *args).mlir_module()
