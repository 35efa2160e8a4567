"""The residual add, RMSNorm and (for an FP8 GEMM next) per-row FP8 quantization in one kernel.

    d = y * rs[:, None] * cs[None, :]     (y: a W8A8 GEMM's unscaled product; without the
                                           scales y is the delta itself), rounded to h's dtype
    h' = h + d                            (the residual stream, written back)
    x = weight * (h' / rms(h'))           (the model's rms_norm, rounded as it rounds)
    quantize: s = max|x| / 448 per row (1 where 0), q = e4m3(x / s)

Without y it is the norm (and quantization) of h alone, and h is not written. The oracle is
`reference.ref_add_rms_norm`, the model's own jnp ops (`llama.rms_norm`, `quant.quantize_rows`).

Why (issues #17, #18): between a layer's o projection and its gate | up GEMM XLA launches the
scaling-and-add fusion, the norm's reduction, the quantization's row max and the convert, each
reading the [T, H] stream again; a one-row decode step pays a launch for each. Here a program
holds whole rows (H <= 16,384) in registers and makes one pass: y and h read once, h' and x (or
q) written once.
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
MAX_WIDTH = 16384  # widest row (rounded up to a power of two) a program holds


def _both(a, b):
    return b if a is None else a if b is None else a & b


def _load(ref, mask):
    return plt.load(ref) if mask is None else plt.load(ref, mask=mask, other=0.0)


def _kernel(*refs, M, H, width, block_rows, eps, has_y, has_scales, quantize, dtype, out_dtype):
    f32 = jnp.float32
    refs = list(refs)
    h_ref = refs.pop(0)
    y_ref = refs.pop(0) if has_y else None
    rs_ref, cs_ref = (refs.pop(0), refs.pop(0)) if has_scales else (None, None)
    w_ref = refs.pop(0)
    ho_ref = refs.pop(0) if has_y else None
    x_ref, s_ref = (refs.pop(0), refs.pop(0)) if quantize else (refs.pop(0), None)

    r0 = pl.program_id(0) * block_rows
    # masks only where the shape needs them (static): unmasked rows load in 16-byte pieces
    r_ok = r0 + jnp.arange(block_rows, dtype=jnp.int32) < M if M % block_rows else None
    c_ok = jnp.arange(width, dtype=jnp.int32) < H if width != H else None
    mask = _both(None if r_ok is None else r_ok[:, None], None if c_ok is None else c_ok[None, :])
    rows, cols = pl.ds(r0, block_rows), pl.ds(0, width)

    h = _load(h_ref.at[rows, cols], mask).astype(f32)
    if has_y:
        d = _load(y_ref.at[rows, cols], mask).astype(f32)
        if has_scales:
            rs = _load(rs_ref.at[rows], r_ok)
            cs = _load(cs_ref.at[cols], c_ok)
            d = (d * rs[:, None] * cs[None, :]).astype(dtype).astype(f32)
        h = (h + d).astype(dtype)
        plt.store(ho_ref.at[rows, cols], h, mask=mask)
        h = h.astype(f32)
    inv_rms = lax.rsqrt(jnp.sum(h * h, axis=1) / H + eps)
    normed = (h * inv_rms[:, None]).astype(dtype).astype(f32)
    w = _load(w_ref.at[cols], c_ok).astype(f32)
    x = (w[None, :] * normed).astype(out_dtype)
    if not quantize:
        plt.store(x_ref.at[rows, cols], x, mask=mask)
        return
    xf = x.astype(f32)
    amax = jnp.max(jnp.abs(xf), axis=1)
    s = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = jnp.clip(xf / s[:, None], -E4M3_MAX, E4M3_MAX).astype(E4M3)
    plt.store(x_ref.at[rows, cols], q, mask=mask)
    plt.store(s_ref.at[rows], s, mask=r_ok)


def default_blocks(M: int, H: int) -> tuple[int, int]:
    """(block_rows, num_warps): a row a program, 16 f32 values of a row a thread (H = 4,096:
    8 warps). On the H200 no other shape of the sweep (1-8 rows x 2-16 warps, at 1-8,192 rows)
    beat it by more than the sweep's ~25% noise (gpu_2026-12-04c_defaults, call 3)."""
    width = next_pow2(H)
    return 1, max(4, min(16, width // 512))


def add_rms_norm(
    h,
    y,
    weight,
    *,
    eps: float,
    row_scales=None,
    col_scales=None,
    quantize: bool = False,
    block_rows: int | None = None,
    num_warps: int | None = None,
    interpret: bool = False,
):
    """-> (h', x) or, with quantize, (h', q [M, H] float8_e4m3fn, s [M] f32) (module docstring).
    h [M, H]; y [M, H] or None (then h' is h, not rewritten); weight [H]; row_scales [M] and
    col_scales [H] both or neither. x has the dtype of `weight * h` (the model's rms_norm)."""
    if h.ndim != 2:
        raise ValueError(f"h must be [M, H], got {h.shape}")
    M, H = h.shape
    if y is not None and y.shape != h.shape:
        raise ValueError(f"y must be {h.shape} like h, got {y.shape}")
    if weight.shape != (H,):
        raise ValueError(f"weight must be [{H}], got {weight.shape}")
    if (row_scales is None) != (col_scales is None) or (row_scales is not None and y is None):
        raise ValueError("row_scales and col_scales come together, and only with y")
    if row_scales is not None and (row_scales.shape != (M,) or col_scales.shape != (H,)):
        raise ValueError(
            f"row_scales must be [{M}] and col_scales [{H}], got {row_scales.shape}, "
            f"{col_scales.shape}"
        )
    width = next_pow2(H)
    if width > MAX_WIDTH:
        raise ValueError(f"rows wider than {MAX_WIDTH} are not supported, got {H}")
    d_rows, d_warps = default_blocks(M, H)
    block_rows = block_rows or d_rows
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of 2, got {block_rows}")
    has_y, has_scales = y is not None, row_scales is not None
    out_dtype = jnp.result_type(weight.dtype, h.dtype)
    kernel = functools.partial(
        _kernel,
        M=M,
        H=H,
        width=width,
        block_rows=block_rows,
        eps=float(eps),
        has_y=has_y,
        has_scales=has_scales,
        quantize=quantize,
        dtype=h.dtype,
        out_dtype=out_dtype,
    )
    args = [h] + ([y] if has_y else [])
    if has_scales:
        args += [row_scales.astype(jnp.float32), col_scales.astype(jnp.float32)]
    args.append(weight)
    out_shape = [jax.ShapeDtypeStruct((M, H), h.dtype)] if has_y else []
    if quantize:
        out_shape += [jax.ShapeDtypeStruct((M, H), E4M3), jax.ShapeDtypeStruct((M,), jnp.float32)]
    else:
        out_shape.append(jax.ShapeDtypeStruct((M, H), out_dtype))
    outs = pl.pallas_call(
        kernel,
        grid=(-(-M // block_rows),),
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps or d_warps, num_stages=1),
        interpret=interpret,
        name=f"add_rms_norm{'_q' if quantize else ''}_r{block_rows}",
    )(*args)
    return tuple(outs) if has_y else (h, *outs)
