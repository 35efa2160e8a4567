"""A mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE / Qwen3.5-MoE's shared expert, Mixtral's routing):
router logits -> softmax -> top-k (renormalised with `norm_topk_prob`), each token through its k
experts' SwiGLU MLPs, their outputs summed by the routing weights; an optional shared expert every
token goes through, scaled by sigmoid(x . w_shared_gate).

The experts' weights are stacked [E, in, out] (`e_gate`, `e_up` or their fusion `e_gate_up`,
`e_down`; an `Fp8Weight` of the same shape: values [E, out, in], scales [E, out]). The grouped
GEMMs: the T * k (token, expert) pairs are sorted by expert and each projection is one
`jax.lax.ragged_dot` over the groups, so every step has one shape per token bucket whatever the
routing (an expert with no tokens is a group of size 0); the products go back to their tokens by
one scatter-add, weighted.

Under expert parallelism (parallel.py) a device holds experts [first_expert, first_expert + E_local)
and routes every token: its pairs with other devices' experts are sorted last, outside every
group, and add nothing; the tensor-parallel all-reduce after the MLP sums the devices' outputs.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from paxengine.models.quant import Fp8Weight, gated_mlp, linear, row_dot


def route(x: jax.Array, w_router, top_k: int, norm_topk_prob: bool):
    """x [T, H], w_router [H, E] -> (weights [T, k] in x's dtype, expert ids [T, k] int32), as
    HF's Qwen3MoeTopKRouter: softmax in float32, top-k, renormalised or not."""
    logits = row_dot(x, w_router, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), ids.astype(jnp.int32)


def _grouped(x: jax.Array, w, sizes: jax.Array, row_expert: jax.Array) -> jax.Array:
    """x [M, in] (rows sorted by expert, `sizes` [E] of them each) @ each row's expert of w
    [E, in, out]. An Fp8Weight: the e4m3 values upcast in the dot, its per-output-channel scales
    applied to each row's product (they commute with the matmul)."""
    if isinstance(w, Fp8Weight):
        dims = (((1,), (2,)), ((), ()))  # contract x's in with the values' [E, out, in] in
        y = jax.lax.ragged_dot_general(
            x,
            w.values.astype(x.dtype),
            sizes,
            jax.lax.RaggedDotDimensionNumbers(
                dims, lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
            ),
            preferred_element_type=jnp.float32,
        )
        return (y * w.scales[row_expert]).astype(x.dtype)
    return jax.lax.ragged_dot(
        x, w.astype(x.dtype), sizes, preferred_element_type=jnp.float32
    ).astype(x.dtype)


def moe_kernel(num_tokens: int) -> str:
    """How a step of num_tokens tokens runs its grouped GEMMs: "pallas" (kernels_pallas.
    moe_gemm: only the experts a step hits are read; the GPU's default), "xla"
    (`jax.lax.ragged_dot`, elsewhere) or "interpret" (the kernel in interpret mode, tests on a
    CPU); PAXENGINE_KERNEL_MOE overrides it, and a step of more tokens than
    PAXENGINE_KERNEL_MOE_MAX_TOKENS (no limit when unset) takes ragged_dot. Both variables are
    part of the executables' key.

    Why the kernel on the GPU (one H100, jax 0.11.2, Qwen3-30B-A3B's experts, one layer's
    gate_up + down; benchmarks/results/gpu_2026-12-07d_moe/): XLA compiles ragged_dot into
    dense GEMMs over all 128 experts, 406 / 451 / 792 / 3,189 / 6,428 / 25,443 us at 1 / 8 /
    64 / 256 / 512 / 2,048 tokens against the kernel's 49 / 200 / 495 / 552 / 713 / 1,652;
    with it the engine's 4,096-token step did not compile (its autotuning ran out of memory)."""
    default = "pallas" if jax.default_backend() == "gpu" else "xla"
    mode = os.environ.get("PAXENGINE_KERNEL_MOE", default)
    if mode not in ("xla", "pallas", "interpret"):
        raise ValueError(f"PAXENGINE_KERNEL_MOE must be xla, pallas or interpret, got {mode!r}")
    limit = os.environ.get("PAXENGINE_KERNEL_MOE_MAX_TOKENS", "")
    if mode != "xla" and limit and num_tokens > int(limit):
        return "xla"
    return mode


# Steps of more (token, expert) pairs than this many per expert take 64-row tiles (tile_rows):
# each tile reads its expert's weights, so with 16-row tiles an expert of ~16 pairs is read about
# twice; a 64-row tile reads it once, its padding rows costing compute only (hidden under the
# weight stream: a step of 128 experts in 64-row tiles is ~4 TFLOP against ~17 ms of weights).
# One H100 (benchmarks/results/gpu_2026-12-07f/): a 256-sequence decode step of Qwen3-30B-A3B
# (2,048 pairs, 16 an expert) spent 46 ms in 16-row kernels where a 64-sequence step, every
# expert hit too, spent 21; a 2,048-token step's layer took 1,153 us in 64-row tiles against
# 1,652 in 16-row ones (gpu_2026-12-07e_moe/, _07d_moe/). 8: Qwen3-30B-A3B's 256-token steps
# and up (was 2,048 pairs flat: its 257-token steps and up).
BIG_TILE_PAIRS_PER_EXPERT = 8


def tile_rows(num_pairs: int, num_experts: int) -> int:
    """The kernel's rows a tile: 16 (Triton's smallest dot; a decode step's expert has a pair
    or two), or 64 for steps of more than BIG_TILE_PAIRS_PER_EXPERT pairs an expert
    (PAXENGINE_KERNEL_MOE_BIG_TILE_PAIRS sets the limit in pairs; PAXENGINE_KERNEL_MOE_TILE_ROWS
    sets every step's rows: A/B knobs, part of the executables' key)."""
    forced = os.environ.get("PAXENGINE_KERNEL_MOE_TILE_ROWS")  # an A/B knob: every step's rows
    if forced:
        rows = int(forced)
        if rows < 16 or rows & (rows - 1):
            raise ValueError(
                f"PAXENGINE_KERNEL_MOE_TILE_ROWS must be a power of two >= 16, got {forced}"
            )
        return rows
    limit = os.environ.get("PAXENGINE_KERNEL_MOE_BIG_TILE_PAIRS")
    limit = int(limit) if limit else BIG_TILE_PAIRS_PER_EXPERT * num_experts
    return 64 if num_pairs > limit else 16


# The kernel's tiling for 16-row tiles (decode-sized steps), grouped_matmul's keywords: empty
# for its defaults (block_n 64, block_k 64, 4 warps, 3 stages). Two sweeps on one H100 at 1 and 8
# tokens (gpu_2026-12-07e_moe/, calls B and S) disagreed by more than their best tunings' gains.
DECODE_TUNING: dict = {}
TUNING_FIELDS = ("block_n", "block_k", "num_warps", "num_stages")


def decode_tuning() -> dict:
    """The kernel's keywords for 16-row tiles: DECODE_TUNING, or PAXENGINE_KERNEL_MOE_DECODE_TUNING
    ("block_n=32,block_k=256,num_warps=4,num_stages=4"; any of TUNING_FIELDS): an A/B knob, part
    of the executables' key."""
    from kernels_pallas.tuning import parse_tuning_spec

    var = "PAXENGINE_KERNEL_MOE_DECODE_TUNING"
    spec = os.environ.get(var)
    if spec is None:
        return dict(DECODE_TUNING)
    return parse_tuning_spec(var, spec, TUNING_FIELDS, signed=False)


def kernel_glu() -> bool:
    """Whether the kernel path computes the experts' SwiGLU inside the gate|up kernel
    (`grouped_matmul(glu=True)`: no [rows, 2I] product written and read back, one XLA op a layer
    fewer); PAXENGINE_KERNEL_MOE_GLU=0 gives the separate product and SwiGLU back (an A/B knob,
    part of the executables' key)."""
    return os.environ.get("PAXENGINE_KERNEL_MOE_GLU", "1") != "0"


def _swiglu(in_proj, down_proj, rows, w: dict, fused_glu=None):
    """The experts' SwiGLU on rows laid out for `in_proj(rows, stack)` (ragged_dot's groups or
    the kernel's tiles): gate|up fused (`e_gate_up`) or apart, then `down_proj(act, e_down)`.
    fused_glu(rows, e_gate_up) -> silu(gate) * up in one pass (the kernel's glu mode)."""
    if "e_gate_up" in w and fused_glu is not None:
        act = fused_glu(rows, w["e_gate_up"])
    elif "e_gate_up" in w:
        gate, up = jnp.split(in_proj(rows, w["e_gate_up"]), 2, axis=-1)
        act = jax.nn.silu(gate) * up
    else:
        act = jax.nn.silu(in_proj(rows, w["e_gate"])) * in_proj(rows, w["e_up"])
    return down_proj(act, w["e_down"])


def _tiled_matmul(xt, w, tile_expert, block_m: int, interpret: bool, glu=False, shared_x=False):
    """xt [NT * block_m, in] (tile_layout's rows; shared_x: one tile's rows for every tile) @
    each tile's expert of w, in xt's dtype (glu: silu(gate) * up of a fused gate|up stack)."""
    from kernels_pallas.moe_gemm import BLOCK_M, grouped_matmul

    kw = dict(block_m=block_m, interpret=interpret, glu=glu, shared_x=shared_x)
    if block_m == BLOCK_M:
        kw.update(decode_tuning())
    if isinstance(w, Fp8Weight):
        return grouped_matmul(xt, w.values, tile_expert, w_scales=w.scales, **kw)
    return grouped_matmul(xt, w.astype(xt.dtype), tile_expert, **kw)


def _experts_tiled(x, weights, w, flat, interpret: bool):
    """grouped_experts through the Pallas kernel: the pairs (flat [T * k], each one's expert)
    laid out once in tiles of one expert each (`tile_layout`: no sort at decode sizes), each
    tiled row gathered straight from its token, the three projections on the tiled rows, and
    the weighted products added straight into their tokens (a decode step's layer is a few XLA
    ops besides the kernels: on the H100 ~25 small ones a layer cost a batch-1 step of
    Qwen3-30B-A3B ~4 ms of its 6.7)."""
    from kernels_pallas.moe_gemm import tile_layout

    t, h = x.shape
    k = weights.shape[1]
    num_experts = w["e_down"].shape[0]
    m = flat.shape[0]
    block_m = tile_rows(m, num_experts)
    tile_expert, _, src = tile_layout(flat, num_experts, block_m)  # src: pair, or m
    real = src < m  # rows of a pair (not padding, not an unused tile's)
    pair = jnp.minimum(src, m - 1)  # the pair's index in the [T * k] routing
    token = jnp.where(real, pair // k, t)  # t: a zero row in, dropped out
    xt = jnp.concatenate([x, jnp.zeros((1, h), x.dtype)])[token]
    mm = functools.partial(
        _tiled_matmul, tile_expert=tile_expert, block_m=block_m, interpret=interpret
    )
    glu = functools.partial(mm, glu=True) if kernel_glu() else None
    y = _swiglu(mm, mm, xt, w, glu).astype(jnp.float32)
    pair_weight = weights.reshape(-1)[pair].astype(jnp.float32)
    y = jnp.where(real[:, None], y * pair_weight[:, None], 0.0)  # unused tiles: undefined rows
    out = jnp.zeros((t + 1, h), jnp.float32).at[token].add(y)
    return out[:t].astype(x.dtype)


def _experts_one_token(x, weights, flat, w, interpret: bool):
    """A one-token step (batch-1 decode) through the kernel: its k experts are distinct, so each
    (token, expert) pair is a tile of its own in routing order, every tile reading the token's
    one padded tile (`shared_x`): no sort, no tile layout, no copies of the token, no scatter
    (the kernel reads the same k experts), and the k products are summed in place. flat [k]:
    the experts, >= E for another device's."""
    from kernels_pallas.moe_gemm import BLOCK_M

    k, h = flat.shape[0], x.shape[1]
    local = flat < w["e_down"].shape[0]
    tile_expert = jnp.where(local, flat, -1).astype(jnp.int32)  # -1: the kernel skips it
    mm = functools.partial(
        _tiled_matmul, tile_expert=tile_expert, block_m=BLOCK_M, interpret=interpret
    )
    first = functools.partial(mm, shared_x=True)  # every tile reads the token's one tile
    glu = functools.partial(first, glu=True) if kernel_glu() else None
    x16 = jnp.pad(x, ((0, BLOCK_M - 1), (0, 0)))
    y = _swiglu(first, mm, x16, w, glu).reshape(k, BLOCK_M, h)[:, 0]
    y = y.astype(jnp.float32) * weights.reshape(k, 1).astype(jnp.float32)
    y = jnp.where(local[:, None], y, 0.0)  # a skipped tile's rows are undefined
    return jnp.sum(y, axis=0, keepdims=True).astype(x.dtype)


def grouped_experts(
    x: jax.Array, weights: jax.Array, ids: jax.Array, w: dict, first_expert=None, real=None
) -> jax.Array:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]): x [T, H], weights / ids [T, k], w the
    layer's expert weights (`e_gate_up` or `e_gate` and `e_up`, `e_down`) -> [T, H].
    first_expert (expert parallelism): w holds experts first_expert.. only; the sum is over
    the pairs with those. real [T] (optional): the bucket's real tokens; a padding token's
    pairs go to no expert (its row is 0), so its routing reads no weights."""
    t, k = ids.shape
    num_experts = w["e_down"].shape[0]
    flat = ids.reshape(-1)
    if first_expert is not None:  # another device's expert: group `num_experts`, past the last
        flat = flat - first_expert
        flat = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    if real is not None:
        flat = jnp.where(jnp.repeat(real, k), flat, num_experts)
    mode = moe_kernel(t)
    if mode != "xla" and t == 1:
        return _experts_one_token(x, weights, flat, w, mode == "interpret")
    if mode != "xla":  # (pairs with another device's experts get no tile)
        return _experts_tiled(x, weights, w, flat, mode == "interpret")
    order = jnp.argsort(flat, stable=True)  # the (token, expert) pairs, grouped by expert
    sorted_ids = flat[order]
    row_expert = jnp.minimum(sorted_ids, num_experts - 1)  # (FP8 scales of local rows only)
    token = order // k
    sizes = jnp.zeros(num_experts, jnp.int32).at[flat].add(1, mode="drop")
    xs = x[token]
    grouped = functools.partial(_grouped, sizes=sizes, row_expert=row_expert)
    y = _swiglu(grouped, grouped, xs, w)
    pair_weight = weights.reshape(-1)[order].astype(jnp.float32)
    if first_expert is not None or real is not None:  # rows past the groups: undefined
        y = jnp.where((sorted_ids < num_experts)[:, None], y, 0)
    y = y.astype(jnp.float32) * pair_weight[:, None]
    return jnp.zeros((t, x.shape[1]), jnp.float32).at[token].add(y).astype(x.dtype)


def real_tokens(attend):
    """The step's real tokens [T] (not the bucket's padding: no KV slot), from the attention's
    metadata where it has one, else None (every token routed)."""
    md = getattr(attend, "md", None)
    return None if md is None else md.slot_mapping >= 0


def moe_mlp(
    x: jax.Array, w: dict, top_k: int, norm_topk_prob: bool, first_expert=None, real=None
) -> jax.Array:
    """The MoE block of one layer: routed experts, plus the shared expert where the layer has
    one (`s_gate_up` or `s_gate` / `s_up`, `s_down`, its gate `s_router` [H, 1]). Under tensor
    parallelism the result is this device's partial sum (the caller all-reduces it). real: the
    bucket's real tokens (`real_tokens`), or None."""
    weights, ids = route(x, w["router"], top_k, norm_topk_prob)
    out = grouped_experts(x, weights, ids, w, first_expert, real)
    if "s_down" in w:
        if "s_gate_up" in w:
            shared = gated_mlp(x, w["s_gate_up"], w["s_down"])
        else:
            shared = linear(jax.nn.silu(linear(x, w["s_gate"])) * linear(x, w["s_up"]), w["s_down"])
        gate = jax.nn.sigmoid(jnp.dot(x, w["s_router"], preferred_element_type=jnp.float32))
        out = out + (shared.astype(jnp.float32) * gate).astype(out.dtype)
    return out
