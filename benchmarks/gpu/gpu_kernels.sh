#!/bin/bash
# Kernel benchmark on the lent H200 (jax 0.11.2 there): correctness vs the oracle, sweep, timings.
#   run: bash benchmarks/gpu/gpu_kernels.sh [extra args for benchmarks.kernels.attention]
set -o pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kernels_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -m benchmarks.kernels.attention --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
