# Call A (carry [".whl"]): Qwen3-30B-A3B at paxengine's defaults (new since 2026-12-07f: 0.92 of
# the card, the MoE layout without an argsort, 64-row tiles from 8 pairs an expert).
set -u
PAXENGINE_COMMIT=${PAXENGINE_COMMIT:?} GPU_BENCH_BUDGET_S=560 bash benchmarks/gpu/gpu_run.sh pax-offline-qwen3moe > $OUT/pax_qwen3moe.log 2>&1
echo "pax rc $?"; grep -i "itl\|tok/s\|startup\|KV cache\|peak\|preempt" $OUT/pax_qwen3moe.log | tail -14
cp /tmp/paxengine_gpu_bench/gpu_bench.json $OUT/gpu_bench.json
