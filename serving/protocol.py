"""Pydantic models of every request and response body (OpenAI shapes).

Requests are validated strictly from JSON (no "0.5" -> 0.5, no true -> 1, no NaN/inf); fields
that OpenAI clients send but we do not use are ignored. Value ranges are checked by
`SamplingParams.validate` and the engine, so there is one source of truth for them.
"""
from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer

_REQUEST = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

TokenIds = list[int]
Prompt = Union[str, list[str], TokenIds, list[TokenIds]]
Stop = Union[str, list[str], None]


# ----------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[int, str]] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ----------------------------------------------------------------------------- shared
class StreamOptions(BaseModel):
    model_config = _REQUEST
    include_usage: bool = False
    continuous_usage_stats: bool = False


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class _SamplingFields(BaseModel):
    """Fields common to /v1/completions and /v1/chat/completions."""
    model_config = _REQUEST
    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Stop = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    logit_bias: Optional[dict[str, float]] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None


# ----------------------------------------------------------------------------- completions
class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    add_special_tokens: bool = True


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


# ----------------------------------------------------------------------------- chat
class TextContentPart(BaseModel):
    model_config = _REQUEST
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _REQUEST
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextContentPart], None] = None
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):  # a delta carries only what changed
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[Usage] = None


# ----------------------------------------------------------------------------- models, tokenize
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "paxengine"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    """Either `prompt` (text) or `messages` (rendered with the chat template)."""
    model_config = _REQUEST
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = _REQUEST
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: str


class VersionResponse(BaseModel):
    version: str


def schema_of(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI `requestBody` for routes that parse their body themselves."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": model.model_json_schema()}}}}
