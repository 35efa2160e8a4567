"""A Responses API answer's output items, built from its choice's pieces (`choices.Piece`, after
the chat chain's reasoning and tool-call stages): a `reasoning` item, the assistant `message`,
`function_call` items; and the stream events that build them. As vLLM's simple streaming
processor: one item is open at a time, a piece of another kind closes it and opens the next.

The finished response's output is these items as they were streamed, so a stream's
`response.completed` carries the ids its events named, and a non-streamed response (the
finished output fed as one piece) has the same shape."""

from __future__ import annotations

import uuid
from typing import Optional

from serving.responses_protocol import (
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningContent,
)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _logprobs(chat_logprobs) -> list[dict]:
    """The chat chain's logprobs (ChatLogprobs) in the Responses shape; -inf as vLLM's -9999
    (JSON has no infinity)."""
    out = []
    for e in chat_logprobs.content or []:
        d = e.model_dump()
        for x in (d, *d["top_logprobs"]):
            x["logprob"] = max(x["logprob"], -9999.0)
        out.append(d)
    return out


class OutputItems:
    """auto_tools: the model's own calls are parsed (tool_choice auto), so the message is the
    text around them stripped, as the chat endpoint's content: leading whitespace is dropped and
    trailing whitespace held back until more text comes. logprobs: keep the tokens' logprobs
    (include: message.output_text.logprobs)."""

    def __init__(self, auto_tools: bool = False, logprobs: bool = False):
        self.items: list[OutputItem] = []
        self.open: Optional[OutputItem] = None
        self.text = ""  # the open item's text, or a call's arguments
        self.auto_tools, self.held = auto_tools, ""
        self.logprobs: Optional[list[dict]] = [] if logprobs else None

    # ------------------------------------------------------------------ pieces -> events
    def feed(self, p) -> list[dict]:
        """The events of one piece (its reasoning, then its content, then its call deltas)."""
        events: list[dict] = []
        lps = _logprobs(p.logprobs) if self.logprobs is not None and p.logprobs else []
        if self.logprobs is not None:
            self.logprobs += lps
        if p.reasoning:
            events += self._delta("reasoning", p.reasoning)
        text = self._content(p.text)
        if text:
            events += self._delta("message", text, lps)
        for d in p.tool_calls:
            f = d.function
            if d.id is not None:  # a new call: its id and name come first
                events += self._close()
                self.open = OutputFunctionCall(
                    id=_id("fc"), call_id=d.id, name=f.name or "", status="in_progress"
                )
                events.append(self._added())
            if f is not None and f.arguments and isinstance(self.open, OutputFunctionCall):
                self.text += f.arguments
                events.append(
                    self._event("response.function_call_arguments.delta", delta=f.arguments)
                )
        return events

    def close(self) -> list[dict]:
        """The open item's done events (the output has finished)."""
        self.held = ""  # whitespace after the last text
        return self._close()

    # ------------------------------------------------------------------ internals
    def _content(self, text: str) -> str:
        if not self.auto_tools or not text:
            return text
        text = self.held + text
        if not isinstance(self.open, OutputMessage):
            text = text.lstrip()
        body = text.rstrip()
        self.held = text[len(body) :]
        return body

    def _delta(self, kind: str, text: str, lps: Optional[list] = None) -> list[dict]:
        events: list[dict] = []
        if self.open is None or self.open.type != kind:
            events += self._close()
            if kind == "message":
                self.open = OutputMessage(id=_id("msg"), status="in_progress")
                part = OutputText(text="")
            else:
                self.open = OutputReasoning(id=_id("rs"), status="in_progress")
                part = ReasoningContent(text="")
            events += [self._added(), self._event("response.content_part.added", 0, part=part)]
        self.text += text
        if kind == "message":
            events.append(
                self._event("response.output_text.delta", 0, delta=text, logprobs=lps or [])
            )
        else:
            events.append(self._event("response.reasoning_text.delta", 0, delta=text))
        return events

    def _close(self) -> list[dict]:
        item, text = self.open, self.text
        if item is None:
            return []
        events = []
        if isinstance(item, OutputMessage):
            item.content = [OutputText(text=text, logprobs=self.logprobs)]
            lps = self.logprobs or []
            events.append(self._event("response.output_text.done", 0, text=text, logprobs=lps))
            events.append(self._event("response.content_part.done", 0, part=item.content[0]))
            self.held = ""  # whitespace before a call is not the message's
        elif isinstance(item, OutputReasoning):
            item.content = [ReasoningContent(text=text)]
            events.append(self._event("response.reasoning_text.done", 0, text=text))
            events.append(self._event("response.content_part.done", 0, part=item.content[0]))
        else:
            item.arguments = text
            events.append(
                self._event("response.function_call_arguments.done", name=item.name, arguments=text)
            )
        item.status = "completed"
        events.append(
            {"type": "response.output_item.done", "output_index": len(self.items), "item": item}
        )
        self.items.append(item)
        self.open, self.text = None, ""
        return events

    def _added(self) -> dict:
        item = self.open.model_copy(deep=True)  # as it was when added
        return {"type": "response.output_item.added", "output_index": len(self.items), "item": item}

    def _event(self, kind: str, content_index: Optional[int] = None, **fields) -> dict:
        """An event of the open item (at output index len(items): it is not among them yet)."""
        e = {"type": kind, "item_id": self.open.id, "output_index": len(self.items)}
        if content_index is not None:
            e["content_index"] = content_index
        return {**e, **fields}
