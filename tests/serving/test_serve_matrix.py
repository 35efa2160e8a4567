"""The serve-option matrix (issue #53): `paxengine serve` started as a user starts it (a process
of the CLI: the engine in a process of its own and background compile, the defaults) once per
row of option families, each answering a completion, a streamed chat and /health, plus what its
options promise (a JSON schema obeyed, a priority taken, a key required, drafts proposed, ...).
`test_every_serve_option_has_a_row` reads the CLI's parser: a flag with neither a row here nor
an entry in ELSEWHERE (the test that covers it, and why not here) fails it.

Small on purpose (CI: 2 cores): short context, 4 sequences, 64-token steps, mostly four of
SmolLM2's layers (devices.truncated_smollm2) where an option does not care about output quality;
the rows' steps compile into a compilation cache of this module's own (cold, as in CI)."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from devices import truncated_smollm2  # noqa: E402

from serving.cli import build_parser  # noqa: E402

KEY = "matrix-key"
NAME = "matrix-model"
NGRAM = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 2}'
)
# in every row: where it listens, this module's compilation cache (--config), small steps
COMMON = [
    "--host",
    "127.0.0.1",
    "--port",
    "{port}",
    "--config",
    "{config}",
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "64",
    "--log-level",
    "info",
]
# the repetitive prompt n-gram lookup drafts from, and any drafter's greedy run continues
COUNT = "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,"
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "yes_no", "schema": SCHEMA}}
# a greedy group -> (the first row of it that answered, its completion)
GREEDY: dict[str, tuple[str, str]] = {}


@dataclass
class Row:
    """One server: its flags beyond COMMON ({short}: the 4-layer SmolLM2's directory, {eagle3}:
    a random EAGLE-3 head for it; a first argument that is no flag is the positional MODEL),
    the simulated CPU devices it needs, and what it checks beyond the common requests."""

    args: list[str]
    check: Callable[["Server"], None]
    devices: int = 1
    key: Optional[str] = None  # the --api-key the requests carry
    xfail: Optional[str] = None  # a known bug outside this test's reach (strict)
    model: str = NAME
    # rows of one group serve the same weights in the same dtype: one greedy completion
    greedy: Optional[str] = None


@dataclass
class Server:
    name: str
    row: Row
    base: str
    log: Path
    http: httpx.Client
    client: object = None  # openai.OpenAI

    def metrics(self) -> str:
        r = self.http.get("/metrics")
        assert r.status_code == 200
        return r.text


def _metric(text: str, name: str, **labels) -> float:
    """The sum of `name`'s samples (with these labels) in a Prometheus text page."""
    total, seen = 0.0, False
    for line in text.splitlines():
        m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})? ([^ ]+)$", line)
        if not m or m.group(1) != name:
            continue
        if any(f'{k}="{v}"' not in (m.group(2) or "") for k, v in labels.items()):
            continue
        total, seen = total + float(m.group(3)), True
    assert seen, f"{name} {labels or ''} not in /metrics"
    return total


def _drafts(s: Server) -> tuple[float, float]:
    """(draft tokens proposed, accepted) so far, after a greedy run of the counting prompt."""
    out = s.client.completions.create(model=s.row.model, prompt=COUNT, max_tokens=16, temperature=0)
    assert out.choices[0].text and out.usage.completion_tokens == 16
    text = s.metrics()
    return (
        _metric(text, "paxengine:spec_decode_num_draft_tokens_total"),
        _metric(text, "paxengine:spec_decode_num_accepted_tokens_total"),
    )


def _json_schema_answer(s: Server):
    return s.client.chat.completions.create(
        model=s.row.model,
        messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
        max_tokens=16,
        temperature=0,
        response_format=RESPONSE_FORMAT,
    )


def _bad_request(s: Server, body: dict, path: str = "/v1/chat/completions") -> dict:
    r = s.http.post(path, json={"model": s.row.model, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    return r.json()["error"]


# ------------------------------------------------------------------------------ row checks


def check_ngram_structured(s: Server) -> None:
    """n-gram speculation proposes and gets drafts accepted on a repetitive prompt; a JSON schema
    is obeyed (structured outputs on, beside speculation: unchained steps); a `priority` on this
    fcfs server is a 400 naming it; bad_words hold under speculation; /v1/responses answers."""
    drafted, accepted = _drafts(s)
    assert drafted > 0 and accepted > 0
    out = _json_schema_answer(s)
    assert json.loads(out.choices[0].message.content)["answer"] in ("yes", "no")
    assert out.choices[0].finish_reason == "stop"
    err = _bad_request(s, {"prompt": "hi", "priority": 1}, "/v1/completions")
    assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"]
    # the second --served-model-name: listed, and a request naming it answers as the first
    assert [m["id"] for m in s.http.get("/v1/models").json()["data"]] == [NAME, "matrix-alias"]
    out = s.client.completions.create(model="matrix-alias", prompt="hi", max_tokens=2)
    assert out.model == NAME
    assert "--async-scheduling: paxengine always schedules" in s.log.read_text()
    # bad_words under speculation: the n-gram drafts propose the banned digit, the verify
    # steps' masks refuse it (SmolLM2 writes digits one a token)
    banned = s.client.completions.create(
        model=NAME, prompt=COUNT, max_tokens=12, temperature=0, extra_body={"bad_words": ["4"]}
    )
    assert banned.usage.completion_tokens == 12 and "4" not in banned.choices[0].text
    # the Responses API answers as the chat endpoint does
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = s.client.chat.completions.create(
        model=NAME, messages=question, max_tokens=8, temperature=0
    )
    resp = s.client.responses.create(
        model=NAME, input=question[0]["content"], max_output_tokens=8, temperature=0
    )
    assert resp.output_text == chat.choices[0].message.content


def check_draft_model(s: Server) -> None:
    """The model as its own draft: every greedy draft is the target's token, so drafts are
    accepted; structured outputs off: a json_schema response_format is a 400 naming it."""
    drafted, accepted = _drafts(s)
    assert drafted > 0 and accepted > 0
    err = _bad_request(
        s,
        {"messages": [{"role": "user", "content": "hi"}], "response_format": RESPONSE_FORMAT},
    )
    assert err["param"] == "response_format" and "structured output is off" in err["message"]


def _hf_log_softmax(model_dir: str, ids: list[int]):
    """transformers' fp32 log-softmax of the model at every position of ids."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()


def check_draft_model_and_prompt_logprobs(s: Server) -> None:
    """check_draft_model, and prompt logprobs through the engine process: an 86-token prompt
    (two chunks of these 64-token steps; the steps' background compile may still be going)
    asked for prompt_logprobs, echo with logprobs, and a chat's, each equal to transformers'
    fp32 log-softmax within 1e-4 at every position; prompt_logprobs 21 is a 400 naming it."""
    check_draft_model(s)
    prompt = "The capital of France is Paris. " * 12
    body = {"model": s.row.model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = s.http.post(
        "/v1/completions", json={**body, "prompt_logprobs": 3, "return_token_ids": True}
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids, plp = choice["prompt_token_ids"], choice["prompt_logprobs"]
    assert len(ids) > 64 and len(plp) == len(ids) and plp[0] is None
    lsm = _hf_log_softmax(s.row.model, ids)
    for i in range(1, len(ids)):
        entry = plp[i]
        assert str(ids[i]) in entry and len(entry) <= 4, entry
        for t, v in entry.items():
            assert abs(v["logprob"] - lsm[i - 1, int(t)]) < 1e-4, (i, t, v)
            assert isinstance(v["decoded_token"], str) and v["rank"] >= 1
    echo = s.client.completions.create(**body, echo=True, logprobs=2)
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text.startswith(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - lsm[i - 1, ids[i]]) < 1e-4, i
        assert len(lp.top_logprobs[i]) in (2, 3)
    assert len(ids) < len(lp.tokens) <= len(ids) + 2
    chat = s.http.post(
        "/v1/chat/completions",
        json={
            "model": s.row.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 2,
            "prompt_logprobs": 0,
            "return_token_ids": True,
        },
    ).json()
    cids, cplp = chat["prompt_token_ids"], chat["prompt_logprobs"]
    clsm = _hf_log_softmax(s.row.model, cids)
    assert len(cplp) == len(cids) and cplp[0] is None
    worst = max(abs(cplp[i][str(t)]["logprob"] - clsm[i - 1, t]) for i, t in enumerate(cids) if i)
    assert worst < 1e-4
    err = _bad_request(s, {**body, "prompt_logprobs": 21}, "/v1/completions")
    assert err["param"] == "prompt_logprobs"


def check_eagle3(s: Server) -> None:
    """A random EAGLE-3 head proposes (its drafts are mostly rejected; the output is the
    target's all the same, checked in test_spec_decode_eagle3)."""
    drafted, _ = _drafts(s)
    assert drafted > 0


def check_fp8_priority_key(s: Server) -> None:
    """FP8 weights and KV as /v1/models says; a request without the key is a 401, with it
    200; `priority` requests run; CORS answers the allowed origin; metrics carry the vllm
    prefix; a body over --max-request-body-bytes is a 413."""
    card = s.http.get("/v1/models").json()["data"][0]
    assert card["id"] == NAME and card["weight_dtype"] == "fp8_e4m3"
    assert card["kv_cache_dtype"] == "fp8_e4m3" and card["kv_cache_scales"] == "calibrated"
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 2}
    anon = httpx.post(s.base + "/v1/completions", json=body, timeout=60)
    assert anon.status_code == 401 and anon.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.post(
        s.base + "/v1/completions",
        json=body,
        headers={"Authorization": "Bearer nope"},
        timeout=60,
    )
    assert wrong.status_code == 401
    assert s.http.post("/v1/completions", json=body).status_code == 200
    for priority in (5, -5):
        out = s.client.completions.create(
            model=NAME, prompt="Hello", max_tokens=3, extra_body={"priority": priority}
        )
        assert out.choices[0].finish_reason in ("length", "stop")
    pre = s.http.options(
        "/v1/completions",
        headers={
            "Origin": "http://ui.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "Authorization",
        },
    )
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "http://ui.example"
    assert pre.headers["access-control-allow-credentials"] == "true"
    assert _metric(s.metrics(), "vllm:request_success_total") >= 3
    big = s.http.post("/v1/completions", json={**body, "prompt": "x" * 300_000})
    assert big.status_code == 413


def check_tensor_parallel(s: Server) -> None:
    """Three devices, one model split over them (SmolLM2's 9 heads: 3 divides them, 2 does
    not). Its greedy completion equals the one-device rows' (test_completion's greedy group);
    here a prompt of two 64-token steps (chunked prefill over the split KV cache)."""
    out = s.client.completions.create(
        model=s.row.model, prompt="word " * 100, max_tokens=4, temperature=0
    )
    assert out.choices[0].text and out.usage.prompt_tokens > 64


def check_data_parallel(s: Server) -> None:
    """Two replicas behind one server: requests sent together are spread over both (the least
    loaded takes the next), each replica a series in /metrics."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int):
        return s.client.completions.create(
            model=s.row.model, prompt=f"Request {i}: the sky is", max_tokens=12, temperature=0
        )

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(one, range(4)))
    assert all(o.choices[0].text and o.usage.completion_tokens >= 1 for o in outs)
    text = s.metrics()
    for engine in ("0", "1"):
        assert _metric(text, "paxengine:generation_tokens_total", engine=engine) > 0, engine


def check_disaggregated(s: Server) -> None:
    """A prefill and a decode engine: a long prompt prefills on engine 0 (its pages cross to
    engine 1), engine 1 decodes, one stream comes back with the text of its non-streamed twin."""
    prompt = "word " * 120
    full = s.client.completions.create(
        model=s.row.model, prompt=prompt, max_tokens=6, temperature=0
    )
    chunks = s.client.completions.create(
        model=s.row.model, prompt=prompt, max_tokens=6, temperature=0, stream=True
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and full.usage.prompt_tokens > 100
    metrics = s.metrics()
    assert _metric(metrics, "paxengine:prompt_tokens_total", engine="0") > 100
    assert _metric(metrics, "paxengine:generation_tokens_total", engine="1") > 0


def check_frontend(s: Server) -> None:
    """vLLM's frontend flags: the --root-path prefix routes as the bare paths do and the docs
    are off; a stream without stream_options carries usage in every chunk; logprob tokens are
    token ids, a top_logprobs past --max-logprobs a 400 naming it; a request's own chat
    template renders its prompt; --override-generation-config's max_new_tokens caps a chat that
    gives none; the prompts and outputs are logged, cut; uvicorn logs at warning only; the
    taken flags are logged. (Each flag's effect in full: test_server_frontend_flags.py.)"""
    assert s.http.get("/proxy/v1/models").json()["data"][0]["id"] == NAME
    for path in ("/docs", "/openapi.json"):
        assert s.http.get(path).status_code == 404, path
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    chunks = list(
        s.client.chat.completions.create(
            model=NAME, messages=msgs, max_tokens=4, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert all(c.usage is not None for c in chunks) and not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == 4
    out = s.client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=3, temperature=0, logprobs=True, top_logprobs=3
    )
    for t in out.choices[0].logprobs.content:
        assert re.fullmatch(r"token_id:\d+", t.token) and len(t.top_logprobs) == 3, t
    err = _bad_request(s, {"messages": msgs, "logprobs": True, "top_logprobs": 4})
    assert err["param"] == "top_logprobs" and "max allowed: 3" in err["message"]
    template = "Q: {% for m in messages %}{{ m.content }}{% endfor %} A:"
    body = {"model": NAME, "messages": msgs, "chat_template": template}
    ids = s.http.post("/tokenize", json=body).json()["tokens"]
    assert s.http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "Q: What is 2+2? A:"
    r = s.http.post(
        "/v1/chat/completions", json={**body, "max_tokens": 2, "return_token_ids": True}
    )
    assert r.status_code == 200 and r.json()["prompt_token_ids"] == ids
    out = s.client.chat.completions.create(
        model=NAME, messages=msgs, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 5
    log = s.log.read_text()
    line = r"Received request chatcmpl-\S+: prompt: '<\|im_start\|>', prompt_token_ids: \[(\d+, ){11}\d+\]"
    assert re.search(line, log), log[-3000:]
    assert re.search(
        r"Generated response chatcmpl-\S+: output: '.{0,12}', finish_reason: length", log
    )
    assert "Uvicorn running on" not in log and '"GET /health' not in log
    assert "--num-gpu-blocks-override 64: taken as --num-kv-blocks 64" in log
    assert "num_kv_blocks=64" in log and "--disable-log-stats: " in log


ROWS: dict[str, Row] = {
    # the embedded model (the README's command), n-gram speculation beside structured outputs
    "ngram+structured": Row(
        [
            "--speculative-config",
            NGRAM,
            "--structured-outputs",
            "--served-model-name",
            NAME,
            "matrix-alias",
            # the server's defaults, given as a user may give them
            "--enable-prefix-caching",
            "--background-compile",
            "--engine-process",
            "--store-executables",
            # the Qwen3.5 recipes' flags: taken as paxengine runs (serving/vllm_flags.py)
            "--trust-remote-code",
            "--language-model-only",
            "--async-scheduling",
            "--limit-mm-per-prompt",
            '{"image": 0, "video": 0}',
            "--default-chat-template-kwargs",
            '{"enable_thinking": false}',
        ],
        check_ngram_structured,
    ),
    # the 4-layer model as its own draft, structured outputs off; the positional MODEL
    "draft+no-structured": Row(
        [
            "{short}",
            "--speculative-config",
            '{"model": "{short}", "num_speculative_tokens": 3}',
            "--no-structured-outputs",
            "--tokenizer",
            "{short}",
            "--dtype",
            "float32",
            "--seed",
            "7",
        ],
        check_draft_model_and_prompt_logprobs,
        model="{short}",
        greedy="4 layers, float32",
    ),
    "eagle3": Row(
        [
            "--model",
            "{short}",
            "--speculative-config",
            '{"method": "eagle3", "model": "{eagle3}", "num_speculative_tokens": 3}',
            "--served-model-name",
            NAME,
            "--performance-mode",
            "interactivity",  # its presets lose to the flags (COMMON)
        ],
        check_eagle3,
        greedy="4 layers, float32",
    ),
    # everything a server combines at once
    "fp8+priority+api-key+dispatch-thread": Row(
        [
            "--model",
            "{short}",
            "--served-model-name",
            NAME,
            "--quantization",
            "fp8",
            "--kv-cache-dtype",
            "fp8",
            "--kv-cache-scales",
            "calibrate",
            "--num-kv-blocks",
            "16",  # 64-token fp8 pages: 1,024 tokens (XLA emulates fp8 on CPUs)
            "--scheduling-policy",
            "priority",
            "--api-key",
            KEY,
            "--dispatch-thread",
            "--metrics-prefix",
            "vllm",
            "--allowed-origins",
            '["http://ui.example"]',
            "--allowed-methods",
            "GET,POST,OPTIONS",
            "--allowed-headers",
            "Authorization,Content-Type",
            "--allow-credentials",
            "--max-request-body-bytes",
            "100000",
            "--request-timeout",
            "120",
            "--shutdown-timeout",
            "10",
            "--max-waiting-requests",
            "16",
            "--max-waiting-tokens",
            "8192",
        ],
        check_fp8_priority_key,
        key=KEY,
    ),
    "tensor-parallel": Row(
        [
            "--model",
            "{short}",
            "--served-model-name",
            NAME,
            "-tp",
            "3",
            "--layer-loop",
            "unroll",
            "--attention-backend",
            "xla",
            "--block-size",
            "16",
            "--gpu-memory-utilization",
            "0.5",
        ],
        check_tensor_parallel,
        devices=3,
        greedy="4 layers, float32",
    ),
    "data-parallel": Row(
        [
            "--model",
            "{short}",
            "--served-model-name",
            NAME,
            "--data-parallel-size",
            "2",
            "--token-buckets",
            "16,64",
            "--seq-buckets",
            "4",
            "--decode-step-token-budget",
            "32",
            "--backlog-step-token-budget",
            "64",
        ],
        check_data_parallel,
        devices=2,
        greedy="4 layers, float32",
    ),
    "disaggregated": Row(
        [
            "--model",
            "{short}",
            "--served-model-name",
            NAME,
            "--kv-transfer-config",
            '{"kv_role": "kv_both", "prefill_device": 0, "decode_device": 1}',
            # the data-parallel row's buckets: its executables, from the store
            "--token-buckets",
            "16,64",
            "--seq-buckets",
            "4",
        ],
        check_disaggregated,
        devices=2,
        greedy="4 layers, float32",
    ),
    # vLLM's frontend flags a user brings from `vllm serve` (serving/cli.py _frontend_flags)
    "vllm-frontend": Row(
        [
            "--model",
            "{short}",
            "--served-model-name",
            NAME,
            "--uvicorn-log-level",
            "warning",
            "--disable-uvicorn-access-log",
            "--root-path",
            "/proxy",
            "--disable-fastapi-docs",
            "--enable-log-requests",
            "--enable-log-outputs",
            "--max-log-len",
            "12",
            "--enable-force-include-usage",
            "--return-tokens-as-token-ids",
            "--max-logprobs",
            "3",
            "--trust-request-chat-template",
            "--override-generation-config",
            '{"max_new_tokens": 5}',
            # taken as what paxengine does (serving/vllm_flags.py)
            "--num-gpu-blocks-override",
            "64",
            "--disable-log-stats",
            "--enable-prompt-tokens-details",
            "--disable-cascade-attn",
            "--revision",
            "main",
        ],
        check_frontend,
        greedy="4 layers, float32",
    ),
}

# Options no row passes: where each is covered instead, and why not here. The test named must
# exist (test_every_serve_option_has_a_row reads the file).
ELSEWHERE: dict[str, tuple[str, str]] = {
    "--hf-overrides": (
        "tests/serving/test_vllm_flags.py::test_hf_overrides_reach_the_engine_config",
        "a config.json edit a row's model would not show: parsed and refused there; the merged "
        "config served against HF (YaRN): tests/test_yarn_parity.py",
    ),
    "--kv-cache-memory-bytes": (
        "tests/serving/test_vllm_flags.py::test_kv_cache_memory_bytes_takes_vllms_forms",
        "the KV pool's size by hand: the flag's forms; the plan's use of it: test_kv_memory.py",
    ),
    "--chat-template": (
        "tests/serving/test_server_reasoning_tools.py::"
        "test_chat_template_flag_renders_chats_with_its_template",
        "a row's greedy texts would change with the template; rendered and refused there",
    ),
    # serving/vllm_flags.py: the recipes' vllm serve flags, taken as paxengine runs or refused
    **{
        flag: (
            "tests/serving/test_vllm_flags.py::test_a_recipes_flags_are_taken_and_logged",
            "taken and logged (the --no- forms and other values refused by name)",
        )
        for flag in (
            "--no-language-model-only",
            "--no-trust-remote-code",
            "--no-async-scheduling",
            "--enable-chunked-prefill",
            "--no-enable-chunked-prefill",
            "--disable-log-requests",
            "--no-disable-log-requests",
            "--tokenizer-mode",
            "--load-format",
            "--chat-template-content-format",
            "--pipeline-parallel-size",
            "--mamba-ssm-cache-dtype",
            "--mamba-cache-mode",
        )
    },
    **{
        flag: (
            "tests/serving/test_vllm_flags.py::test_more_recipe_flags_are_taken",
            "taken and logged (other values refused by name)",
        )
        for flag in ("--distributed-executor-backend", "--swap-space")
    },
    **{
        flag: (
            "tests/serving/test_vllm_flags.py::"
            "test_what_paxengine_does_not_have_is_refused_naming_the_flag",
            "refused at start-up, naming the flag and why",
        )
        for flag in (
            "--enforce-eager",
            "--compilation-config",
            "--moe-backend",
            "--max-cudagraph-capture-size",
            "--cpu-offload-gb",
            "--enable-sleep-mode",
            "--mm-encoder-tp-mode",
            "--mm-processor-cache-gb",
            "--mm-processor-cache-type",
            "--mm-processor-kwargs",
        )
    },
    **{
        "--" + name.replace("_", "-"): (
            "tests/serving/test_vllm_flags.py::test_every_refused_flag_is_refused_with_its_reason",
            "refused at start-up, naming the flag and why",
        )
        for name in (
            "additional_config",
            "kernel_config",
            "linear_backend",
            "logits_processors",
            "tool_server",
            "reasoning_config",
            "nnodes",
            "node_rank",
            "master_addr",
            "master_port",
            "headless",
        )
    },
    "--no-engine-process": (
        "tests/serving/test_server_unit.py::test_cli_main_wires_engine_app_and_uvicorn",
        "the engine on a thread: every in-process server test (tests/serving/conftest.py) runs it",
    ),
    "--no-background-compile": (
        "tests/test_background_compile.py",
        "the offline default; the rows run the server's default (on)",
    ),
    "--prime-steps": (
        "tests/test_prime_steps.py",
        "start-up tuning (a GPU's first kernel loads); on a CPU it only adds start-up time",
    ),
    "--no-prime-steps": ("tests/test_prime_steps.py", "the CPU default"),
    "--no-store-executables": (
        "tests/test_compile_cache.py",
        "start-up tuning: only whether compiled steps are kept on disk",
    ),
    "--no-enable-prefix-caching": (
        "tests/serving/test_server_unit.py::test_config_precedence",
        "a scheduler switch, tested offline in tests/test_prefix_cache.py",
    ),
    "--no-dispatch-thread": (
        "tests/test_engine.py",
        "the default: every engine that does not ask for the thread (the other rows too)",
    ),
    "--no-allow-credentials": (
        "tests/serving/test_server_unit.py::test_cors_for_listed_origins_only",
        "the default: CORS without credentials",
    ),
    "--reasoning-parser": (
        "tests/serving/test_server_reasoning_tools.py::test_reasoning_split_on_smollm2",
        "response text only: the session server with the parser set, and a scripted fake engine",
    ),
    "--enable-auto-tool-choice": (
        "tests/serving/test_server_reasoning_tools.py::test_auto_tool_choice_needs_the_flag_as_in_vllm",
        "response text only: the session server runs with it (tests/serving/conftest.py)",
    ),
    "--tool-call-parser": (
        "tests/serving/test_server_reasoning_tools.py::test_reasoning_then_tool_calls_through_the_chain",
        "response text only: the model's calls parsed on a scripted fake engine",
    ),
    "--generation-config": (
        "tests/serving/test_server_reasoning_tools.py::test_generation_config_defaults",
        "default SamplingParams from a model directory's file; the rows' models have none",
    ),
    # vLLM's frontend flags (serving/cli.py _frontend_flags) no row passes
    **{
        flag: (
            "tests/serving/test_server_frontend_flags.py::test_https_with_the_ssl_flags",
            "HTTPS: the rows' clients speak HTTP; uvicorn serves a certificate made there",
        )
        for flag in ("--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs", "--ssl-cert-reqs")
    },
    "--response-role": (
        "tests/serving/test_server_frontend_flags.py::test_response_role_names_the_answers_role",
        "every row's streamed chat checks the default role",
    ),
    **{
        flag: (
            "tests/serving/test_vllm_flags.py::test_vllms_frontend_flags_reach_the_server_config",
            "the defaults, given as a user may give them",
        )
        for flag in (
            "--no-disable-uvicorn-access-log",
            "--no-disable-fastapi-docs",
            "--no-enable-log-requests",
            "--no-enable-log-outputs",
            "--no-enable-force-include-usage",
            "--no-return-tokens-as-token-ids",
            "--no-trust-request-chat-template",
        )
    },
    **{
        flag: (
            "tests/serving/test_vllm_flags.py::"
            "test_vllms_flags_of_what_paxengine_does_anyway_are_taken",
            "taken and logged (other values refused by name)",
        )
        for flag in (
            "--code-revision",
            "--tokenizer-revision",
            "--max-num-partial-prefills",
            "--max-long-partial-prefills",
            "--long-prefill-token-threshold",
        )
    },
    **{
        flag: (
            "tests/serving/test_vllm_flags.py::"
            "test_what_paxengine_does_not_have_is_refused_naming_the_flag",
            "refused at start-up, naming the flag and why",
        )
        for flag in (
            "--no-disable-log-stats",
            "--no-enable-prompt-tokens-details",
            "--no-disable-cascade-attn",
        )
    },
    **{
        "--" + name.replace("_", "-"): (
            "tests/serving/test_vllm_flags.py::test_every_refused_flag_is_refused_with_its_reason",
            "refused at start-up, naming the flag and why",
        )
        for name in ("download_dir", "enable_lora", "lora_modules", "max_loras", "max_lora_rank")
    },
    "--enable-expert-parallel": (
        "tests/test_qwen3_moe.py::test_the_server_serves_it_with_expert_parallelism",
        "MoE models only: the rows' SmolLM2 has no experts (the flag is refused for it)",
    ),
    # more of vLLM's frontend flags: behaviour on the fake engine's app or its uvicorn server
    **{
        flag: (f"tests/serving/test_server_frontend_flags.py::{test}", why)
        for flag, test, why in (
            (
                "--exclude-tools-when-tool-choice-none",
                "test_exclude_tools_when_tool_choice_none",
                "what the chat template gets: recorded there",
            ),
            (
                "--no-exclude-tools-when-tool-choice-none",
                "test_exclude_tools_when_tool_choice_none",
                "the default (vLLM's), recorded there",
            ),
            ("--enable-log-deltas", "test_log_deltas_under_log_outputs", "log lines only"),
            ("--no-enable-log-deltas", "test_log_deltas_under_log_outputs", "log lines only"),
            (
                "--enable-tokenizer-info-endpoint",
                "test_tokenizer_info_endpoint",
                "one GET route on the app",
            ),
            (
                "--no-enable-tokenizer-info-endpoint",
                "test_tokenizer_info_endpoint",
                "the default: no route",
            ),
            ("--h11-max-header-count", "test_header_count_limit", "a middleware of the app"),
            ("--ssl-ciphers", "test_https_with_the_ssl_flags", "HTTPS: the rows speak HTTP"),
            *(
                (
                    flag,
                    "test_unix_socket_access_log_and_log_config",
                    "uvicorn's listener and logs: served there by the same uvicorn server",
                )
                for flag in (
                    "--uds",
                    "--log-config-file",
                    "--disable-access-log-for-endpoints",
                    "--h11-max-incomplete-event-size",
                )
            ),
        )
    },
    **{
        flag: (
            "tests/serving/test_vllm_flags.py::test_vllms_frontend_switches_taken_or_refused",
            "taken and logged, or refused naming why",
        )
        for flag in (
            "--enable-request-id-headers",
            "--no-enable-request-id-headers",
            "--middleware",
            "--enable-ssl-refresh",
            "--no-enable-ssl-refresh",
            "--no-enable-lora",
        )
    },
}


# ------------------------------------------------------------------------------ the servers


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_eagle3_head(path: Path, short: str) -> str:
    """A random EAGLE-3 speculator for the 4-layer SmolLM2 (hidden 576, vocabulary 49,152) in
    the releases' layout (tests/test_spec_decode_eagle3.py writes the same for a tiny target):
    a 64-token draft vocabulary, aux states of layers 0, 1 and 3."""
    import numpy as np
    from safetensors.numpy import save_file

    cfg = json.loads((Path(short) / "config.json").read_text())
    H, V, draft_v, heads, head_dim, inter = cfg["hidden_size"], cfg["vocab_size"], 64, 2, 32, 128
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    r = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float32)  # noqa: E731
    used = np.sort(rng.choice(V, draft_v, replace=False))
    t2d = np.zeros(V, bool)
    t2d[used] = True
    qd, kd = heads * head_dim, head_dim
    w = {
        "fc.weight": r(H, 3 * H),
        "midlayer.input_layernorm.weight": 1 + r(H),
        "midlayer.hidden_norm.weight": 1 + r(H),
        "midlayer.self_attn.q_proj.weight": r(qd, 2 * H),
        "midlayer.self_attn.k_proj.weight": r(kd, 2 * H),
        "midlayer.self_attn.v_proj.weight": r(kd, 2 * H),
        "midlayer.self_attn.o_proj.weight": r(H, qd),
        "midlayer.post_attention_layernorm.weight": 1 + r(H),
        "midlayer.mlp.gate_proj.weight": r(inter, H),
        "midlayer.mlp.up_proj.weight": r(inter, H),
        "midlayer.mlp.down_proj.weight": r(H, inter),
        "norm.weight": 1 + r(H),
        "lm_head.weight": r(draft_v, H),
        "d2t": (used - np.arange(draft_v)).astype(np.int64),
        "t2d": t2d,
    }
    save_file(w, str(path / "model.safetensors"))
    head = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": 1,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": V,
        "draft_vocab_size": draft_v,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "eagle_aux_hidden_state_layer_ids": [0, 1, 3],  # the default (2, 2, 1) for 4 layers
    }
    (path / "config.json").write_text(json.dumps(head))
    return str(path)


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """What the rows' arguments name: the 4-layer SmolLM2, an EAGLE-3 head for it, a YAML of
    this module's compilation cache."""
    root = tmp_path_factory.mktemp("serve_matrix")
    short = truncated_smollm2()
    config = root / "serve.yaml"
    config.write_text(f"compilation_cache_dir: {root / 'jax'}\n")
    return {
        "short": short,
        "eagle3": _write_eagle3_head(root / "eagle3", short),
        "config": str(config),
        "logs": root,
    }


def _fill(arg: str, values: dict) -> str:
    for k, v in values.items():
        arg = arg.replace("{" + k + "}", str(v))
    return arg


def _params():
    for name, row in ROWS.items():
        marks = [pytest.mark.xfail(reason=row.xfail, strict=True)] if row.xfail else []
        yield pytest.param(name, marks=marks, id=name)


@pytest.fixture(scope="module", params=list(_params()))
def server(request, places):
    name, row = request.param, ROWS[request.param]
    port = _free_port()
    values = {**places, "port": port}
    argv = [_fill(a, values) for a in row.args + COMMON]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if row.devices > 1:
        flag = f"--xla_force_host_platform_device_count={row.devices}"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    log = places["logs"] / f"{re.sub(r'[^A-Za-z0-9]+', '_', name)}.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "paxengine.cli", "serve", *argv],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # a process group: the server and its engine process
        )
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {row.key}"} if row.key else {}
    http = httpx.Client(base_url=base, headers=headers, timeout=120)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"{name}: serve exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
            try:
                if http.get("/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{name}: not ready in 300 s:\n{log.read_text()[-4000:]}")
            time.sleep(0.25)
        print(f"\n{name}: ready in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        import openai

        model = _fill(row.model, values)
        s = Server(name, Row(**{**row.__dict__, "model": model}), base, log, http)
        s.client = openai.OpenAI(
            base_url=base + "/v1", api_key=row.key or "none", max_retries=0, timeout=120
        )
        yield s
    finally:
        http.close()
        _stop(name, proc, log)


def _stop(name: str, proc: subprocess.Popen, log: Path) -> None:
    """SIGTERM: the server drains (its log says so), then the process group goes. Its exit is
    not waited out: a process exits only once every background compile already queued has run
    (step_build's ThreadPoolExecutor is joined at interpreter exit; issue #53's report), up to
    30 s a row here for executables nothing will run."""
    if proc.poll() is not None:  # it failed: its engine process may be left
        _kill_group(proc)
        return
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    drained = False
    while time.monotonic() - t0 < 30 and proc.poll() is None:
        if "drained in" in log.read_text(errors="replace"):
            drained = True
            break
        time.sleep(0.1)
    try:
        proc.wait(timeout=1)
    except subprocess.TimeoutExpired:
        pass
    finally:
        _kill_group(proc)
    print(f"{name}: stopped in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    assert drained or proc.returncode == 0, (
        f"{name}: no drain after SIGTERM (exit status {proc.returncode}):\n"
        + log.read_text(errors="replace")[-4000:]
    )


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the server and its engine process
    except ProcessLookupError:
        pass
    proc.wait()


# ------------------------------------------------------------------------------ the tests


def test_health_and_model(server):
    r = server.http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    models = server.http.get("/v1/models").json()["data"]
    assert [m["id"] for m in models][:1] == [server.row.model]  # a second name may follow


def test_completion(server):
    out = server.client.completions.create(
        model=server.row.model, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    (choice,) = out.choices
    assert choice.text.strip() and choice.finish_reason in ("length", "stop")
    u = out.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    if server.row.greedy:  # speculation, devices, engines: none changes a greedy completion
        first, want = GREEDY.setdefault(server.row.greedy, (server.name, choice.text))
        assert choice.text == want, f"{first} answered {want!r}"


def test_streamed_chat(server):
    stream = server.client.chat.completions.create(
        model=server.row.model,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text.strip() and finish[-1] in ("length", "stop") and not any(finish[:-1])
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_row_options(server):
    server.row.check(server)


# ------------------------------------------------------------------------------ the guard


def _option_names(action: argparse.Action) -> list[str]:
    return list(action.option_strings) or [action.dest.upper()]


def test_every_serve_option_has_a_row():
    """Each of `paxengine serve`'s options is passed by a row (COMMON is in every row; a row
    whose first argument is no flag passes the positional MODEL) or named in ELSEWHERE with the
    test that covers it; ELSEWHERE names only real options, no row passes, and real tests."""
    parser = build_parser()
    passed = {a for row in ROWS.values() for a in row.args + COMMON if a.startswith("-")}
    if any(not row.args[0].startswith("-") for row in ROWS.values()):
        passed.add("MODEL_TAG")
    known: set[str] = set()
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        names = _option_names(action)
        known.update(names)
        if not (set(names) & (passed | set(ELSEWHERE))):
            missing.append("/".join(names))
    assert not missing, (
        f"serve options without a row in tests/serving/test_serve_matrix.py: {missing}; add "
        "them to a row of ROWS, or to ELSEWHERE with the test that covers them"
    )
    assert set(ELSEWHERE) <= known, f"not serve options: {sorted(set(ELSEWHERE) - known)}"
    assert not set(ELSEWHERE) & passed, f"passed by a row: {sorted(set(ELSEWHERE) & passed)}"
    assert passed <= known, f"rows pass unknown options: {sorted(passed - known)}"
    for option, (where, reason) in ELSEWHERE.items():
        path, _, test = where.partition("::")
        assert reason and (ROOT / path).is_file(), f"{option}: {path} is not a file"
        if test:
            assert f"def {test}(" in (ROOT / path).read_text(), f"{option}: no {where}"
