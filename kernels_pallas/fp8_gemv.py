"""FP8-weight GEMV / skinny GEMM for decode (issue #17), a Pallas kernel (Triton lowering).

    y[M, N] = x[M, K] @ (w_values[N, K] * w_scales[N, None]).T, accumulated in f32

x: bf16 / f16 / f32 activations, M small (1..64; any M works); w_values: float8_e4m3fn in the
HF [out, in] layout (row n = output channel n, K contiguous); w_scales: [N] f32, one scale per
output channel. The oracle is `reference.ref_fp8_matmul`.

Why a kernel: on the H200, XLA reads 8-bit weights at about the bf16 time for small M (M=1,
4096 x 28672: bf16 76 us, fp8 upcast in the jit 73 us, ~1.6 TB/s of fp8 reads); a GEMV is a
stream over the weights, so it should run near HBM speed on half the bytes.

Design (bandwidth first):

* grid = (cdiv(N, block_n), k_splits, cdiv(M, block_m)). A program owns `block_n` output
  channels and streams its [block_n, K / k_splits] fp8 weight rows once, `block_k` columns a
  step (a `fori_loop` that Triton software-pipelines over `num_stages` buffers), upcasts them in
  registers (exact: every e4m3 value is a bf16 / f16 / f32 value), accumulates in f32 and
  applies the per-channel scales once, at the end.
* Four inner products, picked by `method` (static; `default_tuning` chooses from M):
  - "dot": x's [block_m, block_k] block (block_m = M rounded up to a power of two >= 16, since
    Triton's dot needs M >= 16; at most 64, more M goes to the third grid axis) times the
    upcast weight block, transposed, in x's dtype (f32: IEEE, `Precision.HIGHEST`) with an f32
    accumulator;
  - "wdot": the same product with the operands swapped, (w @ x.T).T: the weight block is the
    dot's first operand, block_n rows (the small-M "swap AB" trick; best at M=64);
  - "reduce_step" (tiny M, <= 8; no padding rows): each row of x times the weight block,
    elementwise in f32, summed over the block's K columns every step (the default at M <= 2);
  - "reduce": the same, accumulated in a [block_n, block_k] f32 tile per row and reduced once
    after the loop (Inductor's looped reduction; more registers, measured slower).
  `prefetch` loads block b + 1's weights into registers before block b's are used (measured
  slower; Triton pipelines the dot paths' loads itself, num_stages deep).
* Split-K (narrow N: the down projection, k/v): grid axis 1 takes `per` consecutive K blocks
  each; the kernel writes scaled f32 partials [k_splits, M, N] that one jnp sum reduces
  outside (XLA: one small fusion), so the grid has enough programs to fill the 132 SMs.
* e4m3 activations with per-row scales (`x_scales`: the W8A8 GEMV, rows quantized as on the
  W8A8 GEMM path): the dot methods multiply fp8 by fp8 on the tensor cores, no weight converted,
  and both scales apply with the channel scales at the end; K's partial last block runs in f16
  (rows of x past M load undefined there: only their own output rows, never stored, see them).
* Ragged shapes by masking, nothing padded or copied outside: rows of x past M load as zeros
  and are not stored; channels past N load undefined values (only their own output columns see
  them, and those are not stored); K's last, partial block runs once after the unmasked loop,
  its columns past K zeroed after the upcast (Triton cannot make an fp8 `other` for a masked
  load). So every (K, N) works, e.g. SmolLM2-135M's K = 576 and N = 192.

Block shapes are powers of two (Triton's rule); `fp8_matmul` raises ValueError otherwise.
Tuning: `fp8_gemv_tuning.default_tuning(M, K, N)` (static, from the shapes alone, and the
measured one-row tables); any field can be passed.
The GPU sweep is `python -m benchmarks.kernels.fp8_matmul --out DIR`.

Measured (H200, jax 0.11.2, 2026-12-01, default tuning; kernel = its device time in a
profiler trace, loop = a jitted loop's wall time per call, which adds ~6-13 us of launch gaps
and loop overhead per call to every variant, XLA's too):
- M=1: 4096 x 28672 32.5 us kernel = 3.6 TB/s of fp8 reads (loop 40-47 us; XLA W8A16 44 us
  kernel, bf16 59 us); 14336 x 4096 22.2 us = 2.6 TB/s (XLA W8A16 25 us); 4096 x 6144 9.8 us
  = 2.6 TB/s; 4096 x 4096 8.5 us = 2.0 TB/s (XLA W8A16 9.0). Faster than XLA on every shape.
- M=8..64 (dot / wdot): 2.0-2.6 TB/s at M=8-16 (4096 x 28672: 46-48 us), below XLA's own
  W8A16 in this [N, K] layout (a Triton GEMM fusion XLA autotunes: 31 us = 3.7 TB/s at M=8);
  1.7 TB/s at M=64. XLA W8A16 with the weights in [K, N] (the engine's layout today) is
  about our kernel's speed at M=8-16.
- Tried and dropped (2026-12-04, benchmarks/results/gpu_2026-12-04d_f16_gemv/, call 1, tree
  488e160): the dot methods with f16 operands (e4m3 -> f16 is one instruction a pair, -> bf16
  goes through f32). Slower for "dot" at M = 1-16 (4096 x 28672, M=8, 32 x 512 tiles: 76 vs
  56 us), faster only for "wdot" (51 vs 71 us), and nothing reached XLA's W8A16 at M = 8-16
  (32 us): the conversion is not what bounds these paths.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.fp8_gemv_tuning import resolve_tuning
from kernels_pallas.tuning import next_pow2

_X_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_W_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)


def split_plan(K: int, block_k: int, k_splits: int) -> tuple[int, int]:
    """(k_splits, per): K blocks per split and the number of non-empty splits it gives."""
    k_blocks = -(-K // block_k)
    per = -(-k_blocks // min(k_splits, k_blocks))
    return -(-k_blocks // per), per


def _mask2(a, b, shape):
    """a[:, None] & b[None, :] broadcast to shape, either one None (all true); None if both."""
    out = None
    if a is not None:
        out = jnp.broadcast_to(a[:, None], shape)
    if b is not None:
        bb = jnp.broadcast_to(b[None, :], shape)
        out = bb if out is None else out & bb
    return out


def _fp8_matmul_kernel(
    x_ref,
    w_ref,
    s_ref,
    *refs,
    M,
    K,
    N,
    block_m,
    block_n,
    block_k,
    k_splits,
    per,
    method,
    prefetch,
    compute_dtype,
    glu,
    x_fp8,
):
    xs_ref, o_ref = refs if x_fp8 else (None, *refs)  # xs_ref: fp8 activations' row scales
    n0 = pl.program_id(0) * block_n
    sp = pl.program_id(1)
    m0 = pl.program_id(2) * block_m
    k_blocks = -(-K // block_k)
    k_full = K // block_k  # blocks with no column past K
    f32 = jnp.float32
    n_ok = None  # channels past N: loaded (undefined), never stored
    if N % block_n:
        n_ok = n0 + jnp.arange(block_n, dtype=jnp.int32) < N
    m_ok = None  # rows of x past M: zeros (fp8 x: undefined), never stored
    if method in ("dot", "wdot") and M % block_m:
        m_ok = m0 + jnp.arange(block_m, dtype=jnp.int32) < M
    is_dot = method in ("dot", "wdot")
    x_dtype = x_ref.dtype
    precision = lax.Precision.HIGHEST if compute_dtype == f32 else None
    # fp8 x in the dot methods: the full blocks are fp8 x fp8 dots (no operand converted); K's
    # partial last block goes through f16 (exact for e4m3), where its columns past K can be
    # zeroed (the Triton lowering cannot make an fp8 constant).
    tail_dtype = jnp.dtype(jnp.float16) if (x_fp8 and is_dot) else compute_dtype

    def cols(k0, masked):
        return k0 + jnp.arange(block_k, dtype=jnp.int32) < K if masked else None

    def load_w(k0, k_ok):
        """The raw fp8 [block_n, block_k] weight block at column k0."""
        idx = (pl.ds(n0, block_n), pl.ds(k0, block_k))
        mask = _mask2(n_ok, k_ok, (block_n, block_k))
        # (no `other`: the Triton lowering cannot make an fp8 constant; see upcast)
        return w_ref[idx] if mask is None else plt.load(w_ref.at[idx], mask=mask)

    def upcast(w, k_ok, dt):
        w = w.astype(dt if is_dot else f32)  # exact: every e4m3 value is a bf16 / f16 / f32 value
        if k_ok is not None:  # columns past K: zeros (their x columns are zeros too)
            w = jnp.where(k_ok[None, :], w, 0)
        return w

    def x_block(idx_m, k0, mask, dtype):
        """x[idx_m, k0 : k0 + block_k] in `dtype` (masked lanes 0). With `glu`, x holds
        [gate | up] and this is silu(gate) * up, rounded as the unfused model rounds it (to x's
        dtype after each op), so the product is the one a separate fusion would have fed it."""

        def raw(col, dt):
            idx = (idx_m, pl.ds(col, block_k))
            if mask is None:
                return x_ref[idx].astype(dt)
            if not x_fp8:
                return plt.load(x_ref.at[idx], mask=mask, other=0.0).astype(dt)
            v = plt.load(x_ref.at[idx], mask=mask)  # (no fp8 `other`, as for the weights)
            if jnp.dtype(dt).itemsize == 1:  # a full block's rows past M: never stored
                return v
            return jnp.where(mask, v.astype(dt), 0)

        if not glu:
            return raw(k0, dtype)
        gate, up = raw(k0, f32), raw(K + k0, f32)
        silu = (gate / (1.0 + jnp.exp(-gate))).astype(x_dtype).astype(f32)
        return (silu * up).astype(x_dtype).astype(dtype)

    def load_x(k0, k_ok, dt):
        """dot / wdot: x's [block_m, block_k] block in dt; reduce*: its M rows of [block_k]."""
        if is_dot:
            mask = _mask2(m_ok, k_ok, (block_m, block_k))
            return x_block(pl.ds(m0, block_m), k0, mask, dt)
        # (a Python int row index breaks interpret mode)
        return [x_block(jnp.int32(m), k0, k_ok, f32) for m in range(M)]

    def accumulate(acc, w, x):
        if method == "dot":  # [block_m, block_n] += x [block_m, bk] @ w.T
            return acc + jnp.dot(x, w.T, preferred_element_type=f32, precision=precision)
        if method == "wdot":  # swapped operands: [block_n, block_m] += w [block_n, bk] @ x.T
            return acc + jnp.dot(w, x.T, preferred_element_type=f32, precision=precision)
        if method == "reduce":  # late reduction: [block_n, block_k] per row of x
            return tuple(a + w * xm[None, :] for a, xm in zip(acc, x))
        return tuple(a + jnp.sum(w * xm[None, :], axis=1) for a, xm in zip(acc, x))

    if method == "dot":
        acc = jnp.zeros((block_m, block_n), f32)
    elif method == "wdot":
        acc = jnp.zeros((block_n, block_m), f32)
    elif method == "reduce":
        acc = tuple(jnp.zeros((block_n, block_k), f32) for _ in range(M))
    else:
        acc = tuple(jnp.zeros((block_n,), f32) for _ in range(M))

    def step(b, acc, masked):
        k0 = b * block_k
        k_ok = cols(k0, masked)
        dt = tail_dtype if masked else compute_dtype
        return accumulate(acc, upcast(load_w(k0, k_ok), k_ok, dt), load_x(k0, k_ok, dt))

    def full_loop(lo, hi, acc):
        """Blocks [lo, hi) (all full). prefetch: block b + 1's weights are loaded (into
        registers) before block b's are used, so two blocks a program are in flight."""
        if not prefetch:
            return lax.fori_loop(lo, hi, functools.partial(step, masked=False), acc)

        def body(b, carry):
            acc, w = carry
            w_next = load_w(jnp.minimum(b + 1, hi - 1) * block_k, None)
            acc = accumulate(
                acc, upcast(w, None, compute_dtype), load_x(b * block_k, None, compute_dtype)
            )
            return acc, w_next

        w0 = load_w(jnp.minimum(lo, k_full - 1) * block_k, None)
        return lax.fori_loop(lo, hi, body, (acc, w0))[0]

    # This split's K blocks [b0, b0 + per) clipped to k_blocks: the full ones in an unmasked
    # loop, then (only the last split can hold it) K's partial last block, masked.
    if k_splits == 1:
        if k_full > 0:  # (untraced otherwise: a block wider than K cannot load unmasked)
            acc = full_loop(0, k_full, acc)
        if k_full < k_blocks:  # (a traced start: a static one past K fails the bounds check)
            acc = step(jnp.int32(k_full), acc, masked=True)
    else:
        b0 = sp * per
        acc = full_loop(b0, jnp.minimum(b0 + per, k_full), acc)
        if k_full < k_blocks:
            last = sp == k_splits - 1
            tail_hi = jnp.where(last, k_blocks, k_full)
            acc = lax.fori_loop(k_full, tail_hi, functools.partial(step, masked=True), acc)

    if n_ok is None:
        scale = s_ref[pl.ds(n0, block_n)]
    else:
        scale = plt.load(s_ref.at[pl.ds(n0, block_n)], mask=n_ok, other=0.0)
    lead = () if k_splits == 1 else (sp,)  # o_ref: y [M, N], or partials [k_splits, M, N]
    if is_dot:
        if x_fp8:  # the activation rows' scales too
            xs_idx = pl.ds(m0, block_m)
            if m_ok is None:
                x_scale = xs_ref[xs_idx]
            else:
                x_scale = plt.load(xs_ref.at[xs_idx], mask=m_ok, other=0.0)
        if method == "dot":
            y = acc * scale[None, :]
            if x_fp8:
                y = y * x_scale[:, None]
        else:
            y = acc * scale[:, None]
            if x_fp8:
                y = y * x_scale[None, :]
            y = y.T
        idx = (*lead, pl.ds(m0, block_m), pl.ds(n0, block_n))
        mask = _mask2(m_ok, n_ok, (block_m, block_n))
        if mask is None:
            o_ref[idx] = y.astype(o_ref.dtype)
        else:
            plt.store(o_ref.at[idx], y.astype(o_ref.dtype), mask=mask)
    else:
        for m in range(M):
            a = jnp.sum(acc[m], axis=1) if method == "reduce" else acc[m]
            y = a * scale
            if x_fp8:
                y = y * xs_ref[jnp.int32(m)]
            y = y.astype(o_ref.dtype)
            idx = (*lead, jnp.int32(m), pl.ds(n0, block_n))
            if n_ok is None:
                o_ref[idx] = y
            else:
                plt.store(o_ref.at[idx], y, mask=n_ok)


def fp8_matmul(
    x,
    w_values,
    w_scales,
    *,
    x_scales=None,
    out_dtype=None,
    interpret=False,
    block_n=None,
    block_k=None,
    k_splits=None,
    num_warps=None,
    num_stages=None,
    method=None,
    prefetch=None,
    glu=False,
) -> jax.Array:
    """y = x @ (w_values * w_scales[:, None]).T, accumulated in f32, in out_dtype (x's dtype).

    x [M, K] bf16 / f16 / f32, or e4m3 with x_scales [M] f32 (the W8A8 GEMV: x stands for
    x * x_scales[:, None]; out_dtype must be given; the dot methods multiply fp8 by fp8);
    w_values [N, K] float8_e4m3fn (or e5m2); w_scales [N] f32.
    Tuning fields left None come from `default_tuning(M, K, N)`; `method` "dot" / "reduce"
    (module docstring). interpret=True runs Pallas' interpret mode (CPU).
    glu=True: x is [M, 2K], a gated MLP's [gate | up], and the kernel multiplies
    silu(gate) * up (computed as it loads x; the MLP's down projection without the separate
    elementwise kernel before it)."""
    if x.ndim != 2 or w_values.ndim != 2:
        raise ValueError(f"x [M, K] and w_values [N, K] expected, got {x.shape}, {w_values.shape}")
    M, K = x.shape
    if glu:
        if K % 2:
            raise ValueError(f"glu: x must be [M, 2K] ([gate | up]), got {x.shape}")
        K //= 2
    N, Kw = w_values.shape
    if Kw != K:
        raise ValueError(f"x has K={K} columns, w_values {Kw}")
    if w_scales.shape != (N,):
        raise ValueError(f"w_scales must be [N] = [{N}], got {w_scales.shape}")
    if M < 1 or N < 1 or K < 1:
        raise ValueError(f"empty operands: M={M}, K={K}, N={N}")
    x_fp8 = x.dtype == jnp.float8_e4m3fn
    if not (x_fp8 or any(x.dtype == d for d in _X_DTYPES)):
        raise ValueError(f"x must be bf16, f16, f32 or float8_e4m3fn, got {x.dtype}")
    if not any(w_values.dtype == d for d in _W_DTYPES):
        raise ValueError(f"w_values must be float8_e4m3fn (or e5m2), got {w_values.dtype}")
    if x_fp8:
        if x_scales is None or out_dtype is None:
            raise ValueError("float8_e4m3fn activations need x_scales [M] and an out_dtype")
        if x_scales.shape != (M,):
            raise ValueError(f"x_scales must be [M] = [{M}], got {x_scales.shape}")
        if glu:
            raise ValueError("glu takes 16-bit activations ([gate | up]), not float8_e4m3fn")
        if w_values.dtype != jnp.float8_e4m3fn:
            raise ValueError(f"fp8 activations take e4m3 weights, got {w_values.dtype}")
    elif x_scales is not None:
        raise ValueError(f"x_scales go with float8_e4m3fn activations, not {x.dtype}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    tun = resolve_tuning(
        M,
        K,
        N,
        x_fp8=x_fp8,
        block_n=block_n,
        block_k=block_k,
        k_splits=k_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        method=method,
        prefetch=prefetch,
    )
    splits, per = split_plan(K, tun.block_k, tun.k_splits)
    if tun.method in ("dot", "wdot"):
        block_m = min(max(16, next_pow2(M)), 64)
        m_blocks = -(-M // block_m)
    else:
        block_m, m_blocks = M, 1
    kernel = functools.partial(
        _fp8_matmul_kernel,
        M=M,
        K=K,
        N=N,
        block_m=block_m,
        block_n=tun.block_n,
        block_k=tun.block_k,
        k_splits=splits,
        per=per,
        method=tun.method,
        prefetch=bool(tun.prefetch),
        compute_dtype=jnp.dtype(x.dtype),
        glu=bool(glu),
        x_fp8=bool(x_fp8),
    )
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((M, N), out_dtype)
    else:
        out_shape = jax.ShapeDtypeStruct((splits, M, N), jnp.float32)
    y = pl.pallas_call(
        kernel,
        grid=(-(-N // tun.block_n), splits, m_blocks),
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=tun.num_warps, num_stages=tun.num_stages),
        interpret=interpret,
        name=f"fp8_matmul_{tun.method}_n{tun.block_n}_k{tun.block_k}_s{splits}"
        + ("_pf" if tun.prefetch else "")
        + ("_glu" if glu else "")
        + ("_x8" if x_fp8 else ""),
    )(x, w_values, w_scales.astype(jnp.float32), *([x_scales.astype(jnp.float32)] if x_fp8 else []))
    if splits > 1:
        y = jnp.sum(y, axis=0).astype(out_dtype)
    return y
