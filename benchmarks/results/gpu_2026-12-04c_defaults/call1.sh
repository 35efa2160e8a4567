#!/usr/bin/env bash
# Call 1 (issues #17, #18): the FP8 engine offline (FP8 weights + FP8 KV), each variant a run in
# its own process, one after the other on one machine: the default (fused RoPE + KV write in
# steps of <= 16 tokens, W8A8 products in f32); "both" (fused RoPE in steps of <= 512 tokens,
# W8A8 products in the model dtype); each of the two alone. PAXENGINE_KERNEL_* switches are
# part of the executables' key: each variant compiles its own.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
STAGE=${STAGE:-pax-offline-fp8} LIMIT=${LIMIT:-575}
run() {  # name, env...
  local name=$1; shift
  mkdir -p $OUT/$name
  left=$((LIMIT - SECONDS))
  [ $left -lt 60 ] && { echo "skip $name ($left s left)"; return; }
  env "$@" OUT=$OUT/$name GPU_BENCH_BUDGET_S=$((left < 150 ? left : 150)) \
    bash benchmarks/gpu/gpu_run.sh $STAGE > /dev/null 2>&1
  echo "== $name ($SECONDS s)"; grep -E "started in|ITL [0-9]|output tok/s|compiles" $OUT/$name/gpu_log.txt | grep -v "^|" | tail -6
}
for v in ${VARIANTS:-default both rope512 gemm_out_model}; do
  case $v in
    default*) run $v X=1 ;;
    both*) run $v PAXENGINE_KERNEL_FUSED_ROPE_MAX_TOKENS=512 PAXENGINE_KERNEL_FP8_GEMM_OUT=model ;;
    rope512*) run $v PAXENGINE_KERNEL_FUSED_ROPE_MAX_TOKENS=512 ;;
    gemm_out_model*) run $v PAXENGINE_KERNEL_FP8_GEMM_OUT=model ;;
    rope16*) run $v PAXENGINE_KERNEL_FUSED_ROPE_MAX_TOKENS=16 PAXENGINE_KERNEL_FP8_GEMM_OUT=f32 ;;
  esac
done
for d in $OUT/*/; do rm -rf $d/dummy_model $d/*.png 2>/dev/null; done
tar czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/${CALL:-call1}.tgz
