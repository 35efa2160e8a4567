"""Driving the engine to the step a profile times."""

from __future__ import annotations


def step_until_decoding(eng) -> None:
    """Step the engine until no request waits and none is still in its prompt: from here on,
    every step is a decode step of all the running requests."""
    while eng.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running
    ):
        eng.step()
