#!/usr/bin/env bash
# Call 3, same machine: served, vLLM FP8
# (FP8 weights + FP8 KV), then paxengine FP8 (64-token pages): random 1024 in / 128 out, c = 1, 16, 64.
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
GPU_BENCH_BUDGET_S=585 bash benchmarks/gpu/gpu_run.sh vllm-serve-fp8,pax-serve-fp8 > /dev/null 2>&1
tail -45 $OUT/gpu_log.txt
cp -r /tmp/paxengine_gpu_bench $OUT/work 2>/dev/null; rm -rf $OUT/work/model* $OUT/work/dummy* 2>/dev/null
tar czf /tmp/call3.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call3.tgz $OUT/
