#!/usr/bin/env bash
# The operations run on the H200 (issues #21, #22; benchmarks/gpu/ops.py), over two device calls
# on one warm machine (the soak lasts ten minutes, a call at most ten):
#   call 1, carry [".whl"]:  bash benchmarks/gpu/gpu_ops.sh start
#   call 2, at once after:   bash benchmarks/gpu/gpu_ops.sh finish
# or the structured-output runs alone, in one call: bash benchmarks/gpu/gpu_ops.sh structured
# CPU smoke run here: PATH=.venv/bin:$PATH OUT=/tmp/ops bash benchmarks/gpu/gpu_ops.sh start --quick
set -uo pipefail
hold=$(( $(date +%s) + ${OPS_CALL_S:-545} ))  # `start` returns at this time (the soak runs on)
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ops_out}
mkdir -p "$OUT"
if [[ "$1" != finish ]] && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "wheel install failed"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>&1 | tee -a "$OUT/ops_log.txt"
extra=(); [[ "$1" == start ]] && extra=(--hold-until "$hold")
python3 -m benchmarks.gpu.ops "$@" "${extra[@]}" --out "$OUT" 2>&1 | tee -a "$OUT/ops_log.txt"
