"""Prompt logprobs (vLLM's `prompt_logprobs`; a completion's `echo` with `logprobs`): for every
prompt position i >= 1, the raw log-softmax at token i of the logits at position i - 1, its rank
and the top N, computed on the device for the steps whose rows ask.

How (ARCHITECTURE.md, "Prompt logprobs"): a runner built with `prompt_logprobs` returns the
step's final hidden states [T, H] beside its sampled logits; when a step holds prompt tokens of
a request that asked, the engine runs one more executable per token bucket (`device_values`,
compiled at start-up) over those hidden states and the step's targets ([T]: the next prompt
token of each position, -1 where nothing is asked), and reads its packed result with the
samples. The logits are made `CHUNK_ELEMENTS` at a time, in chunks of rows over the whole
vocabulary (the family's own `compute_logits`, so a tied head, FP8 or a sharded head need
nothing new here), so a 2048-token step over a 152k vocabulary never holds all its logits.
On the host, `StepTargets` lays out a step's targets and `PromptLogprobs` keeps a prompt's
values as its chunks are read (a chunked prefill fills it chunk by chunk; a preempted request
computes its prompt again and writes the same values again) and shapes them as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from paxengine.outputs import Logprob

CHUNK_ELEMENTS = 1 << 24  # float32 logits a chunk holds: 64 MiB


def device_values(logits_fn, hidden: jax.Array, targets: jax.Array, vocab_size: int, n_top: int):
    """hidden [T, H] (the model's final normed states), targets [T] int32 (-1: not asked) ->
    one int32 vector: the target's logprob [T] (bits), its rank [T] (1 + the number of tokens
    with a larger logit), the top n_top ids [T, n_top] and their logprobs (bits). Rows without a
    target carry the values of token 0 (nobody reads them). The chunks run in a scan: as
    unrolled slices XLA kept every chunk's logits alive at once (a 4,096-token step over a
    49,152 vocabulary: 1.6 GB of temporaries on the CPU, 0.19 GB in a scan; on an H100, 7.9 GiB
    at 8,192 tokens over Qwen3.5's 248,320, and the start-up ran out of memory)."""
    T = hidden.shape[0]
    rows = max(1, min(T, CHUNK_ELEMENTS // vocab_size))
    n = -(-T // rows)
    pad = n * rows - T
    hidden = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(n, rows, hidden.shape[-1])
    targets = jnp.pad(targets, (0, pad)).reshape(n, rows)

    def chunk(_, xs):
        h, tgt = xs
        logits = logits_fn(h).astype(jnp.float32)  # [rows, V]
        lse = jax.nn.logsumexp(logits, axis=-1)
        t_logit = jnp.take_along_axis(logits, jnp.maximum(tgt, 0)[:, None], axis=-1)[:, 0]
        rank = jnp.sum(logits > t_logit[:, None], axis=-1).astype(jnp.int32) + 1
        vals, ids = jax.lax.top_k(logits, n_top)
        return None, (t_logit - lse, rank, ids.astype(jnp.int32), vals - lse[:, None])

    _, (lps, ranks, top_ids, top_lps) = jax.lax.scan(chunk, None, (hidden, targets))
    flat = lambda x: x.reshape(T + pad, -1)[:T].reshape(-1)  # noqa: E731  (the real rows)
    bits = lambda x: jax.lax.bitcast_convert_type(flat(x), jnp.int32)  # noqa: E731
    return jnp.concatenate([bits(lps), flat(ranks), flat(top_ids), bits(top_lps)])


def unpack(v: np.ndarray, T: int, n_top: int) -> tuple[np.ndarray, ...]:
    """device_values' vector on the host -> (logprobs [T], ranks [T], top ids [T, N], top
    logprobs [T, N])."""
    top = 2 * T + T * n_top
    return (
        v[:T].view(np.float32),
        v[T : 2 * T],
        v[2 * T : top].reshape(T, n_top),
        v[top:].view(np.float32).reshape(T, n_top),
    )


def wants(req) -> bool:
    """Whether a request asks for its prompt's logprobs."""
    return req.params.prompt_logprobs is not None


@dataclass
class StepTargets:
    """One step's prompt-logprob rows: request id -> (its first token in the step's flat
    tokens, that token's position, how many of its tokens have a target)."""

    spans: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    ids: dict[int, int] = field(default_factory=dict)  # flat token index -> target token id

    def array(self, T: int) -> np.ndarray:
        out = np.full(T, -1, np.int32)
        for t, tid in self.ids.items():
            out[t] = tid
        return out


def step_targets(out) -> StepTargets | None:
    """The targets of a scheduled step (`SchedulerOutput`, right after `schedule`: each
    request's scheduled tokens are counted as computed), or None when none of its rows asks.
    A token at position p < P - 1 of a prompt of P tokens targets prompt token p + 1 (the
    last prompt position's logits are the first sample's, not a prompt logprob)."""
    st, t = None, 0
    for req in out.requests:
        n = out.num_scheduled_tokens[req.request_id]
        start = req.num_computed_tokens - n
        m = min(n, req.num_prompt_tokens - 1 - start)
        if m > 0 and wants(req):
            st = st or StepTargets()
            st.spans[req.request_id] = (t, start, m)
            prompt = req.prompt_token_ids
            for j in range(m):
                st.ids[t + j] = prompt[start + j + 1]
        t += n
    return st


class PromptLogprobs:
    """A prompt's logprobs as its steps are read, and their vLLM shape: a list as long as the
    prompt, None first, then {token id: Logprob} with the prompt's own token and the top k."""

    def __init__(self, prompt_token_ids: list[int], k: int):
        P = len(prompt_token_ids)
        self.ids, self.k = prompt_token_ids, k
        self.lp = np.zeros(P, np.float32)
        self.rank = np.zeros(P, np.int32)
        self.top_ids = np.zeros((P, k), np.int32)
        self.top_lps = np.zeros((P, k), np.float32)
        self.covered = 1  # positions [1, covered) are in
        self._entries: list | None = None

    @property
    def complete(self) -> bool:
        return self.covered >= len(self.ids)

    def record(self, span: tuple[int, int, int], values: tuple[np.ndarray, ...]) -> None:
        """A read step's values for one request (`StepTargets.spans`' entry)."""
        t, start, m = span
        lp, rank, top_ids, top_lps = values
        a, b = start + 1, start + 1 + m
        self.lp[a:b], self.rank[a:b] = lp[t : t + m], rank[t : t + m]
        self.top_ids[a:b] = top_ids[t : t + m, : self.k]
        self.top_lps[a:b] = top_lps[t : t + m, : self.k]
        if a <= self.covered:
            self.covered = max(self.covered, b)

    def entries(self, decode) -> list | None:
        """vLLM's prompt_logprobs (decode: one token id -> its text), once complete."""
        if not self.complete:
            return None
        if self._entries is None:
            out: list = [None]
            for i in range(1, len(self.ids)):
                tid = self.ids[i]
                e = {tid: Logprob(float(self.lp[i]), int(self.rank[i]), decode(tid))}
                for j in range(self.k):  # in rank order: the j-th has rank j + 1
                    t = int(self.top_ids[i, j])
                    e.setdefault(t, Logprob(float(self.top_lps[i, j]), j + 1, decode(t)))
                out.append(e)
            self._entries = out
        return self._entries
