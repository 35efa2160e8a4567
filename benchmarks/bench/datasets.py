"""Request sets for the serving and throughput benchmarks.

Every generator returns a list of `SampleRequest`. Prompts are either token ids (random and
shared-prefix datasets: exact lengths, no tokenizer needed, sent as `prompt: [ids]` to
/v1/completions) or text (ShareGPT, or any dataset sent to /v1/chat/completions).
Lengths recorded here are what we *asked* for; the benchmark reports what the server's `usage`
says it processed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# Token ids below this are left out of random prompts: most vocabularies keep their special
# and control tokens there (SmolLM2: 0..16, Llama-3: byte tokens; Llama-3 specials sit at the top,
# above 128000, which the default upper bound excludes).
DEFAULT_TOKEN_LOW = 1000
# Upper bound (exclusive) for random ids when the vocabulary size is unknown: under every vocabulary
# we serve (SmolLM2 49152, Llama-3 128256, Qwen 151936, Mistral 32768).
DEFAULT_VOCAB_SIZE = 32000

# Plain words used to make text prompts when no tokenizer is at hand (chat endpoint). Most are a
# single token with a leading space in BPE vocabularies, so N words are roughly N tokens.
_WORDS = (
    "the of and to in is was for on that with as by at from his her it an are were which "
    "be this has had not but its have they one their also new first two time after who "
    "year been more all other some would into most only over city used can may such "
    "where when these many there school state then about world both through between "
    "during under three people known part later work well while same long high water "
    "found since each house early small black white road river north south east west "
    "war game film music song book line side team club group power land light life "
    "name order place point form area party field board court story young great"
).split()


@dataclass
class SampleRequest:
    prompt: list[int] | str  # token ids, or text
    prompt_len: int  # exact for token ids; an estimate for text
    output_len: int  # max_tokens asked for (ignore_eos makes it exact)

    @property
    def is_tokens(self) -> bool:
        return isinstance(self.prompt, list)


def _lengths(rng: random.Random, n: int, mean: int, range_ratio: float) -> list[int]:
    """n lengths uniform in [mean*(1-r), mean*(1+r)], at least 1 (r = 0: all equal to mean)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, int(round(mean * (1 - range_ratio))))
    hi = max(lo, int(round(mean * (1 + range_ratio))))
    return [rng.randint(lo, hi) for _ in range(n)]


def _ids(rng: random.Random, n: int, low: int, high: int) -> list[int]:
    return [rng.randrange(low, high) for _ in range(n)]


def _check_vocab(vocab_size: int, token_low: int) -> int:
    low = min(token_low, vocab_size // 4)
    if vocab_size - low < 2:
        raise ValueError(f"vocab size {vocab_size} is too small for random prompts")
    return low


def random_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    token_low: int = DEFAULT_TOKEN_LOW,
    seed: int = 0,
) -> list[SampleRequest]:
    """Random token-id prompts of about `input_len` tokens asking for about `output_len`."""
    rng = random.Random(seed)
    low = _check_vocab(vocab_size, token_low)
    ins = _lengths(rng, num_prompts, input_len, range_ratio)
    outs = _lengths(rng, num_prompts, output_len, range_ratio)
    return [SampleRequest(_ids(rng, i, low, vocab_size), i, o) for i, o in zip(ins, outs)]


def shared_prefix_dataset(
    num_prompts: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    token_low: int = DEFAULT_TOKEN_LOW,
    seed: int = 0,
) -> list[SampleRequest]:
    """`num_prompts` requests spread round-robin over `num_prefixes` long common prefixes, each
    followed by its own random suffix (exercises prefix caching). Order is shuffled."""
    if num_prefixes < 1:
        raise ValueError("need at least one prefix")
    rng = random.Random(seed)
    low = _check_vocab(vocab_size, token_low)
    prefixes = [_ids(rng, prefix_len, low, vocab_size) for _ in range(num_prefixes)]
    reqs = []
    for i in range(num_prompts):
        ids = prefixes[i % num_prefixes] + _ids(rng, suffix_len, low, vocab_size)
        reqs.append(SampleRequest(ids, len(ids), output_len))
    rng.shuffle(reqs)
    return reqs


def words_text(rng: random.Random, n: int) -> str:
    """About n tokens of plain text (no tokenizer needed)."""
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n)))


def sharegpt_dataset(
    path: str | Path,
    num_prompts: int,
    output_len: int | None = None,
    tokenizer=None,
    seed: int = 0,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
) -> list[SampleRequest]:
    """First human turn as prompt, the reply's length as output length, from a ShareGPT-format
    JSON file: a list of {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}.
    Lengths use `tokenizer` (anything with .encode) when given, else about 4 characters a token.
    `output_len` fixes every request's output length instead."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ShareGPT file not found: {path}")
    data = json.loads(path.read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")

    def count(text: str) -> int:
        if tokenizer is not None:
            return len(tokenizer.encode(text))
        return max(1, len(text) // 4)

    rng = random.Random(seed)
    order = list(range(len(data)))
    rng.shuffle(order)
    reqs: list[SampleRequest] = []
    for i in order:
        if len(reqs) >= num_prompts:
            break
        conv = data[i].get("conversations") or data[i].get("conversation") or []
        if len(conv) < 2:
            continue
        prompt, reply = conv[0].get("value", ""), conv[1].get("value", "")
        if not prompt:
            continue
        p_len = count(prompt)
        o_len = output_len if output_len is not None else count(reply)
        if p_len < 4 or o_len < 4 or p_len > max_prompt_len or p_len + o_len > max_total_len:
            continue
        reqs.append(SampleRequest(prompt, p_len, o_len))
    if len(reqs) < num_prompts:
        raise ValueError(f"{path}: only {len(reqs)} usable conversations, asked for {num_prompts}")
    return reqs


def to_text(req: SampleRequest, tokenizer=None, seed: int = 0) -> SampleRequest:
    """A text version of a token-id request (for the chat endpoint): decoded with `tokenizer`
    when given, else about as many plain words as tokens."""
    if not req.is_tokens:
        return req
    if tokenizer is not None:
        text = tokenizer.decode(req.prompt)
    else:
        text = words_text(random.Random(hash((seed, tuple(req.prompt[:8])))), req.prompt_len)
    return SampleRequest(text, req.prompt_len, req.output_len)
