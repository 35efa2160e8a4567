"""The device's kernels from a `jax.profiler` trace: each kernel's name, start and duration, their
totals per name, and the device's busy span and idle time. `profile/trace.py` reads engine steps
this way, `kernels/decode_trace.py` single attention calls.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import tempfile
from collections import defaultdict


def trace_events(trace_dir: str) -> tuple[list[dict], set]:
    """Every event of the newest trace in the dir, and the ids of its device tracks (processes
    named for a GPU or device; none on a CPU)."""
    path = sorted(
        glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    )[-1]
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {
        e.get("pid"): str(e.get("args", {}).get("name", ""))
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    device = {
        pid for pid, name in procs.items() if "gpu" in name.lower() or "device" in name.lower()
    }
    return events, device


def device_events(trace_dir: str) -> list[tuple[str, float, float]]:
    """(kernel name, start us, duration us) of every kernel on the device tracks of the newest
    trace in the dir (on a CPU, where there is no device track, of every complete event: host
    ops)."""
    events, device = trace_events(trace_dir)
    return [
        (e["name"], float(e.get("ts", 0.0)), float(e.get("dur", 0.0)))
        for e in events
        if e.get("ph") == "X"
        and not str(e.get("name", "")).startswith("$")  # $: Python
        and (not device or e.get("pid") in device)
    ]


def kernel_times(events) -> tuple[dict[str, float], dict[str, int]]:
    """Kernel name -> total microseconds, and kernel name -> launches, of device_events() rows."""
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for name, _, dur in events:
        totals[name] += dur
        counts[name] += 1
    return dict(totals), dict(counts)


def device_kernel_times(trace_dir: str) -> tuple[dict[str, float], dict[str, int]]:
    """kernel_times() of the newest trace in the dir."""
    return kernel_times(device_events(trace_dir))


def span_of(events) -> tuple[float, float]:
    """(first kernel start to last kernel end, the device's idle time inside that span), us,
    of device_events() rows."""
    if not events:
        return 0.0, 0.0
    ev = sorted((ts, ts + dur) for _, ts, dur in events)
    idle, end = 0.0, ev[0][1]
    for ts, te in ev[1:]:
        idle += max(0.0, ts - end)
        end = max(end, te)
    return end - ev[0][0], idle


def trace_device(run) -> list[tuple[str, float, float]]:
    """device_events() of one run() under jax.profiler (run must wait for its own results)."""
    import jax

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            run()
        return device_events(d)
