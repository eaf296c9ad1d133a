"""Trust by construction: imported and stored values, and the streams.

 3. An import checks every field as the record path does: a created_at that is not a real instant
    ("2026-02-30T25:61:61.999Z"), payload text that is not canonical JSON, or a bare-string payload
    over 1 MiB is refused with 400 naming the line, and nothing is written. A stored timestamp that
    does not parse (a row edited in the database) never breaks the runs list, its failed filter, the
    run page, diff, compare or savings: they answer 200.
 4. Deleting a key, or `actae key rotate`, ends that credential's open /ws subscriptions (per channel
    and "*") within about a second: an error frame with status "unauthorized", then close code 1008
    with a reason. The fleet NDJSON stream of a revoked organisation token, or of an expired fleet
    token, ends with a {"type": "error"} line.
 5. Stalled "*" subscribers (and a stalled per-channel one) do not make the server hold a copy of
    every frame each: its VmRSS grows far less than subscribers x bytes written, and each stalled
    socket is closed with 1013 once its unsent frames pass WS_BACKLOG_BYTES (8 MiB).
 9. (PostgreSQL) After the PostgreSQL server restarts, the first write succeeds, and the /ws "*"
    subscription and the fleet NDJSON "*" stream deliver every event written after it from their
    position, or end with an error the client resumes from (and the resumed stream has them all).
    The restart is of a private cluster the test makes (initdb, pg_ctl), never of the cluster the
    rest of the session runs on: restarting that one would cut the connections of the session's
    shared server, which later modules still use.

Every test starts servers of its own: a damaged or rotated server is never the shared one.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest
import websockets
from websockets.asyncio.client import connect as ws_connect

from conftest import (BACKEND, ServerProcess, api, cli, get_json, http, login, org_token, poll, port_of,
                      query_database, run)

ORG = "local"
NDJSON = "application/x-ndjson"
READ_SCOPES = ["events:read", "state:read", "channels:read", "payloads:read"]
IMPOSSIBLE_INSTANT = "2026-02-30T25:61:61.999Z"
MIB = 1024 * 1024
REVOKED_WITHIN = 2.5          # the server checks each half second; this leaves a loaded machine room
WS_BACKLOG_BYTES = 8 * MIB    # actae.WS_BACKLOG_BYTES, a subscriber's bound


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

def record(srv, channel, payload=None, *, key=None, event_type="step", **fields):
    """POST /api/v1/events/record; the stored event (the answer must be a 200)."""
    body = {"channel_id": channel, "event_type": event_type, "payload": {} if payload is None else payload, **fields}
    status, _, answer = http("POST", srv.url + "/api/v1/events/record", key=key or srv.key, body=body, timeout=60)
    assert status == 200, (status, answer)
    return answer["event"]


def new_key(srv, name, **scopes) -> tuple[int, str]:
    """POST /api/v1/keys with the admin key: (id, key)."""
    status, _, answer = api(srv, "POST", "/api/v1/keys", body={"name": name, "scopes": scopes})
    assert status == 200, answer
    return answer["id"], answer["key"]


def fleet_token(srv, organisation_token) -> str:
    """An organisation token exchanged for a fleet token on `srv`."""
    status, _, answer = http("POST", srv.url + "/api/v1/fleet/token",
                             headers={"authorization": f"Bearer {organisation_token}"},
                             body={"purpose": "fleet_access", "organization_id": ORG, "scopes": READ_SCOPES})
    assert status == 200, answer
    return answer["token"]


def vm_rss_bytes(pid) -> int:
    """The process's resident set (VmRSS in /proc/<pid>/status), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


# --- WebSocket ------------------------------------------------------------------------------

def ws_url(srv) -> str:
    return srv.url.replace("http://", "ws://", 1) + "/ws"


async def next_frame(ws, timeout=10.0) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def ws_open(srv, key, **options):
    """An authenticated /ws connection with `key` (the SDK's handshake: connected, auth, authenticated)."""
    options = {"open_timeout": 10, "max_size": None, "compression": None, "ping_interval": None, **options}
    ws = await ws_connect(ws_url(srv), **options)
    assert (await next_frame(ws)).get("event") == "connected"
    await ws.send(json.dumps({"type": "auth", "api_key": key}))
    authed = await next_frame(ws)
    assert authed.get("event") == "authenticated", authed
    return ws


async def subscribe(ws, topic, cursor=None) -> dict:
    """Subscribe (from now, or after `cursor`); the confirmation frame."""
    await ws.send(json.dumps({"type": "subscribe", "topic": topic, "cursor": cursor, "request_id": f"sub-{topic}"}))
    frame = await next_frame(ws)
    assert frame.get("event") == "subscribed" and frame.get("topic") == topic, frame
    return frame


async def broadcasts_until(ws, predicate, timeout=10.0) -> list:
    """Frames until one `predicate` accepts (that one included); AssertionError on a timeout or a close."""
    frames, deadline = [], time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            frame = await next_frame(ws, max(left, 0.01))
        except TimeoutError:
            raise AssertionError(f"no matching frame within {timeout} s; had {summary(frames)}") from None
        except websockets.ConnectionClosed as exc:
            raise AssertionError(f"the socket closed ({exc}) before a matching frame; had {summary(frames)}") from None
        frames.append(frame)
        if predicate(frame):
            return frames


async def until_closed(ws, timeout) -> tuple:
    """Read every frame until the server closes the socket: (frames, close code, close reason, seconds
    it took). AssertionError when it is still open after `timeout` s."""
    frames, started = [], time.monotonic()
    while True:
        left = started + timeout - time.monotonic()
        try:
            frames.append(json.loads(await asyncio.wait_for(ws.recv(), max(left, 0.01))))
        except TimeoutError:
            raise AssertionError(f"the socket was still open {timeout} s later; it sent {summary(frames)}") from None
        except websockets.ConnectionClosed as exc:
            code, reason = (exc.rcvd.code, exc.rcvd.reason) if exc.rcvd is not None else (None, None)
            return frames, code, reason, time.monotonic() - started


def summary(frames) -> list:
    """Frames as a failure message shows them: type, status/event, position, never a 1 MiB payload."""
    return [{k: frame.get(k) for k in ("type", "event", "status", "message", "position", "topic") if k in frame}
            for frame in frames[-20:]]


def event_of(frame) -> dict | None:
    """The event a broadcast frame carries (None for any other frame)."""
    if frame.get("type") != "broadcast":
        return None
    return frame["payload"]["event"]


def assert_ended_as_revoked(frames, code, reason, took, what):
    assert took < REVOKED_WITHIN, f"{what}: closed only after {took:.2f} s"
    errors = [f for f in frames if f.get("type") == "error"]
    assert errors, f"{what}: closed without an error frame; frames: {summary(frames)}"
    assert errors[-1].get("status") == "unauthorized" and errors[-1].get("message"), errors[-1]
    assert frames[-1] is errors[-1], f"{what}: frames after the error: {summary(frames)}"
    assert code == 1008, f"{what}: closed with code {code} ({reason!r}), not 1008"
    assert reason, f"{what}: the 1008 close carries no reason"


# --- the fleet NDJSON stream -------------------------------------------------------------------

class NdjsonStream:
    """GET /api/v1/fleet/stream read on a task: `.lines` (parsed), `.ended` once the server ends it."""

    def __init__(self, srv, token, **params):
        self.url, self.token, self.params = srv.url + "/api/v1/fleet/stream", token, params
        self.lines: list = []
        self.status = None
        self.ended = asyncio.Event()
        self.opened = asyncio.Event()
        self.task = None

    async def __aenter__(self):
        self.task = asyncio.create_task(self._read())
        await asyncio.wait_for(self.opened.wait(), 15)
        assert self.status == 200, f"the stream answered {self.status}: {self.lines}"
        return self

    async def _read(self):
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=None)) as client:
                async with client.stream("GET", self.url, params=self.params,
                                         headers={"authorization": f"Bearer {self.token}"}) as response:
                    self.status = response.status_code
                    self.opened.set()
                    async for line in response.aiter_lines():
                        if line.strip():
                            self.lines.append(json.loads(line))
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            self.lines.append({"type": "client-side failure", "error": repr(exc)})
        finally:
            self.opened.set()
            self.ended.set()

    async def __aexit__(self, *exc):
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    def events(self) -> list:
        return [line for line in self.lines if "id" in line and "channel_id" in line]

    async def until(self, predicate, timeout, what):
        async def seen():
            return any(predicate(line) for line in self.lines) or self.ended.is_set()
        await poll(seen, timeout, what=what)
        assert any(predicate(line) for line in self.lines), f"{what}: the stream ended first; lines {self.lines[-10:]}"


# --------------------------------------------------------------------------------------------
# 3. Import checks every field as the record path does; damaged stored values never break a page
# --------------------------------------------------------------------------------------------

def chain_hash(previous: str, event: dict) -> str:
    """docs/guarantees.md's chain step over an export line, with its payload and metadata texts as they
    stand in the file (for canonical texts this is exactly the documented formula)."""
    scalar = lambda value: json.dumps(value, ensure_ascii=False)
    fields = {"actor": scalar(event["actor"]), "agent_id": scalar(event["agent_id"]),
              "channel_id": scalar(event["channel_id"]), "cursor": str(event["cursor"]),
              "depends_on": scalar(event["depends_on"]), "id": scalar(event["id"]),
              "metadata": event["metadata"] or "null", "payload": event["payload"] or "null",
              "step_number": scalar(event["step_number"]), "timestamp": scalar(event["created_at"]),
              "type": scalar(event["type"]), "user_id": scalar(event["user_id"])}
    text = "{" + ",".join(f'"{name}":{value}' for name, value in fields.items()) + "}"
    return hashlib.sha256(previous.encode("ascii") + text.encode("utf-8")).hexdigest()


def one_event_file(srv, channel, **event_fields) -> tuple[bytes, int]:
    """A valid, re-chained export file of a one-event run `channel` (the file of a run recorded on `srv`
    under another name, moved to `channel` with a fresh event id), with `event_fields` set on the event
    line: (the file, the event's line number)."""
    source = f"{channel}-src"
    record(srv, source, {"n": 1})
    status, _, data = api(srv, "GET", f"/api/v1/channels/{source}/export", decode=False)
    assert status == 200, data[:300]
    header, *rows = [json.loads(line) for line in data.decode().splitlines()]
    assert [row["kind"] for row in rows] == ["channel", "event"], rows
    run_row, event = rows
    assert chain_hash("0" * 64, event) == event["chain_hash"], "the test's chain step is not the server's"
    header.update(channel_id=channel, channels=[channel])
    run_row.update(id=channel, origin_id=channel)
    event.update(channel_id=channel, id=str(uuid.uuid4()), operation_id=None, **event_fields)
    event["chain_hash"] = run_row["chain_head"] = chain_hash("0" * 64, event)
    lines = [header, run_row, event]
    return b"".join(json.dumps(line, ensure_ascii=False).encode() + b"\n" for line in lines), 3


def import_file(srv, data) -> tuple:
    status, _, answer = api(srv, "POST", "/api/v1/import", raw=data, headers={"content-type": NDJSON})
    return status, answer


def names_line(message: str, number: int) -> bool:
    return f"line {number}:" in message or f"line {number} " in message or message.endswith(f"line {number}")


@pytest.fixture(scope="module")
def importer(tmp_path_factory):
    """A server of this module's own, to import into."""
    with ServerProcess(tmp_path_factory.mktemp("trust-import")).start() as srv:
        yield srv


def test_the_re_chained_one_event_file_itself_imports(importer):
    """The control for the test below: the file it spoils one field of imports as it is."""
    channel = f"imp-control-{uuid.uuid4().hex[:6]}"
    data, _ = one_event_file(importer, channel)
    status, answer = import_file(importer, data)
    assert status == 200 and answer["imported"] == [channel], answer
    assert get_json(importer, f"/api/v1/events/verify/{channel}")["ok"] is True


BAD_EVENT_LINES = {
    "created_at-not-a-real-instant": lambda: {"created_at": IMPOSSIBLE_INSTANT},
    "payload-text-not-canonical": lambda: {"payload": '{"n": 1,  "a": 2}'},
    "bare-string-payload-over-1-mib": lambda: {"payload": json.dumps("x" * (MIB + 16))},
}


@pytest.mark.parametrize("spoil", list(BAD_EVENT_LINES), ids=list(BAD_EVENT_LINES))
def test_an_import_line_the_record_path_would_refuse_is_refused_naming_its_line(importer, spoil):
    channel = f"imp-{spoil[:12]}-{uuid.uuid4().hex[:6]}"
    data, number = one_event_file(importer, channel, **BAD_EVENT_LINES[spoil]())

    status, answer = import_file(importer, data)

    assert status in ((400, 413) if "1-mib" in spoil else (400,)), (status, answer)
    assert set(answer) == {"status", "error"}, answer
    assert names_line(answer["error"], number), f"the error does not name line {number}: {answer['error']}"
    assert api(importer, "GET", f"/api/v1/channels/{channel}/metadata")[0] == 404, "something was imported"
    web = login(importer)
    try:
        assert web.get("/").status_code == 200
    finally:
        web.close()


DAMAGES = {
    # (SQL on the damaged runs' rows, with ? for each of the two run ids)
    "event-created_at": "UPDATE events SET created_at = 'garbage' WHERE channel_id IN (?, ?)",
    "channel-timestamps": "UPDATE channels SET created_at = 'garbage', updated_at = 'garbage' WHERE id IN (?, ?)",
}


@pytest.mark.parametrize("damage", list(DAMAGES), ids=list(DAMAGES))
def test_a_damaged_stored_timestamp_never_breaks_the_runs_list_run_page_diff_compare_or_savings(tmp_path, damage):
    with ServerProcess(tmp_path / "data").start() as srv:
        root, fork, other = "dmg-root", "dmg-fork", "dmg-other"
        for channel in (root, other):
            record(srv, channel, {"n": 1}, step_number=1, metadata={"usage": {"input_tokens": 10, "output_tokens": 2}})
            record(srv, channel, {"n": 2}, step_number=2, metadata={"usage": {"input_tokens": 10, "output_tokens": 2}})
        status, _, answer = api(srv, "POST", f"/api/v1/state/{root}", body={"cursor": 1, "state": {"status": "running"}})
        assert status == 200, answer
        status, _, answer = api(srv, "POST", "/api/v1/channels/fork",
                                body={"source_channel_id": root, "new_channel_id": fork, "at_cursor": 1})
        assert status == 200, answer
        record(srv, fork, {"n": 3}, step_number=2, metadata={"usage": {"input_tokens": 7, "output_tokens": 1}})
        record(srv, fork, {"error": "the tool failed"}, event_type="error")      # a failed run for ?status=failed
        record(srv, root, {"error": "the tool failed"}, event_type="error")

        query_database(srv, DAMAGES[damage], [root, fork])

        web = login(srv)
        try:
            for path in ("/", "/?status=failed", f"/runs/{root}", f"/runs/{fork}",
                         f"/diff?left={root}&right={fork}"):
                response = web.get(path)
                assert response.status_code == 200, (path, response.status_code, response.text[:300])
                if path in ("/", "/?status=failed"):
                    assert fork in response.text and root in response.text, f"{path} no longer lists the damaged runs"
        finally:
            web.close()
        for path in (f"/api/v1/channels/{root}/savings", f"/api/v1/channels/{fork}/savings",
                     f"/api/v1/channels/diff?left={root}&right={fork}",
                     f"/api/v1/channels/compare?left={root}&right={fork}",
                     f"/api/v1/channels/compare?left={other}&right={fork}"):
            status, _, answer = api(srv, "GET", path)
            assert status == 200, (path, status, answer)


# --------------------------------------------------------------------------------------------
# 4. Revoking a credential ends its open streams
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def revoker(tmp_path_factory):
    """A server of this module's own for the key and token revocations."""
    with ServerProcess(tmp_path_factory.mktemp("trust-revoke")).start() as srv:
        yield srv


def test_deleting_a_key_ends_its_ws_subscriptions_with_an_error_frame_and_close_1008(revoker):
    prefix = f"rv{uuid.uuid4().hex[:6]}"
    channel = f"{prefix}-run"
    key_id, key = new_key(revoker, f"{prefix}-key", read=[f"{prefix}*"], write=[f"{prefix}*"])
    record(revoker, channel, {"n": 1})

    async def scenario():
        one, every = await ws_open(revoker, key), await ws_open(revoker, key)
        try:
            await subscribe(one, channel)
            await subscribe(every, "*")
            live = record(revoker, channel, {"n": 2})          # both are live before the key goes
            for ws in (one, every):
                await broadcasts_until(ws, lambda f: (event_of(f) or {}).get("id") == live["id"])
            status, _, answer = await asyncio.to_thread(api, revoker, "DELETE", f"/api/v1/keys/{key_id}")
            assert status == 200 and answer["revoked_at"], answer
            return await asyncio.gather(until_closed(one, REVOKED_WITHIN + 2), until_closed(every, REVOKED_WITHIN + 2))
        finally:
            await asyncio.gather(one.close(), every.close(), return_exceptions=True)

    (one_frames, *one_close), (every_frames, *every_close) = run(scenario())
    assert_ended_as_revoked(one_frames, *one_close, what=f"the subscription to {channel}")
    assert_ended_as_revoked(every_frames, *every_close, what='the subscription to "*"')


def test_key_rotate_ends_the_old_admin_keys_ws_subscriptions_with_close_1008(tmp_path):
    with ServerProcess(tmp_path / "data").start() as srv:
        channel = "rotate-run"
        record(srv, channel, {"n": 1})

        async def scenario():
            one, every = await ws_open(srv, srv.key), await ws_open(srv, srv.key)
            try:
                await subscribe(one, channel)
                await subscribe(every, "*")
                live = record(srv, channel, {"n": 2})
                for ws in (one, every):
                    await broadcasts_until(ws, lambda f: (event_of(f) or {}).get("id") == live["id"])
                rotated = await asyncio.to_thread(cli, "key", "rotate", data_dir=srv)    # another process
                new = next(word for word in rotated.stdout.split() if word.startswith("sk-"))
                return new, await asyncio.gather(until_closed(one, REVOKED_WITHIN + 2),
                                                 until_closed(every, REVOKED_WITHIN + 2))
            finally:
                await asyncio.gather(one.close(), every.close(), return_exceptions=True)

        new, ((one_frames, *one_close), (every_frames, *every_close)) = run(scenario())
        assert_ended_as_revoked(one_frames, *one_close, what=f"the old admin key's subscription to {channel}")
        assert_ended_as_revoked(every_frames, *every_close, what='the old admin key\'s subscription to "*"')
        assert http("GET", srv.url + "/api/v1/channels", key=new)[0] == 200      # the new key works


def assert_stream_ended_with_an_error(stream, ended, took, what):
    assert ended, f"{what}: the stream was still open {took:.1f} s later; lines {summary(stream.lines)}"
    assert stream.lines and stream.lines[-1].get("type") == "error", \
        f"{what}: the stream's last line is not an error line: {stream.lines[-3:]}"


def test_revoking_an_org_token_ends_its_fleet_ndjson_stream_with_an_error_line(revoker):
    channel = f"ndj-{uuid.uuid4().hex[:6]}"
    token_id, organisation = org_token(revoker, "--read", "*")
    token = fleet_token(revoker, organisation)

    async def scenario():
        async with NdjsonStream(revoker, token) as stream:
            live = await asyncio.to_thread(record, revoker, channel, {"n": 1})
            await stream.until(lambda line: line.get("id") == live["id"], 10, "the stream to deliver a live event")
            await asyncio.to_thread(cli, "org-token", "revoke", str(token_id), data_dir=revoker)   # another process
            started = time.monotonic()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stream.ended.wait(), REVOKED_WITHIN)
            return stream, stream.ended.is_set(), time.monotonic() - started

    stream, ended, took = run(scenario())
    assert_stream_ended_with_an_error(stream, ended, took, "a revoked organisation token's NDJSON stream")


def test_an_expired_fleet_tokens_ndjson_stream_ends_with_an_error_line(tmp_path):
    ttl = 2
    with ServerProcess(tmp_path / "data", args=["--fleet-token-ttl", str(ttl)]).start() as srv:
        _, organisation = org_token(srv, "--read", "*")

        async def scenario():
            token = fleet_token(srv, organisation)
            expires = time.monotonic() + ttl
            async with NdjsonStream(srv, token) as stream:
                live = await asyncio.to_thread(record, srv, "expiring", {"n": 1})
                await stream.until(lambda line: line.get("id") == live["id"], 10, "the stream to deliver a live event")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stream.ended.wait(), expires + REVOKED_WITHIN - time.monotonic())
                return stream, stream.ended.is_set(), time.monotonic() - expires

        stream, ended, took = run(scenario())
        assert_stream_ended_with_an_error(stream, ended, took, "an expired fleet token's NDJSON stream (after it expired)")


# --------------------------------------------------------------------------------------------
# 5. Stalled subscribers: memory bounded in bytes, cut off with 1013
# --------------------------------------------------------------------------------------------

STALLED_ALL = 6                # "*" subscribers that never read
WRITTEN_EVENTS = 40            # of ~1 MiB each: 40 MiB written
BLOB_BYTES = 750_000           # random bytes per payload: 1,000,000 characters of base64, under the 1 MiB cap


async def stalled_subscriber(srv, topic):
    """A subscription whose client stops reading: a 16 KiB receive buffer, and the client library
    stops taking frames off the socket once one waits unread."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)      # before connect: the window it offers
    sock.connect(("127.0.0.1", port_of(srv)))
    ws = await ws_open(srv, srv.key, sock=sock, max_queue=1)
    await subscribe(ws, topic)
    return ws


def test_stalled_subscribers_are_cut_off_with_1013_and_memory_does_not_grow_per_subscriber(tmp_path):
    with ServerProcess(tmp_path / "data").start() as srv:
        channel = "flood"
        record(srv, channel, {"n": 0})

        async def scenario():
            sockets = [await stalled_subscriber(srv, "*") for _ in range(STALLED_ALL)]
            sockets.append(await stalled_subscriber(srv, channel))
            try:
                before = vm_rss_bytes(srv.proc.pid)
                written = 0
                for n in range(WRITTEN_EVENTS):
                    blob = base64.b64encode(os.urandom(BLOB_BYTES)).decode()
                    await asyncio.to_thread(record, srv, channel, {"n": n, "blob": blob})
                    written += len(blob)
                # No state of the server's to poll: a second for the readers of every channel to catch up
                # (today: fill their queues) and for the cut-offs to let their backlogs go.
                await asyncio.sleep(1.0)
                grown = vm_rss_bytes(srv.proc.pid) - before
                closes = await asyncio.gather(*(until_closed(ws, 15) for ws in sockets), return_exceptions=True)
                return written, grown, closes
            finally:
                await asyncio.gather(*(ws.close() for ws in sockets), return_exceptions=True)

        started = time.monotonic()
        written, grown, closes = run(scenario())
        took = time.monotonic() - started

    assert written > 3 * WS_BACKLOG_BYTES, "the flood must pass the backlog bound, kernel buffers aside"
    # Today each "*" subscriber holds its own decoded copy of every frame: growth ~ subscribers x written
    # (~270 MiB here). One shared encoded copy, each backlog cut at 8 MiB: ~50 MiB, whatever the count.
    assert grown < STALLED_ALL * written / 2, (
        f"the server's RSS grew by {grown / MIB:.0f} MiB with {STALLED_ALL} stalled \"*\" subscribers after "
        f"{written / MIB:.0f} MiB written ({STALLED_ALL} x written = {STALLED_ALL * written / MIB:.0f} MiB)")
    for n, closed in enumerate(closes):
        what = f"stalled subscriber {n} ({'*' if n < STALLED_ALL else channel})"
        assert not isinstance(closed, BaseException), f"{what}: {closed}"
        frames, code, reason, _ = closed
        delivered = sum(len(json.dumps(f)) for f in frames)
        assert code == 1013, f"{what}: closed with {code} ({reason!r}) after {delivered / MIB:.1f} MiB, not 1013"
        assert delivered < written, f"{what}: it was sent everything ({delivered / MIB:.1f} MiB) and still cut"
    assert took < 60, f"the flood took {took:.0f} s"


# --------------------------------------------------------------------------------------------
# 9. (PostgreSQL) Streams and writes across a restart of the PostgreSQL server
# --------------------------------------------------------------------------------------------

def postgres_bindir() -> Path | None:
    """The PostgreSQL server programs (initdb, pg_ctl): $PG_CONFIG's bindir, `pg_config`'s, or Debian's newest."""
    for pg_config in filter(None, (os.environ.get("PG_CONFIG"), shutil.which("pg_config"))):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            found = Path(subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=10,
                                        check=True).stdout.strip())
            if (found / "initdb").exists() and (found / "pg_ctl").exists():
                return found
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3])
                      if p.parts[-3].isdigit() else 0)
    return versions[-1].parent if versions else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateCluster:
    """A throwaway PostgreSQL cluster for one test, on 127.0.0.1:<free port>, trust auth, no fsync.

    Run as the current user, or as root as `postgres` (initdb refuses root). `restart()` is
    `pg_ctl restart -m fast`: every connection is cut and the server comes back on the same port."""

    def __init__(self, bindir: Path):
        self.bindir = bindir
        self.as_owner = []
        if os.geteuid() == 0:
            if not shutil.which("runuser"):
                pytest.skip("running as root, and no runuser to run PostgreSQL as postgres")
            self.as_owner = ["runuser", "-u", "postgres", "--"]
        self.root = Path(tempfile.mkdtemp(prefix="actae-pg-restart-"))    # not under pytest's 0700 root dir
        if self.as_owner:
            shutil.chown(self.root, "postgres", "postgres")
        self.data, self.log = self.root / "data", self.root / "server.log"
        self.port = free_port()
        self.started = False

    def _run(self, program, *args, timeout=60):
        done = subprocess.run([*self.as_owner, str(self.bindir / program), *args], capture_output=True, text=True,
                              timeout=timeout, cwd=str(self.root), check=False)
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{program} {' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}\n{log}")
        return done

    def start(self) -> PrivateCluster:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root}"
                   " -c fsync=off -c synchronous_commit=off -c full_page_writes=off")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start")
        self.started = True
        return self

    def url(self, database="postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name) -> str:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{name}" ENCODING \'UTF8\' TEMPLATE template0')
        return self.url(name)

    def restart(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-m", "fast", "-w", "-t", "60", "restart")

    def stop(self) -> None:
        if self.started:
            with contextlib.suppress(Exception):
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def restartable_postgres():
    """A private PostgreSQL cluster this test may restart (the session's own cluster serves other
    tests' servers, whose connections a restart would cut)."""
    if BACKEND != "postgresql":
        pytest.skip("a PostgreSQL restart: needs ACTAE_TEST_DATABASE_URL")
    bindir = postgres_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server programs (initdb, pg_ctl) to make a cluster this test may restart")
    cluster = PrivateCluster(bindir)
    try:
        try:
            cluster.start()
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            pytest.skip(f"cannot make a PostgreSQL cluster this test may restart: {exc}")
        yield cluster
    finally:
        cluster.stop()


async def ws_events_after(srv, position, ids, timeout=15.0) -> list:
    """A fresh "*" subscription resumed after `position`: the events it delivers until every id in `ids` came."""
    ws = await ws_open(srv, srv.key)
    try:
        await subscribe(ws, "*", cursor=position)
        got = []

        def complete(frame):
            if event_of(frame):
                got.append(event_of(frame)["id"])
            return set(ids) <= set(got)
        await broadcasts_until(ws, complete, timeout)
        return got
    finally:
        await ws.close()


def test_streams_go_on_across_a_postgresql_restart_and_the_first_write_after_it_succeeds(tmp_path,
                                                                                        restartable_postgres):
    cluster = restartable_postgres
    with ServerProcess(tmp_path / "data", database=cluster.create_database("actae_restart")).start() as srv:
        _, organisation = org_token(srv, "--read", "*")
        token = fleet_token(srv, organisation)

        async def scenario():
            ws = await ws_open(srv, srv.key)
            try:
                async with NdjsonStream(srv, token) as stream:
                    await subscribe(ws, "*")
                    before = await asyncio.to_thread(record, srv, "pg-a", {"n": 0})
                    frames = await broadcasts_until(ws, lambda f: (event_of(f) or {}).get("id") == before["id"])
                    ws_position = frames[-1]["position"]
                    await stream.until(lambda line: line.get("id") == before["id"], 10, "the NDJSON stream to go live")
                    ndjson_position = stream.events()[-1]["position"]
                    ndjson_seen = len(stream.lines)

                    await asyncio.to_thread(cluster.restart)

                    first = await asyncio.to_thread(http, "POST", srv.url + "/api/v1/events/record", key=srv.key,
                                                    body={"channel_id": "pg-a", "event_type": "step", "payload": {"n": 1}})
                    after = [first[2]["event"]] if first[0] == 200 else []
                    for n, channel in enumerate(("pg-b", "pg-a", "pg-c"), start=2):
                        after.append(await asyncio.to_thread(record, srv, channel, {"n": n}))
                    ids = [event["id"] for event in after]

                    ws_result = await outcome_of(ws_outcome(srv, ws, ws_position, ids))
                    ndjson_result = await outcome_of(ndjson_outcome(srv, token, stream, ndjson_seen, ndjson_position, ids))
                    return first, ids, ws_result, ndjson_result
            finally:
                await ws.close()

        first, ids, ws_result, ndjson_result = run(scenario())

    assert first[0] in (200, 201), f"the first write after the restart answered {first[0]}: {first[2]}"
    ws_how, ws_ids = ws_result
    assert ws_ids == ids, f'/ws "*" ({ws_how}) delivered {ws_ids}, not the events written after the restart {ids}'
    ndjson_how, ndjson_ids = ndjson_result
    assert ndjson_ids == ids, f"the NDJSON stream ({ndjson_how}) delivered {ndjson_ids}, not {ids}"


async def outcome_of(check) -> tuple:
    """(how the stream came through, the ids it delivered), or (the failure, None) when the check failed."""
    try:
        return await check
    except AssertionError as exc:
        return str(exc), None


async def ws_outcome(srv, ws, position, ids) -> tuple:
    """How the open "*" subscription came through the restart: ("live", the ids it delivered after
    `position`), or ("resumed", the ids a fresh subscription after its last position delivered) when it
    closed with an error frame. Either way the ids must be exactly `ids`, in order."""
    frames, wanted = [], set(ids)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            frame = await next_frame(ws, max(deadline - time.monotonic(), 0.01))
        except TimeoutError:
            break
        except websockets.ConnectionClosed:
            errors = [f for f in frames if f.get("type") == "error"]
            assert errors, f'/ws "*" closed across the restart without an error frame; frames {summary(frames)}'
            positions = [f["position"] for f in frames if event_of(f)]
            last = positions[-1] if positions else position
            before = [event_of(f)["id"] for f in frames if event_of(f)]
            return "closed with an error, then resumed", before + await ws_events_after(srv, last, set(ids) - set(before))
        frames.append(frame)
        if wanted <= {event_of(f)["id"] for f in frames if event_of(f)}:
            break
        assert frame.get("type") in ("broadcast", "error"), frame
    if any(f.get("type") == "error" for f in frames):
        raise AssertionError(f'/ws "*" sent an error frame across the restart but stayed open: {summary(frames)}')
    return "live", [event_of(f)["id"] for f in frames if event_of(f)]


async def ndjson_outcome(srv, token, stream, seen, position, ids) -> tuple:
    """The NDJSON stream's twin of ws_outcome: its lines after the first `seen`, or when it ended with an
    error line, those and what a stream resumed from its last position (`cursor`) delivers."""
    wanted = set(ids)

    async def settled():
        got = {line.get("id") for line in stream.lines[seen:]}
        return wanted <= got or stream.ended.is_set()
    with contextlib.suppress(AssertionError):
        await poll(settled, 15)
    lines = stream.lines[seen:]
    delivered = [line["id"] for line in lines if "id" in line and "channel_id" in line]
    if not stream.ended.is_set():
        return "live", delivered
    assert lines and lines[-1].get("type") == "error", \
        f"the NDJSON stream ended across the restart without an error line: {lines[-3:]}"
    positions = [line["position"] for line in lines if "position" in line]
    last = positions[-1] if positions else position
    async with NdjsonStream(srv, token, cursor=last) as resumed:
        missing = wanted - set(delivered)

        async def complete():
            return missing <= {line.get("id") for line in resumed.lines} or resumed.ended.is_set()
        await poll(complete, 15, what="the resumed NDJSON stream to deliver the events written after the restart")
        return "ended with an error, then resumed", delivered + [line["id"] for line in resumed.events()]
