#!/usr/bin/env bash
# Call 1 (issues #17, #18): the FP8 engine offline (FP8 weights + FP8 KV), one variant a run in
# its own process, side by side on one machine: the default; the fused RoPE + KV-write kernel
# in every step of <= 512 tokens (decode buckets) and of every size; the W8A8 GEMMs' product in
# the model dtype (PAXENGINE_KERNEL_* switches are part of the executables' key: each compiles).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
run() {  # name, env...
  local name=$1; shift
  mkdir -p $OUT/$name
  left=$((590 - SECONDS))
  [ $left -lt 80 ] && { echo "skip $name ($left s left)"; return; }
  env "$@" OUT=$OUT/$name GPU_BENCH_BUDGET_S=$((left < 150 ? left : 150)) \
    bash benchmarks/gpu/gpu_run.sh pax-offline-fp8 > /dev/null 2>&1
  echo "== $name ($SECONDS s)"; grep -E "ITL|tok/s|compiles" $OUT/$name/gpu_log.txt | tail -8
}
run default X=1
run rope512 PAXENGINE_KERNEL_FUSED_ROPE_MAX_TOKENS=512
run gemm_out_model PAXENGINE_KERNEL_FP8_GEMM_OUT=model
run rope8192 PAXENGINE_KERNEL_FUSED_ROPE_MAX_TOKENS=8192
tar czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/call1.tgz
