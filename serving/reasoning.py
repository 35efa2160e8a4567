"""Reasoning output (`--reasoning-parser`, vLLM's names): the text a model writes between its
think tags goes to the message's `reasoning` (streamed as `delta.reasoning`), the rest to
`content`.

- `qwen3`: a block opens at `<think>` and closes at `</think>`; without tags everything is
  content (Qwen3 with `chat_template_kwargs: {"enable_thinking": false}`, whose template closes
  an empty block in the prompt).
- `deepseek_r1`: the output starts inside the block (the model may or may not write `<think>`
  first) until `</think>`, as vLLM's parser assumes.
- `mistral` (Magistral): `[THINK]` ... `[/THINK]`, special tokens (the server keeps them in
  the text: `choices.ChatSetup.special_tokens`); as vLLM's parser, only the output's own tags
  count (Magistral's system prompt shows an example block), text before `[THINK]` is content
  too, and without `[THINK]` all is content (a stray `[/THINK]` dropped).

Either way (qwen3, deepseek_r1), a prompt that already opened the block (Qwen3.5's and
DeepSeek-R1's templates with thinking on end the prompt with `<think>`) starts the output inside
it, and one that closed it starts outside. One block per output: text after the end tag is
content whatever it holds. An output cut inside the block (max_tokens) is all reasoning.
"""

from __future__ import annotations

from typing import Optional

START, END = "<think>", "</think>"
MISTRAL = "mistral"
PARSERS = ("qwen3", "deepseek_r1", MISTRAL)


def tags(parser: str) -> tuple[str, str]:
    """The parser's (start, end) tags."""
    return ("[THINK]", "[/THINK]") if parser == MISTRAL else (START, END)


def prompt_block(prompt: str, parser: str = "qwen3") -> Optional[str]:
    """Where the prompt leaves the think block: "open" (the output starts inside it), "closed"
    (a block was opened and closed last: thinking is done or off) or None (no tags, or the
    mistral parser, which reads the output's tags only)."""
    if parser == MISTRAL:
        return None
    s, e = prompt.rfind(START), prompt.rfind(END)
    if s < 0 and e < 0:
        return None
    return "open" if s > e else "closed"


def _partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of tags."""
    for n in range(min(max(len(t) for t in tags) - 1, len(text)), 0, -1):
        if any(t.startswith(text[-n:]) and n < len(t) for t in tags):
            return n
    return 0


class ReasoningSplitter:
    """One choice's text, fed as it comes, split into (reasoning, content). A tag split across
    pieces is held back until it is whole (or the output ends)."""

    def __init__(self, parser: str, prompt_state: Optional[str] = None):
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser: one of {PARSERS}, got {parser!r}")
        self.parser = parser
        self.start, self.end = tags(parser)
        if prompt_state == "open" or (parser == "deepseek_r1" and prompt_state != "closed"):
            self.state = "think"
        else:
            self.state = "before"  # qwen3 (or a closed prompt): content until <think>
        self.buf = ""
        self.seen_text = False  # any output text yet (deepseek_r1 drops a leading <think>)

    def lookahead(self, text: str) -> None:
        """Given the whole output before any feed: qwen3 as vLLM's reads a finished one, a
        `</think>` with no `<think>` before it ends a block the prompt opened."""
        e = text.find(END)
        if self.parser != MISTRAL and self.state == "before" and e >= 0 and START not in text[:e]:
            self.state = "think"

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, content = "", ""
        while self.buf:
            if self.state == "after":
                content, self.buf = content + self.buf, ""
                break
            if self.state == "before":
                i = self.buf.find(self.start)
                # mistral: an end tag with no start tag before it is dropped (vLLM's)
                e = self.buf.find(self.end) if self.parser == MISTRAL else -1
                if 0 <= e and not 0 <= i < e:
                    content += self.buf[:e]
                    self.buf = self.buf[e + len(self.end) :]
                    continue
                if i < 0:
                    held = (self.start, self.end) if self.parser == MISTRAL else (self.start,)
                    keep = _partial_suffix(self.buf, held)
                    content += self.buf[: len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep :]
                    break
                content += self.buf[:i]
                self.buf, self.state = self.buf[i + len(self.start) :], "think"
                continue
            # inside the block: up to the end tag; a start tag the model writes first is dropped
            j = self.buf.find(self.end)
            s = self.buf.find(self.start)
            if (
                0 <= s
                and (j < 0 or s < j)
                and not (reasoning or self.seen_text or self.buf[:s].strip())
            ):
                self.buf = self.buf[s + len(self.start) :]
                continue
            if j < 0:
                keep = _partial_suffix(self.buf, (self.end, self.start))
                reasoning += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep :]
                break
            reasoning += self.buf[:j]
            self.buf, self.state = self.buf[j + len(self.end) :], "after"
        self.seen_text = self.seen_text or bool(reasoning or content)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back: a partial tag is text of the part it was in."""
        rest, self.buf = self.buf, ""
        return (rest, "") if self.state == "think" else ("", rest)


def split_reasoning(
    text: str, parser: str, prompt_state: Optional[str] = None
) -> tuple[Optional[str], Optional[str]]:
    """(reasoning, content) of a finished output, None where empty. qwen3 as vLLM's: a
    `</think>` with no `<think>` before it ends a block the prompt opened."""
    sp = ReasoningSplitter(parser, prompt_state)
    sp.lookahead(text)
    r1, c1 = sp.feed(text)
    r2, c2 = sp.finish()
    return (r1 + r2) or None, (c1 + c2) or None


def reasoning_tokens(tokenizer, token_ids, parser: str, skip_special_tokens: bool = True) -> int:
    """How many of an output's tokens are inside its think block (the Responses API's
    `reasoning_tokens`): those before the end tag (all of them when the block never closed),
    less those through a start tag the output wrote itself. The tags' places are found in the
    token ids by decoding prefixes (a binary search: a tag may span several tokens)."""
    ids = list(token_ids)
    decode = lambda n: tokenizer.decode(ids[:n], skip_special_tokens=skip_special_tokens)  # noqa: E731
    text = decode(len(ids))

    def through(tag: str) -> int:  # the fewest tokens whose text holds tag
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if tag in decode(mid) else (mid + 1, hi)
        return lo

    start, end = tags(parser)
    e = text.find(end)
    stop = len(ids)
    if e >= 0:
        stop = through(end) - len(tokenizer.encode(end, add_special_tokens=False))
    s = text.find(start)
    begin = through(start) if 0 <= s and (e < 0 or s < e) else 0
    return max(0, stop - begin)
