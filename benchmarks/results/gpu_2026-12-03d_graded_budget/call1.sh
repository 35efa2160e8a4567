#!/usr/bin/env bash
# lease 2026-12-03d call 1: Poisson 4 / 8 / 16 req/s (1024 / 256 +-90%), the graded step budget
# (base: 512 doubling to 4,096 with the prompt backlog) against the old jump rule (512, or 4,096
# once 8,192 prompt tokens wait), each in its own fresh server; outputs as deltas in both
set -u
T0=$(date +%s)
left() { echo $(( 580 - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $R/gpu.txt 2>&1
timeout $(( $(left) - 15 )) python3 -m benchmarks.gpu.serve_variants --out $R/sv --workload poisson --variants ${VARIANTS:-base,jump} --log-level info > $R/sv.log 2>&1
echo "== done $(left)s left"
rm -rf $R/sv/dummy_model 2>/dev/null
gzip -f $R/sv/*.jsonl 2>/dev/null
tar czf $OUT/results.tgz -C $OUT r
grep -h "ready in\|tok/s" $R/sv.log | tail -20
