"""vLLM's beam search written out in plain numpy over transformers' float32 SmolLM2 (the
`hf_smollm` fixture's model): the reference of tests/test_beam_search.py and the server's."""

import numpy as np


class Reference:
    """vLLM's beam search written out over transformers' logits: each beam's top 2 x width
    next tokens by log-softmax (float64 of the float32 logits), an EOS candidate finished, the
    best `width` others kept (ties: the earlier beam and rank first)."""

    def __init__(self, hf, eos_ids):
        self.hf, self.eos, self.memo = hf, set(eos_ids), {}

    def _log_softmax(self, tokens):
        import torch

        key = tuple(tokens)
        if key not in self.memo:
            with torch.no_grad():
                logits = self.hf(torch.tensor([tokens])).logits[0, -1].double()
            self.memo[key] = torch.log_softmax(logits, -1).numpy()
        return self.memo[key]

    def pool(self, ids, width, steps, ignore_eos=False):
        """Every finished beam, then the live ones: (tokens, cumulative logprob)."""
        beams, done = [(list(ids), 0.0)], []
        for _ in range(steps):
            cands = []
            for tokens, cum in beams:
                lsm = self._log_softmax(tokens)
                for t in np.argsort(-lsm, kind="stable")[: 2 * width]:
                    c = (tokens + [int(t)], cum + float(lsm[t]))
                    (done if int(t) in self.eos and not ignore_eos else cands).append(c)
            cands.sort(key=lambda c: -c[1])
            beams = cands[:width]
        return done + beams

    def best(self, pool, width, length_penalty=1.0):
        def score(b):
            tokens, cum = b
            return cum / ((len(tokens) - (tokens[-1] in self.eos)) ** length_penalty)

        return sorted(pool, key=score, reverse=True)[:width]
