"""Shared fixtures: the real server as a subprocess on a free loopback port, the real SDK.

`ServerProcess` starts `python actae.py --port 0 --data-dir <tmp>` (or any command given, such
as the built executable), reads the printed URL and key, waits for /healthz, and keeps
draining the output so the server never blocks on a full pipe.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
URL_LINE = re.compile(r"^Dashboard:\s+(http://\S+)")
KEY_LINE = re.compile(r"^API key:\s+(.*)$")


class ServerProcess:
    """A running Actae server: `.url`, `.key` (None when it printed no new key), `.lines`."""

    def __init__(self, data_dir, *, command=None, env=None, port=0):
        self.data_dir = Path(data_dir)
        self.command = command or [sys.executable, str(ROOT / "actae.py")]
        inherited = {k: v for k, v in os.environ.items() if k not in ("ACTAE_API_KEY", "ACTAE_DATA_DIR")}
        self.env = {**inherited, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.port = port
        self.lines: list[str] = []
        self.url: str | None = None
        self.key: str | None = None
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None
        self._header_done = threading.Event()

    def start(self, timeout=30.0) -> "ServerProcess":
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [*self.command, "--port", str(self.port), "--data-dir", str(self.data_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env,
            cwd=str(ROOT),
        )
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._header_done.wait(timeout):
            self.kill()
            raise RuntimeError("server printed no URL/key lines:\n" + "\n".join(self.lines))
        self._wait_healthy(timeout)
        self.startup_seconds = time.monotonic() - started
        return self

    def _drain(self):
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            if m := URL_LINE.match(line):
                self.url = m.group(1).rstrip("/")
            elif (m := KEY_LINE.match(line)) and self.url:
                token = m.group(1).split()[0] if m.group(1).split() else ""
                self.key = token if token.startswith("sk-") else None
                self._header_done.set()
        self._header_done.set()

    def _wait_healthy(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + "\n".join(self.lines))
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.05)
        raise RuntimeError("server never became healthy:\n" + "\n".join(self.lines))

    def stop(self, sig=signal.SIGINT, timeout=15.0) -> int:
        """Stop with `sig` (Ctrl-C by default) and return the exit code."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def http(method, url, *, key=None, body=None, raw=None, headers=None, timeout=30):
    """One raw HTTP call; returns (status, headers, parsed JSON or text). Never raises on 4xx/5xx."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method)
    if key:
        req.add_header("x-api-key", key)
    if data is not None and not (headers or {}).get("content-type"):
        req.add_header("content-type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, hdrs, text = r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        status, hdrs, text = e.code, e.headers, e.read().decode()
    if "json" in (hdrs.get("content-type") or ""):
        return status, hdrs, json.loads(text) if text else None
    return status, hdrs, text


def run(coro):
    """Run one coroutine to completion (tests stay plain functions; no plugin needed)."""
    return asyncio.run(coro)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The shared server for the whole test session."""
    srv = ServerProcess(tmp_path_factory.mktemp("actae-data")).start()
    yield srv
    srv.stop()


@pytest.fixture
def make_client(server):
    """`make_client(**kw)` -> an `ActaeClient` pointed at the shared server (not yet connected)."""
    from actae_client import ActaeClient

    def factory(**kw):
        kw.setdefault("api_key", server.key)
        return ActaeClient(endpoint=server.url, **kw)

    return factory


@pytest.fixture
def with_client(make_client):
    """`with_client(body)` -> result of `await body(client)` on a fresh SDK client (closed after)."""

    def runner(body):
        async def main():
            client = make_client()
            try:
                return await body(client)
            finally:
                await client.disconnect()

        return run(main())

    return runner


@pytest.fixture
def unique(request):
    """A channel-id-safe name unique to this test: `unique("base")` -> `t<hash>-base`."""
    import hashlib

    tag = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:10]
    return lambda suffix="": f"t{tag}-{suffix}" if suffix else f"t{tag}"
