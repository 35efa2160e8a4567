#!/usr/bin/env bash
# lease 2026-12-03 call 2 (fresh machine): every step executable run once before serving
set -u
T0=$(date +%s)
left() { echo $(( 215 - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/q; mkdir -p $R
timeout 195 python3 -m benchmarks.gpu.serve_variants --out $R/s --variants nobacklog,base --concurrency 16,64 --log-level info > $R/s.log 2>&1
echo "== serve done $(left)s left"
[ $(left) -gt 40 ] && timeout $(( $(left) - 12 )) python3 -m benchmarks.gpu.serve_variants --out $R/p --workload poisson --variants nobacklog --log-level info > $R/p.log 2>&1
rm -rf $R/*/dummy_model
tar czf $OUT/primed.tgz -C $OUT q
grep -h "ready in\|tok/s" $R/s.log $R/p.log | tail -20
grep -h "ran each step\|ready in" $R/s/*_server.log | tail -6
