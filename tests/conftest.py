"""Shared fixtures: the real server as a subprocess on a free loopback port, the real SDK.

`ServerProcess` starts `python actae.py --port 0 --data-dir <tmp>` (or any command given, such
as the built executable), reads the printed URL and key, waits for /healthz, and keeps
draining the output so the server never blocks on a full pipe.

Backend: with `ACTAE_TEST_DATABASE_URL=postgresql://USER:PW@HOST:PORT/postgres` (a maintenance
database where CREATE DATABASE is allowed) every server the tests start runs on PostgreSQL: each
data dir gets its own database (`database_url_for`), created on first use and dropped when the
session ends, so a restart on the same data dir keeps its data. Without it, SQLite in the data dir.
`BACKEND` says which; `query_database` reads or edits a server's database on either backend.

The helpers every test file shares live here, and only here (a test file imports from conftest,
never from another test file):

- `ServerProcess(dir, args=[...]).start()`, used as `with ServerProcess(dir).start() as srv:`;
  `cli(*args, data_dir=...)` runs `python actae.py ARGS` the way a user would, `run_program`
  and `run_example` a user's program against a server, `import_example` an example as a module;
- `poll(predicate, timeout)` waits for a condition instead of sleeping;
- HTTP: `http` (one urllib call), `api` (a path on a server, with its key), `ok`/`get_json` (a 200's
  body), `latest_cursor`, `record`/`save_state`/`fork`/`new_key` (a run's rows and a scoped key, with a
  server's own key), `post_streaming` (aiohttp), `port_of`; raw sockets: `RawHTTP` (answers read
  off one connection, `parse_head` for the head of one);
- `Recording` (a connection that keeps the SQL a domain function sends, for the plan tests);
- `run`, `client_for`/`using`/`using_async` (one SDK client for one call), the `server`,
  `make_client`, `with_client` and `unique` fixtures;
- observability: `Collector` (a real OTLP/HTTP collector on loopback, keeping each span as a dict),
  `exporting_server` (a server exporting to one), `otel_export` (`actae otel-export` with
  `without_otel`'s environment), and `metric_values`/`value` (/metrics, parsed);
- a fleet: `start_fleet(root, remotes)` (a gateway with remote servers registered on it, as a
  `Fleet`), `instance_id` and `org_token`;
- the dashboard: `login`/`form_token` (an httpx session), `dashboard_cookie`/`with_cookie` (a session
  as a Cookie header), `get_with_host`, the `web` fixture, and for real Chromium
  the `browser` and `visits` fixtures, the `DESKTOP` and `PHONE` viewports, `watch`, `submit_login`,
  `logged_in` (a context and a logged-in page at a viewport), `page_sleep`, `shot` and `run_sdk`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import http.server as http_server
import importlib.util
import inspect
import json
import os
import re
import secrets
import signal
import socket
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
ACTAE_PY = [sys.executable, str(ROOT / "actae.py")]     # the server, as `python actae.py`
# What ServerProcess starts: the server, or with ACTAE_TEST_WRAPPED=1 its app inside an ordinary ASGI
# middleware under plain uvicorn (tests/wrapped_server.py; see test_module.py).
SERVE_PY = ([sys.executable, str(ROOT / "tests" / "wrapped_server.py")] if os.environ.get("ACTAE_TEST_WRAPPED")
            else ACTAE_PY)
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


# --------------------------------------------------------------------------------------------
# Waiting for a condition
# --------------------------------------------------------------------------------------------

def _describe(predicate) -> str:
    """A predicate as a reader of a failure would want it: its name, or a lambda's source line."""
    name = getattr(predicate, "__qualname__", None) or repr(predicate)
    if "<lambda>" in name:
        try:
            return inspect.getsource(predicate).strip()
        except (OSError, TypeError):
            pass
    return name


def _timed_out(predicate, what, timeout, value) -> AssertionError:
    what = what() if callable(what) else what
    shown = repr(value)
    shown = shown if len(shown) <= 500 else shown[:500] + "..."
    return AssertionError(f"timed out after {timeout:g} s waiting for {what or _describe(predicate)} "
                          f"(last value: {shown})")


def poll(predicate, timeout: float = 10.0, *, what=None, every: float = 0.05, sleep=time.sleep):
    """Call `predicate()` until it returns something truthy, and return that value.

    After `timeout` seconds without one, raise AssertionError saying what was awaited (`what`, or
    the predicate's name or source), for how long, and what it last returned; `what` may be a
    function, called then, to describe the state at the timeout. The first call is
    made at once; between calls `sleep(every)` (`sleep=page_sleep(page)` in a browser test, so
    the page's events keep arriving).

    An async predicate (one whose call returns an awaitable) makes `poll` awaitable:
    `await poll(check, 5)` awaits each `check()` and sleeps with asyncio.sleep in between.
    Use it wherever a test would otherwise sleep for a fixed time and hope."""
    started = time.monotonic()
    value = predicate()
    if inspect.isawaitable(value):
        return _poll_async(predicate, value, started, timeout, what, every)
    while not value:
        if time.monotonic() - started >= timeout:
            raise _timed_out(predicate, what, timeout, value)
        sleep(every)
        value = predicate()
    return value


async def _poll_async(predicate, first, started, timeout, what, every):
    value = await first
    while not value:
        if time.monotonic() - started >= timeout:
            raise _timed_out(predicate, what, timeout, value)
        await asyncio.sleep(every)
        value = await predicate()
    return value


# --------------------------------------------------------------------------------------------
# The server as a subprocess, and its command line
# --------------------------------------------------------------------------------------------

# Every server this session started, and what a log line must never carry: a key, a token, a ticket.
SERVERS: list = []
ISSUED_SECRET = re.compile(r"\b(sk|ot|tk|en|ft)-[A-Za-z0-9_-]{20,}|\beyJ[A-Za-z0-9_-]{20,}\.")


@pytest.fixture(scope="session", autouse=True)
def _no_secret_in_any_server_log():
    """After the whole suite: no server printed a key or token in a log line (its banner's first-start
    `API key:` line is the one place a key is shown, on purpose)."""
    yield
    leaked = [f"{srv.data_dir}: {line[:200]}" for srv in SERVERS for line in srv.lines
              if ISSUED_SECRET.search(line) and not line.startswith("API key:")]
    assert not leaked, "a secret in a server's log:\n" + "\n".join(leaked[:20])


class ServerProcess:
    """A running Actae server: `.url`, `.key` (None when it printed no new key), `.lines`.

    Start it and use it as a context manager, which stops it (Ctrl-C) on the way out:

        with ServerProcess(tmp_path).start() as srv:
            ...

    `command` is the program (`python actae.py` unless given, e.g. the built executable) and
    `args` extra flags after it (`args=["--open-signup"]`); `--port`, `--data-dir` and
    `--database` are added. `start()` stops what it started when the server does not come up.

    `.database` is the PostgreSQL URL it gets as `--database` (and as ACTAE_DATABASE_URL in `.env`,
    so `actae.py key ...` run with that env reaches the same database), or None on SQLite. It is
    `database=` when given, else the data dir's own database on the PostgreSQL pass."""

    def __init__(self, data_dir, *, command=None, args=(), env=None, port=0, database: str | None = None):
        self.data_dir = Path(data_dir)
        self.database = database if database is not None else database_url_for(self.data_dir)
        self.command = [*(command or SERVE_PY), *args]
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
        SERVERS.append(self)

    def start(self, timeout=30.0) -> "ServerProcess":
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [*self.command, "--port", str(self.port), "--data-dir", str(self.data_dir),
             *(["--database", self.database] if self.database else [])],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env,
            cwd=str(ROOT),
        )
        try:
            threading.Thread(target=self._drain, daemon=True).start()
            if not self._header_done.wait(timeout):
                raise RuntimeError("server printed no URL/key lines:\n" + "\n".join(self.lines))
            self._wait_healthy(timeout)
        except BaseException:
            self.kill()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

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

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError("server exited:\n" + "\n".join(self.lines))
        try:
            with urllib.request.urlopen(self.url + "/healthz", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, OSError):
            return False

    def _wait_healthy(self, timeout):
        try:
            poll(self._healthy, timeout, what="/healthz to answer 200")
        except AssertionError as exc:
            raise RuntimeError(f"server never became healthy ({exc}):\n" + "\n".join(self.lines)) from None

    def stop(self, sig=signal.SIGINT, timeout=15.0) -> int | None:
        """Stop with `sig` (Ctrl-C by default) and return the exit code (None if it never started)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode if self.proc else None

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def cli(*args, data_dir=None, env=None, input=None, text=True, timeout=60, check=True) -> subprocess.CompletedProcess:
    """`python actae.py ARGS`, run from the repository root as a user would; the finished process.

    With `data_dir` (a directory, or a ServerProcess for its own) `--data-dir DIR` follows ARGS and
    the command gets the environment a server on that dir gets, so on the PostgreSQL pass it
    reaches the same database. Without, it inherits this environment. `env` sets variables over
    that environment (a value of None removes one). Output is captured (text unless `text=False`;
    `input` goes to its stdin); with `check` (the default) it must exit 0."""
    environment = None
    if data_dir is not None:
        srv = data_dir if isinstance(data_dir, ServerProcess) else ServerProcess(data_dir)
        args, environment = (*args, "--data-dir", str(srv.data_dir)), srv.env
    if env:
        merged = {**(environment or os.environ), **env}
        environment = {k: v for k, v in merged.items() if v is not None}
    done = subprocess.run([*ACTAE_PY, *args], input=input, capture_output=True, text=text, timeout=timeout,
                          cwd=str(ROOT), env=environment)
    if check:
        assert done.returncode == 0, (f"`actae.py {' '.join(args)}` exited {done.returncode}:\n"
                                      f"{done.stdout}{done.stderr}")
    return done


def run_program(server, *argv, timeout=300) -> subprocess.CompletedProcess:
    """`python ARGV` as a user's program against `server` runs: ACTAE_URL and ACTAE_API_KEY set,
    from the repository root; the finished process, its output captured as text."""
    env = {**os.environ, "ACTAE_URL": server.url, "ACTAE_API_KEY": server.key}
    return subprocess.run([sys.executable, *map(str, argv)], env=env, cwd=str(ROOT), capture_output=True,
                          text=True, timeout=timeout)


def run_example(server, script, *args, timeout=300) -> subprocess.CompletedProcess:
    """examples/<script> ARGS against `server` (`run_program`)."""
    return run_program(server, ROOT / "examples" / script, *args, timeout=timeout)


def import_example(script):
    """examples/<script> imported as a module (its functions and constants), without running its main.

    It is `sys.modules["example_<stem>"]` while and after it runs, as a module imported by name would
    be (its dataclasses look their module up there)."""
    path = ROOT / "examples" / script
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------
# HTTP and the SDK
# --------------------------------------------------------------------------------------------

class _StayHandler(urllib.request.HTTPRedirectHandler):
    """A redirect handler that follows none: the 3xx itself comes back as the answer."""

    def redirect_request(self, *args, **kwargs):
        return None


_STAY = urllib.request.build_opener(_StayHandler)
_OWN_KEY = object()       # `api`'s default: the server's own key


def http(method, url, *, key=None, body=None, raw=None, headers=None, timeout=30, redirects=True, decode=True):
    """One urllib call: (status, headers, parsed JSON or text; bytes if not `decode`), never raising on 4xx/5xx."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method)
    if key:
        req.add_header("x-api-key", key)
    if data is not None and not (headers or {}).get("content-type"):
        req.add_header("content-type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with (urllib.request.urlopen if redirects else _STAY.open)(req, timeout=timeout) as r:   # or a 3xx as it came
            status, hdrs, content = r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        status, hdrs, content = e.code, e.headers, e.read()
    if not decode:
        return status, hdrs, content
    text = content.decode()
    if "json" in (hdrs.get("content-type") or ""):
        return status, hdrs, json.loads(text) if text else None
    return status, hdrs, text


def api(server, method, path, *, key=_OWN_KEY, raw=None, timeout=60, **kw):
    """`http` to `path` on `server` with its key (`key=` another, None for none); a str `raw` as UTF-8."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8")
    return http(method, server.url + path, key=server.key if key is _OWN_KEY else key, raw=raw, timeout=timeout, **kw)


def ok(response):
    """The body of a (status, headers, body) response, which must be a 200."""
    status, _, body = response
    assert status == 200, f"expected 200, got {status}: {str(body)[:300]}"
    return body


def get_json(server, path):
    """GET `path` on `server` with its key: the body of its 200 answer."""
    return ok(api(server, "GET", path))


def latest_cursor(server, channel):
    """The channel's latest cursor (None when it has no events), from GET /api/v1/events/cursor."""
    return get_json(server, f"/api/v1/events/cursor/{channel}")["latest_cursor"]


# --------------------------------------------------------------------------------------------
# A run's rows over raw HTTP, with a server's own (admin) key unless another is given
# --------------------------------------------------------------------------------------------

def record(srv, channel, event_type="step", payload=None, *, step=None, dependencies=None, key=None) -> dict:
    """POST /api/v1/events/record; the stored event (a refusal fails the test)."""
    body = {"channel_id": channel, "event_type": event_type, "payload": payload if payload is not None else {}}
    if step is not None:
        body["step_number"] = step
    if dependencies is not None:
        body["dependencies"] = dependencies
    status, _, answer = http("POST", srv.url + "/api/v1/events/record", key=key or srv.key, body=body)
    assert status == 200, answer
    return answer["event"]


def save_state(srv, channel, cursor, state) -> None:
    status, _, answer = http("POST", srv.url + f"/api/v1/state/{channel}", key=srv.key,
                             body={"cursor": cursor, "state": state})
    assert status == 200, answer


def fork(srv, source, new, cursor, **extra) -> dict:
    """POST /api/v1/channels/fork at `cursor`; the receipt."""
    status, _, answer = http("POST", srv.url + "/api/v1/channels/fork", key=srv.key,
                             body={"source_channel_id": source, "new_channel_id": new, "at_cursor": cursor, **extra})
    assert status == 200, answer
    return answer


def new_key(srv, **scopes) -> str:
    """A new key with these scopes (`read=[...]`, `write=[...]`, ...), made with the server's key."""
    status, _, answer = http("POST", srv.url + "/api/v1/keys", key=srv.key,
                             body={"name": f"k-{secrets.token_hex(3)}", "scopes": scopes})
    assert status == 200, answer
    return answer["key"]


def post_streaming(url, key, raw, *, chunked):
    """POST `raw` with aiohttp (the SDK's transport, which reads an answer sent before the whole body)."""
    import aiohttp

    async def go():
        async def chunks():
            for i in range(0, len(raw), 64 * 1024):
                yield raw[i:i + 64 * 1024]

        async with aiohttp.ClientSession() as session:
            async with session.post(url, data=chunks() if chunked else raw, headers={
                    "x-api-key": key, "content-type": "application/json"}) as resp:
                text = await resp.text()
                body = json.loads(text) if "json" in resp.headers.get("content-type", "") else text
                return resp.status, resp.headers, body

    return run(go())


def port_of(server) -> int:
    """The loopback port `server` listens on."""
    return urlsplit(server.url).port


STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3})(?: ([^\r\n]*))?")


def parse_head(head: bytes) -> tuple:
    """An answer's status line and header lines (no blank line): (status, reason, [(lower-case name, value)])."""
    first, *lines = head.split(b"\r\n")
    match = STATUS_LINE.fullmatch(first)
    assert match, f"not a status line: {first[:200]!r} (the previous answer's framing is off?)"
    headers = []
    for line in lines:
        name, sep, value = line.partition(b":")
        assert sep and name == name.strip(), f"malformed header line {line!r}"
        headers.append((name.decode("latin-1").lower(), value.strip().decode("latin-1")))
    return int(match.group(1)), (match.group(2) or b"").decode("latin-1"), headers


class RawHTTP:
    """Answers read off one raw HTTP/1.x socket, in order; bytes past one answer wait in `.buf`."""

    LIMIT = 16 * 1024 * 1024

    def __init__(self, sock):
        self.sock, self.buf, self.deadline = sock, b"", None

    @classmethod
    def open(cls, port, timeout=15.0) -> "RawHTTP":
        """A new connection to 127.0.0.1:`port`."""
        return cls(socket.create_connection(("127.0.0.1", port), timeout=timeout))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.sock.close()

    def send(self, *data: bytes):
        self.sock.sendall(b"".join(data))

    def more(self):
        """Receive into `.buf` (by `.deadline` when set); ConnectionError when the server closed."""
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no complete answer in time; got {self.buf[:200]!r}")
            self.sock.settimeout(left)
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"the server closed the connection; unparsed bytes: {self.buf[:300]!r}")
        self.buf += chunk
        if len(self.buf) > self.LIMIT:
            raise AssertionError("answer larger than 16 MiB")

    def take(self, n) -> bytes:
        """The next `n` bytes."""
        while len(self.buf) < n:
            self.more()
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def line(self) -> bytes:
        """The next line, without its CRLF."""
        while b"\r\n" not in self.buf:
            self.more()
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def head(self) -> tuple:
        """The next status line and headers: (status, reason, [(lower-case name, value)])."""
        while b"\r\n\r\n" not in self.buf:
            self.more()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        return parse_head(head)

    def read_response(self, timeout=10.0) -> tuple:
        """The next whole answer within `timeout` s: (status, {lower-case header: value}, decoded body)."""
        self.deadline = time.monotonic() + timeout
        try:
            status, _, pairs = self.head()
            headers = dict(pairs)
            return status, headers, self.body(status, headers)
        finally:
            self.deadline = None

    def body(self, status, headers) -> bytes:
        """The body after a head: none, chunked (decoded), content-length or up to the close."""
        if status < 200 or status in (204, 304):
            return b""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = b""
            while size := int(self.line().split(b";")[0], 16):
                body += self.take(size)
                self.take(2)
            while self.line():              # trailers, up to the blank line
                pass
            return body
        if "content-length" in headers:
            return self.take(int(headers["content-length"]))
        try:
            while True:
                self.more()
        except ConnectionError:
            pass
        body, self.buf = self.buf, b""
        return body


def run(coro):
    """Run one coroutine to completion (tests stay plain functions; no plugin needed)."""
    return asyncio.run(coro)


def client_for(srv, key=None, **kw):
    """An `ActaeClient` on the server `srv` with `key` (its own key unless given); not yet connected."""
    from actae_client import ActaeClient

    return ActaeClient(endpoint=srv.url, api_key=srv.key if key is None else key, **kw)


async def using_async(srv, body, *, key=None, **kw):
    """`using` as a coroutine: `await` it in async code, or `run_sdk(using_async(srv, body))` in a
    browser test (Playwright keeps a loop running on the test's thread)."""
    client = client_for(srv, key, **kw)
    try:
        return await body(client)
    finally:
        await client.disconnect()


def using(srv, body, *, key=None, **kw):
    """`await body(client)` on a fresh SDK client for `srv` (`client_for(srv, key, **kw)`), closed after."""
    return run(using_async(srv, body, key=key, **kw))


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The shared server for the whole test session."""
    with ServerProcess(tmp_path_factory.mktemp("actae-data")).start() as srv:
        yield srv


@pytest.fixture
def make_client(server):
    """`make_client(**kw)` -> an `ActaeClient` pointed at the shared server (not yet connected)."""
    from actae_client import ActaeClient

    def factory(**kw):
        kw.setdefault("api_key", server.key)
        return ActaeClient(endpoint=server.url, **kw)

    return factory


@pytest.fixture
def with_client(server):
    """`with_client(body)` -> result of `await body(client)` on a fresh SDK client (closed after)."""
    return lambda body: using(server, body)


@pytest.fixture
def unique(request):
    """A channel-id-safe name unique to this test: `unique("base")` -> `t<hash>-base`."""
    tag = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:10]
    return lambda suffix="": f"t{tag}-{suffix}" if suffix else f"t{tag}"


def state_sha256(state) -> str:
    """The documented state hash: sha256 of canonical JSON (sorted keys, `,`/`:` separators, UTF-8)."""
    text = json.dumps(state, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


async def replay_all(client, channel) -> list:
    """Every event of `channel`, paging the way the SDK does (limit 1000, exclusive cursor)."""
    events, cursor = [], 0
    while True:
        page = await client.replay(channel, cursor=cursor, limit=1000)
        if not page:
            return events
        assert page[-1].cursor > cursor, "replay did not advance past the requested cursor"
        events += page
        cursor = page[-1].cursor


# --------------------------------------------------------------------------------------------
# The SQL a domain function sends (for EXPLAIN in the plan tests)
# --------------------------------------------------------------------------------------------

class Recording:
    """A connection that keeps every (sql, args) a domain function sends; anything else goes to `conn`."""

    def __init__(self, conn):
        self.conn, self.dialect, self.sent = conn, conn.dialect, []

    def execute(self, sql, args=()):
        self.sent.append((sql, tuple(args)))
        return self.conn.execute(sql, args)

    def __getattr__(self, name):               # in_transaction, pipeline, states, ...
        return getattr(self.conn, name)


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


# --------------------------------------------------------------------------------------------
# Observability: a real OTLP/HTTP collector on loopback, and /metrics
# --------------------------------------------------------------------------------------------

def any_value(value):
    """The Python value an OTLP AnyValue holds (None when it holds none)."""
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


class Collector:
    """POST /v1/traces on 127.0.0.1: decodes ExportTraceServiceRequest and keeps each span as a dict.
    `mode` "ok" answers 200; "slow503" waits `delay` seconds, then answers 503."""

    def __init__(self, mode: str = "ok", delay: float = 2.0):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.mode, self.delay = mode, delay
        self.spans: list[dict] = []
        self.requests = 0
        self.lock = threading.Lock()
        collector = self

        class Handler(http_server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                with collector.lock:
                    collector.requests += 1
                if collector.mode == "slow503":
                    time.sleep(collector.delay)      # what it fakes: a collector slow to answer
                    self.send_response(503)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                got = []
                for resource_spans in request.resource_spans:
                    resource = {a.key: any_value(a.value) for a in resource_spans.resource.attributes}
                    for scope_spans in resource_spans.scope_spans:
                        for s in scope_spans.spans:
                            got.append({
                                "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                "parent": s.parent_span_id.hex(), "name": s.name, "kind": s.kind,
                                "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                                "attributes": {a.key: any_value(a.value) for a in s.attributes},
                                "status": (s.status.code, s.status.message),
                                "links": [(link.trace_id.hex(), link.span_id.hex(),
                                           {a.key: any_value(a.value) for a in link.attributes}) for link in s.links],
                                "service": resource.get("service.name"), "resource": resource,
                                "scope": scope_spans.scope.name})
                with collector.lock:
                    collector.spans += got
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http_server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def taken(self) -> list[dict]:
        with self.lock:
            return list(self.spans)

    def wait_for(self, condition, timeout=30.0, what="spans"):
        """The spans taken so far, as soon as `condition(spans)` holds."""
        def ready():
            spans = self.taken()
            return (spans,) if condition(spans) else None
        (spans,) = poll(ready, timeout, what=lambda: f"the collector to get the {what} "
                                                     f"(it has {len(self.taken())} span(s))")
        return spans


def exporting_server(tmp_path, collector_url, name="data", *, via_env=False):
    """A started server exporting to `collector_url`: by --otlp-endpoint, or by OTEL_EXPORTER_OTLP_ENDPOINT."""
    if via_env:
        return ServerProcess(tmp_path / name, env={"OTEL_EXPORTER_OTLP_ENDPOINT": collector_url,
                                                   "OTEL_SERVICE_NAME": "actae-test"}).start()
    return ServerProcess(tmp_path / name, args=["--otlp-endpoint", collector_url]).start()


def without_otel(**extra) -> dict:
    """For `cli(env=...)`: this environment's OTEL_* variables unset, `extra` set."""
    return {**{k: None for k in os.environ if k.startswith("OTEL_")}, **extra}


def otel_export(server: ServerProcess, collector_url: str, channel: str, *extra) -> subprocess.CompletedProcess:
    """`actae otel-export CHANNEL` against the server's own database (no OTEL_* variables but the flag)."""
    return cli("otel-export", channel, *extra, "--otlp-endpoint", collector_url, data_dir=server.data_dir,
               env=without_otel(), check=False)


def metric_values(server) -> dict:
    """{(name, frozenset(labels)): value} from /metrics, parsed with prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    status, headers, text = http("GET", server.url + "/metrics", key=server.key)
    assert status == 200 and headers["content-type"].startswith("text/plain")
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return values


def value(values, name, **labels) -> float:
    """One sample of `metric_values`: `name` with exactly `labels`, 0.0 when absent."""
    return values.get((name, frozenset(labels.items())), 0.0)


# --------------------------------------------------------------------------------------------
# A fleet: a gateway and the remote servers registered on it
# --------------------------------------------------------------------------------------------

def instance_id(srv) -> str:
    """The server's own instance id, read from its GET /api/v1/instance with its key."""
    return get_json(srv, "/api/v1/instance")["instance_id"]


def org_token(srv, *flags, name=None) -> tuple[int, str]:
    """`actae org-token create --name NAME FLAGS` (e.g. "--admin", or "--read", "*") on `srv`'s data
    dir, a fresh name unless given; (the token's id, the token), as the command prints them."""
    lines = cli("org-token", "create", "--name", name or f"t-{secrets.token_hex(3)}", *flags,
                data_dir=srv).stdout.splitlines()
    return int(lines[0].split()[2]), lines[1]


@dataclasses.dataclass
class Fleet:
    """A running gateway and the remotes registered on it: `.servers` (the gateway first) and their
    instance `.ids` in the same order, the `.organization` the gateway serves, `.token` (an
    organisation token, when `start_fleet` made one) and `.added` (what each `instance add` printed)."""

    gateway: ServerProcess
    remotes: list
    ids: list
    organization: str = "local"
    token: str | None = None
    added: list = dataclasses.field(default_factory=list)

    @property
    def servers(self) -> list:
        return [self.gateway, *self.remotes]

    @property
    def local_id(self) -> str:
        return self.ids[0]

    @property
    def remote_ids(self) -> list:
        return self.ids[1:]

    def server_of(self, instance_id: str) -> ServerProcess:
        return self.servers[self.ids.index(instance_id)]

    def client(self, token=None, *, organization=None, **kw):
        """A `FleetClient` on the gateway with `token` (`.token` unless given), for `.organization`."""
        from actae_client.fleet import FleetClient

        return FleetClient(self.token if token is None else token, self.gateway.url,
                           organization or self.organization, **kw)


@contextlib.contextmanager
def start_fleet(root, remotes=2, *, gateway_args=(), add_args=(), names=None, organization=None, token=None):
    """A gateway (data dir root/gateway) and `remotes` servers (root/remote-N), all started, each
    remote registered on the gateway with `actae instance add URL --key KEY [--name NAME] ADD_ARGS`
    (NAME is `names.format(n=N)`); yields the `Fleet` and stops every server afterwards.

    `gateway_args` are the gateway's extra flags; `organization` starts it with `--organization`
    (the server's default is "local"); `token` (org-token flags, e.g. ("--admin",)) makes `.token`."""
    root = Path(root)
    with contextlib.ExitStack() as stack:
        gateway_args = [*(["--organization", organization] if organization else []), *gateway_args]
        gateway = stack.enter_context(ServerProcess(root / "gateway", args=gateway_args).start())
        servers = [stack.enter_context(ServerProcess(root / f"remote-{n}").start()) for n in range(1, remotes + 1)]
        added = []
        for n, remote in enumerate(servers, 1):
            named = ["--name", names.format(n=n)] if names else []
            added.append(cli("instance", "add", remote.url, "--key", remote.key, *named, *add_args,
                             data_dir=gateway).stdout)
        fleet = Fleet(gateway, servers, [instance_id(s) for s in (gateway, *servers)],
                      organization or "local", added=added)
        if token is not None:
            fleet.token = org_token(gateway, *token)[1]
        yield fleet


# --------------------------------------------------------------------------------------------
# The dashboard: an httpx session, and real Chromium
# --------------------------------------------------------------------------------------------

SESSION_COOKIE = "actae_session"
SHOTS = ROOT / "screenshots"            # every page the browser tests saw (git-ignored)
CHROMIUM = os.environ.get("ACTAE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
_CSRF_FIELD = re.compile(r'name="csrf_token" value="([^"]+)"')
DESKTOP = {"width": 1280, "height": 800}     # the browser tests' two viewports
PHONE = {"width": 390, "height": 844}


def login(server, *, key=None, origin_header=True):
    """An httpx client holding a dashboard session cookie (no redirects followed), for `key`
    (the server's own unless given).

    The login POST sends the dashboard's own Origin and the login form's csrf_token, as a browser
    does. With `origin_header` (the default) every later request carries that Origin too, as a
    browser's do on the dashboard's forms; without it they carry none unless a test adds one."""
    import httpx

    c = httpx.Client(base_url=server.url, follow_redirects=False, timeout=60,
                     headers={"Origin": server.url} if origin_header else None)
    form = {"api_key": server.key if key is None else key}
    if token := _CSRF_FIELD.search(c.get("/login").text):
        form["csrf_token"] = token.group(1)
    r = c.post("/login", data=form, headers={"Origin": server.url})
    assert r.status_code == 303, (r.status_code, r.text[:500])
    assert c.cookies.get(SESSION_COOKIE), r.headers
    return c


def form_token(client) -> str:
    """The session's form token, as every page renders it into its forms (read from the runs page)."""
    match = _CSRF_FIELD.search(client.get("/").text)
    assert match, "no form token on the runs page"
    return match.group(1)


def dashboard_cookie(server, key=None) -> str:
    """The `Cookie` header value of a fresh dashboard session logged in with `key` (`login`)."""
    client = login(server, key=key)
    try:
        return f"{SESSION_COOKIE}={client.cookies[SESSION_COOKIE]}"
    finally:
        client.close()


def with_cookie(server, path, value):
    """GET `path` with only the session cookie `value`, no redirect followed: the httpx Response."""
    import httpx

    return httpx.get(server.url + path, headers={"Cookie": f"{SESSION_COOKIE}={value}"},
                     follow_redirects=False, timeout=30)


def get_with_host(server, path, host):
    """GET `path` with the server's key and `host` as the Host header, no redirect followed: the httpx Response."""
    import httpx

    return httpx.get(server.url + path, headers={"Host": host, "x-api-key": server.key}, follow_redirects=False,
                     timeout=30)


@pytest.fixture(scope="module")
def web(server):
    """A logged-in httpx session on the shared server (the dashboard's Origin on every request)."""
    c = login(server)
    yield c
    c.close()


def run_sdk(coro):
    """`run(coro)` on a worker thread: Playwright's sync API keeps a loop running on this one."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(run, coro).result()


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (Debian's, driven by Playwright) for one test module."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail(f"no Chromium at {CHROMIUM}: .ci/run installs Debian's chromium")
        pytest.skip(f"no Chromium at {CHROMIUM}")
    SHOTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


class Visits:
    """Every URL the browser asked for, and every dialog a page tried to open."""

    def __init__(self):
        self.urls: list[str] = []
        self.dialogs: list[str] = []


@pytest.fixture(scope="module")
def visits():
    return Visits()


def watch(page, visits: Visits):
    """Record what `page` requests and navigates to, and dismiss (and record) its dialogs."""
    page.on("request", lambda req: visits.urls.append(req.url))
    page.on("framenavigated", lambda frame: visits.urls.append(frame.url))

    def on_dialog(dialog):
        visits.dialogs.append(dialog.message)
        dialog.dismiss()
    page.on("dialog", on_dialog)


def submit_login(page, key):
    """On the /login page: type `key` and submit the form like a user; the navigation's response."""
    page.fill("input[name=api_key]", key)
    with page.expect_navigation() as nav:
        page.click("form[action='/login'] button[type=submit]")
    return nav.value


def logged_in(browser, server, viewport=DESKTOP):
    """A new browser context at `viewport` (a phone's, `is_mobile`, when narrower than 500 px) and a page
    in it logged in to `server` through its /login form: (context, page). The caller closes the context."""
    context = browser.new_context(viewport=viewport, is_mobile=viewport["width"] < 500)
    page = context.new_page()
    page.goto(server.url + "/login")
    submit_login(page, server.key)
    return context, page


def page_sleep(page):
    """`poll(..., sleep=page_sleep(page))`: wait the way Playwright's sync API lets a page's events arrive."""
    return lambda seconds: page.wait_for_timeout(seconds * 1000)


def shot(page, name: str) -> None:
    """A full-page screenshot: screenshots/<name>.png."""
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
