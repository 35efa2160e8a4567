#!/usr/bin/env bash
# Call 1 (issue #17): the W8A8 GEMV's tuning sweep at M = 1 and 16 (the engine's 1- and 16-row
# token buckets), then batch-1 / batch-8 ITL of the FP8 engine with the W8A8 GEMV off (today's
# default), on with its rule, and on with the sweep's best tunings (PAXENGINE_KERNEL_FP8_X8_TUNING),
# each variant its own process, one machine. Also: vLLM's last part and its install, for call 2;
# pick.py writes the winning variant's env to /tmp/pax_fp8_env for call 2.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PAXENGINE_COMMIT=${PAXENGINE_COMMIT:-?}
mkdir -p /tmp/vparts && cp .vp8/* /tmp/vparts/ && ls /tmp/vparts | tr '\n' ' '; echo
bash benchmarks/gpu/gpu_vllm_install.sh > /tmp/vinstall.log 2>&1 &  # for call 2, beside the sweep
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
mkdir -p $OUT/sweep
timeout 200 python3 -m benchmarks.kernels.fp8_matmul --x8 --only-m 1,16 --budget ${SWEEP_BUDGET:-100} --out $OUT/sweep \
  > $OUT/sweep/log.txt 2>&1
wait; echo "== sweep + vLLM install ($SECONDS s): $(tail -1 /tmp/vinstall.log)"; grep -iE "best|error" $OUT/sweep/log.txt | tail -12
TUNED=/tmp/x8_sweep.json
cp $OUT/sweep/fp8_matmul.json $TUNED 2>/dev/null
LIMIT=${LIMIT:-565}
run() {  # name, env...
  local name=$1; shift
  mkdir -p $OUT/$name
  left=$((LIMIT - SECONDS))
  [ $left -lt 60 ] && { echo "skip $name ($left s left)"; return; }
  env "$@" OUT=$OUT/$name GPU_BENCH_BUDGET_S=$((left < 150 ? left : 150)) GPU_BENCH_ITL_BATCHES=1,8 \
    GPU_BENCH_OFFLINE="" bash benchmarks/gpu/gpu_run.sh pax-offline-fp8 > /dev/null 2>&1
  echo "== $name ($SECONDS s)"; grep -E "started in|ITL [0-9]|Error|error" $OUT/$name/gpu_log.txt | grep -v "^|" | tail -4
}
run off PAXENGINE_KERNEL_FP8_W8A8_GEMV_MAX_ROWS=0
[ -f $TUNED ] && run tuned PAXENGINE_KERNEL_FP8_W8A8_GEMV_MAX_ROWS=16 PAXENGINE_KERNEL_FP8_X8_TUNING=$TUNED
run off_2 PAXENGINE_KERNEL_FP8_W8A8_GEMV_MAX_ROWS=0
[ -f $TUNED ] && run tuned_2 PAXENGINE_KERNEL_FP8_W8A8_GEMV_MAX_ROWS=16 PAXENGINE_KERNEL_FP8_X8_TUNING=$TUNED
run rule PAXENGINE_KERNEL_FP8_W8A8_GEMV_MAX_ROWS=16
python3 benchmarks/results/gpu_2026-12-05_w8a8_gemv/pick.py $OUT $TUNED | tee /tmp/pax_fp8_env
ls -d /tmp/vsite
for d in $OUT/*/; do rm -rf $d/dummy_model $d/*.png 2>/dev/null; done
tar czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/call1.tgz
