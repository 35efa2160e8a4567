"""The server over a real FP8 engine (issue #17): FP8 weights and an FP8 KV cache with
calibrated scales, said by /v1/models, and requests served through them. Four of SmolLM2's real
layers (devices.truncated_smollm2, its tokenizer): every layer quantizes and calibrates alike,
and the server's part is what is tested here, not the text (XLA emulates fp8 on CPUs: each of
the 30 layers costs step time)."""

from devices import truncated_smollm2
from fastapi.testclient import TestClient

from paxengine.async_engine import AsyncEngine
from paxengine.config import EngineConfig
from serving.app import build_app
from serving.config import ServerConfig


def test_fp8_engine_serves_and_says_what_it_runs():
    engine = AsyncEngine(
        EngineConfig(
            model=truncated_smollm2(),
            quantization="fp8",
            kv_cache_dtype="fp8",
            max_model_len=256,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            token_buckets=[16, 64],
            seq_buckets=[4],
            num_kv_blocks=8,  # 512 tokens of 64-token fp8 pages: XLA emulates fp8 on CPUs
            show_progress=False,
        )
    )
    with TestClient(build_app(engine, ServerConfig())) as c:
        card = c.get("/v1/models").json()["data"][0]
        assert card["weight_dtype"] == "fp8_e4m3"
        assert (card["kv_cache_dtype"], card["kv_cache_scales"]) == ("fp8_e4m3", "calibrated")
        r = c.post(
            "/v1/completions",
            json={
                "model": card["id"],
                "prompt": "The capital of France is",
                "max_tokens": 6,
                "temperature": 0,
            },
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["text"].strip()
        # a request the engine refuses leaves it serving
        bad = c.post("/v1/completions", json={"model": card["id"], "prompt": "x", "max_tokens": 0})
        assert bad.status_code == 400
        again = c.post(
            "/v1/completions",
            json={"model": card["id"], "prompt": "def fib(n):", "max_tokens": 4},
        )
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4
