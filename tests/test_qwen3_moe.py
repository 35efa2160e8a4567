"""Qwen3-MoE (issue #55): the grouped expert GEMMs against a dense per-expert oracle on random
routings (experts with no tokens included, the shared expert too), then a tiny random checkpoint
written by HF transformers against its fp32 greedy tokens through paxengine.LLM: 32-token chunked
prefill, whole prefills, prefix caching, the converted-weights cache, the server; and split over
simulated CPU devices: tensor parallelism, with and without expert parallelism."""

import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from paxengine import LLM, SamplingParams  # noqa: E402
from paxengine.models import moe  # noqa: E402

PROMPTS = [
    [5, 9, 13, 200, 3, 77, 1, 4, 8],
    [(7 * i + 3) % 300 + 1 for i in range(70)],
    [(11 * i + 5) % 300 + 1 for i in range(150)],  # ten blocks of 16
]
MAX_TOKENS = 10
HF = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    mlp_only_layers=[1],  # layers 0 and 2 MoE, layer 1 a dense MLP
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
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


# -- the MoE layer against a dense per-expert oracle ----------------------------------------------
def _silu(x):
    return x / (1 + np.exp(-x))


def _oracle(x, weights, ids, w, shared=None):
    """Token by token, each of its experts' SwiGLU MLP in float64, weighted and summed."""
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            y = (_silu(x[t] @ w["e_gate"][e]) * (x[t] @ w["e_up"][e])) @ w["e_down"][e]
            out[t] += weights[t, j] * y
        if shared is not None:
            s = (_silu(x[t] @ shared["s_gate"]) * (x[t] @ shared["s_up"])) @ shared["s_down"]
            out[t] += s / (1 + np.exp(-(x[t] @ shared["s_router"])))
    return out


def _experts(rng, e, h, i):
    w = {"e_gate": rng.normal(size=(e, h, i)), "e_up": rng.normal(size=(e, h, i))}
    w["e_down"] = rng.normal(size=(e, i, h)) / np.sqrt(i)
    return w


# -- tiny HF checkpoints (also test_mixtral.py's and test_qwen3_moe_fp8_checkpoint.py's) --------
TEACHER_SEQ = [(11 * i + 5) % 300 + 1 for i in range(200)]


def init_weights(model):
    """Weights of 1/sqrt(fan-in) (at 0.02 the MLPs hardly move the tokens), random norms
    (all-ones would pass unread) and a decisive router (its gate at twice that)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0, (2 if name.endswith("mlp.gate.weight") else 1) / p.shape[-1] ** 0.5)
    return model


def hf_teacher_forced(model_dir):
    """HF fp32's next token after each prefix of TEACHER_SEQ of 100..199 tokens -> (its top-1,
    where that top-1 leads by > 0.3: the positions an FP8 model is held to)."""
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(model_dir).float().eval()
    with torch.no_grad():
        logits = hf(torch.tensor([TEACHER_SEQ])).logits[0, 99:199]
    top2 = torch.topk(logits, 2).values
    return logits.argmax(-1).numpy(), (top2[:, 0] - top2[:, 1] > 0.3).numpy()


def teacher_forced_agreement(llm, ref, decisive) -> float:
    """The share of the decisive positions where llm's greedy next token is HF's."""
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    outs = llm.generate([TEACHER_SEQ[:n] for n in range(100, 200)], one, use_tqdm=False)
    got = np.array([o.outputs[0].token_ids[0] for o in outs])
    return float((got == ref)[decisive].mean())


@pytest.mark.parametrize("fused", [False, True])
def test_grouped_experts_equal_a_dense_oracle(fused):
    """Random routings over 8 experts of which 3 get no token (and a step of one token, where
    7 get none): one ragged_dot a projection, the scatter back, the routing weights."""
    rng = np.random.default_rng(0)
    e, h, i, k = 8, 16, 8, 2
    w = _experts(rng, e, h, i)
    used = np.array([0, 2, 3, 6, 7])  # 1, 4 and 5 idle
    for t in (1, 13, 32):
        x = rng.normal(size=(t, h)) / np.sqrt(h)
        ids = np.stack([rng.choice(used, size=k, replace=False) for _ in range(t)])
        weights = rng.random((t, k))
        jw = {n: jnp.asarray(a, jnp.float32) for n, a in w.items()}
        if fused:
            jw["e_gate_up"] = jnp.concatenate([jw.pop("e_gate"), jw.pop("e_up")], axis=-1)
        got = moe.grouped_experts(
            jnp.asarray(x, jnp.float32), jnp.asarray(weights, jnp.float32), jnp.asarray(ids), jw
        )
        np.testing.assert_allclose(np.asarray(got), _oracle(x, weights, ids, w), atol=1e-4)


@pytest.mark.parametrize("shards", [2, 4])
def test_expert_shards_sum_to_the_oracle(shards):
    """Expert parallelism's local sums (`first_expert`): each shard's experts only, the pairs
    routed elsewhere adding zero (a one-token step leaves some shards no pair at all); summed
    over the shards (the all-reduce), the oracle."""
    rng = np.random.default_rng(3)
    e, h, i, k = 8, 16, 8, 2
    w = _experts(rng, e, h, i)
    jw = {n: jnp.asarray(a, jnp.float32) for n, a in w.items()}
    per = e // shards
    for t in (1, 13):
        x = rng.normal(size=(t, h)) / np.sqrt(h)
        ids = np.stack([rng.choice(e, size=k, replace=False) for _ in range(t)])
        weights = rng.random((t, k))
        args = (jnp.asarray(x, jnp.float32), jnp.asarray(weights, jnp.float32), jnp.asarray(ids))
        got = sum(
            moe.grouped_experts(*args, {n: a[f : f + per] for n, a in jw.items()}, first_expert=f)
            for f in range(0, e, per)
        )
        np.testing.assert_allclose(np.asarray(got), _oracle(x, weights, ids, w), atol=1e-4)


@pytest.mark.parametrize("norm", [False, True])
def test_router_and_shared_expert_equal_the_oracle(norm):
    """softmax top-k (renormalised or not) from the router's logits, then the experts and the
    shared expert scaled by its sigmoid gate."""
    rng = np.random.default_rng(1)
    t, e, h, i, k = 11, 6, 16, 8, 3
    x = rng.normal(size=(t, h))
    router = rng.normal(size=(h, e))
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1)[:, :k]
    weights = np.take_along_axis(probs, ids, axis=-1)
    if norm:
        weights = weights / weights.sum(-1, keepdims=True)
    shared = {"s_gate": rng.normal(size=(h, 4)), "s_up": rng.normal(size=(h, 4))}
    shared.update(s_down=rng.normal(size=(4, h)), s_router=rng.normal(size=(h, 1)))
    w = {**_experts(rng, e, h, i), **shared, "router": router}
    got_w, got_ids = moe.route(
        jnp.asarray(x, jnp.float32), jnp.asarray(router, jnp.float32), k, norm
    )
    np.testing.assert_array_equal(np.asarray(got_ids), ids)
    np.testing.assert_allclose(np.asarray(got_w), weights, rtol=1e-5)
    jw = {n: jnp.asarray(a, jnp.float32) for n, a in w.items()}
    got = moe.moe_mlp(jnp.asarray(x, jnp.float32), jw, k, norm)
    np.testing.assert_allclose(
        np.asarray(got), _oracle(x, weights, ids, w, shared), rtol=1e-4, atol=1e-4
    )


# -- the family against HF transformers -----------------------------------------------------------
def _hf_greedy(model, prompts):
    out = []
    for p in prompts:
        gen = model.generate(
            torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS
        )
        out.append(gen[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = init_weights(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**HF)))
    model = model.float().eval()
    path = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(path)
    return path, _hf_greedy(model, PROMPTS)


def _greedy(llm, prompts=PROMPTS):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_chunked_prefill_equals_hf(checkpoint):
    path, want = checkpoint
    llm = LLM(model=str(path), **dict(ENGINE, max_num_batched_tokens=32))
    cfg = llm.engine.model_config
    assert (cfg.family, cfg.moe_layers, cfg.num_experts) == ("qwen3_moe", (0, 2), 8)
    assert _greedy(llm) == want


def test_the_gpus_kernels_equal_hf(checkpoint, monkeypatch):
    """The GPU's path in interpret mode: the experts through kernels_pallas.moe_gemm, the
    Pallas attention backend, and its small buckets' QK-normed q | k | v through the fused RoPE
    + KV-write kernel (counted: one trace a kind of layer in each of the 16-token buckets);
    chunked prefill and decode steps, routings that leave experts idle."""
    import kernels_pallas

    monkeypatch.setenv("PAXENGINE_KERNEL_MOE", "interpret")
    fused = []
    real = kernels_pallas.rope_write_kv
    monkeypatch.setattr(
        kernels_pallas, "rope_write_kv", lambda *a, **k: fused.append(1) or real(*a, **k)
    )
    path, want = checkpoint
    engine = dict(ENGINE, max_num_batched_tokens=32, token_buckets=[16, 32], seq_buckets=[4])
    llm = LLM(model=str(path), attention_backend="pallas", **engine)
    assert llm.engine.runner.backend == "pallas"
    assert len(fused) == 2  # the (16, 4) bucket's MoE and dense layers, not the 32-token one's
    assert _greedy(llm) == want


@pytest.mark.parametrize(
    "first_expert,fp8,big_tiles,glu",
    [
        (None, False, False, True),
        (4, False, False, True),
        (None, True, False, True),
        (4, True, True, True),
        (4, True, False, False),
        (None, False, 32, True),
    ],
)
def test_the_pallas_grouped_gemm_path_equals_the_oracle(
    first_expert, fp8, big_tiles, glu, monkeypatch
):
    """grouped_experts through the kernel: fused gate|up, one-token and 13-token steps (and
    32: a full tile beside partial ones); with first_expert, the shard of experts 4..7 (other
    pairs add nothing); FP8 stacks against the oracle of their dequantized weights; 64-row
    tiles for steps of more than 8 pairs, or 32-row tiles for every step (big_tiles=32:
    PAXENGINE_KERNEL_MOE_TILE_ROWS); the SwiGLU in the gate|up kernel (glu, the default)
    or after it."""
    from paxengine.models.quant import dequantize, quantize_fp8

    monkeypatch.setenv("PAXENGINE_KERNEL_MOE", "interpret")
    monkeypatch.setenv("PAXENGINE_KERNEL_MOE_GLU", "1" if glu else "0")
    big = moe.BIG_TILE_PAIRS_PER_EXPERT * 128  # the default, Qwen3-30B-A3B's 128 experts
    assert (moe.tile_rows(big, 128), moe.tile_rows(big + 1, 128)) == (16, 64)
    if big_tiles is True:
        monkeypatch.setenv("PAXENGINE_KERNEL_MOE_BIG_TILE_PAIRS", "8")
        assert (moe.tile_rows(8, 8), moe.tile_rows(9, 8)) == (16, 64)
    elif big_tiles:
        monkeypatch.setenv("PAXENGINE_KERNEL_MOE_TILE_ROWS", str(big_tiles))
        assert (moe.tile_rows(2, 8), moe.tile_rows(big + 1, 128)) == (big_tiles, big_tiles)
    rng = np.random.default_rng(5)
    e, h, i, k = 8, 32, 16, 2
    w = _experts(rng, e, h, i)
    jw = {n: jnp.asarray(a, jnp.float32) for n, a in w.items()}
    jw["e_gate_up"] = jnp.concatenate([jw.pop("e_gate"), jw.pop("e_up")], axis=-1)
    if fp8:
        jw = {n: quantize_fp8(a) for n, a in jw.items()}
        dense = {n: np.asarray(dequantize(a)) for n, a in jw.items()}
        w = {"e_gate": dense["e_gate_up"][..., :i], "e_up": dense["e_gate_up"][..., i:]}
        w["e_down"] = dense["e_down"]
    if first_expert is not None:
        jw = {n: jax.tree.map(lambda a: a[first_expert:], a) for n, a in jw.items()}
        w = {n: np.where(np.arange(e)[:, None, None] >= first_expert, a, 0) for n, a in w.items()}
    for t in (1, 13, 32):
        x = rng.normal(size=(t, h)) / np.sqrt(h)
        ids = np.stack([rng.choice(e, size=k, replace=False) for _ in range(t)])
        weights = rng.random((t, k))
        args = (jnp.asarray(x, jnp.float32), jnp.asarray(weights, jnp.float32), jnp.asarray(ids))
        got = moe.grouped_experts(*args, jw, first_expert=first_expert)
        np.testing.assert_allclose(np.asarray(got), _oracle(x, weights, ids, w), atol=1e-4)


@pytest.mark.parametrize("mode", ["xla", "interpret"])
def test_padding_tokens_route_to_no_expert(mode, monkeypatch):
    """real=False rows (a bucket's padding: no KV slot) come out 0 and take no expert (in the
    kernel's layout no tile: their routing reads no weights); the real rows are the oracle's.
    One-token steps too (the kernel's tile-per-pair path)."""
    monkeypatch.setenv("PAXENGINE_KERNEL_MOE", mode)
    rng = np.random.default_rng(7)
    e, h, i, k = 8, 32, 16, 2
    w = _experts(rng, e, h, i)
    jw = {n: jnp.asarray(a, jnp.float32) for n, a in w.items()}
    for t, real in ((5, [True, False, True, False, True]), (1, [True]), (1, [False])):
        x = rng.normal(size=(t, h)) / np.sqrt(h)
        ids = np.stack([rng.choice(e, size=k, replace=False) for _ in range(t)])
        weights = rng.random((t, k))
        args = (jnp.asarray(x, jnp.float32), jnp.asarray(weights, jnp.float32), jnp.asarray(ids))
        got = np.asarray(moe.grouped_experts(*args, jw, real=jnp.asarray(real)))
        want = _oracle(x, weights, ids, w) * np.asarray(real)[:, None]
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_steps_past_the_kernels_token_limit_take_ragged_dot(monkeypatch):
    """PAXENGINE_KERNEL_MOE_MAX_TOKENS=4: a 4-token step runs the Pallas kernel, a 5-token
    step jax.lax.ragged_dot (the kernel's 16-row tiles suit decode-sized steps only); the
    kernel path's layout sorts nothing until the pairs pass PAIRWISE_RANK_MAX."""
    monkeypatch.setenv("PAXENGINE_KERNEL_MOE", "interpret")
    monkeypatch.setenv("PAXENGINE_KERNEL_MOE_MAX_TOKENS", "4")
    e, h, i, k = 8, 32, 16, 2
    w = {"e_gate_up": jnp.zeros((e, h, 2 * i)), "e_down": jnp.zeros((e, i, h))}

    def walk(jaxpr):  # the primitives of a jaxpr and of those nested in it (argsort's, ...)
        for eq in jaxpr.eqns:
            yield str(eq.primitive)
            for v in eq.params.values():
                inner = getattr(v, "jaxpr", v)
                if hasattr(inner, "eqns"):
                    yield from walk(inner)

    def prims(t):
        ids = jnp.zeros((t, k), jnp.int32).at[:, 1].set(1)
        jaxpr = jax.make_jaxpr(moe.grouped_experts)(jnp.zeros((t, h)), jnp.ones((t, k)), ids, w)
        return set(walk(jaxpr.jaxpr))

    assert "pallas_call" in prims(4) and "ragged_dot_general" not in prims(4)
    assert "ragged_dot_general" in prims(5) and "pallas_call" not in prims(5)
    # a one-token step: each pair a tile of its own, no sort, no scatter (_experts_one_token)
    assert "pallas_call" in prims(1) and not {"sort", "scatter-add", "scatter"} & prims(1)
    # decode-sized steps: no argsort (kernels_pallas.moe_gemm.PAIRWISE_RANK_MAX); past it one
    assert "scatter-add" in prims(2) and "sort" not in prims(2)
    import kernels_pallas.moe_gemm as mg

    monkeypatch.setattr(mg, "PAIRWISE_RANK_MAX", 4)
    assert "sort" in prims(3) and "sort" not in prims(2)


def test_the_gpus_default_is_the_kernel(monkeypatch):
    """On a GPU every step takes the Pallas kernel unless PAXENGINE_KERNEL_MOE says otherwise
    (XLA's ragged_dot there read all experts: moe_kernel's docstring); elsewhere ragged_dot."""
    monkeypatch.delenv("PAXENGINE_KERNEL_MOE", raising=False)
    monkeypatch.delenv("PAXENGINE_KERNEL_MOE_MAX_TOKENS", raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert moe.moe_kernel(1) == moe.moe_kernel(8192) == "pallas"
    monkeypatch.setenv("PAXENGINE_KERNEL_MOE", "xla")
    assert moe.moe_kernel(1) == "xla"
    monkeypatch.delenv("PAXENGINE_KERNEL_MOE")
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert moe.moe_kernel(1) == "xla"


def test_preemption_and_no_compiles_after_warmup(checkpoint):
    """14 blocks of 16 tokens cannot hold the three prompts' 229 + 30 tokens at once: requests
    are preempted and recomputed; every routing runs in the compiled buckets (0 compiles)."""
    from paxengine.step_build import compile_count

    path, want = checkpoint
    llm = LLM(model=str(path), **dict(ENGINE, num_kv_blocks=14, max_num_batched_tokens=64))
    before = compile_count()
    assert _greedy(llm) == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert compile_count() == before


def test_whole_prefills_prefix_caching_and_the_weights_cache(checkpoint, tmp_path):
    path, want = checkpoint
    llm = LLM(
        model=str(path), weights_cache_dir=str(tmp_path), enable_prefix_caching=True, **ENGINE
    )
    assert _greedy(llm) == want
    hits = llm.engine.kv.prefix_hits
    assert _greedy(llm) == want  # again: every full block but the last token's from the cache
    assert llm.engine.kv.prefix_hits - hits == 64 + 144
    from paxengine.models.loader import load_model

    cached = load_model(str(path), "float32", cache_dir=str(tmp_path), progress=False)
    assert cached.from_cache and cached.config == llm.engine.model_config
    assert cached.params["layers"][0]["e_down"].shape == (8, 32, 64)


def test_ngram_speculation_equals_hf(checkpoint):
    """n-gram drafts (1- to 3-token matches, so the random model's answers give some) verified
    by the MoE forward, some accepted and some not: HF's greedy tokens; a draft model is refused
    by name."""
    path, want = checkpoint
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    ngram |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(model=str(path), speculative_config=ngram, **ENGINE)
    assert _greedy(llm) == want  # together: verify rows beside the others' rows
    assert [_greedy(llm, [p])[0] for p in PROMPTS] == want  # one at a time
    stats = llm.engine.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    with pytest.raises(ValueError, match="method 'draft' .only ngram. is not implemented for"):
        LLM(
            model=str(path),
            speculative_config={"model": str(path), "num_speculative_tokens": 2},
            **ENGINE,
        )


def test_fp8_experts_agree_with_fp32_teacher_forced(checkpoint, tmp_path):
    """--quantization fp8: the experts' stacks quantized per expert and output channel (the
    grouped GEMMs apply each row's expert's scales), attention and the dense MLP as ever; the
    next token after each prefix against HF fp32's, where fp32's top-1 leads by > 0.3 (this
    random model's near-ties are FP8 noise either way: all positions agree ~0.8; applying
    expert 0's scales to every row gave 0.5 on the decisive ones)."""
    from paxengine.models.quant import Fp8Weight

    path, _ = checkpoint
    ref, decisive = hf_teacher_forced(path)
    fp8 = LLM(model=str(path), quantization="fp8", weights_cache_dir=str(tmp_path), **ENGINE)
    layer = fp8.engine.runner.params["layers"][0]
    assert isinstance(layer["e_gate_up"], Fp8Weight) and layer["e_gate_up"].scales.shape == (8, 64)
    assert decisive.sum() >= 20
    agree = teacher_forced_agreement(fp8, ref, decisive)
    assert agree >= 0.9, agree


NGRAM_SERVE = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'


@pytest.mark.parametrize("spec", [None, NGRAM_SERVE], ids=["plain", "ngram"])
def test_the_server_serves_it(checkpoint, spec):
    """`paxengine serve DIR` with its defaults (engine process, background compile), and with
    n-gram speculation: the greedy tokens of a prompt of ten blocks equal HF's."""

    from served import greedy_token_ids, served

    path, want = checkpoint
    args = ["--max-model-len", "256", "--max-num-seqs", "4"]
    args += ["--max-num-batched-tokens", "64", "--served-model-name", "moe"]
    args += ["--speculative-config", spec] if spec else []
    with served(str(path), *args) as base:
        assert greedy_token_ids(base, "moe", PROMPTS[2], MAX_TOKENS) == want[2]
        if spec:  # the answer repeats tokens: 1-token matches drafted
            import httpx

            page = httpx.get(f"{base}/metrics").text
            name = "paxengine:spec_decode_num_draft_tokens_total"
            drafted = re.search(rf"^{name}{{[^}}]*}} (\S+)$", page, re.M)
            assert drafted and float(drafted.group(1)) > 0, page[-2000:]


def test_the_server_serves_it_with_expert_parallelism(checkpoint):
    """`paxengine serve DIR -tp 2 --enable-expert-parallel` on 2 simulated CPU devices."""

    from served import greedy_token_ids, served

    path, want = checkpoint
    args = ["--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]
    args += ["--served-model-name", "moe", "-tp", "2", "--enable-expert-parallel"]
    with served(str(path), *args, devices=2) as base:
        assert greedy_token_ids(base, "moe", PROMPTS[1], MAX_TOKENS) == want[1]


def test_fused_expert_tensors_load_as_the_per_expert_ones():
    """transformers 5's in-memory 3-D form (gate_up_proj [E, 2I, H], down_proj [E, H, I]) and
    the per-expert tensors of the released checkpoints give the same [E, in, out] stacks."""
    from paxengine.models.qwen3_moe import expert_tensor

    rng = np.random.default_rng(2)
    gate_up, down = rng.normal(size=(3, 8, 5)), rng.normal(size=(3, 5, 4))
    fused, each = {}, {}
    expert_tensor(fused, "gate_up_proj", gate_up)
    expert_tensor(fused, "down_proj", down)
    for e in range(3):
        expert_tensor(each, f"{e}.gate_proj.weight", gate_up[e, :4])
        expert_tensor(each, f"{e}.up_proj.weight", gate_up[e, 4:])
        expert_tensor(each, f"{e}.down_proj.weight", down[e])
    for name in ("e_gate", "e_up", "e_down"):
        np.testing.assert_array_equal(fused[name], np.stack([each[name][e] for e in range(3)]))


def _forced_ranks(llm, want, k=0):
    """Teacher-forced on HF's greedy continuations: per continuation token, its prompt-logprob
    entry (rank 1: the engine's top token is HF's)."""
    forced = [list(p) + list(w) for p, w in zip(PROMPTS, want)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
    outs = llm.generate(forced, params, use_tqdm=False)
    return [
        (o.prompt_logprobs[i], o.prompt_token_ids[i])
        for o, p in zip(outs, PROMPTS)
        for i in range(len(p), len(o.prompt_token_ids))
    ]


def test_fp8_kv_cache_calibrates_through_the_family(checkpoint):
    """--kv-cache-dtype fp8 on the MoE family: the scales come from one forward of its own
    (the Llama layout's calibration cannot run its per-layer experts), one (k, v) row per
    layer; teacher-forced on HF fp32's greedy tokens, the fp32 cache ranks every one first and
    the fp8 one >= 0.9 of those the fp32 cache picks by a margin (> 0.3 in logprob: this tiny
    random model has near ties, where an e4m3 rounding may flip them)."""
    path, want = checkpoint
    ref = _forced_ranks(LLM(model=str(path), **ENGINE), want, k=2)
    assert all(e[t].rank == 1 for e, t in ref)
    clear = [sorted((v.logprob for v in e.values()), reverse=True) for e, _ in ref]
    clear = [lp[0] - lp[1] > 0.3 for lp in clear]
    llm = LLM(model=str(path), kv_cache_dtype="fp8", **ENGINE)
    layers = llm.engine.runner.params["layers"]
    scales = np.stack([np.asarray(w["kv_scale"]) for w in layers])
    assert scales.shape == (HF["num_hidden_layers"], 2) and (scales != 1.0).all()
    ranks = [e[t].rank for e, t in _forced_ranks(llm, want)]
    top = [r == 1 for r, c in zip(ranks, clear) if c]
    assert len(top) >= 10 and np.mean(top) >= 0.9, (ranks, clear)


# -- tensor and expert parallelism on simulated CPU devices (tests/devices.py) ---------------------
# One 32-token bucket: the 150-token prompt prefills in chunks.
PARALLEL = dict(ENGINE, max_num_batched_tokens=32, token_buckets=[32], seq_buckets=[4])


@pytest.fixture(scope="module")
def parallel_runs(checkpoint, tmp_path_factory):
    """In one process of 4 CPU devices: TP 2 (each expert's channels split in two), TP 2 with
    expert parallelism (4 whole experts a device), TP 4 with it (2 experts a device, the 2 KV
    heads copied to 4); FP8 experts under TP 2 and under TP 2 with expert parallelism (each
    expert's scales on its device). The one-device FP8 engine they are compared with runs in
    this process (test_fp8_experts_split_over_devices_generate_what_one_device_does): in the
    worker it cost a third device placement's step and samplers, compiled afresh."""
    from devices import run_worker

    path, _ = checkpoint
    cache = str(tmp_path_factory.mktemp("moe_tp") / "jax")
    engine = {k: v for k, v in PARALLEL.items() if k != "show_progress"}
    engine.update(model=str(path), compilation_cache_dir=cache)
    ep = dict(enable_expert_parallel=True)
    runs = [
        {"engine": dict(engine, tensor_parallel_size=2)},
        {"engine": dict(engine, tensor_parallel_size=2, **ep)},
        {"engine": dict(engine, tensor_parallel_size=4, **ep)},
        {"engine": dict(engine, quantization="fp8", tensor_parallel_size=2)},
        {"engine": dict(engine, quantization="fp8", tensor_parallel_size=2, **ep)},
    ]
    for r in runs:
        r.update(prompts=PROMPTS, max_tokens=MAX_TOKENS)
    return run_worker("tp_worker.py", [json.dumps(runs)], 4)


def test_tensor_parallel_equals_hf(checkpoint, parallel_runs):
    """TP 2 without expert parallelism: every expert's gate|up [8, 64, 2 * 32] split by its
    (per-shard fused) output channels, its down [8, 32, 64] by its inputs."""
    _, want = checkpoint
    tp2 = parallel_runs[0]
    assert tp2["tokens"] == want
    gate_up, down = tp2["experts"]["e_gate_up"], tp2["experts"]["e_down"]
    assert gate_up["spec"] == [None, None, "tp"] and gate_up["shard_shape"] == [8, 64, 32]
    assert down["spec"] == [None, "tp", None] and down["shard_shape"] == [8, 16, 64]


def test_expert_parallel_equals_hf(checkpoint, parallel_runs):
    """--enable-expert-parallel: the stacks split by expert, each expert whole on its device;
    at TP 4 the 2 KV heads are copied to one a device."""
    _, want = checkpoint
    for run, n in zip(parallel_runs[1:], (2, 4)):
        assert run["tokens"] == want, n
        gate_up, down = run["experts"]["e_gate_up"], run["experts"]["e_down"]
        assert gate_up["spec"] == ["tp", None, None] and gate_up["shard_shape"] == [8 // n, 64, 64]
        assert down["spec"] == ["tp", None, None] and down["shard_shape"] == [8 // n, 32, 64]
    assert parallel_runs[2]["cache"]["shape"][1] == 4


def test_fp8_experts_split_over_devices_generate_what_one_device_does(checkpoint, parallel_runs):
    """FP8 expert stacks (values [E, out, in], scales [E, out]): split by channel (gate|up's
    scales with their channels) or by expert, the tokens of the one-device FP8 engine (the
    workers' engine configuration, in this process)."""
    path, _ = checkpoint
    one = _greedy(LLM(model=str(path), quantization="fp8", **PARALLEL))
    tp2, ep2 = parallel_runs[3:5]
    assert tp2["tokens"] == one and ep2["tokens"] == one
    assert tp2["experts"]["e_gate_up"]["spec"] == [None, "tp", None]  # values [E, 2I, H]
    assert tp2["experts"]["e_down"]["spec"] == [None, None, "tp"]  # values [E, H, I]
    assert ep2["experts"]["e_gate_up"]["shard_shape"] == [4, 64, 64]


def test_expert_parallel_refusals(checkpoint):
    """--enable-expert-parallel without devices to split over, on a dense model (vLLM ignores
    the flag in both cases), or over a device count that does not divide the experts."""
    path, _ = checkpoint
    with pytest.raises(ValueError, match="needs tensor_parallel_size > 1, got 1"):
        LLM(model=str(path), enable_expert_parallel=True, **ENGINE)
    with pytest.raises(ValueError, match="needs a model with MoE layers; this llama model"):
        LLM(model="dummy:tiny", tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the 8 experts"):
        LLM(model=str(path), tensor_parallel_size=3, enable_expert_parallel=True, **ENGINE)


def test_the_kernels_decode_tuning_reaches_its_16_row_tiles(monkeypatch):
    """PAXENGINE_KERNEL_MOE_DECODE_TUNING's fields are the 16-row tiles' kernel keywords (the
    down projection's N = 32 in two 16-column blocks, not one of 32), the products unchanged;
    a bad item is refused by name."""
    monkeypatch.setenv("PAXENGINE_KERNEL_MOE", "interpret")
    rng = np.random.default_rng(9)
    e, h, i, k = 8, 32, 16, 2
    w = _experts(rng, e, h, i)
    jw = {n: jnp.asarray(a, jnp.float32) for n, a in w.items()}
    x = rng.normal(size=(3, h)) / np.sqrt(h)
    ids = np.stack([rng.choice(e, size=k, replace=False) for _ in range(3)])
    weights = rng.random((3, k))
    args = (jnp.asarray(x, jnp.float32), jnp.asarray(weights, jnp.float32), jnp.asarray(ids))

    def grids():
        jaxpr = jax.make_jaxpr(lambda *a: moe.grouped_experts(*a, jw))(*args)
        eqns = [q for q in jaxpr.jaxpr.eqns if q.primitive.name == "pjit"]
        eqns = [q for p in eqns for q in p.params["jaxpr"].jaxpr.eqns] + list(jaxpr.jaxpr.eqns)
        return [q.params["grid_mapping"].grid for q in eqns if q.primitive.name == "pallas_call"]

    assert moe.decode_tuning() == {}
    default = grids()
    monkeypatch.setenv("PAXENGINE_KERNEL_MOE_DECODE_TUNING", "block_n=16,num_stages=4")
    assert moe.decode_tuning() == {"block_n": 16, "num_stages": 4}
    tuned = grids()
    assert len(default) == len(tuned) == 3 and default[-1][1] == 1 and tuned[-1][1] == 2
    got = moe.grouped_experts(*args, jw)
    np.testing.assert_allclose(np.asarray(got), _oracle(x, weights, ids, w), atol=1e-4)
    monkeypatch.setenv("PAXENGINE_KERNEL_MOE_DECODE_TUNING", "block_m=64")
    with pytest.raises(ValueError, match="block_m=64"):
        moe.decode_tuning()


def test_a_one_row_dot_is_a_two_row_gemm_between_barriers_on_the_gpu(monkeypatch):
    """quant.row_dot: on the GPU a one-row x multiplies as two rows (the second zero) with an
    optimization barrier on each side (XLA would make the vector-matrix dot a multiply that
    writes the whole [in, out] product, then a reduce); the product is x @ w either way, and
    elsewhere (or with more rows) it is the plain dot."""
    from paxengine.models import quant

    rng = np.random.default_rng(11)
    w = jnp.asarray(rng.normal(size=(64, 48)), jnp.float32)
    x1, x3 = (jnp.asarray(rng.normal(size=(m, 64)), jnp.float32) for m in (1, 3))

    def prims(x):
        jaxpr = jax.make_jaxpr(lambda x: quant.row_dot(x, w))(x).jaxpr
        return [(q.primitive.name, [v.aval.shape for v in q.invars]) for q in jaxpr.eqns]

    assert [p for p, _ in prims(x1)] == ["dot_general"]  # the CPU: the plain dot
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    got = prims(x1)
    assert [p for p, _ in got].count("optimization_barrier") == 2
    assert [s[0] for p, s in got if p == "dot_general"] == [(2, 64)]
    assert [p for p, _ in prims(x3)] == ["dot_general"]  # more rows: the plain GEMM
    for x in (x1, x3):
        np.testing.assert_allclose(np.asarray(quant.row_dot(x, w)), np.asarray(x @ w), rtol=1e-6)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_conversion_holds_one_layer_at_a_time(checkpoint, tmp_path, monkeypatch, quantization):
    """A converting load (a cold weights cache) goes layer by layer into the cache file (#55:
    no full copy in host memory): when a layer reaches the cache, the arrays of every layer
    before it are gone; what it reads back equals the in-memory conversion's (no cache)."""
    import weakref

    from paxengine.models import loader, weights_cache
    from paxengine.models.weights import flatten

    path, _ = checkpoint
    handed: list = []  # per layer: weak references to the arrays the loader wrote
    add = weights_cache.StreamWriter.add

    def watch(self, params, prefix=""):
        if prefix.startswith("layers."):
            alive = [i for i, refs in enumerate(handed) if any(r() is not None for r in refs)]
            assert not alive, f"layers {alive} still in memory at {prefix}"
            leaves = [
                a
                for v in flatten(params).values()
                for a in ((v.values, v.scales) if hasattr(v, "values") else (v,))
            ]
            handed.append([weakref.ref(a) for a in leaves])
        return add(self, params, prefix)

    monkeypatch.setattr(weights_cache.StreamWriter, "add", watch)
    kw = dict(quantization=quantization, progress=False)
    streamed = loader.load_model(str(path), "float32", cache_dir=str(tmp_path), **kw)
    assert len(handed) == streamed.config.num_layers and not streamed.from_cache
    whole = loader.load_model(str(path), "float32", use_cache=False, **kw)
    a, b = flatten(streamed.params), flatten(whole.params)
    assert a.keys() == b.keys()
    for k in a:
        x, y = (a[k], b[k]) if not hasattr(a[k], "values") else (a[k].values, b[k].values)
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), k)
        if hasattr(a[k], "scales"):
            np.testing.assert_array_equal(np.asarray(a[k].scales), np.asarray(b[k].scales))
    warm = loader.load_model(str(path), "float32", cache_dir=str(tmp_path), **kw)
    assert warm.from_cache
