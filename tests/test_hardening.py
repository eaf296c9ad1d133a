"""Regression tests for the hardening change (the contract: /tmp/hardening-contract.md).

One test (parametrized where the finding has several shapes) per finding:

 1. documents nested too deeply are refused everywhere they are stored, nothing is written and the
    channel stays readable; exactly DOCUMENT_DEPTH_MAX deep round-trips unchanged
 2. a non-ASCII claim_token is just a wrong token (409 execution_not_owned)
 3. a non-ASCII session cookie is just not a session (303 to /login)
 4. an outcome score past int64 / huge is never a 5xx
 5. a run page start past int64 is never a 5xx
 6. channel_ids in POST /events/query is capped at 1000
 7. a WebSocket subscribe cursor past int64 is an error frame and the socket keeps working
 8. an unexpected exception answers the JSON 500 and the keep-alive connection stays usable
 9. logout ends the session server-side
10. cookies forged from the database's contents are refused
11. the Host header is checked against an allow-list (and --allow-host extends it)
12. security headers on every response
13. dashboard POSTs need a same-origin Origin/Referer and the session's csrf_token
14. consumer-group offsets report each consumer's own acked cursor

Deep JSON is always built as text ("[" * n + "]" * n), never by recursion.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import html
import json
import logging
import math
import re
import secrets
import socket
import sys
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
import websockets

from conftest import (ROOT, SESSION_COOKIE, RawHTTP, ServerProcess, api, get_with_host, latest_cursor, login, ok,
                      poll, port_of, query_database, run, with_cookie)

if str(ROOT) not in sys.path:          # `import actae` (the module under test) from the repository root
    sys.path.insert(0, str(ROOT))

DEPTH_MAX = 64
INT64_MAX = 2**63 - 1
CSRF_INPUT = re.compile(r"<input\b[^>]*\bname=[\"']csrf_token[\"'][^>]*>", re.I)
INPUT_VALUE = re.compile(r"\bvalue=[\"']([^\"']*)[\"']", re.I)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

def depth_max() -> int:
    """actae.DOCUMENT_DEPTH_MAX when the module has it (the contract says 64)."""
    try:
        import actae
    except Exception:   # noqa: BLE001 - the module may be mid-edit; the contract's value then
        return DEPTH_MAX
    return getattr(actae, "DOCUMENT_DEPTH_MAX", DEPTH_MAX)


def assert_json_error(response, status, code=None):
    got, headers, body = response
    assert got == status, f"expected {status}, got {got}: {str(body)[:300]}"
    assert (headers.get("content-type") or "").startswith("application/json"), headers.get("content-type")
    assert isinstance(body, dict) and isinstance(body.get("error"), str) and body["error"], body
    if code is not None:
        assert body.get("status") == code, body


def deep(n: int) -> str:
    """A JSON array nested n levels deep, as text."""
    return "[" * n + "]" * n


def rich_doc(depth: int) -> str:
    """A JSON text exactly `depth` containers deep (objects and arrays, a non-ASCII leaf), compact."""
    pairs, odd = divmod(depth, 2)
    text = '{"a":[' * pairs + '"\u00e9\u2603 x"' + "]}" * pairs
    return "[" + text + "]" if odd else text


def compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def fresh_run(server, channel, steps=1):
    """A run with `steps` step events, each followed by a state snapshot at its cursor."""
    for i in range(1, steps + 1):
        event = ok(api(server, "POST", "/api/v1/events/record",
                       body={"channel_id": channel, "event_type": "step.completed",
                             "payload": {"input": i, "output": i * 10}, "step_number": i}))["event"]
        ok(api(server, "POST", f"/api/v1/state/{channel}", body={"cursor": event["cursor"], "state": {"i": i}}))
    return channel


def snapshot(server, channel):
    """What a refused write must leave unchanged."""
    return {"cursor": latest_cursor(server, channel),
            "state": ok(api(server, "GET", f"/api/v1/state/{channel}")),
            "metadata": ok(api(server, "GET", f"/api/v1/channels/{channel}/metadata"))}


def csrf_of(page: str):
    """The hidden csrf_token of the first form on a page, or None."""
    tag = CSRF_INPUT.search(page or "")
    if not tag:
        return None
    value = INPUT_VALUE.search(tag.group(0))
    return html.unescape(value.group(1)) if value else None


def assert_goes_to_login(response):
    assert response.status_code == 303, (response.status_code, response.text[:300])
    assert urlsplit(response.headers["location"]).path == "/login", response.headers["location"]


@pytest.fixture(scope="module")
def web(server):
    """A dashboard session whose requests carry no Origin unless a test adds one (the origin checks)."""
    c = login(server, origin_header=False)
    yield c
    c.close()


@pytest.fixture(scope="module")
def other_run(server):
    """A second run to diff against."""
    return fresh_run(server, "hardening-diff-other")


# --- WebSocket ------------------------------------------------------------------------------

async def ws_open(server):
    """An authenticated WebSocket to the server (the SDK's handshake: connected, auth, authenticated)."""
    ws = await websockets.connect(server.url.replace("http://", "ws://") + "/ws", open_timeout=10,
                                  max_size=None)
    first = await ws_frame(ws)
    assert first.get("event") == "connected", first
    await ws.send(json.dumps({"type": "auth", "api_key": server.key}))
    authed = await ws_frame(ws)
    assert authed.get("event") == "authenticated", authed
    return ws


async def ws_frame(ws, timeout=15.0) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def ws_until(ws, predicate, limit=20):
    """Frames up to and including the first that matches (at most `limit` frames)."""
    seen = []
    for _ in range(limit):
        try:
            frame = await ws_frame(ws)
        except websockets.ConnectionClosed as exc:
            raise AssertionError(f"the server closed the WebSocket ({exc}) after {seen}") from None
        seen.append(frame)
        if predicate(frame):
            return seen
    raise AssertionError(f"no matching frame in {limit}: {seen}")


def is_error(frame):
    return frame.get("type") == "error"


def is_pong(frame):
    return frame.get("event") == "pong"


# --------------------------------------------------------------------------------------------
# 1. Document depth
# --------------------------------------------------------------------------------------------

def _record(server, ch, doc):
    return api(server, "POST", "/api/v1/events/record",
               raw='{"channel_id":%s,"event_type":"deep","payload":%s}' % (json.dumps(ch), doc))


def _transition_payload(server, ch, doc):
    return api(server, "POST", "/api/v1/events/transition",
               raw='{"channel_id":%s,"type":"deep","payload":%s,"state":{"ok":1}}' % (json.dumps(ch), doc))


def _transition_state(server, ch, doc):
    return api(server, "POST", "/api/v1/events/transition",
               raw='{"channel_id":%s,"type":"deep","payload":{"ok":1},"state":%s}' % (json.dumps(ch), doc))


def _save_state(server, ch, doc):
    return api(server, "POST", f"/api/v1/state/{ch}", raw='{"cursor":1,"state":%s}' % doc)


def _put_metadata(server, ch, doc):
    return api(server, "PUT", f"/api/v1/channels/{ch}/metadata",
               raw='{"display_name":"deep","experiment_metadata":{"deep":%s}}' % doc)


def _fork(server, ch, doc):
    return api(server, "POST", "/api/v1/channels/fork",
               raw='{"source_channel_id":%s,"new_channel_id":%s,"at_cursor":1,'
                   '"experiment_metadata":{"intervention":%s}}' % (json.dumps(ch), json.dumps(ch + "-fork"), doc))


async def _ws_publish(server, ch, doc):
    ws = await ws_open(server)
    try:
        await ws.send('{"type":"broadcast","topic":%s,"request_id":"deep-1","payload":%s}' % (json.dumps(ch), doc))
        frames = await ws_until(ws, lambda f: is_error(f) or f.get("type") == "ack")
    finally:
        await ws.close()
    return frames


DEEP_TARGETS = {
    "record.payload": _record,
    "transition.payload": _transition_payload,
    "transition.state": _transition_state,
    "save_state.state": _save_state,
    "metadata.experiment_metadata": _put_metadata,
    "fork.intervention": _fork,
    "ws.publish.payload": "ws",
}


@pytest.mark.parametrize("levels", [65, 1_000, 100_000])
@pytest.mark.parametrize("target", list(DEEP_TARGETS))
def test_deep_documents_are_refused_and_change_nothing(server, web, other_run, unique, target, levels):
    ch = fresh_run(server, unique("deep"))
    before = snapshot(server, ch)
    doc = deep(levels)
    if DEEP_TARGETS[target] == "ws":
        frames = run(_ws_publish(server, ch, doc))
        assert is_error(frames[-1]), f"a {levels}-deep publish was not refused: {frames[-1]}"
        assert frames[-1].get("status", "bad_request") == "bad_request", frames[-1]
    else:
        assert_json_error(DEEP_TARGETS[target](server, ch, doc), 400, "bad_request")
    assert snapshot(server, ch) == before, "a refused write changed the channel"
    if target == "fork.intervention":
        assert_json_error(api(server, "GET", f"/api/v1/channels/{ch}-fork/metadata"), 404, "not_found")
    # The channel still reads everywhere.
    ok(api(server, "GET", f"/api/v1/events/replay/{ch}?cursor=0&limit=1000"))
    ok(api(server, "GET", f"/api/v1/state/{ch}"))
    ok(api(server, "GET", f"/api/v1/channels/diff?left={ch}&right={other_run}"))
    page = web.get(f"/runs/{ch}")
    assert page.status_code == 200, (page.status_code, page.text[:300])


def test_document_depth_max_is_a_module_constant_of_64():
    import actae
    assert getattr(actae, "DOCUMENT_DEPTH_MAX", None) == DEPTH_MAX


def test_rich_doc_has_the_depth_it_claims():
    """Guard for the helper itself: depth counts nested containers, scalars are depth 0."""
    def depth(value):
        stack, best = [(value, 0)], 0
        while stack:
            item, d = stack.pop()
            if isinstance(item, (list, dict)):
                best = max(best, d + 1)
                stack.extend((child, d + 1) for child in (item.values() if isinstance(item, dict) else item))
        return best
    for n in (0, 1, 2, 63, 64, 65):
        assert depth(json.loads(rich_doc(n))) == n


@pytest.mark.parametrize("kind", ["record", "save_state"])
def test_a_document_at_the_depth_limit_round_trips_and_one_more_is_refused(server, web, other_run, unique, kind):
    limit = depth_max()
    ch = fresh_run(server, unique("limit"))
    at_limit, over = rich_doc(limit), rich_doc(limit + 1)
    write = _record if kind == "record" else (
        lambda s, c, d: api(s, "POST", f"/api/v1/state/{c}", raw='{"cursor":%d,"state":%s}' % (latest_cursor(s, c), d)))

    # limit + 1: refused, nothing written
    before = snapshot(server, ch)
    assert_json_error(write(server, ch, over), 400, "bad_request")
    assert snapshot(server, ch) == before

    # exactly the limit: accepted, and it reads back byte for byte (compact re-serialisation)
    ok(write(server, ch, at_limit))
    path = f"/api/v1/events/replay/{ch}?cursor=0&limit=1000" if kind == "record" else f"/api/v1/state/{ch}"
    r = httpx.get(server.url + path, headers={"x-api-key": server.key}, timeout=30)
    assert r.status_code == 200, (r.status_code, r.text[:300])
    if kind == "record":
        event = r.json()["events"][-1]
        assert event["type"] == "deep"
        stored = event["payload"]
    else:
        stored = r.json()["state"]
    assert stored == json.loads(at_limit)
    assert compact(stored) == at_limit
    assert at_limit.encode("utf-8") in r.content, "the document is not served back byte for byte"
    ok(api(server, "GET", f"/api/v1/channels/diff?left={ch}&right={other_run}"))
    page = web.get(f"/runs/{ch}")
    assert page.status_code == 200, (page.status_code, page.text[:300])


# --------------------------------------------------------------------------------------------
# 2. Non-ASCII claim tokens
# --------------------------------------------------------------------------------------------

ACTION_BODIES = {
    "complete": {"result": {"ok": True}},
    "fail": {"message": "boom", "error_type": "RuntimeError"},
    "heartbeat": {"lease_seconds": 30},
    "cancel": {},
}


@pytest.mark.parametrize("token", ["\u00e9", "\u2603", "real+\u00e9"])
@pytest.mark.parametrize("action", list(ACTION_BODIES))
def test_non_ascii_claim_token_is_a_wrong_token(server, unique, action, token):
    ch = unique("ledger")
    claim = ok(api(server, "POST", "/api/v1/executions/claim",
                   body={"channel_id": ch, "key_name": "charge-1", "tool_name": "charge", "params": {"amount": 5}}))
    assert claim["status"] == "claimed", claim
    execution_id, real = claim["execution"]["id"], claim["claim_token"]
    wrong = real + "\u00e9" if token == "real+\u00e9" else token
    raw = json.dumps({**ACTION_BODIES[action], "claim_token": wrong}, ensure_ascii=False)
    assert_json_error(api(server, "POST", f"/api/v1/executions/{execution_id}/{action}", raw=raw),
                      409, "execution_not_owned")
    # Still the first owner's: running, and its real token still works.
    assert ok(api(server, "GET", f"/api/v1/executions/{execution_id}"))["execution"]["status"] == "running"
    ok(api(server, "POST", f"/api/v1/executions/{execution_id}/heartbeat", body={"claim_token": real}))


# --------------------------------------------------------------------------------------------
# 3. Non-ASCII session cookie
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["\u00e9.\u00e9", "\u2603", "abc.\u00e9"])
def test_non_ascii_session_cookie_is_not_a_session(server, value):
    conn = RawHTTP.open(port_of(server))
    try:
        conn.send(b"GET / HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nCookie: " % port_of(server)
                  + f"{SESSION_COOKIE}={value}".encode("utf-8") + b"\r\nConnection: close\r\n\r\n")
        status, headers, body = conn.read_response()
    finally:
        conn.close()
    assert status == 303, (status, body[:300])
    assert urlsplit(headers.get("location", "")).path == "/login", headers


# --------------------------------------------------------------------------------------------
# 4. Outcome score out of range
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("score", [2**63, 10**300 * 1.0], ids=["2**63", "1e300"])
def test_outcome_score_out_of_int64_is_never_a_5xx(server, unique, score):
    ch = fresh_run(server, unique("outcome"))
    before = ok(api(server, "GET", f"/api/v1/channels/{ch}/metadata"))
    status, headers, body = api(server, "PATCH", f"/api/v1/channels/{ch}/outcome",
                                raw=json.dumps({"outcome": "inconclusive", "score": score}))
    assert status in (200, 400), (status, body)
    after = ok(api(server, "GET", f"/api/v1/channels/{ch}/metadata"))
    if status == 200:           # accepted as a float, and it reads back as that float
        assert after["outcome"] == "inconclusive"
        assert isinstance(after["result_score"], (int, float))
        assert math.isclose(after["result_score"], float(score), rel_tol=1e-12), after["result_score"]
    else:
        assert_json_error((status, headers, body), 400, "bad_request")
        assert after == before


def test_outcome_score_float_reads_back(server, unique):
    ch = fresh_run(server, unique("outcome-ok"))
    ok(api(server, "PATCH", f"/api/v1/channels/{ch}/outcome", body={"outcome": "inconclusive", "score": 1.5}))
    meta = ok(api(server, "GET", f"/api/v1/channels/{ch}/metadata"))
    assert (meta["outcome"], meta["result_score"]) == ("inconclusive", 1.5)


# --------------------------------------------------------------------------------------------
# 5. Run page start out of range
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("twin", [False, True], ids=["html", "json"])
@pytest.mark.parametrize("start", ["9223372036854775000", "9223372036854775807", "99999999999999999999"])
def test_run_page_start_near_or_past_int64_is_never_a_5xx(server, web, unique, start, twin):
    ch = fresh_run(server, unique("page"))
    r = web.get(f"/runs/{ch}", params={"start": start, **({"format": "json"} if twin else {})})
    assert r.status_code in (200, 400), (r.status_code, r.text[:300])
    if twin and r.status_code == 200:
        assert r.json()["timeline"] == []
    if twin and r.status_code == 400:
        assert r.json()["status"] == "bad_request"
    ok(api(server, "GET", "/healthz"))


# --------------------------------------------------------------------------------------------
# 6. channel_ids cap on POST /events/query
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("count,status", [(1000, 200), (1001, 400), (250_000, 400)])
def test_query_channel_ids_are_capped_at_1000(server, unique, count, status):
    ch = fresh_run(server, unique("query"))
    ids = [ch] + [f"q{i}" for i in range(count - 1)]     # short: 250,000 ids stay under 4 MiB
    response = api(server, "POST", "/api/v1/events/query", raw=json.dumps({"channel_ids": ids, "limit": 10}))
    if status == 200:
        events = ok(response)["events"]
        assert [e["channel_id"] for e in events] == [ch], events
    else:
        assert_json_error(response, 400, "bad_request")
    ok(api(server, "GET", "/healthz"))


# --------------------------------------------------------------------------------------------
# 7. WebSocket subscribe cursor out of int64
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cursor", [2**63, 2**70], ids=["2**63", "2**70"])
def test_ws_subscribe_cursor_past_int64_is_an_error_frame_and_the_socket_lives(server, unique, cursor):
    ch = fresh_run(server, unique("ws"))

    async def scenario():
        ws = await ws_open(server)
        try:
            await ws.send(json.dumps({"type": "subscribe", "topic": ch, "cursor": cursor}))
            frames = await ws_until(ws, is_error)
            assert not any(f.get("event") == "subscribed" for f in frames), frames
            assert frames[-1].get("status") == "bad_request", frames[-1]
            assert isinstance(frames[-1].get("message"), str) and frames[-1]["message"], frames[-1]
            await ws.send(json.dumps({"type": "ping"}))
            await ws_until(ws, is_pong)
        finally:
            await ws.close()

    run(scenario())


# --------------------------------------------------------------------------------------------
# 8. A bug answers the JSON 500 and keeps the keep-alive connection
# --------------------------------------------------------------------------------------------

@pytest.fixture
def in_process(tmp_path):
    """The real app served by uvicorn in a thread on 127.0.0.1:<free port>; (actae module, port, key)."""
    import uvicorn

    import actae

    key = "sk-test-" + secrets.token_hex(16)
    app = actae.create_app(tmp_path / "data", env_key=key)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    # The uvicorn Config actae.serve() uses (its guarded HTTP protocol included): `uvicorn_config` when the
    # module has it, else the options serve() passed before the hardening change.
    if hasattr(actae, "uvicorn_config"):
        config = actae.uvicorn_config(app, actae.Settings())
    else:
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                ws_max_size=actae.MAX_BODY_BYTES, timeout_graceful_shutdown=5)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        poll(lambda: srv.started or not thread.is_alive(), 20, what="the in-process server to start", every=0.02)
        assert srv.started, "the in-process server did not start"
        yield actae, sock.getsockname()[1], key
    finally:
        srv.should_exit = True
        thread.join(20)
        sock.close()


def test_an_unexpected_exception_is_a_json_500_and_the_connection_stays_usable(in_process, monkeypatch):
    actae, port, key = in_process

    def boom(*args, **kwargs):
        raise RuntimeError("injected bug")

    monkeypatch.setattr(actae, "list_channels", boom)
    records = {}

    class Collect(logging.Handler):
        def emit(self, record):
            records[id(record)] = record

    collector = Collect()
    watched = [logging.getLogger(), logging.getLogger("uvicorn")]      # uvicorn's loggers do not propagate
    for logger in watched:
        logger.addHandler(collector)
    host = f"127.0.0.1:{port}".encode()
    conn = RawHTTP.open(port)
    try:
        conn.send(b"GET /api/v1/channels HTTP/1.1\r\nHost: " + host + b"\r\nx-api-key: " + key.encode() + b"\r\n\r\n")
        status, headers, body = conn.read_response()
        assert status == 500, (status, body[:300])
        assert headers.get("content-type", "").startswith("application/json"), headers
        data = json.loads(body)
        assert data.get("status") == "internal" and isinstance(data.get("error"), str), data
        assert "injected bug" not in data["error"]          # no internals leak to the client
        conn.send(b"GET /healthz HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
        try:
            status, _, body = conn.read_response()
        except (ConnectionError, socket.timeout) as exc:
            pytest.fail(f"the keep-alive connection was not usable after the 500: {exc!r}")
        assert status == 200, (status, body[:300])
        assert json.loads(body)["status"] == "ok"
        errors = poll(lambda: [r for r in records.values() if r.levelno >= logging.ERROR], 10,
                      what="the bug to be logged")
        assert len(errors) == 1, f"the bug was logged {len(errors)} times: {[r.getMessage() for r in errors]}"
    finally:
        conn.close()
        for logger in watched:
            logger.removeHandler(collector)


# --------------------------------------------------------------------------------------------
# 9. Logout ends the session
# --------------------------------------------------------------------------------------------

def test_logout_revokes_the_old_cookie(server):
    c = login(server, origin_header=False)
    try:
        old = c.cookies.get(SESSION_COOKIE)
        page = c.get("/")
        assert page.status_code == 200, page.status_code
        token = csrf_of(page.text)
        out = c.post("/logout", data={"csrf_token": token} if token else {}, headers={"Origin": server.url})
        assert out.status_code in (302, 303), (out.status_code, out.text[:300])
        assert_goes_to_login(with_cookie(server, "/", old))
    finally:
        c.close()


# --------------------------------------------------------------------------------------------
# 10. Cookies forged from the database
# --------------------------------------------------------------------------------------------

def read_db(server, sql, *, postgresql=None):
    """The rows of one query on the server's database (SQLite or PostgreSQL)."""
    return query_database(server, sql, postgresql=postgresql)


TABLES_SQLITE = "SELECT name FROM sqlite_master WHERE type = 'table'"
TABLES_POSTGRESQL = ("SELECT table_name FROM information_schema.tables WHERE table_type = 'BASE TABLE' "
                     "AND table_schema NOT IN ('pg_catalog', 'information_schema')")


def cookie_candidates(value):
    """What a forger would try with one stored value."""
    if isinstance(value, bytes):
        return [value.hex(), base64.urlsafe_b64encode(value).decode().rstrip("=")]
    if isinstance(value, str) and value and value.isascii() and not re.search(r"[\s;,\"\\]", value):
        return [value]
    return []


@pytest.mark.parametrize("forgery", ["stored_session_values", "old_signed_format"])
def test_cookies_made_from_the_database_are_refused(server, forgery):
    c = login(server, origin_header=False)
    try:
        live = c.cookies.get(SESSION_COOKIE)
        tables = {name for (name,) in read_db(server, TABLES_SQLITE, postgresql=TABLES_POSTGRESQL)}
        if forgery == "stored_session_values":
            assert "sessions" in tables, f"no sessions table (tables: {sorted(tables)})"
            rows = read_db(server, "SELECT * FROM sessions")
            assert rows, "logging in stored no session row"
            stored = [v for row in rows for v in row]
            assert live not in stored, "the raw cookie value is stored (only its SHA-256 may be)"
            cookies = sorted({cand for v in stored for cand in cookie_candidates(v)})
        else:
            settings = read_db(server, "SELECT name, value FROM settings") if "settings" in tables else []
            secrets_ = ([v for name, v in settings if name == "session_secret"]
                        + [v for name, v in settings if name != "session_secret" and isinstance(v, str)])
            payload = base64.urlsafe_b64encode(json.dumps(
                {"k": hashlib.sha256(server.key.encode()).hexdigest(), "t": int(time.time())}).encode()).decode()
            cookies = [f"{payload}.{hmac.new(s.encode(), payload.encode(), hashlib.sha256).hexdigest()}"
                       for s in secrets_ if isinstance(s, str)] + [payload]
        assert cookies
        for cookie in cookies[:200]:
            r = with_cookie(server, "/", cookie)
            assert r.status_code == 303, f"forged cookie {cookie[:40]}... got {r.status_code}"
            assert urlsplit(r.headers["location"]).path == "/login"
        assert c.get("/").status_code == 200          # the real session is unaffected
    finally:
        c.close()


# --------------------------------------------------------------------------------------------
# 11. Host allow-list
# --------------------------------------------------------------------------------------------

HOST_PATHS = {"/api/v1/channels": 200, "/": 303, "/login": 200}    # what an allowed Host gets


@pytest.mark.parametrize("path", list(HOST_PATHS))
def test_a_foreign_host_is_refused(server, path):
    r = get_with_host(server, path, "evil.example")
    assert r.status_code == 400, (r.status_code, r.text[:300])
    if path.startswith("/api/"):
        assert r.headers.get("content-type", "").startswith("application/json")
        body = r.json()
        assert body.get("status") == "bad_request" and body.get("error"), body


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "[::1]:{port}"])
@pytest.mark.parametrize("path", list(HOST_PATHS))
def test_loopback_hosts_are_admitted(server, path, host):
    r = get_with_host(server, path, host.format(port=port_of(server)))
    assert r.status_code == HOST_PATHS[path], (r.status_code, r.text[:300])


@pytest.fixture(scope="module")
def allow_host_server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("actae-allow-host"), args=["--allow-host", "actae.example"])
    try:
        srv.start()
    except Exception as exc:  # noqa: BLE001 - report the server's own output (start() ended it)
        pytest.fail(f"`actae.py --allow-host actae.example` did not start ({exc!r}):\n" + "\n".join(srv.lines[-20:]))
    with srv:
        yield srv


@pytest.mark.parametrize("path", list(HOST_PATHS))
def test_allow_host_admits_the_named_host_only(allow_host_server, path):
    srv = allow_host_server
    r = get_with_host(srv, path, "actae.example")
    assert r.status_code == HOST_PATHS[path], (r.status_code, r.text[:300])
    r = get_with_host(srv, path, "evil.example")
    assert r.status_code == 400, (r.status_code, r.text[:300])


# --------------------------------------------------------------------------------------------
# 12. Security headers
# --------------------------------------------------------------------------------------------

def csp_directives(value):
    out = {}
    for part in value.split(";"):
        words = part.split()
        if words:
            out[words[0].lower()] = [w.lower() for w in words[1:]]
    return out


@pytest.mark.parametrize("path,status,with_key", [
    ("/api/v1/channels", 200, True),
    ("/api/v1/channels/no-such-channel-xyz/metadata", 404, True),
    ("/healthz", 200, False),
    ("/login", 200, False),
    ("/", 303, False),
], ids=["api", "api-error", "healthz", "page", "redirect"])
def test_security_headers(server, path, status, with_key):
    r = httpx.get(server.url + path, headers={"x-api-key": server.key} if with_key else {},
                  follow_redirects=False, timeout=30)
    assert r.status_code == status, r.status_code
    csp = r.headers.get("content-security-policy")
    assert csp, f"no Content-Security-Policy on {path}"
    d = csp_directives(csp)
    assert d.get("frame-ancestors") == ["'none'"], csp
    assert "'self'" in d.get("script-src", []), csp
    assert "'unsafe-inline'" not in d.get("script-src", []), csp
    assert "'self'" in d.get("form-action", []), csp
    assert r.headers.get("x-frame-options", "").upper() == "DENY"
    assert r.headers.get("x-content-type-options", "").lower() == "nosniff"
    assert r.headers.get("referrer-policy", "").lower() == "same-origin"


# --------------------------------------------------------------------------------------------
# 13. Dashboard POSTs: same origin and csrf_token
# --------------------------------------------------------------------------------------------

FOREIGN = "http://127.0.0.1:1"

# case: (Origin, Referer, token, expected status); "self" = the server's own origin
FORK_CASES = {
    "no-origin-no-referer": (None, None, "right", 403),
    "foreign-origin": (FOREIGN, None, "right", 403),
    "foreign-referer": (None, FOREIGN + "/runs/x", "right", 403),
    "missing-token": ("self", None, None, 403),
    "wrong-token": ("self", None, "wrong", 403),
    "same-origin-and-token": ("self", None, "right", 303),
    "same-referer-and-token": (None, "self", "right", 303),
}


@pytest.mark.parametrize("case", list(FORK_CASES))
def test_dashboard_fork_post_needs_same_origin_and_csrf_token(server, web, unique, case):
    origin, referer, token_kind, expected = FORK_CASES[case]
    ch = fresh_run(server, unique("src"), steps=2)
    name = unique("child")
    page = web.get(f"/runs/{ch}")
    assert page.status_code == 200, page.status_code
    token = csrf_of(page.text)
    if expected == 303:
        assert token, "the run page's fork form has no csrf_token field"
    form = {"step": "1", "name": name, "intervention": '{"model": "slow"}', "tool_policies": ""}
    if token_kind == "right" and token:
        form["csrf_token"] = token
    elif token_kind == "wrong":
        form["csrf_token"] = (token or "x") + "-wrong"
    headers = {}
    if origin:
        headers["Origin"] = server.url if origin == "self" else origin
    if referer:
        headers["Referer"] = server.url + f"/runs/{ch}" if referer == "self" else referer
    r = web.post(f"/runs/{ch}/fork", data=form, headers=headers)
    assert r.status_code == expected, (r.status_code, r.text[:300])
    meta = api(server, "GET", f"/api/v1/channels/{name}/metadata")
    if expected == 303:
        assert urlsplit(r.headers["location"]).path == f"/runs/{name}"
        assert ok(meta)["parent_channel_id"] == ch
    else:
        assert_json_error(meta, 404, "not_found")


@pytest.mark.parametrize("headers", [{}, {"Origin": FOREIGN}, {"Referer": FOREIGN + "/login"}],
                         ids=["no-origin", "foreign-origin", "foreign-referer"])
def test_login_post_needs_same_origin(server, headers):
    with httpx.Client(base_url=server.url, follow_redirects=False, timeout=30) as c:
        form = {"api_key": server.key}
        token = csrf_of(c.get("/login").text)
        if token:
            form["csrf_token"] = token
        r = c.post("/login", data=form, headers=headers)
        assert r.status_code == 403, (r.status_code, r.text[:300])
        assert f"{SESSION_COOKIE}=" not in r.headers.get("set-cookie", "")


@pytest.mark.parametrize("case", ["no-origin", "foreign-origin", "missing-token"])
def test_logout_post_needs_same_origin_and_token(server, case):
    c = login(server, origin_header=False)
    try:
        token = csrf_of(c.get("/").text)
        form = {"csrf_token": token} if token and case != "missing-token" else {}
        headers = {"foreign-origin": {"Origin": FOREIGN}, "no-origin": {}}.get(case, {"Origin": server.url})
        r = c.post("/logout", data=form, headers=headers)
        assert r.status_code == 403, (r.status_code, r.text[:300])
        still = with_cookie(server, "/", c.cookies.get(SESSION_COOKIE))
        assert still.status_code == 200, "a refused logout ended the session"
    finally:
        c.close()


# --------------------------------------------------------------------------------------------
# 14. Consumer-group offsets per consumer
# --------------------------------------------------------------------------------------------

def test_group_offsets_report_each_consumers_own_ack(with_client, unique):
    channel, group = unique("log"), unique("workers")

    async def scenario(client):
        for i in range(6):
            await client.record(channel, "work.item", {"i": i}, actor="producer")
        await client.create_group(group, channel)
        await client.join_group(group, "w1", lease_seconds=60)
        await client.join_group(group, "w2", lease_seconds=60)
        first = await client.claim_work(group, "w1", limit=3)
        assert [e.cursor for e in first.events] == [1, 2, 3]
        await client.ack_work(group, "w1", 3)
        second = await client.claim_work(group, "w2", limit=3)
        assert [e.cursor for e in second.events] == [4, 5, 6]
        offsets = {o.consumer_id: o for o in await client.group_offsets(group)}
        assert set(offsets) == {"w1", "w2"}
        assert (offsets["w1"].last_cursor, offsets["w1"].claimed_cursor) == (3, 3)
        assert (offsets["w2"].last_cursor, offsets["w2"].claimed_cursor) == (0, 6)

    with_client(scenario)
