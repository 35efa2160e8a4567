#!/usr/bin/env bash
# lease 2026-12-03d call 6 (a fresh machine, after the runner split ce238a5): the default server,
# bf16 then FP8, cold compile, c = 16 and 64: the build side's move changed nothing on the GPU
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R/b $R/f
timeout 200 python3 -m benchmarks.gpu.serve_variants --out $R/b --variants base --concurrency 16,64 --log-level info > $R/b.log 2>&1
timeout 150 python3 -m benchmarks.gpu.serve_variants --out $R/f --fp8 --variants base --concurrency 16,64 --log-level info > $R/f.log 2>&1
rm -rf $R/b/dummy_model $R/f/dummy_model; gzip -f $R/*/*.jsonl 2>/dev/null
tar czf $OUT/results.tgz -C $OUT r
grep -h "ready in\|tok/s, TTFT\|Error" $R/b.log $R/f.log
