"""The residual add + RMSNorm (+ FP8 rows) kernel, Llama-3.1-8B's hidden size, at the engine's row
counts (1: batch-1 decode; 320: the decode-heavy offline step; 8,192: a prefill step), in the four
ways the model can call it:

  norm_q       the attention's input norm, quantized for a W8A8 QKV GEMM (no add)
  add_q        the add of the o projection's unscaled W8A8 product (+ its scales), the MLP's
               norm, quantized for the gate | up GEMM
  norm, add    the same without FP8 (bf16 weights, or steps on the FP8 GEMV / upcast paths)

Each block shape is checked against the oracle (compiled by XLA), then timed as one jit of
`--iters` chained calls (each call's h' or x feeds the next), median of `--reps`; `--sweep`
times other block shapes too. XLA's own fusions of the oracle are not timed here: chained in
one jit, XLA fuses the adds of successive calls and drops what no later call reads (on the H200
it "ran" 8,192 rows in 6 us), so the kernel is judged in the engine (PAXENGINE_KERNEL_ADD_NORM
and _MAX_ROWS, benchmarks/results/gpu_2026-12-04c_defaults/).

    python -m benchmarks.kernels.add_norm [--rows 1,320,8192] [--sweep 1x4,2x4,4x8] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels.harness import write_rows
from benchmarks.measure import time_per_call
from kernels_pallas import add_rms_norm, ref_add_rms_norm

H, EPS = 4096, 1e-5
MODES = {
    "norm_q": (False, True),
    "add_q": (True, True),
    "norm": (False, False),
    "add": (True, False),
}


def _inputs(M, has_y, quantize, dt):
    k = jax.random.split(jax.random.PRNGKey(M), 5)
    h = jax.random.normal(k[0], (M, H), dt)
    w = (1 + 0.1 * jax.random.normal(k[1], (H,))).astype(dt)
    if not has_y:
        return dict(h=h, y=None, weight=w, row_scales=None, col_scales=None)
    if quantize:  # an fp8 x fp8 product and its scales
        y = (jax.random.normal(k[2], (M, H)) * 3000).astype(dt)
        rs = jax.random.uniform(k[3], (M,), minval=1e-3, maxval=3e-3)
        cs = jax.random.uniform(k[4], (H,), minval=1e-2, maxval=3e-2)
        return dict(h=h, y=y, weight=w, row_scales=rs, col_scales=cs)
    return dict(
        h=h, y=jax.random.normal(k[2], (M, H), dt), weight=w, row_scales=None, col_scales=None
    )


def _loop(fn, iters):
    """iters chained calls, unrolled in one jit (no while loop's per-iteration sync): h' (or, for
    the norm alone, x's first element) feeds the next."""

    @jax.jit
    def many(a):
        h = a["h"]
        for _ in range(iters):
            out = fn(dict(a, h=h))
            if a["y"] is not None:
                h = out[0]
            else:
                h = h.at[0, 0].add((out[1][0, 0].astype(jnp.float32) * 0).astype(h.dtype))
        return h

    return many


def _err(got, want, quantize):
    f = lambda a: np.asarray(a.astype(jnp.float32), np.float64)  # noqa: E731
    x = (f(got[1]) * f(got[2])[:, None]) if quantize else f(got[1])
    xr = (f(want[1]) * f(want[2])[:, None]) if quantize else f(want[1])
    return float(np.linalg.norm(x - xr) / np.linalg.norm(xr)), float(
        np.abs(f(got[0]) - f(want[0])).max()
    )


def _time(fn, a, iters, reps):
    loop = _loop(fn, iters)
    loop(a).block_until_ready()
    return 1e6 * time_per_call(lambda: loop(a), iters, reps)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,320,8192")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--iters", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--sweep",
        default=None,
        help="block_rows x num_warps to time, e.g. 1x4,2x4,4x8 (else the default)",
    )
    p.add_argument("--budget-s", type=float, default=None, help="stop sweeping after this long")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    dt = jnp.bfloat16 if on_gpu else jnp.float32
    configs = [None] + [
        tuple(int(v) for v in c.split("x")) for c in (args.sweep or "").split(",") if c
    ]
    t0, rows = time.perf_counter(), []
    for M in [int(m) for m in args.rows.split(",")]:
        for mode in args.modes.split(","):
            has_y, quantize = MODES[mode]
            a = _inputs(M, has_y, quantize, dt)
            want = jax.jit(functools.partial(_xla, quantize=quantize))(a)
            row = dict(rows=M, mode=mode, configs={})
            for c in configs:
                if c and args.budget_s and time.perf_counter() - t0 > args.budget_s:
                    break
                br, nw = c if c else (None, None)
                kern = functools.partial(
                    _kernel, quantize=quantize, block_rows=br, num_warps=nw, interpret=not on_gpu
                )
                rel, h_err = _err(jax.jit(kern)(a), want, quantize)
                assert rel < 2e-2 and h_err < 1e-1, f"kernel {c} disagrees with the oracle: {row}"
                us = _time(kern, a, args.iters, args.reps)
                row["configs"]["default" if c is None else f"{br}x{nw}"] = us
                row.setdefault("rel_err_x", rel)
            best = min(row["configs"], key=row["configs"].get)
            row.update(best=best, best_us=row["configs"][best], kernel_us=row["configs"]["default"])
            rows.append(row)
            print(
                f"M={M:5d} {mode:7s} default {row['kernel_us']:7.2f} us  best {best}"
                f" {row['best_us']:7.2f} us  rel_err(x) {row['rel_err_x']:.1e}",
                flush=True,
            )
    if args.out:
        write_rows(args.out, "add_norm", rows, hidden=H, iters=args.iters)


def _xla(a, quantize):
    return ref_add_rms_norm(**a, eps=EPS, quantize=quantize)


def _kernel(a, quantize, block_rows, num_warps, interpret):
    return add_rms_norm(
        **a,
        eps=EPS,
        quantize=quantize,
        block_rows=block_rows,
        num_warps=num_warps,
        interpret=interpret,
    )


if __name__ == "__main__":
    main()
