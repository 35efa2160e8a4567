"""Graceful drain (serving.drain) on a real server process: `paxengine serve`'s serving loop
around the FakeEngine (tests/serving/drain_app.py), signalled while streams are in flight."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import _free_port

HERE = os.path.dirname(os.path.abspath(__file__))


class Server:
    def __init__(self, shutdown_timeout: float, step_s: float, die_after_s: float | None = None):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, os.path.join(HERE, "drain_app.py"), str(self.port)]
        args += [str(shutdown_timeout), str(step_s)]
        if die_after_s is not None:
            args.append(str(die_after_s))
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"the server did not start: {self.proc.stdout.read()}")
            time.sleep(0.05)

    def stream(self, max_tokens: int, into: list):
        """A streamed completion on a thread: its chunks' finish reasons and whether [DONE]
        came, appended to `into` when the stream ends."""

        def run():
            reasons, done, first = [], False, True
            body = {"prompt": "hi", "max_tokens": max_tokens, "stream": True}
            with httpx.stream("POST", f"{self.base}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if first:
                        self.started.release()
                        first = False
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        reasons += [c["finish_reason"] for c in json.loads(line[6:])["choices"]]
            into.append((r.status_code, [x for x in reasons if x], done))

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def start_streams(self, n: int, max_tokens: int) -> tuple[list, list]:
        self.started = threading.Semaphore(0)
        results: list = []
        threads = [self.stream(max_tokens, results) for _ in range(n)]
        for _ in range(n):  # every stream has its first chunk: all are in flight
            assert self.started.acquire(timeout=30)
        return threads, results

    def signal(self):
        self.proc.send_signal(signal.SIGTERM)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _wait(threads, timeout):
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a stream did not end"


def test_sigterm_refuses_new_work_lets_streams_finish_and_exits_0():
    srv = Server(shutdown_timeout=30, step_s=0.02)
    try:
        threads, results = srv.start_streams(3, max_tokens=60)  # ~1.2 s each
        srv.signal()
        time.sleep(0.2)
        health = httpx.get(f"{srv.base}/health", timeout=5)
        assert health.status_code == 503 and health.json()["error"]["code"] == "server_draining"
        r = httpx.post(f"{srv.base}/v1/completions", json={"prompt": "x"}, timeout=5)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "shutting down" in r.json()["error"]["message"]
        _wait(threads, 30)
        # every stream ran to its own end, not cut and not aborted
        assert results == [(200, ["length"], True)] * 3
        assert srv.proc.wait(15) == 0
    finally:
        srv.stop()


@pytest.mark.parametrize("second_signal", [False, True], ids=["timeout", "second_signal"])
def test_in_flight_streams_are_aborted_with_a_final_event(second_signal):
    """After the shutdown timeout, or at once on a second signal (the timeout is long then)."""
    srv = Server(shutdown_timeout=120 if second_signal else 0.5, step_s=0.2)
    try:
        threads, results = srv.start_streams(2, max_tokens=100)  # ~20 s each
        srv.signal()
        if second_signal:
            time.sleep(0.5)
            assert not any(results)  # the first signal waits for them
            srv.signal()
        t0 = time.monotonic()
        _wait(threads, 15)
        assert time.monotonic() - t0 < 8
        assert results == [(200, ["abort"], True)] * 2
        assert srv.proc.wait(15) == 0
    finally:
        srv.stop()


def test_a_dead_engine_ends_the_process_with_status_1():
    srv = Server(shutdown_timeout=30, step_s=0.2, die_after_s=2.0)
    try:
        threads, results = srv.start_streams(1, max_tokens=100)
        _wait(threads, 15)
        assert results == [(200, ["abort"], True)]  # ended in-band, not cut
        assert srv.proc.wait(15) == 1
    finally:
        srv.stop()
