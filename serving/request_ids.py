"""X-Request-Id: every response carries one, the client's own when it sent a usable one (so a
request can be followed through a proxy, this server's log and the client's), else a fresh one.
The handlers find it in `request.state.request_id`."""

from __future__ import annotations

import re
import uuid

HEADER = b"x-request-id"
# printable, no spaces or separators that could split a log line or a header: at most 128
_USABLE = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


def usable_request_id(rid: str) -> bool:
    """Whether a client's id can name a request in logs and headers as it is."""
    return isinstance(rid, str) and _USABLE.fullmatch(rid) is not None


class RequestIdMiddleware:
    """A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which wraps `receive` and
    so would hide a client's disconnect from the streaming handlers)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(HEADER, b"").decode("latin-1")
        rid = given if usable_request_id(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": headers + [(HEADER, rid.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)
