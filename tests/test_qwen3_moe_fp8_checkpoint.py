"""A block-quantized FP8 Qwen3-MoE checkpoint (issue #55; the layout of Qwen3-30B-A3B-FP8:
`quant_method: fp8`, `weight_block_size: [128, 128]`, every expert's projections e4m3 with a
`weight_scale_inv` of 128 x 128 blocks, the router left dense): its experts load as FP8 stacks
(values [E, out, in], scales [E, out]) equal to the checkpoint's values times its scales, and
the model's next tokens agree with HF fp32's on the same weights dequantized (the FP8 paths
quantize activations: not bit-exact), through paxengine.LLM, the converted-weights cache and
the server."""

import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from test_fp8_checkpoints import E4M3, FP8_BLOCK, _blocks  # noqa: E402
from test_qwen3_moe import (  # noqa: E402
    ENGINE,
    HF,
    PROMPTS,
    hf_teacher_forced,
    init_weights,
    teacher_forced_agreement,
)

from paxengine import LLM, SamplingParams  # noqa: E402
from paxengine.models.quant import Fp8Weight, dequantize  # noqa: E402

PROJ = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(experts\.(\d+)\.)?\w+_proj\.weight")


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """-> (the FP8 checkpoint's directory, a dense one of the same weights dequantized).
    Expert e's weights are scaled by 2^(e - 4) first: an expert read with another's scales
    is off by a power of two."""
    torch.manual_seed(0)
    model = init_weights(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**HF)))
    model = model.float().eval()
    root = tmp_path_factory.mktemp("qwen3_moe_fp8")
    model.save_pretrained(root / "dense")
    sd = load_file(str(root / "dense" / "model.safetensors"))
    fp8, dequantized = {}, {}
    for key, w in sd.items():
        m = PROJ.fullmatch(key)
        if not m:  # norms, embedding, LM head, the router: dense
            fp8[key] = dequantized[key] = w
            continue
        if m[3] is not None:
            w = w * 2.0 ** (int(m[3]) - 4)
        values, scale = _blocks(w.float())
        fp8[key], fp8[key.removesuffix("weight") + "weight_scale_inv"] = values, scale
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        dequantized[key] = values.float() * full
    for name, tensors in (("fp8", fp8), ("dequantized", dequantized)):
        d = root / name
        d.mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
        cfg = json.loads((root / "dense" / "config.json").read_text())
        if name == "fp8":
            cfg["quantization_config"] = FP8_BLOCK
        (d / "config.json").write_text(json.dumps(cfg))
    # attention's 4 projections a layer, the two MoE layers' experts, layer 1's dense MLP
    assert sum(v.dtype == E4M3 for v in fp8.values()) == 3 * 4 + 2 * 8 * 3 + 3
    return root / "fp8", root / "dequantized"


def _greedy(llm):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_experts_load_as_fp8_and_agree_with_hf_teacher_forced(fp8_checkpoint, tmp_path):
    """The next token after each prefix of a 200-token sequence against HF fp32's on the
    dequantized weights, where fp32's top-1 leads by > 0.3 (as the online FP8 test of
    test_qwen3_moe.py); the second load comes from the converted-weights cache."""
    path, dequantized = fp8_checkpoint
    ref, decisive = hf_teacher_forced(dequantized)
    assert decisive.sum() >= 20
    sd = load_file(str(dequantized / "model.safetensors"))
    for _ in range(2):  # converted, then from the converted-weights cache
        llm = LLM(model=str(path), weights_cache_dir=str(tmp_path), **ENGINE)
        layer = llm.engine.runner.params["layers"][0]
        experts = layer["e_gate_up"]
        assert isinstance(experts, Fp8Weight) and experts.values.shape == (8, 64, 64)
        assert experts.scales.shape == (8, 64) and isinstance(layer["e_down"], Fp8Weight)
        # expert 5's gate: the checkpoint's values times its block scale
        gate = np.asarray(dequantize(experts))[5, :, :32]
        np.testing.assert_array_equal(gate, sd["model.layers.0.mlp.experts.5.gate_proj.weight"].T)
        agree = teacher_forced_agreement(llm, ref, decisive)
        assert agree >= 0.9, agree
        del llm


def test_the_server_serves_what_the_engine_generates(fp8_checkpoint):
    """`paxengine serve` of the FP8 checkpoint (engine process, background compile): the
    greedy tokens paxengine.LLM generates."""
    from served import greedy_token_ids, served

    path, _ = fp8_checkpoint
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = LLM(model=str(path), **ENGINE).generate([PROMPTS[2]], params, use_tqdm=False)
    args = ["--max-model-len", "256", "--max-num-seqs", "4", "--served-model-name", "moe"]
    with served(str(path), *args) as base:
        assert greedy_token_ids(base, "moe", PROMPTS[2], 10) == want[0].outputs[0].token_ids
