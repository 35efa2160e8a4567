"""The Gated DeltaNet layer (Qwen3.5's linear attention) over a step's ragged batch, after its
in-projections: the causal conv with its state, the gating, the gated delta rule with its state,
the gated RMSNorm. `models/qwen3_5.py` projects and calls `layer`; the math and the state pools'
slots are `kernels_pallas/gated_delta_ref.py`'s.

How it runs (`gdn_kernels`): on a GPU the Pallas kernels, elsewhere their jnp oracles (tests
run the kernels in interpret mode with PAXENGINE_KERNEL_GDN=interpret). Steps of up to
`FUSED_STEP_MAX_TOKENS` tokens and every decode bucket (T <= S; `fused_step`) run conv, gating
and recurrence as one kernel (`gated_delta_decode` over the ragged batch), where XLA launched
~20 small kernels a layer; larger prefill buckets XLA's conv and gating, then the chunked kernel.

Speculative verify steps (step["position_slots"], step["verify_rows"] from `verify_slots`): a
verify row [t, d1..dk] must leave the state at its last ACCEPTED position, which the host (or
the device) learns only after the step. So with step["verify_span"] = (first, P) every row of at
most P = k + 1 tokens (decode and verify rows; not a row that writes a prefix-cache snapshot)
keeps the state after each position p: p < len - 1 in slot first + home * k + p
(kv_cache.KVCacheManager.position_slot), the last one in its home slot as usual. When only
a < len - 1 drafts are accepted, the next step reads the state from position a's slot
(restore_slots: Scheduler._settle_drafts). In larger steps these rows' delta rule runs token by
token (the recurrent form keeps per-position states; the chunked one does not), the others'
chunked, as without speculation.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from kernels_pallas import gated_delta_ref as gdr
from paxengine.models.config import ModelConfig

FUSED_STEP_MAX_TOKENS = 64
# Decode buckets of more sequences (T <= S tokens: a token a row, a short chunk here and there)
# run the fused kernel too: through XLA's conv and gating and the chunked kernel a 256-sequence
# decode step of the 9B spent 2.5 ms in transposes and 1.8 ms in scatters of 27.3, the chunked
# kernel ~340 us a layer (benchmarks/results/gpu_2026-12-07b_qwen35_defaults/). The A/B on one
# H100 (benchmarks/results/gpu_2026-12-07c_qwen35_ratio/): 300 x (1000, 1000) 8,412 vs 7,198
# output tok/s, 256 x (1024, 128) 3,155 vs 3,010. PAXENGINE_KERNEL_GDN_FUSED_DECODE=0 turns it off.
FUSED_DECODE_BUCKETS = True


def gdn_kernels() -> str:
    """How the layers run: "gpu" (the Pallas kernels), "interpret" (the same kernels in
    interpret mode, PAXENGINE_KERNEL_GDN=interpret: tests of the model's use of them on a CPU)
    or "oracle" (gated_delta_ref's jnp, the CPU default)."""
    mode = os.environ.get("PAXENGINE_KERNEL_GDN", "auto")
    if mode not in ("auto", "interpret", "oracle"):
        raise ValueError(f"PAXENGINE_KERNEL_GDN must be auto, interpret or oracle, got {mode!r}")
    if mode == "auto":
        return "gpu" if jax.default_backend() == "gpu" else "oracle"
    return mode


def fused_step(t: int, s: int) -> bool:
    """Whether a step bucket of t tokens over s sequence slots runs the layer as one kernel,
    token by token (`gated_delta_decode` ragged): up to FUSED_STEP_MAX_TOKENS tokens
    (PAXENGINE_KERNEL_GDN_FUSED_MAX_TOKENS overrides it, 0: never), or (FUSED_DECODE_BUCKETS)
    a decode bucket, t <= s."""
    limit = int(os.environ.get("PAXENGINE_KERNEL_GDN_FUSED_MAX_TOKENS", FUSED_STEP_MAX_TOKENS))
    if limit <= 0:
        return False
    if t <= limit:
        return True
    default = "1" if FUSED_DECODE_BUCKETS else "0"
    mode = os.environ.get("PAXENGINE_KERNEL_GDN_FUSED_DECODE", default)
    if mode not in ("0", "1"):
        raise ValueError(f"PAXENGINE_KERNEL_GDN_FUSED_DECODE must be 0 or 1, got {mode!r}")
    return mode == "1" and t <= s


def gated_norm(o, z, weight, eps):
    """HF's Qwen3_5RMSNormGated: norm(o) scaled by the weight, times silu(z), per value head."""
    of = o.astype(jnp.float32)
    of = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + eps)
    y = weight * of.astype(o.dtype)
    return (y * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)


def verify_slots(step: dict, first: int, P: int):
    """-> (position_slots [S, P], is_verify_row [S]) of the step's rows (module docstring)."""
    qsl, home = step["query_start_loc"], step["state_slots"]
    lens = (qsl[1:] - qsl[:-1])[:, None]
    verify = (lens[:, 0] > 0) & (lens[:, 0] <= P) & (step["snapshot_slots"] < 0) & (home >= 0)
    p = jnp.arange(P, dtype=jnp.int32)[None, :]
    kept = first + home[:, None] * (P - 1) + p
    pos = jnp.where(p < lens - 1, kept, jnp.where(p == lens - 1, home[:, None], -1))
    return jnp.where(verify[:, None], pos, -1).astype(jnp.int32), verify


def layer(cfg: ModelConfig, w, mixed, z, a, b, states, step):
    """One layer over the step: mixed [T, C] (q | k | v before the conv), z [T, Hv dv], a, b
    [T, Hv] its in-projections; states the layer's {"conv", "ssm"} pools, read at each row's
    initial slot and written at its final one (and position / snapshot slots).
    -> (o [T, Hv dv], the pools)."""
    t = mixed.shape[0]
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    qsl, init, final = step["query_start_loc"], step["initial_slots"], step["state_slots"]
    snap = step["snapshot_slots"]  # the prefix cache's copy of a row's final state, or -1
    pos, verify = step.get("position_slots"), step.get("verify_rows")
    if verify is not None:  # verify rows write through position_slots
        final = jnp.where(verify, -1, final)
    dtype = z.dtype
    z = z.reshape(t, hv, dv)
    kernels = gdn_kernels()
    if kernels != "oracle" and fused_step(t, qsl.shape[0] - 1):
        from kernels_pallas.gated_delta import gated_delta_decode

        o, conv, ssm = gated_delta_decode(
            mixed, w["la_conv"], None, a, b, states["conv"], states["ssm"], init, final, pos,
            query_start_loc=qsl, snapshot_slots=snap, gating=(w["la_A_log"], w["la_dt_bias"]),
            interpret=kernels == "interpret",
        )  # fmt: skip
        o = gated_norm(o, z, w["la_norm"], cfg.rms_norm_eps)
        return o.reshape(t, hv * dv), {"conv": conv, "ssm": ssm}
    y, conv = gdr.ref_causal_conv1d(
        mixed, w["la_conv"], None, states["conv"], qsl, init, final, pos, snapshot_slots=snap
    )
    q, k, v = gdr.split_qkv(y.astype(dtype), hk, dk, hv, dv)
    g, beta = gdr.gdn_gating(a, b, w["la_A_log"], w["la_dt_bias"])
    ssm = states["ssm"]
    if verify is not None:
        # the verify rows first: they read their initial slots before anything here writes
        # them (the chunked call below neither reads nor writes theirs)
        o_v, dst, ssm = _verify_rows(q, k, v, g, beta, ssm, qsl, init, pos, verify)
        init = jnp.where(verify, -1, init)
    o, ssm = _delta_rule(q, k, v, g, beta, ssm, qsl, init, final, snap)
    if verify is not None:
        o = o.at[dst].set(o_v, mode="drop")
    o = gated_norm(o.astype(dtype), z, w["la_norm"], cfg.rms_norm_eps)
    return o.reshape(t, hv * dv), {"conv": conv, "ssm": ssm}


def _delta_rule(q, k, v, g, beta, pool, qsl, init, final, snap):
    """The chunked gated delta rule: the Pallas kernel, or its jnp oracle."""
    args = (q, k, v, g, beta, pool, qsl, init, final)
    kernels = gdn_kernels()
    if kernels != "oracle":
        from kernels_pallas.gated_delta import gated_delta_rule

        interpret = kernels == "interpret"
        return gated_delta_rule(*args, snapshot_slots=snap, interpret=interpret)
    return gdr.ref_chunk_gated_delta_rule(*args, snapshot_slots=snap)


def _verify_rows(q, k, v, g, beta, pool, qsl, init, pos, verify):
    """The delta rule token by token over every row's first P tokens, gathered as rows of
    exactly P (those past a row's end come after its own and write nothing), the states after
    each position to pos. -> (outputs [S * P, Hv, dv], where they go in the step, the pool)."""
    S, P = pos.shape
    T = q.shape[0]
    p = jnp.arange(P, dtype=jnp.int32)[None, :]
    at = qsl[:-1, None] + p
    idx = jnp.clip(at, 0, T - 1).reshape(-1)
    mine = verify[:, None] & (at < qsl[1:, None])
    dst = jnp.where(mine, at, T).reshape(-1)  # T: dropped
    qsl_v = jnp.arange(S + 1, dtype=jnp.int32) * P
    none = jnp.full((S,), -1, jnp.int32)
    init = jnp.where(verify, init, -1)
    args = (q[idx], k[idx], v[idx], g[idx], beta[idx], pool, qsl_v, init, none, pos)
    kernels = gdn_kernels()
    if kernels != "oracle":
        from kernels_pallas.gated_delta import gated_delta_rule

        interpret = kernels == "interpret"
        o, pool = gated_delta_rule(*args, impl="recurrent", interpret=interpret)
    else:
        o, pool = gdr.ref_gated_delta_rule(*args)
    return o, dst, pool
