"""The n-gram proposer (prompt lookup): copy what followed the sequence's latest n-gram the
last time it occurred. Host-side numpy, O(length x n) per call, no model."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the longest suffix n-gram
    (max_n down to min_n) of `tokens`; [] when none occurred. The earliest occurrence, as vLLM's
    proposer does: in a copy-heavy request it is the source text, which has the longest run of
    tokens after it."""
    a = np.asarray(tokens, dtype=np.int64)
    size = len(a)
    if k < 1:
        return []
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # windows that end before the last token, so at least one token follows each
        windows = sliding_window_view(a[: size - 1], n)
        hits = np.flatnonzero((windows == a[size - n :]).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return a[start : min(start + k, size)].tolist()
    return []
