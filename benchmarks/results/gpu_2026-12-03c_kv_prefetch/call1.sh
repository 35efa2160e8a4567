#!/usr/bin/env bash
# lease 2026-12-03c call 1: the decode kernel with K / V loaded a block ahead (Tuning.kv_prefetch)
# against the current defaults, fp8 pages then bf16 pages; the PTX of one fp8 decode launch
# (cp.async vs ld.global) with and without it
set -u
T0=$(date +%s)
left() { echo $(( 580 - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $R/gpu.txt 2>&1
git log -1 --format=%H > $R/tree.txt 2>&1; git status --short >> $R/tree.txt 2>&1
timeout 260 python3 -m benchmarks.kernels.tune --kv-dtype fp8 --prefetch --only decode_b256_ctx1024,decode_b64_ctx2048,decode_b8_ctx8192,decode_b1_ctx8192 --budget 170 --rounds 3 --out $R > $R/tune_fp8.log 2>&1
echo "== fp8 tune done $(left)s left"; grep "^|" $R/tune_fp8.log
for v in default prefetch; do
  tun='{}'; [ $v = prefetch ] && tun='{"kv_prefetch": true}'
  rm -rf /tmp/dump_$v
  XLA_FLAGS="--xla_dump_to=/tmp/dump_$v" timeout 60 python3 -m benchmarks.kernels.one_call decode_b256_ctx1024 --kv-dtype fp8 --tuning "$tun" --calls 1 > /dev/null 2>&1
  f=$(grep -l "ragged_paged_attention" /tmp/dump_$v/*.ptx 2>/dev/null | head -1)
  echo "$v ptx=$f cp.async=$(grep -c 'cp.async' $f 2>/dev/null) ld.global=$(grep -c 'ld.global' $f 2>/dev/null) ld.shared=$(grep -c 'ld.shared' $f 2>/dev/null) .reg=$(grep -m3 '\.reg \.b32' $f 2>/dev/null | tr '\n' ' ')" | tee -a $R/ptx.txt
  [ -n "$f" ] && gzip -c $f > $R/decode_fp8_$v.ptx.gz
done
echo "== ptx done $(left)s left"
timeout $(( $(left) - 20 )) python3 -m benchmarks.kernels.tune --prefetch --only decode_b256_ctx1024,decode_b64_ctx2048 --budget $(( $(left) - 90 )) --rounds 3 --out $R > $R/tune_bf16.log 2>&1
echo "== bf16 tune done $(left)s left"; grep "^|" $R/tune_bf16.log
tar czf $OUT/results.tgz -C $OUT r
