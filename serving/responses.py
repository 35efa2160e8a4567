"""`POST /v1/responses`: OpenAI's Responses API as vLLM serves it, on the chat endpoint's
machinery. A request becomes the chat completion it means (`chat_request`: instructions and input
items as messages, flat function tools as chat tools, `text.format` as `response_format`, ...),
which `openai_api.prepare` turns into its prompt, sampling params, stages (reasoning parser, tool
calls) and engine job as for /v1/chat/completions; the choice's pieces become output items and
stream events (`responses_items.OutputItems`).

Refused by name (`_refuse`), with the reason: `previous_response_id`, `background`, `conversation`
(this server keeps no responses: vLLM without VLLM_ENABLE_RESPONSES_API_STORE, whose
`previous_response_id` finds nothing), `prompt` (stored prompt templates, refused by vLLM too),
`max_tool_calls` (built-in tool loops: none here), hosted tools (a tool's `type` other than
function), `include` values other than output logprobs and reasoning.encrypted_content (the
reasoning comes in clear in the item's `content`, which a client sends back), reasoning summaries
other than "auto" (none is written), `service_tier` other than auto/default. `store: true` is
taken as false, as vLLM does without its store."""

from __future__ import annotations

import json
import logging
import uuid
from contextlib import aclosing
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from serving import reasoning
from serving.errors import ApiError, bad_request, internal_error, renamed, validation_error
from serving.generation import (
    ClientDisconnected,
    ServerState,
    abort_unfinished,
    run_requests,
    until_disconnect,
)
from serving.openai_api import SSEResponse, prepare
from serving.protocol import ChatCompletionRequest
from serving.responses_items import OutputItems
from serving.responses_protocol import (
    FunctionChoice,
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)

log = logging.getLogger("serving")

LOGPROBS = "message.output_text.logprobs"
# the reasoning comes in clear in the item's `content`, which a stateless client sends back
ENCRYPTED_REASONING = "reasoning.encrypted_content"
NO_STORE = "this server keeps no responses (as vLLM without VLLM_ENABLE_RESPONSES_API_STORE)"


# ----------------------------------------------------------------------------- request -> chat
def _refuse(req: ResponsesRequest) -> None:
    """The fields this server does not implement, each a 400 naming it."""
    refused = {
        "previous_response_id": (
            req.previous_response_id is not None,
            f"{NO_STORE}; send the conversation so far in `input`",
        ),
        "background": (req.background not in (None, False), f"{NO_STORE} to run in background"),
        "conversation": (req.conversation is not None, f"{NO_STORE} or conversations"),
        "prompt": (req.prompt is not None, "stored prompt templates are not supported"),
        "max_tool_calls": (
            req.max_tool_calls is not None,
            "there are no built-in tools whose calls it could limit",
        ),
        "service_tier": (
            req.service_tier not in (None, "auto", "default"),
            "there is one service tier",
        ),
    }
    r = req.reasoning
    summary = r and next((s for s in (r.summary, r.generate_summary) if s is not None), None)
    refused["reasoning.summary"] = (
        summary not in (None, "auto"),
        'no reasoning summary is written (the reasoning is the item\'s content); use "auto"',
    )
    verbosity = req.text.verbosity if req.text else None
    refused["text.verbosity"] = (verbosity not in (None, "medium"), 'only "medium", the default')
    so = req.stream_options
    refused["stream_options.include_obfuscation"] = (
        bool(so and so.include_obfuscation),
        "streams are not padded",
    )
    other = [i for i in req.include or [] if i not in (LOGPROBS, ENCRYPTED_REASONING)]
    refused["include"] = (bool(other), f"{other} cannot be included (only {LOGPROBS!r})")
    for i, item in enumerate(req.input if isinstance(req.input, list) else []):
        if item.type == "reasoning" and item.encrypted_content is not None:
            refused[f"input.{i}.encrypted_content"] = (
                True,
                "encrypted reasoning is not supported; send the reasoning item's content",
            )
    for name, (bad, why) in refused.items():
        if bad:
            raise bad_request(f"`{name}` is not supported by this server: {why}", name)
    if req.input == []:
        raise bad_request("input: give a string or at least one item", "input")
    if req.top_logprobs and LOGPROBS not in (req.include or []):
        raise bad_request(f"top_logprobs: requires include [{LOGPROBS!r}]", "top_logprobs")
    if req.structured_outputs is not None and req.text and req.text.format:
        if req.text.format.type != "text":
            raise bad_request("text.format: cannot be combined with structured_outputs", "text")


def _messages(req: ResponsesRequest) -> list[dict]:
    """instructions and input as chat messages (vLLM's construct_input_messages): an earlier
    answer's reasoning, text and calls merge into one assistant message; a call's output is a
    tool message."""
    msgs: list[dict] = []
    if req.instructions:
        msgs.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return msgs + [{"role": "user", "content": req.input}]
    for item in req.input:
        last = msgs[-1] if msgs and msgs[-1]["role"] == "assistant" else None
        if item.type == "message" and item.role != "assistant":
            msgs.append({"role": item.role, "content": item.text()})
        elif item.type == "message":
            if last is not None and last.get("content") is None:
                last["content"] = item.text()
            else:
                msgs.append({"role": "assistant", "content": item.text()})
        elif item.type == "function_call":
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "tool_calls": [call]})
        elif item.type == "function_call_output":
            msgs.append({"role": "tool", "content": item.text(), "tool_call_id": item.call_id})
        elif last is not None and last.get("reasoning") is None:  # reasoning
            last["reasoning"] = item.text()
        else:
            msgs.append({"role": "assistant", "reasoning": item.text()})
    return msgs


def _continues(req: ResponsesRequest) -> bool:
    """vLLM's: an unfinished assistant message last in the input is continued, not answered."""
    last = req.input[-1] if isinstance(req.input, list) and req.input else None
    return (
        last is not None
        and last.type == "message"
        and last.role == "assistant"
        and last.status in ("in_progress", "incomplete")
    )


def _response_format(req: ResponsesRequest) -> Optional[dict]:
    f = req.text.format if req.text else None
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return {"type": "json_object"}
    if f.name is None or f.schema_ is None:
        raise bad_request("text.format: type json_schema needs name and schema", "text.format")
    spec = {"name": f.name, "schema": f.schema_, "description": f.description, "strict": f.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


def chat_request(req: ResponsesRequest, rid: str) -> ChatCompletionRequest:
    """The chat completion a Responses request means (rid names its engine job)."""
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    include = req.include or []
    effort = req.reasoning.effort if req.reasoning else None
    cont = _continues(req)
    body = {
        "model": req.model,
        "messages": _messages(req),
        "max_completion_tokens": req.max_output_tokens,
        "tools": [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
            for t in req.tools
        ]
        or None,
        "tool_choice": choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req),
        "logprobs": LOGPROBS in include,
        "top_logprobs": req.top_logprobs if LOGPROBS in include else None,
        # vLLM's truncation "auto": the prompt's last max_model_len tokens
        "truncate_prompt_tokens": -1 if req.truncation == "auto" else None,
        # as vLLM passes reasoning.effort: a template variable
        "chat_template_kwargs": {"reasoning_effort": effort} if effort else None,
        "add_generation_prompt": not cont,
        "continue_final_message": cont,
        "request_id": rid,
        "structured_outputs": (
            req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            if req.structured_outputs
            else None
        ),
    }
    for name in (
        "temperature top_p top_k seed stop repetition_penalty ignore_eos logit_bias "
        "skip_special_tokens include_stop_str_in_output priority cache_salt user "
        "safety_identifier metadata prompt_cache_key"
    ).split():
        body[name] = getattr(req, name)
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )
    except ValidationError as e:  # whatever the Responses model let through
        raise validation_error(e.errors(include_url=False)) from None


# ----------------------------------------------------------------------------- the response
class _Answer:
    """One Responses call: its chat call (openai_api._Call) and what the response echoes."""

    def __init__(self, state: ServerState, req: ResponsesRequest, call, rid: str):
        self.state, self.req, self.call, self.id = state, req, call, f"resp_{rid}"
        self.items = OutputItems(call.setup.tool_mode == "auto", call.setup.k is not None)
        self.chain = call.chain(0)
        self.final = None  # the last RequestOutput

    def feed(self, out) -> list[dict]:
        self.final = out
        p = self.chain.run(out.outputs[0], out.prompt_logprobs)
        return [] if p is None else self.items.feed(p)

    def response(self, done: bool) -> ResponsesResponse:
        req, params = self.req, self.call.params
        status, usage = "in_progress", None
        if done:
            o = self.final.outputs[0]
            status = {"length": "incomplete", "abort": "cancelled"}.get(
                o.finish_reason, "completed"
            )
            usage = self._usage()
        return ResponsesResponse(
            id=self.id,
            model=self.state.model_name,
            status=status,
            incomplete_details=IncompleteDetails() if status == "incomplete" else None,
            instructions=req.instructions,
            metadata=req.metadata,
            output=list(self.items.items) if done else [],
            parallel_tool_calls=req.parallel_tool_calls is not False,
            temperature=params.temperature,
            top_p=params.top_p,
            tool_choice=(
                req.tool_choice.model_dump()
                if isinstance(req.tool_choice, FunctionChoice)
                else req.tool_choice or "auto"
            ),
            tools=[t.model_dump(exclude_none=True) for t in req.tools],
            max_output_tokens=params.max_tokens,
            reasoning=req.reasoning.model_dump() if req.reasoning else None,
            service_tier=req.service_tier or "auto",
            text=(
                req.text.model_dump(by_alias=True, exclude_none=True)
                if req.text
                else {"format": {"type": "text"}}
            ),
            top_logprobs=req.top_logprobs,
            truncation=req.truncation or "disabled",
            usage=usage,
            user=req.user,
        )

    def _usage(self) -> ResponseUsage:
        u = self.call.usage({0: self.final})
        thinking = 0
        parser = self.call.setup.reasoning_parser
        if parser and any(i.type == "reasoning" for i in self.items.items):
            o, skip = self.final.outputs[0], self.call.params.skip_special_tokens
            thinking = reasoning.reasoning_tokens(self.state.tokenizer, o.token_ids, parser, skip)
        return ResponseUsage(
            input_tokens=u.prompt_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=u.prompt_tokens_details.cached_tokens
            ),
            output_tokens=u.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=thinking),
            total_tokens=u.total_tokens,
        )


def _json(obj) -> str:
    return json.dumps(obj, default=lambda m: m.model_dump(mode="json"), ensure_ascii=False)


# the chat request's fields (prepare's errors name them) -> the Responses request's
_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format.json_schema.schema": "text.format.schema",
    "response_format": "text.format",
    "logprobs": "include",
    "truncate_prompt_tokens": "truncation",
    "chat_template_kwargs": "reasoning.effort",
}


async def respond(state: ServerState, request: Request, req: ResponsesRequest) -> Response:
    _refuse(req)
    rid = uuid.uuid4().hex
    try:
        call = await prepare(state, "chat", chat_request(req, rid))
    except ApiError as e:
        raise renamed(e, _NAMES) from None
    answer = _Answer(state, req, call, rid)
    log.info(
        "%s x-request-id=%s max_tokens=%s stream=%s",
        answer.id,
        getattr(request.state, "request_id", None),
        call.params.max_tokens,
        req.stream,
    )
    close = lambda: abort_unfinished(state, call.jobs)  # noqa: E731
    if req.stream:
        return SSEResponse(_stream(answer, request), on_close=close)

    async def collect():
        async with aclosing(run_requests(state, call.jobs)) as it:
            async for _, out in it:
                answer.final = out
        answer.feed(answer.final)  # finished: one piece
        answer.items.close()

    try:
        await until_disconnect(request, collect())
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        close()
    return Response(answer.response(done=True).model_dump_json(), media_type="application/json")


async def _stream(answer: _Answer, request: Request) -> AsyncIterator[str]:
    """The events, each with its sequence number, as `event: TYPE` / `data: JSON` (vLLM's SSE;
    no [DONE]). The last is response.completed whatever the status (vLLM's), or an error."""
    seq = 0

    def sse(event: dict) -> str:
        nonlocal seq
        event["sequence_number"], seq = seq, seq + 1
        return f"event: {event['type']}\ndata: {_json(event)}\n\n"

    start = answer.response(done=False)
    yield sse({"type": "response.created", "response": start})
    yield sse({"type": "response.in_progress", "response": start})
    try:
        async with aclosing(run_requests(answer.state, answer.call.jobs)) as it:
            async for _, out in it:
                for event in answer.feed(out):
                    yield sse(event)
        for event in answer.items.close():
            yield sse(event)
        yield sse({"type": "response.completed", "response": answer.response(done=True)})
    except Exception as e:  # the stream has started: report in-band, keep the server alive
        err = e if isinstance(e, ApiError) else internal_error(e, request)
        yield sse(
            {"type": "error", "code": str(err.code), "message": err.message, "param": err.param}
        )
