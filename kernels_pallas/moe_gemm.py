"""Grouped expert GEMM for small MoE steps (issue #55), a Pallas kernel (Triton lowering).

    y[p] = x[p] @ W[expert[p]]        for the rows p of a step's (token, expert) pairs

For `jax.lax.ragged_dot`, `models/moe.py` sorts a step's T * k pairs by expert and it multiplies
each group by its expert. At decode sizes a step hits a few of the E experts (a Qwen3-30B-A3B token:
8 of 128), and the weight bytes a step must read are those of the distinct experts hit. This
kernel reads exactly those: the pairs are laid out (no sort at decode sizes) in tiles of `block_m` rows that each
belong to one expert (`tile_layout`, vLLM's moe_align_block_size), and program (tile, n block)
streams its expert's [K, block_n] weights once, `block_k` rows a step, into an f32 accumulator
for the tile's rows (Triton's dot: block_m >= 16; a decode tile holds one pair and 15 zero
rows, and the step is bound by the weight stream anyway). Tiles past the used ones return at
once. The tile count is static (`max_tiles`): fixed shapes per token bucket, 0 recompiles.

Weights: [E, K, N] in x's dtype (the stacked layout models/moe.py keeps), or FP8 values
[E, N, K] (e4m3, HF's [out, in]) with per-output-channel scales [E, N], upcast in registers and
scaled once at the end (`grouped_matmul(..., w_scales=...)`).

The GPU's default (`models/moe.moe_kernel`): on one H100 it ran Qwen3-30B-A3B's experts at 1.5-2.5
TB/s of the weights hit from 1 to 512 tokens, where XLA's ragged_dot read every expert
(benchmarks/results/gpu_2026-12-07d_moe/). The oracle is `ref_grouped_matmul`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

BLOCK_M = 16  # Triton's smallest dot; a decode tile holds one pair


def max_tiles(num_rows: int, num_experts: int, block_m: int = BLOCK_M) -> int:
    """Tiles enough for any routing of num_rows sorted pairs: each expert's group rounds up to
    whole tiles, so at most one partial tile per expert hit beside the full ones."""
    return -(-num_rows // block_m) + min(num_rows, num_experts)


# Up to this many pairs a pair's rank in its expert's group is counted pairwise ([M, M], one
# fused reduce: a decode step's 8 to 4,096 pairs); past it (prefill steps) by a stable argsort.
# The argsort cost a Qwen3-30B-A3B decode step 0.3 ms (8 tokens) to 0.85 ms (256) on the H100
# (benchmarks/results/gpu_2026-12-07f/, `models/moe.py:227 sort`).
PAIRWISE_RANK_MAX = 4096


def _rank_in_group(ids: jax.Array, sizes: jax.Array) -> jax.Array:
    """[M]: how many earlier pairs (in ids' order) have each pair's expert."""
    M = ids.shape[0]
    p = jnp.arange(M, dtype=jnp.int32)
    if M <= PAIRWISE_RANK_MAX:
        earlier = (ids[None, :] == ids[:, None]) & (p[None, :] < p[:, None])
        return jnp.sum(earlier, axis=1, dtype=jnp.int32)
    order = jnp.argsort(ids, stable=True).astype(jnp.int32)
    group_start = jnp.cumsum(sizes) - sizes
    e_sorted = jnp.minimum(ids[order], sizes.shape[0] - 1)
    return jnp.zeros(M, jnp.int32).at[order].set(p - group_start[e_sorted])


def tile_layout(ids: jax.Array, num_experts: int, block_m: int = BLOCK_M):
    """ids [M] (each pair's expert, in any order; >= num_experts: a pair no local expert takes)
    -> (tile_expert [NT] (-1: an unused tile), row_of [M] (each pair's row in the tiled layout
    [NT * block_m], or NT * block_m for a pair without a tile), src [NT * block_m] (the pair
    each tiled row holds, or M for padding)). Tiles go by expert, ascending; within an expert
    its pairs keep their order (`_rank_in_group`)."""
    M = ids.shape[0]
    NT = max_tiles(M, num_experts, block_m)
    ids = jnp.asarray(ids, jnp.int32)
    local = ids < num_experts
    e = jnp.minimum(ids, num_experts - 1)
    sizes = jnp.zeros(num_experts, jnp.int32).at[ids].add(1, mode="drop")
    within = _rank_in_group(ids, sizes)
    tiles = -(-sizes // block_m)
    tile_start = jnp.cumsum(tiles) - tiles
    used = jnp.sum(tiles)
    t = jnp.arange(NT, dtype=jnp.int32)
    # the expert of tile t: the last expert with tiles whose first tile is <= t
    starts = (tiles[None, :] > 0) & (tile_start[None, :] <= t[:, None])  # [NT, E]
    e_of_t = jnp.max(jnp.where(starts, jnp.arange(num_experts)[None, :], -1), axis=1)
    tile_expert = jnp.where(t < used, e_of_t, -1).astype(jnp.int32)
    p = jnp.arange(M, dtype=jnp.int32)
    row_of = jnp.where(local, tile_start[e] * block_m + within, NT * block_m)
    src = jnp.full((NT * block_m,), M, jnp.int32).at[row_of].set(p, mode="drop")
    return tile_expert, row_of.astype(jnp.int32), src


def _kernel(te_ref, x_ref, w_ref, *refs, K, block_m, block_n, block_k, fp8, glu, half, shared_x):
    s_ref, o_ref = refs if fp8 else (None, *refs)
    t, nb = pl.program_id(0), pl.program_id(1)
    e = te_ref[t]
    rows = pl.ds(t * block_m, block_m)
    x_rows = pl.ds(0, block_m) if shared_x else rows
    n0 = nb * block_n
    cols = (n0, n0 + half) if glu else (n0,)  # glu: the gate's columns and the up's

    def weights(k0, c):
        if fp8:  # values [E, N, K]: the [block_n, block_k] block, upcast exactly
            return w_ref[e, pl.ds(c, block_n), pl.ds(k0, block_k)]
        return w_ref[e, pl.ds(k0, block_k), pl.ds(c, block_n)]

    def dot(xb, wb):
        wb = wb.astype(xb.dtype)
        dims = (((1,), (1,)), ((), ())) if fp8 else (((1,), (0,)), ((), ()))
        return jax.lax.dot_general(xb, wb, dims, preferred_element_type=jnp.float32)

    @pl.when(e >= 0)
    def _():
        def step(i, accs):
            k0 = i * block_k
            xb = x_ref[x_rows, pl.ds(k0, block_k)]
            return tuple(a + dot(xb, weights(k0, c)) for a, c in zip(accs, cols))

        zero = jnp.zeros((block_m, block_n), jnp.float32)
        accs = jax.lax.fori_loop(0, K // block_k, step, tuple(zero for _ in cols))
        if fp8:
            accs = tuple(
                a * s_ref[e, pl.ds(c, block_n)].astype(jnp.float32)[None, :]
                for a, c in zip(accs, cols)
            )
        out = jax.nn.silu(accs[0]) * accs[1] if glu else accs[0]
        o_ref[rows, pl.ds(n0, block_n)] = out.astype(o_ref.dtype)


def _block(size: int, want: int, name: str) -> int:
    b = min(size, want)
    if b < 16 or b & (b - 1) or size % b:
        raise ValueError(f"{name}={size} needs a power-of-two block >= 16 dividing it (tried {b})")
    return b


def grouped_matmul(
    x,
    w,
    tile_expert,
    *,
    w_scales=None,
    glu=False,
    shared_x=False,
    block_m=BLOCK_M,
    block_n=None,
    block_k=None,
    num_warps=4,
    num_stages=3,
    interpret=False,
):
    """x [NT * block_m, K] (tile_layout's tiled rows) @ each tile's expert of w -> [NT *
    block_m, N] in x's dtype (unused tiles' rows undefined). w: [E, K, N] in x's dtype, or
    FP8 values [E, N, K] with w_scales [E, N] f32. glu: w's N is a gate's columns then an up's
    (an expert's fused gate|up), and the result is silu(gate) * up [NT * block_m, N / 2] from
    the f32 products: the SwiGLU's two halves never leave the kernel. shared_x: x is one
    tile's [block_m, K] rows that every tile multiplies (a one-token step, each tile one of its
    experts: the token is not copied k times)."""
    fp8 = w_scales is not None
    E = w.shape[0]
    K, N = (w.shape[2], w.shape[1]) if fp8 else (w.shape[1], w.shape[2])
    NT = tile_expert.shape[0]
    if x.shape != ((1 if shared_x else NT) * block_m, K):
        tiles = 1 if shared_x else NT
        raise ValueError(f"x must be [{tiles} tiles x {block_m}, {K}], got {x.shape}")
    if fp8 and w_scales.shape != (E, N):
        raise ValueError(f"w_scales must be [{E}, {N}], got {w_scales.shape}")
    if glu and N % 2:
        raise ValueError(f"glu needs an even N (gate | up), got {N}")
    out_n = N // 2 if glu else N
    block_n = _block(out_n, block_n or 64, "N")
    block_k = _block(K, block_k or 64, "K")
    kernel = functools.partial(
        _kernel,
        K=K,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        fp8=fp8,
        glu=glu,
        half=N // 2,
        shared_x=shared_x,
    )
    args = (tile_expert, x, w) + ((w_scales,) if fp8 else ())
    return pl.pallas_call(
        kernel,
        grid=(NT, out_n // block_n),
        out_shape=jax.ShapeDtypeStruct((NT * block_m, out_n), x.dtype),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"moe_grouped_{'glu' if glu else 'matmul'}_{'fp8' if fp8 else 'w16'}",
    )(*args)


def grouped_pairs_matmul(xs, w, ids, *, w_scales=None, interpret=False, **tuning):
    """xs [M, K] (the pairs' rows, any order) @ each row's expert -> [M, N]: the tiled layout,
    the kernel, and the rows back in pair order (a pair no local expert takes: 0)."""
    E = w.shape[0]
    tile_expert, row_of, src = tile_layout(ids, E)
    M = xs.shape[0]
    tiled = jnp.concatenate([xs, jnp.zeros((1, xs.shape[1]), xs.dtype)])[src]
    y = grouped_matmul(tiled, w, tile_expert, w_scales=w_scales, interpret=interpret, **tuning)
    y = jnp.concatenate([y, jnp.zeros((1, y.shape[1]), y.dtype)])
    return y[jnp.minimum(row_of, y.shape[0] - 1)][:M]


def ref_grouped_matmul(xs, w, sorted_ids, w_scales=None, glu=False):
    """The oracle: each row times its expert's dense weight (f32), 0 for non-local pairs; glu:
    silu of the product's first half times its second (f32)."""
    E = w.shape[0]
    e = jnp.clip(sorted_ids, 0, E - 1)
    ww = w.astype(jnp.float32)
    if w_scales is not None:  # values [E, N, K] * scales [E, N] -> [E, K, N]
        ww = jnp.swapaxes(ww * w_scales[:, :, None], 1, 2)
    y = jnp.einsum("mk,mkn->mn", xs.astype(jnp.float32), ww[e], precision="highest")
    if glu:
        gate, up = jnp.split(y, 2, axis=-1)
        y = jax.nn.silu(gate) * up
    return jnp.where((sorted_ids < E)[:, None], y, 0.0).astype(xs.dtype)
