"""Speculative decoding on Qwen3.5 (issue #54 items 3 and 7): a verify step keeps the recurrent
state after each verified position, so a rejected draft rolls the state back. Greedy tokens
equal the engine's without speculation on a tiny random checkpoint written by transformers,
with prompts that repeat (n-gram drafts accepted and rejected)."""

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engines import step_until_chained  # noqa: E402
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
def target(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT)).float()
    _perturb(model)
    path = tmp_path_factory.mktemp("qwen3_5_spec")
    model.save_pretrained(path)
    return path, model.eval()


@pytest.fixture(scope="module")
def checkpoint(target):
    return target[0]


def _greedy(llm, prompts=PROMPTS):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


class _Mtp(torch.nn.Module):
    """Qwen3.5's MTP layer in torch (vLLM's qwen3_5_mtp.py: its parameter names are the
    checkpoint's `mtp.*`), over HF's own decoder layer, RMSNorm and RoPE: the reference."""

    def __init__(self, cfg, moe: dict | None = None):
        """moe: Qwen3.5-MoE's expert sizes (its MTP layer is an MoE decoder layer)."""
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        one = dict(TEXT, num_hidden_layers=1, layer_types=["full_attention"])
        if moe is None:
            m, kind = transformers.models.qwen3_5.modeling_qwen3_5, "Qwen3_5"
            one = transformers.Qwen3_5TextConfig(**one)
        else:
            m, kind = transformers.models.qwen3_5_moe.modeling_qwen3_5_moe, "Qwen3_5Moe"
            one.pop("intermediate_size")
            one = transformers.Qwen3_5MoeTextConfig(**one, **moe)
        one._attn_implementation = "eager"
        norm = getattr(m, f"{kind}RMSNorm")
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = norm(h, eps)
        self.pre_fc_norm_hidden = norm(h, eps)
        self.layers = torch.nn.ModuleList([getattr(m, f"{kind}DecoderLayer")(one, 0)])
        self.norm = norm(h, eps)
        self._rope = [getattr(m, f"{kind}TextRotaryEmbedding")(one)]  # a list: no tensor

    def forward(self, emb, hidden):
        """emb, hidden [n, H] (token p + 1's embedding, the target's hidden state at p) ->
        the normed outputs [n, H], positions 0..n-1, causal."""
        n = emb.shape[0]
        x = torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], -1)
        x = self.fc(x)[None]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        x = self.layers[0](x, self._rope[0](x, pos), attention_mask=mask, position_ids=pos)
        return self.norm(x)[0]


def _write_mtp(src, dst, target, plain_tokens):
    """A copy of the checkpoint with an MTP layer (`_Mtp`'s weights as mtp.*) crafted to draft
    well inside the loop the second prompt's answer falls into, so drafts are accepted and
    rejected: fc reads only the embedding and maps each loop token's to the LM head row of the
    token after it; attention, MLP and the norms are small random terms that run without
    deciding the drafts."""
    import shutil

    from safetensors.torch import save_file

    torch.manual_seed(2)
    mtp = _Mtp(target.config).float()
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in name else 0.02))
        loop = plain_tokens[-10:]
        nxt = {a: b for a, b in zip(loop, loop[1:])}
        e = mtp.pre_fc_norm_embedding(target.model.embed_tokens.weight[list(nxt)]).T
        u = target.lm_head.weight[list(nxt.values())].T
        mtp.fc.weight.zero_()
        mtp.fc.weight[:, : e.shape[0]] = u @ torch.linalg.pinv(e)
    shutil.copytree(src, dst)
    tensors = {"mtp." + k: v.contiguous() for k, v in mtp.state_dict().items()}
    save_file(tensors, str(dst / "mtp.safetensors"))
    return dst, mtp


@pytest.fixture(scope="module")
def plain(checkpoint):
    llm = LLM(model=str(checkpoint), **dict(ENGINE, max_num_batched_tokens=64))
    return [_greedy(llm, [p])[0] for p in PROMPTS]


@pytest.fixture(scope="module")
def mtp(target, plain, tmp_path_factory):
    """(checkpoint with MTP weights, the torch MTP layer)."""
    path, model = target
    return _write_mtp(path, tmp_path_factory.mktemp("mtp") / "q35", model, plain[1])


def _assert_slots_back(llm):
    kv = llm.engine.kv
    assert sorted(kv.free_slots) == list(range(ENGINE["max_num_seqs"]))


def test_ngram_greedy_equals_plain_one_by_one_and_batched(checkpoint, plain):
    """One request at a time (verify rows alone) and all at once (verify rows beside prompt
    chunks); then the same prompts again (prefix-cache hits restore a snapshot, then verify)."""
    llm = LLM(
        model=str(checkpoint), speculative_config=NGRAM, **dict(ENGINE, max_num_batched_tokens=64)
    )
    assert llm.engine.kv.verify_k == 3
    llm.engine.chain_verify = False  # verify steps read first (chained ones: below)
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
    assert llm.engine.chained_steps > 0  # while one request runs (a chain of one row)
    _assert_slots_back(llm)


def test_ngram_through_the_kernels_equals_plain(checkpoint, plain, monkeypatch):
    """The Pallas kernels in interpret mode (the GPU's path): a verify step's rows run in one
    gated_delta_decode with position_slots, as the plain engine's small steps do."""
    monkeypatch.setenv("PAXENGINE_KERNEL_GDN", "interpret")
    engine = dict(ENGINE, max_num_batched_tokens=64)
    llm = LLM(model=str(checkpoint), speculative_config=NGRAM, **engine)
    assert _greedy(llm, PROMPTS[1:2]) == plain[1:2]
    assert 0 < llm.engine.stats()["spec_decode_num_accepted_tokens"]
    assert llm.engine.chained_steps > 0  # each one's starting slots picked on the device


def _spec_counters(llm):
    return {k: np.asarray(v) for k, v in llm.engine.stats().items() if k.startswith("spec_")}


@pytest.fixture(scope="module")
def wide(checkpoint):
    """16 sample rows: chained verify steps of up to 4 requests (K = 3)."""
    engine = dict(ENGINE, max_num_batched_tokens=64, max_num_seqs=16)
    return LLM(model=str(checkpoint), speculative_config=NGRAM, **engine)


def test_chained_ngram_equals_unchained_and_plain(wide, plain):
    """Chained verify steps (spec_decode/chain.py: built while the previous one runs, each
    row's starting state slot picked on the device from its accepted count) give the plain
    engine's tokens and the unchained steps' counters, one by one and batched (up to 4 rows a
    chained step), the batch after the prompts' prefix-cache hits."""
    llm, eng = wide, wide.engine
    assert eng.runner.chain.verify_span == (32, 4) and eng.runner.chain.rows == 4
    runs = {}
    for chain in (False, True):
        eng.chain_verify = chain
        before, steps, hits = _spec_counters(llm), eng.chained_steps, eng.kv.prefix_hits
        one = [_greedy(llm, [p])[0] for p in PROMPTS]
        batched = _greedy(llm)
        after = _spec_counters(llm)
        counters = {k: (after[k] - before[k]).tolist() for k in after}
        runs[chain] = (one, batched, counters, eng.chained_steps - steps)
        assert eng.kv.prefix_hits > hits
        assert sorted(eng.kv.free_slots) == list(range(16))
    assert runs[False][3] == 0 and runs[True][3] > 20
    for one, batched, _, _ in runs.values():
        assert one == plain and batched == plain
    drafted = runs[True][2]["spec_decode_num_draft_tokens"]
    assert runs[True][2] == runs[False][2]
    assert 0 < runs[True][2]["spec_decode_num_accepted_tokens"] < drafted


MTP = {"method": "mtp", "num_speculative_tokens": 2}


def _reference_round(target, mtp, tokens, k):
    """The torch MTP layer's k greedy drafts after `tokens` and their logits: position p reads
    the target's final hidden state at p and token p + 1; later drafts its own output."""
    with torch.no_grad():
        hidden = target.model(torch.tensor([tokens])).last_hidden_state[0, :-1]
        ids, logits = list(tokens[1:]), []
        for _ in range(k):
            out = mtp(target.model.embed_tokens(torch.tensor(ids)), hidden)
            logits.append(target.lm_head(out[-1]).numpy())
            ids.append(int(np.argmax(logits[-1])))
            hidden = torch.cat([hidden, out[-1:]])
    return ids[len(tokens) - 1 :], logits


@contextlib.contextmanager
def recorded_rounds(drafter):
    """Yields a list that fills with the MTP proposer's draft rounds of one running request:
    (its tokens when the round began, the logits of each draft)."""
    rounds, execute, prepare = [], drafter.runner.execute, drafter.prepare

    def record_execute(arrays, st=None):
        ids, logits = execute(arrays, st)
        rounds[-1][1].append(np.asarray(logits)[0])
        return ids, logits

    def record_prepare(scheduler):
        rounds.append((scheduler.running[0].all_token_ids, []))
        prepare(scheduler)

    drafter.runner.execute, drafter.prepare = record_execute, record_prepare
    kept = []
    try:
        yield kept
    finally:
        del drafter.runner.execute, drafter.prepare
        kept.extend(r for r in rounds if r[1])


def check_rounds(target, mtp, rounds) -> None:
    """Each round's draft logits and drafts equal the torch MTP layer's (`_reference_round`)."""
    for tokens, logits in rounds:
        want_drafts, want_logits = _reference_round(target, mtp, tokens, len(logits))
        np.testing.assert_allclose(np.stack(logits), np.stack(want_logits), rtol=1e-3, atol=1e-3)
        assert [int(np.argmax(lg)) for lg in logits] == want_drafts


def test_mtp_greedy_equals_plain_and_drafts_equal_torch(target, mtp, plain):
    """The checkpoint's MTP layer drafts (chained on the device: its KV in the target's
    blocks, its own output fed back for the second draft): each round's logits and drafts
    equal the torch layer's over transformers' hidden states (its KV right after rollbacks);
    greedy tokens equal the plain engine's, one by one and batched."""
    path, model = target
    llm = LLM(model=str(mtp[0]), speculative_config=MTP, **dict(ENGINE, max_num_batched_tokens=64))
    assert type(llm.engine.drafter).__name__ == "MtpProposer"
    with recorded_rounds(llm.engine.drafter) as rounds:
        assert _greedy(llm, PROMPTS[1:2]) == plain[1:2]
    assert len(rounds) >= 10
    check_rounds(model, mtp[1], rounds[::4])  # a few: the reference recomputes the sequence
    assert [_greedy(llm, [p])[0] for p in PROMPTS] == plain
    stats = llm.engine.stats()
    drafted, accepted = (
        stats["spec_decode_num_draft_tokens"],
        stats["spec_decode_num_accepted_tokens"],
    )
    assert 0 < accepted < drafted, stats
    assert stats["spec_decode_num_accepted_tokens_per_pos"][1] > 0  # the fed-back second draft
    assert _greedy(llm) == plain
    _assert_slots_back(llm)


@pytest.mark.parametrize(
    "spec, match",
    [
        (
            {"method": "mtp", "num_speculative_tokens": 0},
            r"num_speculative_tokens must be in \[1, 16\]",
        ),
        (
            {"method": "mtp", "num_speculative_tokens": 17},
            r"num_speculative_tokens must be in \[1, 16\]",
        ),
        (
            {"method": "mtp", "num_speculative_tokens": 2, "model": "x"},
            "unknown keys \\['model'\\]",
        ),
        (MTP, "no MTP weights \\(no mtp.\\* tensors"),
        ({**MTP, "method": "qwen3_next_mtp"}, "no MTP weights \\(no mtp.\\* tensors"),
    ],
)
def test_mtp_refusals_name_the_fault(checkpoint, spec, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=str(checkpoint), speculative_config=spec, **ENGINE)


# the MTP server as Qwen's model cards start it: vLLM's older method name, taken as "mtp"
CARD_MTP = {"method": "qwen3_next_mtp", "num_speculative_tokens": 2}


@pytest.mark.parametrize("spec", [NGRAM, CARD_MTP], ids=["ngram", "mtp"])
def test_serve_with_speculative_config_equals_plain(request, spec, plain):
    """`paxengine serve DIR --speculative-config JSON` as a user starts it (engine process,
    background compile): a completion's tokens equal the plain engine's, drafts accepted."""
    import json

    import httpx
    from served import greedy_token_ids, served
    from test_qwen3_5 import _write_tokenizer

    path = (
        request.getfixturevalue("mtp")[0]
        if spec is CARD_MTP
        else request.getfixturevalue("checkpoint")
    )
    _write_tokenizer(path)
    args = ["--max-model-len", "256", "--max-num-seqs", "4", "--served-model-name", "q35"]
    args += ["--max-num-batched-tokens", "64"]
    args += ["--speculative-config", json.dumps(spec)]
    with served(str(path), *args) as base:
        assert greedy_token_ids(base, "q35", PROMPTS[1], MAX_TOKENS) == plain[1]
        lines = httpx.get(base + "/metrics").text.splitlines()
        accepted = [
            ln for ln in lines if ln.startswith("paxengine:spec_decode_num_accepted_tokens_total")
        ]
        assert accepted and float(accepted[0].split()[-1]) > 0, accepted


def test_abort_during_a_chained_step_gives_every_slot_back(wide):
    eng = wide.engine
    eng.chain_verify = True
    p = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    eng.add_request("c1", PROMPTS[1], p)
    eng.add_request("c2", PROMPTS[0], SamplingParams(temperature=0, max_tokens=30))
    step_until_chained(eng)
    eng.abort("c1")
    while eng.has_unfinished():
        eng.step()
    assert sorted(eng.kv.free_slots) == list(range(16))
