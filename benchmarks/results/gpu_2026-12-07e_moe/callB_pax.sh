# Call B (carry [".whl"]): pax-offline-qwen3moe at the defaults, after two checks in the same call:
# 1. moe_probe at 1 / 8 / 2,048 tokens with the defaults (the kernel's SwiGLU, 64-row tiles past
#    moe.BIG_TILE_PAIRS), products against ragged_dot's: if one fails or differs, the run goes
#    without both (PAXENGINE_KERNEL_MOE_GLU=0, 16-row tiles only), said so;
# 2. the kernel's 16-row tunings (moe_probe --sweep --small, 1 and 8 tokens, gate_up in glu mode
#    and down): the tuning with the least time over both sizes and projections runs as
#    PAXENGINE_KERNEL_MOE_DECODE_TUNING if it beats grouped_matmul's defaults by 3% (then it
#    becomes moe.DECODE_TUNING in the commit after the lease), said so.
t0=$(date +%s)
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 50 python3 -m benchmarks.gpu.moe_probe --variants pallas --tokens 1 8 2048 > $OUT/probe.log 2>&1
grep '"T"' $OUT/probe.log | cut -c1-170
ok=$(python3 - <<'PY'
import json, os
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/probe.log") if l.startswith("{")]
good = len(rows) == 3 and all("us" in r and r.get("max_abs_diff_vs_xla", 1) < 0.05 for r in rows)
print(1 if good else 0)
PY
)
[ "$ok" = 1 ] || { export PAXENGINE_KERNEL_MOE_GLU=0 PAXENGINE_KERNEL_MOE_BIG_TILE_PAIRS=1000000000; echo "== the defaults failed or differed: run without the glu mode and 64-row tiles"; }
timeout 90 python3 -m benchmarks.gpu.moe_probe --sweep --small --tokens 1 8 --json $OUT/sweep_small.json > $OUT/sweep_small.log 2>&1
echo "== small sweep rc $?"
tune=$(python3 - <<'PY'
import json, os
try:
    rows = json.load(open(os.environ["OUT"] + "/sweep_small.json"))
except Exception:
    raise SystemExit
F = ("block_n", "block_k", "num_warps", "num_stages")
tot, n = {}, {}
for r in rows:
    if "us" in r:
        key = tuple(r[f] for f in F)
        tot[key] = tot.get(key, 0) + r["us"]
        n[key] = n.get(key, 0) + 1
full = {k: v for k, v in tot.items() if n[k] == max(n.values())}
default = full.get((64, 64, 4, 3))
best = min(full, key=full.get, default=None)
print(f"# totals us: default {default}, best {best} {full.get(best)}", file=open(os.environ["OUT"] + "/sweep_pick.txt", "w"))
if best and default and full[best] < 0.97 * default:
    print(",".join(f"{f}={v}" for f, v in zip(F, best)))
PY
)
cat $OUT/sweep_pick.txt 2>/dev/null
[ -z "$tune" ] || { export PAXENGINE_KERNEL_MOE_DECODE_TUNING=$tune; echo "== decode tuning: PAXENGINE_KERNEL_MOE_DECODE_TUNING=$tune"; }
PAXENGINE_COMMIT=${PAXENGINE_COMMIT:-?} GPU_BENCH_BUDGET_S=$(( 588 - ($(date +%s) - t0) )) \
  bash benchmarks/gpu/gpu_run.sh pax-offline-qwen3moe > /dev/null 2>&1
grep -v "^|" $OUT/gpu_log.txt | grep -v "^\[" | tail -30 | cut -c1-250
grep -E "KV cache|device memory|started in|largest" $OUT/gpu_log.txt | cut -c1-200
