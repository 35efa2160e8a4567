"""What a result file carries: the environment it was measured in, and values strict JSON can
hold."""

from __future__ import annotations

import math
import os
import platform
import socket
import subprocess
from pathlib import Path

import numpy as np


def environment(extra: dict | None = None) -> dict:
    """What ran where: host, device name, versions, commit. Never initialises an accelerator
    (importing jax's backend here would take GPU memory from the server)."""
    from importlib import metadata

    def version(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    def sh(cmd):
        try:
            return (
                subprocess.run(
                    cmd,
                    capture_output=True,
                    text=True,
                    timeout=10,
                    cwd=Path(__file__).resolve().parent,
                ).stdout.strip()
                or None
            )
        except (OSError, subprocess.SubprocessError):
            return None

    gpu = sh(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    )
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    # PAXENGINE_COMMIT wins: the GPU's copy of the tree may carry a stale .git (the session's
    # starting state), so git there names the wrong commit.
    commit, dirty = os.environ.get("PAXENGINE_COMMIT"), None
    if not commit:
        commit = sh(["git", "rev-parse", "HEAD"])
        if commit:
            dirty = bool(sh(["git", "status", "--porcelain", "--untracked-files=no"]))
    env = {
        "hostname": socket.gethostname(),
        "device": (
            gpu.splitlines()[0] if gpu else f"CPU: {cpu or platform.processor()} x{os.cpu_count()}"
        ),
        "gpus": gpu.splitlines() if gpu else [],
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax_version": version("jax"),
        "jaxlib_version": version("jaxlib"),
        "torch_version": version("torch"),
        "transformers_version": version("transformers"),
        "commit": commit,
        "commit_dirty": dirty,
        # options that change what XLA compiles (step_build.xla_compile_options)
        "xla_flags": os.environ.get("XLA_FLAGS") or None,
        "paxengine_xla_options": os.environ.get("PAXENGINE_XLA_OPTIONS") or None,
    }
    env.update(extra or {})
    return env


def finite(o):
    """A copy that strict JSON can hold: inf -> "inf", NaN -> None, numpy scalars -> Python."""
    if isinstance(o, dict):
        return {k: finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [finite(v) for v in o]
    if isinstance(o, (np.floating, np.integer)):
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None if math.isnan(o) else ("inf" if o > 0 else "-inf")
    return o
