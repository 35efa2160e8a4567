"""A 16-bit skinny GEMM for decode steps, a Pallas kernel (Triton lowering):

    y[M, N] = x[M, K] @ w[K, N], accumulated in f32, M small (1..64)

w in the engine's [in, out] layout (N contiguous). The oracle is `jnp.dot`.

Why a kernel: Qwen3.5's decode steps compile their GEMMs with cuBLAS (XLA's Triton GEMM
fusions ran at ~2 TB/s in the step, and XLA's pick between them varied between compiles), but
cuBLAS runs the 32 [4096, 4096] out projections a token at ~0.9 TB/s: 37-41 us each against
13.8 for XLA's Triton GEMM alone, ~1.2 ms of a 6.5 ms batch-1 step on the H100. Splitting K
into a batched cuBLAS GEMM did not help (32-37 us; at M = 1 XLA made it a reduction and the
step got slower: benchmarks/results/gpu_2026-12-06c_qwen35_defaults/).

Design: grid = (N / block_n, k_splits). A program owns `block_n` output columns and one K
slice of K / k_splits, which it walks `block_k` rows a step (a `fori_loop` Triton
software-pipelines over `num_stages` buffers): x's [block_m, block_k] block (block_m = M rounded
up to a power of two >= 16, Triton's smallest dot; rows past M load as zeros and are never
stored) times w's [block_k, block_n] block on the tensor cores, into an f32 accumulator. With
k_splits > 1 each program writes f32 partials [k_splits, M, N] that one jnp sum reduces (an
XLA fusion), so N / block_n x k_splits programs fill the SMs where N / block_n alone cannot.
Not yet run on a GPU (2026-12-06: the lease's device time went on refused starts), so the
model takes it only with PAXENGINE_KERNEL_SKINNY=auto (qwen3_5.SKINNY_DEFAULT is "off"); the
sweep and the step A/B are benchmarks/results/gpu_2026-12-06c_qwen35_defaults/call4.sh.
Shapes must tile exactly (K % (block_k k_splits) == 0, N % block_n == 0): `fits` says whether
a shape does, and the model falls back to XLA's GEMM where it does not.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.tuning import next_pow2

MAX_ROWS = 64


@dataclasses.dataclass(frozen=True)
class SkinnyTuning:
    block_n: int = 64
    block_k: int = 128
    k_splits: int = 4
    num_warps: int = 4
    num_stages: int = 3


def default_tuning(M: int, K: int, N: int, num_sms: int = 132) -> SkinnyTuning:
    """From the shape alone: enough (column block, K slice) programs for every SM twice, K
    slices of at least 512 rows. (Unmeasured starting point: the GPU sweep is
    `python3 -m benchmarks.gpu.skinny_probe`.)"""
    tun = SkinnyTuning()
    splits = 1
    while (N // tun.block_n) * splits < 2 * num_sms and K // (2 * splits) >= 512:
        splits *= 2
    return dataclasses.replace(tun, k_splits=splits)


def fits(M: int, K: int, N: int, tun: SkinnyTuning) -> bool:
    return 1 <= M <= MAX_ROWS and N % tun.block_n == 0 and K % (tun.block_k * tun.k_splits) == 0


def _kernel(x_ref, w_ref, o_ref, *, M, block_m, block_n, block_k, per, k_splits):
    n0 = pl.program_id(0) * block_n
    sp = pl.program_id(1)
    rows = jnp.arange(block_m, dtype=jnp.int32) < M
    x_mask = jnp.broadcast_to(rows[:, None], (block_m, block_k))

    def step(i, acc):
        k0 = (sp * per + i) * block_k
        x = plt.load(x_ref.at[pl.ds(0, block_m), pl.ds(k0, block_k)], mask=x_mask, other=0.0)
        w = w_ref[pl.ds(k0, block_k), pl.ds(n0, block_n)]
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, per, step, jnp.zeros((block_m, block_n), jnp.float32))
    lead = (sp,) if k_splits > 1 else ()
    idx = (*lead, pl.ds(0, block_m), pl.ds(n0, block_n))
    out_mask = jnp.broadcast_to(rows[:, None], (block_m, block_n))
    plt.store(o_ref.at[idx], acc.astype(o_ref.dtype), mask=out_mask)


def skinny_matmul(x, w, *, interpret=False, tuning: SkinnyTuning | None = None) -> jax.Array:
    """x [M, K] @ w [K, N] in x's dtype (bf16 / f16), f32 accumulation; M <= MAX_ROWS."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"x [M, K] and w [K, N] expected, got {x.shape}, {w.shape}")
    if x.dtype != w.dtype or x.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"bf16 / f16 operands of one dtype expected, got {x.dtype}, {w.dtype}")
    M, K = x.shape
    N = w.shape[1]
    tun = tuning or default_tuning(M, K, N)
    if not fits(M, K, N, tun):
        raise ValueError(f"[{M}, {K}] @ [{K}, {N}] does not tile by {tun}")
    splits = tun.k_splits
    kernel = functools.partial(
        _kernel,
        M=M,
        block_m=max(16, next_pow2(M)),
        block_n=tun.block_n,
        block_k=tun.block_k,
        per=K // (tun.block_k * splits),
        k_splits=splits,
    )
    lead = (splits,) if splits > 1 else ()
    out_dtype = jnp.float32 if splits > 1 else x.dtype
    y = pl.pallas_call(
        kernel,
        grid=(N // tun.block_n, splits),
        out_shape=jax.ShapeDtypeStruct((*lead, M, N), out_dtype),
        compiler_params=plt.CompilerParams(num_warps=tun.num_warps, num_stages=tun.num_stages),
        interpret=interpret,
        name=f"skinny_gemm_n{tun.block_n}_k{tun.block_k}_s{splits}",
    )(x, w)
    return y.sum(axis=0).astype(x.dtype) if splits > 1 else y
