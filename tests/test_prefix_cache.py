"""Prefix cache (issue #16): SHA-256 chained keys, and a hit only where the block really holds the
request's prefix, so a key collision, forced here by swapping the hash function, is a miss and
never another prompt's KV. Most tests drive KVCacheManager directly; one runs the real engine."""

import hashlib

import numpy as np
import pytest

from paxengine import LLM, SamplingParams, kv_cache
from paxengine.kv_cache import KVCacheManager, hash_block
from paxengine.request import Request

BS = 16


def blocks(*ids) -> list[int]:
    """A prompt made of full blocks, block k filled with token ids[k] (plus one last token)."""
    return [t for i in ids for t in [i] * BS] + [999]


def req(tokens: list[int], name: str) -> Request:
    return Request(name, list(tokens), SamplingParams(max_tokens=4), seed=0)


def prefill(kv: KVCacheManager, r: Request) -> list[int]:
    """What the scheduler does for a new request: look up, allocate, compute, publish."""
    cached = kv.find_cached_prefix(r)
    assert kv.allocate(r, r.num_tokens - len(cached) * BS, cached)
    r.num_computed_tokens = r.num_tokens
    kv.cache_computed_blocks(r)
    return cached


def run(kv: KVCacheManager, tokens: list[int], name: str) -> list[int]:
    """Prefill and finish a request; return the cached blocks it was given."""
    r = req(tokens, name)
    cached = prefill(kv, r)
    kv.free_request(r)
    return cached


def constant_hash(parent, tokens, extra_keys=()):
    return b"collide"


def tokens_only_hash(parent, tokens, extra_keys=()):
    """Chains nothing: the same block at any position, after any prefix, has the same key."""
    return hashlib.sha256(tokens).digest()


def test_block_hash_is_sha256_chain_of_parent_tokens_and_extra_keys():
    toks = np.arange(BS, dtype="<i4").tobytes()
    h = hash_block(kv_cache.ROOT_HASH, toks)
    assert h == hashlib.sha256(kv_cache.ROOT_HASH + toks).digest() and len(h) == 32
    assert hash_block(h, toks) != h  # the parent is in the key
    assert hash_block(kv_cache.ROOT_HASH, toks, ("lora-1",)) != h
    # computed once per block and kept on the request
    kv = KVCacheManager(8, BS)
    r = req(blocks(1, 2), "a")
    kv.find_cached_prefix(r)
    assert r.block_hashes == [
        h1 := hash_block(kv_cache.ROOT_HASH, kv_cache.token_bytes([1] * BS)),
        hash_block(h1, kv_cache.token_bytes([2] * BS)),
    ]


def test_identical_prefix_hits_and_counts():
    kv = KVCacheManager(16, BS)
    assert run(kv, blocks(1, 2, 3), "a") == []
    assert (kv.prefix_queries, kv.prefix_hits) == (3 * BS + 1, 0)
    assert len(run(kv, blocks(1, 2, 3), "b")) == 3
    assert len(run(kv, blocks(1, 2, 4), "c")) == 2  # shares the first two blocks
    assert len(run(kv, blocks(5, 2, 3), "d")) == 0  # same blocks after another prefix
    assert kv.prefix_queries == 4 * (3 * BS + 1)
    assert kv.prefix_hits == 5 * BS


def test_cache_salt_shares_blocks_only_within_one_salt():
    """vLLM's cache_salt: a tenant's prompts hit only its own blocks, whatever the tokens; the
    routing hint (cached_prefix_blocks) counts as the checked lookup does."""

    def salted(tokens, name, salt):
        return Request(name, list(tokens), SamplingParams(max_tokens=4, cache_salt=salt), seed=0)

    def go(kv, r):
        cached = prefill(kv, r)
        kv.free_request(r)
        return len(cached)

    kv = KVCacheManager(32, BS)
    assert go(kv, salted(blocks(1, 2, 3), "a", "tenant-a")) == 0
    assert go(kv, salted(blocks(1, 2, 3), "b", "tenant-b")) == 0  # another tenant: no hit
    assert go(kv, salted(blocks(1, 2, 3), "c", None)) == 0  # nor a request without a salt
    assert go(kv, salted(blocks(1, 2, 4), "d", "tenant-a")) == 2  # its own prefix: a hit
    assert go(kv, req(blocks(1, 2, 3), "e")) == 3  # c's blocks, unsalted
    assert kv.cached_prefix_blocks(blocks(1, 2, 3), "tenant-a") == 3
    assert kv.cached_prefix_blocks(blocks(1, 2, 3), "tenant-z") == 0
    assert kv.cached_prefix_blocks(blocks(1, 2, 3)) == 3
    with pytest.raises(ValueError, match="cache_salt: must be a non-empty string"):
        SamplingParams(cache_salt="").validate(100)


@pytest.mark.parametrize("bad_hash", [constant_hash, tokens_only_hash])
def test_colliding_keys_never_serve_another_prompts_block(monkeypatch, bad_hash):
    monkeypatch.setattr(kv_cache, "hash_block", bad_hash)
    kv = KVCacheManager(32, BS)
    run(kv, blocks(1, 2, 3), "a")
    assert run(kv, blocks(4, 5, 6), "b") == []  # different tokens: no block at all
    assert run(kv, blocks(2, 2, 3), "c") == []  # a's second block, one level early
    assert len(run(kv, blocks(1, 2, 3), "a2")) == (1 if bad_hash is constant_hash else 3)
    if bad_hash is tokens_only_hash:
        assert len(run(kv, blocks(1, 2, 2), "f")) == 2  # a's 2 again, one level late
        run(kv, blocks(7, 6, 8), "d")
        assert len(run(kv, blocks(1, 2, 8), "e")) == 2  # a's 1, 2; not d's 8 (after 7, 6)


def test_same_content_computed_twice_keeps_the_chain_going():
    """Two requests with the same prefix prefilled side by side (both missed): the second one's
    own prefix blocks are duplicates, but its suffix is still published after the first's."""
    kv = KVCacheManager(32, BS)
    a, b = req(blocks(1, 2), "a"), req(blocks(1, 2, 3), "b")
    assert kv.find_cached_prefix(a) == kv.find_cached_prefix(b) == []
    for r in (a, b):
        assert kv.allocate(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
    kv.cache_computed_blocks(a)
    kv.cache_computed_blocks(b)
    assert run(kv, blocks(1, 2, 3), "c") == a.block_ids[:2] + [b.block_ids[2]]


def test_evicted_parent_orphans_its_child_which_gives_way():
    kv = KVCacheManager(8, BS)
    a, b = req(blocks(1, 2), "a"), req(blocks(1, 2, 3), "b")
    for r in (a, b):
        kv.find_cached_prefix(r)
        assert kv.allocate(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
        kv.cache_computed_blocks(r)
    b3 = b.block_ids[2]  # published after a's blocks 1, 2
    kv.free_request(a)
    # 1 free block, then a's 3 (its first two go last): a 4-block request evicts them all
    big = req(blocks(7, 7, 7), "big")
    prefill(kv, big)
    assert kv.entry_of[b3] is not None and kv.num_free_blocks == 0
    kv.free_request(big)
    kv.free_request(b)
    assert run(kv, blocks(1, 2, 3), "c") == []  # 1 and 2 were evicted
    # c republished 1, 2, 3; b's orphaned 3 gave its key up, so the chain is whole again
    assert kv.entry_of[b3] is None
    assert len(run(kv, blocks(1, 2, 3), "d")) == 3


def test_reset_prefix_cache_refused_while_blocks_are_held():
    kv = KVCacheManager(16, BS)
    run(kv, blocks(1, 2), "a")
    holder = req(blocks(5), "holder")
    prefill(kv, holder)
    queries, hits = kv.prefix_queries, kv.prefix_hits
    assert kv.reset_prefix_cache() is False  # refused: nothing changes
    assert len(run(kv, blocks(1, 2), "b")) == 2
    kv.free_request(holder)
    assert kv.reset_prefix_cache() is True
    assert not kv.cached and all(e is None for e in kv.entry_of)
    assert kv.prefix_hits == hits + 2 * BS and kv.prefix_queries > queries  # counters stay
    assert run(kv, blocks(1, 2), "c") == []
    assert len(run(kv, blocks(1, 2), "d")) == 2  # and caching works again


def test_engine_with_colliding_hash_matches_prefix_caching_off(smollm, monkeypatch):
    """The real engine, keys chained over nothing: b shares a's first two blocks, and its third
    block's key is that of c's third block, computed after other tokens. b must get exactly a's
    two blocks, and produce what it produces with prefix caching off."""
    monkeypatch.setattr(kv_cache, "hash_block", tokens_only_hash)
    llm = LLM(
        max_model_len=128,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        block_size=BS,
        token_buckets=[8, 64],
        seq_buckets=[2],
        show_progress=False,
    )
    rng = np.random.default_rng(0)
    u, v, w, x, y, z, tail = (rng.integers(100, 40000, size=BS).tolist() for _ in range(7))
    a, b, c = v + x + y + tail[:5], v + x + z + tail[:5], w + u + z + tail[:5]
    params = SamplingParams(temperature=0, max_tokens=4)

    def gen(ids):
        return llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]

    llm.engine.kv.enable_prefix_caching = False
    b_off = gen(b)
    assert b_off.num_cached_tokens == 0
    llm.engine.kv.enable_prefix_caching = True
    gen(a)
    gen(c)
    b_on = gen(b)
    assert b_on.num_cached_tokens == 2 * BS
    assert b_on.outputs[0].token_ids == b_off.outputs[0].token_ids


def test_a_request_waiting_for_blocks_is_counted_once():
    """The scheduler looks a waiting request up again every step until it fits; the hit-rate
    counters count it when it is admitted, once."""
    from paxengine.scheduler import Scheduler

    kv = KVCacheManager(4, BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256)
    big, late = req(blocks(1, 2), "big"), req(blocks(3, 4), "late")  # 3 blocks each
    sched.add(big)
    sched.add(late)
    for _ in range(5):  # big runs; late cannot get its blocks
        sched.schedule()
    assert kv.prefix_queries == big.num_prompt_tokens
    sched.finish(big, "length")
    sched.schedule()
    assert kv.prefix_queries == big.num_prompt_tokens + late.num_prompt_tokens
