# The next lease (carry [".whl"]), in order; the device was short here (see README.md).
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# 1. The kernel's 64-row tiles for large steps (models/moe.tile_rows) against 16-row ones, by
#    the probe (every step size), then the engine's B1/B8 step after a6aef65's fewer XLA ops:
for big in "" 1; do
  PAXENGINE_KERNEL_MOE_BIG_TILE_PAIRS=$big timeout 120 python3 -m benchmarks.gpu.moe_probe \
    --variants pallas --tokens 1 8 64 256 512 2048 8192 --json $OUT/probe_big$big.json | cut -c1-200
done
#    pick the smallest token count from which 64-row tiles win: PAXENGINE_KERNEL_MOE_BIG_TILE_PAIRS
#    = 8 x (the largest count where 16 still wins); if they win, it becomes tile_rows' default.
#    and the kernel's tunings at decode sizes (~3 min; grouped_matmul's defaults by step size):
timeout 300 python3 -m benchmarks.gpu.moe_probe --sweep --tokens 1 8 64 --json $OUT/sweep.json | cut -c1-400
# 2. Same machine, one call each: pax-offline-qwen3moe at the defaults (and with the knob if
#    it won), then vLLM's parts (.vp0 .. .vp7: `mkdir -p /tmp/vparts && cp .vpK/* /tmp/vparts/`),
#    the last with `GPU_BENCH_BUDGET_S=580 bash benchmarks/gpu/gpu_run.sh vllm-offline-qwen3moe`:
#    #55's first same-lease ratio; then pax-offline-qwen3moe-fp8 / vllm-offline-qwen3moe-fp8
#    (FP8 weights + KV: the experts' bytes halve) if the device time lasts.
# 3. Qwen3.5 (#54): gpu_2026-12-07c_qwen35_ratio/next.sh (the 300-row decode step's profile,
#    cuBLAS past 64 tokens vs 512).
