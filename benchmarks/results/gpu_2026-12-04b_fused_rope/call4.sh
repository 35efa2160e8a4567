#!/usr/bin/env bash
# Call 4, same machine: repeats of calls 1-2's FP8 variants (executables cached: ~50 s a run),
# then bf16 (pax-offline) default and rope512, each run in its own process.
# (Call 3, benchmarks.profile.trace per variant, ran out of GPU memory in the tool's engine: no data.)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
run() {  # stage, name, env...
  local stage=$1 name=$2; shift 2
  mkdir -p $OUT/$name
  left=$((480 - SECONDS))
  [ $left -lt 45 ] && { echo "skip $name ($left s left)"; return; }
  env "$@" OUT=$OUT/$name GPU_BENCH_BUDGET_S=$((left < 150 ? left : 150)) \
    bash benchmarks/gpu/gpu_run.sh $stage > /dev/null 2>&1
  echo "== $name ($SECONDS s)"; grep -E "ITL \(|offline .*tok/s" $OUT/$name/gpu_log.txt | grep -v "^|" | tail -4
}
run pax-offline-fp8 default3 X=1
run pax-offline-fp8 rope512_3 PAXENGINE_KERNEL_FUSED_ROPE_MAX_TOKENS=512
run pax-offline-fp8 both3 PAXENGINE_KERNEL_FUSED_ROPE_MAX_TOKENS=512 PAXENGINE_KERNEL_FP8_GEMM_OUT=model
run pax-offline-fp8 gemm_out_model2 PAXENGINE_KERNEL_FP8_GEMM_OUT=model
run pax-offline bf16_default X=1
run pax-offline bf16_rope512 PAXENGINE_KERNEL_FUSED_ROPE_MAX_TOKENS=512
tar czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/call4.tgz
