"""Speculative decoding counters, named as vLLM's (spec_decode_num_drafts, ...)."""

from __future__ import annotations


class SpecDecodeStats:
    """Cumulative counts over verify steps: a draft is one request's proposal in one step."""

    def __init__(self, num_speculative_tokens: int):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # [k]: how often the draft at each position was accepted (acceptance by depth)
        self.accepted_per_pos = [0] * num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def as_dict(self) -> dict:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
        }
