# Call A (carry [".whl"]): the MoE's grouped GEMMs by lowering (moe_probe), the lowering picked
# from it (the Pallas kernel for steps up to the largest token count where it beats ragged_dot
# at every smaller count, else ragged_dot), then pax-offline-qwen3moe with that pick.
t0=$(date +%s)
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 140 python3 -m benchmarks.gpu.moe_probe --tokens 1 8 64 256 512 2048 --json $OUT/moe_probe.json > $OUT/moe_probe.log 2>&1
echo "== moe probe rc $?"; grep '"T"' $OUT/moe_probe.log | cut -c1-330
eval "$(python3 - <<'PY'
import json, os
rows = json.load(open(os.environ["OUT"] + "/moe_probe.json"))
by = {}
for r in rows:
    by.setdefault(r["T"], {})[r["variant"]] = r.get("us")
limit = None
for T in sorted(by):
    p, x = by[T].get("pallas"), by[T].get("xla")
    if p is None or (x is not None and p >= x):
        break
    limit = T
if limit is None:
    print("export PAXENGINE_KERNEL_MOE=xla")
else:
    print(f"export PAXENGINE_KERNEL_MOE=pallas PAXENGINE_KERNEL_MOE_MAX_TOKENS={limit}")
PY
)"
echo "== pick: PAXENGINE_KERNEL_MOE=$PAXENGINE_KERNEL_MOE max tokens ${PAXENGINE_KERNEL_MOE_MAX_TOKENS:-none}"
PAXENGINE_COMMIT=${PAXENGINE_COMMIT:-?} GPU_BENCH_BUDGET_S=$(( 580 - ($(date +%s) - t0) )) \
  bash benchmarks/gpu/gpu_run.sh pax-offline-qwen3moe > /dev/null 2>&1
grep -v "^|" $OUT/gpu_log.txt | tail -25 | cut -c1-250
