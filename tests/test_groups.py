"""Consumer groups and execution groups, with the real SDK against the real server."""
import asyncio

import pytest
from actae_client.errors import APIError, ChannelConflictError, ConsumerError, ExecutionNotOwnedError, IdempotencyConflictError

from conftest import http


async def record_n(client, channel, n):
    return [await client.record(channel, "work.item", {"i": i}, actor="producer") for i in range(n)]


def test_a_consumer_group_delivers_at_least_once_and_resumes_from_its_ack(with_client, unique):
    channel, group = unique("log"), unique("workers")

    async def scenario(client):
        await record_n(client, channel, 5)
        info = await client.create_group(group, channel, metadata={"team": "a"})
        assert info.channel_id == channel and info.metadata == {"team": "a"}
        with pytest.raises(ConsumerError):
            await client.claim_work(group, "w1")                     # no lease yet
        joined = await client.join_group(group, "w1", lease_seconds=30)
        assert joined.last_cursor == 0 and joined.claimed_cursor == 0
        work = await client.claim_work(group, "w1", limit=3)
        assert [e.cursor for e in work.events] == [1, 2, 3]
        again = await client.claim_work(group, "w1", limit=3)       # unacked: handed back, not skipped
        assert [e.cursor for e in again.events] == [1, 2, 3]
        await client.ack_work(group, "w1", 2)
        work = await client.claim_work(group, "w1", limit=10)
        assert [e.cursor for e in work.events] == [3]
        await client.ack_work(group, "w1", 3)
        work = await client.claim_work(group, "w1", limit=10)
        assert [e.cursor for e in work.events] == [4, 5]
        offsets = await client.group_offsets(group)
        assert [(o.consumer_id, o.last_cursor, o.claimed_cursor) for o in offsets] == [("w1", 3, 5)]
        assert [g.group_id for g in await client.list_groups(channel_id=channel)] == [group]
        await client.delete_group(group)
        assert await client.list_groups(channel_id=channel) == []

    with_client(scenario)


def test_competing_consumers_split_work_and_a_lapsed_lease_is_redelivered(with_client, unique):
    channel, group = unique("log"), unique("pool")

    async def scenario(client):
        await record_n(client, channel, 6)
        await client.create_group(group, channel)
        await client.join_group(group, "slow", lease_seconds=1)
        await client.join_group(group, "fast", lease_seconds=30)
        first = await client.claim_work(group, "slow", limit=3)
        second = await client.claim_work(group, "fast", limit=3)
        assert [e.cursor for e in first.events] == [1, 2, 3]
        assert [e.cursor for e in second.events] == [4, 5, 6]
        await client.ack_work(group, "fast", 6)                      # done, but 1..3 are not: no watermark yet
        # Each consumer reports its own last acknowledged cursor, not the group's watermark.
        assert {o.consumer_id: o.last_cursor for o in await client.group_offsets(group)} == {"fast": 6, "slow": 0}
        with pytest.raises(APIError) as beyond:
            await client.ack_work(group, "fast", 7)                  # never claimed: cannot be acked
        assert beyond.value.status_code == 409
        await asyncio.sleep(1.3)            # time must pass: "slow" crashed, and its 1 s lease lapses
        with pytest.raises(ConsumerError):
            await client.heartbeat(group, "slow", lease_seconds=30)
        redelivered = await client.claim_work(group, "fast", limit=10)
        assert [e.cursor for e in redelivered.events] == [1, 2, 3]   # the crashed consumer's batch
        await client.ack_work(group, "fast", 3)
        # At-least-once: taking over the crashed range replaced fast's finished one, so 4..6 come again.
        again = await client.claim_work(group, "fast", limit=10)
        assert [e.cursor for e in again.events] == [4, 5, 6]
        await client.ack_work(group, "fast", 6)
        assert {o.consumer_id: o.last_cursor for o in await client.group_offsets(group)}["fast"] == 6
        await client.join_group(group, "slow", lease_seconds=30)     # back, but its old batch is gone
        assert (await client.claim_work(group, "slow", limit=10)).events == []

    with_client(scenario)


def test_execution_group_leases_fence_stale_owners(with_client, unique):
    group = unique("crew")

    async def scenario(client):
        created = await client.create_execution_group(group, metadata={"goal": "triage"})
        assert created.group_id == group and created.metadata == {"goal": "triage"}
        await client.add_execution_group_member(group, "planner", unique("planner"), role="lead")
        members = await client.execution_group_members(group)
        assert [(m.member_id, m.role, m.generation) for m in members] == [("planner", "lead", 0)]
        lease = await client.claim_member(group, "planner", "owner-a", lease_seconds=1)
        assert lease.generation == 1 and lease.owner_id == "owner-a"
        with pytest.raises(ExecutionNotOwnedError):
            await client.claim_member(group, "planner", "owner-b")     # live lease elsewhere
        await asyncio.sleep(1.2)            # time must pass: owner-a's 1 s lease lapses
        taken = await client.claim_member(group, "planner", "owner-b", lease_seconds=30)
        assert taken.generation == 2
        with pytest.raises(ExecutionNotOwnedError):
            await client.heartbeat_member(group, "planner", "owner-a", 1)
        renewed = await client.heartbeat_member(group, "planner", "owner-b", 2, lease_seconds=30)
        assert renewed.generation == 2
        await client.release_member(group, "planner", "owner-b", 2)
        assert (await client.claim_member(group, "planner", "owner-c")).generation == 3
        assert group in [g.group_id for g in await client.list_execution_groups()]

    with_client(scenario)


def test_group_messages_are_durable_ordered_idempotent_and_acknowledged(with_client, unique):
    group = unique("chat")

    async def scenario(client):
        session = client.execution_group(group)
        await client.create_execution_group(group)
        await client.add_execution_group_member(group, "a", unique("a"))
        await client.add_execution_group_member(group, "b", unique("b"))
        first = await session.member("a").send("b", "task", {"n": 1}, operation_id="op-1")
        again = await session.member("a").send("b", "task", {"n": 1}, operation_id="op-1")
        assert again.message_id == first.message_id
        with pytest.raises(IdempotencyConflictError):
            await session.member("a").send("b", "task", {"n": 2}, operation_id="op-1")
        second = await session.member("a").send("b", "task", {"n": 2}, causal_context={"why": "follow-up"})
        inbox = await session.member("b").messages()
        assert [m.message_id for m in inbox] == [first.message_id, second.message_id]
        assert [m.message_id for m in await session.member("b").messages(after=first.message_id)] == [second.message_id]
        assert await session.member("a").messages() == []
        delivered = await client.replay(unique("b"), limit=10)
        assert [e.event_type for e in delivered] == ["message.received", "message.received"]
        assert delivered[0].id == first.delivery_event_id and delivered[0].payload["to"] == {"member": "b"}
        sent = await client.replay(unique("a"), limit=10)
        assert [e.id for e in sent] == [first.source_event_id, second.source_event_id]
        async with session.claim_member("b", lease_seconds=30) as member:
            acked = await member.acknowledge(inbox[0])
            assert acked.status == "acknowledged" and acked.acknowledged_at
            waited = await member.wait_for("task", timeout=5)
            assert waited.message_id == first.message_id
        with pytest.raises(ExecutionNotOwnedError):
            await client.acknowledge_group_message(second.message_id, "nobody", 99)

    with_client(scenario)


def test_a_group_fork_forks_members_at_their_boundaries_and_promotes_one(with_client, unique):
    group, fork_group = unique("team"), unique("team-fork")
    writer_channel, reviewer_channel = unique("writer"), unique("reviewer")

    async def scenario(client):
        await client.create_execution_group(group)
        await client.add_execution_group_member(group, "writer", writer_channel)
        await client.add_execution_group_member(group, "reviewer", reviewer_channel)
        cursors = []
        for draft in range(3):
            event = await client.record(writer_channel, "draft", {"v": draft}, actor="writer")
            await client.save_state(writer_channel, event.cursor, {"draft": draft})
            cursors.append(event.cursor)
        await client.save_state(reviewer_channel, 0, {"notes": []})
        fork = await client.fork_execution_group(fork_group, group, "writer", cursors[1],
                                                 member_policies={"reviewer": "share"},
                                                 tool_policies={"publish": "block"})
        writer = fork["members"]["writer"]
        assert writer["policy"] == "fork" and writer["receipt"]["resolved_cursor"] == cursors[1]
        assert fork["members"]["reviewer"] == {"policy": "share", "source_channel_id": reviewer_channel,
                                               "channel_id": reviewer_channel, "receipt": None}
        assert (await client.latest_state(writer["channel_id"]))["state"] == {"draft": 1}
        assert await client.fork_execution_group(fork_group, group, "writer", cursors[1],
                                                 member_policies={"reviewer": "share"},
                                                 tool_policies={"publish": "block"}) == fork
        assert await client.get_execution_group_fork(fork_group) == fork
        await client.save_state(writer["channel_id"], 1, {"draft": "better"})
        promoted = await client.promote_execution_group_fork_member(fork_group, "writer")
        assert promoted["promoted"] == ["writer"]
        assert (await client.latest_state(writer_channel))["state"] == {"draft": "better"}
        members = {m.member_id: m.channel_id for m in await client.execution_group_members(fork_group)}
        assert members == {"writer": writer["channel_id"], "reviewer": reviewer_channel}

    with_client(scenario)


@pytest.mark.parametrize("path, body", [
    ("/api/v1/groups", {"group_id": "g", "channel_id": "a b"}),
    ("/api/v1/groups/{g}/join", {"consumer_id": "w", "lease_seconds": 0}),
    ("/api/v1/groups/{g}/ack", {"consumer_id": "w", "cursor": -1}),
    ("/api/v1/execution-groups", {"group_id": "has space"}),
    ("/api/v1/execution-groups/{g}/members", {"member_id": "m", "channel_id": "c", "metadata": [1]}),
    ("/api/v1/execution-group-forks", {"fork_group_id": "f", "source_group_id": "s",
                                       "intervention_member_id": "m", "intervention_cursor": 1,
                                       "member_policies": {"m": "clone"}}),
    ("/api/v1/groups/{g}/work", {"consumer_id": "w", "limit": "9" * 5000}),
])
def test_bad_group_requests_are_400(server, unique, path, body):
    status, _, error = http("POST", server.url + path.replace("{g}", unique("g")), key=server.key, body=body)
    assert status == 400 and error["status"] == "bad_request" and error["error"]


def test_group_forks_refuse_policies_they_cannot_honour(server, with_client, unique):
    group = unique("src")

    async def scenario(client):
        await client.create_execution_group(group)
        await client.add_execution_group_member(group, "writer", unique("writer"))
        for policies in ({"nobody": "share"}, {"writer": "share"}):
            status, _, error = http("POST", server.url + "/api/v1/execution-group-forks", key=server.key,
                                    body={"fork_group_id": unique("f"), "source_group_id": group,
                                          "intervention_member_id": "writer", "intervention_cursor": 0,
                                          "member_policies": policies, "tool_policies": {}})
            assert status == 400 and error["status"] == "bad_request", error

    with_client(scenario)


def test_a_channel_in_use_by_a_group_is_not_deleted(with_client, unique):
    channel, group = unique("log"), unique("readers")

    async def scenario(client):
        await record_n(client, channel, 2)
        await client.create_group(group, channel)
        with pytest.raises(ChannelConflictError):
            await client.delete_channel(channel)
        assert len(await client.replay(channel, limit=10)) == 2
        await client.delete_group(group)
        await client.delete_channel(channel)
        assert await client.replay(channel, limit=10) == []

    with_client(scenario)
