"""A request field we do not implement gets a 400 that names it, never a silent ignore (issue
#16); its no-op values (null, the documented default) are accepted, since common clients send
them. In-process app, fake engine (seconds, no model)."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from serving.app import build_app
from serving.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, StreamOptions

COMPLETION = ("/v1/completions", {"prompt": "hi", "max_tokens": 2})
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
BOTH = [COMPLETION, CHAT]

FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# A value that asks for something, for every listed field.
SHARED = {
    "guided_whitespace_pattern": r"\s*",
    "guided_decoding_backend": "xgrammar",
    "best_of": 3,
    "logits_processors": ["pkg.module:Processor"],
    "spaces_between_special_tokens": False,
    "kv_transfer_params": {"do_remote_prefill": True},
    "vllm_xargs": {"k": 1},
    "store": True,
    "service_tier": "flex",
}
CHAT_ONLY = {
    "functions": [FUNCTION["function"]],
    "function_call": {"name": "f"},
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"},
    "verbosity": "low",
    "web_search_options": {},
    "mm_processor_kwargs": {"num_crops": 4},
}
COMPLETION_ONLY = {"suffix": " the end", "prompt_embeds": "AAAA"}
MESSAGE = {
    "function_call": {"name": "f", "arguments": "{}"},
    "refusal": "no",
    "annotations": [{"type": "url_citation"}],
    "audio": {"id": "a1"},
}
STREAM = {"include_obfuscation": True}


@pytest.fixture(scope="module")
def client():
    with TestClient(build_app(FakeEngine())) as c:
        yield c


def _refused(r, field):
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["type"] == "invalid_request_error" and e["code"] == 400
    assert e["param"] == field, e
    assert f"`{field}`" in e["message"] and "not supported" in e["message"], e


def test_every_listed_field_has_a_case():
    assert set(SHARED) | set(CHAT_ONLY) == set(ChatCompletionRequest.unimplemented)
    assert set(SHARED) | set(COMPLETION_ONLY) == set(CompletionRequest.unimplemented)
    assert set(MESSAGE) == set(ChatMessage.unimplemented)
    assert set(STREAM) == set(StreamOptions.unimplemented)


# Every field on both endpoints (one that does not apply is refused all the same), except where
# the endpoint implements it.
REFUSED = [
    (*endpoint, field, value)
    for endpoint, model in ((COMPLETION, CompletionRequest), (CHAT, ChatCompletionRequest))
    for field, value in {**SHARED, **CHAT_ONLY, **COMPLETION_ONLY}.items()
    if field not in model.model_fields
]


@pytest.mark.parametrize("route, base, field, value", REFUSED)
def test_unimplemented_field_is_refused(client, route, base, field, value):
    _refused(client.post(route, json={**base, field: value}), field)


@pytest.mark.parametrize("field, value", MESSAGE.items())
def test_unimplemented_message_field_is_refused(client, field, value):
    msg = {"role": "assistant", "content": "a", field: value}
    body = {**CHAT[1], "messages": [{"role": "user", "content": "q"}, msg]}
    _refused(client.post(CHAT[0], json=body), f"messages.1.{field}")


@pytest.mark.parametrize("route, base", BOTH, ids=["completions", "chat"])
@pytest.mark.parametrize("field, value", STREAM.items())
def test_unimplemented_stream_option_is_refused(client, route, base, field, value):
    body = {**base, "stream": True, "stream_options": {"include_usage": True, field: value}}
    _refused(client.post(route, json=body), f"stream_options.{field}")


def test_image_part_is_refused_by_name(client):
    part = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    body = {**CHAT[1], "messages": [{"role": "user", "content": [part]}]}
    _refused(client.post(CHAT[0], json=body), "messages.0.content.0.image_url")


@pytest.mark.parametrize("route, base", BOTH, ids=["completions", "chat"])
def test_unknown_field_is_refused_as_unknown(client, route, base):
    r = client.post(route, json={**base, "max_new_tokens": 5})
    _refused(r, "max_new_tokens")
    assert "unknown field" in r.json()["error"]["message"]
    _refused(
        client.post("/tokenize", json={"prompt": "a", "return_token_strs": True}),
        "return_token_strs",
    )
    # chat's logprobs variant on completions (which take an integer `logprobs`)
    _refused(client.post(COMPLETION[0], json={**COMPLETION[1], "top_logprobs": 2}), "top_logprobs")


def test_several_fields_are_all_named(client):
    r = client.post(
        CHAT[0],
        json={**CHAT[1], "modalities": ["audio"], "audio": {"voice": "alloy"}},
    )
    _refused(r, "modalities")
    assert "`audio`" in r.json()["error"]["message"]
    # a field we lack is reported before a bad value elsewhere: it is what the client counts on
    _refused(
        client.post(
            COMPLETION[0],
            json={
                **COMPLETION[1],
                "temperature": "hot",
                "kv_transfer_params": {"do_remote_prefill": True},
            },
        ),
        "kv_transfer_params",
    )


NOOPS_SHARED = [
    ("response_format", {"type": "text"}),
    ("best_of", 1),
    ("use_beam_search", False),
    ("length_penalty", 1.0),
    ("spaces_between_special_tokens", True),
    ("store", False),
    ("service_tier", "auto"),
    ("service_tier", "default"),
    # metadata and hints that change no output: accepted, whatever their value
    ("user", "u-1"),
    ("safety_identifier", "h-1"),
    ("metadata", {"k": "v"}),
    ("prompt_cache_key", "key"),
]
NOOPS_CHAT = [
    ("tools", []),
    ("tool_choice", "none"),
    ("tool_choice", "auto"),
    ("parallel_tool_calls", True),
    ("modalities", ["text"]),
]
NOOPS_COMPLETION = [("suffix", "")]


@pytest.mark.parametrize(
    "route, base, field, value",
    [(*COMPLETION, f, v) for f, v in NOOPS_SHARED + NOOPS_COMPLETION]
    + [(*CHAT, f, v) for f, v in NOOPS_SHARED + NOOPS_CHAT],
)
def test_noop_value_is_accepted(client, route, base, field, value):
    r = client.post(route, json={**base, field: value})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "route, base, model",
    [(*COMPLETION, CompletionRequest), (*CHAT, ChatCompletionRequest)],
    ids=["completions", "chat"],
)
def test_null_is_accepted_for_every_listed_field(client, route, base, model):
    r = client.post(route, json={**base, **{f: None for f in model.unimplemented}})
    assert r.status_code == 200, r.text


def test_best_of_equal_to_n_is_accepted(client):
    r = client.post(COMPLETION[0], json={**COMPLETION[1], "n": 2, "best_of": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    _refused(client.post(COMPLETION[0], json={**COMPLETION[1], "n": 2, "best_of": 3}), "best_of")


def test_replayed_assistant_message_and_stream_options_noops_are_accepted(client):
    """What a client sends when it appends an earlier answer object to the conversation."""
    answer = {
        "role": "assistant",
        "content": "a",
        "tool_calls": None,
        "function_call": None,
        "refusal": None,
        "annotations": [],
        "audio": None,
        "reasoning_content": None,
    }
    body = {
        **CHAT[1],
        "messages": [{"role": "user", "content": "q"}, answer, {"role": "user", "content": "more"}],
        "stream": True,
        "stream_options": {
            "include_usage": True,
            "continuous_usage_stats": False,
            "include_obfuscation": False,
        },
    }
    with client.stream("POST", CHAT[0], json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and '"usage"' in lines[-2]
    answer["tool_calls"] = []
    body["messages"][1] = answer
    assert client.post(CHAT[0], json={**body, "stream": False}).status_code == 400
    body.pop("stream_options")  # vLLM's rule: stream_options only with stream true
    assert client.post(CHAT[0], json={**body, "stream": False}).status_code == 200


@pytest.mark.parametrize("route, base", BOTH, ids=["completions", "chat"])
def test_stream_options_need_a_stream(client, route, base):
    """As vLLM: stream_options without stream would change nothing, so they are refused; null
    or {} ask for nothing and pass."""
    for options in (None, {}):
        assert client.post(route, json={**base, "stream_options": options}).status_code == 200
    r = client.post(route, json={**base, "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
