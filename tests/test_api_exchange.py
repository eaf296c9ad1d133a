"""API answers written by the connection itself (ApiExchange), checked on the wire.

Since 36a7d16 the HTTP protocol (GuardedHttpProtocol.start_api_exchange) matches an API route
(anything in API_ROUTES: /api/v1/..., /v1/..., /healthz, /openapi.json, ...) itself and writes
ActaeApp.answer_api's whole answer (status line, headers, body) in ONE transport write, while
pages, /ws, /static and unknown paths (404/405) keep going through uvicorn's ASGI cycle into
Starlette. Everything around the answer is still uvicorn's RequestResponseCycle, inherited:
reading the body, `100 Continue`, keep-alive, pipelining, HTTP/1.0, a lost connection. A slip
in that hand-written write shows only in HTTP framing, which an HTTP client library smooths
over, so these tests talk raw HTTP/1.1 over sockets to the real server (the shared `server`
fixture) and read every byte of every answer:

- pipelined requests (API only, and API mixed with ASGI-served ones) come back complete, in
  order, framed by a correct content-length, and a read reflects the write pipelined before it;
- HTTP/1.0 and `Connection: close` get `connection: close` and the socket closed after;
- `Expect: 100-continue` gets `HTTP/1.1 100 Continue` before the body is sent;
- a percent-encoded path parameter is decoded as a channel id;
- an unserved Host gets the JSON 400 and the connection keeps serving;
- every answer carries the security headers, and `date`/`server`, once each; gzip still works;
- a client that goes away mid-request leaves the server serving and the write whole or absent;
- X-Forwarded-* headers from loopback (uvicorn's proxy-header reading, run by the exchange)
  do not disturb an answer. No API answer depends on the scheme or the client address, so
  what those headers change is not observable here.

Every socket has a timeout; nothing sleeps for a fixed time.
"""
from __future__ import annotations

import gzip
import json
import socket
import struct
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import urlsplit

import pytest

from conftest import RawHTTP, http, poll

TIMEOUT = 10.0                # every socket: no test waits longer than this for a byte
HOST = "127.0.0.1"            # a Host the server serves (the port part is not compared)
SECURITY_HEADERS = {          # what every answer carries (SECURITY_HEADERS in actae.py)
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
}


# =============================================================================
# Raw HTTP/1.1: requests as bytes, answers read by content-length
# =============================================================================


def request(method: str, path: str, *, key: Optional[str] = None, body=None, headers=(), version: str = "1.1",
            host: Optional[str] = HOST) -> bytes:
    """One request's bytes. `body`: a JSON value (sent as application/json) or bytes; `headers`:
    (name, value) pairs added as given; `host=None` sends no Host header."""
    lines = [f"{method} {path} HTTP/{version}"]
    if host is not None:
        lines.append(f"Host: {host}")
    if key:
        lines.append(f"x-api-key: {key}")
    data = b""
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        if not isinstance(body, bytes):
            lines.append("content-type: application/json")
        lines.append(f"content-length: {len(data)}")
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data


@dataclass
class Reply:
    status: int
    reason: str
    headers: list                 # (lower-case name, value) in the order sent
    body: bytes
    interim: list = field(default_factory=list)    # the 1xx statuses that came before it

    def values(self, name: str) -> list:
        return [v for k, v in self.headers if k == name]

    def header(self, name: str) -> Optional[str]:
        """The one value of `name` (None when absent); sent twice fails the test."""
        found = self.values(name)
        assert len(found) <= 1, f"header {name!r} sent {len(found)} times: {self.headers}"
        return found[0] if found else None

    def json(self):
        assert "json" in (self.header("content-type") or ""), (self.status, self.headers)
        return json.loads(self.body)


class Connection(RawHTTP):
    """One raw connection to the server. `send` writes bytes (all of them in one sendall);
    `reply` reads the next complete answer, skipping (and noting) 1xx interim ones."""

    def __init__(self, server, timeout: float = TIMEOUT):
        parts = urlsplit(server.url)
        super().__init__(socket.create_connection((parts.hostname, parts.port), timeout=timeout))

    def interim(self) -> int:
        """The next answer's status, which must be a 1xx interim one (it has no body)."""
        status, _, _ = self.head()
        assert 100 <= status < 200, f"expected an interim answer, got {status}"
        return status

    def reply(self) -> Reply:
        """The next final answer, its body exactly content-length bytes: a wrong length shows as the
        next answer's status line not parsing (or as bytes left over, see `closed_by_server`)."""
        interim = []
        while True:
            status, reason, headers = self.head()
            if status >= 200:
                break
            interim.append(status)
        reply = Reply(status, reason, headers, b"", interim)
        assert reply.header("transfer-encoding") is None, f"expected content-length framing: {headers}"
        length = reply.header("content-length")
        assert length is not None and length.isdigit(), f"no content-length: {headers}"
        reply.body = self.take(int(length))
        return reply

    def replies(self, count: int) -> list:
        return [self.reply() for _ in range(count)]

    def closed_by_server(self) -> bool:
        """True when the server closed the connection with nothing more to read."""
        try:
            data = self.buf or self.sock.recv(65536)
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False
        assert not data, f"bytes after the last answer: {data[:300]!r}"
        return True


def exchange(server, *requests: bytes) -> list:
    """All `requests` written at once on a new connection; their answers, in the order they came."""
    with Connection(server) as conn:
        conn.send(*requests)
        return conn.replies(len(requests))


def record(channel: str, payload=None, **fields) -> dict:
    return {"channel_id": channel, "event_type": "probe", "payload": payload, **fields}


def cursor_of(server, channel: str) -> Optional[int]:
    (reply,) = exchange(server, request("GET", f"/api/v1/events/cursor/{channel}", key=server.key))
    assert reply.status == 200, reply
    return reply.json()["latest_cursor"]


def replay_of(server, channel: str) -> list:
    (reply,) = exchange(server, request("GET", f"/api/v1/events/replay/{channel}?limit=1000", key=server.key))
    assert reply.status == 200, reply
    return reply.json()["events"]


def records_answered(server) -> int:
    """How many POST /api/v1/events/record the server has finished (any status), from /metrics:
    it counts a request once its handler is done, whether or not its client was still there."""
    (reply,) = exchange(server, request("GET", "/metrics", key=server.key))
    assert reply.status == 200, reply
    counts = [line.rsplit(" ", 1)[1] for line in reply.body.decode().splitlines()
              if line.startswith("actae_http_request_duration_seconds_count{")
              and 'route="/api/v1/events/record"' in line and 'method="POST"' in line]
    return int(sum(float(n) for n in counts))


def assert_well_formed(reply: Reply) -> None:
    """The headers every answer carries: the security ones, date and server, no name twice."""
    names = [name for name, _ in reply.headers]
    assert len(names) == len(set(names)), f"a header name is repeated: {names}"
    for name, value in SECURITY_HEADERS.items():
        assert reply.header(name) == value, (name, reply.headers)
    csp = reply.header("content-security-policy") or ""
    assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp, csp
    assert reply.header("date") and reply.header("server"), reply.headers


# =============================================================================
# Pipelining
# =============================================================================


def test_pipelined_api_requests_are_answered_in_order(server, unique):
    """Capabilities, a write, then a read of what it wrote, in ONE sendall on one connection; then
    ten write/read pairs the same way: each read sees exactly the write sent before it."""
    channel = unique("pipelined")
    first = [request("GET", "/api/v1/auth/capabilities", key=server.key),
             request("POST", "/api/v1/events/record", key=server.key, body=record(channel, {"n": 1})),
             request("GET", f"/api/v1/events/cursor/{channel}", key=server.key)]
    pairs = []
    for n in range(2, 12):
        pairs += [request("POST", "/api/v1/events/record", key=server.key, body=record(channel, {"n": n})),
                  request("GET", f"/api/v1/events/cursor/{channel}", key=server.key)]
    with Connection(server) as conn:
        conn.send(*first, *pairs)
        capabilities, written, cursor = conn.replies(3)
        rest = conn.replies(len(pairs))
        conn.send(request("GET", "/healthz"))          # the connection is still in step after all that
        assert conn.reply().status == 200
    assert [r.status for r in (capabilities, written, cursor, *rest)] == [200] * (3 + len(pairs))
    for reply in (capabilities, written, cursor, *rest):      # each framed right, or the next one misparses
        assert_well_formed(reply)
    assert capabilities.json()["auth_method"] == "api_key"
    assert capabilities.json()["permissions"]["write"] == ["*"]
    event = written.json()["event"]
    assert (event["channel_id"], event["payload"], event["channel_cursor"]) == (channel, {"n": 1}, 1)
    assert cursor.json() == {"latest_cursor": 1}
    for n, (write, read) in enumerate(zip(rest[::2], rest[1::2]), start=2):
        event = write.json()["event"]
        assert (event["payload"], event["channel_cursor"]) == ({"n": n}, n)
        assert read.json() == {"latest_cursor": n}, f"read {n} does not see the write before it"


def test_pipelined_api_and_asgi_requests_stay_in_order(server, unique):
    """API answers (the exchange) and Starlette's (a page, a 404, a 405), pipelined in one write:
    each comes back whole, in request order, and the API read still follows the API write."""
    channel = unique("mixed")
    requests = [
        request("GET", "/login"),                                             # a page: ASGI
        request("POST", "/api/v1/events/record", key=server.key, body=record(channel, "x")),
        request("GET", "/no-such-page"),                                      # 404 page: ASGI
        request("GET", f"/api/v1/events/cursor/{channel}", key=server.key),
        request("DELETE", "/api/v1/events/record", key=server.key),           # 405: ASGI
        request("GET", "/api/v1/no-such-route", key=server.key),              # 404 JSON: ASGI
        request("GET", "/healthz"),                                           # API, public
    ]
    answers = exchange(server, *requests)
    assert [r.status for r in answers] == [200, 200, 404, 200, 405, 404, 200]
    login, written, missing_page, cursor, not_allowed, missing_route, health = answers
    assert "text/html" in login.header("content-type") and b"api_key" in login.body
    assert written.json()["event"]["channel_id"] == channel
    assert "text/html" in missing_page.header("content-type") and b"/no-such-page" in missing_page.body
    assert cursor.json() == {"latest_cursor": 1}
    assert not_allowed.json()["status"] == "method_not_allowed"
    assert missing_route.json() == {"status": "not_found", "error": "no route for GET /api/v1/no-such-route"}
    assert health.json()["status"] == "ok"
    for reply in answers:
        assert_well_formed(reply)


def test_chunked_request_body_on_an_api_route(server, unique):
    """A write whose body comes as chunks (Transfer-Encoding: chunked), pipelined before a read."""
    channel = unique("chunked")
    data = json.dumps(record(channel, {"chunked": True})).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (data[:7], data[7:20], data[20:])) + b"0\r\n\r\n"
    head = request("POST", "/api/v1/events/record", key=server.key,
                   headers=[("content-type", "application/json"), ("transfer-encoding", "chunked")])
    written, cursor = exchange(server, head + chunks, request("GET", f"/api/v1/events/cursor/{channel}",
                                                                key=server.key))
    assert written.status == 200, written.body
    assert written.json()["event"]["payload"] == {"chunked": True}
    assert cursor.json() == {"latest_cursor": 1}


# =============================================================================
# The connection's end: HTTP/1.0, Connection: close
# =============================================================================


@pytest.mark.parametrize("connection_header", [None, "keep-alive"])
def test_http_1_0_is_answered_then_closed(server, unique, connection_header):
    """HTTP/1.0 (even asking for keep-alive, which uvicorn does not do for 1.0): the answer says
    `connection: close` and the server closes the socket after it. A write works the same."""
    headers = [("Connection", connection_header)] if connection_header else []
    with Connection(server) as conn:
        conn.send(request("GET", "/api/v1/auth/capabilities", key=server.key, version="1.0", headers=headers))
        reply = conn.reply()
        assert reply.status == 200 and reply.json()["auth_method"] == "api_key"
        assert reply.header("connection") == "close"
        assert_well_formed(reply)
        assert conn.closed_by_server()
    channel = unique(connection_header or "plain")
    with Connection(server) as conn:
        conn.send(request("POST", "/api/v1/events/record", key=server.key, body=record(channel, 10), version="1.0",
                          headers=headers))
        reply = conn.reply()
        assert reply.status == 200 and reply.json()["event"]["payload"] == 10
        assert reply.header("connection") == "close"
        assert conn.closed_by_server()
    assert cursor_of(server, channel) == 1


def test_connection_close_is_answered_then_closed(server, unique):
    """An HTTP/1.1 `Connection: close` on an API route: the answer, `connection: close`, the socket
    closed; a write pipelined behind it is never run (cursor still null)."""
    channel = unique("after-close")
    with Connection(server) as conn:
        conn.send(request("GET", "/api/v1/auth/capabilities", key=server.key, headers=[("Connection", "close")]),
                  request("POST", "/api/v1/events/record", key=server.key, body=record(channel, "never")))
        reply = conn.reply()
        assert reply.status == 200 and reply.json()["auth_method"] == "api_key"
        assert reply.header("connection") == "close"
        assert_well_formed(reply)
        assert conn.closed_by_server(), "the server kept the connection open after Connection: close"
    assert cursor_of(server, channel) is None
    # Keep-alive is the default otherwise: the same request without the header gets no `connection`.
    with Connection(server) as conn:
        conn.send(request("GET", "/api/v1/auth/capabilities", key=server.key))
        assert conn.reply().header("connection") is None
        conn.send(request("GET", "/healthz"))
        assert conn.reply().status == 200


# =============================================================================
# Expect: 100-continue
# =============================================================================


def test_expect_100_continue_before_the_body(server, unique):
    """The headers alone, with `Expect: 100-continue`: the server says `HTTP/1.1 100 Continue` before
    any body byte is sent; the answer follows the body, and the connection keeps serving."""
    channel = unique("continue")
    body = json.dumps(record(channel, {"after": "continue"})).encode()
    head = request("POST", "/api/v1/events/record", key=server.key,
                   headers=[("content-type", "application/json"), ("content-length", str(len(body))),
                            ("Expect", "100-continue")])
    with Connection(server) as conn:
        conn.send(head)
        assert conn.interim() == 100
        assert conn.buf == b"", f"bytes beside the 100 Continue: {conn.buf!r}"
        conn.send(body)
        reply = conn.reply()
        assert reply.status == 200, reply.body
        assert reply.json()["event"]["payload"] == {"after": "continue"}
        assert_well_formed(reply)
        # A client that does not wait for the 100 (body sent at once): any interim answer is a 100.
        conn.send(request("POST", "/api/v1/events/record", key=server.key, body=record(channel, 2),
                          headers=[("Expect", "100-continue")]),
                  request("GET", f"/api/v1/events/cursor/{channel}", key=server.key))
        written, cursor = conn.replies(2)
        assert set(written.interim) <= {100} and written.status == 200
        assert cursor.interim == [] and cursor.json() == {"latest_cursor": 2}


def test_expect_100_continue_refused_without_continue(server, unique):
    """No key: the 401 comes instead of a 100 (the body is not wanted). A client that sends the body
    anyway keeps its connection: the body is read and dropped, not taken for the next request."""
    channel = unique("refused")
    body = json.dumps(record(channel, "unwanted")).encode()
    head = request("POST", "/api/v1/events/record",
                   headers=[("content-type", "application/json"), ("content-length", str(len(body))),
                            ("Expect", "100-continue")])
    with Connection(server) as conn:
        conn.send(head)
        reply = conn.reply()
        assert (reply.status, reply.interim) == (401, [])
        assert reply.json()["status"] == "unauthorized"
        assert_well_formed(reply)
        conn.send(body, request("GET", f"/api/v1/events/cursor/{channel}", key=server.key))
        assert conn.reply().json() == {"latest_cursor": None}


# =============================================================================
# Paths and hosts
# =============================================================================


def test_percent_encoded_channel_id_in_the_path(server, unique):
    """A channel id written in the JSON body, read back through a percent-encoded path (`:` as %3A or
    %3a, letters and `.`/`_`/`-` encoded too): the path parameter is the decoded id."""
    channel = unique("enc") + ":a.b_C"
    (written,) = exchange(server, request("POST", "/api/v1/events/record", key=server.key,
                                          body=record(channel, {"encoded": True})))
    assert written.status == 200, written.body
    encoded = [channel.replace(":", "%3A"), channel.replace(":", "%3a"),
               "".join(f"%{ord(c):02X}" for c in channel)]                  # every character encoded
    answers = exchange(server, *[request("GET", f"/api/v1/events/cursor/{path}", key=server.key) for path in encoded],
                       request("GET", f"/api/v1/events/replay/{encoded[0]}", key=server.key),
                       request("GET", f"/api/v1/events/cursor/{channel.replace(':', '%2F')}", key=server.key))
    *cursors, replay, slash = answers
    assert [r.json() for r in cursors] == [{"latest_cursor": 1}] * len(encoded)
    (event,) = replay.json()["events"]
    assert (event["channel_id"], event["payload"]) == (channel, {"encoded": True})
    # An encoded "/" is a "/" once decoded: no route has it inside a channel id (as before: 404 JSON).
    assert slash.status == 404 and slash.json()["status"] == "not_found"


def test_unserved_host_is_refused_and_the_connection_serves_on(server, unique):
    """An API request naming a Host we do not serve: 400 with the JSON error body, nothing done (a
    write's body is read and dropped, not run), and the same connection answers the next request."""
    channel = unique("bad-host")
    with Connection(server) as conn:
        conn.send(request("GET", "/api/v1/auth/capabilities", key=server.key, host="evil.example:8080"),
                  request("POST", "/api/v1/events/record", key=server.key, body=record(channel, "no"),
                          host="rebind.example"),
                  request("GET", f"/api/v1/events/cursor/{channel}", key=server.key))
        refused_read, refused_write, cursor = conn.replies(3)
    for reply, host in ((refused_read, "evil.example:8080"), (refused_write, "rebind.example")):
        assert reply.status == 400
        assert reply.header("content-type") == "application/json"
        body = reply.json()
        assert set(body) == {"status", "error"} and body["status"] == "bad_request"
        assert repr(host) in body["error"] and "--allow-host" in body["error"]
        assert reply.header("connection") is None, "a refused Host should not cost the connection"
        assert_well_formed(reply)
    assert cursor.json() == {"latest_cursor": None}


# =============================================================================
# Headers on every answer, gzip
# =============================================================================


def test_security_headers_once_each_on_every_api_answer(server, unique):
    """A 200, a 401, a 404, two 400s (bad JSON, bad channel id) and a 413 answered by the exchange:
    each carries the security headers and date/server, no header twice, and JSON."""
    channel = unique("headers")
    answers = exchange(
        server,
        request("GET", "/api/v1/auth/capabilities", key=server.key),
        request("GET", "/api/v1/auth/capabilities"),
        request("GET", f"/api/v1/channels/{channel}/metadata", key=server.key),
        request("POST", "/api/v1/events/record", key=server.key, body=b"{not json",
                headers=[("content-type", "application/json")]),
        request("POST", "/api/v1/events/record", key=server.key, body=record("bad channel")),
        request("POST", "/api/v1/events/record", key=server.key, body=b"[" + b"0," * (2 * 1024 * 1024) + b"0]",
                headers=[("content-type", "application/json")]),
    )
    assert [r.status for r in answers] == [200, 401, 404, 400, 400, 413]
    for reply in answers:
        assert_well_formed(reply)
        assert reply.header("content-type") == "application/json"
    for reply in answers[1:]:
        assert set(reply.json()) == {"status", "error"}, reply.body


def test_large_api_answers_are_gzipped_when_asked(server, unique):
    """/openapi.json and a replay of a big event, with and without Accept-Encoding: gzip: gzip'd
    (content-encoding, vary, the compressed length), the security headers once each, and the
    body decompresses to the same JSON as the plain answer."""
    channel = unique("gzip")
    (written,) = exchange(server, request("POST", "/api/v1/events/record", key=server.key,
                                          body=record(channel, {"text": "abcdefgh" * 1000})))
    assert written.status == 200, written.body
    gzipped = [("Accept-Encoding", "gzip, deflate")]
    plain_doc, gzip_doc, plain_replay, gzip_replay = exchange(
        server,
        request("GET", "/openapi.json"),
        request("GET", "/openapi.json", headers=gzipped),
        request("GET", f"/api/v1/events/replay/{channel}", key=server.key),
        request("GET", f"/api/v1/events/replay/{channel}", key=server.key, headers=gzipped))
    for plain, packed in ((plain_doc, gzip_doc), (plain_replay, gzip_replay)):
        assert plain.status == packed.status == 200
        assert plain.header("content-encoding") is None and len(plain.body) > 1024
        assert packed.header("content-encoding") == "gzip"
        assert packed.header("vary") == "accept-encoding"
        assert int(packed.header("content-length")) == len(packed.body) < len(plain.body)
        assert json.loads(gzip.decompress(packed.body)) == plain.json()
        assert_well_formed(plain)
        assert_well_formed(packed)
    assert "paths" in json.loads(gzip.decompress(gzip_doc.body))
    (event,) = json.loads(gzip.decompress(gzip_replay.body))["events"]
    assert event["payload"] == {"text": "abcdefgh" * 1000}



@pytest.mark.parametrize("accept,packed", [("GZIP", True), ("br, gzip;q=0.5", True), ("*", True),
                                           ("gzip;q=0", False), ("gzip; q=0.0, deflate", False),
                                           ("gzip;q=0, *", False), ("identity, *;q=0", False), ("deflate", False)])
def test_accept_encoding_is_read_by_its_rules(server, accept, packed):
    """Coding names are case-insensitive and q=0 means "not acceptable"; `*` stands for gzip only
    when gzip is not named."""
    (answer,) = exchange(server, request("GET", "/openapi.json", headers=[("Accept-Encoding", accept)]))
    assert answer.status == 200
    assert (answer.header("content-encoding") == "gzip") is packed, answer.headers
    body = gzip.decompress(answer.body) if packed else answer.body
    assert "paths" in json.loads(body)

# =============================================================================
# Clients that go away
# =============================================================================


def abandon(server, data: bytes, *, reset: bool) -> None:
    """Write `data` and go away without reading: a normal close (FIN), or a reset (RST)."""
    conn = Connection(server)
    try:
        conn.send(data)
        if reset:
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        conn.sock.close()


def test_client_gone_after_a_write_leaves_it_whole_or_absent(server, unique):
    """Writes whose clients close (or reset) right after sending, before reading: the server keeps
    serving, logs no error, and each write happened fully or not at all. A body cut short (valid
    JSON so far, less than its content-length) is never taken as the whole body."""
    whole, short = unique("gone"), unique("cut-short")
    log_from, answered = len(server.lines), records_answered(server)
    sent = {}
    for n in range(8):
        payload = {"n": n, "text": "x" * 2000}
        sent[n] = payload
        abandon(server, request("POST", "/api/v1/events/record", key=server.key, body=record(whole, payload)),
                reset=n % 2 == 1)
        data = json.dumps(record(short, {"n": n})).encode()
        head = request("POST", "/api/v1/events/record", key=server.key,
                       headers=[("content-type", "application/json"), ("content-length", str(len(data) + 10))])
        abandon(server, head + data, reset=n % 2 == 1)
    # Each abandoned request is finished (its write committed or dropped) before the checks; one never
    # finishing, or the server no longer answering, fails here.
    poll(lambda: records_answered(server) >= answered + 16, what="the 16 abandoned writes to be finished")
    (health,) = exchange(server, request("GET", "/healthz"))
    assert health.status == 200 and health.json()["status"] == "ok"
    assert server.proc.poll() is None, "the server exited"
    events = replay_of(server, whole)
    assert cursor_of(server, whole) == (len(events) or None)
    payloads = [e["payload"] for e in events]
    assert all(p in sent.values() for p in payloads), "an event with a payload that was not sent"
    assert len({p["n"] for p in payloads}) == len(payloads), "a write landed twice"
    assert cursor_of(server, short) is None, "a body cut short was recorded"
    errors = [line for line in server.lines[log_from:] if "Traceback" in line or "Exception" in line]
    assert not errors, "\n".join(server.lines[log_from:])


# =============================================================================
# X-Forwarded-* from loopback
# =============================================================================


def test_forwarded_headers_from_loopback_do_not_disturb_an_api_answer(server):
    """uvicorn's proxy-header reading runs inside the exchange when X-Forwarded-* come (loopback is
    trusted by default): well-formed, odd and empty values still get the normal answer, and the
    connection keeps serving. (No API answer shows the scheme or client address they set.)"""
    variants = [[("X-Forwarded-For", "203.0.113.7"), ("X-Forwarded-Proto", "https")],
                [("X-Forwarded-For", "203.0.113.7, 198.51.100.1, not-an-address"), ("X-Forwarded-Proto", "wss")],
                [("X-Forwarded-For", ""), ("X-Forwarded-Proto", "")],
                [("X-Forwarded-Host", "elsewhere.example")]]
    answers = exchange(server, *[request("GET", "/api/v1/auth/capabilities", key=server.key, headers=h)
                                 for h in variants], request("GET", "/healthz"))
    assert [r.status for r in answers] == [200] * (len(variants) + 1), [r.body[:200] for r in answers]
    for reply in answers[:-1]:
        assert reply.json()["auth_method"] == "api_key"
        assert_well_formed(reply)
    status, _, body = http("GET", server.url + "/api/v1/auth/capabilities", key=server.key)
    assert status == 200 and body["auth_method"] == "api_key"
