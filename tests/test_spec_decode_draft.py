"""Speculative decoding with a draft model (spec_decode/draft_model.py), on tiny random models:
a draft equal to the target accepts every draft and changes no greedy output; another random
draft changes no output either (greedy, and seeded sampling); the draft's KV stays right across
rejections, prefix hits, aborts and preemption, and no block leaks; bad drafts fail start-up;
nothing compiles while serving."""

import json

import pytest

from paxengine import LLM, SamplingParams

K = 3
BASE = dict(
    model="dummy:tiny",
    max_model_len=256,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    block_size=16,
    show_progress=False,
    store_executables=False,
)


def _tiny_config(path, vocab_size=512, layers=1, hidden=32):
    """A random model unlike dummy:tiny (so its drafts are often rejected), the same vocabulary
    unless told."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
    }
    path.write_text(json.dumps(cfg))
    return f"dummy:{path}"


@pytest.fixture(scope="module")
def plain():
    return LLM(**BASE)


@pytest.fixture(scope="module")
def same():
    """The draft is the target (the same preset and seed: the same weights)."""
    return LLM(**BASE, speculative_config={"model": "dummy:tiny", "num_speculative_tokens": K})


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    model = _tiny_config(tmp_path_factory.mktemp("draft") / "config.json")
    return LLM(**BASE, speculative_config={"model": model, "num_speculative_tokens": K})


# prompts that chunk (a 64-token budget), share a prefix (prefix-cache hits: the draft
# re-prefills the shared blocks), and a short one
PROMPTS = [
    {"prompt_token_ids": [(7 * i + j) % 500 for j in range(n)]}
    for i, n in enumerate((20, 90, 5, 40))
] + [{"prompt_token_ids": [(7 * 1 + j) % 500 for j in range(90)] + [3, 4, 5]}]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _delta(llm, before):
    st = llm.engine.stats()
    return {k: st[k] - before[k] for k in st if k.startswith("spec_decode") and "per_pos" not in k}


def _assert_pool_empty(llm):
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks and all(c == 0 for c in kv.ref_counts)
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def test_draft_equal_to_target_accepts_every_draft(plain, same):
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = _ids(plain.generate(PROMPTS, p, use_tqdm=False))
    before = same.engine.stats()
    out = _ids(same.generate(PROMPTS, p, use_tqdm=False))
    assert out == ref
    d = _delta(same, before)
    assert d["spec_decode_num_drafts"] > 0
    # greedy drafting with the target's own weights: every draft is the target's argmax
    assert d["spec_decode_num_accepted_tokens"] == d["spec_decode_num_draft_tokens"] > 0
    # fewer target steps than tokens: k + 1 tokens per verify step
    assert same.engine.stats()["xla_compiles_after_warmup"] == 0
    _assert_pool_empty(same)


def test_other_draft_changes_no_output_greedy_and_seeded(plain, other):
    """A random draft unlike the target: drafts are rejected (rolled back) often, accepted
    sometimes; greedy and seeded outputs are the plain engine's token for token."""
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    seeded = [
        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, seed=s, ignore_eos=True)
        for s in range(len(PROMPTS))
    ]
    before = other.engine.stats()
    assert _ids(other.generate(PROMPTS, greedy, use_tqdm=False)) == _ids(
        plain.generate(PROMPTS, greedy, use_tqdm=False)
    )
    assert _ids(other.generate(PROMPTS, seeded, use_tqdm=False)) == _ids(
        plain.generate(PROMPTS, seeded, use_tqdm=False)
    )
    d = _delta(other, before)
    assert d["spec_decode_num_draft_tokens"] > d["spec_decode_num_accepted_tokens"]
    assert other.engine.stats()["xla_compiles_after_warmup"] == 0
    _assert_pool_empty(other)


def test_abort_mid_speculation_frees_every_block(same):
    eng = same.engine
    eng.add_request("ab", PROMPTS[1], SamplingParams(temperature=0, max_tokens=100))
    eng.add_request("keep", PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))
    for _ in range(40):
        eng.step()
        if eng.inflight is not None and "ab" in eng.inflight.out.drafts:
            break
    assert "ab" in eng.inflight.out.drafts
    eng.abort("ab")
    while eng.has_unfinished():
        eng.step()
    assert "ab" not in eng.drafter.states
    _assert_pool_empty(same)


def test_draft_kv_stays_right_across_rejections(plain, same):
    """The draft is the target, the target samples (seeded; a low temperature, as a random tiny model's logits are flat): drafts are greedy,
    so many are rejected and the draft rolls back. Every proposal must still be the target's
    greedy continuation of the tokens known then, which holds only if the draft's KV for every
    earlier position (the prompt, prefix-cache hits, accepted drafts) is right."""
    eng = same.engine
    seen = []
    prepare = eng.drafter.prepare

    def record(scheduler):
        prepare(scheduler)
        for req in scheduler.running:
            if req.request_id in eng.drafter.proposals:
                seen.append((req.all_token_ids, eng.drafter.proposals[req.request_id]))

    eng.drafter.prepare = record
    try:
        ps = [SamplingParams(temperature=0.02, max_tokens=24, seed=s) for s in range(len(PROMPTS))]
        before = eng.stats()
        outs = same.generate(PROMPTS, ps, use_tqdm=False)
    finally:
        del eng.drafter.prepare
    assert _ids(outs) == _ids(plain.generate(PROMPTS, ps, use_tqdm=False))
    d = _delta(same, before)
    assert 0 < d["spec_decode_num_accepted_tokens"] < d["spec_decode_num_draft_tokens"]
    late = [s for s in seen if len(s[0]) > max(len(p["prompt_token_ids"]) for p in PROMPTS)]
    assert late  # proposals after rejections, not only first ones
    checks = seen[:: max(1, len(seen) // 24)]
    greedy = plain.generate(
        [{"prompt_token_ids": toks} for toks, _ in checks],
        [SamplingParams(temperature=0, max_tokens=len(dr), ignore_eos=True) for _, dr in checks],
        use_tqdm=False,
    )
    assert [list(dr) for _, dr in checks] == _ids(greedy)
    _assert_pool_empty(same)


def test_preemption_under_draft_speculation_matches_plain(plain):
    """A pool too small for every request: decodes preempt (the draft recomputes with the
    target); outputs stay the plain engine's, and with the draft equal to the target every
    draft is still accepted (the draft's KV was rebuilt right); the pool comes back whole."""
    tight = LLM(
        **BASE,
        speculative_config={"model": "dummy:tiny", "num_speculative_tokens": K},
        num_kv_blocks=10,
        enable_prefix_caching=False,
    )
    prompts = PROMPTS[:4]
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = _ids(plain.generate(prompts, p, use_tqdm=False))
    assert _ids(tight.generate(prompts, p, use_tqdm=False)) == ref
    st = tight.engine.stats()
    assert tight.engine.scheduler.num_preemptions > 0
    assert st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_draft_tokens"] > 0
    assert st["xla_compiles_after_warmup"] == 0
    _assert_pool_empty(tight)


def test_bad_draft_models_fail_start_up(tmp_path):
    bad_vocab = _tiny_config(tmp_path / "config.json", vocab_size=256)
    with pytest.raises(ValueError, match="vocabulary of 256 tokens, the target 512"):
        LLM(**BASE, speculative_config={"model": bad_vocab, "num_speculative_tokens": K})
    with pytest.raises(FileNotFoundError, match="model not found"):
        LLM(**BASE, speculative_config={"model": "/no/such/draft", "num_speculative_tokens": K})
    with pytest.raises(ValueError, match="method 'draft' needs 'model'"):
        LLM(**BASE, speculative_config={"method": "draft", "num_speculative_tokens": K})
    with pytest.raises(ValueError, match=r"unknown keys \['prompt_lookup_min'\]"):
        LLM(
            **BASE,
            speculative_config={
                "model": "dummy:tiny",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 2,
            },  # fmt: skip
        )


def test_planned_kv_budget_holds_the_drafts_pages():
    """A byte budget (or free memory) pays for both models' pages per block; an explicit
    num_kv_blocks is kept as it is."""
    import jax.numpy as jnp

    from paxengine.models.config import PRESETS
    from paxengine.spec_decode.draft_model import share_kv_budget

    tiny = PRESETS["tiny"]
    assert share_kv_budget(100, tiny, tiny, 16, jnp.float32, jnp.float32) == 50
    assert share_kv_budget(1, tiny, tiny, 16, jnp.float32, jnp.float32) == 1


def test_serve_flag_takes_a_draft_model(capsys):
    from serving.cli import parse

    raw = '{"model": "dummy:tiny", "num_speculative_tokens": 2}'
    ecfg, _ = parse(["--speculative-config", raw])
    assert ecfg.speculative_config == {"model": "dummy:tiny", "num_speculative_tokens": 2}
    with pytest.raises(SystemExit):
        parse(["--speculative-config", '{"method": "draft", "num_speculative_tokens": 2}'])
    assert "method 'draft' needs 'model'" in capsys.readouterr().err


def test_failed_draft_step_costs_only_the_drafts(plain, same, monkeypatch):
    """A draft forward that raises: that step runs without drafts, the draft's state starts
    over (its cache is fresh), and outputs and the pool are as without it."""
    d = same.engine.drafter
    execute, calls = d.runner.execute, []

    def flaky(arrays, st):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected draft failure")
        return execute(arrays, st)

    monkeypatch.setattr(d.runner, "execute", flaky)
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    before = same.engine.stats()
    out = _ids(same.generate(PROMPTS[:3], p, use_tqdm=False))
    assert len(calls) > 3 and out == _ids(plain.generate(PROMPTS[:3], p, use_tqdm=False))
    delta = _delta(same, before)
    assert delta["spec_decode_num_accepted_tokens"] == delta["spec_decode_num_draft_tokens"] > 0
    assert same.engine.stats()["failed_steps"] == before["failed_steps"]
    _assert_pool_empty(same)
