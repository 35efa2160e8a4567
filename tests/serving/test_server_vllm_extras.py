"""vLLM's request fields that were 400s here, against a real SmolLM2 server (conftest.py):
`stream_options.continuous_usage_stats` and chat `echo`."""

from __future__ import annotations

import json

MSG = [{"role": "user", "content": "Name three colors."}]
PREFIX = "Red, green and"
GREEDY = {"max_tokens": 6, "temperature": 0}


def _sse(http, route, body):
    with http.stream("POST", route, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def _param(r):
    assert r.status_code == 400, r.text
    return r.json()["error"]["param"]


def _check_running_usage(chunks, prompt_len):
    """Each choice chunk's usage: its prompt's tokens and the choice's tokens so far (the sum of
    its chunks' token_ids); the last chunk's usage sums the choices."""
    so_far: dict[int, int] = {}
    for c in chunks[:-1]:
        (ch,) = c["choices"]
        i = ch["index"]
        so_far[i] = so_far.get(i, 0) + len(ch.get("token_ids") or [])
        u = c["usage"]
        assert u["completion_tokens"] == so_far[i], (c, so_far)
        assert u["prompt_tokens"] == prompt_len(i)
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == sum(so_far.values())
    return last["usage"], so_far


def test_continuous_usage_stats(server, http):
    """vLLM's rule: with include_usage, every chunk carries usage (n > 1: per choice; several
    prompts: the chunk's prompt), then the final usage chunk as before; without include_usage,
    no usage anywhere."""
    base = {**GREEDY, "temperature": 1.0, "seed": 3, "ignore_eos": True, "n": 2, "stream": True}
    base["return_token_ids"] = True
    every = {"include_usage": True, "continuous_usage_stats": True}
    prompts = ["The capital of France is", "Once upon a time, in a land far away,"]
    lens = [len(http.post("/tokenize", json={"prompt": p}).json()["tokens"]) for p in prompts]
    assert lens[0] != lens[1]
    body = {**base, "prompt": prompts, "stream_options": every}
    chunks = _sse(http, "/v1/completions", body)
    final, so_far = _check_running_usage(chunks, lambda i: lens[i // 2])
    assert so_far == {0: 6, 1: 6, 2: 6, 3: 6} and final["prompt_tokens"] == sum(lens)

    chat_len = http.post("/tokenize", json={"messages": MSG}).json()["count"]
    chunks = _sse(http, "/v1/chat/completions", {**base, "messages": MSG, "stream_options": every})
    assert [c["choices"][0]["delta"].get("role") for c in chunks[:2]] == ["assistant"] * 2
    assert all(c["usage"]["completion_tokens"] == 0 for c in chunks[:2])  # the role chunks
    final, so_far = _check_running_usage(chunks, lambda i: chat_len)
    assert so_far == {0: 6, 1: 6} and final["prompt_tokens"] == chat_len

    alone = {"continuous_usage_stats": True}
    chunks = _sse(http, "/v1/chat/completions", {**base, "messages": MSG, "stream_options": alone})
    assert chunks[-1]["choices"] and all(c.get("usage") is None for c in chunks)
    bad = {**base, "messages": MSG, "stream_options": {**every, "continuous_usage_stats": "yes"}}
    assert _param(http.post("/v1/chat/completions", json=bad)) == (
        "stream_options.continuous_usage_stats"
    )


def _content(chunks, i):
    return "".join(
        c["choices"][0]["delta"].get("content") or ""
        for c in chunks
        if c["choices"] and c["choices"][0]["index"] == i
    )


def test_chat_echo(server, http):
    """echo: when the last message's role is the answer's, each choice's content starts with
    that message's text and goes on with the answer echo-less (streamed: a chunk of its own per
    choice after the role chunks, without logprobs). Its tokens are not counted or logprob'd;
    vLLM's side effect, the prompt's logprobs in the response (for top_logprobs), is kept."""
    convo = [*MSG, {"role": "assistant", "content": PREFIX}]
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    body = {**GREEDY, "messages": convo, **cont}
    plain = http.post("/v1/chat/completions", json=body).json()
    text = plain["choices"][0]["message"]["content"]
    assert text and "prompt_logprobs" not in plain
    kw = {**body, "echo": True, "logprobs": True, "n": 2}
    echoed = http.post("/v1/chat/completions", json=kw).json()
    made = plain["usage"]["completion_tokens"]
    for ch in echoed["choices"]:
        assert ch["message"]["role"] == "assistant" and ch["message"]["content"] == PREFIX + text
        assert len(ch["logprobs"]["content"]) == made  # the answer's tokens only
    assert echoed["usage"]["completion_tokens"] == 2 * made
    assert echoed["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    plp = echoed["prompt_logprobs"]
    assert len(plp) == plain["usage"]["prompt_tokens"] and plp[0] is None and len(plp[1]) == 1

    chunks = _sse(http, "/v1/chat/completions", {**kw, "stream": True})
    assert [c["choices"][0]["delta"] for c in chunks[2:4]] == [{"content": PREFIX}] * 2
    assert [c["choices"][0]["index"] for c in chunks[:4]] == [0, 1, 0, 1]
    assert all(c["choices"][0]["logprobs"] is None for c in chunks[:4])
    assert _content(chunks, 0) == _content(chunks, 1) == PREFIX + text
    assert all("prompt_logprobs" not in c for c in chunks)  # vLLM's stream sends none

    # a new turn answers as the assistant: a user message last is not echoed
    fresh = {**GREEDY, "messages": MSG}
    answer = http.post("/v1/chat/completions", json=fresh).json()["choices"][0]["message"]
    same = http.post("/v1/chat/completions", json={**fresh, "echo": True}).json()
    assert same["choices"][0]["message"]["content"] == answer["content"]
    # the assistant's own last message, parts joined by newlines (as vLLM joins them)
    parts = [{"type": "text", "text": "Red,"}, {"type": "text", "text": " green"}]
    msgs = [*MSG, {"role": "assistant", "content": parts}]
    r = http.post("/v1/chat/completions", json={**fresh, "messages": msgs, "echo": True})
    assert r.json()["choices"][0]["message"]["content"].startswith("Red,\n green")
    # no new turn: the answer goes on in the last message's role, which is so echoed (vLLM's)
    r = http.post(
        "/v1/chat/completions", json={**fresh, "add_generation_prompt": False, "echo": True}
    ).json()
    msg = r["choices"][0]["message"]
    assert msg["role"] == "user" and msg["content"].startswith(MSG[0]["content"])
    assert _param(http.post("/v1/chat/completions", json={**fresh, "echo": "yes"})) == "echo"


def test_sagemaker_routes_ping_and_invocations(server, http):
    """vLLM's /ping (GET and POST: /health's answer) and /invocations (a body with `messages`
    is a chat completion, one with `prompt` a completion; anything else a 400), behind the key
    like the other inference routes."""
    import httpx

    for method in ("GET", "POST"):
        r = http.request(method, "/ping")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    chat = {**GREEDY, "model": server.model, "messages": MSG}
    want = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]
    got = http.post("/invocations", json=chat).json()
    assert got["object"] == "chat.completion" and got["choices"][0]["message"] == want
    completion = {**GREEDY, "model": server.model, "prompt": PREFIX}
    want = http.post("/v1/completions", json=completion).json()["choices"][0]["text"]
    got = http.post("/invocations", json=completion).json()
    assert got["object"] == "text_completion" and got["choices"][0]["text"] == want
    assert _param(http.post("/invocations", json={"model": server.model})) == "messages"
    assert _param(http.post("/invocations", json={**chat, "max_tokens": -1})) == "max_tokens"
    anon = httpx.post(server.base + "/invocations", json=chat, timeout=60)
    assert anon.status_code == 401
