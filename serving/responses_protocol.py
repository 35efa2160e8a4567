"""The request and response bodies of `POST /v1/responses` (OpenAI's Responses API, as vLLM serves
it). The request is read as strictly as the chat endpoint's (`protocol._Request`: unknown fields
are a 400 naming them); the fields a Responses client may send that this server does not
implement are typed loosely here and refused by name, with the reason, in `responses.py`.
Output items and the response are our own models (the `openai` package is a test dependency
only), in the shapes of `openai.types.responses`."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, Discriminator, Field, Tag

from serving.protocol import StructuredOutputsRequest, _NoOp, _Request

Status = Literal["in_progress", "completed", "incomplete"]


# ----------------------------------------------------------------------------- input items
class InputText(_Request):
    """A text part: the client's (`input_text`) or an earlier answer's sent back
    (`output_text`, whose annotations and logprobs describe that answer and are not read)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: Optional[list[Any]] = None
    logprobs: Optional[list[Any]] = None


def _text(content: Union[str, list[InputText]]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class MessageItem(_Request):
    """A message; `type` may be left out (OpenAI's EasyInputMessage). An earlier answer sent back
    carries its id, status and phase."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[InputText]]
    id: Optional[str] = None
    status: Optional[Status] = None
    phase: Optional[Literal["commentary", "final_answer"]] = None

    def text(self) -> str:
        return _text(self.content)


# Fields of a replayed call that name what this server never makes: null only.
_CALL_UNIMPLEMENTED = {"namespace": _NoOp(), "caller": _NoOp(), "async": _NoOp()}


class FunctionCallItem(_Request):
    """An earlier answer's call of one of the client's functions."""

    unimplemented = _CALL_UNIMPLEMENTED

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: Optional[str] = None
    status: Optional[Status] = None


class FunctionCallOutputItem(_Request):
    """The client's result of a call, for the model's next turn."""

    unimplemented = {**_CALL_UNIMPLEMENTED, "name": _NoOp()}

    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[InputText]]
    id: Optional[str] = None
    status: Optional[Status] = None

    def text(self) -> str:
        return _text(self.output)


class SummaryText(_Request):
    type: Literal["summary_text"]
    text: str


class ReasoningText(_Request):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Request):
    """An earlier answer's reasoning sent back; it goes to the template as the assistant's
    `reasoning` (vLLM's rule). `encrypted_content` is typed loosely: refused in responses.py."""

    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: Optional[list[ReasoningText]] = None
    encrypted_content: Optional[Any] = None
    status: Optional[Status] = None

    def text(self) -> str:
        parts = self.content or self.summary
        return parts[0].text if parts else ""


def _item_type(v) -> Optional[str]:
    """An item's kind by its `type` (a message may leave it out), so that an error names the
    field of the kind the client meant, not every kind's."""
    if isinstance(v, dict):
        return v.get("type", "message")
    return getattr(v, "type", None)


InputItem = Annotated[
    Union[
        Annotated[MessageItem, Tag("message")],
        Annotated[FunctionCallItem, Tag("function_call")],
        Annotated[FunctionCallOutputItem, Tag("function_call_output")],
        Annotated[ReasoningItem, Tag("reasoning")],
    ],
    Discriminator(_item_type),
]


# ----------------------------------------------------------------------------- settings
class FunctionTool(_Request):
    """A function tool in the Responses API's flat shape."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None  # forced calls are enforced whatever it says (as in chat)


class FunctionChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    """`text.format`: plain text, any JSON object, or JSON following `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class TextConfig(_Request):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None  # refused unless "medium" (responses.py)


class ReasoningConfig(_Request):
    # a chat-template variable, as vLLM passes it (templates that know it use it)
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None
    summary: Optional[str] = None  # refused unless "auto" (responses.py)
    generate_summary: Optional[str] = None  # its deprecated name


class StreamOptions(_Request):
    include_obfuscation: Optional[bool] = None  # refused when true (responses.py)


class ResponsesRequest(_Request):
    model: Optional[str] = None
    input: Union[list[InputItem], str]  # the list first: its errors are the ones worth naming
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Union[Literal["none", "auto", "required"], FunctionChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # vLLM without VLLM_ENABLE_RESPONSES_API_STORE keeps nothing: store true is taken as false
    store: Optional[bool] = None
    # Accepted and unused, as on the chat endpoint: they change no output.
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    metadata: Optional[dict[str, Any]] = None  # echoed in the response
    prompt_cache_key: Optional[str] = None
    # vLLM's extras on this endpoint, as on the chat endpoint
    top_k: Optional[int] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    logit_bias: Optional[dict[str, float]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: Optional[str] = None
    structured_outputs: Optional[StructuredOutputsRequest] = None
    # Typed loosely so that responses.py refuses them by name with the reason.
    previous_response_id: Optional[Any] = None
    background: Optional[Any] = None
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None
    max_tool_calls: Optional[Any] = None
    service_tier: Optional[Any] = None


# ----------------------------------------------------------------------------- output
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: Optional[list[dict]] = None  # include: ["message.output_text.logprobs"]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Status = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningContent(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """The think block's text (--reasoning-parser) in `content`; no summary is written
    (vLLM's shape)."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list = Field(default_factory=list)
    content: list[ReasoningContent] = Field(default_factory=list)
    status: Status = "completed"


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: Status = "completed"


OutputItem = Union[OutputReasoning, OutputMessage, OutputFunctionCall]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # output tokens inside the think block


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponsesResponse(BaseModel):
    """The response, with the request's settings echoed as they applied (vLLM's from_request:
    the sampling values and max_output_tokens the engine ran with)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    model: str
    status: Literal["in_progress", "completed", "incomplete", "cancelled"]
    incomplete_details: Optional[IncompleteDetails] = None
    error: None = None
    instructions: Optional[str] = None
    metadata: Optional[dict[str, Any]] = None
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    temperature: float
    top_p: float
    tool_choice: Any = "auto"
    tools: list[dict] = Field(default_factory=list)
    background: bool = False
    max_output_tokens: Optional[int] = None
    max_tool_calls: None = None
    previous_response_id: None = None
    reasoning: Optional[dict] = None
    service_tier: str = "auto"
    store: bool = False  # nothing is kept: a later previous_response_id cannot find it
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    top_logprobs: Optional[int] = None
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: Optional[ResponseUsage] = None
    user: Optional[str] = None
