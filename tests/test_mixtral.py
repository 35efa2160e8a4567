"""Mixtral (issue #55): a tiny random checkpoint written by HF transformers (its released layout:
`block_sparse_moe.experts.{e}.w1/w2/w3`) against its fp32 greedy tokens through paxengine.LLM,
the prompts prefilled in 32-token chunks."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_qwen3_moe import init_weights  # noqa: E402 (its weights: 1/sqrt(fan-in), ...)

from paxengine import LLM, SamplingParams  # noqa: E402

PROMPTS = [[5, 9, 13, 200, 3, 77, 1, 4, 8], [(7 * i + 3) % 300 + 1 for i in range(70)]]
MAX_TOKENS = 10
HF = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=32,  # each expert's
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = init_weights(transformers.MixtralForCausalLM(transformers.MixtralConfig(**HF)))
    model = model.float().eval()
    path = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(path)
    want = []
    for p in PROMPTS:
        gen = model.generate(
            torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS
        )
        want.append(gen[0, len(p) :].tolist())
    return path, want


def test_greedy_tokens_equal_hf(checkpoint):
    path, want = checkpoint
    names = (path / "model.safetensors").read_bytes()[:20000]
    assert b"block_sparse_moe.experts.0.w1.weight" in names  # the released checkpoints' names
    llm = LLM(
        model=str(path),
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        structured_outputs=False,
        store_executables=False,
        show_progress=False,
    )
    cfg = llm.engine.model_config
    assert (cfg.family, cfg.moe_layers, cfg.num_experts, cfg.norm_topk_prob) == (
        "mixtral",
        (0, 1),
        4,
        True,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
