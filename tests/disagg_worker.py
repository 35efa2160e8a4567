"""Run in a subprocess by test_disagg.py with XLA_FLAGS giving it 2 CPU devices: a prefill
engine on device 0 and a decode engine on device 1, offline (LLM) and behind the server, against
one engine. Prints one JSON line of what the tests check."""

import asyncio
import json
import sys

PROMPTS = ["The capital of France is", "def fib(n):", "word " * 40, "Once upon a time"]


def free_blocks(core) -> dict:
    p, d = core.prefill.kv, core.decode.kv
    return {
        "prefill": [p.num_free_blocks, p.num_blocks],
        "decode": [d.num_free_blocks, d.num_blocks],
    }


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def offline(small, res):
    from paxengine import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=8)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=8, seed=11)
    one = LLM(show_progress=False, **small)
    res["one_greedy"] = tokens(one.generate(PROMPTS, greedy, use_tqdm=False))
    res["one_seeded"] = tokens(one.generate(PROMPTS, seeded, use_tqdm=False))
    kvt = {"kv_role": "kv_both", "max_blocks_per_copy": 2}
    pd = LLM(show_progress=False, kv_transfer_config=kvt, **small)
    core = pd.engine
    res["devices"] = [
        sorted(d.id for d in core.prefill.runner.kv_cache[0].devices()),
        sorted(d.id for d in core.decode.runner.kv_cache[0].devices()),
    ]
    res["pd_greedy"] = tokens(pd.generate(PROMPTS, greedy, use_tqdm=False))
    res["pd_seeded"] = tokens(pd.generate(PROMPTS, seeded, use_tqdm=False))
    res["free_after_finish"] = free_blocks(core)
    st = core.transfer.stats
    res["copies_pages"] = [st.copies, st.pages]

    # a prefix the decode engine holds: only the pages past it move
    shared = "You are a careful assistant. " * 12  # ~70 tokens: 4 full 16-token blocks
    pd.generate([shared + "Say hi."], greedy, use_tqdm=False)
    before = (st.pages, st.pages_skipped)
    pd.generate([shared + "Name a colour."], greedy, use_tqdm=False)
    res["prefix_moved_skipped"] = [st.pages - before[0], st.pages_skipped - before[1]]
    res["prefix_prompt_blocks"] = -(-len(pd.tokenizer.encode(shared + "Name a colour.")) // 16)

    # a prompt longer than a step's tokens: its first chunk's pages go before it finishes
    long_prompt = "one two three four " * 25  # ~100 tokens: chunks of 64 and the rest
    before = (st.transfers, st.pages)
    got = tokens(pd.generate([long_prompt], greedy, use_tqdm=False))
    res["chunked"] = [st.transfers - before[0], st.pages - before[1]]
    res["chunked_equal"] = got == tokens(one.generate([long_prompt], greedy, use_tqdm=False))
    res["chunked_blocks"] = -(-len(pd.tokenizer.encode(long_prompt)) // 16)

    # a lost transfer on either side: the decode engine recomputes, same tokens, no block left
    core.transfer.fail_sends = 1
    a = tokens(pd.generate(PROMPTS[:2], greedy, use_tqdm=False))
    core.transfer.fail_receives = 1
    b = tokens(pd.generate(PROMPTS[:2], greedy, use_tqdm=False))
    res["failed_transfer_tokens"] = [a, b]
    res["recomputed"] = core.decode.recomputed
    res["free_after_failures"] = free_blocks(core)

    # aborts: while the pages wait for room on the decode side, and while it decodes there
    from paxengine import SamplingParams as SP

    long = SP(temperature=0, max_tokens=40)
    core.decode.scheduler.max_num_seqs = 0  # no room: the hand-off waits with its pages
    core.add_request("wait", PROMPTS[2], long)
    while "wait" not in core.decode.groups:
        core.step()
    res["parked"] = len(core.decode.arrivals)
    core.abort("wait")
    core.decode.scheduler.max_num_seqs = small["max_num_seqs"]
    core.add_request("run", PROMPTS[2], long)
    for _ in range(12):
        core.step()
    res["running_before_abort"] = len(core.decode.scheduler.running)
    core.abort("run")
    res["free_after_aborts"] = free_blocks(core)
    while core.has_unfinished():  # the step in flight when it was aborted is read, dropped
        assert not core.step()
    res["free_after_drain"] = free_blocks(core)

    # backpressure: while the decode side holds arrived pages it cannot admit (past
    # kv_buffer_size), no new prompt starts on the prefill side
    core.prefill.kv_buffer_size = 1
    core.decode.scheduler.max_num_seqs = 0
    core.add_request("bp1", PROMPTS[0], greedy, final_only=True)
    while "bp1" not in core.decode.groups:
        core.step()
    core.add_request("bp2", PROMPTS[1], greedy, final_only=True)
    for _ in range(4):
        core.step()
    bp2 = core.prefill.seq_of["bp2"][1].req
    res["backpressure"] = [core.decode.waiting_bytes > 0, bp2.num_computed_tokens]
    core.decode.scheduler.max_num_seqs = small["max_num_seqs"]
    done = {}
    while core.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in core.step() if o.finished})
    res["backpressure_tokens"] = [done["bp1"], done["bp2"]]
    res["free_after_backpressure"] = free_blocks(core)
    core.prefill.kv_buffer_size = float("inf")

    # launches from a worker thread (the pages are gathered there), logprobs, stop strings under
    # min_tokens, a grammar carried across: still one engine's output
    from paxengine.structured import StructuredOutputs

    dt = LLM(show_progress=False, kv_transfer_config=kvt, dispatch_thread=True, **small)
    cases = [
        SP(temperature=0, max_tokens=8, logprobs=2),
        SP(temperature=0, max_tokens=8, stop=[" the"], min_tokens=3),
        SP(
            temperature=0,
            max_tokens=12,
            structured_outputs=StructuredOutputs(regex="[a-z]+ [0-9]+"),
        ),
    ]

    def full(outs):
        return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].logprobs) for o in outs]

    both = PROMPTS + [long_prompt]  # the long one sent chunk by chunk from the worker thread
    res["variants_equal"] = [
        full(dt.generate(both, c, use_tqdm=False)) == full(one.generate(both, c, use_tqdm=False))
        for c in cases
    ]
    res["free_dispatch_thread"] = free_blocks(dt.engine)
    return one


async def front_aborts(engine) -> dict:
    """Through the EngineClient: abort() right after the first token (between the engines),
    and a consumer that stops reading while the decode engine runs it. Both sides end idle
    with every block free."""
    from paxengine import SamplingParams

    await engine.start()
    p = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    outs = []
    async for out in engine.generate("ab1", PROMPTS[2], p):
        outs.append(out)
        if len(outs) == 1:
            await engine.abort("ab1")
    first = [outs[-1].outputs[0].finish_reason, len(outs[-1].outputs[0].token_ids)]
    stream = engine.generate("ab2", PROMPTS[2], p)
    n = 0
    async for _ in stream:
        n += 1
        if n == 3:
            break
    await stream.aclose()
    for _ in range(200):  # the aborts are handled between steps, on the engines' threads
        cores = (engine.prefill.core, engine.decode.core)
        if not any(c.has_unfinished() for c in cores):
            break
        await asyncio.sleep(0.02)
    free = [c.kv.num_free_blocks == c.kv.num_blocks for c in cores]
    return {
        "abort_after_first": first,
        "closed_after": n,
        "idle": not any(c.has_unfinished() for c in cores),
        "free": free,
    }


def serving(small, res, one):
    from fastapi.testclient import TestClient

    from paxengine import SamplingParams
    from paxengine.config import EngineConfig
    from paxengine.disagg.front import DisaggregatedEngine
    from serving.app import build_app
    from serving.config import ServerConfig

    cfg = EngineConfig(show_progress=False, kv_transfer_config={"kv_role": "kv_both"}, **small)
    engine = DisaggregatedEngine(cfg)
    from paxengine.client import EngineClient

    res["is_engine_client"] = isinstance(engine, EngineClient)
    res["front_aborts"] = asyncio.run(front_aborts(engine))
    body = {"model": engine.model_info().name, "max_tokens": 8, "temperature": 0}
    want = [
        o.outputs[0].text
        for o in one.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    ]
    with TestClient(build_app(engine, ServerConfig())) as c:
        texts = []
        for p in PROMPTS:
            r = c.post("/v1/completions", json={**body, "prompt": p})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        res["served"] = texts
        streamed = []
        for p in PROMPTS:
            chunks = []
            with c.stream(
                "POST", "/v1/completions", json={**body, "prompt": p, "stream": True}
            ) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:])["choices"][0]["text"])
            res.setdefault("stream_chunks", []).append(len(chunks))
            streamed.append("".join(chunks))
        res["streamed"] = streamed
        res["want_text"] = want
        r = c.post("/v1/completions", json={**body, "prompt": "hi", "n": 2})
        res["n2_status"] = r.status_code
        st = engine.stats()
        res["served_usage"] = [s["kv_cache_usage_perc"] for s in st["replicas"]]
        res["served_free"] = [
            engine.prefill.core.kv.num_free_blocks == engine.prefill.core.kv.num_blocks,
            engine.decode.core.kv.num_free_blocks == engine.decode.core.kv.num_blocks,
        ]
        res["served_pages"] = st["kv_transfer_pages"]
        res["metrics_engines"] = sorted(
            ln.split('engine="')[1].split('"')[0]
            for ln in c.get("/metrics").text.splitlines()
            if "num_requests_running{" in ln
        )
        res["compiles_after_warmup"] = st["xla_compiles_after_warmup"]

        # a dead decode engine: the request fails (503), the prefill side holds nothing
        def die():
            raise RuntimeError("decode engine killed by the test")

        engine.decode.core.step = die
        r = c.post("/v1/completions", json={**body, "prompt": PROMPTS[0]})
        res["dead_peer_status"] = r.status_code
        r = c.post("/v1/completions", json={**body, "prompt": PROMPTS[1]})
        res["after_dead_status"] = r.status_code
        res["healthy_after_dead"] = engine.is_healthy()
        kv = engine.prefill.core.kv
        res["prefill_free_after_dead"] = kv.num_free_blocks == kv.num_blocks


def main() -> None:
    small = json.loads(sys.argv[1])
    res = {}
    one = offline(small, res)
    serving(small, res, one)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
