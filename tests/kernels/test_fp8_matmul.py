"""The FP8-weight GEMV / skinny GEMM (kernels_pallas/fp8_gemv.py): the oracle against float64
numpy, the kernel (interpret mode) against the oracle, input checks, and CUDA lowering of the
configurations the default tuning picks (Triton's rules are only enforced there)."""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas.fp8_gemv_tuning as ft
from kernels_pallas import fp8_matmul, ref_fp8_matmul
from kernels_pallas.lowering import lower_for_cuda

E4M3 = jnp.float8_e4m3fn


def _operands(rng, M, K, N, x_dtype=jnp.float32, spread=(-4.0, 2.0)):
    """x [M, K]; fp8 values [N, K] over e4m3's whole range (subnormals to 448); scales [N]
    spread over 10^spread (channels of very different magnitudes)."""
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32).astype(x_dtype)
    v = rng.standard_normal((N, K)) * 10.0 ** rng.uniform(-3, 2, (N, K))
    v = jnp.asarray(np.clip(v, -448, 448), jnp.float32).astype(E4M3)
    s = jnp.asarray(10.0 ** rng.uniform(*spread, N), jnp.float32)
    return x, v, s


def _f64(x, v, s):
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    w = np.asarray(jnp.asarray(v, jnp.float32), np.float64) * np.asarray(s, np.float64)[:, None]
    return x @ w.T, np.abs(x) @ np.abs(w).T  # the product, and the bound its rounding scales with


def _check(y, x, v, s, tol):
    """|y - x @ W.T| <= tol * (|x| @ |W|.T) elementwise (f32 accumulation of exact products:
    the error bound of a sum), plus bf16 output rounding where y is bf16."""
    exact, bound = _f64(x, v, s)
    y64 = np.asarray(jnp.asarray(y, jnp.float32), np.float64)
    assert y.shape == exact.shape
    assert np.all(np.isfinite(y64))
    out_round = 2.0**-8 * np.abs(exact) if y.dtype == jnp.bfloat16 else 0.0
    excess = np.abs(y64 - exact) - out_round - tol * bound
    assert excess.max() <= 0, f"max excess {excess.max():.3e}"


@pytest.mark.parametrize("M,K,N", [(1, 64, 32), (5, 200, 48), (64, 96, 130)])
def test_oracle_against_float64(M, K, N):
    rng = np.random.default_rng(M + K + N)
    x, v, s = _operands(rng, M, K, N)
    _check(ref_fp8_matmul(x, v, s), x, v, s, 1e-6)
    # bf16 activations: output in x's dtype by default, f32 on request
    xb = x.astype(jnp.bfloat16)
    assert ref_fp8_matmul(xb, v, s).dtype == jnp.bfloat16
    _check(ref_fp8_matmul(xb, v, s), xb, v, s, 1e-6)
    _check(ref_fp8_matmul(xb, v, s, out_dtype=jnp.float32), xb, v, s, 1e-6)


# (method, M, K, N, block_n, block_k, k_splits, prefetch): ragged M, K and N off the blocks
# (tails masked), split-K with and without a K tail in the last split, uneven splits.
CASES = [
    ("dot", 1, 100, 40, 16, 32, 1, False),
    ("dot", 3, 100, 40, 16, 32, 3, False),
    ("dot", 17, 72, 33, 16, 16, 2, True),
    ("dot", 64, 64, 48, 32, 32, 1, False),
    ("dot", 70, 48, 16, 16, 16, 1, False),  # M over one 64-row block: a second grid row
    ("wdot", 8, 100, 40, 16, 32, 2, False),
    ("wdot", 17, 96, 50, 32, 32, 1, True),
    ("wdot", 64, 64, 32, 16, 16, 4, False),
    ("reduce", 1, 100, 40, 8, 32, 1, False),
    ("reduce", 3, 130, 24, 16, 64, 2, True),
    ("reduce", 8, 64, 20, 4, 16, 1, False),
    ("reduce_step", 1, 100, 40, 8, 32, 1, True),
    ("reduce_step", 1, 256, 64, 16, 32, 8, False),
    ("reduce_step", 2, 90, 17, 8, 128, 1, False),  # one block, wider than K and N
    ("reduce_step", 8, 200, 40, 16, 32, 3, False),
]


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_kernel_against_oracle(case):
    method, M, K, N, bn, bk, ks, pf = case
    rng = np.random.default_rng(sum(case[1:6]))
    x, v, s = _operands(rng, M, K, N)
    tun = dict(block_n=bn, block_k=bk, k_splits=ks, method=method, prefetch=pf)
    y = fp8_matmul(x, v, s, interpret=True, **tun)
    assert y.dtype == jnp.float32
    _check(y, x, v, s, 2e-6)
    # and against the oracle, on the same scale (sums that cancel make plain rtol meaningless)
    _, bound = _f64(x, v, s)
    diff = np.abs(np.asarray(y, np.float64) - np.asarray(ref_fp8_matmul(x, v, s), np.float64))
    assert (diff <= 4e-6 * bound).all()


@pytest.mark.parametrize("method", ["dot", "reduce_step"])
def test_bf16_activations(method):
    rng = np.random.default_rng(7)
    M = 3
    x, v, s = _operands(rng, M, 160, 48, x_dtype=jnp.bfloat16)
    tun = dict(method=method, block_n=16, block_k=64, k_splits=2)
    y = fp8_matmul(x, v, s, interpret=True, **tun)
    assert y.dtype == jnp.bfloat16
    _check(y, x, v, s, 2e-6)
    y32 = fp8_matmul(x, v, s, out_dtype=jnp.float32, interpret=True, **tun)
    assert y32.dtype == jnp.float32
    _check(y32, x, v, s, 2e-6)


# (method, M, K, N, block_n, block_k, k_splits): e4m3 activations with row scales (the W8A8
# GEMV): K's partial last block (through f16), rows past a 16-row block, split-K, and the
# reduce methods (x upcast there).
X8_CASES = [
    ("dot", 1, 100, 40, 16, 32, 1),
    ("dot", 17, 72, 33, 16, 16, 2),
    ("wdot", 8, 200, 48, 16, 64, 2),
    ("wdot", 3, 256, 64, 32, 64, 1),
    ("reduce_step", 2, 100, 40, 8, 32, 1),
    ("reduce", 3, 130, 24, 16, 64, 2),
]


@pytest.mark.parametrize("case", X8_CASES, ids=["-".join(map(str, c)) for c in X8_CASES])
def test_fp8_activations_against_oracle(case):
    method, M, K, N, bn, bk, ks = case
    rng = np.random.default_rng(sum(case[1:]))
    x, v, s = _operands(rng, M, K, N)
    xq = jnp.clip(x * 60, -448, 448).astype(E4M3)
    xs = jnp.asarray(10.0 ** rng.uniform(-3, 0, M), jnp.float32)
    tun = dict(block_n=bn, block_k=bk, k_splits=ks, method=method)
    y = fp8_matmul(xq, v, s, x_scales=xs, out_dtype=jnp.float32, interpret=True, **tun)
    assert y.dtype == jnp.float32
    x_eff = xq.astype(jnp.float32) * xs[:, None]  # what the e4m3 rows stand for
    _check(y, x_eff, v, s, 2e-6)
    ref = ref_fp8_matmul(xq, v, s, out_dtype=jnp.float32, x_scales=xs)
    _, bound = _f64(x_eff, v, s)
    assert (np.abs(np.asarray(y, np.float64) - np.asarray(ref, np.float64)) <= 4e-6 * bound).all()
    yb = fp8_matmul(xq, v, s, x_scales=xs, out_dtype=jnp.bfloat16, interpret=True, **tun)
    assert yb.dtype == jnp.bfloat16
    _check(yb, x_eff, v, s, 2e-6)


def test_fp8_activations_default_tuning_and_checks():
    rng = np.random.default_rng(12)
    x, v, s = _operands(rng, 4, 96, 40)
    xq, xs = jnp.clip(x * 60, -448, 448).astype(E4M3), jnp.full((4,), 0.02, jnp.float32)
    y = jax.jit(
        lambda a, b, c, d: fp8_matmul(a, b, c, x_scales=d, out_dtype=jnp.float32, interpret=True)
    )(xq, v, s, xs)
    _check(y, xq.astype(jnp.float32) * xs[:, None], v, s, 2e-6)
    assert ft.default_tuning(1, 4096, 28672, x_fp8=True).method in ("dot", "wdot")
    with pytest.raises(ValueError, match="need x_scales"):
        fp8_matmul(xq, v, s, out_dtype=jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="need x_scales"):
        fp8_matmul(xq, v, s, x_scales=xs, interpret=True)
    with pytest.raises(ValueError, match=r"x_scales must be \[M\]"):
        fp8_matmul(xq, v, s, x_scales=xs[:3], out_dtype=jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="x_scales go with float8_e4m3fn"):
        fp8_matmul(x, v, s, x_scales=xs, interpret=True)
    with pytest.raises(ValueError, match="glu takes 16-bit"):
        fp8_matmul(
            jnp.concatenate([xq, xq], 1),
            v,
            s,
            x_scales=xs,
            out_dtype=jnp.float32,
            glu=True,
            interpret=True,
        )


def test_x8_tuning_from_a_sweep_file(tmp_path, monkeypatch):
    """PAXENGINE_KERNEL_FP8_X8_TUNING: a `--x8` sweep's best row for (K, N) at the smallest
    swept M >= M (else the largest) replaces the W8A8 GEMV's rule; other shapes keep it."""

    def best(M, block_n, k_splits):
        tun = dict(block_n=block_n, block_k=128, k_splits=k_splits, num_warps=4, num_stages=4)
        return {"M": M, "K": 4096, "N": 6144, "tuning": dict(tun, method="wdot", prefetch=False)}

    path = tmp_path / "fp8_matmul.json"
    path.write_text(json.dumps({"x8": True, "best": [best(1, 32, 2), best(16, 128, 4)]}))
    rule, rule_o = (ft.default_tuning(8, 4096, n, x_fp8=True) for n in (6144, 4096))
    monkeypatch.setenv("PAXENGINE_KERNEL_FP8_X8_TUNING", str(path))
    assert ft.default_tuning(1, 4096, 6144, x_fp8=True).block_n == 32
    assert ft.default_tuning(8, 4096, 6144, x_fp8=True).block_n == 128
    assert ft.default_tuning(64, 4096, 6144, x_fp8=True).k_splits == 4
    assert ft.default_tuning(8, 4096, 4096, x_fp8=True) == rule_o
    monkeypatch.delenv("PAXENGINE_KERNEL_FP8_X8_TUNING")
    assert ft.default_tuning(8, 4096, 6144, x_fp8=True) == rule
    bf16_sweep = tmp_path / "bf16.json"
    bf16_sweep.write_text(json.dumps({"x8": False, "best": []}))
    monkeypatch.setenv("PAXENGINE_KERNEL_FP8_X8_TUNING", str(bf16_sweep))
    with pytest.raises(ValueError, match="not an --x8 sweep"):
        ft.default_tuning(1, 4096, 6144, x_fp8=True)


def test_f16_activations_and_jit():
    rng = np.random.default_rng(8)
    x, v, s = _operands(rng, 8, 96, 40, x_dtype=jnp.float16, spread=(-3.0, 0.0))
    f = jax.jit(lambda x, v, s: fp8_matmul(x, v, s, interpret=True, block_n=16, block_k=32))
    y = f(x, v, s)
    assert y.dtype == jnp.float16
    exact, bound = _f64(x, v, s)
    err = np.abs(np.asarray(y, np.float64) - exact) - 2.0**-10 * np.abs(exact) - 2e-6 * bound
    assert err.max() <= 0


@pytest.mark.parametrize("M", [1, 8])
def test_default_tuning_small_model_shapes(M):
    """SmolLM2-135M: hidden 576, intermediate 1536, q 9 x 64, kv 3 x 64 (N = 576, 192)."""
    rng = np.random.default_rng(M)
    for K, N in [(576, 192), (1536, 576)]:
        x, v, s = _operands(rng, M, K, N, x_dtype=jnp.bfloat16)
        _check(fp8_matmul(x, v, s, interpret=True), x, v, s, 2e-6)


def test_default_tuning_rules():
    for M, (K, N) in itertools.product([1, 3, 8, 17, 64, 200], LLAMA8B_KN + SMOL_KN):
        t = ft.default_tuning(M, K, N)
        ft.resolve_tuning(M, K, N, **vars(t))  # valid: powers of two, method fits M
        if M <= ft.REDUCE_MAX_M:
            continue
        assert t.method in ("dot", "wdot")


# (method, M, K, N, block_n, block_k, k_splits): the gated-MLP input [gate | up], K off the blocks
GLU_CASES = [
    ("reduce_step", 1, 100, 40, 8, 32, 1),
    ("reduce_step", 2, 256, 24, 8, 64, 3),
    ("dot", 3, 72, 33, 16, 16, 2),
    ("wdot", 17, 96, 50, 32, 32, 1),
]


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", GLU_CASES, ids=["-".join(map(str, c)) for c in GLU_CASES])
def test_glu_input_against_oracle(case, x_dtype):
    """glu=True: the product of silu(gate) * up, formed while x loads, equals the oracle's
    (the separate elementwise step, each op rounded to x's dtype) times the weight."""
    method, M, K, N, bn, bk, ks = case
    rng = np.random.default_rng(M * K + N)
    x2, v, s = _operands(rng, M, 2 * K, N, x_dtype=x_dtype)
    v = v[:, :K]
    x2 = (3.0 * x2.astype(jnp.float32)).astype(x_dtype)  # gates well into silu's curve
    tun = dict(block_n=bn, block_k=bk, k_splits=ks, method=method)
    y = fp8_matmul(x2, v, s, interpret=True, glu=True, **tun)
    assert y.shape == (M, N) and y.dtype == x_dtype
    gate, up = jnp.split(x2, 2, axis=-1)
    x_eff = (jax.nn.silu(gate.astype(jnp.float32)).astype(x_dtype) * up).astype(x_dtype)
    # exp's last bit may differ between the kernel and XLA: a silu value can round to the
    # neighbouring x_dtype value, which moves the product by that much of |x_eff| @ |W|
    slack = 2e-6 if x_dtype == jnp.float32 else 2.0**-7
    _check(y, x_eff, v, s, slack)
    ref = ref_fp8_matmul(x2, v, s, glu=True)
    _, bound = _f64(x_eff, v, s)
    diff = np.abs(
        np.asarray(jnp.asarray(y, jnp.float32), np.float64)
        - np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    )
    out_round = (
        2.0**-7 * np.abs(np.asarray(jnp.asarray(ref, jnp.float32)))
        if x_dtype == jnp.bfloat16
        else 0
    )
    assert (diff <= slack * bound + out_round + 1e-30).all()


def test_glu_needs_an_even_width():
    v = jnp.zeros((32, 32), E4M3)
    with pytest.raises(ValueError, match="glu"):
        fp8_matmul(jnp.zeros((1, 63), jnp.bfloat16), v, jnp.ones(32), interpret=True, glu=True)


def test_input_checks():
    x = jnp.zeros((2, 64), jnp.bfloat16)
    v = jnp.zeros((32, 64), E4M3)
    s = jnp.ones((32,), jnp.float32)
    bad = [
        (dict(block_n=48), "power of 2"),
        (dict(block_k=100), "power of 2"),
        (dict(method="dot", block_n=8), ">= 16"),
        (dict(method="bogus"), "method"),
        (dict(num_warps=3), "power of 2"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            fp8_matmul(x, v, s, interpret=True, **kw)
    with pytest.raises(ValueError, match="M <= 8"):
        fp8_matmul(jnp.zeros((9, 64), jnp.bfloat16), v, s, interpret=True, method="reduce")
    with pytest.raises(ValueError, match="float8"):
        fp8_matmul(x, v.astype(jnp.bfloat16), s, interpret=True)
    with pytest.raises(ValueError, match="columns"):
        fp8_matmul(jnp.zeros((2, 48), jnp.bfloat16), v, s, interpret=True)
    with pytest.raises(ValueError, match="w_scales"):
        fp8_matmul(x, v, s[:16], interpret=True)
    with pytest.raises(ValueError, match="bf16, f16, f32 or float8_e4m3fn"):
        fp8_matmul(x.astype(jnp.int8), v, s, interpret=True)


# CUDA lowering (Triton IR) on the CPU: what the engine compiles at Llama-3.1-8B decode shapes
LLAMA8B_KN = [(4096, 6144), (4096, 28672), (14336, 4096), (4096, 4096)]
SMOL_KN = [(576, 576), (576, 192), (576, 1536), (1536, 576)]


def _lower(M, K, N, **tun):
    specs = (
        jax.ShapeDtypeStruct((M, K), jnp.bfloat16),
        jax.ShapeDtypeStruct((N, K), E4M3),
        jax.ShapeDtypeStruct((N,), jnp.float32),
    )
    return lower_for_cuda(lambda x, v, s: fp8_matmul(x, v, s, **tun), *specs).mlir_module()


@pytest.mark.parametrize("M", [1, 8, 64])
def test_default_tunings_lower_for_cuda(M):
    for K, N in LLAMA8B_KN + SMOL_KN:
        txt = _lower(M, K, N)
        assert "triton" in txt, (M, K, N)


def test_every_method_lowers_for_cuda():
    for method, pf in itertools.product(ft.METHODS, [False, True]):
        bn, bk = (16, 512) if method.startswith("reduce") else (64, 256)
        for M, K, N, ks in [(3, 4096, 6144, 1), (8, 14336, 4096, 4), (5, 576, 192, 2)]:
            txt = _lower(M, K, N, method=method, prefetch=pf, block_n=bn, block_k=bk, k_splits=ks)
            assert "triton" in txt, (method, pf, M, K, N)


def test_fp8_activations_lower_for_cuda():
    """The W8A8 GEMV (fp8 x fp8 dots) at decode rows: the default tuning and the dot method, a
    K that leaves a partial block (its f16 tail) included."""
    for M, (K, N), tun in itertools.product(
        (1, 8, 16), LLAMA8B_KN[:3] + [(576, 192)], ({}, dict(method="dot", block_n=64))
    ):
        specs = (
            jax.ShapeDtypeStruct((M, K), E4M3),
            jax.ShapeDtypeStruct((N, K), E4M3),
            jax.ShapeDtypeStruct((N,), jnp.float32),
            jax.ShapeDtypeStruct((M,), jnp.float32),
        )
        f = lambda x, v, s, xs, tun=tun: fp8_matmul(  # noqa: E731
            x, v, s, x_scales=xs, out_dtype=jnp.bfloat16, **tun
        )
        assert "triton" in lower_for_cuda(f, *specs).mlir_module(), (M, K, N, tun)


def test_glu_lowers_for_cuda():
    """The down projection's default tuning at decode rows, with the gated input fused."""
    for M in (1, 8):
        K, N = 14336, 4096
        specs = (
            jax.ShapeDtypeStruct((M, 2 * K), jnp.bfloat16),
            jax.ShapeDtypeStruct((N, K), E4M3),
            jax.ShapeDtypeStruct((N,), jnp.float32),
        )
        f = lambda x, v, s: fp8_matmul(x, v, s, glu=True)  # noqa: E731
        assert "triton" in lower_for_cuda(f, *specs).mlir_module()


def test_broken_rule_is_caught(monkeypatch):
    """A block shape that is no power of two gets past our check only if the check is gone;
    the lowering must then refuse it (proof that lowering enforces Triton's rules)."""
    monkeypatch.setattr(ft, "_is_pow2", lambda v: True)
    with pytest.raises(ValueError, match="power of 2"):
        _lower(8, 4096, 4096, method="dot", block_n=48)
