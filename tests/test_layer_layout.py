"""The per-layer (unrolled) layout computes what the stacked (scanned) one does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxengine.models.llama import forward_hidden
from paxengine.models.loader import load_model
from paxengine.models.weights import unstack_layers
from paxengine.reference import contiguous_attend
from paxengine.runner import resolve_layer_loop


def test_unrolled_per_layer_forward_equals_scanned_stacked():
    m = load_model("dummy:tiny", "float32", seed=3)
    cfg, L = m.config, m.config.num_layers
    T, max_len = 12, 32
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, T), jnp.int32)
    positions = jnp.arange(T, dtype=jnp.int32)
    shape = (L, max_len, cfg.num_kv_heads, cfg.head_dim)
    attend = contiguous_attend(positions, cfg.sliding_window)
    stacked = {**m.params, "layers": dict(m.params["layers"])}
    h_scan, (kc, vc) = forward_hidden(
        stacked, cfg, tokens, positions, (jnp.zeros(shape), jnp.zeros(shape)), attend
    )

    per_layer = unstack_layers(m.params)
    assert m.params["layers"] == {}  # consumed: no stacked copy left behind
    assert len(per_layer["layers"]) == L
    assert "wqkv" in per_layer["layers"][0] and "w_gate_up" in per_layer["layers"][0]
    caches = [(jnp.zeros((1, *shape[1:])), jnp.zeros((1, *shape[1:]))) for _ in range(L)]
    h_unroll, caches = forward_hidden(per_layer, cfg, tokens, positions, caches, attend)

    np.testing.assert_allclose(np.asarray(h_unroll), np.asarray(h_scan), rtol=1e-5, atol=1e-5)
    for i, (k, v) in enumerate(caches):  # every layer wrote its own cache
        np.testing.assert_allclose(np.asarray(k[0]), np.asarray(kc[i]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(v[0]), np.asarray(vc[i]), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(caches[-1][0][0, :T]).sum()) > 0


def test_layer_loop_choice():
    assert resolve_layer_loop("auto") == ("unroll" if jax.default_backend() == "gpu" else "scan")
    assert resolve_layer_loop("unroll") == "unroll"
    with pytest.raises(ValueError, match="layer_loop"):
        resolve_layer_loop("sideways")


def test_compiled_step_has_no_device_conditionals():
    """XLA:GPU reads a conditional's predicate back to the host and waits for the stream, so a
    `lax.cond` anywhere in the step serializes launch and execution (measured on the H200: the
    launch took as long as the step). The GPU layout's forward and every sampler variant must
    compile without one; which sampler runs is chosen on the host."""
    from paxengine import LLM

    llm = LLM(
        model="dummy:tiny",
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        token_buckets=[16],
        seq_buckets=[4],
        attention_backend="reference",
        layer_loop="unroll",
        show_progress=False,
    )
    runner = llm.engine.runner
    assert len(runner.samplers) == 11  # penalties x top-k/p x logprobs, 3 with a grammar mask
    for name, exe in [*runner.compiled.items(), *runner.samplers.items()]:
        assert "conditional(" not in exe.as_text(), name
