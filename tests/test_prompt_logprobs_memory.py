"""The prompt-logprob executable's memory: its chunks of logits must not all be alive at once
(an H100 start-up ran out of memory on 8,192 tokens x Qwen3.5's 248,320-token vocabulary when
XLA kept every unrolled chunk's logits; prompt_logprobs.device_values)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paxengine import prompt_logprobs as plp


def _device_values(T: int, H: int, V: int, n_top: int = 5):
    w = jnp.asarray(np.random.default_rng(0).standard_normal((H, V)), jnp.float32)
    f = jax.jit(lambda w, h, t: plp.device_values(lambda x: x @ w, h, t, V, n_top))
    return f, w


def test_temporaries_hold_about_one_chunk_not_the_steps_logits():
    T, H, V = 4096, 64, 49152
    f, w = _device_values(T, H, V)
    exe = f.lower(w, jnp.zeros((T, H)), jnp.zeros(T, jnp.int32)).compile()
    all_logits = T * V * 4
    chunk = plp.CHUNK_ELEMENTS * 4
    assert exe.memory_analysis().temp_size_in_bytes < min(4 * chunk, all_logits / 2)


def test_values_equal_the_whole_log_softmax_on_a_ragged_last_chunk():
    T, H, V, n_top = 70, 16, 1000, 5  # chunks of 16,777 rows: shrink them to cross several
    f, w = _device_values(T, H, V, n_top)
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    targets = jnp.asarray(rng.integers(-1, V, T), jnp.int32)
    old = plp.CHUNK_ELEMENTS
    plp.CHUNK_ELEMENTS = 16 * V  # 16 rows a chunk: 5 chunks, the last of 6 rows
    try:
        v = np.asarray(f(w, h, targets))
    finally:
        plp.CHUNK_ELEMENTS = old
    lps, ranks, top_ids, top_lps = plp.unpack(v, T, n_top)
    lsm = np.asarray(jax.nn.log_softmax(h @ w, axis=-1))
    tgt = np.maximum(np.asarray(targets), 0)
    want = lsm[np.arange(T), tgt]
    np.testing.assert_allclose(lps, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ranks, (lsm > want[:, None]).sum(-1) + 1)
    np.testing.assert_array_equal(top_ids, np.argsort(-lsm, axis=-1)[:, :n_top])
    np.testing.assert_allclose(
        top_lps, np.sort(lsm, axis=-1)[:, ::-1][:, :n_top], rtol=1e-5, atol=1e-5
    )
