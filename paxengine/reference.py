"""The oracle: a plain, unbatched, unpaged greedy generate that recomputes the whole sequence each
step. Slow and obviously right; the engine's tests compare against it token for token."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from paxengine.models.config import ModelConfig
from paxengine.models.llama import compute_logits, dense_causal_attend, forward_hidden


@partial(jax.jit, static_argnames=("cfg",))
def _all_logits(params, cfg: ModelConfig, tokens):
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    hidden, _ = forward_hidden(params, cfg, tokens, positions, None,
                               dense_causal_attend(cfg.sliding_window))
    return compute_logits(params, cfg, hidden)


def reference_logits(params, cfg: ModelConfig, token_ids: list[int]) -> np.ndarray:
    """Logits [T, V] (float32) for every position of one sequence."""
    return np.asarray(_all_logits(params, cfg, jnp.asarray(token_ids, jnp.int32)))


def _bucket(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def reference_generate(params, cfg: ModelConfig, prompt_ids: list[int], max_new_tokens: int,
                       eos_token_ids: list[int] | None = None) -> list[int]:
    """Greedy continuation of one prompt; stops at an EOS id (included) or after max_new_tokens."""
    ids = list(prompt_ids)
    n_total = len(ids) + max_new_tokens
    buf = np.zeros(_bucket(n_total), np.int32)   # padding sits after the sequence: causal masking
    out: list[int] = []                           # keeps it out of every real position
    for _ in range(max_new_tokens):
        buf[:len(ids)] = ids
        logits = _all_logits(params, cfg, jnp.asarray(buf))[len(ids) - 1]
        nxt = int(jnp.argmax(logits))
        out.append(nxt)
        ids.append(nxt)
        if eos_token_ids and nxt in eos_token_ids:
            break
    return out
