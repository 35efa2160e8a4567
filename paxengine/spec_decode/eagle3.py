"""The EAGLE-3 proposer (speculative_config {"method": "eagle3", "model": DIR,
"num_speculative_tokens": k}): a one-layer speculator head that drafts from the target's own
hidden states, in the HF layout of the EAGLE-3 releases (config.json with architectures
["LlamaForCausalLMEagle3"]; safetensors or pytorch_model.bin with fc.weight, midlayer.*,
norm.weight, lm_head.weight, d2t, t2d).

The speculator at position p reads two things: the embedding of the token at p + 1 (the
target's embedding table, unless the checkpoint has its own embed_tokens) and a hidden state
h_p. For positions the target has computed, h_p = fc(concat of the target's residual stream
entering three layers at p): `eagle_aux_hidden_state_layer_ids` in the speculator's config,
else vLLM's default (2, L // 2, L - 3). Then one Llama decoder layer whose attention input is
[input_layernorm(embedding) ; hidden_norm(h_p)] (2H wide; the residual is h_p), its MLP, `norm`
and `lm_head` over a reduced draft vocabulary, mapped to target ids by d2t (target id = draft
id + d2t[draft id]). Its output before `norm` is the hidden state of the next position, so the
2nd..k-th drafts feed the layer's own output back, as the speculator was trained.

Where the target's hidden states come from: a target runner built with `runner.AuxHidden`
projects its aux states by fc in every step and writes them at each token's KV slot into an
aux cache [num_slots, H] beside the KV pages (the forward already has them: no extra pass).
So the aux state of a position is exactly as valid as that position's target KV: prefix-cache
hits, chunked prefill, rejected drafts (overwritten like their KV) and preemption need nothing
of their own. The memory: H values per slot besides the target's KV (and the speculator's one
layer of KV), paid for out of the KV budget like a draft model's pages.

The rest is the draft model's machinery (`draft_model.DraftProposer`): the speculator's one
layer of KV lives in the target's block ids, drafting runs before schedule() in compiled (T, S)
buckets with the samples (argmax over the draft vocabulary, mapped to target ids on the device)
and the fed-back hidden states staying on the device through a round, greedy drafts verified
by the ordinary sampler. The one difference is what stays valid: the speculator's KV at a
position is right only where it was computed from the target's hidden state, so after a round
it is valid for [0, num_tokens - 1) (positions before the last known token) and the next round
feeds from there: the verified tokens again, now with the target's hidden states, as vLLM does.

Known imprecision (never an output change): the speculator's entry at p embeds the token at
p + 1, so the last position of a full block depends on the next block's first token. A request
that re-prefills a prefix shared with a running request (a prefix-cache hit) rewrites the
shared blocks' entries with the same values except at such a boundary, where the other request
then reads an entry made with another next token: its drafts there may be worse.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import kernels_pallas
from paxengine.attention import PagedAttend
from paxengine.models.config import ModelConfig, from_hf_config
from paxengine.models.llama import _attention, rms_norm, rope_for
from paxengine.models.quant import linear
from paxengine.request import Request
from paxengine.runner import AuxHidden, Runner
from paxengine.spec_decode.config import EAGLE3_ARCHITECTURES
from paxengine.spec_decode.draft_model import DraftProposer, _State, _Work
from paxengine.step_build import abstract_of, compile_count

log = logging.getLogger("paxengine")

# checkpoint name (after "midlayer.") -> our layer leaf, and whether it is a Linear [out, in]
_LAYER = {
    "input_layernorm.weight": ("attn_norm", False),
    "hidden_norm.weight": ("hidden_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}


@dataclasses.dataclass
class Eagle3Speculator:
    """A loaded, checked speculator (numpy, float32) before it goes to the device."""

    config: ModelConfig  # its decoder layer's shapes (num_layers 1)
    layer: dict  # our leaf names -> arrays, Linear weights [in, out]
    final_norm: np.ndarray  # [H]
    lm_head: np.ndarray  # [H, draft_vocab]
    draft_to_target: np.ndarray  # [draft_vocab] int32: the target id of each draft id
    fc: np.ndarray  # [len(aux_layers) * target H, H]
    embed: np.ndarray | None  # its own embed_tokens [V, H], or None: the target's
    aux_layers: tuple[int, ...]
    norm_before_residual: bool
    source: str

    def aux_hidden(self, dtype) -> AuxHidden:
        return AuxHidden(self.aux_layers, jnp.asarray(self.fc, dtype), dtype)

    def bytes_per_block(self, block_size: int, dtype) -> int:
        """The speculator's KV pages of one block and its aux states (H a slot)."""
        from paxengine.kv_memory import kv_bytes_per_block

        aux = block_size * self.config.hidden_size * jnp.dtype(dtype).itemsize
        return kv_bytes_per_block(self.config, block_size, dtype) + aux


def _err(path, msg: str) -> ValueError:
    return ValueError(f"speculative_config: EAGLE-3 speculator {path}: {msg}")


def load_eagle3(cfg, spec, target_config: ModelConfig) -> Eagle3Speculator:
    """Read and check speculative_config's EAGLE-3 checkpoint against the target, before
    anything compiles: every failure names the file, key or size at fault."""
    if cfg.tensor_parallel_size != 1:
        raise ValueError(
            "speculative_config: EAGLE-3 with tensor_parallel_size > 1 is not implemented yet"
        )
    path = Path(spec.model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"speculative_config: EAGLE-3 speculator not found: {path} (expected a directory "
            "with config.json and model.safetensors or pytorch_model.bin)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"speculative_config: EAGLE-3 speculator {path}: no config.json")
    raw = json.loads((path / "config.json").read_text())
    archs = raw.get("architectures") or []
    if not any(a in EAGLE3_ARCHITECTURES for a in archs):
        raise _err(
            path, f"architectures {archs} is not an EAGLE-3 Llama head {EAGLE3_ARCHITECTURES}"
        )
    if raw.get("num_hidden_layers", 1) != 1:
        raise _err(path, f"{raw['num_hidden_layers']} decoder layers: only 1 is implemented")
    eagle_config = raw.get("eagle_config") or {}
    if eagle_config.get("use_aux_hidden_state", True) is False:
        raise _err(path, "use_aux_hidden_state false (no fc over aux states) is not implemented")
    tv, th = target_config.vocab_size, target_config.hidden_size
    if raw.get("vocab_size", tv) != tv:
        raise _err(path, f"vocab_size {raw['vocab_size']}, the target's is {tv}")
    try:
        mc = from_hf_config({**raw, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
    except KeyError as e:
        raise _err(path, f"config.json lacks {e}") from None
    if mc.qk_norm or mc.attention_bias:
        raise _err(path, "attention bias or q/k norms are not implemented for EAGLE-3 heads")
    H = mc.hidden_size
    target_h = raw.get("target_hidden_size") or H
    if target_h != th:
        raise _err(
            path,
            f"hidden size mismatch: it reads target hidden states of {target_h}, the target's "
            f"hidden size is {th}",
        )
    L = target_config.num_layers
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    # in layer order, as vLLM concatenates them (whatever order the config lists)
    ids = tuple(sorted(int(i) for i in ids)) if ids else (2, L // 2, L - 3)
    if len(set(ids)) != len(ids) or not all(0 <= i < L for i in ids):
        raise _err(
            path,
            f"aux hidden state layer ids {list(ids)} must be distinct layers of the target's "
            f"{L} (0 .. {L - 1}; the default (2, L // 2, L - 3) needs at least 4 layers)",
        )
    draft_vocab = int(raw.get("draft_vocab_size") or tv)
    t = _read_tensors(path)

    def take(name: str, shape: tuple) -> np.ndarray:
        if name not in t:
            raise _err(path, f"the checkpoint lacks {name}")
        a = t.pop(name)
        if tuple(a.shape) != tuple(shape):
            raise _err(path, f"{name} has shape {tuple(a.shape)}, expected {tuple(shape)}")
        return a

    qd, kd, inter = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim, mc.intermediate_size
    shapes = {
        "input_layernorm.weight": (H,),
        "hidden_norm.weight": (H,),
        "self_attn.q_proj.weight": (qd, 2 * H),
        "self_attn.k_proj.weight": (kd, 2 * H),
        "self_attn.v_proj.weight": (kd, 2 * H),
        "self_attn.o_proj.weight": (H, qd),
        "post_attention_layernorm.weight": (H,),
        "mlp.gate_proj.weight": (inter, H),
        "mlp.up_proj.weight": (inter, H),
        "mlp.down_proj.weight": (H, inter),
    }
    layer = {}
    for name, shape in shapes.items():
        leaf, is_linear = _LAYER[name]
        a = np.asarray(take("midlayer." + name, shape), np.float32)
        layer[leaf] = a.T if is_linear else a
    fc = np.asarray(take("fc.weight", (H, len(ids) * th)), np.float32).T
    final_norm = np.asarray(take("norm.weight", (H,)), np.float32)
    lm_head = np.asarray(take("lm_head.weight", (draft_vocab, H)), np.float32).T
    embed = None
    if "embed_tokens.weight" in t:
        embed = np.asarray(take("embed_tokens.weight", (tv, H)), np.float32)
    elif H != th:
        raise _err(
            path, f"hidden_size {H} differs from the target's {th} and it has no embed_tokens"
        )
    if "d2t" in t:
        d2t = np.asarray(take("d2t", (draft_vocab,)), np.int64)
    elif draft_vocab == tv:
        d2t = np.zeros(draft_vocab, np.int64)  # the target's vocabulary itself
    else:
        raise _err(
            path, f"the checkpoint lacks d2t (its draft vocabulary is {draft_vocab} of {tv})"
        )
    target_ids = np.arange(draft_vocab) + d2t
    bad = np.flatnonzero((target_ids < 0) | (target_ids >= tv))
    if len(bad):
        raise _err(
            path,
            f"d2t maps {len(bad)} draft ids outside the target's vocabulary of {tv} (draft id "
            f"{bad[0]} -> {target_ids[bad[0]]})",
        )
    if "t2d" in t:
        take("t2d", (tv,))  # the reverse mask; drafting needs only d2t
    log.info(
        "EAGLE-3 speculator %s: hidden %d, draft vocabulary %d of %d, aux hidden states of "
        "target layers %s",
        path,
        H,
        draft_vocab,
        tv,
        list(ids),
    )
    return Eagle3Speculator(
        config=mc,
        layer=layer,
        final_norm=final_norm,
        lm_head=lm_head,
        draft_to_target=target_ids.astype(np.int32),
        fc=fc,
        embed=embed,
        aux_layers=ids,
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        source=str(path),
    )


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint (*.safetensors, else pytorch_model.bin), names without a
    leading "model." and with "layers.0." spelled "midlayer." (both occur)."""
    from paxengine.models.fp8_checkpoint import SafetensorsFile

    out = {}
    files = sorted(path.glob("*.safetensors"))
    if files:
        for f in files:
            st = SafetensorsFile(f)
            for key in st.keys():
                try:
                    out[key] = st.get(key)
                except Exception as e:
                    raise _err(path, f"{f.name}: corrupt tensor {key} ({e})") from e
    elif (path / "pytorch_model.bin").is_file():
        try:
            import torch
        except ImportError:
            raise _err(
                path, "pytorch_model.bin needs torch installed (or convert it to safetensors)"
            ) from None
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        out = {
            k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in state.items()
        }
    else:
        raise FileNotFoundError(
            f"speculative_config: EAGLE-3 speculator {path}: no *.safetensors or pytorch_model.bin"
        )
    named = {}
    for key, a in out.items():
        name = key.removeprefix("model.")
        if name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        named[name] = a
    return named


def eagle3_layer(
    params,
    cfg: ModelConfig,
    norm_before_residual: bool,
    tokens,
    positions,
    hidden,
    kv_cache,
    attend,
):
    """The speculator's decoder layer: tokens [T] (each the token after its row's position),
    hidden [T, H] (fc of the target's aux states, or the layer's own earlier output) -> (normed
    output [T, H] for lm_head, output before `norm` [T, H]: the next position's hidden state,
    kv_cache). Its one layer of KV is layer 0 of `kv_cache`."""
    w, eps = params["layers"], cfg.rms_norm_eps
    emb = rms_norm(params["embed"][tokens], w["attn_norm"], eps)
    normed = rms_norm(hidden, w["hidden_norm"], eps)
    residual = normed if norm_before_residual else hidden
    x = jnp.concatenate([emb, normed.astype(emb.dtype)], axis=-1)  # [T, 2H]
    rope = rope_for(cfg, positions)
    o, kv_cache = _attention(cfg, attend, rope, w, x, kv_cache, jnp.int32(0))
    h = residual + linear(o.astype(residual.dtype), w["wo"])
    x = rms_norm(h, w["mlp_norm"], eps)
    h = h + linear(jax.nn.silu(linear(x, w["w_gate"])) * linear(x, w["w_up"]), w["w_down"])
    return rms_norm(h, params["final_norm"], eps), h, kv_cache


class Eagle3Runner(Runner):
    """The speculator's compiled steps: a `Runner` (buckets, packing, the executable store)
    whose forward is `eagle3_layer` and whose samples are the draft vocabulary's argmax mapped
    to target ids, computed in the forward (no sampler executable). A row whose `prev_index`
    is set feeds the previous step's sample of that row and that row's hidden state (the
    layer's output before `norm`); any other row feeds its token and the target's aux state
    at its own slot (the target runner's aux cache, read, never written here)."""

    def __init__(self, params, cfg: ModelConfig, target: Runner, norm_before_residual: bool, **kw):
        self.target = target
        self.norm_before_residual = norm_before_residual
        rows = max(kw["seq_buckets"])
        self.prev_hidden = jnp.zeros((rows, cfg.hidden_size), params["final_norm"].dtype)
        super().__init__(cfg, params, sampler_flags=[], **kw)

    def _abstract_inputs(self, T: int, S: int):
        packed, prev_tokens = super()._abstract_inputs(T, S)
        return (
            packed,
            prev_tokens,
            abstract_of(self.prev_hidden),
            abstract_of(self.target.aux_cache),
        )

    def _forward_fn(self, params, kv_cache, packed, prev_tokens, prev_hidden, aux_cache, *, layout):
        x = layout.unpack(packed)
        md = kernels_pallas.AttentionMetadata(
            x["slot_mapping"], x["block_tables"], x["seq_lens"], x["query_start_loc"], x["num_seqs"]
        )
        prev = x["prev_index"]
        from_prev = prev >= 0
        i = jnp.maximum(prev, 0)
        tokens = jnp.where(from_prev, prev_tokens[i], x["tokens"])
        aux = aux_cache[jnp.maximum(x["slot_mapping"], 0)]
        hidden = jnp.where(from_prev[:, None], prev_hidden[i], aux)
        attend = PagedAttend(md, self.backend, self.cfg, fused_rope=False)
        out, pre, kv_cache = self._layer(params, tokens, x["positions"], hidden, kv_cache, attend)
        rows = x["logits_indices"]
        logits, ids = self._drafts(params, out[rows])
        S = rows.shape[0]
        ids = jnp.zeros(self.max_rows, jnp.int32).at[:S].set(ids)
        hidden = jnp.zeros_like(prev_hidden).at[:S].set(pre[rows].astype(prev_hidden.dtype))
        return kv_cache, ids, hidden, logits

    KIND = "eagle3"  # in the executables' store keys

    def _layer(self, params, tokens, positions, hidden, kv_cache, attend):
        """-> (normed output for the logits, the next position's hidden state, KV)."""
        nbr = self.norm_before_residual
        return eagle3_layer(params, self.cfg, nbr, tokens, positions, hidden, kv_cache, attend)

    def _drafts(self, params, out):
        """out [S, H] -> (the draft vocabulary's logits, each row's draft as a target id)."""
        logits = jnp.dot(out, params["lm_head"], preferred_element_type=jnp.float32)
        return logits, params["draft_to_target"][jnp.argmax(logits, axis=-1)]

    def _forward_job(self, T: int, S: int):
        params, kv = jax.tree.map(abstract_of, (self.params, self.kv_cache))
        args = (params, kv, *self._abstract_inputs(T, S))
        static = (self.KIND, self.norm_before_residual, self.cfg, self.backend)
        static += (self.max_blocks_per_seq, self.max_rows, self.placement)
        key = self.store.key("forward", static, args) if self.store is not None else None
        layout = self.step_layout(T, S)
        return key, lambda: self._forward.lower(*args, layout=layout), None

    def execute(self, arrays, st=None):
        """One draft step -> (each row's draft as a target id [max rows], the draft
        vocabulary's logits [S, draft vocab]), on the device."""
        T, S = arrays.tokens.shape[0], arrays.seq_lens.shape[0]
        packed = self._layouts[("fwd", T, S)].pack(vars(arrays))
        self.kv_cache, self.prev_tokens, self.prev_hidden, logits = self.compiled[(T, S)](
            self.params,
            self.kv_cache,
            packed,
            self.prev_tokens,
            self.prev_hidden,
            self.target.aux_cache,
        )
        return self.prev_tokens, logits

    def reset_device_state(self) -> None:
        super().reset_device_state()
        self.prev_hidden = jnp.zeros_like(self.prev_hidden)


class Eagle3Proposer(DraftProposer):
    """DraftProposer's rounds over the EAGLE-3 speculator: a request's row at position p feeds
    the token at p + 1, and what stays valid after a round is the positions fed with the
    target's hidden states (see the module's docstring)."""

    def __init__(
        self,
        speculator: Eagle3Speculator,
        target: Runner,
        spec,
        *,
        dtype,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        token_buckets: list[int],
        seq_buckets: list[int],
        attention_backend: str,
        show_progress: bool,
        store,
    ):
        self._init_state(spec, block_size, max_model_len, token_buckets, seq_buckets)
        s = speculator
        put = lambda a: jnp.asarray(a, dtype)  # noqa: E731
        params = {
            "embed": put(s.embed) if s.embed is not None else target.params["embed"],
            "layers": {k: put(v) for k, v in s.layer.items()},
            "final_norm": put(s.final_norm),
            "lm_head": put(s.lm_head),
            "draft_to_target": jnp.asarray(s.draft_to_target),
        }
        c0 = compile_count()
        self.runner = Eagle3Runner(
            params,
            s.config,
            target,
            s.norm_before_residual,
            num_blocks=num_blocks,
            block_size=block_size,
            max_model_len=max_model_len,
            token_buckets=token_buckets,
            seq_buckets=seq_buckets,
            kv_dtype=dtype,
            attention_backend=attention_backend,
            show_progress=show_progress,
            store=store,
        )
        self.compiles = compile_count() - c0

    def _work(self, req: Request, k: int) -> _Work:
        c = self._valid(req)  # the row at position p feeds token p + 1
        return _Work(req, c, req.token_slice(c + 1, req.num_tokens), k)

    def _valid(self, req: Request) -> int:
        """Positions whose speculator KV was made from the target's hidden states: those
        before the last known token of the previous round (never past this one's), 0 for a
        request new to it or preempted since."""
        st = self.states.get(req.request_id)
        if st is None or st.epoch != req.num_preemptions:
            return 0
        return min(st.start, req.num_tokens - 2)

    def _remember(self, w: _Work) -> _State:
        return _State(w.req.num_preemptions, w.req.num_tokens - 1)

    def _launch(self, arrays, S: int):
        return self.runner.execute(arrays)[0]
