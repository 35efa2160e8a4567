#!/usr/bin/env bash
# Our attention kernel and vLLM's FlashAttention-3 in one device call. Ours is timed before and
# after FA3, so the card's drift over the call shows as a range (benchmarks/kernels/compare.py).
# On the GPU (carry .whl; vLLM's parts already in /tmp/vparts, see gpu_run.sh):
#   bash benchmarks/gpu/gpu_kernels_fa3.sh [SHAPES]      (comma list of attention.py row names)
# Writes $OUT/{ours1,ours2}/kernels_h200.json, $OUT/kernels_fa3_h200.json, $OUT/compare.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kernels_fa3_out}
S=${1:-decode_b1_ctx8192,decode_b8_ctx8192,decode_b64_ctx2048,decode_b256_ctx512,prefill_512,prefill_2048,chunk_512_ctx4096}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "wheel install failed"; exit 1; }
fi
bash benchmarks/gpu/gpu_vllm_install.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT/ours1" "$OUT/ours2"
ours() {
  python3 -m benchmarks.kernels.attention --sweep none --timing loop --upstream best --only "$S" \
    --out "$1" > "$1/log.txt" 2>&1 || echo "attention.py failed, see $1/log.txt"
}
ours "$OUT/ours1"
PYTHONPATH=/tmp/vsite:$PWD python3 -m benchmarks.kernels.fa3 --only "$S" --out "$OUT" \
  > "$OUT/fa3_log.txt" 2>&1 || echo "fa3.py failed, see $OUT/fa3_log.txt"
ours "$OUT/ours2"
python3 -m benchmarks.kernels.compare "$OUT"/ours1/kernels_*.json "$OUT"/ours2/kernels_*.json \
  "$OUT"/kernels_fa3_*.json --out "$OUT/compare.json"
