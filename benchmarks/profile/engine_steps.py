"""Driving the engine to the step a profile times."""

from __future__ import annotations


def step_until_decoding(eng) -> None:
    """Step the engine until no request waits and none is still in its prompt: from here on,
    every step is a decode step of all the running requests."""
    while eng.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running
    ):
        eng.step()


def start_decoding(eng, batch: int, ctx: int, max_tokens: int) -> None:
    """`batch` requests of `ctx` distinct-per-request tokens (ids "b{batch}-{i}"), stepped until
    every one of them decodes."""
    from paxengine import SamplingParams

    for i in range(batch):
        eng.add_request(
            f"b{batch}-{i}",
            {"prompt_token_ids": [1 + (j * 7 + i * 13) % 499 for j in range(ctx)]},
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
    step_until_decoding(eng)
