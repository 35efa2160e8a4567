"""Our kernel against vLLM's FlashAttention-3, from the JSON files of one device call: one or
more `kernels.py` runs (run before and after `kernels_fa3.py`, they bracket the card's drift
over the call) and one `kernels_fa3.py` run. Prints a markdown table: per shape, our time (the
spread over our runs), FA3's, and our rate as a fraction of FA3's (1.0 = as fast).

  python -m benchmarks.kernels_compare OURS.json [OURS.json ...] FA3.json [--out FILE]

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
        rows.append({"name": f["name"], "ours_us": ts, "ours_median_us": mid,
                     "fa3_us": f["fa3_us"], "ours_over_fa3_rate": f["fa3_us"] / mid,
                     "rate_range": [f["fa3_us"] / max(ts), f["fa3_us"] / min(ts)]})
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| shape | ours us (runs) | FA3 us | ours / FA3 rate (range) |", "|---|---|---|---|"]
    for r in rows:
        runs = " / ".join(f"{t:.1f}" for t in r["ours_us"])
        lo, hi = r["rate_range"]
        out.append(f"| {r['name']} | {runs} | {r['fa3_us']:.1f} | "
                   f"{r['ours_over_fa3_rate']:.2f}x ({lo:.2f}-{hi:.2f}) |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+", help="kernels.py JSON files, then the kernels_fa3.py one")
    ap.add_argument("--out", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    if len(args.files) < 2:
        ap.error("need at least one kernels.py JSON and the kernels_fa3.py JSON")
    loaded = []
    for path in args.files:
        with open(path) as f:
            loaded.append(json.load(f))
    rows = compare(loaded[:-1], loaded[-1])
    print(markdown(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"inputs": args.files, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
