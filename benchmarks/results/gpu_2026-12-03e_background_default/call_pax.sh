#!/usr/bin/env bash
# lease 2026-12-03e call 11: paxengine served beside call 10's vLLM (same machine, servers
# restart from the store): c = 16 / 64 twice, then Poisson 4 / 8 / 16 req/s
set -u
T0=$(date +%s)
left() { echo $(( 580 - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $R/gpu.txt 2>&1
timeout $(( $(left) - 15 )) python3 -m benchmarks.gpu.serve_variants --out $R/serve --variants ${VARIANTS:-base,base#2} --concurrency 1,16,64 --log-level info > $R/serve.log 2>&1
echo "== serve done $(left)s left"
if [ $(left) -gt 150 ]; then
  timeout $(( $(left) - 15 )) python3 -m benchmarks.gpu.serve_variants --out $R/poisson --workload poisson --variants base --log-level info > $R/poisson.log 2>&1
fi
echo "== poisson done $(left)s left"
rm -rf $R/*/dummy_model 2>/dev/null
gzip -f $R/*/*.jsonl 2>/dev/null
tar czf $OUT/results.tgz -C $OUT r
grep -h "ready in\|built at\|tok/s" $R/*.log | tail -30
