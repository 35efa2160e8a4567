# Call 1 (carry [".whl"]): where a 256 / 300-sequence decode step of Qwen3.5-9B goes at the
# defaults (fused DeltaNet decode kernel, cuBLAS up to 64 tokens), kernels by source line, and
# the same with cuBLAS for every step size (PAXENGINE_KERNEL_CUBLAS_MAX_TOKENS=512).
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
P="python3 -m benchmarks.gpu.step_profile --model dummy:benchmarks/gpu/models/qwen35_9b.json --batch 256 300 --max-seqs 512 --steps 12 --top 30"
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 200 $P --hlo-dir /tmp/hlo \
  --json $OUT/profile.json > $OUT/profile.log 2>&1
echo "== profile rc $?"; python3 - <<'PY'
import json, os
try:
    d = json.load(open(os.environ["OUT"] + "/profile.json"))
except Exception as e:
    print("no profile json", e); raise SystemExit
print("startup", d.get("startup_s"), "temp", d.get("step_temp_gib"), "pools", d.get("state_pools_gib"))
for b in ("batch256", "batch300"):
    r = d.get(b, {})
    print(b, r.get("itl_ms"), r.get("gpu_busy_ms_per_step"))
    print(" fam", list(r.get("families_us_per_step", {}).items())[:16])
    print(" src", list(r.get("by_source_us_per_step", {}).items())[:30])
PY
(cd /tmp/hlo && ls -la | head; tar czf $OUT/hlo.tgz $(ls | grep -E 'step_(256|512)_' | head -4) 2>/dev/null)
PAXENGINE_KERNEL_CUBLAS_MAX_TOKENS=512 XLA_FLAGS=--xla_gpu_enable_command_buffer= \
  timeout 170 $P --json $OUT/profile_cublas512.json > $OUT/profile_cublas512.log 2>&1
echo "== cublas512 rc $?"; grep -E '"batch|gpu_busy|itl_ms|startup' $OUT/profile_cublas512.log | cut -c1-160
