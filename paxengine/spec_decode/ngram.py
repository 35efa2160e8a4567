"""The n-gram proposer (prompt lookup): copy what followed the sequence's latest n-gram the
last time it occurred. Host-side numpy, no model."""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the longest suffix n-gram
    (max_n down to min_n) of `tokens`; [] when none occurred. The earliest occurrence, as vLLM's
    proposer does: in a copy-heavy request it is the source text, which has the longest run of
    tokens after it.

    One pass over the sequence finds where its last token occurred before (the candidate ends
    of a match); each further suffix token only filters those candidates, so a long context
    costs one vectorized comparison, not one per n (this runs for every speculating request on
    the critical path of a step: the engine waits for it before dispatching)."""
    a = np.asarray(tokens)
    size = len(a)
    if k < 1 or size < 2:
        return []
    cand = np.flatnonzero(a[: size - 1] == a[size - 1])  # ends of 1-gram matches, a token after
    length = 1
    while length < max_n and len(cand):
        c = cand[cand >= length]  # room for one more token before the match
        c = c[a[c - length] == a[size - 1 - length]]
        if not len(c):
            break
        cand, length = c, length + 1
    if length < min_n or not len(cand):
        return []
    start = int(cand[0]) + 1
    return a[start : start + k].tolist()
