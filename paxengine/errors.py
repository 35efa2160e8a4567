"""The errors an engine client can raise: what a server maps to HTTP statuses, by type."""

from __future__ import annotations


class EngineError(Exception):
    """Base of the errors below."""


class InvalidRequest(EngineError, ValueError):
    """The request itself is wrong (a 400): nothing ran, retrying it unchanged cannot help.
    `param` names the offending field when one does; `code` is a machine-readable reason."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class EngineOverloaded(EngineError):
    """The waiting queue is at its bound (a 503 with Retry-After): retry later."""


class EngineDead(EngineError):
    """The engine loop has stopped (a 503): no request can run until it is restarted."""


class StepFailed(EngineError):
    """The device step a request was in failed (a 500): that request ended; the engine restored
    its device state, re-queued the others by recompute and runs on. `request_ids`: the requests
    (groups) that ended; `outputs`: what the step call had produced before it failed."""

    def __init__(self, message: str, request_ids: list[str], outputs: list | None = None):
        super().__init__(message)
        self.request_ids, self.outputs = request_ids, outputs or []
