#!/usr/bin/env bash
# lease 2026-12-03e last call: a fresh machine, the default server with the heap frozen after
# start-up and again once the background's builds are in: c = 16 / 64 (GC passes in the trace)
set -u
T0=$(date +%s)
left() { echo $(( ${BUDGET:-185} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
timeout $(( $(left) - 5 )) python3 -m benchmarks.gpu.serve_variants --out $R/gc --variants base --concurrency 16,64 --log-level info > $R/gc.log 2>&1
rm -rf $R/*/dummy_model 2>/dev/null
gzip -f $R/*/*.jsonl 2>/dev/null
tar czf $OUT/results.tgz -C $OUT r
grep -h "ready in\|built at\|tok/s" $R/*.log | tail -10
