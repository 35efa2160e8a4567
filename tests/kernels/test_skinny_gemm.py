"""The 16-bit skinny GEMM (kernels_pallas/skinny_gemm.py) against jnp.dot in interpret mode:
rows 1..64 (masked past M), split-K and not; its input checks; CUDA lowering at the Qwen3.5-9B
out projection's shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.lowering import lower_for_cuda
from kernels_pallas.skinny_gemm import SkinnyTuning, default_tuning, fits, skinny_matmul


@pytest.mark.parametrize(
    "M,K,N,tun",
    [
        (1, 512, 128, SkinnyTuning(block_n=64, block_k=128, k_splits=2)),
        (5, 512, 192, SkinnyTuning(block_n=64, block_k=64, k_splits=4)),
        (16, 256, 128, SkinnyTuning(block_n=128, block_k=128, k_splits=1)),
        (33, 256, 64, SkinnyTuning(block_n=64, block_k=64, k_splits=2)),
    ],
)
def test_against_jnp_dot(M, K, N, tun):
    kx, kw = jax.random.split(jax.random.key(M))
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (K, N), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
    got = skinny_matmul(x, w, interpret=True, tuning=tun)
    want = jnp.dot(x, w, preferred_element_type=jnp.float32)
    assert got.shape == (M, N) and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)


def test_default_tuning_fills_the_gpu_at_the_out_projection():
    tun = default_tuning(1, 4096, 4096)
    assert fits(1, 4096, 4096, tun)
    assert (4096 // tun.block_n) * tun.k_splits >= 132
    assert not fits(65, 4096, 4096, tun)  # more rows than a skinny GEMM takes
    assert not fits(8, 4096, 4000, tun)  # columns that do not tile


def test_input_checks():
    x = jnp.zeros((2, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="does not tile"):
        skinny_matmul(x, jnp.zeros((256, 100), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="one dtype"):
        skinny_matmul(x, jnp.zeros((256, 128), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        skinny_matmul(x, jnp.zeros((128, 128), jnp.bfloat16), interpret=True)


@pytest.mark.parametrize("M", [1, 8, 64])
def test_lowers_for_cuda(M):
    sd = jax.ShapeDtypeStruct
    fn = jax.jit(skinny_matmul)
    txt = lower_for_cuda(fn, sd((M, 4096), jnp.bfloat16), sd((4096, 4096), jnp.bfloat16))
    assert "skinny_gemm" in txt.mlir_module()
