"""Servers sharing one PostgreSQL database write to different channels at once, and one channel's
writes stay serial and gapless.

Two `actae.py --database <url>` processes share one fresh database (and one data directory).
What is checked, with raw HTTP and raw WebSocket, each call sent to a chosen server:

 1. A write to channel A through server 1, held up by a lock the test takes on A's row in table
    `channels` (SELECT ... FOR UPDATE, in a transaction of its own), does not hold up a write to
    channel B through server 2: B's answer comes while A's transaction is still waiting in the
    database; once the test lets go of the row, A's write completes with the next cursor. (With
    one lock for every write transaction, B's write waits behind A's, which holds that lock.)
 2. Many concurrent writers over both servers, all on one channel (and a few on other channels at
    the same time): every answer a 200, cursors 1..N without a gap or a duplicate, the log read
    back the same through each server, every chain hash as answered, and the chain verifying.
 3. A subscriber to every channel (/ws topic "*") on server 1, while both servers write to several
    channels: every event exactly once, each channel's in cursor order, positions strictly
    increasing; a second subscription resuming from a position in the middle gets exactly the rest.

The test uses nothing of how the server serialises a channel's writes but the public table
`channels` and its row lock: any design in which a channel's cursor UPDATE takes that row passes
test 1 when writes to other channels do not wait for it.

Skipped unless the tests run on PostgreSQL (ACTAE_TEST_DATABASE_URL), e.g.

    pg_virtualenv bash -c 'export ACTAE_TEST_DATABASE_URL="postgresql://$PGUSER:$PGPASSWORD@$PGHOST:${PGPORT:-5432}/postgres";
                           python -m pytest tests/test_pg_overlap.py -q'
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
from collections import Counter, defaultdict

import pytest

from conftest import BACKEND, ServerProcess, fresh_database_url, http, poll, run

pytestmark = pytest.mark.skipif(
    BACKEND != "postgresql",
    reason="servers sharing one PostgreSQL database: needs ACTAE_TEST_DATABASE_URL (SQLite has one writer)")

WAIT = 30.0              # seconds: a hang guard for what must come, never a timing assertion
STILL_PENDING = 1.0      # how long a write held by a row lock is watched not to answer
OVERLAP_BOUND = 20.0     # how long the write to B may take while A's waits (milliseconds when they overlap,
#                          until the test lets go of A's row when one lock serialises every write)
REQUEST_TIMEOUT = 120.0  # one HTTP request: longer than any wait above, so a held request is never cut off
RECORD = "/api/v1/events/record"


# --------------------------------------------------------------------------------------------
# Two servers on one fresh database
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Pair:
    """Two running servers on one database: `.servers`, the `.key` the first start issued, `.database`."""

    servers: list
    key: str
    database: str


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    database = fresh_database_url("pg_overlap")
    data_dir = tmp_path_factory.mktemp("pg-overlap")
    with contextlib.ExitStack() as stack:
        # The first server on the empty database migrates it and issues the key; the second finds both.
        first = stack.enter_context(ServerProcess(data_dir, database=database).start())
        assert first.key and first.key.startswith("sk-"), first.lines
        second = stack.enter_context(ServerProcess(data_dir, database=database).start())
        assert second.key is None, "only the first start on a database issues a key"
        yield Pair([first, second], first.key, database)


def connect(database: str, *, autocommit: bool):
    import psycopg

    return psycopg.connect(database, autocommit=autocommit, connect_timeout=10)


# --------------------------------------------------------------------------------------------
# Writing and reading back, raw HTTP
# --------------------------------------------------------------------------------------------

def record(server, key: str, channel: str, label: str) -> tuple:
    """POST /api/v1/events/record through `server`: (status, body)."""
    status, _, body = http("POST", server.url + RECORD, key=key, timeout=REQUEST_TIMEOUT,
                           body={"channel_id": channel, "event_type": "overlap.probe", "payload": {"label": label},
                                 "metadata": {"actor": "test"}})
    return status, body


def recorded_cursor(answer: tuple) -> int:
    """The cursor of a record answer, which must be a 200."""
    status, body = answer
    assert status == 200, f"expected 200, got {status}: {str(body)[:300]}"
    return body["event"]["cursor"]


def replay(server, key: str, channel: str) -> list:
    """The channel's whole log through `server`, in pages of 1000 (exclusive cursor): a list of event dicts."""
    events, cursor = [], 0
    for _ in range(1000):                        # bounded: 10^6 events is far past anything written here
        status, _, body = http("GET", f"{server.url}/api/v1/events/replay/{channel}?cursor={cursor}&limit=1000",
                               key=key, timeout=WAIT)
        assert status == 200, (status, body)
        page = body["events"]
        if not page:
            return events
        assert page[-1]["cursor"] > cursor, "replay did not advance past the requested cursor"
        events += page
        cursor = page[-1]["cursor"]
    raise AssertionError(f"replay of {channel} did not end")


def verified(server, key: str, channel: str) -> dict:
    """GET /api/v1/events/verify/{channel} through `server`: the chain check's body (a 200's)."""
    status, _, body = http("GET", f"{server.url}/api/v1/events/verify/{channel}", key=key, timeout=WAIT)
    assert status == 200, (status, body)
    return body


@dataclasses.dataclass
class Ack:
    """One record request's outcome, as its writer saw it."""

    server: int
    channel: str
    writer: str
    n: int
    status: int
    body: object

    @property
    def event(self) -> dict:
        return self.body["event"]


async def write_concurrently(pair: Pair, plan: list, *, bound: float = 120.0) -> list:
    """Run every writer of `plan` at once, each a list of sequential records; returns every `Ack`.

    `plan` is [(server index, channel, writer name, events)]. Raw aiohttp, so each answer's status is
    seen as it came (an SDK retry could hide a failed one)."""
    import aiohttp

    acks: list = []

    async def writer(session, index, channel, name, count):
        url = pair.servers[index].url + RECORD
        for n in range(count):
            body = {"channel_id": channel, "event_type": "overlap.tick", "payload": {"writer": name, "n": n},
                    "metadata": {"actor": name}}
            async with session.post(url, json=body, headers={"x-api-key": pair.key}) as resp:
                answer = await resp.json(content_type=None) if resp.content_type == "application/json" else await resp.text()
                acks.append(Ack(index, channel, name, n, resp.status, answer))

    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.wait_for(asyncio.gather(*(writer(session, *w) for w in plan)), bound)
    return acks


def check_gapless(pair: Pair, channel: str, acks: list) -> None:
    """`channel`'s acknowledged writes are its whole log: cursors 1..N, each once, each writer's in its
    own order, the same log (and chain hashes) through every server, and a chain that verifies."""
    mine = [a for a in acks if a.channel == channel]
    failed = [(a.status, str(a.body)[:200]) for a in mine if a.status != 200]
    assert not failed, f"{len(failed)} of {len(mine)} writes to {channel} failed: {failed[:5]}"
    count = len(mine)
    cursors = Counter(a.event["cursor"] for a in mine)
    duplicated = sorted(c for c, times in cursors.items() if times > 1)
    missing = sorted(set(range(1, count + 1)) - set(cursors))
    assert not duplicated and not missing, (f"{channel}: cursors answered twice {duplicated[:10]}, "
                                            f"never answered {missing[:10]}")
    by_writer = defaultdict(list)
    for a in sorted(mine, key=lambda a: a.n):
        by_writer[a.writer].append(a.event["cursor"])
    assert all(c == sorted(c) for c in by_writer.values()), "a writer's later write got an earlier cursor"

    answered = {a.event["id"]: (a.event["cursor"], a.event["chain_hash"]) for a in mine}
    logs = [[(e["cursor"], e["id"], e["chain_hash"]) for e in replay(srv, pair.key, channel)] for srv in pair.servers]
    assert all(log == logs[0] for log in logs[1:]), f"the servers disagree about {channel}'s log"
    assert [c for c, _, _ in logs[0]] == list(range(1, count + 1)), f"{channel}: the log is not 1..{count}"
    assert {i: (c, h) for c, i, h in logs[0]} == answered, f"{channel}: the log is not what the writers were told"

    for srv in pair.servers:
        check = verified(srv, pair.key, channel)
        assert check["ok"] and check["verified_events"] == count, check


# --------------------------------------------------------------------------------------------
# The database side of test 1: a row lock held by the test, and who waits for it
# --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def channel_row_locked(database: str, channel: str):
    """Hold `channel`'s row in table `channels` FOR UPDATE, in an open transaction, until the block ends
    or `.release()`; yields a handle with the holder's backend `.pid`. Always rolled back: nothing changed."""
    conn = connect(database, autocommit=False)
    try:
        row = conn.execute("SELECT 1 FROM channels WHERE id = %s FOR UPDATE", (channel,)).fetchone()
        assert row is not None, f"channel {channel} has no row to lock"
        holder = RowLock(conn, conn.info.backend_pid)
        yield holder
    finally:
        with contextlib.suppress(Exception):
            conn.rollback()
        conn.close()


@dataclasses.dataclass
class RowLock:
    conn: object
    pid: int

    def release(self) -> None:
        self.conn.rollback()


SESSIONS = """SELECT pid, state, wait_event_type, wait_event, pg_blocking_pids(pid) AS blocked_by,
                     left(regexp_replace(query, '\\s+', ' ', 'g'), 160) AS query
              FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"""


def waiting_on(watcher, holder_pid: int) -> list:
    """The backends of this database waiting for a lock `holder_pid` holds (its row lock): [(pid, query)]."""
    rows = watcher.execute(f"SELECT pid, query FROM ({SESSIONS}) s WHERE wait_event_type = 'Lock'"
                           " AND %s = ANY(blocked_by)", (holder_pid,)).fetchall()
    return [tuple(r) for r in rows]


def lock_waits(watcher) -> str:
    """Every backend of this database waiting on a lock, and whom for: what a failure here should show."""
    rows = watcher.execute(f"SELECT * FROM ({SESSIONS}) s WHERE wait_event_type = 'Lock'").fetchall()
    return "\n".join(f"  pid {pid} ({state}) waits on {kind}/{event} held by {blockers}: {query}"
                     for pid, state, kind, event, blockers, query in rows) or "  (none)"


def answered_within(future, seconds: float) -> bool:
    """Whether `future` is done within `seconds` (a fixed wait only where the point is that it is not)."""
    concurrent.futures.wait([future], timeout=seconds)
    return future.done()


# --------------------------------------------------------------------------------------------
# 1. Writes to different channels overlap across servers
# --------------------------------------------------------------------------------------------

def test_writes_to_different_channels_overlap_across_servers(pair, unique):
    one, two = pair.servers
    a, b = unique("a"), unique("b")
    assert recorded_cursor(record(one, pair.key, a, "first")) == 1
    assert recorded_cursor(record(one, pair.key, b, "first")) == 1
    # Each server stamps its key's last use (a write of the api_keys row, once a minute) as a write job
    # of its own, queued by its first request. Stuck in server 1's held transaction, that stamp would
    # make server 2's wait on the api_keys row: a shared row this test is not about. A request, then a
    # write, through each server commits the stamp first (a server commits its writes in queue order);
    # server 1's were the two writes above.
    assert http("GET", f"{two.url}/api/v1/events/cursor/{b}", key=pair.key)[0] == 200
    assert recorded_cursor(record(two, pair.key, unique("warm"), "stamp the key")) == 1

    watcher = connect(pair.database, autocommit=True)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool, channel_row_locked(pair.database, a) as held:
            # (Leaving the with: the row lock is let go first, so the pool's requests can finish.)
            to_a = pool.submit(record, one, pair.key, a, "behind the row lock")
            # A's transaction is in flight: its backend waits in the database for the test's row lock.
            poll(lambda: waiting_on(watcher, held.pid), WAIT,
                 what=lambda: f"server 1's write to A to wait on A's row lock; lock waits:\n{lock_waits(watcher)}")
            assert not answered_within(to_a, STILL_PENDING), \
                f"the write to A answered while A's row was locked: {to_a.result()}"

            to_b = pool.submit(record, two, pair.key, b, "beside the held write")
            assert answered_within(to_b, OVERLAP_BOUND), (
                f"the write to B through server 2 did not answer within {OVERLAP_BOUND:g} s while the write to A "
                f"through server 1 waited for A's row lock: writes to different channels do not overlap.\n"
                f"Lock waits in the database:\n{lock_waits(watcher)}")
            assert recorded_cursor(to_b.result()) == 2
            # The overlap was real: B's write committed while A's transaction was still waiting for the row.
            assert not to_a.done(), f"the write to A answered before its row lock was let go: {to_a.result()}"
            assert waiting_on(watcher, held.pid), (
                f"A's transaction no longer waits on the row lock:\n{lock_waits(watcher)}")

            held.release()
            assert recorded_cursor(to_a.result(timeout=WAIT)) == 2
    finally:
        watcher.close()

    for srv in pair.servers:
        for channel in (a, b):
            assert [e["cursor"] for e in replay(srv, pair.key, channel)] == [1, 2], (srv.url, channel)
            check = verified(srv, pair.key, channel)
            assert check["ok"] and check["verified_events"] == 2, check


# --------------------------------------------------------------------------------------------
# 2. One channel stays serial and gapless across servers
# --------------------------------------------------------------------------------------------

def test_one_channel_stays_serial_and_gapless_across_servers(pair, unique):
    shared, others = unique("shared"), [unique(f"other-{i}") for i in range(3)]
    # 20 writers of 10 on the shared channel, half through each server; on each other channel 4
    # writers of 10, two through each server: 320 writes, 32 at a time, all running together.
    plan = ([(w % 2, shared, f"s{w}", 10) for w in range(20)]
            + [(w % 2, channel, f"o{i}-{w}", 10) for i, channel in enumerate(others) for w in range(4)])

    acks = run(write_concurrently(pair, plan))

    assert len(acks) == 320
    assert Counter(a.server for a in acks if a.channel == shared) == {0: 100, 1: 100}
    check_gapless(pair, shared, acks)
    for channel in others:
        check_gapless(pair, channel, acks)


# --------------------------------------------------------------------------------------------
# 3. The stream of every channel sees every commit once, in order
# --------------------------------------------------------------------------------------------

class InstanceStream:
    """A raw /ws subscription to every channel (topic "*"): each broadcast frame as it came, in order,
    duplicates included, as (position, channel, cursor, event id)."""

    def __init__(self, server, key: str):
        self.url, self.key = server.url.replace("http://", "ws://") + "/ws", key
        self.frames: list = []
        self.errors: list = []
        self.pongs = 0
        self.confirmed: asyncio.Future | None = None

    async def open(self, position: int | None = None) -> int:
        """Subscribe from after `position` (None: from now on); the position the server confirmed."""
        import websockets

        self.confirmed = asyncio.get_running_loop().create_future()
        self.ws = await websockets.connect(self.url, max_size=None, open_timeout=WAIT)
        assert json.loads(await asyncio.wait_for(self.ws.recv(), WAIT))["event"] == "connected"
        await self.ws.send(json.dumps({"type": "auth", "api_key": self.key}))
        assert json.loads(await asyncio.wait_for(self.ws.recv(), WAIT))["event"] == "authenticated"
        self.reader = asyncio.create_task(self._read())
        frame = {"type": "subscribe", "topic": "*", **({"cursor": position} if position is not None else {})}
        await self.ws.send(json.dumps(frame))
        return await asyncio.wait_for(self.confirmed, WAIT)

    async def _read(self):
        async for text in self.ws:
            frame = json.loads(text)
            kind = frame.get("type")
            if kind == "broadcast":
                event = frame["payload"]["event"]
                self.frames.append((frame.get("position"), event["channel_id"], event["cursor"], event["id"]))
            elif kind == "subscription" and frame.get("event") == "subscribed" and not self.confirmed.done():
                self.confirmed.set_result(frame["cursor"])
            elif kind == "connection" and frame.get("event") == "pong":
                self.pongs += 1
            elif kind == "error":
                self.errors.append(frame)

    async def until(self, count: int, timeout: float = WAIT) -> bool:
        """Wait until `count` frames have come (False when they have not within `timeout`: the caller's
        checks then say which are missing), then one ping round trip: whatever the server had queued for
        this connection before the pong (a frame too many, say) has come too."""
        async def enough():
            return len(self.frames) >= count or self.errors
        try:
            await poll(enough, timeout, what=f"{count} frames on the stream of every channel")
        except AssertionError:
            return False
        pongs = self.pongs
        await self.ws.send(json.dumps({"type": "ping"}))

        async def ponged():
            return self.pongs > pongs
        await poll(ponged, timeout, what="the pong")
        return True

    async def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            await self.ws.close()
        if getattr(self, "reader", None) is not None:
            self.reader.cancel()
            await asyncio.gather(self.reader, return_exceptions=True)


def test_instance_stream_sees_every_commit_once_in_order(pair, unique):
    channels = [unique(f"stream-{i}") for i in range(4)]
    # On each channel two writers through each server, 15 events each: 240 writes, 16 at a time,
    # a few seconds of commits from both servers interleaving on the database.
    plan = [(w % 2, channel, f"{i}-{w}", 15) for i, channel in enumerate(channels) for w in range(4)]

    async def scenario():
        live, resumed = InstanceStream(pair.servers[0], pair.key), InstanceStream(pair.servers[0], pair.key)
        try:
            start = await live.open()                      # from now on: nothing of ours written yet
            acks = await write_concurrently(pair, plan)
            assert all(a.status == 200 for a in acks), [(a.status, a.body) for a in acks if a.status != 200][:5]
            await live.until(len(acks))
            frames = list(live.frames)
            check_stream(frames, start, acks, channels)
            # Resume from the middle of what the live stream saw: the rest must come, exactly.
            middle = len(frames) // 2
            await resumed.open(frames[middle][0])
            await resumed.until(len(frames) - middle - 1)
            return frames, middle, list(resumed.frames), live.errors + resumed.errors
        finally:
            await live.close()
            await resumed.close()

    frames, middle, rest, errors = run(scenario())
    assert errors == []
    assert rest == frames[middle + 1:], (
        f"resumed from position {frames[middle][0]}: got {len(rest)} frames, expected {len(frames) - middle - 1}; "
        f"first got {rest[:3]}, first expected {frames[middle + 1:middle + 4]}")


def check_stream(frames: list, start: int, acks: list, channels: list) -> None:
    """The live stream of every channel carried each acknowledged event once, nothing else, each channel's
    events in cursor order, at strictly increasing positions after the one it was subscribed at."""
    sent = {a.event["id"]: (a.channel, a.event["cursor"]) for a in acks}
    seen = Counter(event_id for *_, event_id in frames)
    missing = sorted(sent[i] for i in set(sent) - set(seen))
    twice = [sent.get(i, i) for i, times in seen.items() if times > 1]
    foreign = [f for f in frames if f[3] not in sent]
    assert not missing and not twice and not foreign, (
        f"the stream of every channel carried {len(frames)} frames for {len(sent)} acknowledged events: "
        f"{len(missing)} missing (channel, cursor) {missing[:8]}, {len(twice)} twice {twice[:8]}, "
        f"{len(foreign)} not written here {foreign[:3]}")
    positions = [position for position, *_ in frames]
    assert all(isinstance(p, int) for p in positions), frames[:5]
    assert all(p > start for p in positions), f"a frame at or before the subscription's position {start}"
    assert all(p < q for p, q in zip(positions, positions[1:])), "positions do not strictly increase"
    for channel in channels:
        cursors = [cursor for _, ch, cursor, _ in frames if ch == channel]
        expected = sorted(cursor for ch, cursor in sent.values() if ch == channel)
        assert cursors == expected == list(range(1, len(expected) + 1)), f"{channel} came out of cursor order: {cursors}"
