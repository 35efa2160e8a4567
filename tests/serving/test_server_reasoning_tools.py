"""Reasoning output (--reasoning-parser), the model's own tool calls by name
(--enable-auto-tool-choice --tool-call-parser, Qwen3's XML format) and --generation-config
(issue #56): the parsers on crafted texts, whole and streamed a character at a time (tags split
across pieces); the response path's stage chain through the app on a fake engine that writes a
scripted text; one reasoning split on the real SmolLM2 server, its output forced by a regex."""

from __future__ import annotations

import json
import logging
import re

import pytest
from fake_engine import FakeEngine, ScriptedEngine
from fastapi.testclient import TestClient

from paxengine.config import EngineConfig
from paxengine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from serving import tool_parsers, tools
from serving.app import build_app
from serving.config import ServerConfig
from serving.reasoning import ReasoningSplitter, prompt_block, split_reasoning
from serving.tool_responses import ToolDeltas

THOUGHT = "<think>\nThe user wants Paris.\n</think>\n\nIt is sunny."


def _streamed(split: ReasoningSplitter, text: str, size: int) -> tuple[str, str]:
    r, c = "", ""
    for i in range(0, len(text), size):
        a, b = split.feed(text[i : i + size])
        r, c = r + a, c + b
    a, b = split.finish()
    return r + a, c + b


# ----------------------------------------------------------------------------- reasoning parsers
@pytest.mark.parametrize(
    "parser, prompt, text, want",
    [
        ("qwen3", "", THOUGHT, ("\nThe user wants Paris.\n", "\n\nIt is sunny.")),
        ("qwen3", "", "No tags at all.", (None, "No tags at all.")),  # enable_thinking false
        ("qwen3", "<think>\n\n</think>\n\n", "Plain.", (None, "Plain.")),  # closed in the prompt
        ("qwen3", "<|im_start|>assistant\n<think>\n", "mull</think>ok", ("mull", "ok")),  # 3.5
        ("qwen3", "", "mull</think>ok", ("mull", "ok")),  # vLLM's: a lone end tag
        ("qwen3", "", "<think>cut by max_tokens", ("cut by max_tokens", None)),
        ("deepseek_r1", "", "mull</think>ok", ("mull", "ok")),  # the block is assumed open
        ("deepseek_r1", "", "<think>mull</think>ok", ("mull", "ok")),
        ("deepseek_r1", "", "still thinking", ("still thinking", None)),
        ("deepseek_r1", "<think>\n\n</think>", "Plain.", (None, "Plain.")),
    ],
)
def test_reasoning_split_whole_and_streamed(parser, prompt, text, want):
    state = prompt_block(prompt)
    assert split_reasoning(text, parser, state) == want
    lone_end = parser == "qwen3" and state is None and text.startswith("mull")
    for size in (1, 2, 5, len(text)):
        r, c = _streamed(ReasoningSplitter(parser, state), text, size)
        if lone_end:  # streaming cannot look ahead: sent as content before </think> came
            assert c.endswith("ok")
            continue
        assert ((r or None), (c or None)) == want, size


def test_prompt_block():
    assert prompt_block("no tags") is None
    assert prompt_block("a<think>\n") == "open"
    assert prompt_block("<think>x</think> then <think>") == "open"
    assert prompt_block("<think>\n\n</think>\n\n") == "closed"


# ----------------------------------------------------------------------------- Qwen3 XML calls
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "temp": {"type": "number"},
                "hourly": {"type": "boolean"},
                "where": {"type": "object"},
                "code": {"type": "string"},
            },
        },
    },
}
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=temp>\n21.5\n</parameter>\n"
    "<parameter=hourly>\ntrue\n</parameter>\n<parameter=where>\n"
    '{"lat": 48.9, "lon": 2.35}\n</parameter>\n<parameter=code>\n007\n</parameter>\n'
    "</function>\n</tool_call>"
)
XML_ARGS = {
    "city": "Paris",
    "days": 3,
    "temp": 21.5,
    "hourly": True,
    "where": {"lat": 48.9, "lon": 2.35},
    "code": "007",
}
SHORT = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"


@pytest.mark.parametrize("fmt", [tools.QWEN3_CODER, tools.QWEN3_XML])
def test_qwen3_xml_calls_typed_by_the_schema(fmt):
    content, calls = tool_parsers.parse_tool_calls(
        "Let me look.\n" + XML_CALL + SHORT, fmt, [WEATHER]
    )
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", XML_ARGS),
        ("get_time", {}),
    ]
    # not a call: stays the text; cut inside a call: closed with what it has
    assert tool_parsers.parse_tool_calls("<tool_call>oops</tool_call>", fmt) == (
        "<tool_call>oops</tool_call>",
        [],
    )
    cut = XML_CALL[: XML_CALL.index("<parameter=days>")] + "<parameter=days>\n4"
    _, (call,) = tool_parsers.parse_tool_calls(cut, fmt, [WEATHER])
    assert json.loads(call.arguments) == {"city": "Paris", "days": 4}


@pytest.mark.parametrize("size", [1, 3, 11, 1000])
def test_qwen3_xml_streams_openai_deltas(size):
    """Streamed a few characters at a time (tags split across pieces): content first, then
    each call's name (index, id, type) and its arguments piece by piece, which join into the
    JSON the whole text parses to; finish_reason tool_calls."""
    text = "\n\nChecking." + XML_CALL + "\n" + SHORT
    td = ToolDeltas("auto", True, tools.QWEN3_XML, [WEATHER])
    msgs = [td.step(text[i : i + size], None) for i in range(0, len(text), size)]
    msgs.append(td.step("", "stop"))
    assert "".join(m.content or "" for m, _ in msgs).strip() == "Checking."
    assert msgs[-1][1] == "tool_calls"
    deltas = [d for m, _ in msgs for d in m.tool_calls or []]
    firsts = [d for d in deltas if d.id]
    assert [(d.index, d.type, d.function.name) for d in firsts] == [
        (0, "function", "get_weather"),
        (1, "function", "get_time"),
    ]
    args = ["".join(d.function.arguments or "" for d in deltas if d.index == i) for i in (0, 1)]
    assert json.loads(args[0]) == XML_ARGS and json.loads(args[1]) == {}
    if size == 1:  # the arguments came as several pieces, not whole at the end
        assert sum(1 for d in deltas if d.index == 0) > 3
    one = ToolDeltas("auto", False, tools.QWEN3_XML, [WEATHER])
    msg, _ = one.step(text, "stop")
    assert {d.index for d in msg.tool_calls} == {0}


# ----------------------------------------------------------------------------- the app's chain
def _client(script: str, **server):
    engine = ScriptedEngine()
    engine.script = script
    return engine, TestClient(build_app(engine, ServerConfig(**server)))


def _chat(c, stream=False, **body):
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], **body}
    if not stream:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()
    with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


REASONING_TOOLS = dict(
    reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="qwen3_xml"
)


def test_reasoning_then_tool_calls_through_the_chain():
    """<think> reasoning, content, a Qwen3 XML call: the final message and the stream
    (delta.reasoning, content, tool-call deltas) agree."""
    engine, c = _client(THOUGHT + "\n" + XML_CALL, **REASONING_TOOLS)
    with c:
        body = {"tools": [WEATHER], "max_tokens": 400}
        r = _chat(c, **body)
        (ch,) = r["choices"]
        msg = ch["message"]
        assert msg["reasoning"] == "\nThe user wants Paris.\n"
        assert msg["content"] == "It is sunny."
        assert ch["finish_reason"] == "tool_calls"
        (call,) = msg["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == XML_ARGS
        chunks = _chat(c, stream=True, **body)
        deltas = [ch["delta"] for k in chunks for ch in k["choices"]]
        assert "".join(d.get("reasoning", "") for d in deltas) == msg["reasoning"]
        assert "".join(d.get("content") or "" for d in deltas).strip() == msg["content"]
        assert not any("reasoning_content" in d for d in deltas)
        pieces = [t for d in deltas for t in d.get("tool_calls", [])]
        assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["id"]
        args = "".join(t["function"].get("arguments", "") for t in pieces)
        assert json.loads(args) == XML_ARGS
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # include_reasoning false drops it, streamed or not
        r = _chat(c, include_reasoning=False, **body)
        assert r["choices"][0]["message"]["reasoning"] is None
        chunks = _chat(c, stream=True, include_reasoning=False, **body)
        assert not any("reasoning" in ch["delta"] for k in chunks for ch in k["choices"])
        # cut inside the block (max_tokens): reasoning only, finish length
        r = _chat(c, max_tokens=12)
        assert r["choices"][0]["message"]["reasoning"] == "\nThe "
        assert r["choices"][0]["message"]["content"] is None
        assert r["choices"][0]["finish_reason"] == "length"


def test_default_chat_template_kwargs_reach_every_template():
    """--default-chat-template-kwargs (Qwen3.5 without thinking: {"enable_thinking": false}):
    every chat's template gets them, a request's chat_template_kwargs win key by key (vLLM's
    merge); the flag parses from `paxengine serve`'s command line; a bad value fails at start-up
    naming the key."""
    from serving.cli import parse

    defaults = {"enable_thinking": False, "style": "terse"}
    engine, c = _client("ok", default_chat_template_kwargs=defaults)
    with c:
        _chat(c)
        assert {k: engine.variables[-1][k] for k in defaults} == defaults
        _chat(c, chat_template_kwargs={"enable_thinking": True})
        got = engine.variables[-1]
        assert got["enable_thinking"] is True and got["style"] == "terse"
        r = c.post("/tokenize", json={"messages": [{"role": "user", "content": "q"}]})
        assert r.status_code == 200 and engine.variables[-1]["enable_thinking"] is False
    _, scfg = parse(["--default-chat-template-kwargs", '{"enable_thinking": false}'])
    assert scfg.default_chat_template_kwargs == {"enable_thinking": False}
    for bad, match in [
        ("{nope", "not valid JSON"),
        ("[1]", "expected a JSON object"),
        ('{"messages": []}', "messages are set by the server"),
    ]:
        with pytest.raises(ValueError, match=match):
            ServerConfig(default_chat_template_kwargs=bad)


def test_chat_template_flag_renders_chats_with_its_template(tmp_path):
    """--chat-template FILE (or the Jinja text itself): chats render with it, not the model's,
    the default kwargs reaching it; a template Jinja cannot parse or a missing file fails at
    start-up naming the key."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    from paxengine.tokenizer import Tokenizer
    from serving.cli import parse
    from serving.generation import ServerState
    from serving.prompts import chat_prompt
    from serving.protocol import ChatCompletionRequest

    ours = "{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ mood }}]{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(ours)
    engine = FakeEngine()
    hf = HFTokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    engine.tokenizer = Tokenizer(hf, bos_token=None, eos_token=None, chat_template="model's")
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    for template in (str(path), ours):
        config = ServerConfig(chat_template=template, default_chat_template_kwargs={"mood": "ok"})
        text, _ = chat_prompt(ServerState.create(engine, config), req)
        assert text == "[user|hi|ok]"
    assert chat_prompt(ServerState.create(engine, ServerConfig()), req)[0] == "model's"
    assert parse(["--chat-template", str(path)])[1].chat_template_text() == ours
    for bad, match in [("{% for %}", "not a valid Jinja template"), ("nofile", "is not a file")]:
        with pytest.raises(ValueError, match=match):
            ServerConfig(chat_template=bad)


def test_documents_reach_the_chat_template():
    """vLLM's `documents` (a RAG template's retrieved texts) render through the template; a
    template variable of that name from the request is still refused."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    from paxengine.tokenizer import Tokenizer
    from serving.generation import ServerState
    from serving.prompts import chat_prompt
    from serving.protocol import ChatCompletionRequest

    rag = (
        "{% if documents %}{% for d in documents %}<{{ d.title }}: {{ d.text }}>{% endfor %}"
        "{% endif %}{% for m in messages %}[{{ m.content }}]{% endfor %}"
    )
    engine = FakeEngine()
    hf = HFTokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    engine.tokenizer = Tokenizer(hf, bos_token=None, eos_token=None, chat_template=rag)
    state = ServerState.create(engine, ServerConfig())
    docs = [{"title": "Paris", "text": "capital of France"}, {"title": "Rome", "text": "Italy"}]
    msgs = [{"role": "user", "content": "hi"}]
    req = ChatCompletionRequest(messages=msgs, documents=docs)
    assert chat_prompt(state, req)[0] == "<Paris: capital of France><Rome: Italy>[hi]"
    assert chat_prompt(state, ChatCompletionRequest(messages=msgs))[0] == "[hi]"
    req = ChatCompletionRequest(messages=msgs, chat_template_kwargs={"documents": docs})
    with pytest.raises(Exception, match="documents are set by the server"):
        chat_prompt(state, req)


def test_request_fields_of_reasoning_models():
    """reasoning_effort goes to the template (the request's chat_template_kwargs win); an
    assistant's reasoning (or the deprecated reasoning_content) goes back as both names;
    thinking_token_budget reaches the engine with the parser's tags (a 400 without a parser);
    a grammar while the reasoning may run reaches it with the tags too (it applies after the
    reasoning: tests/serving/test_server_thinking_model.py)."""
    engine, c = _client("ok", reasoning_parser="deepseek_r1")
    with c:
        _chat(c, reasoning_effort="high")
        assert engine.variables[-1]["reasoning_effort"] == "high"
        _chat(c, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "x"})
        assert engine.variables[-1]["reasoning_effort"] == "x"
        for name in ("reasoning", "reasoning_content"):
            history = [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", name: "because"},
                {"role": "user", "content": "more"},
            ]
            _chat(c, messages=history)
            sent = engine.variables[-1]["messages"][1]
            assert sent["reasoning"] == sent["reasoning_content"] == "because"
        _chat(c, thinking_token_budget=32)
        p = engine.params[-1]
        enc = [ord(ch) for ch in "</think>"]  # the fake's tokenizer: one id a character
        assert p.thinking_token_budget == 32 and list(p.think_tags.end_ids) == enc
        assert p.think_tags.inside  # deepseek_r1: the output starts inside the block
        for extra, field in [
            ({"thinking_token_budget": -1}, "thinking_token_budget"),
        ]:
            r = c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "q"}], **extra},
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        _chat(c, structured_outputs={"regex": "a+"})
        p = engine.params[-1]
        assert p.thinking_token_budget is None and p.think_tags.inside
        assert p.structured_outputs is not None
        # deepseek_r1: no tags in the output, all reasoning (the block is assumed open)
        r = _chat(c)
        assert r["choices"][0]["message"]["reasoning"] == "ok"
    engine, c = _client("ok")  # no --reasoning-parser
    with c:
        body = {"messages": [{"role": "user", "content": "q"}], "thinking_token_budget": 8}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "thinking_token_budget" and "--reasoning-parser" in err["message"]


def test_auto_tool_choice_needs_the_flag_as_in_vllm():
    engine, c = _client("<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
    with c:
        for choice in ({}, {"tool_choice": "auto"}):
            r = c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "q"}], "tools": [WEATHER], **choice},
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
            assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
        r = _chat(c, tools=[WEATHER], tool_choice="none")  # plain text, as the model wrote it
        assert r["choices"][0]["message"]["content"].startswith("<tool_call>")


def test_parser_flags_are_checked():
    from serving.cli import parse

    _, scfg = parse(REASONING_ARGV)
    assert (scfg.reasoning_parser, scfg.tool_call_parser) == ("qwen3", "qwen3_coder")
    assert scfg.enable_auto_tool_choice and scfg.generation_config == "vllm"
    for argv in (["--enable-auto-tool-choice"], ["--generation-config", "/nonexistent"]):
        with pytest.raises(SystemExit):
            parse(argv)


REASONING_ARGV = [
    "--reasoning-parser",
    "qwen3",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "qwen3_coder",
    "--generation-config",
    "vllm",
]


# ----------------------------------------------------------------------------- Mistral's parsers
class MistralEngine(ScriptedEngine):
    """ScriptedEngine whose output ends with EOS (token 0), whose text the engine leaves out
    (output.SequenceOutput, as vLLM) even where the request keeps special tokens."""

    async def _run(self, request_id, ids, params):
        m = RequestMetrics(arrival_time=0.0, num_prompt_tokens=len(ids))
        text = self.script[: params.max_tokens]
        cut = len(text) < len(self.script)
        steps = [(text[:n], [ord(ch) for ch in text[:n]]) for n in range(1, len(text) + 1)]
        if not cut:
            steps.append((text, [ord(ch) for ch in text] + [0]))
        try:
            for i, (t, tokens) in enumerate(steps):
                done = i == len(steps) - 1
                finish = ("length" if cut else "stop") if done else None
                o = CompletionOutput(0, t, tokens, None, None, finish)
                yield RequestOutput(request_id, None, ids, [o], done, m)
        finally:
            self.running.pop(request_id, None)


MISTRAL_ARGS = {"city": "Paris", "days": 3}
MAGISTRAL = "[THINK]Paris: get_weather.[/THINK]Checking.[TOOL_CALLS]get_weather[ARGS]" + json.dumps(
    MISTRAL_ARGS
)


def test_mistral_parsers_through_the_server():
    """--tool-call-parser mistral and --reasoning-parser mistral: the request keeps special
    tokens (the markers are special tokens),
    [THINK] reasoning goes to `reasoning`, the call to tool_calls with a 9-character id,
    streamed or not; the older JSON-list form too; thinking_token_budget gets [/THINK]."""
    engine = MistralEngine()
    engine.script = MAGISTRAL
    config = ServerConfig(
        reasoning_parser="mistral", enable_auto_tool_choice=True, tool_call_parser="mistral"
    )
    with TestClient(build_app(engine, config)) as c:
        body = {"tools": [WEATHER], "max_tokens": 400}
        (ch,) = _chat(c, **body)["choices"]
        assert engine.params[-1].skip_special_tokens is False
        msg = ch["message"]
        assert (msg["reasoning"], msg["content"]) == ("Paris: get_weather.", "Checking.")
        (call,) = msg["tool_calls"]
        assert call["function"]["name"] == "get_weather" and ch["finish_reason"] == "tool_calls"
        assert json.loads(call["function"]["arguments"]) == MISTRAL_ARGS
        assert len(call["id"]) == 9 and call["id"].isalnum()
        chunks = _chat(c, stream=True, **body)
        deltas = [ch["delta"] for k in chunks for ch in k["choices"]]
        assert "".join(d.get("reasoning", "") for d in deltas) == msg["reasoning"]
        assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
        pieces = [t for d in deltas for t in d.get("tool_calls", [])]
        assert pieces[0]["function"]["name"] == "get_weather" and len(pieces[0]["id"]) == 9
        args = "".join(t["function"].get("arguments", "") for t in pieces)
        assert json.loads(args) == MISTRAL_ARGS
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # tool_choice none: the reasoning parser still keeps the markers; the rest is content
        r = _chat(c, tools=[WEATHER], tool_choice="none")
        assert r["choices"][0]["message"]["content"].startswith("Checking.[TOOL_CALLS]")
        assert r["choices"][0]["message"]["content"].endswith("}")
        # the older tokenizers' form, no reasoning (no [THINK]: all content)
        engine.script = 'Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"days": 3}}]'
        (ch,) = _chat(c, **body)["choices"]
        assert (ch["message"]["reasoning"], ch["message"]["content"]) == (None, "Checking.")
        assert json.loads(ch["message"]["tool_calls"][0]["function"]["arguments"]) == {"days": 3}
        # a system prompt's example block does not count; the budget's end tag is [/THINK]
        system = {"role": "system", "content": "Think like this: [THINK]...[/THINK]"}
        _chat(c, messages=[system, {"role": "user", "content": "q"}], thinking_token_budget=8)
        tags = engine.params[-1].think_tags
        assert list(tags.end_ids) == [ord(ch) for ch in "[/THINK]"] and not tags.inside
    # auto: a chat template with [TOOL_CALLS] is Mistral's; no reasoning parser, no tools: the
    # request's skip_special_tokens as it was
    engine = MistralEngine()
    engine.script = "Sure.[TOOL_CALLS]get_time[ARGS]{}"
    engine.tokenizer.chat_template = "{{ '[TOOL_CALLS]' }}"
    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="auto")
    with TestClient(build_app(engine, config)) as c:
        (ch,) = _chat(c, tools=[WEATHER])["choices"]
        assert ch["message"]["tool_calls"][0]["function"]["name"] == "get_time"
        assert ch["message"]["content"] == "Sure."
        _chat(c)
        assert engine.params[-1].skip_special_tokens is True
    from serving.cli import parse

    argv = ["--enable-auto-tool-choice", "--tool-call-parser", "mistral"]
    _, scfg = parse([*argv, "--reasoning-parser", "mistral"])
    assert (scfg.tool_call_parser, scfg.reasoning_parser) == ("mistral", "mistral")


# ----------------------------------------------------------------------------- generation config
def test_generation_config_defaults(tmp_path, caplog):
    """auto: the model directory's generation_config.json gives the defaults a request leaves
    out (its own values win); vllm: none; DIR: DIR's; the start-up log says which apply."""
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 0.6,
                "top_p": 0.95,
                "top_k": 20,
                "min_p": 0.05,
                "repetition_penalty": 1.1,
                "max_new_tokens": 7,
                "do_sample": True,
            }
        )
    )
    cfg = EngineConfig(max_model_len=128, served_model_name="m", model=str(tmp_path))
    for server, applied in (({}, True), ({"generation_config": "vllm"}, False)):
        engine = ScriptedEngine(cfg)
        engine.script = "abcdefghijklmnop"
        with caplog.at_level(logging.INFO, logger="serving"):
            c = TestClient(build_app(engine, ServerConfig(**server)))
        assert ("generation_config.json" in caplog.text) == applied
        caplog.clear()
        with c:
            r = _chat(c)
            c.post("/v1/completions", json={"prompt": "x"})
            _chat(c, temperature=1.0, top_k=5, max_tokens=3)
        chat, completion, own = engine.params
        got = (chat.temperature, chat.top_p, chat.top_k, chat.min_p, chat.repetition_penalty)
        if applied:
            assert got == (0.6, 0.95, 20, 0.05, 1.1) and chat.max_tokens == 7
            assert r["choices"][0]["message"]["content"] == "abcdefg"
            assert completion.max_tokens == 7 and completion.temperature == 0.6
        else:
            assert got == (1.0, 1.0, -1, 0.0, 1.0) and chat.max_tokens > 7
            assert completion.max_tokens == 16
        assert (own.temperature, own.top_k, own.max_tokens) == (1.0, 5, 3)
    # DIR: another directory's file, whatever the model
    engine = ScriptedEngine()
    build_app(engine, ServerConfig(generation_config=str(tmp_path)))  # reads it
    from serving.generation import ServerState

    assert ServerState.create(engine, ServerConfig(generation_config=str(tmp_path))).defaults == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "max_tokens": 7,
    }


# ----------------------------------------------------------------------------- the real server
@pytest.fixture
def thinking_server(server):
    """The session's SmolLM2 server with --reasoning-parser qwen3 for one test (its config is
    read per request), put back after."""
    cfg = server.app.state.serving.config
    before = cfg.reasoning_parser
    cfg.reasoning_parser = "qwen3"
    try:
        yield server
    finally:
        cfg.reasoning_parser = before


def test_reasoning_split_on_smollm2(thinking_server, http):
    """SmolLM2 writes no think tags by itself: a regex forces them (allowed since the prompt
    closed a block: thinking off). Streamed or not, the text between the tags is reasoning."""
    body = {
        "model": thinking_server.model,
        "messages": [{"role": "user", "content": "<think></think>Say yes."}],
        "structured_outputs": {"regex": "<think>[a-z]{2,6}</think>[a-z]{2,6}"},
        "temperature": 0,
        "max_tokens": 40,
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning"] and msg["content"] and msg["reasoning"].isalpha(), msg
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        lines = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    deltas = [ch["delta"] for k in lines for ch in k["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == msg["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    # thinking not closed in the prompt: the grammar waits for a block that may open at the
    # first token (SmolLM2 opens none: a letters-only answer, all content)
    body["messages"] = [{"role": "user", "content": "Say yes."}]
    body["structured_outputs"] = {"regex": "[a-z]{2,6}"}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning"] is None and re.fullmatch("[a-z]{2,6}", msg["content"]), msg
