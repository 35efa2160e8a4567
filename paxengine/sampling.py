"""On-device batched sampling: one row per sequence, every request with its own parameters.

Order as in vLLM: penalties (repetition, presence, frequency) -> min_tokens stop-token ban ->
logit_bias -> temperature -> top-k / top-p / min-p -> sample with the row's own PRNG key
(seed + number of generated tokens, so the same seed gives the same text whatever its batch
mates). Logprobs are those of the raw model output (as vLLM reports them), except that a
grammar's token mask (structured output) comes first of all: a constrained row's logprobs are
those of the masked distribution, the one its token is drawn from.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from paxengine.sampling_params import MAX_LOGIT_BIAS  # OpenAI allows 300 entries
from paxengine.thinking import FORCE_BIAS

NUM_TOP_LOGPROBS = 20  # the API's maximum; computed for every row when any row asks
MAX_STOP_IDS = 16  # stop ids banned while min_tokens is not reached (EOS + stop_token_ids)


@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters, [S] unless noted.

    The flags are static (part of the pytree's structure, not traced): the runner keeps one
    compiled sampler per flag combination and picks it on the host. A data-dependent `lax.cond`
    would do the same on the device, but XLA:GPU reads a conditional's predicate back to the host
    and blocks until everything queued before it has run, which stalls the next step's launch.
    """

    temperature: jax.Array  # f32; 0 = greedy
    top_k: jax.Array  # i32; 0 = off
    top_p: jax.Array  # f32; 1 = off
    min_p: jax.Array  # f32; 0 = off
    presence: jax.Array  # f32
    frequency: jax.Array  # f32
    repetition: jax.Array  # f32; 1 = off
    seeds: jax.Array  # u32
    steps: jax.Array  # i32: tokens generated so far (folded into the key)
    ban_stop: jax.Array  # bool: min_tokens not reached yet
    stop_ids: jax.Array  # [S, MAX_STOP_IDS] i32, -1 padded
    bias_ids: jax.Array  # [S, MAX_LOGIT_BIAS] i32, -1 padded
    bias_vals: jax.Array  # [S, MAX_LOGIT_BIAS] f32
    history: jax.Array | None  # [S, H] i32: prompt + output token ids, -1 padded; None unless
    # `penalties`
    num_prompt: jax.Array  # [S] i32: how many of history are prompt tokens
    mask: jax.Array | None = None  # [S, ceil(V/32)] i32 allowed-token bits; None unless `grammar`
    penalties: bool = False  # static: some row has a penalty (the [S, V] scatters)
    top: bool = False  # static: some row uses top-k / top-p (the [S, V] sort)
    logprobs: bool = False  # static: some row asks for logprobs (the top-20 search)
    grammar: bool = False  # static: some row is constrained by a grammar (the token mask)

    @property
    def flags(self) -> tuple[bool, bool, bool, bool]:
        return (self.penalties, self.top, self.logprobs, self.grammar)


_META_FIELDS = ["penalties", "top", "logprobs", "grammar"]
DATA_FIELDS = [f.name for f in dataclasses.fields(SamplingTensors) if f.name not in _META_FIELDS]
jax.tree_util.register_dataclass(SamplingTensors, data_fields=DATA_FIELDS, meta_fields=_META_FIELDS)
# The compiled sampler variants, (penalties, top, logprobs, grammar). Every combination without a
# grammar (8), and only three with one: a batch runs the cheapest compiled variant that has every
# flag it needs (`choose_flags`; a flag on for rows that do not use it changes nothing for them),
# so a constrained batch with penalties or logprobs runs the all-on sampler instead of 8 more
# executables per sequence bucket compiling at start-up.
_PLAIN_FLAGS = [
    (p, t, l, False) for p in (False, True) for t in (False, True) for l in (False, True)
]
GRAMMAR_FLAGS = [(False, False, False, True), (False, True, False, True), (True, True, True, True)]
ALL_FLAGS = _PLAIN_FLAGS + GRAMMAR_FLAGS


def choose_flags(needed: tuple[bool, ...], available=ALL_FLAGS) -> tuple[bool, ...]:
    """The compiled variant with the fewest flags on that has every flag `needed` has."""
    fits = [f for f in available if all(a or not n for a, n in zip(f, needed))]
    return min(fits, key=sum)


def abstract_sampling_tensors(
    num_rows: int, history_len: int, flags: tuple[bool, bool, bool, bool], vocab_size: int
) -> SamplingTensors:
    """Shapes and dtypes of `build_sampling_tensors`' output, for ahead-of-time compiles."""
    s = num_rows
    spec = lambda dt, *shape: jax.ShapeDtypeStruct(shape, dt)
    f32, i32 = jnp.float32, jnp.int32
    return SamplingTensors(
        spec(f32, s),
        spec(i32, s),
        spec(f32, s),
        spec(f32, s),
        spec(f32, s),
        spec(f32, s),
        spec(f32, s),
        spec(jnp.uint32, s),
        spec(i32, s),
        spec(jnp.bool_, s),
        spec(i32, s, MAX_STOP_IDS),
        spec(i32, s, MAX_LOGIT_BIAS),
        spec(f32, s, MAX_LOGIT_BIAS),
        spec(i32, s, history_len) if flags[0] else None,
        spec(i32, s),
        spec(i32, s, mask_words(vocab_size)) if flags[3] else None,
        *flags,
    )


def mask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


@functools.lru_cache(maxsize=256)
def token_mask(token_ids: tuple[int, ...], vocab_size: int) -> np.ndarray:
    """The bitmask row (`apply_token_mask`'s layout) allowing exactly token_ids; read-only, and
    cached: a request's allowed_token_ids are masked every step it samples."""
    bits = np.zeros(mask_words(vocab_size) * 32, np.uint8)
    bits[list(token_ids)] = 1
    words = np.packbits(bits.reshape(-1, 32)[:, ::-1], axis=1).view(">u4").astype(np.uint32)
    row = words.reshape(-1).view(np.int32)
    row.flags.writeable = False
    return row


def apply_token_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Disallowed tokens -> -inf. mask: [S, ceil(V/32)] int32, bit t % 32 of word t // 32 is
    token t (all ones for unconstrained rows). A row with no allowed token at all (a matcher in
    an error state; the host ends such a request) is left unmasked rather than made all -inf."""
    (s, w), v = mask.shape, logits.shape[-1]
    # each word 32 times by a broadcast (jnp.repeat with a total length builds its gather
    # indices from cumulative sums of constants, which XLA:GPU constant-folded for 1-5 s a
    # compile at a 248k vocabulary)
    words = jnp.broadcast_to(mask[:, :, None], (s, w, 32)).reshape(s, w * 32)[:, :v]
    bit = jnp.arange(v, dtype=jnp.int32) % 32
    allowed = jax.lax.shift_right_logical(words, bit[None, :]) & 1 == 1
    allowed = allowed | ~jnp.any(allowed, axis=-1, keepdims=True)
    return jnp.where(allowed, logits, -jnp.inf)


def _apply_penalties(logits, st: SamplingTensors):
    s, v = logits.shape
    h = st.history
    valid = h >= 0
    is_out = jnp.arange(h.shape[1])[None, :] >= st.num_prompt[:, None]
    ids = jnp.where(valid, h, v)  # out of range -> dropped
    rows = jnp.arange(s)[:, None]
    seen = jnp.zeros((s, v), bool).at[rows, ids].set(True, mode="drop")
    out_counts = (
        jnp.zeros((s, v), jnp.float32).at[rows, jnp.where(is_out, ids, v)].add(1.0, mode="drop")
    )
    rep = st.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - st.frequency[:, None] * out_counts
    logits = logits - st.presence[:, None] * (out_counts > 0)
    return logits


def _apply_top_k_top_p(logits, st: SamplingTensors):
    """Rows without top-k (0) or top-p (1) come back unchanged, bit for bit."""
    v = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(st.top_k > 0, jnp.minimum(st.top_k, v), v)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    # top-p on the top-k-filtered distribution: keep the smallest prefix whose mass reaches p
    sorted_desc = jnp.where(jnp.arange(v)[None, :] < k[:, None], sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = before < st.top_p[:, None]
    cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    cut = (logits < cutoff) & (st.top_p < 1)[:, None]
    return jnp.where(cut, -jnp.inf, logits)


def process_logits(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """Raw logits [S, V] -> the logits that are sampled from (before temperature)."""
    s, v = logits.shape
    logits = logits.astype(jnp.float32)
    if st.penalties:
        logits = _apply_penalties(logits, st)
    rows = jnp.arange(s)[:, None]
    ban = jnp.where(st.ban_stop[:, None] & (st.stop_ids >= 0), st.stop_ids, v)
    logits = logits.at[rows, ban].set(-jnp.inf, mode="drop")
    logits = logits.at[rows, jnp.where(st.bias_ids >= 0, st.bias_ids, v)].add(
        st.bias_vals, mode="drop"
    )
    return logits


_CDF_BLOCK = 256


def _last_positive(x):
    """Index of the last entry > 0 along the last axis (0 if none)."""
    n = x.shape[-1]
    return n - 1 - jnp.argmax(x[..., ::-1] > 0, axis=-1)


def inverse_cdf(probs: jax.Array, u: jax.Array) -> jax.Array:
    """Row i -> the first token whose cumulative mass exceeds u[i] * (row mass): an exact draw
    from the row's distribution. Two levels (block sums, then one block's prefix sum) instead of a
    prefix sum over the whole vocabulary, which XLA:GPU runs as log2(V) passes. Never returns a
    zero-probability token, even when rounding puts the target at the very end of the row."""
    s, v = probs.shape
    b = min(_CDF_BLOCK, v)
    nb = -(-v // b)
    blocks = jnp.pad(probs, ((0, 0), (0, nb * b - v))).reshape(s, nb, b)
    block_mass = blocks.sum(-1)  # [S, nb]
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    target = u * block_cdf[:, -1]
    j = jnp.minimum(jnp.sum(block_cdf <= target[:, None], axis=-1), _last_positive(block_mass))
    before = jnp.where(
        j > 0, jnp.take_along_axis(block_cdf, jnp.maximum(j - 1, 0)[:, None], axis=-1)[:, 0], 0.0
    )
    inner = jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0]  # [S, b]
    k = jnp.sum(before[:, None] + jnp.cumsum(inner, axis=-1) <= target[:, None], axis=-1)
    k = jnp.minimum(k, _last_positive(inner))
    return (j * b + k).astype(jnp.int32)


def sample(logits: jax.Array, st: SamplingTensors):
    """-> (tokens [S], sampled logprob [S], rank [S], top ids [S, N], top logprobs [S, N]).
    Branch-free on the device: what a batch does not use is left out at trace time (`st`'s
    static flags), and the random draw costs a few passes over [S, V], so it always runs."""
    if st.grammar:  # before everything: penalties, bias, every sampling mode and logprobs
        logits = apply_token_mask(logits.astype(jnp.float32), st.mask)
    proc = process_logits(logits, st)
    greedy_tok = jnp.argmax(proc, axis=-1)
    temp = jnp.where(st.temperature > 0, st.temperature, 1.0)
    scaled = proc / temp[:, None]
    if st.top:
        scaled = _apply_top_k_top_p(scaled, st)
    probs = jax.nn.softmax(scaled, axis=-1)
    probs = jnp.where(
        probs < st.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True), 0.0, probs
    )
    # Inverse-CDF sampling: one uniform per row, drawn from the row's own seed and step (so batch
    # mates never change it), instead of V Gumbel draws: ~10x cheaper on a CPU.
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(st.seeds, st.steps)
    u = jax.vmap(lambda k: jax.random.uniform(k, ()))(keys)
    tokens = jnp.where(st.temperature > 0, inverse_cdf(probs, u), greedy_tok).astype(jnp.int32)
    s = logits.shape[0]
    n_top = min(NUM_TOP_LOGPROBS, logits.shape[-1])
    if not st.logprobs:
        return (
            tokens,
            jnp.zeros(s, jnp.float32),
            jnp.zeros(s, jnp.int32),
            jnp.zeros((s, n_top), jnp.int32),
            jnp.zeros((s, n_top), jnp.float32),
        )
    raw = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    tok_lp = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    rank = jnp.sum(raw > tok_lp[:, None], axis=-1).astype(jnp.int32) + 1
    top_lp, top_ids = jax.lax.top_k(raw, n_top)
    if st.grammar:  # masked tokens' -inf is not JSON: the floor OpenAI servers report (vLLM's)
        top_lp = jnp.maximum(top_lp, -9999.0)
    return tokens, tok_lp, rank, top_ids.astype(jnp.int32), top_lp


def pack_samples(result, logprobs: bool) -> jax.Array:
    """`sample`'s five arrays as one int32 vector, so the step's one read is one transfer (five
    cost ~0.5 ms of a step's critical path on the H200): tokens, then, when the batch asked for
    logprobs (else they are zeros and stay on the device), the sampled logprobs (bits), ranks,
    top ids and top logprobs (bits)."""
    tokens, tok_lp, rank, top_ids, top_lp = result
    if not logprobs:
        return tokens
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32).reshape(-1)  # noqa: E731
    return jnp.concatenate([tokens, bits(tok_lp), rank, top_ids.reshape(-1), bits(top_lp)])


def unpack_samples(v: np.ndarray, num_rows: int, n_top: int, logprobs: bool) -> tuple:
    """pack_samples' vector, read to the host -> (tokens, logprobs, ranks, top ids, top
    logprobs), numpy views of it."""
    s = num_rows
    if not logprobs:
        return (
            v,
            np.zeros(s, np.float32),
            np.zeros(s, np.int32),
            np.zeros((s, n_top), np.int32),
            np.zeros((s, n_top), np.float32),
        )
    top = 3 * s + s * n_top
    return (
        v[:s],
        v[s : 2 * s].view(np.float32),
        v[2 * s : 3 * s],
        v[3 * s : top].reshape(s, n_top),
        v[top:].view(np.float32).reshape(s, n_top),
    )


def verify_drafts(tokens, drafts) -> int:
    """Speculative decoding's rejection sampling for one request: how many of its drafts are
    accepted, given the tokens its verify rows sampled (row j: the token after draft j - 1).

    An n-gram draft has no distribution of its own: it is a point mass q on the draft d (as in
    vLLM), and Leviathan et al.'s rule then accepts d with probability min(1, p(d) / q(d)) = p(d)
    and, on a rejection, samples max(p - q, 0) renormalized: p without d. A row's own target
    sample x (`sample`: drawn from p, after every sampling parameter, with the row's key) accepted
    iff x == d is that same rule: P(x = d) = p(d), and x given x != d is distributed as p without
    d; greedy rows accept d iff it is the argmax. So the tokens emitted are the rows' own samples,
    up to and including the first that differs from its draft: the device runs the plain sampler
    (no executable is added), and a seeded request's text does not depend on whether, or what,
    was drafted."""
    a = 0
    while a < len(drafts) and tokens[a] == drafts[a]:
        a += 1
    return a


def _thinking(req):
    return getattr(req, "thinking", None)  # thinking.ThinkingState


def bad_words_banned(words: list[list[int]], past) -> list[int]:
    """vLLM's `apply_bad_words` for one row: the tokens it may not sample after `past` (its output
    tokens so far, drafts before it included; never the prompt's, as vLLM). A one-token word's
    token always, a longer word's last token when past ends with the rest of the word."""
    banned = []
    n = len(past)
    for w in words:
        k = len(w) - 1
        if k == 0 or (k <= n and past[n - 1] == w[k - 1] and list(past[n - k :]) == w[:k]):
            banned.append(w[-1])
    return banned


def _clear_tokens(row: np.ndarray, token_ids: list[int]) -> None:
    """Bad words: clear their bits in a mask row, unless that leaves no token (a grammar or
    allowed_token_ids allowing only them wins: the row keeps its mask, the output stays valid)."""
    kept = row.copy()
    for t in token_ids:
        row[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF).view(np.int32)
    if not row.any():
        row[:] = kept


def _grammar_waits(req) -> bool:
    th = _thinking(req)
    return th is not None and th.grammar_waits


def build_sampling_tensors(
    rows: list,
    num_rows: int,
    history_len: int,
    eos_ids: list[int],
    grammars=None,
    vocab_size: int = 0,
    available=ALL_FLAGS,
    drafts: list[list[int]] | None = None,
) -> SamplingTensors:
    """rows: (Request) objects for the live rows, right after they were scheduled; the rest is
    padding. Host-side numpy. grammars: the engine's `structured.GrammarCompiler`, which writes
    the masks of rows with a grammar (`Request.grammar`); `available`: the compiled variants.
    drafts (a verify step): per request, the draft tokens it verifies; request i then takes
    1 + len(drafts[i]) consecutive rows, row j sampling the token after draft j - 1 with the key,
    min_tokens ban and penalty history of that position (the drafts before it count)."""
    s = num_rows
    entries = [(req, 0, ()) for req in rows]  # (request, draft position, drafts before it)
    if drafts is not None:
        entries = [(r, j, d[:j]) for r, d in zip(rows, drafts) for j in range(len(d) + 1)]
    temperature = np.zeros(s, np.float32)
    top_k = np.zeros(s, np.int32)
    top_p = np.ones(s, np.float32)
    min_p = np.zeros(s, np.float32)
    presence = np.zeros(s, np.float32)
    frequency = np.zeros(s, np.float32)
    repetition = np.ones(s, np.float32)
    seeds = np.zeros(s, np.uint32)
    steps = np.zeros(s, np.int32)
    ban = np.zeros(s, bool)
    stop_ids = np.full((s, MAX_STOP_IDS), -1, np.int32)
    bias_ids = np.full((s, MAX_LOGIT_BIAS), -1, np.int32)
    bias_vals = np.zeros((s, MAX_LOGIT_BIAS), np.float32)
    penalties = top = logprobs = False
    num_prompt = np.zeros(s, np.int32)
    banned = []  # (row, the token ids its bad words ban this step)
    for i, (req, j, drafted) in enumerate(entries):
        p = req.params
        temperature[i] = p.temperature
        top_k[i] = min(max(p.top_k, 0), 1 << 30)
        top_p[i], min_p[i] = p.top_p, p.min_p
        presence[i], frequency[i], repetition[i] = (
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty,
        )
        penalties |= p.has_penalties
        top |= p.top_k > 0 or p.top_p < 1
        logprobs |= p.logprobs is not None
        seeds[i] = req.seed & 0xFFFFFFFF
        # tokens generated before the one this step samples (its own sample is already pending)
        steps[i] = before = max(req.num_output_tokens - 1, 0) + j
        if before < p.min_tokens:
            ban[i] = True
            ids = ([] if p.ignore_eos else list(eos_ids)) + list(p.stop_token_ids)
            ids = ids[:MAX_STOP_IDS]
            stop_ids[i, : len(ids)] = ids
        if p.logit_bias:
            items = list(p.logit_bias.items())[:MAX_LOGIT_BIAS]
            bias_ids[i, : len(items)] = [k for k, _ in items]
            bias_vals[i, : len(items)] = [v for _, v in items]
        forced = req.thinking.forced_token() if getattr(req, "thinking", None) else None
        if forced is not None:  # a spent thinking budget: this sample is the end tag's token
            temperature[i], ban[i] = 0.0, False
            bias_ids[i], bias_vals[i] = -1, 0.0
            bias_ids[i, 0], bias_vals[i, 0] = forced, FORCE_BIAS
        elif p.bad_words_token_ids:  # the output tokens (and drafts) this row samples after
            k = max(len(w) for w in p.bad_words_token_ids) - 1
            past = (req.output_token_ids[-k:] + list(drafted)) if k else ()
            if ids := bad_words_banned(p.bad_words_token_ids, past):
                banned.append((i, ids))
    constrained = [
        (g, i)
        for i, (r, _, _) in enumerate(entries)
        if (g := getattr(r, "grammar", None)) and not _grammar_waits(r)
    ]
    # where a grammar waits for a think block that may still open: its start tag is allowed too
    opening = [(i, th.start_token()) for i, r in enumerate(rows) if (th := _thinking(r))]
    opening = [(i, t) for i, t in opening if t is not None and drafts is None]
    allowed = [(i, r.params.allowed_token_ids) for i, (r, _, _) in enumerate(entries)]
    allowed = [(i, ids) for i, ids in allowed if ids is not None]
    penalties, top, logprobs, grammar = choose_flags(
        (penalties, top, logprobs, bool(constrained or allowed or banned)), available
    )
    mask = None
    if grammar:  # all ones (every token allowed) but in the constrained rows
        mask = np.full((s, mask_words(vocab_size)), -1, np.int32)
        if constrained:  # none in a priming step (StepBuilder.prime), which has no grammars
            grammars.fill_masks(constrained, mask)
        for i, t in opening:
            mask[i, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        for i, ids in allowed:  # and, for a grammar's row, only what both allow
            both = mask[i] & token_mask(tuple(ids), vocab_size)
            if both.any():  # else the grammar's alone: a token it refuses would end the request
                mask[i] = both
        for i, ids in banned:  # then without the bad words' tokens
            _clear_tokens(mask[i], ids)
    # [S, H] only when a row uses a penalty (no S x max_model_len upload every step otherwise).
    history = None
    if penalties:
        history = np.full((s, history_len), -1, np.int32)
        for i, (req, _, before) in enumerate(entries):
            toks = (req.all_token_ids + list(before))[:history_len]
            history[i, : len(toks)] = toks
            num_prompt[i] = req.num_prompt_tokens
    return SamplingTensors(
        temperature,
        top_k,
        top_p,
        min_p,
        presence,
        frequency,
        repetition,
        seeds,
        steps,
        ban,
        stop_ids,
        bias_ids,
        bias_vals,
        history,
        num_prompt,
        mask,
        bool(penalties),
        bool(top),
        bool(logprobs),
        bool(grammar),
    )
