"""KV block pool with reference counts and hash-chained prefix caching (pure Python, no JAX).

A block is free when no running request references it. Free blocks that hold a full, hashed
prefix stay findable by their hash until they are reused (LRU), so a later request with the same
prefix gets them back without recomputation.
"""
from __future__ import annotations

from collections import OrderedDict

from paxengine.request import Request


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}                     # hash -> block id
        # Free blocks in eviction order (oldest first); cached-but-free blocks are in here too.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.prefix_queries = 0      # prompt tokens looked up
        self.prefix_hits = 0         # prompt tokens found cached

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
    def _hashes(self, req: Request, num_full_blocks: int) -> list[int]:
        hashes = req.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else None,
                                     tuple(req.token_slice(i * bs, (i + 1) * bs))))
        return hashes

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the request (at least one token is always
        left to compute, so the step still produces logits)."""
        if not self.enable_prefix_caching:
            return []
        n_full = (req.num_tokens - 1) // self.block_size
        found = []
        for h in self._hashes(req, n_full)[:n_full]:
            b = self.cached.get(h)
            if b is None:
                break
            found.append(b)
        self.prefix_queries += req.num_prompt_tokens
        self.prefix_hits += min(len(found) * self.block_size, req.num_prompt_tokens)
        return found

    def cache_computed_blocks(self, req: Request) -> None:
        """Publish the request's newly completed full blocks under their chain hash."""
        if not self.enable_prefix_caching:
            return
        # Only blocks whose token ids the host has: a sample fed from the device is not hashed yet.
        computed = min(req.num_computed_tokens, req.num_known_tokens)
        n_full = min(computed // self.block_size, len(req.block_ids))
        if n_full <= req.num_published_blocks:    # nothing new: O(1) for most decode steps
            return
        hashes = self._hashes(req, n_full)
        for i in range(req.num_published_blocks, n_full):
            b, h = req.block_ids[i], hashes[i]
            if self.block_hash[b] is None and h not in self.cached:
                self.block_hash[b] = h
                self.cached[h] = b
        req.num_published_blocks = n_full

    # -- allocation -----------------------------------------------------------------------------
    def _take(self, b: int) -> None:
        if self.ref_counts[b] == 0:
            del self.free[b]
        self.ref_counts[b] += 1

    def _pop_free(self) -> int:
        b, _ = self.free.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:                      # evict: its contents are about to be overwritten
            del self.cached[h]
            self.block_hash[b] = None
        self.ref_counts[b] = 1
        return b

    def allocate(self, req: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after any cached prefix).
        All or nothing: returns False, changing nothing, when the pool is too small."""
        total = req.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(req.block_ids) - len(cached_blocks)
        if need <= 0 and not cached_blocks:
            return True                        # most decode steps: the last block has room
        # Cached blocks taken from the free list do not count as free for the new ones.
        revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        if need > len(self.free) - revived:
            return False
        for b in cached_blocks:
            self._take(b)
        req.block_ids.extend(cached_blocks)
        req.block_ids.extend(self._pop_free() for _ in range(max(need, 0)))
        return True

    def free_request(self, req: Request) -> None:
        # Reverse order: a request's tail blocks are evicted before its (more shareable) head.
        for b in reversed(req.block_ids):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free[b] = None
        req.clear_blocks()

    def reset_prefix_cache(self) -> None:
        for h, b in list(self.cached.items()):
            self.block_hash[b] = None
        self.cached.clear()
