#!/usr/bin/env bash
# Our decode kernel and vLLM's FlashAttention-3 in one device call, on three levels: the kernel
# alone, a call as an engine step makes it, a call on its own (benchmarks/kernels/compare.py).
# Ours (decode_trace.py) runs before and after FA3, so the card's drift shows as a range.
# On the GPU, vLLM's parts already in /tmp/vparts (gpu_vllm_install.sh):
#   bash benchmarks/gpu/gpu_decode_fa3.sh [SHAPES]       (comma list of harness.SHAPES decode names)
# Writes $OUT/ours{1,2}/decode_trace.json, $OUT/kernels_fa3_h200.json, $OUT/decode_compare.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/decode_fa3_out}
S=${1:-decode_b64_ctx2048,decode_b8_ctx8192,decode_b256_ctx512,decode_b1_ctx8192}
bash benchmarks/gpu/gpu_vllm_install.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT/ours1" "$OUT/ours2"
ours() {
  python3 -m benchmarks.kernels.decode_trace --only "$S" --variants '[{}]' --out "$1" > "$1/log.txt" 2>&1 \
    || echo "decode_trace.py failed, see $1/log.txt"
  grep -v "^WARNING\|^I0000\|^E0000" "$1/log.txt" | tail -20
}
ours "$OUT/ours1"
PYTHONPATH=/tmp/vsite:$PWD python3 -m benchmarks.kernels.fa3 --only "$S" --out "$OUT" \
  > "$OUT/fa3_log.txt" 2>&1 || echo "fa3.py failed, see $OUT/fa3_log.txt"
grep "FA3\|Error\|error" "$OUT/fa3_log.txt" | tail -12
ours "$OUT/ours2"
fa3=$(ls "$OUT"/kernels_fa3_*.json 2>/dev/null | head -1)
if [ -n "$fa3" ]; then
  python3 -m benchmarks.kernels.compare "$OUT"/ours1/decode_trace.json \
    "$OUT"/ours2/decode_trace.json "$fa3" --out "$OUT/decode_compare.json"
else
  echo "no FA3 results in $OUT: no comparison"
fi
