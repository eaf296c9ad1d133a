"""The server as a deployment may run it: `create_app()` inside an ordinary ASGI middleware (a request
logger), served by plain uvicorn with its own h11 protocol instead of ours.

    python tests/wrapped_server.py --port 0 --data-dir DIR [--database URL]

It prints the two lines `python actae.py` prints (the dashboard URL and the API key), so conftest's
ServerProcess runs it like the real thing when ACTAE_TEST_WRAPPED=1 (see test_module.py).
"""
from __future__ import annotations

import argparse
import logging
import secrets
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import actae  # noqa: E402
import uvicorn  # noqa: E402

log = logging.getLogger("wrapped")


class RequestLogger:
    """An ASGI middleware any deployment might add: it sees every request and every answer's status."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), []

        async def noting(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        await self.app(scope, receive, noting)
        log.info("%s %s %s %.1fms", scope["method"], scope["path"], status[0] if status else "-",
                 (time.perf_counter() - started) * 1000)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--database")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    key = "sk-" + secrets.token_hex(24)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    app = RequestLogger(actae.create_app(Path(args.data_dir), database_url=args.database, env_key=key))
    print(f"Dashboard:   http://127.0.0.1:{sock.getsockname()[1]}")
    print(f"API key:     {key}", flush=True)
    config = uvicorn.Config(app, http="h11", lifespan="on", log_level="warning", ws_max_size=actae.MAX_BODY_BYTES)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
