"""OpenAI-compatible HTTP server for paxengine (FastAPI + uvicorn).

`serving.app.build_app(engine, server_config)` builds the app around an AsyncEngine;
`serving.cli.main(argv)` is what `paxengine serve ...` runs.
"""

from serving.config import ServerConfig

__all__ = ["ServerConfig"]
