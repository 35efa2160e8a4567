#!/usr/bin/env bash
# Call 3 (issue #17; call 2's engine runs measured nothing: the workload filter split the names
# at their commas). The engine, FP8 weights + KV, 300 x (1000, 1000) and 256 x (1024, 128), no ITL,
# each variant its own process: default / the GLU kernel's fast silu / the add + norm kernel in
# every step / 2 warps a program in the decode buckets' attention.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PAXENGINE_COMMIT=${PAXENGINE_COMMIT:-?}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
LIMIT=${LIMIT:-585}
run() {  # stage, name, env...
  local stage=$1 name=$2; shift 2
  mkdir -p $OUT/$name
  left=$((LIMIT - SECONDS))
  [ $left -lt 90 ] && { echo "skip $name ($left s left)"; return; }
  env "$@" OUT=$OUT/$name GPU_BENCH_BUDGET_S=$((left < 150 ? left : 150)) GPU_BENCH_ITL_BATCHES= \
    bash benchmarks/gpu/gpu_run.sh $stage > /dev/null 2>&1
  echo "== $name ($SECONDS s)"; grep -E "started in|ITL [0-9]|output tok/s|Error|error" $OUT/$name/gpu_log.txt | grep -v "^|" | tail -4
}
run pax-offline-fp8 fp8_default X=1
run pax-offline-fp8 fp8_glu_fast PAXENGINE_KERNEL_FP8_GLU_FAST=1
run pax-offline-fp8 fp8_addnorm_all PAXENGINE_KERNEL_ADD_NORM_MAX_ROWS=65536
run pax-offline-fp8 fp8_attn_2warps PAXENGINE_KERNEL_ATTN_DECODE_TUNING=num_warps=2
for d in $OUT/*/; do rm -rf $d/dummy_model $d/*.png 2>/dev/null; done
tar czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/call3.tgz
