"""Model hyper-parameters for the Llama family, read from HF config.json, GGUF metadata or a preset."""

from __future__ import annotations

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
    rope = cfg.get("rope_scaling") or None
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    if rope is None and params.get("rope_type", "default") != "default":
        rope = {k: v for k, v in params.items() if k != "rope_theta"}
    if rope is not None and rope.get("rope_type", rope.get("type")) in (None, "default"):
        rope = None
    if rope is not None and rope.get("rope_type", rope.get("type")) != "llama3":
        raise ValueError(f"unsupported rope_scaling {rope!r}: only 'llama3' scaling is implemented")
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
        rope_theta=float(theta),
        rope_scaling=_freeze(rope),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        qk_norm=arch == "qwen3",
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
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
