"""Retention: `actae prune`, POST /api/v1/admin/prune and --retain-days, on a server of this module's own.

200 runs (roots, forks, forks of forks and one level more), most of them made old by editing their
last activity; one old run waits for an approval, one holds a live claim, one has a pending
wake-up, one is read by a consumer group, and a few recent forks hang below old runs. The test
works out on its own which runs the rules let go (old, nothing needs them, and no kept run below
them), then: the dry run names exactly those and deletes nothing; the prune deletes exactly those
(beside the running server); every kept run still verifies its chain and forks with the receipt
sha256 its state had before; on SQLite the file shrinks. The daily prune runs at start and again
a day later (an injected clock), and the server's --retain-days prunes at start.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from conftest import (BACKEND, ROOT, ServerProcess, cli, database_url_for, http, poll, query_database,
                      state_sha256, using)

OLD = "2000-01-01T00:00:00.000Z"
STATE_BYTES = 3000                    # each snapshot: enough that deleting 150 runs frees whole pages


def padding(name: str, step: int) -> str:
    return hashlib.sha256(f"{name}:{step}".encode()).hexdigest() * (STATE_BYTES // 64)


async def make_run(client, name: str, steps: int, parent=None, at_cursor: int = 0) -> None:
    if parent is not None:
        await client.fork(parent, name, at_cursor)
    for step in range(1, steps + 1):
        event = await client.record(name, "step", {"step_number": step, "input": None, "output": {"n": step}},
                                    actor="agent", step_number=step)
        await client.save_state(name, event.cursor, {"status": "running", "step": step, "blob": padding(name, step)})


def names():
    roots = [f"r{i}" for i in range(130)]
    forks = {f"f{i}": f"r{i}" for i in range(40)}
    forks.update({f"ff{i}": f"f{i}" for i in range(20)})
    forks.update({f"fff{i}": f"ff{i}" for i in range(10)})
    return roots, forks


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("actae-prune")).start() as server:
        yield server


@pytest.fixture(scope="module")
def world(srv):
    """The 200 runs and what is special about them; {"all", "parent", "old", "protected", ...}."""
    roots, forks = names()
    assert len(roots) + len(forks) == 200

    async def main(client):
        await asyncio.gather(*(make_run(client, r, 3) for r in roots))
        for level in ("f", "ff", "fff"):
            await asyncio.gather(*(make_run(client, child, 1, parent, 2) for child, parent in forks.items()
                                   if child.rstrip("0123456789") == level))
        await client.request_approval("r5", summary="keep me: waiting")
        claim = await client.claim_execution("r7", "pay-1", "charge", {"cents": 100}, lease_seconds=3600)
        assert claim.status == "claimed"
        lapsed = await client.claim_execution("r13", "pay-1", "charge", {"cents": 100}, lease_seconds=1)
        assert lapsed.status == "claimed"
        await client.schedule_wakeup("ff3", datetime.now(timezone.utc) + timedelta(days=1))
        await client.create_group("g-r11", "r11")
        request_id = await client.request_approval("r15", summary="times out", timeout_seconds=1)
        done_approval = await client.request_approval("r17", summary="decided")
        await client.decide_approval("r17", done_approval, decision="approved", actor="ops")
        return request_id
    timed_out = using(srv, main)

    def expired():
        _, _, body = http("GET", f"{srv.url}/api/v1/approvals?channel_id=r15", key=srv.key)
        _, _, wakeups = http("GET", f"{srv.url}/api/v1/scheduler/wakeups?channel_id=r15", key=srv.key)
        return body["approvals"][0]["status"] == "expired" and all(w["status"] != "pending" for w in wakeups["wakeups"])
    poll(expired, 30, every=0.1, what="r15's approval to time out and its wake-up to fire")
    # Time itself must pass here: r13's 1-second lease lapses by the clock, and nothing records it.
    time.sleep(1.1)
    assert timed_out
    everything = set(roots) | set(forks)
    recent = {f"r{i}" for i in range(100, 130)} | {"f3", "ff5", "fff2", "f30"}
    old = everything - recent
    for channel in old:
        query_database(srv, "UPDATE channels SET updated_at = ? WHERE id = ?", (OLD, channel))
    return {"all": everything, "parent": dict(forks), "old": old,
            "protected": {"r5": "pending approval", "r7": "live claim", "ff3": "pending wake-up",
                          "r11": "consumer group"}}


def expected_deletions(world) -> set:
    """The rules, worked out here: old and not protected, and no kept run below it."""
    kept = (world["all"] - world["old"]) | set(world["protected"])
    for run_id in list(kept):
        parent = world["parent"].get(run_id)
        while parent is not None:                        # every ancestor of a kept run is kept
            kept.add(parent)
            parent = world["parent"].get(parent)
    return world["all"] - kept


def channels(srv) -> set:
    _, _, body = http("GET", srv.url + "/api/v1/channels", key=srv.key)
    return set(body["channels"])


def prune_cli(srv, *args):
    """`actae prune ARGS` on the server's data dir, beside it; the finished process (any exit code)."""
    return cli("prune", *args, data_dir=srv, timeout=300, check=False)


def disk_bytes(srv) -> int:
    return sum(p.stat().st_size for p in Path(srv.data_dir).glob("actae.db*") if not p.name.endswith("-shm"))


def test_prune_deletes_exactly_what_the_rules_allow(srv, world):
    doomed = expected_deletions(world)
    assert 100 < len(doomed) < 190 and not doomed & set(world["protected"])
    assert {"r13", "r15", "r17"} <= doomed                # a lapsed claim, an expired and a decided approval
    assert not doomed & {"r3", "f3", "r5", "ff3", "f3", "r7"}
    kept = world["all"] - doomed
    shas = {}
    for run_id in kept:
        _, _, state = http("GET", f"{srv.url}/api/v1/state/{run_id}", key=srv.key)
        shas[run_id] = (state["cursor"], state_sha256(state["state"]))
    events = dict(query_database(srv, "SELECT c.id, COALESCE(MAX(e.cursor), 0) FROM channels c"
                                      " LEFT JOIN events e ON e.channel_id = c.id GROUP BY c.id"))

    dry = prune_cli(srv, "--older-than", "30", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["dry_run"] is True and set(plan["deleted"]) == doomed
    reasons = {k["channel_id"]: k["reason"] for k in plan["kept"]}
    assert "pending approval" in reasons["r5"] and "live claim" in reasons["r7"]
    assert "pending wake-up" in reasons["ff3"] and "consumer group" in reasons["r11"]
    assert "ancestor of f3" in reasons["r3"]
    assert plan["rows"]["runs"] == len(doomed) and plan["rows"]["events"] == sum(events[d] for d in doomed)
    assert channels(srv) == world["all"]

    size_before = disk_bytes(srv)
    done = prune_cli(srv, "--older-than", "30", "--json")          # beside the running server
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["dry_run"] is False and set(answer["deleted"]) == doomed
    assert answer["rows"] == plan["rows"] and answer["rows"]["approvals"] == 2   # r15's and r17's
    assert channels(srv) == kept
    for run_id in doomed:
        assert http("GET", f"{srv.url}/api/v1/channels/{run_id}/metadata", key=srv.key)[0] == 404
    leftovers = query_database(srv, "SELECT COUNT(*) FROM events WHERE channel_id NOT IN (SELECT id FROM channels)")
    assert leftovers == [(0,)]
    assert query_database(srv, "SELECT COUNT(*) FROM wakeups WHERE channel_id = 'r15'") == [(0,)]
    if BACKEND == "sqlite":
        assert answer["bytes_freed"] > 0 and answer["bytes_after"] < answer["bytes_before"]
        assert disk_bytes(srv) < size_before, (size_before, disk_bytes(srv))
    else:
        assert "VACUUM (FULL" in answer["space"]

    for run_id in sorted(kept):
        status, _, verdict = http("GET", f"{srv.url}/api/v1/events/verify/{run_id}", key=srv.key)
        assert status == 200 and verdict["ok"] is True, (run_id, verdict)
        cursor, sha = shas[run_id]
        status, _, receipt = http("POST", srv.url + "/api/v1/channels/fork", key=srv.key,
                                  body={"source_channel_id": run_id, "new_channel_id": f"after-{run_id}",
                                        "at_cursor": cursor})
        assert status == 200 and receipt["source_state_sha256"] == sha and receipt["restorable"] is True
    again = prune_cli(srv, "--older-than", "30", "--json")
    assert json.loads(again.stdout)["deleted"] == []


def test_the_admin_api_status_and_failed_runs_kept_longer(srv):
    async def main(client):
        for name in ("done-1", "done-2", "bad-1", "bad-2"):
            await make_run(client, name, 2)
        for name in ("done-1", "done-2"):
            await client.update_metadata(name, experiment_metadata={"status": "completed"})
        for name in ("bad-1", "bad-2"):
            await client.record(name, "run.failed", {"error": "boom"}, actor="agent")
    using(srv, main)
    query_database(srv, "UPDATE channels SET updated_at = ? WHERE id IN ('done-1', 'bad-1')", (OLD,))
    week_ago = (datetime.now(timezone.utc) - timedelta(days=7)).strftime("%Y-%m-%dT%H:%M:%S.000Z")
    query_database(srv, "UPDATE channels SET updated_at = ? WHERE id IN ('done-2', 'bad-2')", (week_ago,))

    def prune(**body):
        status, _, answer = http("POST", srv.url + "/api/v1/admin/prune", key=srv.key, body=body)
        assert status == 200, answer
        return answer
    assert set(prune(older_than_days=5, status="failed", dry_run=True)["deleted"]) == {"bad-1", "bad-2"}
    assert set(prune(older_than_days=5, status="completed", dry_run=True)["deleted"]) == {"done-1", "done-2"}
    assert set(prune(older_than_days=5, keep_failed_days=30, dry_run=True)["deleted"]) >= {"done-1", "done-2", "bad-1"}
    assert "bad-2" not in prune(older_than_days=5, keep_failed_days=30, dry_run=True)["deleted"]
    answer = prune(older_than_days=5, status="completed")
    assert set(answer["deleted"]) == {"done-1", "done-2"} and {"done-1", "done-2"}.isdisjoint(channels(srv))
    if BACKEND == "sqlite":          # the first prune switched the file to incremental vacuum
        assert "incremental vacuum" in answer["space"], answer["space"]
        assert query_database(srv, "PRAGMA auto_vacuum") == [(2,)]
    reader = http("POST", srv.url + "/api/v1/keys", key=srv.key,
                  body={"name": "prune-reader", "scopes": {"read": ["*"], "write": ["*"], "delete": ["*"]}})[2]["key"]
    status, _, refused = http("POST", srv.url + "/api/v1/admin/prune", key=reader, body={"older_than_days": 0})
    assert status == 403
    for body in ({"older_than_days": -1}, {"older_than_days": 1, "status": "old"}, {}):
        assert http("POST", srv.url + "/api/v1/admin/prune", key=srv.key, body=body)[0] == 400


def test_the_daily_prune_runs_at_start_and_again_a_day_later(tmp_path):
    """In process, on a real database: the Retention task with a clock the test moves on."""
    sys.path.insert(0, str(ROOT))
    import actae

    location = actae.Location(tmp_path, database_url_for(tmp_path))
    now = [datetime.now(timezone.utc)]

    def record(channel):
        return actae.RecordEvent(channel_id=channel, event_type="step", payload={"n": 1})

    async def main():
        db = await actae.Database(location).open()
        retention = actae.Retention(db, 2, clock=lambda: now[0], interval=0.05)
        answers = []                    # every prune's answer: the task runs one each 50 ms
        prune = retention.prune

        async def noted(req):
            answers.append(await prune(req))
            return answers[-1]
        retention.prune = noted

        async def prunes(count):
            """`count` more prunes finish (the first may have begun before the call; the later ones after)."""
            for _ in range(count):
                seen = retention.last

                async def another():
                    return retention.last is not seen
                await poll(another, 10, what="the retention task's next prune")

        def gone(channel):
            async def check():
                return await db.read(actae.channel_by_id, channel) is None
            return check
        try:
            await db.write(actae.record_event, record("daily-a"))
            retention.start()
            await prunes(1)                                         # the prune at start: after the write
            assert await db.read(actae.channel_by_id, "daily-a") is not None       # not 2 days idle yet
            now[0] += timedelta(days=3)
            await poll(gone("daily-a"), 10, what="daily-a to be pruned")
            now[0] = datetime.now(timezone.utc)                 # a new day starts: daily-b is fresh
            await db.write(actae.record_event, record("daily-b"))
            await prunes(2)                                         # a whole prune after the write
            assert await db.read(actae.channel_by_id, "daily-b") is not None
            now[0] += timedelta(days=3)                                              # the next day's prune
            await poll(gone("daily-b"), 10, what="daily-b to be pruned")

            async def told():           # the prune that deleted it says so, once it has returned
                return any(a.deleted == ["daily-b"] and a.rows.runs == 1 for a in answers)
            await poll(told, 10, what="the prune that deleted daily-b to answer it")
        finally:
            await retention.stop()
            await db.close()
    asyncio.run(main())


def test_the_server_prunes_at_start_with_retain_days(tmp_path):
    with ServerProcess(tmp_path).start() as first:
        key = first.key
        for name in ("idle", "busy"):
            assert http("POST", first.url + "/api/v1/events/record", key=key,
                        body={"channel_id": name, "event_type": "step", "payload": {}})[0] == 200
    query_database(first, "UPDATE channels SET updated_at = ? WHERE id = 'idle'", (OLD,))
    with ServerProcess(tmp_path, args=["--retain-days", "3"]).start() as second:
        poll(lambda: http("GET", second.url + "/api/v1/channels/idle/metadata", key=key)[0] == 404, 30,
             every=0.1, what="the idle run to be gone")
        assert http("GET", second.url + "/api/v1/channels/busy/metadata", key=key)[0] == 200
    assert any("retention: deleted 1 runs" in line for line in second.lines), second.lines[-20:]
    bad = cli("--retain-days", "-1", data_dir=tmp_path, check=False)
    assert bad.returncode != 0 and "--retain-days" in bad.stderr
