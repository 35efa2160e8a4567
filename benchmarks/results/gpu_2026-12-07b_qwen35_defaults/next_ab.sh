# The next lease's first two calls (one warm machine; carry [".whl"]): the fused DeltaNet kernel
# for every decode bucket (T <= S) against the default (the chunked kernel past 64 tokens), at
# paxengine's defaults on the offline workloads. Call A (cold: compiles and fills the store):
PAXENGINE_COMMIT=<hash> PAXENGINE_KERNEL_GDN_FUSED_DECODE=1 GPU_BENCH_BUDGET_S=420 \
  OUT=$OUT/fused bash benchmarks/gpu/gpu_run.sh pax-offline-qwen35
# Call B, the same machine (the default's executables differ: they compile too):
PAXENGINE_COMMIT=<hash> GPU_BENCH_BUDGET_S=420 OUT=$OUT/default \
  bash benchmarks/gpu/gpu_run.sh pax-offline-qwen35
# Then the 9 vLLM parts and `bash benchmarks/gpu/gpu_run.sh vllm-offline-qwen35,vllm-serve-qwen35`
# (the same lease: the first ratio); if call A won, its setting becomes the default first.
