"""A gated MLP's activation, quantized for the FP8 down projection, in one kernel (issue #17).

    g, u = y[:, :I] * rs[:, None] * cs[None, :I],  y[:, I:] * rs[:, None] * cs[None, I:]
    a = silu(g) * u;   s = max|a| / 448 per row (1 where 0);   q = e4m3(a / s)

y [M, 2I] is the gate|up GEMM's unscaled product (W8A8: fp8 x fp8), rs [M] its activation rows'
scales, cs [2I] its weight channels' scales; (q [M, I] e4m3, s [M] f32) feed the down
projection's FP8 GEMM. All math in f32. The oracle is `reference.ref_glu_quant`.

Why: XLA computes this as two fusions that each read the whole product (a row max, then the
quantized values; the silu recomputed in both), ~0.55 ms a layer at 8,192 tokens on the H200
where one read of the bf16 product takes ~0.14 (benchmarks/kernels/fp8_mlp.py). Here a program
owns `block_rows` rows. For fewer than 1,024 rows of I <= 16,384 it loads a whole row at once,
so every load of it is in flight together, and makes one pass; else rows are walked twice, `block_cols` columns at a time (the row max, then the quantized values; the second walk
reads what the first just brought into L2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.tuning import next_pow2

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = float(jnp.finfo(E4M3).max)  # 448
LOG2E = 1.4426950408889634


def _mufu(op: str, x):
    """One PTX approximate instruction per element (ex2 / rcp .approx.ftz.f32: relative error
    ~2^-22 / 2^-23, what CUDA's fast-math intrinsics give)."""
    [y] = plt.elementwise_inline_asm(
        f"{op}.approx.ftz.f32 $0, $1;",
        args=[x],
        constraints="=f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
    )
    return y


def _sigmoid(g, fast: bool, interpret: bool):
    """1 / (1 + e^-g). fast: as 1 / (1 + 2^(-g log2 e)) with the GPU's approximate ex2 and rcp
    (4 instructions a value, where expf and an IEEE division take ~20; e^-g = inf gives 0);
    interpret mode computes the same formula with jnp."""
    if not fast:
        return 1.0 / (1.0 + jnp.exp(-g))
    e = -g * LOG2E
    if interpret:
        return 1.0 / (1.0 + jnp.exp2(e))
    return _mufu("rcp", 1.0 + _mufu("ex2", e))


def _glu_quant_kernel(
    y_ref, rs_ref, cs_ref, q_ref, s_ref, *, M, I, block_rows, block_cols, fast, interpret
):
    f32 = jnp.float32
    r0 = pl.program_id(0) * block_rows
    r_ok = r0 + jnp.arange(block_rows, dtype=jnp.int32) < M
    rows = pl.ds(r0, block_rows)
    rs = plt.load(rs_ref.at[rows], mask=r_ok, other=0.0)
    n_blocks = -(-I // block_cols)

    def act(b):
        """a for columns [b * block_cols, +block_cols) of the rows, and the block's mask."""
        c0 = b * block_cols
        c_ok = c0 + jnp.arange(block_cols, dtype=jnp.int32) < I
        mask = r_ok[:, None] & c_ok[None, :]
        gate = plt.load(y_ref.at[rows, pl.ds(c0, block_cols)], mask=mask, other=0.0)
        up = plt.load(y_ref.at[rows, pl.ds(I + c0, block_cols)], mask=mask, other=0.0)
        cg = plt.load(cs_ref.at[pl.ds(c0, block_cols)], mask=c_ok, other=0.0)
        cu = plt.load(cs_ref.at[pl.ds(I + c0, block_cols)], mask=c_ok, other=0.0)
        g = gate.astype(f32) * rs[:, None] * cg[None, :]
        u = up.astype(f32) * rs[:, None] * cu[None, :]
        return g * _sigmoid(g, fast, interpret) * u, mask

    def scale_of(amax):
        return jnp.where(amax > 0, amax / E4M3_MAX, 1.0)

    def store(b, a, mask, inv):
        q = jnp.clip(a * inv[:, None], -E4M3_MAX, E4M3_MAX).astype(q_ref.dtype)
        plt.store(q_ref.at[rows, pl.ds(b * block_cols, block_cols)], q, mask=mask)

    if n_blocks == 1:  # whole rows in registers: one pass
        a, mask = act(jnp.int32(0))
        s = scale_of(jnp.max(jnp.abs(a), axis=1))
        store(jnp.int32(0), a, mask, 1.0 / s)
    else:

        def row_max(b, m):
            a, _ = act(b)
            return jnp.maximum(m, jnp.max(jnp.abs(a), axis=1))

        s = scale_of(lax.fori_loop(0, n_blocks, row_max, jnp.zeros((block_rows,), f32)))
        inv = 1.0 / s

        def quantize(b, carry):
            a, mask = act(b)
            store(b, a, mask, inv)
            return carry

        lax.fori_loop(0, n_blocks, quantize, 0)
    plt.store(s_ref.at[rows], s, mask=r_ok)


WHOLE_ROW_MAX = 16384  # widest I (rounded up to a power of two) a program holds in registers
WHOLE_ROW_MAX_M = 1024  # from this many rows on, 4-row programs walking the columns win


def default_blocks(M: int, I: int) -> tuple[int, int, int]:
    """(block_rows, block_cols, num_warps) for M rows of I. H200, I = 14,336, the kernel's device
    time (benchmarks/results/gpu_2026-12-01_glu_quant/fp8_mlp_sweep.json): at M = 320 a whole
    row a program (16 warps: 32 f32 values a thread; one pass, every load of the row in flight)
    17.6 us against 25.6 for the best column walk; at M = 8,192 4 rows a program walking 512
    columns at a time, twice (the second walk from L2) 325 us against 404-418 for whole rows
    (and 92.8 us at M = 2,048). Rows wider than 16,384 always walk."""
    width = next_pow2(I)
    if width <= WHOLE_ROW_MAX and M < WHOLE_ROW_MAX_M:
        return 1, width, max(4, min(16, width // 1024))
    return 4, 512, 4


def glu_quant(
    y,
    row_scales,
    col_scales,
    *,
    block_rows: int | None = None,
    block_cols: int | None = None,
    num_warps: int | None = None,
    fast: bool = False,
    interpret: bool = False,
):
    """(q [M, I] float8_e4m3fn, s [M] f32) of y [M, 2I] (bf16 / f16 / f32), row_scales [M],
    col_scales [2I] (module docstring). Block sizes are powers of two (Triton); None:
    `default_blocks(M, I)`. fast: the silu's sigmoid from the GPU's approximate exp2 and
    reciprocal (`_sigmoid`)."""
    if y.ndim != 2 or y.shape[1] % 2:
        raise ValueError(f"y must be [M, 2I] (the gate | up product), got {y.shape}")
    M, two_i = y.shape
    I = two_i // 2
    if row_scales.shape != (M,) or col_scales.shape != (two_i,):
        raise ValueError(
            f"row_scales must be [{M}] and col_scales [{two_i}], got {row_scales.shape}, "
            f"{col_scales.shape}"
        )
    d_rows, d_cols, d_warps = default_blocks(M, I)
    block_rows = block_rows or d_rows
    block_cols = block_cols or d_cols
    num_warps = num_warps or d_warps
    for name, v in (("block_rows", block_rows), ("block_cols", block_cols)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of 2, got {v}")
    block_cols = min(block_cols, next_pow2(I))
    kernel = functools.partial(
        _glu_quant_kernel,
        M=M,
        I=I,
        block_rows=block_rows,
        block_cols=block_cols,
        fast=bool(fast),
        interpret=bool(interpret),
    )
    return pl.pallas_call(
        kernel,
        grid=(-(-M // block_rows),),
        out_shape=[
            jax.ShapeDtypeStruct((M, I), E4M3),
            jax.ShapeDtypeStruct((M,), jnp.float32),
        ],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"glu_quant_r{block_rows}_c{block_cols}" + ("_fast" if fast else ""),
    )(y, row_scales.astype(jnp.float32), col_scales.astype(jnp.float32))
