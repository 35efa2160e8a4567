"""Functional Llama-family forward (Llama 2/3/3.1, Qwen2, Qwen3, Mistral).

Two layouts of the same weights, chosen by the caller (see `weights.unstack_layers`):
- stacked (`params["layers"]` a dict of [L, ...] arrays, KV cache one array pair [L, ...]): the
  layers run under `lax.scan`, so compile time does not grow with depth (the CPU default);
- per layer (`params["layers"]` a list of dicts, KV cache a list of per-layer pairs): the layers
  are unrolled. On the H200 XLA copies each scanned layer's weights out of the stacked arrays
  before its matmuls (a 16-token Llama-3.1-8B forward: 11.2 ms scanned, 3.9 ms unrolled over
  per-layer arrays), so GPUs use this one.
Attention goes through one callable, `attend(q, k, v, kv_cache, layer)`, so the dense oracle, the
jnp paged reference and the Pallas kernel all drop in without touching the model.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp

from paxengine.models.config import ModelConfig
from paxengine.models.config import from_hf_config as config_from_hf
from paxengine.models.norm import norm_into
from paxengine.models.quant import gated_mlp, linear, linear_parts

Attend = Callable[[jax.Array, jax.Array, jax.Array, Any, jax.Array], tuple[jax.Array, Any]]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # As transformers does it: normalise in float32, cast back, then scale.
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rotary_dim(cfg: ModelConfig) -> int:
    """The leading dims of each head that RoPE rotates (Qwen3.5: a quarter; the rest pass)."""
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """The inverse frequencies [rotary_dim / 2] (f32), with the config's scaling: llama3's, or
    YaRN's blend of interpolated and original frequencies, as transformers computes them
    (modeling_rope_utils; models/config.py's `_scaling` filled in its defaults)."""
    d = rotary_dim(cfg)
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    sc = cfg.rope_scaling_dict
    kind = sc and sc.get("rope_type", sc.get("type"))
    if kind == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = jnp.where(is_mid, mid, scaled)
    elif kind == "yarn":
        inv = _yarn_inv_freq(cfg.rope_theta, d, sc)
    elif kind is not None:  # a config built without models/config.py's check
        raise ValueError(f"unsupported rope_type {kind!r}")
    return inv


def _yarn_inv_freq(base: float, d: int, sc: dict) -> jax.Array:
    """YaRN (arXiv 2309.00071): the dims that turn fewer than beta_slow times over the
    pretraining length are interpolated (frequency / factor), those that turn more than
    beta_fast times kept, a linear ramp between; transformers' _compute_yarn_parameters op for
    op."""
    factor, orig = sc["factor"], sc["original_max_position_embeddings"]

    def correction_dim(rotations):  # the dim that turns `rotations` times over orig positions
        return (d * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(sc["beta_fast"]), correction_dim(sc["beta_slow"])
    if sc["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # (transformers': no division by zero)
    pos_freqs = base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = jnp.clip((jnp.arange(d // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: the original frequency, 0: the interpolated one
    return interpolation * (1 - keep) + extrapolation * keep


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor on cos and sin (YaRN's attention temperature, 0.1 ln(factor) + 1 by
    default; 1.0 without scaling): scaling q and k both, it scales the logits by its square."""
    sc = cfg.rope_scaling_dict
    return float(sc.get("attention_factor", 1.0)) if sc else 1.0


def rope_tables(
    positions: jax.Array, inv_freq: jax.Array, attention_factor: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, D] (float32) of each position's angles, each half the same (HF's
    layout; XLA's cos of it is bit for bit what the layers always used), times
    `attention_factor` as transformers applies it: computed once a step, every layer rotates
    by them, and the fused RoPE + KV-write kernel (attention.py) takes them as they are."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def rope_for(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The step's RoPE tables of a config: the one place a model's cos / sin are made."""
    return rope_tables(positions, rope_inv_freq(cfg), rope_attention_factor(cfg))


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """x: [T, heads, D]; the rotate-half convention of HF checkpoints."""
    cos, sin = (t[:, None, :] for t in rope)
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def scaled_attend(attend: Attend, q, k, v, kv_cache, layer, kv_scale):
    """Attention over an FP8 cache that holds k / k_scale and v / v_scale (kv_scale: [2] f32,
    the layer's (k_scale, v_scale)), for an `attend` that does not apply the scales itself: they
    fold into the operands, so any attention runs unchanged: q.(k/ks) * ks = q.k, and
    softmax(s).(v/vs) * vs = softmax(s).v."""
    if getattr(attend, "takes_kv_scale", False):
        return attend(q, k, v, kv_cache, layer, kv_scale=kv_scale)
    ks, vs = kv_scale[0], kv_scale[1]
    q = (q.astype(jnp.float32) * ks).astype(q.dtype)
    k = (k.astype(jnp.float32) / ks).astype(k.dtype)
    v = (v.astype(jnp.float32) / vs).astype(v.dtype)
    o, kv_cache = attend(q, k, v, kv_cache, layer)
    return (o.astype(jnp.float32) * vs).astype(o.dtype), kv_cache


def _identity(x):
    return x


def _attention(cfg: ModelConfig, attend: Attend, rope, w: dict, x, kv_cache, layer):
    """The projections, RoPE, the KV write and attention of one layer -> (o [T, Hq * D],
    kv_cache). An `attend` with `rope_qkv` (the Pallas backend's small buckets) takes the fused
    projection's output whole: RoPE and the KV write in one kernel, where XLA would launch
    five."""
    t = x.shape[0]
    kv_scale = w.get("kv_scale")
    fused_rope = getattr(attend, "rope_qkv", None)
    if "wqkv" in w:  # the per-layer layout fuses the projections (weights.FUSED)
        qkv = linear(x, w["wqkv"]) + (w["bqkv"] if cfg.attention_bias else 0)
        if fused_rope is not None:
            if cfg.qk_norm:  # (Qwen3) the heads' RMSNorm first, q | k | v one row again
                qkv = _qk_normed(cfg, w, qkv)
            q, kv_cache = fused_rope(qkv, rope, kv_cache, layer, kv_scale)
            o = attend.attend_cached(q, kv_cache, layer, kv_scale)
            return o.reshape(t, cfg.num_heads * cfg.head_dim), kv_cache
        nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = qkv[:, :nq], qkv[:, nq : nq + nkv], qkv[:, nq + nkv :]
    else:
        q, k, v = linear(x, w["wq"]), linear(x, w["wk"]), linear(x, w["wv"])
        if cfg.attention_bias:
            q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    q = q.reshape(t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
    q, k = apply_rope(q, rope), apply_rope(k, rope)
    if kv_scale is not None:
        o, kv_cache = scaled_attend(attend, q, k, v, kv_cache, layer, kv_scale)
    else:
        o, kv_cache = attend(q, k, v, kv_cache, layer)
    return o.reshape(t, cfg.num_heads * cfg.head_dim), kv_cache


def _qk_normed(cfg: ModelConfig, w: dict, qkv):
    """A fused projection's [T, (Hq + 2 Hkv) D] with its q and k heads RMS-normed (QK norm), for
    the fused RoPE + KV-write kernel: on the GPU's batch-1 Qwen3-30B-A3B step the unfused RoPE
    and XLA's KV-write scatters cost ~0.3 ms (benchmarks/results/gpu_2026-12-07e_moe/, call P).
    The same ops as the unfused path's, so the same numbers."""
    t, d, eps = qkv.shape[0], cfg.head_dim, cfg.rms_norm_eps
    nq, nkv = cfg.num_heads * d, cfg.num_kv_heads * d
    q = rms_norm(qkv[:, :nq].reshape(t, -1, d), w["q_norm"], eps).reshape(t, nq)
    k = rms_norm(qkv[:, nq : nq + nkv].reshape(t, -1, d), w["k_norm"], eps).reshape(t, nkv)
    return jnp.concatenate([q, k, qkv[:, nq + nkv :]], axis=1)


def _layer(cfg: ModelConfig, attend: Attend, rope, carry, xs, *, reduce=_identity):
    """One decoder layer. rope: `rope_tables` of the step's positions. `reduce` sums the
    row-parallel projections' partial products over a tensor-parallel group (parallel.py);
    identity on one device."""
    h, kv_cache = carry
    w, layer = xs
    eps = cfg.rms_norm_eps
    qkv = [w["wqkv"]] if "wqkv" in w else [w["wq"], w["wk"], w["wv"]]
    _, x = norm_into(h, None, w["attn_norm"], eps, qkv)
    o, kv_cache = _attention(cfg, attend, rope, w, x, kv_cache, layer)
    o = o.astype(h.dtype)
    # one device: the o projection's W8A8 product goes unscaled into the add + norm kernel
    delta = linear_parts(o, w["wo"]) if reduce is _identity else reduce(linear(o, w["wo"]))
    gate_up = [w["w_gate_up"]] if "w_gate_up" in w else [w["w_gate"], w["w_up"]]
    h, x = norm_into(h, delta, w["mlp_norm"], eps, gate_up)
    if "w_gate_up" in w:
        mlp = gated_mlp(x, w["w_gate_up"], w["w_down"])
    else:
        mlp = linear(jax.nn.silu(linear(x, w["w_gate"])) * linear(x, w["w_up"]), w["w_down"])
    h = h + reduce(mlp)
    return (h, kv_cache), None


def forward_hidden(
    params: dict,
    cfg: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    kv_cache: Any,
    attend: Attend,
    tp=None,
    aux_layers: tuple[int, ...] = (),
) -> tuple[jax.Array, Any]:
    """tokens, positions: [T] int32 -> final hidden states [T, H] (normed) and the updated cache.
    tp: a `parallel.TensorParallel`: the layers run under one shard_map, each device on its
    heads and its share of the MLP, the cache split by KV head.

    aux_layers (EAGLE-3's auxiliary hidden states): also return the residual stream entering
    each of these layers (id j: after j layers; vLLM's convention), concatenated [T, len * H]:
    the result is then (hidden, kv_cache, aux). Empty: nothing else is computed."""
    h = params["embed"][tokens]
    rope = rope_for(cfg, positions)
    layers = params["layers"]
    if aux_layers:
        if tp is not None:
            raise NotImplementedError("auxiliary hidden states under tensor parallelism")
        h, kv_cache, aux = _run_layers(
            cfg, attend, rope, _identity, h, layers, kv_cache, aux_layers
        )
        return rms_norm(h, params["final_norm"], cfg.rms_norm_eps), kv_cache, aux
    if tp is None:
        h, kv_cache = _run_layers(cfg, attend, rope, _identity, h, layers, kv_cache)
    else:
        from paxengine.parallel import run_sharded

        body = partial(_run_layers, tp.local_config(cfg), attend)
        h, kv_cache = run_sharded(
            tp,
            lambda rope, h, layers, kv: body(rope, tp.psum, h, layers, kv),
            rope,
            h,
            layers,
            kv_cache,
        )
    return rms_norm(h, params["final_norm"], cfg.rms_norm_eps), kv_cache


def _run_layers(cfg: ModelConfig, attend: Attend, rope, reduce, h, layers, kv_cache, aux=()):
    """-> (h, kv_cache), or with `aux` layer ids (h, kv_cache, [T, len(aux) * H]): the stream
    entering each of those layers (forward_hidden's aux_layers)."""
    layer = partial(_layer, cfg, attend, rope, reduce=reduce)
    if isinstance(layers, (list, tuple)):
        caches = list(kv_cache) if kv_cache is not None else [None] * len(layers)
        # One jitted function for every layer: traced and lowered once, not once per layer
        # (tracing 32 layers and their Pallas kernels was most of a GPU start-up). XLA inlines
        # the calls, so the compiled step is the same.
        layer_fn = jax.jit(layer)
        taken = {}
        for i, w in enumerate(layers):
            if i in aux:
                taken[i] = h
            # each layer's cache is its own [1, ...] array pair: layer index 0 inside it
            (h, caches[i]), _ = layer_fn((h, caches[i]), (w, jnp.int32(0)))
        if aux:
            return h, caches, jnp.concatenate([taken[i] for i in aux], axis=-1)
        return h, caches
    index = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    if not aux:
        (h, kv_cache), _ = jax.lax.scan(layer, (h, kv_cache), (layers, index))
        return h, kv_cache
    ids = jnp.asarray(aux, jnp.int32)

    def body(carry, xs):  # keeps the stream entering each aux layer as the scan passes it
        h, cache, kept = carry
        kept = jnp.where((ids == xs[1])[:, None, None], h[None], kept)
        (h, cache), _ = layer((h, cache), xs)
        return (h, cache, kept), None

    kept = jnp.zeros((len(aux),) + h.shape, h.dtype)
    (h, kv_cache, kept), _ = jax.lax.scan(body, (h, kv_cache, kept), (layers, index))
    return h, kv_cache, jnp.concatenate(list(kept), axis=-1)


def compute_logits(params: dict, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.dot(hidden, head, preferred_element_type=jnp.float32)


# -- the family's entry points (models/registry.py) -----------------------------------------------
from_hf_config = config_from_hf  # the Llama layout's config.json mapping (models/config.py)
load_hf = None  # the loader's own path reads the Llama layout


def forward_step(params, cfg: ModelConfig, tokens, positions, caches, attend, step, tp=None):
    """forward_hidden as the runner calls every family: `step` (the step's unpacked inputs)
    carries nothing this family needs beyond the attention metadata `attend` holds."""
    return forward_hidden(params, cfg, tokens, positions, caches, attend, tp=tp)


def allocate_state(cfg: ModelConfig, num_slots: int, dtype) -> dict:
    return {}  # no recurrent layers


def state_bytes_per_slot(cfg: ModelConfig, dtype) -> int:
    return 0
