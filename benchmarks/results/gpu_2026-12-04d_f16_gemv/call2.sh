#!/usr/bin/env bash
# Call 2 (issue #17): (1) glu_quant with the silu's sigmoid from approximate ex2 / rcp ("fast")
# against IEEE expf / division, over block shapes, each checked against the oracle, at 2,048 and
# 8,192 rows (the prefill steps; ~325 us a layer at 8,192 where a read of the product takes ~140);
# (2) decode attention over fp8 64-token pages, 2 warps with 2 / 3 / 4 stages (call 1: 2 warps
# -5% at B=300); (3) the engine, FP8 weights + KV, 256 x (1024, 128) only (the prefill-bound
# row), each variant its own process: default / fast GLU / the add + norm kernel in every step /
# both.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
python3 -m benchmarks.kernels.fp8_mlp --glu-only --ms 8192,2048 2>&1 | grep -v "^[IWE][0-9]" > $OUT/glu_sweep.log
grep "'us'" $OUT/glu_sweep.log | sort -t: -k1,1 | head -100
python3 -m benchmarks.kernels.page_blocks --kv-dtype fp8 --page-sizes 64 \
  --only decode_b300_ctx1536,decode_b256_ctx1024,decode_b64_ctx2048 --rounds 3 \
  --variants default,2warps,2warps_2stages,2warps_3stages \
  --out $OUT 2>&1 | grep -v "^[IWE][0-9]" > $OUT/page_blocks.log
grep "^|" $OUT/page_blocks.log
LIMIT=${LIMIT:-580}
run() {  # stage, name, env...
  local stage=$1 name=$2; shift 2
  mkdir -p $OUT/$name
  left=$((LIMIT - SECONDS))
  [ $left -lt 75 ] && { echo "skip $name ($left s left)"; return; }
  env "$@" OUT=$OUT/$name GPU_BENCH_BUDGET_S=$((left < 140 ? left : 140)) GPU_BENCH_ITL_BATCHES= \
    GPU_BENCH_OFFLINE="256x(1024,128)" bash benchmarks/gpu/gpu_run.sh $stage > /dev/null 2>&1
  echo "== $name ($SECONDS s)"; grep -E "started in|ITL [0-9]|output tok/s|Error|error" $OUT/$name/gpu_log.txt | grep -v "^|" | tail -4
}
run pax-offline-fp8 fp8_default X=1
run pax-offline-fp8 fp8_glu_fast PAXENGINE_KERNEL_FP8_GLU_FAST=1
run pax-offline-fp8 fp8_addnorm_all PAXENGINE_KERNEL_ADD_NORM_MAX_ROWS=65536
run pax-offline-fp8 fp8_both PAXENGINE_KERNEL_FP8_GLU_FAST=1 PAXENGINE_KERNEL_ADD_NORM_MAX_ROWS=65536
for d in $OUT/*/; do rm -rf $d/dummy_model $d/*.png 2>/dev/null; done
tar czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/call2.tgz
