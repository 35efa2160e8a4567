# Call C (carry [".vpq09", ".whl"], after .vpq00 .. .vpq08 (40 MiB parts: the tracked tree is 19.6 MiB now) each `mkdir -p /tmp/vparts && cp .vpK/* /tmp/vparts/`
# on the same warm machine): vLLM 0.26 on the same Qwen3-30B-A3B shapes, merged into call B's
# gpu_bench.json (/tmp/paxengine_gpu_bench).
mkdir -p /tmp/vparts && cp .vpq09/* /tmp/vparts/
PAXENGINE_COMMIT=${PAXENGINE_COMMIT:-?} GPU_BENCH_BUDGET_S=545 \
  bash benchmarks/gpu/gpu_run.sh vllm-offline-qwen3moe > /dev/null 2>&1
grep -v "^|" $OUT/gpu_log.txt | grep -v "^\[" | tail -30 | cut -c1-250
grep "^|" $OUT/gpu_log.txt | tail -12 | cut -c1-250
