"""The official `openai` client against a real SmolLM2 server (session fixture in conftest.py)."""

from __future__ import annotations

MSG = [{"role": "user", "content": "Name three colors."}]


def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]


def test_chat(client, server):
    r = client.chat.completions.create(
        model=server.model, messages=MSG, max_tokens=8, temperature=0
    )
    assert r.object == "chat.completion" and len(r.choices) == 1
    ch = r.choices[0]
    assert ch.message.role == "assistant" and ch.message.content
    assert ch.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_with_usage_equals_nonstream(client, server):
    kw = dict(model=server.model, messages=MSG, max_tokens=8, temperature=0.8, seed=7)
    full = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_stream_equals_nonstream(client, server):
    kw = dict(
        model=server.model,
        prompt="The capital of France is",
        max_tokens=10,
        temperature=1.0,
        seed=123,
    )
    full = client.completions.create(**kw)
    text = "".join(
        c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices
    )
    assert text == full.choices[0].text and text


def test_completions_prompt_forms(client, server, http):
    r = client.completions.create(
        model=server.model, prompt="Once upon a time", max_tokens=5, temperature=0
    )
    assert r.object == "text_completion" and r.choices[0].text
    assert r.usage.completion_tokens == 5 or r.choices[0].finish_reason == "stop"
    ids = http.post("/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    r2 = client.completions.create(model=server.model, prompt=ids, max_tokens=5, temperature=0)
    assert r2.choices[0].text == r.choices[0].text  # token ids == the same text
    r3 = client.completions.create(
        model=server.model, prompt=["Hello", "Goodbye"], max_tokens=3, temperature=0, echo=True
    )
    assert [c.index for c in r3.choices] == [0, 1]
    assert r3.choices[0].text.startswith("Hello") and r3.choices[1].text.startswith("Goodbye")


def test_n_greater_than_one(client, server):
    r = client.completions.create(
        model=server.model,
        prompt="My favourite animal is",
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=5,
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.text for c in r.choices)
    c = client.chat.completions.create(model=server.model, messages=MSG, n=2, max_tokens=4, seed=1)
    assert sorted(ch.index for ch in c.choices) == [0, 1]


def test_logprobs_completions(client, server):
    r = client.completions.create(
        model=server.model, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert (
        len(lp.tokens)
        == len(lp.token_logprobs)
        == len(lp.top_logprobs)
        == r.usage.completion_tokens
    )
    assert "".join(lp.tokens) == r.choices[0].text
    for val, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 3 <= len(top) <= 4
        assert max(top.values()) == val  # greedy: the sampled token is the most likely one


def test_logprobs_chat(client, server):
    r = client.chat.completions.create(
        model=server.model, messages=MSG, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4  # greedy


def test_stop_strings(client, server):
    kw = dict(
        model=server.model,
        prompt="Count: one, two, three, four, five,",
        temperature=0,
        max_tokens=12,
    )
    free = client.completions.create(**kw).choices[0].text
    assert len(free) > 4
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    r = client.completions.create(**kw, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free[: free.index(stop)]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(**kw, stop=[stop], stream=True)
        if c.choices
    )
    assert streamed == r.choices[0].text


def test_seeded_sampling_reproducible(client, server):
    kw = dict(
        model=server.model,
        prompt="In the forest there was",
        max_tokens=8,
        temperature=1.2,
        top_p=0.95,
        seed=2024,
    )
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_continue_final_message_and_template_variables(client, server, http):
    """A prefilled answer goes on where it stops: the chat call generates what a completion of
    the rendered text (cut inside the last message) generates. Template variables reach the
    template; the renderer's own names and both turn options at once are refused."""
    convo = [*MSG, {"role": "assistant", "content": "Red, green and"}]
    body = {"messages": convo, "add_generation_prompt": False, "continue_final_message": True}
    ids = http.post("/tokenize", json=body).json()["tokens"]
    closed = http.post("/tokenize", json={**body, "continue_final_message": False}).json()
    assert len(ids) < closed["count"] and closed["tokens"][: len(ids)] == ids  # the turn is open
    chat = client.chat.completions.create(
        model=server.model,
        messages=convo,
        max_tokens=6,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    plain = client.completions.create(model=server.model, prompt=ids, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == len(ids)
    # a variable the template does not read changes nothing (the template's business, as in HF)
    same = http.post("/tokenize", json={**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert same.status_code == 200 and same.json()["tokens"] == ids
    for extra, param in (
        ({"add_generation_prompt": True}, "continue_final_message"),
        ({"chat_template_kwargs": {"add_generation_prompt": True}}, "chat_template_kwargs"),
        ({"messages": [*MSG, {"role": "assistant", "content": ""}]}, "messages"),
    ):
        for route, more in (("/tokenize", {}), ("/v1/chat/completions", {"max_tokens": 2})):
            r = http.post(route, json={**body, **extra, **more})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, r.text)
    assert http.get("/health").status_code == 200


def test_truncate_prompt_tokens(client, server, http):
    """The prompt's last k tokens run (vLLM's field): usage counts them, echo shows them, and the
    answer is the one of those tokens sent alone. A bad k is a 400 naming the field."""
    text = "One, two, three, four, five, six, seven, eight, nine, ten"
    ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    kw = dict(model=server.model, max_tokens=4, temperature=0)
    cut = client.completions.create(
        prompt=text, echo=True, extra_body={"truncate_prompt_tokens": 5}, **kw
    )
    alone = client.completions.create(prompt=ids[-5:], **kw)
    assert cut.usage.prompt_tokens == 5 < len(ids)
    head = http_detok(http, ids[-5:])
    assert cut.choices[0].text == head + alone.choices[0].text and not text.startswith(head)
    chat = client.chat.completions.create(
        messages=MSG, extra_body={"truncate_prompt_tokens": 3}, **kw
    )
    assert chat.usage.prompt_tokens == 3
    for k in (0, -2, 10**6):
        r = http.post("/v1/completions", json={"prompt": text, "truncate_prompt_tokens": k})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_allowed_token_ids(client, server, http):
    ids = http.post("/tokenize", json={"prompt": " yes no maybe"}).json()["tokens"]
    r = client.completions.create(
        model=server.model,
        prompt="Is the sky blue? Answer:",
        max_tokens=5,
        temperature=1.0,
        seed=1,
        logprobs=0,
        extra_body={"allowed_token_ids": ids},
    )
    tokens = r.choices[0].logprobs.tokens
    assert len(tokens) == 5 and set(tokens) <= {http_detok(http, [t]) for t in ids}
    bad = http.post("/v1/completions", json={"prompt": "x", "allowed_token_ids": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "allowed_token_ids"


def test_bad_words(client, server, http):
    """vLLM's bad_words on both endpoints: a word the greedy text has is gone from it (the
    prompt's own words may stay); a value that is not a list of strings is a 400 naming it."""
    kw = dict(model=server.model, max_tokens=8, temperature=0)
    prompt = "Once upon a time"  # greedy: ", the city of Nova Haven was"
    plain = client.completions.create(prompt=prompt, **kw).choices[0].text
    assert "city" in plain
    r = client.completions.create(prompt=prompt, extra_body={"bad_words": ["city"]}, **kw)
    text = r.choices[0].text
    assert "city" not in text and text != plain
    chat = client.chat.completions.create(messages=MSG, **kw).choices[0].message.content
    word = max(chat.replace(",", " ").replace(".", " ").split(), key=len)  # e.g. a colour
    banned = client.chat.completions.create(messages=MSG, extra_body={"bad_words": [word]}, **kw)
    assert word not in banned.choices[0].message.content, (word, chat)
    for route, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": MSG}),
    ):
        for value in ([1], "city", [""]):
            r = http.post(route, json={**body, "bad_words": value})
            assert r.status_code == 400, (route, value, r.text)
            assert r.json()["error"]["param"].split(".")[0] == "bad_words"


def http_detok(http, ids):
    return http.post("/detokenize", json={"tokens": ids}).json()["prompt"]


def test_return_tokens_as_token_ids(client, server, http):
    """Logprobs name each token "token_id:<id>" (sampled, top and echoed prompt tokens, chat and
    completions, streamed or not), the same tokens the plain form names by text."""
    kw = dict(model=server.model, max_tokens=4, temperature=0)
    plain = client.completions.create(prompt="Hi", logprobs=2, echo=True, **kw)
    as_ids = client.completions.create(
        prompt="Hi", logprobs=2, echo=True, extra_body={"return_tokens_as_token_ids": True}, **kw
    )
    a, b = plain.choices[0].logprobs, as_ids.choices[0].logprobs
    assert len(a.tokens) == len(b.tokens) and all(t.startswith("token_id:") for t in b.tokens)
    assert a.token_logprobs == b.token_logprobs
    ids = [int(t.split(":")[1]) for t in b.tokens]
    assert "".join(a.tokens) == plain.choices[0].text  # the text form, token by token
    assert [len(t or {}) for t in a.top_logprobs] == [len(t or {}) for t in b.top_logprobs]
    assert all(k.startswith("token_id:") for t in b.top_logprobs if t for k in t)
    chat = client.chat.completions.create(
        messages=MSG,
        logprobs=True,
        top_logprobs=1,
        stream=True,
        extra_body={"return_tokens_as_token_ids": True},
        **kw,
    )
    entries = [
        e
        for c in chat
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == 4 and all(e.token.startswith("token_id:") for e in entries)
    assert all(e.top_logprobs[0].token.startswith("token_id:") for e in entries)
    assert [http_detok(http, [i]) for i in ids] == a.tokens  # the same tokens, named by id


def test_cache_salt_keeps_tenants_prefixes_apart(client, server, http):
    """usage.prompt_tokens_details.cached_tokens says what the prefix cache served: a repeat
    within one salt hits, the same prompt under another salt (or none) does not."""
    prompt = "Salted prompt. " + " ".join(f"w{i}" for i in range(60))
    kw = dict(model=server.model, prompt=prompt, max_tokens=1, temperature=0)

    def cached(salt):
        r = client.completions.create(**kw, extra_body={"cache_salt": salt} if salt else None)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 16  # its own repeat: whole blocks from the cache
    assert cached("tenant-b") == 0 and cached(None) == 0  # no one else's
    assert cached(None) > 16
    bad = http.post("/v1/completions", json={"prompt": "x", "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def test_return_token_ids(server, http):
    """The prompt's and the output's token ids beside the text (vLLM's return_token_ids, what RL
    trainers read): the same ids streamed (the chunks' ids joined) or not; absent unless asked."""
    prompt = "The capital of France is"
    base = {"model": server.model, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    done = http.post("/v1/completions", json={**base, "prompt": prompt, "return_token_ids": True})
    ch = done.json()["choices"][0]
    assert ch["prompt_token_ids"] == ids and len(ch["token_ids"]) == 6
    assert http_detok(http, ch["token_ids"]) == ch["text"]
    plain = http.post("/v1/completions", json={**base, "prompt": prompt}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    body = {**base, "prompt": prompt, "return_token_ids": True, "stream": True}
    chunks = _sse(http, "/v1/completions", body)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ch["token_ids"]

    msgs = {"messages": MSG, "return_token_ids": True}
    chat = http.post("/v1/chat/completions", json={**base, **msgs}).json()
    chat_ids = http.post("/tokenize", json={"messages": MSG}).json()["tokens"]
    assert chat["prompt_token_ids"] == chat_ids and len(chat["choices"][0]["token_ids"]) == 6
    chunks = _sse(http, "/v1/chat/completions", {**base, **msgs, "stream": True})
    assert chunks[0]["prompt_token_ids"] == chat_ids
    streamed = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids", [])]
    assert streamed == chat["choices"][0]["token_ids"]


def _sse(http, route, body):
    import json

    with http.stream("POST", route, json=body) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]
