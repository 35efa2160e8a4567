#!/usr/bin/env bash
# Call 1b (issue #17; the device's last minutes after two machines were taken back): batch-1 /
# batch-8 ITL of the FP8 engine with the W8A8 GEMV off (today's default) and on with its rule
# (PAXENGINE_KERNEL_FP8_W8A8_GEMV_MAX_ROWS=16), alternating, each run its own process.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PAXENGINE_COMMIT=${PAXENGINE_COMMIT:-?}
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
LIMIT=${LIMIT:-300}
run() {  # name, env...
  local name=$1; shift
  mkdir -p $OUT/$name
  left=$((LIMIT - SECONDS))
  [ $left -lt 45 ] && { echo "skip $name ($left s left)"; return; }
  env "$@" OUT=$OUT/$name GPU_BENCH_BUDGET_S=$((left < 120 ? left : 120)) GPU_BENCH_ITL_BATCHES=1,8 \
    GPU_BENCH_OFFLINE="" bash benchmarks/gpu/gpu_run.sh pax-offline-fp8 > /dev/null 2>&1
  echo "== $name ($SECONDS s)"; grep -E "started in|ITL [0-9]|Error|error" $OUT/$name/gpu_log.txt | grep -v "^|" | tail -4
}
run off PAXENGINE_KERNEL_FP8_W8A8_GEMV_MAX_ROWS=0
run rule PAXENGINE_KERNEL_FP8_W8A8_GEMV_MAX_ROWS=16
run off_2 PAXENGINE_KERNEL_FP8_W8A8_GEMV_MAX_ROWS=0
run rule_2 PAXENGINE_KERNEL_FP8_W8A8_GEMV_MAX_ROWS=16
python3 benchmarks/results/gpu_2026-12-05_w8a8_gemv/pick.py $OUT none
for d in $OUT/*/; do rm -rf $d/dummy_model $d/*.png 2>/dev/null; done
tar czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/call1b.tgz
