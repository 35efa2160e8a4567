"""use_beam_search on the real SmolLM2 server (serving/beam_search.py, vLLM's): n beams, the
choices the best beams (best first) as a plain beam search over transformers' float32 model
ranks them; chat parses after the search; a stream sends each choice whole; usage as vLLM's.
Fields beam search would ignore are 400s naming them (the fake engine's app, no model)."""

from __future__ import annotations

import json

import pytest
from beam_reference import Reference
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from serving.app import build_app

QUESTION = [{"role": "user", "content": "Answer with one word. Is the sky blue?"}]
TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def ref(server, hf_smollm):
    return Reference(hf_smollm[0], server.engine.tokenizer.eos_token_ids)


def _expected(ref, prompt_ids, width, steps, length_penalty=1.0):
    """The reference's best beams as the server shows them: generated ids without a final EOS,
    and whether EOS ended each."""
    best = ref.best(ref.pool(prompt_ids, width, steps), width, length_penalty)
    out = []
    for tokens, _ in best:
        gen = tokens[len(prompt_ids) :]
        ended = gen[-1] in ref.eos
        out.append((gen[:-1] if ended else gen, "stop" if ended else "length"))
    return out


def test_completions_choices_are_the_best_beams(http, server, ref):
    body = {
        "prompt": TEXT,
        "use_beam_search": True,
        "n": 2,
        "max_tokens": 6,
        "temperature": 0,
        "return_token_ids": True,
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    res = r.json()
    choices = res["choices"]
    prompt_ids = choices[0]["prompt_token_ids"]
    expected = _expected(ref, prompt_ids, 2, 6)
    assert [c["index"] for c in choices] == [0, 1]
    assert [(c["token_ids"], c["finish_reason"]) for c in choices] == expected
    tok = server.engine.tokenizer
    assert [c["text"] for c in choices] == [tok.decode(ids) for ids, _ in expected]
    # vLLM's usage: the prompt once, every choice's tokens
    u = res["usage"]
    assert u["prompt_tokens"] == len(prompt_ids)
    assert u["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    # a length penalty that favours nothing (0): the same beams here, ranked by logprob alone
    r0 = http.post("/v1/completions", json={**body, "length_penalty": 0.0})
    assert [c["token_ids"] for c in r0.json()["choices"]] == [
        ids for ids, _ in _expected(ref, prompt_ids, 2, 6, 0.0)
    ]


def test_chat_choices_logprobs_and_stream(http, server, ref):
    body = {
        "messages": QUESTION,
        "use_beam_search": True,
        "n": 3,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "return_token_ids": True,
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    res = r.json()
    expected = _expected(ref, res["prompt_token_ids"], 3, 6)
    choices = res["choices"]
    assert [(c["token_ids"], c["finish_reason"]) for c in choices] == expected
    tok = server.engine.tokenizer
    assert [c["message"]["content"] for c in choices] == [tok.decode(i) for i, _ in expected]
    assert "stop" in {c["finish_reason"] for c in choices}  # "No", then EOS
    for c in choices:  # a logprob per token, the beam's top candidates of each step
        content = c["logprobs"]["content"]
        assert len(content) == len(c["token_ids"])
        assert all(len(e["top_logprobs"]) == 2 for e in content)
    u = res["usage"]
    assert u["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    # streamed: the role for each choice, then each choice whole with its finish reason
    stream = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
    stream |= {"stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=stream) as s:
        assert s.status_code == 200
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts, finishes = {}, {}
    for ch in chunks:
        for c in ch["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
            finishes[c["index"]] = c["finish_reason"] or finishes.get(c["index"])
    assert texts == {c["index"]: c["message"]["content"] for c in choices}
    assert finishes == {c["index"]: c["finish_reason"] for c in choices}
    assert chunks[-1]["usage"]["completion_tokens"] == u["completion_tokens"]


def test_refusals_on_the_real_server(http):
    body = {"prompt": TEXT, "use_beam_search": True, "n": 2, "max_tokens": 6, "stop": ["."]}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    r = http.post("/v1/completions", json={**body, "stop": None, "max_tokens": 600})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


# ----------------------------------------------------------------------------- fake engine
COMPLETION = ("/v1/completions", {"prompt": "hi", "max_tokens": 3})
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
BEAM = {"use_beam_search": True, "n": 2}


@pytest.fixture(scope="module")
def fake():
    with TestClient(build_app(FakeEngine())) as c:
        yield c


REFUSED = [
    ("top_p", 0.5),
    ("top_k", 5),
    ("min_p", 0.1),
    ("presence_penalty", 0.5),
    ("frequency_penalty", 0.5),
    ("repetition_penalty", 1.2),
    ("seed", 1),
    ("stop", "x"),
    ("stop_token_ids", [5]),
    ("logit_bias", {"5": 1.0}),
    ("min_tokens", 1),
    ("allowed_token_ids", [5]),
    ("bad_words", ["x"]),
    ("prompt_logprobs", 1),
    ("response_format", {"type": "json_object"}),
    ("structured_outputs", {"regex": "a+"}),
    ("guided_regex", "a+"),
    ("n", 11),
]


@pytest.mark.parametrize("route, base", [COMPLETION, CHAT], ids=["completions", "chat"])
@pytest.mark.parametrize("field, value", REFUSED)
def test_fields_beam_search_ignores_are_refused(fake, route, base, field, value):
    r = fake.post(route, json={**base, **BEAM, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    if field != "n":
        assert "use_beam_search" in r.json()["error"]["message"]


def test_other_refusals_and_noops(fake):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chat = {**CHAT[1], **BEAM, "tools": [tool], "tool_choice": "required"}
    r = fake.post(CHAT[0], json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    r = fake.post(COMPLETION[0], json={**COMPLETION[1], **BEAM, "echo": True, "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
    # length_penalty without beam search would change nothing: refused (vLLM ignores it)
    r = fake.post(COMPLETION[0], json={**COMPLETION[1], "length_penalty": 0.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty", r.text
    # the values that ask for nothing pass, and the search runs over any engine's generate
    noops = {"top_p": 1.0, "top_k": -1, "stop": [], "seed": None, "min_tokens": 0}
    for route, base in (COMPLETION, CHAT):
        r = fake.post(route, json={**base, **BEAM, **noops, "length_penalty": 2.0})
        assert r.status_code == 200, r.text
        assert [c["index"] for c in r.json()["choices"]] == [0, 1]
