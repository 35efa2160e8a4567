#!/usr/bin/env bash
# lease 2026-12-03 call 1: fresh machine; paxengine serve variants with step traces
set -u
T0=$(date +%s)
left() { echo $(( 570 - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $R/gpu.txt 2>&1
git log -1 --format=%H > $R/tree.txt 2>&1; git status --short >> $R/tree.txt 2>&1
echo "== background (fresh machine) $(left)s left"
timeout 220 python3 -m benchmarks.gpu.serve_variants --out $R/sv1 --variants background --concurrency 1,16,64 > $R/sv1.log 2>&1
echo "== variants $(left)s left"
timeout $(( $(left) - 15 )) python3 -m benchmarks.gpu.serve_variants --out $R/sv2 --variants base,nobacklog,thr1,seq128,base#2,nobacklog#2,thr1#2 --concurrency 16,64 --log-level info > $R/sv2.log 2>&1
echo "== done $(left)s left"
rm -rf $R/sv*/dummy_model 2>/dev/null
tar czf $OUT/results.tgz -C $OUT r
grep -h "ready in\|tok/s" $R/sv1.log $R/sv2.log | tail -40
grep -h "compil\|ready" $R/sv1/background_server.log | tail -8
