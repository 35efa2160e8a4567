"""The OpenAI responses' logprobs: the engine's per-token Logprob dicts as `completions`'
(tokens, token_logprobs, top_logprobs, text_offset) and `chat.completions`' (content entries
with their top_logprobs and UTF-8 bytes)."""

from __future__ import annotations

from typing import Optional

from paxengine.outputs import Logprob
from serving.generation import ServerState
from serving.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    TopLogprob,
)


def _lp(v: Logprob) -> tuple[float, int, Optional[str]]:
    return float(v.logprob), int(v.rank), v.decoded_token


def _tok_str(state: ServerState, tid: int, decoded: Optional[str], as_ids: bool = False) -> str:
    if as_ids:  # vLLM's return_tokens_as_token_ids: a token whatever its text (no lossy decode)
        return f"token_id:{tid}"
    return decoded if decoded is not None else state.tokenizer.decode([tid])


def _token_entries(state, o, start: int, k: int, as_ids: bool):
    """For generated tokens start..: (sampled token str, its logprob, [(str, logprob)] of the top k).
    as_ids: each token as "token_id:<id>" instead of its text."""
    out = []
    lps = o.logprobs or []
    for j in range(start, min(len(o.token_ids), len(lps))):
        tid, d = o.token_ids[j], lps[j] or {}
        entries = [(t, *_lp(v)) for t, v in d.items()]
        ranked = sorted((e for e in entries if e[2] >= 1), key=lambda e: e[2]) or sorted(
            entries, key=lambda e: -e[1]
        )
        s = next((e for e in entries if e[0] == tid), None)
        lp = s[1] if s else float("-inf")
        tstr = _tok_str(state, tid, s[3] if s else None, as_ids)
        tops = [(_tok_str(state, t, dec, as_ids), l) for t, l, _, dec in ranked[:k]]
        out.append((tstr, lp, tops))
    return out


def prompt_logprobs(entries: Optional[list]) -> Optional[list]:
    """The engine's prompt logprobs (RequestOutput.prompt_logprobs) in vLLM's wire shape."""
    if entries is None:
        return None
    return [
        None if d is None else {t: PromptLogprob(**vars(v)) for t, v in d.items()} for d in entries
    ]


def completion_logprobs(
    state, o, start: int, k: int, offset: int, prompt=None, as_ids: bool = False, plp=None
) -> CompletionLogprobs:
    """prompt: echo's prompt token ids, first; plp: their logprobs (the engine's prompt
    logprobs: None for the first token, as OpenAI's echo has it)."""
    res = CompletionLogprobs()
    if prompt is not None:
        for i, tid in enumerate(prompt):
            d = plp[i] if plp is not None and i < len(plp) else None
            t = _tok_str(state, tid, d[tid].decoded_token if d and tid in d else None, as_ids)
            lp, top = None, None
            if d:
                own = d.get(tid)
                lp = float(own.logprob) if own is not None else None
                ranked = sorted(d.items(), key=lambda e: e[1].rank)
                top = {
                    _tok_str(state, x, v.decoded_token, as_ids): float(v.logprob)
                    for x, v in ranked
                    if v.rank <= k
                }
                top.setdefault(t, lp)
            res.tokens.append(t), res.token_logprobs.append(lp), res.top_logprobs.append(top)
            res.text_offset.append(offset)
            offset += len(t)
    for tstr, lp, tops in _token_entries(state, o, start, k, as_ids):
        top = dict(tops)
        top.setdefault(tstr, lp)
        res.tokens.append(tstr), res.token_logprobs.append(lp), res.top_logprobs.append(top)
        res.text_offset.append(offset)
        offset += len(tstr)
    return res


def chat_logprobs(state, o, start: int, k: int, as_ids: bool = False) -> ChatLogprobs:
    content = []
    for tstr, lp, tops in _token_entries(state, o, start, k, as_ids):
        content.append(
            ChatTokenLogprob(
                token=tstr,
                logprob=lp,
                bytes=list(tstr.encode("utf-8", "replace")),
                top_logprobs=[
                    TopLogprob(token=t, logprob=l, bytes=list(t.encode("utf-8", "replace")))
                    for t, l in tops[:k]
                ],
            )
        )
    return ChatLogprobs(content=content)
