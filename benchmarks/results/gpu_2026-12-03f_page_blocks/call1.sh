#!/usr/bin/env bash
# Call 1: the Triton decode kernel's KV read rate against the page size and the block load
# (gathered rows / one page per block / V in [D, bs]), fp8 pages then the bf16 engine's pages.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
timeout 400 python3 -m benchmarks.kernels.page_blocks --kv-dtype fp8 --page-sizes 16,64,128 --rounds 3 --out $OUT/fp8 > $OUT/fp8.log 2>&1
timeout 150 python3 -m benchmarks.kernels.page_blocks --kv-dtype bf16 --page-sizes 16,128 --only decode_b256_ctx1024,decode_b300_ctx1536,decode_b64_ctx2048,decode_b8_ctx8192 --rounds 3 --out $OUT/bf16 > $OUT/bf16.log 2>&1
grep "^|" $OUT/fp8.log $OUT/bf16.log
