"""Every index of the schema, and what needs it: keep only the indexes a query plan uses.

Each index costs every write to its table a page or an entry more, so each one is listed in
INDEX_USES with its user, one line each:

- a query: the domain function that sends it, called on a recording connection; the plan of what it
  sent (EXPLAIN QUERY PLAN on SQLite, EXPLAIN on PostgreSQL) must name the index;
- a constraint: the uniqueness it enforces (primary keys, UNIQUE constraints, a UNIQUE index that makes
  an operation id idempotent); no plan to check, the database needs it to refuse a duplicate;
- unused: no query found that needs it, with what was searched; a test fails until a migration drops it.

The tests:

- test_every_index_is_listed: the indexes of a freshly migrated database are INDEX_USES' names for this
  backend, no more and no fewer (a new index without a user fails, and so does a line for an index the
  schema dropped);
- test_no_listed_index_is_unused: no index is kept without a user;
- test_every_listed_query_uses_its_index: one case per query line, its plan read on a database the real
  server filled through the SDK. On PostgreSQL sequential scans are off (the tables are tiny: the
  question is whether an index *can* serve the query). Where a planner still prefers another index on
  so few rows, the line says so for that backend (`misses`), and the case fails if the note is stale.

Names: a primary key or a UNIQUE constraint has an index of its own on both backends, named
`<table>_pkey` / `<table>_<columns>_key` by PostgreSQL and `sqlite_autoindex_<table>_<n>` by SQLite,
numbered in the order the table declares them (a rebuilt table may renumber them). SQLite's are listed here under PostgreSQL's
name for the same constraint (pk_or_unique_name), so one line covers both backends.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Callable, Optional

import pytest

import httpx

from conftest import BACKEND, ROOT, Recording, ServerProcess, database_url_for, import_example, using

sys.path.insert(0, str(ROOT))
import actae  # noqa: E402  (its query functions, and the EXPLAIN of what they send)


# --------------------------------------------------------------------------------------------
# What the query lines read: a few rows of each kind, written through the SDK by the real server
# --------------------------------------------------------------------------------------------

RUN, FORK = "idx-run", "idx-fork"                  # a root run with steps, states and a fork of it
REQUEST = "idx-request"                            # a pending approval on RUN
GROUP, SENDER, RECEIVER = "idx-group", "sender", "receiver"   # an execution group with one message
NOW = datetime.now(timezone.utc)


async def fill(client) -> None:
    for step in (1, 2, 3):
        await client.record(RUN, "agent.step", {"n": step}, actor="agent", step_number=step)
    await client.save_state(RUN, 3, {"status": "running"})
    await client.save_state(RUN, 3, {"status": "running", "n": 3})
    await client.fork(RUN, FORK, 3)                 # its snapshot refers to RUN's version 2
    await client.record(RUN, "tool.blocked", {"policy": "block"}, actor="ledger")
    await client.request_approval(RUN, summary="ok?", request_id=REQUEST)
    decided = await client.request_approval(FORK, summary="ok?")
    await client.decide_approval(FORK, decided, decision="approved", actor="ops")
    claim = await client.claim_execution(RUN, "charge-1", "charge", {"cents": 1})
    await client.complete_execution(claim.execution.id, claim.claim_token, {"ok": True})
    await client.schedule_wakeup(RUN, NOW + timedelta(days=1))
    await client.create_execution_group(GROUP)
    await client.add_execution_group_member(GROUP, SENDER, "idx-sender")
    await client.add_execution_group_member(GROUP, RECEIVER, "idx-receiver")
    await client.send_group_message(GROUP, SENDER, RECEIVER, "hello", {"n": 1})


def write_tx(conn) -> "actae.Tx":
    """A Tx for the write functions some lines call; the test rolls their transaction back."""
    return actae.Tx(conn, NOW, NOW.isoformat(timespec="milliseconds").replace("+00:00", "Z"))


def first_key_id(conn) -> int:
    """The admin key the server made, read beside the recording (not one of the statements checked)."""
    return conn.conn.execute("SELECT MIN(id) FROM api_keys").fetchone()[0]


# --------------------------------------------------------------------------------------------
# The table: every index -> its user
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Use:
    kind: str                                  # "query", "constraint" or "unused"
    why: str                                   # the query's short name, the uniqueness, or what was searched
    work: Optional[Callable] = None            # query: calls the domain function on a connection
    only: Optional[str] = None                 # the one backend that has the index (None: both)
    misses: dict = field(default_factory=dict)  # backend -> why its plan shows another index (tiny tables)


def query(name: str, work: Callable, *, only=None, misses=None) -> Use:
    return Use("query", name, work, only, misses or {})


def constraint(why: str, *, only=None) -> Use:
    return Use("constraint", why, only=only)


def unused(searched: str, *, only=None) -> Use:
    return Use("unused", searched, only=only)


PG = "postgresql"
ROWID = dict(only=PG)          # SQLite has no index for it: an INTEGER PRIMARY KEY is the table's rowid
SINCE = NOW - timedelta(days=1)

INDEX_USES = {
    # channels
    "channels_pkey": constraint("a run id names one run"),
    "channels_fork_operation": constraint("a fork operation id names one fork: a retried fork gets the same child"),
    "channels_by_parent": query("a run's forks (list_forks)", lambda c: actae.list_forks(c, RUN, actae.EVERYWHERE)),
    "channels_by_activity": query("the runs page's search (runs_page q=)", lambda c: actae.runs_page(c, "idx", "", None)),
    "channels_by_state": query("the runs page's status filter", lambda c: actae.runs_page(c, "", "failed", None)),
    "channels_roots_by_activity": query("the first runs page: roots", lambda c: actae.runs_page(c, "", "", None)),
    "channels_by_origin": query("the first runs page: forks under their root", lambda c: actae.runs_page(c, "", "", None)),
    # events
    "events_pkey": constraint("one event per (channel, cursor): the gapless cursor"),
    "events_id_key": constraint("an event id names one event"),
    "events_operation": constraint("an operation id is used once per channel: a retried record is idempotent"),
    "events_by_step": query("resume at step k (resolve_step)", lambda c: actae.resolve_step(c, RUN, 2)),
    "events_by_time": query("/events/query from= (query_events)", lambda c: actae.query_events(c, actae.EventQuery(since=SINCE))),
    "events_blocked": query("the ledger page's blocked calls (blocked_attempts)", lambda c: actae.blocked_attempts(c, None)),
    "events_by_seq": query("the instance stream", lambda c: actae.events_after_position(c, 0, actae.EVERYWHERE, 9), only=PG),
    # states
    "states_pkey": constraint("one snapshot per (channel, version)"),
    "states_operation": constraint("an operation id is used once per channel: a retried save is idempotent"),
    "states_by_cursor": query("the snapshot at a cursor (state_row_at)", lambda c: actae.state_row_at(c, RUN, 3)),
    "states_by_ref": query("a deleted version's shared copies (free_dependents)", lambda c: actae.free_dependents(write_tx(c), RUN, 1)),
    "states_by_base": query("a deleted version's delta (free_dependents)", lambda c: actae.free_dependents(write_tx(c), RUN, 1)),
    # step usage, executions, wake-ups
    "step_usage_pkey": constraint("one usage row per event (channel, cursor)"),
    "executions_pkey": constraint("an execution id names one execution"),
    "executions_channel_id_key_name_key": constraint("the ledger's idempotency: one execution per (channel, key)"),
    "executions_by_time": query("a run's executions, newest first (list_executions)", lambda c: actae.list_executions(c, RUN, 9)),
    "wakeups_pkey": constraint("a wake-up id names one wake-up"),
    "wakeups_due": query("the scheduler's next wake-up (next_wakeup_at)", lambda c: actae.next_wakeup_at(c)),
    # consumer groups, execution groups, experiments
    "consumer_groups_pkey": constraint("a group id names one consumer group"),
    "group_consumers_pkey": constraint("one consumer per (group, consumer id)"),
    "execution_groups_pkey": constraint("a group id names one execution group"),
    "execution_group_members_pkey": constraint("one member per (group, member id)"),
    "group_messages_pkey": constraint("seq numbers the messages", **ROWID),
    "group_messages_id_key": constraint("a message id names one message"),
    "group_messages_group_id_operation_id_key": constraint("an operation id is used once per group: a retried send is idempotent"),
    "group_messages_inbox": query("a member's inbox (member_inbox)", lambda c: actae.member_inbox(c, GROUP, RECEIVER, None, 9)),
    "experiments_pkey": constraint("an experiment id names one experiment"),
    "experiment_members_pkey": constraint("a run is in an experiment once"),
    # keys, sessions, accounts, settings
    "settings_pkey": constraint("one value per setting"),
    "api_keys_pkey": constraint("a key id names one key", **ROWID),
    "api_keys_key_hash_key": constraint("a key's hash names one key"),
    "sessions_pkey": constraint("a session cookie's hash names one session"),
    "sessions_by_key": query("a revoked key's sessions (revoke_key)", lambda c: actae.revoke_key(write_tx(c), first_key_id(c))),
    "users_pkey": constraint("a user id names one account"),
    "users_email_key_key": constraint("one account per e-mail address, whatever its case"),
    "tokens_pkey": constraint("a login token's id names one token"),
    "preferences_pkey": constraint("one preferences document per owner"),
    # the approvals inbox, bulk forks
    "approvals_pkey": constraint("one approval per (channel, request id)"),
    "approvals_by_status": query("the inbox: pending, oldest first", lambda c: actae.list_approvals(c, "pending", None, 9, NOW)),
    "approvals_by_time": query("the inbox: every status", lambda c: actae.list_approvals(c, None, None, 9, NOW)),
    "approvals_by_request": query("a decision by request id (require_approval)", lambda c: actae.require_approval(c, REQUEST, None)),
    "bulk_forks_pkey": constraint("a bulk fork's operation id names one answer: a retried bulk fork is idempotent"),
    # the fleet
    "fleet_instances_pkey": constraint("an instance id names one remote instance"),
    "org_tokens_pkey": constraint("a token id names one organisation token", **ROWID),
    "org_tokens_token_hash_key": constraint("a token's hash names one organisation token"),
    "fleet_tickets_pkey": constraint("a ticket's hash names one stream ticket (used once)"),
    "fleet_enrollments_pkey": constraint("an enrollment token's hash names one enrollment (used once)"),
    "fleet_enrollment_failures_pkey": constraint("one count of failed enrollments per enrollment token"),
    # the model-call gateway
    "llm_calls_pkey": constraint("a call id names one call"),
    "llm_bodies_pkey": constraint("a body's SHA-256 names it: each distinct body is stored once"),
    "llm_passes_pkey": constraint("one current pass per run"),
    "llm_upstreams_pkey": constraint("a name names one kept upstream (`llm add` again replaces it)"),
    "fork_hand_offs_pkey": constraint("one job at a time per fork: handing it off again replaces a failed one's row"),
    "llm_tallies_pkey": constraint("one tally per (run, pass)"),
    "llm_calls_by_pass": query("a pass's completed call at a position (completed_call_at)",
                               lambda c: actae.completed_call_at(c, RUN, 0, 0, 2**62)),
    "llm_calls_by_request_body": query("a deleted run's bodies that no other call holds (delete_llm_calls)",
                                       lambda c: actae.delete_llm_calls(write_tx(c), RUN)),
    "llm_calls_by_response_body": query("a deleted run's bodies that no other call holds (delete_llm_calls)",
                                        lambda c: actae.delete_llm_calls(write_tx(c), RUN)),
    # PostgreSQL's migration bookkeeping (SQLite counts with PRAGMA user_version)
    "actae_migrations_pkey": constraint("a schema version is recorded once", only=PG),
}


def listed_here() -> dict:
    """INDEX_USES' lines for this backend."""
    return {name: use for name, use in INDEX_USES.items() if use.only in (None, BACKEND)}


def query_lines() -> list:
    return [pytest.param(name, use, id=name) for name, use in listed_here().items() if use.kind == "query"]


# --------------------------------------------------------------------------------------------
# The schema's indexes, by name
# --------------------------------------------------------------------------------------------

def pk_or_unique_name(conn, table: str, index: str) -> str:
    """PostgreSQL's name for the constraint behind one of SQLite's automatic indexes."""
    origin = conn.execute("SELECT origin FROM pragma_index_list(?) WHERE name = ?", (table, index)).fetchone()[0]
    if origin == "pk":
        return f"{table}_pkey"
    columns = [row[0] for row in conn.execute("SELECT name FROM pragma_index_info(?) ORDER BY seqno", (index,))]
    return f"{table}_{'_'.join(columns)}_key"


def schema_indexes(conn) -> dict:
    """{name as INDEX_USES lists it: name as a plan shows it} for every index of the database."""
    if conn.dialect is actae.SQLITE:
        found = {}
        for name, table in conn.execute("SELECT name, tbl_name FROM sqlite_master WHERE type = 'index'").fetchall():
            listed = pk_or_unique_name(conn, table, name) if name.startswith("sqlite_autoindex_") else name
            found[listed] = name
        return found
    rows = conn.execute("SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()").fetchall()
    return {row[0]: row[0] for row in rows}


def test_every_index_is_listed(tmp_path):
    conn = actae.connect_sync(actae.Location(tmp_path, database_url_for(tmp_path)))
    try:
        found = set(schema_indexes(conn))
    finally:
        conn.close()
    listed = set(listed_here())
    unlisted, gone = sorted(found - listed), sorted(listed - found)
    assert not unlisted, (f"indexes of the {BACKEND} schema with no line in INDEX_USES: {unlisted}"
                          " (add the query that needs each one, or the constraint it enforces)")
    assert not gone, f"INDEX_USES lists indexes the {BACKEND} schema does not have: {gone} (edit or delete their lines)"


def test_no_listed_index_is_unused():
    idle = {name: use.why for name, use in listed_here().items() if use.kind == "unused"}
    assert not idle, "indexes with no query that needs them (drop each in a migration, then its line):\n" + "\n".join(
        f"  {name}: {why}" for name, why in idle.items())


# --------------------------------------------------------------------------------------------
# The plans of the query lines
# --------------------------------------------------------------------------------------------

def plan_lines(conn, sql: str, args: tuple) -> list:
    if conn.dialect is actae.SQLITE:
        return [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, args).fetchall()]
    return [row[0] for row in conn.execute("EXPLAIN " + sql, args).fetchall()]


# Statements a plan can be asked for; BEGIN, PRAGMA, SAVEPOINT and the like have none.
PLANNED = re.compile(r"\s*(SELECT|WITH|INSERT|UPDATE|DELETE)\b", re.IGNORECASE)


def sent_in_a_rolled_back_transaction(conn, work: Callable) -> list:
    """(sql, args) of what `work` sent on a recording of `conn`, inside a transaction rolled back after:
    a line calling a write function (revoke_key, free_dependents) leaves the database as it was."""
    recording = Recording(conn)
    conn.execute("BEGIN")
    try:
        work(recording)
    finally:
        conn.execute("ROLLBACK")
    return [(sql, args) for sql, args in recording.sent if PLANNED.match(sql)]


def plans_of(conn, sent: list) -> list:
    """[(sql, its plan's lines)] for each statement sent."""
    return [(sql, plan_lines(conn, sql, args)) for sql, args in sent]


def shown(plans: list) -> str:
    return "\n".join(f"  {' '.join(sql.split())}\n" + "\n".join(f"    {line}" for line in lines) for sql, lines in plans)


def names_index(lines: list, index: str) -> bool:
    return any(re.search(rf"\b{re.escape(index)}\b", line) for line in lines)


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """The Location of a database the real server filled through the SDK (the server stopped after)."""
    data_dir = tmp_path_factory.mktemp("actae-indexes")
    model_server, _ = import_example("tiny_model_server.py").serve()
    upstream = f"tiny=http://127.0.0.1:{model_server.server_address[1]}"
    try:
        with ServerProcess(data_dir, args=["--llm-upstream", upstream]).start() as server:
            using(server, fill)
            answer = httpx.post(f"{server.url}/llm/runs/{RUN}/tiny/v1/chat/completions", timeout=30,
                                headers={"x-api-key": server.key},
                                json={"model": "m", "messages": [{"role": "user", "content": "a recorded call"}]})
            assert answer.status_code == 200, answer.text
    finally:
        model_server.shutdown()
    return actae.Location(server.data_dir, server.database)


@pytest.fixture(scope="module")
def conn(filled):
    connection = actae.connect_sync(filled)
    if connection.dialect is actae.POSTGRES:
        connection.execute("SET enable_seqscan = off")      # tiny tables: ask whether an index *can* serve it
    yield connection
    connection.close()


@pytest.mark.parametrize("index, use", query_lines())
def test_every_listed_query_uses_its_index(conn, index, use):
    in_plans = schema_indexes(conn).get(index, index)
    plans = plans_of(conn, sent_in_a_rolled_back_transaction(conn, use.work))
    assert plans, f"{index}: {use.why} sent no statement to plan"
    used = any(names_index(lines, in_plans) for _, lines in plans)
    miss = use.misses.get(BACKEND)
    if miss is not None:
        assert not used, f"{index}: the {BACKEND} plan of {use.why} uses it now: delete the note ({miss!r})\n{shown(plans)}"
        pytest.xfail(f"{index} on {BACKEND}: {miss}")
    assert used, f"{index} is not in the {BACKEND} plan of {use.why}:\n{shown(plans)}"
