"""Three servers on one PostgreSQL database behave like one server.

Every test here talks to three `actae.py --database <url>` processes that share one fresh
database (and one data directory): the real SDK and raw HTTP/WebSocket, with each call sent to
a chosen server. What is checked:

 1. 100 concurrent writers spread over the three, one channel: cursors 1..N without a gap,
    every acknowledged event exactly once, the same log read through each server.
 2. 50 concurrent claims of one execution key over the three: one `claimed`, 49 `in_progress`.
 3. A fenced `AgentSession` owned through server A locks out owners trying through B and C.
 4. A WebSocket subscriber on A gets what B and C write, in cursor order, no gap, no duplicate,
    live and when catching up from a cursor.
 5. Wake-ups due at the same moment fire exactly once although every server runs a scheduler.
 6. The fork walkthrough of examples/fork_demo.py with its steps spread over the three.
 7. kill -9 of one server while writers go through all three: the other two keep serving,
    nothing acknowledged is lost or doubled, and the killed server serves again after a restart.

Skipped unless ACTAE_TEST_DATABASE_URL names a PostgreSQL server the tests may create
databases on, e.g.

    ACTAE_TEST_DATABASE_URL=postgresql://user:pw@localhost:5432/postgres python -m pytest tests/test_scaleout.py -q
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
from actae_client import ActaeClient, AgentSession, SessionLockedError
from actae_client.errors import ActaeConnectionError

from conftest import (POSTGRES_URL, ROOT, ServerProcess, fresh_database_url, http, poll, replay_all, run,
                      session_log)

pytestmark = pytest.mark.skipif(
    POSTGRES_URL is None,
    reason="three servers on one PostgreSQL database: needs ACTAE_TEST_DATABASE_URL")

WAIT = 20.0        # seconds: a hang guard for things that never come, not a timing assertion
SERVERS = 3


# --------------------------------------------------------------------------------------------
# Three servers on one fresh database
# --------------------------------------------------------------------------------------------

def start_server(data_dir, database: str) -> ServerProcess:
    return ServerProcess(data_dir, database=database).start()


class Cluster:
    """`SERVERS` servers on one database: `.servers`, `.key` (the first server's), `.client(i)`."""

    def __init__(self, data_dir, database: str):
        self.data_dir, self.database = data_dir, database
        self.servers: list[ServerProcess] = []

    def start(self) -> "Cluster":
        # The first server on the empty database issues the key; the others start together after it.
        self.servers.append(start_server(self.data_dir, self.database))
        self.key = self.servers[0].key
        assert self.key and self.key.startswith("sk-"), self.servers[0].lines
        with ThreadPoolExecutor(SERVERS - 1) as pool:
            others = [pool.submit(start_server, self.data_dir, self.database) for _ in range(SERVERS - 1)]
        failed = [f.exception() for f in others if f.exception() is not None]
        self.servers += [f.result() for f in others if f.exception() is None]   # so stop() stops them
        if failed:
            raise failed[0]
        assert [s.key for s in self.servers[1:]] == [None] * (SERVERS - 1), "only the first start issues a key"
        return self

    def stop(self) -> None:
        for srv in self.servers:
            srv.stop()

    def url(self, i: int) -> str:
        return self.servers[i % SERVERS].url

    def client(self, i: int, **kw) -> ActaeClient:
        """An SDK client on server `i % SERVERS` (not yet connected)."""
        return ActaeClient(endpoint=self.url(i), api_key=self.key, **kw)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("scaleout"), fresh_database_url("scaleout"))
    try:
        yield c.start()
    finally:
        c.stop()


class Clients:
    """One SDK client per server: `async with Clients(cluster) as (a, b, c):`."""

    def __init__(self, cluster: Cluster):
        self.clients = [cluster.client(i) for i in range(SERVERS)]

    async def __aenter__(self):
        return self.clients

    async def __aexit__(self, *exc):
        for client in self.clients:
            await client.disconnect()


async def logs_through_each(clients, channel: str) -> list:
    """The channel's log as (cursor, id, type) read through every server; all must agree."""
    logs = [[(e.cursor, e.id, e.event_type) for e in await replay_all(c, channel)] for c in clients]
    assert all(log == logs[0] for log in logs[1:]), "the servers disagree about the log"
    return logs[0]


# --------------------------------------------------------------------------------------------
# 1. Concurrent writers over three servers, one channel
# --------------------------------------------------------------------------------------------

def test_hundred_writers_over_three_servers_leave_one_gapless_log(cluster, unique):
    channel, writers, each = unique("log"), 100, 5

    async def scenario():
        acked = []

        async def write(w):
            client = cluster.client(w)               # round-robin: writer w goes to server w % 3
            try:
                for n in range(each):
                    event = await client.record(channel, "tick", {"w": w, "n": n}, actor=f"w{w}")
                    acked.append((event.id, event.cursor, w, n))
            finally:
                await client.disconnect()

        await asyncio.gather(*(write(w) for w in range(writers)))
        async with Clients(cluster) as clients:
            log = await logs_through_each(clients, channel)
            events = await replay_all(clients[0], channel)
        return acked, log, events

    acked, log, events = run(scenario())
    assert len(acked) == writers * each
    assert [cursor for cursor, _, _ in log] == list(range(1, len(acked) + 1))
    assert Counter(event_id for _, event_id, _ in log) == Counter({event_id: 1 for event_id, *_ in acked})
    # The cursor each writer was told is the one the log holds, and the payload is the writer's.
    by_id = {e.id: e for e in events}
    assert all(by_id[event_id].cursor == cursor for event_id, cursor, _, _ in acked)
    assert (sorted((e.payload["w"], e.payload["n"]) for e in events)
            == [(w, n) for w in range(writers) for n in range(each)])
    # Each writer's own events keep its order.
    for w in range(writers):
        mine = [e.payload["n"] for e in events if e.payload["w"] == w]
        assert mine == list(range(each)), (w, mine)


# --------------------------------------------------------------------------------------------
# 2. Concurrent claims of one execution key over three servers
# --------------------------------------------------------------------------------------------

def test_fifty_claims_over_three_servers_have_one_winner(cluster, unique):
    channel = unique("claim")
    params = {"amount_cents": 4900, "customer": "cus_1"}

    async def scenario():
        async with Clients(cluster) as clients:
            claims = await asyncio.gather(*(
                clients[i % SERVERS].claim_execution(channel, "inv-1", "charge_customer", params)
                for i in range(50)))
            assert Counter(x.status for x in claims) == {"claimed": 1, "in_progress": 49}
            assert len({x.execution.id for x in claims}) == 1, "all claims must see the same ledger row"
            winner = next(x for x in claims if x.status == "claimed")
            assert winner.claim_token and winner.execution.attempts == 1
            assert all(x.claim_token is None for x in claims if x.status == "in_progress")

            # The winner completes through another server; every server then replays the result.
            done = await clients[1].complete_execution(winner.execution.id, winner.claim_token, {"charge_id": "ch_1"})
            assert done.status == "completed"
            again = await asyncio.gather(*(
                clients[i % SERVERS].claim_execution(channel, "inv-1", "charge_customer", params)
                for i in range(9)))
            assert [x.status for x in again] == ["replayed"] * 9
            assert all(x.result == {"charge_id": "ch_1"} and x.execution.id == winner.execution.id for x in again)

            log = await logs_through_each(clients, channel)
            assert [t for _, _, t in log] == ["tool.started", "tool.completed"]
            assert [c for c, _, _ in log] == [1, 2]
            for client in clients:
                assert (await client.get_execution(winner.execution.id)).attempts == 1
            return winner.execution.id

    execution_id = run(scenario())
    # The same claim as raw HTTP, through each server: the stored result, no new run.
    for i in range(SERVERS):
        status, _, body = http("POST", cluster.url(i) + "/api/v1/executions/claim", key=cluster.key,
                               body={"channel_id": channel, "key_name": "inv-1", "tool_name": "charge_customer",
                                     "params": params})
        assert status == 200 and body["status"] == "replayed", (status, body)
        assert body["execution"]["id"] == execution_id and body["result"] == {"charge_id": "ch_1"}


# --------------------------------------------------------------------------------------------
# 3. The session fence across servers
# --------------------------------------------------------------------------------------------

def fenced(client, channel, owner, lease=30):
    return AgentSession(client, channel, fence_owner=owner, fence_lease_seconds=lease, params={"owner": owner})


def test_a_session_fenced_through_one_server_locks_out_owners_on_the_others(cluster, unique):
    channel = unique("fence")

    async def scenario():
        async with Clients(cluster) as (a, b, c):
            async with fenced(a, channel, "A") as owner:
                await owner.step("work", output={"owner": "A"})
                count = len(await replay_all(c, channel))
                for other, name in ((b, "B"), (c, "C")):
                    with pytest.raises(SessionLockedError):
                        async with fenced(other, channel, name):
                            pass
                assert len(await replay_all(a, channel)) == count, "a locked-out session must not write"
                await owner.step("work", output={"owner": "A"})
            # A released the fence on exit (through server A): an owner on server C gets in.
            async with fenced(c, channel, "C") as later:
                await later.step("work", output={"owner": "C"})
            assert session_log(await replay_all(b, channel)) == [
                ("session.started", "A"), ("work", "A"), ("work", "A"), ("session.completed", None),
                ("session.started", "C"), ("work", "C"), ("session.completed", None)]

    run(scenario())


def test_fenced_sessions_started_at_once_on_three_servers_admit_one(cluster, unique):
    channel, contenders = unique("fence-race"), 9

    async def scenario():
        async with Clients(cluster) as clients:
            sessions = [fenced(clients[i % SERVERS], channel, f"o{i}") for i in range(contenders)]
            entered = await asyncio.gather(*(s.__aenter__() for s in sessions), return_exceptions=True)
            winners = [s for s, r in zip(sessions, entered) if r is s]
            locked = [r for r in entered if isinstance(r, SessionLockedError)]
            assert len(winners) == 1 and len(locked) == contenders - 1, entered
            winner = winners[0]
            await winner.step("work", output={"owner": winner.params["owner"]})
            await winner.__aexit__(None, None, None)
            assert session_log(await replay_all(clients[1], channel)) == [
                ("session.started", winner.params["owner"]), ("work", winner.params["owner"]),
                ("session.completed", None)]

    run(scenario())


def test_a_fence_taken_over_through_another_server_stops_the_old_owner(cluster, unique):
    channel = unique("takeover")

    async def scenario():
        async with Clients(cluster) as (a, b, c):
            old = fenced(a, channel, "A", lease=1)
            await old.__aenter__()
            await old.step("work", output={"owner": "A"})

            async def take_over():                 # refused until A's one-second lease has lapsed
                new = fenced(b, channel, "B")
                try:
                    await new.__aenter__()
                except SessionLockedError:
                    return None
                return new
            new = await poll(take_over, WAIT, what="the lapsed lease to be taken over through server B", every=0.2)
            await new.step("work", output={"owner": "B"})
            with pytest.raises(SessionLockedError):
                await old.step("work", output={"owner": "A"})
            await old.__aexit__(SessionLockedError, SessionLockedError("lost the lease"), None)
            await new.step("work", output={"owner": "B"})
            await new.__aexit__(None, None, None)
            assert session_log(await replay_all(c, channel)) == [
                ("session.started", "A"), ("work", "A"),
                ("session.started", "B"), ("work", "B"), ("work", "B"), ("session.completed", None)]

    run(scenario())


# --------------------------------------------------------------------------------------------
# 4. A subscriber on one server, writers on the others
# --------------------------------------------------------------------------------------------

async def both_reach(raw, sdk_got, cursor):
    """Wait until the raw subscriber and the SDK's have both been sent `cursor`."""
    await raw.until_cursor(cursor)

    async def sdk_done():
        return sdk_got and sdk_got[-1].cursor >= cursor
    await poll(sdk_done, WAIT, what="the SDK subscriber to reach the last cursor")


class RawSubscriber:
    """A raw WebSocket subscription: every broadcast frame as it came, duplicates included."""

    def __init__(self, url: str, key: str):
        self.url, self.key = url.replace("http://", "ws://") + "/ws", key
        self.events: list[dict] = []
        self.errors: list[dict] = []
        self.pongs = 0
        self.subscribed = asyncio.Event()

    async def open(self, topic: str, cursor=None) -> "RawSubscriber":
        import websockets
        self.ws = await websockets.connect(self.url, max_size=None)
        assert json.loads(await self.ws.recv())["event"] == "connected"
        await self.ws.send(json.dumps({"type": "auth", "api_key": self.key}))
        assert json.loads(await self.ws.recv())["event"] == "authenticated"
        self.reader = asyncio.create_task(self._read())
        frame = {"type": "subscribe", "topic": topic}
        if cursor is not None:
            frame["cursor"] = cursor
        await self.ws.send(json.dumps(frame))
        await asyncio.wait_for(self.subscribed.wait(), WAIT)
        return self

    async def _read(self):
        async for text in self.ws:
            frame = json.loads(text)
            kind = frame.get("type")
            if kind == "broadcast":
                self.events.append(frame["payload"]["event"])
            elif kind == "subscription" and frame.get("event") == "subscribed":
                self.subscribed.set()
            elif kind == "connection" and frame.get("event") == "pong":
                self.pongs += 1
            elif kind == "error":
                self.errors.append(frame)

    async def until_cursor(self, cursor: int) -> None:
        async def reached():
            return self.events and max(e["cursor"] for e in self.events) >= cursor
        try:
            await poll(reached, WAIT, what=f"cursor {cursor} on the raw subscription")
        except AssertionError as exc:
            got = [e["cursor"] for e in self.events]
            raise AssertionError(f"{exc}: {len(got)} frames, cursors {got[:5]}...{got[-5:]}, "
                                 f"errors {self.errors}") from None
        # A ping round trip: whatever the server had queued for us before the pong has arrived.
        pongs = self.pongs
        await self.ws.send(json.dumps({"type": "ping"}))

        async def ponged():
            return self.pongs > pongs
        await poll(ponged, WAIT, what="the pong")

    async def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            await self.ws.close()
        if getattr(self, "reader", None) is not None:
            self.reader.cancel()
            await asyncio.gather(self.reader, return_exceptions=True)


@contextlib.asynccontextmanager
async def subscribers(cluster, channel):
    """(reader, raw, sdk_got) on server 0: an SDK client whose messages on `channel` land in
    `sdk_got`, and a raw subscriber not yet opened; the raw one closed, the client disconnected after."""
    sdk_got = []
    async with cluster.client(0) as reader:
        reader.on_message(lambda topic, event: sdk_got.append(event) if topic == channel else None)
        raw = RawSubscriber(cluster.url(0), cluster.key)
        try:
            yield reader, raw, sdk_got
        finally:
            await raw.close()


async def write_through(cluster, servers, channel, writers_per_server, each, tag):
    """HTTP writers on the given servers; returns the acknowledged events."""
    acked = []

    async def write(i, w):
        client = cluster.client(i)
        try:
            for n in range(each):
                acked.append(await client.record(channel, "tick", {"tag": tag, "s": i, "w": w, "n": n}, actor="w"))
        finally:
            await client.disconnect()

    await asyncio.gather(*(write(i, w) for i in servers for w in range(writers_per_server)))
    return acked


async def publish_through(cluster, server, channel, count, tag):
    """A WebSocket publisher on `server`; returns the acknowledged events."""
    acked = []
    async with cluster.client(server) as client:
        for n in range(count):
            acked.append(await client.publish(channel, {"tag": tag, "n": n}))
    return acked


def test_a_subscriber_on_one_server_gets_what_the_others_write_live(cluster, unique):
    channel = unique("live")

    async def scenario():
        async with subscribers(cluster, channel) as (reader, raw, sdk_got):
            await reader.subscribe(channel)                       # live only: nothing written yet
            await raw.open(channel)
            recorded, published = await asyncio.gather(
                write_through(cluster, [1, 2], channel, writers_per_server=2, each=20, tag="live"),
                publish_through(cluster, 2, channel, 20, tag="ws"))
            acked = recorded + published
            await both_reach(raw, sdk_got, len(acked))
        return acked, raw, sdk_got

    acked, raw, sdk_got = run(scenario())
    total = len(acked)
    assert total == 100
    assert raw.errors == []
    assert [e["cursor"] for e in raw.events] == list(range(1, total + 1))       # order, no gap, no duplicate
    assert sorted(e["id"] for e in raw.events) == sorted(e.id for e in acked)
    assert [e.cursor for e in sdk_got] == list(range(1, total + 1))
    assert [e.id for e in sdk_got] == [e["id"] for e in raw.events]
    assert all(e.channel_id == channel for e in sdk_got)


def test_a_subscriber_on_one_server_catches_up_from_a_cursor_then_follows_the_others(cluster, unique):
    channel, start = unique("catchup"), 7

    async def scenario():
        before = await write_through(cluster, [1, 2], channel, writers_per_server=1, each=10, tag="before")
        async with subscribers(cluster, channel) as (reader, raw, sdk_got):
            # Subscribe while the next writes are already running: the catch-up hands over to live.
            _, _, after = await asyncio.gather(
                reader.subscribe(channel, cursor=start),
                raw.open(channel, cursor=start),
                write_through(cluster, [1, 2], channel, writers_per_server=2, each=10, tag="after"))
            acked = before + after
            await both_reach(raw, sdk_got, len(acked))
        return acked, raw, sdk_got

    acked, raw, sdk_got = run(scenario())
    total = len(acked)
    assert total == 60
    assert raw.errors == []
    assert [e["cursor"] for e in raw.events] == list(range(start + 1, total + 1))
    expected = {e.id for e in acked if e.cursor > start}
    assert len(expected) == total - start and {e["id"] for e in raw.events} == expected
    assert [e.cursor for e in sdk_got] == list(range(start + 1, total + 1))
    assert [e.id for e in sdk_got] == [e["id"] for e in raw.events]


# --------------------------------------------------------------------------------------------
# 5. Wake-ups fire once although every server runs a scheduler
# --------------------------------------------------------------------------------------------

def test_wakeups_due_at_once_fire_exactly_once_across_three_schedulers(cluster, unique):
    shared, own, on_shared, on_own = unique("wake"), unique("wake-own"), 20, 10

    async def scenario():
        async with Clients(cluster) as clients:
            due = datetime.now(timezone.utc) + timedelta(seconds=1.5)     # the same moment for all
            channels = [shared] * on_shared + [f"{own}-{i}" for i in range(on_own)]
            wakeups = await asyncio.gather(*(
                clients[i % SERVERS].schedule_wakeup(ch, due, payload={"i": i}) for i, ch in enumerate(channels)))
            assert all(w.status == "pending" for w in wakeups)

            async def all_done():
                listed = await clients[2].list_wakeups(status="done")
                return {w.id for w in listed} >= {w.id for w in wakeups}
            await poll(all_done, WAIT, what="every wake-up to be done", every=0.1)
            # A second firing would come from another server's next scheduler round, at most a
            # second after the first: let that round pass before counting (time must pass: no
            # event marks a firing that did not happen).
            await asyncio.sleep(1.5)

            results = {}
            for i, w in enumerate(wakeups):
                fired = await clients[i % SERVERS].get_wakeup(w.id)
                results[w.id] = (fired.status, fired.attempts, bool(fired.executed_at))
            shared_log = await logs_through_each(clients, shared)
            shared_events = await replay_all(clients[1], shared)
            own_events = {ch: await replay_all(clients[i % SERVERS], ch) for i, ch in enumerate(channels[on_shared:])}
        return wakeups, results, shared_log, shared_events, own_events

    wakeups, results, shared_log, shared_events, own_events = run(scenario())
    assert Counter(e.payload["wakeup_id"] for e in shared_events) == Counter({w.id: 1 for w in wakeups[:on_shared]})
    assert [c for c, _, _ in shared_log] == list(range(1, on_shared + 1))
    assert [t for _, _, t in shared_log] == ["scheduler.wakeup"] * on_shared
    for w, (ch, events) in zip(wakeups[on_shared:], own_events.items()):
        assert [(e.cursor, e.event_type, e.payload["wakeup_id"]) for e in events] == [(1, "scheduler.wakeup", w.id)], ch
    assert results == {w.id: ("done", 1, True) for w in wakeups}      # (status, attempts, executed_at set)


# --------------------------------------------------------------------------------------------
# 6. The fork walkthrough with its steps on different servers
# --------------------------------------------------------------------------------------------

def load_fork_demo():
    spec = importlib.util.spec_from_file_location("fork_demo_scaleout", ROOT / "examples" / "fork_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class RoundRobin:
    """Looks like one `ActaeClient`; every method looked up on it is the next server's."""

    def __init__(self, clients):
        self._next = itertools.cycle(clients)

    def __getattr__(self, name):
        return getattr(next(self._next), name)


def test_fork_walkthrough_with_each_step_on_another_server(cluster, unique):
    demo = load_fork_demo()
    base_name, fork_name = unique("demo-base"), unique("demo-fork")
    fork_after, last = demo.FORK_AFTER, len(demo.STEPS)
    intervention, policies = {"model": "slow"}, {"charge_customer": "block", "*": "auto"}
    seen = SimpleNamespace()

    async def scenario():
        async with Clients(cluster) as (a, b, c):
            # 1. Server A records the parent run (the charge goes through A's ledger).
            seen.agent = demo.Pipeline(a, model="fast")
            async with AgentSession(a, base_name, state_fn=seen.agent.snapshot, snapshot_interval=1) as base:
                for number in range(1, last + 1):
                    await seen.agent.run_step(base, number)

            # 2. Server B reads the parent's steps and final state.
            seen.parent_events = await b.replay(base_name, limit=500)
            seen.parent_state = (await b.latest_state(base_name))["state"]
            seen.parent_steps = await demo.step_numbers(b, base_name)

            # 3. Server C forks after step 3, as a separate process would (it only knows the channel).
            seen.tail = demo.Pipeline(b, model=intervention["model"])
            seen.fork = await AgentSession.resume(c, base_name, fork_at_step=fork_after, name=fork_name,
                                                  state_fn=seen.tail.snapshot, intervention=intervention,
                                                  tool_policies=policies)

            # 4. Server A reads the fork's receipt.
            seen.receipt = await a.get_fork_receipt(fork_name)

            # 5. Server B resumes the fork from that receipt and runs steps 4..6 (charge through B).
            seen.resumed = await AgentSession.resume_from_fork(b, seen.receipt, state_fn=seen.tail.snapshot)
            seen.resumed_at, seen.inherited = seen.resumed.step_count, seen.resumed.inherited_state
            seen.tail.restore(seen.inherited)
            async with seen.resumed:
                for number in range(fork_after + 1, last + 1):
                    await seen.tail.run_step(seen.resumed, number)

            # 6. Server C reads what came of it.
            seen.diff = await c.diff_states(base_name, fork_name)
            seen.fork_events = await c.replay(fork_name, limit=500)
            seen.parent_after = await c.replay(base_name, limit=500)
            seen.parent_state_after = (await c.latest_state(base_name))["state"]
            seen.fork_state = (await c.latest_state(fork_name))["state"]
            seen.fork_steps = await demo.step_numbers(c, fork_name)

    run(scenario())
    agent, tail, fork, receipt = seen.agent, seen.tail, seen.fork, seen.receipt
    step3 = agent.snapshots[fork_after]
    paths = [e["path"] for e in seen.diff.get("entries", [])]
    common_state = (seen.diff.get("common") or {}).get("state") or {}
    blocked = [e for e in seen.fork_events if e.event_type == "tool.blocked"]

    assert seen.parent_steps == list(range(1, last + 1))
    assert seen.parent_state["status"] == "failed"
    assert agent.state["charge"]["status"] == "claimed"
    # The receipt server C's fork returned and the one server A reads back are the same.
    made = fork.fork_receipt
    assert ((receipt.child_channel_id, receipt.source_channel_id, receipt.requested_cursor, receipt.resolved_cursor,
             receipt.source_state_version, receipt.source_state_sha256, receipt.restorable, receipt.tool_policies)
            == (made.child_channel_id, made.source_channel_id, made.requested_cursor, made.resolved_cursor,
                made.source_state_version, made.source_state_sha256, made.restorable, made.tool_policies))
    assert (receipt.child_channel_id, receipt.source_channel_id) == (fork_name, base_name)
    assert fork.inherited_state == step3 and seen.inherited == step3
    assert seen.resumed_at == fork_after and seen.resumed.intervention == intervention
    assert fork.tool_policies == policies and receipt.tool_policies == policies
    assert receipt.restorable is True
    assert receipt.requested_cursor == receipt.resolved_cursor
    assert receipt.source_state_sha256 == demo.canonical_sha256(step3)
    assert seen.fork_steps == list(range(fork_after + 1, last + 1))
    assert paths and all(demo.tail_path(p) for p in paths), paths
    assert common_state.get("status") == "running"
    assert seen.parent_state_after["report"] == seen.parent_state["report"]
    assert (seen.fork_state.get("report") or {}).get("model") == "slow"
    assert seen.fork_state.get("status") == "completed"
    assert len(seen.parent_after) == len(seen.parent_events)
    assert tail.state["charge"]["status"] == "blocked"
    assert len(blocked) == 1 and (blocked[0].payload or {}).get("policy") == "block"
    assert agent.charges + tail.charges == 1


@pytest.mark.parametrize("from_new_process", [False, True], ids=["fork", "resume"])
def test_fork_demo_walkthrough_with_every_call_on_the_next_server(cluster, unique, from_new_process):
    """The demo's own `walkthrough`, its client a stand-in that sends each call to the next server."""
    demo = load_fork_demo()

    async def scenario():
        async with Clients(cluster) as clients:
            return await demo.walkthrough(RoundRobin(clients), unique("rr-base"), unique("rr-fork"),
                                          from_new_process=from_new_process)

    checks = run(scenario())
    failed = [(name, detail) for name, ok, detail in checks if not ok]
    assert len(checks) >= 10 and failed == [], failed


# --------------------------------------------------------------------------------------------
# 7. kill -9 of one server under load
# --------------------------------------------------------------------------------------------

def test_killing_one_server_under_load_loses_nothing_acknowledged(tmp_path, unique):
    channel, per_server, each, victim = unique("kill"), 5, 30, 2
    cluster = Cluster(tmp_path / "data", fresh_database_url("kill"))
    try:
        cluster.start()
        async def load():
            acked, failures = [], {}
            half_way = asyncio.Event()

            async def write(i, w):
                client = cluster.client(i)
                try:
                    for n in range(each):
                        try:
                            event = await client.record(channel, "tick", {"s": i, "w": w, "n": n}, actor="w")
                        except Exception as exc:       # noqa: BLE001 - counted and checked below
                            failures[(i, w)] = exc
                            return
                        acked.append((event.id, event.cursor, i, w, n))
                        if len(acked) >= SERVERS * per_server * each // 4:
                            half_way.set()
                finally:
                    await client.disconnect()

            writing = asyncio.gather(*(write(i, w) for i in range(SERVERS) for w in range(per_server)))
            await asyncio.wait_for(half_way.wait(), WAIT)
            cluster.servers[victim].kill()             # SIGKILL, while the writers go on
            await writing
            return acked, failures

        acked, failures = run(load())

        survivors = [i for i in range(SERVERS) if i != victim]
        # Every writer on the dead server failed once (and then stopped); the others never did.
        assert sorted(failures) == [(victim, w) for w in range(per_server)], failures
        assert all(isinstance(exc, ActaeConnectionError) for exc in failures.values()), failures
        for i in survivors:
            assert sum(1 for *_, s, _, _ in acked if s == i) == per_server * each
            assert http("GET", cluster.url(i) + "/healthz")[0] == 200

        async def read_back(servers):
            clients = [cluster.client(i) for i in servers]
            try:
                return await logs_through_each(clients, channel), await replay_all(clients[0], channel)
            finally:
                for client in clients:
                    await client.disconnect()

        log, events = run(read_back(survivors))
        acked_ids = Counter(event_id for event_id, *_ in acked)
        assert [cursor for cursor, _, _ in log] == list(range(1, len(log) + 1))
        assert Counter(event_id for _, event_id, _ in log) == Counter({event_id: 1 for _, event_id, _ in log})
        assert all(acked_ids[event_id] == 1 for event_id in acked_ids)
        assert set(acked_ids) <= {event_id for _, event_id, _ in log}
        by_id = {e.id: e for e in events}
        assert all(by_id[event_id].cursor == cursor for event_id, cursor, *_ in acked)
        # Beyond the acknowledged writes the log may hold only writes in flight to the victim when
        # it died (committed, answer lost): at most one per writer there.
        unacked = [e for e in events if e.id not in acked_ids]
        assert len(unacked) <= per_server and all(e.payload["s"] == victim for e in unacked), unacked
        assert (sorted((e.payload["s"], e.payload["w"], e.payload["n"]) for e in events)
                == sorted(set((e.payload["s"], e.payload["w"], e.payload["n"]) for e in events)))

        # The killed server, restarted with the same arguments, serves again: reads and writes.
        old = cluster.servers[victim]
        cluster.servers[victim] = start_server(old.data_dir, cluster.database)
        assert cluster.servers[victim].key is None, "a restart must not issue a new key"

        async def after_restart():
            async with Clients(cluster) as clients:
                event = await clients[victim].record(channel, "after", {"s": victim}, actor="w")
                log_after = await logs_through_each(clients, channel)
                return event, log_after

        event, log_after = run(after_restart())
        assert event.cursor == len(log) + 1
        assert log_after == log + [(event.cursor, event.id, "after")]
    finally:
        cluster.stop()
