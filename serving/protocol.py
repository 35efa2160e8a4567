"""Pydantic models of every request and response body (OpenAI shapes).

Requests are validated strictly from JSON (no "0.5" -> 0.5, no true -> 1, no NaN/inf). A field
we do not implement is a 400 that names it, never a silent ignore (issue #16): unknown fields are
forbidden, and the fields OpenAI or vLLM define that we lack are listed (`_NoOp` tables) with the
values that ask for nothing, which are accepted since common clients send them. Value ranges are
checked by `SamplingParams.validate` and the engine, so there is one source of truth for them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

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


# ----------------------------------------------------------------------------- unimplemented
class _NoOp:
    """The values of a field we do not implement that ask for nothing: null, the documented
    defaults in `values`, or whatever `test(value, body)` accepts. Any other value is a 400."""

    def __init__(self, *values, test: Optional[Callable[[Any, dict], bool]] = None):
        self.values, self.test = values, test

    def __call__(self, value, body: dict) -> bool:
        if value is None:
            return True
        if self.test is not None:
            return self.test(value, body)
        # == alone would take true for 1 and 1 for true
        return any(
            value == v and isinstance(value, bool) == isinstance(v, bool) for v in self.values
        )


def _best_of_is_n(value, body) -> bool:
    n = body.get("n", 1)
    return type(value) is int and type(n) is int and value == n  # one candidate per output


class _Request(BaseModel):
    """A request body: unknown fields are refused, and the listed unimplemented ones too unless
    their value is a no-op, which is dropped before validation. What stays is refused by
    extra="forbid" with the field's path, which errors.py turns into a 400 naming it."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    unimplemented: ClassVar[dict[str, _NoOp]] = {}

    @model_validator(mode="before")
    @classmethod
    def _drop_noops(cls, data):
        if not isinstance(data, dict) or not cls.unimplemented:
            return data
        return {
            k: v
            for k, v in data.items()
            if not (k in cls.unimplemented and cls.unimplemented[k](v, data))
        }


# Both endpoints. OpenAI's and vLLM's names; vLLM-only ones would otherwise be "unknown".
_SHARED_UNIMPLEMENTED = {
    # structured output: JSON is compact with fixed separators (paxengine/structured.py)
    "guided_whitespace_pattern": _NoOp(),
    "guided_decoding_backend": _NoOp("auto", "llguidance", "guidance"),  # the one we have
    # sampling and decoding
    "best_of": _NoOp(test=_best_of_is_n),
    "logits_processors": _NoOp(),
    "spaces_between_special_tokens": _NoOp(True),
    # serving
    "kv_transfer_params": _NoOp(),
    "vllm_xargs": _NoOp(),
    "store": _NoOp(False),  # keeping the completion for later retrieval
    "service_tier": _NoOp("auto", "default"),  # flex / priority processing
}

_CHAT_UNIMPLEMENTED = {
    **_SHARED_UNIMPLEMENTED,
    # the legacy (pre-tools) function calling: vLLM drops it silently; here a 400 says to use tools
    "functions": _NoOp([]),
    "function_call": _NoOp("none", "auto"),
    # other outputs and models' options
    "modalities": _NoOp(["text"]),
    "audio": _NoOp(),
    "prediction": _NoOp(),
    "verbosity": _NoOp(),
    "web_search_options": _NoOp(),
    # vLLM's chat extras
    "mm_processor_kwargs": _NoOp(),
}

_COMPLETION_UNIMPLEMENTED = {
    **_SHARED_UNIMPLEMENTED,
    "suffix": _NoOp(""),
    "prompt_embeds": _NoOp(),
}

# Fields of a message that a client replaying an earlier answer sends as null or empty.
_MESSAGE_UNIMPLEMENTED = {
    "function_call": _NoOp(),
    "refusal": _NoOp(),
    "annotations": _NoOp([]),
    "audio": _NoOp(),
}

# Content parts other than text (their `type` is refused too; this names the part).
_CONTENT_PART_UNIMPLEMENTED = {"image_url": _NoOp(), "input_audio": _NoOp(), "file": _NoOp()}

_STREAM_OPTIONS_UNIMPLEMENTED = {
    "include_obfuscation": _NoOp(False),  # OpenAI: random padding against size side channels
}

# Every listed name: errors.py says "not supported yet" for these, "unknown field" for others.
UNIMPLEMENTED_FIELDS = frozenset().union(
    _CHAT_UNIMPLEMENTED,
    _COMPLETION_UNIMPLEMENTED,
    _MESSAGE_UNIMPLEMENTED,
    _CONTENT_PART_UNIMPLEMENTED,
    _STREAM_OPTIONS_UNIMPLEMENTED,
)


# ----------------------------------------------------------------------------- shared
class StreamOptions(_Request):
    unimplemented = _STREAM_OPTIONS_UNIMPLEMENTED
    include_usage: bool = False
    # vLLM's: usage in every chunk too (the choice's tokens so far); only with include_usage
    continuous_usage_stats: Optional[bool] = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


# ----------------------------------------------------------------------------- structured output
class JsonSchemaFormat(_Request):
    name: str
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    # strict or not, the schema is enforced (a token mask); strict asks for nothing more
    strict: Optional[bool] = None


class ResponseFormat(_Request):
    """OpenAI's `response_format`: text, json_object, or json_schema; or vLLM's structural_tag:
    its structures and triggers, or xgrammar's format (paxengine/structured.structural_tag
    checks them)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: Optional[JsonSchemaFormat] = None
    structures: Optional[list[dict[str, Any]]] = None
    triggers: Optional[list[str]] = None
    format: Optional[dict[str, Any]] = None


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs` (exactly one of these)."""

    json_: Optional[Union[dict[str, Any], str]] = Field(default=None, alias="json")
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None  # Lark, as llguidance takes it
    structural_tag: Optional[str] = None  # the JSON text of a structural_tag response_format


class _SamplingFields(_Request):
    """Fields common to /v1/completions and /v1/chat/completions."""

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
    # vLLM's beam search (serving/beam_search.py): n beams; length_penalty ranks the finished
    use_beam_search: bool = False
    length_penalty: float = 1.0
    stop: Stop = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    logit_bias: Optional[dict[str, float]] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    priority: int = 0  # vLLM's: lower first, under --scheduling-policy priority
    truncate_prompt_tokens: Optional[int] = None  # vLLM's: the prompt's last k tokens (-1: max)
    allowed_token_ids: Optional[list[int]] = None  # vLLM's: sample only among these
    bad_words: Optional[list[str]] = None  # vLLM's: words the output must not contain
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:<id>"
    cache_salt: Optional[str] = None  # vLLM's: prefix-cache hits only within one salt (tenant)
    return_token_ids: bool = False  # vLLM's: the prompt's and the output's token ids
    # vLLM's: each prompt token's logprob and the top k (the response's `prompt_logprobs`)
    prompt_logprobs: Optional[int] = None
    # vLLM's: the think block is closed after this many tokens (needs --reasoning-parser)
    thinking_token_budget: Optional[int] = None
    request_id: Optional[str] = None  # vLLM's: names the response (cmpl-<id>, chatcmpl-<id>)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # structured output (one of them; serving/constraints.constraint)
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsRequest] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None  # vLLM's legacy names
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    # Accepted and unused: metadata about the caller, or a routing hint, that changes no output.
    user: Optional[str] = None
    safety_identifier: Optional[str] = None  # OpenAI's successor of `user`
    metadata: Optional[dict[str, Any]] = None
    prompt_cache_key: Optional[str] = None  # our prefix cache needs no hint


# ----------------------------------------------------------------------------- completions
class CompletionRequest(_SamplingFields):
    unimplemented = _COMPLETION_UNIMPLEMENTED
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


class _WithTokenIds(BaseModel):
    """A response part that carries token ids when the request asked (`return_token_ids`): the
    fields appear only then."""

    @model_serializer(mode="wrap")
    def _drop_unasked_ids(self, handler):
        return {
            k: v
            for k, v in handler(self).items()
            if not (v is None and k in ("token_ids", "prompt_token_ids", "prompt_logprobs"))
        }


class PromptLogprob(BaseModel):
    """One token of a prompt position's entry (vLLM's Logprob)."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# vLLM's prompt_logprobs: None for the first prompt token, then {token id: its logprob}
PromptLogprobs = Optional[list[Optional[dict[int, PromptLogprob]]]]


class CompletionChoice(_WithTokenIds):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_token_ids: Optional[list[int]] = None  # return_token_ids (streamed: the first chunk)
    token_ids: Optional[list[int]] = None  # return_token_ids (streamed: this chunk's)
    prompt_logprobs: PromptLogprobs = None  # vLLM's (streamed: the choice's first chunk)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


# ----------------------------------------------------------------------------- chat
class TextContentPart(_Request):
    unimplemented = _CONTENT_PART_UNIMPLEMENTED
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    unimplemented = _MESSAGE_UNIMPLEMENTED
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # a tool's result answers this call
    reasoning: Optional[str] = None  # an assistant's earlier reasoning (vLLM's), to the template
    reasoning_content: Optional[str] = None  # its deprecated name, taken as `reasoning`

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema
    strict: Optional[bool] = None  # forced calls are enforced whatever it says


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    unimplemented = _CHAT_UNIMPLEMENTED
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Optional[list[ChatTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # vLLM's: the request's own Jinja chat template (a 400 unless the server runs with
    # --trust-request-chat-template)
    chat_template: Optional[str] = None
    # vLLM's: retrieved documents for a RAG template, each a dict of strings ("title", "text")
    documents: Optional[list[dict[str, str]]] = None
    add_special_tokens: bool = False  # the tokenizer's on top of the template's (vLLM's)
    # vLLM's: false drops the think block's text (--reasoning-parser) from the response
    include_reasoning: bool = True
    # OpenAI's; as vLLM, a template variable (templates that know it use it)
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
    # vLLM's: the last message's content first in each choice when its role is the answer's
    echo: bool = False


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    reasoning: Optional[str] = None  # the think block's text (--reasoning-parser; vLLM's name)
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)


class _DropNone(BaseModel):
    @model_serializer(mode="wrap")
    def _drop_none(self, handler):  # a delta carries only what changed
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_DropNone):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_DropNone):
    """One piece of a streamed tool call: the first has its id, type and name."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None


class ChatChoice(_WithTokenIds):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None  # return_token_ids


class ChatCompletionResponse(_WithTokenIds):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None
    prompt_token_ids: Optional[list[int]] = None  # return_token_ids
    prompt_logprobs: PromptLogprobs = None  # vLLM's


class DeltaMessage(_DropNone):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatStreamChoice(_WithTokenIds):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None  # return_token_ids: this chunk's


class ChatCompletionChunk(_WithTokenIds):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[Usage] = None
    prompt_token_ids: Optional[list[int]] = None  # return_token_ids: in the role chunks
    prompt_logprobs: PromptLogprobs = None  # vLLM's: with the choice's first output


# ----------------------------------------------------------------------------- models, tokenize
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "paxengine"
    root: Optional[str] = None
    max_model_len: Optional[int] = None
    # what the server really runs, never silent: e.g. "fp8_e4m3" weights, an "fp8" KV cache
    dtype: Optional[str] = None
    weight_dtype: Optional[str] = None
    kv_cache_dtype: Optional[str] = None
    kv_cache_scales: Optional[str] = None  # an FP8 cache's scales: checkpoint, calibrated, unit


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    """Either `prompt` (text) or `messages` (rendered with the chat template)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1)
    add_special_tokens: Optional[bool] = None  # None: yes for a prompt, no for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    chat_template: Optional[str] = None  # as a chat request's (--trust-request-chat-template)
    # vLLM's: retrieved documents for a RAG template, each a dict of strings ("title", "text")
    documents: Optional[list[dict[str, str]]] = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
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
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }
