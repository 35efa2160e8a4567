#!/usr/bin/env bash
# Call 2 (issue #17), the same machine right after call 1: vLLM 0.26 FP8 (weights + KV) and
# paxengine FP8 with call 1's winning W8A8 GEMV variant (/tmp/pax_fp8_env), offline (STAGES), served too where the device time allows.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PAXENGINE_COMMIT=${PAXENGINE_COMMIT:-?}
PAX_ENV=$(grep -v '^#' /tmp/pax_fp8_env 2>/dev/null || echo PAXENGINE_KERNEL_FP8_W8A8_GEMV_MAX_ROWS=0)
echo "paxengine env: $PAX_ENV"; ls -d /tmp/vsite
# shellcheck disable=SC2086
env $PAX_ENV GPU_BENCH_BUDGET_S=${BUDGET:-420} \
  bash benchmarks/gpu/gpu_run.sh ${STAGES:-vllm-offline-fp8,pax-offline-fp8} > /dev/null 2>&1
grep -E "started in|ITL [0-9]|output tok/s|stage|Error" $OUT/gpu_log.txt | grep -v "^|" | tail -24
grep "^| FP8" $OUT/gpu_log.txt
rm -rf $OUT/dummy_model $OUT/*.png
tar czf /tmp/call.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/call2.tgz
