"""The side-effect ledger (`/api/v1/executions/*`) and the session fence built on it.

Real `actae-client` SDK against the real server subprocess (`server` fixture). Lease-expiry cases
use `lease_seconds=1` and sleep 1.2 s, so the whole file stays within a few seconds of sleeping.
"""
from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import time
import uuid
from collections import Counter

import pytest
from actae_client import (
    AgentSession,
    ExecutionNotFoundError,
    ExecutionNotOwnedError,
    IdempotencyKeyMismatchError,
    SessionLockedError,
)

from conftest import http, session_log

# > lease_seconds=1. Time must pass here: a lease lapses on the clock, and the server takes no
# injected time, so these sleeps stay sleeps (a poll would retry the very claim the test checks).
LEASE_EXPIRY_WAIT = 1.2


async def events(client, channel):
    return await client.replay(channel, limit=1000)


async def of_type(client, channel, event_type):
    return [e for e in await events(client, channel) if e.event_type == event_type]


# ── 1. concurrency: one winner, then replays ────────────────────────────────────────────────────

def test_fifty_concurrent_claims_have_one_winner_then_replay(with_client, unique):
    channel = unique("conc")  # does not exist before the first claim
    params = {"amount_cents": 4900, "customer": "cus_1"}

    async def body(c):
        claims = await asyncio.gather(*[
            c.claim_execution(channel, "inv-1", "charge_customer", params) for _ in range(50)
        ])
        assert Counter(x.status for x in claims) == {"claimed": 1, "in_progress": 49}
        assert len({x.execution.id for x in claims}) == 1, "all claims must see the same ledger row"
        winner = next(x for x in claims if x.status == "claimed")
        assert winner.claim_token
        assert all(x.claim_token is None for x in claims if x.status == "in_progress")
        assert winner.execution.status == "running" and winner.execution.attempts == 1

        done = await c.complete_execution(winner.execution.id, winner.claim_token, {"charge_id": "ch_1"})
        assert done.status == "completed" and done.result == {"charge_id": "ch_1"}

        again = await asyncio.gather(*[
            c.claim_execution(channel, "inv-1", "charge_customer", params) for _ in range(10)
        ])
        assert [x.status for x in again] == ["replayed"] * 10
        assert all(x.result == {"charge_id": "ch_1"} and x.claim_token is None for x in again)
        assert all(x.execution.id == winner.execution.id for x in again)

        # No new effect: one tool.started, one tool.completed, still one attempt.
        assert len(await of_type(c, channel, "tool.started")) == 1
        assert len(await of_type(c, channel, "tool.completed")) == 1
        assert (await c.get_execution(winner.execution.id)).attempts == 1

    with_client(body)


# ── 2. request identity ────────────────────────────────────────────────────────────────────────

ORIGINAL = ("charge_customer", {"amount_cents": 4900, "currency": "usd"})


@pytest.mark.parametrize("row_status", ["running", "completed"])
@pytest.mark.parametrize("tool, params", [
    pytest.param("charge_customer", {"amount_cents": 5000, "currency": "usd"}, id="changed-value"),
    pytest.param("charge_customer", {"amount_cents": 4900, "currency": "usd", "x": 1}, id="extra-key"),
    pytest.param("charge_customer", {"amount_cents": 4900}, id="missing-key"),
    pytest.param("charge_customer", None, id="no-params"),
    pytest.param("refund_customer", {"amount_cents": 4900, "currency": "usd"}, id="other-tool"),
])
def test_same_key_different_request_is_a_mismatch(with_client, unique, row_status, tool, params):
    channel = unique("mismatch")

    async def body(c):
        first = await c.claim_execution(channel, "inv-1", *ORIGINAL)
        if row_status == "completed":
            await c.complete_execution(first.execution.id, first.claim_token, {"ok": True})
        with pytest.raises(IdempotencyKeyMismatchError):
            await c.claim_execution(channel, "inv-1", tool, params)
        # The mismatch changed nothing: the original request still sees its own row.
        again = await c.claim_execution(channel, "inv-1", *ORIGINAL)
        assert again.status == {"running": "in_progress", "completed": "replayed"}[row_status]
        assert again.execution.id == first.execution.id
        assert len(await of_type(c, channel, "tool.started")) == 1

    with_client(body)


@pytest.mark.parametrize("retry_params, expected", [
    ({"amount_cents": 4900, "nonce": "n-2", "ts": 1}, "replayed"),
    ({"amount_cents": 4900, "nonce": "n-1", "ts": 2}, "replayed"),
    ({"amount_cents": 4900, "nonce": "n-9", "ts": 99}, "replayed"),
    ({"amount_cents": 4900}, "replayed"),
    ({"amount_cents": 5000, "nonce": "n-1", "ts": 1}, "mismatch"),
], ids=["nonce", "ts", "both", "volatile-dropped", "dedup-field-changed"])
def test_dedup_fields_ignore_volatile_params(with_client, unique, retry_params, expected):
    channel = unique("dedup")
    first_params = {"amount_cents": 4900, "nonce": "n-1", "ts": 1}

    async def body(c):
        first = await c.claim_execution(channel, "pay", "charge_customer", first_params, dedup_fields=["amount_cents"])
        assert first.status == "claimed"
        await c.complete_execution(first.execution.id, first.claim_token, {"charge_id": "ch_9"})
        if expected == "mismatch":
            with pytest.raises(IdempotencyKeyMismatchError):
                await c.claim_execution(channel, "pay", "charge_customer", retry_params, dedup_fields=["amount_cents"])
        else:
            again = await c.claim_execution(channel, "pay", "charge_customer", retry_params,
                                            dedup_fields=["amount_cents"])
            assert (again.status, again.result) == ("replayed", {"charge_id": "ch_9"})

    with_client(body)


# ── 3. leases, tokens, terminal states, events ─────────────────────────────────────────────────

def test_lease_expiry_reclaims_and_fences_the_old_token(with_client, unique):
    channel = unique("lease")

    async def body(c):
        old = await c.claim_execution(channel, "k-expire", "tool", {"n": 1}, lease_seconds=1)
        kept = await c.claim_execution(channel, "k-kept", "tool", {"n": 2}, lease_seconds=1)
        assert (old.status, kept.status) == ("claimed", "claimed")
        assert (await c.claim_execution(channel, "k-expire", "tool", {"n": 1})).status == "in_progress"
        # A heartbeat extends the lease of the second key past the sleep.
        beat = await c.heartbeat_execution(kept.execution.id, kept.claim_token, lease_seconds=60)
        assert beat.status == "running"

        await asyncio.sleep(LEASE_EXPIRY_WAIT)

        new = await c.claim_execution(channel, "k-expire", "tool", {"n": 1}, lease_seconds=30)
        assert new.status == "reclaimed"
        assert new.claim_token and new.claim_token != old.claim_token
        assert new.execution.id == old.execution.id
        assert new.execution.attempts == 2
        assert (await c.claim_execution(channel, "k-kept", "tool", {"n": 2})).status == "in_progress"

        stale_calls = {
            "complete": lambda: c.complete_execution(old.execution.id, old.claim_token, {"late": True}),
            "complete-without-token": lambda: c.complete_execution(old.execution.id, None, {"late": True}),
            "fail": lambda: c.fail_execution(old.execution.id, "late", claim_token=old.claim_token),
            "heartbeat": lambda: c.heartbeat_execution(old.execution.id, old.claim_token, lease_seconds=5),
        }
        for name, call in stale_calls.items():
            with pytest.raises(ExecutionNotOwnedError):
                await call()
            assert (await c.get_execution(old.execution.id)).status == "running", name

        done = await c.complete_execution(new.execution.id, new.claim_token, {"v": 2})
        assert (done.status, done.result) == ("completed", {"v": 2})
        # A duplicate complete with the owning token is idempotent.
        assert (await c.complete_execution(new.execution.id, new.claim_token, {"v": 2})).status == "completed"
        # Claim and reclaim each append tool.started; one terminal event.
        assert len(await of_type(c, channel, "tool.started")) == 3
        assert len(await of_type(c, channel, "tool.completed")) == 1

    with_client(body)


@pytest.mark.parametrize("terminal", ["cancel", "fail"])
def test_cancelled_or_failed_execution_is_reclaimed(with_client, unique, terminal):
    channel = unique("reclaim")

    async def body(c):
        first = await c.claim_execution(channel, "job", "tool", {"a": 1})
        before = len(await events(c, channel))
        if terminal == "cancel":
            info = await c.cancel_execution(first.execution.id, first.claim_token)
            assert info.status == "cancelled"
            assert len(await events(c, channel)) == before, "cancel must not append an event"
        else:
            info = await c.fail_execution(first.execution.id, "boom", claim_token=first.claim_token)
            assert info.status == "failed"
        again = await c.claim_execution(channel, "job", "tool", {"a": 1})
        assert again.status == "reclaimed"
        assert again.claim_token and again.claim_token != first.claim_token
        assert again.execution.id == first.execution.id and again.execution.attempts == 2
        with pytest.raises(ExecutionNotOwnedError):
            await c.complete_execution(first.execution.id, first.claim_token, {"stale": True})

    with_client(body)


def test_fail_stores_the_error_and_emits_tool_failed(with_client, unique):
    channel = unique("fail")

    async def body(c):
        claim = await c.claim_execution(channel, "inv-1", "charge_customer", {"amount_cents": 4900})
        failed = await c.fail_execution(claim.execution.id, "card declined", claim_token=claim.claim_token,
                                        error_type="CardError", stack="Traceback: line 1")
        assert failed.status == "failed"
        stored = await c.get_execution(claim.execution.id)
        assert stored.status == "failed"
        assert stored.error["message"] == "card declined"
        assert stored.error["error_type"] == "CardError"
        assert stored.error["stack"] == "Traceback: line 1"
        # A duplicate fail is idempotent.
        again = await c.fail_execution(claim.execution.id, "card declined", claim_token=claim.claim_token,
                                       error_type="CardError", stack="Traceback: line 1")
        assert again.status == "failed"
        evs = await events(c, channel)
        assert [e.event_type for e in evs] == ["tool.started", "tool.failed"]
        assert stored.completed_cursor == evs[1].cursor and stored.completed_event_id == evs[1].id
        assert evs[1].metadata["execution_id"] == claim.execution.id

    with_client(body)


@pytest.mark.parametrize("operation", ["get", "complete", "fail", "heartbeat", "cancel", "delete"])
def test_unknown_execution_id_is_not_found(with_client, operation):
    missing = str(uuid.uuid4())

    async def body(c):
        calls = {
            "get": lambda: c.get_execution(missing),
            "complete": lambda: c.complete_execution(missing, "tok", {"x": 1}),
            "fail": lambda: c.fail_execution(missing, "msg", claim_token="tok"),
            "heartbeat": lambda: c.heartbeat_execution(missing, "tok", lease_seconds=5),
            "cancel": lambda: c.cancel_execution(missing, "tok"),
            "delete": lambda: c.delete_execution(missing),
        }
        with pytest.raises(ExecutionNotFoundError):
            await calls[operation]()

    with_client(body)


def test_lifecycle_events_carry_execution_id_and_cursors(with_client, unique):
    channel = unique("life")

    async def body(c):
        await c.record(channel, "plan", {"step": 1}, actor="test")
        claim = await c.claim_execution(channel, "inv-1", "charge_customer", {"amount_cents": 4900}, actor="billing")
        running = claim.execution
        assert running.started_cursor == 2 and running.completed_cursor is None
        done = await c.complete_execution(running.id, claim.claim_token, {"charge_id": "ch_1"})
        assert done.started_cursor == 2 and done.completed_cursor == 3
        assert done.completed_at and done.params == {"amount_cents": 4900}

        by_cursor = {e.cursor: e for e in await events(c, channel)}
        started, completed = by_cursor[done.started_cursor], by_cursor[done.completed_cursor]
        assert (started.event_type, completed.event_type) == ("tool.started", "tool.completed")
        assert started.id == done.started_event_id and completed.id == done.completed_event_id
        assert started.metadata["execution_id"] == running.id
        assert completed.metadata["execution_id"] == running.id
        assert completed.depends_on == started.id
        assert sorted(by_cursor) == [1, 2, 3]

    with_client(body)


def test_complete_without_a_result_stores_null(with_client, unique):
    channel = unique("noresult")

    async def body(c):
        claim = await c.claim_execution(channel, "fire-and-forget", "notify", {"to": "ops"})
        assert claim.execution.lease_until  # a running row has a lease
        done = await c.complete_execution(claim.execution.id, claim.claim_token)  # SDK omits "result"
        assert (done.status, done.result) == ("completed", None)
        again = await c.claim_execution(channel, "fire-and-forget", "notify", {"to": "ops"})
        assert (again.status, again.result) == ("replayed", None)

    with_client(body)


def test_emit_replay_event_appends_tool_replayed_once(with_client, unique):
    channel = unique("replayed")

    async def body(c):
        claim = await c.claim_execution(channel, "inv-1", "charge_customer", {"amount_cents": 4900})
        await c.complete_execution(claim.execution.id, claim.claim_token, {"charge_id": "ch_1"})
        # Without the flag a replay appends nothing.
        plain = await c.claim_execution(channel, "inv-1", "charge_customer", {"amount_cents": 4900})
        assert plain.status == "replayed"
        assert await of_type(c, channel, "tool.replayed") == []
        for _ in range(3):
            r = await c.claim_execution(channel, "inv-1", "charge_customer", {"amount_cents": 4900},
                                        emit_replay_event=True)
            assert (r.status, r.result) == ("replayed", {"charge_id": "ch_1"})
        marks = await of_type(c, channel, "tool.replayed")
        assert len(marks) == 1
        assert marks[0].metadata["execution_id"] == claim.execution.id
        assert (await c.get_execution(claim.execution.id)).replay_emitted is True
        assert len(await of_type(c, channel, "tool.started")) == 1

    with_client(body)


def test_claim_creates_the_channel(with_client, unique):
    channel = unique("fresh")

    async def body(c):
        assert await events(c, channel) == []
        claim = await c.claim_execution(channel, "first", "tool", {"x": 1})
        assert claim.status == "claimed" and claim.execution.channel_id == channel
        evs = await events(c, channel)
        assert [(e.cursor, e.event_type) for e in evs] == [(1, "tool.started")]
        assert channel in await c.list_channels()

    with_client(body)


def test_list_get_delete_executions(with_client, unique):
    channel, other = unique("list"), unique("other")

    async def body(c):
        ids = []
        for key in ("a", "b", "c"):
            claim = await c.claim_execution(channel, key, f"tool-{key}", {"key": key})
            ids.append(claim.execution.id)
        await c.claim_execution(other, "a", "tool-a", {"key": "a"})

        listed = await c.list_executions(channel)
        assert [e.id for e in listed] == ids[::-1], "newest first, only this channel"
        assert [e.id for e in await c.list_executions(channel, limit=2)] == ids[:0:-1]

        got = await c.get_execution(ids[1])
        assert (got.id, got.channel_id, got.key_name, got.tool_name, got.params, got.status) == (
            ids[1], channel, "b", "tool-b", {"key": "b"}, "running")

        assert await c.delete_execution(ids[1]) is True
        with pytest.raises(ExecutionNotFoundError):
            await c.get_execution(ids[1])
        assert [e.id for e in await c.list_executions(channel)] == [ids[2], ids[0]]
        # The key is free again once its record is gone.
        fresh = await c.claim_execution(channel, "b", "tool-b", {"key": "b"})
        assert fresh.status == "claimed" and fresh.execution.id != ids[1] and fresh.execution.attempts == 1

    with_client(body)


# ── 4. crash consistency against a real downstream ─────────────────────────────────────────────

# One worker process: reads one JSON request per stdin line and performs one attempt of the
# "charge" effect on a SQLite downstream. It imports everything up front and then waits, so a
# rerun can claim within milliseconds of the first worker's death (well inside the 1 s lease).
WORKER = r'''
import asyncio, json, os, sqlite3, sys
from actae_client import ActaeClient

DB = sys.argv[1]

def applied(key):
    con = sqlite3.connect(DB)
    try:
        return con.execute("SELECT COUNT(*) FROM charges WHERE key = ?", (key,)).fetchone()[0]
    finally:
        con.close()

def apply(key):
    con = sqlite3.connect(DB)
    con.execute("INSERT INTO charges (key, amount_cents) VALUES (?, 4900)", (key,))
    con.commit()
    con.close()

async def attempt(channel, key, crash):
    client = ActaeClient.from_env()
    claim = await client.claim_execution(channel, key, "charge_customer", {"amount_cents": 4900},
                                         lease_seconds=1)
    out = {"status": claim.status, "result": claim.result, "applied": False, "completed": False}
    if claim.status in ("claimed", "reclaimed"):
        # reclaimed = the previous attempt's outcome is unknown: ask the downstream first.
        if claim.status == "claimed" or applied(key) == 0:
            apply(key)
            out["applied"] = True
        if crash != "after_effect":
            await client.complete_execution(claim.execution.id, claim.claim_token, {"charge_id": "ch-" + key})
            out["completed"] = True
    print(json.dumps(out), flush=True)
    if crash and claim.status in ("claimed", "reclaimed"):
        os._exit(137)
    await client.disconnect()

print("ready", flush=True)
for line in sys.stdin:
    asyncio.run(attempt(**json.loads(line)))
'''


class Worker:
    """A warm worker subprocess (see WORKER); `attempt()` returns its JSON report."""

    def __init__(self, server, db):
        env = {**os.environ, "ACTAE_URL": server.url, "ACTAE_API_KEY": server.key}
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(db)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        ready = self.proc.stdout.readline().strip()
        assert ready == "ready", self._failure(ready)

    def _failure(self, got):
        self.proc.kill()
        return f"worker said {got!r}; stderr:\n{self.proc.stderr.read()}"

    def attempt(self, channel, key, crash=None):
        self.proc.stdin.write(json.dumps({"channel": channel, "key": key, "crash": crash}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, self._failure(line)
        return json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout=30)
        finally:
            self.proc.stdout.close()
            self.proc.stderr.close()


def downstream_rows(db, key):
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT COUNT(*) FROM charges WHERE key = ?", (key,)).fetchone()[0]
    finally:
        con.close()


@pytest.mark.parametrize("crash, rerun_statuses, attempts", [
    # Died after the effect, before completing: the lease protects the ambiguous window, then
    # the rerun takes over explicitly (reclaimed), checks the downstream and completes.
    ("after_effect", ["in_progress", "wait", "reclaimed", "replayed"], 2),
    # Died right after completing: the rerun only ever replays.
    ("after_complete", ["replayed", "replayed"], 1),
], ids=["killed-after-effect", "killed-after-complete"])
def test_worker_killed_mid_effect_never_duplicates(server, with_client, unique, tmp_path, crash,
                                                   rerun_statuses, attempts):
    channel, key = unique("crash"), "inv-1"
    db = tmp_path / "downstream.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE charges (id INTEGER PRIMARY KEY, key TEXT NOT NULL, amount_cents INTEGER NOT NULL)")
    con.commit()
    con.close()

    first, rerun = Worker(server, db), Worker(server, db)
    try:
        report = first.attempt(channel, key, crash=crash)
        assert report["status"] == "claimed" and report["applied"] is True
        assert report["completed"] is (crash == "after_complete")
        assert first.close() == 137
        assert downstream_rows(db, key) == 1

        for expected in rerun_statuses:
            if expected == "wait":
                time.sleep(LEASE_EXPIRY_WAIT)
                continue
            report = rerun.attempt(channel, key)
            assert report["status"] == expected, report
            assert report["applied"] is False, "the rerun must never apply the effect a second time"
            if expected == "replayed":
                assert report["result"] == {"charge_id": f"ch-{key}"}
            assert downstream_rows(db, key) == 1
    finally:
        first.close()
        rerun.close()

    async def body(c):
        [execution] = await c.list_executions(channel)
        assert (execution.status, execution.attempts) == ("completed", attempts)
        assert len(await of_type(c, channel, "tool.started")) == attempts
        assert len(await of_type(c, channel, "tool.completed")) == 1

    with_client(body)


# ── 5. the session fence ───────────────────────────────────────────────────────────────────────

def test_second_fenced_session_is_locked_out(with_client, unique):
    channel = unique("fence")

    async def body(c):
        async with AgentSession(c, channel, fence_owner="A", fence_lease_seconds=30, params={"owner": "A"}) as a:
            await a.step("work", output={"owner": "A"})
            count = len(await events(c, channel))
            with pytest.raises(SessionLockedError):
                async with AgentSession(c, channel, fence_owner="B", fence_lease_seconds=30, params={"owner": "B"}):
                    pass
            assert len(await events(c, channel)) == count, "a locked-out session must not write"
            await a.step("work", output={"owner": "A"})
        # A released its fence on exit: the next owner gets in.
        async with AgentSession(c, channel, fence_owner="B", fence_lease_seconds=30, params={"owner": "B"}) as b:
            await b.step("work", output={"owner": "B"})
        assert session_log(await events(c, channel)) == [
            ("session.started", "A"), ("work", "A"), ("work", "A"), ("session.completed", None),
            ("session.started", "B"), ("work", "B"), ("session.completed", None)]

    with_client(body)


def test_fence_takeover_after_lease_expiry_stops_the_old_owner(with_client, unique):
    channel = unique("takeover")

    async def body(c):
        a = AgentSession(c, channel, fence_owner="A", fence_lease_seconds=1, params={"owner": "A"})
        b = AgentSession(c, channel, fence_owner="B", fence_lease_seconds=30, params={"owner": "B"})
        await a.__aenter__()
        await a.step("work", output={"owner": "A", "n": 1})
        await asyncio.sleep(LEASE_EXPIRY_WAIT)
        await b.__aenter__()  # takes the expired lease over
        await b.step("work", output={"owner": "B", "n": 1})
        with pytest.raises(SessionLockedError):
            await a.step("work", output={"owner": "A", "n": 2})
        # What `async with a:` does when that error propagates.
        await a.__aexit__(SessionLockedError, SessionLockedError("lost the lease"), None)
        await b.step("work", output={"owner": "B", "n": 2})
        await b.__aexit__(None, None, None)

        # A: session.started + step 1, nothing after the takeover (it crashed: no session.completed).
        assert session_log(await events(c, channel)) == [
            ("session.started", "A"), ("work", "A"),
            ("session.started", "B"), ("work", "B"), ("work", "B"), ("session.completed", None)]

    with_client(body)


# ── 6. bad input ───────────────────────────────────────────────────────────────────────────────

def claim_body(channel, **overrides):
    body = {"channel_id": channel, "key_name": "k", "tool_name": "t", "params": {"x": 1}}
    for k, v in overrides.items():
        if v is ...:
            body.pop(k)
        else:
            body[k] = v
    return json.dumps(body).encode()


BAD_CLAIMS = {
    "missing-key_name": lambda ch: claim_body(ch, key_name=...),
    "empty-key_name": lambda ch: claim_body(ch, key_name=""),
    "key_name-513-bytes": lambda ch: claim_body(ch, key_name="é" * 256 + "x"),
    "missing-tool_name": lambda ch: claim_body(ch, tool_name=...),
    "empty-tool_name": lambda ch: claim_body(ch, tool_name=""),
    "lease-0": lambda ch: claim_body(ch, lease_seconds=0),
    "lease-negative": lambda ch: claim_body(ch, lease_seconds=-1),
    "lease-86401": lambda ch: claim_body(ch, lease_seconds=86401),
    "lease-1e9": lambda ch: claim_body(ch, lease_seconds=10**9),
    "lease-string": lambda ch: claim_body(ch, lease_seconds="60"),
    "lease-bool": lambda ch: claim_body(ch, lease_seconds=True),
    "params-NaN": lambda ch: claim_body(ch, params="@").replace(b'"@"', b'{"x": NaN}'),
    "params-Infinity": lambda ch: claim_body(ch, params="@").replace(b'"@"', b"[Infinity]"),
    "channel-slash": lambda ch: claim_body(ch + "/x"),
    "channel-trailing-newline": lambda ch: claim_body(ch + "\n"),
    "missing-channel": lambda ch: claim_body(ch, channel_id=...),
    "not-json": lambda ch: b"{not json",
    "json-array": lambda ch: b"[]",
}

GOOD_CLAIMS = {
    "lease-1": lambda ch: claim_body(ch, lease_seconds=1),
    "lease-86400": lambda ch: claim_body(ch, lease_seconds=86400),
    "key_name-512-bytes": lambda ch: claim_body(ch, key_name="é" * 256),
    "no-params": lambda ch: claim_body(ch, params=...),
}


@pytest.mark.parametrize("case", list(BAD_CLAIMS))
def test_bad_claim_is_rejected_with_json_400(server, unique, case):
    channel = unique("bad")
    status, headers, body = http("POST", server.url + "/api/v1/executions/claim", key=server.key,
                                 raw=BAD_CLAIMS[case](channel))
    assert status == 400, body
    assert "application/json" in headers.get("content-type", "")
    assert isinstance(body, dict) and isinstance(body.get("status"), str) and body["status"]
    assert isinstance(body.get("error"), str) and body["error"]
    # Nothing half-written.
    _, _, listed = http("GET", f"{server.url}/api/v1/executions?channel_id={channel}&limit=100", key=server.key)
    assert listed["executions"] == []
    _, _, replayed = http("GET", f"{server.url}/api/v1/events/replay/{channel}?limit=100", key=server.key)
    assert replayed["events"] == []


@pytest.mark.parametrize("case", list(GOOD_CLAIMS))
def test_boundary_claims_are_accepted(server, unique, case):
    status, _, body = http("POST", server.url + "/api/v1/executions/claim", key=server.key,
                           raw=GOOD_CLAIMS[case](unique("good")))
    assert 200 <= status < 300, body
    assert body["status"] == "claimed" and body["claim_token"] and isinstance(body["execution"], dict)


def test_a_running_claim_is_only_cancelled_by_its_owner(with_client, unique):
    channel = unique("cancel")

    async def body(client):
        first = await client.claim_execution(channel, "k", "charge", params={"n": 1})
        with pytest.raises(ExecutionNotOwnedError):
            await client.cancel_execution(first.execution.id)                  # no token
        with pytest.raises(ExecutionNotOwnedError):
            await client.cancel_execution(first.execution.id, claim_token="stolen")
        second = await client.claim_execution(channel, "k", "charge", params={"n": 1})
        assert second.status == "in_progress"                                  # still the first owner's
        cancelled = await client.cancel_execution(first.execution.id, claim_token=first.claim_token)
        assert cancelled.status == "cancelled"

    with_client(body)


def test_an_inherited_effect_stays_inherited_in_a_fork_of_a_fork(with_client, unique):
    base, child, grandchild = unique("base"), unique("child"), unique("grandchild")

    async def body(client):
        claim = await client.claim_execution(base, "inv-1", "charge", params={"cents": 4900})
        await client.complete_execution(claim.execution.id, claim.claim_token, result={"charged": 1})
        snapshot = await client.record(base, "step", {"n": 1}, actor="t")
        await client.save_state(base, snapshot.cursor, {"n": 1})
        await client.fork(base, child, snapshot.cursor)
        on_child = await client.claim_execution(child, "inv-1", "charge", params={"cents": 4900})
        assert on_child.status == "replayed" and on_child.result == {"charged": 1}
        later = await client.record(child, "step", {"n": 2}, actor="t")
        await client.save_state(child, later.cursor, {"n": 2})
        await client.fork(child, grandchild, later.cursor, tool_policies={"charge": "replay"})
        on_grandchild = await client.claim_execution(grandchild, "inv-1", "charge", params={"cents": 4900})
        assert on_grandchild.status == "replayed" and on_grandchild.result == {"charged": 1}
        started = [e for c in (child, grandchild) for e in await of_type(client, c, "tool.started")]
        assert started == []                                                   # never ran again

    with_client(body)


def test_fork_policies_do_not_lock_out_the_session_fence(with_client, unique):
    base, fork = unique("base"), unique("fork")

    async def body(client):
        async with AgentSession(client, base, state_fn=lambda: {"ok": True}) as session:
            await session.step("one", output=1)
        await client.fork(base, fork, 0, tool_policies={"*": "block"})
        async with AgentSession(client, fork, state_fn=lambda: {"ok": True}, fence_owner="worker-1") as fenced:
            await fenced.step("two", output=2)
        assert await of_type(client, fork, "tool.blocked") == []

    with_client(body)
