"""Many runs: what a runs page shows per run lives in columns the write path keeps, and indexes
serve the first page, the status filter, the inbox and the bulk fork's selection.

- The stored run_state equals, for every kind of run, what the per-row expression it replaced
  computed from the events and states (kept here as the reference).
- The plans (EXPLAIN QUERY PLAN on SQLite, EXPLAIN on PostgreSQL) of those queries use the
  indexes: no full scan of channels or approvals, no sort of all runs.
- A database written before the migration (the schema taken back by hand) shows exactly the same
  pages after it, and its approval events fill the inbox.
- Imports, deleted state versions and closes keep the columns right.
"""
from __future__ import annotations

import json
import re
import sys
import uuid
from datetime import datetime, timezone

import httpx
import pytest

from conftest import BACKEND, ROOT, Recording, ServerProcess, http, login, query_database, using

sys.path.insert(0, str(ROOT))
import actae  # noqa: E402  (its query functions and the EXPLAIN of what they send)

FAILED = "('failed', 'error')"
BLOCKING = ", ".join(f"'{t}'" for t in actae.BLOCKING_EVENT_TYPES)
FAILURE_EVENT = actae.failure_event_sql(actae.POSTGRES if BACKEND == "postgresql" else actae.SQLITE, "e.type")


def reference_state_sql(sdk: str) -> str:
    """The expression the runs list used before, per row, over the events and states themselves."""
    return f"""CASE
    WHEN {sdk} = 'crashed' OR c.outcome = 'crashed' THEN 'crashed'
    WHEN {sdk} IN {FAILED}
      OR (SELECT s.status FROM states s WHERE s.channel_id = c.id ORDER BY s.version DESC LIMIT 1) IN {FAILED}
      OR EXISTS (SELECT 1 FROM events e WHERE {FAILURE_EVENT} AND e.channel_id = c.id) THEN 'failed'
    WHEN COALESCE({sdk}, '') <> 'completed'
      AND (SELECT e.type FROM events e WHERE e.channel_id = c.id ORDER BY e.cursor DESC LIMIT 1) IN ({BLOCKING})
      THEN 'blocked'
    ELSE COALESCE({sdk}, 'recorded') END"""


SDK_STATUS = {"sqlite": "json_extract(c.experiment_metadata, '$.status')",
              "postgresql": "(CASE WHEN jsonb_typeof(c.experiment_metadata::jsonb) = 'object'"
                            " THEN c.experiment_metadata::jsonb ->> 'status' END)"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("actae-many")).start() as server:
        yield server


async def every_kind(client, tag: str) -> dict:
    """One run of each kind the runs list tells apart; {name: the status it shows}."""
    from actae_client import AgentSession

    kinds = {}

    async def session(name, fail=None, steps=2, final=None):
        state = {"status": "running"}
        s = AgentSession(client, name, state_fn=lambda: dict(state))
        try:
            async with s:
                for n in range(1, steps + 1):
                    if final and n == steps:
                        state["status"] = final
                    await s.step("work", input=n, output={"n": n})
                if fail == "raise":
                    raise RuntimeError("boom")
        except RuntimeError:
            pass
    await session(f"{tag}-completed"); kinds[f"{tag}-completed"] = "completed"
    await session(f"{tag}-crashed", "raise"); kinds[f"{tag}-crashed"] = "crashed"
    await session(f"{tag}-failed-state", final="failed"); kinds[f"{tag}-failed-state"] = "failed"
    await session(f"{tag}-error-state", final="error"); kinds[f"{tag}-error-state"] = "failed"
    await session(f"{tag}-event"); kinds[f"{tag}-event"] = "failed"
    await client.record(f"{tag}-event", "step.error", {"error": "bad"}, actor="agent")
    await client.record(f"{tag}-raw", "note", {"x": 1}, actor="me"); kinds[f"{tag}-raw"] = "recorded"
    await client.record(f"{tag}-waits", "step", {"n": 1}, actor="me", step_number=1)
    await client.request_approval(f"{tag}-waits", summary="ok?"); kinds[f"{tag}-waits"] = "blocked"
    await client.record(f"{tag}-expired", "note", {}, actor="me")
    await client.record(f"{tag}-expired", "approval.expired", {"request_id": "x"}, actor="system")
    kinds[f"{tag}-expired"] = "blocked"
    await client.record(f"{tag}-outcome", "note", {}, actor="me")
    await client.set_outcome(f"{tag}-outcome", "crashed"); kinds[f"{tag}-outcome"] = "crashed"
    await client.update_metadata(f"{tag}-meta-only", experiment_metadata={"status": "stepping"})
    kinds[f"{tag}-meta-only"] = "stepping"
    await client.update_metadata(f"{tag}-odd", experiment_metadata={"status": {"not": "text"}})
    kinds[f"{tag}-odd"] = None
    await client.record(f"{tag}-recovered", "note", {}, actor="me")
    await client.save_state(f"{tag}-recovered", 1, {"status": "failed"})
    await client.save_state(f"{tag}-recovered", 1, {"status": "running"}); kinds[f"{tag}-recovered"] = "recorded"
    await client.fork(f"{tag}-failed-state", f"{tag}-fork-of-failed", 0)
    kinds[f"{tag}-fork-of-failed"] = "failed"             # it copied the failed snapshot
    await client.record(f"{tag}-closed", "tool.blocked", {"policy": "block"}, actor="ledger")
    kinds[f"{tag}-closed"] = "blocked"            # until the fixture closes it: then its last event is the close
    return kinds


@pytest.fixture(scope="module")
def kinds(srv):
    tag = f"k{uuid.uuid4().hex[:6]}"
    found = using(srv, lambda client: every_kind(client, tag))
    closed = next(k for k in found if k.endswith("-closed"))
    assert query_database(srv, "SELECT run_state FROM channels WHERE id = ?", (closed,)) == [("blocked",)]
    assert http("POST", f"{srv.url}/api/v1/channels/{closed}/close", key=srv.key)[0] == 200
    found[closed] = "recorded"
    return found


def stored_and_reference(srv) -> list:
    return query_database(srv, f"SELECT c.id, c.run_state, ({reference_state_sql(SDK_STATUS[BACKEND])}) FROM channels c"
                               " ORDER BY c.id")


def test_the_stored_run_state_is_what_the_per_row_expression_computed(srv, kinds):
    rows = stored_and_reference(srv)
    assert len(rows) >= len(kinds)
    for channel, stored, reference in rows:
        assert stored == (None if reference is None else str(reference)), (channel, stored, reference)
    states = {channel: stored for channel, stored, _ in rows}
    for channel, shown in kinds.items():
        if shown is not None:
            assert states[channel] == shown, (channel, states[channel])


def test_a_deleted_latest_state_and_an_import_keep_the_columns(srv, kinds, tmp_path):
    failed = next(k for k in kinds if k.endswith("-failed-state"))
    status, _, versions = http("GET", f"{srv.url}/api/v1/state/{failed}/versions", key=srv.key)
    latest = versions["versions"][0]["version"]
    copy = f"{failed}-copy"
    assert http("POST", srv.url + "/api/v1/channels/fork", key=srv.key,
                body={"source_channel_id": failed, "new_channel_id": copy})[0] == 200
    assert query_database(srv, "SELECT run_state FROM channels WHERE id = ?", (copy,)) == [("failed",)]
    assert http("DELETE", f"{srv.url}/api/v1/state/{copy}/version/1", key=srv.key)[0] == 200
    assert (query_database(srv, "SELECT run_state, last_state_status FROM channels WHERE id = ?", (copy,))
            == [("recorded", None)])
    assert latest >= 1
    waits = next(k for k in kinds if k.endswith("-waits"))
    exported = httpx.get(f"{srv.url}/api/v1/channels/{waits}/export", headers={"x-api-key": srv.key}).text
    with ServerProcess(tmp_path / "imported").start() as other:
        status, _, answer = http("POST", other.url + "/api/v1/import", key=other.key, raw=exported.encode(),
                                 headers={"content-type": "application/x-ndjson"})
        assert status == 200 and answer["imported"] == [waits], answer
        assert (query_database(other, "SELECT run_state, last_event_type FROM channels WHERE id = ?", (waits,))
                == [("blocked", "approval.requested")])
        status, _, inbox = http("GET", f"{other.url}/api/v1/approvals?channel_id={waits}", key=other.key)
        assert [a["status"] for a in inbox["approvals"]] == ["pending"]


def plan_lines(conn, sql: str, args: tuple) -> list:
    if conn.dialect is actae.SQLITE:
        return [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, args).fetchall()]
    return [row[0] for row in conn.execute("EXPLAIN " + sql, args).fetchall()]


def full_scans(lines: list, tables=("channels", "approvals")) -> list:
    """Plan lines that read a whole table (or sort every run) instead of one page of an index."""
    bad = []
    for line in lines:
        if BACKEND == "sqlite":
            if re.match(r"SCAN (c|channels|approvals)\b", line) and "INDEX" not in line:
                bad.append(line)
        elif re.search(r"Seq Scan on (channels|approvals)\b", line):
            bad.append(line)
    return bad


def test_the_pages_and_the_selection_read_one_index_range(srv, kinds):
    location = actae.Location(srv.data_dir, srv.database)
    conn = actae.connect_sync(location)
    try:
        if conn.dialect is actae.POSTGRES:
            conn.execute("SET enable_seqscan = off")      # a tiny table: ask whether an index *can* serve it
        now = datetime.now(timezone.utc)
        cases = {
            "first page": (lambda c: actae.runs_page(c, "", "", None), "channels_roots_by_activity"),
            "status=failed": (lambda c: actae.runs_page(c, "", "failed", None), "channels_by_state"),
            "status=completed": (lambda c: actae.runs_page(c, "", "completed", None), "channels_by_state"),
            "inbox": (lambda c: actae.list_approvals(c, "pending", None, 100, now), "approvals_by_status"),
            "bulk selection": (lambda c: actae.bulk_fork_candidates(c, actae.BulkForkFilter()), "channels_by_state"),
        }
        for name, (work, index) in cases.items():
            recording = Recording(conn)
            work(recording)
            main_sql, args = recording.sent[0]
            lines = plan_lines(conn, main_sql, args)
            text = "\n".join(lines)
            assert index in text, f"{name}: {index} not in the plan:\n{text}"
            assert not full_scans(lines), f"{name} scans a whole table:\n{text}"
            if conn.dialect is actae.SQLITE and name != "status=failed":
                # One page of the index in its order: no sort of everything the filter matches.
                assert not any("TEMP B-TREE FOR ORDER BY" in line for line in lines[:2]), f"{name}:\n{text}"
    finally:
        conn.close()


def page_twins(srv, channels: list) -> dict:
    c = login(srv)
    try:
        paths = ["/", "/?status=failed", "/?status=blocked", "/?status=completed", "/?q=-e"]
        paths += [f"/runs/{ch}" for ch in channels] + [f"/runs/{ch}/tree" for ch in channels[:3]]
        found = {}
        for path in paths:
            r = c.get(path, params={"format": "json"})
            assert r.status_code == 200, (path, r.text[:300])
            found[path] = json.loads(r.text.replace(srv.url, "URL"))     # a restart serves another port
        return found
    finally:
        c.close()


# Back to a database made before migration 9 (many runs): what 9 and every later one added goes.
# Before migration 19 the row kept its channel's last cursor and chain head.
HEADS = ["ALTER TABLE channels RENAME COLUMN chain_base TO chain_head",
         "ALTER TABLE channels ADD COLUMN last_cursor BIGINT NOT NULL DEFAULT 0",
         "UPDATE channels SET last_cursor = COALESCE((SELECT MAX(e.cursor) FROM events e WHERE e.channel_id = channels.id), 0),"
         " chain_head = COALESCE((SELECT e.chain_hash FROM events e WHERE e.channel_id = channels.id"
         " ORDER BY e.cursor DESC LIMIT 1), chain_head)"]
LATER = [*HEADS, "DROP INDEX events_blocked", "CREATE INDEX events_by_type ON events (type, created_at)",
         "DROP INDEX events_operation", "CREATE UNIQUE INDEX events_operation ON events (channel_id, operation_id)",
         "DROP INDEX events_by_step", "CREATE INDEX events_by_step ON events (channel_id, step_number, cursor)",
         "DROP INDEX channels_fork_operation",
         "CREATE UNIQUE INDEX channels_fork_operation ON channels (fork_operation_id)",
         "DROP INDEX channels_by_activity", "CREATE INDEX channels_by_activity ON channels (updated_at, id)",
         "DROP TABLE step_usage", "DROP TABLE fleet_enrollments", "ALTER TABLE fleet_instances DROP COLUMN enrolled_at",
         "ALTER TABLE fleet_instances DROP COLUMN link_hash"]
DOWNGRADE = {
    "sqlite": [*LATER, "DROP INDEX channels_by_state", "DROP INDEX channels_roots_by_activity", "DROP INDEX channels_by_origin",
               "DROP TABLE approvals", "DROP TABLE bulk_forks", "ALTER TABLE channels DROP COLUMN run_state",
               "ALTER TABLE channels DROP COLUMN last_state_status", "ALTER TABLE channels DROP COLUMN error_cursor",
               "ALTER TABLE channels DROP COLUMN last_event_type", "DROP TRIGGER channels_active_at",
               "DROP TRIGGER channels_active_at_new", "ALTER TABLE channels DROP COLUMN active_at",
               "PRAGMA user_version = 8"],
    "postgresql": [*LATER, "DROP TRIGGER channels_facts_new ON channels", "DROP TRIGGER channels_facts ON channels",
                   "DROP TRIGGER channels_facts_given ON channels", "ALTER TABLE events DROP COLUMN seq", "DROP INDEX channels_by_state", "DROP INDEX channels_roots_by_activity",
                   "DROP INDEX channels_by_origin", "DROP TABLE approvals", "DROP TABLE bulk_forks",
                   "ALTER TABLE channels DROP COLUMN run_state, DROP COLUMN last_state_status,"
                   " DROP COLUMN error_cursor, DROP COLUMN last_event_type, DROP COLUMN active_at",
                   # migration 16's domains back to the CHECK constraints the columns had
                   "ALTER TABLE channels ALTER COLUMN restorable TYPE BIGINT, ADD CHECK (restorable IN (0, 1)),"
                   " ALTER COLUMN reproducibility TYPE TEXT,"
                   f" ADD CHECK (reproducibility IN ({actae.sql_list(actae.REPRODUCIBILITY_GRADES)})),"
                   f" ALTER COLUMN outcome TYPE TEXT, ADD CHECK (outcome IN ({actae.sql_list(actae.OUTCOMES)}))",
                   "ALTER TABLE events ALTER COLUMN step_number TYPE BIGINT, ADD CHECK (step_number >= 1)",
                   "DROP DOMAIN actae_flag, actae_reproducibility, actae_outcome, actae_step",
                   "DELETE FROM actae_migrations WHERE version >= 5"],
}


def test_a_database_from_before_the_migration_shows_the_same_pages(tmp_path):
    tag = "old"

    async def main(client):
        made = await every_kind(client, tag)
        decided = await client.request_approval(f"{tag}-completed", summary="done?")
        await client.decide_approval(f"{tag}-completed", decided, decision="rejected", actor="ops", reason="no")
        return made
    with ServerProcess(tmp_path).start() as first:
        key = first.key
        made = using(first, main)
        before = page_twins(first, sorted(made))
    for statement in DOWNGRADE[BACKEND]:
        query_database(first, statement)
    assert query_database(first, "SELECT COUNT(*) FROM pragma_table_info('channels') WHERE name = 'run_state'",
                          postgresql="SELECT COUNT(*) FROM information_schema.columns WHERE table_name = 'channels'"
                                     " AND column_name = 'run_state'") == [(0,)]
    with ServerProcess(tmp_path).start() as second:             # migrates the old database
        second.key = key
        after = page_twins(second, sorted(made))
        for path in before:
            assert after[path] == before[path], path
        _, _, pending = http("GET", f"{second.url}/api/v1/approvals?status=pending", key=key)
        assert [a["channel_id"] for a in pending["approvals"]] == [f"{tag}-waits"]
        _, _, decided = http("GET", f"{second.url}/api/v1/approvals?status=decided", key=key)
        assert ([(a["channel_id"], a["decision"], a["decided_by"], a["reason"]) for a in decided["approvals"]]
                == [(f"{tag}-completed", "rejected", "ops", "no")])
        assert query_database(second, "SELECT COUNT(*) FROM channels WHERE run_state IS NULL") == [(0,)]
