# call 4 (a later lease, no vLLM: the device budget was spent on refused starts): the skinny GEMM
# in the step (profile, narrowed buckets, not the benchmark), paxengine at its defaults, then
# the kernel's tuning sweep and the profile without it, as far as the call's time goes
P="python3 -m benchmarks.gpu.step_profile --model dummy:benchmarks/gpu/models/qwen35_9b.json --batch 1 8 --top 12"
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 110 $P --json $OUT/profile_skinny.json > $OUT/profile_skinny.log 2>&1
rc=$?; echo "== profile skinny rc $rc"; grep '"itl_ms"' $OUT/profile_skinny.log
if [ $rc != 0 ]; then export PAXENGINE_KERNEL_SKINNY=off; tail -5 $OUT/profile_skinny.log; fi
GPU_BENCH_BUDGET_S=280 bash benchmarks/gpu/gpu_run.sh pax-offline-qwen35 > $OUT/pax_stage.log 2>&1
echo "== pax stage rc $?"; grep "gpu_bench\|Failed\|Qwen3.5" $OUT/pax_stage.log | grep -v "compiling" | tail -14
timeout 40 python3 -m benchmarks.gpu.gemm_probe --shapes out --m 1 8 --skinny --json $OUT/skinny_probe.json > $OUT/skinny_probe.log 2>&1
echo "== probe rc $?"; cut -c1-200 $OUT/skinny_probe.log | grep '"us"'
PAXENGINE_KERNEL_SKINNY=off XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 85 $P --json $OUT/profile_off.json > $OUT/profile_off.log 2>&1
echo "== profile off rc $?"; grep '"itl_ms"' $OUT/profile_off.log
