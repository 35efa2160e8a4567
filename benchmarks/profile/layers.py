"""Scan over stacked layer weights vs other loop forms, forward without attention (GPU)."""
from __future__ import annotations


import jax
import jax.numpy as jnp

from benchmarks.profile.decode import report, timed
from paxengine.models import llama
from paxengine.models.loader import load_model


def main():
    m = load_model("dummy:llama-3.1-8b", "bfloat16")
    cfg, params = m.config, m.params

    def noattn(q, k, v, c, l):
        return q, c
    inv = llama.rope_inv_freq(cfg)
    res = {}
    for T in (16, 256):
        tok = jnp.zeros(T, jnp.int32)

        def scan_fwd(p, t):
            return llama.forward_hidden(p, cfg, t, t, None, noattn)[0]

        def unrolled(p, t):
            h = p["embed"][t]
            for i in range(cfg.num_layers):
                w = {k: v[i] for k, v in p["layers"].items()}
                (h, _), _ = llama._layer(cfg, noattn, inv, t, (h, None), (w, jnp.int32(i)))
            return h

        per_layer = [{k: v[i] for k, v in params["layers"].items()} for i in range(cfg.num_layers)]
        per_layer = jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, per_layer))

        def listed(pl, emb, t):
            h = emb[t]
            for i, w in enumerate(pl):
                (h, _), _ = llama._layer(cfg, noattn, inv, t, (h, None), (w, jnp.int32(i)))
            return h
        f1, f2, f3 = jax.jit(scan_fwd), jax.jit(unrolled), jax.jit(listed)
        res[f"scan_T{T}"] = timed(lambda: f1(params, tok))
        res[f"unrolled_static_slices_T{T}"] = timed(lambda: f2(params, tok))
        res[f"per_layer_arrays_T{T}"] = timed(lambda: f3(per_layer, params["embed"], tok))
    report(res, "profile_layers")


if __name__ == "__main__":
    main()
