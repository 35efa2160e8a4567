# call 4 (a later lease, no vLLM and no engine run: the device budget went on refused starts):
# the skinny GEMM alone (its tuning sweep) and in the step, on and off (step_profile: narrowed
# buckets, command buffers off, not the benchmark)
timeout 45 python3 -m benchmarks.gpu.gemm_probe --shapes out --m 1 8 --skinny --json $OUT/skinny_probe.json > $OUT/skinny_probe.log 2>&1
echo "== probe rc $?"; cut -c1-200 $OUT/skinny_probe.log | grep '"us"'
P="python3 -m benchmarks.gpu.step_profile --model dummy:benchmarks/gpu/models/qwen35_9b.json --batch 1 8 --top 12"
for v in skinny off; do  # (the default is off: "skinny" sets auto)
  PAXENGINE_KERNEL_SKINNY=${v/skinny/auto} XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 110 $P --json $OUT/profile_$v.json > $OUT/profile_$v.log 2>&1
  echo "== profile $v rc $?"; grep '"itl_ms"' $OUT/profile_$v.log; tail -2 $OUT/profile_$v.log | cut -c1-300
done
