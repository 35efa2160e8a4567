#!/usr/bin/env bash
# lease 2026-12-03c call 2: V pages in [D, bs] (v_dn) against [bs, D], the Triton kernel over fp8
# pages (decode tunings, then prefill / mixed shapes at the default), then the bf16 engine's pages
set -u
T0=$(date +%s)
left() { echo $(( 580 - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $R/gpu2.txt 2>&1
timeout 200 python3 -m benchmarks.kernels.v_page_layout --kv-dtype fp8 --out $R > $R/vpl_fp8.log 2>&1
echo "== fp8 decode done $(left)s left"; grep "^|" $R/vpl_fp8.log
mkdir -p $R/pf
timeout 150 python3 -m benchmarks.kernels.v_page_layout --kv-dtype fp8 --variants nd,dn --only prefill_2048,mixed_60dec2048_448pf,chunk_512_ctx4096,engine_8x1000_s256 --out $R/pf > $R/vpl_fp8_prefill.log 2>&1
echo "== fp8 prefill done $(left)s left"; grep "^|" $R/vpl_fp8_prefill.log
timeout $(( $(left) - 15 )) python3 -m benchmarks.kernels.v_page_layout --kv-dtype bf16 --variants nd,dn,dn_3stages --only decode_b256_ctx1024,decode_b64_ctx2048 --out $R > $R/vpl_bf16.log 2>&1
echo "== bf16 done $(left)s left"; grep "^|" $R/vpl_bf16.log
mv $R/pf/v_page_layout_fp8.json $R/v_page_layout_fp8_prefill.json 2>/dev/null
tar czf $OUT/results.tgz -C $OUT r
