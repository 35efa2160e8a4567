# Call S (carry [".whl"], if the device time lasts): the kernel's tunings at 1 and 8 tokens.
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 200 python3 -m benchmarks.gpu.moe_probe --sweep --tokens 1 8 --json $OUT/sweep.json > $OUT/sweep.log 2>&1
echo "== sweep rc $?"; grep '"best"' $OUT/sweep.log | cut -c1-400
