"""Qwen3.5 FP8 (issue #54 item 6): the block-quantized checkpoints Qwen ships (quant_method
"fp8", `weight_block_size`, e4m3 `weight` + float32 `weight_scale_inv` per block) and an fp8 KV
cache on the hybrid's full-attention layers, against HF transformers fp32 on the dequantized
weights, teacher-forced (the next token after each prefix of a greedy continuation).

The checkpoint is a tiny random transformers Qwen3.5 whose projections are quantized here with
numpy / ml_dtypes in [16, 32] blocks (out, in: non-square, so swapped axes fail; hidden 64 and
intermediate 80 make several blocks and partial ones). Each block's weights are scaled by its
own factor first, so a loader that misplaces block scales is far off, not a rounding off."""

import json

import jax
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paxengine import LLM, SamplingParams  # noqa: E402

BLOCK = (16, 32)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
TEXT = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=4,  # three linear-attention layers, then one full-attention layer
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
ENGINE = dict(
    max_model_len=256,
    max_num_seqs=4,
    max_num_batched_tokens=256,
    # the prefixes are prompts only: one step shape; a small pool (XLA emulates fp8 on CPUs:
    # each step converts the whole cache)
    token_buckets=[256],
    seq_buckets=[4],
    num_kv_blocks=48,
    structured_outputs=False,
    store_executables=False,
    show_progress=False,
)
PROMPT = [(11 * i + 5) % 300 + 1 for i in range(130)]
NEW = 32  # teacher-forced positions: the prefixes PROMPT + continuation[:k], k < NEW
# what Qwen's FP8 configs keep dense (transformers' substring match); in_proj_a is quantized
# in the checkpoint anyway: an FP8 tensor of a module paxengine keeps dense is dequantized
NOT_CONVERTED = ["lm_head", "embed_tokens", "linear_attn.in_proj_b", "mlp.gate"]
QUANT = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(BLOCK),
    "modules_to_not_convert": NOT_CONVERTED,
}
PROJECTIONS = ("_proj.weight", "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_a.weight")


def _blockwise(w: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[out, in] float32 -> (its blocks rescaled by random factors (the model's weight now),
    e4m3 values, float32 weight_scale_inv [ceil(out/b0), ceil(in/b1)])."""
    b0, b1 = BLOCK
    nb = (-(-w.shape[0] // b0), -(-w.shape[1] // b1))
    factor = np.exp2(rng.uniform(-2, 2, nb)).astype(np.float32)
    w = w * np.repeat(np.repeat(factor, b0, 0), b1, 1)[: w.shape[0], : w.shape[1]]
    scale = np.zeros(nb, np.float32)
    values = np.zeros(w.shape, E4M3)
    for r in range(nb[0]):
        for c in range(nb[1]):
            blk = w[r * b0 : (r + 1) * b0, c * b1 : (c + 1) * b1]
            scale[r, c] = max(np.abs(blk).max(), 1e-12) / 448.0
            values[r * b0 : (r + 1) * b0, c * b1 : (c + 1) * b1] = (blk / scale[r, c]).astype(E4M3)
    return w, values, scale


def _dequantize(values, scale):
    b0, b1 = BLOCK
    full = np.repeat(np.repeat(scale, b0, 0), b1, 1)[: values.shape[0], : values.shape[1]]
    return values.astype(np.float32) * full


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    """(the FP8 checkpoint, the dense one of its dequantized weights, the HF fp32 model on
    them, its greedy continuation)."""
    from safetensors.torch import save_file

    torch.manual_seed(3)
    rng = np.random.default_rng(3)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT)).float()
    model.eval()
    tensors, dense = {}, {}
    for name, p in model.state_dict().items():
        w = p.detach().numpy().astype(np.float32)
        if "norm" in name or "A_log" in name or "dt_bias" in name:
            w = w + rng.normal(0, 0.1, w.shape).astype(np.float32)  # not the all-ones defaults
        quantized = name.endswith(PROJECTIONS) and not any(m in name for m in NOT_CONVERTED)
        if quantized or name.endswith("in_proj_a.weight"):
            w, values, scale = _blockwise(w, rng)
            tensors[name] = torch.from_numpy(values.view(np.uint8)).view(torch.float8_e4m3fn)
            tensors[name.removesuffix("weight") + "weight_scale_inv"] = torch.from_numpy(scale)
            w = _dequantize(values, scale)
        else:
            tensors[name] = torch.from_numpy(w.copy())
        dense[name] = torch.from_numpy(w)
    model.load_state_dict(dense)
    dense_path = tmp_path_factory.mktemp("qwen3_5_dense")
    model.save_pretrained(dense_path)
    path = tmp_path_factory.mktemp("qwen3_5_fp8")
    model.save_pretrained(path)
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": QUANT}))
    with torch.no_grad():
        gen = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW
        )
    return path, dense_path, model, gen[0].tolist()


def _hf_top1(model, seq):
    """HF's next token after each teacher-forced prefix (one causal forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0]
    return logits.argmax(-1)[len(PROMPT) - 1 : -1].tolist()


def _top1(llm, seq):
    prefixes = [seq[:n] for n in range(len(PROMPT), len(seq))]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    return [o.outputs[0].token_ids[0] for o in llm.generate(prefixes, one, use_tqdm=False)]


def _agreement(a, b):
    assert len(a) == len(b) == NEW
    return sum(x == y for x, y in zip(a, b)) / len(a)


def test_block_fp8_checkpoint_loads_per_channel_and_caches(fp8_ckpt, tmp_path):
    """Every projection an Fp8Weight close to the checkpoint's dequantized weight (its block
    scales folded into one per output channel); in_proj_a (FP8 in the checkpoint) and in_proj_b
    (kept dense) dense; the converted-weights cache reads the same FP8 bytes back."""
    from paxengine.models.loader import load_model
    from paxengine.models.quant import Fp8Weight, dequantize, weight_dtype

    path, _, model, _ = fp8_ckpt
    kw = dict(cache_dir=str(tmp_path), progress=False)
    cold = load_model(str(path), "float32", **kw)
    assert cold.prequantized == "fp8, block weight scales" and not cold.from_cache
    assert weight_dtype(cold.params) == "fp8_e4m3"
    sd = model.state_dict()
    hf = {"la_qkv": "linear_attn.in_proj_qkv", "la_z": "linear_attn.in_proj_z"}
    hf |= {"la_out": "linear_attn.out_proj", "w_down": "mlp.down_proj", "wq": "self_attn.q_proj"}
    for i, name in [(0, "la_qkv"), (1, "la_z"), (2, "la_out"), (0, "w_down"), (3, "wq")]:
        w = cold.params["layers"][i][name]
        assert isinstance(w, Fp8Weight), (i, name)
        want = sd[f"model.layers.{i}.{hf[name]}.weight"].numpy().T  # [in, out]
        got = np.asarray(dequantize(w))
        # quantized again per output channel: within an e4m3 step of the channel's largest
        err = np.abs(got - want).max(axis=0) / np.abs(want).max(axis=0)
        assert err.max() < 2**-3, (i, name, err.max())
    for n in ("la_a", "la_b"):
        w = np.asarray(cold.params["layers"][0][n])
        want = sd[f"model.layers.0.linear_attn.in_proj_{n[-1]}.weight"].numpy().T
        np.testing.assert_allclose(w, want, rtol=1e-6, atol=1e-7)
    warm = load_model(str(path), "float32", **kw)
    assert warm.from_cache and warm.prequantized == cold.prequantized
    a, b = cold.params["layers"][3]["wo"], warm.params["layers"][3]["wo"]
    np.testing.assert_array_equal(
        np.asarray(a.values).view(np.uint8), np.asarray(b.values).view(np.uint8)
    )
    np.testing.assert_array_equal(a.scales, b.scales)


def test_what_it_cannot_load_is_named(fp8_ckpt, tmp_path):
    """Another quantization method, and an FP8 weight without its scale, fail by name."""
    import shutil

    from safetensors.torch import load_file, save_file

    from paxengine.models.loader import load_model

    path = fp8_ckpt[0]
    gptq = shutil.copytree(path, tmp_path / "gptq")
    cfg = json.loads((gptq / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (gptq / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quant_method 'gptq' is not supported"):
        load_model(str(gptq), use_cache=False, progress=False)
    missing = shutil.copytree(path, tmp_path / "missing")
    sd = load_file(str(missing / "model.safetensors"))
    del sd["model.layers.2.linear_attn.out_proj.weight_scale_inv"]
    save_file(sd, str(missing / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.2\.linear_attn\.out_proj\.weight_scale"):
        load_model(str(missing), use_cache=False, progress=False)


def test_block_fp8_checkpoint_agrees_with_hf_teacher_forced(fp8_ckpt):
    path, _, model, seq = fp8_ckpt
    llm = LLM(model=str(path), **ENGINE)
    agree = _agreement(_top1(llm, seq), _hf_top1(model, seq))
    assert agree >= 0.9, agree


def test_fp8_kv_cache_agrees_with_hf_teacher_forced(fp8_ckpt):
    """--kv-cache-dtype fp8 on the attention layer (scales calibrated per layer), the recurrent
    states in the model dtype (float32 here); the prefixes share their prompt, so the prefix
    cache restores fp8 pages and a state snapshot."""
    _, dense, model, seq = fp8_ckpt
    llm = LLM(model=str(dense), kv_cache_dtype="fp8", **ENGINE)
    runner = llm.engine.runner
    assert len(runner.kv_cache) == 1 and runner.kv_cache[0][0].dtype == np.dtype(E4M3)
    assert all(s.dtype == np.float32 for s in jax.tree.leaves(runner.state))
    assert llm.engine.kv_scales.shape == (1, 2)
    agree = _agreement(_top1(llm, seq), _hf_top1(model, seq))
    assert agree >= 0.9, agree
    assert llm.engine.kv.prefix_hits > 0  # the shared prompt's pages and state restored
    # the pages hold K / k_scale: the calibrated scale (2x headroom) maps |K| near 448 / 2
    # (stored unscaled, its largest would be ~1e-2 of that)
    k_pages = np.asarray(runner.kv_cache[0][0]).astype(np.float32)
    assert 448 / 8 < np.abs(k_pages).max() <= 448, np.abs(k_pages).max()


def test_checkpoint_kv_scales_are_the_attention_layers(fp8_ckpt, tmp_path):
    """A checkpoint's per-layer KV-cache scales (compressed-tensors' kv_cache_scheme names): one
    row per full-attention layer, the one an fp8 cache then runs with."""
    import shutil

    from safetensors.torch import load_file, save_file

    from paxengine.models.loader import load_model

    src = shutil.copytree(fp8_ckpt[0], tmp_path / "kv")
    sd = load_file(str(src / "model.safetensors"))
    sd["model.layers.3.self_attn.k_scale"] = torch.tensor(0.03)
    sd["model.layers.3.self_attn.v_scale"] = torch.tensor(0.01)
    save_file(sd, str(src / "model.safetensors"))
    m = load_model(str(src), use_cache=False, progress=False)
    np.testing.assert_allclose(m.kv_scales, [[0.03, 0.01]], rtol=1e-6)


def test_the_server_serves_the_fp8_checkpoint_with_an_fp8_cache(fp8_ckpt):
    """`paxengine serve DIR --kv-cache-dtype fp8` on the block-FP8 checkpoint (the
    Qwen3.5-27B-FP8 deployment's flags): it starts, and each token it returns is HF's next
    token after the ones before it (teacher-forced on its own continuation) but for near-ties."""

    import httpx
    from served import served
    from test_qwen3_5 import _write_tokenizer

    path, _, model, _ = fp8_ckpt
    _write_tokenizer(path)
    args = ["--max-model-len", "256", "--max-num-seqs", "4"]
    args += ["--max-num-batched-tokens", "64", "--num-kv-blocks", "16", "--kv-cache-dtype", "fp8"]
    with served(str(path), *args) as base:
        body = {"model": str(path), "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
        body.update(ignore_eos=True, return_token_ids=True)
        r = httpx.post(base + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["token_ids"]
    assert len(got) == 16
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + got])).logits[0]
    hf = logits.argmax(-1)[len(PROMPT) - 1 : -1].tolist()
    agree = sum(a == b for a, b in zip(got, hf)) / len(got)
    assert agree >= 0.75, (agree, got, hf)
