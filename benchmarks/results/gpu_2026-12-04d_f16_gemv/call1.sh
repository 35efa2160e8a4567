#!/usr/bin/env bash
# Call 1 (issue #17): the FP8-weight GEMV / skinny GEMM with f16 operands (Fp8MatmulTuning.compute
# = "f16": e4m3 -> f16 is one instruction a pair, -> bf16 goes through f32) against today's
# default (M=1 reduce_step in f32; M >= 2 XLA's W8A16 in the engine), swept at M = 1, 8, 16 on
# the four Llama-3.1-8B projections; then decode attention over fp8 64-token pages at 2 / 4 / 8
# warps a program (the kernel reads fp8 pages at ~3.3 TB/s where bf16 pages reach ~3.9).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
python3 -m benchmarks.kernels.fp8_matmul --only-m 1,8,16 --budget 250 --out $OUT 2>&1 \
  | grep -v "^[IWE][0-9]" > $OUT/fp8_matmul.log
tail -20 $OUT/fp8_matmul.log
timeout $((570 - SECONDS)) python3 -m benchmarks.kernels.page_blocks --kv-dtype fp8 --page-sizes 64 \
  --only decode_b300_ctx1536,decode_b256_ctx1024,decode_b64_ctx2048,decode_b8_ctx8192 --rounds 3 \
  --out $OUT 2>&1 | grep -v "^[IWE][0-9]" > $OUT/page_blocks.log
grep "^|" $OUT/page_blocks.log
