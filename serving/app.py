"""The FastAPI app: `build_app(engine, server_config)` around any `paxengine.EngineClient`.

The app's lifespan starts the engine (`await engine.start()`) and shuts it down on exit.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from paxengine.client import EngineClient, served_names
from paxengine.errors import EngineError
from serving import frontend_flags
from serving.config import ServerConfig
from serving.errors import (
    ApiError,
    bad_request,
    install_error_handlers,
    parse_body,
    read_json_object,
    validate_body,
)
from serving.generation import ServerState
from serving.metrics import CONTENT_TYPE
from serving.openai_api import respond
from serving.prompts import chat_prompt
from serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    schema_of,
)
from serving.request_ids import RequestIdMiddleware
from serving.responses import respond as respond_responses
from serving.responses_protocol import ResponsesRequest

log = logging.getLogger("serving")


def _version() -> str:
    import paxengine

    return paxengine.__version__


def build_app(
    engine: EngineClient,
    server_config: Optional[ServerConfig] = None,
    *,
    manage_engine: bool = True,
) -> FastAPI:
    """An OpenAI-compatible app around `engine`. With `manage_engine` the app's lifespan calls
    `engine.start()` and `engine.shutdown()`."""
    cfg = server_config or ServerConfig()
    state = ServerState.create(engine, cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_engine:
            await engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await engine.shutdown()

    # vLLM's --disable-fastapi-docs
    no_docs = dict(openapi_url=None, docs_url=None, redoc_url=None)
    docs = no_docs if cfg.disable_fastapi_docs else {}
    app = FastAPI(
        title="paxengine OpenAI-compatible server", version=_version(), lifespan=lifespan, **docs
    )
    # vLLM's --root-path, set as vLLM sets it (behind a proxy routing a path prefix here): the
    # OpenAPI servers name it, requests are routed with the prefix or without
    app.root_path = cfg.root_path or ""
    app.state.serving = state
    if cfg.h11_max_header_count is not None:  # vLLM's --h11-max-header-count: a 431 past it
        app.add_middleware(frontend_flags.HeaderCountLimit, limit=cfg.h11_max_header_count)
    app.add_middleware(RequestIdMiddleware)  # the outermost: every answer carries the id
    if cfg.allowed_origins:  # off by default: no CORS headers at all
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=cfg.allowed_origins,
            allow_methods=cfg.allowed_methods,
            allow_headers=cfg.allowed_headers,
            allow_credentials=cfg.allow_credentials,
            expose_headers=["X-Request-Id"],
        )
    install_error_handlers(app)

    def require_key(request: Request) -> None:
        if cfg.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        token = (
            auth[7:].strip()
            if auth[:7].lower() == "bearer "
            else request.headers.get("x-api-key", "")
        )
        if not token or not secrets.compare_digest(token.encode(), cfg.api_key.encode()):
            raise ApiError(
                401,
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    auth = [Depends(require_key)]

    # ------------------------------------------------------------------ OpenAI
    @app.post("/v1/completions", dependencies=auth, openapi_extra=schema_of(CompletionRequest))
    async def completions(request: Request):
        req = await parse_body(request, CompletionRequest, cfg.max_request_body_bytes)
        return await respond(state, "completion", request, req)

    @app.post(
        "/v1/chat/completions", dependencies=auth, openapi_extra=schema_of(ChatCompletionRequest)
    )
    async def chat_completions(request: Request):
        req = await parse_body(request, ChatCompletionRequest, cfg.max_request_body_bytes)
        return await respond(state, "chat", request, req)

    @app.post("/invocations", dependencies=auth)
    async def invocations(request: Request):
        """vLLM's (SageMaker's) one route: a body with `messages` is a chat completion, one
        with `prompt` a completion."""
        text, data = await read_json_object(request, cfg.max_request_body_bytes)
        if "messages" in data:
            req = validate_body(ChatCompletionRequest, text, data)
            return await respond(state, "chat", request, req)
        if "prompt" in data:
            req = validate_body(CompletionRequest, text, data)
            return await respond(state, "completion", request, req)
        raise bad_request(
            "/invocations takes a chat completion (`messages`) or a completion (`prompt`)",
            "messages",
        )

    @app.post("/v1/responses", dependencies=auth, openapi_extra=schema_of(ResponsesRequest))
    async def responses(request: Request):
        req = await parse_body(request, ResponsesRequest, cfg.max_request_body_bytes)
        return await respond_responses(state, request, req)

    # --served-model-name's names past the first, each a card of its own as vLLM lists them
    config = getattr(engine, "config", None)
    more_names = served_names(config)[1:] if config is not None else []

    def model_card(name: str | None = None) -> ModelCard:
        info = state.info
        return ModelCard(
            id=name or info.name,
            root=info.aliases[0] if info.aliases else info.name,
            max_model_len=info.max_model_len,
            dtype=info.dtype,
            weight_dtype=info.weight_dtype,
            kv_cache_dtype=info.kv_cache_dtype,
            kv_cache_scales=info.kv_cache_scales,
        )

    @app.get("/v1/models", dependencies=auth, response_model=ModelList)
    async def models():
        return ModelList(data=[model_card()] + [model_card(n) for n in more_names])

    @app.get("/v1/models/{model_id:path}", dependencies=auth, response_model=ModelCard)
    async def model(model_id: str):
        state.check_model(model_id)
        return model_card(model_id if model_id in more_names else None)

    # ------------------------------------------------------------------ tokenizer
    @app.post(
        "/tokenize",
        dependencies=auth,
        response_model=TokenizeResponse,
        openapi_extra=schema_of(TokenizeRequest),
    )
    async def tokenize(request: Request):
        req = await parse_body(request, TokenizeRequest, cfg.max_request_body_bytes)
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of `prompt` or `messages`", "prompt")
        if req.messages is not None:
            _, ids = await asyncio.to_thread(chat_prompt, state, req)
        else:
            ids = list(
                await asyncio.to_thread(
                    state.tokenizer.encode,
                    req.prompt,
                    add_special_tokens=req.add_special_tokens is not False,
                )
            )
        return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids)

    @app.post(
        "/detokenize",
        dependencies=auth,
        response_model=DetokenizeResponse,
        openapi_extra=schema_of(DetokenizeRequest),
    )
    async def detokenize(request: Request):
        req = await parse_body(request, DetokenizeRequest, cfg.max_request_body_bytes)
        state.check_model(req.model)
        state.check_tokens(req.tokens, "tokens")
        return DetokenizeResponse(prompt=state.tokenizer.decode(req.tokens))

    if cfg.enable_tokenizer_info_endpoint:  # vLLM's: may show the chat template, so opt-in

        @app.get("/tokenizer_info", dependencies=auth)
        async def tokenizer_info():
            return JSONResponse(frontend_flags.tokenizer_info(state.tokenizer))

    # ------------------------------------------------------------------ operations
    @app.get("/health", response_model=HealthResponse)
    async def health():
        if state.drain.draining:  # first: an orchestrator stops routing here at once
            return state.draining_error().response()
        if not engine.is_healthy():
            return ApiError(503, "the engine is not healthy", code="engine_unhealthy").response()
        return HealthResponse(status="ok")

    @app.api_route("/ping", methods=["GET", "POST"], response_model=HealthResponse)
    async def ping():  # vLLM's (SageMaker's) name for /health
        return await health()

    @app.post("/reset_prefix_cache", dependencies=auth)
    async def reset_prefix_cache():
        """vLLM's endpoint: forget every cached prefix block (e.g. after a weight swap, or to
        measure cold prefill). 200 when done; 503 when the engine could not do it now."""
        try:
            done = await engine.reset_prefix_cache()
        except EngineError as e:
            raise state.api_error(e) from None
        if not done:
            raise ApiError(
                503,
                "the prefix cache could not be reset now (blocks are in use by "
                "running requests); retry when idle",
                code="prefix_cache_busy",
            )
        return Response(status_code=200)

    @app.get("/version", response_model=VersionResponse)
    async def version():
        return VersionResponse(version=_version())

    @app.get("/metrics")
    async def metrics():
        # rendering every family takes milliseconds: not on the event loop, which streams tokens
        return Response(await asyncio.to_thread(state.metrics.render), media_type=CONTENT_TYPE)

    return app
