"""Where a decode call's time goes. Each variant is timed two ways and traced:
* loop: a jitted fori_loop of chained calls (as `tune.py` times): every call also
  rebuilds its tile metadata (XLA does not hoist it) and the loop updates q;
* unrolled: calls on separate query buffers unrolled in one jit, as the engine unrolls its
  layers: the tile metadata is built once and shared (XLA's CSE), as in an engine step, so
  a call costs its kernel, its split-K combine and the gaps between them;
and the traces separate the attention kernel's own device time from the other kernels, the
device's idle time between kernels (`idle_us`) and, by difference with the wall clock, the
host's dispatch and synchronisation (`outside_kernels_us` = wall - device busy). With the read
rate of the same bytes through an XLA reduction, and each shape with its pages in order as well
as permuted.

  python -m benchmarks.kernels.decode_trace [--only SHAPES] [--variants JSON] [--out DIR]    (GPU)

Writes decode_trace.json to --out (default $OUT or .).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.device_trace import kernel_times, span_of, trace_device
from benchmarks.kernels.harness import (
    BS,
    INTERP,
    QUICK_SHAPES,
    SHAPES,
    D,
    build,
    kv_bytes,
    oracle,
    ours_loop,
)
from benchmarks.measure import time_loop
from kernels_pallas import ragged_paged_attention
from kernels_pallas.testing import rel_err

DECODE_SHAPES = "decode_b64_ctx2048,decode_b8_ctx8192,decode_b256_ctx512,decode_b1_ctx8192"
VARIANTS = [
    {},
    {"num_warps": 8},
    {"num_stages": 2},
    {"pv_split": False},
    {"mosaic_decode": True, "mosaic_block_k": 64, "mosaic_stages": 4, "mosaic_persistent": 132},
]
ITERS = 20


def attention_kernel(name: str) -> bool:
    """The Pallas attention kernel of a trace (Triton or Mosaic GPU), not an XLA fusion."""
    n = name.lower()
    return "ragged_paged" in n or "mosaic_gpu" in n


def traced(f, data) -> dict:
    """Per call, over one run of f (ITERS calls): device microseconds of the attention kernel,
    of every other kernel, the device span (first kernel start to last kernel end) and the idle
    time inside it, and the top kernel names."""
    events = trace_device(lambda: jax.block_until_ready(f(*data)))
    times, counts = kernel_times(events)
    attn = sum(us for n, us in times.items() if attention_kernel(n))
    other = sum(us for n, us in times.items() if not attention_kernel(n))
    span, idle = span_of(events)
    return {
        "kernel_us": attn / ITERS,
        "other_us": other / ITERS,
        "span_us": span / ITERS,
        "idle_us": idle / ITERS,
        "kernels": {
            n[:90]: [round(us / ITERS, 2), counts[n] / ITERS]
            for n, us in sorted(times.items(), key=lambda kv: -kv[1])[:8]
        },
    }


def unrolled(over):
    """ITERS calls in one jit, each on its own query buffer, unrolled as the engine unrolls its
    layers: what does not depend on the queries (the tile metadata) is computed once and shared,
    as in an engine step. Timed with 3 dispatches per synchronisation (the host's dispatch
    overlaps the device's work; what it cannot hide shows as wall clock minus device span)."""

    @jax.jit
    def many(qs, kc, vc, md):
        return [
            ragged_paged_attention(
                q, kc, vc, jnp.int32(0), md, sm_scale=D**-0.5, interpret=INTERP, **over
            )
            for q in qs
        ]

    return many


def read_ceiling(kc, vc) -> float:
    """Seconds for XLA to read both caches once (a sum in fp32)."""

    @jax.jit
    def loop(kc, vc):
        def body(i, acc):  # (acc * 0 inside the sums: nothing is hoisted out of the loop)
            return (
                acc
                + jnp.sum(kc.astype(jnp.float32) + acc * 0)
                + jnp.sum(vc.astype(jnp.float32) + acc * 0)
            )

        return jax.lax.fori_loop(0, ITERS, body, jnp.float32(0))

    jax.block_until_ready(loop(kc, vc))
    return time_loop(loop, (kc, vc), 5, ITERS)


def in_order(md, block_size):
    """The same batch with each sequence's pages in physical order, one after the other."""
    bt = np.asarray(md.block_tables)
    pages = -(-np.asarray(md.seq_lens) // block_size)
    live = np.arange(bt.shape[1])[None, :] < pages[:, None]
    order = (np.cumsum(live.reshape(-1)).reshape(bt.shape) - 1) * live
    return dataclasses.replace(md, block_tables=jnp.asarray(order.astype(np.int32)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=DECODE_SHAPES)
    ap.add_argument("--variants", default=None, help="JSON list of Tuning overrides")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    variants = json.loads(args.variants) if args.variants else VARIANTS
    res = {
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "command": "python -m benchmarks.kernels.decode_trace " + " ".join(sys.argv[1:]),
        "shapes": [],
    }
    t0 = time.time()
    for i, name in enumerate(args.only.split(",")):
        seqs, T, S = {**SHAPES, **QUICK_SHAPES}[name]
        q, kc, vc, md = build(seqs, T, S, 200 + i)
        n = sum(ql for ql, _ in seqs)
        ref = oracle(q, kc, vc, md)
        nbytes = kv_bytes(seqs)
        row = {"name": name, "kv_bytes": nbytes, "variants": []}
        try:
            row["xla_read_TBps"] = (
                (kc.size * kc.dtype.itemsize + vc.size * vc.dtype.itemsize)
                / read_ceiling(kc, vc)
                / 1e12
            )
        except Exception as e:  # noqa: BLE001 -- recorded; the variants still run
            row["xla_read_TBps"], row["xla_read_error"] = (
                float("nan"),
                f"{type(e).__name__}: {e}"[:300],
            )
        runs = []
        for pages in ("permuted", "in_order"):
            data = (q, kc, vc, md if pages == "permuted" else in_order(md, BS))
            for over in variants if pages == "permuted" else variants[:1]:
                v = {"overrides": over, "pages": pages, "us_rounds": []}
                f = ours_loop(over, ITERS)
                try:
                    out = jax.block_until_ready(f(*data))
                    v["rel_err"] = rel_err(out, ref if pages == "permuted" else oracle(*data), n)
                    v["us_rounds"].append(time_loop(f, data, 5, ITERS) * 1e6)
                    v.update(traced(f, data))
                    u = unrolled(over)
                    udata = ([q + 0 for _ in range(ITERS)],) + data[1:]
                    jax.block_until_ready(u(*udata))
                    v["unrolled_us_rounds"] = [time_loop(u, udata, 5, ITERS, per_sync=3) * 1e6]
                    v["unrolled"] = traced(u, udata)
                    runs.append((v, f, data, u, udata))
                except Exception as e:  # noqa: BLE001 -- a variant that fails is recorded
                    v["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                row["variants"].append(v)
        for _ in range(args.rounds - 1):  # interleaved re-timing: the card drifts over a call
            for v, f, data, u, udata in runs:
                try:
                    v["us_rounds"].append(time_loop(f, data, 5, ITERS) * 1e6)
                    v["unrolled_us_rounds"].append(time_loop(u, udata, 5, ITERS, per_sync=3) * 1e6)
                except Exception as e:  # noqa: BLE001 -- the rounds taken so far stand
                    v["retime_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        for v, *_ in runs:
            v["us"] = float(np.median(v["us_rounds"]))
            v["unrolled_us"] = float(np.median(v["unrolled_us_rounds"]))
            v["TBps"] = nbytes / v["us"] / 1e6
            v["kernel_TBps"] = nbytes / v["kernel_us"] / 1e6 if v["kernel_us"] else float("nan")
            # wall time outside the device's kernels: its idle time inside the loop (idle_us) and
            # the host's dispatch and synchronisation
            v["outside_kernels_us"] = v["us"] - v["kernel_us"] - v["other_us"]
        res["shapes"].append(row)
        print(
            f"\n{name}: {nbytes / 1e6:.0f} MB of KV, XLA read {row['xla_read_TBps']:.2f} TB/s "
            f"[{time.time() - t0:.0f}s]"
        )
        print(
            f"  {'variant':48s} {'loop us':>8s} {'kernel':>8s} {'other':>6s} {'outside':>7s} "
            f"{'idle':>6s} {'kern TB/s':>9s} {'unrolled':>8s} {'its other':>9s} {'span':>7s} "
            f"{'idle':>6s} {'err':>8s}"
        )
        for v in row["variants"]:
            label = f"{v['pages']:8s} {json.dumps(v['overrides'])}"[:48]
            if "us" in v:
                u = v["unrolled"]
                print(
                    f"  {label:48s} {v['us']:8.1f} {v['kernel_us']:8.1f} {v['other_us']:6.1f} "
                    f"{v['outside_kernels_us']:7.1f} {v['idle_us']:6.1f} {v['kernel_TBps']:9.2f} "
                    f"{v['unrolled_us']:8.1f} "
                    f"{u['other_us']:9.1f} {u['span_us']:7.1f} {u['idle_us']:6.1f} {v['rel_err']:8.1e}"
                )
            else:
                print(f"  {label:48s} {v['error'][:100]}")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_trace.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
