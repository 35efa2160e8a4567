"""What EngineCore settles before it serves: the config checked (before anything loads), the
loaded params made ready for the runner (FP8 KV scales, tensor-parallel head copies, the layer
layout), and the start-up log lines that say what runs."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp

import kernels_pallas.layout
from paxengine import device_defaults, kv_scales, parallel
from paxengine.client import ModelInfo, served_names
from paxengine.config import EngineConfig, json_object_option
from paxengine.models import registry
from paxengine.models.loader import load_model
from paxengine.models.quant import (
    GEMV_MAX_ROWS,
    W8A8_MIN_ROWS,
    fp8_units,
    w8a8_gemv_max_rows,
    weight_dtype,
)
from paxengine.models.weights import fuse_layers, is_per_layer, unstack_layers
from paxengine.runner import resolve_layer_loop
from paxengine.scheduler import Scheduler, check_policy
from paxengine.spec_decode.chain import ChainSpec

log = logging.getLogger("paxengine")

DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "fp8": jnp.float8_e4m3fn,
}


@dataclass(frozen=True)
class Checked:
    """The config's choices, resolved for this machine."""

    dtype: str  # the model's compute dtype name
    quantization: str | None  # None or "fp8"
    kv_dtype_name: str  # "fp8" or a DTYPES name
    on_gpu: bool
    block_size: int  # tokens per KV page

    @property
    def kv_dtype(self):
        return DTYPES[self.kv_dtype_name]


def check_role(cfg: EngineConfig) -> None:
    """What one EngineCore is not: a data-parallel group or a disaggregated pair (checked before
    the distributed runtime starts)."""
    if cfg.data_parallel_size != 1:
        raise ValueError(
            "an EngineCore (and LLM) runs one replica: data_parallel_size > 1 is served by "
            "paxengine.data_parallel.DataParallelEngine (`paxengine serve "
            "--data-parallel-size N`)"
        )
    if cfg.kv_transfer_config:
        raise ValueError(
            "an EngineCore runs prefill and decode together: kv_transfer_config is served by "
            "paxengine.disagg (LLM(kv_transfer_config=...) or `paxengine serve "
            "--kv-transfer-config JSON`)"
        )


def check_config(cfg: EngineConfig, on_gpu: bool) -> Checked:
    """Every other setting one engine cannot run, refused by name before the model loads."""
    cfg = device_defaults.resolve(cfg, on_gpu)  # as EngineCore runs it
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    if dtype not in DTYPES or dtype == "fp8":
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {cfg.dtype!r}")
    quantization = None if cfg.quantization in (None, "none") else cfg.quantization
    if quantization not in (None, "fp8"):
        raise ValueError(
            f"quantization {cfg.quantization!r} is not supported: none or fp8 (online, "
            "per-output-channel e4m3 weights)"
        )
    kv_dtype_name = dtype if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype
    kv_dtype_name = "fp8" if kv_dtype_name == "fp8_e4m3" else kv_dtype_name  # vLLM's other name
    if kv_dtype_name not in DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be auto, float32, bfloat16 or fp8 (fp8_e4m3), got "
            f"{cfg.kv_cache_dtype!r}"
        )
    block_size = cfg.block_size or default_block_size(kv_dtype_name)
    if block_size < 1:
        raise ValueError(f"block_size must be a positive number of tokens, got {cfg.block_size}")
    max_tokens = cfg.max_num_batched_tokens
    if max_tokens < cfg.max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens ({max_tokens}) must be >= max_num_seqs ({cfg.max_num_seqs})"
        )
    budget, backlog = cfg.decode_step_token_budget, cfg.backlog_step_token_budget
    for name, v in (("decode_step_token_budget", budget), ("backlog_step_token_budget", backlog)):
        if v is not None and not isinstance(v, int):  # "auto" is resolved by now
            raise ValueError(f"{name} must be a number of tokens or 'auto', got {v!r}")
    if budget is not None and not 1 <= budget <= max_tokens:
        raise ValueError(
            f"decode_step_token_budget ({budget}) must be in [1, max_num_batched_tokens "
            f"({max_tokens})]"
        )
    if backlog is not None and (budget is None or not budget <= backlog <= max_tokens):
        raise ValueError(
            f"backlog_step_token_budget ({backlog}) needs decode_step_token_budget and must be "
            f"in [decode_step_token_budget ({budget}), max_num_batched_tokens ({max_tokens})]"
        )
    if cfg.enable_expert_parallel and cfg.tensor_parallel_size < 2:
        # vLLM's EP spans its data-parallel ranks too; here the replicas hold whole models
        raise ValueError(
            "enable_expert_parallel splits the experts over the tensor-parallel devices: it "
            f"needs tensor_parallel_size > 1, got {cfg.tensor_parallel_size}"
        )
    check_policy(cfg.scheduling_policy)
    json_object_option(cfg.hf_overrides, "hf_overrides")  # an object, or refused by name now
    return Checked(dtype, quantization, kv_dtype_name, on_gpu, block_size)


def default_block_size(kv_dtype_name: str) -> int:
    """Tokens per KV page where the config leaves it: 64 for fp8 caches, whose V pages are then
    stored [D, 64] and read a page per attention block (1.2-1.27x faster decode attention on
    the H200 than 16-token pages: kernels_pallas.layout.v_transposed), else vLLM's 16."""
    return kernels_pallas.layout.V_TRANSPOSED_BLOCK if kv_dtype_name == "fp8" else 16


@dataclass
class Prepared:
    params: dict
    kv_scales: object  # per-layer (k, v) scales of an fp8 cache, else None
    scales_from: str | None  # where they came from (kv_scales.choose)
    tp: object  # parallel.TensorParallel or None
    store: object  # the executable store, or None where it cannot serve this process


def prepare_params(cfg: EngineConfig, checked: Checked, loaded, tokenizer, store) -> Prepared:
    """The loaded params as the runner takes them: an fp8 cache's per-layer scales beside the
    layers, KV heads copied for tensor parallelism, the per-layer split where the layers are
    unrolled (before the KV pool is sized: no stacked copy may stay behind). On a mesh the
    params arrive on the host, are laid out there, and each device takes only its shards
    (parallel.shard_params), before the KV plan reads what the weights left free."""
    params = loaded.params
    scales, scales_from = kv_scales.choose(
        cfg.kv_cache_scales,
        checked.kv_dtype_name == "fp8",
        loaded.kv_scales,
        params,
        loaded.config,
        tokenizer,
    )
    if scales is not None:  # per layer, applied by the attention (attention.py)
        params = {**params, "layers": with_kv_scales(params["layers"], scales, loaded.config)}
        log.info("fp8 KV cache, %s scales: %s", scales_from, kv_scales.describe(scales))
    tp = parallel.make_tensor_parallel(
        cfg.tensor_parallel_size, loaded.config, cfg.first_device, cfg.enable_expert_parallel
    )
    if tp is not None:
        params = parallel.copy_kv_heads(params, loaded.config, tp)
        layout = getattr(registry.family(loaded.config), "tp_layout", None)
        if layout is not None:  # a family's fused channels in per-shard order (Qwen3.5)
            params = layout(params, loaded.config, tp)
    if jax.process_count() > 1 and store is not None:
        log.info("several processes: the executable store is off (one-process executables)")
        store = None
    if resolve_layer_loop(cfg.layer_loop) == "unroll":
        params = unstack_layers(params, shards=tp.size if tp is not None else 1)
    fused = getattr(registry.family(loaded.config), "FUSED", None)
    if fused and is_per_layer(params):  # a family of its own layout (Qwen3.5): its fusions
        shards = tp.size if tp is not None else 1
        whole = parallel.EXPERTS if tp is not None and tp.expert_parallel else ()
        params = fuse_layers(params, fused, shards, whole)
    if tp is not None:
        params = parallel.shard_params(params, tp)
    return Prepared(params, scales, scales_from, tp, store)


def with_kv_scales(layers, scales, model_config):
    """Each attention layer's (k_scale, v_scale) beside its weights: a stacked [L, 2] entry, or
    in the per-layer dicts of a family of its own layout (a hybrid's attention layers only)."""
    if not isinstance(layers, list):
        return {**layers, "kv_scale": jnp.asarray(scales)}
    layers = list(layers)
    for row, i in enumerate(model_config.attention_layers):
        layers[i] = {**layers[i], "kv_scale": jnp.asarray(scales[row])}
    return layers


def log_weights(params, prequantized, on_gpu: bool) -> None:
    """Say what the projections run as: FP8 where the weights are e4m3, and where that is a
    correctness path only (no FP8 tensor cores)."""
    if weight_dtype(params) != "fp8_e4m3":
        return
    if on_gpu and not fp8_units():
        log.warning(
            "fp8 weights on %s, which has no FP8 tensor cores: every matmul upcasts them "
            "(half the weight memory, not faster)",
            jax.devices()[0].device_kind,
        )
        return
    log.info(
        "%s weights (%s): e4m3 projections with per-output-channel scales; buckets of >= %d "
        "tokens run FP8 GEMMs with per-token activation scales, %s%s",
        weight_dtype(params),
        f"from the checkpoint: {prequantized}" if prequantized else "quantized online at load",
        W8A8_MIN_ROWS,
        _small_path_words() if on_gpu else "smaller ones upcast the weights",
        "" if on_gpu else "; on this CPU FP8 is a correctness path (no FP8 units): not faster",
    )


def _small_path_words() -> str:
    n = w8a8_gemv_max_rows()
    if n >= GEMV_MAX_ROWS:
        return f"<= {n} the Pallas W8A8 GEMV (e4m3 rows, fp8 x fp8 dots)"
    gemv = f"<= {GEMV_MAX_ROWS} the Pallas FP8 GEMV"
    return f"<= {n} the Pallas W8A8 GEMV, {gemv}" if n > 0 else gemv


def log_ready(load_seconds: float, runner, store, num_kv_blocks: int, block_size: int) -> None:
    n_exe = len(runner.compiled) + len(runner.chained) + len(runner.samplers)
    log.info(
        "model loaded in %.1f s; KV cache of %d blocks of %d tokens; %d step executables in %.1f s: %d from "
        "the store, the rest traced in %.1f s and compiled%s",
        load_seconds,
        num_kv_blocks,
        block_size,
        n_exe,
        runner.builder.compile_seconds,
        store.hits if store is not None else 0,
        runner.builder.trace_seconds,
        "; the other buckets compile in the background (until then a step may run in a larger one)"
        if runner.builder.background is not None
        else "",
    )


# the speculative methods a model with recurrent layers runs: their verify steps roll the state
# back (verify_slots); a draft model or an EAGLE-3 head would need per-model states of their own
HYBRID_SPEC_METHODS = ("ngram", "mtp")
# an MoE model of attention layers only (Qwen3-MoE): n-gram drafts, verified by its own forward
# (EAGLE-3 reads the Llama layout's auxiliary hidden states; a draft model is untested on it)
MOE_SPEC_METHODS = ("ngram",)


def check_hybrid(cfg: EngineConfig, checked: Checked, model_config, spec) -> None:
    """What a model with recurrent layers (Qwen3.5) or MoE layers (Qwen3-MoE) cannot run yet,
    refused by name. n-gram speculation runs under tensor parallelism (a hybrid's verify steps
    keep each device's heads of the per-position states in its shard of the pools); the MTP
    layer runs on one device only."""
    if cfg.enable_expert_parallel and not model_config.moe_layers:
        # vLLM ignores the flag here; a flag that changes nothing is refused instead
        raise ValueError(
            f"enable_expert_parallel needs a model with MoE layers; this {model_config.family} "
            "model has none"
        )
    if not model_config.recurrent_layers and not model_config.moe_layers:
        return
    name = model_config.family
    tp_spec = cfg.tensor_parallel_size > 1 and spec is not None
    for what, unsupported in (
        (_spec_label(model_config, spec), not _spec_runs(model_config, spec)),
        (
            "speculative_config method 'mtp' with tensor_parallel_size > 1",
            tp_spec and spec.method == "mtp",
        ),
        ("kv_transfer_config", cfg.kv_transfer_config is not None),
        ("several processes", cfg.num_processes > 1),
    ):
        if unsupported:
            raise ValueError(f"{what} is not implemented for {name} models yet")


def _spec_methods(model_config) -> tuple[str, ...]:
    return HYBRID_SPEC_METHODS if model_config.recurrent_layers else MOE_SPEC_METHODS


def _spec_runs(model_config, spec) -> bool:
    """load_mtp refuses MTP for models without an MTP layer by name."""
    if spec is None or spec.method == "mtp":
        return True
    return spec.method in _spec_methods(model_config)


def _spec_label(model_config, spec) -> str:
    if spec is None:
        return "speculative_config"
    only = ", ".join(_spec_methods(model_config))
    return f"speculative_config method {spec.method!r} (only {only})"


@dataclass
class Models:
    loaded: object  # models.loader's LoadedModel
    tokenizer: object
    eos_token_ids: list[int]
    draft: object  # speculative_config's draft model, or None
    eagle: object  # its EAGLE-3 speculator or MTP layer (mtp.MtpHead), or None
    load_seconds: float


def load_models(cfg: EngineConfig, checked: Checked, spec) -> Models:
    """The target model, its tokenizer (an explicit `tokenizer` wins over the model's: dummy
    weights have none) and speculative_config's draft model or EAGLE-3 speculator, loaded and
    checked before any compile."""
    t0 = time.perf_counter()
    overrides = json_object_option(cfg.hf_overrides, "hf_overrides")
    if overrides:
        log.info("hf_overrides merged into the model's config.json: %s", json.dumps(overrides))
    loaded = load_model(
        cfg.model,
        checked.dtype,
        cache_dir=cfg.weights_cache_dir,
        progress=cfg.show_progress,
        seed=cfg.seed,
        quantization=checked.quantization,
        # a mesh (tensor parallelism, or a data-parallel replica's device): the weights stay
        # on the host until each device takes its own shards (prepare_params)
        on_device=cfg.tensor_parallel_size == 1 and cfg.first_device == 0,
        hf_overrides=overrides,
    )
    load_seconds = time.perf_counter() - t0
    check_hybrid(cfg, checked, loaded.config, spec)
    tokenizer, eos = loaded.tokenizer, loaded.eos_token_ids
    if cfg.tokenizer:
        from paxengine.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_hf_dir(cfg.tokenizer, eos_token_ids=eos)
        eos = eos or list(tokenizer.eos_token_ids)
    draft = eagle = None
    if spec is not None and spec.method == "draft":
        from paxengine.spec_decode.draft_model import load_draft_model

        draft = load_draft_model(cfg, spec, loaded.config, tokenizer, checked.dtype)
    elif spec is not None and spec.method == "eagle3":
        from paxengine.spec_decode.eagle3 import load_eagle3

        eagle = load_eagle3(cfg, spec, loaded.config)
    elif spec is not None and spec.method == "mtp":  # the checkpoint's own MTP layer
        from paxengine.spec_decode.mtp import load_mtp

        eagle = load_mtp(cfg, loaded.config)
    return Models(loaded, tokenizer, eos, draft, eagle, load_seconds)


def make_drafter(
    cfg: EngineConfig, checked: Checked, spec, models: Models, runner, num_blocks, max_len
):
    """The proposer of models.draft or models.eagle (one or neither set): its pages in the
    target's block ids, its own executables; None without."""
    draft, eagle = models.draft, models.eagle
    if draft is None and eagle is None:
        return None
    shared = dict(
        dtype=DTYPES[checked.dtype],
        num_blocks=num_blocks,
        block_size=checked.block_size,
        max_model_len=max_len,
        token_buckets=runner.token_buckets,
        seq_buckets=runner.seq_buckets,
        attention_backend=cfg.attention_backend,
        show_progress=cfg.show_progress,
        store=runner.store,
    )
    if draft is not None:  # its own params and paged KV
        from paxengine.spec_decode.draft_model import DraftProposer

        drafter = DraftProposer(draft, spec, layer_loop=cfg.layer_loop, **shared)
    elif spec.method == "mtp":  # one layer of KV, the target's embedding and LM head
        from paxengine.spec_decode.mtp import MtpProposer

        drafter = MtpProposer(eagle, runner, spec, **shared)
    else:  # one layer of KV
        from paxengine.spec_decode.eagle3 import Eagle3Proposer

        drafter = Eagle3Proposer(eagle, runner, spec, **shared)
    kind = {"draft": "draft model", "eagle3": "EAGLE-3 speculator", "mtp": "MTP layer of"}
    log.info(
        "%s %s: %d step executables (%d compiled, the rest shared or stored)",
        kind[spec.method],
        spec.model or cfg.model,
        drafter.num_executables,
        drafter.compiles,
    )
    return drafter


def make_scheduler(
    cfg: EngineConfig, kv, max_model_len: int, eos_token_ids, spec, token_buckets, max_rows: int
) -> Scheduler:
    return Scheduler(
        kv,
        cfg.max_num_seqs,
        cfg.max_num_batched_tokens,
        max_model_len,
        token_buckets,
        eos_token_ids,
        decode_step_token_budget=cfg.decode_step_token_budget,
        backlog_step_token_budget=cfg.backlog_step_token_budget,
        policy=cfg.scheduling_policy,
        spec=spec,
        max_sample_rows=max_rows,
    )


def chain_spec(spec, max_num_seqs: int, tp, max_rows: int) -> ChainSpec | None:
    """Chained verify steps for n-gram speculation on one device (spec_decode/chain.py)."""
    if spec is None or spec.method != "ngram" or tp is not None:
        return None
    k = spec.num_speculative_tokens
    rows = min(spec.disable_by_batch_size, max_num_seqs, max_rows // (k + 1))
    if rows < 1:
        return None
    return ChainSpec(k, rows, spec.prompt_lookup_min, spec.prompt_lookup_max)


def model_info(
    cfg: EngineConfig, checked: Checked, name: str, max_model_len: int, runner, scales_from, blocks
) -> ModelInfo:
    """What /v1/models and the clients are told: the effective weight and KV dtypes included."""
    kv = checked.kv_dtype_name
    return ModelInfo(
        name=name,
        # --served-model-name's other names, and the model as given (vLLM answers to the names)
        aliases=tuple(served_names(cfg)[1:]) + ((str(cfg.model),) if cfg.model else ()),
        max_model_len=max_model_len,
        vocab_size=runner.cfg.vocab_size,
        dtype=checked.dtype,
        weight_dtype=weight_dtype(runner.params),
        kv_cache_dtype="fp8_e4m3" if kv == "fp8" else kv,
        kv_cache_scales=scales_from,
        kv_capacity_tokens=blocks * checked.block_size,
        buckets=tuple(sorted(runner.builder.planned)),
    )
