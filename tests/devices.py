"""What the multi-device tests share: a small engine, and a worker script run in a subprocess
with N simulated CPU devices (XLA_FLAGS must be set before jax starts, so not in this process)."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SMALL = dict(
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    token_buckets=[16, 32],
    seq_buckets=[4],
    num_kv_blocks=64,
    attention_backend="xla",
)


def run_worker(script: str, args: list[str], devices: int):
    """Runs tests/<script> with `devices` CPU devices; returns the JSON of its last "RESULT "
    line. The callers give every engine a compilation_cache_dir of the test's own (a JAX cache
    and an executable store; the DP and disagg tests share one, conftest.two_device_cache:
    their engines are the same). The converted weights come from this process's
    weights cache (PAXENGINE_CACHE or ~/.cache/paxengine, as every other test's engines): their
    conversion is tested in test_model_parity, not paid again by each multi-device test."""
    env = dict(os.environ)
    flags = f"--xla_force_host_platform_device_count={devices}"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}"
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])
