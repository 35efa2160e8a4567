"""Qwen3.5's own multi-token-prediction layer as the proposer (speculative_config {"method":
"mtp", "num_speculative_tokens": k}, vLLM's name; issue #54 item 7).

The checkpoint's `mtp.*` tensors (vLLM's qwen3_5_mtp.py layout): at position p the layer reads
the target's final (normed) hidden state h_p and the embedding of the token at p + 1 (the
target's table), x = fc([pre_fc_norm_embedding(emb) ; pre_fc_norm_hidden(h_p)]), then one
full-attention decoder layer of the target's kind (gated attention with QK norms and partial
RoPE, a SwiGLU MLP, or Qwen3.5-MoE's routed experts and shared expert), `norm`, and the
target's LM head: the draft for position p + 2. Its normed
output is the hidden state the 2nd..k-th drafts feed back (as vLLM's proposer does). The
norms are zero-centred (scale 1 + w) like the target's.

Everything else is EAGLE-3's machinery (eagle3.py): the target runner writes its final hidden
state at each token's KV slot into an aux cache (`runner.AuxHidden` without layers), the layer's
one layer of KV lives in the target's block ids, the rounds run before schedule() with the
samples and fed-back hidden states on the device, and what stays valid after a round is what
was computed from the target's hidden states. The target's recurrent state rolls back as for
n-gram drafts (models/qwen3_5.py, verify_slots); the MTP layer itself keeps no recurrent state.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import jax.numpy as jnp

from paxengine.models import qwen3_5, qwen3_moe
from paxengine.models.config import ModelConfig
from paxengine.models.llama import rms_norm, rope_for
from paxengine.models.quant import linear
from paxengine.runner import AuxHidden
from paxengine.spec_decode.eagle3 import Eagle3Proposer, Eagle3Runner
from paxengine.step_build import compile_count

log = logging.getLogger("paxengine")

# checkpoint name after "mtp." -> (our name, a Linear [out, in] stored transposed); the decoder
# layer's own names come from qwen3_5.layer_names, under "layers.0."
_HEAD = {
    "fc.weight": ("fc", True),
    "pre_fc_norm_embedding.weight": ("norm_embed", False),
    "pre_fc_norm_hidden.weight": ("norm_hidden", False),
    "norm.weight": ("final_norm", False),
}
_ZERO_CENTRED = ("norm_embed", "norm_hidden", "final_norm", "attn_norm", "mlp_norm")
_ZERO_CENTRED += ("q_norm", "k_norm")


@dataclasses.dataclass
class MtpHead:
    """A loaded, checked MTP layer (numpy, float32) before it goes to the device."""

    config: ModelConfig  # the target's, one full-attention layer
    params: dict  # fc, norm_embed, norm_hidden, final_norm and "layers" (our names, [in, out])
    source: str

    def aux_hidden(self, dtype) -> AuxHidden:
        return AuxHidden((), None, dtype, self.config.hidden_size)

    def bytes_per_block(self, block_size: int, dtype) -> int:
        """Its KV pages of one block and the target's hidden states there (H a slot)."""
        from paxengine.kv_memory import kv_bytes_per_block

        aux = block_size * self.config.hidden_size * jnp.dtype(dtype).itemsize
        return kv_bytes_per_block(self.config, block_size, dtype) + aux


def _err(path, msg: str) -> ValueError:
    return ValueError(f"speculative_config: method 'mtp': {path}: {msg}")


def load_mtp(cfg, target_config: ModelConfig) -> MtpHead:
    """The MTP layer of the model's own checkpoint, checked against the target before anything
    compiles: every failure names the model, tensor or size at fault."""
    if target_config.family != "qwen3_5":
        raise ValueError(
            "speculative_config: method 'mtp' is implemented for Qwen3.5 checkpoints only "
            f"(dense and MoE), not {target_config.arch}"
        )
    if cfg.tensor_parallel_size != 1:
        raise ValueError("speculative_config: MTP with tensor_parallel_size > 1 is not implemented")
    path = Path(str(cfg.model)).expanduser()
    if not (path / "config.json").is_file():
        raise _err(path, "the MTP layer is read from the model's checkpoint directory: none here")
    raw = json.loads((path / "config.json").read_text())
    text = raw.get("text_config") or raw
    n = text.get("mtp_num_hidden_layers", 1)
    if n != 1:
        raise _err(path, f"mtp_num_hidden_layers {n}: only 1 is implemented")
    from paxengine.models.fp8_checkpoint import CheckpointReader

    reader = CheckpointReader(path, raw)
    keys = {k.removeprefix("model."): k for k in reader.keys() if "mtp." in k}
    if not keys:
        raise _err(
            path,
            "the checkpoint has no MTP weights (no mtp.* tensors, e.g. mtp.fc.weight): use a "
            "checkpoint that ships its MTP layer, or method 'ngram'",
        )
    moe = (0,) if target_config.moe_layers else ()  # Qwen3.5-MoE's MTP layer is an MoE one
    mc = dataclasses.replace(
        target_config, num_layers=1, layer_types=("full_attention",), moe_layers=moe, name="mtp"
    )
    shapes = qwen3_5.param_shapes(mc)["layers"][0]
    h = mc.hidden_size
    shapes.update(fc=(2 * h, h), norm_embed=(h,), norm_hidden=(h,), final_norm=(h,))
    names = {**_HEAD, **{"layers.0." + k: v for k, v in qwen3_5.layer_names(mc, 0).items()}}
    layer = _experts(reader, keys, mc, shapes, path) if moe else {}
    head = {}
    for name, (ours, transpose) in names.items():
        key = keys.get("mtp." + name)
        if key is None:
            raise _err(path, f"the checkpoint lacks mtp.{name}")
        a = reader.weight(key, False)  # float32 (an FP8 tensor dequantized)
        a = a.reshape(a.shape[0], -1).T if transpose else a  # checkpoints keep [out, in]
        if tuple(a.shape) != tuple(shapes[ours]):
            want = shapes[ours][::-1] if transpose else shapes[ours]
            got = a.shape[::-1] if transpose else a.shape
            raise _err(path, f"mtp.{name} has shape {tuple(got)}, expected {tuple(want)}")
        a = a + 1.0 if ours in _ZERO_CENTRED else a
        (layer if name.startswith("layers.") else head)[ours] = a
    log.info(
        "MTP layer of %s: 1 full-attention layer, drafts from the target's hidden states", path
    )
    return MtpHead(mc, {**head, "layers": layer}, str(path))


def _experts(reader, keys: dict, mc: ModelConfig, shapes: dict, path) -> dict:
    """An MoE MTP layer's expert stacks {e_gate, e_up, e_down: [E, in, out]}, from per-expert
    tensors or fused [E, ...] ones (qwen3_moe.expert_tensor), checked against `shapes`."""
    prefix = "mtp.layers.0.mlp.experts."
    experts, layer = {}, {}
    for k in (k for k in keys if k.startswith(prefix)):
        qwen3_moe.expert_tensor(experts, k.removeprefix(prefix), reader.weight(keys[k], False))
    try:
        qwen3_moe.stack_layer_experts(layer, experts, 0, mc)
    except ValueError as e:
        raise _err(path, f"mtp.{e}") from None
    for ours in ("e_gate", "e_up", "e_down"):
        if ours not in layer:
            raise _err(path, f"the checkpoint lacks the MTP layer's experts ({ours})")
        if tuple(layer[ours].shape) != tuple(shapes[ours]):
            raise _err(
                path, f"the MTP layer's {ours} stack is {layer[ours].shape}, not {shapes[ours]}"
            )
    return layer


def mtp_layer(params, cfg: ModelConfig, tokens, positions, hidden, kv_cache, attend):
    """tokens [T] (each the token after its row's position), hidden [T, H] (the target's final
    hidden state there, or the layer's own output) -> (normed output [T, H] for the LM head and
    as the next position's hidden state, itself again, kv_cache: its one layer, layer 0)."""
    w, eps = params["layers"], cfg.rms_norm_eps
    emb = rms_norm(params["embed"][tokens], params["norm_embed"], eps)
    h = rms_norm(hidden, params["norm_hidden"], eps).astype(emb.dtype)
    x = linear(jnp.concatenate([emb, h], axis=-1), params["fc"])
    rope = rope_for(cfg, positions)
    o, kv_cache = qwen3_5._full_attention(
        cfg, w, rms_norm(x, w["attn_norm"], eps), rope, kv_cache, attend
    )
    x = x + linear(o.astype(x.dtype), w["wo"])
    x = x + qwen3_5.mlp(cfg, w, rms_norm(x, w["mlp_norm"], eps)).astype(x.dtype)
    out = rms_norm(x, params["final_norm"], eps)
    return out, out, kv_cache


class MtpRunner(Eagle3Runner):
    """Eagle3Runner over the MTP layer: drafts are the target LM head's argmax."""

    KIND = "mtp"

    def _layer(self, params, tokens, positions, hidden, kv_cache, attend):
        return mtp_layer(params, self.cfg, tokens, positions, hidden, kv_cache, attend)

    def _drafts(self, params, out):
        logits = qwen3_5.compute_logits(params, self.cfg, out)
        return logits, jnp.argmax(logits, axis=-1).astype(jnp.int32)


class MtpProposer(Eagle3Proposer):
    """Eagle3Proposer's rounds (a row at position p feeds the token at p + 1) over the MTP layer,
    which shares the target's embedding and LM head."""

    def __init__(self, head: MtpHead, target, spec, *, dtype, **kw):
        self._init_state(
            spec, kw["block_size"], kw["max_model_len"], kw["token_buckets"], kw["seq_buckets"]
        )
        put = lambda a: jnp.asarray(a, dtype)  # noqa: E731
        p = head.params
        params = {k: put(v) for k, v in p.items() if k != "layers"}
        params["layers"] = {k: put(v) for k, v in p["layers"].items()}
        params["embed"] = target.params["embed"]
        if "lm_head" in target.params:
            params["lm_head"] = target.params["lm_head"]
        c0 = compile_count()
        self.runner = MtpRunner(params, head.config, target, False, kv_dtype=dtype, **kw)
        self.compiles = compile_count() - c0
