"""What a chat or completion request asks its output to follow: a structured-output constraint
(OpenAI's `response_format`, vLLM's `structured_outputs` or legacy `guided_*`) and the tool-call
mode (`tools` / `tool_choice`). Bad combinations are 400s naming the field, before any engine
work."""

from __future__ import annotations

from typing import Optional

from paxengine.errors import InvalidRequest
from paxengine.structured import StructuredOutputs
from serving.errors import bad_request

GUIDED = ("json", "regex", "choice", "grammar")
TAG_FIELDS = ("structures", "triggers", "format")  # a structural_tag response_format's


def constraint(req) -> Optional[StructuredOutputs]:
    """The request's structured-output constraint: OpenAI's response_format, vLLM's
    structured_outputs or its legacy guided_* fields (at most one of them)."""
    found = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", StructuredOutputs(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request(
                "response_format: type json_schema needs json_schema.schema", "response_format"
            )
        found.append(("response_format", StructuredOutputs(json=rf.json_schema.schema_)))
    elif rf is not None and rf.type == "structural_tag":
        tag = {k: getattr(rf, k) for k in TAG_FIELDS if getattr(rf, k) is not None}
        found.append(("response_format", StructuredOutputs(structural_tag=tag)))
        if rf.json_schema is not None:
            raise bad_request(
                "response_format.json_schema: not with type structural_tag",
                "response_format.json_schema",
            )
    for k in TAG_FIELDS if rf is not None and rf.type != "structural_tag" else ():
        if getattr(rf, k) is not None:
            raise bad_request(
                f"response_format.{k}: only with type structural_tag", f"response_format.{k}"
            )
    so = req.structured_outputs
    if so is not None:
        found.append(
            (
                "structured_outputs",
                StructuredOutputs(
                    json=so.json_,
                    json_object=bool(so.json_object),
                    regex=so.regex,
                    choice=so.choice,
                    grammar=so.grammar,
                    structural_tag=so.structural_tag,
                ),
            )
        )
    for name in GUIDED:  # vLLM's legacy guided_* fields
        value = getattr(req, f"guided_{name}")
        if value is not None:
            found.append((f"guided_{name}", StructuredOutputs(**{name: value})))
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise bad_request(f"{names}: give at most one output constraint", found[1][0])
    if not found:
        return None
    name, spec = found[0]
    try:
        spec.key()  # exactly one constraint of the right type, before any engine work
    except InvalidRequest as e:
        if (e.param or "").startswith("structural_tag"):
            raise bad_request(*_tag_named(str(e), e.param, name)) from None
        raise bad_request(f"{name}: {e}", name) from None
    return spec


def _tag_named(message: str, param: str, field: str) -> tuple[str, str]:
    """A structural tag's error (param structural_tag[.path]) named as the request wrote it:
    response_format holds the tag's fields (response_format.structures.0.schema), the text of
    structured_outputs.structural_tag the whole tag."""
    where = "response_format" if field == "response_format" else f"{field}.structural_tag"
    named = where + param[len("structural_tag") :]
    return named + message[len(param) :], named


# the params of a constraint's compile error (paxengine/structured.GrammarCompiler): its kind's
_COMPILED = {
    "json_schema": "json",
    "response_format": "json_object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "structured_outputs": None,
}


def named(req, e: InvalidRequest, forced: bool = False) -> InvalidRequest:
    """An engine's InvalidRequest about the request's constraint (the grammar compiles in
    engine.validate) named by the request's field: a structural tag's path in it, the schema of
    response_format, structured_outputs' kind, a guided_* field, or `tools` for a forced call's
    grammar (forced); an error about another field (the prompt) as it is."""
    field, param = "tools" if forced else constraint_field(req), e.param or ""
    if field is None:
        return e
    if param.startswith("structural_tag"):
        return InvalidRequest(*_tag_named(str(e), param, field), code=e.code)
    if param not in _COMPILED:
        return e
    kind, where = _COMPILED[param], field
    if field == "response_format" and kind == "json":
        where = "response_format.json_schema.schema"
    elif field == "structured_outputs" and kind is not None:
        where = f"structured_outputs.{kind}"
    message = str(e)
    rest = message[len(param) :] if message.startswith(param) else f": {message}"
    return InvalidRequest(where + rest, param=where, code=e.code)


def constraint_field(req) -> Optional[str]:
    """The name of the request's output-constraint field (constraint), for its errors."""
    for name in ("response_format", "structured_outputs", *(f"guided_{n}" for n in GUIDED)):
        value = getattr(req, name)
        if value is not None and not (name == "response_format" and value.type == "text"):
            return name
    return None


def tool_mode(req, auto_enabled: bool = True) -> Optional[str]:
    """None (plain text), "auto", "required", or the name of the function to call. With tools,
    no tool_choice means "auto" (vLLM's), which needs the server's --enable-auto-tool-choice
    (auto_enabled) as in vLLM."""
    choice = req.tool_choice
    if not req.tools:
        if choice in (None, "none", "auto"):
            return None
        raise bad_request("tool_choice: requires tools", "tool_choice")
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", "tools")
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        if not auto_enabled:
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                'to be set (or send tool_choice "none", "required" or a function)',
                "tool_choice",
            )
        return "auto"
    if choice == "required":
        return "required"
    if choice.function.name not in names:
        raise bad_request(
            f"tool_choice: no tool named {choice.function.name!r} in tools", "tool_choice"
        )
    return choice.function.name
