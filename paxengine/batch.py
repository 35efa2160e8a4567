"""Scheduled requests -> one flat, bucket-padded ragged batch (host-side numpy)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from paxengine.scheduler import SchedulerOutput


def _ladder(largest: int, smallest: int, factor: int) -> list[int]:
    out, b = [], smallest
    while b < largest:
        out.append(b)
        b *= factor
    return out + [largest]


def token_buckets(max_num_batched_tokens: int, smallest: int = 16) -> list[int]:
    return _ladder(max_num_batched_tokens, smallest, 2)


def seq_buckets(max_num_seqs: int, smallest: int = 4) -> list[int]:
    return _ladder(max_num_seqs, smallest, 4)


MAX_TOKENS_PER_ROW = 128  # a bucket (T, S) with T > 128 S is left out unless S is the largest


def bucket_pairs(tb: list[int], sb: list[int]) -> list[tuple[int, int]]:
    """(T, S) shapes to compile. A step has at least one token per sequence, so S never needs
    to exceed the smallest sequence bucket that holds T; and a step of many tokens over a few
    sequences (a long prefill) runs in the next larger S at no real cost (the extra rows only
    add sampling rows), so those small-S shapes are not compiled: fewer compiles at start-up."""
    pairs = []
    for t in tb:
        cap = sb[min(bisect.bisect_left(sb, t), len(sb) - 1)]
        pairs += [(t, s) for s in sb if s <= cap and (t <= MAX_TOKENS_PER_ROW * s or s == sb[-1])]
    return pairs


def pick(buckets: list[int], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclass
class StepArrays:
    tokens: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    block_tables: np.ndarray  # [S, P]
    seq_lens: np.ndarray  # [S]
    query_start_loc: np.ndarray  # [S+1]
    num_seqs: np.ndarray  # [1]
    # [S]: the tokens whose logits are sampled: each row's last token, or in a verify step a
    # speculating row's last k + 1 (its last known token and its k drafts), rows packed in order
    logits_indices: np.ndarray
    prev_index: np.ndarray  # [T]: row of the previous step whose sampled token goes here, or -1
    # [S]: each row's recurrent-state slot (a hybrid model's; -1: padding or none), and whether
    # the slot holds the state of the tokens before this step (0: the row starts from zeros)
    state_slots: np.ndarray | None = None
    has_state: np.ndarray | None = None
    # [S]: a prefix-cache hit's snapshot slot to start from, and the slot to keep the state
    # reached at the end of the row's chunk (-1: none); SchedulerOutput.restore / .snapshots
    restore_slots: np.ndarray | None = None
    snapshot_slots: np.ndarray | None = None

    @classmethod
    def padding(cls, T: int, S: int, P: int, num_seqs: int) -> "StepArrays":
        """A step of T tokens and S rows, all padding (slots -1, no previous-step tokens), for
        the caller to fill its `num_seqs` live rows in."""
        return cls(
            np.zeros(T, np.int32),
            np.zeros(T, np.int32),
            np.full(T, -1, np.int32),
            np.zeros((S, P), np.int32),
            np.zeros(S, np.int32),
            np.zeros(S + 1, np.int32),
            np.asarray([num_seqs], np.int32),
            np.zeros(S, np.int32),
            np.full(T, -1, np.int32),
            np.full(S, -1, np.int32),
            np.zeros(S, np.int32),
            np.full(S, -1, np.int32),
            np.full(S, -1, np.int32),
        )

    def fields(self) -> tuple:
        """(tokens, positions, slots, tables, seq_lens, query_start_loc, logits_indices,
        prev_index): the arrays a builder fills."""
        return (
            self.tokens,
            self.positions,
            self.slot_mapping,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.logits_indices,
            self.prev_index,
        )


def build_step(
    out: SchedulerOutput,
    block_size: int,
    T: int,
    S: int,
    P: int,
    prev_rows: dict[str, int] | None = None,
) -> StepArrays:
    """Call right after `out` was scheduled. prev_rows: request id -> its row in the step still on
    the device, for requests whose last scheduled token is the sample of that step (not yet on
    the host: its id is taken on the device)."""
    arrays = StepArrays.padding(T, S, P, len(out.requests))
    tokens, positions, slots, tables, seq_lens, qsl, logits_idx, prev_index = arrays.fields()
    t = r = 0  # tokens, sampled positions so far
    for row, req in enumerate(out.requests):
        n = out.num_scheduled_tokens[req.request_id]
        drafts = out.drafts.get(req.request_id, ())
        end = req.num_computed_tokens  # schedule() already counted the n as computed
        start = end - n
        known = min(end, req.num_known_tokens)  # past it: the previous step's sample
        blocks = req.block_array()
        if n == 1:  # a decode row: no per-row numpy temporaries (most rows of a big batch)
            if known > start:
                tokens[t] = req.token_slice(start, known)[0]
            positions[t] = start
            slots[t] = blocks[start // block_size] * block_size + start % block_size
        else:
            pos = np.arange(start, end, dtype=np.int32)
            tokens[t : t + known - start] = req.token_slice(start, known)
            if drafts:  # the scheduled tokens past the known ones are the drafts
                tokens[t + n - len(drafts) : t + n] = drafts
            positions[t : t + n] = pos
            slots[t : t + n] = blocks[pos // block_size] * block_size + pos % block_size
        tables[row, : len(blocks)] = blocks
        arrays.state_slots[row] = req.state_slot
        arrays.has_state[row] = start > 0
        arrays.restore_slots[row] = out.restore.get(req.request_id, -1)
        arrays.snapshot_slots[row] = out.snapshots.get(req.request_id, (0, -1))[1]
        if known < end and not drafts:
            assert known == end - 1, (req.request_id, known, end)
            prev_index[t + n - 1] = prev_rows[req.request_id]
        seq_lens[row] = end
        t += n
        qsl[row + 1] = t
        logits_idx[r : r + len(drafts) + 1] = np.arange(t - 1 - len(drafts), t)
        r += len(drafts) + 1
    qsl[len(out.requests) + 1 :] = t
    return arrays
