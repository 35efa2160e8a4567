# Call P (carry [".whl"], after call B on the same machine): where the Qwen3-30B-A3B decode step
# goes at the defaults (B1 / B8 profile, kernels attributed to the model's source lines through
# the optimized HLO's stack frames); then the same steps' GPU busy time with XLA's dot strength
# reduction off (a one-row dot becomes multiply + reduce fusions) and with cuBLAS for the steps'
# dense GEMMs (PAXENGINE_KERNEL_CUBLAS_MAX_TOKENS=64, as Qwen3.5's default).
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
P="python3 -m benchmarks.gpu.step_profile --model dummy:benchmarks/gpu/models/qwen3_30b_a3b.json --batch 1 8 --steps 16"
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 200 $P --hlo-dir /tmp/hlo \
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
    print(" fam", list(r.get("families_us_per_step", {}).items())[:14])
    print(" src", list(r.get("by_source_us_per_step", {}).items())[:30])
PY
(cd /tmp/hlo && tar czf $OUT/hlo.tgz step_1_8.hlo.txt step_64_8.hlo.txt 2>/dev/null || tar czf $OUT/hlo.tgz .)
XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_enable_dot_strength_reduction=false" \
  timeout 130 $P --top 12 > $OUT/profile_nosr.log 2>&1
echo "== no strength reduction rc $?"; grep -E '"batch"|gpu_busy|startup' $OUT/profile_nosr.log | cut -c1-120
PAXENGINE_KERNEL_CUBLAS_MAX_TOKENS=64 XLA_FLAGS=--xla_gpu_enable_command_buffer= \
  timeout 130 $P --top 12 > $OUT/profile_cublas.log 2>&1
echo "== cublas rc $?"; grep -E '"batch"|gpu_busy|startup' $OUT/profile_cublas.log | cut -c1-120
