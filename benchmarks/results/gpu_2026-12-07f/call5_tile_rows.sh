# Call 5 (carry [".whl"]): the MoE kernel's rows a tile by step size (call 4: a 256-sequence
# decode step's experts took 46 ms of 56 with 16-row tiles, ~2.7x the weights' read; each tile
# reads its expert's weights once). Qwen3-30B-A3B's experts, one layer, pallas only.
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for r in 16 32 64 128; do
  PAXENGINE_KERNEL_MOE_TILE_ROWS=$r timeout 90 python3 -m benchmarks.gpu.moe_probe \
    --tokens 64 128 256 512 2048 8192 --variants pallas --json $OUT/probe_rows$r.json > $OUT/probe_rows$r.log 2>&1
  echo "== rows $r rc $?"; grep -o '"T": [0-9]*\|"us": [0-9.]*' $OUT/probe_rows$r.log | paste -sd' ' | sed 's/"T"/\n"T"/g'
done
