#!/usr/bin/env bash
# Call 3: the add + RMSNorm kernel's block shapes (rows a program x warps), loads unmasked where
# the shape allows (the tree of this call), against XLA's fusions of the oracle, at the
# engine's row counts; one jit of 32 chained calls a timing (call 2's loop was a while loop,
# whose per-iteration sync hid the small sizes).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m benchmarks.kernels.add_norm --out $OUT --rows 320,8192,1,2048,8 --modes norm_q,add_q,add,norm \
  --sweep 1x2,1x4,1x8,2x4,2x8,4x4,4x8,8x8,8x16 --budget-s 330 2>&1 | grep -v "^[IWE][0-9]" | tee $OUT/add_norm.log
