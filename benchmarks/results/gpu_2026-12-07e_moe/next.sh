# The next lease, in order (carry [".whl"]; one machine, back to back: it goes back after 30 s idle).
# 1. pax-offline-qwen3moe at the defaults (row_dot and the QK-normed fused RoPE + KV write are
#    new since call B here; neither has run through the engine):
#      PAXENGINE_COMMIT=<hash> GPU_BENCH_BUDGET_S=585 bash benchmarks/gpu/gpu_run.sh pax-offline-qwen3moe
# 2. vLLM's parts .vp0 .. .vp6 (carry [".vpK"], `mkdir -p /tmp/vparts && cp .vpK/* /tmp/vparts/`),
#    then callC_vllm.sh (carry [".vp7", ".whl"]): #55's first same-lease ratio.
# 3. If the device time lasts: callP_profile.sh again (what is left of the B1 / B8 glue: batch 8's
#    sort, gathers, scatter-add and tile layout ~1.4 ms; the kernel at ~2.7 TB/s), then the FP8
#    pair (pax-offline-qwen3moe-fp8 / vllm-offline-qwen3moe-fp8) and pax-serve-qwen3moe (the
#    server with its background compiles has not run the MoE on a GPU).
# 4. Qwen3.5 (#54): gpu_2026-12-07c_qwen35_ratio/next.sh; row_dot is not applied to Qwen3.5's or
#    Llama's one-row dots: profile their batch-1 step for `loop_multiply_fusion` first.
