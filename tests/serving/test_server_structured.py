"""Structured output and tool calling through the official `openai` client against the real
SmolLM2 server (session fixture in conftest.py): schemas validate, choices and regexes match,
forced tool calls parse, bad grammars are 400s and nothing recompiles."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
MSG = [{"role": "user", "content": "Describe a person as JSON."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
        },
    },
}
SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}


@pytest.fixture(scope="module", autouse=True)
def compiles_before(server):
    """The compile counter before this file's first request. It is per process and restarts at
    the latest runner's warm-up, so the session server's absolute count also holds compiles of
    other test files run in this worker after that runner was built (1171 of them once, under
    xdist on a cold JAX cache); what this file's requests compile is the difference."""
    return server.engine.stats()["xla_compiles_after_warmup"]


def _chat(client, server, **kw):
    kw.setdefault("max_tokens", 48)
    return client.chat.completions.create(model=server.model, messages=MSG, **kw)


def test_json_schema_validates_across_seeds_and_temperatures(client, server):
    r = _chat(client, server, response_format=SCHEMA_FORMAT, temperature=1.2, seed=1, n=3)
    r0 = _chat(client, server, response_format=SCHEMA_FORMAT, temperature=0)
    for ch in r.choices + r0.choices:
        assert ch.finish_reason == "stop", ch
        jsonschema.validate(json.loads(ch.message.content), PERSON)
    # schema order, compact separators
    assert r0.choices[0].message.content.startswith('{"name": "')


def test_json_schema_streamed_equals_nonstreamed(client, server):
    kw = dict(response_format=SCHEMA_FORMAT, temperature=0.9, seed=5, top_p=0.95)
    full = _chat(client, server, **kw)
    chunks = list(_chat(client, server, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_json_object_and_logprobs(client, server):
    r = _chat(
        client,
        server,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=40,
        logprobs=True,
        top_logprobs=3,
    )
    ch = r.choices[0]
    if ch.finish_reason == "stop":
        assert isinstance(json.loads(ch.message.content), dict)
    else:  # cut by max_tokens: still a JSON object's prefix
        assert ch.message.content.startswith("{")
    lps = ch.logprobs.content
    assert lps and all(-9999 <= t.logprob <= 0 for t in lps)
    assert all(-9999 <= t.logprob for e in lps for t in e.top_logprobs)


def test_choice_regex_and_grammar(client, server, http):
    ch = _chat(
        client,
        server,
        extra_body={"structured_outputs": {"choice": ["sunny", "rainy", "snowy"]}},
        temperature=1.0,
        seed=3,
        n=2,
    )
    assert all(c.message.content in ("sunny", "rainy", "snowy") for c in ch.choices)
    assert all(c.finish_reason == "stop" for c in ch.choices)
    rx = r"[A-Z][a-z]{2,5}-[0-9]{3}"
    out = client.completions.create(
        model=server.model,
        prompt="A product code:",
        max_tokens=16,
        temperature=1.0,
        seed=9,
        extra_body={"guided_regex": rx},
    )
    assert re.fullmatch(rx, out.choices[0].text) and out.choices[0].finish_reason == "stop"
    lark = 'start: "(" item ("," item)* ")"\nitem: /[0-9]/'
    g = _chat(client, server, extra_body={"guided_grammar": lark}, temperature=0, max_tokens=12)
    text = g.choices[0].message.content
    assert re.fullmatch(r"\([0-9](,[0-9])*\)", text) or (
        g.choices[0].finish_reason == "length" and re.fullmatch(r"\([0-9](,[0-9]?)*", text)
    )


def test_forced_named_tool_call(client, server):
    kw = dict(
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0.8,
        seed=2,
    )
    r = _chat(client, server, **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # streamed: OpenAI's delta shape (id, type and name first, then argument pieces)
    chunks = [c for c in _chat(client, server, stream=True, **kw) if c.choices]
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].type == "function"
    assert deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_required_tool_calls(client, server):
    kw = dict(tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=64)
    r = _chat(client, server, parallel_tool_calls=False, **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    (call,) = ch.message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    chunks = [c for c in _chat(client, server, stream=True, parallel_tool_calls=False, **kw)]
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (call.function.name, call.function.arguments)
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_tools_and_a_tool_turn(client, server):
    """SmolLM2-135M rarely calls tools by itself (the parser's tests use crafted text); here the
    tools and a full call / result round trip go through its template and come back as a
    well-formed answer: text, or calls that parse."""
    msgs = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    r = client.chat.completions.create(
        model=server.model, messages=msgs, tools=[WEATHER], max_tokens=16, temperature=0
    )
    ch = r.choices[0]
    assert ch.finish_reason in ("stop", "length", "tool_calls")
    assert ch.message.content or ch.message.tool_calls
    for call in ch.message.tool_calls or []:
        json.loads(call.function.arguments)


CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Rome"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
# vLLM's structural_tag response_format: free text; from "<function=" on, a structure
TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "<function=get_weather>", "schema": CITY, "end": "</function>"}],
    "triggers": ["<function="],
}
# the same in xgrammar's format (vLLM's newer form)
TAG_FORMAT = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<function="],
        "tags": [
            {
                "begin": "<function=get_weather>",
                "content": {"type": "json_schema", "json_schema": CITY},
                "end": "</function>",
            }
        ],
    },
}
CALLS = (
    'Call the tool: <function=get_weather>{"city": "Paris"}</function>\n'
    'Call the tool: <function=get_weather>{"city": "Berlin"}</function>\n'
    "Call the tool:"
)


def test_structural_tag(client, server, http):
    """response_format structural_tag on /v1/completions (the prompt makes SmolLM2 call the tool
    at once) and /v1/chat/completions: the structures' JSON follows the schema, text around them
    is free; structured_outputs.structural_tag (xgrammar's format as JSON text) is the same
    constraint, so the same greedy text."""
    body = {"model": server.model, "prompt": CALLS, "max_tokens": 40, "temperature": 0}
    r = http.post("/v1/completions", json={**body, "response_format": TAG})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    args = re.findall(r"<function=get_weather>(.*?)</function>", text)
    assert text.startswith(" <function=get_weather>{") and args, text
    for a in args:
        jsonschema.validate(json.loads(a), CITY)
    assert text.split("</function>", 1)[1].startswith("\nCall the tool"), text
    r = http.post("/v1/completions", json={**body, "response_format": TAG_FORMAT})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text, r.text
    so = {"structural_tag": json.dumps(TAG_FORMAT)}
    r = http.post("/v1/completions", json={**body, "structured_outputs": so})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text, r.text
    # chat: whatever the model writes, any structure in it follows the schema
    msgs = [{"role": "user", "content": "Call get_weather as <function=get_weather>{...}"}]
    ch = client.chat.completions.create(
        model=server.model, messages=msgs, response_format=TAG, max_tokens=48, temperature=0
    )
    content = ch.choices[0].message.content
    assert content is not None
    for a in re.findall(r"<function=get_weather>(.*?)</function>", content):
        jsonschema.validate(json.loads(a), CITY)


def _tag(**kw):
    fn = {"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}
    return {"type": "structural_tag", "structures": [{**fn, **kw}], "triggers": ["<f"]}


BAD = [
    ({"response_format": _tag(schema=None)}, "response_format.structures.0.schema"),
    ({"response_format": _tag(begin="<g>")}, "response_format.structures.0.begin"),
    ({"response_format": {**_tag(), "triggers": ["<f", "<h"]}}, "response_format.triggers.1"),
    # a schema llguidance refuses: found when the engine compiles the grammar
    ({"response_format": _tag(schema={"type": "strin"})}, "response_format.structures.0.schema"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.structures"),
    ({"response_format": {"type": "json_object", "triggers": ["<f"]}}, "response_format.triggers"),
    (
        {
            "response_format": {
                **TAG_FORMAT,
                "format": {**TAG_FORMAT["format"], "at_least_one": True},
            }
        },
        "response_format.format.at_least_one",
    ),
    ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs.structural_tag"),
    (
        {"structured_outputs": {"structural_tag": json.dumps({"format": {"type": "or"}})}},
        "structured_outputs.structural_tag.format.type",
    ),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strin"}},
            }
        },
        "response_format.json_schema.schema",
    ),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    # a forced call's grammar is the tools' schemas: the error names tools
    (
        {
            "tools": [
                {**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": "strin"}}}
            ],
            "tool_choice": "required",
        },
        "tools",
    ),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " "}}, None),
]


@pytest.mark.parametrize("extra, param", BAD)
def test_bad_constraints_are_400_and_the_server_lives(client, server, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, server, max_tokens=4, extra_body=extra)
    err = e.value.body
    if param is not None:
        assert err["param"] == param, err
    r = _chat(client, server, max_tokens=2, temperature=0)
    assert r.choices[0].message.content is not None


def test_nothing_recompiled(server, http, compiles_before):
    assert http.get(f"{server.base}/metrics").status_code == 200
    # not one compile for all of this file's constrained requests (see compiles_before)
    assert server.engine.stats()["xla_compiles_after_warmup"] - compiles_before == 0
