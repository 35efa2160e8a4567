#!/usr/bin/env bash
# lease 2026-12-03e call 10 (after 8 calls that carried vLLM's parts, `cp .vpK/* /tmp/vparts/`):
# vLLM 0.26 served, random 1024/128 at c = 1 / 16 / 64, then Poisson 4 / 8 / 16 req/s
set -u
mkdir -p $OUT/v
PAXENGINE_COMMIT=${PAXENGINE_COMMIT:-} OUT=/tmp/vres GPU_BENCH_BUDGET_S=565 bash benchmarks/gpu/gpu_run.sh vllm-serve,vllm-poisson > $OUT/v/console.txt 2>&1
cp /tmp/vres/gpu_bench.json /tmp/vres/gpu_log.txt $OUT/v/ 2>/dev/null
tar czf $OUT/vllm_results.tgz -C /tmp vres
grep -h "tok/s\|ready" $OUT/v/console.txt | tail -20
