"""Tool calls in a chat response: a finished choice's content, calls and finish reason
(`finished_calls`), and a streamed choice's OpenAI tool-call deltas (`ToolDeltas`). The formats
themselves (parsing, forced-call grammars, the template's view) are in `serving/tools.py`."""

from __future__ import annotations

from typing import Optional

from serving import tools
from serving.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall


def finished_calls(
    mode: Optional[str],
    text: str,
    finish: Optional[str],
    parallel: bool = True,
    fmt: str = tools.HERMES,
):
    """(content, calls, finish_reason) of a finished chat output. parallel=False keeps the first
    call the model wrote (a forced one has a grammar of one call already); fmt: the model's
    tool-call format (tools.call_format)."""
    if mode is None:
        return text, [], finish
    if mode == "auto":
        content, calls = tools.parse_tool_calls(text, fmt)
        calls = calls if parallel else calls[:1]
        return content, calls, ("tool_calls" if calls and finish == "stop" else finish)
    calls = tools.forced_calls(text, mode) if finish == "stop" else None
    if calls is None:  # cut short (length, a stop string): what was written, as text
        return text, [], finish
    # OpenAI's finish_reason: "tool_calls" when the model chose to call, "stop" when forced to
    # call one named function
    return None, calls, ("tool_calls" if mode == "required" else "stop")


def call_format_of(tokenizer) -> str:
    """The tool-call format of the model behind this tokenizer's chat template."""
    return tools.call_format(getattr(tokenizer, "chat_template", None))


class ToolDeltas:
    """A streamed chat choice's deltas when tools are on: content and OpenAI tool-call deltas."""

    def __init__(self, mode: str, parallel: bool, fmt: str = tools.HERMES):
        self.mode, self.n_calls, self.parallel = mode, 0, parallel
        self.auto = tools.call_stream(fmt) if mode == "auto" else None
        self.text = ""  # a forced call's output so far
        self.named_id = None

    def _call_deltas(self, calls) -> list[DeltaToolCall]:
        out = []
        for c in calls if self.parallel else calls[: max(0, 1 - self.n_calls)]:
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

    def step(self, delta: str, finish: Optional[str]) -> tuple[DeltaMessage, Optional[str]]:
        if self.auto is not None:
            content, calls = self.auto.feed(delta)
            if finish is not None:
                more, last = self.auto.finish()
                content, calls = content + more, calls + last
            if finish == "stop" and self.auto.calls:
                finish = "tool_calls"
            return DeltaMessage(
                content=content or None, tool_calls=self._call_deltas(calls) or None
            ), finish
        self.text += delta
        if self.mode == "required":  # an array of calls: sent whole, when it is complete
            if finish is None:
                return DeltaMessage(), None
            _, calls, finish = finished_calls(self.mode, self.text, finish)
            if not calls:
                return DeltaMessage(content=self.text), finish
            return DeltaMessage(tool_calls=self._call_deltas(calls)), finish
        # a named function: its arguments stream as they come
        first = self.named_id is None
        if first:
            self.named_id = tools.Call(self.mode, "").id
        piece = DeltaToolCall(
            index=0,
            id=self.named_id if first else None,
            type="function" if first else None,
            function=DeltaFunctionCall(name=self.mode if first else None, arguments=delta),
        )
        return DeltaMessage(tool_calls=[piece]), finish
