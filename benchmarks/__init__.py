"""paxengine benchmarks, by job (README.md has the table):

  bench/     the shipped `paxengine bench serve|throughput` commands
  gpu/       the GPU run (`gpu/gpu_run.sh`): roofline, engine stages, the report
  kernels/   attention kernel micro-benchmarks
  profile/   one-off profiles of the engine step
"""
