"""Every door, one scope rule: a key that may read, write and delete exactly `mine-<uid>` learns nothing of
the runs around it, whichever route it calls.

One real server, built with the admin key:

- `zz-parent-<uid>`: out of scope, a few step events, a display name and reason, state snapshots; every
  payload and state recorded AFTER the fork boundary carries a SECRET marker;
- `mine-<uid>` (the one run the key may touch): forked from zz-parent at an early cursor, so its parent
  is unreadable; its own steps, states, a step that depends on an event of `zz-dep-<uid>`, an
  approval.requested event, an execution claim, a consumer group, a wake-up; an experiment and an
  execution group (with a message and a group fork) that name it;
- `zz-child-<uid>` (a fork of mine, display name and reason carrying the marker), `zz-sib-<uid>` (another
  fork of zz-parent: mine's sibling), `zz-dep-<uid>` (a marker payload; only a dependency target);
- an API key with read+write+delete on exactly `mine-<uid>`, an organisation token with the same patterns
  (and its fleet token), a dashboard session of the key.

Then every route of the server's own table is called as that key would call it. The table is READ in process
(`actae.app_endpoints()`: the API routes of `api_routes()` = API_ROUTES + every region's ROUTE_LISTS, the
pages of `page_routes()`, /login, the WebSockets and streams of ENDPOINT_LISTS); the server is never served
in process. Each request is built from the route's method, path template and declared records: path
parameters from the values that belong to `mine` (FILL), a minimal valid body from the body record (channel
fields name `mine`), query variants from the query record. The gateway's `ops/{operation_id}` route is
expanded into one call per fleet-supported manifest operation. A route whose path parameter or body field
cannot be filled, or whose kind is unknown, fails the test by name unless it is in ALLOWED (with a reason).

Every answer (whatever its status), every WebSocket frame and every NDJSON line must contain none of the
forbidden strings: the marker, the names of zz-child / zz-sib / zz-dep and of the group fork's runs, the
parent's display name and reason, the ids of the parent's events after the boundary, and the parent's
post-boundary state. zz-parent's bare id is allowed (a fork's own record may name it). All offending routes
are collected and reported at once: route, status, and an excerpt around what leaked.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone
from urllib.parse import parse_qs, urlencode

import msgspec
import pytest

from conftest import ROOT, SESSION_COOKIE, ServerProcess, dashboard_cookie, http, import_example, org_token

sys.path.insert(0, str(ROOT))
import actae  # noqa: E402  - read for its route table only; never served in process

UID = uuid.uuid4().hex[:8]
MINE = f"mine-{UID}"
PARENT = f"zz-parent-{UID}"
CHILD = f"zz-child-{UID}"
SIBLING = f"zz-sib-{UID}"
DEP = f"zz-dep-{UID}"
MARKER = f"SECRET-{uuid.uuid4().hex[:12]}"
PARENT_NAME = f"parentname{UID}"
PARENT_REASON = f"parentreason{UID}"
ORG = "local"
BOUNDARY = 2              # mine = zz-parent's history up to this cursor
STREAM_SECONDS = 4.0      # how long a stream is read, at most, for its sentinel

# Routes (or endpoints) this test does not call, each with why. Keep it small: a new route belongs in FILL.
ALLOWED = {
    ("POST", "/login"): "the login form itself: conftest's login() posts the scoped key there to open the session",
}


# --- helpers ---------------------------------------------------------------------------------------------

def admin(srv, method, path, body=None, **kw):
    status, _, answer = http(method, srv.url + path, key=srv.key, body=body, **kw)
    assert 200 <= status < 300, (method, path, status, answer)
    return answer


def record(srv, channel, event_type="agent.step", payload=None, **extra):
    body = {"channel_id": channel, "event_type": event_type, "payload": payload if payload is not None else {}, **extra}
    return admin(srv, "POST", "/api/v1/events/record", body)["event"]


def iso_in(days: int) -> str:
    return (datetime.now(timezone.utc) + timedelta(days=days)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def all_strings(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield str(k)
            yield from all_strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from all_strings(v)
    elif value is not None:
        yield str(value)


class World:
    """What the fixture built: the values that fill a route's path, and what must never show."""

    def __init__(self, srv):
        self.srv = srv
        self.fill: dict = {}            # path parameter -> value belonging to mine
        self.fill_under: dict = {}      # (path prefix, parameter) -> value, where one name means several things
        self.forbidden: dict = {}       # string -> what it is
        self.key = self.key_id = self.org_token = self.fleet_token = self.cookie = None
        self.instance_id = None
        self.login_refused = None       # why the dashboard refused the scoped key's session, if it did
        self.mine_cursor = 0


def build(srv) -> World:
    w = World(srv)
    w.instance_id = admin(srv, "GET", "/api/v1/instance")["instance_id"]

    # zz-parent: steps 1..5; payloads after the boundary carry the marker; states before and after.
    parent_events = []
    for step in range(1, 6):
        payload = {"step": step, "note": MARKER if step > BOUNDARY else "shared prefix"}
        parent_events.append(record(srv, PARENT, payload=payload, step_number=step))
    admin(srv, "POST", f"/api/v1/state/{PARENT}", {"cursor": 1, "state": {"prefix": True}})
    admin(srv, "POST", f"/api/v1/state/{PARENT}", {"cursor": parent_events[-1]["cursor"],
                                                  "state": {"secret": MARKER, "parent_only": f"pstate{UID}"}})
    admin(srv, "PUT", f"/api/v1/channels/{PARENT}/metadata", {"display_name": PARENT_NAME, "reason": PARENT_REASON})
    for event in parent_events[BOUNDARY:]:
        w.forbidden[event["id"]] = "an id of a zz-parent event after the fork boundary"
    w.forbidden[f"pstate{UID}"] = "zz-parent's state after the boundary"
    w.forbidden[PARENT_NAME] = "zz-parent's display name"
    w.forbidden[PARENT_REASON] = "zz-parent's reason"

    # mine: forked at the boundary; then its own life.
    admin(srv, "POST", "/api/v1/channels/fork", {"source_channel_id": PARENT, "new_channel_id": MINE,
                                                 "at_cursor": BOUNDARY, "display_name": f"mine {UID}",
                                                 "reason": "the in-scope run"})
    # a sibling (another fork of zz-parent) and zz-dep, a run that is only a dependency target
    admin(srv, "POST", "/api/v1/channels/fork", {"source_channel_id": PARENT, "new_channel_id": SIBLING,
                                                 "at_cursor": BOUNDARY + 1, "display_name": f"sib {MARKER}",
                                                 "reason": f"sibling {MARKER}"})
    record(srv, SIBLING, payload={"note": MARKER})
    dep_event = record(srv, DEP, "tool.result", {"note": MARKER, "secret": MARKER}, step_number=1)
    admin(srv, "POST", f"/api/v1/state/{DEP}", {"cursor": dep_event["cursor"], "state": {"secret": MARKER}})

    step3 = record(srv, MINE, payload={"step": 3, "note": "mine's own"}, step_number=3)
    admin(srv, "POST", f"/api/v1/state/{MINE}", {"cursor": step3["cursor"], "state": {"mine": 3}})
    depending = record(srv, MINE, payload={"step": 4, "uses": "a result"}, step_number=4,
                       dependencies=[{"event_id": dep_event["id"]}])
    saved = admin(srv, "POST", f"/api/v1/state/{MINE}", {"cursor": depending["cursor"], "state": {"mine": 4}})
    request_id = f"rq-{UID}"
    record(srv, MINE, "approval.requested", {"request_id": request_id, "summary": "may I?"})

    # zz-child: a fork of mine, named with the marker, with its own marker event
    admin(srv, "POST", "/api/v1/channels/fork", {"source_channel_id": MINE, "new_channel_id": CHILD,
                                                 "at_cursor": step3["cursor"], "display_name": f"child {MARKER}",
                                                 "reason": f"why {MARKER}"})
    record(srv, CHILD, payload={"note": MARKER})
    # model calls through the gateway on the runs out of scope, the marker in what was asked and answered
    out_of_scope_calls = {run: llm_call(srv, run, f"tell me {MARKER}") for run in (PARENT, CHILD, SIBLING)}

    claim = admin(srv, "POST", "/api/v1/executions/claim", {"channel_id": MINE, "key_name": f"k-{UID}",
                                                             "tool_name": "send_email"})
    group_id = f"cg-{UID}"
    admin(srv, "POST", "/api/v1/groups", {"group_id": group_id, "channel_id": MINE})
    wakeup = admin(srv, "POST", "/api/v1/scheduler/wakeups", {"channel_id": MINE, "run_at": iso_in(30),
                                                               "payload": {"wake": "mine"}})
    experiment = admin(srv, "POST", "/api/v1/experiments", {"name": f"exp-{UID}", "baseline_channel_id": MINE})
    experiment_id = experiment.get("group_id") or experiment.get("id")
    admin(srv, "POST", f"/api/v1/experiments/{experiment_id}/members", {"channel_id": CHILD})
    egroup = f"eg-{UID}"
    admin(srv, "POST", "/api/v1/execution-groups", {"group_id": egroup})
    admin(srv, "POST", f"/api/v1/execution-groups/{egroup}/members", {"member_id": "m-mine", "channel_id": MINE})
    message = admin(srv, "POST", f"/api/v1/execution-groups/{egroup}/messages",
                    {"from_member_id": "m-mine", "to_member_id": "m-mine", "type": "probe", "payload": {}})
    fork_group = f"fg-{UID}"
    group_fork = admin(srv, "POST", "/api/v1/execution-group-forks",
                       {"fork_group_id": fork_group, "source_group_id": egroup, "intervention_member_id": "m-mine",
                        "intervention_cursor": step3["cursor"]})
    for value in all_strings(group_fork):           # the group fork's runs are forks of mine the key may not read
        if value.startswith(MINE) and value != MINE:
            w.forbidden[value] = "a run made by the execution-group fork (a fork of mine, out of scope)"

    w.mine_cursor = depending["cursor"] + 1
    w.fill = {
        "channel_id": MINE, "event_id": depending["id"], "execution_id": claim["execution"]["id"],
        "group_id": group_id, "wakeup_id": wakeup["id"], "id": claim["execution"]["id"],
        "version": saved.get("version", 1), "step_number": 3, "request_id": request_id,
        "member_id": "m-mine", "message_id": message.get("message_id") or message.get("id") or
        (message.get("message") or {}).get("id"), "fork_group_id": fork_group,
        "organization_id": ORG, "instance_id": w.instance_id,
        # the model-call gateway: an upstream name, a path under it, a call (of zz-child: asked as mine's, 404)
        "upstream": "openai", "rest": "models", "call_id": out_of_scope_calls[CHILD],
    }
    w.fill_under = {
        ("/api/v1/experiments/", "group_id"): experiment_id, ("/experiments/", "group_id"): experiment_id,
        ("/api/v1/execution-groups/", "group_id"): egroup,
        ("/api/v1/scheduler/wakeups/", "id"): wakeup["id"],
    }
    for name, what in ((MARKER, "the SECRET marker"), (CHILD, "zz-child's id (a fork of mine, out of scope)"),
                       (SIBLING, "zz-sib's id (mine's sibling)"), (DEP, "zz-dep's id (only a dependency target)")):
        w.forbidden[name] = what

    # the scoped credentials
    created = admin(srv, "POST", "/api/v1/keys", {"name": f"mine-only-{UID}",
                                                   "scopes": {"read": [MINE], "write": [MINE], "delete": [MINE]}})
    w.key = created["key"]
    w.key_id = created.get("id") or created.get("key_id") or (created.get("info") or {}).get("id")
    w.fill["key_id"] = w.key_id
    w.org_token = org_token(srv, "--read", MINE, "--write", MINE, "--delete", MINE, name=f"o-{UID}")[1]
    status, _, answer = http("POST", srv.url + "/api/v1/fleet/token", headers={"authorization": f"Bearer {w.org_token}"},
                             body={"purpose": "fleet_access", "organization_id": ORG})
    assert status == 200, answer
    w.fleet_token = answer["token"]
    # The dashboard refuses a key that may not read every run (403 at /login, today); then the pages are still
    # requested, with no session, and their answers (a redirect, a 401) checked like any other.
    try:
        w.cookie = dashboard_cookie(srv, w.key).split("=", 1)[1]
    except AssertionError as refused:
        w.login_refused = str(refused)[:300]
        w.cookie = "no-session"
    return w


def llm_call(srv, run: str, text: str) -> str:
    """A model call of `run` through the gateway, with the admin key: its call id."""
    status, headers, answer = http("POST", f"{srv.url}/llm/runs/{run}/openai/v1/chat/completions",
                                   headers={"authorization": f"Bearer {srv.key}"},
                                   body={"model": "probe", "messages": [{"role": "user", "content": text}]})
    assert status == 200 and text in json.dumps(answer), (status, answer)
    return headers["x-actae-call-id"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    upstream, _ = import_example("tiny_model_server.py").serve()
    args = ["--llm-upstream", f"openai=http://127.0.0.1:{upstream.server_address[1]}"]
    try:
        with ServerProcess(tmp_path_factory.mktemp("reach"), args=args).start() as srv:
            yield build(srv)
    finally:
        upstream.shutdown()


# --- requests built from the route table ---------------------------------------------------------------

class Unfillable(Exception):
    pass


PARAM = re.compile(r"\{(\w+)(?::\w+)?\}")


def param_value(w: World, template: str, name: str):
    for (prefix, param), value in w.fill_under.items():
        if param == name and template.startswith(prefix):
            return value
    if w.fill.get(name) is None:
        raise Unfillable(f"path parameter {{{name}}}")
    return w.fill[name]


def fill_path(w: World, template: str) -> str:
    return PARAM.sub(lambda m: str(param_value(w, template, m.group(1))), template)


CHANNEL_FIELDS = {"channel_id", "source_channel_id", "baseline_channel_id", "left", "right"}
STRING_FIELDS = {   # required string fields whose value must mean something
    "run_at": lambda w: iso_in(30), "email": lambda w: f"probe-{UID}@example.com",
    "password": lambda w: "probe-password-123", "url": lambda w: "http://127.0.0.1:9",
    "instance_id": lambda w: w.instance_id, "new_channel_id": lambda w: f"{MINE}-new",
    "source_group_id": lambda w: w.fill_under[("/api/v1/execution-groups/", "group_id")],
    "intervention_member_id": lambda w: "m-mine", "from_member_id": lambda w: "m-mine",
    "to_member_id": lambda w: "m-mine", "token": lambda w: "probe-token", "key": lambda w: "sk-probe",
}


def value_for(w: World, name: str, info, depth=0):
    """A minimal valid value of msgspec type `info` for the field `name`."""
    if name in CHANNEL_FIELDS:
        return MINE
    if name == "channel_ids":
        return [MINE]
    if name in STRING_FIELDS:
        return STRING_FIELDS[name](w)
    if name == "instances":
        return [w.instance_id]
    if name in ("cursor", "at_cursor", "intervention_cursor"):
        return w.mine_cursor - 1
    mi = msgspec.inspect
    if isinstance(info, mi.Metadata):
        return value_for(w, name, info.type, depth)
    if isinstance(info, mi.UnionType):
        for t in info.types:
            if not isinstance(t, (mi.NoneType, mi.UnsetType)):
                return value_for(w, name, t, depth)
        return None
    if isinstance(info, mi.LiteralType):
        return info.values[0]
    if isinstance(info, mi.StrType):
        return "probe"
    if isinstance(info, (mi.IntType, mi.FloatType)):
        return max(1, int(getattr(info, "ge", None) or 1))
    if isinstance(info, mi.BoolType):
        return False
    if isinstance(info, (mi.ListType, mi.SetType, mi.VarTupleType)):
        return []
    if isinstance(info, (mi.DictType, mi.AnyType)):
        return {}
    if isinstance(info, mi.StructType):
        return struct_value(w, info, depth + 1)
    raise Unfillable(f"field {name!r} of type {type(info).__name__}")


def struct_value(w: World, info, depth=0) -> dict:
    if depth > 4:
        return {}
    out = {}
    for f in info.fields:
        if f.required or f.encode_name in CHANNEL_FIELDS | {"channel_ids"}:
            out[f.encode_name] = value_for(w, f.encode_name, f.type, depth)
    if info.cls.__name__ == "CreateKey":
        out["scopes"] = {"read": [MINE]}
    return out


def body_for(w: World, route) -> bytes | None:
    if route.text_body is not None:
        return w.import_file if route.text_body.name == "ExportFile" else b""
    if route.body is None:
        return None
    return json.dumps(struct_value(w, msgspec.inspect.type_info(route.body))).encode()


def query_variants(w: World, route) -> list[str]:
    """'' (required fields only), and all the channel-ish and boolean options set (export ?with_forks=true)."""
    if route.query is None:
        return [""]
    info = msgspec.inspect.type_info(route.query)
    required = {f.encode_name: value_for(w, f.encode_name, f.type) for f in info.fields if f.required}
    full = dict(required)
    for f in info.fields:
        inner = f.type.type if isinstance(f.type, msgspec.inspect.Metadata) else f.type
        kinds = inner.types if isinstance(inner, msgspec.inspect.UnionType) else (inner,)
        if f.encode_name in CHANNEL_FIELDS:
            full[f.encode_name] = MINE
        elif any(isinstance(k, msgspec.inspect.BoolType) for k in kinds):
            full[f.encode_name] = "true"
    variants = [urlencode(required, doseq=True)]
    if full != required:
        variants.append(urlencode(full, doseq=True))
    return variants


# --- what was seen -----------------------------------------------------------------------------------------

class Seen:
    def __init__(self, w: World):
        self.w, self.leaks, self.unfillable, self.calls, self.log = w, [], [], 0, []

    def check(self, route: str, status, text) -> None:
        self.calls += 1
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        if not isinstance(text, str):
            text = json.dumps(text)
        self.log.append((route, status, (text if os.environ.get("ACTAE_REACH_LOG") == "full" else text[:160]).replace("\n", " ")))
        for needle, what in self.w.forbidden.items():
            at = text.find(needle)
            if at >= 0:
                excerpt = text[max(0, at - 120): at + len(needle) + 60].replace("\n", " ")
                self.leaks.append(f"{route} -> {status}: {what} ({needle!r}) in ...{excerpt}...")

    def report(self) -> str:
        return "\n".join(self.leaks)


def call(seen: Seen, label: str, method: str, url: str, *, headers=None, raw=None):
    status, hdrs, content = http(method, url, raw=raw, headers=headers, redirects=False, decode=False, timeout=30)
    seen.check(label, status, content)
    return status, hdrs, content


def api_headers(w: World, route) -> dict:
    if route.auth == "fleet":
        return {"authorization": f"Bearer {w.fleet_token}"}
    if route.auth == "org":
        return {"authorization": f"Bearer {w.org_token}"}
    if route.auth == "bearer":
        return {"authorization": f"Bearer {w.key}", "x-api-key": w.key}
    return {"x-api-key": w.key}


def phase(method: str, path: str) -> int:
    """Reads first, then writes, then what ends things (close, cancel, revoke, log out, delete), the run last."""
    if method == "GET" or method == "WS":
        return 0
    if path.endswith(("/logout",)) or path in ("/api/v1/channels/{channel_id}", "/runs/{channel_id}/delete"):
        return 3
    if method == "DELETE" or path.endswith(("/close", "/cancel", "/revoke", "/delete", "/promote")):
        return 2
    return 1


def run_api_route(w: World, seen: Seen, route) -> None:
    path = fill_path(w, route.path)
    raw = body_for(w, route)
    for query in query_variants(w, route):
        url = w.srv.url + path + (f"?{query}" if query else "")
        headers = api_headers(w, route)
        if raw is not None:
            headers["content-type"] = "application/json"
        call(seen, f"{route.method} {route.path}{'?' + query if query else ''}", route.method, url,
             headers=headers, raw=raw if raw is not None else (b"" if route.method in ("POST", "PUT", "PATCH") else None))


def fleet_operations(w: World, route):
    """The gateway's ops route expanded: one (operation id, its direct route) per fleet-supported manifest
    operation, called on this server's own instance."""
    return sorted(actae.fleet_operation_routes().items())


def run_fleet_operation(w: World, seen: Seen, route, op_id: str, target) -> None:
    names = PARAM.findall(actae.FLEET_MANIFEST[op_id].path)          # the manifest's names ({id} for execution_id)
    values = [param_value(w, target.path, name) for name in PARAM.findall(target.path)]
    params = dict(zip(names, values))
    raw = body_for(w, target)
    for query in query_variants(w, target):
        envelope = {"path_params": params}
        if query:
            envelope["query"] = {k: v[0] for k, v in parse_qs(query).items()}
        if raw:
            envelope["body"] = json.loads(raw)
        url = w.srv.url + fill_path(w, route.path.replace("{operation_id}", op_id))
        call(seen, f"POST {route.path} [{op_id}{' ?' + query if query else ''}]", "POST", url,
             headers={"authorization": f"Bearer {w.fleet_token}", "content-type": "application/json"},
             raw=json.dumps(envelope).encode())


PAGE_FORM = {"step": "1", "name": "probe", "decision": "approved", "run": MINE, "channel_id": MINE,
             "intervention": "", "tool_policies": "", "confirm": MINE}


def run_page(w: World, seen: Seen, method: str, template: str, csrf: str) -> None:
    path = fill_path(w, template)
    cookie = {"Cookie": f"{SESSION_COOKIE}={w.cookie}"}
    if method == "GET":
        for suffix in ("", "?format=json"):
            call(seen, f"page GET {template}{suffix}", "GET", w.srv.url + path + suffix, headers=cookie)
        return
    form = urlencode({**PAGE_FORM, "csrf_token": csrf}).encode()
    status, hdrs, _ = call(seen, f"page {method} {template}", method, w.srv.url + path, raw=form,
                           headers={**cookie, "Origin": w.srv.url, "content-type": "application/x-www-form-urlencoded"})
    location = hdrs.get("location") if 300 <= status < 400 else None
    if location and not location.startswith("/login") and template != "/logout":
        target = location if location.startswith("http") else w.srv.url + location
        call(seen, f"page {method} {template} -> GET {location[:80]}", "GET", target, headers=cookie)


def run_llm_call(w: World, seen: Seen, method: str, template: str) -> None:
    """The model-call gateway, with the key where a provider client sends its own (both ways), on mine and on
    the runs around it: every answer is checked like any other."""
    body = json.dumps({"model": "probe", "messages": [{"role": "user", "content": "hello"}]}).encode()
    for run in (MINE, PARENT, CHILD, SIBLING):
        path = fill_path(w, template).replace(f"/llm/runs/{MINE}/", f"/llm/runs/{run}/", 1)
        for headers in ({"authorization": f"Bearer {w.key}"}, {"x-api-key": w.key}):
            status, _, content = http(method, w.srv.url + path, raw=body if method == "POST" else None,
                                      headers={**headers, "content-type": "application/json"}, redirects=False,
                                      decode=False, timeout=30)
            # The id the request itself named may come back ("run ... not found"); nothing else may.
            seen.check(f"llm {method} {template} ({run[:6]})", status, content.replace(run.encode(), b"<the run asked>"))


def mcp_messages(w: World) -> list:
    """JSON-RPC messages an MCP client sends: every tool that names a run, with mine and each run around it,
    the tools that list across runs, and the run resource (the SDK's stateless mode takes them one by one)."""
    messages = [{"method": "tools/list", "params": {}}, {"method": "prompts/list", "params": {}},
                {"method": "tools/call", "params": {"name": "find_runs", "arguments": {}}},
                {"method": "tools/call", "params": {"name": "find_runs", "arguments": {"text": "zz"}}},
                {"method": "tools/call", "params": {"name": "list_approvals", "arguments": {}}},
                {"method": "tools/call", "params": {"name": "bulk_fork", "arguments": {"dry_run": True}}}]
    for run in (MINE, PARENT, CHILD, SIBLING, DEP):
        for tool, arguments in (("read_run", {"channel_id": run}), ("read_step", {"channel_id": run, "step": 3}),
                                ("read_step", {"channel_id": run, "step": 5}), ("fork_tree", {"channel_id": run}),
                                ("verify_run", {"channel_id": run}), ("plan_fork", {"channel_id": run}),
                                ("diff_runs", {"left": MINE, "right": run}),
                                ("list_approvals", {"channel_id": run})):
            messages.append({"method": "tools/call", "params": {"name": tool, "arguments": arguments}})
        messages.append({"method": "resources/read", "params": {"uri": f"actae://runs/{run}"}})
    return [{"jsonrpc": "2.0", "id": n, **message} for n, message in enumerate(messages, 1)]


def run_mcp(w: World, seen: Seen, method: str, template: str) -> None:
    """The MCP endpoint with the scoped key (as an MCP client sends it, and as x-api-key): every answer checked."""
    for headers in ({"authorization": f"Bearer {w.key}"}, {"x-api-key": w.key}):
        headers = {**headers, "accept": "application/json, text/event-stream", "content-type": "application/json"}
        if method != "POST":
            status, _, content = http(method, w.srv.url + template, headers=headers, decode=False, timeout=30)
            seen.check(f"mcp {method} {template}", status, content)
            continue
        for message in mcp_messages(w):
            status, _, content = http("POST", w.srv.url + template, raw=json.dumps(message).encode(), headers=headers,
                                      decode=False, timeout=30)
            label = f"mcp {message['method']} {json.dumps(message['params'].get('arguments') or message['params'])[:80]}"
            asked = json.dumps(message["params"]).encode()
            # The ids the message itself named may come back ("channel ... not found"); nothing else may.
            for run in (PARENT, CHILD, SIBLING, DEP):
                if run.encode() in asked:
                    content = content.replace(run.encode(), b"<the run asked>")
            seen.check(label, status, content)


def otlp_request(run: str) -> bytes:
    """An OTLP protobuf export of one span (a model call carrying the marker) named to `run`."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.append(KeyValue(key="actae.channel_id", value=AnyValue(string_value=run)))
    span = resource_spans.scope_spans.add().spans.add(trace_id=uuid.uuid4().bytes, span_id=uuid.uuid4().bytes[:8],
                                                      name="chat probe", start_time_unix_nano=1, end_time_unix_nano=2)
    span.attributes.append(KeyValue(key="gen_ai.operation.name", value=AnyValue(string_value="chat")))
    span.attributes.append(KeyValue(key="gen_ai.input.messages", value=AnyValue(string_value=f"[\"{MARKER}\"]")))
    return request.SerializeToString()


def run_otlp(w: World, seen: Seen, method: str, template: str) -> None:
    """OTLP ingest with the scoped key: spans named to mine and to each run around it. Each answer is
    checked, and the runs around it must have taken none of them."""
    for run in (MINE, PARENT, CHILD, SIBLING):
        for headers in ({"authorization": f"Bearer {w.key}"}, {"x-api-key": w.key}):
            status, _, content = http(method, w.srv.url + template, raw=otlp_request(run), decode=False, timeout=30,
                                      headers={**headers, "content-type": "application/x-protobuf"})
            seen.check(f"otlp {method} {template} ({run[:6]})", status, content.replace(run.encode(), b"<the run asked>"))
    for run in (PARENT, CHILD, SIBLING):
        events = admin(w.srv, "GET", f"/api/v1/events/replay/{run}?limit=1000")["events"]
        spans = [e["type"] for e in events if e["type"].startswith("span.")]
        if spans:
            seen.leaks.append(f"otlp {method} {template}: the scoped key's {len(spans)} span(s) were written into {run}")


# --- the streams ---------------------------------------------------------------------------------------------

async def read_until(receive, sentinel: str, seconds: float) -> list[str]:
    frames, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            frame = await asyncio.wait_for(receive(), deadline - time.monotonic())
        except (asyncio.TimeoutError, StopAsyncIteration):
            break
        if frame is None:
            break
        frames.append(frame)
        if sentinel in frame:
            break
    return frames


def live_events(w: World) -> str:
    """Out-of-scope events recorded while a stream is open, then mine's sentinel: its event id."""
    for channel in (PARENT, CHILD, DEP, SIBLING):
        record(w.srv, channel, "live", {"note": MARKER})
    return record(w.srv, MINE, "live", {"note": f"sentinel {uuid.uuid4().hex}"})["id"]


async def ws_session(w: World, seen: Seen) -> None:
    import aiohttp
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(w.srv.url.replace("http", "ws", 1) + "/ws") as ws:
            async def receive():
                msg = await ws.receive()
                return msg.data if msg.type == aiohttp.WSMsgType.TEXT else None
            await ws.send_str(json.dumps({"type": "auth", "api_key": w.key}))
            for topic in ("*", MINE, PARENT):
                await ws.send_str(json.dumps({"type": "subscribe", "topic": topic, "cursor": 0}))
            await ws.send_str(json.dumps({"type": "broadcast", "topic": MINE, "payload": {"hello": 1}}))
            first = await read_until(receive, "\u0000never", 1.0)          # catch-up
            sentinel = await asyncio.to_thread(live_events, w)
            frames = first + await read_until(receive, sentinel, STREAM_SECONDS)
    for frame in frames:
        seen.check("WS /ws (subscribed to *, mine, zz-parent)", "frame", frame)
    assert any(sentinel in f for f in frames), f"/ws never delivered mine's live event: {frames[-5:]}"


async def fleet_ws_session(w: World, seen: Seen, template: str) -> None:
    import aiohttp
    for channel in (None, MINE):
        body = {"instance_id": w.instance_id, "resume_cursor": 0, **({"channel_id": channel} if channel else {})}
        status, _, ticket = call(seen, f"POST /v1/organizations/{{organization_id}}/events/stream/tickets ({channel})",
                                 "POST", w.srv.url + f"/v1/organizations/{ORG}/events/stream/tickets",
                                 headers={"authorization": f"Bearer {w.fleet_token}", "content-type": "application/json"},
                                 raw=json.dumps(body).encode())
        assert status == 200, ticket
        ticket = json.loads(ticket)["ticket"]
        url = w.srv.url.replace("http", "ws", 1) + fill_path(w, template) + "?" + urlencode({"ticket": ticket})
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(url) as ws:
                async def receive():
                    msg = await ws.receive()
                    return msg.data if msg.type == aiohttp.WSMsgType.TEXT else None
                first = await read_until(receive, "\u0000never", 1.0)
                sentinel = await asyncio.to_thread(live_events, w)
                frames = first + await read_until(receive, sentinel, STREAM_SECONDS)
        for frame in frames:
            seen.check(f"WS {template} (channel {channel or 'every'})", "frame", frame)
        assert any(sentinel in f for f in frames), f"{template} never delivered mine's live event"


def ndjson_session(w: World, seen: Seen, template: str) -> None:
    import httpx
    for channel in (None, MINE):
        params = {"cursor": 0, **({"channel_id": channel} if channel else {})}
        lines, sentinel = [], None
        with httpx.Client(timeout=httpx.Timeout(STREAM_SECONDS, read=STREAM_SECONDS)) as client:
            with client.stream("GET", w.srv.url + template, params=params,
                               headers={"authorization": f"Bearer {w.fleet_token}"}) as r:
                seen.check(f"GET {template} ({channel or 'every'}) head", r.status_code, "")
                if r.status_code != 200:
                    seen.check(f"GET {template} ({channel or 'every'})", r.status_code, r.read())
                    pytest.fail(f"{template}: {r.status_code}")
                deadline = time.monotonic() + STREAM_SECONDS
                started = False
                try:
                    for line in r.iter_lines():
                        lines.append(line)
                        if not started:
                            started, sentinel = True, live_events(w)
                        if sentinel and sentinel in line or time.monotonic() > deadline:
                            break
                except httpx.ReadTimeout:
                    pass
        for line in lines:
            seen.check(f"GET {template} ({channel or 'every'})", "line", line)
        assert sentinel and any(sentinel in line for line in lines), f"{template} never delivered mine's live event"


# --- the test ------------------------------------------------------------------------------------------------

def prepare_import(w: World) -> None:
    """POST /api/v1/import's body: mine's own export, its event ids swapped for zz-dep's and the parent's (a
    collision with another run must not name it), payloads emptied so nothing forbidden is sent."""
    _, _, text = http("GET", w.srv.url + f"/api/v1/channels/{MINE}/export", key=w.srv.key, decode=False)
    lines = text.decode().splitlines()
    foreign = [i for i, what in w.forbidden.items() if "event" in what]
    dep_ids = [e["id"] for e in http("GET", w.srv.url + f"/api/v1/events/replay/{DEP}", key=w.srv.key)[2]["events"]]
    swap = iter(dep_ids + foreign)
    out = []
    for line in lines:
        item = json.loads(line)
        if isinstance(item, dict) and isinstance(item.get("id"), str) and "payload" in item:
            item["payload"] = "{}" if isinstance(item["payload"], str) else {}   # stored as its JSON text
            item["id"] = next(swap, item["id"])
        out.append(json.dumps(item))
    w.import_file = ("\n".join(out) + "\n").encode()


def endpoints_in_order(w: World):
    api = {(r.method, r.path): r for r in actae.api_routes()}
    pages = {(m, p) for m, p, _ in actae.page_routes()}
    plan, unknown = [], []
    for e in actae.app_endpoints():
        key = (e.method, e.path)
        if key in ALLOWED:
            continue
        if key in api and api[key].path.endswith("/ops/{operation_id}"):
            for op_id, target in fleet_operations(w, api[key]):
                plan.append((phase(target.method, target.path), len(plan), "fleet-op", e.method, e.path,
                             (api[key], op_id, target)))
            continue
        if key in api:
            kind = "api"
        elif key in pages or (e.method, e.path) == ("GET", "/login") or e.path == "/favicon.ico":
            kind = "page"
        elif e.method == "WS" and e.path == "/ws":
            kind = "ws"
        elif e.method == "WS" and e.path.startswith("/v1/organizations/"):
            kind = "fleet-ws"
        elif e.method == "GET" and e.path == "/api/v1/fleet/stream":
            kind = "ndjson"
        elif e.path.startswith("/llm/runs/"):
            kind = "llm"
        elif e.path == "/mcp":
            kind = "mcp"
        elif e.path == "/v1/traces":
            kind = "otlp"
        else:
            unknown.append(f"{e.method} {e.path} ({getattr(e.handle, '__name__', e.handle)})")
            continue
        plan.append((phase(e.method, e.path), len(plan), kind, e.method, e.path, api.get(key)))
    plan.sort(key=lambda p: (p[0], p[1]))
    return plan, unknown


def test_the_detector_sees_what_an_unfiltered_door_shows(world):
    """The control, run first: the same doors asked with the admin key (a door that filters nothing) show every
    kind of forbidden string, so the scoped run below passes only because the server hides them."""
    w = world
    seen = Seen(w)
    for path in (f"/api/v1/events/replay/{PARENT}", f"/api/v1/state/{PARENT}", f"/api/v1/channels/{PARENT}/metadata",
                 f"/api/v1/channels/{MINE}/fork-tree", f"/api/v1/channels/{PARENT}/fork-tree",
                 f"/api/v1/events/{w.fill['event_id']}/causal-graph"):
        call(seen, f"admin GET {path}", "GET", w.srv.url + path, headers={"x-api-key": w.srv.key})
    found = {what for what in w.forbidden.values() if any(f"{what} (" in leak for leak in seen.leaks)}
    assert found == set(w.forbidden.values()), f"never shown even to the admin key: {set(w.forbidden.values()) - found}"


def test_a_key_scoped_to_one_run_learns_nothing_of_the_runs_around_it_through_any_route(world):
    w = world
    started = time.monotonic()
    seen = Seen(w)
    prepare_import(w)
    plan, unknown = endpoints_in_order(w)
    assert len(plan) > 100, f"the route table looks too small to be the whole server: {len(plan)}"
    csrf = re.search(r'name="csrf_token" value="([^"]+)"',
                     http("GET", w.srv.url + "/", headers={"Cookie": f"{SESSION_COOKIE}={w.cookie}"})[2])
    csrf = csrf.group(1) if csrf else ""
    covered = []
    for _, _, kind, method, path, route in plan:
        try:
            if kind == "api":
                run_api_route(w, seen, route)
            elif kind == "fleet-op":
                run_fleet_operation(w, seen, *route)
            elif kind == "page":
                run_page(w, seen, method, path, csrf)
            elif kind == "ws":
                asyncio.run(ws_session(w, seen))
            elif kind == "fleet-ws":
                asyncio.run(fleet_ws_session(w, seen, path))
            elif kind == "ndjson":
                ndjson_session(w, seen, path)
            elif kind == "llm":
                run_llm_call(w, seen, method, path)
            elif kind == "mcp":
                run_mcp(w, seen, method, path)
            elif kind == "otlp":
                run_otlp(w, seen, method, path)
            covered.append((method, path))
        except Unfillable as exc:
            seen.unfillable.append(f"{method} {path}: cannot fill {exc}")
    problems = []
    if unknown:
        problems.append("endpoints of an unknown kind (add a way to call them, or to ALLOWED with a reason):\n  "
                        + "\n  ".join(unknown))
    if seen.unfillable:
        problems.append("routes this test cannot build a request for (add the value to World.fill / "
                        "STRING_FIELDS, or the route to ALLOWED with a reason):\n  " + "\n  ".join(seen.unfillable))
    if seen.leaks:
        problems.append(f"{len(seen.leaks)} answer(s) leak what the key may not read "
                        f"(marker {MARKER!r}):\n  " + "\n  ".join(seen.leaks))
    if w.login_refused:
        print(f"\nthe dashboard refused the scoped key (pages were checked without a session): {w.login_refused[:80]}")
    print(f"\n{seen.calls} answers checked over {len(covered)} routes in {time.monotonic() - started:.1f} s")
    if os.environ.get("ACTAE_REACH_LOG"):
        print("\n".join(f"{status} {route}: {excerpt}" for route, status, excerpt in seen.log))
    assert not problems, "\n\n".join(problems)
