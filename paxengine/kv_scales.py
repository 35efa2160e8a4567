"""Per-layer scales of an FP8 KV cache: what K and V are divided by before they are stored.

e4m3 keeps 3 mantissa bits between 2^-6 and 448 (subnormals down to 2^-9): with a scale of 1.0
small values lose bits (V is often ~1e-2) and values past 448 saturate. A scale per layer maps
each layer's range onto the format. They come from the checkpoint (compressed-tensors'
`kv_cache_scheme`), or from a calibration pass: one forward over a built-in text, K (after
RoPE) and V's largest magnitude per layer, with 2x headroom for what the text did not show.
The write and attention kernels apply them (`paxengine/attention.py`; `llama.scaled_attend`
folds them into the operands for an attention without that). A hybrid model (Qwen3.5) has them
for its full-attention layers only; its recurrent states stay in the model dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paxengine.models.config import ModelConfig
from paxengine.models.llama import forward_hidden
from paxengine.models.quant import FP8_MAX

MODES = ("auto", "calibrate", "unit")
HEADROOM = 2.0

# Prose, code and numbers: a spread of activations, ~250 tokens under a Llama tokenizer.
CALIBRATION_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type with an oil-based ink. Within fifty years presses "
    "were at work in more than two hundred cities across Europe.\n\n"
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < "
    "b[0] else b.pop(0))\n    return out + a + b\n\n"
    "Q: What is 17 * 23? A: 391. Q: Convert 3.5 km to metres. A: 3500 m.\n"
    "User: Write a haiku about the sea.\nAssistant: Grey waves fold and break / salt wind "
    "carries gull voices / the tide keeps its time.\n"
    "| year | city | presses |\n|---|---|---|\n| 1470 | Venice | 12 |\n| 1480 | Paris | 9 |\n"
)


def calibration_tokens(tokenizer, vocab_size: int, n: int = 256) -> list[int]:
    """The built-in text under the model's tokenizer; random ids for a model without one
    (dummy weights), seeded so the scales are reproducible."""
    if tokenizer is not None:
        return tokenizer.encode(CALIBRATION_TEXT)[:n]
    return np.random.default_rng(0).integers(0, vocab_size, n).tolist()


def calibrate(params: dict, cfg: ModelConfig, token_ids: list[int]) -> np.ndarray:
    """[L, 2] float32 (k_scale, v_scale) of the attention layers from one forward of
    `token_ids`: over stacked layers, or a family's own forward (a hybrid's per-layer params,
    its recurrent layers run from zero states)."""
    from paxengine.reference import contiguous_attend

    tokens = jnp.asarray(token_ids, jnp.int32)
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    dtype = params["embed"].dtype
    shape = (cfg.num_layers, tokens.shape[0], cfg.num_kv_heads, cfg.head_dim)
    inner = contiguous_attend(positions, cfg.sliding_window)

    def recording(q, k, v, cache, layer):
        kv, amax = cache
        o, kv = inner(q, k, v, kv, layer)
        seen = jnp.stack([jnp.max(jnp.abs(k)), jnp.max(jnp.abs(v))]).astype(jnp.float32)
        return o, (kv, amax.at[layer].max(seen))

    def run(params):
        cache = ((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)), jnp.zeros((shape[0], 2)))
        _, (_, amax) = forward_hidden(params, cfg, tokens, positions, cache, recording)
        return amax

    def run_family(params):  # a family's own layout: one cache per attention layer, each its 0
        from paxengine.models import registry

        family = registry.family(cfg)
        one = (1,) + shape[1:]
        kv = [((jnp.zeros(one, dtype),) * 2, jnp.zeros((1, 2))) for _ in cfg.attention_layers]
        slot, none = jnp.zeros(1, jnp.int32), jnp.full(1, -1, jnp.int32)
        step = dict(query_start_loc=jnp.array([0, tokens.shape[0]], jnp.int32), state_slots=slot)
        step.update(has_state=slot, restore_slots=none, snapshot_slots=none)
        states = cfg.recurrent_layers and family.allocate_state(cfg, 1, dtype)
        caches = (kv, states) if cfg.recurrent_layers else kv
        _, caches = family.forward_step(params, cfg, tokens, positions, caches, recording, step)
        kv = caches[0] if cfg.recurrent_layers else caches
        return jnp.concatenate([amax for _, amax in kv])

    amax = np.asarray(jax.jit(run if cfg.family == "llama" else run_family)(params))
    return np.where(amax > 0, HEADROOM * amax / FP8_MAX, 1.0).astype(np.float32)


def describe(scales: np.ndarray) -> str:
    k, v = scales[:, 0], scales[:, 1]
    return (
        f"k_scale {k.min():.3g}..{k.max():.3g}, v_scale {v.min():.3g}..{v.max():.3g} "
        f"over {len(scales)} layers"
    )


def choose(
    mode: str, fp8_cache: bool, checkpoint: np.ndarray | None, params, cfg, tokenizer
) -> tuple[np.ndarray | None, str]:
    """The scales an engine runs with and where they came from: ("none" without an FP8 cache),
    "checkpoint", "calibrated" or "unit", one row per attention layer. params: stacked layers,
    or a hybrid family's per-layer ones (calibration runs on them)."""
    if mode not in MODES:
        raise ValueError(f"kv_cache_scales must be one of {', '.join(MODES)}, got {mode!r}")
    if not fp8_cache:
        return None, "none"
    if mode == "unit":
        return np.ones((cfg.num_kv_layers, 2), np.float32), "unit"
    if mode == "auto" and checkpoint is not None:
        return np.asarray(checkpoint, np.float32).reshape(cfg.num_kv_layers, 2), "checkpoint"
    return calibrate(params, cfg, calibration_tokens(tokenizer, cfg.vocab_size)), "calibrated"
