"""The SDK's MANIFEST_OPERATIONS, walked: every fleet-supported operation dispatches through the gateway
(`FleetClient.call_operation`, i.e. POST .../instances/{id}/ops/{operation_id}) to the local and to a
remote instance and answers what the direct route answers; every other operation is refused.

Each operation runs twice on the target server, on twin resources made the same way: once through
the gateway ("g" resources) and once on the server's own route with its own key ("d" resources). The
two answers must be equal once the twins' names and what is unique to a write (ids, timestamps,
hashes) are put aside; a read of the same resource (both on "g") must be equal outright. Identity
reads on the local instance (capabilities, me, preferences) name the organisation token instead of
a key, so there they agree in shape.
"""
from __future__ import annotations

import re
import sys
import uuid
from datetime import datetime, timedelta, timezone
from urllib.parse import quote, urlencode

import pytest

from conftest import ROOT, http, run, start_fleet

ORG = "local"
VOLATILE = re.compile(r"^([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|\d{4}-\d\d-\d\dT[\d:.]+Z"
                      r"|[0-9a-f]{64}|[0-9a-f]{16,}|tok_.*|ct_.*|[A-Za-z0-9_-]{40,})$")
UNSTABLE_KEYS = {"uptime_seconds", "started_at", "last_used_at", "check_duration_ms", "lease_until",
                 "lease_expires_at", "expires_at", "claim_token", "duration_seconds"}
IDENTITY_OPS = {"actae.api.v1.auth.capabilities.get", "actae.api.v1.auth.me.get",
                "actae.api.v1.user.preferences.get", "actae.api.v1.user.preferences.put"}


def direct(srv, method, path, body=None, query=None):
    url = srv.url + path + ("?" + urlencode({k: v for k, v in (query or {}).items() if v is not None}) if query else "")
    headers = None
    if path == "/api/v1/auth/me":      # Bearer-only: the key exchanged for a login token, as the gateway does
        token = http("POST", srv.url + "/api/v1/auth/api-key-login", key=srv.key, body={})[2]["token"]
        headers = {"authorization": f"Bearer {token}"}
    status, _, answer = http(method, url, key=srv.key, body=body, headers=headers)
    return status, answer


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A gateway and one remote; `.token` an admin organisation token."""
    with start_fleet(tmp_path_factory.mktemp("mf"), 1, token=("--admin",)) as f:
        yield f


def target(fleet, which: str):
    """(the server, its instance id) for "local" (the gateway itself) or "remote"."""
    n = ("local", "remote").index(which)
    return fleet.servers[n], fleet.ids[n]


def setup_twin(srv, p: str) -> dict:
    """The resources one variant's calls use, made on the server directly."""
    ok = lambda r: (r[0] == 200 or pytest.fail(f"setup: {r}"), r[1])[1]  # noqa: E731
    ctx = {"p": p, "c": f"{p}-c", "f": f"{p}-f", "m2": f"{p}-m2"}
    for n in (1, 2, 3):
        ok(direct(srv, "POST", "/api/v1/events/record", {"channel_id": ctx["c"], "event_type": "step",
                                                          "payload": {"n": n}, "step_number": n}))
    ok(direct(srv, "POST", f"/api/v1/state/{ctx['c']}", {"cursor": 3, "state": {"n": 3}}))
    ok(direct(srv, "POST", f"/api/v1/state/{ctx['c']}", {"cursor": 3, "state": {"n": 33}}))
    ok(direct(srv, "POST", "/api/v1/channels/fork", {"source_channel_id": ctx["c"], "new_channel_id": ctx["f"],
                                                      "at_cursor": 3}))
    ok(direct(srv, "POST", "/api/v1/events/record", {"channel_id": ctx["m2"], "event_type": "x", "payload": {}}))
    ctx["event_id"] = ok(direct(srv, "GET", f"/api/v1/events/replay/{ctx['c']}"))["events"][2]["id"]
    for name in ("complete", "fail", "heartbeat", "cancel", "delete", "get"):
        claim = ok(direct(srv, "POST", "/api/v1/executions/claim", {"channel_id": ctx["c"], "key_name": f"k-{name}",
                                                                     "tool_name": "tool", "params": {"a": 1}}))
        ctx[f"x_{name}"], ctx[f"t_{name}"] = claim["execution"]["id"], claim["claim_token"]
    ok(direct(srv, "POST", "/api/v1/groups", {"group_id": f"{p}-grp", "channel_id": ctx["c"]}))
    ok(direct(srv, "POST", "/api/v1/execution-groups", {"group_id": f"{p}-eg"}))
    for member, channel in (("m1", ctx["c"]), ("m2", ctx["m2"])):
        ok(direct(srv, "POST", f"/api/v1/execution-groups/{p}-eg/members", {"member_id": member,
                                                                             "channel_id": channel}))
    return ctx


def operations(ctx: dict, later: dict) -> list:
    """(operation id, path params, query, body) in an order that works, for one variant."""
    p, c, f = ctx["p"], ctx["c"], ctx["f"]
    soon = (datetime.now(timezone.utc) + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%S.000Z")
    return [
        ("auth.capabilities.get", {}, {}, None),
        ("auth.me.get", {}, {}, None),
        ("user.preferences.put", {}, {}, {"preferences": {"theme": "dark"}}),
        ("user.preferences.get", {}, {}, None),
        ("instance.get", {}, {}, None),
        ("events.record", {}, {}, {"channel_id": c, "event_type": "step", "payload": {"n": 4}, "step_number": 4,
                                   "operation_id": f"{p}-op4"}),
        ("events.transition", {}, {}, {"channel_id": c, "type": "moved", "payload": {"to": 5}, "state": {"n": 5}}),
        ("events.replay", {"channel_id": c}, {"cursor": 0, "limit": 100}, None),
        ("events.query", {}, {}, {"channel_ids": [c], "limit": 10}),
        ("events.cursor.get", {"channel_id": c}, {}, None),
        ("events.verify_chain", {"channel_id": c}, {}, None),
        ("events.causal_graph.get", {"event_id": ctx["event_id"]}, {}, None),
        ("channels.list", {}, {}, None),
        ("state.save", {"channel_id": c}, {}, {"cursor": 5, "state": {"n": 55}, "operation_id": f"{p}-s"}),
        ("state.load", {"channel_id": c}, {}, None),
        ("state.versions.list", {"channel_id": c}, {}, None),
        ("state.version.get", {"channel_id": c, "version": 1}, {}, None),
        ("forks.create", {}, {}, {"source_channel_id": c, "new_channel_id": f"{p}-f2", "at_cursor": 3,
                                  "reason": "walk", "operation_id": f"{p}-fork2"}),
        ("channels.diff", {}, {"left": c, "right": f}, None),
        ("channels.compare", {}, {"left": c, "right": f}, None),
        ("channels.outcome.set", {"channel_id": f}, {}, {"outcome": "promoted", "score": 0.5}),
        ("forks.promote", {"channel_id": f}, {}, None),
        ("channels.metadata.get", {"channel_id": c}, {}, None),
        ("channels.metadata.put", {"channel_id": c}, {}, {"channel_id": c, "display_name": "walked"}),
        ("channels.steps.latest", {"channel_id": c}, {}, None),
        ("channels.steps.resolve", {"channel_id": c, "step_number": 2}, {}, None),
        ("channels.forks.list", {"channel_id": c}, {}, None),
        ("channels.fork_tree.get", {"channel_id": c}, {}, None),
        ("channels.trail.get", {"channel_id": c}, {}, None),
        ("channels.receipt.get", {"channel_id": f}, {}, None),
        ("groups.create", {}, {}, {"group_id": f"{p}-grp2", "channel_id": c}),
        ("groups.list", {}, {"channel_id": c}, None),
        ("groups.join", {"group_id": f"{p}-grp"}, {}, {"consumer_id": "w1"}),
        ("groups.claim_work", {"group_id": f"{p}-grp"}, {}, {"consumer_id": "w1", "limit": 2}),
        ("groups.ack", {"group_id": f"{p}-grp"}, {}, {"consumer_id": "w1", "cursor": 2}),
        ("groups.heartbeat", {"group_id": f"{p}-grp"}, {}, {"consumer_id": "w1"}),
        ("groups.offsets.get", {"group_id": f"{p}-grp"}, {}, None),
        ("execution_groups.create", {}, {}, {"group_id": f"{p}-eg2"}),
        ("execution_groups.list", {}, {}, None),
        ("execution_groups.members.add", {"group_id": f"{p}-eg"}, {}, {"member_id": "m3", "channel_id": f}),
        ("execution_groups.members.list", {"group_id": f"{p}-eg"}, {}, None),
        ("execution_groups.members.claim", {"group_id": f"{p}-eg", "member_id": "m1"}, {}, {"owner_id": "o1"}),
        ("execution_groups.members.heartbeat", {"group_id": f"{p}-eg", "member_id": "m1"}, {},
         lambda: {"owner_id": "o1", "generation": later["generation"]}),
        ("execution_groups.messages.send", {"group_id": f"{p}-eg"}, {},
         {"from_member_id": "m1", "to_member_id": "m2", "type": "hello", "payload": {"hi": 1}}),
        ("execution_groups.messages.list", {"group_id": f"{p}-eg", "member_id": "m2"}, {}, None),
        ("execution_groups.members.claim", {"group_id": f"{p}-eg", "member_id": "m2"}, {}, {"owner_id": "o2"}),
        ("execution_groups.messages.ack", lambda: {"message_id": later["message_id"]}, {},
         lambda: {"owner_id": "o2", "generation": later["generation"]}),
        ("execution_groups.members.release", {"group_id": f"{p}-eg", "member_id": "m1"}, {},
         {"owner_id": "o1", "generation": 1}),
        ("execution_groups.forks.create", {}, {}, {"fork_group_id": f"{p}-egf", "source_group_id": f"{p}-eg",
                                                  "intervention_member_id": "m1", "intervention_cursor": 3}),
        ("execution_groups.forks.get", {"fork_group_id": f"{p}-egf"}, {}, None),
        ("execution_groups.forks.promote", {"fork_group_id": f"{p}-egf", "member_id": "m1"}, {}, None),
        ("experiments.create", {}, {}, {"name": f"{p}-exp", "baseline_channel_id": c}),
        ("experiments.list", {}, {}, None),
        ("experiments.get", lambda: {"group_id": later["experiment"]}, {}, None),
        ("experiments.members.add", lambda: {"group_id": later["experiment"]}, {}, {"channel_id": f, "role": "variant"}),
        ("experiments.rank", lambda: {"group_id": later["experiment"]}, {}, None),
        ("scheduler.wakeups.create", {}, {}, {"channel_id": c, "run_at": soon, "payload": {"w": 1}}),
        ("scheduler.wakeups.list", {}, {"channel_id": c}, None),
        ("scheduler.wakeups.get", lambda: {"id": later["wakeup"]}, {}, None),
        ("scheduler.wakeups.cancel", lambda: {"id": later["wakeup"]}, {}, None),
        ("executions.claim", {}, {}, {"channel_id": c, "key_name": "k-new", "tool_name": "tool", "params": {"b": 2}}),
        ("executions.list", {}, {"channel_id": c}, None),
        ("executions.get", {"id": ctx["x_get"]}, {}, None),
        ("executions.complete", {"id": ctx["x_complete"]}, {}, {"claim_token": ctx["t_complete"], "result": {"r": 1}}),
        ("executions.fail", {"id": ctx["x_fail"]}, {}, {"claim_token": ctx["t_fail"], "message": "no"}),
        ("executions.heartbeat", {"id": ctx["x_heartbeat"]}, {}, {"claim_token": ctx["t_heartbeat"]}),
        ("executions.cancel", {"id": ctx["x_cancel"]}, {}, {"claim_token": ctx["t_cancel"]}),
        ("executions.delete", {"id": ctx["x_delete"]}, {}, None),
        ("groups.delete", {"group_id": f"{p}-grp2"}, {}, None),
        ("state.version.delete", {"channel_id": c, "version": 1}, {}, None),
        ("channels.close", {"channel_id": f"{p}-f2"}, {}, None),
        ("channels.delete", {"channel_id": f"{p}-f2"}, {"recursive": True}, None),
    ]


def remember(op: str, answer: dict, later: dict) -> None:
    """Ids an operation makes that later ones need."""
    if op == "execution_groups.members.claim":
        later["generation"] = answer["generation"]
    elif op == "execution_groups.messages.send":
        later["message_id"] = answer["message_id"]
    elif op == "experiments.create":
        later["experiment"] = answer["id"]
    elif op == "scheduler.wakeups.create":
        later["wakeup"] = answer["id"]


def normal(value, names: dict):
    """An answer with the twin's names swapped for one name and what a write makes unique put aside."""
    if isinstance(value, dict):
        return {k: ("<v>" if k in UNSTABLE_KEYS else normal(v, names)) for k, v in sorted(value.items())}
    if isinstance(value, list):
        items = [normal(v, names) for v in value]
        return sorted(items, key=repr) if all(isinstance(i, str) for i in items) else items
    if isinstance(value, str):
        for old, new in names.items():
            value = value.replace(old, new)
        return "<x>" if VOLATILE.match(value) else value
    return value


def shape(value):
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    return "list" if isinstance(value, list) else type(value).__name__


@pytest.mark.parametrize("which", ["local", "remote"])
def test_every_fleet_operation_answers_what_its_direct_route_answers(fleet, which):
    from actae_client.manifest import MANIFEST_BY_ID, MANIFEST_OPERATIONS

    srv, instance = target(fleet, which)
    run_id = "mf" + uuid.uuid4().hex[:8]
    ctx = {v: setup_twin(srv, f"{run_id}{v}") for v in ("g", "d")}
    later = {"g": {}, "d": {}}
    plans = {v: operations(ctx[v], later[v]) for v in ("g", "d")}
    names = {f"{run_id}g": "<p>", f"{run_id}d": "<p>"}
    if which == "local":               # who acted: the organisation token through the gateway, the key directly
        names.update({"org-token:1": "<actor>", "key:1": "<actor>"})
    covered, problems = set(), []

    async def body():
        async with fleet.client() as gateway:
            for (op, g_params, query, g_body), (_, d_params, _, d_body) in zip(plans["g"], plans["d"]):
                manifest = MANIFEST_BY_ID["actae.api.v1." + op]
                resolve = lambda x: x() if callable(x) else x  # noqa: E731
                g_params, d_params, g_body, d_body = map(resolve, (g_params, d_params, g_body, d_body))
                via_gateway = await gateway.call_operation(manifest.id, instance_id=instance,
                                                           path_params=g_params, query=query, body=g_body)
                path = manifest.path
                for name, value in d_params.items():
                    path = path.replace("{" + name + "}", quote(str(value), safe=""))
                status, own = direct(srv, manifest.method, path, d_body, query)
                if status != 200:
                    problems.append(f"{op}: the direct route answered {status} {own}")
                    continue
                remember(op, via_gateway, later["g"])
                remember(op, own, later["d"])
                covered.add(manifest.id)
                # who the caller is: on a remote too, its capabilities are the token's (intersected with
                # the remote key's), not those of the key the gateway holds for that remote
                if manifest.id in IDENTITY_OPS and (which == "local" or op == "auth.capabilities.get"):
                    if shape(via_gateway) != shape(own):
                        problems.append(f"{op}: {shape(via_gateway)} != {shape(own)}")
                elif normal(via_gateway, names) != normal(own, names):
                    problems.append(f"{op}:\n  gateway {normal(via_gateway, names)}\n  direct  {normal(own, names)}")
                if manifest.action == "read" and manifest.id not in IDENTITY_OPS and "wakeups.get" not in op:
                    status, again = direct(srv, manifest.method, path.replace(f"{run_id}d", f"{run_id}g"),
                                           None, {k: str(v).replace(f"{run_id}d", f"{run_id}g")
                                                  for k, v in query.items()} if query else None)
                    if ("{" not in manifest.path and not query and manifest.id != "actae.api.v1.events.query"
                            and normal(via_gateway, {}) != normal(again, {}) and "list" not in op):
                        problems.append(f"{op}: a read of the same resource differs")
    run(body())
    assert not problems, "\n".join(problems)
    wanted = {op.id for op in MANIFEST_OPERATIONS if op.fleet_supported}
    assert covered == wanted, sorted(wanted - covered)


@pytest.mark.parametrize("which", ["local", "remote"])
def test_every_other_manifest_operation_is_refused(fleet, which):
    from actae_client.errors import APIError
    from actae_client.fleet import UnsupportedOperationError
    from actae_client.manifest import MANIFEST_OPERATIONS

    _, instance = target(fleet, which)
    others = [op for op in MANIFEST_OPERATIONS if not op.fleet_supported]
    assert len(others) == 5

    async def body():
        async with fleet.client() as gateway:
            for op in others:
                with pytest.raises(UnsupportedOperationError):          # the SDK refuses before sending
                    await gateway.call_operation(op.id, instance_id=instance, body={})
                with pytest.raises(APIError) as refused:                 # and so does the gateway, sent anyway
                    await gateway._request("POST", f"/v1/organizations/{ORG}/instances/{instance}/ops/{op.id}",
                                           body={"path_params": {}, "query": {}, "body": {}})
                assert refused.value.status_code == 426, (op.id, refused.value)
                with pytest.raises(APIError) as direct_call:             # FleetClient.call on its path
                    await gateway.call(op.method, op.path, instance_id=instance, body={})
                assert direct_call.value.status_code == 426, (op.id, direct_call.value)
            with pytest.raises(APIError) as unknown:
                await gateway._request("POST", f"/v1/organizations/{ORG}/instances/{instance}/ops/"
                                       "actae.api.v1.nope", body={"body": {}})
            assert unknown.value.status_code == 404
    run(body())


def test_the_servers_manifest_is_the_sdks():
    sys.path.insert(0, str(ROOT))
    import actae
    from actae_client.manifest import MANIFEST_OPERATIONS

    ours = {op.id: (op.method, op.path, op.scope, op.fleet_supported) for op in actae.FLEET_MANIFEST.values()}
    assert ours == {op.id: (op.method, op.path, op.scope, op.fleet_supported) for op in MANIFEST_OPERATIONS}
    assert set(actae.fleet_operation_routes()) == {op.id for op in MANIFEST_OPERATIONS if op.fleet_supported}
