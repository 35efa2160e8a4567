# Call B (carry [".whl"]): pax-offline-qwen3moe at the defaults. First the kernel with and
# without its SwiGLU at 1 / 8 / 64 tokens (moe_probe, its products against ragged_dot's): if the
# glu mode fails or differs here, the run goes without it (PAXENGINE_KERNEL_MOE_GLU=0), said so.
t0=$(date +%s)
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for glu in 1 0; do
  echo "== probe PAXENGINE_KERNEL_MOE_GLU=$glu" >> $OUT/probe_glu.log
  PAXENGINE_KERNEL_MOE_GLU=$glu timeout 50 python3 -m benchmarks.gpu.moe_probe --variants pallas \
    --tokens 1 8 64 >> $OUT/probe_glu.log 2>&1
done
grep -E '^==|"T"' $OUT/probe_glu.log | cut -c1-170
ok=$(python3 - <<'PY'
import json, os
rows, glu = [], None
for line in open(os.environ["OUT"] + "/probe_glu.log"):
    if line.startswith("=="):
        glu = line.strip().endswith("=1")
    elif line.startswith("{") and glu:
        rows.append(json.loads(line))
good = len(rows) == 3 and all("us" in r and r.get("max_abs_diff_vs_xla", 1) < 0.05 for r in rows)
print(1 if good else 0)
PY
)
[ "$ok" = 1 ] || { export PAXENGINE_KERNEL_MOE_GLU=0; echo "== glu mode failed or differed: run without it"; }
# 64-row tiles past moe.BIG_TILE_PAIRS (the default) against 16-row ones at every size: the
# default stands unless 16-row tiles win at a size it gives 64 (then the run goes without them)
for big in "" 1000000000; do
  echo "== probe PAXENGINE_KERNEL_MOE_BIG_TILE_PAIRS=$big" >> $OUT/probe_big.log
  PAXENGINE_KERNEL_MOE_BIG_TILE_PAIRS=$big timeout 50 python3 -m benchmarks.gpu.moe_probe \
    --variants pallas --tokens 512 2048 8192 >> $OUT/probe_big.log 2>&1
done
grep -E '^==|"T"' $OUT/probe_big.log | cut -c1-170
# the pick: 64-row tiles from the smallest probed size where they win there and at every larger
# one (the default, if that is the smallest size; else the limit just below it; else never)
pick=$(python3 - <<'PY'
import json, os
us, big = {}, None
for line in open(os.environ["OUT"] + "/probe_big.log"):
    if line.startswith("=="):
        big = line.strip().endswith("=")
    elif line.startswith("{"):
        r = json.loads(line)
        us.setdefault(r["T"], {})[big] = r.get("us")
Ts = sorted(us)
win = [T for T in Ts if us[T].get(True) and (not us[T].get(False) or us[T][True] < us[T][False])]
start = next((i for i in range(len(Ts)) if all(T in win for T in Ts[i:])), None)
if not Ts or start is None:
    print(1000000000)
elif start > 0:
    print(Ts[start - 1] * 8)  # (top-8: pairs of the largest size where 16-row tiles won)
PY
)
[ -z "$pick" ] || { export PAXENGINE_KERNEL_MOE_BIG_TILE_PAIRS=$pick; echo "== not the default tiles: PAXENGINE_KERNEL_MOE_BIG_TILE_PAIRS=$pick"; }
PAXENGINE_COMMIT=${PAXENGINE_COMMIT:-?} GPU_BENCH_BUDGET_S=$(( 585 - ($(date +%s) - t0) )) \
  bash benchmarks/gpu/gpu_run.sh pax-offline-qwen3moe > /dev/null 2>&1
grep -v "^|" $OUT/gpu_log.txt | grep -v "^\[" | tail -30 | cut -c1-250
grep -E "KV cache|device memory|started in|largest" $OUT/gpu_log.txt | cut -c1-200
