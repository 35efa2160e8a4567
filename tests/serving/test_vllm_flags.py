"""serving/vllm_flags.py: the recipes' `vllm serve` flags on `paxengine serve`'s command line
(and in its YAML) are taken as what paxengine does anyway, or refused naming the flag and why."""

import json
import re

import pytest

from serving.cli import parse
from serving.config import resolve_configs

RECIPE = [  # Qwen3.5's vLLM recipe and model card flags that name what paxengine always does
    "--trust-remote-code",
    "--language-model-only",
    "--async-scheduling",
    "--enable-chunked-prefill",
    "--tokenizer-mode",
    "auto",
    "--load-format",
    "safetensors",
    "--limit-mm-per-prompt",
    '{"image": 0, "video": 0}',
    "--mamba-ssm-cache-dtype",
    "auto",
    "--mamba-cache-mode",
    "align",
    "--disable-log-requests",
]


def test_a_recipes_flags_are_taken_and_logged():
    ecfg, scfg = parse(RECIPE + ["--max-num-seqs", "4"])
    assert ecfg.max_num_seqs == 4 and ecfg.model is None  # the rest of the line as without them
    notes = "\n".join(scfg.vllm_flag_notes)
    for flag in ("--trust-remote-code", "--async-scheduling", "--limit-mm-per-prompt"):
        assert flag in notes
    assert "no image, video inputs" in notes


def test_several_served_model_names_as_vllm_takes_them():
    """--served-model-name a b: responses carry a, requests may name either, /v1/models lists
    both (a second name was taken as the model path before)."""
    from fake_engine import FakeEngine
    from fastapi.testclient import TestClient

    from paxengine.config import EngineConfig
    from serving.app import build_app
    from serving.config import ServerConfig

    ecfg, _ = parse(["--served-model-name", "a", "b"])
    assert ecfg.served_model_name == ["a", "b"] and ecfg.model is None
    assert parse(["--served-model-name", "a"])[0].served_model_name == "a"
    engine = FakeEngine(EngineConfig(max_model_len=128, served_model_name=["a", "b"]))
    with TestClient(build_app(engine, ServerConfig())) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["a", "b"]
        assert c.get("/v1/models/b").json()["id"] == "b"
        r = c.post("/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "a"
        r = c.post("/v1/completions", json={"model": "c", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404


def test_kv_cache_memory_bytes_takes_vllms_forms():
    for text, n in [("8000000000", 8 * 10**9), ("8G", 8 * 10**9), ("8GiB", 8 << 30)]:
        assert parse(["--kv-cache-memory-bytes", text])[0].kv_cache_memory_bytes == n
    with pytest.raises(SystemExit):
        parse(["--kv-cache-memory-bytes", "8Q"])
    # the YAML's key takes the same forms (the engine resolves it), refused by name otherwise
    from paxengine.config import EngineConfig
    from paxengine.device_defaults import resolve

    for raw, n in [("8G", 8 * 10**9), ("1.5GiB", 3 << 29), (4096, 4096), (None, None)]:
        assert resolve(EngineConfig(kv_cache_memory_bytes=raw), False).kv_cache_memory_bytes == n
    for raw in ("8Q", "GiB", 0, -5, True):
        with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
            resolve(EngineConfig(kv_cache_memory_bytes=raw), False)


def test_hf_overrides_reach_the_engine_config(tmp_path):
    """--hf-overrides (and the YAML key): vLLM's recipes' JSON object, as the engine's
    hf_overrides; what is not an object is refused before anything loads, a rope type
    paxengine lacks and a GGUF model when the engine starts (a config.json to merge into is
    needed), naming the flag."""
    from paxengine.engine_setup import check_config
    from paxengine.models.loader import load_model

    recipe = (
        '{"text_config": {"rope_parameters": {"mrope_interleaved": true, "mrope_section": [11, '
        '11, 10], "rope_type": "yarn", "rope_theta": 10000000, "partial_rotary_factor": 0.25, '
        '"factor": 4.0, "original_max_position_embeddings": 262144}}}'
    )
    ecfg, scfg = parse(["--hf-overrides", recipe, "--max-model-len", "1010000"])
    assert ecfg.hf_overrides == json.loads(recipe) and ecfg.max_model_len == 1010000
    assert not scfg.vllm_flag_notes  # taken as itself, not as a flag paxengine ignores
    ecfg, _ = resolve_configs({"hf_overrides": '{"max_position_embeddings": 1010000}'}, {})
    assert ecfg.hf_overrides == '{"max_position_embeddings": 1010000}'  # YAML: checked at start
    with pytest.raises(ValueError, match="hf_overrides: expected a JSON object, got list"):
        check_config(ecfg.replace(hf_overrides="[1]"), on_gpu=False)
    with pytest.raises(ValueError, match="hf_overrides: not valid JSON"):
        check_config(ecfg.replace(hf_overrides="{"), on_gpu=False)
    # a rope type paxengine lacks: refused naming it, when the config is built
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
              "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    dynamic = {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'"):
        load_model(f"dummy:{tmp_path / 'config.json'}", hf_overrides=dynamic)
    with pytest.raises(ValueError, match=r"hf_overrides \(--hf-overrides\): .*GGUF"):
        load_model(None, hf_overrides=dynamic)  # the embedded default is a GGUF file
    with pytest.raises(ValueError, match=r"--hf-overrides.*preset"):
        load_model("dummy:tiny", hf_overrides={"max_position_embeddings": 8})


def test_load_format_dummy_serves_the_configs_random_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    ecfg, _ = parse([str(tmp_path), "--load-format", "dummy"])
    assert ecfg.model == f"dummy:{tmp_path / 'config.json'}" and ecfg.tokenizer is None
    (tmp_path / "tokenizer.json").write_text("{}")  # the directory's tokenizer stays in use
    ecfg, _ = parse([str(tmp_path), "--load-format", "dummy"])
    assert ecfg.tokenizer == str(tmp_path) and ecfg.served_model_name == str(tmp_path)
    ecfg, _ = resolve_configs({"model": str(tmp_path)}, {"load_format": "dummy"})  # YAML model
    assert ecfg.model == f"dummy:{tmp_path / 'config.json'}"
    # the YAML's name and tokenizer stay: the flag names them only where nothing does
    yaml = {"model": str(tmp_path), "served_model_name": "mine", "tokenizer": "/tok"}
    ecfg, _ = resolve_configs(yaml, {"load_format": "dummy"})
    assert (ecfg.served_model_name, ecfg.tokenizer) == ("mine", "/tok")


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--enforce-eager"], "--enforce-eager: refused: .*no eager mode"),
        (["--compilation-config", '{"cudagraph_mode": "FULL"}'], "torch.compile"),
        (["--moe-backend", "triton"], "--moe-backend: refused"),
        (["--mm-encoder-tp-mode", "data"], "text model alone"),
        (["--limit-mm-per-prompt", '{"image": 2}'], "only limits of 0"),
        (["--limit-mm-per-prompt", "{image"], "not valid JSON"),
        (["--tokenizer-mode", "mistral"], "'mistral' is refused, \\['auto', 'hf'\\] taken"),
        (["--mamba-ssm-cache-dtype", "float32"], "kept in the model's dtype"),
        (["--pipeline-parallel-size", "2"], "one pipeline stage"),
        (["--max-cudagraph-capture-size", "256"], "--max-cudagraph-capture-size: refused"),
        (["--load-format", "dummy"], "needs a model directory with a config.json"),
        (["--no-enable-chunked-prefill"], "always chunks prompts.*cannot be turned off"),
        (["--hf-overrides", "[1]"], "--hf-overrides: expected a JSON object, got list"),
        (["--hf-overrides", "{rope"], "--hf-overrides: not valid JSON"),
        (["--revision", "v2.0"], "--revision: 'v2.0' is refused, \\['main'\\] taken: .*local"),
        (["--tokenizer-revision", "abc123"], "no hub downloads"),
        (["--code-revision", "dev"], "no hub downloads"),
        (["--download-dir", "/models"], "--download-dir: refused: paxengine downloads nothing"),
        (["--max-num-partial-prefills", "4"], "no per-prompt chunk cap"),
        (["--max-long-partial-prefills", "2"], "no per-prompt chunk cap"),
        (["--long-prefill-token-threshold", "512"], "'512' is refused, \\['0'\\] taken"),
        (["--enable-lora"], "--enable-lora: refused: LoRA adapters are not implemented"),
        (["--lora-modules", "a=/x", "b=/y"], "--lora-modules: refused: LoRA"),
        (["--max-loras", "4"], "--max-loras: refused: LoRA"),
        (["--max-lora-rank", "64"], "--max-lora-rank: refused: LoRA"),
        (["--no-disable-log-stats"], "no periodic throughput lines.*cannot be turned off"),
        (["--no-disable-cascade-attn"], "no cascade attention.*cannot be turned off"),
        (["--no-enable-prompt-tokens-details"], "always reports.*cannot be turned off"),
        (
            ["--num-gpu-blocks-override", "8", "--num-kv-blocks", "16"],
            "--num-gpu-blocks-override 8 and --num-kv-blocks 16: the same setting twice",
        ),
    ],
)
def test_what_paxengine_does_not_have_is_refused_naming_the_flag(flags, match, capsys):
    with pytest.raises(SystemExit):
        parse(flags)
    assert re.search(match, capsys.readouterr().err), flags


def test_yaml_keys_go_the_same_way():
    yaml = {"async_scheduling": True, "trust_remote_code": True, "pipeline_parallel_size": 1}
    _, scfg = resolve_configs(yaml, {})
    assert len(scfg.vllm_flag_notes) == 3
    with pytest.raises(ValueError, match="cannot be turned off"):
        resolve_configs({"enable_chunked_prefill": False}, {})
    with pytest.raises(ValueError, match="--enforce-eager: refused"):
        resolve_configs({"enforce_eager": True}, {})


def test_every_refused_flag_is_refused_with_its_reason(capsys):
    from serving import vllm_flags

    for name, why in vllm_flags.REFUSED.items():
        flag = "--" + name.replace("_", "-")
        for args in ([flag], [flag, "x"]):  # a switch or with a value
            with pytest.raises(SystemExit):
                parse(args)
            assert f"{flag}: refused: {why}" in capsys.readouterr().err, args


def test_more_recipe_flags_are_taken(capsys):
    """The other model families' recipes: vLLM's executor, swap space and attention backend
    names, and fp8_e4m3 (vLLM's other name for the fp8 KV cache) start the server."""
    from paxengine.engine_setup import check_config

    ecfg, scfg = parse(
        [
            "--distributed-executor-backend",
            "mp",
            "--swap-space",
            "16",
            "--attention-backend",
            "FLASHINFER",
            "--kv-cache-dtype",
            "fp8_e4m3",
        ]
    )
    notes = "\n".join(scfg.vllm_flag_notes)
    for flag in ("--distributed-executor-backend mp", "--swap-space 16", "FLASHINFER"):
        assert flag in notes
    assert ecfg.attention_backend == parse([])[0].attention_backend  # the default's kernels
    assert check_config(ecfg, on_gpu=False).kv_dtype_name == "fp8"
    assert parse(["--attention-backend", "xla"])[0].attention_backend == "xla"
    with pytest.raises(SystemExit):
        parse(["--distributed-executor-backend", "ray"])
    assert "'ray' is refused" in capsys.readouterr().err


def test_vllms_flags_of_what_paxengine_does_anyway_are_taken(capsys):
    """vLLM's flags that ask what paxengine does (no periodic stats lines, cached tokens in the
    usage, no cascade attention, the local model as it is, no per-prompt chunk cap at vLLM's
    defaults) start the server, logged; --num-gpu-blocks-override is --num-kv-blocks. The YAML
    keys go the same way."""
    flags = [
        "--disable-log-stats",
        "--enable-prompt-tokens-details",
        "--disable-cascade-attn",
        "--revision",
        "main",
        "--code-revision",
        "main",
        "--tokenizer-revision",
        "main",
        "--max-num-partial-prefills",
        "1",
        "--max-long-partial-prefills",
        "1",
        "--long-prefill-token-threshold",
        "0",
        "--num-gpu-blocks-override",
        "64",
    ]
    ecfg, scfg = parse(flags)
    assert ecfg.num_kv_blocks == 64
    notes = "\n".join(scfg.vllm_flag_notes)
    for flag in flags:
        if flag.startswith("--"):
            assert flag in notes, flag
    assert "--num-gpu-blocks-override 64: taken as --num-kv-blocks 64" in notes
    yaml = {
        "disable_log_stats": True,
        "revision": "main",
        "long_prefill_token_threshold": 0,
        "num_gpu_blocks_override": 32,
    }
    ecfg, scfg = resolve_configs(yaml, {})
    assert ecfg.num_kv_blocks == 32 and len(scfg.vllm_flag_notes) == 4
    # the flag wins over the YAML's, as any flag
    assert (
        resolve_configs({"num_kv_blocks": 8}, {"num_gpu_blocks_override": 16})[0].num_kv_blocks
        == 16
    )
    for bad, match in [({"revision": "v2"}, "no hub downloads"), ({"enable_lora": True}, "LoRA")]:
        with pytest.raises(ValueError, match=match):
            resolve_configs(bad, {})


FRONTEND = {  # vLLM's frontend flags and the ServerConfig they make
    "--uvicorn-log-level": ("trace", "uvicorn_log_level", "trace"),
    "--disable-uvicorn-access-log": (None, "disable_uvicorn_access_log", True),
    "--root-path": ("/proxy/", "root_path", "/proxy"),
    "--disable-fastapi-docs": (None, "disable_fastapi_docs", True),
    "--enable-log-requests": (None, "enable_log_requests", True),
    "--enable-log-outputs": (None, "enable_log_outputs", True),
    "--max-log-len": ("100", "max_log_len", 100),
    "--enable-force-include-usage": (None, "enable_force_include_usage", True),
    "--return-tokens-as-token-ids": (None, "return_tokens_as_token_ids", True),
    "--max-logprobs": ("5", "max_logprobs", 5),
    "--response-role": ("bot", "response_role", "bot"),
    "--trust-request-chat-template": (None, "trust_request_chat_template", True),
    "--override-generation-config": (
        '{"temperature": 0.5, "max_new_tokens": 64}',
        "override_generation_config",
        {"temperature": 0.5, "max_new_tokens": 64},
    ),
    "--exclude-tools-when-tool-choice-none": (None, "exclude_tools_when_tool_choice_none", True),
    "--enable-log-deltas": (None, "enable_log_deltas", True),
    "--uds": ("/tmp/paxengine.sock", "uds", "/tmp/paxengine.sock"),
    "--disable-access-log-for-endpoints": (
        "/health, /metrics",
        "disable_access_log_for_endpoints",
        ["/health", "/metrics"],
    ),
    "--h11-max-incomplete-event-size": ("65536", "h11_max_incomplete_event_size", 65536),
    "--h11-max-header-count": ("64", "h11_max_header_count", 64),
    "--enable-tokenizer-info-endpoint": (None, "enable_tokenizer_info_endpoint", True),
}


def test_vllms_frontend_flags_reach_the_server_config(tmp_path):
    """Each of vLLM's frontend flags paxengine implements (its behaviour: the tests of
    test_server_frontend_flags.py) sets its ServerConfig key, from the command line and from the
    YAML alike; defaults as vLLM's."""
    argv = []
    for flag, (value, _, _) in FRONTEND.items():
        argv += [flag] + ([value] if value is not None else [])
    _, scfg = parse(argv)
    for flag, (_, key, want) in FRONTEND.items():
        assert getattr(scfg, key) == want, flag
    assert not scfg.vllm_flag_notes  # implemented, not taken as something else
    yaml = tmp_path / "serve.yaml"
    yaml.write_text("".join(f"{key}: {json.dumps(want)}\n" for _, key, want in FRONTEND.values()))
    _, from_yaml = parse(["--config", str(yaml)])
    for flag, (_, key, want) in FRONTEND.items():
        assert getattr(from_yaml, key) == want, flag
    # the YAML's JSON text too, as the flag's
    _, scfg = resolve_configs({"override_generation_config": '{"top_k": 20}'}, {})
    assert scfg.override_generation_config == {"top_k": 20}
    d = parse([])[1]
    assert (d.max_logprobs, d.response_role, d.ssl_cert_reqs, d.uvicorn_log_level) == (
        20,
        "assistant",
        0,
        None,
    )
    switches = [key for value, key, _ in FRONTEND.values() if value is None]
    assert not any(getattr(d, key) for key in switches)
    _, scfg = parse(["--enable-log-requests", "--no-enable-log-requests"])
    assert scfg.enable_log_requests is False
    assert d.enable_log_deltas is None  # vLLM's default: on (under --enable-log-outputs)
    assert parse(["--no-enable-log-deltas"])[1].enable_log_deltas is False


def test_more_frontend_keys_from_files(tmp_path):
    """--log-config-file (a dictConfig JSON file, read at start-up) and --ssl-ciphers (with a
    certificate), from the command line and the YAML."""
    conf = tmp_path / "log.json"
    conf.write_text(json.dumps({"version": 1, "disable_existing_loggers": False}))
    pem = tmp_path / "x.pem"
    pem.write_text("not checked here: uvicorn loads it")
    cipher = "ECDHE-ECDSA-AES128-GCM-SHA256"
    argv = ["--log-config-file", str(conf), "--ssl-certfile", str(pem), "--ssl-ciphers", cipher]
    _, scfg = parse(argv)
    assert (scfg.log_config_file, scfg.ssl_ciphers) == (str(conf), cipher)
    keys = {"log_config_file": str(conf), "ssl_certfile": str(pem), "ssl_ciphers": cipher}
    _, scfg = resolve_configs(keys, {})
    assert (scfg.log_config_file, scfg.ssl_ciphers) == (str(conf), cipher)
    bad = tmp_path / "bad.json"
    for text, match in [("{", "is not a JSON file"), ("[1]", 'needs "version": 1')]:
        bad.write_text(text)
        with pytest.raises(ValueError, match=match):
            resolve_configs({"log_config_file": str(bad)}, {})
    for keys, match in [
        ({"log_config_file": "/no/such.json"}, "log_config_file: '/no/such.json' is not a JSON"),
        ({"ssl_ciphers": cipher}, "ssl_ciphers: needs ssl_certfile"),
        ({"ssl_certfile": str(pem), "ssl_ciphers": "NO-SUCH"}, "selects no cipher from"),
        ({"uds": "/no/such/dir/x.sock"}, "uds: a socket path in an existing directory"),
        ({"uds": "/tmp/" + "x" * 120}, "uds: at most 107 bytes"),
        ({"disable_access_log_for_endpoints": "health"}, "paths starting with '/'"),
        ({"disable_access_log_for_endpoints": ["/a", 3]}, "paths starting with '/'"),
        ({"h11_max_header_count": 0}, "h11_max_header_count: a positive integer"),
        ({"h11_max_incomplete_event_size": True}, "h11_max_incomplete_event_size: a positive"),
        ({"enable_log_deltas": "yes"}, "enable_log_deltas: true or false"),
        ({"exclude_tools_when_tool_choice_none": 1}, "must be true or false"),
    ]:
        with pytest.raises(ValueError, match=match):
            resolve_configs(keys, {})


def test_vllms_frontend_switches_taken_or_refused(capsys):
    """--enable-request-id-headers is what paxengine always does (its --no- form refused);
    --no-enable-lora and --no-enable-ssl-refresh ask for what paxengine does; --middleware
    (user code) and --enable-ssl-refresh are refused naming why. The YAML keys alike."""
    flags = ["--enable-request-id-headers", "--no-enable-lora", "--no-enable-ssl-refresh"]
    _, scfg = parse(flags)
    notes = "\n".join(scfg.vllm_flag_notes)
    for flag in flags:
        assert flag + ": " in notes, flag
    assert "X-Request-Id" in notes and "LoRA adapters are not implemented" in notes
    yaml = {"enable_request_id_headers": True, "enable_lora": False, "enable_ssl_refresh": False}
    assert len(resolve_configs(yaml, {})[1].vllm_flag_notes) == 3
    for argv, match in [
        (["--middleware", "my.module.Middleware"], "--middleware: refused: .*imports no code"),
        (["--enable-ssl-refresh"], "--enable-ssl-refresh: refused: .*at start-up"),
        (["--no-enable-request-id-headers"], "X-Request-Id.*cannot be turned off"),
    ]:
        with pytest.raises(SystemExit):
            parse(argv)
        assert re.search(match, capsys.readouterr().err), argv
    with pytest.raises(ValueError, match="--middleware: refused"):
        resolve_configs({"middleware": ["a.B"]}, {})


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--uvicorn-log-level", "loud"], "invalid choice: 'loud'"),
        (["--max-logprobs", "21"], "max_logprobs: an integer in \\[0, 20\\].*top 20"),
        (["--max-logprobs", "-1"], "the whole vocabulary, is not served"),
        (["--enable-log-outputs"], "enable_log_outputs: needs enable_log_requests"),
        (["--max-log-len", "-3"], "max_log_len: an integer >= 0"),
        (["--response-role", ""], "response_role: a non-empty string"),
        (["--root-path", "api"], "root_path: a path starting with '/'"),
        (["--override-generation-config", "[1]"], "expected a JSON object, got list"),
        (["--override-generation-config", '{"do_sample": true}'], "\\['do_sample'\\] are not"),
        (["--override-generation-config", '{"top_p": "high"}'], "top_p must be a number"),
        (["--ssl-certfile", "/no/such.pem"], "ssl_certfile: '/no/such.pem' is not a file"),
        (["--ssl-cert-reqs", "3"], "invalid choice: 3"),
    ],
)
def test_bad_frontend_values_are_refused_naming_the_key(flags, match, capsys):
    with pytest.raises(SystemExit):
        parse(flags)
    assert re.search(match, capsys.readouterr().err), flags


def test_https_keys_are_checked_before_anything_loads(tmp_path):
    pem = tmp_path / "x.pem"
    pem.write_text("not checked here: uvicorn loads it")
    ok = dict(ssl_certfile=str(pem), ssl_keyfile=str(pem))
    _, scfg = parse(["--ssl-certfile", str(pem), "--ssl-keyfile", str(pem)])
    assert (scfg.ssl_certfile, scfg.ssl_keyfile) == (str(pem), str(pem))
    for keys, match in [
        ({"ssl_keyfile": str(pem)}, "ssl_keyfile: needs ssl_certfile"),
        ({"ssl_ca_certs": str(pem)}, "ssl_ca_certs: needs ssl_certfile"),
        ({**ok, "ssl_cert_reqs": 2}, "need ssl_ca_certs"),
        ({**ok, "ssl_cert_reqs": True}, "ssl_cert_reqs: 0"),
        ({"disable_fastapi_docs": "yes"}, "disable_fastapi_docs: must be true or false"),
    ]:
        with pytest.raises(ValueError, match=match):
            resolve_configs(keys, {})
    _, scfg = resolve_configs({**ok, "ssl_ca_certs": str(pem), "ssl_cert_reqs": 2}, {})
    assert scfg.ssl_cert_reqs == 2
