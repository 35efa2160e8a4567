"""Structured output: JSON schemas, regexes, choices and Lark grammars enforced token by token.

The backend is llguidance (a Rust library with a numpy bitmask API and no heavy dependencies). A
request's constraint (`StructuredOutputs`, in its SamplingParams) compiles once per distinct text
into a matcher, off the step loop: on the validating thread (the server validates in a worker
thread), cached by text. Each sequence then owns a copy (`GrammarState`, on its Request), which
the scheduler advances exactly once per accepted token (`Scheduler._append`). Before a step, the
host writes each constrained row's allowed tokens into a fixed-shape `[S, ceil(V/32)]` int32
bitmask (bit `t % 32` of word `t // 32` set = token t allowed); the sampler applies it on the
device before anything else (`sampling.apply_token_mask`).

EOS is allowed only where the grammar can end (llguidance puts the EOS ids in the mask then), and
a grammar that is complete ends its request with finish_reason "stop".
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from paxengine.errors import InvalidRequest

# Compact JSON with fixed separators: with free whitespace a small model can spend its whole
# max_tokens on newlines inside a valid prefix. Unknown schema keywords are errors (a 400), not
# silently dropped constraints.
_JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}
_CACHE_SIZE = 256


@dataclass(frozen=True)
class StructuredOutputs:
    """One constraint on a request's output (vLLM's `structured_outputs` fields): a JSON schema
    (`json`, a dict or its text), `json_object` (any JSON object), a `regex`, a `choice` of
    strings, or a `grammar` (Lark as llguidance takes it, or llama.cpp's GBNF, which llguidance
    converts). Exactly one is set."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def kind(self) -> str:
        set_ = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise InvalidRequest(
                "structured_outputs: exactly one of json, json_object, regex, choice, grammar "
                f"must be given, got {set_ or 'none'}",
                param="structured_outputs",
            )
        return set_[0]

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): the compile cache's key."""
        kind = self.kind()
        if kind == "json_object":
            return kind, ""
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise InvalidRequest(
                        f"structured_outputs.json: not valid JSON: {e}", param="json_schema"
                    ) from None
            if not isinstance(value, (dict, bool)):
                raise InvalidRequest(
                    "structured_outputs.json: a JSON schema is an object", param="json_schema"
                )
            return kind, json.dumps(value)  # key order kept: properties come in schema order
        if kind == "choice":
            if not value or not all(isinstance(c, str) and c for c in value):
                raise InvalidRequest(
                    "structured_outputs.choice: a non-empty list of non-empty strings",
                    param="choice",
                )
            return kind, json.dumps(list(value))
        if not isinstance(value, str) or not value:
            raise InvalidRequest(f"structured_outputs.{kind}: a non-empty string", param=kind)
        return kind, value


def grammar_text(kind: str, text: str) -> str:
    """llguidance's grammar for a constraint (not yet checked: compiling does that)."""
    import llguidance as llg

    if kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(json.loads(text), overrides=_JSON_OPTIONS)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        lark = "start: " + " | ".join(json.dumps(c) for c in json.loads(text))
        return llg.LLMatcher.grammar_from_lark(lark)
    return llg.grammar_from("grammar", text)  # "grammar": Lark, or GBNF (converted to Lark)


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher):
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the mask should
        have made that impossible)."""
        return self.matcher.consume_token(token)

    @property
    def is_complete(self) -> bool:
        """Nothing more can follow (only EOS): the request ends here with "stop"."""
        return self.matcher.is_stopped()

    @property
    def is_error(self) -> bool:
        return self.matcher.is_error()


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary, caching matchers by their text;
    safe to call from several threads (the server validates off the event loop)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self._hf = tokenizer  # paxengine.tokenizer.Tokenizer (HF `tokenizers` underneath)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.mask_words = -(-vocab_size // 32)
        self._lock = threading.Lock()
        self._llt = None
        self._executor = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.compile_seconds: dict[tuple[str, str], float] = {}  # for benchmarks

    def _tokenizer(self):
        """llguidance's view of the tokenizer (~0.3 s to build on a 49k vocabulary): once, on the
        first constrained request."""
        import llguidance as llg

        with self._lock:
            if self._llt is None:
                if self._hf is None:
                    raise InvalidRequest(
                        "structured output needs the model's tokenizer, and this model has none",
                        param="structured_outputs",
                    )
                self._llt = llg.LLTokenizer(
                    self._hf.tok.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
                self._executor = llg.LLExecutor()
            return self._llt

    def compile(self, spec: StructuredOutputs):
        """The cached (never advanced) matcher of a constraint; InvalidRequest naming the problem
        if it does not compile."""
        import time

        import llguidance as llg

        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        llt = self._tokenizer()
        t0 = time.perf_counter()
        try:
            text = grammar_text(*key)
        except (ValueError, TypeError) as e:
            raise InvalidRequest(f"{_param(key[0])}: {e}", param=_param(key[0])) from None
        matcher = llg.LLMatcher(llt, text, log_level=0)  # drops the GIL while it compiles
        if matcher.is_error():
            raise InvalidRequest(
                f"{_param(key[0])}: invalid {_what(key[0])}: {matcher.get_error().strip()}",
                param=_param(key[0]),
            )
        with self._lock:
            self.compile_seconds[key] = time.perf_counter() - t0
            self._cache[key] = matcher
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def new_state(self, spec: StructuredOutputs) -> GrammarState:
        return GrammarState(self.compile(spec).deep_copy())

    def fill_masks(self, rows: list[tuple[GrammarState, int]], mask: np.ndarray) -> None:
        """Write each (state, row)'s allowed tokens into mask[row] (the other rows are left as
        they are), in parallel on llguidance's threads."""
        if not rows:
            return
        from llguidance.numpy import fill_next_token_bitmask_par

        self._tokenizer()
        fill_next_token_bitmask_par(self._executor, [(s.matcher, i) for s, i in rows], mask)


def _param(kind: str) -> str:
    return {"json": "json_schema", "json_object": "response_format"}.get(kind, kind)


def _what(kind: str) -> str:
    return {
        "json": "JSON schema",
        "json_object": "JSON object grammar",
        "regex": "regex",
        "choice": "choice",
        "grammar": "Lark grammar",
    }[kind]


def allowed_tokens(mask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """Bool [V] of a bitmask row (for tests and debugging)."""
    bits = (mask_row.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return bits.reshape(-1)[:vocab_size].astype(bool)
