#!/usr/bin/env bash
# Call 2 (issues #17, #18): the fused add + RMSNorm (+ FP8 rows) kernel. First the kernel alone
# against XLA's fusions of its oracle (benchmarks.kernels.add_norm: checked, then timed), then the
# engine offline, each variant a run in its own process: FP8 (weights + KV) with the kernel (the
# new default; W8A8 products in bf16, call 1's gemm_out_model) and without it
# (PAXENGINE_KERNEL_ADD_NORM=0), then bf16 with and without it.
# (PAXENGINE_KERNEL_ADD_NORM=0 was that tree's off switch; today PAXENGINE_KERNEL_ADD_NORM_MAX_ROWS=0.)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
python3 -m benchmarks.kernels.add_norm --out $OUT 2>&1 | grep -v "^[IWE][0-9]" | tee $OUT/add_norm.log
LIMIT=${LIMIT:-575}
run() {  # stage, name, env...
  local stage=$1 name=$2; shift 2
  mkdir -p $OUT/$name
  left=$((LIMIT - SECONDS))
  [ $left -lt 60 ] && { echo "skip $name ($left s left)"; return; }
  env "$@" OUT=$OUT/$name GPU_BENCH_BUDGET_S=$((left < 140 ? left : 140)) \
    bash benchmarks/gpu/gpu_run.sh $stage > /dev/null 2>&1
  echo "== $name ($SECONDS s)"; grep -E "started in|ITL [0-9]|output tok/s|Error|error" $OUT/$name/gpu_log.txt | grep -v "^|" | tail -6
}
run pax-offline-fp8 fp8_addnorm X=1
run pax-offline-fp8 fp8_no_addnorm PAXENGINE_KERNEL_ADD_NORM=0
run pax-offline bf16_addnorm X=1
run pax-offline bf16_no_addnorm PAXENGINE_KERNEL_ADD_NORM=0
for d in $OUT/*/; do rm -rf $d/dummy_model $d/*.png 2>/dev/null; done
tar czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/call2.tgz
