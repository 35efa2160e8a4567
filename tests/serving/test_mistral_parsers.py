"""Mistral's parsers (vLLM's `--tool-call-parser mistral` and `--reasoning-parser mistral`) on
crafted texts, whole and streamed in pieces of every size and at every split point (the
`[TOOL_CALLS]`, `[THINK]`, `[/THINK]` markers cut in two). Through the server:
tests/serving/test_server_reasoning_tools.py::test_mistral_parsers_through_the_server."""

from __future__ import annotations

import json

import pytest

from serving import tool_parsers, tools
from serving.reasoning import ReasoningSplitter, prompt_block, split_reasoning
from serving.tool_responses import ToolDeltas

WEATHER = '{"city": "Paris", "days": 3}'
LIST_FORM = (  # tokenizers before v11: one marker, a JSON list
    'Let me check.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": 3}}, {"name": "get_time", "arguments": {}}]'
)
NAMED_FORM = (  # v11 on, as an HF tokenizer shows it: a marker and [ARGS] per call
    f"Let me check.[TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]get_time[ARGS]{{}}"
)
TWO_CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]


def _is_mistral_id(s: str) -> bool:
    return len(s) == 9 and s.isascii() and s.isalnum()


def _calls(calls) -> list:
    return [(c.name, json.loads(c.arguments)) for c in calls]


# ----------------------------------------------------------------------------- tool calls, whole
@pytest.mark.parametrize("text", [LIST_FORM, NAMED_FORM, NAMED_FORM.replace("[ARGS]", "")])
def test_both_forms_whole(text):
    """Content is what comes before the marker; the calls get Mistral's 9-character ids."""
    content, calls = tool_parsers.parse_tool_calls(text, tools.MISTRAL)
    assert content == "Let me check."
    assert _calls(calls) == TWO_CALLS
    assert all(_is_mistral_id(c.id) for c in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize(
    "text, want",
    [
        ("Just text, [no] calls.", ("Just text, [no] calls.", [])),
        ('[TOOL_CALLS] {"name": "get_time", "arguments": {}}', (None, [("get_time", {})])),
        # the older form's JSON cut short, or not calls: content, as the model wrote it
        (
            '[TOOL_CALLS] [{"name": "get_time", "argu',
            ('[TOOL_CALLS] [{"name": "get_time", "argu', []),
        ),
        ('ok[TOOL_CALLS] [{"city": "Paris"}]', ('ok[TOOL_CALLS] [{"city": "Paris"}]', [])),
        ("[TOOL_CALLS] []", ("[TOOL_CALLS] []", [])),
        ("[TOOL_CALLS]", ("[TOOL_CALLS]", [])),
        # a name with no arguments is no call; the call after it still is
        ("[TOOL_CALLS]get_time[TOOL_CALLS]now[ARGS]{}", ("[TOOL_CALLS]get_time", [("now", {})])),
        # text after a JSON list is content
        ('[TOOL_CALLS][{"name": "now", "arguments": {}}] done', ("done", [("now", {})])),
    ],
)
def test_content_and_malformed_calls(text, want):
    content, calls = tool_parsers.parse_tool_calls(text, tools.MISTRAL)
    assert (content, _calls(calls)) == want


def test_named_arguments_that_are_not_json_stay_a_call():
    """vLLM's rule for v11 on: the model sees the call it tried (cut by max_tokens here)."""
    content, (call,) = tool_parsers.parse_tool_calls('[TOOL_CALLS]f[ARGS]{"a": ', tools.MISTRAL)
    assert content is None and (call.name, call.arguments) == ("f", '{"a":')


def test_a_call_id_the_model_wrote():
    """v11 templates render `[CALL_ID]` in earlier calls; a model that writes one keeps it if it
    is Mistral's shape, else gets a new one."""
    _, (a, b) = tool_parsers.parse_tool_calls(
        "[TOOL_CALLS]f[CALL_ID]abcDEF123[ARGS]{}[TOOL_CALLS]g[CALL_ID]bad-id[ARGS]{}",
        tools.MISTRAL,
    )
    assert (a.name, a.id) == ("f", "abcDEF123")
    assert b.name == "g" and _is_mistral_id(b.id) and b.id != "bad-id"


def test_auto_picks_mistral_from_the_chat_template():
    assert tools.call_format("{{ '[TOOL_CALLS]' + tool_calls|tojson }}") == tools.MISTRAL
    assert tools.call_format("<|python_tag|>") == tools.LLAMA3_JSON
    assert tools.call_format("{{ messages }}") == tools.HERMES
    assert "mistral" in tools.PARSERS


# ----------------------------------------------------------------------------- tool calls, streamed
def _stream(text: str, cuts: list[int], parallel: bool = True):
    """(content, {index: (id, name, arguments)}, name-before-arguments, finish) of text streamed
    in the pieces cut at `cuts`."""
    td = ToolDeltas("auto", parallel, tools.MISTRAL)
    bounds = [0, *cuts, len(text)]
    msgs = [td.step(text[a:b], None) for a, b in zip(bounds, bounds[1:])]
    msgs.append(td.step("", "stop"))
    content = "".join(m.content or "" for m, _ in msgs)
    calls, ordered = {}, True
    for m, _ in msgs:
        for d in m.tool_calls or []:
            if d.function.name is not None:
                ordered &= d.index not in calls
                calls[d.index] = [d.id, d.function.name, d.function.arguments or ""]
            else:
                ordered &= d.index in calls
                calls[d.index][2] += d.function.arguments or ""
    return content, calls, ordered, msgs[-1][1]


@pytest.mark.parametrize("text", [LIST_FORM, NAMED_FORM])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_calls_match_the_whole_text(text, size):
    content, calls, ordered, finish = _stream(text, list(range(size, len(text), size)))
    assert content == "Let me check." and finish == "tool_calls" and ordered
    assert [(n, json.loads(a)) for _, n, a in calls.values()] == TWO_CALLS
    assert sorted(calls) == [0, 1] and all(_is_mistral_id(i) for i, _, _ in calls.values())


@pytest.mark.parametrize("text", [LIST_FORM, NAMED_FORM])
def test_every_split_point(text):
    """Two pieces cut anywhere, the marker's inside included, give the whole text's result."""
    for cut in range(1, len(text)):
        content, calls, ordered, finish = _stream(text, [cut])
        got = [(n, json.loads(a)) for _, n, a in calls.values()]
        assert (content, got, ordered, finish) == ("Let me check.", TWO_CALLS, True, "tool_calls")


def test_named_calls_stream_name_then_arguments():
    """Character by character: the content goes out before the marker is whole, each call's
    name (with its id) first, then its arguments in several pieces."""
    td = ToolDeltas("auto", True, tools.MISTRAL)
    pieces = [td.step(ch, None)[0] for ch in NAMED_FORM] + [td.step("", "stop")[0]]
    i = NAMED_FORM.index("[TOOL_CALLS]")
    assert "".join(m.content or "" for m in pieces[:i]) == "Let me check."
    deltas = [d for m in pieces for d in m.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    weather = [d for d in deltas if d.index == 0]
    assert len(weather) > 5 and all(d.id is None for d in weather[1:])
    assert "".join(d.function.arguments for d in weather) == WEATHER


def test_not_parallel_keeps_the_first_call():
    for text in (LIST_FORM, NAMED_FORM):
        _, calls, _, _ = _stream(text, [5, 20, 40], parallel=False)
        assert [n for _, n, _ in calls.values()] == ["get_weather"]
        td = ToolDeltas("auto", False, tools.MISTRAL)
        msg, _ = td.step(text, "stop")
        assert {d.index for d in msg.tool_calls} == {0}
        assert [d.function.name for d in msg.tool_calls if d.function.name] == ["get_weather"]


def test_malformed_streamed_stays_content():
    text = 'Hm.[TOOL_CALLS] [{"name": "get_time", "argu'
    content, calls, _, finish = _stream(text, list(range(1, len(text))))
    assert (content, calls, finish) == (text, {}, "stop")


def test_forced_calls_get_mistral_ids_too():
    """tool_choice required or named under this parser: the ids the template takes back."""
    td = ToolDeltas("required", True, tools.MISTRAL)
    msg, finish = td.step('[{"name": "get_time", "arguments": {}}]', "stop")
    assert finish == "tool_calls" and _is_mistral_id(msg.tool_calls[0].id)
    td = ToolDeltas("get_time", True, tools.MISTRAL)
    msg, _ = td.step("{}", None)
    assert _is_mistral_id(msg.tool_calls[0].id)


# ----------------------------------------------------------------------------- reasoning
@pytest.mark.parametrize(
    "text, want",
    [  # vLLM's cases (tests/reasoning/test_mistral_reasoning_parser.py)
        (
            "[THINK]This is reasoning[/THINK]This is the rest",
            ("This is reasoning", "This is the rest"),
        ),
        ("[THINK]This\nThat[/THINK]", ("This\nThat", None)),
        ("[THINK]cut by max_tokens", ("cut by max_tokens", None)),
        ("This is content", (None, "This is content")),
        # a stray end tag (no [THINK]) is dropped, all content
        ("This is a section[/THINK]The rest", (None, "This is a sectionThe rest")),
        ("[/THINK]The rest", (None, "The rest")),
        # text before [THINK] is content too
        ("Before\n[THINK]Reasoning[/THINK]\nThe rest", ("Reasoning", "Before\n\nThe rest")),
        ("", (None, None)),
        # one block: a later [THINK] is content
        ("[THINK]a[/THINK]b[THINK]c", ("a", "b[THINK]c")),
    ],
)
def test_reasoning_whole_and_streamed(text, want):
    assert split_reasoning(text, "mistral", prompt_block("", "mistral")) == want
    for size in (1, 2, 3, 5, max(1, len(text))):
        sp = ReasoningSplitter("mistral")
        r, c = "", ""
        for i in range(0, len(text), size):
            a, b = sp.feed(text[i : i + size])
            r, c = r + a, c + b
        a, b = sp.finish()
        assert ((r + a) or None, (c + b) or None) == want, size


def test_reasoning_ignores_the_prompt_tags():
    """Magistral's system prompt shows an example [THINK]...[/THINK] block (and a Qwen-style
    prompt's <think> means nothing here): only the output's own tags count, as in vLLM."""
    for prompt in ("[SYSTEM_PROMPT]e.g. [THINK]x[/THINK] y[/SYSTEM_PROMPT]", "<think>\n"):
        state = prompt_block(prompt, "mistral")
        assert state is None
        assert split_reasoning("Plain answer.", "mistral", state) == (None, "Plain answer.")
    assert prompt_block("<think>\n") == "open"  # the others' rule is unchanged
