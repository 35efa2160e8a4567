#!/usr/bin/env bash
# Call 2, same machine (after 9 calls that carried vLLM 0.26's parts into /tmp/vparts): vLLM FP8
# offline (FP8 weights + FP8 KV), then paxengine's FP8 default again beside it.
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
GPU_BENCH_BUDGET_S=585 bash benchmarks/gpu/gpu_run.sh vllm-offline-fp8,pax-offline-fp8 > /dev/null 2>&1
tail -45 $OUT/gpu_log.txt
cp -r /tmp/paxengine_gpu_bench $OUT/work 2>/dev/null; rm -rf $OUT/work/model* $OUT/work/dummy* 2>/dev/null
tar czf /tmp/call2.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call2.tgz $OUT/
