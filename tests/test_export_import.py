"""Moving runs between servers: `actae export` / `actae import` and their HTTP twins.

Two fresh servers (two data dirs) per module; runs are made on the first with the real SDK,
carried to the second as JSON Lines (over HTTP, or with the CLI on the data dirs while both
servers run), and must then read, verify, fork and diff there exactly as on the first.
"""
from __future__ import annotations

import copy
import json

import pytest
from actae_client import AgentSession, ForkToolBlockedError

from conftest import POSTGRES_URL, ServerProcess, api, cli, get_json, http, state_sha256, using

NDJSON = "application/x-ndjson"
CHARGE = ("inv-1", "charge_customer", {"amount_cents": 4900})
# Receipt fields that derive from the source run's content (not from when or where the fork was made).
CONTENT_FIELDS = ("source_channel_id", "origin_run_id", "requested_cursor", "resolved_cursor",
                  "resolved_state_cursor", "resolved_event_id", "forked_at_step", "source_state_version",
                  "source_state_sha256", "restorable", "manifest", "reproducibility", "tool_policies")


class Crash(Exception):
    pass


# ── servers, clients, files ─────────────────────────────────────────────────────────────────────

@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(source, target): two fresh servers on two data dirs."""
    with (ServerProcess(tmp_path_factory.mktemp("export-source")).start() as source,
          ServerProcess(tmp_path_factory.mktemp("import-target")).start() as target):
        yield source, target


def export_http(srv, channel, *, with_forks=False, key=None):
    path = f"/api/v1/channels/{channel}/export?with_forks={'true' if with_forks else 'false'}"
    status, headers, body = api(srv, "GET", path, key=key or srv.key, decode=False)
    ctype = headers.get("content-type")
    assert status == 200, body[:500]
    assert ctype.startswith(NDJSON), ctype
    return body


def import_http(srv, data, *, key=None):
    """(status, JSON answer) of POST /api/v1/import."""
    status, headers, body = api(srv, "POST", "/api/v1/import", key=key or srv.key, raw=data,
                                headers={"content-type": NDJSON}, decode=False)
    ctype = headers.get("content-type")
    assert ctype.startswith("application/json"), (status, ctype, body[:300])
    return status, json.loads(body)


def lines_of(data: bytes) -> list:
    return [json.loads(line) for line in data.decode().splitlines()]


def rows_of(data: bytes) -> list:
    """The rows of a file, without the header (whose exported_at differs between two exports)."""
    return lines_of(data)[1:]


def channels_of(srv) -> list:
    return sorted(get_json(srv, "/api/v1/channels")["channels"])


def content_of(receipt: dict) -> dict:
    return {name: receipt[name] for name in CONTENT_FIELDS}


def content_sha256(receipt: dict) -> str:
    return state_sha256(content_of(receipt))


# ── runs to move ─────────────────────────────────────────────────────────────────────────────────

async def run_with_history(c, root, fork):
    """A root with events, a ledger charge, a large (compressed) and a small state, metadata and an
    outcome; a fork of it with a block policy and events of its own, closed."""
    await c.record(root, "plan", {"step": 1, "text": "naïve café ☕", "big": 2**70}, actor="test",
                   metadata={"model": "m-1"})
    claim = await c.claim_execution(root, *CHARGE)
    await c.complete_execution(claim.execution.id, claim.claim_token, {"charge_id": "ch_1"})
    cursor = await c.get_cursor(root)
    await c.save_state(root, cursor, {"status": "running", "notes": ["note " * 20] * 40})
    await c.record(root, "step", {"n": 2}, actor="test", step_number=1)
    await c.save_state(root, await c.get_cursor(root), {"status": "done"})
    await c.update_metadata(root, display_name="the root", reason="for export")
    await c.set_outcome(root, "inconclusive", score=0.25)
    await c.fork(root, fork, cursor, tool_policies={"charge_customer": "block"}, reason="what if")
    await c.record(fork, "more", {"n": 3}, actor="test")
    await c.save_state(fork, await c.get_cursor(fork), {"status": "forked"})
    status, _, body = http("POST", f"{SERVER_OF[c].url}/api/v1/channels/{fork}/close", key=SERVER_OF[c].key)
    assert status == 200, body


SERVER_OF: dict = {}       # client -> server, for the few calls the SDK has no method for


def make_run(srv, root, fork):
    async def body(c):
        SERVER_OF[c] = srv
        try:
            await run_with_history(c, root, fork)
        finally:
            SERVER_OF.pop(c, None)
    using(srv, body)


def same_views(source, target, channels):
    """What the API shows of each channel is the same on both servers."""
    for channel in channels:
        for path in (f"/api/v1/events/replay/{channel}?limit=1000", f"/api/v1/channels/{channel}/metadata",
                     f"/api/v1/state/{channel}", f"/api/v1/state/{channel}/versions",
                     f"/api/v1/events/verify/{channel}", f"/api/v1/executions?channel_id={channel}",
                     f"/api/v1/channels/{channel}/fork-tree", f"/api/v1/channels/{channel}/steps"):
            assert get_json(source, path) == get_json(target, path), path
        assert get_json(target, f"/api/v1/events/verify/{channel}")["ok"] is True


# ── round trips ─────────────────────────────────────────────────────────────────────────────────

def test_http_round_trip_copies_every_row(servers, unique):
    source, target = servers
    root, fork = unique("root"), unique("fork")
    make_run(source, root, fork)

    data = export_http(source, fork)
    header, *rows = lines_of(data)
    assert header["format"] == "actae-export" and header["version"] == 1
    assert header["channel_id"] == fork and header["with_forks"] is False
    assert header["channels"] == [root, fork], "a fork comes with its ancestors, parents first"
    kinds = [r["kind"] for r in rows]
    assert header["counts"] == {"channels": 2, "events": kinds.count("event"), "states": kinds.count("state"),
                                "executions": kinds.count("execution")}
    assert kinds.count("execution") == 1 and kinds.count("state") == 4
    assert all("claim_token" not in r for r in rows)

    status, answer = import_http(target, data)
    assert status == 200, answer
    assert answer["imported"] == [root, fork] and answer["unchanged"] == []
    assert answer["rows"] == {"events": kinds.count("event"), "states": 4, "executions": 1}

    same_views(source, target, [root, fork])
    assert get_json(source, f"/api/v1/channels/{fork}/receipt") == get_json(target, f"/api/v1/channels/{fork}/receipt")
    diff = f"/api/v1/channels/diff?left={root}&right={fork}"
    assert get_json(source, diff) == get_json(target, diff)
    assert rows_of(export_http(target, fork)) == rows
    big = get_json(target, f"/api/v1/state/{root}/version/1")["state"]
    assert big["notes"] == ["note " * 20] * 40      # stored compressed on both sides

    # The imported fork is still closed; the imported root takes new events after its own.
    assert http("POST", f"{target.url}/api/v1/events/record", key=target.key,
                body={"channel_id": fork, "event_type": "late"})[0] == 409
    status, _, recorded = http("POST", f"{target.url}/api/v1/events/record", key=target.key,
                               body={"channel_id": root, "event_type": "after-import", "payload": {"x": 1}})
    assert status == 200 and recorded["event"]["cursor"] == header["counts"]["events"] - 3 + 1
    assert get_json(target, f"/api/v1/events/verify/{root}")["ok"] is True


def test_cli_round_trip_through_a_file_and_stdin(servers, unique, tmp_path):
    source, target = servers
    root, fork = unique("root"), unique("fork")
    make_run(source, root, fork)

    exported = cli("export", fork, data_dir=source, text=False, check=False)
    assert exported.returncode == 0, exported.stderr
    assert rows_of(exported.stdout) == rows_of(export_http(source, fork))
    path = tmp_path / "run.jsonl"
    path.write_bytes(exported.stdout)

    imported = cli("import", str(path), data_dir=target, text=False, check=False)
    assert imported.returncode == 0, imported.stderr
    out = imported.stdout.decode()
    assert f"Imported 2 channel(s): {root}, {fork}" in out and "unchanged: -" in out
    same_views(source, target, [root, fork])

    again = cli("import", "-", "--json", input=exported.stdout, data_dir=target, text=False, check=False)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == {"ok": True, "imported": [], "unchanged": [root, fork],
                                        "rows": {"events": 0, "states": 0, "executions": 0}}

    missing = cli("export", unique("nope"), data_dir=source, text=False, check=False)
    assert missing.returncode == 1 and b"not found" in missing.stderr and missing.stdout == b""
    bad = cli("import", "-", input=b'{"format": "actae-export", "version": 1}\n{"kind": "x"}\n', data_dir=target,
              text=False, check=False)
    assert bad.returncode == 1 and b"line 1" in bad.stderr


def test_importing_twice_changes_nothing(servers, unique):
    source, target = servers
    root, fork = unique("root"), unique("fork")
    make_run(source, root, fork)
    data = export_http(source, fork, with_forks=True)

    kinds = [row["kind"] for row in rows_of(data)]
    assert import_http(target, data) == (200, {"ok": True, "imported": [root, fork], "unchanged": [], "rows": {
        "events": kinds.count("event"), "states": kinds.count("state"), "executions": kinds.count("execution")}})
    before = export_http(target, fork)
    status, answer = import_http(target, data)
    assert status == 200 and answer["imported"] == [] and answer["unchanged"] == [root, fork]
    assert export_http(target, fork).splitlines()[1:] == before.splitlines()[1:]

    # A file of the root alone is the root, unchanged; the fork already here stays as it is.
    status, answer = import_http(target, export_http(source, root))
    assert status == 200 and answer == {"ok": True, "imported": [], "unchanged": [root],
                                        "rows": {"events": 0, "states": 0, "executions": 0}}


# ── a crashed run moves and forks the same ───────────────────────────────────────────────────────

async def crashed_run(c, channel):
    """Five planned steps, a snapshot after each; step 2 charges the customer; step 3 dies."""
    state = {"status": "running", "step": 0, "notes": []}
    with pytest.raises(Crash):
        async with AgentSession(c, channel, state_fn=lambda: copy.deepcopy(state), snapshot_interval=1) as session:
            for n in range(1, 6):
                state["step"] = n
                if n == 2:
                    claim = await c.claim_execution(channel, *CHARGE)
                    await c.complete_execution(claim.execution.id, claim.claim_token, {"charge_id": "ch_1"})
                    state["charge"] = "ch_1"
                if n == 3:
                    raise Crash("the agent died in step 3")
                state["notes"].append(f"step {n} ☕")
                await session.step(f"step-{n}", input={"n": n}, output={"note": state["notes"][-1]})


async def fork_at(c, channel, step, name, policy):
    """Fork `channel` at `step` the way an agent does, then try the charge on the fork."""
    session = await AgentSession.resume(c, channel, fork_at_step=step, name=name,
                                        tool_policies={"charge_customer": policy})
    try:
        claim = await c.claim_execution(name, *CHARGE)
    except ForkToolBlockedError:
        return session.inherited_state, "blocked", None
    return session.inherited_state, claim.status, claim.result


@pytest.mark.parametrize("step, policy, outcome", [
    (2, "block", ("blocked", None)),              # the charge the run made is refused
    (2, "replay", ("replayed", {"charge_id": "ch_1"})),   # ... or replayed from the imported ledger row
    (1, "replay", ("blocked", None)),             # before the charge there is nothing to replay
    (1, "auto", ("claimed", None)),
], ids=["step2-block", "step2-replay", "step1-replay", "step1-auto"])
def test_a_crashed_run_forks_the_same_after_moving(servers, unique, step, policy, outcome):
    crashed_run_moves_and_forks_the_same(*servers, unique("crashed"), unique("fork"), step, policy, outcome)


@pytest.fixture(scope="module", params=["postgresql-to-sqlite", "sqlite-to-postgresql"])
def across_backends(request, tmp_path_factory):
    """(source, target) on different backends: a PostgreSQL server and a SQLite one, both ways."""
    if POSTGRES_URL is None:
        pytest.skip("moving a run between backends needs PostgreSQL (ACTAE_TEST_DATABASE_URL)")
    with (ServerProcess(tmp_path_factory.mktemp("on-postgresql")).start() as postgresql,
          ServerProcess(tmp_path_factory.mktemp("on-sqlite"), database="").start() as sqlite):
        assert [get_json(srv, "/api/v1/instance")["backend"] for srv in (postgresql, sqlite)] == [
            "postgresql", "sqlite"]
        yield (postgresql, sqlite) if request.param == "postgresql-to-sqlite" else (sqlite, postgresql)


@pytest.mark.parametrize("step, policy, outcome", [
    (2, "block", ("blocked", None)),
    (2, "replay", ("replayed", {"charge_id": "ch_1"})),
], ids=["step2-block", "step2-replay"])
def test_a_crashed_run_moves_between_backends_and_forks_the_same(across_backends, unique, step, policy, outcome):
    crashed_run_moves_and_forks_the_same(*across_backends, unique("crashed"), unique("fork"), step, policy, outcome)


def crashed_run_moves_and_forks_the_same(source, target, channel, fork, step, policy, outcome):
    """A run that crashed at step 3 on `source`, imported into `target`, forks there at `step` with
    the same receipt content, states, ledger outcome and diff as a fork made on `source`."""
    using(source, lambda c: crashed_run(c, channel))
    meta = get_json(source, f"/api/v1/channels/{channel}/metadata")
    assert meta["outcome"] == "crashed" and meta["experiment_metadata"]["status"] == "crashed"

    status, answer = import_http(target, export_http(source, channel))
    assert status == 200 and answer["imported"] == [channel], answer
    same_views(source, target, [channel])

    results = {}
    for srv in (source, target):
        inherited, claim_status, result = using(srv, lambda c: fork_at(c, channel, step, fork, policy))
        receipt = get_json(srv, f"/api/v1/channels/{fork}/receipt")
        versions = get_json(srv, f"/api/v1/state/{fork}/versions")["versions"]
        states = [get_json(srv, f"/api/v1/state/{fork}/version/{v['version']}")["state"] for v in versions]
        results[srv.url] = {"receipt": content_of(receipt), "content_sha256": content_sha256(receipt),
                            "inherited": inherited, "state_sha256s": [state_sha256(s) for s in states],
                            "claim": (claim_status, result),
                            "diff": get_json(srv, f"/api/v1/channels/diff?left={channel}&right={fork}"),
                            "blocked": [e["payload"] for e in get_json(srv, f"/api/v1/events/replay/{fork}")["events"]
                                        if e["type"] == "tool.blocked"]}
    on_source, on_target = results[source.url], results[target.url]
    assert on_target == on_source
    receipt = on_target["receipt"]
    assert receipt["forked_at_step"] == step and receipt["restorable"] is True
    assert receipt["source_state_sha256"] == state_sha256(on_target["inherited"]) == on_target["state_sha256s"][0]
    assert on_target["inherited"]["step"] == step
    assert on_target["claim"] == outcome
    if outcome[0] == "blocked":
        assert [b["policy"] for b in on_target["blocked"]] == [policy]
    # The charge ran once, on the source run; a replay copies its row, it never fires again.
    [charge] = get_json(target, f"/api/v1/executions?channel_id={channel}")["executions"]
    assert (charge["status"], charge["attempts"], charge["result"]) == ("completed", 1, {"charge_id": "ch_1"})


# ── refusals: conflicts, bad files, scopes ───────────────────────────────────────────────────────

def test_a_channel_here_with_other_content_is_refused_with_409(servers, unique):
    source, target = servers
    root, fork = unique("root"), unique("fork")
    make_run(source, root, fork)
    data = export_http(source, fork)
    assert http("POST", f"{target.url}/api/v1/events/record", key=target.key,
                body={"channel_id": root, "event_type": "someone-else's", "payload": {}})[0] == 200
    before, channels = export_http(target, root), channels_of(target)

    status, answer = import_http(target, data)
    assert status == 409 and answer["status"] == "channel_conflict", answer
    assert f"channel {root} already exists" in answer["error"] and "nothing was imported" in answer["error"]
    assert answer["error"].startswith("line ")
    assert channels_of(target) == channels
    assert http("GET", f"{target.url}/api/v1/channels/{fork}/metadata", key=target.key)[0] == 404
    assert export_http(target, root).splitlines()[1:] == before.splitlines()[1:]


def test_an_event_id_held_by_another_channel_is_refused_with_409(servers, unique):
    """The same run under other channel names still carries its event ids, which are unique server-wide."""
    source, target = servers
    root, fork = unique("root"), unique("fork")
    make_run(source, root, fork)
    data = export_http(source, root)
    assert import_http(target, data)[0] == 200
    renamed = data.replace(root.encode(), unique("renamed").encode())
    channels = channels_of(target)
    status, answer = import_http(target, renamed)
    assert status == 409 and answer["status"] == "channel_conflict", answer
    assert "already exists on this server, in channel " + root in answer["error"]
    assert channels_of(target) == channels


def replace_line(lines, match, change):
    """`lines` (parsed) with `change(line)` applied to the first line `match` accepts."""
    out, done = [], False
    for line in lines:
        if not done and match(line):
            line, done = change(copy.deepcopy(line)), True
        out.append(line)
    assert done
    return out


def with_header_fixed(lines):
    """Lines whose header again names exactly what follows (so only the change under test is wrong)."""
    header, rows = lines[0], [line for line in lines[1:] if line is not None]
    header = {**header, "channels": [r["id"] for r in rows if r["kind"] == "channel"],
              "counts": {"channels": sum(r["kind"] == "channel" for r in rows),
                         "events": sum(r["kind"] == "event" for r in rows),
                         "states": sum(r["kind"] == "state" for r in rows),
                         "executions": sum(r["kind"] == "execution" for r in rows)}}
    return [header, *rows]


def encoded(lines) -> bytes:
    return b"".join(json.dumps(line, ensure_ascii=False).encode() + b"\n" for line in lines)


def index_of(lines, match) -> int:
    """The 1-based line number of the first line `match` accepts."""
    return next(i for i, line in enumerate(lines, start=1) if match(line))


def is_event(cursor, channel_of=None):
    return lambda line: (line.get("kind") == "event" and line["cursor"] == cursor
                         and (channel_of is None or line["channel_id"] == channel_of))


def is_kind(kind):
    return lambda line: line.get("kind") == kind


def set_field(name, value):
    def change(line):
        line[name] = value
        return line
    return change


def drop_field(name):
    def change(line):
        del line[name]
        return line
    return change


def tamper_payload(line):
    payload = json.loads(line["payload"])
    payload["step"] = 2                            # the plan now says something else
    line["payload"] = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return line


def tamper_state(line):
    line["state"] = line["state"].replace("running", "stopped")
    return line


# (id, how the file is spoiled: (data, parsed lines, root) -> bytes, what the error says, the line it names)
BAD_FILES = [
    ("empty", lambda data, lines, root: b"", "empty", None),
    ("not-utf8", lambda data, lines, root: b"\xff\xfe" + data, "not UTF-8", None),
    ("not-an-export", lambda data, lines, root: encoded([{"hello": 1}, *lines[1:]]), "not an export header", 1),
    ("future-version", lambda data, lines, root: encoded([{**lines[0], "version": 2}, *lines[1:]]), "version 2", 1),
    ("header-garbled", lambda data, lines, root: b"{format: actae-export}\n" + data.split(b"\n", 1)[1],
     "not valid JSON", 1),
    ("truncated-at-a-line", lambda data, lines, root: encoded(lines[:-1]), "truncated", 1),
    ("truncated-mid-line", lambda data, lines, root: data[:-40], "not valid JSON", "last"),
    ("garbled-line", lambda data, lines, root: encoded(lines[:3]) + b"{\"kind\": \"event\", oops\n" + encoded(lines[4:]),
     "not valid JSON", 4),
    ("empty-line", lambda data, lines, root: encoded(lines[:3]) + b"\n" + encoded(lines[3:]), "empty", 4),
    ("a-list", lambda data, lines, root: encoded(lines[:3]) + b"[1, 2]\n" + encoded(lines[4:]), "line 4", 4),
    ("unknown-kind", lambda data, lines, root: encoded(replace_line(lines, is_kind("state"), set_field("kind", "wakeup"))),
     "invalid line", "state"),
    ("missing-column", lambda data, lines, root: encoded(replace_line(lines, is_event(1), drop_field("chain_hash"))),
     "chain_hash", "event1"),
    ("unknown-column", lambda data, lines, root: encoded(replace_line(lines, is_event(1), set_field("colour", "red"))),
     "colour", "event1"),
    ("wrong-type", lambda data, lines, root: encoded(replace_line(lines, is_event(1), set_field("cursor", "1"))),
     "invalid line", "event1"),
    ("bad-timestamp", lambda data, lines, root: encoded(replace_line(lines, is_event(1),
                                                                      set_field("created_at", "yesterday"))),
     "created_at", "event1"),
    ("payload-not-json", lambda data, lines, root: encoded(replace_line(lines, is_event(1), set_field("payload", "{x"))),
     "payload on line", "event1"),
    ("payload-too-deep", lambda data, lines, root: encoded(replace_line(lines, is_event(1),
                                                                         set_field("payload", "[" * 65 + "]" * 65))),
     "nested more than 64", "event1"),
    ("policies-not-policies", lambda data, lines, root: encoded(replace_line(
        lines, lambda l: l.get("kind") == "channel" and l["parent_id"], set_field("tool_policies", '{"x": "maybe"}'))),
     "tool_policies on line", "fork"),
    ("nul", lambda data, lines, root: encoded(replace_line(lines, is_event(1), set_field("actor", "a\u0000b"))),
     "NUL", "event1"),
    ("tampered-payload", lambda data, lines, root: encoded(replace_line(lines, is_event(1), tamper_payload)),
     "event chain", "event1"),
    ("tampered-chain-hash", lambda data, lines, root: encoded(replace_line(lines, is_event(2),
                                                                            set_field("chain_hash", "0" * 64))),
     "event chain", "event2"),
    ("tampered-chain-head", lambda data, lines, root: encoded(replace_line(lines, is_kind("channel"),
                                                                            set_field("chain_head", "a" * 64))),
     "chain_head", 2),
    ("tampered-state", lambda data, lines, root: encoded(replace_line(lines, is_kind("state"), tamper_state)),
     "sha256", "state"),
    ("missing-event", lambda data, lines, root: encoded(with_header_fixed(
        [None if is_event(2)(line) else line for line in lines])), "last_cursor", 2),
    ("duplicate-event", lambda data, lines, root: encoded(with_header_fixed(
        lines[:3] + [lines[2]] + lines[3:])), "second event", 4),
    ("fork-without-its-parent", lambda data, lines, root: encoded(with_header_fixed(
        [lines[0]] + [None if line.get("channel_id", line.get("id")) == root else line for line in lines[1:]])),
     "not in the file before it", 2),
    ("rows-before-their-channel", lambda data, lines, root: encoded([lines[0], lines[2], lines[1], *lines[3:]]),
     "comes before", 2),
]


@pytest.mark.parametrize("spoil, says, names_line", [case[1:] for case in BAD_FILES], ids=[c[0] for c in BAD_FILES])
def test_a_bad_file_is_refused_with_400_and_writes_nothing(servers, unique, spoil, says, names_line):
    source, target = servers
    root, fork = unique("root"), unique("fork")
    make_run(source, root, fork)
    data = export_http(source, fork)
    lines = lines_of(data)
    bad = spoil(data, lines, root)
    channels = channels_of(target)

    status, answer = import_http(target, bad)
    assert status == 400, answer
    assert set(answer) == {"status", "error"} and answer["status"] == "bad_request"
    assert says in answer["error"], answer["error"]
    if names_line is not None:
        expected = {"last": len(bad.decode("utf-8", "replace").splitlines()),
                    "event1": index_of(lines, is_event(1)), "event2": index_of(lines, is_event(2)),
                    "state": index_of(lines, is_kind("state")),
                    "fork": index_of(lines, lambda l: l.get("kind") == "channel" and bool(l["parent_id"]))
                    }.get(names_line, names_line)
        assert (answer["error"].startswith(f"line {expected}") or f"line {expected}:" in answer["error"]
                or f"line {expected} " in answer["error"]), (expected, answer["error"])
    assert channels_of(target) == channels
    for channel in (root, fork):
        assert http("GET", f"{target.url}/api/v1/channels/{channel}/metadata", key=target.key)[0] == 404


def test_export_and_import_need_scopes_on_every_channel(servers, unique):
    source, target = servers
    root, fork = unique("root"), unique("fork")
    make_run(source, root, fork)

    def key_for(srv, *flags):
        done = cli("key", "create", "--name", "scoped", *flags, data_dir=srv, text=False, check=False)
        assert done.returncode == 0, done.stderr
        return next(w for w in done.stdout.decode().split() if w.startswith("sk-"))

    fork_only = key_for(source, "--read", fork)
    status, _, body = api(source, "GET", f"/api/v1/channels/{fork}/export", key=fork_only, decode=False)
    assert status == 403 and root.encode() in body, body      # the ancestor comes along, and is not readable
    both = key_for(source, "--read", unique("") + "*")
    data = export_http(source, fork, key=both)

    writer = key_for(target, "--write", fork, "--read", "*")
    channels = channels_of(target)
    status, answer = import_http(target, data, key=writer)
    assert status == 403 and root in answer["error"], answer
    assert channels_of(target) == channels
    status, answer = import_http(target, data, key=key_for(target, "--write", unique("") + "*"))
    assert status == 200 and answer["imported"] == [root, fork]


# ── fork trees ───────────────────────────────────────────────────────────────────────────────────

def test_with_forks_carries_the_fork_tree(servers, unique):
    source, target = servers
    root, f1, f1a, f2 = unique("root"), unique("f1"), unique("f1a"), unique("f2")

    async def tree(c):
        for n in (1, 2):
            await c.record(root, "step", {"n": n}, actor="t", step_number=n)
            await c.save_state(root, await c.get_cursor(root), {"n": n})
        await c.fork(root, f1, 2)
        await c.record(f1, "step", {"n": 3}, actor="t", step_number=3)
        await c.save_state(f1, await c.get_cursor(f1), {"n": 3})
        await c.fork(f1, f1a, await c.get_cursor(f1), tool_policies={"*": "replay"})
        await c.record(f1a, "step", {"n": 4}, actor="t", step_number=4)
        await c.fork(root, f2, 4)
    using(source, tree)

    assert lines_of(export_http(source, f1))[0]["channels"] == [root, f1]
    assert lines_of(export_http(source, f1, with_forks=True))[0]["channels"] == [root, f1, f1a]
    assert lines_of(export_http(source, f1a, with_forks=True))[0]["channels"] == [root, f1, f1a]
    data = export_http(source, root, with_forks=True)
    assert lines_of(data)[0]["channels"] == [root, f1, f1a, f2]
    seen = set()
    for line in rows_of(data):                       # every row after its channel, every fork after its parent
        if line["kind"] == "channel":
            assert line["parent_id"] is None or line["parent_id"] in seen
            seen.add(line["id"])
        else:
            assert line["channel_id"] in seen

    status, answer = import_http(target, data)
    assert status == 200 and answer["imported"] == [root, f1, f1a, f2], answer
    assert get_json(target, f"/api/v1/channels/{root}/fork-tree") == get_json(source, f"/api/v1/channels/{root}/fork-tree")
    same_views(source, target, [root, f1, f1a, f2])
    assert get_json(target, f"/api/v1/channels/{f1a}/steps/2")["channel_id"] == root
    diff = f"/api/v1/channels/diff?left={f2}&right={f1a}"
    assert get_json(target, diff) == get_json(source, diff)


def test_the_openapi_document_describes_both_routes(servers):
    source, _ = servers
    document = get_json(source, "/openapi.json")
    export = document["paths"]["/api/v1/channels/{channel_id}/export"]["get"]
    assert NDJSON in export["responses"]["200"]["content"]
    assert [p["name"] for p in export["parameters"]] == ["channel_id", "with_forks"]
    assert "application/octet-stream" in export["responses"]["200"]["content"]   # bytes, for generators
    imports = document["paths"]["/api/v1/import"]["post"]
    # The body is documented as bytes (every generator sends those); the file in it is NDJSON.
    assert list(imports["requestBody"]["content"]) == ["application/octet-stream"]
    assert imports["x-actae-scopes"] == [{"action": "write", "channel": "body.channel_ids"}]
    export_file = document["components"]["schemas"]["ExportFile"]
    assert export_file["type"] == "string" and export_file["contentMediaType"] == NDJSON
