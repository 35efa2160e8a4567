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
