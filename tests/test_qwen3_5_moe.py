"""Qwen3.5-MoE (the hybrid of Gated DeltaNet and gated attention with a routed MoE block and a
shared expert in every layer; issues #54 / #55) against HF transformers fp32, token for token, on
a tiny random checkpoint written by transformers: whole prefills and 32-token chunked prefill."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paxengine import LLM, SamplingParams  # noqa: E402
from tests.test_qwen3_5 import ENGINE, MAX_TOKENS, PROMPTS, TEXT, _hf_greedy  # noqa: E402

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
MOE.update(shared_expert_intermediate_size=48)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(3)
    text = {k: v for k, v in TEXT.items() if k != "intermediate_size"}
    cfg = transformers.Qwen3_5MoeTextConfig(**text, **MOE)
    model = transformers.Qwen3_5MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():  # random norms and decays; experts of 1/sqrt(fan-in) (at 0.02 the
        # MLPs hardly move the tokens) and a decisive router
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif ".mlp." in name:
                p.normal_(0, (2 if name.endswith("mlp.gate.weight") else 1) / p.shape[-1] ** 0.5)
    path = tmp_path_factory.mktemp("qwen3_5_moe")
    model.save_pretrained(path)
    return path, _hf_greedy(model, PROMPTS)


def _greedy(llm):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("chunk", [256, 32])
def test_greedy_equals_hf(checkpoint, chunk):
    path, want = checkpoint
    llm = LLM(model=str(path), **dict(ENGINE, max_num_batched_tokens=chunk))
    cfg = llm.engine.model_config
    assert cfg.moe_layers == tuple(range(TEXT["num_hidden_layers"])) and cfg.recurrent_layers
    layer = llm.engine.runner.params["layers"][0]
    assert {"router", "e_gate_up", "e_down", "s_gate_up", "s_router"} <= set(layer)
    assert _greedy(llm) == want
