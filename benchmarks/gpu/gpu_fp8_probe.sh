#!/bin/bash
# Issue #17's open questions on the lent H200, in one call (~4 min), after the first FP8 lease
# (benchmarks/results/gpu_2026-12-01_fp8_engine/README.md):
#  1. batch-1 FP8 decode: the step's kernels take 3.4 ms but the ITL is 4.5 ms. Does the 1-token
#     bucket's HLO run its 128 Pallas GEMV calls outside XLA's command buffers (CUDA graphs)?
#     The ITL and the compiled HLO by default and with custom calls in command buffers, and bf16.
#  2. FP8 KV decode attention after 4281ee0 (fp16 dot operands over fp8 pages): its share of a
#     256-row decode step (was 11.6 ms of 17.2 at ~1.5 TB/s; bf16 pages: 8.6 ms at ~4 TB/s).
#   run: bash benchmarks/gpu/gpu_fp8_probe.sh        (results in $OUT: at most 8 files)
set -o pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fp8_probe}
mkdir -p "$OUT"
CMDBUF="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
PROFILE_TAG=fp8 PROFILE_QUANT=fp8 timeout 100 python3 -m benchmarks.profile.batch1 2>&1 | grep -v "Delay kernel" | tail -12
PROFILE_TAG=fp8_cmdbuf PROFILE_QUANT=fp8 XLA_FLAGS="$CMDBUF" timeout 100 python3 -m benchmarks.profile.batch1 2>&1 | grep -v "Delay kernel" | tail -12
PROFILE_TAG=bf16 timeout 100 python3 -m benchmarks.profile.batch1 2>&1 | grep -v "Delay kernel" | tail -12
PROFILE_QUANT=fp8 timeout 150 python3 -m benchmarks.profile.trace 2>&1 | grep -v "Delay kernel" | grep -A8 "^decode"
