"""`paxengine serve` as a user starts it, for the model-family tests: a process of its own (the
engine process, background compile on) on a free port, ready when /health answers."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx


@contextlib.contextmanager
def served(model: str, *args: str, ready_s: float = 300, devices: int = 1):
    """Yields the server's base URL; the process group is killed on exit. devices > 1: the
    process sees that many simulated CPU devices (XLA_FLAGS, read when jax starts)."""
    env = dict(os.environ)
    if devices > 1:
        flag = f"--xla_force_host_platform_device_count={devices}"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "paxengine.cli", "serve", model, "--port", str(port), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"not ready in {ready_s:.0f} s"
            time.sleep(0.25)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def greedy_token_ids(base: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    """A greedy /v1/completions of a token-id prompt (ignore_eos): its token ids; a non-200
    answer fails the test with its body."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body.update(ignore_eos=True, return_token_ids=True)
    r = httpx.post(base + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]
