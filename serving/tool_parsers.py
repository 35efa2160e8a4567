"""The model's own tool calls out of its text (`tool_choice: "auto"`), in the formats `tools.py`
names: Hermes' `<tool_call>` JSON blocks, Llama 3.1's JSON message, Qwen3's XML calls
(`qwen3_coder` / `qwen3_xml`), Mistral's `[TOOL_CALLS]`, Python lists of calls (`pythonic`,
`llama4_pythonic`: `tool_parser_pythonic.py`); whole (`parse_tool_calls`) or while streaming
(`call_stream`).
Prompts and forced calls are `tools.py`'s.
"""

from __future__ import annotations

import json
import math
import re

from serving.tools import (
    CLOSE,
    HERMES,
    LLAMA3_JSON,
    LLAMA4_PYTHONIC,
    MISTRAL,
    OPEN,
    PYTHON_TAG,
    PYTHONIC,
    QWEN3_CODER,
    QWEN3_XML,
    TOOL_CALLS,
    Call,
    CallPiece,
    mistral_id,
    partial_suffix,
)


# ----------------------------------------------------------------------------- the model's own calls
def _call_of(obj) -> Call | None:
    """A call from `{"name": ..., "arguments" | "parameters": {...}}`, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return Call(obj["name"], args if isinstance(args, str) else json.dumps(args))


def _parse_block(body: str) -> Call | None:
    try:
        return _call_of(json.loads(body))
    except ValueError:
        return None


def _llama3_body(text: str) -> str | None:
    """The JSON part of a Llama 3.1 call message, or None when the message is not one."""
    s = text.strip()
    if s.startswith(PYTHON_TAG):
        s = s[len(PYTHON_TAG) :].lstrip()
    return s if s.startswith("{") else None


def _parse_llama3(text: str) -> tuple[str | None, list[Call]]:
    """Llama 3.1: the message is calls alone, JSON objects joined by `;`; anything else (or
    JSON that is not calls) is content, as the model wrote it."""
    s = _llama3_body(text)
    as_text = (text.strip() or None), []
    if s is None:
        return as_text
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(s):
        try:
            obj, pos = decoder.raw_decode(s, pos)
        except ValueError:
            return as_text
        call = _call_of(obj)
        if call is None:
            return as_text
        calls.append(call)
        while pos < len(s) and s[pos] in " \t\n;":
            pos += 1
    return None, calls


def parse_tool_calls(
    text: str, fmt: str = HERMES, tool_defs: list[dict] | None = None
) -> tuple[str | None, list[Call]]:
    """(content, calls) of a finished output in the model's format (`call_format`). Hermes:
    content is the text outside the call blocks (None if only whitespace); a block that is not
    a JSON call stays in the content (the client sees what the model wrote); an unclosed last
    block counts if its JSON is whole. tool_defs: the request's tools (OpenAI dicts), whose
    schemas type the XML formats' parameter values."""
    if fmt == LLAMA3_JSON:
        return _parse_llama3(text)
    if fmt in (QWEN3_CODER, QWEN3_XML):
        stream = Qwen3XmlStream(tool_defs)
        content, pieces = stream.feed(text)
        more, last = stream.finish()
        return ((content + more).strip() or None), calls_of_pieces(pieces + last)
    if fmt == MISTRAL:
        stream = MistralCallStream()
        content, _ = stream.feed(text)
        more, _ = stream.finish()
        return ((content + more).strip() or None), stream.calls
    if fmt in (PYTHONIC, LLAMA4_PYTHONIC):
        from serving.tool_parser_pythonic import parse_pythonic

        return parse_pythonic(text, llama4=fmt == LLAMA4_PYTHONIC)
    calls, content, pos = [], [], 0
    while True:
        i = text.find(OPEN, pos)
        if i < 0:
            content.append(text[pos:])
            break
        j = text.find(CLOSE, i)
        end = len(text) if j < 0 else j + len(CLOSE)
        call = _parse_block(text[i + len(OPEN) : j if j >= 0 else len(text)])
        content.append(text[pos:i] if call else text[pos:end])
        if call:
            calls.append(call)
        pos = end
        if j < 0:
            break
    rest = "".join(content).strip()
    return (rest or None), calls


class ToolCallStream:
    """Hermes' format while streaming: text outside call blocks goes out as content at once,
    except what might be the start of `<tool_call>`; a block goes out as one tool call when it
    closes (or at the end)."""

    def __init__(self):
        self.buf = ""  # text not yet sent: a possible partial OPEN, or an open block
        self.calls: list[Call] = []
        self.sent_content = False

    def feed(self, delta: str) -> tuple[str, list[Call]]:
        self.buf += delta
        out, calls = "", []
        while True:
            i = self.buf.find(OPEN)
            if i < 0:
                keep = partial_suffix(self.buf, OPEN)
                out += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep :]
                break
            j = self.buf.find(CLOSE, i)
            if j < 0:
                out += self.buf[:i]
                self.buf = self.buf[i:]
                break
            call = _parse_block(self.buf[i + len(OPEN) : j])
            out += self.buf[:i] if call else self.buf[: j + len(CLOSE)]
            if call:
                calls.append(call)
            self.buf = self.buf[j + len(CLOSE) :]
        return self._content(out, calls), calls

    def finish(self) -> tuple[str, list[Call]]:
        rest, calls = parse_tool_calls(self.buf) if self.buf.startswith(OPEN) else (self.buf, [])
        self.buf = ""
        return self._content(rest or "", calls), calls

    def _content(self, out: str, calls: list[Call]) -> str:
        self.calls += calls
        if not self.sent_content:  # text before a call is usually a newline or two
            out = out.lstrip()
            self.sent_content = bool(out)
        return out


class Llama3CallStream:
    """Llama 3.1's format while streaming: a message that starts as a call (`{` or
    `<|python_tag|>`) is held and parsed whole at the end; any other goes out as content."""

    def __init__(self):
        self.buf, self.mode = "", None  # mode: None (undecided), "content" or "call"
        self.calls: list[Call] = []

    def feed(self, delta: str) -> tuple[str, list[Call]]:
        self.buf += delta
        if self.mode is None:
            head = self.buf.lstrip()
            if not head or (len(head) < len(PYTHON_TAG) and PYTHON_TAG.startswith(head)):
                return "", []  # too early to tell
            self.mode = "call" if head.startswith((PYTHON_TAG, "{")) else "content"
        if self.mode == "content":
            out, self.buf = self.buf, ""
            return out, []
        return "", []

    def finish(self) -> tuple[str, list[Call]]:
        text, self.buf = self.buf, ""
        if self.mode == "content":
            return text, []
        content, calls = _parse_llama3(text)
        self.calls += calls
        return content or "", calls


def call_stream(fmt: str, tool_defs: list[dict] | None = None):
    """The streaming parser of a tool-call format (`call_format`, a --tool-call-parser name).
    Its feed / finish give (content, items): whole `Call`s, or `CallPiece`s of calls that
    stream piece by piece (the XML formats)."""
    if fmt in (QWEN3_CODER, QWEN3_XML):
        return Qwen3XmlStream(tool_defs)
    if fmt == MISTRAL:
        return MistralCallStream()
    if fmt in (PYTHONIC, LLAMA4_PYTHONIC):
        from serving.tool_parser_pythonic import PythonicCallStream

        return PythonicCallStream(llama4=fmt == LLAMA4_PYTHONIC)
    return Llama3CallStream() if fmt == LLAMA3_JSON else ToolCallStream()


# ----------------------------------------------------------------------------- Qwen3's XML calls
def calls_of_pieces(pieces: list) -> list[Call]:
    calls: dict[int, Call] = {}
    for p in pieces:
        if p.name is not None:
            calls[p.call] = Call(p.name, p.arguments, p.id or "")
        elif p.call in calls:
            calls[p.call].arguments += p.arguments
    return [calls[k] for k in sorted(calls)]


_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.S)
_PARAMETER_OPEN = re.compile(r"<parameter=([^>\n]*)>(.*)\Z", re.S)  # cut by the output's end
FUNCTION_END = "</function>"


def _schema_type(schema: dict | None) -> str | None:
    t = (schema or {}).get("type")
    if isinstance(t, list):  # ["integer", "null"]: the first that is not null
        t = next((x for x in t if x != "null"), None)
    return t if isinstance(t, str) else None


def typed_value(text: str, schema: dict | None):
    """A parameter's text as its JSON schema's type says (as vLLM's qwen3_coder parser reads
    it): strings kept, numbers, booleans, objects and arrays parsed, "null" as null; text that
    does not parse stays a string."""
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    t = _schema_type(schema)
    if text.strip().lower() == "null" and t != "string":
        return None
    if t == "string":
        return text
    if t == "integer":
        try:
            return int(text.strip())
        except ValueError:
            return text
    if t == "number":
        try:
            f = float(text.strip())
        except ValueError:
            return text
        if not math.isfinite(f):
            return text
        return int(f) if f.is_integer() else f
    if t == "boolean":
        low = text.strip().lower()
        return {"true": True, "false": False}.get(low, text)
    try:  # object, array, or no type: JSON if it is JSON
        return json.loads(text)
    except ValueError:
        return text


class Qwen3XmlStream:
    r"""`<tool_call>\n<function=NAME>\n<parameter=P>\nvalue\n</parameter>\n</function>\n
    </tool_call>` while streaming: text outside blocks goes out as content at once (but a
    possible start of `<tool_call>`); a call streams as OpenAI's deltas do: its name when
    `<function=NAME>` is whole, then `{"P": value` / `, "P": value` as each parameter closes,
    and `}` at `</function>`. A block that is not a call stays content, as the model wrote
    it; a call cut by the output's end is closed with the parameters it has."""

    def __init__(self, tool_defs: list[dict] | None = None):
        self.props = {
            t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties") or {}
            for t in tool_defs or []
            if t.get("function")
        }
        self.buf, self.state = "", "text"  # text | block | function | block_end
        self.calls: list[Call] = []  # the finished calls
        self.n = 0  # calls opened
        self.name, self.id, self.args = "", "", {}
        self.sent_content = False

    def _open(self, name: str) -> CallPiece:
        self.name, self.args = name.strip(), {}
        self.id = Call(self.name, "").id
        return CallPiece(self.n, self.name, "", self.id)

    def _param(self, name: str, text: str) -> CallPiece:
        name = name.strip()
        value = typed_value(text, self.props.get(self.name, {}).get(name))
        sep = "{" if not self.args else ", "
        self.args[name] = value
        return CallPiece(self.n, None, f"{sep}{json.dumps(name)}: {json.dumps(value)}")

    def _close(self) -> CallPiece:
        piece = CallPiece(self.n, None, "}" if self.args else "{}")
        self.calls.append(Call(self.name, json.dumps(self.args), self.id))
        self.n += 1
        return piece

    def feed(self, delta: str) -> tuple[str, list[CallPiece]]:
        self.buf += delta
        out, pieces = "", []
        while True:
            if self.state == "text":
                i = self.buf.find(OPEN)
                if i < 0:
                    keep = partial_suffix(self.buf, OPEN)
                    out += self.buf[: len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep :]
                    break
                out += self.buf[:i]
                self.buf, self.state = self.buf[i + len(OPEN) :], "block"
                continue
            s = self.buf.lstrip()
            if self.state in ("block", "block_end"):
                m = _FUNCTION.match(self.buf)
                if m:
                    pieces.append(self._open(m.group(1)))
                    self.buf, self.state = self.buf[m.end() :], "function"
                    continue
                if s.startswith(CLOSE):
                    self.buf, self.state = s[len(CLOSE) :], "text"
                    continue
                if not s or CLOSE.startswith(s) or _could_open_function(s):
                    break  # not yet whole
                # not a call: what the model wrote is content
                out += (OPEN if self.state == "block" else "") + self.buf
                self.buf, self.state = "", "text"
                continue
            # inside a function: parameters until </function>
            m = _PARAMETER.match(s)
            if m:
                pieces.append(self._param(m.group(1), m.group(2)))
                self.buf = s[m.end() :]
                continue
            if s.startswith(FUNCTION_END):
                pieces.append(self._close())
                self.buf, self.state = s[len(FUNCTION_END) :], "block_end"
                continue
            if s.startswith(CLOSE):  # </function> left out
                pieces.append(self._close())
                self.buf, self.state = s[len(CLOSE) :], "text"
                continue
            if (
                not s
                or s.startswith("<parameter=")
                or any(t.startswith(s) for t in ("<parameter=", FUNCTION_END, CLOSE))
            ):
                break  # not yet whole
            j = s.find("<", 1)  # stray text inside the function: skipped
            self.buf = s[j:] if j > 0 else ""
            if j <= 0:
                break
        return self._content(out), pieces

    def finish(self) -> tuple[str, list[CallPiece]]:
        rest, self.buf, pieces = self.buf, "", []
        if self.state == "function":  # cut inside a call: close it with what it has
            s = rest.lstrip()
            m = _PARAMETER_OPEN.match(s)
            if m:
                pieces.append(self._param(m.group(1), m.group(2).rstrip()))
            pieces.append(self._close())
            rest = ""
        elif self.state == "block":
            rest = OPEN + rest
        elif self.state == "block_end":
            rest = ""
        self.state = "text"
        return self._content(rest), pieces

    def _content(self, out: str) -> str:
        if not self.sent_content:  # text before a call is usually a newline or two
            out = out.lstrip()
            self.sent_content = bool(out)
        return out


def _could_open_function(s: str) -> bool:
    """s (stripped) may still become `<function=NAME>`."""
    head = "<function="
    if len(s) < len(head):
        return head.startswith(s)
    return s.startswith(head) and ">" not in s and "\n" not in s


# ----------------------------------------------------------------------------- Mistral's calls
ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"  # v11 tokenizers' special tokens inside a named call


class MistralCallStream:
    """Mistral's calls, whole or streaming. Text before `[TOOL_CALLS]` is content; after it
    either JSON, a list of `{"name": ..., "arguments": {...}}` (tokenizers before v11; one
    object taken too), or `NAME[ARGS]{...}` (v11 on, a marker before each call). A JSON list
    goes out as whole calls once it parses (one that never does stays content, as the model
    wrote it); a named call streams as its name, then its arguments as they come, up to the
    next marker or the end. As in vLLM, named arguments that are not JSON stay a call (so the
    model sees the call it tried); a name with no arguments stays content. Call ids are
    Mistral's 9 characters (a `[CALL_ID]` the model wrote, where it is one)."""

    def __init__(self):
        self.buf, self.state = "", "text"  # text | head | json | name | args
        self.calls: list[Call] = []  # the finished calls
        self.n = 0  # named calls opened (their CallPiece numbers)
        self.call: Call | None = None  # the named call streaming
        self.sent_content = False

    def feed(self, delta: str) -> tuple[str, list]:
        self.buf += delta
        return self._run(final=False)

    def finish(self) -> tuple[str, list]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, list]:
        """Consume what is whole; final: the output ended, so what waits is resolved too."""
        out, items = "", []
        while True:
            if self.state == "text":
                i = self.buf.find(TOOL_CALLS)
                if i < 0:
                    keep = 0 if final else partial_suffix(self.buf, TOOL_CALLS)
                    out += self.buf[: len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep :]
                    break
                out += self.buf[:i]
                self.buf, self.state = self.buf[i + len(TOOL_CALLS) :], "head"
                continue
            if self.state == "head":  # which form: JSON starts with [ or {, a name otherwise
                s = self.buf.lstrip()
                if s:
                    self.state = "json" if s[0] in "[{" else "name"
                    continue
            elif self.state == "json":
                calls, end = self._json()
                if end:
                    items += calls
                    out += "" if calls else TOOL_CALLS + self.buf[:end]
                    self.buf, self.state = self.buf[end:], "text"
                    continue
            elif self.state == "name":
                j, k = self.buf.find("{"), self.buf.find(TOOL_CALLS)
                if 0 <= j and not 0 <= k < j:
                    items.append(self._open(self.buf[:j]))
                    self.buf, self.state = self.buf[j:], "args"
                    continue
                if 0 <= k:  # another marker first: no arguments, so not a call
                    out += TOOL_CALLS + self.buf[:k]
                    self.buf, self.state = self.buf[k:], "text"
                    continue
            else:  # the arguments run to the next marker or the end
                k = self.buf.find(TOOL_CALLS)
                if k < 0 and not final:
                    # a partial marker, or blanks that may end the arguments, wait
                    keep = partial_suffix(self.buf, TOOL_CALLS)
                    send = self.buf[: len(self.buf) - keep].rstrip()
                    items += self._args(send)
                    self.buf = self.buf[len(send) :]
                    break
                k = len(self.buf) if k < 0 else k
                items += self._args(self.buf[:k].rstrip())
                self.calls.append(self.call)
                self.call, self.n = None, self.n + 1
                self.buf, self.state = self.buf[k:], "text"
                continue
            if not final:
                break  # not yet whole
            out += TOOL_CALLS + self.buf  # cut by the end before it was a call: as written
            self.buf, self.state = "", "text"
        return self._content(out), items

    def _json(self) -> tuple[list[Call], int]:
        """(calls, end) of the JSON after the marker: end 0 while it does not parse yet; calls
        empty when what parsed is not calls."""
        s = self.buf.lstrip()
        try:
            value, end = json.JSONDecoder().raw_decode(s)
        except ValueError:
            return [], 0
        values = value if isinstance(value, list) else [value]
        calls = [_call_of(v) for v in values]
        if not calls or None in calls:
            calls = []
        for c in calls:
            c.id = mistral_id()
        self.calls += calls
        return calls, end + len(self.buf) - len(s)

    def _open(self, head: str) -> CallPiece:
        name, _, given = head.replace(ARGS, "").partition(CALL_ID)
        given = given.strip()
        ok = len(given) == 9 and given.isascii() and given.isalnum()
        self.call = Call(name.strip(), "", given if ok else mistral_id())
        return CallPiece(self.n, self.call.name, "", self.call.id)

    def _args(self, text: str) -> list[CallPiece]:
        if not text:
            return []
        self.call.arguments += text
        return [CallPiece(self.n, None, text)]

    def _content(self, out: str) -> str:
        if not self.sent_content:  # text before a call is usually a newline or two
            out = out.lstrip()
            self.sent_content = bool(out)
        return out
