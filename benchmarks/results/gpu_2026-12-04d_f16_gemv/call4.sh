#!/usr/bin/env bash
# Call 4 (issue #17): the new FP8 defaults (the GLU kernel's fast silu, the add + norm kernel in
# every W8A8 step, 2-warp decode attention from 2,400 programs) against the old ones by their
# env switches, each its own process, one lease: 300 x (1000, 1000), 256 x (1024, 128), batch-1 ITL.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PAXENGINE_COMMIT=${PAXENGINE_COMMIT:-?}
LIMIT=${LIMIT:-330}
run() {  # stage, name, env...
  local stage=$1 name=$2; shift 2
  mkdir -p $OUT/$name
  left=$((LIMIT - SECONDS))
  [ $left -lt 90 ] && { echo "skip $name ($left s left)"; return; }
  env "$@" OUT=$OUT/$name GPU_BENCH_BUDGET_S=$((left < 160 ? left : 160)) GPU_BENCH_ITL_BATCHES=1 \
    bash benchmarks/gpu/gpu_run.sh $stage > /dev/null 2>&1
  echo "== $name ($SECONDS s)"; grep -E "started in|ITL [0-9]|output tok/s|Error|error" $OUT/$name/gpu_log.txt | grep -v "^|" | tail -4
}
run pax-offline-fp8 fp8_new X=1
run pax-offline-fp8 fp8_old PAXENGINE_KERNEL_FP8_GLU_FAST=0 PAXENGINE_KERNEL_ADD_NORM_W8A8=0 PAXENGINE_KERNEL_ATTN_DECODE_TUNING=num_warps=4
for d in $OUT/*/; do rm -rf $d/dummy_model $d/*.png 2>/dev/null; done
tar czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/call4.tgz
