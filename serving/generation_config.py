"""`--generation-config auto|vllm|DIR` (vLLM's): the default sampling parameters a model's
`generation_config.json` recommends. `auto` (the default) reads the model directory's, `vllm`
none, DIR reads DIR/generation_config.json. A request's own values win over them; a model
without the file (the embedded GGUF one) changes nothing."""

from __future__ import annotations

import json
import logging
import os
from typing import Optional

log = logging.getLogger("serving")

# generation_config.json's name -> SamplingParams' (vLLM's list)
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def source(mode: str, model) -> Optional[str]:
    """The generation_config.json that `mode` takes defaults from, or None."""
    if mode == "vllm":
        return None
    folder = model if mode == "auto" else mode
    if not folder or not os.path.isdir(str(folder)):
        return None  # no model directory (the embedded model, a GGUF file)
    path = os.path.join(str(folder), "generation_config.json")
    return path if os.path.isfile(path) else None


def check_override(override: Optional[dict]) -> Optional[dict]:
    """--override-generation-config's object (vLLM's): generation_config.json's names and
    numbers. vLLM drops other keys unsaid; here they are an error naming them."""
    if not override:
        return None
    unknown = sorted(set(override) - set(FIELDS))
    if unknown:
        raise ValueError(
            f"override_generation_config: {unknown} are not default sampling parameters; "
            f"generation_config.json's names: {list(FIELDS)}"
        )
    for name, v in override.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"override_generation_config: {name} must be a number, got {v!r}")
    return override


def _fields(data) -> dict:
    out = {}
    for name, field in FIELDS.items():
        v = data.get(name) if isinstance(data, dict) else None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        out[field] = int(v) if field in ("top_k", "max_tokens") else float(v)
    if out.get("top_k") == 0:  # HF's "no top-k"
        out["top_k"] = -1
    return out


def defaults(mode: str, model, override: Optional[dict] = None) -> tuple[dict, Optional[str]]:
    """({SamplingParams field: value}, the file they came from). A file that does not parse is
    an error naming it; fields of the wrong type are left out. `override`
    (--override-generation-config, vLLM's) is merged over the file's fields, or taken alone
    (no file, or mode vllm), as vLLM merges it."""
    path = source(mode, model)
    data: dict = {}
    if path is not None:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"generation_config: cannot read {path}: {e}") from None
        if not isinstance(data, dict):
            data = {}
    return _fields({**data, **(override or {})}), path


def describe(values: dict, path: Optional[str], mode: str, override: Optional[dict] = None) -> str:
    """The start-up log's line on which defaults apply."""
    if values:
        flag = "--override-generation-config" if override else None
        where = " over ".join(x for x in (flag, path) if x)
        off = "; --generation-config vllm ignores the file's" if path else ""
        return (
            f"default sampling parameters from {where}: {values} (a request's own values win{off})"
        )
    if mode == "vllm":
        return "default sampling parameters: vLLM's (--generation-config vllm)"
    return "default sampling parameters: vLLM's (the model has no generation_config.json)"
