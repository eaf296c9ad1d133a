"""State storage that grows with what changed: deltas against the previous version, forks that share.

A 200-step run whose state is a message list growing by about 1 KB a step (varied text) stores
less than twice the bytes it adds; every version reads back exactly as it was saved (the same
JSON text, hence the same sha256), on a fresh server, across a restart, after export and import,
and after a version that later ones were built on is deleted; a fork shares its parent's snapshot
and reads it back the same; a database written before deltas existed opens and reads.

Bytes stored are read from the database itself (the `states` rows of the run), on either backend.
"""
from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, ServerProcess, cli, http, query_database, state_sha256

STEPS = 200


def varied_text(rng: random.Random, size: int) -> str:
    words = ["fork", "ledger", "agent", "tool", "state", "replay", "cursor", "receipt", "step", "budget",
             "λ", "naïve", "数据", "🙂"]
    out = []
    while sum(len(w) + 1 for w in out) < size:
        out.append(rng.choice(words) + str(rng.randrange(10 ** rng.randrange(1, 6))))
    return " ".join(out)


def growing_states(steps: int = STEPS, seed: int = 7) -> list:
    """The state after each step: messages grow by ~1 KB; a few other keys change as agents' do."""
    rng = random.Random(seed)
    states, messages = [], []
    for step in range(1, steps + 1):
        messages = messages + [{"role": rng.choice(["user", "assistant", "tool"]), "content": varied_text(rng, 1000),
                                "tokens": rng.randrange(100, 400), "score": rng.random()}]
        state = {"step": step, "status": "running", "messages": messages, "usage": {"tokens": step * 250}}
        if step % 17 == 0:
            state["plan"] = {"next": varied_text(rng, 40), "ok": True}
        if step % 23 == 0:
            state = {"messages": messages, "status": "running", "step": step}          # keys reordered, some gone
        if step % 41 == 0:
            state["messages"] = messages[:-3] + [{"role": "user", "content": "rewritten"}]   # not an append
        if step % 29 == 0:
            state["flags"] = [1, 1.0, True, None, "1"]                                   # values only JSON tells apart
        states.append(state)
    return states


def text_of(value) -> str:
    """The JSON text the server stores and answers (compact, keys in the order given)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def save_all(server, channel: str, states: list) -> list:
    versions = []
    for cursor, state in enumerate(states, start=1):
        status, _, body = http("POST", server.url + f"/api/v1/events/record", key=server.key,
                               body={"channel_id": channel, "event_type": "step", "payload": {"n": cursor},
                                     "step_number": cursor})
        assert status == 200, body
        status, _, body = http("POST", server.url + f"/api/v1/state/{channel}", key=server.key,
                               body={"cursor": body["event"]["cursor"], "state": state})
        assert status == 200, body
        versions.append(body["version"])
    return versions


def raw_version_text(server, channel: str, version: int) -> str:
    """The state as the server answers it, as text: the answer's "state" member, byte for byte."""
    status, _, body = http("GET", server.url + f"/api/v1/state/{channel}/version/{version}", key=server.key)
    assert status == 200, body
    return text_of(body["state"])


def assert_reads_back(server, channel: str, versions: list, states: list) -> None:
    for version, state in zip(versions, states):
        got = raw_version_text(server, channel, version)
        assert got == text_of(state), f"version {version} reads back differently"
        assert hashlib.sha256(got.encode()).hexdigest() == hashlib.sha256(text_of(state).encode()).hexdigest()
    status, _, latest = http("GET", server.url + f"/api/v1/state/{channel}", key=server.key)
    assert status == 200 and text_of(latest["state"]) == text_of(states[-1]) and latest["version"] == versions[-1]


def stored_bytes(target, channel: str) -> int:
    sql = "SELECT COALESCE(SUM(LENGTH(state)), 0) FROM states WHERE channel_id = ?"
    return int(query_database(target, sql, (channel,), postgresql=sql.replace("?", "%s"))[0][0])


def added_bytes(states: list) -> int:
    """What each step adds: the growth of the state's JSON text (the first step adds all of it)."""
    sizes = [len(text_of(s).encode()) for s in states]
    return sizes[0] + sum(max(0, b - a) for a, b in zip(sizes, sizes[1:]))


@pytest.fixture(scope="module")
def stored_run(tmp_path_factory):
    data = tmp_path_factory.mktemp("deltas")
    states = growing_states()
    with ServerProcess(data).start() as srv:
        versions = save_all(srv, "grow", states)
        yield srv, data, versions, states


def test_a_growing_state_stores_less_than_twice_what_it_adds(stored_run):
    srv, _, _, states = stored_run
    stored, added = stored_bytes(srv, "grow"), added_bytes(states)
    whole = sum(len(text_of(s).encode()) for s in states)
    print(f"\n[state storage] {STEPS} steps: added {added} B, stored {stored} B ({stored / added:.2f}x); "
          f"stored whole it would be {whole} B ({whole / added:.0f}x)")
    assert stored < 2 * added
    kinds = query_database(srv, "SELECT COUNT(*), COUNT(delta_base) FROM states WHERE channel_id = ?", ("grow",),
                           postgresql="SELECT COUNT(*), COUNT(delta_base) FROM states WHERE channel_id = %s")[0]
    assert kinds[0] == STEPS and kinds[1] > STEPS // 2, "most versions are deltas"


def test_every_version_reads_back_as_it_was_saved(stored_run):
    srv, _, versions, states = stored_run
    assert_reads_back(srv, "grow", versions, states)


def test_every_version_reads_back_after_a_restart(stored_run):
    srv, data, versions, states = stored_run
    key = srv.key
    srv.stop()
    with ServerProcess(data).start() as again:     # an empty cache: every version is rebuilt from the rows
        again.key = key
        assert_reads_back(again, "grow", versions, states)
    srv.start()
    srv.key = key


def test_a_fork_shares_its_snapshot_and_both_read_back(stored_run):
    srv, _, versions, states = stored_run
    at = 100
    status, _, receipt = http("POST", srv.url + "/api/v1/channels/fork", key=srv.key,
                              body={"source_channel_id": "grow", "new_channel_id": "grow-fork", "at_cursor": at})
    assert status == 200 and receipt["source_state_sha256"] == state_sha256(states[at - 1])
    assert stored_bytes(srv, "grow-fork") == 0, "the fork's first snapshot is shared, not copied"
    status, _, latest = http("GET", srv.url + "/api/v1/state/grow-fork", key=srv.key)
    assert text_of(latest["state"]) == text_of(states[at - 1])
    grown = [dict(states[at - 1], step=at + n, note="x" * 5000 + str(n)) for n in range(1, 4)]
    fork_versions = save_all(srv, "grow-fork", grown)
    assert_reads_back(srv, "grow-fork", fork_versions, grown)


def test_versions_survive_export_and_import(stored_run, tmp_path):
    srv, data, versions, states = stored_run
    exported = cli("export", "grow", data_dir=srv).stdout
    (tmp_path / "grow.jsonl").write_text(exported)
    with ServerProcess(tmp_path / "other").start() as other:
        status, _, answer = http("POST", other.url + "/api/v1/import", key=other.key,
                                 raw=exported.encode(), headers={"content-type": "application/x-ndjson"})
        assert status == 200 and answer["imported"] == ["grow"], answer
        assert_reads_back(other, "grow", versions, states)


def test_deleting_a_version_that_later_ones_build_on_keeps_them_readable(tmp_path):
    states = growing_states(60, seed=11)
    with ServerProcess(tmp_path / "d").start() as srv:
        versions = save_all(srv, "del", states)
        base = query_database(srv, "SELECT delta_base FROM states WHERE channel_id = ? AND version = ?",
                              ("del", versions[40]),
                              postgresql="SELECT delta_base FROM states WHERE channel_id = %s AND version = %s")[0][0]
        assert base is not None, "version 41 is a delta (the test needs one)"
        http("POST", srv.url + "/api/v1/channels/fork", key=srv.key,
             body={"source_channel_id": "del", "new_channel_id": "del-fork", "at_cursor": base})
        for gone in (base, versions[0], versions[-1]):
            status, _, body = http("DELETE", srv.url + f"/api/v1/state/del/version/{gone}", key=srv.key)
            assert status == 200 and body["deleted"] == 1
        kept = [(v, s) for v, s in zip(versions, states) if v not in (base, versions[0], versions[-1])]
        for version, state in kept:
            assert raw_version_text(srv, "del", version) == text_of(state), f"version {version}"
        status, _, fork_state = http("GET", srv.url + "/api/v1/state/del-fork", key=srv.key)
        assert text_of(fork_state["state"]) == text_of(states[versions.index(base)])


def test_a_database_written_before_deltas_opens_and_reads(tmp_path):
    """The server of the commit before deltas writes the run; this one opens the same database."""
    old = tmp_path / "old"
    old.mkdir()
    try:
        source = subprocess.run(["git", "-C", str(ROOT), "show", "d327d80:actae.py"], capture_output=True,
                                text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs the repository's history (git) for the server before deltas")
    (old / "actae.py").write_text(source)
    shutil.copytree(ROOT / "ui", old / "ui")
    states = growing_states(30, seed=3)
    data = tmp_path / "data"
    with ServerProcess(data, command=[sys.executable, str(old / "actae.py")]).start() as before:
        versions = save_all(before, "legacy", states)
        key = before.key
    with ServerProcess(data).start() as now:
        now.key = key
        assert_reads_back(now, "legacy", versions, states)
        more = [dict(states[-1], step=31 + n, extra="y" * 6000) for n in range(3)]
        assert_reads_back(now, "legacy", versions + save_all(now, "legacy", more), states + more)


def test_a_null_state_and_a_large_state_after_it_are_stored_and_read(tmp_path):
    with ServerProcess(tmp_path / "n").start() as srv:
        big = {"messages": ["x" * 5000]}
        for state in (None, big, None, dict(big, more=1)):
            status, _, body = http("POST", srv.url + "/api/v1/state/nulls", key=srv.key, body={"cursor": 0, "state": state})
            assert status == 200, body
        versions = [1, 2, 3, 4]
        assert_reads_back(srv, "nulls", versions, [None, big, None, dict(big, more=1)])
