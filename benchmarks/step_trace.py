"""Summarise a PAXENGINE_STEP_TRACE file (paxengine/step_trace.py): where a served or offline
run's engine iterations spent their time, and how often the device waited on the host.

  python -m benchmarks.step_trace FILE [FILE ...] [--json OUT]

Per file, per busy stretch (a server's benchmark runs are cut apart where it sat idle): iterations, the median and mean of each host phase, the device's share (time the host
waited for a step), the iterations whose wait was under 0.2 ms (the device was idle behind the
host: its next step was not queued in time), and the step interval (between consecutive reads)
split by what the step held: decode rows only, or prompt tokens too, per token bucket.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

PHASES = ("gap_ms", "schedule_ms", "build_ms", "launch_ms", "host_ms", "wait_ms", "process_ms")
IDLE_WAIT_MS = 0.2


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    return {
        "n": len(xs),
        "mean": round(statistics.fmean(xs), 3),
        "p50": round(xs[len(xs) // 2], 3),
        "p90": round(xs[int(len(xs) * 0.9)], 3),
        "p99": round(xs[min(len(xs) - 1, int(len(xs) * 0.99))], 3),
        "sum": round(sum(xs), 1),
    }


def segments(recs: list[dict], idle_ms: float = 500.0, min_steps: int = 50) -> list[list[dict]]:
    """The trace cut where the engine sat idle (an iteration that began more than idle_ms after
    the last ended: a server between two benchmark runs), keeping pieces of min_steps steps or
    more (warm-up requests make short ones)."""
    pieces, cur = [], []
    for r in recs:
        if cur and r.get("gap_ms", 0.0) > idle_ms:
            pieces.append(cur)
            cur = []
        cur.append(r)
    pieces.append(cur)
    return [p for p in pieces if sum(1 for r in p if "T" in r) >= min_steps]


def summarise(recs: list[dict]) -> dict:
    """The summary of one trace (records in iteration order)."""
    recs = [{**recs[0], "gap_ms": 0.0}, *recs[1:]] if recs else recs  # idle before it: not its
    steps = [r for r in recs if "T" in r]
    phases = {p: _stats([r.get(p, 0.0) for r in recs]) for p in PHASES}
    waited = [r for r in recs if "wait_ms" in r]
    idle = sum(1 for r in waited if r["wait_ms"] < IDLE_WAIT_MS)
    # interval of the step dispatched in iteration i: from the read before it to the read of it
    by_kind: dict[str, list[float]] = defaultdict(list)
    reads = [(i, r["read_at"]) for i, r in enumerate(recs) if "read_at" in r]
    for (i, a), (_, b) in zip(reads, reads[1:]):
        r = recs[i]  # dispatched in iteration i, read in the next one
        if "T" not in r:
            continue
        kind = "decode" if r["prompt_tokens"] == 0 else "mixed" if r["decode_rows"] else "prefill"
        by_kind[f"{kind} T={r['T']}"].append((b - a) * 1e3)
    span = (recs[-1]["t"] - recs[0]["t"]) if len(recs) > 1 else 0.0
    return {
        "iterations": len(recs),
        "steps": len(steps),
        "span_s": round(span, 3),
        "sync_iterations": sum(1 for r in recs if r.get("sync")),
        "device_idle_iterations": idle,
        "device_idle_share": round(idle / len(waited), 3) if waited else None,
        "phases_ms": phases,
        "host_ms_per_step": round(
            sum(sum(r.get(p, 0.0) for p in PHASES if p != "wait_ms") for r in recs)
            / max(1, len(steps)),
            3,
        ),
        # the garbage collector's passes (gc time overlaps the phases it fell in)
        "gc_ms": _stats([r.get("gc_ms", 0.0) for r in recs]),
        "gc_full_passes": sum(r.get("gc_full", 0) for r in recs),
        "tokens": _stats([r["tokens"] for r in steps]),
        "decode_rows": _stats([r["decode_rows"] for r in steps]),
        "step_interval_ms": {k: _stats(v) for k, v in sorted(by_kind.items())},
    }


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    out = None
    if "--json" in args:
        k = args.index("--json")
        out = args[k + 1]
        del args[k : k + 2]
    if not args:
        print(__doc__)
        return 2
    result = {path: [summarise(seg) for seg in segments(load(path))] for path in args}
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
