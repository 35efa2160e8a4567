"""Scan over stacked layer weights vs other loop forms, forward without attention (GPU).

python -m benchmarks.profile.layers
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.measure import time_calls
from benchmarks.profile.no_attention import no_attention
from benchmarks.record import write_to_out
from paxengine.models import llama
from paxengine.models.loader import load_model


def main():
    m = load_model("dummy:llama-3.1-8b", "bfloat16")
    cfg, params = m.config, m.params

    inv = llama.rope_inv_freq(cfg)  # the rope tables of positions t, built in each jit

    def rope(t):
        return llama.rope_tables(t, inv)

    res = {}
    for T in (16, 256):
        tok = jnp.zeros(T, jnp.int32)

        def scan_fwd(p, t):
            return llama.forward_hidden(p, cfg, t, t, None, no_attention)[0]

        def unrolled(p, t):
            h = p["embed"][t]
            for i in range(cfg.num_layers):
                w = {k: v[i] for k, v in p["layers"].items()}
                (h, _), _ = llama._layer(cfg, no_attention, rope(t), (h, None), (w, jnp.int32(i)))
            return h

        per_layer = [{k: v[i] for k, v in params["layers"].items()} for i in range(cfg.num_layers)]
        per_layer = jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, per_layer))

        def listed(pl, emb, t):
            h = emb[t]
            for i, w in enumerate(pl):
                (h, _), _ = llama._layer(cfg, no_attention, rope(t), (h, None), (w, jnp.int32(i)))
            return h

        f1, f2, f3 = jax.jit(scan_fwd), jax.jit(unrolled), jax.jit(listed)
        res[f"scan_T{T}"] = 1e3 * time_calls(lambda: f1(params, tok))
        res[f"unrolled_static_slices_T{T}"] = 1e3 * time_calls(lambda: f2(params, tok))
        res[f"per_layer_arrays_T{T}"] = 1e3 * time_calls(
            lambda: f3(per_layer, params["embed"], tok)
        )
    write_to_out(res, "profile_layers")


if __name__ == "__main__":
    main()
