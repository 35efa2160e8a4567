#!/usr/bin/env bash
# Call 1 (issue #17): fp8 KV with 64-token pages and V stored [D, 64] (the new default) against
# 16-token pages, in one lease: the decode kernel alone (page_blocks), then the engine offline
# (FP8 weights + FP8 KV; the default block size, then --block-size 16).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
timeout 170 python3 -m benchmarks.kernels.page_blocks --kv-dtype fp8,bf16 --page-sizes 16,64 \
  --only decode_b256_ctx1024,decode_b300_ctx1536,decode_b64_ctx2048,decode_b8_ctx8192,decode_b1_ctx8192,mixed_60dec2048_448pf,prefill_2048 \
  --rounds 3 --out $OUT > $OUT/page_blocks.log 2>&1
grep "^|" $OUT/page_blocks.log
GPU_BENCH_BUDGET_S=$((585 - SECONDS)) bash benchmarks/gpu/gpu_run.sh pax-offline-fp8,pax-offline-fp8bs16 > /dev/null 2>&1
tail -45 $OUT/gpu_log.txt
cp -r /tmp/paxengine_gpu_bench $OUT/work 2>/dev/null; rm -rf $OUT/work/model* $OUT/work/dummy* 2>/dev/null
tar czf /tmp/call1.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call1.tgz $OUT/
