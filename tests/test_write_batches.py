"""The writer's batches (run_jobs) on a real database: SQLite here, PostgreSQL on CI's second pass.

A batch first runs together, without a savepoint per job; a failure rolls it back and runs it
again isolated. These tests hold what callers rely on whichever way a batch ran: each job gets
exactly the outcome it would have had alone, only the jobs that succeeded are committed, their
after-commit actions run once, and a failed attempt leaves nothing behind.
"""
from __future__ import annotations

import asyncio
import sys
import threading
from datetime import datetime, timedelta, timezone

import pytest

from conftest import ROOT, database_url_for, http

sys.path.insert(0, str(ROOT))
import actae  # noqa: E402  (the module under test, imported from the checkout)


@pytest.fixture
def conn(tmp_path):
    connection = actae.connect_sync(actae.Location(tmp_path, database_url_for(tmp_path)))
    yield connection
    connection.close()


def record(channel: str, operation: str, n: int) -> actae.Job:
    body = actae.RecordEvent(channel_id=channel, event_type="step", payload={"n": n}, operation_id=operation)
    return actae.Job(actae.record_event, (body,), None)


def refused(tx: actae.Tx) -> None:
    """Writes a row, then refuses: the row must not survive whichever way the batch ran."""
    actae.append_event(tx, "refused-run", "step", {"written": "then refused"})
    raise actae.Conflict("conflict", "refused on purpose")


def duplicate_key(tx: actae.Tx) -> None:
    """A write the database itself refuses (a unique constraint): the caller's 409."""
    tx.conn.execute("INSERT INTO settings (name, value) VALUES ('instance_id', 'a second one')")


def noted(log: list, name: str):
    def work(tx: actae.Tx) -> str:
        tx.after_commit.append(lambda: log.append(name))
        return name
    return actae.Job(work, (), None)


def cursors(conn, channel: str) -> list:
    return [row[0] for row in conn.execute(
        "SELECT cursor FROM events WHERE channel_id = ? ORDER BY cursor", (channel,)).fetchall()]


def test_a_batch_that_succeeds_commits_every_job_in_order(conn):
    outcomes = actae.run_jobs(conn, [record("ok-run", f"op-{n}", n) for n in range(5)])
    assert [(result.cursor, len(events)) for result, events in outcomes] == [(n, 1) for n in range(1, 6)]
    assert cursors(conn, "ok-run") == [1, 2, 3, 4, 5]


def test_a_failing_job_fails_alone_and_the_others_commit_gapless(conn):
    log: list = []
    jobs = [record("mixed-run", "a", 1), actae.Job(refused, (), None), noted(log, "after-refusal"),
            actae.Job(duplicate_key, (), None), record("mixed-run", "b", 2)]
    conn.execute("INSERT INTO settings (name, value) VALUES ('instance_id', 'the first one')")
    outcomes = actae.run_jobs(conn, jobs)
    (first, _), (refusal, refusal_events), (name, _), (duplicate, duplicate_events), (last, _) = outcomes
    assert (first.cursor, last.cursor) == (1, 2)              # gapless: the refused jobs took no cursor
    assert isinstance(refusal, actae.Conflict) and refusal.message == "refused on purpose"
    assert isinstance(duplicate, actae.Conflict) and refusal_events is None and duplicate_events is None
    assert name == "after-refusal" and log == ["after-refusal"]   # once, though the batch ran twice
    assert cursors(conn, "mixed-run") == [1, 2]
    assert cursors(conn, "refused-run") == []                 # what the refused job wrote is gone
    assert conn.execute("SELECT value FROM settings WHERE name = 'instance_id'").fetchone()[0] == "the first one"


def test_a_lone_failing_job_gets_its_error_and_leaves_nothing(conn):
    (outcome, events), = actae.run_jobs(conn, [actae.Job(refused, (), None)])
    assert isinstance(outcome, actae.Conflict) and events is None
    assert cursors(conn, "refused-run") == []
    (result, _), = actae.run_jobs(conn, [record("refused-run", "after", 1)])   # the connection still writes
    assert result.cursor == 1


def test_a_replayed_operation_id_is_not_a_failure(conn):
    actae.run_jobs(conn, [record("replay-run", "same", 1)])
    (again, events), (other, _) = actae.run_jobs(conn, [record("replay-run", "same", 1), record("replay-run", "new", 2)])
    assert again.cursor == 1 and events == []                 # the stored event, nothing appended
    assert other.cursor == 2 and cursors(conn, "replay-run") == [1, 2]


def event_of_type(channel: str, operation: str, event_type: str) -> actae.Job:
    body = actae.RecordEvent(channel_id=channel, event_type=event_type, payload={}, operation_id=operation)
    return actae.Job(actae.record_event, (body,), None)


def stored_row(conn, channel: str) -> tuple:
    return tuple(conn.execute("SELECT * FROM channels WHERE id = ?", (channel,)).fetchone())


def test_an_event_within_its_runs_second_writes_no_row_of_the_run(conn, monkeypatch):
    """A run's event count, chain head and exact last activity are its last event's, read off the
    events; the run's row holds what changes at most once a second (the activity's second) or
    rarely (a blocking or failing event), so an ordinary event within the second leaves it as it was:
    one page fewer per commit. The clock is held inside one second; batches step a millisecond each."""
    monkeypatch.setattr(actae, "utc_now", lambda: datetime(2030, 1, 2, 3, 4, 5, 100_000, tzinfo=timezone.utc))
    (first, _), = actae.run_jobs(conn, [record("quiet-run", "q1", 1)])
    quiet = stored_row(conn, "quiet-run")
    (second, _), = actae.run_jobs(conn, [record("quiet-run", "q2", 2)])
    (third, _), = actae.run_jobs(conn, [record("quiet-run", "q3", 3)])
    assert stored_row(conn, "quiet-run") == quiet
    row = actae.channel_by_id(conn, "quiet-run")
    assert (row["last_cursor"], row["chain_head"]) == (3, third.chain_hash)
    assert (first.cursor, second.cursor) == (1, 2) and first.timestamp < second.timestamp < third.timestamp
    assert actae.verify_chain(conn, "quiet-run").ok
    actae.run_jobs(conn, [event_of_type("quiet-run", "q4", "approval.requested")])
    assert actae.channel_by_id(conn, "quiet-run")["run_state"] == "blocked"     # a fact changed: written
    actae.run_jobs(conn, [record("quiet-run", "q5", 5)])
    assert actae.channel_by_id(conn, "quiet-run")["run_state"] == "recorded"    # and written back
    (failed, _), = actae.run_jobs(conn, [event_of_type("quiet-run", "q6", "agent.error")])
    row = actae.channel_by_id(conn, "quiet-run")
    assert (row["run_state"], row["error_cursor"], row["last_cursor"]) == ("failed", failed.cursor, 6)


VALUES = ("text é ✓", 1, 70_000, 2**40, -(2**62), b"\x00\x01\xff", 1.25, None)


def stored_time(tx: actae.Tx) -> str:
    return tx.ts


def test_batches_one_after_another_store_later_times_even_within_a_millisecond(conn):
    """Stored times have millisecond resolution and the runs pages list by last activity: batches in
    a row on one writer must not tie, however fast they commit (a burst within the writer's lead)."""
    times = [actae.run_jobs(conn, [actae.Job(stored_time, (), None)])[0][0] for _ in range(8)]
    assert times == sorted(set(times))


def test_a_writer_never_runs_further_ahead_of_the_clock_than_its_lead(conn):
    """Leases and expiries read stored times against the clock: however far ahead the previous batch
    was stamped (a clock stepped back, a long burst), the next is at most BATCH_LEAD_MAX ahead."""
    conn.last_batch_at = datetime.now(timezone.utc) + timedelta(hours=1)
    (stamped, _), = actae.run_jobs(conn, [actae.Job(stored_time, (), None)])
    after = datetime.now(timezone.utc)
    assert stamped <= stamp(after + actae.BATCH_LEAD_MAX)


def stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


BROKEN_RULES = ["UPDATE channels SET outcome = 'bogus' WHERE id = 'rules-run'",
                "UPDATE channels SET reproducibility = 'bogus' WHERE id = 'rules-run'",
                "UPDATE channels SET restorable = 2 WHERE id = 'rules-run'",
                "UPDATE events SET step_number = 0 WHERE channel_id = 'rules-run'"]


@pytest.mark.parametrize("statement", BROKEN_RULES)
def test_the_database_itself_refuses_a_value_outside_a_columns_rule(conn, statement):
    """The rules hold below the domain code too (PostgreSQL keeps them as domains, SQLite as CHECKs)."""
    actae.run_jobs(conn, [record("rules-run", "op-1", 1)])
    (outcome, events), = actae.run_jobs(conn, [actae.Job(lambda tx: tx.conn.execute(statement), (), None)])
    assert isinstance(outcome, Exception) and events is None
    row = conn.execute("SELECT outcome, reproducibility, restorable FROM channels WHERE id = 'rules-run'").fetchone()
    assert tuple(row) == (None, None, 0)
    assert conn.execute("SELECT step_number FROM events WHERE channel_id = 'rules-run'").fetchone()[0] is None


def echo(tx: actae.Tx) -> tuple:
    """The values read back inside a batch, as a job reads rows (by position and by column name)."""
    row = tx.conn.execute("SELECT ? AS t, ? AS i2, ? AS i4, ? AS i8, ? AS neg, ? AS b, ? AS f, ? AS n", VALUES).fetchone()
    return tuple(row), row["t"], row["b"]


def test_values_read_back_in_a_batch_are_the_ones_read_outside(conn):
    """A batch's statements may take another path to the database than a lone read (PostgreSQL
    pipelines them): each value comes back as it went in, of the same type, either way."""
    outside = tuple(conn.execute("SELECT ? AS t, ? AS i2, ? AS i4, ? AS i8, ? AS neg, ? AS b, ? AS f, ? AS n", VALUES).fetchone())
    (together, _), (again, _) = actae.run_jobs(conn, [actae.Job(echo, (), None), actae.Job(echo, (), None)])
    assert together == again == (VALUES, VALUES[0], VALUES[5])
    assert outside == VALUES
    assert [type(value) for value in together[0]] == [type(value) for value in VALUES]


def test_a_read_between_sends_sees_the_batchs_own_writes(conn):
    """A job reads what the jobs before it in the same batch wrote (a read waits for every answer
    sent before it), and a job that fails after such a read fails alone."""
    def write_then_read(tx: actae.Tx) -> list:
        actae.append_event(tx, "read-run", "step", {"n": 2})
        return cursors(tx.conn, "read-run")

    def read_then_refuse(tx: actae.Tx) -> None:
        assert cursors(tx.conn, "read-run") == [1, 2]
        raise actae.Conflict("conflict", "refused after reading")

    outcomes = actae.run_jobs(conn, [record("read-run", "first", 1), actae.Job(write_then_read, (), None),
                                     actae.Job(read_then_refuse, (), None), record("read-run", "last", 3)])
    assert outcomes[1][0] == [1, 2]
    assert isinstance(outcomes[2][0], actae.Conflict) and outcomes[3][0].cursor == 3
    assert cursors(conn, "read-run") == [1, 2, 3]


# --- where a batch runs: a lone quick write on the event loop's thread, the rest on the writer's ---


def thread_name(tx: actae.Tx) -> str:
    actae.append_event(tx, "where-run", "step", {"thread": threading.current_thread().name})
    return threading.current_thread().name


async def opened(tmp_path, lone) -> actae.Database:
    db = await actae.Database(actae.Location(tmp_path, database_url_for(tmp_path)), actae.CommitPolicy(alone=lone)).open()
    db.here_seconds_max = 1.0          # what counts as a quick batch, for a test on a busy machine
    return db


def test_a_lone_quick_write_commits_on_the_event_loops_thread(tmp_path):
    async def scenario():
        db = await opened(tmp_path, lambda job: job.work is thread_name)
        # "Quick" is injected, not measured: a commit on a loaded machine (two suites at once) can take
        # longer than the server's 2 ms and would make this test about the disk, not the rule.
        db.here_seconds_max = 1.0
        try:
            first = await db.write(thread_name)            # no batch timed yet: the writer's thread
            second = await db.write(thread_name)           # quick and alone: here
            db.last_batch_seconds = 5.0                     # as after a slow commit
            third = await db.write(thread_name)            # the writer's thread again...
            fourth = await db.write(thread_name)           # ...until a batch is quick
            job = record("where-run", "not-listed", 1)
            other = await db.write(job.work, *job.args)    # not a lone write: the writer's thread
            return first, second, third, fourth, other, db.batches
        finally:
            await db.close()

    here = threading.current_thread().name
    first, second, third, fourth, other, batches = asyncio.run(scenario())
    on_postgres = database_url_for(tmp_path) is not None
    assert first != here and third != here and batches == 5
    assert (second == here and fourth == here) is not on_postgres   # PostgreSQL: always the writer's thread
    assert other.cursor == 5
    conn = actae.connect_sync(actae.Location(tmp_path, database_url_for(tmp_path)))
    try:                                                   # committed, as seen by another connection
        assert cursors(conn, "where-run") == [1, 2, 3, 4, 5]
    finally:
        conn.close()


def test_writes_in_flight_together_share_the_writers_batches(tmp_path):
    async def scenario():
        db = await opened(tmp_path, lambda job: False)     # what create_app says while others are in flight
        try:
            names = await asyncio.gather(*(db.write(thread_name) for _ in range(40)))
            return names, db.batches
        finally:
            await db.close()

    names, batches = asyncio.run(scenario())
    assert threading.current_thread().name not in names and batches < 40


def batch_counts(server) -> tuple:
    """(batches, jobs) committed so far, from /metrics."""
    status, _, text = http("GET", server.url + "/metrics", key=server.key)
    assert status == 200
    found = dict(line.split() for line in text.splitlines()
                 if line.startswith(("actae_write_batch_jobs_count ", "actae_write_batch_jobs_sum ")))
    return float(found["actae_write_batch_jobs_count"]), float(found["actae_write_batch_jobs_sum"])


def test_requests_in_flight_together_are_committed_together(server, unique):
    """Only a write alone on the server commits on the event loop's thread: 64 sent at once share
    the writer's batches (group commit), and each gets its own answer."""
    import aiohttp

    channels = [unique("together") for _ in range(64)]

    async def send_all():
        headers = {"x-api-key": server.key}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
            async def one(channel):
                body = {"channel_id": channel, "event_type": "step", "payload": {"n": 1}}
                async with session.post(server.url + "/api/v1/events/record", json=body, headers=headers) as answer:
                    return answer.status, (await answer.json())["event"]["channel_id"]
            return await asyncio.gather(*(one(channel) for channel in channels))

    before = batch_counts(server)
    answers = asyncio.run(send_all())
    after = batch_counts(server)
    assert answers == [(200, channel) for channel in channels]
    batches, jobs = after[0] - before[0], after[1] - before[1]
    assert jobs >= 64 and batches <= jobs / 2, (batches, jobs)      # others (wake-ups, key use) may commit too


def test_the_app_lets_only_a_listed_write_alone_on_the_server_commit_on_its_loop(tmp_path):
    app = actae.create_app(tmp_path, database_url=database_url_for(tmp_path))
    lone = app.services.db.policy.alone
    step = record("c", "op", 1)
    prune = actae.Job(actae.prune_runs, (), None)
    assert lone(step) and not lone(prune)                  # nothing else in flight: an SDK step may, a prune never
    app.in_flight = 1                                      # the request that writes (ActaeApp counts its own)
    assert lone(step) and not lone(prune)
    app.in_flight = 2                                      # another request, being answered or waiting to be
    assert not lone(step)


def test_several_writers_take_each_channels_jobs_apart_and_in_order():
    """Several writers (an engine may run more than one): a batch takes no job of a channel another
    batch in flight holds, nor any later job of it (one channel's jobs keep their order); a job that
    names no channels waits for the batches in flight; with nothing in flight, a batch is the queue's
    front as it came."""
    def job(*channels):
        return actae.Job(None, (), None, channels=None if channels == (None,) else channels)

    queue = actae.WriteQueue(2)
    a1, b1, a2, c1, anything, c2, b2 = job("a"), job("b"), job("a"), job("c"), job(None), job("c"), job("b")
    for each in (a1, b1):
        queue.put(each)
    first = queue.take()
    assert first == [a1, b1]
    for each in (a2, c1, anything, c2, b2):
        queue.put(each)
    second = queue.take()                 # a2 waits for a1's batch; `anything` for every batch
    assert second == [c1]
    queue.done(first)
    third = queue.take()
    assert third == [a2]                   # c1's batch is still in flight: `anything` waits
    queue.done(second)
    queue.done(third)
    assert queue.take() == [anything, c2, b2]   # nothing in flight: the front, in order
    queue.put(None)
    assert queue.take() is None


def test_one_writer_batches_the_queue_front_and_runs_a_bare_job_alone():
    queue = actae.WriteQueue(1)
    jobs = [actae.Job(None, (), None) for _ in range(3)]
    bare = actae.Job(None, (), None, bare=True)
    for each in (jobs[0], jobs[1], bare, jobs[2]):
        queue.put(each)
    first = queue.take()
    assert first == jobs[:2]
    queue.done(first)
    alone = queue.take()
    assert alone == [bare]
    queue.done(alone)
    assert queue.take() == [jobs[2]]
