"""Reasoning and tool calls end to end (issue #56): a tiny Qwen3 checkpoint written here, whose
tokenizer has the think and tool-call tokens and whose weights are crafted so that greedy
decoding writes `<think> hmm weather needed</think><tool_call>{...}</tool_call>`, served by
`paxengine serve` as a user starts it (engine process, background compile) with
--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser hermes.

The crafted weights: attention and MLP outputs are zero, so each position's final state is its
own token's embedding and the next token depends on the current one only; the LM head's row
for token j is the embeddings of the tokens whose successor is j (random 64-dim vectors of a
~270-token vocabulary, 256 of them bytes, are nearly orthogonal), so greedy decoding follows
the script."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
# added tokens over a byte-level alphabet; each script token's greedy successor is the next one
# (the generation prompt ends with "assistant")
SCRIPT = ["assistant", "<think>", " hmm", " weather", " needed", "</think>", "<tool_call>", CALL]
SCRIPT += ["</tool_call>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def write_model(path: Path) -> None:
    import torch
    import transformers as tf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE({ch: i for i, ch in enumerate(sorted(alphabet))}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = [t for t in SCRIPT if t != "<|im_end|>"]
    tok.add_tokens([AddedToken(t, normalized=False) for t in words])
    tok.add_special_tokens(
        [AddedToken(t, normalized=False) for t in ("<|im_start|>", "<|im_end|>")]
    )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": TEMPLATE})
    )
    V = tok.get_vocab_size()
    cfg = tf.Qwen3Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=eos,
    )
    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(cfg).eval()
    ids = [tok.token_to_id(t) for t in SCRIPT]
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        emb = torch.randn(V, 64)
        model.model.embed_tokens.weight.copy_(emb)
        head = torch.zeros(V, 64)
        unit = emb / emb.norm(dim=1, keepdim=True)
        for a, b in zip(ids, ids[1:]):
            head[b] += 10 * unit[a]
        # the runner-up after </think>: a whole JSON object (what a JSON grammar takes there)
        head[tok.token_to_id(CALL)] += 5 * unit[tok.token_to_id("</think>")]
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path, safe_serialization=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("thinking_model")
    write_model(d / "model")
    port = _free_port()
    argv = [d / "model", "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", port]
    argv += ["--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "4"]
    argv += ["--max-num-batched-tokens", "128", "--reasoning-parser", "qwen3"]
    argv += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    log = d / "serve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "paxengine.cli", "serve", *map(str, argv)],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # a process group: the server and its engine process
        )
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"serve exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
            try:
                if http.get("/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"not ready in 300 s:\n{log.read_text()[-4000:]}")
            time.sleep(0.25)
        yield http
    finally:
        http.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _body(**kw) -> dict:
    msgs = [{"role": "user", "content": "what is the weather in Paris ?"}]
    return {"model": "tiny", "messages": msgs, "tools": [WEATHER], "max_tokens": 20, **kw}


def _chat(http, **kw) -> dict:
    r = http.post("/v1/chat/completions", json=_body(**{"temperature": 0, **kw}))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _stream(http, **kw) -> list[dict]:
    with http.stream("POST", "/v1/chat/completions", json=_body(stream=True, **kw)) as r:
        assert r.status_code == 200
        lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [ch["delta"] for x in lines[:-1] for ch in json.loads(x)["choices"]]


def test_reasoning_and_a_tool_call(server):
    """The think block's text is `reasoning`, the Hermes call a tool call; streamed, the same
    text as delta.reasoning and the call as tool-call deltas."""
    ch = _chat(server)
    msg = ch["message"]
    assert msg["reasoning"].split() == ["hmm", "weather", "needed"], msg
    assert not (msg["content"] or "").strip()
    assert ch["finish_reason"] == "tool_calls"
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    deltas = _stream(server, temperature=0)
    assert "".join(d.get("reasoning") or "" for d in deltas) == msg["reasoning"]
    pieces = [t for d in deltas for t in d.get("tool_calls") or []]
    assert pieces[0]["function"]["name"] == "get_weather"
    args = "".join(t["function"].get("arguments", "") for t in pieces)
    assert json.loads(args) == {"city": "Paris"}


def test_thinking_token_budget_closes_the_block(server):
    """Budget 1: one reasoning token, then the engine forces `</think>` and the model goes on
    with its call (sampled at temperature 1: the forced token does not depend on it)."""
    for temperature in (0, 1.0):
        ch = _chat(server, thinking_token_budget=1, temperature=temperature)
        assert ch["message"]["reasoning"].split() == ["hmm"], ch
        if temperature == 0:
            assert ch["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    r = server.post("/v1/chat/completions", json=_body(thinking_token_budget=-2))
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"
    assert _chat(server)["finish_reason"] == "tool_calls"  # the engine runs on


def test_a_grammar_applies_after_the_reasoning(server):
    """A JSON constraint under --reasoning-parser (vLLM's rule): the block opens and runs
    unconstrained (its tokens are no JSON), then the grammar takes over: after </think> the
    model's own choice (<tool_call>) is masked and its runner-up, a whole JSON object, ends
    the output; with a budget of 1 the same after one reasoning token."""
    for extra, words in (
        ({}, ["hmm", "weather", "needed"]),
        ({"thinking_token_budget": 1}, ["hmm"]),
    ):
        body = {"response_format": {"type": "json_object"}, "tools": None, **extra}
        ch = _chat(server, **body)
        msg = ch["message"]
        assert msg["reasoning"].split() == words, msg
        assert json.loads(msg["content"]) == json.loads(CALL) and not msg["tool_calls"]
        assert ch["finish_reason"] == "stop"
