"""A checkpoint's matrices reach the host in the model dtype (bfloat16: half of float32's bytes;
a Qwen3-30B-A3B in float32 would be 122 GB of host memory before it reaches the device), and
the converted-weights cache stores them so; vectors (norms) stay float32. Both layouts: the
Llama family's stacked one and a family of its own (Qwen3-MoE, per layer, experts stacked)."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import ml_dtypes  # noqa: E402

from paxengine.models.loader import load_model  # noqa: E402
from paxengine.models.weights import flatten  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
SMALL = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
)  # fmt: skip
MODELS = {
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**SMALL)),
    "qwen3_moe": (
        transformers.Qwen3MoeForCausalLM,
        transformers.Qwen3MoeConfig(
            **SMALL, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2
        ),
    ),
}


@pytest.mark.parametrize("family", list(MODELS))
def test_matrices_load_and_cache_in_the_model_dtype(family, tmp_path):
    cls, cfg = MODELS[family]
    torch.manual_seed(0)
    cls(cfg).float().save_pretrained(tmp_path / "ckpt")  # float32 on disk
    want = load_model(str(tmp_path / "ckpt"), "float32", use_cache=False, on_device=False)
    cache = str(tmp_path / "cache")
    for source in ("checkpoint", "cache"):
        got = load_model(str(tmp_path / "ckpt"), "bfloat16", cache_dir=cache, on_device=False)
        assert got.from_cache == (source == "cache")
        flat, ref = flatten(got.params), flatten(want.params)
        assert flat.keys() == ref.keys()
        for name, a in flat.items():
            assert a.dtype == BF16, (source, name, a.dtype)  # _place casts the rest
            np.testing.assert_array_equal(a, ref[name].astype(BF16))
    if family == "qwen3_moe":
        assert flat["layers.0.e_gate"].shape == (4, 32, 16)
    # on disk: the matrices in bfloat16, the norms in float32
    (entry,) = (tmp_path / "cache" / "weights").iterdir()
    with open(entry / "params.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    header.pop("__metadata__", None)
    kinds = {(name.endswith("norm"), h["dtype"]) for name, h in header.items()}
    assert kinds == {(False, "BF16"), (True, "F32")}, kinds
