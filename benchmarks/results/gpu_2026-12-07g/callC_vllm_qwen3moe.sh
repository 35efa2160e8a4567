# Call C (carry [".vpq09", ".whl"], after .vpq00 .. .vpq08 each `mkdir -p /tmp/vparts && cp
# .vpqK/* /tmp/vparts/` on the same warm machine): Qwen3-30B-A3B in vLLM 0.26 at its defaults,
# merged beside call A's paxengine stage (/tmp/paxengine_gpu_bench/gpu_bench.json).
set -u
mkdir -p /tmp/vparts && cp .vpq09/* /tmp/vparts/
PAXENGINE_COMMIT=${PAXENGINE_COMMIT:-?} GPU_BENCH_BUDGET_S=545 bash benchmarks/gpu/gpu_run.sh vllm-offline-qwen3moe > $OUT/vllm_qwen3moe.log 2>&1
echo "vllm rc $?"; grep -v "^|" $OUT/gpu_log.txt | grep -v "^\[" | tail -20 | cut -c1-250
grep "^|" $OUT/gpu_log.txt | tail -12 | cut -c1-250
cp /tmp/paxengine_gpu_bench/gpu_bench.json $OUT/gpu_bench.json
