"""Server configuration and how YAML, presets and flags combine into (EngineConfig, ServerConfig).

Precedence, lowest first: EngineConfig defaults < the server's own (`SERVER_ENGINE_DEFAULTS`) <
`performance_mode` preset < YAML keys < explicit command-line flags. YAML keys that are not
EngineConfig fields must be server keys.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

from paxengine.config import AUTO, EngineConfig, json_object_option
from paxengine.sampling_params import MAX_LOGPROBS

PERFORMANCE_MODES: dict[str, dict[str, Any]] = {
    # EngineConfig's own defaults
    "balanced": {},
    # fewer sequences and a small token budget per step: short steps, low TTFT and ITL
    "interactivity": {"max_num_seqs": 16, "max_num_batched_tokens": 512},
    # large batches and a large prefill budget: more tokens/s, longer steps
    "throughput": {"max_num_seqs": 256, "max_num_batched_tokens": 8192},
}


UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

# Engine settings where a server wants another default than the offline LLM:
# - background_compile: a server is ready once the few buckets that hold any step are built and
#   builds the rest while it serves (H200, Llama-3.1-8B, a fresh machine: ready in 39-43 s
#   instead of 87-110; a restart loads everything from the executable store either way). An offline run
#   wants every bucket before its first step instead.
# - the step budgets while requests decode: the device class's (paxengine/device_defaults.py),
#   so a long prefill does not stall the running streams; an offline run wants full steps.
SERVER_ENGINE_DEFAULTS: dict[str, Any] = {
    "background_compile": True,
    "decode_step_token_budget": AUTO,
    "backlog_step_token_budget": AUTO,
}


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None  # also read from $PAXENGINE_API_KEY by the CLI
    metrics_prefix: str = "paxengine"  # "vllm" makes vLLM dashboards/alerts work unchanged
    performance_mode: str = "balanced"
    log_level: str = "info"
    retry_after_s: int = 1  # Retry-After when the waiting queue is full
    # on SIGTERM / SIGINT, how long requests in flight may run before they are aborted
    shutdown_timeout: float = 30.0
    max_request_body_bytes: int = 32 * 1024 * 1024  # larger bodies get 413, unread
    # seconds a request may run before the server aborts it (finish_reason "abort"); None: no
    # limit
    request_timeout: Optional[float] = None
    # CORS, as vLLM's flags name it, but off unless origins are given (vLLM allows every origin
    # by default): browsers on these origins may call the API
    allowed_origins: list = dataclasses.field(default_factory=list)
    allowed_methods: list = dataclasses.field(default_factory=lambda: ["GET", "POST"])
    allowed_headers: list = dataclasses.field(
        default_factory=lambda: ["Authorization", "Content-Type", "X-Request-Id"]
    )
    allow_credentials: bool = False
    # the engine's step loop in a process of its own (vLLM's layout), so that the server's event
    # loop and the step loop never wait for one GIL; None: yes, where one engine serves (data-
    # parallel replicas and disaggregated engines run on threads of the server's process)
    engine_process: Optional[bool] = None
    # vLLM's: the think block's text as `reasoning` (serving/reasoning.py): qwen3, deepseek_r1,
    # mistral
    reasoning_parser: Optional[str] = None
    # vLLM's: tool_choice "auto" parses the model's calls in --tool-call-parser's format
    # (serving/tools.py: auto, hermes, llama3_json, qwen3_coder, qwen3_xml, mistral, pythonic,
    # llama4_pythonic); without it, "auto" is a 400 as in vLLM
    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None
    # vLLM's: tool_choice "none" keeps the request's tools out of the chat template (without
    # it, a template that renders tools gets them, as in vLLM; the model's calls stay text)
    exclude_tools_when_tool_choice_none: bool = False
    # vLLM's: default sampling parameters from generation_config.json: auto (the model's), vllm
    # (none), or a directory holding one (serving/generation_config.py)
    generation_config: str = "auto"
    # vLLM's: variables every chat request's template gets (Qwen3.5 without thinking:
    # {"enable_thinking": false}); a request's chat_template_kwargs win key by key
    default_chat_template_kwargs: Optional[dict] = None
    # vLLM's: the chat template to render with instead of the model's, a file or the Jinja text
    chat_template: Optional[str] = None
    # vLLM's frontend flags (vllm/entrypoints/openai/cli_args.py), as vLLM serves them:
    # uvicorn's log level (None: log_level's) and access log
    uvicorn_log_level: Optional[str] = None
    disable_uvicorn_access_log: bool = False
    # HTTPS: uvicorn's TLS (the certificate and its key; client certificates against the CA file
    # when ssl_cert_reqs is ssl.CERT_OPTIONAL 1 or CERT_REQUIRED 2)
    ssl_keyfile: Optional[str] = None
    ssl_certfile: Optional[str] = None
    ssl_ca_certs: Optional[str] = None
    ssl_cert_reqs: int = 0
    root_path: Optional[str] = None  # FastAPI's, behind a proxy that routes a path prefix here
    disable_fastapi_docs: bool = False  # no /docs, /redoc, /openapi.json
    # a log line per engine request with its prompt and params, and with enable_log_outputs
    # one per finished output with its text; max_log_len cuts the texts and token ids
    enable_log_requests: bool = False
    enable_log_outputs: bool = False
    max_log_len: Optional[int] = None
    enable_force_include_usage: bool = False  # usage in every stream (and every chunk), as vLLM
    return_tokens_as_token_ids: bool = False  # every request's logprob tokens as "token_id:N"
    max_logprobs: int = MAX_LOGPROBS  # the most logprobs a token a request may ask (a 400 past)
    response_role: str = "assistant"  # a chat answer's role with add_generation_prompt
    trust_request_chat_template: bool = False  # a chat request's own chat_template renders it
    # generation_config.json's fields over the model's (or alone, with generation_config vllm)
    override_generation_config: Optional[dict] = None
    # with enable_log_outputs, a line per streamed delta too (None: vLLM's default, on)
    enable_log_deltas: Optional[bool] = None
    # uvicorn's: a Unix socket instead of host:port; TLS 1.2 cipher suites; a logging config
    # (dictConfig JSON) for uvicorn's loggers and any it names; the access log without these
    # paths ("/health,/metrics" or a list); the h11 protocol, buffering at most this many bytes
    # of an incomplete event (a request's head still coming; past it a 400); more request
    # headers than h11_max_header_count: a 431
    uds: Optional[str] = None
    ssl_ciphers: Optional[str] = None
    log_config_file: Optional[str] = None
    disable_access_log_for_endpoints: Optional[list] = None
    h11_max_incomplete_event_size: Optional[int] = None
    h11_max_header_count: Optional[int] = None
    # vLLM's GET /tokenizer_info (the tokenizer's configuration and chat template)
    enable_tokenizer_info_endpoint: bool = False
    # vLLM's flags taken as what paxengine does anyway (serving/vllm_flags.py): the start-up
    # log's lines, not a key of its own
    vllm_flag_notes: list = dataclasses.field(default_factory=list, init=False)

    def __post_init__(self):
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if isinstance(value, str):  # a flag or YAML string: JSON list or comma-separated
                value = _str_list(value, name)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{name}: must be a list of strings, got {value!r}")
            setattr(self, name, value)
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError(
                "allow_credentials with allowed_origins '*': browsers refuse credentials for "
                "any origin; list the origins"
            )
        self.metrics_prefix = (self.metrics_prefix or "paxengine").rstrip(":")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.metrics_prefix):
            raise ValueError(
                f"metrics_prefix: {self.metrics_prefix!r} is not a valid metric name prefix"
            )
        if self.performance_mode not in PERFORMANCE_MODES:
            raise ValueError(
                f"performance_mode: must be one of {sorted(PERFORMANCE_MODES)}, "
                f"got {self.performance_mode!r}"
            )
        if (
            isinstance(self.port, bool)
            or not isinstance(self.port, int)
            or not 0 <= self.port < 65536
        ):
            raise ValueError(f"port: must be an integer in [0, 65535], got {self.port!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host: must be a non-empty string, got {self.host!r}")
        if (
            isinstance(self.shutdown_timeout, bool)
            or not isinstance(self.shutdown_timeout, (int, float))
            or not self.shutdown_timeout >= 0
        ):
            raise ValueError(
                f"shutdown_timeout: must be a number of seconds >= 0, got {self.shutdown_timeout!r}"
            )
        if (
            isinstance(self.max_request_body_bytes, bool)
            or not isinstance(self.max_request_body_bytes, int)
            or self.max_request_body_bytes < 1
        ):
            raise ValueError(
                "max_request_body_bytes: must be a positive integer, got "
                f"{self.max_request_body_bytes!r}"
            )
        if self.request_timeout is not None and (
            isinstance(self.request_timeout, bool)
            or not isinstance(self.request_timeout, (int, float))
            or not self.request_timeout > 0
        ):
            raise ValueError(
                f"request_timeout: must be a number of seconds > 0, got {self.request_timeout!r}"
            )
        if self.api_key is not None and not isinstance(self.api_key, str):
            raise ValueError("api_key: must be a string")
        self._check_parsers()
        self._check_template_kwargs()
        self._check_chat_template()
        self._check_frontend()

    def _check_frontend(self) -> None:
        """vLLM's frontend keys (YAML values arrive unchecked by argparse)."""
        from serving import generation_config

        for name in (
            "disable_uvicorn_access_log",
            "disable_fastapi_docs",
            "enable_log_requests",
            "enable_log_outputs",
            "enable_force_include_usage",
            "return_tokens_as_token_ids",
            "trust_request_chat_template",
            "exclude_tools_when_tool_choice_none",
            "enable_tokenizer_info_endpoint",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        if self.uvicorn_log_level not in (None, *UVICORN_LOG_LEVELS):
            raise ValueError(
                f"uvicorn_log_level: one of {list(UVICORN_LOG_LEVELS)}, got "
                f"{self.uvicorn_log_level!r}"
            )
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and (not isinstance(path, str) or not os.path.isfile(path)):
                raise ValueError(f"{name}: {path!r} is not a file")
        https = self.ssl_certfile is not None
        if not https and self.ssl_keyfile is not None:
            raise ValueError("ssl_keyfile: needs ssl_certfile (the certificate it is the key of)")
        if not https and self.ssl_ca_certs is not None:
            raise ValueError("ssl_ca_certs: needs ssl_certfile (HTTPS)")
        r = self.ssl_cert_reqs
        if isinstance(r, bool) or r not in (0, 1, 2):
            raise ValueError(
                "ssl_cert_reqs: 0 (ssl.CERT_NONE), 1 (CERT_OPTIONAL) or 2 (CERT_REQUIRED), got "
                f"{r!r}"
            )
        if r and not https:
            raise ValueError("ssl_cert_reqs: client certificates need ssl_certfile (HTTPS)")
        if r and self.ssl_ca_certs is None:
            raise ValueError(
                "ssl_cert_reqs: client certificates need ssl_ca_certs to be checked against"
            )
        rp = self.root_path
        if rp is not None and (not isinstance(rp, str) or (rp and not rp.startswith("/"))):
            raise ValueError(f"root_path: a path starting with '/', got {rp!r}")
        if rp is not None:
            self.root_path = rp.rstrip("/")
        n = self.max_log_len
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"max_log_len: an integer >= 0, got {n!r}")
        if self.enable_log_outputs and not self.enable_log_requests:
            raise ValueError("enable_log_outputs: needs enable_log_requests (vLLM's rule)")
        k = self.max_logprobs
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS:
            raise ValueError(
                f"max_logprobs: an integer in [0, {MAX_LOGPROBS}], got {k!r} (paxengine's "
                f"sampler computes a token's top {MAX_LOGPROBS} logprobs, vLLM's default cap; "
                "-1, the whole vocabulary, is not served)"
            )
        if not isinstance(self.response_role, str) or not self.response_role:
            raise ValueError(f"response_role: a non-empty string, got {self.response_role!r}")
        override = json_object_option(self.override_generation_config, "override_generation_config")
        self.override_generation_config = generation_config.check_override(override)
        self._check_listener()

    def _check_listener(self) -> None:
        """uvicorn's keys of vLLM's frontend flags, checked before anything loads."""
        if self.enable_log_deltas is not None and not isinstance(self.enable_log_deltas, bool):
            raise ValueError(f"enable_log_deltas: true or false, got {self.enable_log_deltas!r}")
        uds = self.uds
        if uds is not None:
            if (
                not isinstance(uds, str)
                or not uds
                or not os.path.isdir(os.path.dirname(uds) or ".")
            ):
                raise ValueError(f"uds: a socket path in an existing directory, got {uds!r}")
            if len(os.fsencode(uds)) > 107:  # sockaddr_un's sun_path
                raise ValueError(f"uds: at most 107 bytes (a Unix socket's path), got {uds!r}")
        c = self.ssl_ciphers
        if c is not None:
            import ssl

            if self.ssl_certfile is None:
                raise ValueError("ssl_ciphers: needs ssl_certfile (HTTPS)")
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).set_ciphers(c)
            except (ssl.SSLError, TypeError):
                raise ValueError(f"ssl_ciphers: OpenSSL selects no cipher from {c!r}") from None
        f = self.log_config_file
        if f is not None:
            try:
                with open(f, encoding="utf-8") as fh:
                    cfg = json.load(fh)
            except (OSError, TypeError, ValueError) as e:
                raise ValueError(f"log_config_file: {f!r} is not a JSON file ({e})") from None
            if not isinstance(cfg, dict) or "version" not in cfg:
                raise ValueError(
                    f"log_config_file: {f} is not a logging.config.dictConfig object (it needs "
                    '"version": 1)'
                )
        paths = self.disable_access_log_for_endpoints
        if isinstance(paths, str):  # vLLM's: comma-separated
            paths = [p.strip() for p in paths.split(",") if p.strip()]
        if paths is not None and not (
            isinstance(paths, list) and all(isinstance(p, str) and p.startswith("/") for p in paths)
        ):
            raise ValueError(
                "disable_access_log_for_endpoints: paths starting with '/' (comma-separated or a "
                f"list), got {self.disable_access_log_for_endpoints!r}"
            )
        self.disable_access_log_for_endpoints = paths or None
        for name in ("h11_max_incomplete_event_size", "h11_max_header_count"):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise ValueError(f"{name}: a positive integer, got {n!r}")

    def _check_template_kwargs(self) -> None:
        from paxengine.tokenizer import RESERVED_TEMPLATE_VARIABLES

        # a dict, or its JSON text (a flag, a YAML string)
        kw = json_object_option(self.default_chat_template_kwargs, "default_chat_template_kwargs")
        taken = sorted(RESERVED_TEMPLATE_VARIABLES & set(kw or {}))
        if taken:
            raise ValueError(
                f"default_chat_template_kwargs: {', '.join(taken)} are set by the server per "
                "request"
            )
        self.default_chat_template_kwargs = kw

    def _check_chat_template(self) -> None:
        t = self.chat_template
        if t is not None and (not isinstance(t, str) or not t.strip()):
            raise ValueError(f"chat_template: a file or a Jinja template, got {t!r}")
        if t is not None and not os.path.isfile(t) and "{" not in t:
            raise ValueError(f"chat_template: {t} is not a file (nor a Jinja template)")
        if t is not None:
            from paxengine.tokenizer import compile_chat_template

            compile_chat_template(self.chat_template_text())

    def _check_parsers(self) -> None:
        from serving import reasoning, tools

        if self.reasoning_parser is not None and self.reasoning_parser not in reasoning.PARSERS:
            raise ValueError(
                f"reasoning_parser: must be one of {list(reasoning.PARSERS)}, got "
                f"{self.reasoning_parser!r}"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in tools.PARSERS:
            raise ValueError(
                f"tool_call_parser: must be one of {list(tools.PARSERS)}, got "
                f"{self.tool_call_parser!r}"
            )
        if not isinstance(self.enable_auto_tool_choice, bool):
            raise ValueError("enable_auto_tool_choice: must be true or false")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "enable_auto_tool_choice: needs tool_call_parser (--tool-call-parser "
                f"{{{','.join(tools.PARSERS)}}}; auto: the chat template's format)"
            )
        g = self.generation_config
        if not isinstance(g, str) or not g:
            raise ValueError(f"generation_config: auto, vllm or a directory, got {g!r}")
        if g not in ("auto", "vllm") and not os.path.isfile(
            os.path.join(g, "generation_config.json")
        ):
            raise ValueError(f"generation_config: {g} has no generation_config.json")

    def chat_template_text(self) -> Optional[str]:
        """--chat-template's Jinja text: the file's, or the flag's own (vLLM takes either)."""
        t = self.chat_template
        if t is None or not os.path.isfile(t):
            return t
        with open(t, encoding="utf-8") as f:
            return f.read()

    @classmethod
    def fields(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls) if f.init}


def _str_list(text: str, name: str) -> list:
    text = text.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not a valid JSON list ({e})") from None
    return [x.strip() for x in text.split(",") if x.strip()]


def resolve_configs(
    yaml_keys: Optional[dict] = None, flags: Optional[dict] = None
) -> tuple[EngineConfig, ServerConfig]:
    """Combine YAML keys and explicit flags (both flat dicts, `None` values = not given)."""
    from serving import vllm_flags

    yaml_keys = {k.replace("-", "_"): v for k, v in (yaml_keys or {}).items()}
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    if "load_format" in flags:  # --load-format dummy turns the model into random weights,
        for key in ("model", "tokenizer", "served_model_name"):  # naming them where not given
            if key not in flags and key in yaml_keys:
                flags[key] = yaml_keys[key]
    notes = vllm_flags.apply(yaml_keys) + vllm_flags.apply(flags)
    engine_fields, server_fields = EngineConfig.fields(), ServerConfig.fields()
    unknown = set(yaml_keys) - engine_fields - server_fields
    if unknown:
        raise ValueError(
            f"unknown config keys: {sorted(unknown)} (engine keys: "
            f"{sorted(engine_fields)}; server keys: {sorted(server_fields)})"
        )
    unknown = set(flags) - engine_fields - server_fields
    if unknown:  # a programming error in the CLI, not user input
        raise ValueError(f"unknown flags: {sorted(unknown)}")
    merged = {**yaml_keys, **flags}
    mode = merged.get("performance_mode", "balanced")
    if mode not in PERFORMANCE_MODES:
        raise ValueError(
            f"performance_mode: must be one of {sorted(PERFORMANCE_MODES)}, got {mode!r}"
        )
    engine_kw = {
        **SERVER_ENGINE_DEFAULTS,
        **PERFORMANCE_MODES[mode],
        **{k: v for k, v in merged.items() if k in engine_fields},
    }
    server_kw = {k: v for k, v in merged.items() if k in server_fields}
    if server_kw.get("api_key") is None and os.environ.get("PAXENGINE_API_KEY"):
        server_kw["api_key"] = os.environ["PAXENGINE_API_KEY"]
    scfg = ServerConfig(**server_kw)
    scfg.vllm_flag_notes = notes
    return EngineConfig.from_dict(engine_kw), scfg
