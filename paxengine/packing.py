"""A step's many small host arrays as one int32 buffer, so they cross to the device in one
transfer: each host array an executable takes is a transfer of its own (on the H200, tens of
microseconds each, paid on the host while it launches the step), and a step has ~25 of them.

The layout (names, shapes, dtypes, in order) is static, part of the compiled executable; the
host packs into it (`pack`), the traced function unpacks (`unpack`: static slices, bitcasts).
int32, float32 and uint32 travel bit for bit; bool travels as 0/1.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import jax
import jax.numpy as jnp
import numpy as np

_KINDS = ("int32", "float32", "uint32", "bool")


@dataclass(frozen=True)
class PackedLayout:
    entries: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype name)

    @classmethod
    def of(cls, fields) -> "PackedLayout":
        """fields: (name, shape, dtype) triples, in the order they are packed."""
        entries = tuple((n, tuple(int(d) for d in s), np.dtype(t).name) for n, s, t in fields)
        for name, _, kind in entries:
            if kind not in _KINDS:
                raise TypeError(f"cannot pack {name} of dtype {kind}: one of {_KINDS}")
        return cls(entries)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e[0] for e in self.entries)

    @property
    def size(self) -> int:
        return sum(prod(s) for _, s, _ in self.entries)

    def pack(self, values: dict) -> np.ndarray:
        """The host arrays (by name, of the layout's shapes) -> one int32 vector."""
        out = np.empty(self.size, np.int32)
        o = 0
        for name, shape, kind in self.entries:
            x = np.asarray(values[name])
            if x.shape != shape:
                raise ValueError(f"{name}: shape {x.shape}, the layout has {shape}")
            n = x.size
            flat = x.reshape(-1)
            if kind == "bool":
                out[o : o + n] = flat
            else:
                out[o : o + n] = np.ascontiguousarray(flat, dtype=kind).view(np.int32)
            o += n
        return out

    def unpack(self, buf: jax.Array) -> dict:
        """Inside a traced function: the int32 vector -> the arrays, by name."""
        out, o = {}, 0
        for name, shape, kind in self.entries:
            n = prod(shape)
            x = jax.lax.slice(buf, (o,), (o + n,)).reshape(shape)
            if kind == "bool":
                x = x != 0
            elif kind != "int32":
                x = jax.lax.bitcast_convert_type(x, jnp.dtype(kind))
            out[name] = x
            o += n
        return out
