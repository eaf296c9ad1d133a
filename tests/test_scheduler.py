"""Scheduler wake-ups and human approvals, with the real SDK against the real server."""
from datetime import datetime, timedelta, timezone

from conftest import ServerProcess, http, poll, using


async def wait_for_status(client, wakeup_id, status, seconds=10.0):
    async def reached():
        wakeup = await client.get_wakeup(wakeup_id)
        return wakeup if wakeup.status == status else None
    return await poll(reached, seconds, what=f"wake-up {wakeup_id} to become {status}", every=0.1)


def test_a_wakeup_fires_once_as_a_scheduler_event(with_client, unique):
    channel = unique("wake")

    async def scenario(client):
        due = datetime.now(timezone.utc) + timedelta(seconds=0.5)
        wakeup = await client.schedule_wakeup(channel, due, payload={"reason": "retry"})
        assert wakeup.status == "pending" and wakeup.channel_id == channel
        fired = await wait_for_status(client, wakeup.id, "done")
        assert fired.executed_at and fired.attempts == 1
        events = await client.replay(channel, limit=100)
        assert [e.event_type for e in events] == ["scheduler.wakeup"]
        assert events[0].payload["reason"] == "retry" and events[0].payload["wakeup_id"] == wakeup.id
        assert await client.cancel_wakeup(wakeup.id) is False          # already fired

    with_client(scenario)


def test_cancel_list_and_unknown_wakeups(with_client, unique):
    channel = unique("cancel")

    async def scenario(client):
        later = await client.schedule_wakeup(channel, "2999-01-01T00:00:00+00:00")
        assert await client.cancel_wakeup(later.id) is True
        assert await client.cancel_wakeup(later.id) is False
        cancelled = await client.list_wakeups(channel_id=channel, status="cancelled")
        assert [w.id for w in cancelled] == [later.id]
        assert await client.list_wakeups(channel_id=channel, status="pending") == []
        assert await client.get_wakeup("no-such-wakeup") is None
        assert await client.replay(channel, limit=10) == []

    with_client(scenario)


def test_bad_wakeups_are_refused(server, unique):
    url = server.url + "/api/v1/scheduler/wakeups"
    for body in ({"channel_id": unique("bad"), "run_at": "tomorrow"},
                 {"channel_id": unique("bad"), "run_at": "2030-01-01T00:00:00"},   # no zone
                 {"channel_id": "a b", "run_at": "2030-01-01T00:00:00Z"},
                 {"channel_id": unique("bad"), "run_at": "2030-01-01T00:00:00Z", "payload": [1]}):
        status, _, error = http("POST", url, key=server.key, body=body)
        assert status == 400 and error["status"] == "bad_request" and error["error"]
    status, _, error = http("GET", url + "?status=sleeping", key=server.key)
    assert status == 400


def test_a_pending_wakeup_survives_a_restart(tmp_path):
    async def schedule(client):
        due = datetime.now(timezone.utc) + timedelta(seconds=2)
        wakeup = await client.schedule_wakeup("restart-wake", due)
        return wakeup.id

    with ServerProcess(tmp_path).start() as first:
        key = first.key
        wakeup_id = using(first, schedule)

    async def check(client):
        await wait_for_status(client, wakeup_id, "done")
        events = await client.replay("restart-wake", limit=10)
        assert [e.event_type for e in events] == ["scheduler.wakeup"]

    with ServerProcess(tmp_path).start() as second:
        using(second, check, key=key)


def test_an_approval_round_trip_is_durable_and_idempotent(with_client, unique):
    channel = unique("approval")

    async def scenario(client):
        request_id = await client.request_approval(channel, summary="refund 49 EUR?", timeout_seconds=60)
        pending = await client.list_wakeups(channel_id=channel, status="pending")
        assert [w.payload["approval_request_id"] for w in pending] == [request_id]
        first = await client.decide_approval(channel, request_id, decision="approved", actor="alice")
        again = await client.decide_approval(channel, request_id, decision="approved", actor="alice")
        assert again.id == first.id and again.cursor == first.cursor
        decided = await client.wait_for_approval(channel, request_id, timeout_seconds=5, poll_interval=0.05)
        assert decided.payload["decision"] == "approved"
        types = [e.event_type for e in await client.replay(channel, limit=100)]
        assert types == ["approval.requested", "approval.decided"]

    with_client(scenario)
