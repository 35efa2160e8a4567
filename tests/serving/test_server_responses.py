"""POST /v1/responses (serving/responses.py): the official `openai` client's `responses.create`
and `responses.stream` against the real SmolLM2 server (conftest.py), each answer checked against
the chat endpoint's for the same messages (the same machinery underneath, so the same tokens);
the reasoning item, a model's own call and the stream's item order on a scripted fake engine;
the input items as chat messages; the refused fields."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from paxengine.config import EngineConfig
from paxengine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from serving.app import build_app
from serving.config import ServerConfig
from serving.responses import _messages
from serving.responses_protocol import ResponsesRequest

QUESTION = "What is the capital of France?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,  # the forced call ends after the city (SmolLM2 rambles)
    },
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


def _chat(client, server, messages, **kw):
    r = client.chat.completions.create(model=server.model, messages=messages, temperature=0, **kw)
    return r.choices[0], r.usage


def _types(events) -> list[str]:
    return [e.type for e in events]


def _valid_order(types: list[str]) -> None:
    """created, in_progress, then items (each: added, its parts and deltas, done), completed."""
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    open_item = False
    for t in types[2:-1]:
        if t == "response.output_item.added":
            assert not open_item
            open_item = True
        elif t == "response.output_item.done":
            assert open_item
            open_item = False
        else:
            assert open_item, t  # parts, deltas and their done events belong to an open item
    assert not open_item


# ----------------------------------------------------------------------------- real SmolLM2
def test_greedy_answer_is_the_chat_endpoints(client, server):
    """The same tokens as /v1/chat/completions for one user message (text, usage, logprobs)."""
    r = client.responses.create(
        model=server.model,
        input=QUESTION,
        max_output_tokens=16,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        store=True,  # vLLM without its store: taken as false
        metadata={"team": "a"},
    )
    choice, usage = _chat(
        client,
        server,
        [{"role": "user", "content": QUESTION}],
        max_tokens=16,
        logprobs=True,
        top_logprobs=2,
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.model == server.model
    assert r.output_text == choice.message.content and r.output_text
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    (part,) = msg.content
    assert part.type == "output_text" and part.annotations == []
    assert [lp.token for lp in part.logprobs] == [lp.token for lp in choice.logprobs.content]
    assert [lp.logprob for lp in part.logprobs] == pytest.approx(
        [lp.logprob for lp in choice.logprobs.content]
    )
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert r.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    u = r.usage
    assert (u.input_tokens, u.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    assert u.input_tokens_details.cached_tokens <= u.input_tokens
    # the settings it ran with, echoed
    assert (r.temperature, r.top_p, r.max_output_tokens) == (0.0, 1.0, 16)
    assert r.metadata == {"team": "a"} and r.tools == [] and r.tool_choice == "auto"


def test_stream_events_build_the_same_answer(client, server):
    """openai's stream helper parses every event; the deltas make the non-streamed text."""
    kw = dict(model=server.model, input=QUESTION, max_output_tokens=16, temperature=0)
    full = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = _types(events)
    _valid_order(types)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text == final.output_text
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    added = next(e for e in events if e.type == "response.output_item.added")
    assert final.output[0].id == added.item.id  # the final response names the streamed item
    assert final.usage.output_tokens == full.usage.output_tokens and final.status == full.status
    # the raw stream (create(stream=True)) carries the same events
    raw = list(client.responses.create(**kw, stream=True))
    assert _types(raw) == types


def test_instructions_and_message_items_are_the_chat_messages(client, server):
    items = [
        {"role": "user", "content": "Hi"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hello!"}],
        },
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Name a color."}],
        },
    ]
    r = client.responses.create(
        model=server.model,
        instructions="You are terse.",
        input=items,
        max_output_tokens=8,
        temperature=0,
    )
    choice, _ = _chat(
        client,
        server,
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Name a color."},
        ],
        max_tokens=8,
    )
    assert r.output_text == choice.message.content
    assert r.instructions == "You are terse."


def test_max_output_tokens_cut_is_incomplete(client, server):
    r = client.responses.create(
        model=server.model, input=QUESTION, max_output_tokens=2, temperature=0
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2 and r.max_output_tokens == 2


def test_function_call_round_trip(client, server):
    """A named tool_choice forces the call (a grammar, as on the chat endpoint); the call and the
    client's output go back as items, read as the chat endpoint reads the same messages."""
    r = client.responses.create(
        model=server.model,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=32,
        temperature=0,
    )
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id and call.id.startswith("fc_") and call.status == "completed"
    args = json.loads(call.arguments)
    assert isinstance(args["city"], str)
    assert r.tool_choice.name == "get_weather" and r.tools[0].name == "get_weather"
    # streamed: the argument deltas make the same call
    with client.responses.stream(
        model=server.model,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=32,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    _valid_order(_types(events))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments == final.output[0].arguments
    # the next turn: the call and its output as items (tool_choice auto: the server's parser)
    follow = [
        {"role": "user", "content": "What is the weather in Paris?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"},
    ]
    r2 = client.responses.create(
        model=server.model, input=follow, tools=[WEATHER], max_output_tokens=12, temperature=0
    )
    choice, _ = _chat(
        client,
        server,
        [
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 24 C"},
        ],
        tools=[CHAT_WEATHER],
        max_tokens=12,
    )
    assert r2.output_text == (choice.message.content or "")
    calls = [o for o in r2.output if o.type == "function_call"]
    assert [c.name for c in calls] == [c.function.name for c in choice.message.tool_calls or []]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"previous_response_id": "resp_abc"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
        ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input.0"),
        ({"input": []}, "input"),
        ({"store": False, "conversation": "conv_1"}, "conversation"),
        # the chat request's names (prompt, response_format) as the Responses request's
        ({"input": "Hi " * 600}, "input"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}},
            "text.format.schema",
        ),
    ],
)
def test_refused_fields_are_400s_naming_them(http, server, extra, param):
    r = http.post("/v1/responses", json={"model": server.model, "input": "Hi", **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"


# ----------------------------------------------------------------------------- scripted engine
THOUGHT = "<think>\nThe user wants Paris.\n</think>\n\nLet me check.\n"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _scripted(script: str, **server):
    from fake_engine import FakeEngine

    class Scripted(FakeEngine):
        """Writes `script` one character (token) per step."""

        async def _run(self, request_id, ids, params):
            m = RequestMetrics(arrival_time=0.0, num_prompt_tokens=len(ids))
            text = script[: params.max_tokens]
            try:
                for n in range(1, len(text) + 1):
                    done = n == len(text)
                    finish = ("stop" if text == script else "length") if done else None
                    o = CompletionOutput(
                        0, text[:n], [ord(c) for c in text[:n]], None, None, finish
                    )
                    yield RequestOutput(request_id, None, ids, [o], done, m)
            finally:
                self.running.pop(request_id, None)

    engine = Scripted(EngineConfig(max_model_len=4096, served_model_name="fake-model"), 0.0005)
    test = TestClient(build_app(engine, ServerConfig(**server)))
    api = openai.OpenAI(
        base_url="http://testserver/v1", api_key="x", http_client=test, max_retries=0
    )
    return test, api


def test_reasoning_text_and_call_items_streamed_and_whole():
    """--reasoning-parser and the model's own call (auto): a reasoning item, the message, a
    function_call item; the stream builds the same items in that order."""
    test, api = _scripted(
        THOUGHT + CALL,
        reasoning_parser="qwen3",
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    kw = dict(model="fake-model", input="Weather in Paris?", tools=[WEATHER], max_output_tokens=400)
    with test:
        r = api.responses.create(**kw)
        with api.responses.stream(**kw) as stream:
            events = list(stream)
            final = stream.get_final_response()
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    thought, msg, call = r.output
    assert thought.content[0].text == "\nThe user wants Paris.\n" and thought.summary == []
    assert thought.id.startswith("rs_")
    assert msg.content[0].text == "Let me check."  # stripped around the call, as chat's content
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert r.usage.output_tokens_details.reasoning_tokens == len("\nThe user wants Paris.\n")
    assert r.status == "completed"
    _valid_order(_types(events))
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == (thought.content[0].text, "Let me check.")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1, 2]


def test_input_items_as_chat_messages():
    """An earlier answer sent back (reasoning, text, a call) merges into one assistant message,
    a call's output is a tool message, instructions come first (vLLM's mapping)."""
    req = ResponsesRequest.model_validate(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "mull"}],
                },
                {
                    "type": "message",
                    "id": "msg_1",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
                },
                {
                    "type": "function_call",
                    "id": "fc_1",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": '{"city": "Paris"}',
                    "status": "completed",
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
            ],
        }
    )
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    assert _messages(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "reasoning": "mull", "content": "Checking.", "tool_calls": [call]},
        {"role": "tool", "content": "Sunny", "tool_call_id": "call_1"},
    ]
