"""The fleet gateway with the real SDK: one gateway (its own local instance) and two remote servers.

Three real servers on loopback: G (the gateway, organisation `acme`) and R1, R2 registered on it with
`actae instance add`; an organisation token from `actae org-token create`. Every public method of
`FleetClient` and `FleetSessionTransport` is called against G, on the local instance and on a remote
one, and each answer is checked against what the target server itself stores, read back through
that server's own API with its own key (never through the gateway). `AgentSession` runs over
`FleetClient.for_instance(R1)`: six steps, a fork after step 3 with an intervention and a `block`
policy, resumed; R1's own replay, receipt and ledger show exactly that. The streams (the ticketed
WebSocket and the NDJSON one) deliver events recorded on a remote within a second, and a resume
cursor loses and repeats none.

The SDK 1.3.0's FleetSessionTransport calls `ChannelMetadata.from_dict`, which its types module does
not define (every call of get_channel_metadata/update_metadata would raise AttributeError after the
server answered). `sdk_channel_metadata_from_dict` below adds exactly that constructor, from the
dataclass's own fields, when it is missing; `test_the_sdk_still_lacks_channel_metadata_from_dict`
says when it is no longer needed.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid

import pytest

from conftest import Fleet, ServerProcess, cli, http, run, start_fleet

ORG = "acme"


def _sdk_has_from_dict() -> bool:
    from actae_client.types import ChannelMetadata
    return hasattr(ChannelMetadata, "from_dict")


SDK_HAS_CHANNEL_METADATA_FROM_DICT = _sdk_has_from_dict()     # before the shim below adds it


# --- the servers ------------------------------------------------------------------------------------

def direct(srv: ServerProcess, method: str, path: str, body=None):
    """The target server's own API, with its own key: what it stores, without the gateway."""
    status, _, answer = http(method, srv.url + path, key=srv.key, body=body)
    return status, answer


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with start_fleet(tmp_path_factory.mktemp("fleet"), 2, names="r{n}", organization=ORG, token=("--admin",)) as f:
        assert f"Organization: {ORG} " in "\n".join(f.gateway.lines) + " "
        for remote_id, out in zip(f.remote_ids, f.added):
            assert remote_id in out
        assert f.token.startswith("ot-") and " " not in f.token, f.token      # the token, on a line of its own
        yield f


@pytest.fixture(scope="module", autouse=True)
def sdk_channel_metadata_from_dict():
    from actae_client.types import ChannelMetadata
    if hasattr(ChannelMetadata, "from_dict"):
        yield
        return
    names = {f.name for f in dataclasses.fields(ChannelMetadata)}
    ChannelMetadata.from_dict = classmethod(lambda cls, data: cls(**{k: v for k, v in data.items() if k in names}))
    try:
        yield
    finally:
        del ChannelMetadata.from_dict


def test_the_sdk_still_lacks_channel_metadata_from_dict():
    """When this fails, the SDK has fixed FleetSessionTransport's metadata calls: drop the shim above."""
    assert not SDK_HAS_CHANNEL_METADATA_FROM_DICT


def tag() -> str:
    return "fl" + uuid.uuid4().hex[:10]


def target(fleet: Fleet, which: str, remote: int = 0) -> tuple:
    """(instance id, its server, a fresh channel name) for "local" (the gateway's own instance) or
    "remote" (`remote_ids[remote]`)."""
    instance = fleet.local_id if which == "local" else fleet.remote_ids[remote]
    return instance, fleet.server_of(instance), tag()


# --- the organisation: instances, capabilities, the client's plumbing ---------------------------------

def test_instances_lists_this_server_and_the_registered_remotes(fleet):
    async def body():
        async with fleet.client() as f:
            return await f.instances()
    answer = run(body())
    assert answer["organization_id"] == ORG and answer["gateway_protocol_version"] == "1"
    listed = {i["instance_id"]: i for i in answer["instances"]}
    assert set(listed) == {fleet.local_id, *fleet.remote_ids}
    assert listed[fleet.local_id]["local"] is True and listed[fleet.local_id]["url"] is None
    for srv, rid in zip(fleet.remotes, fleet.remote_ids):
        assert listed[rid]["url"] == srv.url and listed[rid]["local"] is False
    # the same list the command line shows, read from the gateway's database
    out = json.loads(cli("instance", "list", "--json", data_dir=fleet.gateway).stdout)
    assert out["local_instance_id"] == fleet.local_id
    assert {i["instance_id"] for i in out["instances"]} == set(fleet.remote_ids)
    assert all("key" not in i or i["key"] is None for i in out["instances"])


def test_capabilities_report_each_instances_own_versions_and_every_fleet_operation(fleet):
    from actae_client.fleet import UnsupportedOperationError
    from actae_client.manifest import MANIFEST_OPERATIONS

    async def body():
        async with fleet.client() as f:
            caps = {i: await f.capabilities(i) for i in [fleet.local_id, *fleet.remote_ids]}
            await f.ensure_operation("actae.api.v1.events.record", instance_id=fleet.remote_ids[1])
            with pytest.raises(UnsupportedOperationError):
                await f.ensure_operation("actae.api.v1.auth.login", instance_id=fleet.remote_ids[1])
            return caps
    caps = run(body())
    wanted = sorted(op.id for op in MANIFEST_OPERATIONS if op.fleet_supported)
    for instance_id, answer in caps.items():
        own = direct(fleet.server_of(instance_id), "GET", "/api/v1/instance")[1]
        assert answer["instance_id"] == own["instance_id"] == instance_id
        assert (answer["version"], answer["api_version"], answer["backend"]) == (own["version"], own["api_version"],
                                                                                 own["backend"])
        assert answer["gateway_protocol_version"] == "1"
        assert sorted(answer["supported_fleet_operations"]) == wanted
        assert answer["local"] is (instance_id == fleet.local_id)


def test_from_env_for_instance_and_close(fleet, monkeypatch):
    from actae_client.fleet import FleetClient, FleetSessionTransport
    monkeypatch.setenv("ACTAE_ORG_TOKEN", fleet.token)
    monkeypatch.setenv("ACTAE_FLEET_URL", fleet.gateway.url)
    monkeypatch.setenv("ACTAE_ORG_ID", ORG)

    async def body():
        f = FleetClient.from_env()
        try:
            transport = f.for_instance(fleet.remote_ids[0])
            assert isinstance(transport, FleetSessionTransport) and transport.instance_id == fleet.remote_ids[0]
            return await f.instances()
        finally:
            await f.close()
            assert f._session is None
    assert {i["instance_id"] for i in run(body())["instances"]} >= set(fleet.remote_ids)


# --- FleetClient's resource calls, on the local and a remote instance ---------------------------------

@pytest.mark.parametrize("which", ["local", "remote"])
def test_record_replay_state_fork_through_the_gateway_land_on_the_instance(fleet, which):
    instance, srv, ch = target(fleet, which)

    async def body():
        async with fleet.client() as f:
            first = await f.record(instance, ch, "note", {"n": 1}, operation_id=f"{ch}-op1")
            again = await f.record(instance, ch, "note", {"n": 1}, operation_id=f"{ch}-op1")   # a retry: once
            second = await f.record(instance, ch, "note", {"n": 2})
            version = await f.save_state(instance, ch, 2, {"seen": 2}, operation_id=f"{ch}-s1")
            retried = await f.save_state(instance, ch, 2, {"seen": 2}, operation_id=f"{ch}-s1")
            latest = await f.latest_state(instance, ch)
            replayed = await f.replay(instance, ch, cursor=0, limit=10)
            receipt = await f.fork(instance, ch, f"{ch}-fork", 2, operation_id=f"{ch}-f1", reason="try")
            receipt_again = await f.fork(instance, ch, f"{ch}-fork", 2, operation_id=f"{ch}-f1", reason="try")
            return first, again, second, version, retried, latest, replayed, receipt, receipt_again
    first, again, second, version, retried, latest, replayed, receipt, receipt_again = run(body())
    assert first["event"]["id"] == again["event"]["id"]
    events = direct(srv, "GET", f"/api/v1/events/replay/{ch}?cursor=0")[1]["events"]
    assert [(e["id"], e["payload"]) for e in events] == [(first["event"]["id"], {"n": 1}),
                                                          (second["event"]["id"], {"n": 2})]
    assert [e["id"] for e in replayed["events"]] == [e["id"] for e in events]
    assert version == retried == {"version": 1}
    assert direct(srv, "GET", f"/api/v1/state/{ch}/versions")[1]["versions"][0]["version"] == 1
    assert len(direct(srv, "GET", f"/api/v1/state/{ch}/versions")[1]["versions"]) == 1
    stored = direct(srv, "GET", f"/api/v1/state/{ch}")[1]
    assert latest == stored and stored["state"] == {"seen": 2}
    assert receipt_again["replayed"] is True              # the retried fork answers the original one
    assert receipt == {**receipt_again, "replayed": False} == direct(srv, "GET", f"/api/v1/channels/{ch}-fork/receipt")[1]
    assert receipt["source_channel_id"] == ch and receipt["requested_cursor"] == 2
    assert direct(srv, "GET", f"/api/v1/channels/{ch}-fork/metadata")[1]["reason"] == "try"
    other = fleet.remotes[1] if srv is not fleet.remotes[1] else fleet.gateway
    assert direct(other, "GET", f"/api/v1/events/cursor/{ch}")[1]["latest_cursor"] is None   # nowhere else


@pytest.mark.parametrize("which", ["local", "remote"])
def test_query_query_page_and_iter_query_answer_the_instances_events(fleet, which):
    instance, srv, ch = target(fleet, which)
    for n in range(7):
        assert direct(srv, "POST", "/api/v1/events/record", {"channel_id": ch, "event_type": "q",
                                                              "payload": {"n": n}})[0] == 200

    async def body():
        async with fleet.client() as f:
            whole = await f.query(instance, channel_ids=[ch], limit=50)
            page = await f.query_page(instance, channel_ids=[ch], limit=3)
            walked = [e async for e in f.iter_query(instance, channel_ids=[ch], limit=3)]
            return whole, page, walked
    whole, page, walked = run(body())
    stored = direct(srv, "POST", "/api/v1/events/query", {"channel_ids": [ch], "limit": 50})[1]["events"]
    assert [e["id"] for e in whole["events"]] == [e["id"] for e in stored] and len(stored) == 7
    assert all(e["instance_id"] == instance for e in whole["events"]) and whole["errors"] == []
    assert [e["id"] for e in page.items] == [e["id"] for e in stored[:3]] and page.next_page_token
    assert [e["id"] for e in walked] == [e["id"] for e in stored]


def test_query_many_merges_instances_and_keeps_every_page_token(fleet):
    ch = tag()
    for srv in (fleet.gateway, *fleet.remotes):
        for n in range(2):
            direct(srv, "POST", "/api/v1/events/record", {"channel_id": ch, "event_type": "m", "payload": {"n": n}})
    ids = [fleet.local_id, *fleet.remote_ids]

    async def body():
        async with fleet.client() as f:
            return await f.query_many(instance_ids=[*ids, "no-such-instance"], channel_ids=[ch], limit=100)
    result = run(body())
    got = {(e["instance_id"], e["id"]) for e in result.items}
    stored = {(i, e["id"]) for i in ids
              for e in direct(fleet.server_of(i), "POST", "/api/v1/events/query", {"channel_ids": [ch]})[1]["events"]}
    assert got == stored and len(got) == 6
    assert [(e.instance_id, e.code) for e in result.errors] == [("no-such-instance", "unknown_instance")]
    stamps = [e["timestamp"] for e in result.items]
    assert stamps == sorted(stamps, reverse=True)


# --- call and call_operation (the typed escape hatches) -------------------------------------------------

@pytest.mark.parametrize("which", ["local", "remote"])
def test_call_and_call_operation_reach_the_named_instance(fleet, which):
    instance, srv, ch = target(fleet, which, 1)

    async def body():
        async with fleet.client() as f:
            recorded = await f.call("POST", "/api/v1/events/record", instance_id=instance, operation_id=f"{ch}-c",
                                    body={"channel_id": ch, "event_type": "called", "payload": {"via": "call"}},
                                    operation_manifest_id="actae.api.v1.events.record")
            cursor = await f.call("GET", f"/api/v1/events/cursor/{ch}", instance_id=instance)
            listed = await f.call("GET", "/api/v1/channels", instance_id=instance)
            trail = await f.call_operation("actae.api.v1.channels.trail.get", instance_id=instance,
                                           path_params={"channel_id": ch})
            closed = await f.call_operation("actae.api.v1.channels.close", instance_id=instance,
                                            path_params={"channel_id": ch})
            deleted = await f.call("DELETE", f"/api/v1/channels/{ch}", instance_id=instance, confirm_target=ch)
            return recorded, cursor, listed, trail, closed, deleted
    recorded, cursor, listed, trail, closed, deleted = run(body())
    assert recorded["event"]["payload"] == {"via": "call"} and cursor == {"latest_cursor": 1}
    assert ch in listed["channels"] and trail["channel_id"] == ch and closed["ok"] is True
    assert deleted["deleted"] == [ch]
    assert direct(srv, "GET", f"/api/v1/channels/{ch}/metadata")[0] == 404      # gone from that server


# --- FleetSessionTransport, every method, on the local and a remote instance ----------------------------

@pytest.mark.parametrize("which", ["local", "remote"])
def test_every_session_transport_method_lands_on_the_instance(fleet, which):
    instance, srv, ch = target(fleet, which)

    async def body():
        async with fleet.client() as f:
            t = f.for_instance(instance)
            e1 = await t.record(ch, "step", {"k": 1}, actor="agent", agent_id="a1", step_number=1,
                                operation_id=f"{ch}-1")
            e2 = await t.record(ch, "step", {"k": 2}, actor="agent", step_number=2,
                                dependencies=[{"event_id": e1.id, "dependency_type": "causal"}])
            replayed = await t.replay(ch, cursor=0, limit=10)
            version = await t.save_state(ch, e2.cursor, {"at": 2})
            latest = await t.latest_state(ch)
            meta = await t.update_metadata(ch, display_name="Fleet run", experiment_metadata={"x": 1})
            got = await t.get_channel_metadata(ch)
            missing = await t.get_channel_metadata(f"{ch}-nope")
            step = await t.resolve_step(ch, 2)
            no_step = await t.resolve_step(ch, 9)
            last = await t.latest_step_number(ch)
            receipt = await t.fork(ch, f"{ch}-child", e2.cursor, reason="child")
            outcome = await t.set_outcome(f"{ch}-child", "promoted", score=0.9)
            promoted = await t.promote_channel(f"{ch}-child")
            experiment = await t.create_experiment(f"exp-{ch}", description="d", baseline_channel_id=ch)
            member = await t.add_experiment_member(experiment["id"], f"{ch}-child", role="variant",
                                                   declared_delta={"model": "b"})
            return (e1, e2, replayed, version, latest, meta, got, missing, step, no_step, last, receipt, outcome,
                    promoted, experiment, member)
    (e1, e2, replayed, version, latest, meta, got, missing, step, no_step, last, receipt, outcome, promoted,
     experiment, member) = run(body())
    events = direct(srv, "GET", f"/api/v1/events/replay/{ch}?cursor=0")[1]["events"]
    assert [e["id"] for e in events[:2]] == [e1.id, e2.id] == [e.id for e in replayed[:2]]
    assert events[0]["agent_id"] == "a1" and events[1]["step_number"] == 2
    graph = direct(srv, "GET", f"/api/v1/events/{e2.id}/causal-graph")[1]
    assert {d["depends_on_event_id"] for d in graph["dependencies"]} == {e1.id}
    assert version == 1 and latest == {"cursor": e2.cursor, "state": {"at": 2}}
    stored = direct(srv, "GET", f"/api/v1/channels/{ch}/metadata")[1]
    assert stored["display_name"] == "Fleet run" == meta.display_name == got.display_name
    assert stored["experiment_metadata"] == {"x": 1} == got.experiment_metadata
    assert missing is None and no_step is None
    resolved = direct(srv, "GET", f"/api/v1/channels/{ch}/steps/2")[1]
    assert step == (resolved["channel_id"], resolved["cursor"], resolved["event_id"])
    assert last == direct(srv, "GET", f"/api/v1/channels/{ch}/steps")[1]["last_step_number"] == 2
    assert receipt.child_channel_id == f"{ch}-child"
    assert direct(srv, "GET", f"/api/v1/channels/{ch}-child/receipt")[1]["fork_id"] == receipt.fork_id
    child = direct(srv, "GET", f"/api/v1/channels/{ch}-child/metadata")[1]
    assert child["outcome"] == "promoted" and child["result_score"] == 0.9 and outcome["ok"] is True
    assert promoted["ok"] is True
    stored_experiment = direct(srv, "GET", f"/api/v1/experiments/{experiment['id']}")[1]
    assert stored_experiment["name"] == f"exp-{ch}" and stored_experiment["baseline_channel_id"] == ch
    assert member == stored_experiment
    assert ([m["declared_delta"] for m in stored_experiment["members"] if m["channel_id"] == f"{ch}-child"]
            == [{"model": "b"}])


# --- AgentSession over a remote instance ---------------------------------------------------------------

STEPS = ["research", "insights", "risks", "recommendations", "summary", "finalize"]


def test_agent_session_over_a_remote_instance_forks_blocks_and_resumes(fleet):
    from actae_client import AgentSession
    from actae_client.errors import APIError

    remote = fleet.remote_ids[0]
    srv, base = fleet.server_of(remote), tag()
    fork = f"{base}-fork"

    async def charge(f, channel: str) -> dict:
        claim = await f.call_operation("actae.api.v1.executions.claim", instance_id=remote, body={
            "channel_id": channel, "key_name": "inv-1", "tool_name": "charge_customer",
            "params": {"amount_cents": 4900}})
        if claim["status"] == "claimed":
            await f.call_operation("actae.api.v1.executions.complete", instance_id=remote,
                                   path_params={"id": claim["execution"]["id"]},
                                   body={"claim_token": claim["claim_token"], "result": {"charge_id": "ch_1"}})
        return claim

    async def body():
        async with fleet.client() as f:
            transport = f.for_instance(remote)
            state = {"done": 0, "notes": {}}
            session = AgentSession(transport, base, state_fn=lambda: json.loads(json.dumps(state)),
                                   params={"model": "fast"})
            async with session:
                for n, name in enumerate(STEPS, 1):
                    if n == 4:
                        assert (await charge(f, base))["status"] == "claimed"
                    state["done"], state["notes"][name] = n, f"{name} by fast"
                    await session.step(name, input={"n": n}, output={"text": f"{name} by fast"})
            child = await AgentSession.resume(transport, base, fork_at_step=3, name=fork,
                                              intervention={"model": "slow"},
                                              tool_policies={"charge_customer": "block", "*": "auto"})
            inherited = json.loads(json.dumps(child.inherited_state))
            child._state_fn = lambda: inherited
            blocked = None
            async with child:
                for n, name in enumerate(STEPS[3:], 4):
                    if n == 4:
                        try:
                            await charge(f, fork)
                        except APIError as exc:
                            blocked = exc
                    inherited["done"], inherited["notes"][name] = n, f"{name} by {child.intervention['model']}"
                    await child.step(name, input={"n": n}, output={"text": f"{name} by slow"})
            return child.fork_receipt, blocked, inherited
    receipt, blocked, final = run(body())
    assert blocked is not None and blocked.status_code == 409 and "block" in str(blocked).lower()
    # R1's own record: the base run's six steps, the fork's steps 4-6 after its boundary at step 3
    base_steps = [e for e in direct(srv, "GET", f"/api/v1/events/replay/{base}?cursor=0&limit=500")[1]["events"]
                  if e["step_number"]]
    assert [e["step_number"] for e in base_steps] == [1, 2, 3, 4, 5, 6]
    fork_events = direct(srv, "GET", f"/api/v1/events/replay/{fork}?cursor=0&limit=500")[1]["events"]
    assert [e["step_number"] for e in fork_events if e["step_number"]] == [4, 5, 6]
    assert all("by slow" in json.dumps(e["payload"]) for e in fork_events if e["step_number"])
    stored_receipt = direct(srv, "GET", f"/api/v1/channels/{fork}/receipt")[1]
    assert stored_receipt["fork_id"] == receipt.fork_id and stored_receipt["forked_at_step"] == 3
    assert stored_receipt["source_channel_id"] == base and stored_receipt["restorable"] is True
    assert stored_receipt["tool_policies"] == {"charge_customer": "block", "*": "auto"}
    meta = direct(srv, "GET", f"/api/v1/channels/{fork}/metadata")[1]
    assert meta["experiment_metadata"]["intervention"] == {"model": "slow"}
    assert final["notes"]["recommendations"] == "recommendations by slow" and final["notes"]["risks"] == "risks by fast"
    # the ledger: the base run's one charge ran; the fork's never did
    ledger = {ch: direct(srv, "GET", f"/api/v1/executions?channel_id={ch}")[1]["executions"] for ch in (base, fork)}
    charges = [x for x in ledger[base] if x["tool_name"] == "charge_customer"]
    assert [(x["key_name"], x["status"]) for x in charges] == [("inv-1", "completed")]
    assert [x for x in ledger[fork] if x["tool_name"] == "charge_customer"] == []
    blocked_events = [e for e in fork_events if e["type"] == "tool.blocked"]
    assert [(e["payload"]["tool_name"], e["payload"]["policy"]) for e in blocked_events] == [("charge_customer", "block")]
    # and none of it on the gateway's own server
    assert direct(fleet.gateway, "GET", f"/api/v1/channels/{fork}/metadata")[0] == 404


# --- streams ------------------------------------------------------------------------------------------

async def mint_ticket(f, instance_id: str, channel_id: str, resume_cursor=None) -> str:
    body = {"instance_id": instance_id, "channel_id": channel_id}
    if resume_cursor is not None:
        body["resume_cursor"] = resume_cursor
    answer = await f._request("POST", f"/v1/organizations/{ORG}/events/stream/tickets", body=body)
    assert answer["expires_in"] > 0 and answer["ticket"]
    return answer["ticket"]


@pytest.mark.parametrize("which", ["remote", "local"])
def test_stream_delivers_within_a_second_and_resumes_without_loss_or_repeat(fleet, which):
    from actae_client.errors import ActaeConnectionError
    instance, srv, ch = target(fleet, which, 1)
    record = lambda n: direct(srv, "POST", "/api/v1/events/record",  # noqa: E731
                              {"channel_id": ch, "event_type": "s", "payload": {"n": n}})[1]["event"]
    first = record(0)

    async def body():
        async with fleet.client() as f:
            ticket = await mint_ticket(f, instance, ch)
            stream = f.stream(ticket=ticket, channel_id=ch, resume_cursor=0)
            got = [await asyncio.wait_for(stream.__anext__(), 10)]          # the history after cursor 0
            latencies = []
            for n in (1, 2, 3):
                started = time.monotonic()
                await asyncio.to_thread(record, n)
                got.append(await asyncio.wait_for(stream.__anext__(), 5))
                latencies.append(time.monotonic() - started)
            await stream.aclose()
            seen = got[-1]["event"]["cursor"]
            for n in (4, 5):                               # recorded while nobody listens
                await asyncio.to_thread(record, n)
            again = f.stream(ticket=await mint_ticket(f, instance, ch), channel_id=ch, resume_cursor=seen)
            resumed = [await asyncio.wait_for(again.__anext__(), 10) for _ in range(2)]
            await asyncio.to_thread(record, 6)
            resumed.append(await asyncio.wait_for(again.__anext__(), 5))
            await again.aclose()
            with pytest.raises(ActaeConnectionError):      # a used ticket opens nothing
                reused = f.stream(ticket=ticket, channel_id=ch)
                await asyncio.wait_for(reused.__anext__(), 10)
            return got, latencies, resumed
    got, latencies, resumed = run(body())
    assert got[0]["event"]["id"] == first["id"]
    assert all(item["type"] == "event" and item["instance_id"] == instance for item in got + resumed)
    assert max(latencies) < 1.0, latencies
    stored = direct(srv, "GET", f"/api/v1/events/replay/{ch}?cursor=0")[1]["events"]
    assert [i["event"]["id"] for i in got + resumed] == [e["id"] for e in stored]       # none lost, none twice
    assert [i["event"]["payload"]["n"] for i in got + resumed] == list(range(7))


def test_ndjson_stream_delivers_a_remote_instances_events(fleet):
    instance, srv, ch = target(fleet, "remote")
    for n in range(2):
        direct(srv, "POST", "/api/v1/events/record", {"channel_id": ch, "event_type": "nd", "payload": {"n": n}})

    async def body():
        async with fleet.client() as f:
            stream = f.stream(instance_id=instance, channel_id=ch, cursor=1)
            item = await asyncio.wait_for(stream.__anext__(), 10)
            started = time.monotonic()
            await asyncio.to_thread(direct, srv, "POST", "/api/v1/events/record",
                                    {"channel_id": ch, "event_type": "nd", "payload": {"n": 2}})
            live = await asyncio.wait_for(stream.__anext__(), 5)
            elapsed = time.monotonic() - started
            await stream.aclose()
            return item, live, elapsed
    item, live, elapsed = run(body())
    assert (item["cursor"], item["payload"], item["instance_id"]) == (2, {"n": 1}, instance)
    assert (live["cursor"], live["payload"]) == (3, {"n": 2}) and elapsed < 1.0


# --- the gateway's errors ---------------------------------------------------------------------------------

def test_gateway_errors_carry_the_message_the_sdk_reads_and_name_the_instance(fleet):
    from actae_client.errors import APIError

    async def body():
        async with fleet.client() as f:
            with pytest.raises(APIError) as unknown:
                await f.record("no-such-instance", "x", "t", {})
            with pytest.raises(APIError) as other_org:
                await f._request("GET", "/v1/organizations/other/instances")
            with pytest.raises(APIError) as not_fleet:
                await f._request("POST", f"/v1/organizations/{ORG}/instances/{fleet.local_id}/ops/"
                                         "actae.api.v1.auth.login", body={"body": {}})
            return unknown.value, other_org.value, not_fleet.value
    unknown, other_org, not_fleet = run(body())
    assert unknown.status_code == 404 and "no-such-instance" in str(unknown)
    assert other_org.status_code == 403 and "acme" in str(other_org)
    assert not_fleet.status_code == 426 and "not a fleet command" in str(not_fleet)
    status, _, answer = http("GET", fleet.gateway.url + f"/v1/organizations/{ORG}/instances")
    assert status == 401 and set(answer) == {"status", "error", "message"} and answer["message"] == answer["error"]
