"""A store of compiled step executables on disk, so a restart skips tracing and compiling.

JAX's persistent compilation cache only skips XLA's compile: every bucket must still be traced
and lowered to compute its key, and for an unrolled 8B model with Pallas kernels that tracing is
most of a start-up. This store keys a serialized executable by everything that decides it
without tracing: the source of paxengine and kernels_pallas, the jax/jaxlib versions, the
device, XLA's flags, the function's static configuration and the shapes, dtypes and tree
structure of its arguments. A hit is deserialized and loaded; a miss (or an unreadable entry) is
compiled as before and written for next time.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import threading
import time
from pathlib import Path

import jax
import jaxlib
from jax.experimental.compilation_cache import compilation_cache
from jax.experimental.serialize_executable import deserialize_and_load, serialize

log = logging.getLogger("paxengine")

_SOURCE_PACKAGES = ("paxengine", "kernels_pallas")


@functools.cache
def source_digest() -> str:
    """SHA-256 of every .py file of the packages whose code a step runs."""
    h = hashlib.sha256()
    for pkg in _SOURCE_PACKAGES:
        root = Path(__import__(pkg).__file__).parent
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _environment() -> tuple:
    dev = jax.devices()[0]
    # (PAXENGINE_KERNEL_*: switches of which kernels a step compiles, e.g. attention.py's)
    prefixes = ("XLA_", "JAX_", "PAXENGINE_KERNEL_")
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(prefixes))
    return (
        jax.__version__,
        jaxlib.__version__,
        dev.platform,
        dev.device_kind,
        jax.device_count(),
        dev.client.platform_version,
        tuple(env),
        source_digest(),
    )


def signature(args) -> tuple:
    """Tree structure, shapes and dtypes of a call's arguments (arrays or ShapeDtypeStructs)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    return str(tree), tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


_bypass_lock = threading.Lock()
_bypass_depth = 0  # builds inside bypassing_jax_cache now (a background build and a foreground
_bypass_saved = None  # one of another replica may overlap): the setting before the first


@contextlib.contextmanager
def bypassing_jax_cache():
    """Compile without JAX's persistent cache, for executables that go into the store: one that
    JAX loaded from its own cache does not survive being serialized again (seen on XLA:CPU: the
    stored copy loads, then fails when run with "Function negate_power_fusion not found").
    Overlapping uses (threads) share one bypass: the cache comes back when the last one ends."""
    global _bypass_depth, _bypass_saved
    with _bypass_lock:
        if _bypass_depth == 0:
            _bypass_saved = jax.config.jax_enable_compilation_cache
            compilation_cache.reset_cache()  # JAX decides once whether to use its cache: ask again
            jax.config.update("jax_enable_compilation_cache", False)
        _bypass_depth += 1
    try:
        yield
    finally:
        with _bypass_lock:
            _bypass_depth -= 1
            if _bypass_depth == 0:
                jax.config.update("jax_enable_compilation_cache", _bypass_saved)
                compilation_cache.reset_cache()


class ExecutableStore:
    """Serialized executables under `directory`, one file per key. Every code change makes new
    keys, so the folder is pruned to `max_bytes` on opening, least recently used first (a load
    touches its file)."""

    def __init__(self, directory: str | Path, max_bytes: int = 8 << 30):
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self._prune()
        self.hits = self.misses = 0
        self.load_seconds = 0.0  # summed over loads (they may overlap)
        self.unstored: list[str] = []  # labels of executables that could not be stored

    def key(self, name: str, static, args) -> str:
        """static: the configuration the traced function closes over (reprs must be stable)."""
        blob = repr((name, static, signature(args), _environment())).encode()
        return hashlib.sha256(blob).hexdigest()

    def _prune(self) -> None:
        try:
            files = sorted(self.dir.glob("*.exe"), key=lambda p: p.stat().st_mtime)
            total = sum(p.stat().st_size for p in files)
            for p in files:
                if total <= self.max_bytes:
                    break
                total -= p.stat().st_size
                p.unlink(missing_ok=True)
        except OSError:  # another process pruned at the same time: nothing to do
            pass

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}.exe"

    def load(self, key: str):
        """The executable stored under `key`, loaded on the device, or None."""
        path = self._path(key)
        if not path.is_file():
            self.misses += 1
            return None
        t = time.perf_counter()
        try:
            blob, in_tree, out_tree, device_ids = pickle.loads(path.read_bytes())
            # on the devices it was compiled for: by default it would take every device of
            # the process, and a one-device step on a multi-GPU host then refuses its inputs
            by_id = {d.id: d for d in jax.devices()}
            devices = [by_id[i] for i in device_ids]
            exe = deserialize_and_load(blob, in_tree, out_tree, execution_devices=devices)
        except Exception as e:  # truncated, or from an incompatible runtime: compile instead
            log.warning(
                "stored executable %s unusable (%s: %s): recompiling",
                path.name,
                type(e).__name__,
                e,
            )
            path.unlink(missing_ok=True)
            self.misses += 1
            return None
        self.hits += 1
        self.load_seconds += time.perf_counter() - t
        path.touch()  # recently used: pruned last
        return exe

    def save(self, key: str, compiled, label: str = "") -> None:
        try:
            blob, in_tree, out_tree = serialize(compiled)
            device_ids = [d.id for d in compiled.runtime_executable().local_devices()]
            data = pickle.dumps((blob, in_tree, out_tree, device_ids))
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = self._path(key).with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(data)
            tmp.replace(self._path(key))  # atomic: a reader never sees half a file
        except Exception as e:  # not serializable here, or no disk: the next start compiles
            log.warning("could not store executable %s (%s: %s)", label, type(e).__name__, e)
            self.unstored.append(f"{label}: {type(e).__name__}: {e}"[:300])
