"""Speculative decoding: a proposer guesses k tokens on the host, one ragged step verifies them
(see ARCHITECTURE.md, "Speculative decoding")."""

from paxengine.spec_decode.config import SpeculativeConfig, parse_speculative_config
from paxengine.spec_decode.ngram import propose_ngram

__all__ = ["SpeculativeConfig", "parse_speculative_config", "propose_ngram"]
