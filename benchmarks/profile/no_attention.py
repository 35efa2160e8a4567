"""The model's forward with attention left out: each layer's attention returns its queries. What
a step costs without attention is the step's time less this (decode.py, prefill.py, layers.py)."""

from __future__ import annotations


def no_attention(q, k, v, cache, layer):
    """An attention function for forward_hidden that does nothing: q out, the cache as it was."""
    return q, cache


def forward_without_attention(cfg, rows: int):
    """jit(params, tokens) -> the logits of the first `rows` tokens, attention left out."""
    import jax

    from paxengine.models.llama import compute_logits, forward_hidden

    def fwd(params, tokens):
        hidden = forward_hidden(params, cfg, tokens, tokens, None, no_attention)[0]
        return compute_logits(params, cfg, hidden[:rows])

    return jax.jit(fwd)
