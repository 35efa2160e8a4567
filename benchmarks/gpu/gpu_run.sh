#!/usr/bin/env bash
# The GPU benchmark, run on the lent H200 through the `run` tool (repo root as working dir).
#
# Here, once:   ../shared/gpu/fetch-wheels.sh uvloop httptools   (fastapi, uvicorn, pydantic, gguf, ... -> .whl/)
# On the GPU:   carry [".whl"], command:  bash benchmarks/gpu/gpu_run.sh [STAGES]
#
# STAGES (default roofline,pax-offline,pax-serve; see benchmarks/gpu/main.py): any of
#   roofline pax-offline pax-serve vllm-offline vllm-serve hf, comma-separated, or "all".
# vLLM stages need /tmp/vsite (VLLM-PEER.md); when /tmp/vparts holds the uploaded parts and
# /tmp/vsite is missing, this script assembles and installs them first.
# The whole command stays inside the device's 10-minute limit (GPU_BENCH_BUDGET_S, default 560 s);
# results land in $OUT (gpu_bench.json, gpu_log.txt, {pax,vllm}_serve.json and plots) and in
# /tmp/paxengine_gpu_bench, where a later call on the same warm machine merges its stages in.
# PAXENGINE_COMMIT=<hash> records the commit (the device's copy of the tree has no .git).
# CPU smoke run here: PATH=.venv/bin:$PATH OUT=/tmp/gr GPU_BENCH_ARGS=--quick bash benchmarks/gpu/gpu_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/benchmarks/results/gpu}
mkdir -p "$OUT"
STAGES=${1:-roofline,pax-offline,pax-serve}
start=$(date +%s)

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "wheel install failed"; exit 1; }
fi
if [[ "$STAGES" == *vllm* || "$STAGES" == all ]]; then
  bash benchmarks/gpu/gpu_vllm_install.sh
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VLLM_PYTHONPATH=/tmp/vsite
used=$(( $(date +%s) - start ))
budget=$(( ${GPU_BENCH_BUDGET_S:-560} - used ))

{
  echo "== $(date -u +%FT%TZ) commit ${PAXENGINE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')} stages $STAGES budget ${budget}s"
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv 2>&1
  python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1
  # shellcheck disable=SC2086  # GPU_BENCH_ARGS: extra flags, e.g. --quick for a CPU smoke run
  python3 -m benchmarks.gpu.main --out "$OUT" --stages "$STAGES" --budget-s "$budget" ${GPU_BENCH_ARGS:-}
  echo "== exit $?"
} 2>&1 | tee -a "$OUT/gpu_log.txt"
