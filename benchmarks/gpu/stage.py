"""What a stage's process keeps while it runs: its deadline and the measurements it has finished,
written out at once so that a stage cut off by its time limit still reports them."""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.record import finite

_partial: dict = {}
_partial_file: Path | None = None
_deadline: float | None = None  # time.time() by which this stage must be done


def log(*a) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}]", *a, flush=True)


def begin(result_file: Path, deadline: float | None) -> None:
    """Called once by the stage's process before the stage runs."""
    global _partial_file, _deadline
    _partial_file, _deadline = result_file, deadline


def seconds_left() -> float | None:
    """Until the stage's deadline (None: no deadline)."""
    return None if _deadline is None else _deadline - time.time()


def save_partial(**kv) -> None:
    """Record finished measurements at once, so a stage cut off by its time limit keeps them."""
    _partial.update(kv)
    if _partial_file is not None:
        _partial_file.write_text(
            json.dumps(
                finite({"ok": False, "partial": True, **_partial}), indent=1, allow_nan=False
            )
        )


def partial() -> dict:
    """Everything save_partial() recorded so far."""
    return dict(_partial)
