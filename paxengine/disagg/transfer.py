"""KV pages from one runner's cache to another's on other devices, by JAX's own copies.

A transfer is a list of pieces. Each piece gathers up to `max_blocks_per_copy` pages of the
source cache into one buffer per dtype, every layer's pages stacked (a compiled gather on the
source devices: any set of pages, contiguous or not, becomes one contiguous buffer; a bf16 cache
has two, its K pages and its fp16 V pages), moves it with one `jax.device_put` onto the
destination cache's sharding (device to device: NVLink between GPUs of one host, no host copy),
and a compiled scatter writes it into the destination cache (donated, updated in place). Piece
sizes are powers of two, so a few executables per side serve every request: n pages go as its
binary decomposition (63 = 32 + 16 + 8 + 4 + 2 + 1), never padded, never one page per call.

Threads: `send` reads the source cache and must run where its engine steps (the cache is
donated to every step); `receive` likewise on the destination's. Everything is dispatched
asynchronously: the device orders the gather after the step that wrote the pages, the copy after
the gather, the scatter before the next step that reads them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from paxengine.step_build import mark_warm


class TransferFailed(RuntimeError):
    """A transfer did not happen (nothing was written on the destination)."""


@dataclass
class Piece:
    """One copy: pages [start, start + n) of a transfer, on the destination devices."""

    start: int
    n: int
    pages: tuple  # a buffer per dtype group: [layers (K or V), H, n, *page] (page: bs, D or D, bs)


@dataclass
class TransferStats:
    transfers: int = 0
    copies: int = 0
    pages: int = 0  # pages moved
    pages_skipped: int = 0  # pages the destination already held (its prefix cache)
    bytes: int = 0
    seconds: float = 0.0  # copy time, with measure_transfers only
    failures: int = 0

    def as_dict(self) -> dict:
        d = {f"kv_transfer_{k}": v for k, v in self.__dict__.items()}
        if self.seconds:
            d["kv_transfer_gb_per_s"] = self.bytes / self.seconds / 1e9
        return d


def _sizes(largest: int) -> list[int]:
    out, s = [], 1
    while s < largest:
        out.append(s)
        s *= 2
    return out + [largest]


def _replicated(leaf: jax.Array):
    """Where an index vector for this cache lives: every device of the cache."""
    s = leaf.sharding
    return NamedSharding(s.mesh, P()) if isinstance(s, NamedSharding) else s


def _abstract(tree):
    return jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree
    )


def dtype_groups(leaves) -> list[list[int]]:
    """The cache's arrays by dtype and page shape (K pages; V pages where they differ: fp16
    under a bf16 cache, [D, bs] in a 64-token fp8 one): a piece is one buffer per group, every
    layer's pages stacked on the leading axis, so an unrolled cache of 32 layers still moves as
    one or two large copies, not 64 small ones."""
    groups: dict = {}
    for i, a in enumerate(leaves):
        groups.setdefault((a.dtype, a.shape[1:2] + a.shape[3:]), []).append(i)
    return list(groups.values())


def _gather(groups, cache, idx):
    leaves = jax.tree_util.tree_leaves(cache)
    return tuple(
        jnp.concatenate([jnp.take(leaves[i], idx, axis=2) for i in g], axis=0) for g in groups
    )


def _scatter(groups, cache, buffers, idx):
    leaves, tree = jax.tree_util.tree_flatten(cache)
    new = list(leaves)
    for g, buf in zip(groups, buffers):
        start = 0
        for i in g:
            n = leaves[i].shape[0]
            # an index past the pool (a page the destination already holds) is dropped
            new[i] = leaves[i].at[:, :, idx].set(buf[start : start + n], mode="drop")
            start += n
    return jax.tree_util.tree_unflatten(tree, new)


@dataclass
class KVTransfer:
    """Moves pages from `src`'s KV cache to `dst`'s (two `Runner`s of the same model, cache
    layout and dtype; their devices may differ)."""

    src: object
    dst: object
    max_blocks_per_copy: int = 256
    measure: bool = False
    stats: TransferStats = field(default_factory=TransferStats)
    # test-only fault injection: the next this many sends / receives raise TransferFailed
    fail_sends: int = 0
    fail_receives: int = 0

    def __post_init__(self):
        s_leaves = jax.tree_util.tree_leaves(self.src.kv_cache)
        d_leaves = jax.tree_util.tree_leaves(self.dst.kv_cache)
        if [(a.shape[:2] + a.shape[3:], a.dtype) for a in s_leaves] != [
            (a.shape[:2] + a.shape[3:], a.dtype) for a in d_leaves
        ]:
            raise ValueError("KV transfer between caches of different layouts or dtypes")
        self.dst_num_blocks = d_leaves[0].shape[2]
        self.page_bytes = sum(a.nbytes // a.shape[2] for a in s_leaves)
        self.sizes = _sizes(self.max_blocks_per_copy)
        self._src_idx = _replicated(s_leaves[0])
        self._dst_idx = _replicated(d_leaves[0])
        groups = dtype_groups(s_leaves)
        # a piece's buffers: [sum of the group's leading axes, H, n, *page] each, placed
        # as the group's first cache array is (split by KV head under tensor parallelism)
        self._dst_shardings = tuple(d_leaves[g[0]].sharding for g in groups)
        gather = jax.jit(
            partial(_gather, groups), out_shardings=tuple(s_leaves[g[0]].sharding for g in groups)
        )
        dst_cache_shardings = jax.tree_util.tree_map(lambda a: a.sharding, self.dst.kv_cache)
        scatter = jax.jit(
            partial(_scatter, groups), donate_argnums=0, out_shardings=dst_cache_shardings
        )
        self._gathers, self._scatters = {}, {}
        for n in self.sizes:  # every shape now: nothing compiles while serving
            idx = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self._src_idx)
            self._gathers[n] = gather.lower(_abstract(self.src.kv_cache), idx).compile()
            buffers = tuple(
                jax.ShapeDtypeStruct(
                    (sum(d_leaves[i].shape[0] for i in g), *d_leaves[g[0]].shape[1:2], n)
                    + d_leaves[g[0]].shape[3:],
                    d_leaves[g[0]].dtype,
                    sharding=sh,
                )
                for g, sh in zip(groups, self._dst_shardings)
            )
            idx = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self._dst_idx)
            self._scatters[n] = scatter.lower(_abstract(self.dst.kv_cache), buffers, idx).compile()
        # these compiles belong to start-up, not to serving (step_build.compiles_after_warmup)
        mark_warm()

    def _split(self, n: int) -> list[tuple[int, int]]:
        """[start, size) pieces covering n pages: the largest sizes first."""
        out, i = [], 0
        while i < n:
            size = max(s for s in self.sizes if s <= n - i)
            out.append((i, size))
            i += size
        return out

    def send(self, src_blocks: list[int], first: int = 0) -> list[Piece]:
        """Gather these source pages and start their copies onto the destination devices (on
        the source engine's thread); they are pages first, first + 1, ... of the transfer.
        Raises TransferFailed; the source cache is untouched."""
        if self.fail_sends:
            self.fail_sends -= 1
            self.stats.failures += 1
            raise TransferFailed("injected send failure (test hook)")
        pieces = []
        try:
            gathered = []
            for start, n in self._split(len(src_blocks)):
                idx = jax.device_put(
                    np.asarray(src_blocks[start : start + n], np.int32), self._src_idx
                )
                gathered.append((start, n, self._gathers[n](self.src.kv_cache, idx)))
            if self.measure:  # time the link alone: not the step in flight, not the gathers
                jax.block_until_ready([g[2] for g in gathered])
            t0 = time.perf_counter()
            for start, n, pages in gathered:
                pieces.append(Piece(first + start, n, jax.device_put(pages, self._dst_shardings)))
            if self.measure:
                jax.block_until_ready([p.pages for p in pieces])
                self.stats.seconds += time.perf_counter() - t0
        except Exception as e:
            self.stats.failures += 1
            raise TransferFailed(f"sending {len(src_blocks)} pages failed: {e!r}") from e
        self.stats.transfers += 1
        self.stats.copies += len(pieces)
        self.stats.pages += len(src_blocks)
        self.stats.bytes += len(src_blocks) * self.page_bytes
        return pieces

    def receive(self, pieces: list[Piece], dst_blocks: list[int]) -> None:
        """Write the pieces into the destination cache: page i of the transfer into block
        dst_blocks[i], or nowhere when that is -1 (the destination holds it already). On the
        destination engine's thread. TransferFailed: nothing was written."""
        if self.fail_receives:
            self.fail_receives -= 1
            self.stats.failures += 1
            raise TransferFailed("injected receive failure (test hook)")
        for p in pieces:
            ids = np.asarray(dst_blocks[p.start : p.start + p.n], np.int32)
            ids = np.where(ids < 0, self.dst_num_blocks, ids)
            idx = jax.device_put(ids, self._dst_idx)
            self.dst.kv_cache = self._scatters[p.n](self.dst.kv_cache, p.pages, idx)
