"""Qwen3.5 (the hybrid of Gated DeltaNet and gated attention, issue #54) against HF transformers
fp32, token for token: tiny random checkpoints of both architectures written by transformers,
prompts that cross the delta rule's 64-token chunk and several KV blocks; whole prefills,
32-token chunked prefill (the state carried between chunks), forced preemption (the state
recomputed from zeros), n > 1, the converted-weights cache, and the server."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paxengine import LLM, SamplingParams  # noqa: E402

PROMPTS = [
    [5, 9, 13, 200, 3, 77, 1, 4, 8],
    [(7 * i + 3) % 300 + 1 for i in range(70)],  # one chunk and a bit
    [(11 * i + 5) % 300 + 1 for i in range(150)],  # three chunks, ten blocks
]
MAX_TOKENS = 10
TEXT = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,  # three linear-attention layers, then one full-attention layer
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # two value heads per key head
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
ENGINE = dict(
    max_model_len=256,
    max_num_seqs=4,
    max_num_batched_tokens=256,
    structured_outputs=False,
    store_executables=False,
    show_progress=False,
)


def _perturb(model):
    """Random norms, decays and time steps: zero-centred norms read as all-ones would pass."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.1)


def _hf_greedy(model, prompts):
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(
            ids, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS
        )
        out.append(gen[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module")
def causal_lm(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(**TEXT)
    model = transformers.Qwen3_5ForCausalLM(cfg).float().eval()
    _perturb(model)
    path = tmp_path_factory.mktemp("qwen3_5_causal")
    model.save_pretrained(path)
    return path, _hf_greedy(model, PROMPTS)


@pytest.fixture(scope="module")
def conditional(tmp_path_factory):
    """The multimodal checkpoint (text under model.language_model., a vision tower beside)."""
    torch.manual_seed(1)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    cfg = transformers.Qwen3_5Config(text_config=TEXT, vision_config=vision)
    model = transformers.Qwen3_5ForConditionalGeneration(cfg).float().eval()
    _perturb(model)
    path = tmp_path_factory.mktemp("qwen3_5_conditional")
    model.save_pretrained(path)
    return path, _hf_greedy(model, PROMPTS)


def _greedy(llm, prompts=PROMPTS, n=1):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n)
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_chunked_prefill_and_n_equal_hf(causal_lm):
    path, want = causal_lm
    llm = LLM(model=str(path), **dict(ENGINE, max_num_batched_tokens=32))
    got = _greedy(llm, n=2)
    assert [o[0] for o in got] == want and [o[1] for o in got] == want
    assert sorted(llm.engine.kv.free_slots) == list(range(ENGINE["max_num_seqs"]))


def test_the_fused_kernel_in_the_model_equals_hf(causal_lm, monkeypatch):
    """The DeltaNet layers through the Pallas kernel the GPU runs in small steps (interpret
    mode): conv, gating and recurrence in one kernel over 32-token chunked prefills and decode
    rows side by side; then the same prompts again, restored from prefix-cache snapshots the
    kernel wrote."""
    monkeypatch.setenv("PAXENGINE_KERNEL_GDN", "interpret")
    path, want = causal_lm
    llm = LLM(model=str(path), **dict(ENGINE, max_num_batched_tokens=32))
    assert [o[0] for o in _greedy(llm)] == want
    hits = llm.engine.kv.prefix_hits
    assert [o[0] for o in _greedy(llm)] == want
    assert llm.engine.kv.prefix_hits > hits


def test_decode_buckets_through_the_fused_kernel_equal_hf(causal_lm, monkeypatch):
    """PAXENGINE_KERNEL_GDN_FUSED_DECODE=1 (interpret mode): buckets of more tokens than the
    fused limit (2 here) take the fused kernel when they are decode buckets (T <= S), the others
    the chunked path; tokens equal HF's either way."""
    from kernels_pallas import gated_delta
    from paxengine.models import gated_deltanet

    monkeypatch.setenv("PAXENGINE_KERNEL_GDN", "interpret")
    monkeypatch.setenv("PAXENGINE_KERNEL_GDN_FUSED_MAX_TOKENS", "2")
    monkeypatch.setenv("PAXENGINE_KERNEL_GDN_FUSED_DECODE", "1")
    shapes = []
    decode = gated_delta.gated_delta_decode

    def spy(x, *a, query_start_loc=None, **k):  # (traced once per bucket)
        shapes.append((x.shape[0], query_start_loc.shape[0] - 1))
        return decode(x, *a, query_start_loc=query_start_loc, **k)

    monkeypatch.setattr(gated_delta, "gated_delta_decode", spy)
    path, want = causal_lm
    llm = LLM(model=str(path), **dict(ENGINE, max_num_batched_tokens=32, token_buckets=[4, 32]))
    assert [o[0] for o in _greedy(llm)] == want
    assert any(t > 2 and t <= s for t, s in shapes), shapes  # a decode bucket past the limit
    assert all(t <= 2 or t <= s for t, s in shapes), shapes
    assert gated_deltanet.fused_step(4, 4) and not gated_deltanet.fused_step(32, 4)
    monkeypatch.setenv("PAXENGINE_KERNEL_GDN_FUSED_DECODE", "0")
    assert not gated_deltanet.fused_step(4, 4) and gated_deltanet.fused_step(2, 1)
    monkeypatch.setenv("PAXENGINE_KERNEL_GDN_FUSED_MAX_TOKENS", "0")
    assert not gated_deltanet.fused_step(1, 4)


def test_the_model_takes_it_for_16_bit_out_projections_only(monkeypatch):
    """qwen3_5._out_projection: the kernel (interpret mode here; "auto" in the GPU's cuBLAS
    steps) for a 16-bit weight whose shape tiles, XLA's GEMM for FP8 weights, MoE models, shapes
    that do not tile, or with the switch off; an unknown mode is refused."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas import skinny_gemm
    from paxengine.models import qwen3_5
    from paxengine.models.config import ModelConfig
    from paxengine.models.quant import quantize_fp8

    calls = []
    real = skinny_gemm.skinny_matmul
    monkeypatch.setattr(
        skinny_gemm, "skinny_matmul", lambda *a, **k: calls.append(k) or real(*a, **k)
    )
    cfg = ModelConfig(
        arch="Qwen3_5ForCausalLM", vocab_size=16, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=64,
    )  # fmt: skip
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (3, 512), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (512, 128), jnp.float32) / 23).astype(jnp.bfloat16)
    want = np.asarray(jnp.dot(x, w, preferred_element_type=jnp.float32))

    def project(mode, x=x, w=w, cfg=cfg):
        monkeypatch.setenv("PAXENGINE_KERNEL_SKINNY", mode)
        y, rows, cols = qwen3_5._out_projection(cfg, x, w)
        assert rows is None and cols is None
        return np.asarray(y, np.float32)

    np.testing.assert_allclose(project("interpret"), want, rtol=2e-2, atol=2e-2)
    assert len(calls) == 1 and calls[0]["interpret"]
    np.testing.assert_allclose(project("off"), want, rtol=2e-2, atol=2e-2)
    project("auto")  # on a CPU: no cuBLAS steps, XLA's GEMM
    project("interpret", w=w[:, :100])  # columns that do not tile
    project("interpret", cfg=dataclasses.replace(cfg, moe_layers=(0,)))
    qwen3_5._out_projection(cfg, x, quantize_fp8(w.astype(jnp.float32)))  # FP8: its own path
    assert len(calls) == 1
    with pytest.raises(ValueError, match="PAXENGINE_KERNEL_SKINNY"):
        project("on")


def test_preemption_recomputes_the_state(causal_lm):
    path, want = causal_lm
    # 14 blocks of 16 tokens cannot hold the three prompts' 229 + 30 tokens at once
    llm = LLM(model=str(path), **dict(ENGINE, num_kv_blocks=14, max_num_batched_tokens=64))
    assert [o[0] for o in _greedy(llm)] == want
    assert llm.engine.scheduler.num_preemptions > 0


def test_whole_prefills_and_prefix_caching_equal_hf(causal_lm, tmp_path):
    """Whole prefills; then prefix caching: a prompt's state is kept at its last full block
    before its last token, and the same prompts again, and a next turn that starts with an
    earlier prompt and its answer, restore it; then the converted-weights cache read back."""
    path, want = causal_lm
    llm = LLM(model=str(path), weights_cache_dir=str(tmp_path), **ENGINE)
    assert llm.engine.model_config.recurrent_layers == (0, 1, 2)
    kv = llm.engine.kv
    assert [o[0] for o in _greedy(llm)] == want
    hits = kv.prefix_hits
    assert [o[0] for o in _greedy(llm)] == want
    assert kv.prefix_hits - hits == 64 + 144  # the 70- and 150-token prompts' boundaries
    turn = PROMPTS[2] + want[2] + [5, 6, 7]
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(path).float().eval()
    hits = kv.prefix_hits
    assert [o[0] for o in _greedy(llm, [turn])] == _hf_greedy(hf, [turn])
    assert kv.prefix_hits - hits == 144
    assert sorted(kv.free_slots) == list(range(ENGINE["max_num_seqs"]))
    from paxengine.models.loader import load_model

    cached = load_model(str(path), "float32", cache_dir=str(tmp_path), progress=False)
    assert cached.from_cache and cached.config == llm.engine.model_config
    again = LLM(model=str(path), weights_cache_dir=str(tmp_path), **ENGINE)
    assert [o[0] for o in _greedy(again, PROMPTS[:1])] == want[:1]


def test_the_multimodal_checkpoint_serves_its_text_model(conditional):
    path, want = conditional
    llm = LLM(model=str(path), **ENGINE)
    assert [o[0] for o in _greedy(llm)] == want


def test_what_is_not_implemented_yet_is_refused_by_name(causal_lm):
    path, _ = causal_lm
    with pytest.raises(ValueError, match="method 'draft' .* not implemented for qwen3_5"):
        LLM(
            model=str(path),
            speculative_config={"model": "default", "num_speculative_tokens": 2},
            **ENGINE,
        )


def test_fp8_weights_agree_with_fp32_teacher_forced(causal_lm):
    """--quantization fp8 (online, per output channel; the delta rule's state stays in the
    model dtype): the next token after each prefix of a greedy continuation, against fp32."""
    from paxengine.models.quant import weight_dtype

    path, want = causal_lm
    seq = PROMPTS[2] + want[2]
    prefixes = [seq[:n] for n in range(130, 160)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def top1(llm):
        return [o.outputs[0].token_ids[0] for o in llm.generate(prefixes, one, use_tqdm=False)]

    ref = top1(LLM(model=str(path), **ENGINE))
    fp8 = LLM(model=str(path), quantization="fp8", **ENGINE)
    assert weight_dtype(fp8.engine.runner.params) == "fp8_e4m3"
    agree = sum(a == b for a, b in zip(top1(fp8), ref)) / len(ref)
    assert agree >= 0.9, agree


def _write_tokenizer(path):
    """A byte-level BPE of the model's 320 ids with a ChatML template: enough for the server."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the cat sat on the mat and the dog ran to the park"] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(
        __import__("json").dumps({"chat_template": template, "eos_token": "<|im_end|>"})
    )


def test_the_server_serves_it_as_a_user_starts_it(causal_lm):
    """`paxengine serve DIR` with its defaults (engine process, background compile): the
    tokens equal HF's; a streamed chat answers; an image part is a 400 naming it."""

    import httpx
    from served import greedy_token_ids, served

    path, want = causal_lm
    _write_tokenizer(path)
    args = ["--max-model-len", "256", "--max-num-seqs", "4"]
    args += ["--max-num-batched-tokens", "64", "--served-model-name", "q35"]
    with served(str(path), *args) as base:
        assert greedy_token_ids(base, "q35", PROMPTS[2], MAX_TOKENS) == want[2]
        chat = {"model": "q35", "messages": [{"role": "user", "content": "the cat"}]}
        chat.update(max_tokens=6, stream=True, temperature=0)
        with httpx.stream("POST", base + "/v1/chat/completions", json=chat, timeout=300) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 3
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        bad = {"model": "q35", "messages": [{"role": "user", "content": [image]}]}
        r = httpx.post(base + "/v1/chat/completions", json=bad, timeout=60)
        assert r.status_code == 400 and "image_url" in r.text
        assert httpx.get(base + "/health").status_code == 200
