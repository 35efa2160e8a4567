"""A choice's way from the engine's outputs to the response: a one-way chain of small stages,
chosen once per request from the server's flags and the request's fields.

    engine output (cumulative) -> TextDelta -> [Reasoning] -> [ToolCalls] -> Logprobs -> Piece

Each stage takes the `Piece` the one before made (`feed`) and, when the piece ends the choice
(its `finish` is set), adds what it still held (`finish`). The endpoint (openai_api.py) turns
pieces into chunks (streaming: one chain per choice, fed every output) or into the final message
(one chain fed the finished output once: a finished output is the same stream in one piece).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from paxengine.outputs import CompletionOutput
from serving.logprobs import chat_logprobs, completion_logprobs
from serving.reasoning import ReasoningSplitter
from serving.tool_responses import ToolDeltas


@dataclass
class Piece:
    """What one engine output adds to a choice, as it goes down the chain."""

    output: CompletionOutput  # the cumulative output it came from
    text: str  # new text; after the reasoning and tool stages: content only
    first: bool  # the choice's first piece
    text_start: int  # output text before this piece
    token_start: int  # output tokens before this piece
    finish: Optional[str]
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)  # DeltaToolCall
    logprobs: Any = None
    prompt_logprobs: Optional[list] = None  # the request's (RequestOutput.prompt_logprobs)


class TextDelta:
    """A cumulative output -> the piece that is new since the last one (None: nothing new that
    the response shows: no text, no finish, no tokens whose logprobs were asked, no echo)."""

    def __init__(self, logprobs: bool, echo: bool = False):
        self.logprobs, self.echo = logprobs, echo
        self.text, self.tokens, self.started, self.done = 0, 0, False, False

    def feed(self, o: CompletionOutput) -> Optional[Piece]:
        if self.done:
            return None
        delta, first = o.text[self.text :], not self.started
        new_tokens = len(o.token_ids) > self.tokens
        if not (
            delta or o.finish_reason or (self.logprobs and new_tokens) or (first and self.echo)
        ):
            return None
        piece = Piece(o, delta, first, self.text, self.tokens, o.finish_reason)
        self.text, self.tokens, self.started = len(o.text), len(o.token_ids), True
        self.done = o.finish_reason is not None
        return piece


class Reasoning:
    """The think block's text -> `reasoning` (dropped with include_reasoning false)."""

    def __init__(self, parser: str, prompt_state: Optional[str], include: bool = True):
        self.split, self.include = ReasoningSplitter(parser, prompt_state), include

    def feed(self, p: Piece) -> Piece:
        if p.first and p.finish is not None:  # a finished output in one piece: vLLM's rule
            self.split.lookahead(p.text)
        r, p.text = self.split.feed(p.text)
        p.reasoning = r if self.include else ""
        return p

    def finish(self, p: Piece) -> Piece:
        r, c = self.split.finish()
        p.text += c
        p.reasoning += r if self.include else ""
        return p


class ToolCalls:
    """The content's tool calls -> OpenAI tool-call deltas (serving/tool_responses.py); the
    finish reason becomes tool_calls where the model called."""

    def __init__(self, deltas: ToolDeltas):
        self.deltas = deltas

    def feed(self, p: Piece) -> Piece:
        if p.finish is None:
            p.text, p.tool_calls = self.deltas.feed(p.text)
        return p

    def finish(self, p: Piece) -> Piece:
        msg, p.finish = self.deltas.step(p.text, p.finish)
        p.text, p.tool_calls = msg.content or "", msg.tool_calls or []
        return p


class ChatLogprobs:
    def __init__(self, state, k: int, as_ids: bool):
        self.state, self.k, self.as_ids = state, k, as_ids

    def feed(self, p: Piece) -> Piece:
        p.logprobs = chat_logprobs(self.state, p.output, p.token_start, self.k, self.as_ids)
        return p


class CompletionEcho:
    """A completion's echo (the prompt's text first, and its tokens in the logprobs, with
    their values: echo with logprobs asks the engine for the prompt's logprobs) and logprobs
    (k, or None: none asked)."""

    def __init__(self, state, prompt: tuple[str, list[int]], echo: bool, k, as_ids: bool):
        self.state, self.prompt, self.echo, self.k, self.as_ids = state, prompt, echo, k, as_ids

    def feed(self, p: Piece) -> Piece:
        ptext, pids = self.prompt
        echo_now = p.first and self.echo
        if self.k is not None:
            offset = p.text_start + (len(ptext) if self.echo and not p.first else 0)
            p.logprobs = completion_logprobs(
                self.state,
                p.output,
                p.token_start,
                self.k,
                offset,
                pids if echo_now else None,
                self.as_ids,
                p.prompt_logprobs,
            )
        if echo_now:
            p.text = ptext + p.text
        return p


class Chain:
    """One choice's stages, in order."""

    def __init__(self, source: TextDelta, stages: list):
        self.source, self.stages = source, stages

    def run(self, o: CompletionOutput, prompt_logprobs: Optional[list] = None) -> Optional[Piece]:
        """prompt_logprobs: the request's, when it asked (the echo stage reads them)."""
        p = self.source.feed(o)
        if p is None:
            return None
        p.prompt_logprobs = prompt_logprobs
        for stage in self.stages:
            p = stage.feed(p)
            if p.finish is not None and hasattr(stage, "finish"):
                p = stage.finish(p)
        return p


@dataclass
class ChatSetup:
    """What a chat request's choices need from the request and the server, decided once."""

    k: Optional[int] = None  # top logprobs (None: no logprobs)
    as_ids: bool = False
    tool_mode: Optional[str] = None  # constraints.tool_mode
    tool_format: str = "hermes"
    tool_defs: Optional[list[dict]] = None
    parallel: bool = True
    reasoning_parser: Optional[str] = None
    prompt_state: Optional[str] = None  # reasoning.prompt_block of the prompt
    include_reasoning: bool = True
    role: str = "assistant"  # the answer's (vLLM's: the last message's without a new turn)
    echo: Optional[str] = None  # echo: the text each choice's content starts with

    @property
    def plain(self) -> bool:
        """Content is the text as it came (no stage holds text back or moves it)."""
        return self.tool_mode is None and self.reasoning_parser is None

    @property
    def special_tokens(self) -> bool:
        """A parser reads markers that are special tokens (Mistral's `[TOOL_CALLS]`, `[THINK]`),
        so the text keeps them (vLLM sets skip_special_tokens false for these parsers too)."""
        mistral_calls = self.tool_mode == "auto" and self.tool_format == "mistral"
        return mistral_calls or self.reasoning_parser == "mistral"


def chat_chain(state, setup: ChatSetup) -> Chain:
    stages: list = []
    if setup.reasoning_parser is not None:
        stages.append(
            Reasoning(setup.reasoning_parser, setup.prompt_state, setup.include_reasoning)
        )
    if setup.tool_mode is not None:
        deltas = ToolDeltas(setup.tool_mode, setup.parallel, setup.tool_format, setup.tool_defs)
        stages.append(ToolCalls(deltas))
    if setup.k is not None:
        stages.append(ChatLogprobs(state, setup.k, setup.as_ids))
    return Chain(TextDelta(setup.k is not None), stages)


def completion_chain(state, prompt, echo: bool, k: Optional[int], as_ids: bool) -> Chain:
    return Chain(TextDelta(k is not None, echo), [CompletionEcho(state, prompt, echo, k, as_ids)])
