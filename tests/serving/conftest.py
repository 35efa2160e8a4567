"""Fixtures for the server tests: the repository root on sys.path, and (in the real-engine test
files) one SmolLM2 server per test session, see `real_server.py`."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import socket
import threading
import time
from types import SimpleNamespace

import pytest

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"


def engine_config():
    """A small engine: short context, few sequences, small steps (2 CPU cores in CI)."""
    from paxengine.config import EngineConfig

    return EngineConfig(
        model=None,
        served_model_name=MODEL,
        max_model_len=512,
        max_num_seqs=16,
        max_num_batched_tokens=128,
        num_kv_blocks=256,
        block_size=16,
        show_progress=False,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server():
    """One real SmolLM2 server on a loopback port for the whole session."""
    import uvicorn

    from paxengine.async_engine import AsyncEngine
    from serving.app import build_app
    from serving.config import ServerConfig

    engine = AsyncEngine(engine_config())
    port = _free_port()
    # tool_choice "auto" as vLLM serves it: with --enable-auto-tool-choice --tool-call-parser
    scfg = ServerConfig(
        host="127.0.0.1",
        port=port,
        api_key=API_KEY,
        enable_auto_tool_choice=True,
        tool_call_parser="auto",
    )
    app = build_app(engine, scfg)
    srv = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5
        )
    )
    thread = threading.Thread(target=srv.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    while not srv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            pytest.fail("the server did not start")
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}"
    yield SimpleNamespace(
        base=base,
        url=f"{base}/v1",
        engine=engine,
        app=app,
        api_key=API_KEY,
        model=MODEL,
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    srv.should_exit = True
    thread.join(30)


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server):
    import httpx

    with httpx.Client(base_url=server.base, headers=server.headers, timeout=120) as c:
        yield c
