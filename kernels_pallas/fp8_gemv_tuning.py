"""The FP8 GEMV's tuning (kernels_pallas/fp8_gemv.py): the block shapes, warps, stages, split-K
and inner-product method a call takes, chosen statically from (M, K, N) by a rule per M class and
the H200 sweeps' measured rows, or read from a sweep's JSON for an A/B; checked before a kernel
is built."""

from __future__ import annotations

import dataclasses
import functools
import json
import os

from kernels_pallas.tuning import next_pow2

NUM_SMS = 132  # H200
METHODS = ("dot", "wdot", "reduce", "reduce_step")
REDUCE_MAX_M = 8  # the reduce methods keep an accumulator (and load x) per row of x


def _is_pow2(x) -> bool:
    return isinstance(x, int) and x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class Fp8MatmulTuning:
    block_n: int  # output channels per program (power of two; >= 16 for "dot")
    block_k: int  # K columns per inner step (power of two; >= 16 for "dot")
    k_splits: int  # split-K partitions (grid axis 1); 1 = no partials
    num_warps: int
    num_stages: int
    # "dot": x @ w.T (Triton dot, M padded to >= 16); "wdot": (w @ x.T).T, the weight block
    # as the dot's first operand (block_n rows: a 64-row wgmma at block_n 64); "reduce": the
    # elementwise product, reduced over K after the loop; "reduce_step": reduced every step.
    method: str = "dot"
    # Load block b + 1's weights before block b's are used (register double-buffering, on
    # top of whatever pipelining Triton does with num_stages).
    prefetch: bool = False


def default_tuning(
    M: int, K: int, N: int, num_sms: int = NUM_SMS, x_fp8: bool = False
) -> Fp8MatmulTuning:
    """Static choice from (M, K, N). From the first H200 sweeps (`python -m
    benchmarks.kernels.fp8_matmul`, jax 0.11.2, 2026-12-01; ~35 candidates per shape, ranked by
    loop time): the rule per M class that came closest to each shape's best (within ~4-9% on
    average over the four Llama-3.1-8B (K, N); run-to-run noise is +-5-10%). These numbers are
    to be replaced by a longer sweep's results (its JSON's `best` rows, ranked by device time).

    - M <= 2: reduce_step 8 x 1024, 2 warps (M=1: 40-42 us on 4096 x 28672 = 2.8-2.9 TB/s;
      the dot paths 50-60 us, wdot 70+; late reduction, prefetch, 8 warps: slower);
    - M <= 16: dot 64 x 256, 4 warps, 3 stages, split-K to >= 2 programs an SM;
    - M <= 32: the same, split-K to >= 1 program an SM;
    - M > 32: wdot 128 x 128, 4 warps, 4 stages (the weight block as the 128-row operand:
      1.5-1.7x faster than dot 64 x 256 at M=64).
    num_stages matters little (+-3%) and k_splits only where N / block_n < num_sms.

    x_fp8 (e4m3 activations, the W8A8 GEMV): fp8 x fp8 tensor-core dots, no conversion a weight;
    wdot 64 x 256 (the weight block as wgmma's 64-row operand), 4 warps, 3 stages, split-K to
    >= 2 programs an SM at every M: a first guess, to be replaced by the sweep's rows."""
    if x_fp8 and (measured := _x8_sweep_best(M, K, N)) is not None:
        return measured
    if x_fp8:
        method, block_n, block_k, warps, stages, target = "wdot", 64, 256, 4, 3, 2
    elif M <= 2 and (K, N) in _MEASURED_ONE_ROW:
        return _MEASURED_ONE_ROW[(K, N)]
    elif M <= 2:
        method, block_n, block_k, warps, stages, target = "reduce_step", 8, 1024, 2, 3, 2
    elif M <= 16:
        method, block_n, block_k, warps, stages, target = "dot", 64, 256, 4, 3, 2
    elif M <= 32:
        method, block_n, block_k, warps, stages, target = "dot", 64, 256, 4, 3, 1
    else:
        method, block_n, block_k, warps, stages, target = "wdot", 128, 128, 4, 4, 1
    floor = 16 if method in ("dot", "wdot") else 1
    block_n = max(floor, min(block_n, next_pow2(N)))
    block_k = max(floor, min(block_k, next_pow2(K)))
    n_blocks = -(-N // block_n)
    k_blocks = -(-K // block_k)
    k_splits = 1
    while n_blocks * k_splits < target * num_sms and k_splits < 8 and k_blocks >= 4 * k_splits:
        k_splits *= 2
    return Fp8MatmulTuning(block_n, block_k, k_splits, warps, stages, method=method)


# One-row steps on the Llama-3.1-8B projections where the sweep's best beat the rule above by
# more than its spread: kernel device time (us) in a profiler trace, H200, jax 0.11.2
# (benchmarks/results/gpu_2026-12-01_glu_quant/fp8_matmul_m1.json, `python3 -m
# benchmarks.kernels.fp8_matmul --only-m 1 --budget 220`): qkv 4096 x 6144 9.85 -> 8.85; down
# 14336 x 4096 22.2 -> 18.1 (the late reduction, 4 stages); o 4096 x 4096 8.50 -> 7.10 (2
# splits). gate_up 4096 x 28672 keeps the rule's (32.6 us, 3.6 TB/s; nothing beat it).
_MEASURED_ONE_ROW = {
    (4096, 6144): Fp8MatmulTuning(32, 512, 2, 8, 3, method="reduce_step"),
    (14336, 4096): Fp8MatmulTuning(8, 1024, 1, 4, 4, method="reduce"),
    (4096, 4096): Fp8MatmulTuning(8, 1024, 2, 2, 3, method="reduce_step"),
}


def _x8_sweep_best(M: int, K: int, N: int) -> Fp8MatmulTuning | None:
    """For an A/B before a sweep's rows are committed: PAXENGINE_KERNEL_FP8_X8_TUNING names the
    JSON of `python -m benchmarks.kernels.fp8_matmul --x8`; its best tuning for (K, N) at the
    smallest swept M >= M (else the largest) is taken. Unset: None."""
    path = os.environ.get("PAXENGINE_KERNEL_FP8_X8_TUNING")
    if not path:
        return None
    rows = [b for b in _sweep_best_rows(path) if (b["K"], b["N"]) == (K, N)]
    if not rows:
        return None
    above = [b for b in rows if b["M"] >= M]
    pick = min(above, key=lambda b: b["M"]) if above else max(rows, key=lambda b: b["M"])
    return Fp8MatmulTuning(**pick["tuning"])


@functools.lru_cache(maxsize=4)
def _sweep_best_rows(path: str) -> tuple:
    with open(path) as f:
        doc = json.load(f)
    if not doc.get("x8"):
        raise ValueError(f"PAXENGINE_KERNEL_FP8_X8_TUNING: {path} is not an --x8 sweep")
    return tuple(doc["best"])


def resolve_tuning(M: int, K: int, N: int, x_fp8: bool = False, **overrides) -> Fp8MatmulTuning:
    """default_tuning(M, K, N, x_fp8=x_fp8) with the non-None overrides; checks the result
    (ValueError)."""
    tun = default_tuning(M, K, N, x_fp8=x_fp8)
    over = {k: v for k, v in overrides.items() if v is not None}
    if over:
        tun = dataclasses.replace(tun, **over)
    if tun.method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {tun.method!r}")
    for name in ("block_n", "block_k"):
        v = getattr(tun, name)
        if not _is_pow2(v):
            raise ValueError(f"{name} must be a power of 2 (Triton block shapes), got {v}")
        if tun.method in ("dot", "wdot") and v < 16:
            raise ValueError(f"{name} must be >= 16 for the {tun.method} method, got {v}")
    if not (isinstance(tun.k_splits, int) and tun.k_splits >= 1):
        raise ValueError(f"k_splits must be a positive int, got {tun.k_splits}")
    if not _is_pow2(tun.num_warps):
        raise ValueError(f"num_warps must be a power of 2, got {tun.num_warps}")
    if not (isinstance(tun.num_stages, int) and tun.num_stages >= 1):
        raise ValueError(f"num_stages must be a positive int, got {tun.num_stages}")
    if tun.method.startswith("reduce") and M > REDUCE_MAX_M:
        raise ValueError(f"the {tun.method} method takes M <= {REDUCE_MAX_M}, got M={M}")
    return tun
