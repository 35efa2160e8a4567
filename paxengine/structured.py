"""Structured output: JSON schemas, regexes, choices, Lark grammars and structural tags enforced
token by token.

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
    strings, a `grammar` (Lark as llguidance takes it, or llama.cpp's GBNF, which llguidance
    converts), or a `structural_tag` (a dict or its JSON text: free text in which each trigger
    starts one of its structures, see `structural_tag`). Exactly one is set."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None

    def kind(self) -> str:
        set_ = [
            name
            for name in ("json", "regex", "choice", "grammar", "structural_tag")
            if getattr(self, name) is not None
        ]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise InvalidRequest(
                "structured_outputs: exactly one of json, json_object, regex, choice, grammar, "
                f"structural_tag must be given, got {set_ or 'none'}",
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
                except (ValueError, RecursionError) as e:  # nested past Python's parser
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
        if kind == "structural_tag":
            return kind, json.dumps(structural_tag(value))
        if not isinstance(value, str) or not value:
            raise InvalidRequest(f"structured_outputs.{kind}: a non-empty string", param=kind)
        return kind, value


def _tag_error(path: str, what: str) -> InvalidRequest:
    name = "structural_tag" + (f".{path}" if path else "")
    return InvalidRequest(f"{name}: {what}", param=name)


def _keys(obj, path: str, allowed: tuple[str, ...]) -> dict:
    where = path or "a structural tag"
    if not isinstance(obj, dict):
        raise _tag_error(path, "must be a JSON object")
    for k in obj:
        if k not in allowed:
            raise _tag_error(f"{path}.{k}" if path else k, f"not a field of {where}")
    return obj


_FALSE_KEYS = ("at_least_one", "stop_after_first", "excludes")  # triggered_tags' we take unset


def structural_tag(value) -> dict:
    """A structural tag (a dict or its JSON text) checked and in one shape: {"triggers": [...],
    "structures": [{"begin", "schema", "end", "trigger", "at"}]} (`trigger`: the structure's;
    `at`: where its schema was, for a compile error's name). The model writes free text; where
    the text reaches a trigger, what follows is one of the structures whose begin starts with it
    (the begin string, JSON the schema accepts, the end string), then free text again.

    vLLM's two forms (its response_format, or the JSON text of structured_outputs.structural_tag):
    - {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}: the original one,
      the one vLLM's llguidance backend takes;
    - xgrammar's {"format": {"type": "triggered_tags", "triggers": [...], "tags": [{"type": "tag",
      "begin", "content": {"type": "json_schema", "json_schema": {...}}, "end"}, ...]}}: as far as
      it says the same (llguidance's structural tags are the first form). Its other formats
      (sequence, or, const_string, ...), other contents (regex, xgrammar's EBNF, XML styles), a
      list of ends, at_least_one, stop_after_first and excludes are refused naming the field.
    A structure belongs to the first trigger its begin starts with (vLLM's rule); a structure that
    starts with none, or a trigger that starts no structure, is refused."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:  # nested past Python's parser
            raise _tag_error("", f"not valid JSON: {e}") from None
    _keys(value, "", ("type", "structures", "triggers", "format"))
    if value.get("type", "structural_tag") != "structural_tag":
        raise _tag_error("type", 'must be "structural_tag"')
    items = []  # (path of the structure, begin, schema, end, path of the schema)
    if "format" in value:
        if "structures" in value or "triggers" in value:
            raise _tag_error("format", "give either format or structures and triggers")
        fmt = value["format"]
        if not isinstance(fmt, dict):
            raise _tag_error("format", "must be a JSON object")
        if fmt.get("type") != "triggered_tags":
            raise _tag_error(
                "format.type",
                f"{fmt.get('type')!r} is not supported: llguidance's structural tags are "
                "triggered_tags (or structures and triggers)",
            )
        _keys(fmt, "format", ("type", "triggers", "tags") + _FALSE_KEYS)
        for name in _FALSE_KEYS[:2]:
            if fmt.get(name, False) is not False:
                raise _tag_error(f"format.{name}", "only false (llguidance's structural tags)")
        if fmt.get("excludes", []) != []:
            raise _tag_error("format.excludes", "not supported (llguidance's structural tags)")
        triggers, tags = fmt.get("triggers"), fmt.get("tags")
        tpath, spath = "format.triggers", "format.tags"
        if not isinstance(tags, list) or not tags:
            raise _tag_error(spath, "a non-empty list of tags")
        for i, t in enumerate(tags):
            at = f"{spath}.{i}"
            _keys(t, at, ("type", "begin", "content", "end"))
            if t.get("type", "tag") != "tag":
                raise _tag_error(f"{at}.type", 'only "tag"')
            c = t.get("content")
            if not isinstance(c, dict) or c.get("type") != "json_schema":
                raise _tag_error(
                    f"{at}.content.type",
                    f"{c.get('type') if isinstance(c, dict) else c!r} is not supported: only "
                    "json_schema",
                )
            _keys(c, f"{at}.content", ("type", "json_schema", "style"))
            if c.get("style", "json") != "json":
                raise _tag_error(f"{at}.content.style", 'only "json"')
            schema = {} if c.get("json_schema") is True else c.get("json_schema")
            items.append((at, t.get("begin"), schema, t.get("end"), f"{at}.content.json_schema"))
    else:
        triggers, structures = value.get("triggers"), value.get("structures")
        tpath, spath = "triggers", "structures"
        if not isinstance(structures, list) or not structures:
            raise _tag_error(spath, "a non-empty list of structures (begin, schema, end)")
        for i, st in enumerate(structures):
            at = f"{spath}.{i}"
            _keys(st, at, ("begin", "schema", "end"))
            items.append((at, st.get("begin"), st.get("schema"), st.get("end"), f"{at}.schema"))
    if not isinstance(triggers, list) or not triggers:
        raise _tag_error(tpath, "a non-empty list of non-empty strings")
    for i, t in enumerate(triggers):
        if not isinstance(t, str) or not t:
            raise _tag_error(f"{tpath}.{i}", "a non-empty string")
    out = []
    for at, begin, schema, end, schema_at in items:
        if not isinstance(begin, str) or not begin:
            raise _tag_error(f"{at}.begin", "a non-empty string, starting with a trigger")
        if not isinstance(end, str):
            raise _tag_error(f"{at}.end", "a string (may be empty)")
        if not isinstance(schema, dict):
            raise _tag_error(schema_at, "a JSON schema (an object) is required")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise _tag_error(f"{at}.begin", f"{begin!r} starts with none of the triggers")
        out.append(dict(begin=begin, schema=schema, end=end, trigger=trigger, at=schema_at))
    for i, t in enumerate(triggers):
        if not any(s["trigger"] == t for s in out):
            raise _tag_error(f"{tpath}.{i}", f"no structure's begin starts with {t!r}")
    return {"triggers": triggers, "structures": out}


def _is_special_token(llt, text: str) -> bool:
    if llt is None:
        return False
    ids = llt.tokenize_str(text, parse_special=True)
    return len(ids) == 1 and llt.is_special_token(ids[0])


def _structural_tag_grammar(tag: dict, llt) -> str:
    """llguidance's grammar of a checked structural tag (`structural_tag`): StructTag's, with
    each schema compiled as json_schema's are (compact separators, unknown keywords refused). A
    trigger written <...> that is one special token of the tokenizer matches that token (Llama's
    <|python_tag|>); otherwise every trigger is matched as text."""
    import llguidance as llg

    tags = []
    for s in tag["structures"]:
        schema = dict(s["schema"])
        try:
            schema["x-guidance"] = {**(schema.get("x-guidance") or {}), **_JSON_OPTIONS}
            err = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_json_schema(schema))
        except (ValueError, TypeError) as e:
            err = str(e)
        if err:
            raise _tag_error(s["at"], f"invalid JSON schema: {err.strip()}")
        tags.append(
            llg.StructTag(trigger=s["trigger"], begin=s["begin"], grammar=schema, end=s["end"])
        )
    special = {
        t: _is_special_token(llt, t)
        for t in tag["triggers"]
        if t.startswith("<") and t.endswith(">")
    }
    if len(set(special.values())) > 1:
        raise _tag_error(
            "triggers",
            f"special tokens {[t for t, v in special.items() if v]} cannot be mixed with <...> "
            f"text triggers {[t for t, v in special.items() if not v]}",
        )
    return llg.StructTag.to_grammar(tags, assume_special=any(special.values()))


def grammar_text(kind: str, text: str, tokenizer=None) -> str:
    """llguidance's grammar for a constraint (not yet checked: compiling does that).
    `tokenizer`: llguidance's, which tells a structural tag's special-token triggers."""
    import llguidance as llg

    if kind == "structural_tag":
        return _structural_tag_grammar(json.loads(text), tokenizer)
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
            text = grammar_text(*key, tokenizer=llt)
        except InvalidRequest:
            raise
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
        "structural_tag": "structural tag",
    }[kind]


def allowed_tokens(mask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """Bool [V] of a bitmask row (for tests and debugging)."""
    bits = (mask_row.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return bits.reshape(-1)[:vocab_size].astype(bool)
