"""The oracle: a plain, unbatched, unpaged greedy generate. One sequence, one contiguous KV
buffer indexed by position; obviously right. The engine's tests compare against it token for
token."""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.layout import quantize_kv
from paxengine.models.config import ModelConfig
from paxengine.models.llama import compute_logits, forward_hidden
from paxengine.models.weights import is_per_layer


def contiguous_attend(positions: jax.Array, sliding_window: int | None):
    """Attention over a contiguous per-layer KV buffer [L, max_len, Hkv, D]: write this step's
    K/V at their positions (padding tokens carry position max_len and are dropped), then attend
    causally by position."""

    def attend(q, k, v, cache, layer):
        kc, vc = cache
        # stored as the engine stores them (an fp8 cache saturates rather than NaN)
        kc = kc.at[layer, positions].set(quantize_kv(k, kc.dtype), mode="drop")
        vc = vc.at[layer, positions].set(quantize_kv(v, vc.dtype), mode="drop")
        keys, vals = kc[layer].astype(jnp.float32), vc[layer].astype(jnp.float32)
        group = q.shape[1] // keys.shape[1]
        keys, vals = jnp.repeat(keys, group, axis=1), jnp.repeat(vals, group, axis=1)
        s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), keys) / math.sqrt(q.shape[-1])
        kpos = jnp.arange(keys.shape[0])[None, :]
        mask = kpos <= positions[:, None]
        if sliding_window:
            mask &= positions[:, None] - kpos < sliding_window
        s = jnp.where(mask[None], s, -jnp.inf)
        o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), vals)
        return o.astype(q.dtype), (kc, vc)

    return attend


@partial(jax.jit, static_argnames=("cfg",), donate_argnums=(2,))
def _cached_step(params, cfg: ModelConfig, cache, tokens, positions, last):
    hidden, cache = forward_hidden(
        params, cfg, tokens, positions, cache, contiguous_attend(positions, cfg.sliding_window)
    )
    return compute_logits(params, cfg, hidden[last][None])[0], cache


def _empty_cache(params, cfg: ModelConfig, max_len: int):
    """[L, ...] for stacked layers; one [1, ...] pair per layer for the per-layer layout."""
    dtype = params["embed"].dtype
    if is_per_layer(params):
        shape = (1, max_len, cfg.num_kv_heads, cfg.head_dim)
        return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in params["layers"]]
    shape = (cfg.num_layers, max_len, cfg.num_kv_heads, cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


@partial(jax.jit, static_argnames=("cfg",))
def _all_logits(params, cfg: ModelConfig, tokens):
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    cache = _empty_cache(params, cfg, tokens.shape[0])
    hidden, _ = forward_hidden(
        params, cfg, tokens, positions, cache, contiguous_attend(positions, cfg.sliding_window)
    )
    return compute_logits(params, cfg, hidden)


def reference_logits(params, cfg: ModelConfig, token_ids: list[int]) -> np.ndarray:
    """Logits [T, V] (float32) for every position of one sequence, in one pass."""
    return np.asarray(_all_logits(params, cfg, jnp.asarray(token_ids, jnp.int32)))


def _bucket(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def reference_generate(
    params,
    cfg: ModelConfig,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_token_ids: list[int] | None = None,
    return_logits: bool = False,
):
    """Greedy continuation of one prompt; stops at an EOS id (included) or after max_new_tokens.
    With return_logits, also the float32 logits each generated token was chosen from."""
    max_len = _bucket(len(prompt_ids) + max_new_tokens)
    cache = _empty_cache(params, cfg, max_len)
    n = len(prompt_ids)
    tokens = np.zeros(_bucket(n), np.int32)
    tokens[:n] = prompt_ids
    positions = np.full(_bucket(n), max_len, np.int32)  # padding: dropped, attends to nothing real
    positions[:n] = np.arange(n)
    logits, cache = _cached_step(
        params, cfg, cache, jnp.asarray(tokens), jnp.asarray(positions), n - 1
    )
    out, all_logits = [], []
    for i in range(max_new_tokens):
        all_logits.append(np.asarray(logits))
        nxt = int(jnp.argmax(logits))
        out.append(nxt)
        if (eos_token_ids and nxt in eos_token_ids) or i == max_new_tokens - 1:
            break
        logits, cache = _cached_step(
            params, cfg, cache, jnp.asarray([nxt], jnp.int32), jnp.asarray([n + i], jnp.int32), 0
        )
    return (out, np.stack(all_logits)) if return_logits else out
