"""Pythonic tool calls: vLLM's `--tool-call-parser pythonic` (Llama 3.2 / Llama 4 instruct models,
ToolACE) and `llama4_pythonic` (the same list, which Llama 4 may wrap in `<|python_start|>` ...
`<|python_end|>`). The message is a Python list of calls, `[get_weather(city="Paris", days=3),
get_time()]`, read with `ast` (never evaluated):

- the whole message (stripped; llama4_pythonic: without a leading `<|python_start|>` and any
  `<|python_end|>`) is one list expression of one or more calls, each a plain name with keyword
  arguments only, each value a literal: a string, a number (with a sign), True / False / None, a
  list or a dict with string keys (no key twice), nested. Anything else (`[1, 2]`, `[Note: ...]`,
  a positional argument, a variable, text after the list) is content, as the model wrote it;
- each call's arguments become a JSON object (`json.dumps`, non-ASCII kept), each call an id;
- streaming (`PythonicCallStream`): a message that does not start with `[` streams as content at
  once; one that does is held while it can still be a call list, and goes out as content as soon
  as it cannot. A call goes out once it has a keyword argument (or closes): its name with `{`,
  then its arguments as they become certain: a string value character by character, any other
  value once it is whole, `}` at its `)`. The streamed calls are the whole text's calls. A list
  that breaks after a call went out (cut by max_tokens, text after `]`) cannot take the call
  back: its text follows as content, and the finish reason is not tool_calls.

vLLM's parser differs (vllm/tool_parsers/pythonic_tool_parser.py): it takes a message only when
it starts with `[` and then a letter (no blank or line break before the first name; names and
keywords start with a letter), reads the first statement (`[f()]` then `[g()]` on a line of its
own: f there, content here), refuses a negative number (`-1` is not an `ast.Constant`), takes
any constant dict key (a repeated one: the last wins); while streaming it drops a text starting
with `[` that is not calls, sends a call's name at its `(`, and diffs re-serialized JSON (a
float's `1.` then `1.5` breaks its stream), where this holds a number back until it is whole.
"""

from __future__ import annotations

import ast
import json
import keyword
import math
import re
import warnings

from serving.tools import Call, CallPiece, partial_suffix

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4's


class NotCalls(ValueError):
    """The text is not (or can no longer become) a list of calls."""


# ----------------------------------------------------------------------------- the whole text
def _value(node):
    """A literal's value (JSON's kinds), else NotCalls."""
    if isinstance(node, ast.Constant):
        v = node.value
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float) and math.isfinite(v):
            return v
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = node.operand
        if isinstance(inner, ast.Constant) and type(inner.value) in (int, float):
            v = -inner.value if isinstance(node.op, ast.USub) else inner.value
            if math.isfinite(v):
                return v
    elif isinstance(node, ast.List):
        return [_value(e) for e in node.elts]
    elif isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            if not (isinstance(k, ast.Constant) and isinstance(k.value, str)) or k.value in out:
                raise NotCalls("dict keys: strings, each once")
            out[k.value] = _value(v)
        return out
    raise NotCalls("not a literal")


def _call(node) -> tuple[str, dict]:
    """(name, arguments) of one call node, else NotCalls."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise NotCalls("a call of a name with keyword arguments")
    args = {}
    for kw in node.keywords:
        if kw.arg is None:  # **kwargs
            raise NotCalls("keyword arguments only")
        args[kw.arg] = _value(kw.value)
    return node.func.id, args


def _parse(text: str):
    """ast.parse in eval mode, quietly (a string's invalid escape warns)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return ast.parse(text, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            raise NotCalls("not Python") from None


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _body(text: str, llama4: bool) -> str:
    s = text.strip()
    if llama4 and s.startswith(PYTHON_START):
        s = s[len(PYTHON_START) :]
    return (s.replace(PYTHON_END, "") if llama4 else s).strip()


def parse_pythonic(text: str, llama4: bool = False) -> tuple[str | None, list[Call]]:
    """(content, calls) of a finished message (the module's rules)."""
    s = _body(text, llama4)
    try:
        if not s.startswith("["):
            raise NotCalls("not a list")
        node = _parse(s)
        if not isinstance(node, ast.List) or not node.elts:
            raise NotCalls("a list of one or more calls")
        calls = [_call(e) for e in node.elts]
    except NotCalls:
        return (text.strip() or None), []
    return None, [Call(name, _dumps(args)) for name, args in calls]


# ----------------------------------------------------------------------------- streaming
# a string's escape that more text may still change: a lone backslash, a short \x, \u, \U,
# an unclosed \N{...}, one or two octal digits
_PARTIAL_ESCAPE = re.compile(
    r"\\(x[0-9a-fA-F]?|u[0-9a-fA-F]{0,3}|U[0-9a-fA-F]{0,7}|N(\{[^}]*)?|[0-7]{1,2})?\Z"
)


class _Scan:
    """The call list's text, each character scanned once: brackets, strings and comments, where
    the current top-level element starts, and NotCalls as soon as the text cannot be a call
    list."""

    def __init__(self):
        self.text, self.pos = "", 0  # pos: scanned up to (a backslash or a quote may wait)
        self.stack: list[str] = []
        self.quote, self.quote_at = None, 0  # the open string's quote; where its text starts
        self.comment = False
        self.phase = "start"  # start | name (of a call) | call | after (a call) | closed
        self.elem = 0  # where the current top-level element starts
        self.spans: list[tuple[int, int]] = []  # the closed calls' text

    def feed(self, more: str) -> None:
        self.text += more
        t, i, n = self.text, self.pos, len(self.text)
        while i < n:
            c = t[i]
            if self.quote:
                q = self.quote
                if c == "\\":
                    if i + 1 == n:
                        break  # what it escapes is not here yet
                    i += 2
                elif t.startswith(q, i):
                    self.quote, i = None, i + len(q)
                elif len(q) == 3 and c == q[0] and q.startswith(t[i:]):
                    break  # a closing triple quote may be coming
                elif c == "\n" and len(q) == 1:
                    raise NotCalls("a line break inside a string")
                else:
                    i += 1
                continue
            if self.comment:
                self.comment = c != "\n"
                i += 1
                continue
            depth = len(self.stack)
            if c == "#" and depth:
                self.comment, i = True, i + 1
                continue
            if c in "'\"":
                if depth < 2:
                    raise NotCalls("a string in the list")
                if t.startswith(c * 3, i):
                    self.quote = c * 3
                elif i + 3 > n and (c * 3).startswith(t[i:]):
                    break  # one quote or two: a triple quote may be coming
                else:
                    self.quote = c
                i += len(self.quote)
                self.quote_at = i
                continue
            if depth == 0:
                if c == "[" and self.phase == "start":
                    self.stack.append(c)
                    self.phase, self.elem = "name", i + 1
                elif not c.isspace():
                    raise NotCalls("text outside the list")
            elif depth == 1:
                self._top(c, i)
            elif c in "([{":
                self.stack.append(c)
            elif c in ")]}":
                if self.stack.pop() != {")": "(", "]": "[", "}": "{"}[c]:
                    raise NotCalls("brackets that do not match")
                if len(self.stack) == 1:
                    self.phase = "after"
                    self.spans.append((self.elem, i + 1))
            i += 1
        self.pos = i

    def _top(self, c: str, i: int) -> None:
        """A character inside the list, outside its calls."""
        if self.phase == "name":
            name = re.sub(r"#[^\n]*", "", self.text[self.elem : i]).strip()  # no comments
            if c == "(":
                if not name.isidentifier() or keyword.iskeyword(name):
                    raise NotCalls("a call of a name")
                self.stack.append(c)
                self.phase = "call"
            elif c == "]" and not name and self.spans:  # a trailing comma
                self.stack.pop()
                self.phase = "closed"
            elif not (c.isalnum() or c == "_" or c.isspace()):
                raise NotCalls("not a call")
        elif c == ",":
            self.phase, self.elem = "name", i + 1
        elif c == "]":
            self.stack.pop()
            self.phase = "closed"
        elif not c.isspace():
            raise NotCalls("text between calls")

    def open_call(self) -> tuple[str, int] | None:
        """The call being written as a complete Python text, and how much of it is the model's
        (the rest closes its strings and brackets); None outside a call."""
        if self.phase != "call":
            return None
        end = self.pos
        if self.quote:  # a string's escape still growing: up to it
            m = _PARTIAL_ESCAPE.search(self.text, self.quote_at, end)
            if m and _escapes(self.text, m.start(), self.quote_at):
                end = m.start()
        real = self.text[self.elem : end].lstrip()
        closers = "".join({"(": ")", "[": "]", "{": "}"}[b] for b in reversed(self.stack[1:]))
        return real + ("\n" if self.comment else "") + (self.quote or "") + closers, len(real)


def _escapes(text: str, at: int, start: int) -> bool:
    """Whether the backslash at `at` starts an escape (an even run of backslashes before it)."""
    k = at
    while k > start and text[k - 1] == "\\":
        k -= 1
    return (at - k) % 2 == 0


def _ends(text: str):
    """(lineno, UTF-8 column) -> character offset in text, as ast positions count."""
    starts = [0] + [m.end() for m in re.finditer(r"\r\n|\r|\n", text)]
    ascii_only = text.isascii()

    def at(lineno: int, col: int) -> int:
        start = starts[lineno - 1]
        if ascii_only:
            return start + col
        return start + len(text[start:].encode("utf-8")[:col].decode("utf-8", "ignore"))

    return at


class _Prefix:
    """The JSON text of a partial call's arguments that no later text can change."""

    def __init__(self, text: str, real: int):
        self.text, self.real, self.at = text, real, _ends(text)

    def _closed(self, node) -> bool:
        end = self.at(node.end_lineno, node.end_col_offset)
        if isinstance(node, (ast.List, ast.Dict)):
            return end <= self.real  # its own closing bracket
        return end < self.real and self.text[end : self.real].strip() != ""

    def value(self, node) -> str:
        if self._closed(node):
            return _dumps(_value(node))
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return _dumps(node.value)[:-1]  # open: without its closing quote
        if isinstance(node, ast.List):
            return "[" + self._items([(None, e) for e in node.elts])
        if isinstance(node, ast.Dict):
            _value(node)  # string keys, each once
            return "{" + self._items([(k.value, v) for k, v in zip(node.keys, node.values)])
        _value(node)  # a literal: a number (or True, None) still being written
        return ""

    def _items(self, pairs) -> str:
        """Closed items whole, an open last one's prefix (its key, if any, with it)."""
        out = []
        for key, node in pairs:
            head = "" if key is None else _dumps(key) + ": "
            out.append(head + self.value(node))
        return ", ".join(out)

    def call(self, node) -> str:
        _call(node)  # keywords and literals, or NotCalls
        return "{" + self._items([(kw.arg, kw.value) for kw in node.keywords])


class PythonicCallStream:
    """The pythonic format while streaming (feed / finish -> (content, CallPieces)); see the
    module's docstring."""

    def __init__(self, llama4: bool = False):
        self.llama4 = llama4
        self.raw = ""  # the message from its first non-blank character
        self.held = ""  # llama4: a possible `<|python_end|>` not yet whole
        self.mode = None  # None (undecided), calls, content
        self.scan = _Scan()
        self.final = 0  # closed calls whose whole arguments went out
        self.calls: list[Call] = []  # the finished calls
        self.sent: list[str] = []  # each opened call's arguments sent so far
        self.ids: list[str] = []

    def feed(self, delta: str) -> tuple[str, list]:
        if self.mode == "content":
            return delta, []
        self.raw += delta if self.raw else delta.lstrip()
        if self.mode == "calls":
            return self._more(delta)
        head = self.raw
        if not head or (
            self.llama4 and len(head) < len(PYTHON_START) and PYTHON_START.startswith(head)
        ):
            return "", []  # too early to tell
        if self.llama4 and head.startswith(PYTHON_START):
            self.mode = "calls"
            return self._more(head[len(PYTHON_START) :])
        if head.startswith("["):
            self.mode = "calls"
            return self._more(head)
        self.mode = "content"
        return head, []

    def _more(self, delta: str) -> tuple[str, list]:
        if self.llama4:  # every `<|python_end|>` left out, a partial one held
            text = (self.held + delta).replace(PYTHON_END, "")
            keep = partial_suffix(text, PYTHON_END)
            delta, self.held = text[: len(text) - keep], text[len(text) - keep :]
        try:
            self.scan.feed(delta)
            return "", self._pieces()
        except NotCalls:
            return self._as_content()

    def _as_content(self) -> tuple[str, list]:
        """Not a call list: what the model wrote goes out as content (after any call that went
        out already, which cannot be taken back)."""
        self.mode = "content"
        return self.raw, []

    def _pieces(self) -> list:
        s, pieces = self.scan, []
        while self.final < len(s.spans):  # calls closed since: their whole arguments
            a, b = s.spans[self.final]
            name, args = _call(_parse(s.text[a:b].strip()))  # NotCalls: for good
            pieces += self._send(self.final, name, _dumps(args))
            self.final += 1
        found = s.open_call()
        if found is None:
            return pieces
        text, real = found
        try:
            node = _parse(text)
            prefix = _Prefix(text, real).call(node)
        except NotCalls:
            return pieces  # not yet a call (a name, a value being written)
        if not node.keywords:
            return pieces  # a call's name goes out with its first argument (or at its end)
        return pieces + self._send(len(s.spans), node.func.id, prefix)

    def _send(self, i: int, name: str, args: str) -> list:
        """Pieces that bring call i's arguments sent so far up to `args` (a longer prefix)."""
        if i == len(self.sent):
            self.ids.append(Call(name, "").id)
            self.sent.append(args)
            return [CallPiece(i, name, args, self.ids[i])]
        if i < len(self.sent) and args.startswith(self.sent[i]) and args != self.sent[i]:
            more, self.sent[i] = args[len(self.sent[i]) :], args
            return [CallPiece(i, None, more)]
        return []

    def finish(self) -> tuple[str, list]:
        if self.mode != "calls":
            rest = self.raw if self.mode is None else ""
            self.mode = "content"
            return rest, []
        _, calls = parse_pythonic(self.raw, self.llama4)
        if not calls:
            return self._as_content()
        pieces = []
        for i, c in enumerate(calls):
            pieces += self._send(i, c.name, c.arguments)
            c.id = self.ids[i]
        self.calls = calls
        return "", pieces
