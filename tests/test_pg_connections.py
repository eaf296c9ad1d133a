"""A server whose PostgreSQL connections are cut writes again, and nothing half-written remains.

PostgreSQL may drop a server's connections (a restart, a failover, an administrator's
pg_terminate_backend). The write that meets a dropped connection fails with a 503 and commits
nothing; its pool opens a new connection and the next writes succeed (and so do reads: each reader
connection fails one read the same way). The test cuts every connection of the server's database
mid-run, then writes until one succeeds: every answer is a 200 or a 503, never anything else, and
the channel's cursors are exactly those the 200s answered.

Skipped unless the tests run on PostgreSQL (ACTAE_TEST_DATABASE_URL).
"""
from __future__ import annotations

import time

import pytest

from conftest import BACKEND, ServerProcess, fresh_database_url, http

pytestmark = pytest.mark.skipif(BACKEND != "postgresql", reason="PostgreSQL connections: needs ACTAE_TEST_DATABASE_URL")

WAIT = 30.0            # a hang guard: the pool reconnects within a second or two
CHANNEL = "cut-run"


def record(server, n: int) -> tuple:
    status, _, body = http("POST", server.url + "/api/v1/events/record", key=server.key,
                           body={"channel_id": CHANNEL, "event_type": "step", "payload": {"n": n}, "actor": "test"})
    return status, body


def test_writes_succeed_again_after_postgresql_drops_every_connection(tmp_path):
    import psycopg

    database = fresh_database_url("pg_cut")
    with ServerProcess(tmp_path, database=database).start() as server, \
            psycopg.connect(database, autocommit=True) as admin:
        answered = [record(server, 0)]
        assert answered[0][0] == 200, answered
        cut = admin.execute("SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity"
                            " WHERE datname = current_database() AND pid <> pg_backend_pid()").fetchone()[0]
        assert cut >= 2                       # at least the writer's connection and a reader's
        deadline = time.monotonic() + WAIT
        while answered[-1][0] != 200 or len(answered) == 1:
            assert time.monotonic() < deadline, f"no write succeeded after the cut: {answered[-3:]}"
            answered.append(record(server, len(answered)))
        statuses = [status for status, _ in answered]
        assert set(statuses) <= {200, 503}, answered
        while True:                           # each reader's dropped connection fails one read too
            status, _, body = http("GET", f"{server.url}/api/v1/events/replay/{CHANNEL}?cursor=0&limit=1000",
                                   key=server.key)
            assert status in (200, 503), body
            if status == 200:
                break
            assert time.monotonic() < deadline, f"no read succeeded after the cut: {body}"
        stored = [event["cursor"] for event in body["events"]]
        assert stored == [answer["event"]["cursor"] for status, answer in answered if status == 200] == list(range(1, len(stored) + 1))
