"""A tiny OpenAI-compatible streaming server for unit-testing the bench client (no model).

Each request streams `max_tokens` tokens ("t0 ", "t1 ", ...) `token_delay` seconds apart, then a
usage chunk (when stream_options.include_usage) and [DONE]. Prompts over `max_prompt_len` tokens
get HTTP 400, as a real server's validation would."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def make_app(
    token_delay: float = 0.002,
    max_prompt_len: int = 4096,
    usage: bool = True,
    model: str = "fake-model",
) -> FastAPI:
    app = FastAPI()
    app.state.requests = []

    @app.get("/health")
    async def health():
        return {}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model"}]}

    async def handle(req: Request, chat: bool):
        body = await req.json()
        app.state.requests.append(body)
        if chat:
            prompt = " ".join(m["content"] for m in body["messages"])
            n_prompt = len(prompt.split())
        else:
            prompt = body["prompt"]
            n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        if n_prompt > max_prompt_len:
            return JSONResponse(
                {
                    "error": {
                        "message": f"prompt too long ({n_prompt})",
                        "type": "BadRequestError",
                        "param": "prompt",
                        "code": 400,
                    }
                },
                400,
            )
        n_out = int(body.get("max_tokens") or 16)
        rid = f"cmpl-{len(app.state.requests)}"

        async def gen():
            if chat:
                yield (
                    "data: "
                    + json.dumps(
                        {
                            "id": rid,
                            "choices": [
                                {
                                    "index": 0,
                                    "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None,
                                }
                            ],
                        }
                    )
                    + "\n\n"
                )
            for i in range(n_out):
                await asyncio.sleep(token_delay)
                fin = "length" if i == n_out - 1 else None
                if chat:
                    ch = {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": fin}
                else:
                    ch = {"index": 0, "text": f"t{i} ", "finish_reason": fin}
                yield "data: " + json.dumps({"id": rid, "choices": [ch], "usage": None}) + "\n\n"
            if usage and (body.get("stream_options") or {}).get("include_usage"):
                yield (
                    "data: "
                    + json.dumps(
                        {
                            "id": rid,
                            "choices": [],
                            "usage": {
                                "prompt_tokens": n_prompt,
                                "completion_tokens": n_out,
                                "total_tokens": n_prompt + n_out,
                            },
                        }
                    )
                    + "\n\n"
                )
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: Request):
        return await handle(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        return await handle(req, chat=True)

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn in a background thread on 127.0.0.1."""

    def __init__(self, app, port: int | None = None):
        self.port = port or free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(
                app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
