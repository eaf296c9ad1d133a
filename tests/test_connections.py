"""Hostile connections over raw sockets (hardening contract, "Connections" and "Errors").

Acceptance: "Raw sockets against a running server: a 128 MiB unterminated header, 30 x 8 MiB
headers, 1,000 silent connections and 300 slowloris connections: server RSS grows < 50 MB, each is
cut off within its timeout, and a normal SDK client keeps being served throughout".

The module starts its own server with short timeouts (2 s for headers, keep-alive and body; the
other flags keep their defaults: 64 KiB of request line + headers, at most 100 headers). Every
attack is bounded in count and time, goes to loopback only, and closes its sockets in `finally`.
Cut-off times are measured on this side with time.monotonic() from the moment the socket was
opened (or the last byte sent), and compared with the configured timeout plus a generous margin.
"""
from __future__ import annotations

import asyncio
import json
import resource
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional
from urllib.parse import urlsplit

import pytest

from conftest import RawHTTP, ServerProcess, http, parse_head, poll

MiB = 1024 * 1024
HEADER_TIMEOUT = 2.0
KEEPALIVE_TIMEOUT = 2.0
BODY_TIMEOUT = 2.0
MARGIN = 3.0                 # slack on top of every configured timeout
EARLY = 0.5                  # a cut-off sooner than timeout - EARLY means the flag is not what it does
RSS_GROWTH_MAX = 50 * 1000 * 1000   # "< 50 MB"
MAX_HEADER_BYTES = 65536     # the default --max-header-bytes
PROBE_CALL_MAX = 5.0         # "every call succeeds within a few seconds"


# =============================================================================
# Server and small helpers
# =============================================================================


def raise_nofile_limit() -> None:
    """This process holds ~1,000 sockets at once: lift the soft open-file limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A server of its own with short connection timeouts (defaults for everything else)."""
    raise_nofile_limit()
    flags = ["--header-timeout", str(int(HEADER_TIMEOUT)),
             "--keepalive-timeout", str(int(KEEPALIVE_TIMEOUT)),
             "--body-timeout", str(int(BODY_TIMEOUT))]
    with ServerProcess(tmp_path_factory.mktemp("actae-connections"), args=flags).start() as srv:
        yield srv


@pytest.fixture
def server(guarded):
    """The module's server; after each test it must still be running and answering /healthz."""
    yield guarded
    assert guarded.proc.poll() is None, "server exited:\n" + "\n".join(guarded.lines[-40:])
    status, _, _ = http("GET", guarded.url + "/healthz", timeout=5)
    assert status == 200, f"/healthz answered {status} after the test"


def address(server) -> tuple:
    parts = urlsplit(server.url)
    return parts.hostname, parts.port


def connect(server, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(address(server), timeout=timeout)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS line")


class RssWatch:
    """Baseline RSS on enter, then the peak seen by a 10 ms sampler until exit (plus the last value)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.baseline = self.peak = self.last = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, rss_bytes(self.pid))
            except (OSError, RuntimeError):
                return
            self._stop.wait(0.01)

    def __enter__(self):
        self.baseline = self.peak = rss_bytes(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        time.sleep(0.2)   # time must pass: memory still held right after the attack counts too
        self._stop.set()
        self._thread.join(5)
        self.last = rss_bytes(self.pid)
        self.peak = max(self.peak, self.last)

    @property
    def growth(self) -> int:
        return self.peak - self.baseline

    def __str__(self):
        return (f"RSS baseline {self.baseline / 1e6:.1f} MB, peak {self.peak / 1e6:.1f} MB "
                f"(+{self.growth / 1e6:.1f} MB), after {self.last / 1e6:.1f} MB")


def status_of(data: bytes) -> Optional[int]:
    """The status code of an HTTP/1.x response at the start of `data` (None if there is none)."""
    if not data.startswith(b"HTTP/1."):
        return None
    parts = data.split(b"\r\n", 1)[0].split(b" ")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def readable(sock: socket.socket, timeout: float) -> bool:
    sel = selectors.DefaultSelector()   # epoll: safe for any fd number
    try:
        sel.register(sock, selectors.EVENT_READ)
        return bool(sel.select(timeout))
    finally:
        sel.close()


@dataclass
class Ending:
    """How a connection ended: `end` is "eof", "reset" or "open" (still open at the deadline)."""
    end: str
    at: float                  # time.monotonic() when the end was seen
    data: bytes = b""

    @property
    def status(self) -> Optional[int]:
        return status_of(self.data)

    @property
    def closed(self) -> bool:
        return self.end in ("eof", "reset")


def wait_closed(sock: socket.socket, deadline: float) -> Ending:
    """Read (and keep) whatever the server still sends until it closes or `deadline` passes."""
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return Ending("open", time.monotonic(), data)
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            return Ending("open", time.monotonic(), data)
        except (ConnectionResetError, BrokenPipeError):
            return Ending("reset", time.monotonic(), data)
        if not chunk:
            return Ending("eof", time.monotonic(), data)
        if len(data) < 65536:
            data += chunk


def send_counted(sock: socket.socket, data: bytes, counter: list) -> None:
    """sendall() that adds every byte the kernel accepted to counter[0]."""
    view = memoryview(data)
    while view:
        n = sock.send(view)
        counter[0] += n
        view = view[n:]


# =============================================================================
# Many connections at once: one epoll loop on this side
# =============================================================================


@dataclass
class Conn:
    sock: socket.socket
    opened: float
    ending: Optional[Ending] = None
    sent: int = 0              # bytes sent after the opening bytes

    @property
    def cut_after(self) -> Optional[float]:
        return None if self.ending is None or not self.ending.closed else self.ending.at - self.opened


@dataclass
class Attack:
    conns: list
    started: float = 0.0
    finished: float = 0.0
    open_failures: list = field(default_factory=list)

    def cut_times(self) -> list:
        return [c.cut_after for c in self.conns if c.cut_after is not None]

    def still_open(self) -> list:
        return [c for c in self.conns if c.cut_after is None]

    def statuses(self) -> set:
        return {c.ending.status for c in self.conns if c.ending is not None}

    def summary(self) -> str:
        cuts = sorted(self.cut_times())
        if not cuts:
            return f"{len(self.conns)} connections, none cut off"
        return (f"{len(self.conns)} connections: cut off after min {cuts[0]:.2f} s, "
                f"median {cuts[len(cuts) // 2]:.2f} s, max {cuts[-1]:.2f} s; "
                f"{len(self.still_open())} still open; statuses seen {sorted(map(str, self.statuses()))}; "
                f"attack lasted {self.finished - self.started:.2f} s")


def run_attack(server, count: int, opening: bytes, *, drip: Optional[Callable[[int], bytes]] = None,
               drip_every: float = 0.5, watch_for: float = HEADER_TIMEOUT + MARGIN + 1.0) -> Attack:
    """Open `count` connections, send `opening` on each, then (if `drip`) send drip(i) every
    `drip_every` s on each live one; record when the server closes each (EOF or reset).
    Stops when all are closed or `watch_for` s after the last one was opened."""
    attack = Attack([])
    sel = selectors.DefaultSelector()
    try:
        attack.started = time.monotonic()
        for _ in range(count):
            try:
                sock = connect(server)
            except OSError as exc:
                attack.open_failures.append(repr(exc))
                continue
            conn = Conn(sock, time.monotonic())
            attack.conns.append(conn)
            if opening:
                sock.sendall(opening)
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ, conn)
        deadline = time.monotonic() + watch_for
        next_drip, drips = time.monotonic() + drip_every, 0
        live = len(attack.conns)

        def closed(conn, end: str) -> None:
            """The server ended `conn` (`end`: "reset" or "eof"); what it sent before is kept."""
            nonlocal live
            conn.ending = Ending(end, time.monotonic(), conn.ending.data if conn.ending else b"")
            sel.unregister(conn.sock)
            live -= 1

        while live and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.02):
                conn = key.data
                try:
                    chunk = conn.sock.recv(65536)
                except BlockingIOError:
                    continue
                except (ConnectionResetError, BrokenPipeError):
                    closed(conn, "reset")
                    continue
                if chunk:   # an answer (408...): keep it, the close must still follow
                    conn.ending = Ending("open", time.monotonic(), (conn.ending.data if conn.ending else b"") + chunk)
                    continue
                closed(conn, "eof")
            if drip and time.monotonic() >= next_drip:
                payload = drip(drips)
                drips += 1
                next_drip += drip_every
                for key in list(sel.get_map().values()):
                    conn = key.data
                    try:
                        conn.sent += conn.sock.send(payload)
                    except BlockingIOError:
                        pass
                    except (ConnectionResetError, BrokenPipeError):
                        closed(conn, "reset")
        attack.finished = time.monotonic()
        return attack
    finally:
        sel.close()
        for conn in attack.conns:
            conn.sock.close()


def silent_attack(server) -> Attack:
    return run_attack(server, 1000, b"")


SLOW_HEADER = b"X-Slow-Header: " + b"a" * 64


def slowloris_attack(server) -> Attack:
    return run_attack(server, 300, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n",
                      drip=lambda i: SLOW_HEADER[i % len(SLOW_HEADER):][:1], drip_every=0.5)


def assert_cut_off_by_header_timeout(attack: Attack, count: int):
    assert not attack.open_failures, (f"{len(attack.open_failures)} connections could not be opened: "
                                      f"{attack.open_failures[:3]}")
    assert len(attack.conns) == count
    still = attack.still_open()
    assert not still, (f"{len(still)} of {count} connections were still open "
                       f"{HEADER_TIMEOUT + MARGIN + 1.0:.0f} s after opening; " + attack.summary())
    cuts = attack.cut_times()
    assert max(cuts) <= HEADER_TIMEOUT + MARGIN, "cut off too late: " + attack.summary()
    assert min(cuts) >= HEADER_TIMEOUT - EARLY, (
        f"cut off before the {HEADER_TIMEOUT} s header timeout: " + attack.summary())
    assert attack.statuses() <= {None, 408}, "unexpected answer: " + attack.summary()


# =============================================================================
# A normal SDK client, running in its own thread while an attack goes on
# =============================================================================


@dataclass
class Call:
    kind: str
    started: float
    seconds: float
    error: Optional[str]


class Probe:
    """Alternates SDK record, SDK list_channels and a fresh-connection urllib GET /api/v1/channels."""

    def __init__(self, server, channel: str):
        self.server, self.channel = server, channel
        self.calls: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.crash: Optional[str] = None

    async def _main(self):
        from actae_client import ActaeClient

        client = ActaeClient(endpoint=self.server.url, api_key=self.server.key, timeout=PROBE_CALL_MAX * 2)
        try:
            n = 0
            while not self._stop.is_set():
                kind = ("record", "list_channels", "urllib")[n % 3]
                started = time.monotonic()
                error = None
                try:
                    if kind == "record":
                        event = await client.record(self.channel, "probe", {"n": n}, actor="connections-test")
                        assert isinstance(event.cursor, int) and event.cursor >= 1, event
                    elif kind == "list_channels":
                        channels = await client.list_channels()
                        assert isinstance(channels, list), channels
                    else:
                        status, _, body = await asyncio.to_thread(
                            http, "GET", self.server.url + "/api/v1/channels", key=self.server.key,
                            timeout=PROBE_CALL_MAX * 2)
                        assert status == 200 and isinstance(body, dict), (status, body)
                except Exception as exc:   # noqa: BLE001 - every failure is a finding
                    error = f"{type(exc).__name__}: {exc}"
                self.calls.append(Call(kind, started, time.monotonic() - started, error))
                n += 1
                await asyncio.sleep(0.1)   # the probe's pace: a call every 0.1 s or so, not a wait
        except Exception as exc:   # noqa: BLE001
            self.crash = repr(exc)
        finally:
            await client.disconnect()

    def __enter__(self):
        self._thread.start()
        poll(lambda: len([c for c in self.calls if c.error is None]) >= 3, 15,
             what=lambda: f"the SDK probe to get going before the attack (calls: {self.calls}, crash: {self.crash})")
        return self

    def __exit__(self, *exc):
        time.sleep(0.3)   # time must pass: the probe goes on for a moment after the attack, and those calls count
        self._stop.set()
        self._thread.join(PROBE_CALL_MAX * 3)

    def during(self, start: float, end: float) -> list:
        return [c for c in self.calls if c.started + c.seconds >= start and c.started <= end]


# =============================================================================
# 1. A 128 MiB header line that never ends
# =============================================================================


def kernel_buffer_bytes() -> int:
    """What loopback TCP can hold in flight without the server reading: max rmem + max wmem."""
    total = 0
    for name in ("tcp_rmem", "tcp_wmem"):
        with open(f"/proc/sys/net/ipv4/{name}") as f:
            total += int(f.read().split()[2])
    return total


def test_unterminated_128mib_header_is_refused_early(server):
    chunk = b"a" * MiB
    accepted_cap = min(kernel_buffer_bytes() + 8 * MiB, 64 * MiB)
    sent = [0]
    stop = "all 128 MiB were accepted"
    with RssWatch(server.proc.pid) as rss:
        sock = connect(server)
        try:
            sock.settimeout(HEADER_TIMEOUT + MARGIN)   # a send blocked this long: the server stopped reading
            start = time.monotonic()
            try:
                send_counted(sock, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: ", sent)
                for _ in range(128):
                    if readable(sock, 0):
                        stop = "the server answered or closed"
                        break
                    send_counted(sock, chunk, sent)
            except socket.timeout:
                stop = "a send blocked (server not reading)"
            except (ConnectionResetError, BrokenPipeError) as exc:
                stop = f"send failed: {type(exc).__name__}"
            ending = wait_closed(sock, time.monotonic() + HEADER_TIMEOUT + MARGIN)
        finally:
            sock.close()
    elapsed = ending.at - start
    report = (f"{stop}; {sent[0] / MiB:.1f} MiB accepted by the kernel; ended by {ending.end} "
              f"with status {ending.status} after {elapsed:.2f} s; {rss}")
    print(report)
    assert stop != "all 128 MiB were accepted", report
    assert sent[0] < accepted_cap, f"more than {accepted_cap / MiB:.0f} MiB accepted: " + report
    assert ending.closed, "the connection stayed open: " + report
    assert ending.status in (None, 431), report
    assert elapsed <= HEADER_TIMEOUT + MARGIN, report
    assert rss.growth < RSS_GROWTH_MAX, report


# =============================================================================
# 2. 30 concurrent 8 MiB headers
# =============================================================================


def test_30_concurrent_8mib_headers_are_refused(server):
    chunk = b"b" * MiB
    count = 30
    barrier = threading.Barrier(count, timeout=20)
    results: list = [None] * count

    def attacker(i):
        sock = None
        sent = [0]
        try:
            sock = connect(server)
            barrier.wait()
            start = time.monotonic()
            sock.settimeout(HEADER_TIMEOUT + MARGIN)
            how = "all 8 MiB sent"
            try:
                send_counted(sock, f"GET /api/v1/channels HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big-{i}: ".encode(), sent)
                for _ in range(8):
                    if readable(sock, 0):
                        how = "answered/closed early"
                        break
                    send_counted(sock, chunk, sent)
                else:
                    send_counted(sock, b"\r\n\r\n", sent)
            except socket.timeout:
                how = "send blocked"
            except (ConnectionResetError, BrokenPipeError) as exc:
                how = f"send failed: {type(exc).__name__}"
            ending = wait_closed(sock, time.monotonic() + HEADER_TIMEOUT + MARGIN)
            results[i] = (how, sent[0], ending, ending.at - start)
        except Exception as exc:   # noqa: BLE001
            results[i] = ("error", sent[0], None, repr(exc))
        finally:
            if sock is not None:
                sock.close()

    with RssWatch(server.proc.pid) as rss:
        threads = [threading.Thread(target=attacker, args=(i,), daemon=True) for i in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert all(r is not None for r in results), "an attacker thread never finished"
    errors = [r for r in results if r[0] == "error"]
    assert not errors, errors[:3]
    worst = max(r[3] for r in results)
    report = (f"{count} x 8 MiB: ways {sorted({r[0] for r in results})}; endings "
              f"{sorted({(r[2].end, r[2].status) for r in results}, key=str)}; most accepted "
              f"{max(r[1] for r in results) / MiB:.1f} MiB; slowest cut-off {worst:.2f} s; {rss}")
    print(report)
    for how, sent, ending, elapsed in results:
        assert ending.closed, "a connection stayed open: " + report
        assert ending.status in (None, 431), report
        assert elapsed <= HEADER_TIMEOUT + MARGIN, report
    assert rss.growth < RSS_GROWTH_MAX, report


# =============================================================================
# 3. 1,000 silent connections
# =============================================================================


def test_1000_silent_connections_are_cut_off_by_the_header_timeout(server):
    with RssWatch(server.proc.pid) as rss:
        attack = silent_attack(server)
    print("silent:", attack.summary(), rss)
    assert_cut_off_by_header_timeout(attack, 1000)
    assert rss.growth < RSS_GROWTH_MAX, str(rss)


# =============================================================================
# 4. 300 slowloris connections
# =============================================================================


def test_300_slowloris_connections_are_cut_off_by_the_header_timeout(server):
    with RssWatch(server.proc.pid) as rss:
        attack = slowloris_attack(server)
    print("slowloris:", attack.summary(), rss,
          f"bytes dripped per connection: {min(c.sent for c in attack.conns)}..{max(c.sent for c in attack.conns)}")
    assert_cut_off_by_header_timeout(attack, 300)
    # they really kept sending while they were cut off: at least 3 drips (1.5 s) each
    assert min(c.sent for c in attack.conns) >= 3, "the slowloris connections did not keep sending"
    assert rss.growth < RSS_GROWTH_MAX, str(rss)


# =============================================================================
# 5. A normal SDK client is served throughout both attacks
# =============================================================================


@pytest.mark.parametrize("attack", [silent_attack, slowloris_attack], ids=["1000-silent", "300-slowloris"])
def test_sdk_client_is_served_during_the_attack(server, attack, unique):
    with Probe(server, unique("probe")) as probe:
        result = attack(server)
    window = probe.during(result.started, result.finished)
    failed = [c for c in probe.calls if c.error]
    slow = [c for c in window if c.seconds > PROBE_CALL_MAX]
    worst = max((c.seconds for c in window), default=0.0)
    report = (f"{attack.__name__}: {result.summary()}; probe made {len(window)} calls during the attack "
              f"({sorted({c.kind for c in window})}), slowest {worst:.2f} s, {len(failed)} failed "
              f"of {len(probe.calls)} in all")
    print(report)
    assert probe.crash is None, probe.crash
    assert not failed, report + f"; failures: {failed[:5]}"
    assert len(window) >= 6, "too few probe calls overlapped the attack: " + report
    assert {c.kind for c in window} == {"record", "list_channels", "urllib"}, report
    assert not slow, report + f"; slow calls: {slow[:5]}"
    assert_cut_off_by_header_timeout(result, len(result.conns))


# =============================================================================
# 6. A slow body; an idle keep-alive connection
# =============================================================================


def slow_body(server) -> tuple:
    """POST /api/v1/events/record announcing 1000 bytes, sending 10 and then nothing.
    Returns (Ending, seconds from the last byte sent to the end)."""
    sock = connect(server)
    try:
        sock.sendall(("POST /api/v1/events/record HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      f"x-api-key: {server.key}\r\ncontent-type: application/json\r\n"
                      "Content-Length: 1000\r\n\r\n").encode() + b'{"channel_')   # 10 of 1000 bytes
        last_byte = time.monotonic()
        ending = wait_closed(sock, last_byte + BODY_TIMEOUT + MARGIN + 2)
    finally:
        sock.close()
    return ending, ending.at - last_byte


def test_slow_body_is_cut_off_by_the_body_timeout(server):
    ending, elapsed = slow_body(server)
    report = (f"slow body: ended by {ending.end} with status {ending.status} after {elapsed:.2f} s "
              f"({ending.data[:120]!r})")
    print(report)
    assert ending.closed, "the connection stayed open: " + report
    assert ending.status in (None, 408), report
    assert BODY_TIMEOUT - EARLY <= elapsed <= BODY_TIMEOUT + MARGIN, report


@pytest.mark.parametrize("path, key", [("/api/v1/events/record", True), ("/api/v1/events/record", False),
                                       ("/healthz", False)], ids=["with-key", "no-key", "healthz"])
def test_a_dripped_body_is_cut_off_by_the_body_deadline(server, path, key):
    """One byte every 0.3 s keeps no connection: the body timeout bounds the whole body, and a
    request answered before its body arrived stops being read."""
    sock = connect(server)
    try:
        sock.sendall((f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      + (f"x-api-key: {server.key}\r\n" if key else "")
                      + "content-type: application/json\r\nContent-Length: 1000000\r\n\r\n").encode())
        started = time.monotonic()
        closed_at = None
        sock.settimeout(0.3)
        while time.monotonic() - started < BODY_TIMEOUT + MARGIN:
            try:
                sock.sendall(b" ")
                while sock.recv(65536):
                    pass
                closed_at = time.monotonic()      # recv returned b"": the server closed
                break
            except socket.timeout:
                continue
            except OSError:
                closed_at = time.monotonic()
                break
    finally:
        sock.close()
    assert closed_at is not None, f"a dripped body to {path} held the connection past the body timeout"
    assert closed_at - started <= BODY_TIMEOUT + MARGIN


def test_idle_keepalive_connection_is_closed_by_the_keepalive_timeout(server):
    sock = connect(server)
    try:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status, headers, _ = RawHTTP(sock).read_response()
        answered = time.monotonic()
        assert status == 200, status
        assert headers.get("connection", "").lower() != "close", headers
        ending = wait_closed(sock, answered + KEEPALIVE_TIMEOUT + MARGIN + 2)
    finally:
        sock.close()
    elapsed = ending.at - answered
    report = f"idle keep-alive: ended by {ending.end} after {elapsed:.2f} s ({ending.data[:120]!r})"
    print(report)
    assert ending.closed, "the idle connection stayed open: " + report
    assert ending.data == b"", "the server sent something on an idle connection: " + report
    assert KEEPALIVE_TIMEOUT - EARLY <= elapsed <= KEEPALIVE_TIMEOUT + MARGIN, report


def test_slow_second_request_on_keepalive_is_cut_off_by_the_header_timeout(server):
    """The header timeout runs "from the first byte of the next request" on a kept-alive connection."""
    sock = connect(server)
    try:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert RawHTTP(sock).read_response()[0] == 200
        time.sleep(1.0)   # time must pass: idle, but well inside the keep-alive timeout
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        first_byte = time.monotonic()
        drips, ending = 0, None
        while time.monotonic() < first_byte + HEADER_TIMEOUT + MARGIN + 1:
            if readable(sock, 0.5):
                break
            try:
                sock.sendall(SLOW_HEADER[drips:drips + 1])
                drips += 1
            except (ConnectionResetError, BrokenPipeError):
                ending = Ending("reset", time.monotonic())
                break
        ending = ending or wait_closed(sock, time.monotonic() + 1.0)
    finally:
        sock.close()
    elapsed = ending.at - first_byte
    report = (f"slow second request: {drips} bytes dripped, ended by {ending.end} with status "
              f"{ending.status} {elapsed:.2f} s after its first byte")
    print(report)
    assert ending.closed, "the connection stayed open: " + report
    assert ending.status in (None, 408), report
    assert HEADER_TIMEOUT - EARLY <= elapsed <= HEADER_TIMEOUT + MARGIN, report


def test_body_timeout_is_not_logged_as_an_unhandled_error(server):
    """A client that stalls (or drops) mid-body is not a bug: no "unhandled error" traceback per
    connection (contract, Errors: only an unexpected exception is logged), or any client floods the log."""
    before = len(server.lines)
    ending, _ = slow_body(server)
    assert ending.closed
    # Time must pass: a traceback would reach `server.lines` through the thread draining the
    # server's output, and the server writes nothing that would mark "no traceback came".
    time.sleep(0.5)
    logged = server.lines[before:]
    assert not [line for line in logged if "unhandled error" in line or "Traceback" in line], (
        "a body timeout was logged as an unhandled error:\n" + "\n".join(logged[:20]))


# =============================================================================
# 7. The header count cap (at most 100) and the size cap from below
# =============================================================================


def request_with_headers(server, total: int, *, pad: int = 0) -> bytes:
    """GET /api/v1/channels carrying exactly `total` header lines (Host and x-api-key included)."""
    lines = ["GET /api/v1/channels HTTP/1.1", "Host: 127.0.0.1", f"x-api-key: {server.key}"]
    lines += [f"X-H-{i}: v{i}" for i in range(total - 2)]
    if pad:
        lines[-1] += "p" * pad
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@pytest.mark.parametrize("total,served", [(50, True), (100, True), (101, False)])
def test_header_count_cap(server, total, served):
    sock = connect(server)
    try:
        sock.sendall(request_with_headers(server, total))
        status, headers, body = RawHTTP(sock).read_response()
        after = time.monotonic()
        if served:
            assert status == 200, (status, body[:200])
            assert headers.get("content-type", "").startswith("application/json"), headers
            # still a working keep-alive connection: a second request on it is served
            sock.sendall(request_with_headers(server, total))
            assert RawHTTP(sock).read_response()[0] == 200
        else:
            assert status in (431, 400), (status, body[:200])
            ending = wait_closed(sock, after + 1.5)   # "431 and close": not at the keep-alive timeout
            assert ending.closed, f"no close within 1.5 s after the {status}"
    finally:
        sock.close()


def test_header_block_just_under_the_size_cap_is_served(server):
    """The 64 KiB cap refuses the attacks above, not normal large headers: ~62 KiB is served."""
    raw = request_with_headers(server, 10, pad=MAX_HEADER_BYTES - 3 * 1024)
    assert len(raw) < MAX_HEADER_BYTES
    sock = connect(server)
    try:
        sock.sendall(raw)
        status, _, body = RawHTTP(sock).read_response()
    finally:
        sock.close()
    assert status == 200, (status, body[:200])


# =============================================================================
# Errors: a refusal on an API route is the JSON error body (contract, "Errors")
# =============================================================================


def refusal_431_size(server):
    return request_with_headers(server, 3, pad=MAX_HEADER_BYTES)


def refusal_431_count(server):
    return request_with_headers(server, 101)


@pytest.mark.parametrize("make,expected", [(refusal_431_size, 431), (refusal_431_count, 431), (None, 408)],
                         ids=["431-header-bytes", "431-header-count", "408-body-timeout"])
def test_connection_refusals_on_api_routes_carry_the_json_error_body(server, make, expected):
    """"Every API error is {"status": "<code>", "error": "<message>"} with content-type:
    application/json and the right HTTP status (... 431 headers too large)"."""
    if make is None:
        ending, _ = slow_body(server)
    else:
        sock = connect(server)
        try:
            sock.sendall(make(server))
            ending = wait_closed(sock, time.monotonic() + HEADER_TIMEOUT + MARGIN)
        finally:
            sock.close()
    assert ending.status == expected, ending.data[:300]
    head, _, body = ending.data.partition(b"\r\n\r\n")
    headers = dict(parse_head(head)[2])
    assert headers.get("content-type", "").startswith("application/json"), (
        f"{expected} on an API route without the JSON error body: {ending.data[:300]!r}")
    parsed = json.loads(body)
    assert isinstance(parsed.get("status"), str) and parsed["status"], parsed
    assert isinstance(parsed.get("error"), str) and parsed["error"].strip(), parsed
