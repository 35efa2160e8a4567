"""A request's prompts as (text, token ids): a completion's prompt forms, a chat's messages
through the chat template (its options and variables), and truncate_prompt_tokens' cut. The
endpoints (openai_api.py, /tokenize in app.py) build their prompts here."""

from __future__ import annotations

from paxengine.errors import InvalidRequest
from paxengine.tokenizer import RESERVED_TEMPLATE_VARIABLES
from paxengine.validation import truncate_prompt
from serving import tools
from serving.errors import bad_request
from serving.generation import ServerState
from serving.protocol import CompletionRequest


def completion_prompts(state: ServerState, req: CompletionRequest) -> list[tuple[str, list[int]]]:
    """(prompt text, prompt token ids) for each prompt of a completion request."""
    p, tok = req.prompt, state.tokenizer
    if isinstance(p, str):
        items: list = [p]
    elif not p:
        raise bad_request("prompt is empty", "prompt")
    else:
        items = [p] if isinstance(p[0], int) else list(p)
    out = []
    for item in items:
        if isinstance(item, str):
            ids = list(tok.encode(item, add_special_tokens=req.add_special_tokens))
            out.append((item, ids))
        else:
            state.check_tokens(item)
            # the text only echo shows: decoding a long prompt is host time a burst queues behind
            out.append((tok.decode(list(item)) if req.echo else "", list(item)))
    return out


def truncated(state: ServerState, req, prompts: list[tuple[str, list[int]]]):
    """The prompts as `truncate_prompt_tokens` keeps them (the engine's rule); a cut prompt's
    text is what its kept tokens say (echo shows it)."""
    if req.truncate_prompt_tokens is None:
        return prompts
    out = []
    for text, ids in prompts:
        try:
            cut_text, cut = truncate_prompt(
                text, ids, req.truncate_prompt_tokens, state.max_model_len
            )
        except InvalidRequest as e:
            raise state.api_error(e) from None
        if cut_text is None:
            cut_text = state.tokenizer.decode(cut) if getattr(req, "echo", False) else ""
        out.append((cut_text, cut))
    return out


def _reasoning(m) -> dict:
    """An assistant's earlier reasoning (`reasoning`, or the deprecated `reasoning_content`)
    under both names: templates read `reasoning_content` (Qwen3's), vLLM 0.26 `reasoning`."""
    text = m.reasoning if m.reasoning is not None else m.reasoning_content
    return {} if text is None else {"reasoning": text, "reasoning_content": text}


def _tokenizer(state: ServerState, req):
    """The tokenizer rendering this chat: with the request's own `chat_template` (vLLM's, only
    under --trust-request-chat-template), else the server's (--chat-template's or the model's)."""
    template = getattr(req, "chat_template", None)
    if template is None:
        return state.tokenizer
    if not state.config.trust_request_chat_template:
        raise bad_request(
            "chat_template: a request's own chat template is refused unless the server runs "
            "with --trust-request-chat-template (vLLM's rule)",
            "chat_template",
        )
    try:
        return state.request_templated(template)
    except ValueError as e:
        raise bad_request(str(e), "chat_template") from None


def _shown_tools(state: ServerState, req, tool_defs, template):
    """The tools the chat template gets: the call's (tool_defs); with tool_choice "none" the
    request's, where the template renders tools (vLLM's default: the model still sees them, its
    calls stay text), none under --exclude-tools-when-tool-choice-none or for a template that
    does not render them (no Hermes system prompt for calls that will not be parsed)."""
    if tool_defs is not None or getattr(req, "tool_choice", None) != "none":
        return tool_defs
    if not getattr(req, "tools", None) or state.config.exclude_tools_when_tool_choice_none:
        return None
    if not tools.template_renders_tools(template):
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def chat_prompt(state: ServerState, req, tool_defs=None) -> tuple[str, list[int]]:
    """req: a chat completion or a tokenize request (its messages and template options);
    tool_defs: the tools to show the model (OpenAI dicts), or None."""
    # `name` goes to the template as vLLM passes it (templates that know it use it)
    msgs = [
        {
            "role": "system" if m.role == "developer" else m.role,
            "content": m.text(),
            **({"name": m.name} if m.name is not None else {}),
            **({"tool_calls": [c.model_dump() for c in m.tool_calls]} if m.tool_calls else {}),
            **({"tool_call_id": m.tool_call_id} if m.tool_call_id is not None else {}),
            **_reasoning(m),
        }
        for m in req.messages
    ]
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request(
            "continue_final_message: set add_generation_prompt to false with it (the answer "
            "goes on inside the last message, not in a new turn)",
            "continue_final_message",
        )
    # the server's defaults (--default-chat-template-kwargs), the request's on top, as vLLM merges
    variables = {
        **(state.config.default_chat_template_kwargs or {}),
        **(req.chat_template_kwargs or {}),
    }
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None:  # vLLM passes it to the template; the kwargs win
        variables = {"reasoning_effort": effort, **variables}
    taken = sorted(RESERVED_TEMPLATE_VARIABLES & variables.keys())
    if taken:
        raise bad_request(
            f"chat_template_kwargs: {', '.join(taken)} are set by the server, not the request",
            "chat_template_kwargs",
        )
    tok = _tokenizer(state, req)
    tool_defs = _shown_tools(state, req, tool_defs, getattr(tok, "chat_template", None))
    options = {"continue_final_message": True} if req.continue_final_message else {}
    if req.documents is not None:  # the template's `documents`, as vLLM passes them
        options["documents"] = req.documents
    try:
        msgs, extra = tools.template_inputs(msgs, tool_defs, getattr(tok, "chat_template", None))
        text = tok.apply_chat_template(
            msgs, add_generation_prompt=req.add_generation_prompt, **options, **variables, **extra
        )
    except Exception as e:  # template errors (role order, ...) are the client's
        raise bad_request(f"messages: the chat template rejected them: {e}", "messages") from None
    # the template holds the special tokens the model wants; a request may ask for the
    # tokenizer's on top (vLLM's add_special_tokens, off by default for chat)
    special = bool(req.add_special_tokens)
    return text, list(tok.encode(text, add_special_tokens=special))
