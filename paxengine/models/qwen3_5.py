"""Qwen3.5 (dense, text only): the hybrid of Gated DeltaNet layers and gated full attention
(HF transformers `models/qwen3_5`: `Qwen3_5ForCausalLM`, `Qwen3_5ForConditionalGeneration`).

- `layer_types`: "linear_attention" layers (three of every four in the released models) keep
  one state slot per request, a conv state [C, K-1] and a recurrent state [Hv, dk, dv], instead
  of KV pages; "full_attention" layers use the paged KV cache like the Llama family.
- Gated DeltaNet: in-projections q|k|v (one matmul), z, b, a; a causal depthwise conv1d with
  SiLU over q|k|v; L2-normalised q and k; beta = sigmoid(b), g = -exp(A_log) softplus(a + dt);
  the gated delta rule (kernels_pallas.gated_delta); a gated RMSNorm (norm(o) * silu(z)); out.
- Full attention: q_proj yields each head's query and an output gate (sigmoid); QK RMSNorm;
  RoPE over the first `partial_rotary_factor` of each head (text positions: MRoPE's three
  sections share one position, so it is plain RoPE).
- RMSNorms are zero-centred (scale 1 + w): the loader adds the 1, so the Llama family's norm
  runs them; the gated RMSNorm of the DeltaNet is not (its weight is the scale).
The layers always run unrolled (they differ in kind); the state pools are one array per kind
a layer ([slots, ...], `allocate_state`), written in place by the kernels. The config mapping,
weight names and loader are `qwen3_5_checkpoint.py`'s.
"""

from __future__ import annotations

import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from paxengine.models import gated_deltanet
from paxengine.models.config import ModelConfig
from paxengine.models.llama import compute_logits, rms_norm, rope_for, scaled_attend  # noqa: F401
from paxengine.models.moe import moe_mlp, real_tokens
from paxengine.models.norm import norm_into
from paxengine.models.quant import (
    Fp8Weight,
    array_module,
    cublas_step,
    gated_mlp,
    linear,
    linear_parts,
)

# the family's config and weight entry points (registry.py), in their own module
from paxengine.models.qwen3_5_checkpoint import (  # noqa: F401
    FUSED,
    _conv_dim,
    _value_dim,
    check_shapes,
    dummy_params,
    from_hf_config,
    layer_names,
    load_hf,
    param_shapes,
)


# -- per-request state ----------------------------------------------------------------------------
def state_shapes(cfg: ModelConfig, num_slots: int) -> dict:
    n = len(cfg.recurrent_layers)
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return {
        "conv": (n, num_slots, _conv_dim(cfg), cfg.linear_conv_kernel_dim - 1),
        "ssm": (n, num_slots, hv, dk, dv),
    }


def allocate_state(cfg: ModelConfig, num_slots: int, dtype, tp=None) -> dict:
    """The recurrent layers' state pools, zeros (a new request starts from zeros anyway): one
    array a layer, since the kernels address a pool with int32 offsets (the 9B's 24 layers x
    1,024 slots of [32, 128, 128] are 12.9 G elements; a layer's 537 M). tp: each pool split
    by channel / value head over the mesh (parallel.STATE_SPEC), each device's share in place."""

    def zeros(shape, dt):
        if tp is None:
            return jnp.zeros(shape, dt)
        from paxengine.parallel import STATE_SPEC

        return jax.jit(lambda: jnp.zeros(shape, dt), out_shardings=tp.sharding(STATE_SPEC))()

    return {
        k: [zeros(s[1:], dtype) for _ in range(s[0])]
        for k, s in state_shapes(cfg, num_slots).items()
    }


def tp_layout(params: dict, cfg: ModelConfig, tp) -> dict:
    """Per-layer params with each DeltaNet's q|k|v channels (in_proj_qkv's outputs, the conv's
    channels) reordered shard by shard, [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: a contiguous split
    into tp.size blocks (parallel.py) then gives each device its key heads' q and k and their
    value heads' v, in the order split_qkv reads on the local head counts."""
    n = tp.size
    qk, vd = cfg.linear_num_key_heads * cfg.linear_key_head_dim, _value_dim(cfg)
    parts = [np.arange(qk), qk + np.arange(qk), 2 * qk + np.arange(vd)]
    perm = np.concatenate([p.reshape(n, -1) for p in parts], axis=1).reshape(-1)
    take = lambda a, axis: array_module(a).take(a, perm, axis=axis)  # noqa: E731 (host or device)
    layers = []
    for w in params["layers"]:
        w = dict(w)
        if "la_qkv" in w:
            qkv = w["la_qkv"]
            if isinstance(qkv, Fp8Weight):  # values [out, in], scales [out]
                w["la_qkv"] = Fp8Weight(take(qkv.values, 0), take(qkv.scales, 0))
            else:
                w["la_qkv"] = take(qkv, -1)
            w["la_conv"] = take(w["la_conv"], 0)
        layers.append(w)
    return {**params, "layers": layers}


def state_bytes_per_slot(cfg: ModelConfig, dtype) -> int:
    per = state_shapes(cfg, 1)
    return sum(int(np.prod(s)) for s in per.values()) * jnp.dtype(dtype).itemsize


# -- forward --------------------------------------------------------------------------------------
def _apply_rope(x, rope):
    """x [T, heads, D]: the rotate-half RoPE on the first rd dims, the rest passed through."""
    cos, sin = (t[:, None, :] for t in rope)
    rd = cos.shape[-1]
    xr, xp = x[..., :rd].astype(jnp.float32), x[..., rd:]
    half = rd // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    return jnp.concatenate([(xr * cos + rotated * sin).astype(x.dtype), xp], axis=-1)


def mlp(cfg: ModelConfig, w: dict, x, first_expert=None, real=None):
    """A layer's MLP block on its normed input: the SwiGLU MLP (gate|up fused or apart), or
    Qwen3.5-MoE's routed experts and shared expert (models/moe.py; real: the step's real
    tokens, `moe.real_tokens`). Also the MTP layer's."""
    if "router" in w:
        return moe_mlp(x, w, cfg.num_experts_per_tok, cfg.norm_topk_prob, first_expert, real)
    if "w_gate_up" in w:
        return gated_mlp(x, w["w_gate_up"], w["w_down"])
    gate, up = _project(x, w, "w_gate_up", ())
    return linear(jax.nn.silu(gate) * up, w["w_down"])


def _project(x, w: dict, fused: str, sizes: tuple) -> list:
    """x @ each part of FUSED[fused] (output widths `sizes`): one GEMM over the fused weight,
    split, or one GEMM a part where the layer keeps them apart."""
    if fused in w:
        y = linear(x, w[fused])
        return jnp.split(y, np.cumsum(sizes)[:-1].tolist(), axis=-1)
    return [linear(x, w[p]) for p in FUSED[fused]]


def _weights(w: dict, fused: str) -> list:
    """The weights x goes into (norm_into's next_weights): fused, or its parts."""
    return [w[fused]] if fused in w else [w[p] for p in FUSED[fused]]


def _full_attention(cfg: ModelConfig, w, x, rope, kv, attend):
    t, hq, d = x.shape[0], cfg.num_heads, cfg.head_dim
    kd = cfg.num_kv_heads * d
    qg, k, v = _project(x, w, "wqkv", (2 * hq * d, kd, kd))
    qg = qg.reshape(t, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(t, hq * d)
    k = k.reshape(t, cfg.num_kv_heads, d)
    v = v.reshape(t, cfg.num_kv_heads, d)
    q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
    q, k = _apply_rope(q, rope), _apply_rope(k, rope)
    if "kv_scale" in w:  # an fp8 KV cache: the layer's (k_scale, v_scale) (kv_scales.py)
        o, kv = scaled_attend(attend, q, k, v, kv, jnp.int32(0), w["kv_scale"])
    else:
        o, kv = attend(q, k, v, kv, jnp.int32(0))
    o = o.reshape(t, hq * d).astype(gate.dtype) * jax.nn.sigmoid(gate)
    return o, kv


# The temporaries of an 8,192-token step (kv_memory's activation reserve): XLA's analysis of the
# 9B's (8192, 512) forward said 6.46 GB on an H100 (benchmarks/results/gpu_2026-12-07_qwen35_lease/),
# past the 4 GiB of a Llama-sized step, and the start-up ran out of memory priming; 8 GiB holds
# it with the margin the sampler's scratch showed (its allocation 1.2x its analysis).
STEP_TEMP_BYTES = 8 << 30


# Steps of up to this many tokens compile without XLA's Triton GEMMs (quant.dense_xla_options):
# H100, decode ITL batch 1 / 8 6.55 / 7.32 ms against 7.13 / 8.51 with XLA's own pick, Triton
# GEMMs at ~2 TB/s (benchmarks/results/gpu_2026-12-06b_qwen35_gemm/). Not measured on the
# other families, nor on Qwen3.5-MoE (its ragged_dot): they keep XLA's pick.
CUBLAS_MAX_TOKENS = 64
# ... and there the 16-bit out projections (the 24 + 8 [4096, 4096] of the 9B, where cuBLAS
# fills too few SMs: ~1.2 ms of a 6.5 ms batch-1 step) run through the Pallas skinny GEMM
# (kernels_pallas/skinny_gemm.py) with PAXENGINE_KERNEL_SKINNY=auto (off | interpret: CPU
# tests). Off by default until measured: the device time of the lease that built it went on
# refused starts, and a kernel not yet run on a GPU must not stop the engine's start-up. The
# A/B is benchmarks/results/gpu_2026-12-06c_qwen35_defaults/call4.sh.
# K split into a batched cuBLAS GEMM instead measured slower in the step (H100, batch 1 7.72
# against 6.54 ms: XLA made it a reduction; gpu_2026-12-06c_qwen35_defaults/).


SKINNY_DEFAULT = "off"


def _out_projection(cfg: ModelConfig, x, w):
    """x @ w as linear_parts' (product, row scales, column scales); the skinny GEMM kernel in
    cuBLAS steps where its tiles fit."""
    mode = os.environ.get("PAXENGINE_KERNEL_SKINNY", SKINNY_DEFAULT)
    if mode not in ("auto", "off", "interpret"):
        raise ValueError(f"PAXENGINE_KERNEL_SKINNY must be auto, off or interpret, got {mode!r}")
    if (
        mode != "off"
        and not isinstance(w, Fp8Weight)
        and not cfg.moe_layers  # (their steps keep XLA's Triton GEMMs, step_build)
        and x.dtype == w.dtype
        and x.dtype in (jnp.bfloat16, jnp.float16)
        and (mode == "interpret" or cublas_step(x.shape[0], CUBLAS_MAX_TOKENS))
    ):
        from kernels_pallas import skinny_gemm  # (the Pallas import only where it runs)

        m, k = x.shape
        tun = skinny_gemm.default_tuning(m, k, w.shape[1])
        if skinny_gemm.fits(m, k, w.shape[1], tun):
            y = skinny_gemm.skinny_matmul(x, w, interpret=mode == "interpret", tuning=tun)
            return y, None, None
    return linear_parts(x, w)


def _delta_net(cfg: ModelConfig, w, x, states, step):
    """A Gated DeltaNet layer: its in-projections, then models/gated_deltanet.py's layer over
    the step (states: the layer's {"conv", "ssm"} pools)."""
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    mixed, z = _project(x, w, "la_qkvz", (_conv_dim(cfg), hv * dv))
    b, a = _project(x, w, "la_ba", (hv, hv))
    return gated_deltanet.layer(cfg, w, mixed, z, a, b, states, step)


def forward_step(params, cfg: ModelConfig, tokens, positions, caches, attend, step, tp=None):
    """-> (final hidden states [T, H] (normed), (KV caches, state pools)). caches: the KV pair
    of each attention layer and the state pools; step: the step's unpacked inputs
    (query_start_loc, state_slots, has_state). tp: the layers run under one shard_map
    (parallel.run_sharded) on a local config, each device its attention heads, its DeltaNet
    key / value heads with their state pools, its MLP channels or experts."""
    kv, states = caches
    step = dict(step)
    slots = step["state_slots"]
    own = jnp.where(step["has_state"] > 0, slots, -1)
    step["initial_slots"] = jnp.where(step["restore_slots"] >= 0, step["restore_slots"], own)
    span = step.pop("verify_span", None)  # (static ints: not an argument of the layers' jit)
    if span is not None:  # speculative decoding (gated_deltanet.py)
        step["position_slots"], step["verify_rows"] = gated_deltanet.verify_slots(step, *span)
    h = params["embed"][tokens]
    rope = rope_for(cfg, positions)  # over the rotated share (partial_rotary_factor)

    def run(cfg, rope, h, ws, kv, states, tp=None):
        reduce = tp.psum if tp is not None else None
        first = tp.first_expert(cfg) if tp is not None else None  # (inside the shard_map)
        return _run_layers(cfg, ws, h, rope, kv, states, step, attend, reduce, first)

    if tp is None:
        h, kv, states = run(cfg, rope, h, params["layers"], kv, states)
    else:
        from paxengine.parallel import run_sharded

        local = tp.local_config(cfg)
        h, kv, states = run_sharded(
            tp,
            lambda rope, h, ws, kv, st: run(local, rope, h, ws, kv, st, tp),
            rope,
            h,
            params["layers"],
            kv,
            states,
        )
    return rms_norm(h, params["final_norm"], cfg.rms_norm_eps), (kv, states)


def _run_layers(cfg, layers, h, rope, kv, states, step, attend, reduce, first_expert):
    """The layers, unrolled; under tensor parallelism (`cfg` the device's own) `reduce`
    all-reduces the out projections' and the MLPs' partial products."""
    kv = list(kv)
    attn_index = {i: j for j, i in enumerate(cfg.attention_layers)}
    lin_index = {i: j for j, i in enumerate(cfg.recurrent_layers)}
    # One jitted function for the layers: traced and lowered once per kind of layer (the
    # structure of its weights and caches), not once per layer: tracing the 32 layers of the 9B
    # and their Pallas kernels in each of ~80 step executables was most of a cold start-up.
    # XLA inlines the calls, so the compiled step is the same.
    layer = jax.jit(partial(_layer, cfg, attend, reduce, first_expert))
    for i, w in enumerate(layers):
        if i in attn_index:
            j = attn_index[i]
            h, kv[j], _ = layer(h, w, rope, kv[j], None, step)
        else:
            j = lin_index[i]
            h, _, mine = layer(h, w, rope, None, {k: v[j] for k, v in states.items()}, step)
            states = {k: [*v[:j], mine[k], *v[j + 1 :]] for k, v in states.items()}
    return h, kv, states


def _layer(cfg, attend, reduce, first_expert, h, w, rope, kv, state, step):
    """One layer: gated attention over its KV pair `kv`, or (kv None) a Gated DeltaNet over its
    `state` pools. -> (h, kv, state)."""
    eps = cfg.rms_norm_eps
    # the residual adds and norms as the Llama family's (models/norm.py): one kernel in
    # small steps, FP8 rows handed to FP8 projections
    if kv is not None:
        _, x = norm_into(h, None, w["attn_norm"], eps, _weights(w, "wqkv"))
        o, kv = _full_attention(cfg, w, x, rope, kv, attend)
        out = w["wo"]
    else:
        into = _weights(w, "la_qkvz") + _weights(w, "la_ba")
        _, x = norm_into(h, None, w["attn_norm"], eps, into)
        o, state = _delta_net(cfg, w, x, state, step)
        out = w["la_out"]
    if reduce is None:  # one device: the W8A8 product goes unscaled into the add + norm
        delta = _out_projection(cfg, o.astype(h.dtype), out)
    else:
        delta = reduce(linear(o.astype(h.dtype), out))
    into = [w["router"]] if "router" in w else _weights(w, "w_gate_up")
    h, x = norm_into(h, delta, w["mlp_norm"], eps, into)
    out = mlp(cfg, w, x, first_expert, real_tokens(attend))
    h = h + (out if reduce is None else reduce(out)).astype(h.dtype)
    return h, kv, state
