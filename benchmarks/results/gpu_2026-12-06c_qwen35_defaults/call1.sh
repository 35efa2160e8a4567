# call 1: the lone GEMMs (split-K, the LM head's output dtype) and the step profile A/B
# (python3 -m benchmarks.gpu.step_profile: narrowed buckets, command buffers off, not the benchmark)
python3 -m benchmarks.gpu.gemm_probe --shapes out down lm_head --m 1 8 --splits 2 4 8 \
  --json $OUT/gemm_probe.json > $OUT/gemm_probe.log 2>&1
tail -3 $OUT/gemm_probe.log
for v in split4 split1 logits_bf16 nofused; do
  case $v in
    split4) E="PAXENGINE_X=1" ;;
    split1) E="PAXENGINE_KERNEL_SPLIT_K=1" ;;
    logits_bf16) E="PAXENGINE_KERNEL_LOGITS_IN_DTYPE=1" ;;
    nofused) E="PAXENGINE_KERNEL_GDN_FUSED_MAX_TOKENS=0" ;;
  esac
  env $E XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 170 python3 -m benchmarks.gpu.step_profile \
    --model dummy:benchmarks/gpu/models/qwen35_9b.json --batch 1 8 --top 12 \
    --json $OUT/profile_$v.json > $OUT/profile_$v.log 2>&1
  echo "== $v rc $?"; grep -i "itl\|gemm" $OUT/profile_$v.log | tail -4
done
grep -h '"us"' $OUT/gemm_probe.log | cut -c1-160
