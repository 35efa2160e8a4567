#!/usr/bin/env bash
# Call 3, same machine: kernel time per engine step by kind (benchmarks.profile.trace: an 8,192-token
# prefill, a 256-row decode at ~1k context, batch 1; FP8 weights + FP8 KV) for the default and
# each of call 1's variants, each in its own process.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PROFILE_QUANT=fp8
for v in default:X=1 rope512:PAXENGINE_KERNEL_FUSED_ROPE_MAX_TOKENS=512 gemm_out_model:PAXENGINE_KERNEL_FP8_GEMM_OUT=model both:PAXENGINE_KERNEL_FUSED_ROPE_MAX_TOKENS=512,PAXENGINE_KERNEL_FP8_GEMM_OUT=model; do
  name=${v%%:*}; envs=${v#*:}
  [ $((580 - SECONDS)) -lt 100 ] && { echo "skip $name"; continue; }
  mkdir -p $OUT/$name
  env ${envs//,/ } OUT=$OUT/$name timeout $((580 - SECONDS)) python3 -m benchmarks.profile.trace llama-3.1-8b > $OUT/$name/trace.log 2>&1
  echo "== $name ($SECONDS s)"; grep -E "^\||step|ms" $OUT/$name/trace.log | grep -v "^I\|^W\|^E" | tail -30
done
tar czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/call3.tgz
