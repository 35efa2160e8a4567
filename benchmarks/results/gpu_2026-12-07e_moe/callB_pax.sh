# Call B (carry [".whl"]): pax-offline-qwen3moe at the defaults. First moe_probe at 1 / 8 / 2,048
# tokens with the defaults (the kernel's SwiGLU, 64-row tiles past moe.BIG_TILE_PAIRS), products
# against ragged_dot's: if one fails or differs, the run goes without both (said so); then the
# same without them (PAXENGINE_KERNEL_MOE_GLU=0, 16-row tiles only) for the A/B.
t0=$(date +%s)
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== probe defaults" >> $OUT/probe.log
timeout 50 python3 -m benchmarks.gpu.moe_probe --variants pallas --tokens 1 8 2048 >> $OUT/probe.log 2>&1
echo "== probe PAXENGINE_KERNEL_MOE_GLU=0 PAXENGINE_KERNEL_MOE_BIG_TILE_PAIRS=1000000000" >> $OUT/probe.log
PAXENGINE_KERNEL_MOE_GLU=0 PAXENGINE_KERNEL_MOE_BIG_TILE_PAIRS=1000000000 timeout 50 \
  python3 -m benchmarks.gpu.moe_probe --variants pallas --tokens 1 8 2048 >> $OUT/probe.log 2>&1
grep -E '^==|"T"' $OUT/probe.log | cut -c1-170
ok=$(python3 - <<'PY'
import json, os
rows, first = [], None
for line in open(os.environ["OUT"] + "/probe.log"):
    if line.startswith("=="):
        first = line.strip() == "== probe defaults"
    elif line.startswith("{") and first:
        rows.append(json.loads(line))
good = len(rows) == 3 and all("us" in r and r.get("max_abs_diff_vs_xla", 1) < 0.05 for r in rows)
print(1 if good else 0)
PY
)
[ "$ok" = 1 ] || { export PAXENGINE_KERNEL_MOE_GLU=0 PAXENGINE_KERNEL_MOE_BIG_TILE_PAIRS=1000000000; echo "== the defaults failed or differed: run without the glu mode and 64-row tiles"; }
PAXENGINE_COMMIT=${PAXENGINE_COMMIT:-?} GPU_BENCH_BUDGET_S=$(( 585 - ($(date +%s) - t0) )) \
  bash benchmarks/gpu/gpu_run.sh pax-offline-qwen3moe > /dev/null 2>&1
grep -v "^|" $OUT/gpu_log.txt | grep -v "^\[" | tail -30 | cut -c1-250
grep -E "KV cache|device memory|started in|largest" $OUT/gpu_log.txt | cut -c1-200
