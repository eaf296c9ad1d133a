"""The foundation, through the real `actae-client` SDK against the real server.

Covers: an `AgentSession` run end to end (events, states, metadata, step index), record and
transition idempotency and guards, the WebSocket (catch-up then live, publish, fan-out without
echo, auth), the edge cases users hit, durability across SIGKILL, restart and key
rotation, and the command line.
"""
from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
from actae_client import ActaeClient, AgentSession, AuthError, SessionCompletedError, VersionConflictError
from actae_client.errors import ActaeError, IdempotencyConflictError

from conftest import ServerProcess, cli, http, poll, replay_all, run, using

STEP_NAMES = ["research", "insights", "risks", "recommendations", "summary", "finalize"]
KEY_RE = re.compile(r"^API key:\s+(sk-[A-Za-z0-9_-]{32,})(\s|$)")
URL_SAFE_ID = re.compile(r"^[A-Za-z0-9._~:-]+$")
RFC3339_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|\+00:00)$")
WS_WAIT = 20  # seconds: a hang guard for frames that never come, not a timing assertion


# --------------------------------------------------------------------------------------------
# AgentSession end to end
# --------------------------------------------------------------------------------------------

def test_agent_session_six_steps_records_states_metadata_and_step_index(with_client, unique):
    channel = unique("run")
    agent = {"step": 0, "notes": []}

    def state_fn():
        return {"step": agent["step"], "notes": list(agent["notes"]), "status": "running"}

    async def scenario(client):
        stepped, snapshots = [], []
        session = AgentSession(client, channel, state_fn=state_fn, snapshot_interval=1)
        async with session:
            assert session.channel_id == channel  # taken from the record response
            for number, name in enumerate(STEP_NAMES, 1):
                agent["step"] = number
                agent["notes"].append(name)
                snapshots.append(state_fn())
                stepped.append(await session.step(name, input={"n": number}, output={"done": name}))
        return (stepped, snapshots, await client.replay(channel, cursor=0, limit=500),
                await client.latest_state(channel), await client.list_states(channel),
                await client.get_state(channel, 3), await client.get_channel_metadata(channel),
                await client.resolve_step(channel, 3), await client.resolve_step(channel, 7),
                await client.latest_step_number(channel), await client.get_cursor(channel),
                await client.list_channels())

    (stepped, snapshots, events, latest, versions, state3, meta, step3, step7,
     last_step, cursor, channels) = with_client(scenario)

    assert [e.event_type for e in events] == ["session.started", *STEP_NAMES, "session.completed"]
    assert [e.cursor for e in events] == list(range(1, 9))
    assert len({e.id for e in events}) == 8 and all(URL_SAFE_ID.match(e.id) for e in events)
    assert all(e.channel_id == channel and RFC3339_UTC.match(e.timestamp) for e in events)
    assert all(e.channel_cursor in (None, e.cursor) for e in events)
    steps = events[1:7]
    assert [(e.id, e.cursor) for e in steps] == [(e.id, e.cursor) for e in stepped]
    for number, (name, event) in enumerate(zip(STEP_NAMES, steps), 1):
        assert event.payload == {"step_number": number, "input": {"n": number}, "output": {"done": name}}
        assert event.actor == "agent_session"
        assert event.metadata == {"step_number": number}  # the inner user metadata
    assert events[-1].payload == {"session_name": channel, "total_steps": 6}
    assert cursor == 8

    assert latest == {"cursor": steps[-1].cursor, "state": snapshots[-1]}
    assert len(versions) == 6
    by_version = sorted(versions, key=lambda v: v["version"])
    assert [v["version"] for v in by_version] == [1, 2, 3, 4, 5, 6]
    assert [v["cursor"] for v in by_version] == [e.cursor for e in steps]
    assert all(isinstance(v.get("timestamp"), str) and v["timestamp"] for v in versions)
    assert state3 == {"cursor": steps[2].cursor, "state": snapshots[2], "version": 3}

    # experiment_metadata comes back exactly as the SDK last wrote it.
    assert meta.experiment_metadata == {
        "session_name": channel, "params": {}, "status": "completed",
        "started_at": events[0].timestamp, "step_count": 6,
        "cursors": [e.cursor for e in steps], "cursors_stored": 6,
    }
    assert (meta.channel_id, meta.display_name, meta.parent_channel_id) == (channel, channel, None)
    assert (meta.origin_run_id, meta.forked_at_cursor) == (channel, 0)

    assert step3 == (channel, steps[2].cursor, steps[2].id)
    assert step7 is None  # not indexed -> 404 -> None
    assert last_step == 6
    assert channel in channels


def test_crashed_session_is_marked_and_resumes_at_the_next_step(with_client, unique):
    """A crash records status and outcome; `resume` continues the numbering."""
    channel = unique("crash")

    async def scenario(client):
        with pytest.raises(RuntimeError):
            async with AgentSession(client, channel, state_fn=lambda: {"k": 1}) as session:
                await session.step("one", output=1)
                await session.step("two", output=2)
                raise RuntimeError("boom")
        crashed = await client.get_channel_metadata(channel)
        resumed = await AgentSession.resume(client, channel)
        async with resumed:
            assert resumed.inherited_state == {"k": 1}
            third = await resumed.step("three", output=3)
        with pytest.raises(SessionCompletedError):
            await AgentSession.resume(client, channel)
        return crashed, third, await client.replay(channel, cursor=0), await client.resolve_step(channel, 3)

    crashed, third, events, step3 = with_client(scenario)
    assert crashed.experiment_metadata["status"] == "crashed"
    assert crashed.experiment_metadata["crash_reason"] == "RuntimeError: boom"
    assert crashed.outcome == "crashed"
    assert third.payload["step_number"] == 3 and step3 == (channel, third.cursor, third.id)
    assert [e.event_type for e in events] == ["session.started", "one", "two", "three", "session.completed"]


@pytest.mark.parametrize("where", ["event payload", "state", "experiment_metadata"])
def test_json_values_round_trip_exactly(with_client, unique, where):
    """Payloads, states and metadata come back exactly: big ints, int vs float, unicode."""
    channel = unique(where.replace(" ", "-").replace("_", "-"))
    value = {"big": 2**63 + 11, "neg_big": -(2**70), "one": 1, "one_float": 1.0, "tiny": 1e-7,
             "text": "é ✓ <a&b> \u2028", "nested": {"list": [1, None, True, "x", {}]}, "empty": []}

    async def scenario(client):
        await client.record(channel, "setup", {"v": 0}, actor="tester")
        if where == "event payload":
            recorded = await client.record(channel, "value", value, actor="tester")
            assert recorded.payload == value
            return (await client.replay(channel, cursor=1))[0].payload
        if where == "state":
            await client.save_state(channel, 1, value)
            return (await client.latest_state(channel))["state"]
        put = await client.update_metadata(channel, experiment_metadata=value)
        assert put.experiment_metadata == value
        return (await client.get_channel_metadata(channel)).experiment_metadata

    got = with_client(scenario)
    assert got == value
    assert type(got["one"]) is int and type(got["one_float"]) is float
    assert got["big"] == 2**63 + 11 and type(got["big"]) is int


def test_metadata_put_is_partial_and_replaces_experiment_metadata(with_client, unique):
    """Only keys present change; `experiment_metadata` is replaced wholesale."""
    channel = unique("meta")

    async def scenario(client):
        await client.record(channel, "x", {}, actor="tester")
        await client.update_metadata(channel, display_name="First", reason="why",
                                     experiment_metadata={"a": 1, "keep": False})
        second = await client.update_metadata(channel, experiment_metadata={"b": 2})
        return second, await client.get_channel_metadata(channel)

    second, fetched = with_client(scenario)
    assert second == fetched
    assert (fetched.display_name, fetched.reason, fetched.experiment_metadata) == ("First", "why", {"b": 2})


# --------------------------------------------------------------------------------------------
# Idempotency and guards
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("retry", ["identical", "keys reordered"])
def test_record_with_same_operation_id_returns_the_original_event(with_client, unique, retry):
    channel = unique("op")
    first_payload = {"a": 1, "b": {"c": [1, 2]}}
    retry_payload = first_payload if retry == "identical" else {"b": {"c": [1, 2]}, "a": 1}

    async def scenario(client):
        first = await client.record(channel, "step", first_payload, actor="t",
                                    operation_id="op-1", step_number=1)
        again = await client.record(channel, "step", retry_payload, actor="t",
                                    operation_id="op-1", step_number=1)
        return first, again, await client.replay(channel, cursor=0), await client.latest_step_number(channel)

    first, again, events, last_step = with_client(scenario)
    assert (again.id, again.cursor) == (first.id, first.cursor) == (first.id, 1)
    assert [(e.id, e.cursor) for e in events] == [(first.id, 1)]
    assert last_step == 1


@pytest.mark.parametrize("change", ["payload", "event_type"])
def test_record_reusing_an_operation_id_for_a_different_request_conflicts(with_client, unique, change):
    channel = unique("conflict")

    async def scenario(client):
        first = await client.record(channel, "step", {"a": 1}, actor="t", operation_id="op-x")
        event_type, payload = ("step", {"a": 2}) if change == "payload" else ("other", {"a": 1})
        with pytest.raises(IdempotencyConflictError):
            await client.record(channel, event_type, payload, actor="t", operation_id="op-x")
        # Operation ids are scoped to a channel: the same id elsewhere is a new event.
        elsewhere = await client.record(unique("conflict-other"), "step", {"a": 2}, actor="t",
                                        operation_id="op-x")
        return first, elsewhere, await client.replay(channel, cursor=0)

    first, elsewhere, events = with_client(scenario)
    assert [e.id for e in events] == [first.id]
    assert elsewhere.cursor == 1 and elsewhere.id != first.id


def test_transition_is_idempotent_and_guarded(with_client, unique):
    channel = unique("transition")

    async def scenario(client):
        first = await client.transition(channel, "phase.one", {"p": 1}, {"s": 1},
                                        operation_id="op-t", expected_version=0)
        again = await client.transition(channel, "phase.one", {"p": 1}, {"s": 1},
                                        operation_id="op-t", expected_version=0)
        assert ((again.event.id, again.event.cursor, again.state_version)
                == (first.event.id, first.event.cursor, first.state_version))
        with pytest.raises(IdempotencyConflictError):
            await client.transition(channel, "phase.one", {"p": 2}, {"s": 1}, operation_id="op-t")
        with pytest.raises(VersionConflictError):
            await client.transition(channel, "phase.two", {"p": 2}, {"s": 2}, expected_version=0)
        second = await client.transition(channel, "phase.two", {"p": 2}, {"s": 2},
                                         expected_version=1, expected_cursor=1)
        with pytest.raises(VersionConflictError):
            await client.transition(channel, "phase.three", {}, {"s": 3}, expected_cursor=1)
        with pytest.raises(VersionConflictError):
            await client.save_state(channel, 2, {"s": 99}, expected_version=5)
        return (first, second, await client.replay(channel, cursor=0),
                await client.list_states(channel), await client.latest_state(channel))

    first, second, events, versions, latest = with_client(scenario)
    assert (first.event.cursor, first.state_version, first.event.event_type) == (1, 1, "phase.one")
    assert first.event.channel_id == channel
    assert (second.event.cursor, second.state_version) == (2, 2)
    assert [e.event_type for e in events] == ["phase.one", "phase.two"]  # rejected writes left nothing
    assert sorted((v["version"], v["cursor"]) for v in versions) == [(1, 1), (2, 2)]
    assert latest == {"cursor": 2, "state": {"s": 2}}


# --------------------------------------------------------------------------------------------
# Events API details and the edge cases users hit
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, expected", [
    ({"cursor": 0}, [1, 2, 3, 4, 5]),
    ({}, [1, 2, 3, 4, 5]),
    ({"cursor": 3}, [4, 5]),                       # exclusive
    ({"cursor": 1, "limit": 2}, [2, 3]),
    ({"cursor": 5}, []),
    ({"cursor": 0, "event_type": "even"}, [2, 4]),
    ({"cursor": 0, "limit": 50000}, [1, 2, 3, 4, 5]),  # clamped, never rejected
])
def test_replay_cursor_limit_and_type_filter(with_client, unique, kwargs, expected):
    channel = unique("replay")

    async def scenario(client):
        for n in range(1, 6):
            await client.record(channel, "even" if n % 2 == 0 else "odd", {"n": n}, actor="t")
        return await client.replay(channel, **kwargs)

    events = with_client(scenario)
    assert [e.cursor for e in events] == expected
    assert [e.payload for e in events] == [{"n": c} for c in expected]


def test_list_channels_puts_the_most_recently_active_first(with_client, unique):
    first, second = unique("first"), unique("second")

    async def scenario(client):
        for channel in (first, second, first):
            await client.record(channel, "x", {}, actor="t")
        return await client.list_channels()

    channels = with_client(scenario)
    assert all(isinstance(c, str) for c in channels)
    assert channels.index(first) < channels.index(second)


def test_channel_written_only_by_record_has_synthesized_root_metadata(with_client, unique):
    channel = unique("raw")

    async def scenario(client):
        event = await client.record(channel, "raw", {"x": 1}, actor="t")
        return event, await client.get_channel_metadata(channel), await client.get_channel_metadata(unique("never"))

    event, meta, missing = with_client(scenario)
    assert (event.cursor, event.channel_id, event.event_type) == (1, channel, "raw")
    assert event.channel_cursor in (None, 1)
    assert meta is not None
    assert ((meta.channel_id, meta.parent_channel_id, meta.origin_run_id, meta.forked_at_cursor)
            == (channel, None, channel, 0))
    assert isinstance(meta.forked_at, str) and meta.forked_at
    assert missing is None  # unknown channel -> 404 -> None


def test_empty_channels_answer_with_nulls_not_errors(with_client, unique):
    events_only, never = unique("events-only"), unique("never-written")

    async def scenario(client):
        await client.record(events_only, "x", {}, actor="t")
        return (await client.latest_state(events_only), await client.latest_state(never),
                await client.get_cursor(never), await client.replay(never, cursor=0),
                await client.get_state(events_only, 1), await client.list_states(events_only),
                await client.latest_step_number(events_only), await client.resolve_step(events_only, 1))

    assert with_client(scenario) == (None, None, None, [], None, [], 0, None)


def test_save_state_at_cursor_zero_on_a_channel_without_events(with_client, unique):
    channel = unique("state0")

    async def scenario(client):
        version = await client.save_state(channel, 0, {"warm": True})
        return (version, await client.latest_state(channel), await client.get_state(channel, 1),
                await client.get_cursor(channel), await client.list_states(channel))

    version, latest, by_version, cursor, versions = with_client(scenario)
    assert version == 1
    assert latest == {"cursor": 0, "state": {"warm": True}}
    assert by_version == {"cursor": 0, "state": {"warm": True}, "version": 1}
    assert cursor is None
    assert [(v["version"], v["cursor"]) for v in versions] == [(1, 0)]


def test_deleted_state_version_is_gone(with_client, unique):
    channel = unique("delete-state")

    async def scenario(client):
        first = await client.save_state(channel, 0, {"v": 1})
        second = await client.save_state(channel, 0, {"v": 2})
        await client.delete_state(channel, first)
        return (first, second, await client.get_state(channel, first), await client.list_states(channel),
                await client.latest_state(channel))

    first, second, deleted, versions, latest = with_client(scenario)
    assert (first, second, deleted) == (1, 2, None)
    assert [v["version"] for v in versions] == [2]
    assert latest == {"cursor": 0, "state": {"v": 2}}


@pytest.mark.parametrize("which, event_type, expected, extra", [
    ("left", "alpha", {("left", 1), ("left", 3)}, {}),
    ("both", None, {("left", 2), ("left", 3)}, {"cursor_start": 2, "cursor_end": 3}),
    ("both", None, {("right", 1)}, {"actor": "right-actor"}),
    ("both", "alpha", {("left", 1), ("left", 3), ("right", 1)}, {}),
    ("left", None, {("left", 1), ("left", 2), ("left", 3)}, {}),
    ("right", "beta", set(), {}),
])
def test_query_filters(with_client, unique, which, event_type, expected, extra):
    left, right = unique("left"), unique("right")
    names = {left: "left", right: "right"}
    channel_ids = {"left": [left], "right": [right], "both": [left, right]}[which]
    alpha, beta = unique("alpha"), unique("beta")  # types unique to this test on the shared server
    types = {"alpha": alpha, "beta": beta, None: None}

    async def scenario(client):
        for channel, kind in [(left, alpha), (left, beta), (left, alpha), (right, alpha)]:
            await client.record(channel, kind, {"k": kind}, actor=f"{names[channel]}-actor")
        return await client.query(channel_ids=channel_ids, event_type=types[event_type], limit=100, **extra)

    events = with_client(scenario)
    assert {(names.get(e.channel_id), e.cursor) for e in events} == expected
    if event_type:
        assert all(e.event_type == types[event_type] for e in events)
    assert len(events) == len(expected)


def test_causal_graph_walks_dependencies_to_ancestors(with_client, unique):
    channel = unique("causal")

    async def scenario(client):
        root = await client.record(channel, "root", {}, actor="t")
        unrelated = await client.record(channel, "unrelated", {}, actor="t")
        child = await client.record(channel, "child", {}, actor="t",
                                    dependencies=[{"event_id": root.id, "dependency_type": "causal"}])
        leaf = await client.record(channel, "leaf", {}, actor="t",
                                   dependencies=[{"event_id": child.id, "dependency_type": "causal"}])
        return root, unrelated, child, leaf, await client.causal_graph(leaf.id)

    root, unrelated, child, leaf, graph = with_client(scenario)
    assert graph["root_event_id"] == leaf.id
    ids = {e["id"] for e in graph["events"]}
    assert {root.id, child.id, leaf.id} <= ids
    assert unrelated.id not in ids
    edges = {(d["event_id"], d["depends_on_event_id"], d["dependency_type"]) for d in graph["dependencies"]}
    assert {(leaf.id, child.id, "causal"), (child.id, root.id, "causal")} <= edges
    assert graph["truncated"] is False


def test_health_readiness_and_metrics_parse(with_client, unique):
    async def scenario(client):
        await client.record(unique("metrics"), "x", {}, actor="t")
        return (await client.health_check(), await client.readiness_check(),
                await client.get_metrics_text(), await client.get_metrics_json())

    health, ready, metrics, snapshot = with_client(scenario)
    assert health.status == "ok" and health.timestamp
    assert all(isinstance(c.status, str) for c in health.components.values())
    # The SDK documents "ok" | "degraded" | "unavailable"; any healthy word is accepted here.
    assert ready.status not in ("degraded", "unavailable", "unknown", "") and ready.database_ready is True
    assert isinstance(metrics, str) and re.search(r"^actae_\w+", metrics, re.M)
    assert snapshot.status == "ok" and isinstance(snapshot.websocket_connections, int)


def test_capabilities_grant_the_single_key_everything(with_client, server, unique):
    """The first key may do everything; the preview never leaks the key."""
    caps = with_client(lambda client: client.capabilities())
    channel = unique("caps")
    assert caps.auth_method == "api_key"
    assert all(check(channel) for check in (caps.can_read, caps.can_write, caps.can_publish, caps.can_fork))
    assert server.key not in repr([caps.key_id, caps.key_source, caps.expires_at])


# --------------------------------------------------------------------------------------------
# WebSocket
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("start", [0, 2])
def test_stream_delivers_earlier_events_then_live_ones_in_cursor_order(make_client, unique, start):
    channel = unique("stream")

    async def scenario():
        async with make_client() as client:
            earlier = [await client.record(channel, "before", {"n": n}, actor="t") for n in (1, 2, 3)]
            stream = client.stream(channel, cursor=start)
            got = [await asyncio.wait_for(stream.__anext__(), WS_WAIT) for _ in earlier[start:]]
            live = [await client.record(channel, "after", {"n": n}, actor="t") for n in (4, 5, 6)]
            got += [await asyncio.wait_for(stream.__anext__(), WS_WAIT) for _ in live]
            await stream.aclose()
            return earlier[start:] + live, got

    sent, got = run(scenario())
    assert [e.cursor for e in got] == list(range(start + 1, 7))
    assert [(e.id, e.event_type, e.payload) for e in got] == [(e.id, e.event_type, e.payload) for e in sent]
    assert all(e.channel_id == channel for e in got)


def test_subscribing_while_writers_are_busy_loses_and_reorders_nothing(make_client, unique):
    """The catch-up replay hands over to live delivery without a gap."""
    channel, writers, each = unique("handover"), 4, 600
    total = writers * each

    async def scenario():
        async with make_client() as reader:
            enough = asyncio.Event()
            written = []

            async def write(number):
                client = make_client()
                try:
                    for n in range(each):
                        await client.record(channel, "tick", {"w": number, "n": n}, actor="t")
                        written.append((number, n))
                        if len(written) == total // 2:
                            enough.set()
                finally:
                    await client.disconnect()

            writing = asyncio.gather(*(write(w) for w in range(writers)))
            await asyncio.wait_for(enough.wait(), WS_WAIT)
            stream = reader.stream(channel, cursor=0)  # catch-up runs while the writers go on
            got = []
            while not got or got[-1].cursor < total:
                got.append(await asyncio.wait_for(stream.__anext__(), WS_WAIT))
            await stream.aclose()
            await writing
            return got

    got = run(scenario())
    assert [e.cursor for e in got] == list(range(1, total + 1))
    assert (sorted((e.payload["w"], e.payload["n"]) for e in got)
            == [(w, n) for w in range(writers) for n in range(each)])


def test_publish_acks_and_reaches_other_subscribers_but_not_the_publisher(make_client, unique):
    channel = unique("pubsub")

    async def scenario():
        async with make_client() as alice, make_client() as bob:
            await alice.record(channel, "seed", {"n": 0}, actor="t")
            inbox = {"alice": asyncio.Queue(), "bob": asyncio.Queue()}
            confirmed = []
            alice.on_subscribed(lambda topic, cursor: confirmed.append((topic, cursor)))
            alice.on_message(lambda topic, ev: inbox["alice"].put_nowait(ev))
            bob.on_message(lambda topic, ev: inbox["bob"].put_nowait(ev))
            await alice.subscribe(channel)
            await bob.subscribe(channel)
            acks = {"alice": [], "bob": []}
            for n, who in enumerate(["alice", "bob", "alice", "bob"], 1):
                acks[who].append(await (alice if who == "alice" else bob).publish(channel, {"n": n}))
            received = {who: [await asyncio.wait_for(q.get(), WS_WAIT) for _ in range(2)]
                        for who, q in inbox.items()}
            assert confirmed == [(channel, 1)]  # the topic's latest cursor
            return acks, received, await alice.replay(channel, cursor=0)

    acks, received, events = run(scenario())
    first = acks["alice"][0]
    assert (first.event_type, first.cursor, first.channel_id, first.payload) == ("broadcast", 2, channel, {"n": 1})
    assert first.id and first.timestamp
    assert [a.cursor for a in acks["alice"]] == [2, 4] and [a.cursor for a in acks["bob"]] == [3, 5]
    # Each side sees only the other's publishes: a server echo would show up first.
    for me, other in [("alice", "bob"), ("bob", "alice")]:
        assert ([(e.id, e.cursor, e.payload, e.event_type) for e in received[me]]
                == [(a.id, a.cursor, a.payload, "broadcast") for a in acks[other]])
    assert [(e.cursor, e.event_type) for e in events] == [(1, "seed")] + [(n, "broadcast") for n in range(2, 6)]


def test_publish_with_operation_id_is_idempotent(make_client, unique):
    channel = unique("pub-op")

    async def scenario():
        async with make_client() as client:
            first = await client.publish(channel, {"v": 1}, operation_id="pub-1")
            again = await client.publish(channel, {"v": 1}, operation_id="pub-1")
            return first, again, await client.replay(channel, cursor=0)

    first, again, events = run(scenario())
    assert (again.id, again.cursor) == (first.id, first.cursor) == (first.id, 1)
    assert [e.id for e in events] == [first.id]


@pytest.mark.parametrize("call", ["list_channels", "replay", "record", "websocket connect"])
def test_wrong_key_raises_auth_error(server, unique, call):
    client = ActaeClient(endpoint=server.url, api_key="sk-wrong-" + "x" * 32, timeout=10)

    async def scenario():
        try:
            with pytest.raises(AuthError) as caught:
                if call == "list_channels":
                    await client.list_channels()
                elif call == "replay":
                    await client.replay(unique("auth"))
                elif call == "record":
                    await client.record(unique("auth"), "x", {}, actor="t")
                else:
                    await client.connect()
            return str(caught.value)
        finally:
            await client.disconnect()

    message = run(scenario())
    # A server that stays silent on a bad key makes the SDK time out instead.
    assert "timed out" not in message.lower()


def test_unsubscribe_stops_delivery(make_client, unique):
    gone, kept = unique("gone"), unique("kept")

    async def scenario():
        async with make_client() as client:
            inbox = asyncio.Queue()
            client.on_message(lambda topic, ev: inbox.put_nowait((topic, ev.cursor)))
            await client.subscribe(gone)
            await client.subscribe(kept)
            await client.unsubscribe(gone)
            # The server answers an unsubscribe before it reads the next frame; a subscribe
            # round-trip after it proves the unsubscribe was processed.
            await client.subscribe(unique("barrier"))
            await client.record(gone, "x", {}, actor="t")  # committed (and fanned out) first
            await client.record(kept, "x", {}, actor="t")
            return await asyncio.wait_for(inbox.get(), WS_WAIT)

    assert run(scenario()) == (kept, 1)


def test_hundred_concurrent_writers_keep_cursors_gapless(make_client, with_client, unique):
    """100 concurrent clients on one channel: gapless cursors, no 5xx, no lost write."""
    channel, writers, each = unique("hundred"), 100, 5

    async def write(number):
        client = make_client()
        try:
            return [(e.id, e.cursor) for e in
                    [await client.record(channel, "w", {"w": number, "n": n}, actor="t") for n in range(each)]]
        finally:
            await client.disconnect()

    async def scenario():
        return [pair for batch in await asyncio.gather(*(write(w) for w in range(writers))) for pair in batch]

    acked = run(scenario())
    events = with_client(lambda c: replay_all(c, channel))
    assert [e.cursor for e in events] == list(range(1, writers * each + 1))
    assert sorted(acked, key=lambda pair: pair[1]) == [(e.id, e.cursor) for e in events]


# --------------------------------------------------------------------------------------------
# Durability, restart, key rotation, command line
# --------------------------------------------------------------------------------------------

def test_acknowledged_writes_survive_sigkill(tmp_path):
    with ServerProcess(tmp_path).start() as srv:
        key, channel, writers, kill_after = srv.key, "durable", 20, 150
        acked: list[tuple[str, int, dict]] = []
        outcomes: list[str] = []
        killed = []

        async def writer(number):
            client = ActaeClient(endpoint=srv.url, api_key=key, timeout=15)
            try:
                for n in range(10_000):
                    payload = {"writer": number, "n": n}
                    try:
                        event = await client.record(channel, "write", payload, actor=f"w{number}")
                    except ActaeError as exc:
                        outcomes.append("cut off" if killed else f"failed before the kill: {exc!r}")
                        return
                    acked.append((event.id, event.cursor, payload))
                    if len(acked) == kill_after:
                        srv.proc.kill()  # SIGKILL while the other writers have requests in flight
                        killed.append(len(acked))
                outcomes.append("finished")
            finally:
                await client.disconnect()

        async def write_all():
            await asyncio.gather(*(writer(n) for n in range(writers)))

        run(write_all())
        srv.kill()  # no-op after the SIGKILL above; ends a server that stopped acknowledging
        assert killed, f"the server stopped acknowledging after {len(acked)} writes: {outcomes}"
        assert outcomes == ["cut off"] * writers, outcomes  # every writer was mid-way at the kill
        with ServerProcess(tmp_path).start() as restarted:
            assert restarted.key is None

            async def read_back(client):
                events = await replay_all(client, channel)
                return events, await client.record(channel, "after-restart", {}, actor="t")

            events, after = using(restarted, read_back, key=key)

    assert len(acked) >= kill_after
    assert [e.cursor for e in events] == list(range(1, len(events) + 1))
    stored = {e.id: (e.cursor, e.payload) for e in events}
    lost = [(i, c) for i, c, p in acked if stored.get(i) != (c, p)]
    assert not lost, f"{len(lost)} acknowledged events lost or changed, e.g. {lost[:3]}"
    assert after.cursor == len(events) + 1


def test_restart_keeps_the_key_and_never_prints_it_again(tmp_path, unique):
    with ServerProcess(tmp_path).start() as first:
        key = first.key
        assert key and re.fullmatch(r"sk-[A-Za-z0-9_-]{32,}", key)
        key_lines = [line for line in first.lines if line.startswith("API key:")]
        assert len(key_lines) == 1 and "shown once" in key_lines[0]
        status, _, _ = http("POST", first.url + "/api/v1/events/record", key=key, body={
            "channel_id": "kept", "event_type": "x", "payload": {"v": 1},
            "metadata": {"actor": "t", "agent_id": None, "user_id": None, "metadata": None}})
        assert status < 300

    with ServerProcess(tmp_path).start() as second:
        assert second.key is None
        assert any(line.startswith("API key:") for line in second.lines)
        assert not any("sk-" in line for line in second.lines)
        status, _, body = http("GET", second.url + "/api/v1/events/replay/kept?limit=10", key=key)
        assert status == 200 and [e["payload"] for e in body["events"]] == [{"v": 1}]


def rotate(data_dir):
    """Run `actae.py key rotate`; return the new key it printed."""
    done = cli("key", "rotate", data_dir=data_dir)
    keys = [m.group(1) for line in done.stdout.splitlines() if (m := KEY_RE.match(line))]
    assert len(keys) == 1, done.stdout
    return keys[0]


def refused(url: str, key: str, seconds: float) -> None:
    """`key` gets 401 within `seconds` (a running server re-reads its keys every second)."""
    poll(lambda: http("GET", url + "/api/v1/channels", key=key)[0] == 401, seconds,
         what=f"the old key to be refused (still accepted after {seconds} s)")


@pytest.mark.parametrize("server_state", ["stopped", "running"])
def test_key_rotate_revokes_the_old_key(tmp_path, server_state):
    with ServerProcess(tmp_path).start() as first:
        old = first.key
        if server_state == "stopped":
            first.stop()
        new = rotate(tmp_path)
        # Stopped: a restart after the rotation; running: the same server, told nothing.
        with ServerProcess(tmp_path).start() if server_state == "stopped" else first as srv:
            if server_state == "stopped":
                assert srv.key is None
            assert new != old
            refused(srv.url, old, 1.5)
            assert http("GET", srv.url + "/api/v1/channels", key=new)[0] == 200

            async def old_key_over_sdk(client):
                with pytest.raises(AuthError):
                    await client.list_channels()

            using(srv, old_key_over_sdk, key=old)


def test_env_api_key_is_accepted_and_never_printed(tmp_path):
    env_key = "sk-from-env-" + "e" * 32
    with ServerProcess(tmp_path, env={"ACTAE_API_KEY": env_key}).start() as srv:
        assert not any(env_key in line for line in srv.lines)
        assert http("GET", srv.url + "/api/v1/channels", key=env_key)[0] == 200
    assert not any(env_key in line for line in srv.lines)


@pytest.mark.parametrize("flag, expected", [
    ("--version", [r"\d+\.\d+"]),
    ("--help", ["--host", "--port", "--data-dir", "--version"]),
])
def test_command_line_flags(flag, expected):
    done = cli(flag)
    for pattern in expected:
        assert re.search(pattern, done.stdout), done.stdout


def test_an_open_websocket_stops_working_when_its_key_is_rotated(tmp_path):
    import websockets

    async def scenario(srv):
        async with websockets.connect(srv.url.replace("http://", "ws://") + "/ws") as ws:
            await ws.recv()                                                   # connected
            await ws.send(json.dumps({"type": "auth", "api_key": srv.key}))
            assert json.loads(await ws.recv())["event"] == "authenticated"
            rotate(tmp_path)
            started = time.monotonic()
            # Unasked, within about a second (the keys are re-read each half second while a stream is
            # open): the reason, then a close with 1008 (policy violation).
            answer = json.loads(await asyncio.wait_for(ws.recv(), timeout=10))
            assert answer["type"] == "error" and "revoked" in answer["message"], answer
            await asyncio.wait_for(ws.wait_closed(), timeout=10)
            assert ws.close_code == 1008 and time.monotonic() - started < 5

    with ServerProcess(tmp_path).start() as srv:
        run(scenario(srv))
