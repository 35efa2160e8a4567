"""Fast unit tests of the server's validation, shapes and config handling against a fake engine
(seconds; no model). The real SmolLM2 engine is exercised by the other test files."""

from __future__ import annotations

import json

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from serving.app import build_app
from serving.cli import parse
from serving.config import ServerConfig, resolve_configs


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine()
    with TestClient(build_app(engine, ServerConfig(api_key="k"))) as client:
        client.headers["Authorization"] = "Bearer k"
        yield engine, client


def _err(r, status, param=None):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    if param is not None:
        assert e["param"] == param, e


def test_completion_shapes(fake):
    _, c = fake
    r = c.post(
        "/v1/completions",
        json={
            "prompt": [[97, 98], [97, 98]],
            "n": 2,
            "max_tokens": 3,
            "seed": 1,
            "logprobs": 2,
            "echo": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2, 3]
    assert all(ch["text"].startswith("ab") and len(ch["text"]) == 5 for ch in body["choices"])
    lp = body["choices"][0]["logprobs"]
    # echo with logprobs: the prompt tokens' logprobs (the engine's prompt logprobs), the
    # first one's None (OpenAI's)
    assert lp["token_logprobs"][:2] == [None, -0.25] and len(lp["tokens"]) == 5
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"b": -0.25, "a": -2.0}
    # ... also as vLLM's prompt_logprobs (echo with logprobs asks for them)
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and plp[1] == {
        "98": {"logprob": -0.25, "rank": 1, "decoded_token": "b"},
        "97": {"logprob": -2.0, "rank": 2, "decoded_token": "a"},
    }
    plain = c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain["choices"][0]  # the field appears only when asked
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 12,
        "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_stream_equals_nonstream(fake):
    _, c = fake
    req = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "seed": 3,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
    }
    full = c.post("/v1/chat/completions", json=req).json()
    text = {0: "", 1: ""}
    usage = None
    with c.stream(
        "POST",
        "/v1/chat/completions",
        json={**req, "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        lines = [l for l in r.iter_lines() if l]
    assert lines[-1] == "data: [DONE]"
    for l in lines[:-1]:
        chunk = json.loads(l[len("data: ") :])
        assert chunk["object"] == "chat.completion.chunk"
        for ch in chunk["choices"]:
            text[ch["index"]] += ch["delta"].get("content", "")
        usage = chunk.get("usage") or usage
    assert [text[0], text[1]] == [ch["message"]["content"] for ch in full["choices"]]
    assert usage == full["usage"]
    assert len(full["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "top_k": -2}, "top_k"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 10**6}, "n"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
        ({"prompt": "x" * 500}, "prompt"),
        ({"prompt": [1, 999]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1], "a"]}, "prompt"),
        ({"prompt": "x", "stop_token_ids": [999]}, "stop_token_ids"),
        ({"prompt": "x", "logit_bias": {"999": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"temperature": 1}, "prompt"),
    ],
)
def test_bad_completion(fake, body, param):
    _, c = fake
    _err(c.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30},
            "top_logprobs",
        ),
    ],
)
def test_bad_chat(fake, body, param):
    _, c = fake
    _err(c.post("/v1/chat/completions", json=body), 400, param)


def test_bad_bodies_auth_model_overload(fake):
    engine, c = fake
    hdr = {"content-type": "application/json"}
    _err(c.post("/v1/completions", content=b"{not json", headers=hdr), 400)
    _err(c.post("/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers=hdr), 400)
    _err(c.post("/v1/completions", content=b"[1, 2]", headers=hdr), 400)
    _err(c.post("/v1/completions", content=b"", headers=hdr), 400)
    _err(c.post("/v1/completions", json={"prompt": "x", "model": "nope"}), 404, "model")
    _err(
        c.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer bad"}),
        401,
    )
    _err(c.get("/v1/models", headers={"Authorization": ""}), 401)
    _err(c.get("/nope"), 404)
    engine.waiting = 8
    r = c.post("/v1/completions", json={"prompt": "x"})
    _err(r, 503)
    assert r.headers["retry-after"] == "1"
    engine.waiting = 0
    engine.healthy = False
    _err(c.get("/health"), 503)
    engine.healthy = True
    assert c.get("/health").status_code == 200
    assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_odd_bodies_the_fuzz_found_are_400s_naming_the_field(fake):
    """test_server_fuzz.py's finds: a body nested past json.loads' recursion, and unknown fields
    whose names look like pydantic's union branches ("", "str", "list[int]") were 500s; a field
    inside a union (tool_choice, a Responses input item) was named with pydantic's branch name
    (tool_choice.NamedToolChoice.name, input.0.message.content)."""
    _, c = fake
    hdr = {"content-type": "application/json"}
    deep = b'{"prompt": "x", "stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for route in ("/v1/completions", "/invocations", "/tokenize"):
        r = c.post(route, content=deep, headers=hdr)
        _err(r, 400)
        assert "nested too deeply" in r.json()["error"]["message"]
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for name in ("", "str", "list[int]", "a.b"):
        _err(c.post("/v1/completions", json={"prompt": "x", name: 1}), 400, name)
        _err(c.post("/invocations", json={**chat, name: 1}), 400, name)
    tools = [{"type": "function", "function": {"name": "f"}}]
    named = {"type": "function", "function": {"name": "f"}, "str": 1}
    r = c.post("/v1/chat/completions", json={**chat, "tools": tools, "tool_choice": named})
    _err(r, 400, "tool_choice.str")
    named = {"type": "function", "function": {"name": "f", "x": 1}}
    r = c.post("/v1/chat/completions", json={**chat, "tools": tools, "tool_choice": named})
    _err(r, 400, "tool_choice.function.x")
    for item, param in (
        ({"role": "user", "content": 5}, "input.0.content"),
        ({"type": "function_call", "call_id": "c", "name": "f"}, "input.0.arguments"),
        ({"type": "reasoning", "summary": [], "content": "x"}, "input.0.content"),
        ({"type": "function_call_output", "call_id": "c", "output": "r", "": 1}, "input.0."),
    ):
        _err(c.post("/v1/responses", json={"input": [item]}), 400, param)
    r = c.post("/v1/responses", json={"input": "x", "tool_choice": {"type": "function", "x": 1}})
    _err(r, 400, "tool_choice.x")
    # the engine's names of a prompt and its budget, as each route's request names them
    long = [{"role": "user", "content": "x" * 500}]
    _err(c.post("/v1/chat/completions", json={"messages": long}), 400, "messages")
    r = c.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 10**6})
    _err(r, 400, "max_completion_tokens")
    _err(c.post("/v1/chat/completions", json={**chat, "max_tokens": 10**6}), 400, "max_tokens")
    _err(c.post("/v1/responses", json={"input": "x" * 500}), 400, "input")
    r = c.post("/v1/responses", json={"input": "x", "max_output_tokens": 10**6})
    _err(r, 400, "max_output_tokens")
    _err(c.post("/v1/completions", json={"prompt": "x" * 500}), 400, "prompt")
    assert c.post("/v1/chat/completions", json=chat).status_code == 200


def test_misc_endpoints(fake):
    _, c = fake
    assert c.get("/v1/models").json()["data"][0]["id"] == "fake-model"
    assert c.get("/version").json()["version"]
    t = c.post("/tokenize", json={"prompt": "abc"}).json()
    assert t["tokens"] == [97, 98, 99] and t["count"] == 3 and t["max_model_len"] == 128
    assert c.post("/detokenize", json={"tokens": [97, 98]}).json() == {"prompt": "ab"}
    assert (
        c.post("/tokenize", json={"messages": [{"role": "user", "content": "a"}]}).json()["count"]
        > 3
    )
    _err(c.post("/detokenize", json={"tokens": [9999]}), 400, "tokens")
    fams = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
    assert "paxengine:num_requests_running" in fams and "paxengine:request_success" in fams
    assert "paxengine:time_to_first_token_seconds" in fams


def test_config_precedence(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text(
        "max_num_seqs: 8\nport: 9001\nperformance_mode: throughput\nmetrics_prefix: vllm\n"
    )
    ecfg, scfg = parse(["--config", str(y), "--max-num-seqs", "4", "--no-enable-prefix-caching"])
    assert ecfg.max_num_seqs == 4  # flag beats YAML
    assert ecfg.max_num_batched_tokens == 8192  # preset from YAML's performance_mode
    assert (
        ecfg.enable_prefix_caching is False and scfg.port == 9001 and scfg.metrics_prefix == "vllm"
    )
    ecfg, scfg = parse(["--performance-mode", "interactivity", "--config", str(y)])
    assert ecfg.max_num_seqs == 8 and ecfg.max_num_batched_tokens == 512  # YAML beats preset
    ecfg, scfg = parse([])
    assert ecfg.model is None and scfg.host == "127.0.0.1"
    y.write_text("bogus_key: 1\n")
    with pytest.raises(SystemExit):
        parse(["--config", str(y)])
    with pytest.raises(ValueError):
        resolve_configs({"performance_mode": "fast"})


def test_cli_main_exit_codes(capsys):
    from serving.cli import main

    assert main(["serve", "--help"]) == 0
    assert "--max-num-batched-tokens" in capsys.readouterr().out
    assert main(["--port", "http"]) == 2
    assert main(["--performance-mode", "turbo"]) == 2


def test_serving_over_several_processes_is_refused_by_name(tmp_path, caplog):
    from serving.cli import main

    y = tmp_path / "mh.yaml"
    y.write_text("num_processes: 2\ncoordinator_address: 127.0.0.1:1\n")
    assert main(["--config", str(y)]) == 2
    assert "serving over several processes (num_processes=2) is not implemented" in caplog.text


def test_cli_main_wires_engine_app_and_uvicorn(monkeypatch, tmp_path, caplog):
    """`paxengine serve` with the engine and the server loop replaced: flags reach both, start-up
    is logged."""
    import logging

    import paxengine.async_engine
    import paxengine.engine_process
    import serving.cli

    seen = {}

    def fake_engine(kind):
        def build(cfg):
            seen["engine_config"], seen["kind"] = cfg, kind
            return FakeEngine(cfg)

        return build

    def fake_serve(app, engine, scfg):
        seen["app"], seen["server_config"] = app, scfg
        return 0

    monkeypatch.setattr(paxengine.async_engine, "AsyncEngine", fake_engine("thread"))
    monkeypatch.setattr(paxengine.engine_process, "ProcessEngine", fake_engine("process"))
    monkeypatch.setattr(serving.cli, "serve", fake_serve)
    from serving.cli import main

    assert main(["--no-engine-process"]) == 0 and seen["kind"] == "thread"

    with caplog.at_level(logging.INFO, logger="serving"):
        rc = main(
            [
                "serve",
                "--port",
                "8123",
                "--max-num-seqs",
                "3",
                "--served-model-name",
                "m",
                "--metrics-prefix",
                "vllm",
                "--performance-mode",
                "interactivity",
            ]
        )
    assert rc == 0 and seen["kind"] == "process"  # the default: the engine in its own process
    cfg = seen["engine_config"]
    assert cfg.max_num_seqs == 3 and cfg.max_num_batched_tokens == 512 and cfg.model is None
    assert seen["server_config"].port == 8123 and seen["server_config"].host == "127.0.0.1"
    assert seen["app"].state.serving.config.metrics_prefix == "vllm"
    assert "url=http://127.0.0.1:8123/v1" in caplog.text and "model=m" in caplog.text


def test_x_request_id_is_echoed_or_made(fake):
    _, client = fake
    body = {"prompt": "hi", "max_tokens": 2}
    r = client.post("/v1/completions", json=body, headers={"X-Request-Id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    made = client.get("/health").headers["x-request-id"]
    bad = client.get("/health", headers={"X-Request-Id": "has space"}).headers["x-request-id"]
    assert len(made) == 32 and len(bad) == 32 and bad != made
    with client.stream(
        "POST",
        "/v1/completions",
        json={**body, "stream": True},
        headers={"X-Request-Id": "s-1"},
    ) as s:
        assert s.headers["x-request-id"] == "s-1" and "data: [DONE]" in list(s.iter_lines())


def test_a_bug_answers_500_without_its_internals(monkeypatch, caplog):
    import serving.openai_api

    def broken(*a, **k):
        raise RuntimeError("secret detail at /opt/internal/path.py")

    monkeypatch.setattr(serving.openai_api, "prepare", broken)
    app = build_app(FakeEngine(), ServerConfig())
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "b-1"})
    _err(r, 500)
    assert "b-1" in r.json()["error"]["message"]
    assert "secret" not in r.text and "/opt" not in r.text
    assert "secret detail" in caplog.text  # the log has it


def test_a_body_over_the_limit_is_413_unread():
    app = build_app(FakeEngine(), ServerConfig(max_request_body_bytes=1000))
    with TestClient(app) as client:
        ok = client.post("/v1/completions", json={"prompt": "x" * 100, "max_tokens": 2})
        assert ok.status_code == 200
        _err(client.post("/v1/completions", json={"prompt": "x" * 2000}), 413)

        def chunked():  # no Content-Length: the limit holds while reading
            yield b'{"prompt": "'
            for _ in range(20):
                yield b"x" * 100
            yield b'"}'

        r = client.post("/v1/completions", content=chunked())
        _err(r, 413)
        assert r.json()["error"]["code"] == "request_too_large"


def test_request_timeout_aborts_with_what_was_made():
    app = build_app(FakeEngine(step_s=0.05), ServerConfig(request_timeout=0.3))
    body = {"prompt": "hi", "max_tokens": 100}  # ~5 s at this pace
    with TestClient(app) as client:
        r = client.post("/v1/completions", json=body)
        choice = r.json()["choices"][0]
        assert r.status_code == 200 and choice["finish_reason"] == "abort"
        assert 0 < len(choice["text"]) < 100
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            lines = [x for x in s.iter_lines() if x.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort"
        short = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert short.json()["choices"][0]["finish_reason"] == "length"


def test_cors_for_listed_origins_only():
    """--allowed-origins turns CORS on for those origins; others get no CORS headers."""
    _, scfg = parse(["--allowed-origins", "https://app.example, https://b.example"])
    assert scfg.allowed_origins == ["https://app.example", "https://b.example"]
    with TestClient(build_app(FakeEngine(), scfg)) as client:
        ok = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
        pre = client.options("/v1/completions", headers=ok)
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "https://app.example"
        r = client.post(
            "/v1/completions",
            json={"prompt": "hi", "max_tokens": 1},
            headers={"Origin": "https://app.example"},
        )
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
        other = client.options(
            "/v1/completions",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--allowed-origins", "*", "--allow-credentials"], "allow_credentials"),
        (["--allowed-origins", '["a", 3]'], "list of strings"),
        (["--allowed-origins", "[oops"], "JSON"),
    ],
)
def test_bad_cors_options_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert message in capsys.readouterr().err


def test_no_cors_headers_by_default(fake):
    _, client = fake
    origin = {"Origin": "https://evil.example"}
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=origin)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    pre = client.options(
        "/v1/completions", headers={**origin, "Access-Control-Request-Method": "POST"}
    )
    assert "access-control-allow-origin" not in pre.headers


def test_prompt_logprobs_where_vllm_puts_them(fake):
    """A chat's prompt_logprobs at the response's top level (streamed: in one chunk, the first
    after the engine's first output); a completion's in its choice (streamed: the choice's
    first chunk); out of range: a 400 naming the field."""
    import json

    _, c = fake
    msgs = [{"role": "user", "content": "hi"}]
    chat = c.post(
        "/v1/chat/completions", json={"messages": msgs, "max_tokens": 3, "prompt_logprobs": 1}
    ).json()
    plp = chat["prompt_logprobs"]
    assert plp[0] is None and len(plp) > 1 and all(len(e) == 1 for e in plp[1:])
    body = {"messages": msgs, "max_tokens": 3, "prompt_logprobs": 0, "stream": True}
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    carried = [i for i, ch in enumerate(chunks) if "prompt_logprobs" in ch]
    assert carried == [1] and chunks[1]["prompt_logprobs"][1:] == plp[1:]
    body = {"prompt": "abc", "max_tokens": 3, "prompt_logprobs": 2, "stream": True, "n": 2}
    with c.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    firsts = [ch["choices"][0] for ch in chunks if "prompt_logprobs" in ch["choices"][0]]
    assert sorted(f["index"] for f in firsts) == [0, 1]
    assert all(len(f["prompt_logprobs"]) == 3 for f in firsts)
    _err(
        c.post("/v1/completions", json={"prompt": "a", "prompt_logprobs": -1}),
        400,
        "prompt_logprobs",
    )


def test_token_prompt_is_decoded_only_for_echo(fake, monkeypatch):
    engine, c = fake
    decoded = []
    real = engine.tokenizer.decode
    monkeypatch.setattr(
        engine.tokenizer, "decode", lambda ids, **kw: decoded.append(list(ids)) or real(ids, **kw)
    )
    for echo in (False, True):
        decoded.clear()
        r = c.post("/v1/completions", json={"prompt": [97, 98], "max_tokens": 2, "echo": echo})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].startswith("ab") is echo
        assert ([97, 98] in decoded) is echo


def test_request_id_names_the_response(fake):
    _, client = fake
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "request_id": "a-1"})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-a-1"
    r = client.post("/v1/chat/completions", json={**chat, "request_id": "a-2", "stream": True})
    first = json.loads(r.text.split("\n\n")[0][len("data: ") :])
    assert first["id"] == "chatcmpl-a-2"
    for bad in ("has space", "x" * 129, ""):
        _err(
            client.post("/v1/chat/completions", json={**chat, "request_id": bad}), 400, "request_id"
        )


def test_chat_add_special_tokens_adds_the_tokenizers(fake):
    """Off by default for chat (the template has what the model wants), as vLLM; asked, the
    tokenizer's own (a BOS) come on top, in the prompt that runs and in /tokenize."""
    engine, client = fake
    engine.tokenizer.bos_id = 2
    try:
        msgs = {"messages": [{"role": "user", "content": "hi"}]}
        plain = client.post("/tokenize", json=msgs).json()["tokens"]
        asked = client.post("/tokenize", json={**msgs, "add_special_tokens": True}).json()
        assert plain[0] != 2 and asked["tokens"] == [2] + plain
        assert client.post("/tokenize", json={"prompt": "hi"}).json()["tokens"][0] == 2
        body = {**msgs, "max_tokens": 1}
        usage = [
            client.post("/v1/chat/completions", json={**body, **extra}).json()["usage"]
            for extra in ({}, {"add_special_tokens": True})
        ]
        assert usage[1]["prompt_tokens"] == usage[0]["prompt_tokens"] + 1 == len(plain) + 1
    finally:
        engine.tokenizer.bos_id = None
