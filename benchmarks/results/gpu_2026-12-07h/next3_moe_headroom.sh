# Next lease, call 3 (carry [".whl"]): Qwen3-30B-A3B with the KV plan's margin at 0.5% instead
# of 2% (PAXENGINE_KV_HEADROOM): this lease's peak left 1.9 GB of the 78.2 GB pool unused, and
# vLLM's KV holds 13% more tokens. Against this folder's pax-offline-qwen3moe (same card kind).
set -u
PAXENGINE_KV_HEADROOM=0.005 PAXENGINE_COMMIT=${PAXENGINE_COMMIT:?} GPU_BENCH_BUDGET_S=560 bash benchmarks/gpu/gpu_run.sh pax-offline-qwen3moe > $OUT/pax_qwen3moe_h005.log 2>&1
echo "pax rc $?"; grep -i "itl\|tok/s\|started\|KV cache\|peak\|temporaries" $OUT/pax_qwen3moe_h005.log | cut -c1-220 | tail -14
cp /tmp/paxengine_gpu_bench/gpu_bench.json $OUT/gpu_bench_h005.json
