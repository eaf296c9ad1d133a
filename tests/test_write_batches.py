"""The writer's batches (run_jobs) on a real database: SQLite here, PostgreSQL on CI's second pass.

A batch first runs together, without a savepoint per job; a failure rolls it back and runs it
again isolated. These tests hold what callers rely on whichever way a batch ran: each job gets
exactly the outcome it would have had alone, only the jobs that succeeded are committed, their
after-commit actions run once, and a failed attempt leaves nothing behind.
"""
from __future__ import annotations

import sys

import pytest

from conftest import ROOT, database_url_for

sys.path.insert(0, str(ROOT))
import actae  # noqa: E402  (the module under test, imported from the checkout)


@pytest.fixture
def conn(tmp_path):
    connection = actae.connect_sync(actae.Location(tmp_path, database_url_for(tmp_path)))
    yield connection
    connection.close()


def record(channel: str, operation: str, n: int) -> actae._Job:
    body = actae.RecordEvent(channel_id=channel, event_type="step", payload={"n": n}, operation_id=operation)
    return actae._Job(actae.record_event, (body,), None)


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
    return actae._Job(work, (), None)


def cursors(conn, channel: str) -> list:
    return [row[0] for row in conn.execute(
        "SELECT cursor FROM events WHERE channel_id = ? ORDER BY cursor", (channel,)).fetchall()]


def test_a_batch_that_succeeds_commits_every_job_in_order(conn):
    outcomes = actae.run_jobs(conn, [record("ok-run", f"op-{n}", n) for n in range(5)])
    assert [(result.cursor, len(events)) for result, events in outcomes] == [(n, 1) for n in range(1, 6)]
    assert cursors(conn, "ok-run") == [1, 2, 3, 4, 5]


def test_a_failing_job_fails_alone_and_the_others_commit_gapless(conn):
    log: list = []
    jobs = [record("mixed-run", "a", 1), actae._Job(refused, (), None), noted(log, "after-refusal"),
            actae._Job(duplicate_key, (), None), record("mixed-run", "b", 2)]
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
    (outcome, events), = actae.run_jobs(conn, [actae._Job(refused, (), None)])
    assert isinstance(outcome, actae.Conflict) and events is None
    assert cursors(conn, "refused-run") == []
    (result, _), = actae.run_jobs(conn, [record("refused-run", "after", 1)])   # the connection still writes
    assert result.cursor == 1


def test_a_replayed_operation_id_is_not_a_failure(conn):
    actae.run_jobs(conn, [record("replay-run", "same", 1)])
    (again, events), (other, _) = actae.run_jobs(conn, [record("replay-run", "same", 1), record("replay-run", "new", 2)])
    assert again.cursor == 1 and events == []                 # the stored event, nothing appended
    assert other.cursor == 2 and cursors(conn, "replay-run") == [1, 2]
