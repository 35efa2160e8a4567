#!/usr/bin/env bash
# Call 5 (a fresh machine, after the split-K change): the engine offline, FP8 weights + FP8 KV,
# the default (64-token pages) then --block-size 16, in one lease.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
GPU_BENCH_BUDGET_S=$((400 - SECONDS)) bash benchmarks/gpu/gpu_run.sh pax-offline-fp8,pax-offline-fp8bs16 > /dev/null 2>&1
tail -45 $OUT/gpu_log.txt
cp -r /tmp/paxengine_gpu_bench $OUT/work 2>/dev/null; rm -rf $OUT/work/model* $OUT/work/dummy* 2>/dev/null
tar czf /tmp/call5.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call5.tgz $OUT/
