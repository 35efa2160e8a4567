# The next lease, in order (one machine, back to back: it goes back after 30 s idle; carry
# [".whl"] unless said). New since this lease's runs, all unmeasured on a GPU: gpu_memory_
# utilization 0.92 (130d2cd), the DeltaNet conv windows by kernels_pallas/slot_rows.copy_rows
# (0f0b4c3), the MoE layout without an argsort (e1a35ee), 64-row MoE tiles from 8 pairs an
# expert (e2e480b). ~1,620 s with a ~90 s start.
# 1. (~150 s) bash benchmarks/results/gpu_2026-12-07f/call5_tile_rows.sh: 16 / 32 / 64 / 128-row
#    tiles at 64 .. 8,192 tokens; if 16 beats 64 at 256 tokens, PAXENGINE_KERNEL_MOE_BIG_TILE_PAIRS
#    =2048 in step 3 (the old rule) and revert e2e480b; if 128 wins at 2,048+ tokens, a third size.
# 2. (~220 s) PAXENGINE_COMMIT=<hash> GPU_BENCH_BUDGET_S=400 bash benchmarks/gpu/gpu_run.sh pax-offline-qwen35
# 3. (~390 s) PAXENGINE_COMMIT=<hash> GPU_BENCH_BUDGET_S=585 bash benchmarks/gpu/gpu_run.sh pax-offline-qwen3moe
#    (this lease: B1 / B8 4.11 / 12.21 ms, 1,844 / 1,565 tok/s, KV 87,376 tokens)
# 4. vLLM's parts: for K in 00 .. 09: carry [".vpqK"], `mkdir -p /tmp/vparts && cp .vpqK/* /tmp/vparts/`
#    (40 MiB parts; the tracked tree is ~20 MiB: a part plus it must stay under 64 MiB)
# 5. (~320 s) cp-free: GPU_BENCH_BUDGET_S=400 bash benchmarks/gpu/gpu_run.sh vllm-offline-qwen35
#    (its Qwen3.5 spec carries additional_config gdn_prefill_backend=triton, language_model_only)
# 6. (~390 s) GPU_BENCH_BUDGET_S=545 bash benchmarks/gpu/gpu_run.sh vllm-offline-qwen3moe
# Steps 5 and 6 merge into /tmp/paxengine_gpu_bench/gpu_bench.json beside steps 2 and 3: copy it
# to $OUT at the end of step 6. Then (another lease): pax-serve-qwen3moe (never run on a GPU),
# the FP8 pairs, and the DeltaNet decode kernel's tuning at 256+ sequences (1.85 TB/s of its
# states in call 1 here: `python -m kernels_pallas.gated_delta_bench --sweep`).
