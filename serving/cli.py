"""`paxengine serve [MODEL] [--config X.yaml] [flags]`: parse, build the engine, run uvicorn.

Flags are named as `vllm serve` names them. Precedence: defaults < --performance-mode preset <
YAML keys < explicit flags (see serving.config.resolve_configs).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Optional

from paxengine.client import EngineClient
from paxengine.config import byte_count, json_object_option, max_model_len_option, token_count
from paxengine.sampling_params import MAX_LOGPROBS
from serving import frontend_flags, reasoning, tools, vllm_flags
from serving.config import PERFORMANCE_MODES, UVICORN_LOG_LEVELS, ServerConfig, resolve_configs

log = logging.getLogger("serving")


def _bool_pair(p: argparse.ArgumentParser, name: str, help: str) -> None:
    dest = name.replace("-", "_")
    p.add_argument(f"--{name}", dest=dest, action="store_true", default=None, help=help)
    p.add_argument(f"--no-{name}", dest=dest, action="store_false", default=None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="paxengine serve", description=__doc__.split("\n")[0], argument_default=None
    )
    p.add_argument("model_tag", nargs="?", help="model (same as --model)")
    p.add_argument("--config", help="YAML file of engine and server keys (flags override it)")
    e = p.add_argument_group("engine")
    e.add_argument(
        "--model", help="HF directory / GGUF file; default: the embedded SmolLM2-135M-Instruct"
    )
    e.add_argument("--tokenizer")
    e.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    e.add_argument(
        "--max-model-len",
        type=_model_len,
        metavar="N",
        help="the longest context (vLLM's forms: 131072, 128k = 128,000, 128K = 131,072; auto or "
        "-1: the model's, or what the KV pool holds if less); default: the model's, up to 8,192",
    )
    e.add_argument("--max-num-seqs", type=int, help="default: 512 on a GPU, 64 on a CPU")
    e.add_argument(
        "--max-num-batched-tokens",
        type=_tokens,
        metavar="N",
        help="default: 8,192 on a GPU, 2,048 on a CPU (8k, 8K: vLLM's forms)",
    )
    e.add_argument(
        "--decode-step-token-budget",
        type=int,
        help="while requests decode, a step takes at most this many tokens (bounds inter-token "
        "latency under long prefills; default: the device class's, 512 on a GPU, 16 on a CPU; "
        "--max-num-batched-tokens turns it off)",
    )
    e.add_argument(
        "--backlog-step-token-budget",
        type=int,
        help="the largest cap while prompts wait to prefill: --decode-step-token-budget doubles "
        "up to it as the prompt tokens waiting reach twice each doubled cap (TTFT under load; "
        "default: 4,096 on a GPU, none on a CPU)",
    )
    e.add_argument("--block-size", type=int)
    e.add_argument("--num-kv-blocks", type=int)
    e.add_argument("--gpu-memory-utilization", type=float)
    e.add_argument(
        "--kv-cache-memory-bytes",
        type=_bytes,
        metavar="N",
        help="the KV pool's bytes a device (vLLM's; 8000000000, 8G or 8GiB), instead of "
        "--gpu-memory-utilization's plan",
    )
    _bool_pair(e, "enable-prefix-caching", "reuse KV blocks of shared prompt prefixes")
    _bool_pair(e, "dispatch-thread", "launch each step from a worker thread")
    _bool_pair(
        e,
        "background-compile",
        "serve once the buckets that hold any step are compiled; compile the others behind "
        "(default: on; the metric step_executables_pending counts them down)",
    )
    _bool_pair(
        e,
        "prime-steps",
        "run every compiled step once before serving (default: on a GPU, where a step's first "
        "run loads its kernels)",
    )
    _bool_pair(
        e,
        "structured-outputs",
        "JSON schemas, regexes, grammars and forced tool calls (3 more samplers per sequence "
        "bucket to compile at start-up)",
    )
    _bool_pair(
        e,
        "store-executables",
        "keep compiled steps on disk; a restart loads them instead of compiling",
    )
    e.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16", "fp8", "fp8_e4m3"])
    e.add_argument(
        "--kv-cache-scales",
        choices=["auto", "calibrate", "unit"],
        help="an fp8 KV cache's per-layer scales: the checkpoint's, else calibrated (auto); "
        "calibrated on a built-in text; or 1.0",
    )
    e.add_argument("--quantization", choices=["fp8"])
    e.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        help="replicas of the model, each on its own --tensor-parallel-size devices; requests "
        "go to the replica holding their prefix",
    )
    e.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        help="split the model over this many devices of this host",
    )
    e.add_argument(
        "--enable-expert-parallel",
        "-ep",
        action="store_true",
        default=None,
        help="MoE models: each of the --tensor-parallel-size devices holds num_experts / N "
        "whole experts (instead of a share of every expert)",
    )
    e.add_argument(
        "--attention-backend",
        choices=["auto", "xla", "pallas", "reference", *vllm_flags.VLLM_ATTENTION_BACKENDS],
        metavar="{auto,xla,pallas,reference}",
        help="paxengine's attention kernels (vLLM's backend names are taken as auto)",
    )
    e.add_argument(
        "--layer-loop",
        choices=["auto", "scan", "unroll"],
        help="unrolled per-layer weights (auto on GPU) or a scan over stacked ones",
    )
    e.add_argument(
        "--token-buckets",
        type=_int_list,
        metavar="N,N,...",
        help="step token counts to compile (default: derived from --max-num-batched-tokens)",
    )
    e.add_argument(
        "--seq-buckets",
        type=_int_list,
        metavar="N,N,...",
        help="step sequence counts to compile (default: derived from --max-num-seqs)",
    )
    e.add_argument(
        "--served-model-name",
        nargs="+",
        type=str,
        help="the model's name in responses; more names (vLLM's) are accepted in requests too",
    )
    e.add_argument("--seed", type=int)
    e.add_argument(
        "--max-waiting-requests",
        type=int,
        help="bound of the waiting queue; beyond it requests get 503 + Retry-After",
    )
    e.add_argument(
        "--max-waiting-tokens",
        type=int,
        help="bound of the prompt tokens waiting; beyond it requests get 503 + Retry-After",
    )
    e.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        help="fcfs: arrival order; priority: the requests' `priority` (lower first), the "
        "lowest preempted first when KV blocks run out",
    )
    e.add_argument(
        "--speculative-config",
        type=_speculative_config,
        metavar="JSON",
        help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": '
        '4, "prompt_lookup_max": 4}\' (n-gram prompt lookup) or \'{"model": SOURCE, '
        '"num_speculative_tokens": 4}\' (a draft model with the same vocabulary, any --model '
        'source); "disable_by_batch_size": N stops speculating above N running requests',
    )
    e.add_argument(
        "--kv-transfer-config",
        type=_kv_transfer_config,
        metavar="JSON",
        help='disaggregated prefill, as vLLM\'s: \'{"kv_role": "kv_both", "prefill_device": 0, '
        '"decode_device": 1}\' (a prefill and a decode engine on their own devices, KV pages '
        "copied device to device; one stream per request)",
    )
    e.add_argument(
        "--hf-overrides",
        type=_hf_overrides,
        metavar="JSON",
        help="an object merged into the checkpoint's config.json before the model is built "
        "(vLLM's; nested objects key by key), e.g. YaRN for long contexts: '{\"text_config\": "
        '{"rope_parameters": {"rope_type": "yarn", "factor": 4.0, '
        '"original_max_position_embeddings": 262144}}}\'',
    )
    e.add_argument(
        "--performance-mode",
        choices=sorted(PERFORMANCE_MODES),
        help="presets of max-num-seqs / max-num-batched-tokens (flags and YAML win)",
    )
    s = p.add_argument_group("server")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument(
        "--api-key", help="require 'Authorization: Bearer KEY' on /v1 (or $PAXENGINE_API_KEY)"
    )
    s.add_argument("--metrics-prefix", help="metric name prefix: paxengine (default) or vllm")
    s.add_argument(
        "--max-request-body-bytes",
        type=int,
        help="larger request bodies get 413 without being read (default 32 MiB)",
    )
    s.add_argument(
        "--request-timeout",
        type=float,
        help="seconds a request may run before it is aborted (finish_reason abort; default: "
        "no limit)",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        help="on SIGTERM/SIGINT, seconds requests in flight may run on before they are aborted "
        "(default 30; new requests get 503 meanwhile; a second signal aborts at once)",
    )
    s.add_argument(
        "--allowed-origins",
        help="CORS: origins browsers may call from (JSON list or comma-separated; default none: "
        "no CORS headers)",
    )
    s.add_argument("--allowed-methods", help="CORS: methods (default GET,POST)")
    s.add_argument(
        "--allowed-headers",
        help="CORS: request headers (default Authorization,Content-Type,X-Request-Id)",
    )
    _bool_pair(s, "allow-credentials", "CORS: allow cookies / auth from those origins")
    _bool_pair(
        s,
        "engine-process",
        "run the engine's step loop in a process of its own (default: yes for one engine; "
        "--no-engine-process runs it on a thread of the server's process)",
    )
    s.add_argument(
        "--reasoning-parser",
        choices=list(reasoning.PARSERS),
        help="the text between the model's think tags goes to message.reasoning "
        "(delta.reasoning), the rest to content",
    )
    s.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        default=None,
        help='tool_choice "auto" (the default with tools) parses the model\'s own calls in '
        "--tool-call-parser's format (without it, a 400 as in vLLM)",
    )
    s.add_argument(
        "--tool-call-parser",
        choices=list(tools.PARSERS),
        help="the model's tool-call format (auto: the chat template's, Hermes, Llama 3.1 JSON "
        "or Mistral's; pythonic / llama4_pythonic: a Python list of calls, Llama 3.2 / 4)",
    )
    _bool_pair(
        s,
        "exclude-tools-when-tool-choice-none",
        'tool_choice "none": the chat template gets no tools (default: a template that renders '
        "tools gets them, as in vLLM)",
    )
    s.add_argument(
        "--generation-config",
        metavar="auto|vllm|DIR",
        help="default sampling parameters from generation_config.json: the model "
        "directory's (auto, the default), none (vllm), or DIR's; a request's own values win",
    )
    s.add_argument(
        "--chat-template",
        metavar="FILE|JINJA",
        help="the chat template to render chats with instead of the model's: a file, or the "
        "template itself (vLLM's)",
    )
    s.add_argument(
        "--default-chat-template-kwargs",
        metavar="JSON",
        help="variables for every chat request's template, e.g. '{\"enable_thinking\": false}' "
        "(Qwen3 / Qwen3.5 without thinking); a request's chat_template_kwargs win key by key",
    )
    s.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    _frontend_flags(p.add_argument_group("vLLM's server flags"))
    vllm_flags.add_to(p)
    return p


def _frontend_flags(s) -> None:
    """vLLM's `vllm serve` frontend flags (its cli_args.py), as vLLM serves them."""
    s.add_argument(
        "--uvicorn-log-level",
        choices=list(UVICORN_LOG_LEVELS),
        help="uvicorn's log level (default: --log-level's)",
    )
    _bool_pair(s, "disable-uvicorn-access-log", "no uvicorn access log line a request")
    s.add_argument("--ssl-keyfile", metavar="FILE", help="HTTPS: the certificate's private key")
    s.add_argument("--ssl-certfile", metavar="FILE", help="HTTPS: serve with this certificate")
    s.add_argument(
        "--ssl-ca-certs",
        metavar="FILE",
        help="HTTPS: the CA file client certificates are checked against",
    )
    s.add_argument(
        "--ssl-cert-reqs",
        type=int,
        choices=[0, 1, 2],
        help="HTTPS client certificates: 0 none (default), 1 optional, 2 required (the ssl "
        "module's CERT_*)",
    )
    s.add_argument(
        "--root-path",
        metavar="PATH",
        help="FastAPI's root_path, behind a proxy that routes a path prefix here (the OpenAPI "
        "servers and docs name it)",
    )
    _bool_pair(s, "disable-fastapi-docs", "no /docs, /redoc or /openapi.json")
    _bool_pair(
        s,
        "enable-log-requests",
        "log each request's prompt (text and token ids) and sampling parameters",
    )
    _bool_pair(
        s,
        "enable-log-outputs",
        "with --enable-log-requests: log each finished output's text (token ids at debug level)",
    )
    s.add_argument(
        "--max-log-len",
        type=int,
        metavar="N",
        help="the logged prompts' and outputs' characters and token ids past N are cut "
        "(default: none)",
    )
    _bool_pair(
        s,
        "enable-force-include-usage",
        "usage in every streamed response (and in every chunk), without stream_options",
    )
    _bool_pair(
        s,
        "return-tokens-as-token-ids",
        'every request\'s logprob tokens as "token_id:N" (a request may ask alone)',
    )
    s.add_argument(
        "--max-logprobs",
        type=int,
        metavar="N",
        help="the most logprobs a token a request may ask (logprobs, top_logprobs, "
        f"prompt_logprobs; more is a 400); 0 to {MAX_LOGPROBS}, the default",
    )
    s.add_argument(
        "--response-role",
        metavar="ROLE",
        help="a chat answer's role when the request's add_generation_prompt is true (default "
        "assistant)",
    )
    _bool_pair(
        s,
        "trust-request-chat-template",
        "a chat request's own chat_template renders it (without: such a request is a 400)",
    )
    s.add_argument(
        "--override-generation-config",
        metavar="JSON",
        help="generation_config.json's fields merged over the model's defaults (alone with "
        "--generation-config vllm), e.g. '{\"temperature\": 0.6}'",
    )
    _bool_pair(
        s,
        "enable-log-deltas",
        "with --enable-log-outputs: a line per streamed delta too (default: on, as vLLM's)",
    )
    s.add_argument(
        "--uds", metavar="PATH", help="listen on this Unix socket instead of --host / --port"
    )
    s.add_argument(
        "--ssl-ciphers",
        metavar="CIPHERS",
        help="HTTPS: OpenSSL's cipher list for TLS 1.2 and below (TLS 1.3's suites are OpenSSL's)",
    )
    s.add_argument(
        "--log-config-file",
        metavar="FILE",
        help="a JSON logging config (logging.config.dictConfig) for uvicorn's loggers and any "
        "others it names, as vLLM's",
    )
    s.add_argument(
        "--disable-access-log-for-endpoints",
        metavar="PATHS",
        help="no access log line for requests to these paths, e.g. /health,/metrics",
    )
    s.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        metavar="BYTES",
        help="serve HTTP with h11 (not httptools) buffering at most this many bytes of an "
        "incomplete event (a request's head still coming); past it, a 400",
    )
    s.add_argument(
        "--h11-max-header-count",
        type=int,
        metavar="N",
        help="a request with more than N headers gets a 431",
    )
    _bool_pair(
        s,
        "enable-tokenizer-info-endpoint",
        "GET /tokenizer_info: the tokenizer's configuration and chat template (vLLM's)",
    )


def _arg_type(parse):
    """An argparse type from a parser that raises ValueError: its message is argparse's error,
    and a bad value fails before the model loads."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


@_arg_type
def _speculative_config(text: str) -> dict:
    """The JSON object, checked now so a bad one fails before the model loads."""
    from paxengine.spec_decode import parse_speculative_config

    parse_speculative_config(text)
    return json.loads(text)


@_arg_type
def _kv_transfer_config(text: str) -> dict:
    """The JSON object, checked now so a bad one fails before the model loads."""
    from paxengine.disagg.config import parse_kv_transfer_config

    parse_kv_transfer_config(text)
    return json.loads(text)


@_arg_type
def _hf_overrides(text: str) -> dict:
    return json_object_option(text, "--hf-overrides") or {}


@_arg_type
def _tokens(text: str) -> int:
    return token_count(text, "a token count")


_model_len = _arg_type(max_model_len_option)


@_arg_type
def _bytes(text: str) -> int:
    return byte_count(text, "a byte count")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def parse(argv: list[str]):
    """argv -> (EngineConfig, ServerConfig); raises SystemExit(2) on bad flags or config."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    if args.get("served_model_name") and len(args["served_model_name"]) == 1:
        args["served_model_name"] = args["served_model_name"][0]
    tag, config_path = args.pop("model_tag"), args.pop("config")
    if tag is not None:
        if args.get("model") not in (None, tag):
            parser.error(f"model given twice: {tag!r} and --model {args['model']!r}")
        args["model"] = tag
    try:
        yaml_keys = {}
        if config_path:
            from paxengine.config import load_yaml

            yaml_keys = load_yaml(config_path)
        return resolve_configs(yaml_keys, args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        parser.error(str(e))


def describe(engine: EngineClient, scfg: ServerConfig) -> str:
    """One start-up line from what the engine serves."""
    info = engine.model_info()
    shapes = ", ".join(f"{t}x{s}" for t, s in info.buckets)
    return (
        f"model={info.name} dtype={info.dtype} weights={info.weight_dtype} "
        f"kv_cache_dtype={info.kv_cache_dtype} kv_cache_scales={info.kv_cache_scales} "
        f"max_model_len={info.max_model_len} kv_capacity_tokens={info.kv_capacity_tokens} "
        f"buckets={len(info.buckets)} [tokens x seqs: {shapes}] "
        + (
            f"uds={scfg.uds}"
            if scfg.uds is not None
            else f"url={'https' if scfg.ssl_certfile else 'http'}://{scfg.host}:{scfg.port}/v1"
        )
    )


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    try:
        ecfg, scfg = parse(argv)
    except SystemExit as e:
        return int(e.code or 0)
    logging.basicConfig(
        level=scfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    from paxengine.async_engine import AsyncEngine
    from paxengine.data_parallel import DataParallelEngine
    from serving.app import build_app

    for note in scfg.vllm_flag_notes:
        log.info("%s", note)
    if scfg.max_log_len is not None and not scfg.enable_log_requests:
        log.info("--max-log-len: nothing is logged to cut without --enable-log-requests")
    if scfg.enable_log_deltas and not scfg.enable_log_outputs:
        log.info("--enable-log-deltas: no deltas are logged without --enable-log-outputs")
    log.info("engine config: %s", ecfg)
    if ecfg.num_processes > 1:
        log.error(
            "cannot start the engine: serving over several processes (num_processes=%d) is not "
            "implemented yet; run the offline LLM on every host (SPMD), or one server a host "
            "with --data-parallel-size",
            ecfg.num_processes,
        )
        return 2
    one_engine = not ecfg.kv_transfer_config and ecfg.data_parallel_size == 1
    if scfg.engine_process and not one_engine:
        log.error(
            "cannot start the engine: --engine-process runs one engine in a process of its own; "
            "data-parallel replicas and disaggregated engines run on threads of the server's "
            "process (leave engine_process unset or pass --no-engine-process)"
        )
        return 2
    t0 = time.perf_counter()
    try:
        # loads the model and compiles the buckets (each replica's)
        if ecfg.kv_transfer_config:  # a prefill and a decode engine (paxengine/disagg)
            from paxengine.disagg.front import DisaggregatedEngine

            engine = DisaggregatedEngine(ecfg)
        elif ecfg.data_parallel_size > 1:
            engine = DataParallelEngine(ecfg)
        elif scfg.engine_process is False:
            engine = AsyncEngine(ecfg)
        else:
            from paxengine.engine_process import ProcessEngine

            engine = ProcessEngine(ecfg)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        log.error("cannot start the engine: %s", e)
        return 2
    app = build_app(engine, scfg)
    log.info("ready in %.1f s: serving %s", time.perf_counter() - t0, describe(engine, scfg))
    return serve(app, engine, scfg)


def serve(app, engine: EngineClient, scfg: ServerConfig) -> int:
    """Run the app until a stop signal has drained it (serving.drain); the exit status."""
    server = frontend_flags.make_server(app, engine, scfg)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    except SystemExit as e:  # uvicorn's start-up failure (e.g. the port is taken)
        return int(e.code or 0)
    return server.exit_code if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
