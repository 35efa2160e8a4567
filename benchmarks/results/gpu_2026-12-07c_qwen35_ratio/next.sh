# The next lease's first call (carry [".whl"]; the device budget ran out before it here): where
# a 256-sequence decode step of the 9B goes with the fused DeltaNet kernel (the new default), and
# cuBLAS's GEMMs for the steps past 64 tokens against XLA's autotuned Triton ones (qwen3_5.
# CUBLAS_MAX_TOKENS; step_profile: narrowed buckets, command buffers off, not the benchmark).
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
# --batch 300 --max-seqs 512: the offline row's decode (300 rows in a 512-row sequence bucket: the
# lm_head and the sampler over 512 rows of a 248,320-token vocabulary)
P="python3 -m benchmarks.gpu.step_profile --model dummy:benchmarks/gpu/models/qwen35_9b.json --batch 256 300 --max-seqs 512 --top 30"
for v in 64 512; do
  PAXENGINE_KERNEL_CUBLAS_MAX_TOKENS=$v XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 140 \
    $P --json $OUT/profile_cublas$v.json > $OUT/profile_cublas$v.log 2>&1
  echo "== $v rc $?"; grep '"itl_ms"\|startup' $OUT/profile_cublas$v.log | cut -c1-200
done
# If 512 wins: PAXENGINE_KERNEL_CUBLAS_MAX_TOKENS=512 vs unset on pax-offline-qwen35 (one call,
# as call 1 here), then vLLM's parts and the ratio again. The server's "every step executable
# built" time with compiles sharing their turn (289 s with one at a time): pax-serve-qwen35.

# In the same call, the MoE's grouped GEMMs by lowering (#55; XLA's default may expand a ragged
# dot into dense dots over all 128 experts: every step would read all 58 GB of them):
timeout 150 python3 -m benchmarks.gpu.moe_probe --json $OUT/moe_probe.json > $OUT/moe_probe.log 2>&1
echo "== moe probe rc $?"; cut -c1-260 $OUT/moe_probe.log | grep '"T"'
# Then the MoE engine (#55): pax-offline-qwen3moe has never run on a GPU; the probe says which
# PAXENGINE_KERNEL_MOE (or PAXENGINE_XLA_OPTIONS) to run first. One call each (the 30B's
# 61 GB of dummy weights and its compile), the same warm machine:
#   PAXENGINE_COMMIT=<hash> GPU_BENCH_BUDGET_S=560 OUT=$OUT/xla bash benchmarks/gpu/gpu_run.sh pax-offline-qwen3moe
#   PAXENGINE_COMMIT=<hash> PAXENGINE_KERNEL_MOE=pallas GPU_BENCH_BUDGET_S=560 OUT=$OUT/pallas \
#     bash benchmarks/gpu/gpu_run.sh pax-offline-qwen3moe   (only the experts a step hits are read)
# and vLLM's parts, the last with `bash benchmarks/gpu/gpu_run.sh vllm-offline-qwen3moe`.
