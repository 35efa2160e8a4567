"""The draft-model proposer (speculative_config {"model": ..., "num_speculative_tokens": k}): a
second, smaller model in the same engine process, with its own params, its own paged KV cache
and its own compiled (T, S) buckets (a second `Runner`), drafting greedily k tokens per
speculating request before each verify step.

KV layout: the draft's cache has the target's block_size and num_blocks, and a request's draft
pages live in the *same block ids* as its target pages (the target's block table is the draft's
too). So the target's KVCacheManager does all the accounting: allocation, trimming rejected
slots, freeing on finish/abort/preemption and the pool's size cover the draft's pages with no
second allocator to keep in step (a separate manager would need every scheduler decision
mirrored, and could disagree with it under pressure). The cost: the draft's pool is as many
blocks as the target's, whatever the draft's size (small next to the target's: its layers are
few and narrow); a planned pool (kv_cache_memory_bytes, or free GPU memory) is shrunk so both
fit (`share_kv_budget`).

What the draft has computed: `_State` per request. The draft's KV is valid for positions
[0, computed); each round feeds the tokens after that (on a request's first speculation, or
after a preemption, its whole known sequence: a prompt of P tokens costs the draft a P-token
prefill, chunked through its buckets, once), then its own greedy samples k - 1 times. A prefix
cache hit does not carry the draft's pages with it (a cached block's draft pages are only as
good as whoever last wrote them), so a request's draft state always starts at 0: the draft
re-prefills the cached prefix too, writing the same values into the shared blocks.
After the verify step, the drafts the target accepted keep their KV (a KV entry depends only on
the tokens up to it); the rest is simply overwritten later: `computed` rolls back to the
accepted length, bounded by the blocks the request still holds.

Why greedy drafts keep the target distribution: a greedy draft is a point mass q on d, and the
verify step's rule (accept d iff the row's own sample equals it, `sampling.verify_drafts`) is
Leviathan et al.'s rule for a point-mass q exactly (ARCHITECTURE.md, "Rejection sampler"). A
sampled draft would need the full rule with the draft's q; it is not done.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import jax
import numpy as np

from paxengine.batch import StepArrays
from paxengine.request import Request
from paxengine.runner import Runner, resolve_layer_loop
from paxengine.sampling import build_sampling_tensors
from paxengine.spec_decode.config import EAGLE3_ARCHITECTURES
from paxengine.step_build import compile_count

log = logging.getLogger("paxengine")

GREEDY_FLAGS = [(False, False, False, False)]  # the one sampler variant the draft compiles


def load_draft_model(cfg, spec, target_config, target_tokenizer, dtype: str):
    """Load speculative_config's model and check it can draft for the target: the same
    vocabulary (token ids are compared as ints). Called right after the target loads, before
    anything compiles, so a bad draft fails start-up fast. A draft trained on a shorter context
    than the target's still runs past it (RoPE extrapolates): it only drafts worse there."""
    from paxengine.models.loader import load_model

    if cfg.tensor_parallel_size != 1:
        raise ValueError(
            "speculative_config: a draft model with tensor_parallel_size > 1 is not implemented yet"
        )
    _not_a_speculator(spec.model)
    loaded = load_model(
        spec.model,
        dtype,
        cache_dir=cfg.weights_cache_dir,
        progress=cfg.show_progress,
        seed=cfg.seed,
    )
    dv, tv = loaded.config.vocab_size, target_config.vocab_size
    if dv != tv:
        raise ValueError(
            f"speculative_config: the draft model {spec.model!r} has a vocabulary of {dv} tokens, "
            f"the target {tv}: a draft model must share the target's vocabulary"
        )
    dt, tt = loaded.tokenizer, target_tokenizer
    if dt is not None and tt is not None and _vocab_size(dt) != _vocab_size(tt):
        raise ValueError(
            f"speculative_config: the draft model's tokenizer has {_vocab_size(dt)} tokens, the "
            f"target's {_vocab_size(tt)}: a draft model must share the target's tokenizer"
        )
    return loaded


def _not_a_speculator(source: str) -> None:
    """An EAGLE-3 head is no model of its own (its config says llama, its weights are not a
    Llama's): say so instead of failing on its first missing weight."""
    import json
    from pathlib import Path

    config = Path(str(source)).expanduser() / "config.json"
    if config.is_file():
        archs = json.loads(config.read_text()).get("architectures") or []
        if any(a in EAGLE3_ARCHITECTURES for a in archs):
            raise ValueError(
                f"speculative_config: {source} is an EAGLE-3 speculator ({archs[0]}), not a "
                "draft model: use method 'eagle3'"
            )


def share_kv_budget(num_blocks: int, target_cfg, draft_cfg, block_size, kv_dtype, draft_dtype):
    """The pool size when a planned KV budget (bytes or free memory) must also hold the draft's
    pages: a block costs the target's pages plus the draft's (same block ids, see above). An
    explicit num_kv_blocks is taken as it is."""
    from paxengine.kv_memory import kv_bytes_per_block

    t = kv_bytes_per_block(target_cfg, block_size, kv_dtype)
    d = kv_bytes_per_block(draft_cfg, block_size, draft_dtype)
    return max(1, num_blocks * t // (t + d))


def _vocab_size(tok) -> int | None:
    return getattr(tok, "vocab_size", None)  # paxengine.tokenizer.Tokenizer's, added tokens too


@dataclass
class _State:
    epoch: int  # the request's num_preemptions when this was written: a preemption resets it
    start: int  # position of the first fed draft (the request's num_tokens that round)
    fed: list[int] = field(default_factory=list)  # drafts fed at start, start + 1, ...
    limit: int = 0  # positions past it may sit in blocks the request no longer holds


@dataclass
class _Work:
    req: Request
    pos: int  # the next position to feed
    feed: list[int]  # tokens still to feed, from pos
    k: int  # drafts wanted
    # while drafting: (step, row) of each draft's sample on the device; then the token ids
    drafts: list = field(default_factory=list)
    prev_row: int = -1  # its row in the step just run


class DraftProposer:
    def __init__(
        self,
        loaded,
        spec,
        *,
        dtype,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        token_buckets: list[int],
        seq_buckets: list[int],
        attention_backend: str,
        layer_loop: str,
        show_progress: bool,
        store,
    ):
        from paxengine.models.weights import unstack_layers

        params = loaded.params
        if resolve_layer_loop(layer_loop) == "unroll":
            params = unstack_layers(params, shards=1)
        self._init_state(spec, block_size, max_model_len, token_buckets, seq_buckets)
        c0 = compile_count()
        # The target's ladders: a first speculation prefills whole prompts (up to the target's
        # step budget per draft step), the later draft steps are one token per request.
        self.runner = Runner(
            loaded.config,
            params,
            num_blocks=num_blocks,
            block_size=block_size,
            max_model_len=max_model_len,
            token_buckets=token_buckets,
            seq_buckets=seq_buckets,
            kv_dtype=dtype,  # the draft's own (no fp8 KV: it would need its own scales)
            attention_backend=attention_backend,
            show_progress=show_progress,
            store=store,
            sampler_flags=GREEDY_FLAGS,
        )
        # one forward per (T, S) of the target's ladders and one greedy sampler per S (the
        # target's own when the shapes match: samplers are shared per process)
        self.compiles = compile_count() - c0

    def _init_state(self, spec, block_size, max_model_len, token_buckets, seq_buckets) -> None:
        self.k = spec.num_speculative_tokens
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_T = max(token_buckets)
        self.max_S = max(seq_buckets)
        self.states: dict[str, _State] = {}
        self.proposals: dict[str, list[int]] = {}
        self._last_work: list[_Work] = []  # this round's requests, for settle()
        self._kv = None
        self.draft_steps = 0  # draft forwards run (stats)
        self.draft_tokens_fed = 0

    @property
    def num_executables(self) -> int:
        return len(self.runner.compiled) + len(self.runner.samplers)

    # -- the scheduler's hook -------------------------------------------------------------------
    def proposal(self, req: Request, k: int) -> list[int]:
        """Scheduler._propose: this step's drafts for req, at most k (the scheduler's caps)."""
        return self.proposals.get(req.request_id, [])[:k]

    # -- before schedule(): draft for every request that may speculate --------------------------
    def prepare(self, scheduler) -> None:
        """Run the draft for the decoding requests that may speculate in the next step (all
        their tokens on the host), store the drafts for `proposal`. Their KV slots, the draft's
        and the verify step's, are allocated here: the draft writes them before the scheduler
        runs. Never at anyone's expense: only while every running request keeps a free block
        for its next token (drafts never preempt)."""
        self.proposals = {}
        running = scheduler.running
        live = {r.request_id for r in running}
        for rid in [r for r in self.states if r not in live]:  # finished or waiting again
            del self.states[rid]
        kv = self._kv = scheduler.kv
        work = self._last_work = []
        for req in running:
            k = self._wanted(req, scheduler)
            if k < 1:
                continue
            need = kv.blocks_needed(req.num_computed_tokens + 1 + k) - len(req.block_ids)
            if need > 0 and kv.num_free_blocks - need < len(running):
                continue
            if not kv.allocate(req, 1 + k):
                continue
            work.append(self._work(req, k))
        if not work:
            return
        try:
            self._run(work)
        except Exception:  # a failed draft costs the drafts, never the requests
            log.exception("the draft model's step failed: no drafts this step")
            self.runner.reset_device_state()
            self.states.clear()
            return
        for w in work:
            self.proposals[w.req.request_id] = w.drafts

    def settle(self, out) -> None:
        """After schedule(): give back the slots of drafts the scheduler did not take (those
        blocks were never published), and bound what the draft may keep to the blocks that
        stay (see _State.limit)."""
        for w in self._last_work:
            req = w.req
            if req.is_finished or not req.block_ids:  # preempted or ended: blocks already freed
                self.states.pop(req.request_id, None)
                continue
            self._kv.trim(req, req.num_computed_tokens)
            st = self.states.get(req.request_id)
            if st is not None:
                # the verify step keeps the accepted slots (< start + taken) at most; a request
                # without drafts this step keeps only what its blocks still hold
                taken = len(out.drafts.get(req.request_id, ()))
                st.limit = min(st.start + taken, len(req.block_ids) * self.block_size)
        self._last_work = []

    def _wanted(self, req: Request, scheduler) -> int:
        """Drafts worth computing for req now: 0 unless it decodes with every token on the host
        and no grammar (as Scheduler._propose), at most k, within the context and max_tokens."""
        if (
            req.num_pending_tokens
            or req.grammar is not None
            or req.forces_tokens
            or req.num_tokens - req.num_computed_tokens != 1
        ):
            return 0
        k = min(self.k, self.max_model_len - req.num_tokens)
        if req.params.max_tokens is not None:
            k = min(k, req.params.max_tokens - req.num_output_tokens - 1)
        return k

    def _work(self, req: Request, k: int) -> _Work:
        """What req feeds this round: the tokens from the first position whose draft KV is not
        right any more."""
        start = self._valid(req)
        return _Work(req, start, req.token_slice(start, req.num_tokens), k)

    def _valid(self, req: Request) -> int:
        """Positions of req whose draft KV is still right: the sequence known at the last
        round, plus the fed drafts the sequence has since taken (accepted), within the blocks
        kept; 0 for a request new to the draft or preempted since."""
        st = self.states.get(req.request_id)
        if st is None or st.epoch != req.num_preemptions:
            return 0
        m = 0
        have = req.token_slice(st.start, min(st.start + len(st.fed), req.num_tokens))
        while m < len(have) and have[m] == st.fed[m]:
            m += 1
        return min(st.start + m, st.limit, req.num_tokens - 1)

    # -- the draft steps ------------------------------------------------------------------------
    def _run(self, work: list[_Work]) -> None:
        """Feed every request's backlog, then its own samples, through the draft's buckets: a
        request whose feed runs out in a step takes that row's sample as its next draft (and
        feeds it next, until it has k). A long backlog is chunked.

        The samples stay on the device until the round ends (one read-back, not one per
        step): a request feeding its last draft takes it from the previous step's samples
        (`prev_index`, as the target's overlapped steps do). Those requests go first in each
        step, one token each, so they always fit in it (max_num_batched_tokens >=
        max_num_seqs); the loop's control flow depends on counts only, never on token ids."""
        results = []  # each step's sampled ids, on the device
        active = list(work)
        while active:
            # requests feeding the previous step's sample first: that sample is in prev_tokens
            active.sort(key=lambda w: w.feed != [None])
            rows, t = [], 0
            for w in active:
                if len(rows) == self.max_S or t == self.max_T:
                    break
                n = min(len(w.feed), self.max_T - t)
                rows.append((w, n))
                t += n
            if any(w.feed == [None] for w in active[len(rows) :]):  # custom buckets too small
                raise RuntimeError("a draft row did not fit the step after its sample")
            results.append(self._execute(rows, t))
            for i, (w, n) in enumerate(rows):
                w.pos += n
                w.feed = w.feed[n:]
                if not w.feed:  # this row's sample follows its whole sequence: a draft
                    w.drafts.append((len(results) - 1, i))
                    w.prev_row = i
                    if len(w.drafts) < w.k:
                        w.feed = [None]  # the sample just drawn, taken on the device
            active = [w for w in active if len(w.drafts) < w.k]
        fetched = [np.asarray(x) for x in jax.device_get(results)]
        for w in work:
            w.drafts = [int(fetched[step][row]) for step, row in w.drafts]
            self.states[w.req.request_id] = self._remember(w)

    def _remember(self, w: _Work) -> _State:
        req = w.req
        # fed: the drafts at num_tokens, ... (the last one was never fed)
        return _State(req.num_preemptions, req.num_tokens, w.drafts[:-1], req.num_tokens)

    def _execute(self, rows, num_tokens: int):
        """One draft step over `rows` ((work, tokens fed), in order) -> its samples, on the
        device: row i's at index i."""
        r = self.runner
        T, S = r.bucket_for(num_tokens, len(rows))
        bs, P = self.block_size, r.max_blocks_per_seq
        arrays = StepArrays.padding(T, S, P, len(rows))
        tokens, positions, slots, tables, seq_lens, qsl, logits_idx, prev_index = arrays.fields()
        t = 0
        for i, (w, n) in enumerate(rows):
            blocks = w.req.block_array()
            pos = np.arange(w.pos, w.pos + n, dtype=np.int32)
            if w.feed[0] is None:  # the previous step's sample of this request (n == 1)
                prev_index[t] = w.prev_row
            else:
                tokens[t : t + n] = w.feed[:n]
            positions[t : t + n] = pos
            slots[t : t + n] = blocks[pos // bs] * bs + pos % bs
            tables[i, : len(blocks)] = blocks
            seq_lens[i] = w.pos + n
            t += n
            qsl[i + 1] = t
            logits_idx[i] = t - 1
        qsl[len(rows) + 1 :] = t
        self.draft_steps += 1
        self.draft_tokens_fed += num_tokens
        return self._launch(arrays, S)

    def _launch(self, arrays: StepArrays, S: int):
        st = build_sampling_tensors([], S, self.runner.history_len, [], available=GREEDY_FLAGS)
        return self.runner.execute(arrays, st)[0]  # the samples: without logprobs, the tokens
