"""paxengine benchmarks, by job (README.md has the table):

  bench/     the shipped `paxengine bench serve|throughput` commands
  gpu/       the GPU run (`gpu/gpu_run.sh`): roofline, engine stages, the report
  kernels/   the attention kernels' benchmark
  results/   what they measured (results/README.md is the index)
  soak.py    a running server under mixed, dropped and bad requests; step_trace.py reads a
             PAXENGINE_STEP_TRACE file

What they share: measure.py (time per call, copy and matmul rates, compile counting), record.py
(a result's environment, strict JSON).
"""
