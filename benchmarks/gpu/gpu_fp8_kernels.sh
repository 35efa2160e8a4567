#!/bin/bash
# FP8 matmuls on the lent H200: the Pallas GEMV's tuning sweep against its oracle, then every
# path an Fp8Weight can take per token bucket (benchmarks/kernels/fp8_paths.py).
#   run: bash benchmarks/gpu/gpu_fp8_kernels.sh        (results in $OUT)
set -o pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fp8_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/nvidia-smi.txt"
timeout 300 python3 -m benchmarks.kernels.fp8_matmul --out "$OUT" 2>&1 | tee "$OUT/fp8_matmul_log.txt"
timeout 240 python3 -m benchmarks.kernels.fp8_paths --out "$OUT" 2>&1 | tee "$OUT/fp8_paths_log.txt"
