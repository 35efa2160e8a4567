"""Chained n-gram verify steps: verify step N+1 is built and launched while step N runs.

A verify step read before the next is built leaves the device idle while the host launches
(~1.5 ms of an 8B batch-1 step on the H200: benchmarks/results/gpu_2026-12-02_spec_launch/).
Chaining keeps plain decoding's overlap. When step N+1 is built the host knows each request's
tokens up to step N - 1 and N's drafts, but not how many of them N accepts. So the host sends
the known tokens and N's drafts, and the device, from N's samples (`prev_tokens`):
- counts N's accepted drafts a (leading drafts equal to the target's samples, the rule of
  `sampling.verify_drafts`) and takes N's correction or bonus token c = sample a;
- extends the history by the accepted drafts and c, and runs the n-gram lookup of
  `ngram.propose_ngram` on it (`ngram_drafts`, the same proposals: greedy and seeded outputs
  equal the unchained engine's);
- lays out the row [c, drafts] at positions L + a ..., its KV slots from the block table, its
  sequence length, and the sampler's key offset a for each of its rows.
On a model with recurrent layers (Qwen3.5) a row also starts from the state N left after its last
accepted token (`chained_states`): N's position slot a when N rejected a draft, else its home slot.
Every chained row has exactly K drafts (fixed shapes): when the lookup finds fewer, the rest are
-1 (never accepted; token 0 is computed in their place and rolled back like any rejected draft).
The forward returns the drafts it made, which the host reads with the step's samples, and which
the next chained step reads on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from paxengine.packing import PackedLayout


@dataclass(frozen=True)
class ChainSpec:
    """What a runner compiles chained steps for: K drafts a row, at most `rows` requests."""

    k: int
    rows: int
    min_n: int
    max_n: int
    # a model with recurrent layers: the runner's verify_span (first per-position state slot,
    # K + 1), from which each chained row's starting state slot is found (`chained_states`)
    verify_span: tuple[int, int] | None = None

    def rows_in(self, T: int, S: int) -> int:
        """Requests a chained step of bucket (T, S) holds: each takes K + 1 tokens and rows."""
        return min(self.rows, T // (self.k + 1), S // (self.k + 1))


def chain_layout(chain: ChainSpec, T: int, S: int, P: int, H: int) -> PackedLayout:
    """A chained step's host inputs (one int32 vector). Per request r: base_len (its known
    tokens L), src (its first sample row in step N), prev_k (N's drafts: K if N was chained),
    prev_row (its row in N's device drafts when N was chained, else -1: host_drafts holds them),
    hist (its known tokens, -1 padded); with recurrent layers state_slot (its home slot)."""
    R, K = chain.rows_in(T, S), chain.k
    states = [("state_slot", (R,), np.int32)] if chain.verify_span is not None else []
    return PackedLayout.of(
        states
        + [
            ("block_tables", (S, P), np.int32),
            ("num_seqs", (1,), np.int32),
            ("base_len", (R,), np.int32),
            ("src", (R,), np.int32),
            ("prev_k", (R,), np.int32),
            ("prev_row", (R,), np.int32),
            ("host_drafts", (R, K), np.int32),
            ("hist", (R, H), np.int32),
        ]
    )


def ngram_drafts(hist, length, min_n: int, max_n: int, k: int):
    """propose_ngram for every row at once, on the device: hist [R, H] (a row's first `length`
    entries are its tokens), -> [R, k] drafts, -1 past what the lookup found.

    Per candidate end i (i <= length - 2, a token after it), m_i is how many of the sequence's
    last tokens (up to max_n) match the ones ending at i. The proposal follows the earliest i with
    the largest m_i, when that m_i >= min_n: what propose_ngram's candidate filtering finds."""
    R, H = hist.shape
    i = jnp.arange(H)[None, :]
    last = length[:, None] - 1
    run = jnp.ones((R, H), bool)
    m = jnp.zeros((R, H), jnp.int32)
    for j in range(max_n):
        shifted = jnp.pad(hist, ((0, 0), (j, 0)), constant_values=-2)[:, :H]  # hist[i - j]
        target = jnp.take_along_axis(hist, jnp.maximum(last - j, 0), axis=1)  # hist[len-1-j]
        run = run & (i - j >= 0) & (last - j >= 0) & (shifted == target)
        m = m + run
    m = jnp.where(i <= length[:, None] - 2, m, 0)
    best = jnp.max(m, axis=1)
    found = best >= max(min_n, 1)
    start = jnp.argmax(m >= jnp.maximum(best, 1)[:, None], axis=1) + 1
    idx = start[:, None] + jnp.arange(k)[None, :]
    drafts = jnp.take_along_axis(hist, jnp.minimum(idx, H - 1), axis=1)
    return jnp.where(found[:, None] & (idx < length[:, None]), drafts, -1)


def chained_inputs(x: dict, prev_tokens, prev_drafts, chain: ChainSpec, block_size: int, T, S):
    """The device side of a chained step (see the module's doc). x: chain_layout's arrays.
    -> (tokens [T], positions [T], slots [T], seq_lens [S], query_start_loc [S + 1],
    logits_indices [S], key shift [S], drafts [chain.rows, K], the recurrent layers' step
    inputs or None)."""
    K, R = chain.k, x["base_len"].shape[0]
    rows = x["num_seqs"][0]
    live = jnp.arange(R) < rows
    L = x["base_len"]
    # step N's drafts: from its forward (chained) or the host (built from known tokens)
    from_dev = prev_drafts[jnp.maximum(x["prev_row"], 0)]
    d_prev = jnp.where(x["prev_row"][:, None] >= 0, from_dev, x["host_drafts"])
    samples = prev_tokens[jnp.clip(x["src"][:, None] + jnp.arange(K + 1), 0, len(prev_tokens) - 1)]
    match = (samples[:, :K] == d_prev) & (jnp.arange(K)[None, :] < x["prev_k"][:, None])
    a = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    c = jnp.take_along_axis(samples, a[:, None], axis=1)[:, 0]
    # the history as N leaves it: the known tokens, the accepted drafts, c
    H = x["hist"].shape[1]
    col = jnp.arange(H)[None, :]
    drafted = jnp.take_along_axis(d_prev, jnp.clip(col - L[:, None], 0, K - 1), axis=1)
    hist = jnp.where((col >= L[:, None]) & (col < (L + a)[:, None]), drafted, x["hist"])
    hist = jnp.where(col == (L + a)[:, None], c[:, None], hist)
    drafts = ngram_drafts(hist, L + a + 1, chain.min_n, chain.max_n, K)
    drafts = jnp.where(live[:, None], drafts, -1)
    # the rows: [c, drafts] at positions L + a + j, packed request after request
    n = R * (K + 1)
    row_tokens = jnp.concatenate([c[:, None], jnp.maximum(drafts, 0)], axis=1).reshape(n)
    row_pos = ((L + a)[:, None] + jnp.arange(K + 1)[None, :]).reshape(n)
    owner = jnp.repeat(jnp.arange(R), K + 1)
    block = x["block_tables"][owner, row_pos // block_size]
    row_slots = jnp.where(live[owner], block * block_size + row_pos % block_size, -1)
    tokens = jnp.zeros(T, jnp.int32).at[:n].set(jnp.where(live[owner], row_tokens, 0))
    positions = jnp.zeros(T, jnp.int32).at[:n].set(jnp.where(live[owner], row_pos, 0))
    slots = jnp.full(T, -1, jnp.int32).at[:n].set(row_slots)
    seq_lens = jnp.zeros(S, jnp.int32).at[:R].set(jnp.where(live, L + a + K + 1, 0))
    qsl = jnp.minimum(jnp.arange(S + 1), rows) * (K + 1)
    s = jnp.arange(S)
    sampled = s < rows * (K + 1)
    logits_indices = jnp.where(sampled, s, 0)
    shift = jnp.where(sampled, a[jnp.minimum(s // (K + 1), R - 1)], 0)
    out = jnp.full((chain.rows, K), -1, jnp.int32).at[:R].set(drafts)
    step = chained_states(x, a, live, chain, qsl, S) if chain.verify_span is not None else None
    return tokens, positions, slots, seq_lens, qsl, logits_indices, shift, out, step


def chained_states(x: dict, a, live, chain: ChainSpec, qsl, S: int) -> dict:
    """A hybrid's state inputs of a chained step (models/qwen3_5.forward_step's `step`): each
    row starts from the state N left after its last accepted token, which is N's position slot
    a (kv_cache.KVCacheManager.position_slot) when a < N's drafts, else the home slot (all
    accepted, or none drafted): the slot Scheduler._settle_drafts / _settle_chained have the
    next unchained step restore. Chained rows decode (a state each) and keep no snapshot."""
    first, P = chain.verify_span
    R = a.shape[0]
    home = x["state_slot"]
    restore = jnp.where(live & (a < x["prev_k"]), first + home * (P - 1) + a, -1)

    def rows(v, fill):
        return jnp.full(S, fill, jnp.int32).at[:R].set(v.astype(jnp.int32))

    return {
        "query_start_loc": qsl,
        "state_slots": rows(jnp.where(live, home, -1), -1),
        "has_state": rows(live, 0),
        "restore_slots": rows(restore, -1),
        "snapshot_slots": jnp.full(S, -1, jnp.int32),
        "verify_span": chain.verify_span,
    }


def build_chained(out, prev_out, prev_rows: dict[str, int], chain: ChainSpec, T, S, P, H):
    """The host side: chain_layout's arrays for `out` (Scheduler.schedule_chained's step), whose
    requests all have step `prev_out` in flight (prev_rows: their first sample rows there)."""
    R, K = chain.rows_in(T, S), chain.k
    tables = np.zeros((S, P), np.int32)
    base_len, src = np.zeros(R, np.int32), np.zeros(R, np.int32)
    prev_k, prev_row = np.zeros(R, np.int32), np.full(R, -1, np.int32)
    host_drafts = np.full((R, K), -1, np.int32)
    hist = np.full((R, H), -1, np.int32)
    prev_index = {r.request_id: i for i, r in enumerate(prev_out.requests)}
    homes = np.full(R, -1, np.int32)
    for r, req in enumerate(out.requests):
        rid = req.request_id
        blocks, known = req.block_array(), req.token_array()
        tables[r, : len(blocks)] = blocks
        homes[r] = req.state_slot
        base_len[r] = len(known)
        hist[r, : len(known)] = known
        src[r] = prev_rows[rid]
        if prev_out.chained:
            prev_k[r], prev_row[r] = K, prev_index[rid]
        else:
            d = prev_out.drafts.get(rid, ())
            prev_k[r] = len(d)
            host_drafts[r, : len(d)] = d
    values = {
        "block_tables": tables,
        "num_seqs": np.asarray([len(out.requests)], np.int32),
        "base_len": base_len,
        "src": src,
        "prev_k": prev_k,
        "prev_row": prev_row,
        "host_drafts": host_drafts,
        "hist": hist,
    }
    if chain.verify_span is not None:
        values["state_slot"] = homes
    return values
