"""One scope rule for every door: a prefix-scoped credential sees and changes only its channels, and a
channel it may not read answers exactly what a channel that does not exist answers.

Doors checked, each against real servers (a gateway and a remote started with `start_fleet`, or a
plain server), with raw HTTP where the exact status and body matter and the SDK's `FleetClient`
for the stream:

- the fleet gateway to a REMOTE instance, with an organisation token `--read 'ci-*'`: the lists
  (`channels.list`, `events.query`, a run's `forks`) and the single-channel reads (`replay`,
  `cursor`, `state`, `versions`, `metadata`, `forks`, `events.query` of one channel, a stream
  ticket) of `secret-r1` (exists, out of scope) against `nope-x` (does not exist, out of scope):
  as on the direct routes, a channel outside the scopes answers 403 whether or not it exists, so
  an out-of-scope run cannot be told from one that does not exist, and the gateway answers what
  the local instance answers for the same token; `auth.capabilities.get` answers the caller's effective
  scopes (the token's intersected with the remote key's), not the remote admin key's;
- `actae instance add URL --key-file PATH` and `ACTAE_REMOTE_KEY=... actae instance add URL`
  register the remote as `--key` does, without the key in the process's arguments;
- the gateway's stream of a whole instance (a ticket with no channel): events of two channels
  within a second, a resume that loses and repeats none, and only in-scope channels for a
  prefix-scoped token;
- the bulk fork (`POST /api/v1/forks/bulk`) with an `inv-*` key: nothing of `other-*` in any
  answer, no failure-text oracle, no fork out of out-of-scope history;
- the approvals inbox's decide with an `inv-*` key: an out-of-scope request id is an unknown one,
  and a request id shared with an out-of-scope run is simply the in-scope run's;
- `/openapi.json`: every operation has a 2xx response schema.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid

import pytest

from conftest import (ACTAE_PY, ROOT, ServerProcess, cli, fork, http, instance_id, new_key, org_token, poll, record, run,
                      save_state, start_fleet, using)

ORG = "local"
OPS = "/v1/organizations/{org}/instances/{instance}/ops/actae.api.v1.{op}"
READ_SCOPES = ["events:read", "state:read", "channels:read", "payloads:read"]


# --- helpers ------------------------------------------------------------------------------------------

def fleet_token(gateway, organisation_token, scopes=READ_SCOPES) -> str:
    status, _, answer = http("POST", gateway.url + "/api/v1/fleet/token",
                             headers={"authorization": f"Bearer {organisation_token}"},
                             body={"purpose": "fleet_access", "organization_id": ORG, "scopes": scopes})
    assert status == 200, answer
    return answer["token"]


def op(fleet, token, instance, operation, **envelope):
    """POST .../instances/{instance}/ops/actae.api.v1.{operation} with the fleet token: (status, body)."""
    status, _, answer = http("POST", fleet.gateway.url + OPS.format(org=ORG, instance=instance, op=operation),
                             headers={"authorization": f"Bearer {token}"}, body=envelope)
    return status, answer


def masked(answer, *names):
    """The answer with each channel name in it replaced by <channel>: what must not differ between doors."""
    text = json.dumps(answer, sort_keys=True)
    for name in names:
        text = text.replace(name, "<channel>")
    return json.loads(text)


def shape(value):
    """The structure of a JSON value: keys and types, not the values."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(v) for v in value[:1]]
    return type(value).__name__


def channels_named(answer) -> set:
    """Every channel id an answer mentions (lists of ids, and `channel_id`-like fields anywhere)."""
    found = set()

    def walk(value, key=None):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, k)
        elif isinstance(value, list):
            for v in value:
                walk(v, key)
        elif isinstance(value, str) and key in ("channels", "channel_id", "parent_channel_id", "source_channel_id",
                                                "child_channel_id", "origin_run_id", "channel_ids"):
            found.add(value)
    walk(answer)
    return found


# --- the fleet: a gateway, a remote with secret-r1 and ci-r1, a read-only-key remote ---------------------

@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("doors")
    with start_fleet(root, 1, names="r1") as f, ServerProcess(root / "remote-ro").start() as ro:
        remote = f.remotes[0]
        for channel in ("secret-r1", "ci-r1"):
            first = record(remote, channel, payload={"n": 1})
            record(remote, channel, payload={"n": 2})
            save_state(remote, channel, first["cursor"], {"of": channel})
        fork(remote, "ci-r1", "secret-child", 1)          # an out-of-scope fork of an in-scope run
        # A second remote, registered with a key that may only read: the intersection's other side.
        cli("instance", "add", ro.url, "--key", new_key(ro, read=["*"]), "--name", "ro", data_dir=f.gateway)
        f.ro, f.ro_id = ro, instance_id(ro)
        f.ci_token = org_token(f.gateway, "--read", "ci-*", name="t")[1]
        f.ci = fleet_token(f.gateway, f.ci_token)
        yield f


IN_SCOPE_READS = {
    "channels.list": {},
    "events.query (ci-r1)": {"body": {"channel_ids": ["ci-r1"]}},
    "events.replay ci-r1": {"path_params": {"channel_id": "ci-r1"}},
    "state.load ci-r1": {"path_params": {"channel_id": "ci-r1"}},
    "channels.metadata.get ci-r1": {"path_params": {"channel_id": "ci-r1"}},
    "channels.forks.list ci-r1": {"path_params": {"channel_id": "ci-r1"}},
}


@pytest.mark.parametrize("call", list(IN_SCOPE_READS))
def test_gateway_reads_on_a_remote_show_only_in_scope_channels(fleet, call):
    operation = call.split()[0]
    status, answer = op(fleet, fleet.ci, fleet.remote_ids[0], operation, **IN_SCOPE_READS[call])
    assert status == 200, (status, answer)
    named = channels_named(answer)
    assert not {c for c in named if not c.startswith("ci-")}, f"{call} names out-of-scope channels: {named}"
    assert "secret" not in json.dumps(answer), answer
    if operation in ("channels.list", "events.query"):        # and it is not empty by refusing everything
        assert "ci-r1" in named, answer
        if operation == "events.query":
            assert sorted(e["payload"]["n"] for e in answer["events"] if e["channel_id"] == "ci-r1") == [1, 2]


SINGLE_CHANNEL_READS = {
    "events.replay": lambda ch: {"path_params": {"channel_id": ch}},
    "events.cursor.get": lambda ch: {"path_params": {"channel_id": ch}},
    "state.load": lambda ch: {"path_params": {"channel_id": ch}},
    "state.versions.list": lambda ch: {"path_params": {"channel_id": ch}},
    "channels.metadata.get": lambda ch: {"path_params": {"channel_id": ch}},
    "channels.forks.list": lambda ch: {"path_params": {"channel_id": ch}},
    "events.query": lambda ch: {"body": {"channel_ids": [ch]}},
}


@pytest.mark.parametrize("operation", list(SINGLE_CHANNEL_READS))
def test_an_out_of_scope_channel_on_a_remote_answers_as_an_unknown_one(fleet, operation):
    envelope = SINGLE_CHANNEL_READS[operation]
    answers = {ch: op(fleet, fleet.ci, fleet.remote_ids[0], operation, **envelope(ch)) for ch in ("secret-r1", "nope-x")}
    secret, unknown = answers["secret-r1"], answers["nope-x"]
    assert (secret[0], masked(secret[1], "secret-r1")) == (unknown[0], masked(unknown[1], "nope-x")), answers
    # and the remote answers exactly what the gateway's own instance answers for the same token
    local = op(fleet, fleet.ci, fleet.local_id, operation, **envelope("secret-r1"))
    assert (secret[0], masked(secret[1], "secret-r1")) == (local[0], masked(local[1], "secret-r1")), (secret, local)


@pytest.mark.parametrize("body", [{}, {"channel_ids": ["ci-r1", "secret-r1"]}])
def test_an_events_query_beyond_the_scopes_is_refused_on_a_remote_as_on_the_local_instance(fleet, body):
    remote = op(fleet, fleet.ci, fleet.remote_ids[0], "events.query", body=body)
    local = op(fleet, fleet.ci, fleet.local_id, "events.query", body=body)
    assert remote[0] == local[0] == 403 and "secret" not in json.dumps(remote[1]).replace("secret-r1", ""), (remote, local)


def test_a_stream_ticket_for_an_out_of_scope_channel_answers_as_for_an_unknown_one(fleet):
    def mint(channel):
        status, _, answer = http("POST", fleet.gateway.url + f"/v1/organizations/{ORG}/events/stream/tickets",
                                 headers={"authorization": f"Bearer {fleet.ci}"},
                                 body={"instance_id": fleet.remote_ids[0], "channel_id": channel})
        return status, answer
    answers = {ch: mint(ch) for ch in ("secret-r1", "nope-x")}
    looks = {ch: (status, shape(masked(answer, ch))) for ch, (status, answer) in answers.items()}
    assert looks["secret-r1"] == looks["nope-x"], answers


def test_capabilities_through_the_gateway_are_the_callers_effective_scopes(fleet):
    _, writer = org_token(fleet.gateway, "--read", "ci-*", "--write", "ci-*")

    async def body():
        async with fleet.client(writer) as f:
            on_admin_remote = await f.call_operation("actae.api.v1.auth.capabilities.get",
                                                     instance_id=fleet.remote_ids[0])
            on_read_only_remote = await f.call_operation("actae.api.v1.auth.capabilities.get",
                                                         instance_id=fleet.ro_id)
            return on_admin_remote, on_read_only_remote
    on_admin_remote, on_read_only_remote = run(body())
    status, reader_caps = op(fleet, fleet.ci, fleet.remote_ids[0], "auth.capabilities.get")
    assert status == 200
    # the fleet token's patterns, as the remote admin key allows all of them
    assert reader_caps["permissions"] == {"read": ["ci-*"], "write": [], "delete": [], "admin": []}, reader_caps
    assert on_admin_remote["permissions"] == {"read": ["ci-*"], "write": ["ci-*"], "delete": [], "admin": []}, (
        on_admin_remote)
    # the remote's key may only read: whatever the token grants, nothing may be written there
    assert on_read_only_remote["permissions"] == {"read": ["ci-*"], "write": [], "delete": [], "admin": []}, (
        on_read_only_remote)


# --- `actae instance add` without the key on the command line ------------------------------------------

def test_instance_add_takes_the_key_from_a_file_or_the_environment_never_from_argv(fleet, tmp_path):
    with ServerProcess(tmp_path / "remote-k").start() as extra:
        extra_id = instance_id(extra)
        key_file = tmp_path / "remote.key"
        key_file.write_text(extra.key + "\n")
        key_file.chmod(0o600)
        _, admin = org_token(fleet.gateway, "--admin")

        def add(argv, env):
            argv = [*ACTAE_PY, "instance", "add", extra.url, *argv, "--data-dir", str(fleet.gateway.data_dir)]
            assert not any(extra.key in arg for arg in argv)
            proc = subprocess.Popen(argv, cwd=str(ROOT), env={**fleet.gateway.env, **env}, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            try:
                with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                cmdline = b""                                  # it ended already: its argv was checked above
            out, err = proc.communicate(timeout=60)
            assert extra.key.encode() not in cmdline
            return proc.returncode, out + err

        def answers_through_the_gateway():
            async def body():
                async with fleet.client(admin) as f:
                    return await f.call_operation("actae.api.v1.instance.get", instance_id=extra_id)
            return run(body())

        for argv, env in ((["--key-file", str(key_file), "--name", "by-file"], {}),
                          (["--name", "by-env"], {"ACTAE_REMOTE_KEY": extra.key})):
            cli("instance", "remove", extra_id, data_dir=fleet.gateway, check=False)
            code, output = add(argv, env)
            assert code == 0, f"`instance add {' '.join(argv)}` exited {code}: {output}"
            assert extra_id in output and extra.key not in output
            assert answers_through_the_gateway()["instance_id"] == extra_id
            listed = json.loads(cli("instance", "list", "--json", data_dir=fleet.gateway).stdout)
            assert [i["name"] for i in listed["instances"] if i["instance_id"] == extra_id] == [argv[-1]]
        cli("instance", "remove", extra_id, data_dir=fleet.gateway, check=False)


# --- the stream of a whole instance -------------------------------------------------------------------

def resume_position(frame: dict):
    """Where a stream resumes after `frame`: a position the frame carries for the whole stream, else (what
    the SDK's FleetClient.stream uses when it reconnects) its event's cursor."""
    for name in ("resume_cursor", "position", "sequence", "seq", "cursor"):
        if isinstance(frame.get(name), int):
            return frame[name]
    return frame["event"]["cursor"]


async def mint_instance_ticket(f, instance_id: str) -> str:
    answer = await f._request("POST", f"/v1/organizations/{ORG}/events/stream/tickets",
                              body={"instance_id": instance_id})
    return answer["ticket"]


class Listener:
    """A whole-instance stream read on a task; `.frames` every frame it delivered, in order."""

    def __init__(self, stream):
        self.stream, self.frames = stream, []
        self.task = asyncio.ensure_future(self._read())

    async def _read(self):
        async for frame in self.stream:
            self.frames.append(frame)

    def ids(self, channels) -> list:
        return [fr["event"]["id"] for fr in self.frames if fr.get("channel_id", fr["event"].get("channel_id")) in channels]

    async def until(self, event_id, timeout, what):
        async def seen():
            if self.task.done() and self.task.exception() is not None:
                raise self.task.exception()
            return any(fr["event"]["id"] == event_id for fr in self.frames)
        await poll(seen, timeout, what=what, every=0.01)

    async def warm_up(self, record_one, timeout=15):
        """Record on an in-scope channel until the stream delivers (it is open once it does)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            event = await asyncio.to_thread(record_one)
            try:
                await self.until(event["id"], 0.5, "the warm-up event")
                return
            except AssertionError:
                continue
        raise AssertionError("the whole-instance stream delivered nothing in 15 s")

    async def close(self):
        self.task.cancel()                       # ends the generator at its await: the socket closes
        await asyncio.gather(self.task, return_exceptions=True)
        try:
            await self.stream.aclose()
        except Exception:  # noqa: BLE001 - it may have ended with the task
            pass


def opened(stream_error):
    from actae_client.errors import ActaeConnectionError
    if isinstance(stream_error, ActaeConnectionError):
        pytest.fail(f"the whole-instance stream (a ticket without channel_id) did not open: {stream_error}")


def test_a_whole_instance_stream_delivers_two_channels_and_resumes_without_loss_or_repeat(fleet):
    from actae_client.errors import ActaeConnectionError
    remote, remote_id = fleet.remotes[0], fleet.remote_ids[0]
    tag = uuid.uuid4().hex[:8]
    a, b = f"wa-{tag}", f"wb-{tag}"
    recorded = []

    def put(channel, n):
        event = record(remote, channel, "w", {"n": n})
        recorded.append(event["id"])
        return event

    async def body():
        async with fleet.client(org_token(fleet.gateway, "--admin")[1]) as f:
            first = Listener(f.stream(ticket=await mint_instance_ticket(f, remote_id), instance_id=remote_id))
            try:
                await first.warm_up(lambda: record(remote, f"wz-{tag}", "w", {"n": "warm"}))
                latencies = []
                for channel, n in ((a, 1), (b, 1), (a, 2), (b, 2)):
                    started = time.monotonic()
                    event = await asyncio.to_thread(put, channel, n)
                    await first.until(event["id"], 1.0, f"{channel}'s event {n} within a second")
                    latencies.append(time.monotonic() - started)
            except ActaeConnectionError as exc:
                opened(exc)
            finally:
                await first.close()
            last = [fr for fr in first.frames if fr["event"]["id"] in recorded][-1]
            for channel, n in ((a, 3), (b, 3), (a, 4)):               # while nobody listens
                await asyncio.to_thread(put, channel, n)
            again = Listener(f.stream(ticket=await mint_instance_ticket(f, remote_id), instance_id=remote_id,
                                      resume_cursor=resume_position(last)))
            try:
                live = await asyncio.to_thread(put, b, 4)
                await again.until(live["id"], 10, "the resumed stream to reach the newest event")
            finally:
                await again.close()
            return first.ids({a, b}), again.ids({a, b}), latencies
    before, after, latencies = run(body())
    assert max(latencies) < 1.0, latencies
    assert len(before) == len(set(before)) and len(after) == len(set(after))
    repeated = set(before) & set(after)
    assert not repeated, f"the resumed stream repeated {len(repeated)} event(s)"
    assert set(before) | set(after) == set(recorded), "events were lost"
    for channel in (a, b):                                          # each channel in its own order
        stored = http("GET", remote.url + f"/api/v1/events/replay/{channel}?limit=1000", key=remote.key)[2]["events"]
        mine = [i for i in before + after if i in {e["id"] for e in stored}]
        assert mine == [e["id"] for e in stored]


def test_a_whole_instance_stream_shows_only_in_scope_channels(fleet):
    from actae_client.errors import ActaeConnectionError
    remote, remote_id = fleet.remotes[0], fleet.remote_ids[0]
    tag = uuid.uuid4().hex[:8]

    async def body():
        async with fleet.client(fleet.ci_token) as f:
            listener = Listener(f.stream(ticket=await mint_instance_ticket(f, remote_id), instance_id=remote_id))
            try:
                await listener.warm_up(lambda: record(remote, f"ci-st-{tag}", "w", {"n": "warm"}))
                await asyncio.to_thread(record, remote, f"secret-st-{tag}", "w", {"n": "hidden"})
                marker = await asyncio.to_thread(record, remote, f"ci-st-{tag}", "w", {"n": "after"})
                await listener.until(marker["id"], 5, "the in-scope event recorded after the out-of-scope one")
            except ActaeConnectionError as exc:
                opened(exc)
            finally:
                await listener.close()
            return listener.frames
    frames = run(body())
    assert {fr["event"]["channel_id"] for fr in frames} == {f"ci-st-{tag}"}, frames


# --- the bulk fork ------------------------------------------------------------------------------------

def failed_run(srv, channel, steps=2, error="model outage"):
    """A run with `steps` steps (a state at each) and then a run.failed event saying `error`."""
    for step in range(1, steps + 1):
        event = record(srv, channel, "agent.step", {"step": step}, step=step)
        save_state(srv, channel, event["cursor"], {"done": step})
    record(srv, channel, "run.failed", {"error": error})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A server with failed runs inv-1, other-1, other-2 (each failure names secret-token-XYZZY), and an
    `inv-*` key that may read and write."""
    with ServerProcess(tmp_path_factory.mktemp("bulk")).start() as srv:
        for channel in ("inv-1", "other-1", "other-2"):
            failed_run(srv, channel, error=f"outage: secret-token-XYZZY on {channel}")
        srv.inv = new_key(srv, read=["inv-*"], write=["inv-*"])
        yield srv


def bulk(srv, body, key):
    status, _, answer = http("POST", srv.url + "/api/v1/forks/bulk", key=key, body=body)
    return status, answer


def assert_names_no_other(answer):
    text = json.dumps(answer)
    assert "other-" not in text, answer
    for item in answer["forks"]:
        assert item["source_channel_id"].startswith("inv-") and item["channel_id"].startswith("inv-")
    assert answer["skipped"] == [], answer
    for name, value in answer.items():       # any count the answer carries counts in-scope runs only
        if isinstance(value, int) and not isinstance(value, bool):
            assert value <= len(answer["forks"]), (name, answer)


def test_a_bulk_fork_dry_run_never_names_out_of_scope_runs(runs):
    status, answer = bulk(runs, {"dry_run": True}, runs.inv)
    assert status == 200, answer
    assert [f["source_channel_id"] for f in answer["forks"]] == ["inv-1"]
    assert_names_no_other(answer)


def test_a_bulk_fork_never_names_out_of_scope_runs(runs):
    before = set(http("GET", runs.url + "/api/v1/channels", key=runs.key)[2]["channels"])
    status, answer = bulk(runs, {}, runs.inv)
    assert status == 200, answer
    assert [f["source_channel_id"] for f in answer["forks"]] == ["inv-1"]
    assert_names_no_other(answer)
    made = set(http("GET", runs.url + "/api/v1/channels", key=runs.key)[2]["channels"]) - before
    assert made == {"inv-1-retry"}


def test_the_failure_text_of_an_out_of_scope_run_is_no_oracle(runs):
    def dry(text):
        return bulk(runs, {"filter": {"channel_ids": ["other-1"], "failure_contains": text}, "dry_run": True}, runs.inv)
    # (the admin key sees that the text is there: the two filters do select differently)
    admin = {text: bulk(runs, {"filter": {"channel_ids": ["other-1"], "failure_contains": text}, "dry_run": True},
                        runs.key)[1]["forks"] for text in ("secret-token-XYZZY", "no-such-text")}
    assert len(admin["secret-token-XYZZY"]) == 1 and admin["no-such-text"] == []
    assert dry("secret-token-XYZZY") == dry("no-such-text")


def test_a_bulk_fork_does_not_fork_from_out_of_scope_history(tmp_path):
    with ServerProcess(tmp_path / "lineage").start() as srv:
        failed_run(srv, "other-root", steps=3)
        fork(srv, "other-root", "inv-9", 4)                  # made by the admin key: inv-9's steps are other-root's
        record(srv, "inv-9", "run.failed", {"error": "again"})
        inv = new_key(srv, read=["inv-*"], write=["inv-*"])
        before = set(http("GET", srv.url + "/api/v1/channels", key=srv.key)[2]["channels"])
        status, answer = bulk(srv, {"filter": {"channel_ids": ["inv-9"]}, "at": 1, "name": "{channel_id}-at{step}"},
                              inv)
        made = set(http("GET", srv.url + "/api/v1/channels", key=srv.key)[2]["channels"]) - before
        if status != 200:
            assert made == set() and "other-root" not in json.dumps(answer), answer
            return
        for channel in made:
            receipt = http("GET", srv.url + f"/api/v1/channels/{channel}/receipt", key=srv.key)[2]
            meta = http("GET", srv.url + f"/api/v1/channels/{channel}/metadata", key=srv.key)[2]
            sources = {receipt.get("source_channel_id"), meta.get("parent_channel_id"),
                       (meta.get("experiment_metadata") or {}).get("forked_from")}
            assert "other-root" not in sources, (channel, receipt, meta)
        assert "other-root" not in json.dumps(answer), answer


# --- the approvals inbox --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def approvals(runs):
    """other-a1 asks for approval; inv-a2 and other-a2 both ask with request id rq-dup."""
    async def body(client):
        await client.record("other-a1", "step", {}, actor="agent", step_number=1)
        request_id = await client.request_approval("other-a1", summary="out of scope")
        for channel in ("inv-a2", "other-a2"):
            await client.request_approval(channel, summary="the same id", request_id="rq-dup")
        return request_id
    return using(runs, body)


def decide(srv, request_id, key, **body):
    status, _, answer = http("POST", srv.url + f"/api/v1/approvals/{request_id}/decide", key=key,
                             body={"decision": "approved", **body})
    return status, answer


def test_deciding_an_out_of_scope_request_answers_as_an_unknown_one(runs, approvals):
    hidden = decide(runs, approvals, runs.inv)
    unknown = decide(runs, "rq-no-such-request", runs.inv)
    assert "other-a1" not in json.dumps(hidden[1]), hidden
    assert (hidden[0], masked(hidden[1], approvals)) == (unknown[0], masked(unknown[1], "rq-no-such-request")), (
        hidden, unknown)
    status, _, listed = http("GET", runs.url + "/api/v1/approvals?channel_id=other-a1", key=runs.key)
    assert [a["status"] for a in listed["approvals"]] == ["pending"]


def test_a_request_id_shared_with_an_out_of_scope_run_decides_the_in_scope_one(runs, approvals):
    status, answer = decide(runs, "rq-dup", runs.inv)
    assert "other-a2" not in json.dumps(answer), (status, answer)
    assert status == 200 and answer["approval"]["channel_id"] == "inv-a2", (status, answer)
    status, _, listed = http("GET", runs.url + "/api/v1/approvals?channel_id=other-a2", key=runs.key)
    assert [a["status"] for a in listed["approvals"]] == ["pending"]


# --- /openapi.json --------------------------------------------------------------------------------------

def openapi(srv) -> dict:
    status, _, document = http("GET", srv.url + "/openapi.json")
    assert status == 200
    return document


def resolved(document, schema):
    while isinstance(schema, dict) and set(schema) == {"$ref"}:
        ref = schema["$ref"]
        assert ref.startswith("#/"), ref
        schema = document
        for part in ref[2:].split("/"):
            schema = schema[part]
    return schema


def operations(document):
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            if method in ("get", "put", "post", "delete", "patch", "head", "options", "trace"):
                yield method.upper(), path, operation


def two_xx_schemas(document, operation):
    return [resolved(document, media.get("schema"))
            for code, response in operation.get("responses", {}).items() if str(code).startswith("2")
            for media in (resolved(document, response).get("content") or {}).values()]


def describes(schema) -> bool:
    """More than an empty schema, or than a bare {"type": "object"} (any object at all)."""
    if not isinstance(schema, dict) or not schema:
        return False
    return schema != {"type": "object"}


def test_every_operation_has_a_non_empty_2xx_response_schema(fleet):
    document = openapi(fleet.gateway)
    empty = [(m, p) for m, p, o in operations(document) if not any(s not in (None, {}) for s in two_xx_schemas(document, o))]
    assert len(list(operations(document))) > 50
    assert empty == [], empty


def test_the_fleet_operation_and_openapi_answers_are_described_beyond_a_bare_object(fleet):
    document = openapi(fleet.gateway)
    bare = [(m, p) for m, p, o in operations(document) if not any(describes(s) for s in two_xx_schemas(document, o))]
    assert bare == [], bare
