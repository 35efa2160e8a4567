"""Speculative decoding with the n-gram proposer: config errors, the proposer, the rejection
sampler's distribution (chi-square), exact counters and block rollback in the scheduler, and on
the real SmolLM2: greedy outputs equal to non-speculative ones, seeded sampling reproducible, no
leaked blocks after rejections, aborts and preemption, nothing compiled while serving."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engines import step_until_chained
from scipy.stats import chisquare

from paxengine import LLM, SamplingParams
from paxengine.kv_cache import KVCacheManager
from paxengine.request import Request
from paxengine.sampling import (
    MAX_LOGIT_BIAS,
    MAX_STOP_IDS,
    SamplingTensors,
    sample,
    verify_drafts,
)
from paxengine.scheduler import Scheduler
from paxengine.spec_decode import parse_speculative_config, propose_ngram

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}

# -- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, match",
    [
        ({"method": "eagle3", "num_speculative_tokens": 3}, "method 'eagle3' needs 'model'"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "'eagle' is not implemented yet"),
        ({"method": "draft", "num_speculative_tokens": 3}, "method 'draft' needs 'model'"),
        ({"model": "x"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "model": "x", "num_speculative_tokens": 3}, "is for method 'draft'"),
        ({"method": "eagle", "model": "x", "num_speculative_tokens": 3}, "not implemented yet"),
        ({"method": "magic", "num_speculative_tokens": 3}, "unknown method 'magic'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"must be in \[1, 16\], got 0"),
        ({"method": "ngram", "num_speculative_tokens": 17}, r"must be in \[1, 16\], got 17"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 5,
                "prompt_lookup_max": 3,
            },
            r"prompt_lookup_min \(5\) must be <= prompt_lookup_max \(3\)",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, ">= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, r"unknown keys \['typo'\]"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "must be an integer"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_configs_are_refused(raw, match):
    with pytest.raises(ValueError, match=match):
        parse_speculative_config(raw)


def test_bad_config_fails_before_the_model_loads():
    with pytest.raises(ValueError, match="'eagle' is not implemented yet"):
        LLM(
            model="/no/such/model",
            speculative_config={"method": "eagle", "num_speculative_tokens": 2},
        )


@pytest.mark.parametrize("name", ["qwen3_next_mtp", "qwen3_5_mtp", "deepseek_mtp"])
def test_vllms_per_model_mtp_names_are_mtp(name):
    """Qwen's model cards launch Qwen3.5 with {"method": "qwen3_next_mtp", ...}: vLLM takes its
    per-model MTP names as "mtp", and so do we (the model's own MTP layer)."""
    c = parse_speculative_config({"method": name, "num_speculative_tokens": 2})
    assert (c.method, c.num_speculative_tokens) == ("mtp", 2)
    with pytest.raises(ValueError, match="unknown keys"):  # mtp's keys, not ngram's
        parse_speculative_config({"method": name, "num_speculative_tokens": 2, "model": "x"})


def test_config_defaults_and_json():
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (3, 5, 5)
    c = parse_speculative_config({"num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 3)  # as vLLM
    c = parse_speculative_config({"num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    assert c.disable_by_batch_size == 16
    assert parse_speculative_config(None) is None and parse_speculative_config({}) is None


# -- the proposer -------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_earlier_match():
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 1, 3, 3) == [4, 5, 1]
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 1, 3, 10) == [4, 5, 1, 2, 3]
    # the longest n-gram wins over a shorter, earlier one: [9, 2] matches at 3, [2] at 0
    assert propose_ngram([2, 7, 0, 9, 2, 8, 9, 2], 1, 2, 1) == [8]
    assert propose_ngram([2, 7, 0, 9, 2, 8, 9, 2], 1, 1, 1) == [7]  # earliest match of [2]
    assert propose_ngram([1, 2, 3], 1, 3, 2) == []  # nothing repeats
    assert propose_ngram([1, 2, 1], 2, 2, 2) == []  # below prompt_lookup_min
    assert propose_ngram([4], 1, 3, 2) == []


def _brute_force_ngram(tokens, min_n, max_n, k):
    """The definition, longest n first: the earliest window equal to the suffix n-gram that has
    a token after it."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        for i in range(size - n):
            if tokens[i : i + n] == tokens[size - n :]:
                return tokens[i + n : i + n + k]
    return []


def test_ngram_matches_its_definition_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(400):
        toks = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 40))).tolist()
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        k = int(rng.integers(1, 6))
        assert propose_ngram(toks, lo, hi, k) == _brute_force_ngram(toks, lo, hi, k), toks


def test_device_ngram_matches_the_host_proposer_on_random_sequences():
    """The chained steps' lookup (spec_decode/chain.py, all rows at once on the device) drafts
    what propose_ngram drafts, -1 past its proposal."""
    from paxengine.spec_decode.chain import ngram_drafts

    rng = np.random.default_rng(1)
    for _ in range(40):
        R, H = 6, 48
        k, lo = int(rng.integers(1, 6)), int(rng.integers(1, 3))
        hi = lo + int(rng.integers(0, 3))
        hist = np.full((R, H), -1, np.int32)
        lens = rng.integers(1, H + 1, R)
        for r in range(R):
            hist[r, : lens[r]] = rng.integers(0, int(rng.integers(2, 5)), lens[r])
        got = np.asarray(ngram_drafts(jnp.asarray(hist), jnp.asarray(lens, jnp.int32), lo, hi, k))
        for r in range(R):
            want = propose_ngram(hist[r, : lens[r]], lo, hi, k)
            assert got[r].tolist() == want + [-1] * (k - len(want)), (hist[r, : lens[r]], lo, hi)


def test_request_token_array_follows_appends():
    req = Request("t", [1, 2, 3], SamplingParams(), seed=0)
    assert req.token_array().tolist() == [1, 2, 3]
    for t in range(100):  # past the first buffer: it grows and keeps what it held
        req.output_token_ids.append(t)
        if t % 7 == 0:
            assert req.token_array().tolist() == req.all_token_ids
    assert req.token_array().tolist() == req.all_token_ids


# -- the rejection sampler, called directly ------------------------------------------------------


def _tensors(n, temperature, top_k=0, seed0=0):
    f32 = lambda v: jnp.full(n, v, jnp.float32)  # noqa: E731
    i32 = lambda v: jnp.full(n, v, jnp.int32)  # noqa: E731
    return SamplingTensors(
        f32(temperature), i32(top_k), f32(1.0), f32(0.0), f32(0.0), f32(0.0), f32(1.0),
        jnp.arange(seed0, seed0 + n, dtype=jnp.uint32), i32(0), jnp.zeros(n, bool),
        jnp.full((n, MAX_STOP_IDS), -1, jnp.int32), jnp.full((n, MAX_LOGIT_BIAS), -1, jnp.int32),
        jnp.zeros((n, MAX_LOGIT_BIAS), jnp.float32), None, i32(0), None,
        False, top_k > 0, False, False,
    )  # fmt: skip


@pytest.mark.parametrize("draft, top_k", [(2, 0), (0, 0), (5, 0), (1, 4)])
def test_rejection_sampler_keeps_the_target_distribution(draft, top_k):
    """Whatever the draft (likely, unlikely, or cut by top-k): it is accepted with probability
    p(draft), a rejection emits the target without the draft (chi-square), and the emitted token
    is distributed as the target (chi-square): 40k single-draft verifications on 8 tokens."""
    n, logits = 40_000, jnp.log(jnp.asarray([0.05, 0.1, 0.3, 0.02, 0.2, 0.13, 0.15, 0.05]))
    p = np.asarray(jax.nn.softmax(logits), np.float64)
    if top_k:
        p = np.where(p >= np.sort(p)[-top_k], p, 0.0)
        p /= p.sum()
    rows = np.asarray(jax.jit(sample)(jnp.broadcast_to(logits, (n, 8)), _tensors(n, 1.0, top_k))[0])
    accepted = np.asarray([verify_drafts(rows[i : i + 1], [draft]) for i in range(n)], bool)
    emitted = np.where(accepted, draft, rows)  # the draft, or the rejecting row's token
    assert not np.any(emitted[~accepted] == draft)
    assert abs(accepted.mean() - p[draft]) < 0.01  # accepted with probability p(draft)
    for tokens, target in (
        (emitted, p),
        (emitted[~accepted], np.where(np.arange(8) == draft, 0, p)),
    ):
        counts = np.bincount(tokens, minlength=8)
        keep = target > 0
        assert counts[~keep].sum() == 0
        expected = counts.sum() * target[keep] / target[keep].sum()
        assert chisquare(counts[keep], expected).pvalue > 1e-3


def test_verify_drafts_greedy_is_exact():
    logits = jnp.asarray([[0.0, 3.0, 1.0, 2.0]] * 3)
    tokens = np.asarray(sample(logits, _tensors(3, 0.0))[0])
    assert tokens.tolist() == [1, 1, 1]  # the argmax at every position
    assert verify_drafts(tokens, [1, 1]) == 2  # both drafts accepted, tokens[2] is the bonus
    assert verify_drafts(tokens, [1, 3]) == 1  # the second rejected: tokens[1] replaces it
    assert verify_drafts(tokens, [0, 1]) == 0
    assert verify_drafts(tokens[:1], []) == 0


# -- the scheduler: counters and rollback, with crafted samples ---------------------------------


def test_counters_and_rollback_exact_on_a_crafted_case():
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    spec = parse_speculative_config({**NGRAM, "prompt_lookup_max": 2})
    sched = Scheduler(kv, 8, 64, 256, spec=spec, max_sample_rows=8)
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6]  # "5 6" occurred: drafts 7 8 9 10
    req = Request("r", prompt, SamplingParams(max_tokens=50), seed=0)
    sched.add(req)
    out = sched.schedule()  # the prompt
    assert not out.drafts
    sched.update_from_output(out, {"r": [7]})  # tokens ... 5 6 7: "6 7" -> drafts 8 9 10 11
    out = sched.schedule()
    assert out.drafts == {"r": [8, 9, 10, 11]} and out.num_scheduled_tokens == {"r": 5}
    assert out.num_sample_rows == 5 and out.sample_rows() == {"r": 0}
    assert req.num_computed_tokens == 14 and len(req.block_ids) == 4  # 14 slots: 4 blocks
    sched.update_from_output(out, {"r": [8, 9, 3]})  # two accepted, the third corrected
    s = sched.spec_stats
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (1, 4, 2)
    assert s.accepted_per_pos == [1, 1, 0, 0]
    assert req.output_token_ids == [7, 8, 9, 3]
    # KV kept for the prompt, 7, 8, 9 (12 tokens: 3 blocks); the block of rejected slots is free
    assert req.num_computed_tokens == 12 and req.num_tokens == 13
    assert len(req.block_ids) == 3 and kv.num_free_blocks == 61
    out = sched.schedule()  # "9 3" never occurred, nor "3": a plain decode
    assert not out.drafts and out.num_scheduled_tokens == {"r": 1}
    sched.update_from_output(out, {"r": [5]})  # ... 3 5: "5" -> 6 7 8 9, all accepted
    out = sched.schedule()
    assert out.drafts == {"r": [6, 7, 8, 9]}
    sched.update_from_output(out, {"r": [6, 7, 8, 9, 1]})
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 8, 6)
    assert s.accepted_per_pos == [2, 2, 1, 1]
    assert req.num_computed_tokens == 18 and req.num_tokens == 19
    sched.finish(req, "abort")
    assert kv.num_free_blocks == kv.num_blocks


def test_drafts_respect_max_tokens_budget_and_disable_by_batch_size():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    spec = parse_speculative_config({**NGRAM, "disable_by_batch_size": 1})
    sched = Scheduler(kv, 8, 64, 256, spec=spec, max_sample_rows=8)
    prompt = [1, 2, 3, 4, 5, 6, 1, 2]
    a = Request("a", prompt, SamplingParams(max_tokens=3), seed=0)
    sched.add(a)
    sched.update_from_output(sched.schedule(), {"a": [3]})
    out = sched.schedule()  # 1 output so far, max_tokens 3: one draft and its bonus token
    assert out.drafts == {"a": [4]}
    sched.update_from_output(out, {"a": [4, 5]})
    assert a.is_finished and a.finish_reason == "length"
    b, c = (Request(x, prompt, SamplingParams(max_tokens=20), seed=0) for x in "bc")
    sched.add(b)
    sched.add(c)
    sched.update_from_output(sched.schedule(), {"b": [3], "c": [3]})
    assert not sched.schedule().drafts  # two running, disable_by_batch_size 1


# -- the engine on SmolLM2 -------------------------------------------------------------------------

COPY = [
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog. the quick brown "
    "fox jumps over the lazy dog. the quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,",
]
FREE = ["Describe a cat.", "x", "The capital of France is"]
MAX_TOKENS = 24


def _llm(**kw):
    base = dict(
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=16,
        show_progress=False,
        store_executables=False,
    )
    return LLM(**{**base, **kw})


@pytest.fixture(scope="module")
def plain(smollm):
    return _llm()


@pytest.fixture(scope="module")
def spec(smollm):
    return _llm(speculative_config=NGRAM)


def _assert_pool_empty(llm):
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks and all(c == 0 for c in kv.ref_counts)
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def test_greedy_identical_with_and_without_speculation(plain, spec):
    """A mixed batch: copy-heavy prompts and free ones, chunked prefill (a 64-token budget),
    prefix hits, a repetition penalty, min_tokens over EOS, and a constrained row sharing the
    verify steps (it does not speculate)."""
    from paxengine import StructuredOutputs

    prompts = COPY + FREE + [COPY[2]]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS)] * len(prompts)
    params[1] = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, repetition_penalty=1.2)
    params[4] = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=20)
    params[6] = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputs(regex="[0-9, ]+")
    )
    ref = plain.generate(prompts, params, use_tqdm=False)
    before = spec.engine.stats()
    out = spec.generate(prompts, params, use_tqdm=False)
    for p, a, b in zip(prompts, ref, out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, p
        assert a.outputs[0].text == b.outputs[0].text
    st = spec.engine.stats()
    assert st["spec_decode_num_drafts"] > before["spec_decode_num_drafts"]
    accepted = st["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    drafted = st["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    assert 0 < accepted < drafted  # some accepted, some rejected (rolled back)
    assert st["generation_tokens"] - before["generation_tokens"] == sum(
        len(o.outputs[0].token_ids) for o in out
    )
    assert st["xla_compiles_after_warmup"] == 0
    _assert_pool_empty(spec)


def test_counters_match_a_replay_of_the_proposer(spec):
    """One greedy request alone: every verify step's drafts and acceptance follow from its
    final tokens (the proposer on the tokens known then, accepted while they match)."""
    prompt = COPY[0]
    before = spec.engine.stats()
    out = spec.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )[0]
    toks = out.prompt_token_ids + out.outputs[0].token_ids
    n_known, drafts = len(out.prompt_token_ids) + 1, [0, 0, 0]
    per_pos = [0] * 4
    while n_known < len(toks):
        k = min(4, MAX_TOKENS - (n_known - len(out.prompt_token_ids)) - 1)
        d = propose_ngram(toks[:n_known], 1, 3, k) if k >= 1 else []
        a = 0
        while a < len(d) and d[a] == toks[n_known + a]:
            a += 1
        if d:
            drafts = [drafts[0] + 1, drafts[1] + len(d), drafts[2] + a]
            per_pos = [c + (i < a) for i, c in enumerate(per_pos)]
        n_known += a + 1
    st = spec.engine.stats()
    got = [
        st[k] - before[k]
        for k in (
            "spec_decode_num_drafts",
            "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens",
        )
    ]
    assert got == drafts and drafts[2] > 0
    got_pos = [
        x - y
        for x, y in zip(
            st["spec_decode_num_accepted_tokens_per_pos"],
            before["spec_decode_num_accepted_tokens_per_pos"],
        )
    ]
    assert got_pos == per_pos


def test_seeded_sampling_identical_with_and_without_speculation_and_logprobs(plain, spec):
    """A verify row draws the plain sampler's token with the plain sampler's key (seed and
    position): a seeded request's text is the same whether, and whatever, was drafted, and
    whatever its batch mates. Logprobs are those of the tokens emitted."""
    p = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=MAX_TOKENS, seed=11)
    ref = plain.generate(COPY[2], p, use_tqdm=False)[0].outputs[0].token_ids
    alone = spec.generate(COPY[2], p, use_tqdm=False)[0].outputs[0].token_ids
    mates = spec.generate([COPY[0], COPY[2], FREE[0]], p, use_tqdm=False)[1].outputs[0].token_ids
    assert alone == ref and mates == ref
    lp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2)
    a = plain.generate(COPY[2], lp, use_tqdm=False)[0].outputs[0]
    b = spec.generate(COPY[2], lp, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids and len(b.logprobs) == len(b.token_ids)
    for x, y, t in zip(a.logprobs, b.logprobs, b.token_ids):
        assert y[t].rank == x[t].rank and abs(y[t].logprob - x[t].logprob) < 1e-3
    _assert_pool_empty(spec)


def test_random_mix_identical_with_and_without_speculation(plain, spec):
    """Seeded and greedy requests with every sampling option (top-k/top-p, n=2, stop strings,
    min_tokens, a penalty, logprobs, ignore_eos, max_tokens from 1) give the plain engine's texts
    token for token: with seeds the verify rows draw what the plain sampler draws."""
    rng = np.random.default_rng(3)
    pool = COPY + FREE + ["a b c a b c a b c a b"]
    prompts, params = [], []
    for _ in range(16):
        kw = {"max_tokens": int(rng.integers(1, 20)), "seed": int(rng.integers(100))}
        if rng.random() < 0.5:
            kw.update(temperature=0.8, top_p=float(rng.choice([1.0, 0.9])), top_k=20)
        else:
            kw.update(temperature=0)
        for key, value, prob in (("n", 2, 0.2), ("stop", ["fox", "\n"], 0.2),
                                 ("repetition_penalty", 1.1, 0.15), ("logprobs", 1, 0.15),
                                 ("ignore_eos", True, 0.2), ("min_tokens", 1, 0.2)):  # fmt: skip
            if rng.random() < prob:
                kw[key] = value
        prompts.append(str(rng.choice(pool)))
        params.append(SamplingParams(**kw))
    before = spec.engine.stats()["spec_decode_num_accepted_tokens"]
    a = plain.generate(prompts, params, use_tqdm=False)
    b = spec.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        for ox, oy in zip(x.outputs, y.outputs):
            assert (ox.token_ids, ox.text, ox.finish_reason) == (
                oy.token_ids, oy.text, oy.finish_reason)  # fmt: skip
    assert spec.engine.stats()["spec_decode_num_accepted_tokens"] > before
    _assert_pool_empty(spec)


def test_abort_mid_speculation_frees_every_block(spec):
    eng = spec.engine
    eng.add_request("ab", COPY[0], SamplingParams(temperature=0, max_tokens=200))
    eng.add_request("keep", COPY[1], SamplingParams(temperature=0, max_tokens=8))
    for _ in range(40):
        eng.step()
        if eng.inflight is not None and "ab" in eng.inflight.out.drafts:
            break
    assert "ab" in eng.inflight.out.drafts  # a verify step of it is on the device
    eng.abort("ab")
    while eng.has_unfinished():
        eng.step()
    _assert_pool_empty(spec)


@pytest.fixture(scope="module")
def short_plain(short_smollm):
    """Four of SmolLM2's layers (conftest.short_smollm) without speculation: the chained verify
    steps' reference. Chaining is the scheduler's and the sampler's, alike for every layer;
    each 16-row step of the 30-layer model cost ~3x these."""
    return _llm(model=short_smollm.source)


@pytest.fixture(scope="module")
def wide(short_smollm):
    """16 sample rows: chained verify steps of up to 3 requests (K = 4); four of SmolLM2's
    layers (`short_plain`)."""
    return _llm(model=short_smollm.source, speculative_config=NGRAM, max_num_seqs=16)


def _counters(llm, before=None):
    st = llm.engine.stats()
    keys = [k for k in st if k.startswith("spec_decode_")]
    now = {k: np.asarray(st[k]) for k in keys}
    return now if before is None else {k: (now[k] - before[k]).tolist() for k in keys}


def test_chained_verify_steps_equal_unchained_ones(short_plain, wide):
    """Verify steps built while the previous one runs (the device counts its accepted drafts
    and drafts the next ones) give the texts, logprobs and counters of verify steps read first,
    which are the plain engine's texts; a penalty in the batch reads first again."""
    eng = wide.engine
    prompts = [COPY[0], COPY[1], COPY[2]]
    # 40 tokens: 20 chained steps here (17 on the 30 layers; 60 gave 30); each token is a step
    # of the 16-row engine
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, seed=5, ignore_eos=True)
    runs = {}
    for chain in (False, True):
        eng.chain_verify = chain
        before, steps = _counters(wide), eng.chained_steps
        outs = wide.generate(prompts, [greedy, seeded, greedy], use_tqdm=False)
        runs[chain] = (outs, _counters(wide, before), eng.chained_steps - steps)
        _assert_pool_empty(wide)
    assert runs[False][2] == 0 and runs[True][2] > 10
    assert runs[True][1] == runs[False][1] and runs[True][1]["spec_decode_num_accepted_tokens"] > 0
    ref = short_plain.generate(prompts, [greedy, seeded, greedy], use_tqdm=False)
    for a, b, c in zip(ref, runs[False][0], runs[True][0]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
        for x, y in zip(b.outputs[0].logprobs or [], c.outputs[0].logprobs or []):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    # a penalty's history is the host's: that batch never chains, and keeps the plain texts
    pen = SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.2)
    steps = eng.chained_steps
    outs = wide.generate(prompts, [greedy, pen, greedy], use_tqdm=False)
    assert eng.chained_steps == steps
    ref = short_plain.generate(prompts, [greedy, pen, greedy], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert eng.stats()["xla_compiles_after_warmup"] == 0


def test_abort_during_a_chained_step_frees_every_block(wide):
    eng = wide.engine
    p = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    eng.add_request("c1", COPY[0], p)
    eng.add_request("c2", COPY[2], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    step_until_chained(eng)
    eng.abort("c1")
    while eng.has_unfinished():
        eng.step()
    _assert_pool_empty(wide)


def test_preemption_under_speculation_matches_plain(short_plain, short_smollm):
    """A pool too small for every request: drafts never preempt, but decodes do; the outputs
    stay those of the plain engine and the pool comes back whole (four of SmolLM2's layers:
    the blocks a request holds are its tokens', whatever the layers)."""
    tight = _llm(
        model=short_smollm.source,
        speculative_config=NGRAM,
        num_kv_blocks=14,
        enable_prefix_caching=False,
    )
    prompts = COPY + COPY[:1]
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = short_plain.generate(prompts, p, use_tqdm=False)
    out = tight.generate(prompts, p, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.stats()["spec_decode_num_accepted_tokens"] > 0
    for a, b in zip(ref, out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    _assert_pool_empty(tight)


def test_metrics_endpoint_names():
    from serving.metrics import ServerMetrics

    stats = {
        "spec_decode_num_drafts": 3,
        "spec_decode_num_draft_tokens": 12,
        "spec_decode_num_accepted_tokens": 5,
        "spec_decode_num_accepted_tokens_per_pos": [3, 2, 0, 0],
    }
    text = ServerMetrics("vllm", "m", lambda: stats).render().decode()
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 3.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 12.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 5.0' in text
    assert (
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0'
        in text
    )


def test_serve_flag_parses_and_refuses_bad_configs(capsys):
    from serving.cli import parse

    ecfg, _ = parse(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert ecfg.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit):
        parse(["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 3}'])
    assert "'eagle' is not implemented yet" in capsys.readouterr().err


def test_failed_verify_step_recovers_and_leaks_nothing(monkeypatch):
    """A verify step that fails on the device (launched from the dispatch thread) ends its
    requests; the engine runs on with the same greedy results and an empty pool."""
    from paxengine.engine import EngineCore
    from paxengine.errors import StepFailed

    core = EngineCore(
        model="dummy:tiny",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        token_buckets=[8, 32],
        seq_buckets=[4, 8],
        num_kv_blocks=64,
        block_size=4,
        show_progress=False,
        store_executables=False,
        dispatch_thread=True,
        speculative_config=NGRAM,
    )
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]

    def run():
        core.add_request("a", {"prompt_token_ids": prompt}, SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True))  # fmt: skip
        texts, failed = {}, []
        while core.has_unfinished():
            try:
                outs = core.step()
            except StepFailed as e:
                failed += e.request_ids
                outs = e.outputs
            texts.update({o.request_id: o.outputs[0].token_ids for o in outs if o.finished})
        assert core.kv.usage == 0
        return texts, failed

    ref, failed = run()
    assert not failed and len(ref["a"]) == 12
    original, fired = core.runner.execute, []

    def faulty(arrays, st):
        verify = arrays.num_seqs[0] == 1 and arrays.logits_indices[1] > 0  # "a"'s k + 1 rows
        if verify and not fired:
            fired.append(True)
            raise RuntimeError("injected device fault")
        return original(arrays, st)

    monkeypatch.setattr(core.runner, "execute", faulty)
    texts, failed = run()
    assert fired and failed == ["a"] and texts == {}
    assert run() == (ref, [])


def test_data_parallel_stats_sum_the_per_position_counters():
    from types import SimpleNamespace

    from paxengine.data_parallel import DataParallelEngine

    def replica(drafts, per_pos):
        stats = {
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_accepted_tokens_per_pos": per_pos,
        }
        return SimpleNamespace(stats=lambda: stats)

    fake = SimpleNamespace(replicas=[replica(2, [2, 1]), replica(3, [1, 0])], routed=[0, 0])
    total = DataParallelEngine.stats(fake)
    assert total["spec_decode_num_drafts"] == 5
    assert total["spec_decode_num_accepted_tokens_per_pos"] == [3, 1]
