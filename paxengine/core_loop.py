"""The engine's step loop, one for both ways of running EngineCore behind a server: on a thread of
the server's process (AsyncEngine) or in a process of its own (ProcessEngine).

Between steps it takes what the front end posted (("add", id, (prompt, params)), ("abort", id,
None), ("reset", None, reply_to), ("stop", None, None)), then steps while there is work and hands
every output on. A `Transport` is how the messages come in and the outputs go out.
"""

from __future__ import annotations

from typing import Protocol

from paxengine.errors import StepFailed


class Transport(Protocol):
    def take(self, block: bool) -> list[tuple]:
        """The posted messages, in order; with `block`, waits up to 0.5 s for the first."""

    def deliver(self, items: list[tuple[str, object]]) -> None:
        """(request id, cumulative output or exception) pairs, one call a step."""

    def taken(self, num_seqs: int, num_tokens: int) -> None:
        """An add has left the posted messages (for the front end's admission count)."""

    def reply(self, reply_to, value=None, error: BaseException | None = None) -> None:
        """The answer to a reset."""

    def other(self, kind: str, rid: str, payload) -> None:
        """A message of a kind this loop does not know (a decode engine's hand-offs)."""


def run(core, transport: Transport) -> None:
    """Until a stop message. Exceptions other than a contained StepFailed propagate: the
    caller makes a dead loop visible."""
    while True:
        block = not core.has_unfinished()
        if block and core.prime_idle():  # more to prime: look again without waiting
            block = False
        for kind, rid, payload in transport.take(block):
            if kind == "stop":
                return
            _handle(core, transport, kind, rid, payload)
        if core.has_unfinished():
            failed: list = []
            try:
                outputs = core.step()
            except StepFailed as e:  # contained: its requests end with it, the rest run
                outputs, failed = e.outputs, [(rid, e) for rid in e.request_ids]
            transport.deliver([(out.request_id, out) for out in outputs] + failed)


def _handle(core, transport: Transport, kind: str, rid: str, payload) -> None:
    if kind == "add":
        prompt, params = payload
        try:
            core.add_request(rid, prompt, params)
        except Exception as e:  # refused after all (an id reused while its abort is queued)
            transport.deliver([(rid, e)])
        finally:
            transport.taken(params.n, len(prompt["prompt_token_ids"]) * params.n)
    elif kind == "abort":
        out = core.abort(rid)
        if out is not None:
            out.finished = True
            transport.deliver([(rid, out)])
    elif kind == "reset":
        try:
            transport.reply(payload, core.reset_prefix_cache())
        except Exception as e:
            transport.reply(payload, error=e)
    else:
        transport.other(kind, rid, payload)
