"""Qwen3.5 with the long-context recipe's rope_parameters (YaRN over the rotated quarter of each
head, mrope_interleaved / mrope_section on text positions) against HF transformers fp32: the
prompt's logprobs at every position (past the original 32 and the checkpoint's 64), and the
greedy tokens; the engine's length is YaRN's derived 32 x 4."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_yarn_parity import ENGINE, MAX_TOKENS, PROMPTS, YARN, _greedy, _hf_greedy, _init  # noqa: E402

from paxengine import LLM, SamplingParams  # noqa: E402

QWEN3_5 = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
    full_attention_interval=2,  # two of the four layers attend (RoPE's)
)  # fmt: skip
ROPE = dict(YARN, rope_theta=10000.0, partial_rotary_factor=0.25, mrope_interleaved=True,
            mrope_section=[2, 1, 1])  # fmt: skip


def test_qwen3_5_yarn_on_its_partial_rotary_dims_equals_hf(tmp_path):
    torch.manual_seed(1)
    cfg = transformers.Qwen3_5TextConfig(**QWEN3_5, rope_parameters=ROPE)
    model = _init(transformers.Qwen3_5ForCausalLM(cfg))
    model.save_pretrained(tmp_path)
    long = PROMPTS[1]
    with torch.no_grad():
        logits = model(torch.tensor([long])).logits[0].float()
    want_lp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(long[1:])[:, None])[:, 0]
    want = _hf_greedy(model)

    llm = LLM(model=str(tmp_path), **ENGINE)
    assert llm.engine.max_model_len == 128  # 64 in the checkpoint: YaRN's 32 x 4
    assert llm.engine.model_config.partial_rotary_factor == 0.25
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    (out,) = llm.generate([long], params, use_tqdm=False)
    got_lp = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], long[1:])]
    # fp32 against fp32: within ~1e-5; YaRN's attention factor left out moves them by up to 0.16
    np.testing.assert_allclose(got_lp, want_lp.numpy(), rtol=0, atol=2e-4)
    assert _greedy(llm) == want and len(want[0]) == MAX_TOKENS
