"""paxengine benchmarks, by job (README.md has the table):

  bench/     the shipped `paxengine bench serve|throughput` commands
  gpu/       the GPU run (`gpu/gpu_run.sh`): roofline, engine stages, the report
  kernels/   attention kernel micro-benchmarks
  profile/   one-off profiles of the engine step
  results/   what they measured (results/README.md is the index)

What they share: measure.py (time per call, copy and matmul rates, compile counting),
device_trace.py (the device's kernels from a jax.profiler trace), record.py (a result's
environment, strict JSON, $OUT).
"""
