"""A server alone on its PostgreSQL database tells nobody of its commits; told that another listens,
it tells of every one.

Servers sharing a database hear of each other's commits through NOTIFY (their streams read them
then). Each notice costs a transaction, a signal to every listener and a wake-up of the sender's own
listener, so a server sends none until it hears another server say it listens: a listener says
"hello" when it starts, and the servers already there answer "here". The test plays the newcomer
with a plain connection: it listens, watches a write go by untold, says hello, hears the answer,
and then hears of the next write. Two real servers telling each other are tests/test_pg_overlap.py's
third case (a subscriber on one server gets what the other wrote).

Skipped unless the tests run on PostgreSQL (ACTAE_TEST_DATABASE_URL).
"""
from __future__ import annotations

import pytest

from conftest import BACKEND, ServerProcess, fresh_database_url, http

pytestmark = pytest.mark.skipif(BACKEND != "postgresql", reason="NOTIFY between servers: needs ACTAE_TEST_DATABASE_URL")

CHANNEL = "actae_events"      # the server's NOTIFY channel: payload "<server id>\n<lines>"
WAIT = 30.0                   # a hang guard for what must come
UNTOLD = 1.5                  # how long a write is watched go by without a notice (a notice comes in ms)


def record(server, channel: str) -> None:
    status, _, body = http("POST", server.url + "/api/v1/events/record", key=server.key,
                           body={"channel_id": channel, "event_type": "step", "payload": {}, "actor": "test"})
    assert status == 200, body


def heard(ear, timeout: float, until=lambda payload: False) -> list:
    """The payloads the listening connection hears within `timeout` seconds, or until one satisfies `until`."""
    payloads = []
    for note in ear.notifies(timeout=timeout):
        payloads.append(note.payload)
        if until(note.payload):
            break
    return payloads


def test_a_server_alone_tells_nobody_until_a_newcomer_says_hello(tmp_path):
    import psycopg

    database = fresh_database_url("pg_peers")
    with ServerProcess(tmp_path, database=database).start() as server, \
            psycopg.connect(database, autocommit=True) as ear:
        ear.execute(f"LISTEN {CHANNEL}")
        record(server, "untold-run")
        assert not any("untold-run" in p for p in heard(ear, UNTOLD)), "a server alone sent a notice"

        ear.execute("SELECT pg_notify(%s, %s)", (CHANNEL, "test-newcomer\nhello"))
        answers = heard(ear, WAIT, until=lambda p: p.endswith("\nhere"))
        assert answers and answers[-1].endswith("\nhere"), answers
        origin = answers[-1].split("\n")[0]

        record(server, "told-run")
        notices = heard(ear, WAIT, until=lambda p: "told-run\t1" in p)
        assert notices and notices[-1] == f"{origin}\ntold-run\t1", notices
