"""The server codes against `EngineClient` and maps the engine's errors by type: no attribute
probing, no matching on class names. Against the fake engine (seconds, no model)."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from paxengine.client import EngineClient
from paxengine.errors import EngineDead, EngineOverloaded, InvalidRequest
from serving.app import build_app
from serving.config import ServerConfig

BODY = {"prompt": "hi", "max_tokens": 2}


@pytest.fixture
def fake():
    engine = FakeEngine()
    with TestClient(build_app(engine, ServerConfig())) as client:
        yield engine, client


def _refuse_with(engine, error, after: int = 0):
    """engine.generate raises `error` from its (after+1)-th call on."""
    real, calls = engine.generate, []

    def generate(request_id, prompt, params):
        calls.append(request_id)
        if len(calls) > after:
            raise error
        return real(request_id, prompt, params)

    engine.generate = generate
    return calls


def test_the_fake_is_an_engine_client():
    assert isinstance(FakeEngine(), EngineClient)


@pytest.mark.parametrize(
    "error, status, code",
    [
        (InvalidRequest("foo: too foo", param="foo", code="foo_code"), 400, "foo_code"),
        (EngineOverloaded("full"), 503, "server_overloaded"),
        (EngineDead("gone"), 503, "engine_unhealthy"),
    ],
)
def test_engine_errors_map_by_type(fake, error, status, code):
    engine, c = fake
    _refuse_with(engine, error)
    for stream in (False, True):  # a refusal is a status, also for a stream (nothing started)
        r = c.post("/v1/completions", json={**BODY, "stream": stream})
        assert r.status_code == status, r.text
        assert r.json()["error"]["code"] == code
    if isinstance(error, InvalidRequest):
        assert r.json()["error"]["param"] == "foo"
    if isinstance(error, EngineOverloaded):
        assert r.headers["retry-after"] == "1"


def test_a_class_name_is_not_a_mapping(fake):
    class QueueFullOverloadedDead(RuntimeError):  # what name matching would have taken for 503
        pass

    engine, c = fake
    _refuse_with(engine, QueueFullOverloadedDead("no"))
    with pytest.raises(QueueFullOverloadedDead):
        c.post("/v1/completions", json=BODY)


def test_one_refused_prompt_aborts_the_started_ones(fake):
    engine, c = fake
    calls = _refuse_with(engine, EngineOverloaded("full"), after=1)
    r = c.post("/v1/completions", json={**BODY, "prompt": ["a", "b", "c"], "max_tokens": 50})
    assert r.status_code == 503
    assert len(calls) == 2 and engine.aborted == calls[:1]
    assert not engine.running


def test_invalid_prompt_in_a_batch_is_a_400_naming_it(fake):
    engine, c = fake
    r = c.post("/v1/completions", json={"prompt": ["ok", "x" * 500], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert not engine.running


def test_reset_prefix_cache(fake):
    engine, c = fake
    assert c.post("/reset_prefix_cache").status_code == 200 and engine.resets == 1
    engine.prefix_cache_busy = True
    r = c.post("/reset_prefix_cache")
    assert r.status_code == 503 and r.json()["error"]["code"] == "prefix_cache_busy"
    engine.healthy = False
    assert c.post("/reset_prefix_cache").json()["error"]["code"] == "engine_unhealthy"


def test_models_and_limits_come_from_model_info(fake):
    engine, c = fake
    card = c.get("/v1/models").json()["data"][0]
    assert card["id"] == engine.model_info().name == "fake-model"
    assert card["max_model_len"] == engine.model_info().max_model_len
    assert (card["weight_dtype"], card["kv_cache_dtype"]) == ("float32", "float32")
