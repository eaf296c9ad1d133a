"""Every public ActaeClient method is exercised by some test that checks its answer.

`test_every_client_method_is_called_by_a_test` lists the SDK's methods and finds a call of each
in tests/; the tests below cover the ones no other module calls (the blocking twins, the
execution-group message calls, `latest_cursor`, and the reconnect callbacks).
"""
from __future__ import annotations

import asyncio
import inspect
import re
from pathlib import Path

from actae_client import ActaeClient

from conftest import ServerProcess, poll, run

TESTS = Path(__file__).resolve().parent
# The hosted fleet gateway lives in FleetClient, not ActaeClient; nothing of it is excluded here.
NOT_A_SERVER_CALL: set = set()


def client_methods() -> list:
    return sorted(name for name, member in inspect.getmembers(ActaeClient)
                  if not name.startswith("_") and callable(member) and name not in NOT_A_SERVER_CALL)


def test_every_client_method_is_called_by_a_test():
    text = "\n".join(path.read_text() for path in TESTS.glob("test_*.py"))
    uncalled = [name for name in client_methods() if not re.search(rf"\.{name}\(", text)]
    assert len(client_methods()) > 90
    assert uncalled == [], f"ActaeClient methods no test calls: {uncalled}"


def test_the_blocking_twins(server, unique):
    """record_sync and friends run the async calls on a loop of their own, from plain code."""
    channel, fork = unique("sync"), unique("sync-fork")
    client = ActaeClient(endpoint=server.url, api_key=server.key)
    try:
        first = client.record_sync(channel, "agent.step", {"step": 1}, actor="sync")
        assert (first.cursor, first.event_type, first.payload) == (1, "agent.step", {"step": 1})
        assert client.save_state_sync(channel, first.cursor, {"done": 1}) == 1
        moved = client.transition_sync(channel, "agent.step", {"step": 2}, {"done": 2}, actor="sync")
        assert moved.event.cursor == 2 and moved.state_version == 2
        assert client.get_cursor_sync(channel) == 2
        assert client.latest_state_sync(channel)["state"] == {"done": 2}
        assert [e.cursor for e in client.replay_sync(channel)] == [1, 2]
        assert {e.cursor for e in client.query_sync(channel_ids=[channel])} == {1, 2}
        receipt = client.fork_sync(channel, fork, 1)
        assert receipt.child_channel_id == fork and receipt.resolved_cursor == 1
        diff = client.diff_states_sync(channel, fork)
        assert diff["left"]["state"] == {"done": 2} and diff["right"]["state"] == {"done": 1}
        trail = client.decision_trail_sync(fork)
        assert trail["channel_id"] == fork and trail["boundary"]["cursor"] == 1
    finally:
        client.disconnect_sync()
    assert client.get_cursor_sync(channel) == 2          # a disconnected client still makes HTTP calls
    client.disconnect_sync()


def test_group_messages_through_the_client_calls(with_client, unique):
    group = unique("msgs")

    async def body(client):
        await client.create_execution_group(group)
        await client.add_execution_group_member(group, "a", unique("a"))
        await client.add_execution_group_member(group, "b", unique("b"))
        sent = await client.send_group_message(group, "a", "b", "handoff", {"todo": 1}, operation_id="m-1")
        assert (sent.group_id, sent.from_member_id, sent.to_member_id, sent.message_type) == (group, "a", "b",
                                                                                           "handoff")
        again = await client.send_group_message(group, "a", "b", "handoff", {"todo": 1}, operation_id="m-1")
        assert again.message_id == sent.message_id
        inbox = await client.group_messages(group, "b")
        assert [(m.message_id, m.payload) for m in inbox] == [(sent.message_id, {"todo": 1})]
        assert await client.group_messages(group, "b", after=sent.message_id) == []
        assert await client.group_messages(group, "a") == []
        assert await client.latest_cursor(unique("b")) == await client.get_cursor(unique("b")) == 1
        assert await client.latest_cursor(unique("never-written")) is None

    with_client(body)


def test_reconnect_callbacks_fire_when_the_server_restarts(tmp_path):
    seen = []

    async def reconnected():
        return "reconnected" in seen

    async def scenario(srv):
        key, port = srv.key, int(srv.url.rsplit(":", 1)[1])
        client = ActaeClient(endpoint=srv.url, api_key=key)
        client.on_disconnected(lambda: seen.append("disconnected"))
        client.on_reconnect(lambda: seen.append("reconnected"))
        await client.connect()
        await client.subscribe("reconnecting", cursor=0)
        await asyncio.to_thread(srv.stop)
        restarted = ServerProcess(tmp_path, port=port)
        try:
            await asyncio.to_thread(restarted.start)
            await poll(reconnected, 30, what="the client to reconnect to the restarted server", every=0.1)
            await client.record("reconnecting", "t", {"after": True}, actor="a")
        finally:
            await client.disconnect()
            await asyncio.to_thread(restarted.stop)

    with ServerProcess(tmp_path).start() as srv:
        run(scenario(srv))
    assert seen[:2] == ["disconnected", "reconnected"], seen
