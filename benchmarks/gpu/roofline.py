"""The roofline stage: the card's measured ceilings (copy bandwidth, matmul rate) and the floors
they put under every workload: max(bytes / bandwidth, FLOPs / matmul rate) per step, from the
model's costs. A floor is the time no engine can beat on this card; the report prints each
engine's figure beside it."""

from __future__ import annotations

import math
from pathlib import Path


def model_costs(cfg, dtype_bytes: int = 2) -> dict:
    """Parameters that go through matmuls per token (the layers' and the LM head's), weight
    bytes read per step, KV bytes per token, attention FLOPs per (query, key) pair."""
    h, i, d, L = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_layers
    layer_matmul = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * h * i
    head = cfg.vocab_size * h
    # the embedding is a gather, not read whole each step (unless tied to the LM head)
    weights = cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * h)
    return {
        "layer_matmul_params": L * layer_matmul,
        "lm_head_params": head,
        "weight_bytes_per_step": weights * dtype_bytes,
        "kv_bytes_per_token": 2 * L * cfg.num_kv_heads * d * dtype_bytes,
        "attn_flops_per_qk": 4 * L * cfg.num_heads * d,
    }  # QK^T + PV, per (query, key) pair


def decode_step_floor(c: dict, batch: int, ctx: float, bw: float, rate: float) -> float:
    """Seconds: one decode step of `batch` sequences at context `ctx`."""
    bytes_ = c["weight_bytes_per_step"] + batch * ctx * c["kv_bytes_per_token"]
    flops = (
        2 * batch * (c["layer_matmul_params"] + c["lm_head_params"])
        + batch * ctx * c["attn_flops_per_qk"]
    )
    return max(bytes_ / bw, flops / rate)


def prefill_floor(c: dict, num_seqs: int, length: int, bw: float, rate: float) -> float:
    """Seconds: prefill of `num_seqs` prompts of `length` tokens (logits for the last token
    only), in steps of 8,192 tokens that each read the weights once."""
    flops = (
        2 * num_seqs * length * c["layer_matmul_params"]
        + 2 * num_seqs * c["lm_head_params"]
        + num_seqs * c["attn_flops_per_qk"] * length * (length + 1) / 2
    )
    steps = max(1, math.ceil(num_seqs * length / 8192))
    return max(flops / rate, steps * c["weight_bytes_per_step"] / bw)


def workload_floor(
    c: dict, n: int, inp: int, out: int, max_seqs: int, bw: float, rate: float
) -> float:
    """Seconds for n x (inp, out) in waves of max_seqs: prefill then out-1 decode steps each."""
    total, left = 0.0, n
    while left > 0:
        b = min(left, max_seqs)
        total += prefill_floor(c, b, inp, bw, rate)
        total += sum(decode_step_floor(c, b, inp + t, bw, rate) for t in range(1, out))
        left -= b
    return total


def measure_ceilings(spec: dict) -> dict:
    """Copy bandwidth (bytes read + written per second) and bf16 (f32 on CPU) matmul FLOP/s,
    timed over many dispatches between syncs, on random data (benchmarks.measure)."""
    import jax
    import jax.numpy as jnp

    from benchmarks.measure import copy_rate, device_dtype, matmul_rate

    dev = jax.devices()[0]
    dt = device_dtype()
    bw, copy_bytes = copy_rate(spec["copy_mib"], iters=spec["iters"], dtype=dt)
    rate = matmul_rate(spec["matmul_n"], iters=spec["iters"], dtype=dt)
    return {
        "device": str(dev.device_kind),
        "platform": dev.platform,
        "dtype": str(jnp.dtype(dt)),
        "copy_bytes": copy_bytes,
        "copy_bandwidth_Bps": bw,
        "matmul_n": spec["matmul_n"],
        "matmul_flops_per_s": rate,
    }


def stage_roofline(spec: dict, out: Path) -> dict:
    """The card's ceilings and the floors they put under every workload of the spec."""
    from paxengine.models.config import PRESETS

    ceil = measure_ceilings(spec)
    cfg = PRESETS[spec["preset"]]
    c = model_costs(cfg, 2 if spec["dtype"] == "bfloat16" else 4)
    bw, rate = ceil["copy_bandwidth_Bps"], ceil["matmul_flops_per_s"]
    itl = spec["itl"]
    ctx = itl["input_len"] + (itl["n1"] + itl["n2"]) / 2
    floors = {
        f"itl_batch{b}_ms": 1e3 * decode_step_floor(c, b, ctx, bw, rate) for b in itl["batches"]
    }
    for w in spec["offline"]:  # the lowest floor: every request in one wave
        n = w["num_prompts"]
        t = workload_floor(c, n, w["input_len"], w["output_len"], n, bw, rate)
        floors[f"offline_{w['name']}_output_tok_s"] = w["num_prompts"] * w["output_len"] / t
    sv = spec["serve"]
    for conc in sv["concurrency"]:
        step = decode_step_floor(c, conc, sv["input_len"] + sv["output_len"] / 2, bw, rate)
        # each request's prefill is spread over its output tokens
        step += conc / sv["output_len"] * prefill_floor(c, 1, sv["input_len"], bw, rate)
        floors[f"serve_c{conc}_tpot_ms"] = 1e3 * step
        floors[f"serve_c{conc}_output_tok_s"] = conc / step
    floors["prefill_1024_ms"] = 1e3 * prefill_floor(c, 1, 1024, bw, rate)
    return {
        **ceil,
        "model_costs": c,
        "floors": floors,
        "note": "floors: max(bytes / measured copy bandwidth, FLOPs / measured matmul rate) "
        "per step; offline: all requests in one wave, prefill then decode; serving: "
        "decode step at the mean context plus each request's prefill spread over its "
        "tokens",
    }
