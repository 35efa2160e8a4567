"""The grouped expert GEMM (kernels_pallas/moe_gemm.py, interpret mode) against the dense
per-expert oracle on random routings: experts with no pairs, with several tiles, pairs of
another device's experts (sorted last, expert parallelism), bf16 [E, K, N] and FP8 [E, N, K]
weights; the tile layout's invariants; CUDA lowering at Qwen3-30B-A3B shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.lowering import lower_for_cuda
from kernels_pallas.moe_gemm import (
    BLOCK_M,
    grouped_matmul,
    grouped_pairs_matmul,
    max_tiles,
    ref_grouped_matmul,
    tile_layout,
)


def _routing(rng, M, E, foreign=0):
    """M sorted expert ids: a skewed draw (one expert over two tiles, most with none) and
    `foreign` pairs of other devices' experts (id E), sorted last."""
    ids = rng.choice(E, size=M - foreign, p=np.r_[0.6, np.full(E - 1, 0.4 / (E - 1))])
    return jnp.asarray(np.sort(np.r_[ids, np.full(foreign, E)]), jnp.int32)


@pytest.mark.parametrize("order", ["sorted", "shuffled", "shuffled_argsort"])
def test_tile_layout_puts_each_pair_in_a_tile_of_its_expert(order, monkeypatch):
    """Sorted or not (a step's routing as it comes), by the pairwise rank or (past
    PAIRWISE_RANK_MAX pairs) the argsort: each pair in a tile of its expert, tiles ascending
    by expert, an expert's pairs in their order, foreign pairs without a row."""
    import kernels_pallas.moe_gemm as mg

    if order == "shuffled_argsort":
        monkeypatch.setattr(mg, "PAIRWISE_RANK_MAX", 8)
    rng = np.random.default_rng(0)
    E, M = 12, 50
    ids = _routing(rng, M, E, foreign=3)
    if order != "sorted":
        ids = jnp.asarray(rng.permutation(np.asarray(ids)))
    te, row_of, src = map(np.asarray, tile_layout(ids, E))
    NT = max_tiles(M, E)
    assert te.shape == (NT,) and src.shape == (NT * BLOCK_M,)
    ids = np.asarray(ids)
    for p in range(M):
        if ids[p] < E:
            assert te[row_of[p] // BLOCK_M] == ids[p] and src[row_of[p]] == p
            later = [q for q in range(p + 1, M) if ids[q] == ids[p]]
            assert all(row_of[q] > row_of[p] for q in later)
        else:
            assert row_of[p] == NT * BLOCK_M
    used = te[te >= 0]
    assert (te[: len(used)] == used).all() and (np.diff(used) >= 0).all()  # used tiles first
    counts = np.bincount(ids[ids < E], minlength=E)
    assert len(used) == sum(-(-c // BLOCK_M) for c in counts)
    assert sorted(src[src < M].tolist()) == [p for p in range(M) if ids[p] < E]


@pytest.mark.parametrize("case", ["bf16_decode", "f32_skewed_foreign", "fp8"])
def test_grouped_matmul_against_the_dense_oracle(case):
    rng = np.random.default_rng({"bf16_decode": 1, "f32_skewed_foreign": 2, "fp8": 3}[case])
    E, K, N = 8, 64, 96 if case != "fp8" else 32
    M, foreign = {"bf16_decode": (6, 0), "f32_skewed_foreign": (40, 5), "fp8": (24, 2)}[case]
    dtype = jnp.bfloat16 if case != "f32_skewed_foreign" else jnp.float32
    ids = _routing(rng, M, E, foreign)
    xs = jnp.asarray(rng.standard_normal((M, K)), dtype)
    scales = None
    if case == "fp8":
        w = jnp.asarray(rng.standard_normal((E, N, K)) * 2, jnp.float8_e4m3fn)
        scales = jnp.asarray(rng.uniform(0.01, 0.1, (E, N)), jnp.float32)
    else:
        w = jnp.asarray(rng.standard_normal((E, K, N)) * 0.2, dtype)
    kw = dict(w_scales=scales, interpret=True, block_n=32, block_k=32)
    got = jax.jit(lambda *a: grouped_pairs_matmul(*a, **kw))(xs, w, ids)
    want = ref_grouped_matmul(xs, w, ids, scales)
    assert got.shape == (M, N) and got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol
    )
    assert not np.asarray(got, np.float32)[np.asarray(ids) >= E].any()  # other devices' pairs


@pytest.mark.parametrize("fp8", [False, True])
def test_glu_mode_against_the_oracle(fp8):
    """glu: a fused gate|up stack's silu(gate) * up straight out of the kernel (f32 products),
    pairs of another device's experts 0."""
    rng = np.random.default_rng(4 + fp8)
    E, K, I, M = 8, 64, 32, 20
    ids = _routing(rng, M, E, foreign=2)
    xs = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    scales = None
    if fp8:
        w = jnp.asarray(rng.standard_normal((E, 2 * I, K)) * 2, jnp.float8_e4m3fn)
        scales = jnp.asarray(rng.uniform(0.01, 0.1, (E, 2 * I)), jnp.float32)
    else:
        w = jnp.asarray(rng.standard_normal((E, K, 2 * I)) * 0.2, jnp.bfloat16)
    kw = dict(w_scales=scales, glu=True, interpret=True, block_n=16, block_k=32)
    got = jax.jit(lambda *a: grouped_pairs_matmul(*a, **kw))(xs, w, ids)
    want = ref_grouped_matmul(xs, w, ids, scales, glu=True)
    plain = ref_grouped_matmul(xs, w, ids, scales)  # (the glu is not the product's first half)
    assert got.shape == (M, I) and got.dtype == jnp.bfloat16
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    assert np.abs(got - np.asarray(plain, np.float32)[:, :I]).max() > 0.1
    assert not got[np.asarray(ids) >= E].any()


def test_input_checks():
    te = jnp.zeros((2,), jnp.int32)
    w = jnp.zeros((4, 64, 48), jnp.bfloat16)
    with pytest.raises(ValueError, match="x must be"):
        grouped_matmul(jnp.zeros((16, 64), jnp.bfloat16), w, te, interpret=True)
    with pytest.raises(ValueError, match="power-of-two block"):
        grouped_matmul(jnp.zeros((32, 64), jnp.bfloat16), w, te, interpret=True)


@pytest.mark.parametrize(
    "fp8,block_m,glu,shared_x",
    [(False, BLOCK_M, False, False), (True, BLOCK_M, True, True), (False, 64, True, False)],
)
def test_lowers_for_cuda(fp8, block_m, glu, shared_x):
    """Qwen3-30B-A3B: 128 experts, hidden 2048, 768 a expert; a 64-token step's 512 pairs
    through the fused gate|up [2048 -> 1536] (and in 64-row tiles, models/moe.tile_rows; glu:
    its SwiGLU in the kernel; shared_x: a one-token step's tiles all reading its one tile)."""
    E, K, N, M = 128, 2048, 1536, 512
    sd = jax.ShapeDtypeStruct
    NT = max_tiles(M, E, block_m)
    if fp8:
        args = (sd((E, N, K), jnp.float8_e4m3fn), sd((E, N), jnp.float32))
    else:
        args = (sd((E, K, N), jnp.bfloat16),)

    def fn(x, te, w, *s):
        s = s[0] if s else None
        return grouped_matmul(x, w, te, w_scales=s, block_m=block_m, glu=glu, shared_x=shared_x)

    x = sd(((1 if shared_x else NT) * block_m, K), jnp.bfloat16)
    txt = lower_for_cuda(fn, x, sd((NT,), jnp.int32), *args).mlir_module()
    assert "triton" in txt
