#!/usr/bin/env bash
# lease 2026-12-03b call 1: fresh machine; the engine in a process of its own (base, nobacklog)
# against the step loop on a thread of the server's process (thread, nobacklog_thread)
set -u
T0=$(date +%s)
left() { echo $(( 575 - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $R/gpu.txt 2>&1
git log -1 --format=%H > $R/tree.txt 2>&1; git status --short >> $R/tree.txt 2>&1
timeout $(( $(left) - 15 )) python3 -m benchmarks.gpu.serve_variants --out $R/sv --variants base,thread,nobacklog,nobacklog_thread,base#2,thread#2,nobacklog#2,nobacklog_thread#2 --concurrency 16,64 --log-level info > $R/sv.log 2>&1
echo "== done $(left)s left"
rm -rf $R/sv/dummy_model 2>/dev/null
tar czf $OUT/results.tgz -C $OUT r
grep -h "ready in\|tok/s" $R/sv.log | tail -40
grep -h "ran each step\|ready in" $R/sv/*_server.log | tail -12
