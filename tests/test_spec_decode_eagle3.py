"""EAGLE-3 speculative decoding (spec_decode/eagle3.py) on a tiny random HF Llama target and a
tiny random speculator written here in the layout of the EAGLE-3 releases (config.json with
LlamaForCausalLMEagle3, model.safetensors with fc / midlayer.* / norm / lm_head / d2t / t2d):
the target's aux hidden states are transformers' hidden_states; the engine's draft logits,
round after round, equal a numpy forward of the speculator written here; greedy and seeded
outputs equal the plain engine's; no block leaks after rejections, aborts and preemption;
acceptance counters exact on a crafted speculator; bad speculators fail start-up clearly."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from paxengine import LLM, SamplingParams

K = 3
LAYERS = 7  # vLLM's default aux layers (2, L // 2, L - 3) are then (2, 3, 4)
V, H, DRAFT_V = 256, 32, 64
SPEC = dict(heads=2, kv_heads=1, head_dim=16, inter=64, eps=1e-6, theta=10000.0)
BASE = dict(
    max_model_len=256,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    token_buckets=[16, 64],  # few buckets: every engine here compiles in seconds
    seq_buckets=[16],  # 4 requests and their 3 drafts each: 16 sampled rows
    block_size=16,
    num_kv_blocks=24,
    structured_outputs=False,
    show_progress=False,
    store_executables=False,
)


def _write_target(path):
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def _write_speculator(path, seed=0):
    """Random weights in the release layout (torch's [out, in]), a draft vocabulary of DRAFT_V
    target ids picked at random."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    s = SPEC
    qd, kd = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    r = lambda *shape: (rng.standard_normal(shape) * 0.3).astype(np.float32)  # noqa: E731
    used = np.sort(rng.choice(V, DRAFT_V, replace=False))
    t2d = np.zeros(V, bool)
    t2d[used] = True
    w = {
        "fc.weight": r(H, 3 * H),
        "midlayer.input_layernorm.weight": 1 + r(H),
        "midlayer.hidden_norm.weight": 1 + r(H),
        "midlayer.self_attn.q_proj.weight": r(qd, 2 * H),
        "midlayer.self_attn.k_proj.weight": r(kd, 2 * H),
        "midlayer.self_attn.v_proj.weight": r(kd, 2 * H),
        "midlayer.self_attn.o_proj.weight": r(H, qd),
        "midlayer.post_attention_layernorm.weight": 1 + r(H),
        "midlayer.mlp.gate_proj.weight": r(s["inter"], H),
        "midlayer.mlp.up_proj.weight": r(s["inter"], H),
        "midlayer.mlp.down_proj.weight": r(H, s["inter"]),
        "norm.weight": 1 + r(H),
        "lm_head.weight": r(DRAFT_V, H),
        "d2t": (used - np.arange(DRAFT_V)).astype(np.int64),
        "t2d": t2d,
    }
    save_file(w, str(path / "model.safetensors"))
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": s["inter"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "num_hidden_layers": 1,
        "rms_norm_eps": s["eps"],
        "rope_theta": s["theta"],
        "vocab_size": V,
        "draft_vocab_size": DRAFT_V,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    return w


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    hf = _write_target(root / "target")
    w = _write_speculator(root / "speculator")
    return {
        "root": root,
        "target": str(root / "target"),
        "spec": root / "speculator",
        "hf": hf,
        "w": w,
    }


def _llm(ckpt, **kw):
    return LLM(model=ckpt["target"], weights_cache_dir=str(ckpt["root"] / "weights"), **BASE, **kw)


@pytest.fixture(scope="module")
def plain(ckpt):
    return _llm(ckpt)


@pytest.fixture(scope="module")
def eagle(ckpt):
    sc = {"method": "eagle3", "model": str(ckpt["spec"]), "num_speculative_tokens": K}
    return _llm(ckpt, speculative_config=sc)


# prompts that chunk (a 64-token budget), share a prefix (a prefix-cache hit), and a short one
PROMPTS = [
    {"prompt_token_ids": [(7 * i + j) % 250 + 3 for j in range(n)]}
    for i, n in enumerate((20, 90, 5, 40))
] + [{"prompt_token_ids": [(7 * 1 + j) % 250 + 3 for j in range(90)] + [3, 4, 5]}]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _delta(llm, before):
    st = llm.engine.stats()
    return {k: st[k] - before[k] for k in st if k.startswith("spec_decode") and "per_pos" not in k}


def _assert_pool_empty(llm):
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks and all(c == 0 for c in kv.ref_counts)
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


# -- the reference: transformers' hidden states, and the speculator in numpy --------------------
def _rms(x, g, eps=SPEC["eps"]):
    return g * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope(x, pos):
    d = x.shape[-1]
    inv = 1.0 / SPEC["theta"] ** (np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]


def _speculator(w, embed, tokens, hidden):
    """The EAGLE-3 layer over a whole sequence: row p reads (token at p + 1, hidden h_p) ->
    (draft-vocabulary logits [n, DRAFT_V], the output before `norm` [n, H])."""
    s, n = SPEC, len(tokens)
    m = lambda name: w["midlayer." + name].astype(np.float64)  # noqa: E731
    x = np.concatenate(
        [_rms(embed[tokens], m("input_layernorm.weight")), _rms(hidden, m("hidden_norm.weight"))],
        -1,
    )
    D, nh, nkv = s["head_dim"], s["heads"], s["kv_heads"]
    pos = np.arange(n)
    q = _rope((x @ m("self_attn.q_proj.weight").T).reshape(n, nh, D), pos)
    k = _rope((x @ m("self_attn.k_proj.weight").T).reshape(n, nkv, D), pos)
    v = (x @ m("self_attn.v_proj.weight").T).reshape(n, nkv, D)
    k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(D)
    scores = np.where(np.tril(np.ones((n, n), bool))[None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("hqk,khd->qhd", p, v).reshape(n, nh * D)
    h = hidden + o @ m("self_attn.o_proj.weight").T
    y = _rms(h, m("post_attention_layernorm.weight"))
    gate, up = y @ m("mlp.gate_proj.weight").T, y @ m("mlp.up_proj.weight").T
    h = h + (gate / (1 + np.exp(-gate)) * up) @ m("mlp.down_proj.weight").T
    out = _rms(h, w["norm.weight"].astype(np.float64))
    return out @ w["lm_head.weight"].astype(np.float64).T, h


def _reference_round(ckpt, tokens, k):
    """The speculator's k greedy drafts after `tokens` (target ids) and the logits of each."""
    hf, w = ckpt["hf"], ckpt["w"]
    with torch.no_grad():
        hs = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    # hidden_states[j]: the stream entering layer j, vLLM's aux convention
    aux = np.concatenate([hs[j][0].double().numpy() for j in (2, LAYERS // 2, LAYERS - 3)], -1)
    hidden = list(aux[:-1] @ w["fc.weight"].astype(np.float64).T)  # positions 0 .. n - 2
    feed = list(tokens[1:])
    embed = hf.model.embed_tokens.weight.detach().double().numpy()
    drafts, logits = [], []
    for _ in range(k):
        lg, pre = _speculator(w, embed, np.asarray(feed), np.asarray(hidden))
        d = int(np.argmax(lg[-1]))
        drafts.append(d + int(w["d2t"][d]))
        logits.append(lg[-1])
        feed.append(drafts[-1])
        hidden.append(pre[-1])  # the next position reads the layer's own output
    return drafts, logits


# -- tests --------------------------------------------------------------------------------------
def test_target_returns_the_aux_hidden_states_of_hf(ckpt):
    """forward_hidden's aux_layers, scanned and unrolled, are transformers' hidden_states."""
    from paxengine.models.llama import forward_hidden
    from paxengine.models.loader import load_model
    from paxengine.models.weights import unstack_layers
    from paxengine.reference import _empty_cache, contiguous_attend

    m = load_model(ckpt["target"], "float32", use_cache=False, progress=False)
    ids = [5, 17, 250, 3, 99, 42, 8, 200]
    with torch.no_grad():
        hs = ckpt["hf"](torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = np.concatenate([hs[j][0].numpy() for j in (0, 3, 6)], -1)
    tokens = jnp.asarray(ids, jnp.int32)
    pos = jnp.arange(len(ids), dtype=jnp.int32)
    per_layer = unstack_layers({**m.params, "layers": dict(m.params["layers"])})
    for params in (m.params, per_layer):
        cache = _empty_cache(params, m.config, len(ids))
        _, _, aux = forward_hidden(
            params, m.config, tokens, pos, cache, contiguous_attend(pos, None), aux_layers=(0, 3, 6)
        )
        np.testing.assert_allclose(np.asarray(aux), want, rtol=1e-4, atol=1e-5)


def test_draft_logits_match_a_numpy_speculator_every_round(ckpt, eagle):
    """Each round's k draft steps of one request: logits and drafts equal the numpy
    speculator's over the tokens known then, so the speculator's KV after rejections (rolled
    back, the verified tokens fed again with the target's hidden states) is right too."""
    eng = eagle.engine
    d = eng.drafter
    rounds, execute, prepare = [], d.runner.execute, d.prepare

    def record_execute(arrays, st=None):
        ids, logits = execute(arrays, st)
        rounds[-1][1].append(np.asarray(logits)[0])  # (numpy: no op compiles while serving)
        return ids, logits

    def record_prepare(scheduler):
        req = scheduler.running[0]
        rounds.append((req.all_token_ids, []))
        prepare(scheduler)

    d.runner.execute, d.prepare = record_execute, record_prepare
    try:
        prompt = [(11 * j) % 240 + 9 for j in range(30)]
        p = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
        eagle.generate([{"prompt_token_ids": prompt}], p, use_tqdm=False)
    finally:
        del d.runner.execute, d.prepare
    rounds = [r for r in rounds if r[1]]  # the last steps have no room for drafts
    assert len(rounds) >= 3
    to_target = np.asarray(d.runner.params["draft_to_target"])
    for tokens, logits in rounds:
        want_drafts, want_logits = _reference_round(ckpt, tokens, len(logits))
        np.testing.assert_allclose(np.stack(logits), np.stack(want_logits), rtol=2e-4, atol=2e-4)
        got = [int(to_target[np.argmax(lg)]) for lg in logits]
        assert got == want_drafts
    _assert_pool_empty(eagle)


def test_drafts_after_the_off_switch_and_prefix_hits_match_the_reference(ckpt, plain, eagle):
    """Several requests, the off switch at 2 running (rounds resume after plain decode steps,
    from a stale state), chunked first feeds and a prefix-cache hit (its first round re-feeds
    the cached prefix): every request's drafts in every round are the numpy speculator's."""
    import dataclasses

    eng = eagle.engine
    d, prepare, spec = eng.drafter, eng.drafter.prepare, eng.scheduler.spec
    seen = []

    def record(scheduler):
        known = {r.request_id: r.all_token_ids for r in scheduler.running}
        prepare(scheduler)
        seen.extend((w.req.request_id, known[w.req.request_id], w.drafts) for w in d._last_work)

    d.prepare = record
    eng.scheduler.spec = dataclasses.replace(spec, disable_by_batch_size=2)
    try:
        p = [
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            for n in (40, 30, 6, 10, 30)
        ]
        got = _ids(eagle.generate(PROMPTS, p, use_tqdm=False))
    finally:
        del d.prepare
        eng.scheduler.spec = spec
    assert got == _ids(plain.generate(PROMPTS, p, use_tqdm=False))
    assert len(seen) > 10 and max(len(t) for _, t, _ in seen) > 100
    lengths = {}  # request id -> the lengths it drafted at
    for rid, t, _ in seen:
        lengths.setdefault(rid, []).append(len(t))
    # a round after plain decode steps (the off switch), from the state of a round before
    assert any(b - a > K + 1 for n in lengths.values() for a, b in zip(n, n[1:]))
    for _, tokens, drafts in seen:
        assert drafts == _reference_round(ckpt, tokens, len(drafts))[0]
    _assert_pool_empty(eagle)


def test_greedy_and_seeded_outputs_equal_the_plain_engine(plain, eagle):
    """A mixed batch (chunked prompts, a prefix-cache hit, EOS allowed or not, several
    lengths): a random speculator's drafts are mostly rejected and rolled back; every token is
    the plain engine's."""
    greedy = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=i % 2 == 0)
        for i, n in enumerate((30, 12, 25, 30, 20))
    ]
    seeded = [
        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=20, seed=s, ignore_eos=True)
        for s in range(len(PROMPTS))
    ]
    before = eagle.engine.stats()  # (the counters are the process's: deltas, whatever ran before)
    for params in (greedy, seeded):
        got = _ids(eagle.generate(PROMPTS, params, use_tqdm=False))
        assert got == _ids(plain.generate(PROMPTS, params, use_tqdm=False))
    d = _delta(eagle, before)
    assert d["spec_decode_num_drafts"] > 0
    assert d["spec_decode_num_draft_tokens"] > d["spec_decode_num_accepted_tokens"]
    after = eagle.engine.stats()
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]
    assert after["xla_compiles_after_warmup"] == before["xla_compiles_after_warmup"]
    _assert_pool_empty(eagle)


def test_counters_are_consistent(eagle):
    st = eagle.engine.stats()
    per = st["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per) == K and sum(per) == st["spec_decode_num_accepted_tokens"]
    assert all(
        a >= b for a, b in zip(per, per[1:])
    )  # a draft is accepted only after the ones before
    assert st["spec_decode_num_draft_tokens"] <= K * st["spec_decode_num_drafts"]


def test_crafted_speculator_counters_are_exact(plain, eagle):
    """A speculator that always proposes token X (zero lm_head: argmax is draft id 0, mapped
    to X), swapped into the compiled steps: for one greedy request, every verify step accepts
    exactly the run of X the plain output has there, so the counters follow from that output."""
    prompt = {"prompt_token_ids": [(5 * j) % 200 + 7 for j in range(25)]}
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = _ids(plain.generate([prompt], p, use_tqdm=False))[0]
    x = max(set(out[1:]), key=out[1:].count)
    drafts = tokens = accepted = 0
    per = [0] * K
    n = 1  # the prompt's step samples the first token
    while n < len(out):
        k = min(K, len(out) - n - 1)  # the last draft's bonus token must fit max_tokens
        a = 0
        while a < k and out[n + a] == x:
            a += 1
        if k:
            drafts, tokens, accepted = drafts + 1, tokens + k, accepted + a
            per = [c + (i < a) for i, c in enumerate(per)]
        n += a + 1
    r = eagle.engine.drafter.runner
    saved = r.params
    to_target = np.asarray(saved["draft_to_target"]).copy()
    to_target[0] = x
    r.params = {  # same shapes and dtypes: the compiled steps take them as they are
        **saved,
        "lm_head": jnp.asarray(np.zeros(saved["lm_head"].shape, saved["lm_head"].dtype)),
        "draft_to_target": jnp.asarray(to_target),
    }
    jax.block_until_ready(r.params)
    before = eagle.engine.stats()  # (the arrays above were staged: those are not step compiles)
    try:
        assert _ids(eagle.generate([prompt], p, use_tqdm=False))[0] == out
    finally:
        r.params = saved
    after = eagle.engine.stats()
    assert _delta(eagle, before) == {
        "spec_decode_num_drafts": drafts,
        "spec_decode_num_draft_tokens": tokens,
        "spec_decode_num_accepted_tokens": accepted,
    }
    got = [
        a - b
        for a, b in zip(*(s["spec_decode_num_accepted_tokens_per_pos"] for s in (after, before)))
    ]
    assert got == per and accepted > 0
    assert after["xla_compiles_after_warmup"] == before["xla_compiles_after_warmup"]
    _assert_pool_empty(eagle)


def test_abort_mid_speculation_frees_every_block(eagle):
    eng = eagle.engine
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
    _assert_pool_empty(eagle)


def test_preemption_under_eagle3_matches_plain(plain, eagle):
    """More KV than the pool holds: decodes preempt (the target recomputes, and the speculator
    starts over on the target's recomputed hidden states); outputs stay the plain engine's and
    the pool comes back whole."""
    prompts = [{"prompt_token_ids": [(13 * i + j) % 240 + 5 for j in range(60)]} for i in range(4)]
    p = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
    before = eagle.engine.stats()
    assert _ids(eagle.generate(prompts, p, use_tqdm=False)) == _ids(
        plain.generate(prompts, p, use_tqdm=False)
    )
    after = eagle.engine.stats()
    assert after["num_preemptions"] > before["num_preemptions"]
    assert after["spec_decode_num_drafts"] > before["spec_decode_num_drafts"]
    assert after["xla_compiles_after_warmup"] == before["xla_compiles_after_warmup"]
    _assert_pool_empty(eagle)


def test_failed_speculator_step_costs_only_the_drafts(plain, eagle, monkeypatch):
    """A speculator step that raises: that round has no drafts, the speculator's state starts
    over, outputs and the pool are as without it."""
    r = eagle.engine.drafter.runner
    execute, calls = r.execute, []

    def flaky(arrays, st=None):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected speculator failure")
        return execute(arrays, st)

    monkeypatch.setattr(r, "execute", flaky)
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    before = eagle.engine.stats()
    assert _ids(eagle.generate(PROMPTS[:3], p, use_tqdm=False)) == _ids(
        plain.generate(PROMPTS[:3], p, use_tqdm=False)
    )
    assert len(calls) > 3 and eagle.engine.stats()["failed_steps"] == before["failed_steps"]
    _assert_pool_empty(eagle)


def test_pytorch_bin_and_layers_0_names_load_the_same(ckpt, tmp_path):
    """pytorch_model.bin (the first EAGLE-3 releases' format) with "model.layers.0." names
    reads as the safetensors "midlayer." checkpoint."""
    from paxengine.config import EngineConfig
    from paxengine.models.config import from_hf_config
    from paxengine.spec_decode.config import parse_speculative_config
    from paxengine.spec_decode.eagle3 import load_eagle3

    shutil.copy(ckpt["spec"] / "config.json", tmp_path / "config.json")
    state = {
        k.replace("midlayer.", "model.layers.0."): torch.from_numpy(np.asarray(v))
        for k, v in ckpt["w"].items()
    }
    torch.save(state, tmp_path / "pytorch_model.bin")
    target = from_hf_config(json.loads((ckpt["root"] / "target" / "config.json").read_text()))
    loaded = []
    for path in (ckpt["spec"], tmp_path):
        sc = {"method": "eagle3", "model": str(path), "num_speculative_tokens": K}
        loaded.append(load_eagle3(EngineConfig(), parse_speculative_config(sc), target))
    a, b = loaded
    assert a.aux_layers == b.aux_layers == (2, 3, 4)
    for name in ("fc", "final_norm", "lm_head", "draft_to_target"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    for name in a.layer:
        np.testing.assert_array_equal(a.layer[name], b.layer[name])


# -- bad speculators fail start-up, before anything compiles ------------------------------------
def _variant(ckpt, name, config=None, drop=(), tensors=None):
    """A copy of the speculator with its config updated, tensors dropped or replaced."""
    dst = ckpt["root"] / name
    shutil.copytree(ckpt["spec"], dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    if drop or tensors:
        w = load_file(str(dst / "model.safetensors"))
        w = {k: v for k, v in w.items() if k not in drop}
        save_file({**w, **(tensors or {})}, str(dst / "model.safetensors"))
    return str(dst)


def test_bad_speculators_fail_start_up(ckpt):
    d2t = ckpt["w"]["d2t"].copy()
    d2t[5] = 10_000
    cases = [
        (str(ckpt["root"] / "nowhere"), FileNotFoundError, "EAGLE-3 speculator not found"),
        (ckpt["target"], ValueError, "is not an EAGLE-3 Llama head"),
        (
            _variant(ckpt, "no_norm", drop=["midlayer.hidden_norm.weight"]),
            ValueError,
            "lacks midlayer.hidden_norm.weight",
        ),
        (
            _variant(ckpt, "wide", config={"target_hidden_size": 48}),
            ValueError,
            "hidden size mismatch: it reads target hidden states of 48, the target's hidden size is 32",
        ),
        (
            _variant(ckpt, "bad_d2t", tensors={"d2t": d2t}),
            ValueError,
            "d2t maps 1 draft ids outside the target's vocabulary of 256",
        ),
        (
            _variant(
                ckpt,
                "narrow_q",
                tensors={"midlayer.self_attn.q_proj.weight": np.zeros((32, H), np.float32)},
            ),
            ValueError,
            r"midlayer.self_attn.q_proj.weight has shape \(32, 32\), expected \(32, 64\)",
        ),
        (
            _variant(ckpt, "aux_ids", config={"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}),
            ValueError,
            r"aux hidden state layer ids \[1, 3, 7\] must be distinct layers of the target's 7",
        ),
        (
            _variant(ckpt, "vocab", config={"vocab_size": 512}),
            ValueError,
            "vocab_size 512, the target's is 256",
        ),
    ]
    for model, error, match in cases:
        with pytest.raises(error, match=match):
            _llm(
                ckpt,
                speculative_config={
                    "method": "eagle3",
                    "model": model,
                    "num_speculative_tokens": K,
                },
            )
    spec = str(ckpt["spec"])
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 is not implemented"):
        _llm(
            ckpt,
            tensor_parallel_size=2,
            speculative_config={"method": "eagle3", "model": spec, "num_speculative_tokens": K},
        )
    with pytest.raises(ValueError, match="is an EAGLE-3 speculator .* use method 'eagle3'"):
        _llm(ckpt, speculative_config={"model": spec, "num_speculative_tokens": K})
    with pytest.raises(ValueError, match="method 'eagle3' needs 'model'"):
        LLM(
            model="/no/such/model",
            speculative_config={"method": "eagle3", "num_speculative_tokens": K},
        )
    with pytest.raises(ValueError, match="'eagle' is not implemented yet"):
        LLM(
            model="/no/such/model",
            speculative_config={"method": "eagle", "model": spec, "num_speculative_tokens": K},
        )
