"""Bulk fork from failure (POST /api/v1/forks/bulk, `actae fork-failed`) against the real server and SDK.

Ten runs of examples/fork_failed.py's agent (six fail at steps 1..6 in the three ways agents say it:
a crash, a `run.failed` event, a failed state; four complete): the bulk fork forks exactly the
six, each after its own last good step, each receipt restorable with the sha256 of the parent's
state at that step (read back here, not from the receipt); the same request again answers the same
forks and makes nothing; a dry run makes nothing, its operation id included; with a `block` policy
no fork charges again, and the ledger holds one charge per original run. The example itself runs
end to end; the command line does the same beside the running server.
"""
from __future__ import annotations

import json
import os

import pytest

from conftest import cli, http, import_example, run_example, state_sha256, using

example = import_example("fork_failed.py")


def bulk(server, body, key=None):
    return http("POST", server.url + "/api/v1/forks/bulk", key=key or server.key, body=body)


def channels(server) -> set:
    status, _, body = http("GET", server.url + "/api/v1/channels", key=server.key)
    assert status == 200
    return set(body["channels"])


def state_at_step(server, channel: str, step: int):
    """The state `channel` saved with its step `step`: its events and state versions, read back."""
    _, _, replay = http("GET", f"{server.url}/api/v1/events/replay/{channel}?limit=500", key=server.key)
    cursor = next(e["cursor"] for e in replay["events"] if e["step_number"] == step)
    _, _, versions = http("GET", f"{server.url}/api/v1/state/{channel}/versions?limit=100", key=server.key)
    version = max(v["version"] for v in versions["versions"] if v["cursor"] == cursor)
    _, _, state = http("GET", f"{server.url}/api/v1/state/{channel}/version/{version}", key=server.key)
    return state["state"]


def charges(server, channel: str) -> int:
    _, _, listed = http("GET", f"{server.url}/api/v1/executions?channel_id={channel}", key=server.key)
    return sum(1 for x in listed["executions"] if x["tool_name"] == "charge_customer" and x["status"] == "completed")


def build_runs(server, prefix: str) -> dict:
    """The ten runs; {failed run: its last good step}."""
    async def main(client):
        for i in range(example.RUNS):
            outage = example.OUTAGES[i] if i < len(example.OUTAGES) else None
            await example.original_run(client, f"{prefix}-run{i}", outage)
    using(server, main)
    return {f"{prefix}-run{i}": step for i, (_, step) in enumerate(example.OUTAGES)}


@pytest.fixture(scope="module")
def outage(server):
    prefix = f"bulk{os.getpid()}"
    return prefix, build_runs(server, prefix)


def body_for(prefix: str, **extra) -> dict:
    # include_handled: the tests below go on with the outage's runs after their forks completed
    return {"filter": {"channel_prefix": f"{prefix}-run", "include_handled": True}, "intervention": {"model": "fallback"},
            "tool_policies": {"charge_customer": "block"}, "name": "{channel_id}-retry", **extra}


def test_a_status_filter_selects_by_the_indexed_run_state(server, outage):
    prefix, expected = outage
    status, _, dry = bulk(server, body_for(prefix, dry_run=True, filter={"channel_prefix": f"{prefix}-run",
                                                                          "status": ["completed"]}))
    assert (status == 200
            and {f["source_channel_id"] for f in dry["forks"]} == {f"{prefix}-run{i}" for i in range(6, 10)})
    assert all(f["step"] == example.STEPS for f in dry["forks"])       # a completed run: after its last step


def test_a_dry_run_makes_nothing_not_even_its_operation_id(server, outage):
    prefix, expected = outage
    before = channels(server)
    status, _, dry = bulk(server, body_for(prefix, dry_run=True, operation_id=f"{prefix}-op"))
    assert status == 200, dry
    assert dry["dry_run"] is True and dry["skipped"] == []
    assert {f["source_channel_id"]: f["step"] for f in dry["forks"]} == expected
    assert all(f["receipt"] is None and f["channel_id"] == f"{f['source_channel_id']}-retry" for f in dry["forks"])
    assert channels(server) == before


def test_the_bulk_fork_forks_exactly_the_failed_runs_after_their_last_good_step(server, outage):
    prefix, expected = outage
    before = channels(server)
    status, _, first = bulk(server, body_for(prefix, operation_id=f"{prefix}-op"))   # the dry run's id is free
    assert status == 200, first
    assert first["dry_run"] is False and first["skipped"] == []
    assert {f["source_channel_id"]: f["step"] for f in first["forks"]} == expected
    for item in first["forks"]:
        receipt = item["receipt"]
        assert receipt["restorable"] is True and receipt["replayed"] is False
        assert receipt["forked_at_step"] == item["step"]
        assert receipt["source_state_sha256"] == state_sha256(state_at_step(server, item["source_channel_id"],
                                                                                item["step"]))
        _, _, meta = http("GET", f"{server.url}/api/v1/channels/{item['channel_id']}/metadata", key=server.key)
        assert meta["experiment_metadata"]["intervention"] == {"model": "fallback"}
        assert meta["tool_policies"] == {"charge_customer": "block"}
    made = channels(server) - before
    assert made == {f["channel_id"] for f in first["forks"]}

    status, _, again = bulk(server, body_for(prefix, operation_id=f"{prefix}-op"))
    assert status == 200 and again == first
    assert channels(server) - before == made
    # Without an operation id the forks are found by name: replayed, nothing new either.
    status, _, unnamed = bulk(server, body_for(prefix))
    assert status == 200 and {f["channel_id"] for f in unnamed["forks"]} == made
    assert all(f["receipt"]["replayed"] for f in unnamed["forks"]) and channels(server) - before == made
    # The same operation id for another request is refused.
    status, _, refused = bulk(server, body_for(prefix, operation_id=f"{prefix}-op", name="{channel_id}-other"))
    assert status == 409 and refused["status"] == "idempotency_conflict"


def test_the_forks_continue_to_completion_without_charging_again(server, outage):
    prefix, expected = outage

    async def main(client):
        return [await example.continue_fork(client, f"{source}-retry", source) for source in sorted(expected)]
    finished = using(server, main)
    assert [f["first_step"] for f in finished] == [expected[s] + 1 for s in sorted(expected)]
    assert all(f["charge"] == "blocked" and f["lines"] == example.STEPS for f in finished)
    for source in sorted(expected):
        fork = f"{source}-retry"
        _, _, meta = http("GET", f"{server.url}/api/v1/channels/{fork}/metadata", key=server.key)
        assert meta["experiment_metadata"]["status"] == "completed"
        _, _, steps = http("GET", f"{server.url}/api/v1/channels/{fork}/steps", key=server.key)
        assert steps["last_step_number"] == example.STEPS
        assert charges(server, fork) == 0
        _, _, blocked = http("GET", f"{server.url}/api/v1/events/replay/{fork}?event_type=tool.blocked",
                             key=server.key)
        assert len(blocked["events"]) == 1
    for i in range(example.RUNS):
        assert charges(server, f"{prefix}-run{i}") == 1


def test_the_failure_text_and_time_window_narrow_the_selection(server, outage):
    prefix, expected = outage
    status, _, none = bulk(server, body_for(prefix, dry_run=True, filter={"channel_prefix": f"{prefix}-run",
                                                                           "failure_contains": "disk full"}))
    assert status == 200 and none["forks"] == [] and none["skipped"] == []
    status, _, later = bulk(server, body_for(prefix, dry_run=True, filter={"channel_prefix": f"{prefix}-run",
                                                                            "since": "2999-01-01T00:00:00Z"}))
    assert status == 200 and later["forks"] == []
    # The forks of the test before completed: each failed run is handled now, and left out unless asked.
    status, _, handled = bulk(server, body_for(prefix, dry_run=True, filter={"channel_prefix": f"{prefix}-run",
                                                                              "status": ["crashed"]}))
    assert status == 200 and handled["forks"] == [], handled
    assert {s["channel_id"] for s in handled["skipped"]} == {f"{prefix}-run{i}" for i in (0, 3, 5)}, handled
    assert all(s["reason"].startswith("handled: its fork ") for s in handled["skipped"]), handled
    status, _, crashed = bulk(server, body_for(prefix, dry_run=True, filter={"channel_prefix": f"{prefix}-run",
                                                                              "status": ["crashed"],
                                                                              "include_handled": True}))
    assert {f["source_channel_id"] for f in crashed["forks"]} == {f"{prefix}-run{i}" for i in (0, 3, 5)}
    status, _, at = bulk(server, body_for(prefix, dry_run=True, at=5, name="{channel_id}-at{step}",
                                          filter={"channel_prefix": f"{prefix}-run", "include_handled": True}))
    assert status == 200
    assert {f["source_channel_id"] for f in at["forks"]} == {s for s, k in expected.items() if k >= 5}
    assert {s["channel_id"] for s in at["skipped"]} == {s for s, k in expected.items() if k < 5}
    assert all(f["channel_id"].endswith("-at5") for f in at["forks"])


@pytest.mark.parametrize("body, words", [
    ({"name": "retry"}, "{channel_id}"),
    ({"at": 0}, "at"),
    ({"filter": {"status": ["exploded"]}}, "status"),
    ({"filter": {"channel_prefix": "a b"}}, "channel_prefix"),
    ({"tool_policies": {"x": "sometimes"}}, "tool_policies"),
])
def test_bad_requests_are_refused_with_the_reason(server, body, words):
    status, _, answer = bulk(server, body)
    assert status == 400 and words in answer["error"], answer


def test_scopes_a_read_only_key_is_refused_and_a_narrow_one_skips_what_it_may_not_write(server, outage, tmp_path):
    prefix, expected = outage
    reader = http("POST", server.url + "/api/v1/keys", key=server.key,
                  body={"name": "bulk-reader", "scopes": {"read": ["*"]}})[2]["key"]
    status, _, answer = bulk(server, body_for(prefix, dry_run=True), key=reader)
    assert status == 403 and answer["status"] == "forbidden"
    narrow = http("POST", server.url + "/api/v1/keys", key=server.key,
                  body={"name": "bulk-narrow", "scopes": {"read": ["*"], "write": [f"{prefix}-run0*"]}})[2]["key"]
    status, _, answer = bulk(server, body_for(prefix, dry_run=True, name="{channel_id}-narrow"), key=narrow)
    assert status == 200
    assert [f["source_channel_id"] for f in answer["forks"]] == [f"{prefix}-run0"]
    assert len(answer["skipped"]) == 5 and all("may not write" in s["reason"] for s in answer["skipped"])


def fork_failed(server, *args):
    """`actae fork-failed ARGS` on the server's data dir, beside it; the finished process (any exit code)."""
    return cli("fork-failed", *args, data_dir=server, timeout=120, check=False)


def test_the_command_line_forks_beside_the_running_server(server, outage):
    prefix, expected = outage
    before = channels(server)
    dry = fork_failed(server, "--prefix", f"{prefix}-run", "--include-handled", "--contains", "OUTAGE", "--name", "{channel_id}-cli",
                      "--policy", "charge_customer=block", "--intervention", '{"model": "cli"}', "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    listed = json.loads(dry.stdout)
    assert listed["dry_run"] is True and {f["source_channel_id"]: f["step"] for f in listed["forks"]} == expected
    assert channels(server) == before
    made = fork_failed(server, "--prefix", f"{prefix}-run", "--include-handled", "--name", "{channel_id}-cli", "--policy",
                       "charge_customer=block", "--intervention", '{"model": "cli"}', "--operation-id", f"{prefix}-cli")
    assert made.returncode == 0, made.stderr
    assert "Forked 6 run(s)" in made.stdout
    assert channels(server) - before == {f"{s}-cli" for s in expected}
    _, _, meta = http("GET", f"{server.url}/api/v1/channels/{prefix}-run2-cli/metadata", key=server.key)
    assert meta["experiment_metadata"]["intervention"] == {"model": "cli"} and meta["forked_at_cursor"] > 0
    again = fork_failed(server, "--prefix", f"{prefix}-run", "--include-handled", "--name", "{channel_id}-cli", "--policy",
                        "charge_customer=block", "--intervention", '{"model": "cli"}', "--operation-id",
                        f"{prefix}-cli", "--json")
    assert again.returncode == 0 and len(json.loads(again.stdout)["forks"]) == 6
    assert channels(server) - before == {f"{s}-cli" for s in expected}
    bad = fork_failed(server, "--policy", "charge_customer")
    assert bad.returncode != 0 and "TOOL=POLICY" in bad.stderr


def test_the_example_runs_end_to_end(server):
    proc = run_example(server, "fork_failed.py", "--name", f"ex{os.getpid()}")
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "FAIL" not in proc.stdout and proc.stdout.count("PASS") == 8, proc.stdout
