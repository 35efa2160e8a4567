"""/v1/completions and /v1/chat/completions: one request -> its prompts (prompts.py) -> engine
jobs (generation.py) -> a stream of engine outputs -> each choice's chain of stages (choices.py:
text delta -> reasoning -> tool calls -> logprobs) -> SSE chunks or the final response. The
chains are chosen once per request (`prepare`); this module only assembles what they give."""

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
from paxengine.sampling_params import SamplingParams
from serving import beam_search, constraints, reasoning, request_params, tool_responses, tools
from serving.choices import ChatSetup, Piece, chat_chain, completion_chain
from serving.errors import ApiError, bad_request, internal_error, renamed
from serving.generation import (
    ClientDisconnected,
    Job,
    ServerState,
    abort_unfinished,
    log_delta,
    run_requests,
    start_jobs,
    until_disconnect,
)
from serving.logprobs import prompt_logprobs
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
    DeltaToolCall,
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


# ----------------------------------------------------------------------------- shared driver
class _Call:
    """One API call: its prompts, engine jobs, and how each choice's outputs become the
    response (`chain`)."""

    def __init__(
        self,
        state: ServerState,
        kind: str,
        req,
        prompts,
        params: SamplingParams,
        k: Optional[int],
        setup: Optional[ChatSetup] = None,
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
        self.jobs = [
            Job(f"{self.id}-{i}", ids, params, prompt=text or None)
            for i, (text, ids) in enumerate(prompts)
        ]
        self.n = params.n
        self.setup = setup  # a chat's stages (None for completions)
        self.as_ids = request_params.tokens_as_ids(
            state, req
        )  # logprobs' tokens as "token_id:<id>"
        self.ids_on = bool(req.return_token_ids)  # the responses carry the token ids too

    def index(self, prompt_i: int, out_i: int) -> int:
        return prompt_i * self.n + out_i

    def chain(self, prompt_i: int):
        """A new chain of stages for one choice of prompt prompt_i."""
        if self.kind == "chat":
            return chat_chain(self.state, self.setup)
        return completion_chain(
            self.state, self.prompts[prompt_i], bool(self.req.echo), self.k, self.as_ids
        )

    def usage_so_far(self, prompt_i: int, tokens: int) -> Usage:
        """A chunk's usage (vLLM's continuous_usage_stats): its prompt's tokens and its
        choice's tokens so far."""
        p = len(self.prompts[prompt_i][1])
        return Usage(prompt_tokens=p, completion_tokens=tokens, total_tokens=p + tokens)

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
    try:
        return await _prepare(state, kind, req)
    except ApiError as e:
        if kind != "chat":
            raise
        # the engine's names of a chat's prompt and budget: the request's own fields
        budget = "max_completion_tokens" in req.model_fields_set
        names = {
            "prompt": "messages",
            **({"max_tokens": "max_completion_tokens"} if budget else {}),
        }
        raise renamed(e, names) from None


async def _prepare(state: ServerState, kind: str, req) -> _Call:
    state.check_model(req.model)
    beam_search.check_request(req, kind)  # use_beam_search: what it refuses, first
    if req.stream_options is not None and req.stream_options.model_fields_set and not req.stream:
        # vLLM's rule too: the options would change nothing (null or {} ask for nothing)
        raise bad_request("stream_options: only with stream true", "stream_options")
    mode, spec, setup = None, constraints.constraint(req), None
    cfg = state.config
    if kind == "chat":
        request_params.check_top_logprobs(req)
        mode = constraints.tool_mode(req, cfg.enable_auto_tool_choice)
        if mode is not None and spec is not None:
            raise bad_request(
                "response_format: an output constraint cannot be combined with tools "
                "(tool_choice auto, required or a function); set tool_choice to none",
                "response_format",
            )
        tool_defs = [t.model_dump(exclude_none=True) for t in req.tools] if mode else None
        # vLLM's: a new turn's role is --response-role's; without one the answer goes on in the
        # last message's role
        role = cfg.response_role if req.add_generation_prompt else req.messages[-1].role
        size = sum(len(m.text()) for m in req.messages)
        prompts = truncated(state, req, [await _off_loop(size, chat_prompt, state, req, tool_defs)])
        parser = cfg.reasoning_parser
        prompt_state = reasoning.prompt_block(prompts[0][0], parser) if parser else None
        k = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        if max_tokens is None:
            max_tokens = request_params.default_max_tokens(
                state, state.max_model_len - len(prompts[0][1])
            )
        setup = ChatSetup(
            k=k,
            as_ids=request_params.tokens_as_ids(state, req),
            tool_mode=mode,
            tool_format=tool_responses.call_format_of(state.tokenizer, cfg.tool_call_parser),
            tool_defs=tool_defs,
            parallel=req.parallel_tool_calls is not False,
            reasoning_parser=cfg.reasoning_parser,
            prompt_state=prompt_state,
            include_reasoning=req.include_reasoning,
            role=role,
            echo=request_params.echo_text(req, role),
        )
    else:
        p = req.prompt
        size = len(p) if isinstance(p, str) else sum(len(x) for x in p if isinstance(x, str))
        prompts = truncated(state, req, await _off_loop(size, completion_prompts, state, req))
        k, max_tokens = req.logprobs, req.max_tokens
        room = state.max_model_len - max(len(ids) for _, ids in prompts)
        if "max_tokens" not in req.model_fields_set:  # the default 16, or the model's fewer
            max_tokens = request_params.default_max_tokens(state, 1 << 62, max_tokens)
        elif max_tokens is None:
            max_tokens = request_params.default_max_tokens(state, room)
    params = request_params.sampling_params(state, req, max_tokens, k, spec)
    request_params.check_logprobs_cap(state, kind, params)
    if setup is not None and setup.special_tokens:
        params.skip_special_tokens = False  # the parser's markers are special tokens
    if kind == "chat" and mode not in (None, "auto"):  # a forced call: its grammar
        parallel = req.parallel_tool_calls is not False
        params.structured_outputs = tools.forced_constraint(tool_defs, mode, parallel)
    request_params.set_think_tags(state, req, params, prompts[0][0])
    if params.structured_outputs is not None:
        # compiles the grammar (cached by its text) off the event loop: a bad one is a 400 here
        try:
            await asyncio.to_thread(state.engine.validate, prompts[0][1], params)
        except InvalidRequest as e:
            forced = kind == "chat" and mode not in (None, "auto")
            raise state.api_error(constraints.named(req, e, forced)) from None
    if req.request_id is not None and not usable_request_id(req.request_id):
        raise bad_request(
            "request_id: at most 128 characters of letters, digits and ._:/+=@-",
            "request_id",
        )
    call = _Call(state, kind, req, prompts, params, k, setup)
    if req.use_beam_search:  # each prompt's job is its search (serving/beam_search.py)
        beam_search.start_jobs(state, call.jobs, req.length_penalty)
    else:  # the engine validates and admits: refusals are 4xx/503 here
        start_jobs(state, call.jobs)
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


# ----------------------------------------------------------------------------- pieces -> response
def _merged_calls(deltas: list[DeltaToolCall]) -> list[ResponseToolCall]:
    """A finished choice's tool-call deltas (a call whole, or its name then argument pieces)
    as the message's calls."""
    calls: dict[int, ResponseToolCall] = {}
    for d in deltas:
        f = d.function
        if d.index not in calls:
            calls[d.index] = ResponseToolCall(
                id=d.id or tools.Call("", "").id,
                function=ResponseFunctionCall(name=f.name or "", arguments=f.arguments or ""),
            )
        elif f is not None and f.arguments:
            calls[d.index].function.arguments += f.arguments
    return [calls[i] for i in sorted(calls)]


def _chat_message(setup: ChatSetup, p: Piece) -> ChatResponseMessage:
    content: Optional[str] = p.text
    if setup.tool_mode == "auto":
        content = content.strip() or None  # the text around calls, as parse_tool_calls gives it
    elif not setup.plain:
        content = content or None
    if setup.echo is not None:  # vLLM's: before whatever content the choice has
        content = setup.echo + (content or "")
    return ChatResponseMessage(
        role=setup.role,
        content=content,
        reasoning=(p.reasoning or None) if setup.reasoning_parser else None,
        tool_calls=_merged_calls(p.tool_calls),
    )


def _delta_message(setup: ChatSetup, p: Piece) -> DeltaMessage:
    return DeltaMessage(
        content=p.text if setup.plain else (p.text or None),
        reasoning=p.reasoning or None,
        tool_calls=p.tool_calls or None,
    )


def _final_response(call: _Call, finals: dict):
    state, choices = call.state, []
    for pi, (_, pids) in enumerate(call.prompts):
        for o in finals[pi].outputs:
            idx = call.index(pi, o.index)
            p = call.chain(pi).run(o, finals[pi].prompt_logprobs)  # finished: one piece
            if call.kind == "chat":
                choices.append(
                    ChatChoice(
                        index=idx,
                        message=_chat_message(call.setup, p),
                        logprobs=p.logprobs,
                        finish_reason=p.finish,
                        stop_reason=o.stop_reason,
                        token_ids=list(o.token_ids) if call.ids_on else None,
                    )
                )
            else:
                choices.append(
                    CompletionChoice(
                        index=idx,
                        text=p.text,
                        logprobs=p.logprobs,
                        finish_reason=p.finish,
                        stop_reason=o.stop_reason,
                        prompt_token_ids=list(pids) if call.ids_on else None,
                        token_ids=list(o.token_ids) if call.ids_on else None,
                        prompt_logprobs=prompt_logprobs(finals[pi].prompt_logprobs),
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
            prompt_logprobs=prompt_logprobs(finals[0].prompt_logprobs),
        )
    return CompletionResponse(id=call.id, model=state.model_name, choices=choices, usage=usage)


def _call_text(message: DeltaMessage) -> str:
    """A delta's tool-call arguments (vLLM logs them as the delta's text)."""
    return "".join(t.function.arguments or "" for t in message.tool_calls or [] if t.function)


async def _stream(call: _Call) -> AsyncIterator[str]:
    state, req, chat = call.state, call.req, call.kind == "chat"
    so = req.stream_options
    # --enable-force-include-usage (vLLM's): usage in every stream, in every chunk too
    force = state.config.enable_force_include_usage
    usage_on = force or bool(so and so.include_usage)
    # vLLM's continuous_usage_stats: usage in every chunk too, only with include_usage
    each_on = force or (usage_on and bool(so.continuous_usage_stats))
    cfg = state.config  # --enable-log-deltas (vLLM's default on) under --enable-log-outputs
    log_deltas = cfg.enable_log_outputs and cfg.enable_log_deltas is not False
    chains: dict[int, object] = {}
    sent_ids: dict[int, int] = {}  # return_token_ids: the output's token ids sent so far
    plp_sent: set[int] = set()  # a chat's prompts whose prompt logprobs went
    finals: dict = {}

    def chunk(choices, usage=None, prompt_ids=None, plp=None):
        if chat:
            return sse(
                ChatCompletionChunk(
                    id=call.id,
                    model=state.model_name,
                    choices=choices,
                    usage=usage,
                    prompt_token_ids=prompt_ids,
                    prompt_logprobs=plp,
                )
            )
        return sse(
            CompletionResponse(id=call.id, model=state.model_name, choices=choices, usage=usage)
        )

    try:
        if chat:  # the role comes first, once per choice, then echo's text (vLLM's order)
            setup, start = call.setup, call.usage_so_far(0, 0) if each_on else None
            for idx in range(len(call.prompts) * call.n):
                yield chunk(
                    [ChatStreamChoice(index=idx, delta=DeltaMessage(role=setup.role, content=""))],
                    usage=start,
                    prompt_ids=list(call.prompts[0][1]) if call.ids_on and idx == 0 else None,
                )
            for idx in range(call.n if setup.echo else 0):
                yield chunk(
                    [ChatStreamChoice(index=idx, delta=DeltaMessage(content=setup.echo))],
                    usage=start,
                )
        async with aclosing(run_requests(state, call.jobs)) as it:
            async for pi, out in it:
                finals[pi] = out
                for o in out.outputs:
                    idx = call.index(pi, o.index)
                    if idx not in chains:
                        chains[idx] = call.chain(pi)
                    p = chains[idx].run(o, out.prompt_logprobs)
                    if p is None:
                        continue
                    # the prompt's logprobs: with a completion choice's first chunk; a chat's
                    # (one prompt) with the first chunk sent after they came
                    plp = None
                    if out.prompt_logprobs is not None and (chat or p.first) and pi not in plp_sent:
                        plp = prompt_logprobs(out.prompt_logprobs)
                    if chat:
                        message = _delta_message(call.setup, p)
                        if p.finish is None and call.k is None and not message.model_dump():
                            if plp is None:  # held back (a tag or a call not yet whole)
                                continue
                        c = ChatStreamChoice(
                            index=idx,
                            delta=message,
                            logprobs=p.logprobs,
                            finish_reason=p.finish,
                            stop_reason=o.stop_reason,
                        )
                    else:
                        c = CompletionChoice(
                            index=idx,
                            text=p.text,
                            logprobs=p.logprobs,
                            finish_reason=p.finish,
                            stop_reason=o.stop_reason,
                            prompt_logprobs=plp,
                        )
                    if chat and plp is not None:
                        plp_sent.add(pi)
                    if call.ids_on:
                        c.token_ids = list(o.token_ids[sent_ids.get(idx, 0) :])
                        sent_ids[idx] = len(o.token_ids)
                        if not chat and p.first:
                            c.prompt_token_ids = list(call.prompts[pi][1])
                    so_far = call.usage_so_far(pi, len(o.token_ids)) if each_on else None
                    if log_deltas:
                        text = (message.content or _call_text(message)) if chat else p.text
                        log_delta(cfg, call.jobs[pi].request_id, o.index, call.n, text)
                    yield chunk([c], usage=so_far, plp=plp if chat else None)
        if usage_on:
            yield chunk([], usage=call.usage(finals))
    except ApiError as e:
        yield sse(e.body())
    except Exception as e:  # the stream has started: report in-band, keep the server alive
        yield sse(internal_error(e, getattr(call, "request", None)).body())
    yield "data: [DONE]\n\n"
