# Call D (carry [".vpq09", ".whl"], after .vpq00 .. .vpq08 each `mkdir -p /tmp/vparts && cp
# .vpqK/* /tmp/vparts/` on the same warm machine): the Qwen3.5-9B pair, paxengine then vLLM
# 0.26, both at their defaults, merged into one JSON.
set -u
mkdir -p /tmp/vparts && cp .vpq09/* /tmp/vparts/
PAXENGINE_COMMIT=${PAXENGINE_COMMIT:?} GPU_BENCH_BUDGET_S=220 bash benchmarks/gpu/gpu_run.sh pax-offline-qwen35 > $OUT/pax_qwen35.log 2>&1
echo "pax rc $?"; grep -i "itl\|tok/s\|startup\|KV cache\|peak" $OUT/pax_qwen35.log | tail -12
GPU_BENCH_BUDGET_S=370 bash benchmarks/gpu/gpu_run.sh vllm-offline-qwen35 > $OUT/vllm_qwen35.log 2>&1
echo "vllm rc $?"; grep -i "itl\|tok/s\|startup" $OUT/vllm_qwen35.log | tail -8
cp /tmp/paxengine_gpu_bench/gpu_bench.json $OUT/gpu_bench.json
