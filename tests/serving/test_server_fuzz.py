"""A seeded fuzz of every POST route: valid bodies mutated (fields dropped, wrong types, odd but
valid values, unknown fields) must get a 200 or a 4xx in the server's error shape, never a 500,
and a stream never ends with an error event; the server answers a valid request afterwards.

A 4xx's param must name a field of the request (a path into the body, or one of the route's
fields), never a pydantic union branch or another route's name for it. The bulk runs on the fake
engine's app (FastAPI's TestClient, seconds): one server with a reasoning parser and auto tool
choice (Hermes calls, scripted into the fake's output so the parsers run), one whose output is a
forced call's JSON (tool_choice required or a function), one with --trust-request-chat-template
and the pythonic tool parser over a real byte-level Tokenizer and a Jinja template; a short
subset against the real SmolLM2 server, whose engine validates more (grammars, beam search, bad
words). Bugs it found: test_server_unit.py's test_odd_bodies_the_fuzz_found_..., test_structured's
nested JSON text, test_beam_search's extreme length penalties."""

from __future__ import annotations

import copy
import json
import logging
import random
import time
from typing import Any, Optional

import httpx
import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from paxengine.config import EngineConfig
from serving.app import build_app
from serving.config import ServerConfig
from serving.protocol import (
    _CHAT_UNIMPLEMENTED,
    _COMPLETION_UNIMPLEMENTED,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from serving.responses_protocol import ResponsesRequest

SEED = 20261208
DEEP = "\x00deep\x00"  # stands for a list nested past any parser's depth (spliced into the text)
DEEP_TEXT = "[" * 50_000 + "]" * 50_000  # the same inside a string that is JSON text

# ----------------------------------------------------------------------------- valid bodies
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TAG = {
    "type": "structural_tag",
    "structures": [
        {
            "begin": "<f>",
            "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "end": "</f>",
        }
    ],
    "triggers": ["<f>"],
}
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "city",
        "schema": {"type": "object", "properties": {"c": {"type": "string"}}},
    },
}
USER = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
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
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]

COMPLETIONS = [
    {"prompt": "Hello", "max_tokens": 4},
    {"prompt": ["a b", "c"], "max_tokens": 3, "n": 2, "logprobs": 2, "echo": True, "stop": ["x"]},
    {"prompt": [72, 101, 108], "max_tokens": 3, "temperature": 0, "return_token_ids": True},
    {"prompt": "Hi", "max_tokens": 3, "prompt_logprobs": 1, "seed": 7, "top_k": 5, "min_p": 0.1},
    {"prompt": "Hi", "max_tokens": 3, "use_beam_search": True, "n": 2, "length_penalty": 0.5},
    {"prompt": "Hi", "max_tokens": 4, "bad_words": ["a", "bc"], "response_format": TAG},
    {"prompt": "x", "max_tokens": 3, "structured_outputs": {"regex": "[a-z]+"}},
    {
        "prompt": "x",
        "max_tokens": 3,
        "logit_bias": {"104": 2.0},
        "allowed_token_ids": [104, 105, 106],
        "truncate_prompt_tokens": 4,
        "skip_special_tokens": False,
    },
]

CHATS = [
    {"messages": USER, "max_tokens": 4},
    {"messages": HISTORY, "tools": [WEATHER, TIME], "tool_choice": "auto", "max_tokens": 200},
    {
        "messages": USER,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "max_completion_tokens": 30,
    },
    {"messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 30},
    {
        "messages": [*USER, {"role": "assistant", "content": "It is"}],
        "echo": True,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "max_tokens": 4,
    },
    {
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            *USER,
        ],
        "logprobs": True,
        "top_logprobs": 2,
        "n": 2,
        "max_tokens": 5,
        "reasoning_effort": "low",
        "chat_template_kwargs": {"enable_thinking": True},
        "include_reasoning": False,
    },
    {"messages": USER, "use_beam_search": True, "n": 3, "max_tokens": 3},
    {"messages": USER, "response_format": SCHEMA, "max_tokens": 20},
    {"messages": USER, "response_format": TAG, "max_tokens": 20, "bad_words": ["zz"]},
    {
        "messages": USER,
        "thinking_token_budget": 5,
        "max_tokens": 20,
        "documents": [{"title": "t", "text": "x"}],
    },
    {
        "messages": USER,
        "max_tokens": 8,
        "return_token_ids": True,
        "prompt_logprobs": 2,
        "echo": True,
    },
]

RESPONSES = [
    {"input": "Hello", "max_output_tokens": 16},
    {
        "input": [{"role": "user", "content": "Weather in Paris?"}],
        "instructions": "Be terse.",
        "tools": [
            {
                "type": "function",
                "name": "get_weather",
                "parameters": WEATHER["function"]["parameters"],
            }
        ],
        "tool_choice": "auto",
        "max_output_tokens": 200,
    },
    {
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Paris?"}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "hm"}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "message", "role": "assistant", "content": "It is", "status": "in_progress"},
        ],
        "tools": [{"type": "function", "name": "get_weather"}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 30,
    },
    {
        "input": "JSON please",
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
        "reasoning": {"effort": "low"},
        "max_output_tokens": 20,
    },
    {
        "input": "Hi",
        "structured_outputs": {"choice": ["yes", "no"]},
        "truncation": "auto",
        "metadata": {"k": "v"},
        "max_output_tokens": 5,
    },
]

TOKENIZE = [
    {"prompt": "hello world"},
    {"prompt": "hello", "add_special_tokens": True},
    {"messages": HISTORY, "add_generation_prompt": True, "chat_template_kwargs": {"x": 1}},
    {
        "messages": [*USER, {"role": "assistant", "content": "It is"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    },
    {"messages": USER, "documents": [{"title": "a", "text": "b"}]},
]
DETOKENIZE = [
    {"tokens": [104, 105]},
    {"tokens": []},
    {"tokens": [72, 101, 108, 108, 111], "model": None},
]

INVOCATIONS = COMPLETIONS[:3] + CHATS[:3]
BASES = {
    "/v1/completions": COMPLETIONS,
    "/v1/chat/completions": CHATS,
    "/v1/responses": RESPONSES,
    "/invocations": INVOCATIONS,
    "/tokenize": TOKENIZE,
    "/detokenize": DETOKENIZE,
}


# ----------------------------------------------------------------------------- mutation
def _deep_dict(n: int) -> dict:
    d: dict = {}
    for _ in range(n):
        d = {"a": d}
    return d


WEIRD: list[Any] = [
    None, True, False, 0, 1, -1, 2, 2**31, 2**63, 2**64 + 1, -(2**63), 10**40, 0.5, -0.0, 1.5,
    1e308, -1e308, 1e-320, "", " ", "NaN", "inf", "-Infinity", "1", "true", "null", "x" * 5000,
    "\U0001f642\u65e5\u672c\x00", "\ud800", "\u202e\ufeff", "<think>", "</tool_call>", "{{ x }}",
    "[get_time()]", [], [None], [[]], [1, "a"], [0] * 50, ["a"] * 200, {}, {"a": None},
    {"type": "text"}, {"": []}, {"type": "function", "function": {}}, _deep_dict(60), DEEP,
    DEEP_TEXT,
]  # fmt: skip

# valid-looking values of known fields, each worth sending (many are refused by range)
ODD: dict[str, list[Any]] = {
    "n": [0, 2, 3, 10, 11, 64, 10**6],
    "max_tokens": [0, 1, -1, 200, 10**9],
    "max_completion_tokens": [0, 1, -1, 10**9],
    "max_output_tokens": [0, 1, -1, 10**9],
    "temperature": [-1, 0, 1e-9, 2.5, 1e30],
    "top_p": [0, 1e-9, 1, 1.5],
    "top_k": [-2, -1, 0, 1, 10**12],
    "min_p": [-0.5, 1, 1.5],
    "presence_penalty": [-2, 2, 5],
    "frequency_penalty": [-2.5, 2],
    "repetition_penalty": [0, 0.5, 3, 1e9],
    "seed": [-1, 2**64, -(2**70)],
    "logprobs": [True, False, 0, 1, 20, 21, -1, 10**6],
    "top_logprobs": [-1, 0, 5, 20, 21, 1000],
    "prompt_logprobs": [-1, 0, 5, 20, 21],
    "use_beam_search": [True],
    "length_penalty": [0, -1, 2.0, 1e30],
    "bad_words": [
        [],
        [""],
        [" "],
        ["a" * 300],
        [["x"]],
        ["x"] * 200,
        ["\U0001f642"],
        [" hi there"],
        ["\x00"],
    ],
    "stop": [[""], ["a"] * 1000, "", ["<think>"], "a"],
    "stop_token_ids": [[], [-1], [0], [10**9]],
    "logit_bias": [{"-1": 1}, {"1e3": 1}, {"104": 100}, {"104": 101}, {"104": -1e9}, {" 104": 1}],
    "allowed_token_ids": [[], [-1], [10**9], [0], [104] * 500],
    "min_tokens": [-1, 1, 10**9],
    "truncate_prompt_tokens": [-2, -1, 0, 1, 10**9],
    "thinking_token_budget": [-1, 0, 1, 10**12],
    "priority": [-1, 1, 10**20],
    "request_id": ["", "a" * 200, "bad id", "../x", "ok-id_1"],
    "cache_salt": ["", "s" * 1000],
    "echo": [True],
    "stream_options": [
        {"include_usage": True},
        {"include_usage": True, "continuous_usage_stats": True},
        {"continuous_usage_stats": True},
        {"include_obfuscation": True},
        {},
    ],
    "prompt": [
        "",
        [],
        [[]],
        [0],
        [255],
        [256],
        [[1], [2]],
        ["a", ""],
        [[104], "a"],
        "hello " * 500,
        [104] * 5000,
    ],
    "messages": [
        [],
        [{"role": "tool", "content": "x"}],
        [{"role": "assistant", "content": "only me"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": []}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
            }
        ],
        [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
        [{"role": "function", "content": "x", "name": "f"}],
        [{"role": "user", "content": "x", "name": ""}],
        [
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}
                ],
            }
        ],
        [
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {"name": "f", "arguments": "[1, 2]"},
                    }
                ],
            }
        ],
        [{"role": "assistant", "tool_calls": []}],
        [
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {"name": "f", "arguments": DEEP_TEXT},
                    }
                ],
            }
        ],
        [{"role": "user", "content": "x", "reasoning": "r", "reasoning_content": "s"}],
        [*USER, {"role": "assistant", "content": ""}],
        [*USER, {"role": "assistant", "content": "   "}],
        [{"role": "system", "content": "s"}] * 3,
    ],
    "tools": [
        [],
        [WEATHER, WEATHER],
        [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                },
            }
        ],
        [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nope"}}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
        [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        [{"type": "function", "function": {"name": "bad name!"}}],
        [{"type": "function", "function": {"name": "x" * 65}}],
        [{"type": "code_interpreter"}],
        [{"type": "function", "name": "flat"}],
        [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {
                        "type": "object",
                        "required": ["missing"],
                        "additionalProperties": False,
                    },
                },
            }
        ],
    ],
    "tool_choice": [
        "auto",
        "none",
        "required",
        "bogus",
        {"type": "function", "function": {"name": "missing"}},
        {"type": "function", "name": "missing"},
        {"type": "function", "name": "get_weather"},
        {"type": "function"},
        {"type": "file_search"},
    ],
    "parallel_tool_calls": [False, True],
    "response_format": [
        {"type": "text"},
        {"type": "json_object"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"$ref": "#/definitions/none"}},
        },
        {
            "type": "json_schema",
            "json_schema": {
                "name": "x",
                "schema": {"type": "object", "properties": {"a": {"pattern": "("}}},
            },
        },
        {"type": "structural_tag"},
        {"type": "structural_tag", "structures": []},
        {"type": "structural_tag", "structures": [{}], "triggers": ["<"]},
        {
            "type": "structural_tag",
            "structures": [{"begin": "<f>", "end": "</f>"}],
            "triggers": ["<f>"],
        },
        {
            "type": "structural_tag",
            "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
            "triggers": [],
        },
        {
            "type": "structural_tag",
            "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
            "triggers": ["<g>"],
        },
        {
            "type": "structural_tag",
            "structures": [{"begin": "<f>", "schema": "x", "end": "</f>"}],
            "triggers": ["<f>"],
        },
        {
            "type": "structural_tag",
            "structures": [{"begin": "", "schema": {}, "end": ""}],
            "triggers": [""],
        },
        {
            "type": "structural_tag",
            "structures": [{"begin": "<f>", "schema": {"type": "nonsense"}, "end": "</f>"}],
            "triggers": ["<f>"],
        },
        {
            "type": "structural_tag",
            "format": {
                "type": "triggered_tags",
                "triggers": ["<f>"],
                "tags": [
                    {
                        "begin": "<f>",
                        "content": {"type": "json_schema", "json_schema": {}},
                        "end": "</f>",
                    }
                ],
            },
        },
        {"type": "structural_tag", "format": {"type": "triggered_tags"}},
        {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}},
        {"type": "structural_tag", "format": {}},
        {
            "type": "structural_tag",
            "format": {"type": "triggered_tags", "triggers": "<f>", "tags": "x"},
        },
        {"type": "json_object", "structures": []},
    ],
    "structured_outputs": [
        {},
        {"regex": "("},
        {"regex": ""},
        {"grammar": "garbage"},
        {"grammar": ""},
        {"choice": []},
        {"choice": [""]},
        {"json": "not json"},
        {"json": "{}"},
        {"json": {"type": "nonsense"}},
        {"json": {}},
        {"structural_tag": "{bad"},
        {"structural_tag": "{}"},
        {"structural_tag": "[]"},
        {"structural_tag": "1"},
        {"json_object": True, "regex": "a"},
        {"json_object": False},
        {"json": DEEP_TEXT},
        {"structural_tag": DEEP_TEXT},
        {"json": {"type": "array", "items": _deep_dict(300)}},
    ],
    "guided_json": ["{", {"type": "object"}, "[]", DEEP_TEXT],
    "guided_regex": ["(", "a*"],
    "guided_choice": [[], ["a"]],
    "guided_grammar": ["root ::= x", ""],
    "chat_template_kwargs": [
        {"messages": 1},
        {"tools": 1},
        {"add_generation_prompt": 1},
        {"x": [1]},
        {"enable_thinking": False},
    ],
    "documents": [[], [{}], [{"title": 1}], [{"text": "\ud800"}]],
    "chat_template": [
        "{{ raise }}",
        "{% for %}",
        "{{ messages[99].content }}",
        "{{ 1/0 }}",
        "{{ undefined.x.y }}",
        "",
        "{{ messages | tojson }}{{ tools | tojson }}",
        "{% for m in messages %}{{ m.content }}{% endfor %}",
        "{{ raise_exception('no') }}",
        "{{ ''.__class__.__mro__ }}",
        "{% for i in range(10**9) %}{% endfor %}",
    ],
    "continue_final_message": [True],
    "add_generation_prompt": [False],
    "reasoning_effort": ["none", "max", ""],
    "input": [
        "",
        [],
        [""],
        [1],
        [None],
        [[]],
        [{"type": "unknown"}],
        [{"type": ["message"]}],
        [{"type": {"a": 1}}],
        [{"type": None, "role": "user", "content": "x"}],
        [{"role": "tool", "content": "x"}],
        [{"role": "user", "content": []}],
        [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
        [{"type": "function_call_output", "call_id": "c", "output": "r"}],
        [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}],
        [{"type": "function_call", "call_id": "c", "name": "f", "arguments": DEEP_TEXT}],
        [{"type": "reasoning", "summary": []}],
        [{"type": "reasoning", "summary": [], "encrypted_content": "xx"}],
        [{"role": "assistant", "content": "x", "status": "in_progress"}],
        [{"role": "assistant", "content": "", "status": "incomplete"}],
        [
            {
                "type": "function_call_output",
                "call_id": "c",
                "output": [{"type": "input_text", "text": "r"}],
            }
        ],
        [{"type": "message", "role": "user", "content": "x", "phase": "final_answer", "id": 5}],
    ],
    "instructions": ["", "\ud800", None],
    "text": [
        {"format": {"type": "json_schema"}},
        {"format": {"type": "json_schema", "name": "x"}},
        {"format": {"type": "json_object"}},
        {"verbosity": "low"},
        {"format": None},
        {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}},
    ],
    "include": [
        [],
        ["message.output_text.logprobs"],
        ["reasoning.encrypted_content"],
        ["file_search_call.results"],
        [1],
    ],
    "reasoning": [
        {},
        {"effort": "max"},
        {"summary": "detailed"},
        {"generate_summary": "auto"},
        {"effort": "xhigh", "summary": "auto"},
    ],
    "truncation": ["auto", "disabled", "x"],
    "previous_response_id": ["resp_1"],
    "background": [True, False],
    "service_tier": ["flex", "auto"],
    "store": [True, False],
    "best_of": [1, 2],
    "tokens": [[], [-1], [0], [255], [256], [10**20], [True], [1.0]],
    "add_special_tokens": [True, False],
    "model": ["", "fake-model", "gpt-17", None],
}

FIELDS = {
    "/v1/completions": sorted(
        {f.alias or k for k, f in CompletionRequest.model_fields.items()}
        | set(_COMPLETION_UNIMPLEMENTED)
    ),
    "/v1/chat/completions": sorted(
        {f.alias or k for k, f in ChatCompletionRequest.model_fields.items()}
        | set(_CHAT_UNIMPLEMENTED)
    ),
    "/v1/responses": sorted({f.alias or k for k, f in ResponsesRequest.model_fields.items()}),
    "/tokenize": sorted({f.alias or k for k, f in TokenizeRequest.model_fields.items()}),
    "/detokenize": sorted({f.alias or k for k, f in DetokenizeRequest.model_fields.items()}),
}
FIELDS["/invocations"] = sorted(
    set(FIELDS["/v1/completions"]) | set(FIELDS["/v1/chat/completions"])
)


def _paths(v, at=()):
    """Every (path) inside a JSON value, the value itself not included."""
    if isinstance(v, dict):
        for k, x in v.items():
            yield at + (k,)
            yield from _paths(x, at + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v[:8]):
            yield at + (i,)
            yield from _paths(x, at + (i,))


def _get(v, path):
    for p in path:
        v = v[p]
    return v


def _weird(rng: random.Random):
    if rng.random() < 0.15:  # a small random structure
        k = rng.randrange(3)
        if k == 0:
            return [_weird(rng) for _ in range(rng.randrange(4))]
        if k == 1:
            return {rng.choice(["type", "text", "name", "x", ""]): _weird(rng) for _ in range(2)}
    return copy.deepcopy(rng.choice(WEIRD))


def mutate(rng: random.Random, body: dict, route: str) -> dict:
    body = copy.deepcopy(body)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        op = rng.random()
        paths = list(_paths(body))
        if op < 0.2:  # fields of another valid body: features combined
            other = rng.choice(BASES[route])
            for k in rng.sample(sorted(other), min(len(other), rng.randrange(1, 4))):
                body[k] = copy.deepcopy(other[k])
            continue
        op = (op - 0.2) / 0.8
        if op < 0.12 and paths:  # drop a field or an element
            path = rng.choice(paths)
            parent = _get(body, path[:-1])
            if isinstance(parent, dict):
                parent.pop(path[-1], None)
            elif path[-1] < len(parent):
                parent.pop(path[-1])
        elif op < 0.32 and paths:  # a wrong value anywhere
            path = rng.choice(paths)
            parent = _get(body, path[:-1])
            if isinstance(parent, dict) or path[-1] < len(parent):
                parent[path[-1]] = _weird(rng)
        elif op < 0.42:  # a known field set to a wrong value
            body[rng.choice(FIELDS[route])] = _weird(rng)
        elif op < 0.85:  # a known field set to an odd but valid-looking value
            names = [f for f in FIELDS[route] if f in ODD]
            name = rng.choice(names)
            body[name] = copy.deepcopy(rng.choice(ODD[name]))
            if name == "use_beam_search":
                body["n"] = rng.choice([1, 2, 10, 11, 0])
        elif op < 0.93:  # an unknown field somewhere
            dicts = [body] + [_get(body, p) for p in paths if isinstance(_get(body, p), dict)]
            rng.choice(dicts)[rng.choice(["foo", "", "type ", "x" * 100, "\U0001f642"])] = _weird(
                rng
            )
        else:  # an element of odd type in a list
            lists = [_get(body, p) for p in paths if isinstance(_get(body, p), list)]
            if lists:
                lst = rng.choice(lists)
                lst.insert(rng.randrange(len(lst) + 1), _weird(rng))
    return body


def encode(body: dict) -> bytes:
    """The body's JSON text (ASCII: a lone surrogate goes as its \\u escape); DEEP spliced in as
    a list nested 100,000 deep."""
    text = json.dumps(body)
    deep = json.dumps(DEEP)
    if deep in text:
        text = text.replace(deep, "[" * 100_000 + "]" * 100_000, 1).replace(deep, "[[]]")
    return text.encode()


# ----------------------------------------------------------------------------- checking
class _Errors(logging.Handler):
    """The server's logged errors (a 500's traceback) while a request runs."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def text(self) -> str:
        f = logging.Formatter()
        return "\n".join(f.format(r) for r in self.records)[-3000:]


def _error_shape(err, status: Optional[int] = None) -> Optional[str]:
    """What is wrong with an error object (None: it is the server's shape)."""
    if not isinstance(err, dict) or not {"message", "type", "param", "code"} <= set(err):
        return f"not the error shape: {err!r}"[:300]
    if not isinstance(err["message"], str) or not err["message"] or not err["type"]:
        return f"no message or type: {err!r}"[:300]
    if err["param"] is not None and not isinstance(err["param"], str):
        return f"param not a string: {err!r}"[:300]
    return None


def _named(route: str, body: dict, param: str) -> bool:
    """Whether a 4xx's param names a field of the route's request: a path into the body, whose
    last part may be missing (a required field, or a top-level field of the route left at its
    default) or past a value that is not an object (its wrong type)."""
    at, parts = body, param.split(".")
    for i, p in enumerate(parts):
        if isinstance(at, dict) and p in at:
            at = at[p]
        elif isinstance(at, list) and p.isdigit() and int(p) < len(at):
            at = at[int(p)]
        elif i == 0:  # /v1/responses' `prompt` is a stored template, never the input's tokens
            return p in FIELDS[route] and not (route == "/v1/responses" and p == "prompt")
        else:
            return i == len(parts) - 1 or not isinstance(at, (dict, list))
    return True


def _fault_4xx(route: str, body: dict, raw: str, status: int) -> Optional[str]:
    try:
        err = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return f"a {status} without the error JSON: {raw[:200]!r}"
    fault = _error_shape(err, status)
    if fault is None and status != 404 and err["param"] is not None:
        if not _named(route, body, err["param"]):
            fault = f"param {err['param']!r} names no field of the body: {err['message'][:200]}"
    return fault


def _sse_fault(route: str, text: str) -> Optional[str]:
    """What is wrong with a 200 stream: an error event, a missing end, a line not JSON."""
    if route == "/v1/responses":
        events = [b for b in text.split("\n\n") if b.strip()]
        last = None
        for e in events:
            data = [line[6:] for line in e.split("\n") if line.startswith("data: ")]
            if not data:
                return f"an event without data: {e[:200]!r}"
            last = json.loads(data[0])
            if last.get("type") == "error":
                return f"error event in the stream: {last}"
        if last is None or last.get("type") != "response.completed":
            return f"the stream does not end with response.completed: {last}"[:300]
        return None
    data = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    if not data or data[-1] != "[DONE]":
        return f"the stream does not end with [DONE]: {data[-2:]}"[:300]
    for d in data[:-1]:
        obj = json.loads(d)
        if "error" in obj:
            return f"error event in the stream: {obj}"[:400]
    return None


def _fault(route: str, body: dict, status: int, ctype: str, raw: str) -> Optional[str]:
    """What is wrong with an answer (None: a 200, or a 4xx in the error shape naming a field)."""
    if status == 200:
        try:
            if "text/event-stream" in ctype:
                return _sse_fault(route, raw)
            json.loads(raw)
        except ValueError as e:
            return f"a 200 that is not JSON ({e}): {raw[:200]!r}"
        return None
    if 400 <= status < 500:
        return _fault_4xx(route, body, raw, status)
    return f"status {status}: {raw[:300]}"


def send(c, route: str, body: dict, log: _Errors) -> Optional[str]:
    """One request to the app; the fault found, with the server's logged traceback."""
    log.records.clear()
    headers = {"Content-Type": "application/json"}
    t0 = time.monotonic()
    with c.stream("POST", route, content=encode(body), headers=headers) as r:
        raw = r.read().decode("utf-8", "replace")
        status, ctype = r.status_code, r.headers.get("content-type", "")
    took = time.monotonic() - t0
    fault = f"took {took:.1f} s" if took > 20 else _fault(route, body, status, ctype, raw)
    if fault and log.records:
        fault += "\n" + log.text()
    return fault


def _report(faults: list[tuple[str, dict, str]]) -> str:
    lines = [f"{len(faults)} bodies failed:"]
    for route, body, fault in faults[:12]:
        lines.append(f"--- {route} {json.dumps(body)[:600]}\n{fault}")
    return "\n".join(lines)


def bodies(rng: random.Random, counts: dict[str, int]):
    """(route, body) pairs: each route's valid bodies, streamed and not where the route
    streams, mutated `counts[route]` times in all."""
    for route, count in counts.items():
        streams = route not in ("/tokenize", "/detokenize")
        for i in range(count):
            base = dict(BASES[route][i % len(BASES[route])])
            if streams and i % 2:
                base["stream"] = True
                if route != "/v1/responses" and i % 4 == 1:
                    base["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
            yield route, mutate(rng, base, route)


# ----------------------------------------------------------------------------- the fake engine
SCRIPT = (
    '<think>The user wants Paris.</think>It is sunny. <tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "Paris"}}\n</tool_call>'
)
PYTHONIC = "mull</think>[get_weather(city='Paris'), get_time()]"
FORCED = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'

# a chat template that renders tools and documents, ChatML-like
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}[{{ c.function.name }}({{ c.function.arguments }})]"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if documents %}{{ documents | tojson }}{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_tokenizer():
    """A real paxengine Tokenizer whose ids are bytes (byte-level BPE without merges), with
    TEMPLATE: the fake engine's outputs (one character a token) decode as they were written."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from paxengine.tokenizer import Tokenizer

    # GPT-2's byte -> printable character map
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    vocab = {chr(c): b for b, c in zip(bs, cs)}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    return Tokenizer(hf, bos_token=None, eos_token=None, chat_template=TEMPLATE)


def _fake(script: str, real_tokenizer: bool = False) -> FakeEngine:
    engine = FakeEngine(
        EngineConfig(max_model_len=512, max_waiting_requests=64, served_model_name="fake-model"),
        step_s=0,
    )
    engine.script = script
    if real_tokenizer:
        engine.tokenizer = _byte_tokenizer()
    return engine


SERVERS = {
    # --reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser hermes
    "reasoning+hermes": (
        lambda: _fake(SCRIPT),
        dict(reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes"),
        {
            "/v1/completions": 320,
            "/v1/chat/completions": 240,
            "/v1/responses": 200,
            "/invocations": 160,
            "/tokenize": 100,
            "/detokenize": 100,
        },
    ),
    # a forced call's output, as its grammar makes it: tool_choice required or a function
    "forced-calls": (
        lambda: _fake(FORCED),
        dict(enable_auto_tool_choice=True, tool_call_parser="hermes"),
        {"/v1/chat/completions": 100, "/v1/responses": 60},
    ),
    # --trust-request-chat-template --tool-call-parser pythonic (a real tokenizer and template)
    "trusted-template+pythonic": (
        lambda: _fake(PYTHONIC, real_tokenizer=True),
        dict(
            trust_request_chat_template=True,
            enable_auto_tool_choice=True,
            tool_call_parser="pythonic",
            reasoning_parser="deepseek_r1",
        ),
        {"/v1/chat/completions": 140, "/v1/responses": 60, "/tokenize": 100},
    ),
}


@pytest.mark.timeout(300)  # a hang fails here, not at the suite's limit
@pytest.mark.parametrize("name", list(SERVERS))
def test_fuzz_every_route_on_the_fake_engine(name):
    make, flags, counts = SERVERS[name]
    rng = random.Random(f"{SEED}-{name}")
    log, serving = _Errors(), logging.getLogger("serving")
    serving.addHandler(log)
    faults, engine = [], make()
    try:
        with TestClient(
            build_app(engine, ServerConfig(**flags)), raise_server_exceptions=False
        ) as c:
            for route, body in bodies(rng, counts):
                if route in ("/tokenize", "/v1/chat/completions") and "chat_template" not in body:
                    if name.startswith("trusted") and rng.random() < 0.3:
                        body["chat_template"] = rng.choice(ODD["chat_template"])
                fault = send(c, route, body, log)
                if fault:
                    faults.append((route, body, fault))
            r = c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert not engine.running  # every request ended or was aborted
    finally:
        serving.removeHandler(log)
    assert not faults, _report(faults)


# ----------------------------------------------------------------------------- the real engine
def _short(route: str, body: dict) -> dict:
    """Keep the real SmolLM2 server's answers short (2 CPU cores): any token budget the mutation
    left out or made large (but in range) is 4."""
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        v = body.get(name)
        if type(v) is int and 4 < v < 10**6:
            body[name] = 4
    chat = route in ("/v1/chat/completions", "/v1/responses", "/invocations") and (
        "messages" in body or "input" in body
    )
    if chat and not any(
        n in body for n in ("max_tokens", "max_completion_tokens", "max_output_tokens")
    ):
        body["max_output_tokens" if "input" in body else "max_tokens"] = 4
    if "n" in body and type(body["n"]) is int and body["n"] > 4 and not body.get("use_beam_search"):
        body["n"] = 4
    return body


@pytest.mark.timeout(400)
def test_fuzz_subset_on_the_real_server(server, http):
    """60 mutated bodies against the real engine (its tokenizer, grammars, beam search and
    validation), across the routes."""
    rng = random.Random(f"{SEED}-real")
    counts = {
        "/v1/completions": 16,
        "/v1/chat/completions": 18,
        "/v1/responses": 14,
        "/invocations": 4,
        "/tokenize": 5,
        "/detokenize": 3,
    }
    faults = []
    for route, body in bodies(rng, counts):
        body = _short(route, body)
        if "model" in body and body["model"] == "fake-model":
            body["model"] = server.model
        try:
            r = http.post(
                route,
                content=encode(body),
                headers={"Content-Type": "application/json"},
                timeout=120,
            )
        except httpx.TimeoutException:
            faults.append((route, body, "timed out"))
            continue
        fault = _fault(route, body, r.status_code, r.headers.get("content-type", ""), r.text)
        if fault:
            faults.append((route, body, fault))
    assert server.engine.is_healthy()
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert not faults, _report(faults)
