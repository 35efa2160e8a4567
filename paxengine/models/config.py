"""Model hyper-parameters for the Llama family, read from HF config.json, GGUF metadata or a preset."""

from __future__ import annotations

import math
from dataclasses import dataclass

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None  # sorted (key, value) pairs, hashable for jit
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    name: str = ""
    # the family that runs it (models/registry.py); the fields below are the hybrid ones
    family: str = "llama"
    # per layer "full_attention" (KV pages) or "linear_attention" (a Gated DeltaNet with one
    # state slot per request); None: every layer is attention
    layer_types: tuple | None = None
    partial_rotary_factor: float = 1.0  # RoPE over the first share of each head
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # mixture-of-experts MLPs (models/moe.py): the layers that have one, E experts, top-k each
    moe_layers: tuple = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0

    def __post_init__(self):
        # a config read back from JSON (the weights cache) has lists where jit keys need tuples
        for f in ("rope_scaling", "layer_types", "moe_layers"):
            v = getattr(self, f)
            if isinstance(v, list):
                object.__setattr__(self, f, _tuples(v))

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with KV pages, in order (a KV cache holds these only)."""
        if self.layer_types is None:
            return tuple(range(self.num_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The layers with a per-request state slot instead of KV pages."""
        if self.layer_types is None:
            return ()
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def num_kv_layers(self) -> int:
        return len(self.attention_layers)

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def derived_max_model_len(self) -> int:
        """The longest context the model takes, by vLLM's rule: max_position_embeddings, except
        that YaRN stretches the pretraining length (original_max_position_embeddings x
        factor); llama3 scaling's max_position_embeddings is the stretched length already."""
        sc = self.rope_scaling_dict
        if sc and sc.get("rope_type") == "yarn":
            return int(sc["original_max_position_embeddings"] * sc["factor"])
        return self.max_position_embeddings

    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else h * self.vocab_size
        return self.num_layers * per_layer + self.vocab_size * h + h + head


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, (list, tuple)) else v


def _freeze(d: dict | None) -> tuple | None:
    if not d:
        return None
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


ROPE_TYPES = ("default", "llama3", "yarn")  # the `rope_type`s models/llama.py computes


def hf_rope(cfg: dict, max_pos: int, partial: float = 1.0) -> tuple[float, float, tuple | None]:
    """(rope_theta, partial_rotary_factor, rope_scaling) of a config.json dict (a multimodal
    one's text_config), read as transformers 5 reads them: `rope_scaling` is taken over
    `rope_parameters` where both are set, theta and the rotary share come from that dict, else
    the config's top level (`partial`: the family's default). rope_scaling: frozen pairs of the
    parameters the RoPE tables need (`_scaling`), None for plain RoPE; Qwen3.5's
    mrope_section / mrope_interleaved change nothing for text (every position's three axes are
    the same), so they are read past."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"rope_parameters: expected an object, got {rope!r}")
    theta = rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0
    share = rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or partial
    return float(theta), float(share), _freeze(_scaling(rope, cfg, max_pos))


def _scaling(rope: dict, cfg: dict, max_pos: int) -> dict | None:
    """The scaling's parameters with transformers' defaults filled in
    (modeling_rope_utils.standardize_rope_params, _compute_yarn_parameters), so that the table
    builder and the weights cache's stored config hold the numbers that run. Another
    rope_type is a ValueError naming it."""
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind == "default":
        return None
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {kind!r} (rope_scaling / rope_parameters): paxengine "
            f"implements {', '.join(repr(t) for t in ROPE_TYPES)}"
        )
    # a top-level original_max_position_embeddings wins (transformers' Phi-3 exception), then
    # the scaling's own, then the config's max_position_embeddings
    orig = int(
        cfg.get("original_max_position_embeddings")
        or rope.get("original_max_position_embeddings")
        or max_pos
    )
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor")
        return {
            "rope_type": kind,
            **{k: rope[k] for k in keys},
            "original_max_position_embeddings": orig,
        }
    factor = rope.get("factor")
    factor = float(factor if factor is not None else max_pos / orig)  # DeepSeek-V3's rule
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:  # the YaRN paper's 0.1 ln(s) + 1, or DeepSeek's ratio of two
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": orig,
        "attention_factor": float(attention_factor),
        "beta_fast": float(rope.get("beta_fast") or 32),
        "beta_slow": float(rope.get("beta_slow") or 1),
        "truncate": bool(rope.get("truncate", True)),
    }


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def apply_hf_overrides(raw: dict, overrides: dict | None) -> dict:
    """config.json's dict with --hf-overrides merged in (vLLM's flag): a nested object merges
    key by key into the dict it names (`{"text_config": {"rope_parameters": {"factor": 4}}}`
    changes that one key of a multimodal checkpoint's text model), anything else replaces the
    value. rope_scaling and rope_parameters name one attribute in transformers 5 (vLLM sets
    it on the loaded config), so an override under either name goes to the one this config
    uses: YaRN given as rope_parameters reaches a checkpoint whose rope_scaling is llama3's,
    which `hf_rope` would otherwise read first. A new dict; `raw` is left as it is."""
    out, overrides = dict(raw), dict(overrides or {})
    ropes = [overrides.pop(k) for k in _ROPE_KEYS if k in overrides]
    if ropes:  # (both names given: one object of the two)
        rope = ropes[-1]
        if len(ropes) == 2 and all(isinstance(r, dict) for r in ropes):
            rope = {**ropes[0], **ropes[1]}
        overrides["rope_scaling" if out.get("rope_scaling") else "rope_parameters"] = rope
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = apply_hf_overrides(out[k], v)
        else:
            out[k] = v
    return out


_ROPE_KEYS = ("rope_scaling", "rope_parameters")


def from_hf_config(cfg: dict) -> ModelConfig:
    """Build a ModelConfig from a transformers config.json dict; unknown architectures fail clearly."""
    archs = cfg.get("architectures") or []
    arch = next((SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS), None)
    if arch is None:
        mt = cfg.get("model_type")
        arch = mt if mt in SUPPORTED_ARCHS.values() else None
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}: paxengine supports "
            f"{sorted(SUPPORTED_ARCHS)}"
        )
    heads = cfg["num_attention_heads"]
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    theta, _, rope = hf_rope(cfg, max_pos)
    use_sw = cfg.get("use_sliding_window", arch == "mistral")
    return ModelConfig(
        arch=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=theta,
        rope_scaling=rope,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        qk_norm=arch == "qwen3",
        max_position_embeddings=max_pos,
        sliding_window=cfg.get("sliding_window") if use_sw else None,
        name=cfg.get("_name_or_path", ""),
    )


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Real shapes for benchmarks with dummy weights (`model: dummy:<name>`).
PRESETS = {
    "llama-3.1-8b": ModelConfig(
        arch="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rope_scaling=_freeze(_LLAMA3_ROPE),
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        name="dummy-llama-3.1-8b",
    ),
    "qwen3-8b": ModelConfig(
        arch="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        qk_norm=True,
        max_position_embeddings=40960,
        name="dummy-qwen3-8b",
    ),
    "smollm2-135m": ModelConfig(
        arch="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        name="dummy-smollm2-135m",
    ),
    "tiny": ModelConfig(
        arch="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        name="dummy-tiny",
    ),
}
