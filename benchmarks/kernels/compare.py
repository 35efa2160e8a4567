"""Our kernel against vLLM's FlashAttention-3, from the JSON files of one device call: one or
more `attention.py` runs, or `decode_trace.py` runs (run before and after `fa3.py`, they
bracket the card's drift over the call) and one `fa3.py` run. Prints a markdown table: per
shape, our time (the spread over our runs), FA3's, and our rate as a fraction of FA3's (1.0 =
as fast).

  python -m benchmarks.kernels.compare OURS.json [OURS.json ...] FA3.json [--out FILE]

Reads JSON only (no JAX, no torch), so it runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def compare(ours_runs: list[dict], fa3: dict) -> list[dict]:
    """Rows for the shapes that both sides timed, in FA3's order."""
    ours: dict[str, list[float]] = {}
    for run in ours_runs:
        for r in run["rows"]:
            if "ours_us" in r:
                ours.setdefault(r["name"], []).append(r["ours_us"])
    rows = []
    for f in fa3["rows"]:
        ts = ours.get(f["name"])
        if not ts:
            continue
        mid = statistics.median(ts)
        rows.append(
            {
                "name": f["name"],
                "ours_us": ts,
                "ours_median_us": mid,
                "fa3_us": f["fa3_us"],
                "ours_over_fa3_rate": f["fa3_us"] / mid,
                "rate_range": [f["fa3_us"] / max(ts), f["fa3_us"] / min(ts)],
            }
        )
    return rows


def compare_decode(traces: list[dict], fa3: dict) -> list[dict]:
    """Decode rows from decode_trace.py runs (their default variant, pages permuted) and a
    fa3.py run, on three levels:
    * kernel: the attention kernel alone (device time), both sides back to back as in a step
      (ours in the unrolled form, FA3 in the graph replay);
    * step: a call inside an engine step, on the device (first kernel start to last kernel end,
      per call; kernels, split-K combine and the gaps between them): ours unrolled in one jit
      with the metadata shared, FA3 replayed from a CUDA graph with its schedule planned once
      (as vLLM decodes);
    * alone: wall time of a call on its own (ours: the jitted loop, metadata rebuilt every
      call; FA3: eager calls, each planning its schedule).
    Ours is the median over the traces; rate = FA3's time / ours (> 1: ours is faster). Shapes
    without FA3's graph trace are left out, with a note on stderr."""
    ours: dict[str, list[dict]] = {}
    for run in traces:
        for shape in run["shapes"]:
            v = next(
                (
                    v
                    for v in shape["variants"]
                    if v["overrides"] == {} and v["pages"] == "permuted" and "us" in v
                ),
                None,
            )
            if v:
                ours.setdefault(shape["name"], []).append(v)
    rows = []
    for f in fa3["rows"]:
        vs = ours.get(f["name"])
        ft = f.get("fa3_graph_trace")
        if not vs or "kv_bytes" not in f:
            continue
        if not ft:
            print(
                f"note: {f['name']}: no FA3 graph trace "
                f"({f.get('fa3_graph_error', 'no kernels traced')}); left out",
                file=sys.stderr,
            )
            continue
        med = lambda key: statistics.median(key(v) for v in vs)  # noqa: E731
        r = {
            "name": f["name"],
            "kv_bytes": f["kv_bytes"],
            "ours_runs": len(vs),
            "ours_kernel_us": med(lambda v: v["unrolled"]["kernel_us"]),
            "fa3_kernel_us": ft["kernel_us"],
            "ours_kernel_in_loop_us": med(lambda v: v["kernel_us"]),
            "ours_step_us": med(lambda v: v["unrolled"]["span_us"]),
            "fa3_step_us": ft["span_us"],
            "ours_alone_us": med(lambda v: v["us"]),
            "fa3_alone_us": f["fa3_us"],
            # wall clock of the engine-like forms (ours pays ~0.3 ms per jit execution on
            # the host that the device span leaves out)
            "ours_unrolled_wall_us": med(lambda v: v["unrolled_us"]),
            "fa3_graph_wall_us": f.get("fa3_graph_us"),
        }
        for k in ("kernel", "step", "alone"):
            r[f"{k}_rate"] = r[f"fa3_{k}_us"] / r[f"ours_{k}_us"]
        rows.append(r)
    return rows


def markdown_decode(rows: list[dict]) -> str:
    out = [
        "| shape | kernel: ours / FA3 us (TB/s) | rate | in a step: ours / FA3 us | rate | "
        "alone: ours / FA3 us | rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tb = lambda us: r["kv_bytes"] / us / 1e6  # noqa: E731
        out.append(
            f"| {r['name']} | {r['ours_kernel_us']:.1f} ({tb(r['ours_kernel_us']):.2f}) / "
            f"{r['fa3_kernel_us']:.1f} ({tb(r['fa3_kernel_us']):.2f}) | "
            f"{r['kernel_rate']:.2f}x | {r['ours_step_us']:.1f} / {r['fa3_step_us']:.1f} | "
            f"{r['step_rate']:.2f}x | {r['ours_alone_us']:.1f} / {r['fa3_alone_us']:.1f} | "
            f"{r['alone_rate']:.2f}x |"
        )
    return "\n".join(out)


def markdown(rows: list[dict]) -> str:
    out = ["| shape | ours us (runs) | FA3 us | ours / FA3 rate (range) |", "|---|---|---|---|"]
    for r in rows:
        runs = " / ".join(f"{t:.1f}" for t in r["ours_us"])
        lo, hi = r["rate_range"]
        out.append(
            f"| {r['name']} | {runs} | {r['fa3_us']:.1f} | "
            f"{r['ours_over_fa3_rate']:.2f}x ({lo:.2f}-{hi:.2f}) |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "files", nargs="+", help="attention.py (or decode_trace.py) JSON files, then the fa3.py one"
    )
    ap.add_argument("--out", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    if len(args.files) < 2:
        ap.error("need at least one attention.py JSON and the fa3.py JSON")
    loaded = []
    for path in args.files:
        with open(path) as f:
            loaded.append(json.load(f))
    if all(isinstance(run.get("shapes"), list) for run in loaded[:-1]):  # decode_trace.py
        rows = compare_decode(loaded[:-1], loaded[-1])
        print(markdown_decode(rows))
    else:
        rows = compare(loaded[:-1], loaded[-1])
        print(markdown(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"inputs": args.files, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
