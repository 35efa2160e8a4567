"""vLLM's `vllm serve` frontend flags that paxengine serves as vLLM does (their parsing:
test_vllm_flags.py): the in-process app around the fake engine (seconds, no model), and uvicorn
over HTTPS with a certificate made here."""

from __future__ import annotations

import json
import logging
import shutil
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
    uvicorn.Config; the TLS keys only with a certificate."""
    from serving.cli import uvicorn_options

    kw = uvicorn_options(ServerConfig(log_level="debug"))
    assert kw["log_level"] == "debug" and kw["access_log"] is True
    assert not any(k.startswith("ssl_") for k in kw)
    kw = uvicorn_options(
        ServerConfig(uvicorn_log_level="warning", disable_uvicorn_access_log=True, port=9)
    )
    assert (kw["log_level"], kw["access_log"], kw["port"]) == ("warning", False, 9)


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


def test_https_with_the_ssl_flags(tmp_path):
    """--ssl-certfile / --ssl-keyfile: uvicorn serves HTTPS (a self-signed certificate made
    here; the client does not verify it); plain HTTP gets no answer; the start-up line's URL
    says https."""
    import socket

    import uvicorn

    from serving.cli import describe, uvicorn_options

    cert, key = _self_signed(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = ServerConfig(port=port, ssl_certfile=cert, ssl_keyfile=key, log_level="warning")
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
    finally:
        server.should_exit = True
        thread.join(10)
