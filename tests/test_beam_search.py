"""LLM.beam_search (paxengine/beam_search.py, vLLM's algorithm above the engine) against a plain
beam search over transformers' float32 SmolLM2: the same best sequences, in the same order, with
the same cumulative logprobs; length_penalty ranking as get_beam_search_score says; EOS ending a
beam, or not with ignore_eos."""

import asyncio

import numpy as np
import pytest
from beam_reference import Reference
from engines import TINY

from paxengine import LLM
from paxengine.beam_search import (
    BeamSearch,
    BeamSearchParams,
    BeamSearchSequence,
    get_beam_search_score,
)
from paxengine.errors import InvalidRequest
from paxengine.outputs import CompletionOutput, Logprob

# greedy beams of 3 over 6 tokens: "No" then EOS finishes early (-4.44) beside longer beams
QUESTION = [{"role": "user", "content": "Answer with one word. Is the sky blue?"}]
TEXT = "The capital of France is"
WIDTH, STEPS = 3, 6


@pytest.fixture(scope="module")
def llm():
    return LLM(**TINY)


@pytest.fixture(scope="module")
def ref(llm, hf_smollm):
    return Reference(hf_smollm[0], llm.tokenizer.eos_token_ids)


def test_best_beams_match_the_reference_and_batch_with_the_prefix_cache(llm, ref):
    chat = llm.tokenizer.encode_chat(QUESTION, True)
    text_ids = llm.tokenizer.encode(TEXT)
    hits = llm.engine.stats()["prefix_cache_hits"]
    outs = llm.beam_search(
        [{"prompt_token_ids": chat}, TEXT], BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS)
    )
    assert len(outs) == 2
    for out, ids in zip(outs, (chat, text_ids)):
        expected = ref.best(ref.pool(ids, WIDTH, STEPS), WIDTH)
        assert [s.tokens for s in out.sequences] == [t for t, _ in expected]
        np.testing.assert_allclose(
            [s.cum_logprob for s in out.sequences], [c for _, c in expected], atol=2e-3
        )
        for s in out.sequences:
            assert s.tokens[: len(ids)] == ids
            assert s.text == llm.tokenizer.decode(s.tokens)  # vLLM's: the prompt's and output's
            assert len(s.logprobs) == len(s.tokens) - len(ids)  # one dict a generated token
            # each step's dict: the top 2 x width (the sampled token, greedy, is among them)
            assert all(len(d) == 2 * WIDTH for d in s.logprobs)
            steps = [d[t].logprob for d, t in zip(s.logprobs, s.tokens[len(ids) :])]
            assert sum(steps) == pytest.approx(s.cum_logprob, abs=1e-4)
    # the chat's third beam ended in EOS after "No": finished (its EOS kept, as vLLM's offline)
    eos = set(llm.tokenizer.eos_token_ids)
    ended = [s for s in outs[0].sequences if s.tokens[-1] in eos]
    assert len(ended) == 1 and len(ended[0].tokens) == len(chat) + 2
    assert ended[0].finish_reason == "stop" and ended[0].stop_reason == ended[0].tokens[-1]
    assert all(len(s.tokens) == len(chat) + STEPS for s in outs[0].sequences if s not in ended)
    # each iteration's prompts are the beams so far: their full blocks come from the cache
    assert llm.engine.stats()["prefix_cache_hits"] > hits
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks and not llm.engine.scheduler.running


def test_length_penalty_ranks_as_get_beam_search_score(llm, ref):
    chat = llm.tokenizer.encode_chat(QUESTION, True)
    pool = ref.pool(chat, WIDTH, STEPS)
    eos = llm.tokenizer.eos_token_ids
    firsts = []
    for lp in (0.0, 30.0):
        params = BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS, length_penalty=lp)
        (out,) = llm.beam_search([{"prompt_token_ids": chat}], params)
        expected = ref.best(pool, WIDTH, lp)
        assert [s.tokens for s in out.sequences] == [t for t, _ in expected], lp
        scores = [get_beam_search_score(s.tokens, s.cum_logprob, eos, lp) for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        firsts.append({tuple(s.tokens) for s in out.sequences})
    # a strong length penalty prefers the long beams: the short one that ended drops out
    short = {t for t in firsts[0] if len(t) < len(chat) + STEPS}
    assert short and not short & firsts[1]


def test_ignore_eos_keeps_every_beam_going(llm, ref):
    chat = llm.tokenizer.encode_chat(QUESTION, True)
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=4, ignore_eos=True)
    (out,) = llm.beam_search([{"prompt_token_ids": chat}], params)
    expected = ref.best(ref.pool(chat, WIDTH, 4, ignore_eos=True), WIDTH)
    assert [s.tokens for s in out.sequences] == [t for t, _ in expected]
    assert all(len(s.tokens) == len(chat) + 4 and s.finish_reason is None for s in out.sequences)
    eos = set(llm.tokenizer.eos_token_ids)
    assert any(t[-1] in eos for t, _ in ref.pool(chat, WIDTH, 4))  # without it, "No" ended


def test_refusals(llm):
    with pytest.raises(InvalidRequest) as e:
        llm.beam_search([TEXT], BeamSearchParams(beam_width=11, max_tokens=4))
    assert e.value.param == "beam_width"
    with pytest.raises(InvalidRequest) as e:  # the prompt + max_tokens past the context
        llm.beam_search([TEXT], BeamSearchParams(beam_width=2, max_tokens=500))
    assert e.value.param == "max_tokens"
    with pytest.raises(ValueError, match="lora_request"):
        llm.beam_search([TEXT], BeamSearchParams(beam_width=2, max_tokens=4), lora_request="x")


# ----------------------------------------------------------------------------- the search alone
def _out(lps: dict[int, float], finish="length") -> CompletionOutput:
    d = {t: Logprob(v, r + 1, str(t)) for r, (t, v) in enumerate(lps.items())}
    return CompletionOutput(0, "", [next(iter(lps))], logprobs=[d], finish_reason=finish)


def test_search_steps_eos_and_abort():
    """Two beams from [1]: EOS (9) candidates finish (without the token unless kept), the best
    two others go on across both beams; an aborted step ends every live beam as "abort"."""
    s = BeamSearch([1], BeamSearchParams(beam_width=2, max_tokens=5), [9])
    s.extend([_out({2: -0.1, 9: -0.5, 3: -1.0, 4: -2.0})])
    assert [(b.tokens, b.cum_logprob) for b in s.beams] == [([1, 2], -0.1), ([1, 3], -1.0)]
    assert [(b.tokens, b.finish_reason, b.stop_reason) for b in s.completed] == [([1], "stop", 9)]
    s.extend([_out({5: -0.2, 9: -0.3, 6: -3.0, 7: -4}), _out({8: -0.1, 9: -0.2, 2: -5, 3: -6})])
    assert [b.tokens for b in s.beams] == [[1, 2, 5], [1, 3, 8]]
    s.extend([_out({2: -1.0}, "abort"), _out({2: -1.0})])
    assert s.done and not s.beams
    assert {b.finish_reason for b in s.completed} == {"stop", "abort"}
    # cum / len: [1, 2, 5] -0.3 / 3, [1, 2] -0.4 / 2 (its EOS not kept), [1, 3, 8] -1.1 / 3, ...
    assert [b.tokens for b in s.best()] == [[1, 2, 5], [1, 2]]
    kept = BeamSearch([1], BeamSearchParams(beam_width=2, max_tokens=1), [9], keep_eos=True)
    kept.extend([_out({9: -0.5, 2: -1.0})])
    assert kept.completed[0].tokens == [1, 9]
    assert get_beam_search_score([1, 9], -0.5, 9) == -0.5  # the final EOS is not counted
    assert isinstance(kept.best()[0], BeamSearchSequence)


def test_extreme_length_penalties_rank_without_raising():
    """Any finite length_penalty is taken (the server's length_penalty field): where the power
    leaves the floats' range the score is its limit, not an OverflowError or ZeroDivisionError
    (a 500 in the fuzz: length_penalty 1e30 and -1e308)."""
    assert get_beam_search_score([1, 2, 3], -0.5, 9, 1e30) == 0.0  # -0.5 / inf
    assert get_beam_search_score([1, 2, 3], -0.5, 9, -1e308) == -np.inf  # -0.5 / 0
    assert get_beam_search_score([1, 2, 3], 0.0, 9, -1e308) == 0.0
    assert get_beam_search_score([1, 2, 3], -0.5, 9, 2.0) == -0.5 / 9
    for lp in (1e30, -1e308, -1e30, 1e308):
        s = BeamSearch([1], BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=lp), [9])
        s.extend([_out({2: -0.1, 9: -0.5, 3: -1.0})])
        s.extend([_out({5: -0.2, 6: -3.0}), _out({8: -0.1, 7: -2.0})])
        assert len(s.best()) == 2


def test_async_engine_search_and_abort_by_id(llm):
    """Over AsyncEngine's generate: the server's form of the same search (text and tokens
    without the prompt, EOS left out of both), and abort(id) ends a running search."""
    from paxengine.async_engine import AsyncEngine

    eng = AsyncEngine(core=llm.engine)
    chat = llm.tokenizer.encode_chat(QUESTION, True)
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS)
    (offline,) = llm.beam_search([{"prompt_token_ids": chat}], params)

    async def main():
        await eng.start()
        try:
            outs = [o async for o in eng.beam_search("bs", chat, params)]
            long = BeamSearchParams(beam_width=2, max_tokens=60, ignore_eos=True)
            stream = eng.beam_search("bs2", chat, long)
            task = asyncio.ensure_future(stream.__anext__())
            live = eng.__dict__.get("_beam_searches", {})
            while not live.get("bs2") or not live["bs2"].step_ids:
                await asyncio.sleep(0.01)
            await eng.abort("bs2")
            aborted = await asyncio.wait_for(task, 120)
            return outs, aborted
        finally:
            await eng.shutdown()

    outs, aborted = asyncio.run(main())
    assert len(outs) == 1 and outs[0].finished
    eos = set(llm.tokenizer.eos_token_ids)
    for o, s in zip(outs[0].outputs, offline.sequences):
        gen = s.tokens[len(chat) :]
        assert o.token_ids == [t for t in gen if t not in eos]  # EOS not kept (no include)
        assert o.text == llm.tokenizer.decode(o.token_ids)
        assert o.cumulative_logprob == pytest.approx(s.cum_logprob, abs=1e-5)
        assert o.finish_reason == ("stop" if gen[-1] in eos else "length")
    assert {o.finish_reason for o in aborted.outputs} == {"abort"}
    assert all(len(o.token_ids) < 60 for o in aborted.outputs)
    assert not eng.__dict__["_beam_searches"]  # finished searches are forgotten


def test_every_engine_clients_abort_reaches_a_search():
    """Data parallel and disaggregated serving take the same BeamSearches mixin: abort(id) of a
    running search marks it aborted and aborts its step requests where they run."""
    from paxengine.beam_search import _Live
    from paxengine.data_parallel import DataParallelEngine
    from paxengine.disagg.front import DisaggregatedEngine

    class Part:
        def __init__(self):
            self.aborted = []

        async def abort(self, rid):
            self.aborted.append(rid)

    steps = ["s-beam3-0", "s-beam3-1"]
    dp = DataParallelEngine.__new__(DataParallelEngine)
    dp.replicas, dp._owner = [Part(), Part()], {steps[0]: 0, steps[1]: 1}
    pd = DisaggregatedEngine.__new__(DisaggregatedEngine)
    pd.prefill, pd.decode, pd._live, pd._aborted = Part(), Part(), set(steps), set()
    for eng, parts in ((dp, dp.replicas), (pd, [pd.prefill, pd.decode])):
        entry = _Live(step_ids=list(steps))
        eng.__dict__["_beam_searches"] = {"s": entry}
        asyncio.run(eng.abort("s"))
        assert entry.aborted
        assert sorted(r for p in parts for r in p.aborted if r != "s") == sorted(
            steps * (1 if eng is dp else 2)
        )
