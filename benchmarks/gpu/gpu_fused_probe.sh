#!/bin/bash
# The batch-1 step with the fused decode kernels (68fad99: RoPE + KV write in one kernel, the
# FP8 GEMV forming silu(gate) * up) on the lent H200, in one call (~4 min):
#  1. the compiled kernels against their oracles (benchmarks.kernels.fused_decode_check);
#  2. the batch-1 ITL and kernels per step (benchmarks.profile.batch1), FP8 and bf16, each
#     with the fusions and without them (PAXENGINE_KERNEL_* switches), in separate processes.
#   run: carry [".whl"], bash benchmarks/gpu/gpu_fused_probe.sh       (results in $OUT)
set -o pipefail
cd "$(dirname "$0")/../.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fused_probe}
mkdir -p "$OUT"
python3 -m benchmarks.kernels.fused_decode_check --out "$OUT" 2>&1 | grep -v "Delay kernel"
OFF="PAXENGINE_KERNEL_FUSED_ROPE_MAX_TOKENS=0 PAXENGINE_KERNEL_FP8_GLU=0"
for quant in fp8 ""; do
  for fused in on off; do
    tag="${quant:-bf16}_fused_${fused}"
    env $([ $fused = off ] && echo "$OFF") PROFILE_TAG=$tag PROFILE_QUANT=$quant \
      timeout 120 python3 -m benchmarks.profile.batch1 2>&1 | grep -v "Delay kernel" | tail -14
  done
done
rm -f "$OUT"/b1_forward_*_fused_off.hlo.txt  # the fused ones' HLO is kept
