#!/usr/bin/env bash
# Call 4 (a fresh machine): twice the split-K of the default for 64-token fp8 pages at decode,
# beside the default and 16-token pages (long contexts at small batch lost 9-12% in call 1).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
timeout 300 python3 -m benchmarks.kernels.page_blocks --kv-dtype fp8 --page-sizes 16,64 \
  --only decode_b8_ctx8192,decode_b1_ctx8192,decode_b64_ctx2048,decode_b256_ctx1024,decode_b300_ctx1536 \
  --rounds 5 --out $OUT > $OUT/page_blocks_splits.log 2>&1
mv $OUT/page_blocks.json $OUT/page_blocks_splits.json
grep "^|" $OUT/page_blocks_splits.log
