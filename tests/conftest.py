"""Shared fixtures: the real server as a subprocess on a free loopback port, the real SDK.

`ServerProcess` starts `python actae.py --port 0 --data-dir <tmp>` (or any command given, such
as the built executable), reads the printed URL and key, waits for /healthz, and keeps
draining the output so the server never blocks on a full pipe.

Backend: with `ACTAE_TEST_DATABASE_URL=postgresql://USER:PW@HOST:PORT/postgres` (a maintenance
database where CREATE DATABASE is allowed) every server the tests start runs on PostgreSQL: each
data dir gets its own database (`database_url_for`), created on first use and dropped when the
session ends, so a restart on the same data dir keeps its data. Without it, SQLite in the data dir.
`BACKEND` says which; `query_database` reads or edits a server's database on either backend.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import secrets
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
URL_LINE = re.compile(r"^Dashboard:\s+(http://\S+)")
KEY_LINE = re.compile(r"^API key:\s+(.*)$")

# --------------------------------------------------------------------------------------------
# Backend: SQLite in the data dir, or PostgreSQL when ACTAE_TEST_DATABASE_URL is set
# --------------------------------------------------------------------------------------------

POSTGRES_URL: str | None = os.environ.get("ACTAE_TEST_DATABASE_URL") or None
BACKEND = "postgresql" if POSTGRES_URL else "sqlite"
DATABASE_PREFIX = "actae_t_"

_databases_lock = threading.Lock()
_databases: dict[str, None] = {}      # names made (or found) this session, in order; dropped at the end


def _psycopg():
    import psycopg  # only on the PostgreSQL pass

    return psycopg


def _url_of(name: str) -> str:
    """POSTGRES_URL with its database replaced by `name` (user, password, host, query kept)."""
    return urlunsplit(urlsplit(POSTGRES_URL)._replace(path="/" + name))


def _create_database(name: str) -> str:
    """CREATE DATABASE `name` (UTF8) unless this session already has it; returns its URL."""
    with _databases_lock:
        if name not in _databases:
            psycopg = _psycopg()
            from psycopg import sql

            statement = sql.SQL("CREATE DATABASE {} ENCODING 'UTF8' TEMPLATE template0").format(sql.Identifier(name))
            with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=10) as conn:
                try:
                    conn.execute(statement)
                except (psycopg.errors.DuplicateDatabase, psycopg.errors.UniqueViolation):
                    pass                          # already there (made by a concurrent or earlier run)
            _databases[name] = None
    return _url_of(name)


def database_url_for(data_dir) -> str | None:
    """The PostgreSQL database a server on `data_dir` uses (created on first use), or None on SQLite.

    One database per resolved data dir: `actae_t_<first 16 hex of its sha1>`."""
    if not POSTGRES_URL:
        return None
    digest = hashlib.sha1(str(Path(data_dir).resolve()).encode()).hexdigest()[:16]
    return _create_database(DATABASE_PREFIX + digest)


def fresh_database_url(tag: str = "db") -> str:
    """A brand-new, empty PostgreSQL database (for several servers on one database); its URL.

    Skips the calling test on SQLite, where servers cannot share a database this way."""
    if not POSTGRES_URL:
        pytest.skip("needs PostgreSQL (set ACTAE_TEST_DATABASE_URL)")
    safe = re.sub(r"[^a-z0-9_]+", "_", tag.lower()).strip("_")[:24] or "db"
    return _create_database(f"{DATABASE_PREFIX}{safe}_{secrets.token_hex(6)}")


def drop_test_databases() -> None:
    """DROP (WITH FORCE) every database this session made; failures are ignored."""
    with _databases_lock:
        names = list(_databases)
        _databases.clear()
    if not names:
        return
    try:
        psycopg = _psycopg()
        from psycopg import sql

        with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=10) as conn:
            for name in names:
                try:
                    conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
                except Exception:  # noqa: BLE001 - best effort: a leftover database is harmless
                    pass
    except Exception:  # noqa: BLE001 - the cluster may already be gone
        pass


@pytest.fixture(scope="session", autouse=True)
def _drop_databases_at_the_end():
    """Session cleanup: the PostgreSQL databases created for the tests are dropped afterwards."""
    yield
    drop_test_databases()


def query_database(target, sql: str, params=None, *, postgresql: str | None = None) -> list[tuple]:
    """Run one statement on the database behind `target` (a ServerProcess or a data dir), committed.

    Returns the rows (a list of tuples; [] for a statement without result). `sql` is written for
    SQLite with `?` placeholders; on PostgreSQL each `?` becomes `%s`, unless `postgresql=` gives
    that backend's own statement (use it where the dialects differ, e.g. catalog queries or casts).
    Values come back as each driver returns them (PostgreSQL: bytea -> bytes, jsonb -> Python objects)."""
    if isinstance(target, ServerProcess):
        data_dir, url = target.data_dir, target.database
    else:
        data_dir, url = Path(target), database_url_for(target)
    if url:
        psycopg = _psycopg()
        if postgresql is None:
            postgresql = sql.replace("%", "%%").replace("?", "%s") if params else sql
        with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
            cursor = conn.execute(postgresql, params or None)
            return cursor.fetchall() if cursor.description else []
    conn = sqlite3.connect((Path(data_dir) / "actae.db").resolve().as_uri() + "?mode=rw", uri=True, timeout=10)
    try:
        with conn:
            cursor = conn.execute(sql, params or ())
            return cursor.fetchall() if cursor.description else []
    finally:
        conn.close()


class ServerProcess:
    """A running Actae server: `.url`, `.key` (None when it printed no new key), `.lines`.

    `.database` is the PostgreSQL URL it gets as `--database` (and as ACTAE_DATABASE_URL in `.env`,
    so `actae.py key ...` run with that env reaches the same database), or None on SQLite. It is
    `database=` when given, else the data dir's own database on the PostgreSQL pass."""

    def __init__(self, data_dir, *, command=None, env=None, port=0, database: str | None = None):
        self.data_dir = Path(data_dir)
        self.database = database if database is not None else database_url_for(self.data_dir)
        self.command = command or [sys.executable, str(ROOT / "actae.py")]
        inherited = {k: v for k, v in os.environ.items()
                     if k not in ("ACTAE_API_KEY", "ACTAE_DATA_DIR", "ACTAE_DATABASE_URL")}
        backend = {"ACTAE_DATABASE_URL": self.database} if self.database else {}
        self.env = {**inherited, "PYTHONUNBUFFERED": "1", **backend, **(env or {})}
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
            [*self.command, "--port", str(self.port), "--data-dir", str(self.data_dir),
             *(["--database", self.database] if self.database else [])],
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


def session_log(events):
    """[(event type, owner)] of an AgentSession's own events: owner from session.started's params
    and each "work" step's output (None for session.completed); the fence's ledger events left out."""
    out = []
    for e in events:
        if e.event_type == "session.started":
            out.append((e.event_type, e.payload["params"]["owner"]))
        elif e.event_type == "work":
            out.append((e.event_type, e.payload["output"]["owner"]))
        elif e.event_type == "session.completed":
            out.append((e.event_type, None))
    return out
