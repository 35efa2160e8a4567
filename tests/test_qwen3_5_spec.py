"""Speculative decoding on Qwen3.5 (issue #54 items 3 and 7): a verify step keeps the recurrent
state after each verified position, so a rejected draft rolls the state back. Greedy tokens
equal the engine's without speculation on a tiny random checkpoint written by transformers,
with prompts that repeat (n-gram drafts accepted and rejected)."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_qwen3_5 import ENGINE, TEXT, _perturb  # noqa: E402

from paxengine import LLM, SamplingParams  # noqa: E402

MAX_TOKENS = 40  # the second prompt's answer falls into a 5-token loop after 28: drafts accepted
# repeated phrases: the n-gram lookup finds matches; the random model follows some, not all
PROMPTS = [
    [5, 9, 13, 200, 3] * 4,
    [7, 8, 9, 10, 11, 12] * 3 + [7, 8],
    [(11 * i + 5) % 300 + 1 for i in range(40)] * 2,  # crosses blocks, a prefill of two chunks
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT)).float()
    _perturb(model)
    path = tmp_path_factory.mktemp("qwen3_5_spec")
    model.save_pretrained(path)
    return path


def _greedy(llm, prompts=PROMPTS):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(checkpoint):
    llm = LLM(model=str(checkpoint), **dict(ENGINE, max_num_batched_tokens=64))
    return [_greedy(llm, [p])[0] for p in PROMPTS]


def _assert_slots_back(llm):
    kv = llm.engine.kv
    assert sorted(kv.free_slots) == list(range(ENGINE["max_num_seqs"]))


def test_ngram_greedy_equals_plain_one_by_one_and_batched(checkpoint, plain):
    """One request at a time (verify rows alone) and all at once (verify rows beside prompt
    chunks); then the same prompts again (prefix-cache hits restore a snapshot, then verify)."""
    llm = LLM(
        model=str(checkpoint), speculative_config=NGRAM, **dict(ENGINE, max_num_batched_tokens=64)
    )
    assert llm.engine.kv.verify_k == 3 and llm.engine.runner.chain is None
    assert [_greedy(llm, [p])[0] for p in PROMPTS] == plain
    stats = llm.engine.stats()
    drafted, accepted = (
        stats["spec_decode_num_draft_tokens"],
        stats["spec_decode_num_accepted_tokens"],
    )
    assert 0 < accepted < drafted, stats  # some drafts accepted, some rolled back
    assert _greedy(llm) == plain
    assert _greedy(llm) == plain
    _assert_slots_back(llm)


def test_ngram_with_preemption_equals_plain(checkpoint, plain):
    """10 blocks of 16 cannot hold the three requests' 240 tokens: a preempted request drops
    any kept state (it recomputes from zeros) and speculates again."""
    engine = dict(ENGINE, max_num_batched_tokens=64, num_kv_blocks=10)
    llm = LLM(model=str(checkpoint), speculative_config=NGRAM, **engine)
    assert _greedy(llm) == plain
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_slots_back(llm)


def test_serve_with_speculative_config_equals_plain(checkpoint, plain):
    """`paxengine serve DIR --speculative-config JSON` as a user starts it (engine process,
    background compile): a completion's tokens equal the plain engine's."""
    import json

    import httpx
    from served import served
    from test_qwen3_5 import _write_tokenizer

    _write_tokenizer(checkpoint)
    args = ["--max-model-len", "256", "--max-num-seqs", "4", "--served-model-name", "q35"]
    args += ["--speculative-config", json.dumps(NGRAM)]
    with served(str(checkpoint), *args) as base:
        body = {"model": "q35", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS}
        body.update(temperature=0, ignore_eos=True, return_token_ids=True)
        r = httpx.post(base + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == plain[1]
        lines = httpx.get(base + "/metrics").text.splitlines()
        accepted = [
            ln for ln in lines if ln.startswith("paxengine:spec_decode_num_accepted_tokens_total")
        ]
        assert accepted and float(accepted[0].split()[-1]) > 0, accepted
