"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}.

Every failure path of the app ends here: our own `ApiError`, FastAPI's validation errors (422
becomes 400), Starlette's HTTP errors (404/405 for unknown routes) and anything unexpected (500,
logged; the engine keeps running).
"""

from __future__ import annotations

import json
import logging
from typing import Optional, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.protocol import UNIMPLEMENTED_FIELDS, ErrorInfo, ErrorResponse

log = logging.getLogger("serving")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}

M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: Optional[str] = None,
        code: Optional[str] = None,
        type: Optional[str] = None,
        headers: Optional[dict] = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code if code is not None else status
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        ).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: Optional[str] = None) -> ApiError:
    return ApiError(400, message, param=param)


def renamed(e: ApiError, names: dict[str, str]) -> ApiError:
    """`e` naming its field by `names` (a param, or the start of a param's path, -> the name the
    client's request gives it); the message's leading name too."""
    for old, new in names.items():
        if e.param is not None and (e.param == old or e.param.startswith(old + ".")):
            param = new + e.param[len(old) :]
            message = e.message
            if message.startswith(e.param):
                message = param + message[len(e.param) :]
            return ApiError(
                e.status, message, param=param, code=e.code, type=e.type, headers=e.headers
            )
    return e


_BRANCHES = ("str", "int", "float", "bool", "list", "dict", "function-after", "[key]")


def _branch(p) -> bool:
    """Whether a location part looks like pydantic's name of a union branch."""
    return isinstance(p, str) and ("[" in p or p in _BRANCHES)


def _path(loc, body=None) -> list[str]:
    """A pydantic error's location as the request's field path, without pydantic's names of
    union branches ("str", "list[int]", a model's class name, a tagged union's tag). With the
    request's JSON `body`, a name is a field where the body has it (the last part: also a
    missing field of an object); without (FastAPI's errors), by its look, and FastAPI's "body"
    prefix goes."""
    parts, at = [], body
    for i, p in enumerate(loc):
        if body is None:
            if p != "body" and not _branch(p):
                parts.append(str(p))
            continue
        if isinstance(p, int):
            at = at[p] if isinstance(at, list) and -len(at) <= p < len(at) else None
        elif isinstance(at, dict) and p in at:
            at = at[p]
        elif not (isinstance(at, dict) and i == len(loc) - 1 and not _branch(p)):
            continue  # a union branch's name
        parts.append(str(p))
    return parts


def _loc(loc, body=None) -> Optional[str]:
    return ".".join(_path(loc, body)) or None


def _not_supported(name: str) -> str:
    if name.rsplit(".", 1)[-1] in UNIMPLEMENTED_FIELDS:
        return f"`{name}` is not supported by this server yet"
    return f"`{name}` is not supported by this server (unknown field)"


def _field(loc, body=None) -> str:
    """An unknown field's path: its own name (the last part) kept whatever it is ("", "str",
    "a[0]"), which `_path` without the body would take for a union branch's name."""
    if body is not None:
        return ".".join(_path(loc, body))
    head, name = _loc(loc[:-1]), str(loc[-1]) if loc else ""
    return f"{head}.{name}" if head else name


def validation_error(errors: list[dict], body=None) -> ApiError:
    """pydantic's errors as one 400 naming the field; `body`: the request's JSON object, which
    tells the fields from pydantic's names of union branches in the errors' locations."""
    # A field we do not implement comes first: the client is counting on what it asks for.
    extra = [_field(e["loc"], body) for e in errors if e.get("type") == "extra_forbidden"]
    if extra:
        return bad_request("; ".join(_not_supported(n) for n in extra), extra[0])
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = _loc(first.get("loc", ()), body)
    top = param.split(".")[0] if param else None
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first.get('msg')}")
    if top == "prompt":
        msg = (
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists"
        )
    elif top == "stop":
        msg = "stop must be a string or a list of strings"
    elif top == "messages" and param.endswith(".content"):
        msg = f'{param} must be a string or a list of {{"type": "text", "text": ...}} parts'
    else:
        msg = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
    return bad_request(msg, param)


async def parse_body(request: Request, model: type[M], max_bytes: int) -> M:
    """Read and validate a JSON body; every failure is a shaped 400, a body over `max_bytes` a
    413 (read no further than that: a huge upload cannot grow the server's memory)."""
    text, data = await read_json_object(request, max_bytes)
    return validate_body(model, text, data)


def validate_body(model: type[M], text: str, data: Optional[dict] = None) -> M:
    """`text` as a `model`; data: its JSON object (read_json_object's), for the errors' params."""
    try:
        return model.model_validate_json(text)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False), data) from None


async def read_json_object(request: Request, max_bytes: int) -> tuple[str, dict]:
    """A body's text and its JSON object (parse_body's reading, for a route that looks at the
    object before choosing its model: /invocations)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("request body is not valid UTF-8") from None
    if not text.strip():
        raise bad_request("request body is empty; expected a JSON object")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    except RecursionError:  # Python's parser recurses per nesting level
        raise bad_request("request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, got {type(data).__name__}")
    return text, data


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"request body is larger than {max_bytes} bytes", code="request_too_large")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return ApiError(
            exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)
        ).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return internal_error(exc, request).response()


def internal_error(exc: BaseException, request: Request | None = None) -> ApiError:
    """A bug's 500: the details (message, stack) go to the log under the request's X-Request-Id;
    the body names only that id (an exception's text can hold paths and internals)."""
    rid = getattr(request.state, "request_id", None) if request is not None else None
    where = f"{request.method} {request.url.path}" if request is not None else "a stream"
    log.error("unhandled error in %s (x-request-id %s)", where, rid, exc_info=exc)
    return ApiError(500, f"internal server error (x-request-id {rid}); see the server log")
