# Next lease, call 1 (carry [".whl"]): Qwen3.5-9B at paxengine's defaults (0.92 of the card; a
# compile that runs out of device memory beside others is built again by itself: how many were).
set -u
PAXENGINE_COMMIT=${PAXENGINE_COMMIT:?} GPU_BENCH_BUDGET_S=300 bash benchmarks/gpu/gpu_run.sh pax-offline-qwen35 > $OUT/pax_qwen35.log 2>&1
echo "pax rc $?"; grep -i "itl\|tok/s\|started\|KV cache\|peak\|temporaries\|slots" $OUT/pax_qwen35.log | cut -c1-220 | tail -14
echo "compiled again by itself: $(grep -c 'again by itself' $OUT/pax_qwen35.log)"
cp /tmp/paxengine_gpu_bench/gpu_bench.json $OUT/gpu_bench.json
