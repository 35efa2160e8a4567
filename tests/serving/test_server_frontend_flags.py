"""vLLM's `vllm serve` frontend flags that paxengine serves as vLLM does (their parsing:
test_vllm_flags.py): the in-process app around the fake engine (seconds, no model), and uvicorn
over HTTPS with a certificate made here."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time

import httpx
import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from serving.app import build_app
from serving.config import ServerConfig

CHAT = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 4}


def _client(**server) -> TestClient:
    return TestClient(build_app(FakeEngine(), ServerConfig(**server)))


def _sse(c: TestClient, route: str, body: dict) -> list[dict]:
    with c.stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def _param(r) -> str:
    assert r.status_code == 400, r.text
    return r.json()["error"]["param"]


def test_root_path_names_the_proxys_prefix():
    """--root-path: the OpenAPI document's servers name the prefix (the docs call through it);
    requests come with the prefix (a proxy that keeps it) or without (one that strips it)."""
    with _client(root_path="/proxy") as c:
        spec = c.get("/openapi.json").json()
        assert spec["servers"] == [{"url": "/proxy"}]
        assert "/v1/chat/completions" in spec["paths"]
        assert c.get("/proxy/v1/models").json()["data"][0]["id"] == "fake-model"
        assert c.get("/v1/models").status_code == 200
        assert c.get("/docs").status_code == 200
    with _client() as c:
        assert "servers" not in c.get("/openapi.json").json()


def test_disable_fastapi_docs():
    """--disable-fastapi-docs: no /docs, /redoc, /openapi.json; the API as before."""
    with _client(disable_fastapi_docs=True) as c:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert c.get(path).status_code == 404, path
        assert c.get("/health").status_code == 200
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    with _client() as c:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert c.get(path).status_code == 200, path


def test_force_include_usage_puts_usage_in_every_stream():
    """--enable-force-include-usage (vLLM's should_include_usage): a stream without
    stream_options ends with the usage chunk, and every chunk carries the usage so far; without
    the flag no usage unless asked."""
    with _client(enable_force_include_usage=True) as c:
        for route, body in (
            ("/v1/chat/completions", CHAT),
            ("/v1/completions", {"prompt": "hello", "max_tokens": 4}),
        ):
            chunks = _sse(c, route, body)
            assert all(ch["usage"] is not None for ch in chunks), route
            last = chunks[-1]
            assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
            u = last["usage"]
            assert u["total_tokens"] == u["prompt_tokens"] + 4 and u["prompt_tokens"] > 0
            assert c.post(route, json=body).json()["usage"]["completion_tokens"] == 4
    with _client() as c:
        chunks = _sse(c, "/v1/chat/completions", CHAT)
        assert all(ch.get("usage") is None for ch in chunks)


def test_return_tokens_as_token_ids_for_every_request():
    """--return-tokens-as-token-ids: every request's logprob tokens are "token_id:N" (the
    request's own field asks for it alone, as before)."""
    with _client(return_tokens_as_token_ids=True) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2})
        choice = r.json()["choices"][0]
        content = choice["logprobs"]["content"]
        assert len(content) == 4
        for entry, ch in zip(content, choice["message"]["content"]):
            assert entry["token"] == f"token_id:{ord(ch)}"
            assert all(t["token"].startswith("token_id:") for t in entry["top_logprobs"])
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 2})
        lp = r.json()["choices"][0]["logprobs"]
        assert all(t.startswith("token_id:") for t in lp["tokens"])
        assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
    with _client() as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 2})
        assert not any(
            t.startswith("token_id:") for t in r.json()["choices"][0]["logprobs"]["tokens"]
        )


def test_max_logprobs_refuses_more_with_a_400_naming_the_field():
    """--max-logprobs N: top_logprobs, a completion's logprobs and prompt_logprobs up to N are
    served, more is a 400 naming the field (vLLM's message)."""
    with _client(max_logprobs=2) as c:
        ok = c.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2})
        assert ok.status_code == 200
        r = c.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 3})
        assert _param(r) == "top_logprobs"
        assert "greater than max allowed: 2" in r.json()["error"]["message"]
        body = {"prompt": "hi", "max_tokens": 2}
        assert c.post("/v1/completions", json={**body, "logprobs": 2}).status_code == 200
        assert _param(c.post("/v1/completions", json={**body, "logprobs": 3})) == "logprobs"
        r = c.post("/v1/completions", json={**body, "prompt_logprobs": 3})
        assert _param(r) == "prompt_logprobs"
        assert _param(c.post("/v1/chat/completions", json={**CHAT, "prompt_logprobs": 5})) == (
            "prompt_logprobs"
        )
    with _client() as c:  # vLLM's default: 20
        r = c.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 20})
        assert r.status_code == 200
        assert _param(c.post("/v1/completions", json={"prompt": "x", "logprobs": 21})) == "logprobs"


def test_response_role_names_the_answers_role():
    """--response-role: a chat answer's role when add_generation_prompt is true (the message's
    and the stream's first delta); without a new turn the last message's role, as before."""
    with _client(response_role="bot") as c:
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.json()["choices"][0]["message"]["role"] == "bot"
        assert _sse(c, "/v1/chat/completions", CHAT)[0]["choices"][0]["delta"]["role"] == "bot"
        body = {**CHAT, "add_generation_prompt": False}
        r = c.post("/v1/chat/completions", json=body)
        assert r.json()["choices"][0]["message"]["role"] == "user"


def _word_engine() -> FakeEngine:
    """The fake engine with a real Tokenizer (words of a tiny vocabulary) and its own template."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from paxengine.tokenizer import Tokenizer

    words = ["[UNK]", "MODEL", "REQUEST", "hello", "world", "user"]
    hf = HFTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    hf.pre_tokenizer = Whitespace()
    engine = FakeEngine()
    engine.tokenizer = Tokenizer(
        hf,
        bos_token=None,
        eos_token=None,
        chat_template="MODEL {% for m in messages %}{{ m.content }} {% endfor %}",
    )
    return engine


def test_a_requests_chat_template_needs_the_servers_trust():
    """vLLM's rule: a request's own chat_template is a 400 naming it unless the server runs with
    --trust-request-chat-template; with it, the request's template renders that request's prompt
    (/tokenize and a chat's prompt tokens), others keep the model's; a template Jinja cannot
    parse is a 400 naming chat_template."""
    ours = "REQUEST {% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}"
    msgs = [{"role": "user", "content": "hello world"}]
    with TestClient(build_app(_word_engine(), ServerConfig())) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "chat_template": ours})
        assert _param(r) == "chat_template"
        assert "--trust-request-chat-template" in r.json()["error"]["message"]
        r = c.post("/tokenize", json={"messages": msgs, "chat_template": ours})
        assert _param(r) == "chat_template"
    with TestClient(build_app(_word_engine(), ServerConfig(trust_request_chat_template=True))) as c:
        r = c.post("/tokenize", json={"messages": msgs, "chat_template": ours})
        assert r.json()["tokens"] == [2, 5, 3, 4]  # REQUEST user hello world
        assert c.post("/tokenize", json={"messages": msgs}).json()["tokens"] == [1, 3, 4]
        body = {**CHAT, "chat_template": ours, "return_token_ids": True}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["prompt_token_ids"] == [2, 5, 3, 4]
        r = c.post("/v1/chat/completions", json={**CHAT, "return_token_ids": True})
        assert r.json()["prompt_token_ids"] == [1, 3, 4]
        r = c.post("/v1/chat/completions", json={**CHAT, "chat_template": "{% for %}"})
        assert _param(r) == "chat_template"
        assert "not a valid Jinja template" in r.json()["error"]["message"]
        state = c.app.state.serving
        assert list(state._request_templates) == [ours]  # compiled once, kept by its text


def test_override_generation_config_over_the_models_defaults(tmp_path):
    """--override-generation-config: generation_config.json's fields over the model's file (or
    alone: no file, --generation-config vllm); a request's own values still win."""
    from paxengine.config import EngineConfig
    from serving.generation import ServerState

    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 7})
    )
    override = '{"temperature": 0.25, "top_k": 0, "max_new_tokens": 3}'
    engine = FakeEngine(EngineConfig(max_model_len=128, served_model_name="m", model=str(tmp_path)))
    state = ServerState.create(engine, ServerConfig(override_generation_config=override))
    assert state.defaults == {"temperature": 0.25, "top_p": 0.9, "top_k": -1, "max_tokens": 3}
    alone = ServerConfig(override_generation_config=override, generation_config="vllm")
    assert ServerState.create(engine, alone).defaults == {
        "temperature": 0.25,
        "top_k": -1,
        "max_tokens": 3,
    }
    assert ServerState.create(FakeEngine(), ServerConfig()).defaults == {}
    with TestClient(build_app(engine, ServerConfig(override_generation_config=override))) as c:
        r = c.post("/v1/chat/completions", json={"messages": CHAT["messages"]})
        assert r.json()["usage"]["completion_tokens"] == 3
        assert c.post("/v1/chat/completions", json=CHAT).json()["usage"]["completion_tokens"] == 4


def test_request_and_output_logs(caplog):
    """--enable-log-requests: a line per engine request with its prompt's text and token ids
    (cut to --max-log-len) and params; --enable-log-outputs: a line per finished output (its
    text cut too). Neither by default."""
    cfg = dict(enable_log_requests=True, enable_log_outputs=True, max_log_len=5)
    with caplog.at_level(logging.INFO, logger="serving"), _client(**cfg) as c:
        caplog.clear()
        out = c.post("/v1/chat/completions", json={**CHAT, "request_id": "r1"}).json()
        text = out["choices"][0]["message"]["content"]
        c.post("/v1/completions", json={"prompt": [104, 105], "max_tokens": 2, "n": 2})
    log = caplog.text
    # the fake template: "<user>hello world\n<assistant>", its first 5 characters and ids
    line = "Received request chatcmpl-r1-0: prompt: '<user', prompt_token_ids: "
    assert line + "[60, 117, 115, 101, 114], params: SamplingParams(" in log
    assert f"Generated response chatcmpl-r1-0: output: {text!r}, finish_reason: length" in log
    assert "prompt: None, prompt_token_ids: [104, 105]" in log  # a prompt of token ids
    assert "(choice 1): output: " in log
    with caplog.at_level(logging.INFO, logger="serving"), _client() as c:
        caplog.clear()
        c.post("/v1/chat/completions", json=CHAT)
    assert "Received request" not in caplog.text and "Generated response" not in caplog.text


# ------------------------------------------------------------------------------ uvicorn


def test_uvicorn_options_from_the_flags():
    """--uvicorn-log-level (else --log-level's) and --disable-uvicorn-access-log reach
    uvicorn.Config; the TLS keys only with a certificate; --uds and
    --h11-max-incomplete-event-size (with the h11 protocol) when given."""
    from serving.frontend_flags import uvicorn_options

    kw = uvicorn_options(ServerConfig(log_level="debug"))
    assert kw["log_level"] == "debug" and kw["access_log"] is True
    assert not any(k.startswith("ssl_") for k in kw)
    kw = uvicorn_options(
        ServerConfig(uvicorn_log_level="warning", disable_uvicorn_access_log=True, port=9)
    )
    assert (kw["log_level"], kw["access_log"], kw["port"]) == ("warning", False, 9)
    assert not {"uds", "log_config", "http", "ssl_ciphers"} & set(kw)  # uvicorn's defaults
    kw = uvicorn_options(ServerConfig(uds="/tmp/x.sock", h11_max_incomplete_event_size=4096))
    assert (kw["uds"], kw["http"], kw["h11_max_incomplete_event_size"]) == (
        "/tmp/x.sock",
        "h11",
        4096,
    )


def _self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key: the `cryptography` package's, else openssl's."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    try:
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor openssl to make a certificate")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
             "-subj", "/CN=127.0.0.1"],
            check=True,
            capture_output=True,
        )  # fmt: skip
        return str(cert), str(key)
    pk = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    c = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(pk.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(pk, hashes.SHA256())
    )
    cert.write_bytes(c.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        pk.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert), str(key)


def _tls12_cipher(port: int, cipher: str) -> str:
    """The cipher a TLS 1.2 client offering only `cipher` agrees on with the server."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers(cipher)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw) as s:
            return s.cipher()[0]


def test_https_with_the_ssl_flags(tmp_path):
    """--ssl-certfile / --ssl-keyfile: uvicorn serves HTTPS (a self-signed certificate made
    here; the client does not verify it); plain HTTP gets no answer; the start-up line's URL
    says https. --ssl-ciphers: the TLS 1.2 ciphers it takes."""
    import uvicorn

    from serving.cli import describe
    from serving.frontend_flags import uvicorn_options

    cert, key = _self_signed(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cipher = "ECDHE-ECDSA-AES128-GCM-SHA256"  # the certificate's key is EC
    cfg = ServerConfig(
        port=port, ssl_certfile=cert, ssl_keyfile=key, ssl_ciphers=cipher, log_level="warning"
    )
    engine = FakeEngine()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, cfg), **uvicorn_options(cfg)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        r = httpx.get(f"https://127.0.0.1:{port}/health", verify=False, timeout=10)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert f"url=https://127.0.0.1:{port}/v1" in describe(engine, cfg)
        # --ssl-ciphers: TLS 1.2 agrees on the one cipher the server allows, or on none
        assert _tls12_cipher(port, cipher) == cipher
        with pytest.raises(ssl.SSLError):
            _tls12_cipher(port, "ECDHE-ECDSA-AES256-GCM-SHA384")
    finally:
        server.should_exit = True
        thread.join(10)


# ------------------------------------------------------------------------------ more of vLLM's flags
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def _recording(template: str) -> tuple[FakeEngine, list]:
    """The word engine with `template`, recording the variables each render gets."""
    engine, seen = _word_engine(), []
    tok = engine.tokenizer.with_chat_template(template)
    render = tok.apply_chat_template

    def apply(messages, *args, **variables):
        seen.append({"messages": messages, **variables})
        return render(messages, *args, **variables)

    tok.apply_chat_template = apply
    engine.tokenizer = tok
    return engine, seen


def test_exclude_tools_when_tool_choice_none():
    """vLLM's default: tool_choice "none" still shows the tools to a template that renders them
    (the model's calls stay text); --exclude-tools-when-tool-choice-none keeps them out. A
    template that does not render tools gets none either way (no Hermes prompt); tool_choice
    required shows them with the flag too."""
    renders = "MODEL {% for m in messages %}{{ m.content }} {% endfor %}{{ tools | length }}"
    body = {**CHAT, "tools": [TOOL], "tool_choice": "none"}
    for exclude, want in ((False, [TOOL]), (True, None)):
        engine, seen = _recording(renders)
        cfg = ServerConfig(exclude_tools_when_tool_choice_none=exclude)
        with TestClient(build_app(engine, cfg)) as c:
            assert c.post("/v1/chat/completions", json=body).status_code == 200
            assert seen[-1].get("tools") == want, exclude
            r = c.post("/v1/chat/completions", json={**body, "tool_choice": "required"})
            assert r.status_code == 200 and seen[-1]["tools"] == [TOOL]
    engine, seen = _recording("MODEL {% for m in messages %}{{ m.content }} {% endfor %}")
    with TestClient(build_app(engine, ServerConfig())) as c:
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        assert "tools" not in seen[-1] and [m["role"] for m in seen[-1]["messages"]] == ["user"]


def test_log_deltas_under_log_outputs(caplog):
    """--enable-log-outputs logs a streamed chat's and completion's deltas too (vLLM's
    --enable-log-deltas, on by default), cut to --max-log-len; --no-enable-log-deltas: only
    the finished outputs; a request that does not stream logs no deltas."""
    cfg = dict(enable_log_requests=True, enable_log_outputs=True, max_log_len=3)
    with caplog.at_level(logging.INFO, logger="serving"), _client(**cfg) as c:
        caplog.clear()
        chunks = _sse(c, "/v1/chat/completions", {**CHAT, "request_id": "d1"})
        text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks)
        lines = [r.getMessage() for r in caplog.records if "(streaming delta)" in r.getMessage()]
        assert len(lines) == 4 and all(
            x.startswith("Generated response chatcmpl-d1-0") for x in lines
        )
        assert lines[0].endswith(f"output: {text[0]!r}")
        assert f"Generated response chatcmpl-d1-0: output: {text[:3]!r}" in caplog.text
        _sse(c, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 2})
        assert "(choice 1) (streaming delta)" in caplog.text
        caplog.clear()
        c.post("/v1/chat/completions", json=CHAT)
        assert "(streaming delta)" not in caplog.text and "Generated response" in caplog.text
    with (
        caplog.at_level(logging.INFO, logger="serving"),
        _client(**cfg, enable_log_deltas=False) as c,
    ):
        caplog.clear()
        _sse(c, "/v1/chat/completions", CHAT)
        assert "(streaming delta)" not in caplog.text and "Generated response" in caplog.text


def test_tokenizer_info_endpoint():
    """--enable-tokenizer-info-endpoint: GET /tokenizer_info, vLLM's shape (the tokenizer's
    configuration, its class and the chat template in use), behind the API key; off: 404."""
    with TestClient(build_app(_word_engine(), ServerConfig())) as c:
        assert c.get("/tokenizer_info").status_code == 404
    cfg = ServerConfig(enable_tokenizer_info_endpoint=True, api_key="k")
    with TestClient(build_app(_word_engine(), cfg)) as c:
        assert c.get("/tokenizer_info").status_code == 401
        info = c.get("/tokenizer_info", headers={"Authorization": "Bearer k"}).json()
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["chat_template"].startswith("MODEL {% for m in messages %}")
    assert info["add_bos_token"] is False and info["added_tokens_decoder"] == {}
    with TestClient(
        build_app(FakeEngine(), ServerConfig(enable_tokenizer_info_endpoint=True))
    ) as c:
        assert c.get("/tokenizer_info").json() == {"tokenizer_class": "PreTrainedTokenizerFast"}


def test_header_count_limit():
    """--h11-max-header-count N: a request with more than N headers gets a 431 (X-Request-Id
    still on it); up to N, served."""
    with _client(h11_max_header_count=12) as c:
        assert c.get("/health").status_code == 200  # the test client's few headers
        many = {f"x-extra-{i}": "1" for i in range(12)}
        r = c.get("/health", headers=many)
        assert r.status_code == 431 and r.headers["x-request-id"]
        assert r.json()["error"]["code"] == "request_header_fields_too_large"
    with _client() as c:
        assert (
            c.get("/health", headers={f"x-extra-{i}": "1" for i in range(300)}).status_code == 200
        )


def test_unix_socket_access_log_and_log_config(tmp_path):
    """paxengine serve's uvicorn server (frontend_flags.make_server) with --uds (a Unix socket, no TCP
    port), --log-config-file (its JSON sends uvicorn's access log to a file),
    --disable-access-log-for-endpoints (no line for /health) and
    --h11-max-incomplete-event-size (h11 serves; a request head still incomplete past it is a
    400)."""
    import tempfile

    from serving.cli import describe
    from serving.frontend_flags import filter_access_log, make_server

    sock = os.path.join(tempfile.mkdtemp(prefix="pax", dir="/tmp"), "s")  # short: sun_path
    access = tmp_path / "access.log"
    conf = tmp_path / "log.json"
    conf.write_text(
        json.dumps(
            {
                "version": 1,
                "disable_existing_loggers": False,
                "formatters": {"plain": {"format": "%(message)s"}},
                "handlers": {
                    "file": {
                        "class": "logging.FileHandler",
                        "filename": str(access),
                        "formatter": "plain",
                    }
                },  # fmt: skip
                "loggers": {"uvicorn.access": {"handlers": ["file"], "propagate": False}},
            }
        )
    )
    cfg = ServerConfig(
        uds=sock,
        log_config_file=str(conf),
        disable_access_log_for_endpoints="/health,/ping",
        h11_max_incomplete_event_size=4096,
        log_level="info",
    )
    engine = FakeEngine()
    server = make_server(build_app(engine, cfg), engine, cfg)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        assert server.config.http == "h11" and f"uds={sock}" in describe(engine, cfg)
        with httpx.Client(transport=httpx.HTTPTransport(uds=sock), timeout=10) as c:
            assert c.get("http://pax/health").json() == {"status": "ok"}
            assert c.get("http://pax/v1/models?x=1").status_code == 200
            assert c.get("http://pax/health?probe=1").status_code == 200
        # a request head still incomplete past 4096 bytes: h11's 400
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(sock)
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: pax\r\nX-Big: " + b"a" * 8192)
            assert s.recv(4096).startswith(b"HTTP/1.1 400 ")
    finally:
        server.should_exit = True
        thread.join(10)
        filter_access_log(None)
    logger = logging.getLogger("uvicorn.access")
    for h in list(logger.handlers):  # the file's handler goes with this test
        h.close()
        logger.removeHandler(h)
    lines = access.read_text().splitlines()
    assert any('"GET /v1/models?x=1 HTTP/1.1" 200' in x for x in lines), lines
    assert not any("/health" in x for x in lines), lines
