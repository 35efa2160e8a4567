"""Sampling masks on crafted logits (top-k, top-p, min-p, penalties, bias, min_tokens)."""
import jax
import jax.numpy as jnp
import numpy as np

from paxengine.request import Request
from paxengine.sampling import build_sampling_tensors, process_logits, sample
from paxengine.sampling_params import SamplingParams

V = 8


def tensors(*params, history=None, out_tokens=None):
    reqs = []
    for i, p in enumerate(params):
        r = Request(f"r{i}", list(history or [0]), p, seed=i)
        r.output_token_ids = list(out_tokens or [])
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
    st = tensors(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), history=[0, 2],
                 out_tokens=[3, 3])
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
