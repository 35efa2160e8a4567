"""Sampling masks on crafted logits (top-k, top-p, min-p, penalties, bias, min_tokens)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


class _WordTokenizer:
    """encode() from a table, without special tokens (as update_from_tokenizer must ask)."""

    TABLE = {
        "foo": [1],
        " foo": [2],  # a one-token word, another token after a space: both banned
        "bar": [3, 4],
        " bar": [5, 4],  # same length, another first token: both
        "baz": [6, 7],
        " baz": [8],  # another length: only the plain one (vLLM's rule)
        "qux": [9],
        " qux": [9],  # the same first token: once
        "": [],
        " ": [],
        "big": [60, 61],
        " big": [62, 61],
    }

    def encode(self, text, add_special_tokens=True):
        assert not add_special_tokens
        return list(self.TABLE[text])


def test_bad_words_are_tokenized_as_vllm_does():
    from paxengine.errors import InvalidRequest
    from paxengine.sampling_params import MAX_BAD_WORDS

    p = SamplingParams(bad_words=["foo", " bar", "baz", "qux", "foo"])
    p.update_from_tokenizer(_WordTokenizer(), 70)
    # " bar": its leading space stripped first; the repeated "foo" once
    assert p.bad_words_token_ids == [[1], [2], [3, 4], [5, 4], [6, 7], [9]]
    assert p.bad_words == ["foo", " bar", "baz", "qux", "foo"]  # the user's words kept
    assert p.has_bad_word_prefixes and not SamplingParams(bad_words=["foo"]).has_bad_word_prefixes

    words = _WordTokenizer()

    def refused(match, vocab=70, tokenizer=words, **kw):
        with pytest.raises(InvalidRequest, match=match) as e:
            p = SamplingParams(**kw)
            p.validate(vocab)
            p.update_from_tokenizer(tokenizer, vocab)
        assert e.value.param == "bad_words"

    refused("empty string", bad_words=["foo", ""])
    refused("list of strings", bad_words=[1])
    refused("list of strings", bad_words="foo")
    refused("at least one token", bad_words=[" "])
    refused("outside the vocabulary", vocab=62, bad_words=["big"])
    refused("tokenizer", tokenizer=None, bad_words=["foo"])
    refused("at most", bad_words_token_ids=[[1]] * (MAX_BAD_WORDS + 1))
    nothing = SamplingParams()
    nothing.update_from_tokenizer(None, 70)  # no words: no tokenizer needed
    assert nothing.bad_words == [] and nothing.bad_words_token_ids is None


def test_bad_words_banned_follows_the_output_tokens_only():
    from paxengine.sampling import bad_words_banned

    assert bad_words_banned([[5]], []) == [5]  # a one-token word: always
    two, three = [[3, 4]], [[1, 2, 3]]
    assert bad_words_banned(two, []) == [] and bad_words_banned(two, [3]) == [4]
    assert bad_words_banned(two, [1, 3]) == [4] and bad_words_banned(two, [3, 1]) == []
    assert bad_words_banned(three, [1, 2]) == [3] and bad_words_banned(three, [9, 1, 2]) == [3]
    assert bad_words_banned(three, [2]) == [] and bad_words_banned(three, [1, 9, 2]) == []
    assert bad_words_banned([[5], [3, 4], [3, 6]], [3]) == [5, 4, 6]


def test_bad_words_mask_their_rows():
    """A row's mask bans what its bad words ban after its output tokens (not the prompt's, as
    vLLM), ANDed with allowed_token_ids (which win when nothing would be left); a verify step's
    row j counts the drafts before it; greedy then picks the best token left."""
    from paxengine.structured import allowed_tokens

    V = 70
    words = [[40], [3, 4]]

    def req(out, prompt=(1, 3), **kw):
        p = SamplingParams(temperature=0, bad_words_token_ids=words, **kw)
        r = Request("r", list(prompt), p, seed=0)
        r.output_token_ids = list(out)
        return r

    def allowed(st, i):
        return np.flatnonzero(allowed_tokens(st.mask[i], V)).tolist()

    rows = [req([]), req([3]), req([3], allowed_token_ids=[4, 6]), req([3], allowed_token_ids=[4])]
    st = build_sampling_tensors(rows, 5, 8, [0], None, V)
    assert st.grammar
    everything = list(range(V))
    assert allowed(st, 0) == [t for t in everything if t != 40]  # the prompt's 3 is not output
    assert allowed(st, 1) == [t for t in everything if t not in (4, 40)]
    assert allowed(st, 2) == [6] and allowed(st, 3) == [4] and allowed(st, 4) == everything
    logits = np.zeros((5, V), np.float32)
    logits[:, 40], logits[:, 4], logits[:, 6] = 3.0, 2.0, 1.0
    tokens = np.asarray(sample(jnp.asarray(logits), st)[0]).tolist()
    assert tokens == [4, 6, 6, 4, 40]  # row 4: padding, unmasked
    # a verify step: drafts [3, 9]: row 1 samples after the draft 3
    st = build_sampling_tensors([req([5])], 3, 8, [0], None, V, drafts=[[3, 9]])
    assert [4 in allowed(st, i) for i in range(3)] == [True, False, True]
    # no word bans anything in this step: no mask
    p = SamplingParams(bad_words_token_ids=[[3, 4]])
    assert not build_sampling_tensors([Request("r", [3], p, seed=0)], 1, 8, [0], None, V).grammar


def test_a_grammar_wins_over_allowed_token_ids_that_leave_it_nothing():
    """allowed_token_ids ANDs with a grammar's mask; where the two share no token the grammar's
    mask stays (before: the row went unmasked, sampled a token the grammar refused, and the
    request ended as abort)."""
    from paxengine.sampling import token_mask
    from paxengine.structured import allowed_tokens

    V = 70

    class Grammars:
        def fill_masks(self, constrained, mask):
            for _, i in constrained:
                mask[i] = token_mask((7, 8), V)

    rows = []
    for ids in ([8, 9], [1, 2]):
        r = Request("r", [1], SamplingParams(temperature=0, allowed_token_ids=ids), seed=0)
        r.grammar = object()
        rows.append(r)
    st = build_sampling_tensors(rows, 2, 8, [0], Grammars(), V)
    assert [np.flatnonzero(allowed_tokens(st.mask[i], V)).tolist() for i in range(2)] == [
        [8],
        [7, 8],
    ]
