"""Engine configuration: one dataclass, set from YAML and/or keyword overrides."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

AUTO = "auto"  # a setting the engine fills in for its device class (paxengine/device_defaults.py)


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    tokenizer: str | None = None  # defaults to the model's own
    dtype: str = "auto"  # auto | float32 | bfloat16 (auto: bf16 on GPU, fp32 on CPU)
    # None: min(model's max positions, 8192); "auto" (or -1): the model's whole length, or what
    # the KV pool holds if less (vLLM's); "32k" / "32K": 32,000 / 32,768 (max_model_len_option)
    max_model_len: int | str | None = None
    # None: the device class's default (paxengine/device_defaults.py: 512 / 8,192 on a GPU,
    # 64 / 2,048 elsewhere)
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    # while requests decode, a step's tokens (decodes first, then prompt chunks) stay under this:
    # it bounds how long a prefill stalls their next token; None: max_num_batched_tokens;
    # "auto" (the server's default): the device class's (512 on a GPU, 16 on a CPU)
    decode_step_token_budget: int | str | None = None
    # the largest cap while prompts wait to prefill: decode_step_token_budget doubles up to it
    # as the waiting prompt tokens reach 2x each doubled cap (scheduler._decoding_step_budget):
    # a burst of arrivals is prefilled in large steps (its TTFT tail), a trickle in small ones;
    # "auto" (the server's default): 4,096 on a GPU, none on a CPU
    backlog_step_token_budget: int | str | None = None
    # tokens per KV page; None: 64 for an fp8 cache (its V pages then stored [head_dim, 64], a
    # page per attention block: kernels_pallas.layout.v_transposed), 16 otherwise
    block_size: int | None = None
    num_kv_blocks: int | None = None  # explicit pool size; else from the memory budget
    # vLLM 0.26's default (its log: "the current --gpu-memory-utilization=0.9200"); at 0.9 our
    # KV held 87,376 Qwen3-30B-A3B tokens to its 129,680 (benchmarks/results/gpu_2026-12-07f/)
    gpu_memory_utilization: float = 0.92
    kv_cache_memory_bytes: int | None = None  # byte budget for the KV pool (CPU default: 512 MiB)
    enable_prefix_caching: bool = True
    # auto (= model dtype) | float32 | bfloat16 | fp8; a bf16 cache keeps V pages in fp16
    kv_cache_dtype: str = "auto"
    # an fp8 KV cache's per-layer K/V scales: auto (the checkpoint's kv_cache_scheme, else
    # calibrated) | calibrate (one forward over a built-in text) | unit (1.0)
    kv_cache_scales: str = "auto"
    quantization: str | None = None  # None | fp8
    attention_backend: str = (
        "auto"  # auto (pallas on GPU, xla elsewhere) | xla | pallas | reference
    )
    layer_loop: str = "auto"  # auto (unroll on GPU, scan elsewhere) | unroll | scan
    # devices one model is split over (Megatron-style, paxengine/parallel.py): must divide the
    # attention heads and the intermediate size; KV heads are copied when there are fewer
    tensor_parallel_size: int = 1
    # MoE models (vLLM's flag): each of the tensor_parallel_size devices holds num_experts / N
    # whole experts instead of 1/N of every expert's channels (parallel.py)
    enable_expert_parallel: bool = False
    # replicas of the model behind one AsyncEngine-like client (paxengine/data_parallel.py), each
    # on its own tensor_parallel_size devices; requests go where their prefix is cached
    data_parallel_size: int = 1
    first_device: int = 0  # this engine's first device (replica r: r * tensor_parallel_size)
    # several hosts, one process each (the names of jax.distributed.initialize); every process
    # runs the same LLM script over one mesh of all their devices (offline, SPMD)
    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0
    dispatch_thread: bool = False  # launch steps from a worker thread (see EngineCore.step)
    # build the few buckets that serve any step first (step_build.first_buckets) and the others on
    # a background thread while serving: a cold start is ready sooner, and until a bucket is
    # built its steps run in the smallest built one that holds them (padded, slower)
    background_compile: bool = False
    # run every compiled step once before serving (None: on a GPU, where an executable's first
    # run loads its kernels, 30-165 ms for an 8B bucket; on the CPU that first run costs little)
    prime_steps: bool | None = None
    # structured output (JSON schemas, regexes, grammars, forced tool calls): compiles 3 more
    # samplers per sequence bucket at start-up (~0.7 s each on a CPU); off, constrained requests
    # are refused with a 400
    structured_outputs: bool = True
    seed: int = 0
    # the name responses carry; vLLM's list form: the first answers, the others are accepted too
    served_model_name: str | list[str] | None = None
    compilation_cache_dir: str | None = None  # default ~/.cache/paxengine/jax
    # keep compiled step executables under compilation_cache_dir/executables: a restart with the
    # same code, model and configuration loads them instead of tracing and compiling
    store_executables: bool = True
    weights_cache_dir: str | None = None  # default ~/.cache/paxengine/weights
    token_buckets: list[int] | None = None  # derived from max_num_batched_tokens when None
    seq_buckets: list[int] | None = None  # derived from max_num_seqs when None
    max_waiting_requests: int = 1024  # AsyncEngine refuses requests (503) while this many wait
    # ... or while the prompts waiting hold this many tokens (None: no bound): a burst of long
    # prompts is refused early instead of queueing minutes of prefill
    max_waiting_tokens: int | None = None
    # "fcfs": arrival order; "priority": requests' `priority` (lower first, then arrival), and
    # when KV blocks run out the lowest-priority running request is preempted first
    scheduling_policy: str = "fcfs"
    # speculative decoding, vLLM's keys (paxengine/spec_decode): {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 4,
    # "disable_by_batch_size": 16}, or a draft model: {"model": <any --model source>,
    # "num_speculative_tokens": k}; a dict or its JSON text; None: off
    speculative_config: dict | str | None = None
    # disaggregated prefill, vLLM's keys (paxengine/disagg): {"kv_role": "kv_both",
    # "prefill_device": 0, "decode_device": 1, "max_blocks_per_copy": 256}: a prefill engine and
    # a decode engine in this process, KV pages copied device to device; a dict or its JSON text
    kv_transfer_config: dict | str | None = None
    # vLLM's --hf-overrides: an object merged into the checkpoint's config.json before the
    # model's config is built (nested objects key by key), e.g. YaRN for long contexts:
    # {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
    # "original_max_position_embeddings": 32768}}; a dict or its JSON text; None: none
    hf_overrides: dict | str | None = None
    show_progress: bool = True

    @classmethod
    def fields(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        unknown = set(d) - cls.fields()
        if unknown:
            raise ValueError(f"unknown engine config keys: {sorted(unknown)}")
        return cls(**d)

    def replace(self, **overrides) -> "EngineConfig":
        unknown = set(overrides) - self.fields()
        if unknown:
            raise ValueError(f"unknown engine config keys: {sorted(unknown)}")
        return dataclasses.replace(self, **overrides)


def load_yaml(path: str | Path) -> dict:
    """Read a config YAML as a flat dict (engine keys and server keys together)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
    return {k.replace("-", "_"): v for k, v in data.items()}


def json_object_option(raw, name: str) -> dict | None:
    """An option given as a dict or its JSON text (a flag, a YAML key) -> a copy of the dict;
    None or {} -> None. Raises ValueError naming the option."""
    if raw is None:
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{name}: expected a JSON object, got {type(raw).__name__}")
    return dict(raw) if raw else None


_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30}


def token_count(raw, name: str) -> int | None:
    """A count of tokens as vLLM reads one (its human_readable_int): an int, or digits with
    k / m / g (powers of 1000, decimals taken: 25.6k = 25,600) or K / M / G (powers of 1024,
    whole numbers: 1K = 1,024). None stays None. Raises ValueError naming the option."""
    if raw is None or isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    text = str(raw).strip()
    try:
        if text and text[-1] in _DECIMAL:
            return int(round(float(text[:-1]) * _DECIMAL[text[-1]]))
        if text and text[-1] in _BINARY:
            return int(text[:-1]) * _BINARY[text[-1]]
        return int(text)
    except ValueError:
        raise ValueError(
            f"{name}: expected a number of tokens (131072, 128k or 128K), got {raw!r}"
        ) from None


_BYTE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def byte_count(raw, name: str) -> int | None:
    """A count of bytes as vLLM's --kv-cache-memory-bytes takes one: an int, or digits with a
    k / M / G / T suffix (powers of 1000; KiB .. TiB: 1024), a trailing B allowed. None stays
    None. Raises ValueError naming the option."""
    if raw is None or isinstance(raw, int) and not isinstance(raw, bool) and raw > 0:
        return raw
    t = str(raw).strip().lower().removesuffix("b")
    binary = t.endswith("i")
    t = t.removesuffix("i")
    unit = t[-1] if t and t[-1] in _BYTE_UNITS else ""
    try:
        n = float(t[: len(t) - len(unit)])
    except ValueError:
        n = 0.0
    if isinstance(raw, bool) or n <= 0 or binary and not unit:
        raise ValueError(f"{name}: expected a byte count like 8000000000, 8G or 8GiB, got {raw!r}")
    return int(n * (1024 ** ("kmgt".index(unit) + 1) if binary else _BYTE_UNITS[unit]))


def max_model_len_option(raw) -> int | str | None:
    """max_model_len: a token count (`token_count`), None (the default: the model's length up
    to 8,192), or "auto" / -1 (vLLM's: the model's whole length, or as much of it as the KV
    pool holds)."""
    if str(raw).strip().lower() in ("auto", "-1"):
        return "auto"
    n = token_count(raw, "max_model_len")
    if n is not None and n < 1:
        raise ValueError(
            f"max_model_len: must be a positive number of tokens, or auto; got {raw!r}"
        )
    return n


def resolve_max_model_len(want: int | str | None, model_len: int) -> int:
    """The served length for `max_model_len_option`'s value and the model's derived length
    (auto: the model's, which the engine then cuts to its KV pool). Past the model's length is
    refused as vLLM refuses it, unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (then served with a
    warning: positions past the trained length may give wrong outputs)."""
    if want == "auto":
        return model_len
    if want is None:
        return min(model_len, 8192)
    if want > model_len:
        what = (
            f"max_model_len {want} is past the model's {model_len} (max_position_embeddings, "
            "or YaRN's original_max_position_embeddings x factor)"
        )
        if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").lower() not in ("1", "true"):
            raise ValueError(
                f"{what}; set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to serve it anyway (positions "
                "past the model's length may give wrong outputs), or leave max_model_len out"
            )
        logging.getLogger("paxengine").warning(
            "%s: served, as VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 asks", what
        )
    return want
