"""The attention kernel's tuning sweep: the current default against candidate tunings and kernel
variants, per shape (writes kernels_tune_<device>.json under --out).

  python -m benchmarks.kernels.tune [--quick] [--only SHAPES] [--kv-dtype fp8] [--budget S]
      [--rounds R] [--out DIR]

Each candidate is a dict of Tuning overrides (kernels_pallas.tuning.Tuning fields) on top of
default_tuning(shape); rows report the fully resolved Tuning, so a winner maps 1:1 onto
default_tuning. Every candidate is compiled ONCE: a jitted fori_loop of `iters` chained calls
whose last output is checked against the oracle (bf16 rel. error < 2e-3, padding rows zero) and
whose wall time / iters is the time. `--kv-dtype fp8`: e4m3 K and V pages (the FP8 engine's
cache) and, for decode shapes, the candidates of FP8_DECODE; the file is then
kernels_tune_fp8_<device>.json. Candidates run round-robin over the shapes (the first ones
matter most), under a wall-clock budget: what does not fit is skipped and listed. Then every
timed candidate is re-timed in R - 1 more interleaved rounds and keeps its median.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels.harness import (
    BS,
    DT,
    HKV,
    HQ,
    QUICK_SHAPES,
    SHAPES,
    D,
    attn_flops,
    build,
    kv_bytes,
    log,
    oracle,
    ours_loop,
    run_record,
    save,
)
from benchmarks.measure import time_loop
from kernels_pallas.testing import rel_err
from kernels_pallas.tuning import default_tuning, plan_launches

# Candidates per shape of harness.SHAPES, in priority order; {} = the current default.
_OLD_LOOP = dict(split_mask=False, reverse_tiles=False)  # the run-3 kernel's loop structure
_F16 = dict(pv_fp16=True)
# the Mosaic GPU prefill kernel (attention_mgpu.py): persistent grid (2 x SMs CTAs: the
# default) or a CTA per (head, tile), N CTAs; KV block and pipeline depth; Triton
_MOSAIC = [
    dict(mosaic=True, mosaic_persistent=0),
    dict(mosaic=True, mosaic_persistent=132),
    dict(mosaic=True, mosaic_persistent=264, mosaic_block_k=64, mosaic_stages=3),
    dict(mosaic=True, mosaic_persistent=396),
    dict(mosaic=False),
]
# the Mosaic prefill kernel's ping-pong schedule: never, always, on items of 4+ / 16+ KV blocks
_SCHED = [dict(mosaic_schedule=n) for n in (0, 1, 4, 16)]
# the Mosaic GPU decode kernel (attention_mgpu_decode.py): KV block x pipeline depth, a CTA
# per item or persistent, two compute warpgroups or one; Triton
_MDEC = [
    dict(mosaic_decode=True, mosaic_block_k=128, mosaic_stages=2),
    dict(mosaic_decode=True, mosaic_block_k=64, mosaic_stages=4),
    dict(mosaic_decode=True, mosaic_block_k=128, mosaic_stages=2, mosaic_persistent=132),
    dict(mosaic_decode=True, mosaic_block_k=64, mosaic_stages=4, mosaic_persistent=132),
    dict(
        mosaic_decode=True,
        mosaic_block_k=128,
        mosaic_stages=2,
        mosaic_decode_wgs=1,
        mosaic_persistent=132,
    ),
    dict(mosaic_decode=False),
]
CANDIDATES = {  # in priority order; {} = the current default
    "decode_b1_ctx8192": [{}, *_MDEC, dict(_MDEC[2], k_splits=32), dict(k_splits=8)],
    "engine_8x1000_s256": [{}, *_SCHED, *_MOSAIC],
    "decode_b64_ctx2048": [
        {},
        *_MDEC,
        _F16,
        dict(num_warps=8, num_stages=3),
        _OLD_LOOP,
        dict(k_splits=2),
        dict(block_k=64, num_stages=4),
    ],
    "engine_b1_ctx256": [
        {},
        *_MDEC[:3],
        dict(k_splits=1),
        dict(k_splits=2),
        dict(k_splits=1, block_k=64),
    ],
    # the default is 256-row tiles (block_q 64 x 4 heads); 16 warps, 512-row tiles, 128-wide
    # KV blocks; the 64-row tiles of short prefills
    "prefill_2048": [
        {},
        *_SCHED,
        *_MOSAIC,
        dict(num_warps=16),
        dict(num_warps=16, block_k=128),
        dict(block_q=128, num_warps=16),
        dict(num_stages=2),
        dict(num_stages=4),
        dict(block_q=16, block_k=64, num_warps=4, num_stages=2, pv_fp16=False),
        _OLD_LOOP,
        dict(_F16, block_q=32, block_k=64, num_warps=8, num_stages=2),
        dict(_F16, block_q=32, block_k=64, num_warps=8, num_stages=3),
        dict(_F16, block_q=32, block_k=128, num_warps=8, num_stages=2),
        dict(_F16, block_k=128),
        dict(_F16, block_k=32, num_stages=3),
        dict(reverse_tiles=False),
        dict(block_q=32, block_k=64, num_warps=8),
    ],
    "decode_b8_ctx8192": [
        {},
        *_MDEC,
        dict(_MDEC[2], k_splits=16),
        dict(num_stages=3),
        _OLD_LOOP,
        dict(k_splits=16),
        dict(block_k=64, num_stages=4),
    ],
    # a chunk with a long context: 256-row tiles split over the KV range fill the GPU
    "chunk_512_ctx4096": [
        {},
        *_SCHED,
        *_MOSAIC,
        dict(_F16, block_q=64, block_k=64, num_warps=8, num_stages=3, k_splits=4),
        dict(_F16, block_q=64, block_k=64, num_warps=8, num_stages=3, k_splits=2),
        dict(_F16, block_q=32, block_k=64, num_warps=8, num_stages=3, k_splits=2),
        _F16,
        dict(pv_split=False),
        dict(_F16, block_q=32, block_k=64, num_warps=8, num_stages=2),
        dict(_F16, block_q=32, block_k=64, num_warps=8, num_stages=3),
        dict(_F16, block_q=32, block_k=128, num_warps=8, num_stages=2),
        dict(_F16, block_k=128),
    ],
    "decode_b256_ctx512": [{}, *_MDEC, _F16, _OLD_LOOP, dict(block_k=64, num_stages=4)],
    "prefill_4x2048": [{}, *_SCHED, *_MOSAIC],
    "prefill_8192": [{}, *_SCHED, *_MOSAIC],
    "prefill_512": [{}, *_SCHED, dict(mosaic=True, mosaic_persistent=264), dict(mosaic=True)],
    "decode_b64_ctx512": [{}, *_MDEC, _OLD_LOOP, dict(k_splits=2), dict(block_k=64, num_stages=4)],
    # the decode launch takes the main launch's split_mask / pv_fp16 (plan_launches); the
    # second candidate was the decode defaults' values there
    "mixed_60dec2048_1988pf": [
        {},
        *_SCHED,
        dict(mosaic=False, mosaic_decode=True),
        *_MOSAIC,
        dict(split_mask=False, pv_fp16=False),
        dict(mixed_split=False),
        dict(block_q=16, num_warps=4, num_stages=2, pv_fp16=False),
    ],
    "mixed_60dec2048_448pf": [
        {},
        dict(mosaic=True, mosaic_persistent=264),
        dict(mosaic=False, mosaic_decode=True),
        *_MOSAIC,
        dict(split_mask=False),
        _OLD_LOOP,
        _F16,
        dict(mixed_split=True, pv_fp16=True),
    ],
}
# bf16 decode shapes: P in fp16 in one PV dot (the V pages are fp16 already) instead of hi + lo
_ONE_PV = dict(pv_split=False)
for _name in ("decode_b64_ctx2048", "decode_b8_ctx8192", "decode_b256_ctx512"):
    CANDIDATES[_name] += [_ONE_PV, dict(_ONE_PV, num_warps=8)]
CANDIDATES["decode_b256_ctx1024"] = [{}, _ONE_PV, dict(_ONE_PV, num_warps=8), *_MDEC[:2]]
# fp8 pages, decode shapes: the K and V conversions (e4m3 -> fp16) and the PV product's dots
# are the compute a KV byte costs, so fewer dots, more warps to hide it, and deeper pipelines
FP8_DECODE = [
    {},
    _ONE_PV,
    dict(_ONE_PV, num_warps=8),
    dict(_ONE_PV, num_stages=4),
    dict(_ONE_PV, num_stages=2),
    dict(_ONE_PV, block_k=256),
    dict(_ONE_PV, block_k=256, num_warps=8),
    dict(_ONE_PV, block_k=64, num_stages=4),
    dict(_ONE_PV, split_mask=True),
    dict(num_warps=8),
    dict(_ONE_PV, k_splits=2),
]
_SPLIT_ONE_PV = dict(_ONE_PV, split_mask=True)
FP8_DECODE_2 = [  # round 2 (--round2): around round 1's winner
    _SPLIT_ONE_PV,
    dict(_SPLIT_ONE_PV, num_stages=2),
    dict(_SPLIT_ONE_PV, num_stages=4),
    dict(_SPLIT_ONE_PV, block_k=64, num_stages=4),
    dict(_SPLIT_ONE_PV, num_warps=8),
    dict(_SPLIT_ONE_PV, num_warps=2),
    dict(_SPLIT_ONE_PV, block_k=64, num_stages=3),
    {},
]
QUICK_CANDIDATES = [
    {},
    _OLD_LOOP,
    dict(_F16, block_k=32),
    dict(k_splits=2, block_q=4),
    dict(mixed_split=True),
]


def tune(args, result, t_start):
    """Check and time every candidate of every shape (round-robin, under the budget), re-time
    them in interleaved rounds, print the table of the best correct candidate against the
    default, and save it all in `result`."""
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.only:
        shapes = {k: v for k, v in shapes.items() if k in args.only.split(",")}
    iters, reps = (2, 1) if args.quick else (20, 5)
    fp8 = args.kv_dtype == "fp8"
    kv_dtype = jnp.float8_e4m3fn if fp8 else DT
    data, rows = {}, {}
    for i, (name, (seqs, T, S)) in enumerate(shapes.items()):
        q, kc, vc, md = build(seqs, T, S, 100 + i, kv_dtype=kv_dtype)
        n = sum(ql for ql, _ in seqs)
        ref = jax.block_until_ready(oracle(q, kc, vc, md))
        itemsize = jnp.dtype(kv_dtype).itemsize
        dflt = dataclasses.asdict(default_tuning(T, S, HQ, HKV, D, BS, kv_itemsize=itemsize))
        data[name] = (q, kc, vc, md, ref, n)
        rows[name] = dict(
            name=name,
            T=T,
            S=S,
            kv_bytes=kv_bytes(seqs, itemsize),
            flops=attn_flops(seqs),
            default_tuning=dflt,
            candidates=[],
            skipped=[],
        )
    log(f"tune: {len(shapes)} shapes, data + oracle ready [{time.time() - t_start:.0f}s]")

    def candidates(name):
        if args.quick:
            return QUICK_CANDIDATES
        decode = name.startswith(("decode_", "engine_b1"))
        if decode and args.round2:
            return FP8_DECODE_2
        return FP8_DECODE if fp8 and decode else CANDIDATES[name]

    cands = {k: candidates(k) for k in shapes}
    seen = {k: set() for k in shapes}
    compiled = {}  # id(candidate row) -> its compiled loop, for the re-timing rounds
    for rnd in range(max(len(c) for c in cands.values())):
        for name in shapes:
            if rnd >= len(cands[name]):
                continue
            over = cands[name][rnd]
            row = rows[name]
            try:
                launch, dec = plan_launches(
                    row["T"], row["S"], HQ, HKV, D, BS, kv_itemsize=itemsize, **over
                )
                tun = dataclasses.asdict(launch)
            except Exception as e:  # noqa: BLE001
                log(f"  {name} {over}: bad tuning {e}")
                continue
            # both launches' tunings: an override may change only a mixed bucket's decode launch
            key = (tuple(sorted(tun.items())), dec)
            if key in seen[name]:
                continue
            seen[name].add(key)
            if time.time() - t_start > args.budget:
                row["skipped"].append(over)
                continue
            q, kc, vc, md, ref, n = data[name]
            c = dict(overrides=over, tuning=tun)
            t0 = time.time()
            try:
                f = ours_loop(tun, iters)
                out = jax.block_until_ready(f(q, kc, vc, md))
                c["compile_s"] = time.time() - t0
                err = rel_err(out, ref, n)
                fin = bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
                pad0 = bool(jnp.all(out[n:] == 0))
                c.update(rel_err=err, finite=fin, padding_zero=pad0, ok=fin and pad0 and err < 2e-3)
                t = time_loop(f, data[name][:4], reps, iters)
                c.update(
                    us=t * 1e6,
                    us_rounds=[t * 1e6],
                    TBps=row["kv_bytes"] / t / 1e12,
                    TFLOPs=row["flops"] / t / 1e12,
                )
                compiled[id(c)] = f
            except Exception as e:  # noqa: BLE001 -- a config that does not compile is logged
                c.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            row["candidates"].append(c)
            log(
                f"  {name:22s} {str(over):70s} "
                + (
                    f"{c['us']:8.1f} us {c['TBps']:5.2f} TB/s {c['TFLOPs']:6.1f} TFLOP/s "
                    f"err={c['rel_err']:.2e} {'ok' if c['ok'] else 'FAIL'}"
                    if "us" in c
                    else c.get("error", "")[:120]
                )
                + f"  [{time.time() - t_start:.0f}s]"
            )
            result["tune"] = list(rows.values())
            save(result, [], args.out, fname=_fname(args))
    # More rounds over every timed candidate, interleaved (round r times all of them before
    # round r + 1): the card's speed drifts by 5-10% over a call, and the time a candidate keeps
    # is its median over the rounds, so neighbours in the ranking saw the same conditions.
    for _ in range(args.rounds - 1):
        for name, row in rows.items():
            for c in row["candidates"]:
                if id(c) in compiled:
                    t = time_loop(compiled[id(c)], data[name][:4], reps, iters)
                    c["us_rounds"].append(t * 1e6)
                    t = float(np.median(c["us_rounds"])) / 1e6
                    c.update(
                        us=t * 1e6, TBps=row["kv_bytes"] / t / 1e12, TFLOPs=row["flops"] / t / 1e12
                    )
    if args.rounds > 1:
        log(
            f"re-timed every candidate {args.rounds - 1} more times, interleaved; median of "
            f"{args.rounds} rounds [{time.time() - t_start:.0f}s]"
        )
    # summary: best correct candidate per shape vs the default
    log("\n| shape | default us | best us | speedup | TB/s | TFLOP/s | best overrides |")
    log("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        good = [c for c in row["candidates"] if c.get("ok")]
        d = next((c for c in row["candidates"] if c["overrides"] == {} and "us" in c), None)
        if not good:
            log(f"| {name} | {d['us'] if d else float('nan'):.1f} | - | - | - | - | none ok |")
            continue
        b = min(good, key=lambda c: c["us"])
        row["best"] = b
        du = d["us"] if d else float("nan")
        log(
            f"| {name} | {du:.1f} | {b['us']:.1f} | {du / b['us']:.2f}x | {b['TBps']:.2f} |"
            f" {b['TFLOPs']:.0f} | {b['overrides']} |"
        )
        if row["skipped"]:
            log(f"|   (skipped for time: {row['skipped']}) |")
    result["tune"] = list(rows.values())
    result["wall_s"] = time.time() - t_start
    save(result, [], args.out, fname=_fname(args))


def _fname(args) -> str:
    return "kernels_tune_fp8" if args.kv_dtype == "fp8" else "kernels_tune"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels.tune", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--only", default="", help="comma list of shape names (harness.SHAPES)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument(
        "--kv-dtype", default="bf16", choices=["bf16", "fp8"], help="the K and V pages' dtype"
    )
    ap.add_argument(
        "--round2", action="store_true", help="decode shapes: FP8_DECODE_2's candidates"
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=115.0,
        help="wall seconds after which remaining candidates are skipped",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="timing rounds over all candidates, interleaved (median kept)",
    )
    args = ap.parse_args(argv)
    t_start = time.time()
    result = run_record(timing="loop")
    result["mode"] = "tune"
    result["kv_dtype"] = args.kv_dtype
    tune(args, result, t_start)


if __name__ == "__main__":
    main()
