"""Call 1's choice for call 2: the variant (off / tuned / rule) with the lowest median of its
runs' batch-1 + batch-8 ITL; prints its env line (KEY=VALUE ...)."""

import json
import statistics
import sys
from pathlib import Path

out, tuned = Path(sys.argv[1]), sys.argv[2]
ENV = {
    "off": "PAXENGINE_KERNEL_FP8_W8A8_GEMV_MAX_ROWS=0",
    "tuned": f"PAXENGINE_KERNEL_FP8_W8A8_GEMV_MAX_ROWS=16 PAXENGINE_KERNEL_FP8_X8_TUNING={tuned}",
    "rule": "PAXENGINE_KERNEL_FP8_W8A8_GEMV_MAX_ROWS=16",
}


def itls(doc):
    found = {}

    def walk(o):
        if isinstance(o, dict):
            for k, v in o.items():
                if k in ("itl_batch1_ms", "itl_batch8_ms"):
                    found[k] = v
                walk(v)

    walk(doc)
    return found


scores = {}
for d in sorted(out.iterdir()):
    f = d / "gpu_bench.json"
    if not f.exists():
        continue
    it = itls(json.loads(f.read_text()))
    if len(it) == 2:
        name = d.name.split("_")[0]
        scores.setdefault(name, []).append(it["itl_batch1_ms"] + it["itl_batch8_ms"])
        print(
            f"# {d.name}: b1 {it['itl_batch1_ms']:.3f} b8 {it['itl_batch8_ms']:.3f}",
            file=sys.stderr,
        )
best = min(scores, key=lambda n: statistics.median(scores[n])) if scores else "off"
print(f"# pick {best}: {scores}", file=sys.stderr)
print(ENV[best])
