# Call 1 (carry [".whl"]): the MoE's grouped GEMMs by lowering (which one pax-offline-qwen3moe
# runs first), then where a 256/300-row Qwen3.5-9B decode step goes with cuBLAS's GEMMs past 64
# tokens (default) vs past 512.
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 200 python3 -m benchmarks.gpu.moe_probe --tokens 1 8 64 512 2048 8192 --json $OUT/moe_probe.json > $OUT/moe_probe.log 2>&1
echo "== moe probe rc $?"; grep '"T"' $OUT/moe_probe.log | cut -c1-330
P="python3 -m benchmarks.gpu.step_profile --model dummy:benchmarks/gpu/models/qwen35_9b.json --batch 256 300 --max-seqs 512 --top 30"
for v in 64 512; do
  PAXENGINE_KERNEL_CUBLAS_MAX_TOKENS=$v XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 160 \
    $P --json $OUT/profile_cublas$v.json > $OUT/profile_cublas$v.log 2>&1
  echo "== $v rc $?"; cut -c1-400 $OUT/profile_cublas$v.log | tail -4
done
