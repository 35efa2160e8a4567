# Call 1 (carry [".whl"]): where the Qwen3-30B-A3B decode step goes after a6aef65 / 53c51a1 /
# 86a9bd6 and the kernel's SwiGLU (B1 / B8 profile, kernels attributed to the model's source
# lines), the kernel with and without its SwiGLU, its tunings at decode sizes, and 64-row tiles
# against 16-row ones for large steps.
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 250 python3 -m benchmarks.gpu.step_profile \
  --model dummy:benchmarks/gpu/models/qwen3_30b_a3b.json --batch 1 8 --hlo-dir /tmp/hlo \
  --json $OUT/profile.json > $OUT/profile.log 2>&1
echo "== profile rc $?"; python3 - <<'PY'
import json, os
try:
    d = json.load(open(os.environ["OUT"] + "/profile.json"))
except Exception as e:
    print("no profile json", e); raise SystemExit
for b in ("batch1", "batch8"):
    r = d.get(b, {})
    print(b, r.get("itl_ms"), r.get("gpu_busy_ms_per_step"))
    print(" fam", list(r.get("families_us_per_step", {}).items())[:12])
    print(" src", list(r.get("by_source_us_per_step", {}).items())[:24])
PY
(cd /tmp/hlo && tar czf $OUT/hlo.tgz step_1_8.hlo.txt step_64_8.hlo.txt 2>/dev/null || tar czf $OUT/hlo.tgz .)
for glu in 1 0; do
  echo "== probe PAXENGINE_KERNEL_MOE_GLU=$glu" >> $OUT/probes.log
  PAXENGINE_KERNEL_MOE_GLU=$glu timeout 60 python3 -m benchmarks.gpu.moe_probe --variants pallas \
    --tokens 1 8 64 512 2048 >> $OUT/probes.log 2>&1
done
grep -E '^==|"T"' $OUT/probes.log | cut -c1-200
timeout 150 python3 -m benchmarks.gpu.moe_probe --sweep --tokens 1 8 --json $OUT/sweep.json > $OUT/sweep.log 2>&1
echo "== sweep rc $?"; grep '"best"' $OUT/sweep.log | cut -c1-400
for big in "" 1; do
  echo "== probe PAXENGINE_KERNEL_MOE_BIG_TILE_PAIRS=$big" >> $OUT/probes.log
  PAXENGINE_KERNEL_MOE_BIG_TILE_PAIRS=$big timeout 45 python3 -m benchmarks.gpu.moe_probe \
    --variants pallas --tokens 2048 8192 >> $OUT/probes.log 2>&1
done
grep -E '^==|"T"' $OUT/probes.log | tail -6 | cut -c1-200
