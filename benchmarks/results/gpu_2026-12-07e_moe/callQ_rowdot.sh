# Call Q (carry [".whl"]): call P's B1 / B8 profile again with quant.row_dot (a one-row dot as a
# two-row GEMM between optimization barriers) for the out projection and the router.
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 200 python3 -m benchmarks.gpu.step_profile \
  --model dummy:benchmarks/gpu/models/qwen3_30b_a3b.json --batch 1 8 --steps 16 --hlo-dir /tmp/hlo \
  --json $OUT/profile_rowdot.json > $OUT/profile_rowdot.log 2>&1
echo "== profile rc $?"; python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/profile_rowdot.json"))
for b in ("batch1", "batch8"):
    r = d.get(b, {})
    print(b, r.get("itl_ms"), r.get("gpu_busy_ms_per_step"))
    print(" fam", list(r.get("families_us_per_step", {}).items())[:10])
    print(" src", list(r.get("by_source_us_per_step", {}).items())[:16])
PY
grep -c "loop_multiply_fusion" /tmp/hlo/step_1_8.hlo.txt
