"""HTTP/1.1 on raw sockets: pipelining past the header limit, the limit itself, and a client that goes away.

- 600 pipelined `GET /healthz` requests of exactly 111 bytes each (66,600 bytes, more than the
  64 KiB header limit in all, though each head is tiny), sent in ONE sendall, get 600 answers, in
  order, each 200; a different request after them gets its own answer (the framing held);
- a single request whose head is over the limit (`--max-header-bytes`, default 65536) still gets 431;
- clients that close a connection while a large replay is being answered leave no Traceback in
  the server's output.
"""
from __future__ import annotations

import json
import socket
import time

import pytest

from conftest import RawHTTP, ServerProcess, http, port_of

MAX_HEADER_BYTES = 65536
COUNT, SIZE = 600, 111


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("pipelining")).start() as s:
        yield s


def healthz_request(port: int, size: int = SIZE) -> bytes:
    """GET /healthz with its Host header, padded with an X-Pad header to exactly `size` bytes."""
    bare = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Pad: \r\n\r\n"
    request = bare.replace("X-Pad: ", "X-Pad: " + "p" * (size - len(bare))).encode("ascii")
    assert len(request) == size
    return request


def test_600_pipelined_requests_in_one_send_get_600_answers_in_order(srv):
    port = port_of(srv)
    with RawHTTP.open(port, timeout=30) as conn:
        conn.send(healthz_request(port) * COUNT)
        for n in range(1, COUNT + 1):
            try:
                status, headers, body = conn.read_response(timeout=20)
            except (ConnectionError, TimeoutError) as exc:
                pytest.fail(f"answer {n} of {COUNT} never came: {exc}")
            assert status == 200, f"answer {n} of {COUNT} was {status}: {body[:200]!r}"
            assert "version" in json.loads(body), body[:200]
        # the next request on the same connection is answered as itself: no answer was lost or doubled
        conn.send(f"GET /openapi.json HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        status, _, body = conn.read_response(timeout=20)
        assert status == 200 and "openapi" in json.loads(body), body[:200]


def test_a_single_request_over_the_header_limit_still_gets_431(srv):
    port = port_of(srv)
    pad = "p" * (MAX_HEADER_BYTES + 1024)
    request = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Pad: {pad}\r\n\r\n".encode()
    assert len(request) > MAX_HEADER_BYTES
    with RawHTTP.open(port) as conn:
        conn.send(request)
        status, _, body = conn.read_response(timeout=15)
    assert status == 431, (status, body[:200])
    # and just under the limit is served
    under = healthz_request(port, MAX_HEADER_BYTES - 1024)
    with RawHTTP.open(port) as conn:
        conn.send(under)
        assert conn.read_response(timeout=15)[0] == 200


def test_clients_closing_mid_answer_leave_no_traceback(srv):
    port, channel = port_of(srv), "big-replay"
    blob = "x" * (200 * 1024)
    for n in range(20):                                  # a replay of about 4 MB
        status, _, answer = http("POST", srv.url + "/api/v1/events/record", key=srv.key,
                                 body={"channel_id": channel, "event_type": "big", "payload": {"n": n, "blob": blob}})
        assert status == 200, answer
    logged_from = len(srv.lines)
    request = (f"GET /api/v1/events/replay/{channel}?limit=1000 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
               f"x-api-key: {srv.key}\r\n\r\n").encode()
    for n in range(6):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(request)
        if n % 2:                                        # half of them read the start of the answer first
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.close()
    # the server is still well: a whole replay on a new connection is answered
    with RawHTTP.open(port, timeout=30) as conn:
        conn.send(request)
        status, _, body = conn.read_response(timeout=30)
    assert status == 200 and len(json.loads(body)["events"]) == 20

    def traceback_logged():
        return [line for line in srv.lines[logged_from:] if "Traceback" in line]
    deadline = time.monotonic() + 1.5                    # give a late error time to be printed
    while time.monotonic() < deadline and not traceback_logged():
        time.sleep(0.05)
    assert not traceback_logged(), "\n".join(srv.lines[logged_from:])[-4000:]
