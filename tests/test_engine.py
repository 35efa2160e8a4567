"""The engine against the oracle on the real SmolLM2: batching, chunked prefill, preemption,
prefix caching, compile guard, and that every ending gives its blocks back."""

import json

import numpy as np
import pytest
from prompts import PROMPTS

from paxengine import LLM, SamplingParams
from paxengine.errors import InvalidRequest
from paxengine.reference import reference_generate, reference_logits
from paxengine.step_build import compile_count

MAX_TOKENS = 16
# 16 prompts of mixed lengths (4 to ~70 tokens), some sharing prefixes.
MIXED = (
    PROMPTS
    + [p + " " + q for p, q in zip(PROMPTS[::2], PROMPTS[1::2])]
    + [
        "word " * 30,
        "Describe a cat.",
        "x",
        "The capital of France is Paris. The capital of Italy is",
    ]
)


def small_llm(smollm, **kw):
    base = dict(
        max_model_len=256,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        block_size=16,
        show_progress=False,
        attention_backend="reference",
    )
    base.update(kw)
    return LLM(**base)


@pytest.fixture(scope="module")
def oracle(smollm):
    out = {}
    for p in MIXED:
        ids = smollm.tokenizer.encode(p)
        out[p] = reference_generate(
            smollm.params, smollm.config, ids, MAX_TOKENS, smollm.eos_token_ids
        )
    return out


def assert_pool_empty(llm):
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert all(c == 0 for c in kv.ref_counts)
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def check_against_oracle(llm, oracle):
    overlapped = llm.engine.overlapped_steps
    outs = llm.generate(MIXED, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    # step N+1 was scheduled and dispatched before step N's tokens reached the host
    assert llm.engine.overlapped_steps > overlapped
    for p, o in zip(MIXED, outs):
        assert o.outputs[0].token_ids == oracle[p], p
    assert_pool_empty(llm)


@pytest.fixture(scope="module")
def llm_chunked(smollm):
    """Prefix caching on, a 32-token budget: prompts longer than that are prefilled in chunks.
    The default CPU attention (tiled XLA); the other engine uses the oracle's attention."""
    return small_llm(
        smollm, max_num_batched_tokens=32, enable_prefix_caching=True, attention_backend="auto"
    )


@pytest.fixture(scope="module")
def llm_tight(smollm):
    """Prefix caching off and a tiny pool: the scheduler must preempt and recompute. Steps are
    launched from the dispatch thread (the other engine launches from the caller)."""
    return small_llm(smollm, enable_prefix_caching=False, num_kv_blocks=14, dispatch_thread=True)


def test_batch_matches_oracle_chunked_prefill_prefix_on(llm_chunked, oracle):
    assert llm_chunked.engine.runner.backend == "xla"
    check_against_oracle(llm_chunked, oracle)
    # run again: now the prefixes are cached and the answers must not change
    hits = llm_chunked.engine.kv.prefix_hits
    check_against_oracle(llm_chunked, oracle)
    assert llm_chunked.engine.kv.prefix_hits > hits


def test_batch_matches_oracle_with_preemption_prefix_off(llm_tight, oracle):
    before = llm_tight.engine.scheduler.num_preemptions
    assert llm_tight.engine._dispatcher is not None
    check_against_oracle(llm_tight, oracle)
    assert llm_tight.engine.scheduler.num_preemptions > before
    assert llm_tight.engine.kv.prefix_hits == 0


def test_no_compiles_after_warmup_50_requests(llm_chunked):
    rng = np.random.default_rng(0)
    before = compile_count()
    prompts = [
        {"prompt_token_ids": rng.integers(0, 49152, size=int(n)).tolist()}
        for n in rng.integers(1, 120, size=50)
    ]
    params = [
        SamplingParams(temperature=float(t), max_tokens=int(m), seed=i)
        for i, (t, m) in enumerate(zip(rng.uniform(0, 1.5, 50), rng.integers(1, 24, 50)))
    ]
    outs = llm_chunked.generate(prompts, params, use_tqdm=False)
    assert all(o.finished for o in outs)
    assert compile_count() == before
    assert_pool_empty(llm_chunked)


def test_prefix_cache_computes_only_new_tokens(llm_chunked):
    tok = llm_chunked.tokenizer
    shared = "You are a careful assistant. " * 12
    a = llm_chunked.generate(
        shared + "Question one?", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )[0]
    b = llm_chunked.generate(
        shared + "Question two?", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )[0]
    n_shared = len(tok.encode(shared))
    assert a.num_cached_tokens == 0 or a.num_cached_tokens < n_shared
    assert b.num_cached_tokens >= (n_shared // 16 - 1) * 16 and b.num_cached_tokens > 0
    ref = reference_generate(
        llm_chunked.engine.runner.params,
        llm_chunked.engine.model_config,
        tok.encode(shared + "Question two?"),
        8,
        llm_chunked.engine.eos_token_ids,
    )
    assert b.outputs[0].token_ids == ref
    assert_pool_empty(llm_chunked)


def test_every_ending_frees_blocks(llm_chunked):
    eng = llm_chunked.engine
    # stop string, finish by length, EOS via logit bias, abort mid-way, and a refused request
    outs = llm_chunked.generate(
        ["1, 2, 3, 4, 5,", "Once upon a time", "Hello"],
        [
            SamplingParams(temperature=0, max_tokens=30, stop=[" 8"]),
            SamplingParams(temperature=0, max_tokens=5),
            SamplingParams(temperature=0, max_tokens=20, logit_bias={eng.eos_token_ids[0]: 100}),
        ],
        use_tqdm=False,
    )
    assert outs[0].outputs[0].finish_reason == "stop" and outs[0].outputs[0].stop_reason == " 8"
    assert outs[0].outputs[0].text == " 6, 7,"
    # a stop string spread over several tokens (", 8" is "," + " " + "8" or similar)
    o = llm_chunked.generate(
        "1, 2, 3, 4, 5,",
        SamplingParams(temperature=0, max_tokens=30, stop=[", 8,"]),
        use_tqdm=False,
    )[0]
    assert o.outputs[0].text == " 6, 7" and o.outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].finish_reason == "length"
    assert outs[2].outputs[0].finish_reason == "stop" and len(outs[2].outputs[0].token_ids) == 1
    assert_pool_empty(llm_chunked)
    eng.add_request("to-abort", "Tell me a long story", SamplingParams(max_tokens=50))
    for _ in range(3):
        eng.step()
    assert eng.kv.num_free_blocks < eng.kv.num_blocks
    eng.abort("to-abort")
    assert_pool_empty(llm_chunked)
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("too-long", {"prompt_token_ids": [1] * 300}, SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        eng.add_request("bad", "hi", SamplingParams(temperature=-1))
    assert_pool_empty(llm_chunked)
    assert llm_chunked.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_request_that_can_never_fit_is_refused(llm_tight):
    with pytest.raises(ValueError, match="KV blocks"):
        llm_tight.generate(
            {"prompt_token_ids": [5] * 200}, SamplingParams(max_tokens=40), use_tqdm=False
        )
    assert_pool_empty(llm_tight)


def test_seeded_sampling_independent_of_batch_mates(llm_chunked):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234)
    alone = llm_chunked.generate("The weather today", p, use_tqdm=False)[0].outputs[0].token_ids
    mates = llm_chunked.generate(
        ["Some other prompt", "The weather today", "def f(x):"],
        [SamplingParams(temperature=0.8, max_tokens=7, seed=5), p, SamplingParams(temperature=0)],
        use_tqdm=False,
    )
    assert mates[1].outputs[0].token_ids == alone
    other = llm_chunked.generate(
        "The weather today",
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=99),
        use_tqdm=False,
    )[0]
    assert other.outputs[0].token_ids != alone


def test_batch_mates_flags_leave_other_rows_alone(llm_chunked):
    """A plain seeded request runs in the sampler without penalties, top-k/p or logprobs when it
    is alone; next to mates that switch all three on, it runs in the other variant, and must still
    draw the same tokens (those passes leave rows that do not use them bit-exact)."""
    p = SamplingParams(temperature=1.0, max_tokens=12, seed=77)
    alone = llm_chunked.generate("The weather today", p, use_tqdm=False)[0].outputs[0].token_ids
    mates = llm_chunked.generate(
        ["Some other prompt", "The weather today", "def f(x):"],
        [
            SamplingParams(temperature=0.7, top_k=5, max_tokens=9, seed=3, logprobs=2),
            p,
            SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5),
        ],
        use_tqdm=False,
    )
    assert mates[1].outputs[0].token_ids == alone
    assert mates[0].outputs[0].logprobs is not None and mates[1].outputs[0].logprobs is None


def test_grammar_mates_leave_other_rows_alone(llm_chunked):
    """Next to a constrained mate a plain row runs in a sampler with the token mask (its row all
    ones) and draws the same tokens as alone."""
    from paxengine import StructuredOutputs

    p = SamplingParams(temperature=1.0, max_tokens=12, seed=78)
    alone = llm_chunked.generate("The weather today", p, use_tqdm=False)[0].outputs[0].token_ids
    spec = StructuredOutputs(choice=["sunny", "rainy"])
    mates = llm_chunked.generate(
        ["The weather today", "Weather:"],
        [p, SamplingParams(temperature=1.0, max_tokens=4, seed=1, structured_outputs=spec)],
        use_tqdm=False,
    )
    assert mates[0].outputs[0].token_ids == alone
    assert mates[1].outputs[0].text in ("sunny", "rainy")


def test_structural_tag_generate(llm_chunked):
    """vLLM's structural_tag offline (StructuredOutputs(structural_tag=...)): free text, and where
    the text reaches the trigger a structure whose JSON its schema accepts. The few-shot prompt
    makes SmolLM2 call the tool at once; alone it writes a city the schema does not allow."""
    import re

    import jsonschema

    from paxengine import StructuredOutputs

    city = {
        "type": "object",
        "properties": {"city": {"enum": ["Oslo", "Rome"]}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    zone = {"type": "object", "properties": {"zone": {"enum": ["utc"]}}, "required": ["zone"]}
    tag = {
        "structures": [
            {"begin": "<function=get_weather>", "schema": city, "end": "</function>"},
            {"begin": "<function=get_time>", "schema": zone, "end": "</function>"},
        ],
        "triggers": ["<function="],
    }
    prompt = (
        'Call the tool: <function=get_weather>{"city": "Paris"}</function>\n'
        'Call the tool: <function=get_weather>{"city": "Berlin"}</function>\n'
        "Call the tool:"
    )
    call = re.compile(r"<function=get_weather>(.*?)</function>")
    texts = [
        o.outputs[0].text
        for o in llm_chunked.generate(
            [prompt] * 2,
            [
                SamplingParams(temperature=0, max_tokens=40),
                SamplingParams(
                    temperature=0, max_tokens=40, structured_outputs=StructuredOutputs(structural_tag=tag)
                ),
            ],
            use_tqdm=False,
        )
    ]  # fmt: skip
    free, tagged = texts
    assert free.startswith(" <function=get_weather>{") and '"days"' not in free.split("\n")[0]
    args = call.findall(tagged)
    assert tagged.startswith(" <function=get_weather>{") and args, tagged
    for a in args:
        jsonschema.validate(json.loads(a), city)
    # after the structure's end, free text again (the model goes on with the next line)
    assert tagged.split("</function>", 1)[1].startswith("\nCall the tool"), tagged
    # under a reasoning parser the constraint applies after the think block (vLLM's rule): an
    # output that starts inside a block it never closes is free, one that opens none is not
    from paxengine.thinking import ThinkTags

    for inside, want in ((True, free), (False, tagged)):
        p = SamplingParams(
            temperature=0,
            max_tokens=40,
            structured_outputs=StructuredOutputs(structural_tag=json.dumps(tag)),
            think_tags=ThinkTags(start_ids=(1,), end_ids=(0,), inside=inside),
        )
        assert llm_chunked.generate(prompt, p, use_tqdm=False)[0].outputs[0].text == want
    assert_pool_empty(llm_chunked)


def test_logprobs_match_oracle_log_softmax(llm_chunked, smollm):
    prompt = "The three primary colors are"
    out = llm_chunked.generate(
        prompt, SamplingParams(temperature=0, max_tokens=6, logprobs=5), use_tqdm=False
    )[0].outputs[0]
    ids = smollm.tokenizer.encode(prompt)
    toks, logits = reference_generate(smollm.params, smollm.config, ids, 6, return_logits=True)
    assert out.token_ids == toks
    for step, (tok, lg) in enumerate(zip(toks, logits)):
        lsm = lg - np.log(np.sum(np.exp(lg - lg.max()))) - lg.max()
        entry = out.logprobs[step]
        assert entry[tok].rank == 1
        np.testing.assert_allclose(entry[tok].logprob, lsm[tok], atol=1e-4)
        top5 = np.argsort(-lsm)[:5]
        assert set(top5.tolist()) <= set(entry)
        for t in top5:
            np.testing.assert_allclose(entry[int(t)].logprob, lsm[t], atol=1e-4)
    assert out.cumulative_logprob == pytest.approx(
        sum(out.logprobs[i][t].logprob for i, t in enumerate(toks)), abs=1e-4
    )


def test_n_children_share_the_prompt(llm_chunked):
    outs = llm_chunked.generate(
        "Write a haiku about",
        SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7),
        use_tqdm=False,
    )[0]
    assert [o.index for o in outs.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in outs.outputs}) > 1
    assert_pool_empty(llm_chunked)


def test_min_tokens_and_ignore_eos(llm_chunked):
    eng = llm_chunked.engine
    eos = eng.eos_token_ids[0]
    o = llm_chunked.generate(
        "Hi",
        SamplingParams(temperature=0, max_tokens=6, min_tokens=4, logit_bias={eos: 100}),
        use_tqdm=False,
    )[0]
    ids = o.outputs[0].token_ids
    assert len(ids) == 5 and eos not in ids[:4] and ids[4] == eos
    o = llm_chunked.generate(
        "Hi",
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={eos: 100}),
        use_tqdm=False,
    )[0]
    assert o.outputs[0].token_ids == [eos] * 5 and o.outputs[0].finish_reason == "length"


def test_the_stop_token_that_ends_a_request_is_not_in_its_text(llm_chunked):
    """As vLLM's detokenizer: the EOS or stop_token_ids token that ended a request is left out
    of the text, special or not (with skip_special_tokens=False the EOS' '<|im_end|>' ended
    every text), and include_stop_str_in_output keeps it; a length cut keeps its last token."""
    eos = llm_chunked.engine.eos_token_ids[0]
    tok = llm_chunked.engine.tokenizer
    shown = tok.decode([eos], skip_special_tokens=False)
    base = dict(temperature=0, max_tokens=6, min_tokens=3, skip_special_tokens=False)

    def run(**kw):
        (o,) = llm_chunked.generate("Hi", SamplingParams(**{**base, **kw}), use_tqdm=False)
        return o.outputs[0]

    o = run(logit_bias={eos: 100})
    assert o.token_ids[-1] == eos and o.finish_reason == "stop" and shown
    assert o.text == tok.decode(o.token_ids[:-1], skip_special_tokens=False)
    o = run(logit_bias={eos: 100}, include_stop_str_in_output=True)
    assert o.text.endswith(shown)
    plain = run(max_tokens=4, ignore_eos=True)  # four tokens, no stop: each in the text
    stop = plain.token_ids[3]
    o = run(max_tokens=4, stop_token_ids=[stop])
    assert o.token_ids == plain.token_ids and o.stop_reason == stop
    assert o.text == tok.decode(plain.token_ids[:3], skip_special_tokens=False) != plain.text
    o = run(max_tokens=4, ignore_eos=True, logit_bias={eos: 100})  # EOS, but a length cut
    assert o.finish_reason == "length" and o.text.endswith(shown)
    assert_pool_empty(llm_chunked)


def test_chat_uses_the_template(llm_chunked):
    o = llm_chunked.chat(
        [{"role": "user", "content": "What is 2+2?"}],
        SamplingParams(temperature=0, max_tokens=8),
        use_tqdm=False,
    )[0]
    tok = llm_chunked.tokenizer
    assert o.prompt_token_ids == tok.encode_chat([{"role": "user", "content": "What is 2+2?"}])
    assert o.outputs[0].text.strip()
    # a prefilled answer: the prompt is the rendered chat cut inside the last message
    convo = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2"}]
    go_on = llm_chunked.chat(
        convo,
        SamplingParams(temperature=0, max_tokens=4),
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )[0]
    text = tok.apply_chat_template(convo, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("2+2") and go_on.prompt_token_ids == tok.encode(
        text, add_special_tokens=False
    )


def test_vllms_offline_api_names(llm_chunked):
    """What a vLLM script calls: generate(prompts, sampling_params=...) with TextPrompt dicts,
    get_tokenizer(), reset_prefix_cache(), chat(tools=..., chat_template=...)."""
    greedy = SamplingParams(temperature=0, max_tokens=4)
    (a,) = llm_chunked.generate("Describe a cat.", greedy, use_tqdm=False)
    (b,) = llm_chunked.generate(
        [{"prompt": "Describe a cat."}], sampling_params=greedy, use_tqdm=False
    )
    assert b.prompt_token_ids == a.prompt_token_ids and b.outputs[0].text == a.outputs[0].text
    with pytest.raises(TypeError, match="not both"):
        llm_chunked.generate("x", sampling_params=greedy, params=greedy)
    assert llm_chunked.get_tokenizer() is llm_chunked.tokenizer
    assert llm_chunked.reset_prefix_cache()  # nothing runs: every cached block dropped
    assert llm_chunked.engine.kv.num_free_blocks == llm_chunked.engine.kv.num_blocks
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    template = "{% for t in tools %}{{ t.function.name }}:{% endfor %}{{ messages[0].content }}"
    (c,) = llm_chunked.chat(
        [{"role": "user", "content": "hi"}],
        greedy,
        use_tqdm=False,
        tools=tools,
        chat_template=template,
    )
    tok = llm_chunked.get_tokenizer()
    assert c.prompt_token_ids == tok.encode("get_weather:hi", add_special_tokens=False)


def test_truncate_prompt_tokens_runs_the_prompts_last_tokens(llm_chunked):
    tok = llm_chunked.tokenizer
    text = "One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve"
    ids = tok.encode(text)
    greedy = dict(temperature=0, max_tokens=5, ignore_eos=True)
    cut = llm_chunked.generate(
        text, SamplingParams(**greedy, truncate_prompt_tokens=7), use_tqdm=False
    )[0]
    plain = llm_chunked.generate(
        {"prompt_token_ids": ids[-7:]}, SamplingParams(**greedy), use_tqdm=False
    )[0]
    assert len(ids) > 7 and cut.prompt_token_ids == ids[-7:] and cut.prompt is None
    assert cut.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(InvalidRequest, match="exceeds max_model_len") as e:
        llm_chunked.generate(text, SamplingParams(truncate_prompt_tokens=10**6), use_tqdm=False)
    assert e.value.param == "truncate_prompt_tokens"


def test_allowed_token_ids_sample_only_them(llm_chunked):
    """Seeded sampling stays inside the set; greedy picks the set's best, as a +100 logit bias
    on the same ids does (logits are far below 100 apart)."""
    ids = llm_chunked.tokenizer.encode(" red green blue yellow")
    prompt = "My favourite colours are"
    sampled = llm_chunked.generate(
        [prompt] * 2,
        SamplingParams(temperature=1.0, seed=3, max_tokens=8, allowed_token_ids=ids),
        use_tqdm=False,
    )
    for o in sampled:
        assert set(o.outputs[0].token_ids) <= set(ids) and len(o.outputs[0].token_ids) == 8
    greedy = dict(temperature=0, max_tokens=8, ignore_eos=True)
    masked, biased = (
        llm_chunked.generate(prompt, SamplingParams(**greedy, **kw), use_tqdm=False)[0]
        for kw in ({"allowed_token_ids": ids}, {"logit_bias": {t: 100 for t in ids}})
    )
    assert masked.outputs[0].token_ids == biased.outputs[0].token_ids
    with pytest.raises(InvalidRequest, match="outside the vocabulary") as e:
        llm_chunked.generate(prompt, SamplingParams(allowed_token_ids=[10**7]), use_tqdm=False)
    assert e.value.param == "allowed_token_ids"


def _holds(tokens, seq) -> bool:
    return any(tokens[i : i + len(seq)] == seq for i in range(len(tokens) - len(seq) + 1))


def test_bad_words_are_never_sampled_and_match_transformers(llm_chunked, hf_smollm):
    """vLLM's bad_words: a one-token word never appears, a two-token word's second token never
    follows its first (the first still may). The greedy output is transformers' greedy output
    with bad_words_ids the same token ids, checked teacher-forced in one forward (as
    test_model_parity): at every position HF's NoBadWordsLogitsProcessor's argmax is our next
    token. HF also matches a word's start in the prompt, vLLM only in the output: this prompt
    ends in neither word's first token, so the two rules agree here."""
    import torch
    from transformers.generation.logits_process import NoBadWordsLogitsProcessor

    hf, _ = hf_smollm
    prompt = "Once upon a time"  # greedy: ", the city of Nova Haven was a thriving metropolis"
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    plain = llm_chunked.generate(prompt, SamplingParams(**greedy), use_tqdm=False)[0]
    ids, before = plain.prompt_token_ids, plain.outputs[0].token_ids
    for words in (["city"], ["city of"]):  # " city": one token; " city of": two
        p = SamplingParams(**greedy, bad_words=words)
        out = llm_chunked.generate(prompt, p, use_tqdm=False)[0].outputs[0].token_ids
        seqs = p.bad_words_token_ids  # set at entry: the word, and after a space
        assert len(seqs) == 2 and {len(s) for s in seqs} == {len(words[0].split())}
        assert any(_holds(before, s) for s in seqs)  # the plain output has the word
        assert not any(_holds(out, s) for s in seqs) and len(out) == 12, words
        if len(seqs[0]) == 2:  # the first token of a two-token word is not banned
            assert any(t in out for t in (s[0] for s in seqs))
        proc = NoBadWordsLogitsProcessor(seqs, eos_token_id=None)
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out])).logits[0]
        ref = [
            int(proc(torch.tensor([ids + out[:j]]), logits[len(ids) - 1 + j][None])[0].argmax())
            for j in range(len(out))
        ]
        assert out == ref, words
    with pytest.raises(InvalidRequest, match="bad_words") as e:
        llm_chunked.generate(prompt, SamplingParams(bad_words=[""]), use_tqdm=False)
    assert e.value.param == "bad_words"
    assert_pool_empty(llm_chunked)


def test_penalties_take_the_exact_history_path(llm_chunked):
    prompt = "word word word word word word word word"
    plain = (
        llm_chunked.generate(prompt, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[
            0
        ]
        .outputs[0]
        .token_ids
    )
    pen = SamplingParams(temperature=0, max_tokens=10, frequency_penalty=2.0, presence_penalty=1.0)
    a = llm_chunked.generate(prompt, pen, use_tqdm=False)[0].outputs[0].token_ids
    b = (
        llm_chunked.generate(
            [prompt, "other"], [pen, SamplingParams(max_tokens=3)], use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    assert a == b and a != plain
    # a token generated twice must have been penalised below any never-seen alternative: with a
    # frequency penalty of 2 per use, greedy decoding repeats no token more than a few times
    assert max(a.count(t) for t in set(a)) <= 3


def test_structured_outputs_offline_under_preemption(llm_tight, oracle):
    """Constrained and unconstrained requests in one batch on the preempting engine: constrained
    outputs follow their grammars (across preemption and recompute), the unconstrained ones
    still match the oracle (their all-ones mask rows change nothing), and nothing recompiles."""
    import re

    import jsonschema

    from paxengine import StructuredOutputs

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }
    plain = MIXED[:6]
    json_spec = StructuredOutputs(json=schema)
    cons = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=32, structured_outputs=json_spec)
        for i in range(4)
    ] + [
        SamplingParams(
            temperature=0, max_tokens=8, structured_outputs=StructuredOutputs(regex=r"[0-9]{4}")
        )
    ]
    before, preempted = compile_count(), llm_tight.engine.scheduler.num_preemptions
    outs = llm_tight.generate(
        plain + ["Describe a person as JSON:"] * len(cons),
        [SamplingParams(temperature=0, max_tokens=MAX_TOKENS)] * len(plain) + cons,
        use_tqdm=False,
    )
    for p, o in zip(plain, outs):
        assert o.outputs[0].token_ids == oracle[p], p
    for o in outs[len(plain) : len(plain) + 4]:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0]
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
    assert re.fullmatch(r"[0-9]{4}", outs[-1].outputs[0].text)
    assert llm_tight.engine.scheduler.num_preemptions > preempted
    assert compile_count() == before
    assert_pool_empty(llm_tight)


# ------------------------------------------------------------------------- prompt logprobs
def _hf_prompt_log_softmax(hf_smollm, ids):
    """transformers' fp32 log-softmax at every prompt position: row i - 1 scores token i."""
    import torch

    hf, _ = hf_smollm
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def check_prompt_logprobs(o, lsm, k: int, rtol: float = 2e-5) -> None:
    """o: a RequestOutput whose params asked prompt_logprobs=k; lsm: HF's log-softmax. Within
    1e-4, and 2e-5 of the value for rare tokens (below -5): where two fp32 forwards of 30
    layers (JAX's and torch's) differ that much themselves (-14.1093 vs -14.1092)."""
    ids = o.prompt_token_ids
    plp = o.prompt_logprobs
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        row, tok, entry = lsm[i - 1], ids[i], plp[i]
        np.testing.assert_allclose(
            entry[tok].logprob, row[tok], atol=1e-4, rtol=rtol, err_msg=f"position {i}"
        )
        # rank: 1 + how many tokens score higher (near ties may swap within the tolerance)
        tol = 1e-4 + rtol * abs(row[tok])
        higher = int(np.sum(row > row[tok] + tol)) + 1
        close = int(np.sum(row > row[tok] - tol))
        assert higher <= entry[tok].rank <= max(close, 1), (i, entry[tok].rank, higher, close)
        top = np.argsort(-row)[:k]
        assert len(entry) <= k + 1
        for t in top:  # the top k are HF's top k (but for near ties), with their logprobs
            if int(t) in entry:
                np.testing.assert_allclose(entry[int(t)].logprob, row[t], atol=1e-4, rtol=rtol)
            else:
                assert row[t] - row[top[-1]] < 1e-4, (i, int(t))
        for t, v in entry.items():
            np.testing.assert_allclose(v.logprob, row[t], atol=1e-4, rtol=rtol)


def test_prompt_logprobs_match_hf_with_chunked_prefill_and_no_prefix_hit(
    llm_chunked, smollm, hf_smollm
):
    """32-token steps: the ~70-token prompts' logprobs come in three chunks. The prompt was
    cached by a request before: the one asking computes it anyway (no hit), the values equal
    transformers' fp32 log-softmax at every position, and nothing compiles."""
    prompt = " ".join(PROMPTS)  # 88 tokens
    ids = smollm.tokenizer.encode(prompt)
    assert len(ids) > 64
    llm_chunked.generate(prompt, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    before = compile_count()
    prompts = [prompt, PROMPTS[2], "x"]
    outs = llm_chunked.generate(
        prompts,
        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=5),
        use_tqdm=False,
    )
    assert compile_count() == before
    assert outs[0].num_cached_tokens == 0
    for o in outs:
        check_prompt_logprobs(o, _hf_prompt_log_softmax(hf_smollm, o.prompt_token_ids), 5)
    assert_pool_empty(llm_chunked)
    # without the field: none
    plain = llm_chunked.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None


def test_prompt_logprobs_under_preemption(llm_tight, smollm, hf_smollm, oracle):
    """A tiny pool: requests are preempted and recompute their prompts; every prompt's
    logprobs still equal transformers' (k = 0: only the prompt's own tokens), and our own
    oracle's forward (the same attention; batched, not contiguous) within 5e-5 (2e-5 of the value)."""
    before = llm_tight.engine.scheduler.num_preemptions
    # PROMPTS and their pairs: text on which our fp32 forward is within 1e-4 of transformers'
    # ("word " * 30 is not: its activations are large, 5e-4 in both engines' own logits)
    prompts = MIXED[:12]
    outs = llm_tight.generate(
        prompts,
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, prompt_logprobs=0),
        use_tqdm=False,
    )
    assert llm_tight.engine.scheduler.num_preemptions > before
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == oracle[p], p
        ids = o.prompt_token_ids
        check_prompt_logprobs(o, _hf_prompt_log_softmax(hf_smollm, ids), 0)
        ours = np.asarray(reference_logits(smollm.params, smollm.config, ids), np.float64)
        ours = ours - ours.max(-1, keepdims=True)
        ours -= np.log(np.exp(ours).sum(-1, keepdims=True))
        got = [o.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i]
        np.testing.assert_allclose(
            got, ours[np.arange(len(ids) - 1), ids[1:]], atol=5e-5, rtol=2e-5
        )
    assert_pool_empty(llm_tight)


# ------------------------------------------------------------------------- thinking budget
def test_thinking_token_budget_forces_the_end_tag(llm_chunked):
    """After `budget` tokens inside the block the end tag's tokens are forced, one by one;
    before that the tokens are the unforced greedy ones; a block the model closes itself, or
    one that never opens, is left alone; nothing compiles."""
    from paxengine.thinking import ThinkingState, ThinkTags

    prompt = "Once upon a time, in a land far away,"
    greedy = SamplingParams(temperature=0, max_tokens=10)
    free = llm_chunked.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    end = (28, 29)  # any two tokens stand for `</think>`
    before = compile_count()
    for inside, budget in ((True, 3), (True, 0)):
        tags = ThinkTags(start_ids=(1,), end_ids=end, inside=inside)
        params = SamplingParams(
            temperature=0.8, seed=3, max_tokens=10, thinking_token_budget=budget, think_tags=tags
        )
        greedy_budget = SamplingParams(
            temperature=0, max_tokens=10, thinking_token_budget=budget, think_tags=tags
        )
        toks = llm_chunked.generate(prompt, greedy_budget, use_tqdm=False)[0].outputs[0].token_ids
        assert toks[:budget] == free[:budget] and tuple(toks[budget : budget + 2]) == end
        sampled = llm_chunked.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        assert tuple(sampled[budget : budget + 2]) == end  # forced whatever the temperature
    # the block never opens (no start tag): nothing is forced
    tags = ThinkTags(start_ids=(1,), end_ids=end, inside=False)
    p = SamplingParams(temperature=0, max_tokens=10, thinking_token_budget=0, think_tags=tags)
    assert llm_chunked.generate(prompt, p, use_tqdm=False)[0].outputs[0].token_ids == free
    assert compile_count() == before
    # the state machine: a start tag opens, a partial end tag is completed, a natural one ends
    st = ThinkingState(2, ThinkTags(start_ids=(7,), end_ids=(8, 9), inside=False))
    for t in (5, 7, 1):
        st.accept(t)
    assert st.forced_token() is None and st.count == 1
    st.accept(8)  # the model starts the end tag itself at the budget
    assert st.forced_token() == 9
    st.accept(9)
    assert not st.active and st.forced_token() is None
    # a grammar after the block: the block may open only at the first token, and which tokens
    # are the grammar's
    tags = ThinkTags(start_ids=(7,), end_ids=(8,), inside=False)
    st = ThinkingState(None, tags, grammar=True)
    assert st.start_token() == 7 and not st.active and not st.grammar_waits
    assert [st.accept(t) for t in (7, 1, 2, 8, 3)] == [False, False, False, False, True]
    st = ThinkingState(None, tags, grammar=True)
    assert [st.accept(t) for t in (3, 7, 8)] == [True, True, True]  # no block: all grammar
    assert st.start_token() is None and not st.grammar_waits
    with pytest.raises(InvalidRequest, match="think_tags"):
        llm_chunked.generate(prompt, SamplingParams(thinking_token_budget=3), use_tqdm=False)
    assert_pool_empty(llm_chunked)
