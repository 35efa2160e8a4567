"""A request as the scheduler sees it: token ids, progress, blocks. No JAX, no text."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from paxengine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # sampling seed (the request's own or drawn for it)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)  # known on the host
    # Samples of steps still on the device: counted in num_tokens, their ids not known here yet
    # (the next step reads them on the device, see batch.build_step's prev_index). Only
    # Scheduler changes this and output_token_ids (schedule and update_from_output).
    num_pending_tokens: int = 0
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of the prompt, served by the prefix cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(
        default_factory=list
    )  # full blocks' keys (kv_cache.hash_block)
    num_published_blocks: int = 0  # full blocks already offered to the prefix cache
    # its recurrent layers' state slot (a hybrid model's, kv_cache.KVCacheManager); -1: none
    state_slot: int = -1
    # after a verify step that rejected drafts: the slot holding the state at its last accepted
    # position (KVCacheManager.position_slot), read by its next step instead; -1: none
    state_restore: int = -1
    _block_array: object = field(default=None, repr=False)  # block_ids as int32 (block_array)
    _token_buf: object = field(default=None, repr=False)  # known tokens as int32 (token_array)
    _token_len: int = field(default=0, repr=False)
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # the last output token is the EOS or a stop_token_ids token that ended the request: its
    # text is left out of the output (as vLLM's detokenizer does; include_stop_str_in_output
    # keeps it)
    ended_by_stop_token: bool = False
    # structured output: this sequence's place in its grammar (structured.GrammarState), advanced
    # by the scheduler once per accepted token; None when unconstrained
    grammar: object = field(default=None, repr=False)
    # a thinking budget's place (thinking.ThinkingState), advanced like the grammar; None: none
    thinking: object = field(default=None, repr=False)

    @property
    def forces_tokens(self) -> bool:
        """Whether its next samples may be forced (a thinking budget not spent or closed yet):
        like a grammar, each step is read before the next is built, and it does not
        speculate."""
        return self.thinking is not None and self.thinking.active

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def clear_blocks(self) -> None:
        """Drop the block list and everything derived from it (the KV manager freed them)."""
        self.block_ids = []
        self.num_published_blocks = 0
        self._block_array = None

    def block_array(self):
        """block_ids as an int32 numpy array, rebuilt only when blocks were added (every
        block_size decode steps): the step builder copies it into the block table each step.
        clear_blocks resets it, so a re-grown list never meets a stale copy."""
        arr = self._block_array
        if arr is None or len(arr) != len(self.block_ids):
            arr = self._block_array = np.asarray(self.block_ids, np.int32)
        return arr

    def token_array(self):
        """The known tokens (prompt and output) as an int32 numpy view, for the n-gram proposer:
        kept between calls and extended by the tokens appended since (doubling its buffer), so
        a speculating request costs O(new tokens) a step, not a conversion of its whole context.
        Tokens are only ever appended (the scheduler's one path), so the copy stays valid."""
        n, buf, done = self.num_known_tokens, self._token_buf, self._token_len
        if buf is None or len(buf) < n:
            grown = np.empty(max(2 * n, 64), np.int32)
            if buf is not None:
                grown[:done] = buf[:done]
            buf = self._token_buf = grown
        if done < n:
            p = len(self.prompt_token_ids)
            if done < p:
                buf[done:p] = self.prompt_token_ids[done:]
                done = p
            buf[done:n] = self.output_token_ids[done - p :]
            self._token_len = n
        return buf[:n]

    def token_slice(self, start: int, stop: int) -> list[int]:
        """all_token_ids[start:stop] without building the whole list (a decode step needs one)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, pending samples included (the scheduler's view)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host has: token_slice reads only below this."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far, pending samples included."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
