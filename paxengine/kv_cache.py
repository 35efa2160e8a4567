"""KV block pool with reference counts and hash-chained prefix caching (pure Python, no JAX).

A block is free when no running request references it. Free blocks that hold a full, hashed
prefix stay findable by their hash until they are reused (LRU), so a later request with the same
prefix gets them back without recomputation.

A hit must never serve another prompt's KV (issue #16, vLLM's CVE-2025-25183): the index key is a
SHA-256 chain (`hash_block`), and a hit is trusted only after checking what the block holds: its
token ids and extra keys equal the request's, and it was computed right after the block the
request matched one level up (the parent entry, by identity). So a collision of the key, found or
crafted, costs a miss, never a wrong block, whatever the hash function.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from paxengine.request import Request
from paxengine.state_snapshots import StateSnapshots

# Parent of a prompt's first block. A fixed, versioned constant rather than a per-engine random
# salt: SHA-256 needs no salt to resist crafted collisions (the hits are checked anyway), and
# stable keys let a later KV offload/transfer match blocks across processes. Change the tag if
# the encoding below changes. Per-tenant isolation, if wanted, belongs in the extra keys.
ROOT_HASH = hashlib.sha256(b"paxengine-prefix-cache-v1").digest()


def token_bytes(tokens) -> bytes:
    return np.asarray(tokens, "<i4").tobytes()  # fixed width and byte order: stable everywhere


def salt_keys(cache_salt: str | None, i: int) -> tuple:
    """Block i's extra keys for a request with this cache salt: the salt in the first block."""
    return ("cache_salt", cache_salt) if i == 0 and cache_salt is not None else ()


def hash_block(parent: bytes, tokens: bytes, extra_keys: tuple = ()) -> bytes:
    """SHA-256 of the parent block's hash, this block's token ids (`token_bytes`) and its extra
    keys. Full blocks only: the token bytes have a fixed length, so the parts cannot run into
    each other. Extra keys are ints, strings or bytes (adapter ids, multimodal content hashes),
    whose repr, unlike hash(), is the same in every process."""
    return hashlib.sha256(
        parent + tokens + (repr(extra_keys).encode() if extra_keys else b"")
    ).digest()


class _Entry:
    """A cached block: where it is, what it holds, and which cached block it was computed after."""

    __slots__ = ("block", "extra_keys", "hash", "parent", "tokens")

    def __init__(
        self, block: int, block_hash: bytes, tokens: bytes, extra_keys: tuple, parent: _Entry | None
    ):
        self.block, self.hash, self.tokens = block, block_hash, tokens
        self.extra_keys, self.parent = extra_keys, parent

    def holds(self, parent: _Entry | None, tokens: bytes, extra_keys: tuple) -> bool:
        """Whether this block is the KV of `tokens` (with `extra_keys`) right after `parent`:
        by induction from the first block, of the whole prefix."""
        return self.parent is parent and self.tokens == tokens and self.extra_keys == extra_keys


_BROKEN = object()  # a request's chain can no longer be published (see cache_computed_blocks)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_state_slots: int = 0,
        num_snapshot_slots: int = 0,
        num_verify_positions: int = 0,
    ):
        """num_state_slots: a hybrid model's recurrent layers keep one fixed-size state per
        request (vLLM's mamba state beside the attention pages): a request holds a slot from
        admission to its end (finish, abort, preemption) as it holds blocks, and is admitted
        only when both are free. 0: the model has no such layers. num_snapshot_slots: with
        prefix caching, slots after those that keep the state at cached prefixes' ends
        (state_snapshots.py); a hybrid model's cache hits need one. num_verify_positions:
        speculative decoding on a hybrid model: k slots per state slot, after the snapshots,
        that a verify step writes the states after its first k positions into
        (`position_slot`), so rejected drafts roll back by reading one of them."""
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least 1 block, got {num_blocks}")
        self.num_state_slots = num_state_slots
        self.free_slots: list[int] = list(range(num_state_slots - 1, -1, -1))  # pop() -> 0 first
        self.snapshots = (
            StateSnapshots(num_state_slots, num_snapshot_slots)
            if num_state_slots and num_snapshot_slots and enable_prefix_caching
            else None
        )
        self.verify_k = num_verify_positions
        self.first_verify_slot = num_state_slots + num_snapshot_slots
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.entry_of: list[_Entry | None] = [None] * num_blocks  # block id -> its index entry
        self.cached: dict[bytes, _Entry] = {}  # block hash -> entry
        # The last entry of each running request's published chain: the parent of its next block.
        self._tail: dict[str, _Entry | object | None] = {}
        # Free blocks in eviction order (oldest first); cached-but-free blocks are in here too.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found cached

    # -- figures --------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (cached-but-unreferenced count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ---------------------------------------------------------------------------
    def _extra_keys(self, req: Request, i: int) -> tuple:
        """What besides the tokens decides who may share block i's KV (a LoRA adapter, the images
        it covers): a tenant's cache salt, in the first block (the chain carries it to the rest).
        Goes into the hash and is checked on a hit."""
        return salt_keys(req.params.cache_salt, i)

    def _token_bytes(self, req: Request, start: int, stop: int) -> bytes:
        """Token ids of full blocks [start, stop), as `token_bytes`."""
        return token_bytes(req.token_slice(start * self.block_size, stop * self.block_size))

    def _hashes(self, req: Request, num_full_blocks: int) -> list[bytes]:
        """The request's block hashes, each computed once and kept in req.block_hashes."""
        hashes = req.block_hashes
        start = len(hashes)
        if start < num_full_blocks:
            buf, w = self._token_bytes(req, start, num_full_blocks), 4 * self.block_size
            parent = hashes[-1] if hashes else ROOT_HASH
            for i in range(start, num_full_blocks):
                j = (i - start) * w
                parent = hash_block(parent, buf[j : j + w], self._extra_keys(req, i))
                hashes.append(parent)
        return hashes

    def _live(self, e: _Entry) -> bool:
        return self.entry_of[e.block] is e

    def _unindex(self, e: _Entry) -> None:
        del self.cached[e.hash]
        self.entry_of[e.block] = None
        if self.snapshots is not None:
            self.snapshots.drop_block(e.block)
        e.parent = None  # a dead entry keeps no chain alive

    def _lookup(self, h: bytes) -> _Entry | None:
        e = self.cached.get(h)
        if e is not None and e.parent is not None and not self._live(e.parent):
            self._unindex(e)  # its parent was evicted: no lookup can reach it again
            return None
        return e

    def cached_prefix_blocks(self, token_ids, cache_salt: str | None = None) -> int:
        """How many leading full blocks of `token_ids` (a request with `cache_salt`) this cache
        holds, by key only: a routing hint for another thread (reads the index, changes
        nothing; `find_cached_prefix` is the checked lookup the scheduler uses)."""
        if not self.enable_prefix_caching:
            return 0
        w = self.block_size
        buf, parent, n = token_bytes(list(token_ids)[: len(token_ids) // w * w]), ROOT_HASH, 0
        for i in range(len(token_ids) // w):
            parent = hash_block(parent, buf[4 * w * i : 4 * w * (i + 1)], salt_keys(cache_salt, i))
            if self.cached.get(parent) is None:
                break
            n += 1
        return n

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the request (at least one token is always
        left to compute, so the step still produces logits). A block whose key matches is taken
        only if it holds the request's tokens and follows the block taken one level up."""
        if not self.enable_prefix_caching:
            return []
        n_full = (req.num_tokens - 1) // self.block_size
        candidates = []
        for h in self._hashes(req, n_full)[:n_full]:
            e = self._lookup(h)
            if e is None:
                break
            candidates.append(e)
        found, parent = [], None
        if candidates:  # the token copy only when there is something to check
            buf, w = self._token_bytes(req, 0, len(candidates)), 4 * self.block_size
            for i, e in enumerate(candidates):
                if not e.holds(parent, buf[i * w : (i + 1) * w], self._extra_keys(req, i)):
                    break
                found.append(e.block)
                parent = e
        if self.snapshots is not None:  # a hybrid model resumes only where a state was kept
            while found and self.snapshots.of(found[-1]) is None:
                found.pop()
        return found

    def position_slot(self, req: Request, p: int) -> int:
        """Where a verify step left the state after position p < k of the request's row (the
        layout the model's forward writes: models/gated_deltanet.verify_slots)."""
        assert 0 <= p < self.verify_k and req.state_slot >= 0, (p, req.state_slot)
        return self.first_verify_slot + req.state_slot * self.verify_k + p

    def restore_slot(self, cached_blocks: list[int]) -> int:
        """The snapshot slot a hit on these blocks starts its recurrent state from, or -1."""
        if self.snapshots is None or not cached_blocks:
            return -1
        return self.snapshots.of(cached_blocks[-1])

    def bind_snapshot(self, req: Request, boundary: int, slot: int) -> None:
        """The step that wrote `slot` (req's state after `boundary` tokens) is done: bind it
        to the block ending there, if that block is cached; else the slot goes back."""
        i = boundary // self.block_size - 1
        e = self.entry_of[req.block_ids[i]] if i < len(req.block_ids) else None
        if e is not None and self._live(e):
            self.snapshots.bind(e.block, slot)
        else:
            self.snapshots.release(slot)

    def cache_computed_blocks(self, req: Request) -> None:
        """Publish the request's newly completed full blocks under their chain hash.

        A block whose key is already taken by the same content (another request computed it at
        the same time) is not published again; the chain goes on through that entry. A key taken
        by other content (a collision) ends the request's publishing: its later blocks would
        hang off a block no lookup can match."""
        if not self.enable_prefix_caching:
            return
        # Only blocks whose token ids the host has: a sample fed from the device is not hashed yet.
        computed = min(req.num_computed_tokens, req.num_known_tokens)
        n_full = min(computed // self.block_size, len(req.block_ids))
        start = req.num_published_blocks
        if n_full <= start:  # nothing new: O(1) for most decode steps
            return
        hashes = self._hashes(req, n_full)
        parent = self._tail.get(req.request_id) if start else None
        if parent is not None and parent is not _BROKEN and not self._live(parent):
            parent = _BROKEN  # it followed another request's block, since evicted
        if parent is not _BROKEN:
            buf, w = self._token_bytes(req, start, n_full), 4 * self.block_size
            for i in range(start, n_full):
                tokens, extra = buf[(i - start) * w : (i - start + 1) * w], self._extra_keys(req, i)
                e = self._lookup(hashes[i])
                if e is None:
                    b = req.block_ids[i]
                    if self.entry_of[b] is not None:  # cannot happen: a hit is found by this key
                        parent = _BROKEN
                        break
                    e = _Entry(b, hashes[i], tokens, extra, parent)
                    self.cached[e.hash] = self.entry_of[b] = e
                elif not e.holds(parent, tokens, extra):
                    parent = _BROKEN
                    break
                parent = e
        self._tail[req.request_id] = parent
        req.num_published_blocks = n_full

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (e.g. after a weight update made the cached KV stale).

        As in vLLM, refused while any block is held by a request: returns False and changes
        nothing. A running request's blocks, and every block it would publish later, hold KV
        computed from the state the reset is meant to discard; call it when the engine is idle.
        The hit counters stay: they are monotonic (Prometheus counters)."""
        if len(self.free) != self.num_blocks:
            return False
        self.cached.clear()
        if self.snapshots is not None:
            self.snapshots.clear()
        self.entry_of = [None] * self.num_blocks
        self._tail.clear()
        return True

    # -- allocation -----------------------------------------------------------------------------
    def _take(self, b: int) -> None:
        if self.ref_counts[b] == 0:
            del self.free[b]
        self.ref_counts[b] += 1

    def _pop_free(self) -> int:
        b, _ = self.free.popitem(last=False)
        e = self.entry_of[b]
        if e is not None:  # evict: its contents are about to be overwritten
            self._unindex(e)
        self.ref_counts[b] = 1
        return b

    def allocate(self, req: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after any cached prefix).
        All or nothing: returns False, changing nothing, when the pool is too small."""
        total = req.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(req.block_ids) - len(cached_blocks)
        new_slot = self.num_state_slots > 0 and req.state_slot < 0
        if new_slot and not self.free_slots:
            return False
        if need <= 0 and not cached_blocks and not new_slot:
            return True  # most decode steps: the last block has room
        # Cached blocks taken from the free list do not count as free for the new ones.
        revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        if need > len(self.free) - revived:
            return False
        if self.enable_prefix_caching and not req.block_ids:  # admitted now: count its lookup
            self.prefix_queries += req.num_prompt_tokens
            self.prefix_hits += min(len(cached_blocks) * self.block_size, req.num_prompt_tokens)
        for b in cached_blocks:
            self._take(b)
        if new_slot:
            req.state_slot = self.free_slots.pop()
        req.block_ids.extend(cached_blocks)
        req.block_ids.extend(self._pop_free() for _ in range(max(need, 0)))
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free the request's blocks past the first `num_tokens` tokens (speculative decoding:
        blocks that held only rejected drafts). Such blocks were never published (they hold no
        known token), so they go back to the front of the free list: reused first."""
        keep = self.blocks_needed(num_tokens)
        if len(req.block_ids) <= keep:
            return
        for b in reversed(req.block_ids[keep:]):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free[b] = None
                self.free.move_to_end(b, last=False)
        del req.block_ids[keep:]
        req._block_array = None  # a re-grown list of the same length must not meet a stale copy

    def free_request(self, req: Request) -> None:
        # Reverse order: a request's tail blocks are evicted before its (more shareable) head.
        for b in reversed(req.block_ids):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free[b] = None
        req.clear_blocks()
        if req.state_slot >= 0:  # a preempted request starts its state again from zeros
            self.free_slots.append(req.state_slot)
            req.state_slot = -1
        req.state_restore = -1
        self._tail.pop(req.request_id, None)
