"""Bad input over raw HTTP: every malformed request gets the JSON error body, nothing else.

Every rejection must be the right 4xx with `Content-Type: application/json` and the body
`{"status": <code>, "error": <message>}`, must write nothing, and must leave the server serving.
No response is ever 204.
"""
from __future__ import annotations

import json
import re
from urllib.parse import quote

import pytest

from conftest import api, http, latest_cursor, post_streaming

CODES = {400: "bad_request", 401: "unauthorized", 404: "not_found", 413: "payload_too_large"}
CHANNEL_RE = re.compile(r"[A-Za-z0-9._:-]{1,256}")
MiB = 1024 * 1024
BAD_IDS = {"slash": "a/b", "space": "a b", "newline": "abc\n", "257 chars": "a" * 257, "empty": ""}


def call(server, method, path, **kw):
    """`api(server, method, path, **kw)`, whose answer must not be a 204 (the SDK cannot read one)."""
    response = api(server, method, path, **kw)
    assert response[0] != 204, f"{method} {path} answered 204 (the SDK cannot read it)"
    return response


def assert_error(response, status, *, allowed=None):
    got, headers, body = response
    assert got in (allowed or {status}), f"expected {allowed or status}, got {got}: {body!r}"
    assert (headers.get("content-type") or "").startswith("application/json"), headers.get("content-type")
    assert isinstance(body, dict), body
    assert isinstance(body.get("error"), str) and body["error"].strip(), body
    assert isinstance(body.get("status"), str) and body["status"], body
    if got in CODES:
        assert body["status"] == CODES[got], body


def record_body(channel, **override):
    body = {"channel_id": channel, "event_type": "t", "payload": {"k": 1},
            "metadata": {"actor": "tester", "agent_id": None, "user_id": None, "metadata": None}}
    return {**body, **override}


@pytest.fixture(scope="module")
def existing(server):
    """A channel with one event and one state version."""
    channel = "bad-input-existing"
    assert call(server, "POST", "/api/v1/events/record", body=record_body(channel))[0] < 300
    state = {"channel_id": channel, "cursor": 1, "state": {}}
    assert call(server, "POST", f"/api/v1/state/{channel}", body=state)[0] < 300
    return channel


# --------------------------------------------------------------------------------------------
# Channel ids
# --------------------------------------------------------------------------------------------

PATH_ROUTES = [
    ("GET", "/api/v1/events/replay/{}?limit=10"),
    ("GET", "/api/v1/events/cursor/{}"),
    ("GET", "/api/v1/state/{}"),
    ("GET", "/api/v1/state/{}/versions?limit=10&offset=0"),
    ("GET", "/api/v1/state/{}/version/1"),
    ("POST", "/api/v1/state/{}"),
    ("GET", "/api/v1/channels/{}/metadata"),
    ("PUT", "/api/v1/channels/{}/metadata"),
    ("GET", "/api/v1/channels/{}/steps"),
    ("GET", "/api/v1/channels/{}/steps/1"),
]


@pytest.mark.parametrize("bad", BAD_IDS.values(), ids=BAD_IDS.keys())
@pytest.mark.parametrize("method, route", PATH_ROUTES, ids=[f"{m} {r}" for m, r in PATH_ROUTES])
def test_bad_channel_id_in_path_is_rejected(server, method, route, bad):
    body = None
    if method == "POST":
        body = {"channel_id": bad, "cursor": 0, "state": {}}
    elif method == "PUT":
        body = {"channel_id": bad, "display_name": "x"}
    response = call(server, method, route.format(quote(bad, safe="/")), body=body)
    # A slash or an empty id changes the path itself, so "no such route" is an honest answer.
    assert_error(response, 400, allowed={400, 404} if bad in ("a/b", "") else None)


BODY_ROUTES = {
    "record": ("/api/v1/events/record", lambda bad: record_body(bad)),
    "transition": ("/api/v1/events/transition",
                   lambda bad: {"channel_id": bad, "type": "t", "payload": {}, "state": {},
                                "metadata": {"actor": "t"}}),
    "query": ("/api/v1/events/query", lambda bad: {"limit": 10, "channel_ids": [bad]}),
}


@pytest.mark.parametrize("bad", BAD_IDS.values(), ids=BAD_IDS.keys())
@pytest.mark.parametrize("route", BODY_ROUTES)
def test_bad_channel_id_in_body_is_rejected(server, route, bad):
    path, make = BODY_ROUTES[route]
    assert_error(call(server, "POST", path, body=make(bad)), 400)


@pytest.mark.parametrize("channel", ["a" * 256, "A.b_c:d-9"])
def test_channel_ids_at_the_edge_of_the_grammar_are_accepted(server, channel):
    status, _, body = call(server, "POST", "/api/v1/events/record", body=record_body(channel))
    assert status < 300, body
    assert body["event"]["channel_id"] == channel
    assert latest_cursor(server, channel) == body["event"]["cursor"]


# --------------------------------------------------------------------------------------------
# Malformed bodies, wrong types, bad query parameters
# --------------------------------------------------------------------------------------------

def json_routes(channel):
    return [("POST", "/api/v1/events/record"), ("POST", "/api/v1/events/transition"),
            ("POST", f"/api/v1/state/{channel}"), ("PUT", f"/api/v1/channels/{channel}/metadata"),
            ("POST", "/api/v1/events/query")]


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2", "{\"a\": \"\xff\"}".encode("latin-1")],
                         ids=["garbage", "empty", "truncated", "not utf-8"])
@pytest.mark.parametrize("route", range(5), ids=["record", "transition", "state", "metadata", "query"])
def test_invalid_json_body_is_rejected(server, existing, route, raw):
    method, path = json_routes(existing)[route]
    assert_error(call(server, method, path, raw=raw, headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize("where", ["record payload", "state"])
def test_nan_and_infinity_are_rejected_and_nothing_is_written(server, unique, where, token):
    channel = unique(f"{where.split()[0]}-{token.strip('-').lower().replace('999', '')}")
    if where == "state":
        path, text = f"/api/v1/state/{channel}", json.dumps({"channel_id": channel, "cursor": 0, "state": {"v": 0}})
    else:
        path, text = "/api/v1/events/record", json.dumps(record_body(channel, payload={"v": 0}))
    raw = text.replace('{"v": 0}', '{"v": %s}' % token).encode()
    assert token.encode() in raw
    assert_error(call(server, "POST", path, raw=raw), 400)
    assert latest_cursor(server, channel) is None
    status, _, body = call(server, "GET", f"/api/v1/state/{channel}")
    assert status == 200 and body.get("cursor") is None


WRONG_TYPES = [
    ("record", {"step_number": "x"}),
    ("record", {"step_number": 0}),
    ("record", {"step_number": -1}),
    ("record", {"step_number": True}),
    ("record", {"step_number": 1.5}),
    ("record", {"event_type": 5}),
    ("record", {"event_type": None}),
    ("record", {"channel_id": 5}),
    ("record", {"metadata": "actor"}),
    ("record", {"operation_id": 7}),
    ("record", {"dependencies": "x"}),
    ("record", {"dependencies": [{"event_id": 5, "dependency_type": "causal"}]}),
    ("state", {"cursor": "x"}),
    ("state", {"cursor": -1}),
    ("state", {"cursor": None}),
    ("state", {"expected_version": "1"}),
    ("transition", {"type": 5}),
    ("transition", {"expected_version": "0"}),
    ("query", {"limit": "ten"}),
    ("query", {"channel_ids": "not-a-list"}),
    ("query", {"cursor_start": -1}),
    ("metadata", {"experiment_metadata": [1, 2]}),
]


@pytest.mark.parametrize("route, body", WRONG_TYPES, ids=[f"{r} {json.dumps(b)}" for r, b in WRONG_TYPES])
def test_wrong_types_are_rejected_and_nothing_is_written(server, unique, route, body):
    channel = unique("types")
    base = {
        "record": ("POST", "/api/v1/events/record", record_body(channel)),
        "state": ("POST", f"/api/v1/state/{channel}", {"channel_id": channel, "cursor": 0, "state": {}}),
        "transition": ("POST", "/api/v1/events/transition",
                       {"channel_id": channel, "type": "t", "payload": {}, "state": {}, "metadata": {"actor": "t"}}),
        "query": ("POST", "/api/v1/events/query", {"limit": 10, "channel_ids": [channel]}),
        "metadata": ("PUT", f"/api/v1/channels/{channel}/metadata", {"channel_id": channel}),
    }
    method, path, good = base[route]
    if route == "metadata":
        assert call(server, "POST", "/api/v1/events/record", body=record_body(channel))[0] < 300
    assert_error(call(server, method, path, body={**good, **body}), 400)
    if route in ("record", "state", "transition"):
        assert latest_cursor(server, channel) is None
        assert call(server, "GET", f"/api/v1/state/{channel}")[2].get("cursor") is None


def test_state_body_naming_another_channel_never_writes_there(server, unique):
    """The body's channel_id must match the path: 400, or the body copy is ignored."""
    path_channel, body_channel = unique("path"), unique("body")
    status, _, body = call(server, "POST", f"/api/v1/state/{path_channel}",
                           body={"channel_id": body_channel, "cursor": 0, "state": {"v": 1}})
    if status >= 400:
        assert_error((status, _, body), 400)
    else:
        assert call(server, "GET", f"/api/v1/state/{path_channel}")[2]["state"] == {"v": 1}
    assert call(server, "GET", f"/api/v1/state/{body_channel}")[2].get("cursor") is None


BIG = 2**70  # past SQLite's 64-bit integers
HUGE_INTEGERS = [
    ("POST", "/api/v1/events/record", record_body("bad-input-huge", step_number=BIG)),
    ("POST", "/api/v1/events/record", record_body("bad-input-huge", step_number=2**63)),
    ("POST", "/api/v1/state/bad-input-huge", {"channel_id": "bad-input-huge", "cursor": BIG, "state": {}}),
    ("POST", "/api/v1/events/query", {"limit": 10, "cursor_start": BIG}),
    ("POST", "/api/v1/events/query", {"limit": 10, "offset": BIG}),
    ("GET", f"/api/v1/events/replay/bad-input-existing?cursor={BIG}", None),
    ("GET", f"/api/v1/state/bad-input-existing/versions?offset={BIG}", None),
    ("GET", f"/api/v1/state/bad-input-existing/version/{BIG}", None),
    ("DELETE", f"/api/v1/state/bad-input-existing/version/{BIG}", None),
    ("GET", f"/api/v1/channels/bad-input-existing/steps/{BIG}", None),
]


@pytest.mark.parametrize("method, path, body", HUGE_INTEGERS, ids=[
    "record step_number 2^70", "record step_number 2^63", "save_state cursor 2^70", "query cursor_start 2^70",
    "query offset 2^70", "replay cursor 2^70", "versions offset 2^70", "get state version 2^70",
    "delete state version 2^70", "resolve step 2^70"])
def test_integers_past_64_bits_never_cause_a_5xx(server, existing, method, path, body):
    """No 5xx on bad input. A 400, or an honest empty answer, is fine."""
    status, headers, answer = call(server, method, path, body=body)
    assert status < 500, answer
    if status >= 400:
        assert_error((status, headers, answer), 400, allowed={400, 404})


@pytest.mark.parametrize("query", ["cursor=-1", "cursor=abc", "cursor=1.5", "limit=abc", "limit=-1"])
def test_bad_replay_parameters_are_rejected(server, existing, query):
    assert_error(call(server, "GET", f"/api/v1/events/replay/{existing}?{query}"), 400)


def test_huge_replay_and_query_limits_are_clamped_not_rejected(server, existing):
    status, _, body = call(server, "GET", f"/api/v1/events/replay/{existing}?limit=1000000&cursor=0")
    assert status == 200 and [e["cursor"] for e in body["events"]] == [1]
    status, _, body = call(server, "POST", "/api/v1/events/query", body={"limit": 1000000, "channel_ids": [existing]})
    assert status == 200 and len(body["events"]) == 1


# --------------------------------------------------------------------------------------------
# Size limits: 4 MiB per body, 1 MiB per document
# --------------------------------------------------------------------------------------------

def _big(n):
    return "x" * n


@pytest.mark.parametrize("case", ["2 MiB event payload", "2 MiB state", "5 MiB body", "5 MiB chunked body"])
def test_oversized_input_is_413_and_nothing_is_written(server, unique, case):
    channel = unique("big")
    if case == "2 MiB state":
        path, body = f"/api/v1/state/{channel}", {"channel_id": channel, "cursor": 0, "state": {"blob": _big(2 * MiB)}}
    else:
        size = 2 * MiB if case.startswith("2") else 5 * MiB
        path, body = "/api/v1/events/record", record_body(channel, payload={"blob": _big(size)})
    raw = json.dumps(body).encode()
    if case.startswith("5"):
        response = post_streaming(server.url + path, server.key, raw, chunked="chunked" in case)
        assert response[0] != 204
    else:
        response = call(server, "POST", path, raw=raw)
    assert_error(response, 413)
    assert latest_cursor(server, channel) is None
    assert call(server, "GET", f"/api/v1/state/{channel}")[2].get("cursor") is None


def test_payload_just_under_the_limit_is_accepted(server, unique):
    channel = unique("under")
    status, _, body = call(server, "POST", "/api/v1/events/record",
                           body=record_body(channel, payload={"blob": _big(MiB - 1024)}))
    assert status < 300, body
    assert latest_cursor(server, channel) == 1


# --------------------------------------------------------------------------------------------
# Authentication, routes, content types
# --------------------------------------------------------------------------------------------

AUTH_ROUTES = [
    ("GET", "/api/v1/channels", None),
    ("GET", "/api/v1/events/replay/anything?limit=1", None),
    ("POST", "/api/v1/events/record", record_body("auth-check")),
    ("GET", "/readyz", None),
    ("GET", "/metrics", None),
]


@pytest.mark.parametrize("key", [None, "sk-wrong-key-00000000000000000000000000"], ids=["missing", "wrong"])
@pytest.mark.parametrize("method, path, body", AUTH_ROUTES, ids=[f"{m} {p}" for m, p, _ in AUTH_ROUTES])
def test_missing_or_wrong_key_is_401(server, method, path, body, key):
    assert_error(call(server, method, path, key=key, body=body), 401)
    if method == "POST":
        assert latest_cursor(server, "auth-check") is None


def test_healthz_needs_no_key(server):
    status, headers, body = call(server, "GET", "/healthz", key=None)
    assert status == 200 and headers["content-type"].startswith("application/json")
    assert body["status"] == "ok"


def test_metrics_is_text_with_a_key(server):
    status, headers, body = call(server, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert re.search(r"^actae_\w+", body, re.M)


@pytest.mark.parametrize("method, path, allowed", [
    ("GET", "/api/v1/nope", {404}),
    ("GET", "/api/v1/channels/x/nope", {404}),
    ("POST", "/api/v1/events/nope", {404}),
    ("DELETE", "/api/v1/events/record", {404, 405}),
    ("GET", "/api/v1/events/record", {404, 405}),
    ("GET", "/api/v1/events/no-such-event/causal-graph", {404}),
    ("GET", "/api/v1/state/bad-input-existing/version/abc", {400, 404}),
    ("GET", "/api/v1/channels/bad-input-existing/steps/abc", {400, 404}),
    ("GET", "/api/v1/channels/bad-input-existing/steps/0", {400, 404}),
])
def test_unknown_routes_methods_and_ids_answer_json(server, existing, method, path, allowed):
    assert_error(call(server, method, path), min(allowed), allowed=allowed)


def test_unknown_page_outside_the_api_is_404(server):
    """Outside /api the dashboard may answer with its HTML error page; still a 404."""
    assert call(server, "GET", "/definitely/not/here")[0] == 404


def test_deletes_answer_200_json_never_204(server, unique):
    channel = unique("delete")
    assert call(server, "POST", "/api/v1/events/record", body=record_body(channel))[0] < 300
    state = {"channel_id": channel, "cursor": 1, "state": {}}
    assert call(server, "POST", f"/api/v1/state/{channel}", body=state)[0] < 300
    for path in (f"/api/v1/state/{channel}/version/1", f"/api/v1/channels/{channel}?recursive=false"):
        status, headers, body = call(server, "DELETE", path)
        assert status == 200 and headers["content-type"].startswith("application/json") and isinstance(body, dict)


# --------------------------------------------------------------------------------------------
# After all of that (runs last in this module)
# --------------------------------------------------------------------------------------------

def test_server_still_serves_and_no_bad_id_was_stored(server, unique):
    channel = unique("after")
    status, _, body = call(server, "POST", "/api/v1/events/record", body=record_body(channel, payload={"ok": True}))
    assert status < 300, body
    status, _, body = call(server, "GET", f"/api/v1/events/replay/{channel}?limit=10&cursor=0")
    assert status == 200 and [(e["cursor"], e["payload"]) for e in body["events"]] == [(1, {"ok": True})]
    status, _, body = call(server, "GET", "/api/v1/channels")
    assert status == 200 and channel in body["channels"]
    assert [c for c in body["channels"] if not CHANNEL_RE.fullmatch(c)] == []
    assert "auth-check" not in body["channels"]


def test_keys_never_appear_in_the_server_output(server):
    """The key is printed once at first start and never logged, nor are wrong keys."""
    assert call(server, "GET", "/api/v1/channels")[0] == 200
    banner = [line for line in server.lines if line.startswith("API key:")]
    assert len(banner) == 1
    others = [line for line in server.lines if not line.startswith("API key:")]
    assert not [line for line in others if server.key in line or "sk-wrong" in line]


def test_a_refused_write_does_not_take_the_writes_batched_with_it_down(server, unique):
    """Concurrent writes share one transaction; the ones refused (an operation id reused for another
    payload) get their 409 and the others commit, gapless, as if each had been alone."""
    from concurrent.futures import ThreadPoolExecutor

    channel = unique("batch")
    url = f"{server.url}/api/v1/events/record"
    for n in range(10):
        status, _, _ = http("POST", url, key=server.key, body={
            "channel_id": channel, "event_type": "first", "payload": {"n": n}, "operation_id": f"op-{n}"})
        assert status == 200

    def write(n):
        reused = n < 10            # the same operation id with another payload: refused
        body = {"channel_id": channel, "event_type": "second", "payload": {"n": n, "again": True},
                "operation_id": f"op-{n}" if reused else f"new-{n}"}
        status, _, answer = http("POST", url, key=server.key, body=body)
        return reused, status, answer

    for _ in range(3):             # several rounds: refused and accepted writes meet in one batch
        with ThreadPoolExecutor(40) as pool:
            outcomes = list(pool.map(write, range(40)))
        assert all(status == 409 and answer["status"] == "idempotency_conflict"
                   for reused, status, answer in outcomes if reused), outcomes
        assert all(status == 200 for reused, status, _ in outcomes if not reused), outcomes
    status, _, replay = http("GET", f"{server.url}/api/v1/events/replay/{channel}?limit=1000", key=server.key)
    assert status == 200
    events = replay["events"]
    assert [e["cursor"] for e in events] == list(range(1, 10 + 30 + 1))
    assert sorted(e["payload"]["n"] for e in events if e["type"] == "second") == list(range(10, 40))
    assert len({e["id"] for e in events}) == len(events)
