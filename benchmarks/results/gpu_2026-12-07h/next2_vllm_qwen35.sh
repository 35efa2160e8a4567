# Next lease, call 2 (carry [".vpq09", ".whl"], after .vpq00 .. .vpq08 each `mkdir -p
# /tmp/vparts && cp .vpqK/* /tmp/vparts/` on the same warm machine): Qwen3.5-9B in vLLM 0.26 at
# its defaults, merged beside call 1 (its stage took 288-335 s; 356 s ran out in 2026-12-07h).
set -u
mkdir -p /tmp/vparts && cp .vpq09/* /tmp/vparts/
PAXENGINE_COMMIT=${PAXENGINE_COMMIT:-?} GPU_BENCH_BUDGET_S=520 bash benchmarks/gpu/gpu_run.sh vllm-offline-qwen35 > $OUT/vllm_qwen35.log 2>&1
echo "vllm rc $?"; grep "^|" $OUT/vllm_qwen35.log | grep -i "qwen3.5" | cut -c1-200
cp /tmp/paxengine_gpu_bench/gpu_bench.json $OUT/gpu_bench.json
