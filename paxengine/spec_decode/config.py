"""`speculative_config`: vLLM's keys, checked before the model loads."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from paxengine.config import json_object_option

log = logging.getLogger("paxengine")

MAX_SPECULATIVE_TOKENS = 16
# Methods vLLM has that we do not run yet (issue #20's later slices): refused by name. "eagle"
# (EAGLE-1/2 heads: fc over [embedding ; the target's last hidden state], no aux layers, the full
# vocabulary) is another architecture than EAGLE-3's, not a setting of it.
_NOT_YET = ("eagle", "medusa", "mlp_speculator")
# vLLM's per-model names of "mtp" (its MTPModelTypes), which it takes as "mtp" with a deprecation
# warning: Qwen's model cards launch Qwen3.5 with {"method": "qwen3_next_mtp", ...}. The model's
# own MTP layer runs whichever name; a model without one is refused by name (spec_decode/mtp.py).
MTP_ALIASES = (
    "qwen3_next_mtp",
    "qwen3_5_mtp",
    "deepseek_mtp",
    "mimo_mtp",
    "glm4_moe_mtp",
    "ernie_mtp",
    "longcat_flash_mtp",
)
_WITH_MODEL = ("draft", "eagle3")  # methods whose `model` the engine loads
# config.json "architectures" of an EAGLE-3 Llama head (eagle3.py loads one; draft_model.py
# refuses one as a draft model)
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# Above this many running sequences the engine stops speculating: a verify step costs more than
# it saves once the batch is compute-bound. On the H200 (8B, benchmarks/results/
# gpu_2026-12-02_spec_launch/) a free-form acceptance already loses at batch 8 and a copy-heavy
# one still gains at 64; 16 sits between, and 64 requests run within 2% of no speculation.
DEFAULT_DISABLE_BY_BATCH_SIZE = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: drafts per sequence and step (at most)
    prompt_lookup_min: int = 5  # shortest suffix n-gram that may match (vLLM's default)
    prompt_lookup_max: int = 5  # longest, tried first
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    # method "draft": the draft model, any source --model takes (a safetensors directory, a
    # .gguf file, "default" for the embedded GGUF, dummy:<preset>); method "eagle3": the
    # speculator's directory (spec_decode/eagle3.py). Loaded by the engine
    model: str | None = None


def parse_speculative_config(raw) -> SpeculativeConfig | None:
    """A dict (or its JSON text) -> SpeculativeConfig; None/{} -> None. Raises ValueError with
    the offending key on anything we cannot run."""
    if isinstance(raw, SpeculativeConfig):
        return raw
    raw = json_object_option(raw, "speculative_config")
    if raw is None:
        return None
    method = raw.pop("method", None)
    if method is None:
        # vLLM infers ngram from prompt_lookup_*; a draft model from `model`
        method = "draft" if "model" in raw else "ngram"
    if method in MTP_ALIASES:
        log.warning(
            "speculative_config: method %r is vLLM's older name of 'mtp': taken as 'mtp'", method
        )
        method = "mtp"
    if method in _NOT_YET or (method not in ("ngram", "mtp", *_WITH_MODEL) and "model" in raw):
        raise ValueError(
            f"speculative_config: method {method!r} is not implemented yet (only 'ngram', "
            "prompt lookup, 'draft', a draft model, 'eagle3', an EAGLE-3 speculator, and "
            "'mtp', Qwen3.5's own MTP layer, are)"
        )
    if method in _WITH_MODEL:
        return _parse_model(raw, method)
    if method == "mtp":  # the model's own MTP layer (mtp.py): no model of its own
        unknown = set(raw) - {"num_speculative_tokens", "disable_by_batch_size"}
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)} for method 'mtp'")
        return SpeculativeConfig("mtp", _check_ints(raw), 5, 5, _disable(raw))
    if method != "ngram":
        raise ValueError(
            f"speculative_config: unknown method {method!r} (supported: 'ngram', 'draft', "
            "'eagle3', 'mtp')"
        )
    if "model" in raw:
        raise ValueError("speculative_config: 'model' is for method 'draft', not 'ngram'")
    known = {
        "num_speculative_tokens",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "disable_by_batch_size",
    }
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {sorted(unknown)} for method 'ngram'")
    k = _check_ints(raw)
    # vLLM's defaults: both 5; one of them given, the other equals it
    lo = raw.get("prompt_lookup_min", raw.get("prompt_lookup_max", 5))
    hi = raw.get("prompt_lookup_max", lo)
    if lo < 1:
        raise ValueError(f"speculative_config: prompt_lookup_min must be >= 1, got {lo}")
    if lo > hi:
        raise ValueError(
            f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
        )
    return SpeculativeConfig("ngram", k, lo, hi, _disable(raw))


def _check_ints(raw: dict) -> int:
    """Every value in `raw` an int (bools refused); -> num_speculative_tokens, checked."""
    for key, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"speculative_config: {key} must be an integer, got {value!r}")
    if "num_speculative_tokens" not in raw:
        raise ValueError("speculative_config: num_speculative_tokens is required")
    k = raw["num_speculative_tokens"]
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"speculative_config: num_speculative_tokens must be in [1, "
            f"{MAX_SPECULATIVE_TOKENS}], got {k}"
        )
    return k


def _disable(raw: dict) -> int:
    disable = raw.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
    if disable < 1:
        raise ValueError(f"speculative_config: disable_by_batch_size must be >= 1, got {disable}")
    return disable


def _parse_model(raw: dict, method: str) -> SpeculativeConfig:
    """methods 'draft' and 'eagle3': {"model", "num_speculative_tokens",
    "disable_by_batch_size"}. The model itself (its vocabulary, its hidden size against the
    target's) is checked when the engine loads it."""
    model = raw.pop("model", None)
    if not isinstance(model, str) or not model:
        what = (
            "a path, a .gguf file, 'default' or dummy:<preset>"
            if method == "draft"
            else "the speculator's directory"
        )
        raise ValueError(
            f"speculative_config: method {method!r} needs 'model' ({what}), got {model!r}"
        )
    unknown = set(raw) - {"num_speculative_tokens", "disable_by_batch_size"}
    if unknown:
        raise ValueError(
            f"speculative_config: unknown keys {sorted(unknown)} for method {method!r}"
        )
    k = _check_ints(raw)
    return SpeculativeConfig(method, k, 5, 5, _disable(raw), model)
