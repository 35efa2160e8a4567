"""`paxengine serve`'s serving loop (serving.cli.serve: drain on SIGTERM/SIGINT) around the
FakeEngine, as a process the drain tests can signal.

    python tests/serving/drain_app.py PORT SHUTDOWN_TIMEOUT STEP_S [DIE_AFTER_S]

DIE_AFTER_S: the engine turns unhealthy (as a dead engine loop) that long after start.
"""

import os
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]

from fake_engine import FakeEngine  # noqa: E402

from serving.app import build_app  # noqa: E402
from serving.cli import serve  # noqa: E402
from serving.config import ServerConfig  # noqa: E402

if __name__ == "__main__":
    port, timeout, step_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    engine = FakeEngine(step_s=step_s)
    if len(sys.argv) > 4:
        threading.Timer(float(sys.argv[4]), setattr, (engine, "healthy", False)).start()
    cfg = ServerConfig(host="127.0.0.1", port=port, shutdown_timeout=timeout, log_level="warning")
    sys.exit(serve(build_app(engine, cfg), engine, cfg))
