"""Tokenizer: HF `tokenizers` underneath, chat templates rendered as transformers renders them,
and incremental detokenization that is right for multi-byte UTF-8 and BPE merges across steps."""

from __future__ import annotations

import copy
import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled as the tokenizer renders it; ValueError naming the fault where
    Jinja cannot parse it (a server checks --chat-template with this before the model loads)."""
    try:
        return _compile_template(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat_template: not a valid Jinja template ({e})") from None


def _compile_template(source: str) -> jinja2.Template:
    # Same environment options as transformers' chat template renderer.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **kw: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# Variables the renderer sets itself (plus transformers' own arguments): a request's template
# variables may not name them. `tools` and `documents` are the renderer's too, set from the
# request's own fields.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "bos_token",
        "eos_token",
        "tools",
        "documents",
        "chat_template",
        "tokenize",
    }
)


def _cut_after_final_message(text: str, messages: list[dict]) -> str:
    """The rendered chat up to the end of the last message's content: the template's closing
    of that turn (an end-of-turn token, a newline) is dropped. Where the template stripped the
    content's outer whitespace, the cut is after the stripped content."""
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message: the final message has no text to continue")
    core = content.strip()
    at = text.rfind(core)
    if at < 0:
        raise ValueError(
            "continue_final_message: the chat template does not render the final message's "
            "text as written, so there is no place to continue it from"
        )
    tail = content.lstrip()  # with its trailing whitespace, where the template kept it
    return text[: at + (len(tail) if text.startswith(tail, at) else len(core))]


class Tokenizer:
    def __init__(
        self,
        tok: HFTokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        add_bos_token: bool = False,
        eos_token_ids: list[int] | None = None,
    ):
        self.tok = tok
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = tok.token_to_id(bos_token) if bos_token else None
        ids = list(eos_token_ids or [])
        if (
            eos_token
            and tok.token_to_id(eos_token) is not None
            and tok.token_to_id(eos_token) not in ids
        ):
            ids.insert(0, tok.token_to_id(eos_token))
        self.eos_token_ids = ids
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template else None
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = {
            tok.token_to_id(t.content) for t in tok.get_added_tokens_decoder().values() if t.special
        }

    def with_chat_template(self, template: str) -> "Tokenizer":
        """A copy rendering chats with `template` (a server's --chat-template) instead of the
        model's; a template Jinja cannot parse is a ValueError naming the fault."""
        other = copy.copy(self)
        other.chat_template, other._template = template, compile_chat_template(template)
        return other

    # The compiled chat template does not pickle: it is compiled again on the other side (an
    # engine in its own process sends its tokenizer to the server's process once, at start-up).
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_template"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._template = _compile_template(self.chat_template) if self.chat_template else None

    # -- encoding -------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        return self.tok.id_to_token(i)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs,
    ) -> str:
        """kwargs: more template variables (a model's switches, e.g. Qwen3's enable_thinking).
        continue_final_message: the text ends inside the last message, so the model goes on
        writing it (a prefilled answer) instead of starting a new turn."""
        if self._template is None:
            raise ValueError("this model has no chat template; use a completion prompt instead")
        taken = RESERVED_TEMPLATE_VARIABLES & kwargs.keys() - {"tools", "documents"}
        if taken:
            raise ValueError(f"template variables set by the engine: {sorted(taken)}")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        text = self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
        return _cut_after_final_message(text, messages) if continue_final_message else text

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs
    ) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        # The template already holds BOS where the model wants one (as transformers does).
        return self.encode(text, add_special_tokens=False)

    # -- loading --------------------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str | Path, eos_token_ids: list[int] | None = None) -> "Tokenizer":
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json (paxengine needs a fast tokenizer)")
        tok = HFTokenizer.from_file(str(tj))
        cfg = {}
        if (path / "tokenizer_config.json").is_file():
            cfg = json.loads((path / "tokenizer_config.json").read_text())

        def name(t):
            return t.get("content") if isinstance(t, dict) else t

        template = cfg.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(
            tok,
            bos_token=name(cfg.get("bos_token")),
            eos_token=name(cfg.get("eos_token")),
            chat_template=template,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            eos_token_ids=eos_token_ids,
        )

    @classmethod
    def from_gguf_fields(cls, fields: dict) -> "Tokenizer":
        """Build a byte-level BPE tokenizer from GGUF `tokenizer.ggml.*` metadata."""
        from tokenizers import AddedToken, decoders, models, pre_tokenizers

        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"unsupported GGUF tokenizer model {kind!r}: only byte-level BPE "
                f"('gpt2') is implemented"
            )
        tokens = fields["tokenizer.ggml.tokens"]
        types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = HFTokenizer(
            models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
        )
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        # Control (3) and user-defined (4) tokens are matched whole, before BPE.
        specials = [
            AddedToken(tokens[i], special=types[i] == 3, normalized=False)
            for i in range(len(tokens))
            if types[i] in (3, 4)
        ]
        tok.add_tokens(specials)

        def tid(key):
            v = fields.get(key)
            return tokens[v] if v is not None and 0 <= v < len(tokens) else None

        return cls(
            tok,
            bos_token=tid("tokenizer.ggml.bos_token_id"),
            eos_token=tid("tokenizer.ggml.eos_token_id"),
            chat_template=fields.get("tokenizer.chat_template"),
            add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        )


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window of recent tokens and emits only text that is complete: a window whose
    decoding ends in U+FFFD is an unfinished UTF-8 sequence and waits for the next token; BPE
    merges that change earlier characters are handled by decoding from `prefix` on each step.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids or [])[-6:]
        self.prefix = 0  # window start
        self.read = len(self.ids)  # tokens whose text was emitted
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self.tokenizer.decode(self.ids[self.prefix : self.read], self.skip)
        full_text = self.tokenizer.decode(self.ids[self.prefix :], self.skip)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self.prefix, self.read = self.read, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a sequence, emit whatever is left (even a lone replacement character)."""
        prefix_text = self.tokenizer.decode(self.ids[self.prefix : self.read], self.skip)
        full_text = self.tokenizer.decode(self.ids[self.prefix :], self.skip)
        delta = full_text[len(prefix_text) :]
        self.prefix = self.read = len(self.ids)
        self.text += delta
        return delta
