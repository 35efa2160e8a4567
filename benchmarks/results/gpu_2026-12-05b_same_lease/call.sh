#!/usr/bin/env bash
# One device call of the 2026-12-05b lease (issues #17 and #18): groups of gpu_run.sh stages, each
# "STAGES:SECONDS" (the seconds it is expected to need; a group that no longer fits LIMIT is
# skipped), each into its own folder of $OUT, on the machine that holds vLLM's parts.
#   bash call.sh "vllm-offline,pax-offline:430" "pax-offline:70"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PAXENGINE_COMMIT=${PAXENGINE_COMMIT:-?}
[ -d .vp8 ] && mkdir -p /tmp/vparts && cp .vp8/* /tmp/vparts/
ls /tmp/vparts 2>/dev/null | tr '\n' ' '; echo
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee $OUT/gpu.txt
LIMIT=${LIMIT:-585}
n=$(ls -d /tmp/lease_groups/* 2>/dev/null | wc -l)
for g in "$@"; do
  stages=${g%%:*}; need=${g##*:}; left=$((LIMIT - SECONDS))
  if [ "$left" -lt "$need" ]; then echo "== skip $stages (needs $need s, $left s left)"; continue; fi
  n=$((n + 1)); d=/tmp/lease_groups/$n-${stages//,/+}; mkdir -p "$d"
  OUT=$d GPU_BENCH_BUDGET_S=$left bash benchmarks/gpu/gpu_run.sh "$stages" > /dev/null 2>&1
  echo "== $n $stages (at $SECONDS s)"
  grep -E "started in|ITL [0-9]|output tok/s|done in|rror" "$d/gpu_log.txt" | tail -14
  grep "^|" "$d/gpu_log.txt" | tail -20
  rm -rf "$d"/dummy_model* "$d"/*.png
  cp -r "$d" "$OUT/"
done
tar czf /tmp/call.tgz -C $OUT . && rm -rf ${OUT:?}/* && mv /tmp/call.tgz $OUT/call.tgz
