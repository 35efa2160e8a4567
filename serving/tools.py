"""Tool calling: tools into the prompt, the grammar of a forced call, and calls out of the text.

- `tool_choice: "auto"` (the server's `--enable-auto-tool-choice`): the model writes calls in
  its own format, parsed into `message.tool_calls` by `tool_parsers.py` (`parse_tool_calls`;
  `call_stream` while streaming). `--tool-call-parser` names the format (vLLM's names), `auto`
  takes it from the chat template (`call_format`): Hermes-style
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen 2.5/3, SmolLM2, Hermes), or
  Llama 3.1's JSON: the whole message is `{"name": ..., "parameters": {...}}` (several joined by
  `;`), after an optional `<|python_tag|>`; `qwen3_coder` / `qwen3_xml` (Qwen3-Coder, Qwen3.5):
  `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`, each value
  typed by the tool's JSON schema (`tool_parsers.Qwen3XmlStream`); `mistral`: `[TOOL_CALLS]`
  then a JSON list of calls (Mistral's tokenizers before v11) or `NAME[ARGS]{...}` per call (v11
  on), with Mistral's 9-character call ids (`tool_parsers.MistralCallStream`); `pythonic` /
  `llama4_pythonic` (Llama 3.2 / 4): the message is a Python list of calls with keyword
  arguments, `[get_weather(city="Paris")]` (`tool_parser_pythonic.py`).
- `"required"` / a named function: a grammar (a JSON schema) forces the call: for a named
  function the output is its arguments; for "required" a JSON array of {name, arguments} objects
  (one of the tools each). `forced_calls` reads them back.
- `"none"` (or no tools): plain text, the tools are not shown to the model.

A chat template that renders `tools` itself (it names the variable) gets them and the OpenAI
messages; one that does not (SmolLM2's) gets Hermes' system prompt and messages rewritten in
Hermes' shape: an assistant's calls as `<tool_call>` blocks, a tool's result as a user turn in
`<tool_response>` tags (as Qwen's template renders them).
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass

from paxengine.structured import StructuredOutputs

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's tool-call start
HERMES, LLAMA3_JSON = "hermes", "llama3_json"
QWEN3_CODER, QWEN3_XML = "qwen3_coder", "qwen3_xml"  # one format (Qwen3-Coder, Qwen3.5)
MISTRAL = "mistral"
TOOL_CALLS = "[TOOL_CALLS]"  # Mistral's tool-call start (a special token)
# a Python list of calls (Llama 3.2 / 4); llama4_pythonic: maybe inside <|python_start|>
PYTHONIC, LLAMA4_PYTHONIC = "pythonic", "llama4_pythonic"
# --tool-call-parser's names (vLLM's); "auto": the format the chat template shows (call_format)
PARSERS = ("auto", HERMES, LLAMA3_JSON, QWEN3_CODER, QWEN3_XML, MISTRAL, PYTHONIC, LLAMA4_PYTHONIC)


def call_format(template: str | None) -> str:
    """The tool-call format the model of this chat template writes: Llama 3.1's templates
    mention its `<|python_tag|>`, Mistral's their `[TOOL_CALLS]`; every other one is taken as
    Hermes'."""
    if template and PYTHON_TAG in template:
        return LLAMA3_JSON
    return MISTRAL if template and TOOL_CALLS in template else HERMES


def mistral_id() -> str:
    """A call id Mistral's chat templates take back (they refuse any but 9 letters or digits)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


_HERMES_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass
class Call:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"


def template_renders_tools(template: str | None) -> bool:
    return bool(template) and re.search(r"\btools\b", template) is not None


def _arguments(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past Python's parser: as written
        return text


def template_inputs(messages: list[dict], tools: list[dict] | None, template: str | None):
    """(messages, extra template variables) for the chat template. messages: OpenAI-shaped dicts
    (role, content, and tool_calls / tool_call_id where given); tools: OpenAI tool dicts to show
    the model, or None."""
    if template_renders_tools(template):
        msgs = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [
                    {
                        **c,
                        "function": {
                            **c["function"],
                            "arguments": _arguments(c["function"]["arguments"]),
                        },
                    }
                    for c in m["tool_calls"]
                ]
            msgs.append(m)
        return msgs, ({"tools": tools} if tools else {})
    msgs = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [
                f"{OPEN}\n"
                + json.dumps(
                    {
                        "name": c["function"]["name"],
                        "arguments": _arguments(c["function"]["arguments"]),
                    }
                )
                + f"\n{CLOSE}"
                for c in m["tool_calls"]
            ]
            content = "\n".join(([content] if content else []) + blocks)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        msgs.append(
            {
                **{k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")},
                "role": role,
                "content": content,
            }
        )
    if tools:
        prompt = _HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + prompt}
        else:
            msgs.insert(0, {"role": "system", "content": prompt})
    return msgs, {}


# ----------------------------------------------------------------------------- forced calls
def _parameters(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object"}


def forced_constraint(tools: list[dict], choice, parallel: bool) -> StructuredOutputs:
    """The grammar of a forced call. choice: "required" or a function's name."""
    if choice != "required":
        fn = next(t["function"] for t in tools if t["function"]["name"] == choice)
        return StructuredOutputs(json=_parameters(fn))
    one_of = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": _parameters(t["function"]),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {
        "type": "array",
        "minItems": 1,
        "items": one_of[0] if len(one_of) == 1 else {"anyOf": one_of},
    }
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputs(json=schema)


def forced_calls(text: str, choice) -> list[Call] | None:
    """The calls in a forced call's output, or None if it is not complete JSON (cut by
    max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if choice != "required":
        return [Call(choice, json.dumps(value))]
    return [Call(c["name"], json.dumps(c["arguments"])) for c in value]


@dataclass
class CallPiece:
    """A piece of a call that streams (the parsers' output, tool_responses' input): the first
    (name set) opens call `call`, the others add to its arguments (JSON text)."""

    call: int
    name: str | None = None
    arguments: str = ""
    id: str | None = None


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (what a parser
    holds back while the text may still open a tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
