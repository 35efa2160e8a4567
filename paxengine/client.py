"""`EngineClient`: the one interface a server (or a replica router, or a test fake) codes against.

`AsyncEngine` implements it in-process; anything else that does (an engine in another process,
a fake for tests) is interchangeable behind `serving/`. Errors are the types in
`paxengine.errors`: `InvalidRequest` (400), `EngineOverloaded` (503, retry), `EngineDead` (503).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Protocol, Sequence, runtime_checkable

from paxengine.config import EngineConfig
from paxengine.outputs import RequestOutput
from paxengine.sampling_params import SamplingParams
from paxengine.validation import Limits

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the embedded model's served name


@dataclass(frozen=True)
class ModelInfo:
    """What an engine serves, fixed once it has started."""

    name: str  # the served model name (the `model` field of the API)
    aliases: tuple[str, ...]  # other names a request may use for it (the model path)
    max_model_len: int
    vocab_size: int
    dtype: str  # activations (and weights, unless weight_dtype says otherwise)
    weight_dtype: str  # what the projection weights hold: the dtype, or "fp8_e4m3"
    kv_cache_dtype: str
    kv_capacity_tokens: int
    buckets: tuple[tuple[int, int], ...]  # compiled (tokens, sequences) step shapes
    # an FP8 cache's per-layer K/V scales: "checkpoint" | "calibrated" | "unit"; else "none"
    kv_cache_scales: str = "none"

    @property
    def limits(self) -> Limits:
        return Limits(self.vocab_size, self.max_model_len, self.kv_capacity_tokens)


def served_names(config: EngineConfig) -> list[str]:
    """vLLM's rule: --served-model-name's names (the first is the one responses carry), else the
    model argument as given."""
    names = config.served_model_name
    if isinstance(names, (list, tuple)) and names:
        return [str(n) for n in names]
    if names:
        return [str(names)]
    return [str(config.model) if config.model else DEFAULT_MODEL_NAME]


def served_name(config: EngineConfig) -> str:
    return served_names(config)[0]


@runtime_checkable
class EngineClient(Protocol):
    config: EngineConfig

    @property
    def tokenizer(self):
        """.encode(text, add_special_tokens=True), .decode(ids), .apply_chat_template(messages,
        add_generation_prompt=True, continue_final_message=False, **template_variables) -> str,
        .eos_token_ids."""

    def model_info(self) -> ModelInfo: ...

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise InvalidRequest unless `generate` would accept this request."""

    def generate(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Validate and admit the request at once (raising InvalidRequest, EngineOverloaded or
        EngineDead from this call), then return an iterator of cumulative outputs, the last
        with `finished`. `prompt` is token ids, or text for the engine's tokenizer. Closing the
        iterator early aborts the request; one never iterated must be aborted by the caller."""

    async def abort(self, request_id: str) -> None: ...

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False when it could not be done now."""

    def stats(self) -> dict:
        """Counters and gauges (names in serving/metrics.py); must not block on a step."""

    def is_healthy(self) -> bool: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...
