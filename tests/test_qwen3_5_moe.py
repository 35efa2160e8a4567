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
def target(tmp_path_factory):
    """(checkpoint directory, the transformers model)."""
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
    return path, model


@pytest.fixture(scope="module")
def checkpoint(target):
    path, model = target
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


@pytest.fixture(scope="module")
def mtp(target, tmp_path_factory):
    """(a copy of the checkpoint with an MoE MTP layer, that torch layer): random experts of
    1/sqrt(fan-in) and a decisive router, so the routing decides the drafts; HF's fused expert
    stacks as the checkpoint's tensors."""
    import shutil

    from safetensors.torch import save_file
    from test_qwen3_5_spec import _Mtp

    path, model = target
    torch.manual_seed(4)
    layer = _Mtp(model.config, MOE).float().eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = 2 if name.endswith("mlp.gate.weight") else 1
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in name else scale / p.shape[-1] ** 0.5))
    dst = tmp_path_factory.mktemp("mtp") / "q35moe"
    shutil.copytree(path, dst)
    tensors = {"mtp." + k: v.contiguous() for k, v in layer.state_dict().items()}
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in tensors
    save_file(tensors, str(dst / "mtp.safetensors"))
    return dst, layer


def test_mtp_layer_of_experts_drafts_as_torch_does(target, checkpoint, mtp):
    """Qwen3.5-MoE's MTP layer is an MoE decoder layer (routed experts, the shared expert): each
    draft round's logits equal the torch layer's over transformers' hidden states, and the
    greedy tokens stay HF's."""
    from test_qwen3_5_spec import MTP, check_rounds, recorded_rounds

    model, want = target[1], checkpoint[1]
    llm = LLM(model=str(mtp[0]), speculative_config=MTP, **ENGINE)
    d = llm.engine.drafter
    assert type(d).__name__ == "MtpProposer" and "router" in d.runner.params["layers"]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with recorded_rounds(d) as rounds:
        out = llm.generate([PROMPTS[1]], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == want[1]
    assert len(rounds) >= 3
    check_rounds(model, mtp[1], rounds[::3])
    assert _greedy(llm) == want


def test_serve_with_the_mtp_layer_of_experts(checkpoint, mtp):
    """`paxengine serve DIR --speculative-config '{"method": "mtp", ...}'` as a user starts it:
    HF's greedy tokens, drafts proposed."""
    import json

    import httpx
    from served import greedy_token_ids, served
    from test_qwen3_5 import _write_tokenizer
    from test_qwen3_5_spec import MTP

    _write_tokenizer(mtp[0])
    args = ["--max-model-len", "256", "--max-num-seqs", "4", "--served-model-name", "q35moe"]
    args += ["--max-num-batched-tokens", "64", "--speculative-config", json.dumps(MTP)]
    with served(str(mtp[0]), *args) as base:
        assert greedy_token_ids(base, "q35moe", PROMPTS[2], MAX_TOKENS) == checkpoint[1][2]
        lines = httpx.get(base + "/metrics").text.splitlines()
        name = "paxengine:spec_decode_num_draft_tokens_total"
        drafted = [ln for ln in lines if ln.startswith(name)]
        assert drafted and float(drafted[0].split()[-1]) > 0, drafted
