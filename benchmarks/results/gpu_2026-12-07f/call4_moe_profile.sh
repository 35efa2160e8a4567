# Call 4 (carry [".whl"]): where Qwen3-30B-A3B's large decode steps go (64 / 256 sequences, the
# throughput rows' decode; kernels by source line), then the MoE layer alone at prefill sizes
# (512 / 2,048 / 8,192 tokens) by lowering: ragged_dot (XLA) against the Pallas grouped GEMM.
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 220 python3 -m benchmarks.gpu.step_profile \
  --model dummy:benchmarks/gpu/models/qwen3_30b_a3b.json --batch 64 256 --max-seqs 256 --steps 12 \
  --top 30 --hlo-dir /tmp/hlo --json $OUT/profile.json > $OUT/profile.log 2>&1
echo "== profile rc $?"; python3 - <<'PY'
import json, os
try:
    d = json.load(open(os.environ["OUT"] + "/profile.json"))
except Exception as e:
    print("no profile json", e); raise SystemExit
for b in ("batch64", "batch256"):
    r = d.get(b, {})
    print(b, r.get("itl_ms"), r.get("gpu_busy_ms_per_step"))
    print(" fam", list(r.get("families_us_per_step", {}).items())[:14])
    print(" src", list(r.get("by_source_us_per_step", {}).items())[:24])
PY
timeout 200 python3 -m benchmarks.gpu.moe_probe --tokens 512 2048 8192 --variants xla pallas \
  --json $OUT/moe_probe.json > $OUT/moe_probe.log 2>&1
echo "== probe rc $?"; grep '"T"\|us' $OUT/moe_probe.log | cut -c1-220 | tail -20
