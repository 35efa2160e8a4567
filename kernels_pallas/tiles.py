"""Query tiles of a ragged batch: which tokens of which sequence each program of a launch
takes, for the Triton kernel, the Mosaic decode kernel and the XLA path.

A tile is up to `block_q` consecutive query tokens of ONE sequence. Its metadata is computed
with a few jnp ops outside the kernels; the number of tiles a launch has is static (from the
bucket shape, `tile_count`), and the data decides which of them hold tokens (unused tiles
have 0 and their programs exit at once). The Mosaic prefill kernel tiles differently (128
rows on an 8-row grid): `attention_mgpu.mosaic_tile_metadata`.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.metadata import AttentionMetadata, count_le, live_query_lens


def tile_count(T: int, S: int, block_q: int) -> int:
    """Tiles of up to block_q tokens of one sequence that any ragged batch of T tokens in S
    sequence slots can need (see tile_metadata)."""
    return max(1, min(T, -(-(T + S * (block_q - 1)) // block_q)))


def tile_metadata(
    md: AttentionMetadata,
    num_tokens: int,
    block_q: int,
    num_tiles: int,
    pad_tiles: bool = False,
    min_q_len: int = 1,
):
    """[num_tiles, 8] int32: seq, first token, tokens in tile, first position, kv_len, 0, 0, 0.

    Unused tiles have 0 tokens. Sequences with fewer than `min_q_len` query tokens get no tile.
    pad_tiles=True (the kernel): tiles past the live sequences' tiles cover the padding tokens
    [qsl[num_seqs], T) with kv_len 0: their programs run no KV step and store zeros, so every
    output row is written by the kernel (no masking pass afterwards). There are always enough of
    them: with
    num_tiles = cdiv(T + S (block_q - 1), block_q) the unused tiles span >= T - live tokens rows;
    with num_tiles = T, each used tile holds >= 1 live token.
    """
    qsl = md.query_start_loc
    S = md.seq_lens.shape[0]
    q_lens = live_query_lens(md, min_q_len)
    n_tiles = (q_lens + block_q - 1) // block_q
    cum = jnp.cumsum(n_tiles)
    j = jnp.arange(num_tiles, dtype=jnp.int32)
    s = jnp.minimum(count_le(cum, j), S - 1)
    local = j - (cum[s] - n_tiles[s])
    valid = j < cum[-1]
    q_start = qsl[s] + local * block_q
    q_len = jnp.clip(qsl[s] + q_lens[s] - q_start, 0, block_q)
    kv_len = md.seq_lens[s]
    pos0 = kv_len - q_lens[s] + local * block_q
    if not pad_tiles:
        q_start = jnp.where(valid, q_start, 0)
        q_len = jnp.where(valid, q_len, 0)
        z = jnp.zeros_like(j)
        return jnp.stack([s, q_start, q_len, pos0, kv_len, z, z, z], axis=1).astype(jnp.int32)
    n_live = qsl[md.num_seqs[0]]
    pad_start = n_live + (j - cum[-1]) * block_q
    q_start = jnp.where(valid, q_start, jnp.minimum(pad_start, num_tokens))
    q_len = jnp.where(valid, q_len, jnp.clip(num_tokens - pad_start, 0, block_q))
    pos0 = jnp.where(valid, pos0, 0)
    kv_len = jnp.where(valid, kv_len, 0)
    z = jnp.zeros_like(j)
    return jnp.stack([s, q_start, q_len, pos0, kv_len, z, z, z], axis=1).astype(jnp.int32)


def decode_tile_metadata(md: AttentionMetadata, block_q: int):
    """[S, 8] like tile_metadata: one tile per sequence slot holding all of its query tokens if
    it has at most block_q of them (decode), else none (0 tokens)."""
    qsl = md.query_start_loc
    S = md.seq_lens.shape[0]
    s = jnp.arange(S, dtype=jnp.int32)
    q_lens = live_query_lens(md)
    q_len = jnp.where(q_lens <= block_q, q_lens, 0)
    z = jnp.zeros_like(s)
    return jnp.stack(
        [s, qsl[:-1], q_len, md.seq_lens - q_lens, md.seq_lens, z, z, z], axis=1
    ).astype(jnp.int32)
