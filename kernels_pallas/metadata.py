"""Step metadata shared by the reference and the Pallas kernels (see ARCHITECTURE.md)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """int32 arrays describing one ragged step (T tokens, S sequence slots, P pages per slot).

    slot_mapping[T]      block * block_size + offset of each token's K/V; -1 = padding (no write)
    block_tables[S, P]   physical block ids of each sequence
    seq_lens[S]          KV length of each sequence including this step's tokens; 0 for padding
    query_start_loc[S+1] cumulative query lengths; rows past num_seqs repeat the last value
    num_seqs[1]          live sequences
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    query_start_loc: jax.Array
    num_seqs: jax.Array


jax.tree_util.register_dataclass(
    AttentionMetadata,
    data_fields=["slot_mapping", "block_tables", "seq_lens", "query_start_loc", "num_seqs"],
    meta_fields=[],
)


def token_to_seq(md: AttentionMetadata, num_tokens: int):
    """Per flat token: (sequence index, position in the sequence, valid flag)."""
    qsl = md.query_start_loc
    num_seqs = md.num_seqs[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    # sequence s owns tokens [qsl[s], qsl[s+1]): count the end offsets <= t. (Written as a
    # compare-and-sum: jnp.searchsorted's default 'scan' method is a while loop, which on a GPU
    # costs a host round trip per iteration, ~100+ us per call.)
    seq = count_le(qsl[1:], t)
    seq = jnp.minimum(seq, md.seq_lens.shape[0] - 1)
    valid = (t < qsl[num_seqs]) & (seq < num_seqs)
    q_len = qsl[seq + 1] - qsl[seq]
    pos = md.seq_lens[seq] - q_len + (t - qsl[seq])
    return seq, pos, valid


def count_le(sorted_vals, x):
    """searchsorted(sorted_vals, x, side='right') as one parallel compare-and-sum (no loop)."""
    return jnp.sum(sorted_vals[None, :] <= x[:, None], axis=1, dtype=jnp.int32)


def live_query_lens(md: AttentionMetadata, min_q_len: int = 1):
    """[S] query tokens of each live sequence slot; 0 for slots past num_seqs and (min_q_len > 1)
    for sequences with fewer than min_q_len of them."""
    qsl = md.query_start_loc
    live = jnp.arange(md.seq_lens.shape[0], dtype=jnp.int32) < md.num_seqs[0]
    q_lens = jnp.where(live, qsl[1:] - qsl[:-1], 0)
    return q_lens if min_q_len <= 1 else jnp.where(q_lens >= min_q_len, q_lens, 0)
