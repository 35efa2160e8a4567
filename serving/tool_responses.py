"""Tool calls in a chat response: a finished choice's content, calls and finish reason
(`finished_calls`), and a streamed choice's OpenAI tool-call deltas (`ToolDeltas`). The formats
themselves are in `serving/tools.py` (forced-call grammars, the template's view) and
`serving/tool_parsers.py` (parsing)."""

from __future__ import annotations

from typing import Optional

from serving import tool_parsers, tools
from serving.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall


def finished_calls(
    mode: Optional[str],
    text: str,
    finish: Optional[str],
    parallel: bool = True,
    fmt: str = tools.HERMES,
    tool_defs: Optional[list[dict]] = None,
):
    """(content, calls, finish_reason) of a finished chat output. parallel=False keeps the first
    call the model wrote (a forced one has a grammar of one call already); fmt: the model's
    tool-call format (tools.call_format, a --tool-call-parser name)."""
    if mode is None:
        return text, [], finish
    if mode == "auto":
        content, calls = tool_parsers.parse_tool_calls(text, fmt, tool_defs)
        calls = calls if parallel else calls[:1]
        return content, calls, ("tool_calls" if calls and finish == "stop" else finish)
    calls = tools.forced_calls(text, mode) if finish == "stop" else None
    if calls is None:  # cut short (length, a stop string): what was written, as text
        return text, [], finish
    if fmt == tools.MISTRAL:  # ids the chat template takes back on the next turn
        for c in calls:
            c.id = tools.mistral_id()
    # OpenAI's finish_reason: "tool_calls" when the model chose to call, "stop" when forced to
    # call one named function
    return None, calls, ("tool_calls" if mode == "required" else "stop")


def call_format_of(tokenizer, parser: Optional[str] = None) -> str:
    """The tool-call format: --tool-call-parser's, or (None, "auto") the one of the model behind
    this tokenizer's chat template."""
    if parser not in (None, "auto"):
        return parser
    return tools.call_format(getattr(tokenizer, "chat_template", None))


class ToolDeltas:
    """A chat choice's tool-call stage: the content it is fed comes out as content and OpenAI
    tool-call deltas (`feed`, then `finish` with the finish reason). `auto`: the model's own
    calls in format `fmt`; "required": the forced array of calls, sent whole once complete; a
    function's name: its forced arguments, streamed as they come (or, fed whole and finished at
    once, read as a finished output)."""

    def __init__(
        self,
        mode: str,
        parallel: bool,
        fmt: str = tools.HERMES,
        tool_defs: Optional[list[dict]] = None,
    ):
        self.mode, self.n_calls, self.parallel, self.fmt = mode, 0, parallel, fmt
        self.auto = tool_parsers.call_stream(fmt, tool_defs) if mode == "auto" else None
        self.text = ""  # a forced call's output so far
        self.named_id = None
        self.piece_index: dict[int, int] = {}  # a streamed call's number -> its delta index

    def _call_deltas(self, items) -> list[DeltaToolCall]:
        out = []
        for c in items:
            if isinstance(c, tools.CallPiece):  # a call streaming piece by piece
                if c.name is not None:
                    if not self.parallel and self.n_calls >= 1:
                        continue
                    self.piece_index[c.call] = self.n_calls
                    self.n_calls += 1
                    out.append(
                        DeltaToolCall(
                            index=self.piece_index[c.call],
                            id=c.id,
                            type="function",
                            function=DeltaFunctionCall(name=c.name, arguments=c.arguments),
                        )
                    )
                elif c.call in self.piece_index:
                    out.append(
                        DeltaToolCall(
                            index=self.piece_index[c.call],
                            function=DeltaFunctionCall(arguments=c.arguments),
                        )
                    )
                continue
            if not self.parallel and self.n_calls >= 1:
                continue
            out.append(
                DeltaToolCall(
                    index=self.n_calls,
                    id=c.id,
                    type="function",
                    function=DeltaFunctionCall(name=c.name, arguments=c.arguments),
                )
            )
            self.n_calls += 1
        return out

    def feed(self, delta: str) -> tuple[str, list[DeltaToolCall]]:
        """(content, tool-call deltas) of more output text."""
        if self.auto is not None:
            content, items = self.auto.feed(delta)
            return content, self._call_deltas(items)
        self.text += delta
        if self.mode == "required" or not delta:  # an array of calls: sent whole at the end
            return "", []
        # a named function: its arguments stream as they come
        first = self.named_id is None
        if first:
            self.named_id = (
                tools.mistral_id() if self.fmt == tools.MISTRAL else tools.Call(self.mode, "").id
            )
        piece = DeltaToolCall(
            index=0,
            id=self.named_id if first else None,
            type="function" if first else None,
            function=DeltaFunctionCall(name=self.mode if first else None, arguments=delta),
        )
        return "", [piece]

    def finish(self, finish: Optional[str]) -> tuple[str, list[DeltaToolCall], Optional[str]]:
        """What was held back, and the finish reason (tool_calls where the model called)."""
        if self.auto is not None:
            content, items = self.auto.finish()
            deltas = self._call_deltas(items)
            if finish == "stop" and self.auto.calls:
                finish = "tool_calls"
            return content, deltas, finish
        if self.mode != "required" and self.named_id is not None:
            return "", [], finish  # a named function's arguments have streamed
        # the forced output whole: the array of calls, or a named function's arguments
        content, calls, finish = finished_calls(self.mode, self.text, finish, fmt=self.fmt)
        if not calls:
            return content or "", [], finish
        return "", self._call_deltas(calls), finish

    def step(self, delta: str, finish: Optional[str]) -> tuple[DeltaMessage, Optional[str]]:
        """feed and, with a finish reason, finish: one chunk's message and finish reason."""
        if self.mode != "auto" and self.mode != "required" and finish is not None:
            if self.named_id is None:  # fed whole: read as a finished output
                self.text += delta
                delta = ""
        content, calls = self.feed(delta)
        if finish is not None:
            more, last, finish = self.finish(finish)
            content, calls = content + more, calls + last
        return DeltaMessage(content=content or None, tool_calls=calls or None), finish
