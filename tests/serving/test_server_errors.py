"""Every class of bad input gets its 4xx in the OpenAI error shape, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

GOOD = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def _check(r: httpx.Response, status: int, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err


def _good_still_works(http):
    r = http.post("/v1/completions", json=GOOD)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


COMPLETION_CASES = [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "warm"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"logprobs": 21}, "logprobs"),
    ({"n": 0}, "n"),
    ({"n": 100000}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"prompt": "hello " * 600}, "prompt"),
    ({"prompt": [1, 2, 10**7]}, "prompt"),
    ({"prompt": [[1, 2], [-1]]}, "prompt"),
    ({"prompt": [1, "two"]}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"stop_token_ids": [10**7]}, "stop_token_ids"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"stop": 12}, "stop"),
    ({"seed": "abc"}, "seed"),
    ({"stream": "true"}, "stream"),
    ({"priority": 5}, "priority"),  # this server schedules fcfs
    ({"priority": 1.5}, "priority"),
]


@pytest.mark.parametrize(
    "override, param", COMPLETION_CASES, ids=[c[1] + str(i) for i, c in enumerate(COMPLETION_CASES)]
)
def test_bad_completion_values(http, override, param):
    _check(http.post("/v1/completions", json={**GOOD, **override}), 400, param)


CHAT_CASES = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": {"a": 1}}]}, "messages.0.content"),
    ({"messages": "hello"}, "messages"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),  # the field the request set
    ({"logprobs": True, "top_logprobs": 25}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"temperature": -1}, "temperature"),
]


@pytest.mark.parametrize(
    "override, param", CHAT_CASES, ids=[c[1] + str(i) for i, c in enumerate(CHAT_CASES)]
)
def test_bad_chat_values(http, override, param):
    _check(http.post("/v1/chat/completions", json={**CHAT, **override}), 400, param)


def test_bad_bodies(http):
    ct = {"Content-Type": "application/json"}
    for raw in (
        b"{",
        b"not json at all",
        b'{"prompt": "\xc3\x28"}',
        b"\xff\xfe\x00",
        b"[]",
        b"",
        b"null",
    ):
        _check(http.post("/v1/completions", content=raw, headers=ct), 400)
        _check(http.post("/v1/chat/completions", content=raw, headers=ct), 400)
    _check(http.post("/tokenize", json={}), 400)
    _check(http.post("/detokenize", json={"tokens": [10**8]}), 400, "tokens")
    _good_still_works(http)


def test_unknown_model_auth_routes(http, server):
    _check(http.post("/v1/completions", json={**GOOD, "model": "gpt-17"}), 404, "model")
    _check(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-17"}), 404, "model")
    with httpx.Client(base_url=server.base, timeout=30) as anon:
        _check(anon.post("/v1/completions", json=GOOD), 401)
        _check(anon.get("/v1/models"), 401)
        _check(
            anon.post("/v1/completions", json=GOOD, headers={"Authorization": "Bearer wrong"}), 401
        )
        assert anon.get("/health").status_code == 200  # health and metrics stay open
        assert anon.get("/metrics").status_code == 200
    _check(http.get("/v1/nothing-here"), 404)
    _check(http.get("/v1/completions"), 405)
    _good_still_works(http)


def test_overload_gets_503_with_retry_after(http, server):
    cfg = server.engine.config
    bound = cfg.max_waiting_requests
    cfg.max_waiting_requests = 0  # any request now finds the waiting queue full
    try:
        r = http.post("/v1/completions", json=GOOD)
        _check(r, 503)
        assert int(r.headers["Retry-After"]) >= 1
        r = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
        _check(r, 503)
    finally:
        cfg.max_waiting_requests = bound
    _good_still_works(http)


def test_extreme_but_valid_values_do_not_hurt_the_engine(http, server):
    """Values the engine packs into fixed-width arrays: huge top_k / seeds, many biases."""
    for extra in (
        {"top_k": 10**12},
        {"seed": 2**80},
        {"seed": -5},
        {"temperature": 1e30},
        {"logit_bias": {str(i): -1.0 for i in range(300)}},
        {"stop": ["x"] * 50},
        {"min_tokens": 2, "stop_token_ids": list(range(40))},
    ):
        r = http.post("/v1/completions", json={**GOOD, **extra})
        assert r.status_code == 200, (extra, r.text)
    assert server.engine.is_healthy()
    assert http.get("/health").status_code == 200
    _good_still_works(http)
