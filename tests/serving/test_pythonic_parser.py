"""vLLM's `--tool-call-parser pythonic` / `llama4_pythonic` (serving/tool_parser_pythonic.py): a
Python list of calls, parsed whole and streamed cut at every character position (the streamed
calls are the parsed ones); texts that are not calls, `[` first included, stay content; through
the app on a fake engine that writes a scripted text."""

from __future__ import annotations

import json

import pytest
from fake_engine import ScriptedEngine
from fastapi.testclient import TestClient

from paxengine.config import EngineConfig
from serving import tool_parsers, tools
from serving.app import build_app
from serving.config import ServerConfig
from serving.tool_responses import ToolDeltas

TWO = "[get_weather(city=\"Paris\", days=3), get_time(tz='CET')]"
TWO_CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "CET"})]
VALID = [  # (text, calls)
    (TWO, TWO_CALLS),
    ("[get_time()]", [("get_time", {})]),
    # every literal: signs, floats, escapes, nested lists and dicts, True / False / None
    (
        '[f(s="Par\\u00eds \\x41\\101\\N{LATIN SMALL LETTER E WITH ACUTE}\\n", n=-3.5, i=+7, '
        "big=12345678901234567890, e=1e3, t=True, no=None, "
        'd={"a": [1, 2.0, None, False], "b": {"c": "d"}}, empty=[], nothing={})]',
        [
            (
                "f",
                {
                    "s": "París AAé\n",
                    "n": -3.5,
                    "i": 7,
                    "big": 12345678901234567890,
                    "e": 1000.0,
                    "t": True,
                    "no": None,
                    "d": {"a": [1, 2.0, None, False], "b": {"c": "d"}},
                    "empty": [],
                    "nothing": {},
                },
            )
        ],
    ),
    # blanks, line breaks, a trailing comma, triple quotes, implicit concatenation, a comment
    (
        '\n[\n  f(),\n  g(x="""tri"ple""", z=\'a\' "b"),  # done\n]\n',
        [("f", {}), ("g", {"x": 'tri"ple', "z": "ab"})],
    ),
    ('[f(q=\'say "hi"\', r="it\'s")]', [("f", {"q": 'say "hi"', "r": "it's"})]),
    ('[f(path="C:\\\\dir\\\\x")]', [("f", {"path": "C:\\dir\\x"})]),
]
PROSE = [  # not calls, and never the start of one
    "[1, 2, 3]",
    "[Note: the weather is fine]",
    "[link](https://example.com)",
    "[]",
    "[ ]",
    "[f]",
    "[f(1)]",  # positional
    "[f(a=x)]",  # a variable
    "[f(**kw)]",
    "[os.system(cmd='ls')]",  # not a plain name
    "[f(a=b'x')]",
    "Sure: [f(a=1)]",
]
BROKEN = [  # a call that went out before the text broke (streamed: it stays, the text follows)
    "[f(a=1 + 2)]",  # an expression
    "[f(a={1: 2})]",  # a key that is not a string
    '[f(a={"k": 1, "k": 2})]',  # a key twice
    "[f(a=1)] and some text",
    "[f(a=1), 2]",
    "[f(a=1)]\n[g(b=2)]",
    "[f(a=1)",  # cut by max_tokens
    "[f(a='line\nbreak')]",
]
NOT_CALLS = PROSE + BROKEN


def _calls(calls) -> list:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _stream(text: str, cuts: list[int], fmt: str = tools.PYTHONIC, parallel: bool = True):
    """(content, [(id, name, arguments)], names-before-arguments, finish) of text streamed in
    the pieces cut at `cuts`."""
    td = ToolDeltas("auto", parallel, fmt)
    bounds = [0, *cuts, len(text)]
    msgs = [td.step(text[a:b], None) for a, b in zip(bounds, bounds[1:])]
    msgs.append(td.step("", "stop"))
    content = "".join(m.content or "" for m, _ in msgs)
    calls, ordered = {}, True
    for m, _ in msgs:
        for d in m.tool_calls or []:
            if d.function.name is not None:
                ordered &= d.index not in calls and d.id is not None
                calls[d.index] = [d.id, d.function.name, d.function.arguments or ""]
            else:
                ordered &= d.index in calls and d.id is None
                calls[d.index][2] += d.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)], ordered, msgs[-1][1]


# ----------------------------------------------------------------------------- whole
@pytest.mark.parametrize("text, want", VALID)
def test_calls_whole(text, want):
    content, calls = tool_parsers.parse_tool_calls(text, tools.PYTHONIC)
    assert content is None and _calls(calls) == want
    assert len({c.id for c in calls}) == len(calls)
    # the arguments are json.dumps' (non-ASCII as it is)
    assert calls[0].arguments == json.dumps(want[0][1], ensure_ascii=False)


@pytest.mark.parametrize("text", NOT_CALLS)
def test_what_is_not_calls_is_content(text):
    assert tool_parsers.parse_tool_calls(text, tools.PYTHONIC) == (text.strip(), [])
    assert tool_parsers.parse_tool_calls("  ", tools.PYTHONIC) == (None, [])


def test_llama4_pythonic_takes_its_tags():
    """llama4_pythonic: a leading <|python_start|> and any <|python_end|> are left out; the
    plain list is taken too; pythonic keeps the tags (content)."""
    tagged = f"<|python_start|>{TWO}<|python_end|>"
    for text in (tagged, TWO, f"<|python_start|>\n{TWO}"):
        content, calls = tool_parsers.parse_tool_calls(text, tools.LLAMA4_PYTHONIC)
        assert content is None and _calls(calls) == TWO_CALLS, text
    assert tool_parsers.parse_tool_calls(tagged, tools.PYTHONIC) == (tagged, [])
    for name in ("pythonic", "llama4_pythonic"):
        assert name in tools.PARSERS


# ----------------------------------------------------------------------------- streamed
@pytest.mark.parametrize("text, want", VALID)
def test_every_split_point_streams_the_parsed_calls(text, want):
    """Two pieces cut at every position, and one character at a time: the calls (names first,
    each id once) and their arguments are the whole text's, text for text; no content."""
    _, parsed = tool_parsers.parse_tool_calls(text, tools.PYTHONIC)
    whole = [(c.name, c.arguments) for c in parsed]
    for cuts in [[]] + [[k] for k in range(1, len(text))] + [list(range(1, len(text)))]:
        content, calls, ordered, finish = _stream(text, cuts)
        assert (content, finish, ordered) == ("", "tool_calls", True), cuts
        assert [(n, a) for _, n, a in calls] == whole, cuts
        assert len({i for i, _, _ in calls}) == len(calls)


@pytest.mark.parametrize("text", NOT_CALLS)
def test_every_split_point_keeps_what_is_not_calls(text):
    """A text that is not calls (`[` first too) comes out as content, as written, wherever it
    is cut; without a call first while it could be one (BROKEN: a call whose start went out
    before the text broke stays)."""
    for cuts in [[]] + [[k] for k in range(1, len(text))] + [list(range(1, len(text)))]:
        content, calls, _, finish = _stream(text, cuts)
        assert content.strip() == text.strip() and finish == "stop", cuts
        if text in PROSE:
            assert calls == [], cuts


def test_calls_stream_as_they_come():
    """One character at a time: a non-call text goes out at its first sure character; a call's
    name goes out with its first argument; a string argument streams in many pieces while a
    number waits until it is whole."""
    td = ToolDeltas("auto", True, tools.PYTHONIC)
    text = '[get_weather(city="San Francisco", days=12)]'
    msgs = [td.step(ch, None)[0] for ch in text] + [td.step("", "stop")[0]]
    deltas = [(i, d) for i, m in enumerate(msgs) for d in m.tool_calls or []]
    first_i, first = deltas[0]
    assert first.function.name == "get_weather" and text[: first_i + 1].endswith('city="S')
    pieces = [d.function.arguments for _, d in deltas]
    assert "".join(pieces) == '{"city": "San Francisco", "days": 12}'
    assert sum(bool('"' not in p and p.strip(", ")) for p in pieces) > 5  # the city, char by char
    assert pieces[-2:] == [', "days": ', "12}"]  # the number whole, once its call closed
    td = ToolDeltas("auto", True, tools.PYTHONIC)
    assert td.step("[", None)[0].content is None  # may be calls: held
    assert td.step("Note", None)[0].content is None
    assert td.step(":", None)[0].content == "[Note:"  # can no longer be a call
    assert td.step(" hi", None)[0].content == " hi"


def test_llama4_tags_streamed():
    text = f"<|python_start|>{TWO}<|python_end|>"
    for cuts in [[k] for k in range(1, len(text))] + [list(range(1, len(text)))]:
        content, calls, ordered, finish = _stream(text, cuts, tools.LLAMA4_PYTHONIC)
        assert (content, finish, ordered) == ("", "tool_calls", True)
        assert [(n, json.loads(a)) for _, n, a in calls] == TWO_CALLS
    content, calls, _, _ = _stream("<|python_start|>no calls", [3, 9], tools.LLAMA4_PYTHONIC)
    assert (content, calls) == ("<|python_start|>no calls", [])


def test_not_parallel_keeps_the_first_call():
    _, calls, _, _ = _stream(TWO, [5, 20, 40], parallel=False)
    assert [n for _, n, _ in calls] == ["get_weather"]
    msg, finish = ToolDeltas("auto", False, tools.PYTHONIC).step(TWO, "stop")
    assert finish == "tool_calls" and {d.index for d in msg.tool_calls} == {0}


# ----------------------------------------------------------------------------- through the app
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def _chat(c, stream=False, **body):
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER, TIME], **body}
    if not stream:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]
    with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def _streamed(chunks) -> tuple[str, list, str]:
    deltas = [ch["delta"] for k in chunks for ch in k["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    calls: dict = {}
    for t in (t for d in deltas for t in d.get("tool_calls") or []):
        if t["index"] not in calls:
            calls[t["index"]] = [t["function"]["name"], ""]
        calls[t["index"]][1] += t["function"].get("arguments") or ""
    return (
        content,
        [(n, json.loads(a)) for n, a in calls.values()],
        chunks[-1]["choices"][0]["finish_reason"],
    )


def test_pythonic_calls_through_the_server():
    """--tool-call-parser pythonic: the calls in message.tool_calls (finish_reason tool_calls),
    streamed as the same calls; a text starting with `[` that is not calls stays content;
    tool_choice required / a named function are forced as for the other parsers; llama4_pythonic
    takes Llama 4's tags."""
    engine = ScriptedEngine(EngineConfig(max_model_len=4096, served_model_name="m"))
    engine.script = TWO
    cfg = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="pythonic")
    with TestClient(build_app(engine, cfg)) as c:
        ch = _chat(c)
        msg = ch["message"]
        assert ch["finish_reason"] == "tool_calls" and msg["content"] is None
        got = [
            (t["function"]["name"], json.loads(t["function"]["arguments"]))
            for t in msg["tool_calls"]
        ]
        assert got == TWO_CALLS and all(
            t["id"] and t["type"] == "function" for t in msg["tool_calls"]
        )
        assert _streamed(_chat(c, stream=True)) == ("", TWO_CALLS, "tool_calls")
        # not calls: content, as the model wrote it, whole and streamed
        engine.script = "[1] Paris is sunny. [2] Berlin is not."
        ch = _chat(c)
        assert ch["message"]["content"] == engine.script and ch["finish_reason"] == "stop"
        assert not ch["message"].get("tool_calls")
        assert _streamed(_chat(c, stream=True)) == (engine.script, [], "stop")
        # tool_choice none: plain text
        engine.script = TWO
        ch = _chat(c, tool_choice="none")
        assert ch["message"]["content"] == TWO and ch["finish_reason"] == "stop"
        # required and named: the grammar forces the call, read back as for every parser
        engine.script = '[{"name": "get_time", "arguments": {}}]'
        ch = _chat(c, tool_choice="required")
        assert engine.params[-1].structured_outputs is not None
        assert ch["finish_reason"] == "tool_calls"
        assert ch["message"]["tool_calls"][0]["function"]["name"] == "get_time"
        engine.script = '{"city": "Paris"}'
        named = {"type": "function", "function": {"name": "get_weather"}}
        ch = _chat(c, tool_choice=named)
        assert ch["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
        # one call only when parallel_tool_calls is false
        engine.script = TWO
        ch = _chat(c, parallel_tool_calls=False)
        assert [t["function"]["name"] for t in ch["message"]["tool_calls"]] == ["get_weather"]
    engine.script = f"<|python_start|>{TWO}<|python_end|>"
    cfg = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="llama4_pythonic")
    with TestClient(build_app(engine, cfg)) as c:
        got = [
            (t["function"]["name"], json.loads(t["function"]["arguments"]))
            for t in _chat(c)["message"]["tool_calls"]
        ]
        assert got == TWO_CALLS
        assert _streamed(_chat(c, stream=True)) == ("", TWO_CALLS, "tool_calls")
