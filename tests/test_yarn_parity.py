"""YaRN through whole models against HF transformers fp32, token for token, past the pretraining
length: a tiny random Llama saved without scaling and served with --hf-overrides' YaRN
(original_max_position_embeddings 32, factor 4) equals HF's model built with it, on prompts
longer than 32 and than the checkpoint's max_position_embeddings (64: YaRN's 128 is the derived
length); the converted-weights cache keeps the two configs apart; the fused RoPE + KV-write
kernel (Pallas, interpret mode) takes the scaled tables. Qwen3.5's partial rotary YaRN:
tests/test_qwen3_5_yarn.py."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paxengine import LLM, SamplingParams  # noqa: E402

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
LLAMA = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    tie_word_embeddings=False,
)  # fmt: skip
PROMPTS = [
    [(7 * i + 3) % 250 + 1 for i in range(40)],  # past the original 32
    [(11 * i + 5) % 250 + 1 for i in range(70)],  # past max_position_embeddings (64) too
]
MAX_TOKENS = 8
ENGINE = dict(
    max_model_len=128,  # past the checkpoint's 64: YaRN's derived length
    max_num_seqs=2,
    max_num_batched_tokens=64,
    structured_outputs=False,
    store_executables=False,
    show_progress=False,
)


def _init(model):
    """Weights of 1/sqrt(fan-in) and random norms: at 0.02 the attention is near uniform and
    the positions (the RoPE under test) would hardly move a token."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
    return model.float().eval()


def _hf_greedy(model, prompts=PROMPTS):
    out = []
    for p in prompts:
        gen = model.generate(
            torch.tensor([p]),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
        out.append(gen[0, len(p) :].tolist())
    return out


def _greedy(llm, prompts=PROMPTS):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A checkpoint without scaling, HF's greedy tokens with YaRN (and without: they differ, so
    the parity below is YaRN's)."""
    torch.manual_seed(0)
    model = _init(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)))
    path = tmp_path_factory.mktemp("llama_yarn")
    model.save_pretrained(path)
    plain = _hf_greedy(model)
    yarn = transformers.LlamaConfig(**LLAMA, rope_parameters=dict(YARN, rope_theta=10000.0))
    scaled = transformers.LlamaForCausalLM(yarn).float().eval()
    scaled.load_state_dict(model.state_dict())
    want = _hf_greedy(scaled)
    assert want != plain
    return path, want, plain


def test_hf_overrides_yarn_equals_hf_past_the_original_length(llama, tmp_path):
    path, want, plain = llama
    cache = str(tmp_path / "cache")
    # without the override first: its cache entry must not serve the override's model
    base = LLM(model=str(path), weights_cache_dir=cache, **dict(ENGINE, max_model_len=64))
    assert base.engine.max_model_len == 64 and base.engine.model_config.rope_scaling is None
    assert _greedy(base, PROMPTS[:1]) == plain[:1]
    del base
    for _ in ("converted", "from the cache"):
        llm = LLM(
            model=str(path), weights_cache_dir=cache, hf_overrides={"rope_scaling": YARN}, **ENGINE
        )
        assert llm.engine.max_model_len == 128  # original 32 x factor 4
        assert llm.engine.model_config.rope_scaling_dict["rope_type"] == "yarn"
        assert _greedy(llm) == want
        del llm
        assert len(list((tmp_path / "cache" / "weights").iterdir())) == 2  # one entry each


def test_the_fused_rope_kv_write_kernel_takes_the_scaled_tables(llama, monkeypatch):
    """The Pallas backend's small buckets rotate q and k inside the KV-write kernel, from the
    tables the model built (YaRN's attention factor folded into cos and sin)."""
    import kernels_pallas

    fused = []
    real = kernels_pallas.rope_write_kv
    monkeypatch.setattr(
        kernels_pallas, "rope_write_kv", lambda *a, **k: fused.append(1) or real(*a, **k)
    )
    path, want, _ = llama
    llm = LLM(
        model=str(path),
        hf_overrides='{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, '
        '"original_max_position_embeddings": 32}}',  # the flag's JSON text
        attention_backend="pallas",
        layer_loop="unroll",
        token_buckets=[16, 64],
        seq_buckets=[2],
        **ENGINE,
    )
    assert fused  # the decode bucket's layers went through the kernel
    assert _greedy(llm) == want
