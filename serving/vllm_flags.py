"""`vllm serve` flags of the recipes (vLLM's, Qwen's model cards) that paxengine takes as what it
does anyway, or refuses with the reason: a recipe's command line either starts the server or
says which flag to drop and why, instead of argparse's "unrecognized arguments".

Taken (logged at start-up): what the flag asks for is how paxengine always runs. Refused: the
flag is about a part paxengine does not have (a vision encoder, torch.compile, vLLM's MoE
kernels), so accepting it would pretend to honour it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from paxengine.config import json_object_option

TEXT_ONLY = "paxengine serves a multimodal checkpoint's text model alone (no vision encoder)"
LOCAL_ONLY = (
    "paxengine loads --model from a local directory or file as it is (no hub downloads, so no "
    "other revision to fetch)"
)
NO_CHUNK_CAP = (
    "no per-prompt chunk cap: paxengine prefills the waiting prompts together within "
    "--max-num-batched-tokens, and --decode-step-token-budget bounds a step while requests "
    "decode"
)

# switches (store_true): what paxengine does instead of needing the flag
ALWAYS = {
    "language_model_only": "the text model alone is what paxengine serves (vision weights are "
    "skipped; an image or video part is a 400)",
    "trust_remote_code": "paxengine runs no code from checkpoints: nothing to trust",
    "async_scheduling": "paxengine always schedules the next step while the device runs the last",
    "enable_chunked_prefill": "paxengine always chunks prompts (--max-num-batched-tokens a step)",
    "disable_log_requests": "paxengine logs no request's prompt or output (unless "
    "--enable-log-requests)",
    "disable_log_stats": "paxengine logs no periodic throughput lines (the numbers are on "
    "/metrics)",
    "enable_prompt_tokens_details": "paxengine always reports usage.prompt_tokens_details."
    "cached_tokens (the prompt tokens the prefix cache served), as OpenAI's API does",
    "disable_cascade_attn": "paxengine has no cascade attention (a shared prefix is shared "
    "through the prefix cache's blocks)",
    "enable_request_id_headers": "paxengine answers every request with X-Request-Id (the "
    "client's own when usable, else a fresh one)",
}
# flags with a value: the values paxengine runs as it is, and what it does
VALUES = {
    "tokenizer_mode": (("auto", "hf"), "the tokenizers library reads tokenizer.json"),
    "load_format": (
        ("auto", "safetensors", "gguf", "dummy"),
        "the model source's format is read from it; dummy: random weights of its config.json",
    ),
    "chat_template_content_format": (("auto", "string"), "messages reach the template as text"),
    "pipeline_parallel_size": (("1",), "one pipeline stage (-tp / -dp split the model's work)"),
    # Qwen3.5's recurrent layers (vLLM's "mamba" cache)
    "mamba_ssm_cache_dtype": (("auto",), "the recurrent states are kept in the model's dtype"),
    "mamba_cache_mode": (
        ("align",),
        "a cached prefix's recurrent state is kept at a block boundary (vLLM's align mode)",
    ),
    "distributed_executor_backend": (
        ("mp", "uni"),
        "paxengine's engine runs in a process of its own beside the server's (no Ray)",
    ),
    # the hub's: paxengine reads a local directory or file (--model) as it is
    **{
        name: (("main",), LOCAL_ONLY)
        for name in ("revision", "code_revision", "tokenizer_revision")
    },
    # vLLM V1 caps one prompt's chunk a step at long_prefill_token_threshold (4% of
    # max_model_len once max_num_partial_prefills > 1)
    "max_num_partial_prefills": (("1",), NO_CHUNK_CAP),
    "max_long_partial_prefills": (("1",), NO_CHUNK_CAP),
    "long_prefill_token_threshold": (("0",), NO_CHUNK_CAP),
}
# flags whose every value is taken: what paxengine does whatever it says
ANY_VALUE = {
    "swap_space": "a preempted request is recomputed, not swapped to the CPU (as in vLLM V1)",
}
# vLLM's attention backends (--attention-backend NAME): paxengine's own kernels serve instead
VLLM_ATTENTION_BACKENDS = (
    "FLASH_ATTN",
    "FLASHINFER",
    "TRITON_ATTN",
    "FLEX_ATTENTION",
    "FLASH_ATTN_MLA",
    "FLASHMLA",
    "FLASHINFER_MLA",
    "TRITON_MLA",
    "CUTLASS_MLA",
)
MULTI_HOST = (
    "serving over several hosts is not implemented: one server a host (--data-parallel-size "
    "within it), or the offline LLM over hosts (SPMD)"
)
KERNELS = "vLLM's kernel choices; paxengine picks its own kernels (kernels_pallas/README.md)"
NO_LORA = (
    "LoRA adapters are not implemented: paxengine serves the checkpoint's own weights (merge an "
    "adapter into them to serve it)"
)
REFUSED = {
    "enforce_eager": "paxengine's steps are XLA executables compiled before serving; it has no "
    "eager mode (--no-background-compile builds every bucket before the first request)",
    "compilation_config": "vLLM's torch.compile / CUDA graph settings; paxengine compiles XLA "
    "executables per step bucket (--token-buckets, --seq-buckets)",
    "moe_backend": "vLLM's MoE kernels; paxengine's grouped expert kernel is its own",
    "max_cudagraph_capture_size": "vLLM's CUDA graphs; paxengine's decode steps are XLA "
    "executables per sequence bucket (--seq-buckets)",
    "cpu_offload_gb": "paxengine keeps every weight on the devices",
    "enable_sleep_mode": "paxengine's engine does not release its device memory while idle",
    "mm_encoder_tp_mode": TEXT_ONLY,
    "mm_processor_cache_gb": TEXT_ONLY,
    "mm_processor_cache_type": TEXT_ONLY,
    "mm_processor_kwargs": TEXT_ONLY,
    "additional_config": "vLLM's platform plugins' options; paxengine has none",
    "kernel_config": KERNELS,
    "linear_backend": KERNELS,
    "logits_processors": "custom logits processors (Python classes) are not loaded",
    "tool_server": "gpt-oss's built-in tools (a tool server) are not served",
    "reasoning_config": "paxengine's reasoning parsers (--reasoning-parser) know their markers",
    "nnodes": MULTI_HOST,
    "node_rank": MULTI_HOST,
    "master_addr": MULTI_HOST,
    "master_port": MULTI_HOST,
    "headless": MULTI_HOST,
    "download_dir": "paxengine downloads nothing: --model names a local directory or file",
    "enable_lora": NO_LORA,
    "lora_modules": NO_LORA,
    "max_loras": NO_LORA,
    "max_lora_rank": NO_LORA,
    "middleware": "paxengine imports no code named on its command line into its server (put a "
    "proxy in front of it for what the middleware does)",
    "enable_ssl_refresh": "paxengine reads the TLS certificate files at start-up; restart it to "
    "serve renewed ones",
}
# refused switches whose --no- form asks for what paxengine does: taken
TAKEN_OFF = {
    "enable_lora": NO_LORA,
    "enable_ssl_refresh": "the TLS certificate files are read once, at start-up",
}
# refused flags that take several values as vLLM's do
NARGS = {"lora_modules": "*"}
# vLLM's names of paxengine's own flags: the value goes to paxengine's key
ALIASES = {"num_gpu_blocks_override": "num_kv_blocks"}


def add_to(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("vLLM's flags taken as paxengine runs, or refused with why")
    for name, what in ALWAYS.items():
        flag = "--" + name.replace("_", "-")
        g.add_argument(flag, action="store_true", default=None, help=f"taken: {what}")
        # vLLM's --no- form: refused by apply(), it cannot be turned off
        g.add_argument("--no-" + flag[2:], dest=name, action="store_false", help=argparse.SUPPRESS)
    for name, (values, what) in VALUES.items():
        flag = "--" + name.replace("_", "-")
        # values checked by apply(), whose refusal says why
        g.add_argument(flag, metavar="{" + ",".join(values) + "}", help=f"taken: {what}")
    for name, what in ANY_VALUE.items():
        g.add_argument("--" + name.replace("_", "-"), metavar="X", help=f"taken: {what}")
    g.add_argument(
        "--limit-mm-per-prompt",
        metavar="JSON",
        help='taken when every limit is 0 (\'{"image": 0, "video": 0}\': text only); ' + TEXT_ONLY,
    )
    for name, why in REFUSED.items():
        flag = "--" + name.replace("_", "-")  # a switch or with a value: refused either way
        more = {"nargs": NARGS[name]} if name in NARGS else {"nargs": "?", "const": True}
        g.add_argument(flag, **more, metavar="X", help=f"refused: {why}")
    for name, what in TAKEN_OFF.items():
        flag = "--no-" + name.replace("_", "-")
        g.add_argument(flag, dest=name, action="store_false", help=f"taken: {what}")
    for name, ours in ALIASES.items():
        g.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            metavar="N",
            help=f"taken as --{ours.replace('_', '-')}",
        )


def apply(keys: dict) -> list[str]:
    """Takes this module's flags out of `keys` (parsed flags or YAML keys, `_` names): refuses
    one (ValueError naming it and why), or drops it, saying what paxengine does instead (the
    lines returned, for the start-up log). --load-format dummy makes the model its config's
    random weights (`dummy:DIR/config.json`), served under DIR's name with DIR's tokenizer."""
    notes = []
    for name in list(keys):
        value = keys.get(name)
        if name == "attention_backend" and str(value) in VLLM_ATTENTION_BACKENDS:
            del keys[name]  # paxengine's --attention-backend chooses among its own kernels
            notes.append(f"--attention-backend {value}: vLLM's; paxengine's own kernels serve")
            continue
        if value is None or name not in (
            *ALWAYS,
            *VALUES,
            *ANY_VALUE,
            *REFUSED,
            *ALIASES,
            "limit_mm_per_prompt",
        ):
            continue
        flag = "--" + name.replace("_", "-")
        if name in ALIASES:
            ours = ALIASES[name]
            if keys.get(ours) not in (None, value):
                raise ValueError(
                    f"{flag} {value} and --{ours.replace('_', '-')} {keys[ours]}: the same "
                    "setting twice"
                )
            keys[ours] = keys.pop(name)
            notes.append(f"{flag} {value}: taken as --{ours.replace('_', '-')} {value}")
            continue
        if name in TAKEN_OFF and value is False:
            del keys[name]
            notes.append(f"--no-{flag[2:]}: {TAKEN_OFF[name]}")
            continue
        if name in REFUSED:
            raise ValueError(f"{flag}: refused: {REFUSED[name]}")
        del keys[name]
        if name in ALWAYS:
            if value is not True:
                raise ValueError(f"{flag}: {ALWAYS[name]}; it cannot be turned off")
            notes.append(f"{flag}: {ALWAYS[name]}")
        elif name in ANY_VALUE:
            notes.append(f"{flag} {value}: {ANY_VALUE[name]}")
        elif name == "limit_mm_per_prompt":
            notes.append(f"{flag}: {_text_only(value, flag)}")
        else:
            values, what = VALUES[name]
            if str(value) not in values:
                raise ValueError(f"{flag}: {value!r} is refused, {list(values)} taken: {what}")
            if name == "load_format" and value == "dummy":
                model = keys.get("model")
                keys["model"] = _dummy_model(model, flag)
                if not keys.get("tokenizer") and (Path(model) / "tokenizer.json").is_file():
                    keys["tokenizer"] = str(model)  # vLLM's dummy weights keep the tokenizer
                keys.setdefault("served_model_name", str(model))  # and the model's name
            notes.append(f"{flag} {value}: {what}")
    return notes


def _text_only(value, flag: str) -> str:
    limits = json_object_option(value, flag) or {}
    if any(v != 0 for v in limits.values()):
        raise ValueError(f"{flag}: only limits of 0 are taken ({TEXT_ONLY}), got {value!r}")
    return f"no {', '.join(sorted(limits)) or 'media'} inputs: {TEXT_ONLY}"


def _dummy_model(model, flag: str) -> str:
    config = Path(str(model or "")) / "config.json"
    if not model or not config.is_file():
        raise ValueError(f"{flag} dummy: needs a model directory with a config.json, got {model!r}")
    return f"dummy:{config}"
