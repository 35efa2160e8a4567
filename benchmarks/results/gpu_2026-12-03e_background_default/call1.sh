#!/usr/bin/env bash
# lease 2026-12-03e call 1: a fresh machine; `paxengine serve`'s new default (background
# compilation): ready time, every bucket built, then c = 1 / 16 / 64; then restarts from the
# store (foreground: everything loaded before ready; base#2: the default) and FP8 fresh
set -u
T0=$(date +%s)
left() { echo $(( 580 - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $R/gpu.txt 2>&1
timeout $(( $(left) - 15 )) python3 -m benchmarks.gpu.serve_variants --out $R/fresh --variants base --concurrency 1,16,64 --log-level info > $R/fresh.log 2>&1
echo "== fresh done $(left)s left"
if [ $(left) -gt 150 ]; then
  timeout $(( $(left) - 15 )) python3 -m benchmarks.gpu.serve_variants --out $R/restart --variants foreground,base#2 --concurrency 16,64 --log-level info > $R/restart.log 2>&1
fi
echo "== restart done $(left)s left"
if [ $(left) -gt 200 ]; then
  timeout $(( $(left) - 15 )) python3 -m benchmarks.gpu.serve_variants --out $R/fp8 --fp8 --variants base --concurrency 16,64 --log-level info > $R/fp8.log 2>&1
fi
echo "== fp8 done $(left)s left"
rm -rf $R/*/dummy_model 2>/dev/null
gzip -f $R/*/*.jsonl 2>/dev/null
tar czf $OUT/results.tgz -C $OUT r
grep -h "ready in\|built at\|tok/s" $R/*.log | tail -30
grep -h "ran each step\|ready in\|background" $R/*/*_server.log | tail -20
