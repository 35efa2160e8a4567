"""Sampling masks on crafted logits (top-k, top-p, min-p, penalties, bias, min_tokens)."""

import jax
import jax.numpy as jnp
import numpy as np

from paxengine.request import Request
from paxengine.sampling import (
    _apply_top_k_top_p,
    build_sampling_tensors,
    inverse_cdf,
    process_logits,
    sample,
)
from paxengine.sampling_params import SamplingParams

V = 8


def tensors(*params, history=None, out_tokens=None):
    reqs = []
    for i, p in enumerate(params):
        r = Request(f"r{i}", list(history or [0]), p, seed=i)
        r.output_token_ids = list(out_tokens or [])
        r.num_pending_tokens = 1  # as right after scheduling: this step's sample is pending
        reqs.append(r)
    return build_sampling_tensors(reqs, len(reqs), 16, eos_ids=[7])


def support(logits, st, draws=200):
    """The set of tokens sampled over many steps (different keys each step)."""

    def draw(step):
        st2 = st.__class__(**{**st.__dict__, "steps": jnp.full_like(st.steps, step)})
        return sample(jnp.asarray(logits), st2)[0][0]

    return set(np.asarray(jax.jit(jax.vmap(draw))(jnp.arange(draws))).tolist())


def test_top_k_keeps_k_best():
    logits = np.array([[0.0, 3.0, 1.0, 2.0, 0.5, -1.0, 0.2, 0.1]], np.float32)
    assert support(logits, tensors(SamplingParams(temperature=1.0, top_k=2))) == {1, 3}


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = np.array([[0.5, 0.3, 0.1, 0.05, 0.05, 0, 0, 0]]) + 1e-9
    logits = np.log(probs).astype(np.float32)
    assert support(logits, tensors(SamplingParams(temperature=1.0, top_p=0.75))) == {0, 1}


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = np.array([[0.4, 0.3, 0.2, 0.1, 1e-9, 1e-9, 1e-9, 1e-9]])
    logits = np.log(probs).astype(np.float32)
    assert support(logits, tensors(SamplingParams(temperature=1.0, min_p=0.6))) == {0, 1}


def test_penalties_on_crafted_logits():
    logits = jnp.asarray([[2.0, 2.0, -2.0, 1.0, 0, 0, 0, 0]])
    st = tensors(SamplingParams(repetition_penalty=2.0), history=[0, 2], out_tokens=[3, 3])
    out = np.asarray(process_logits(logits, st))[0]
    # prompt tokens 0 and 2 and output token 3 were seen: positive / 2, negative * 2
    np.testing.assert_allclose(out[:4], [1.0, 2.0, -4.0, 0.5])
    st = tensors(
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        history=[0, 2],
        out_tokens=[3, 3],
    )
    out = np.asarray(process_logits(logits, st))[0]
    # only output tokens count: token 3 twice -> 1 - 0.5 - 2 * 0.25
    np.testing.assert_allclose(out[:4], [2.0, 2.0, -2.0, 0.0])


def test_logit_bias_and_min_tokens_ban():
    logits = jnp.zeros((1, V))
    st = tensors(SamplingParams(logit_bias={5: 3.0}, min_tokens=2, stop_token_ids=[6]))
    out = np.asarray(process_logits(logits, st))[0]
    assert out[5] == 3.0 and out[7] == -np.inf and out[6] == -np.inf and out[0] == 0.0
    tok, *_ = sample(logits, tensors(SamplingParams(temperature=0, logit_bias={4: 1.0})))
    assert int(tok[0]) == 4


def test_inverse_cdf_matches_a_flat_prefix_sum():
    """The two-level draw picks the token a float64 prefix sum over the whole row picks (away
    from ties), skips zero-probability tokens, and stays in range for u near 1."""
    rng = np.random.default_rng(0)
    v = 1000  # not a multiple of the 256-token block
    probs = rng.random((3, v)) ** 4
    probs[:, rng.random(v) < 0.5] = 0.0  # holes, including whole blocks in row 2
    probs[2, :600] = 0.0
    probs[1, -300:] = 0.0  # the last block carries no mass
    u = np.concatenate([rng.random(200), [0.0, 1.0 - 2**-24]]).astype(np.float32)
    got = np.asarray(
        jax.jit(jax.vmap(inverse_cdf, in_axes=(None, 0)))(
            jnp.asarray(probs, jnp.float32), jnp.asarray(np.tile(u[:, None], (1, 3)))
        )
    )
    cdf = np.cumsum(probs, axis=-1)
    for r in range(3):
        want = np.searchsorted(cdf[r], u * cdf[r, -1], side="right")
        near_edge = (
            np.min(np.abs(cdf[r][None, :] - (u * cdf[r, -1])[:, None]), axis=1) < 1e-4 * cdf[r, -1]
        )
        assert (got[:, r] == np.minimum(want, v - 1))[~near_edge].all()
        assert (probs[r, got[:, r]] > 0).all()


def test_top_p_leaves_rows_without_it_unchanged():
    """One row's top-p switches the [S, V] filter on for the batch; a row without top-k/top-p
    must draw from its full distribution."""
    probs = np.array([[0.5, 0.3, 0.1, 0.05, 0.05, 0, 0, 0]] * 2) + 1e-9
    logits = np.log(probs).astype(np.float32)
    st = tensors(SamplingParams(temperature=1.0, top_p=0.75), SamplingParams(temperature=1.0))
    assert st.top and not st.penalties and not st.logprobs
    filtered = np.asarray(_apply_top_k_top_p(jnp.asarray(logits), st))
    assert np.isinf(filtered[0, 2:]).all() and np.isfinite(filtered[0, :2]).all()
    np.testing.assert_array_equal(filtered[1], logits[1])
