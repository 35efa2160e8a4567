"""The small engine the front-end tests share (AsyncEngine, ProcessEngine, EngineCore beside
them): the same settings compile the same executables, so their engines after the first start
from the executable store."""

TINY = dict(
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    show_progress=False,
    token_buckets=[16, 32],
    seq_buckets=[4],
)


def step_until_chained(eng, steps: int = 60) -> None:
    """EngineCore.step until a chained verify step is in flight (fails if none comes)."""
    for _ in range(steps):
        eng.step()
        if eng.inflight is not None and eng.inflight.out.chained:
            return
    raise AssertionError(f"no chained step in flight after {steps} steps")
