"""Structured output without a server: the token mask against the grammar on random walks, the
mask on the device, the sampler variants, and Hermes tool-call parsing on crafted text."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxengine.errors import InvalidRequest
from paxengine.request import Request
from paxengine.sampling import (
    ALL_FLAGS,
    apply_token_mask,
    build_sampling_tensors,
    choose_flags,
    sample,
)
from paxengine.sampling_params import SamplingParams
from paxengine.structured import GrammarCompiler, StructuredOutputs, allowed_tokens, grammar_text
from serving import tool_parsers, tools

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}
SPECS = [
    StructuredOutputs(json=SCHEMA),
    StructuredOutputs(json_object=True),
    StructuredOutputs(regex=r"(yes|no)-[0-9]{2,3}"),
    StructuredOutputs(choice=["red", "green", "blue"]),
    StructuredOutputs(grammar='start: "(" item ("," item)* ")"\nitem: /[a-c]+/'),
]
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Rome"]}, "days": {"type": "integer", "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
# vLLM's structural_tag: free text, where "<function=" comes one of the structures follows
TAG = {
    "structures": [
        {"begin": "<function=get_weather>", "schema": CITY, "end": "</function>"},
        {"begin": "<function=get_time>", "schema": ZONE, "end": "</function>"},
    ],
    "triggers": ["<function="],
}
# the same as xgrammar's format (vLLM's newer form)
TAG_FORMAT = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<function="],
        "tags": [
            {
                "type": "tag",
                "begin": s["begin"],
                "content": {"type": "json_schema", "json_schema": s["schema"]},
                "end": s["end"],
            }
            for s in TAG["structures"]
        ],
    },
}
SPECS.append(StructuredOutputs(structural_tag=TAG))


@pytest.fixture(scope="module")
def compiler(smollm):
    return GrammarCompiler(smollm.tokenizer, smollm.config.vocab_size, smollm.eos_token_ids)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind())
def test_mask_matches_the_grammar_on_random_walks(compiler, smollm, spec):
    """At every step of random walks through the grammar, every token the mask allows is
    accepted by the matcher and every token it masks is rejected (on a random sample of the
    vocabulary and all allowed ids); EOS is allowed exactly where the grammar can end."""
    V, eos = smollm.config.vocab_size, smollm.eos_token_ids[0]
    rng = np.random.default_rng(0)
    mask = np.zeros((2, -(-V // 32)), np.int32)
    for _walk in range(2):
        state = compiler.new_state(spec)
        for _ in range(24):
            mask[:] = 0
            compiler.fill_masks([(state, 1)], mask)
            assert not mask[0].any()  # other rows untouched
            allowed = allowed_tokens(mask[1], V)
            ids = np.flatnonzero(allowed)
            assert len(ids) > 0
            probe = np.union1d(rng.choice(V, 300, replace=False), ids[:300])
            for t in probe:
                ok = state.matcher.validate_tokens([int(t)]) == 1
                assert ok == bool(allowed[t]), (t, smollm.tokenizer.decode([int(t)]))
            assert allowed[eos] == state.matcher.is_accepting()
            non_eos = ids[ids != eos]
            if len(non_eos) == 0:
                break
            t = int(rng.choice(non_eos))
            assert state.accept(t) and not state.is_error
            if state.is_complete:
                break


def test_bad_constraints_are_invalid_requests(compiler):
    bad = [
        (StructuredOutputs(json={"type": "strin"}), "json_schema"),
        (StructuredOutputs(json={"type": "object", "dependentSchemas": {}}), "json_schema"),
        (StructuredOutputs(regex="(a"), "regex"),
        (StructuredOutputs(grammar="start: foo"), "grammar"),
        (StructuredOutputs(choice=[]), "choice"),
        (StructuredOutputs(regex="a", choice=["a"]), "structured_outputs"),
    ]
    for spec, param in bad:
        with pytest.raises(InvalidRequest) as e:
            compiler.compile(spec)
        assert e.value.param == param, (spec, e.value)
    # structural tags: their own field's path in param
    fn = {"begin": "<f>", "schema": ZONE, "end": "</f>"}
    tags = [
        ("{", "structural_tag"),
        ({"structures": [], "triggers": ["<f"]}, "structural_tag.structures"),
        ({"structures": [fn]}, "structural_tag.triggers"),
        ({"structures": [{**fn, "schema": None}], "triggers": ["<f"]}, "structural_tag.structures.0.schema"),
        ({"structures": [{"begin": "<f>", "schema": ZONE}], "triggers": ["<f"]}, "structural_tag.structures.0.end"),
        ({"structures": [fn], "triggers": ["<g"]}, "structural_tag.structures.0.begin"),
        ({"structures": [fn], "triggers": ["<f", "<h"]}, "structural_tag.triggers.1"),
        ({"structures": [{**fn, "schema": {"type": "strin"}}], "triggers": ["<f"]}, "structural_tag.structures.0.schema"),
        ({"structures": [{**fn, "x": 1}], "triggers": ["<f"]}, "structural_tag.structures.0.x"),
        ({"format": {"type": "sequence", "elements": []}}, "structural_tag.format.type"),
        ({"format": {**TAG_FORMAT["format"], "at_least_one": True}}, "structural_tag.format.at_least_one"),
        ({"format": {**TAG_FORMAT["format"], "stop_after_first": True}}, "structural_tag.format.stop_after_first"),
        ({"format": {**TAG_FORMAT["format"], "triggers": ["<x"]}}, "structural_tag.format.tags.0.begin"),
    ]  # fmt: skip
    regex_tag = dict(TAG_FORMAT["format"]["tags"][0], content={"type": "regex", "pattern": "a"})
    tags.append(
        ({"format": {**TAG_FORMAT["format"], "tags": [regex_tag]}}, "structural_tag.format.tags.0.content.type")
    )  # fmt: skip
    # a special-token trigger (SmolLM2's <|im_start|>) beside a text one written <...>
    mixed = {
        "structures": [{**fn, "begin": "<|im_start|>f"}, fn],
        "triggers": ["<|im_start|>", "<f>"],
    }
    tags.append((mixed, "structural_tag.triggers"))
    for tag, param in tags:
        with pytest.raises(InvalidRequest) as e:
            compiler.compile(StructuredOutputs(structural_tag=tag))
        assert e.value.param == param and str(e.value).startswith(param), (tag, e.value)
    # GBNF converts; a cached compile is the same matcher
    gbnf = StructuredOutputs(grammar='root ::= "a" | "b"')
    assert compiler.compile(gbnf) is compiler.compile(gbnf)


def test_json_text_nested_past_pythons_parser_is_an_invalid_request():
    """A schema's or structural tag's JSON text nested deeper than json.loads recurses is the
    request's fault (InvalidRequest naming it), not a RecursionError (a 500 in the fuzz)."""
    deep = "[" * 50_000 + "]" * 50_000
    for spec, param in (
        (StructuredOutputs(json=deep), "json_schema"),
        (StructuredOutputs(structural_tag=deep), "structural_tag"),
    ):
        with pytest.raises(InvalidRequest) as e:
            spec.key()
        assert e.value.param == param and "not valid JSON" in str(e.value)


def _walk(compiler, spec, ids, V):
    """(allowed tokens before each of ids, the EOS allowed there), consuming each; all must be
    allowed."""
    state, mask, seen = compiler.new_state(spec), np.zeros((1, -(-V // 32)), np.int32), []
    for t in ids:
        compiler.fill_masks([(state, 0)], mask)
        allowed = allowed_tokens(mask[0], V)
        assert allowed[t] and state.accept(t), (len(seen), t)
        seen.append(allowed)
    compiler.fill_masks([(state, 0)], mask)
    return seen + [allowed_tokens(mask[0], V)]


@pytest.mark.parametrize("tag", [TAG, json.dumps(TAG), TAG_FORMAT, json.dumps(TAG_FORMAT)])
def test_structural_tag_masks_free_text_then_a_structure_then_free_text(compiler, smollm, tag):
    """Token by token through a hand-written output: before the trigger any text (and EOS), from
    the trigger on only a structure's begin, JSON its schema accepts and its end, then any text
    again. vLLM's form, xgrammar's format, each as a dict or its JSON text: one grammar."""
    tok, V, eos = smollm.tokenizer, smollm.config.vocab_size, smollm.eos_token_ids[0]
    spec = StructuredOutputs(structural_tag=tag)
    head, call, tail = (
        "Sure: ",
        '<function=get_weather>{"city": "Rome", "days": 3}</function>',
        " ok.",
    )
    ids = tok.encode(head + call + tail, add_special_tokens=False)
    seen = _walk(compiler, spec, ids, V)
    ends = [len(tok.decode(ids[:i])) for i in range(len(ids) + 1)]  # text before each mask
    trig_end, call_end = len(head) + len("<function="), len(head) + len(call)
    for at, allowed in zip(ends, seen):
        if at < trig_end or at >= call_end:  # free text: nearly the whole vocabulary, and EOS
            assert allowed.sum() > V * 0.9 and allowed[eos], at
        else:  # inside: the few tokens that go on with begin, the schema's JSON or end
            assert allowed.sum() < 200 and not allowed[eos], (at, allowed.sum())
    legacy = StructuredOutputs(structural_tag=TAG)
    assert grammar_text(*spec.key()) == grammar_text(*legacy.key())
    # what the schema or the begins refuse
    for bad in (
        '<function=get_weather>{"city": "Paris"',
        '<function=get_weather>{"days": 3',
        "<function=get_date>",
        '<function=get_time>{"zone": "utc"}</fun>',
        '<function=get_time>{"zone": "utc"} ',
    ):
        ids = tok.encode(head + bad, add_special_tokens=False)
        state = compiler.new_state(spec)
        assert state.matcher.validate_tokens(ids) < len(ids), bad
    # two calls with text between them, and a trigger-less text
    for ok in (call + " and " + call.replace("Rome", "Oslo"), "No call: <function is a word."):
        ids = tok.encode(ok, add_special_tokens=False)
        assert compiler.new_state(spec).matcher.validate_tokens(ids) == len(ids), ok


def test_structural_tag_special_token_trigger(compiler, smollm):
    """A trigger that is one special token of the tokenizer (SmolLM2's <|im_start|>, as Llama's
    <|python_tag|>) is that token: it starts the structure, its text spelled out does not."""
    tok, V = smollm.tokenizer, smollm.config.vocab_size
    (start,) = tok.encode("<|im_start|>", add_special_tokens=False)
    tag = {
        "structures": [{"begin": "<|im_start|>call", "schema": ZONE, "end": "\n"}],
        "triggers": ["<|im_start|>"],
    }
    spec = StructuredOutputs(structural_tag=tag)
    ids = [*tok.encode("Hi ", add_special_tokens=False), start]
    after = len(ids)
    ids += tok.encode('call{"zone": "cet"}\nbye', add_special_tokens=False)
    seen = _walk(compiler, spec, ids, V)
    assert seen[after - 1].sum() > V * 0.9 and seen[after - 1][start]  # free text before it
    assert seen[after].sum() < 10 and not seen[after][start]  # right after it: only "call"
    spelled = [tok.encode(p, add_special_tokens=False) for p in ("Hi <|im_start", '|>{"zone": 1}')]
    spelled = spelled[0] + spelled[1]  # the tag's text in ordinary tokens: free text
    assert start not in spelled and tok.decode(spelled) == 'Hi <|im_start|>{"zone": 1}'
    assert compiler.new_state(spec).matcher.validate_tokens(spelled) == len(spelled)


def test_device_mask_lowers_without_index_arithmetic():
    """The mask's bits expand by a broadcast: no cumulative sums or scatters of constants,
    which XLA:GPU constant-folded for 1-5 s a sampler compile at Qwen3.5's 248,320 tokens."""
    S, V = 8, 248_320
    spec = jax.ShapeDtypeStruct
    text = (
        jax.jit(apply_token_mask)
        .lower(spec((S, V), jnp.float32), spec((S, -(-V // 32)), jnp.int32))
        .as_text()
    )
    assert not any(op in text for op in ("reduce_window", "cumsum", "scatter")), text[:2000]


def test_device_mask_and_sampler_never_pick_a_masked_token():
    rng = np.random.default_rng(1)
    S, V = 4, 100
    mask = rng.integers(-(2**31), 2**31, (S, -(-V // 32)), dtype=np.int64).astype(np.int32)
    mask[3] = -1  # an unconstrained row
    logits = rng.normal(size=(S, V)).astype(np.float32) * 5
    masked = np.asarray(apply_token_mask(jnp.asarray(logits), jnp.asarray(mask)))
    for i in range(S):
        ok = allowed_tokens(mask[i], V)
        np.testing.assert_array_equal(np.isfinite(masked[i]), ok)
        np.testing.assert_array_equal(masked[i][ok], logits[i][ok])

    class Row:  # a Request's view for build_sampling_tensors, with a fixed mask
        def __init__(self, p, grammar):
            self.params, self.grammar, self.seed = p, grammar, 3
            self.num_output_tokens, self.num_prompt_tokens, self.all_token_ids = 1, 1, [0]

    class Fixed:
        def fill_masks(self, rows, out):
            for _, i in rows:
                out[i] = mask[i]

    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.5),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.9, logprobs=3, presence_penalty=1),
        SamplingParams(temperature=1.0),
    ]
    rows = [Row(p, object() if i < 3 else None) for i, p in enumerate(params)]
    st = build_sampling_tensors(rows, S, 8, [0], Fixed(), V)
    assert st.flags == (True, True, True, True)  # penalties + logprobs: the all-on variant
    for step in range(20):
        st2 = st.__class__(**{**st.__dict__, "steps": jnp.full_like(st.steps, step)})
        tokens, lp, _, _, top_lp = sample(jnp.asarray(logits), st2)
        for i in range(3):
            assert allowed_tokens(mask[i], V)[int(tokens[i])]
        assert np.isfinite(np.asarray(top_lp)).all()


def test_allowed_token_ids_mask_their_rows_and_narrow_a_grammars():
    """allowed_token_ids: the row's mask allows exactly them; on a grammar's row, only what
    both allow; other rows stay all ones, and the mask's sampler variant is chosen."""
    from paxengine.sampling import token_mask

    V = 70
    for ids in ([0], [31, 32, 69], list(range(0, 70, 3))):
        assert np.flatnonzero(allowed_tokens(token_mask(tuple(ids), V), V)).tolist() == ids

    grammar_allows = np.zeros(V, bool)
    grammar_allows[:40] = True

    class Row:
        def __init__(self, p, grammar=None):
            self.params, self.grammar, self.seed = p, grammar, 3
            self.num_output_tokens, self.num_prompt_tokens, self.all_token_ids = 1, 1, [0]

    class Fixed:
        def fill_masks(self, rows, out):
            for _, i in rows:
                out[i] = token_mask(tuple(np.flatnonzero(grammar_allows)), V)

    rows = [
        Row(SamplingParams(allowed_token_ids=[5, 50])),
        Row(SamplingParams(allowed_token_ids=[5, 50]), grammar=object()),
        Row(SamplingParams()),
    ]
    st = build_sampling_tensors(rows, 4, 8, [0], Fixed(), V)
    assert st.grammar
    allowed = [np.flatnonzero(allowed_tokens(st.mask[i], V)).tolist() for i in range(4)]
    assert allowed[:2] == [[5, 50], [5]] and allowed[2] == allowed[3] == list(range(V))
    plain = build_sampling_tensors(rows[2:], 4, 8, [0], Fixed(), V)
    assert not plain.grammar and plain.mask is None


def test_sampler_variants():
    plain = [f for f in ALL_FLAGS if not f[3]]
    assert len(plain) == 8 and len(ALL_FLAGS) == 11
    for f in plain:  # an unconstrained batch runs exactly its own variant
        assert choose_flags(f) == f
    assert choose_flags((False, False, False, True)) == (False, False, False, True)
    assert choose_flags((False, True, False, True)) == (False, True, False, True)
    assert choose_flags((False, False, True, True)) == (True, True, True, True)


def test_request_grammar_ends_the_request(compiler):
    """The scheduler advances the grammar once per token and ends a complete one with stop."""
    from paxengine.kv_cache import KVCacheManager
    from paxengine.scheduler import Scheduler

    sched = Scheduler(KVCacheManager(16, 4), 4, 64, 64, eos_token_ids=[2])
    spec = StructuredOutputs(choice=["ab"])
    req = Request("r", [5, 6], SamplingParams(max_tokens=10, structured_outputs=spec), seed=0)
    req.grammar = compiler.new_state(spec)
    sched.add(req)
    ids = compiler._hf.encode("ab", add_special_tokens=False)
    for t in ids:
        out = sched.schedule()
        sched.update_from_output(out, {"r": [t]})
    assert req.is_finished and req.finish_reason == "stop" and req.output_token_ids == ids


# ----------------------------------------------------------------------------- tool calls
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_parse_hermes_tool_calls():
    content, calls = tool_parsers.parse_tool_calls("Let me check.\n" + CALL + "\n" + CALL)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ] * 2
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert tool_parsers.parse_tool_calls("no calls here") == ("no calls here", [])
    # not JSON: stays text; an unclosed last block with whole JSON counts
    assert tool_parsers.parse_tool_calls("<tool_call>oops</tool_call>")[1] == []
    content, calls = tool_parsers.parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}')
    assert content is None and calls[0].name == "f" and calls[0].arguments == "{}"


@pytest.mark.parametrize("size", [1, 3, 7, 50])
def test_streamed_tool_calls_equal_parsed(size):
    text = "Sure <b>.\n" + CALL + " then " + CALL.replace("Paris", "Rome")
    stream = tool_parsers.ToolCallStream()
    content, calls = "", []
    for i in range(0, len(text), size):
        c, k = stream.feed(text[i : i + size])
        content, calls = content + c, calls + k
    c, k = stream.finish()
    content, calls = content + c, calls + k
    want_content, want = tool_parsers.parse_tool_calls(text)
    assert content.split() == want_content.split()
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want]


LLAMA3_TEMPLATE = "{{- '<|python_tag|>' + tool_call.name }} ... {{ tools }}"  # as 3.1's names it


def test_parse_llama3_json_tool_calls():
    assert tools.call_format(LLAMA3_TEMPLATE) == tools.LLAMA3_JSON
    assert tools.call_format("{{ messages }}") == tools.call_format(None) == tools.HERMES
    fmt = tools.LLAMA3_JSON
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    for text in (one, "<|python_tag|>" + one, "\n " + one + "\n"):
        content, calls = tool_parsers.parse_tool_calls(text, fmt)
        assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris"})
        ]
    content, calls = tool_parsers.parse_tool_calls(one + "; " + one.replace("Paris", "Rome"), fmt)
    assert content is None and [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    # not calls: the text as the model wrote it
    for text in ("It is sunny.", '{"city": "Paris"}', one[:-3], one + " and more"):
        assert tool_parsers.parse_tool_calls(text, fmt) == (text.strip(), [])


@pytest.mark.parametrize("size", [1, 4, 50])
def test_streamed_llama3_calls_equal_parsed(size):
    for text in (
        '<|python_tag|>{"name": "f", "parameters": {"x": 1}}',
        "<|pyth but not a call",
        "Plain {text}",
    ):
        stream, content, calls = tool_parsers.call_stream(tools.LLAMA3_JSON), "", []
        for i in range(0, len(text), size):
            c, k = stream.feed(text[i : i + size])
            content, calls = content + c, calls + k
        c, k = stream.finish()
        content, calls = content + c, calls + k
        want_content, want = tool_parsers.parse_tool_calls(text, tools.LLAMA3_JSON)
        assert (content or None) == want_content
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want]


def test_forced_call_grammar_and_parse():
    fns = [
        {"type": "function", "function": {"name": "f", "parameters": SCHEMA}},
        {"type": "function", "function": {"name": "g"}},
    ]
    spec = tools.forced_constraint(fns, "required", parallel=False)
    assert spec.json["maxItems"] == 1 and len(spec.json["items"]["anyOf"]) == 2
    assert tools.forced_constraint(fns, "f", True).json == SCHEMA
    calls = tools.forced_calls('[{"name": "g", "arguments": {"x": 1}}]', "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("g", {"x": 1})]
    assert tools.forced_calls('{"name": "a"', "f") is None  # cut short


def test_tool_messages_through_smollm_template(smollm):
    """SmolLM2's template knows no tools: they go in a Hermes system prompt, an assistant's
    calls as <tool_call> blocks and a tool's result as a <tool_response> turn."""
    tok = smollm.tokenizer
    assert not tools.template_renders_tools(tok.chat_template)
    fn = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    msgs = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    m, extra = tools.template_inputs(msgs, [fn], tok.chat_template)
    text = tok.apply_chat_template(m, **extra)
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text


def test_streamed_auto_tool_call_deltas_in_openai_shape():
    """The server's per-choice deltas for tool_choice auto on crafted model text: content first,
    then each call whole (index, id, type, name, arguments), finish_reason tool_calls."""
    from serving.tool_responses import ToolDeltas

    td = ToolDeltas("auto", parallel=True)
    text = "\n\nChecking." + CALL + CALL.replace("Paris", "Rome")
    deltas = [td.step(text[i : i + 5], None) for i in range(0, len(text), 5)]
    deltas.append(td.step("", "stop"))
    content = "".join(d.content or "" for d, _ in deltas)
    calls = [c for d, _ in deltas for c in d.tool_calls or []]
    assert content == "Checking." and deltas[-1][1] == "tool_calls"
    assert [(c.index, c.type, c.function.name) for c in calls] == [
        (0, "function", "get_weather"),
        (1, "function", "get_weather"),
    ]
    assert json.loads(calls[1].function.arguments) == {"city": "Rome"} and calls[0].id
    one = ToolDeltas("auto", parallel=False)
    got = [c for d, _ in [one.step(text, "stop")] for c in d.tool_calls or []]
    assert len(got) == 1


def test_template_that_renders_tools_gets_them():
    """A template naming `tools` (Qwen's, Llama 3.1's) renders them itself: it gets the OpenAI
    tool list and messages, the calls' arguments as objects (as transformers passes them)."""
    from paxengine.tokenizer import _compile_template

    source = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}{% endfor %}"
        "{% endfor %}"
    )
    assert tools.template_renders_tools(source)
    fn = {"type": "function", "function": {"name": "get_weather"}}
    call = {"id": "c", "type": "function", "function": {"name": "get_weather"}}
    call["function"]["arguments"] = '{"city": "Oslo"}'
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "rain", "tool_call_id": "c"},
    ]
    m, extra = tools.template_inputs(msgs, [fn], source)
    assert _compile_template(source).render(messages=m, **extra) == (
        "[get_weather]<user>q<assistant>Oslo<tool>rain"
    )
