"""`paxengine serve`'s uvicorn server as vLLM's frontend flags set it up (`make_server`,
`uvicorn_options`), and what those flags need beyond uvicorn's keywords: the access log without
some paths (--disable-access-log-for-endpoints), a bound on a request's headers
(--h11-max-header-count), GET /tokenizer_info's body (--enable-tokenizer-info-endpoint)."""

from __future__ import annotations

import json
import logging
from typing import Optional

from serving.config import ServerConfig
from serving.errors import ApiError

ACCESS_LOGGER = "uvicorn.access"


class AccessPathFilter(logging.Filter):
    """Drops uvicorn's access log line of a request to one of `paths` (its path without the
    query, as the request line names it; uvicorn's record args: client, method, path, HTTP
    version, status)."""

    def __init__(self, paths):
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in self.paths
        return True


def filter_access_log(paths: Optional[list]) -> None:
    """Puts the filter of `paths` on uvicorn's access logger (after uvicorn configured it; again:
    the last call's paths), or takes it off (None)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    for f in [f for f in logger.filters if isinstance(f, AccessPathFilter)]:
        logger.removeFilter(f)
    if paths:
        logger.addFilter(AccessPathFilter(paths))


class HeaderCountLimit:
    """--h11-max-header-count: a request with more headers than `limit` gets a 431 before the
    app sees it (a plain ASGI middleware, as request_ids.RequestIdMiddleware)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and len(scope.get("headers") or ()) > self.limit:
            error = ApiError(
                431,
                f"the request has more than {self.limit} headers (the server's "
                "--h11-max-header-count)",
                code="request_header_fields_too_large",
            )
            return await error.response()(scope, receive, send)
        return await self.app(scope, receive, send)


def tokenizer_info(tokenizer) -> dict:
    """vLLM's GET /tokenizer_info body: the tokenizer's configuration (vLLM sends Hugging Face's
    init kwargs, tokenizer_config.json's fields, added tokens as their text) with its class and
    the chat template in use. paxengine's tokenizer keeps the special tokens, add_bos_token, the
    added tokens and the template; it is tokenizer.json's fast tokenizer, which Hugging Face
    loads as PreTrainedTokenizerFast."""
    info: dict = {}
    for key in ("add_bos_token", "bos_token", "eos_token"):
        value = getattr(tokenizer, key, None)
        if value is not None:
            info[key] = value
    hf = getattr(tokenizer, "tok", None)  # a `tokenizers` Tokenizer
    if hf is not None:
        added = sorted(hf.get_added_tokens_decoder().items())
        info["added_tokens_decoder"] = {str(i): t.content for i, t in added}
    info["tokenizer_class"] = "PreTrainedTokenizerFast"
    template = getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = template
    return info


def make_server(app, engine, scfg: ServerConfig):
    """serve()'s uvicorn server: it drains on a stop signal (serving.drain), listens as the keys
    say (uvicorn_options), its access log without --disable-access-log-for-endpoints' paths."""
    from serving.drain import draining_server

    server = draining_server(app, engine, app.state.serving.drain, **uvicorn_options(scfg))
    # after uvicorn.Config configured its loggers (a --log-config-file's too)
    filter_access_log(scfg.disable_access_log_for_endpoints)
    return server


def uvicorn_options(scfg: ServerConfig) -> dict:
    """uvicorn.Config's keywords from the server's keys: where it listens (host and port, or a
    Unix socket), its log level, access log and logging config, TLS, the h11 protocol's bound."""
    kw = dict(
        host=scfg.host,
        port=scfg.port,
        log_level=scfg.uvicorn_log_level or scfg.log_level,
        access_log=not scfg.disable_uvicorn_access_log,
        timeout_graceful_shutdown=5,
    )
    if scfg.uds is not None:  # vLLM's: host and port are ignored
        kw["uds"] = scfg.uds
    if scfg.log_config_file is not None:
        with open(scfg.log_config_file, encoding="utf-8") as f:
            kw["log_config"] = json.load(f)
    if scfg.ssl_certfile is not None:
        kw.update(
            ssl_certfile=scfg.ssl_certfile,
            ssl_keyfile=scfg.ssl_keyfile,
            ssl_ca_certs=scfg.ssl_ca_certs,
            ssl_cert_reqs=scfg.ssl_cert_reqs,
        )
        if scfg.ssl_ciphers is not None:
            kw["ssl_ciphers"] = scfg.ssl_ciphers
    if scfg.h11_max_incomplete_event_size is not None:
        # httptools (uvicorn's choice when installed) has no such bound: h11 serves
        kw.update(http="h11", h11_max_incomplete_event_size=scfg.h11_max_incomplete_event_size)
    return kw
