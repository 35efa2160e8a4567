"""/v1/completions and /v1/chat/completions: request -> engine jobs -> response or SSE stream."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from contextlib import aclosing
from typing import AsyncIterator, Optional

import anyio
from fastapi import Request
from fastapi.responses import Response
from starlette.responses import StreamingResponse

from paxengine.errors import InvalidRequest
from paxengine.sampling_params import MAX_LOGPROBS, SamplingParams
from paxengine.structured import StructuredOutputs
from serving import constraints, tool_responses, tools
from serving.errors import ApiError, bad_request, internal_error
from serving.generation import (
    ClientDisconnected,
    Job,
    ServerState,
    abort_unfinished,
    run_requests,
    start_jobs,
    until_disconnect,
)
from serving.logprobs import chat_logprobs, completion_logprobs
from serving.prompts import chat_prompt, completion_prompts, truncated
from serving.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    ResponseFunctionCall,
    ResponseToolCall,
    Usage,
)
from serving.request_ids import usable_request_id

log = logging.getLogger("serving")


class SSEResponse(StreamingResponse):
    """StreamingResponse that always listens for the client going away (whatever ASGI spec version
    the server reports), so a dropped stream cancels its generator at once; `on_close` runs
    however the response ends, also when the generator never started."""

    def __init__(self, content, on_close, **kw):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            **kw,
        )
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            async with anyio.create_task_group() as tg:

                async def stream():
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.on_close()


def sse(obj) -> str:
    data = obj.model_dump_json() if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


# ----------------------------------------------------------------------------- request -> params
def sampling_params(
    state: ServerState,
    req,
    max_tokens: Optional[int],
    logprobs: Optional[int],
    structured_outputs: Optional[StructuredOutputs] = None,
) -> SamplingParams:
    """The request's fields as SamplingParams; their values are checked by the engine.
    structured_outputs: the request's constraint (constraints.constraint)."""
    bias = {}
    for k, v in (req.logit_bias or {}).items():
        try:
            bias[int(k)] = v
        except ValueError:
            raise bad_request(f"logit_bias: key {k!r} is not a token id", "logit_bias") from None
    opt = lambda v, d: d if v is None else v  # noqa: E731
    return SamplingParams(
        n=req.n,
        temperature=opt(req.temperature, 1.0),
        top_p=opt(req.top_p, 1.0),
        # top_k beyond the vocabulary means "all tokens": clamp (the engine packs it into int32)
        top_k=min(opt(req.top_k, -1), state.vocab_size),
        min_p=opt(req.min_p, 0.0),
        presence_penalty=opt(req.presence_penalty, 0.0),
        frequency_penalty=opt(req.frequency_penalty, 0.0),
        repetition_penalty=opt(req.repetition_penalty, 1.0),
        seed=req.seed,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        include_stop_str_in_output=req.include_stop_str_in_output,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        logit_bias=bias,
        skip_special_tokens=req.skip_special_tokens,
        priority=req.priority,
        structured_outputs=structured_outputs,
        allowed_token_ids=req.allowed_token_ids,
        cache_salt=req.cache_salt,
    )


# ----------------------------------------------------------------------------- shared driver
class _Call:
    """One API call: its prompts, engine jobs, and what has been sent so far (for deltas)."""

    def __init__(
        self,
        state: ServerState,
        kind: str,
        req,
        prompts,
        params: SamplingParams,
        k: Optional[int],
        tools: Optional[str] = None,
    ):
        self.state, self.kind, self.req, self.prompts, self.params, self.k = (
            state,
            kind,
            req,
            prompts,
            params,
            k,
        )
        # vLLM's request_id: the client's (checked in prepare) names the call and its jobs
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{req.request_id or uuid.uuid4().hex}"
        self.jobs = [Job(f"{self.id}-{i}", ids, params) for i, (_, ids) in enumerate(prompts)]
        self.n = params.n
        self.tools = tools  # the tool-call mode (constraints.tool_mode), None without tools
        self.as_ids = bool(req.return_tokens_as_token_ids)  # logprobs' tokens as "token_id:<id>"
        self.ids_on = bool(req.return_token_ids)  # the responses carry the token ids too

    def index(self, prompt_i: int, out_i: int) -> int:
        return prompt_i * self.n + out_i

    def usage(self, finals: dict) -> Usage:
        p = sum(len(ids) for _, ids in self.prompts)
        c = sum(len(o.token_ids) for out in finals.values() for o in out.outputs)
        cached = sum(out.num_cached_tokens or 0 for out in finals.values())
        return Usage(
            prompt_tokens=p,
            completion_tokens=c,
            total_tokens=p + c,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


async def _off_loop(size: int, fn, *args):
    """Tokenize long texts in a worker thread so one huge prompt does not stall every stream."""
    if size > 16384:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def prepare(state: ServerState, kind: str, req) -> _Call:
    state.check_model(req.model)
    mode, spec = None, constraints.constraint(req)
    if kind == "chat":
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(
                    f"top_logprobs: must be an integer in [0, {MAX_LOGPROBS}], "
                    f"got {req.top_logprobs}",
                    "top_logprobs",
                )
        mode = constraints.tool_mode(req)
        if mode is not None and spec is not None:
            raise bad_request(
                "response_format: an output constraint cannot be combined with tools "
                "(tool_choice auto, required or a function); set tool_choice to none",
                "response_format",
            )
        tool_defs = [t.model_dump(exclude_none=True) for t in req.tools] if mode else None
        size = sum(len(m.text()) for m in req.messages)
        prompts = truncated(state, req, [await _off_loop(size, chat_prompt, state, req, tool_defs)])
        k = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        if max_tokens is None:
            max_tokens = max(1, state.max_model_len - len(prompts[0][1]))
    else:
        p = req.prompt
        size = len(p) if isinstance(p, str) else sum(len(x) for x in p if isinstance(x, str))
        prompts = truncated(state, req, await _off_loop(size, completion_prompts, state, req))
        k, max_tokens = req.logprobs, req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, state.max_model_len - max(len(ids) for _, ids in prompts))
    params = sampling_params(state, req, max_tokens, k, spec)
    if kind == "chat" and mode not in (None, "auto"):  # a forced call: its grammar
        parallel = req.parallel_tool_calls is not False
        params.structured_outputs = tools.forced_constraint(tool_defs, mode, parallel)
    if params.structured_outputs is not None:
        # compiles the grammar (cached by its text) off the event loop: a bad one is a 400 here
        try:
            await asyncio.to_thread(state.engine.validate, prompts[0][1], params)
        except InvalidRequest as e:
            raise state.api_error(e) from None
    if req.request_id is not None and not usable_request_id(req.request_id):
        raise bad_request(
            "request_id: at most 128 characters of letters, digits and ._:/+=@-",
            "request_id",
        )
    call = _Call(state, kind, req, prompts, params, k, mode)
    start_jobs(state, call.jobs)  # the engine validates and admits: refusals are 4xx/503 here
    return call


async def respond(state: ServerState, kind: str, request: Request, req) -> Response:
    call = await prepare(state, kind, req)
    call.request = request  # for the log line of an error in its stream
    # one line a request, without its text (X-Request-Id ties it to the client's and proxy's logs)
    log.info(
        "%s x-request-id=%s prompts=%d n=%d max_tokens=%s stream=%s",
        call.id,
        getattr(request.state, "request_id", None),
        len(call.prompts),
        call.n,
        call.params.max_tokens,
        bool(req.stream),
    )
    close = lambda: abort_unfinished(state, call.jobs)  # noqa: E731
    if req.stream:
        return SSEResponse(_stream(call), on_close=close)

    async def collect():
        finals = {}
        async with aclosing(run_requests(state, call.jobs)) as it:
            async for i, out in it:
                finals[i] = out
        return finals

    try:
        finals = await until_disconnect(request, collect())
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        close()
    return Response(_final_response(call, finals).model_dump_json(), media_type="application/json")


def _final_response(call: _Call, finals: dict):
    state, choices = call.state, []
    for pi, (ptext, pids) in enumerate(call.prompts):
        for o in finals[pi].outputs:
            idx = call.index(pi, o.index)
            if call.kind == "chat":
                lp = chat_logprobs(state, o, 0, call.k, call.as_ids) if call.k is not None else None
                content, calls, finish = tool_responses.finished_calls(
                    call.tools,
                    o.text,
                    o.finish_reason,
                    call.req.parallel_tool_calls is not False,
                    tool_responses.call_format_of(state.tokenizer),
                )
                choices.append(
                    ChatChoice(
                        index=idx,
                        message=ChatResponseMessage(
                            content=content,
                            tool_calls=[
                                ResponseToolCall(
                                    id=c.id,
                                    function=ResponseFunctionCall(
                                        name=c.name, arguments=c.arguments
                                    ),
                                )
                                for c in calls
                            ],
                        ),
                        logprobs=lp,
                        finish_reason=finish,
                        stop_reason=o.stop_reason,
                        token_ids=list(o.token_ids) if call.ids_on else None,
                    )
                )
            else:
                echo = ptext if call.req.echo else ""
                lp = (
                    completion_logprobs(
                        state, o, 0, call.k, 0, pids if call.req.echo else None, call.as_ids
                    )
                    if call.k is not None
                    else None
                )
                choices.append(
                    CompletionChoice(
                        index=idx,
                        text=echo + o.text,
                        logprobs=lp,
                        finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason,
                        prompt_token_ids=list(pids) if call.ids_on else None,
                        token_ids=list(o.token_ids) if call.ids_on else None,
                    )
                )
    choices.sort(key=lambda c: c.index)
    usage = call.usage(finals)
    if call.kind == "chat":
        prompt_ids = list(call.prompts[0][1]) if call.ids_on else None
        return ChatCompletionResponse(
            id=call.id,
            model=state.model_name,
            choices=choices,
            usage=usage,
            prompt_token_ids=prompt_ids,
        )
    return CompletionResponse(id=call.id, model=state.model_name, choices=choices, usage=usage)


async def _stream(call: _Call) -> AsyncIterator[str]:
    state, req, chat = call.state, call.req, call.kind == "chat"
    usage_on = bool(req.stream_options and req.stream_options.include_usage)
    sent_text: dict[int, int] = {}
    sent_tok: dict[int, int] = {}
    sent_ids: dict[int, int] = {}  # return_token_ids: the output's token ids sent so far
    tool_deltas: dict[int, tool_responses.ToolDeltas] = {}
    done: set[int] = set()
    finals: dict = {}

    def chunk(choices, usage=None, prompt_ids=None):
        if chat:
            return sse(
                ChatCompletionChunk(
                    id=call.id,
                    model=state.model_name,
                    choices=choices,
                    usage=usage,
                    prompt_token_ids=prompt_ids,
                )
            )
        return sse(
            CompletionResponse(id=call.id, model=state.model_name, choices=choices, usage=usage)
        )

    try:
        if chat:  # the role comes first, once per choice
            for idx in range(len(call.prompts) * call.n):
                yield chunk(
                    [ChatStreamChoice(index=idx, delta=DeltaMessage(role="assistant", content=""))],
                    prompt_ids=list(call.prompts[0][1]) if call.ids_on and idx == 0 else None,
                )
        async with aclosing(run_requests(state, call.jobs)) as it:
            async for pi, out in it:
                finals[pi] = out
                for o in out.outputs:
                    idx = call.index(pi, o.index)
                    if idx in done:
                        continue
                    t0, n0 = sent_text.get(idx, 0), sent_tok.get(idx, 0)
                    delta, finish = o.text[t0:], o.finish_reason
                    new_tokens = len(o.token_ids) > n0
                    first = idx not in sent_text
                    if not (
                        delta
                        or finish
                        or (call.k is not None and new_tokens)
                        or (first and not chat and req.echo)
                    ):
                        continue
                    sent_text[idx], sent_tok[idx] = len(o.text), len(o.token_ids)
                    if finish is not None:
                        done.add(idx)
                    if chat:
                        lp = (
                            chat_logprobs(state, o, n0, call.k, call.as_ids)
                            if call.k is not None
                            else None
                        )
                        message = DeltaMessage(content=delta)
                        if call.tools is not None:
                            td = tool_deltas.setdefault(
                                idx,
                                tool_responses.ToolDeltas(
                                    call.tools,
                                    call.req.parallel_tool_calls is not False,
                                    tool_responses.call_format_of(state.tokenizer),
                                ),
                            )
                            message, finish = td.step(delta, finish)
                            if finish is None and call.k is None and not message.model_dump():
                                continue  # held back (a call not yet complete): nothing to send
                        c = ChatStreamChoice(
                            index=idx,
                            delta=message,
                            logprobs=lp,
                            finish_reason=finish,
                            stop_reason=o.stop_reason,
                        )
                    else:
                        ptext, pids = call.prompts[pi]
                        echo = first and req.echo
                        lp = (
                            completion_logprobs(
                                state,
                                o,
                                n0,
                                call.k,
                                t0 + (len(ptext) if req.echo and not first else 0),
                                pids if echo else None,
                                call.as_ids,
                            )
                            if call.k is not None
                            else None
                        )
                        c = CompletionChoice(
                            index=idx,
                            text=(ptext if echo else "") + delta,
                            logprobs=lp,
                            finish_reason=finish,
                            stop_reason=o.stop_reason,
                        )
                    if call.ids_on:
                        c.token_ids = list(o.token_ids[sent_ids.get(idx, 0) :])
                        sent_ids[idx] = len(o.token_ids)
                        if not chat and first:
                            c.prompt_token_ids = list(call.prompts[pi][1])
                    yield chunk([c])
        if usage_on:
            yield chunk([], usage=call.usage(finals))
    except ApiError as e:
        yield sse(e.body())
    except Exception as e:  # the stream has started: report in-band, keep the server alive
        yield sse(internal_error(e, getattr(call, "request", None)).body())
    yield "data: [DONE]\n\n"
