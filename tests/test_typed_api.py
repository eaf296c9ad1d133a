"""Three small contract fixes found while typing the API's answers.

1. `/api/v1/auth/me` and `/api/v1/auth/logout` are documented (and served) with the Bearer login
   token only; every other operation keeps the key.
2. Channel ids `.` and `..` are refused with 400 (browsers rewrite `/runs/..` away), in bodies
   and in paths.
3. The SDK runtime's lifecycle envelope (payload "schema": "actae.framework-event/v1") carries the
   sending attempt's clock: a redelivered job that enters the same `Actae.workflow(...,
   attempt=1)` again gets the original `run.started` back instead of a 409, and its run completes.
   Any other difference in such an envelope, and any other payload, still conflicts.
"""
from __future__ import annotations

import asyncio
import json
from http.client import HTTPConnection
from urllib.parse import urlsplit

from conftest import http

FRAMEWORK_EVENT = "actae.framework-event/v1"


def raw_get(server, path: str, key: str):
    """GET with the path sent exactly as written (no client-side dot-segment handling)."""
    parts = urlsplit(server.url)
    conn = HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", path, headers={"x-api-key": key})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


# --- 1. the Bearer routes ---------------------------------------------------------------------


def test_me_and_logout_are_documented_with_the_bearer_token_only(server):
    status, _, doc = http("GET", server.url + "/openapi.json")
    assert status == 200
    for path, method in (("/api/v1/auth/me", "get"), ("/api/v1/auth/logout", "post")):
        assert doc["paths"][path][method]["security"] == [{"bearer": []}], path
    # the key still documents the rest, and the preferences take either
    assert doc["paths"]["/api/v1/events/record"]["post"]["security"] == [{"apiKey": []}]
    assert {"bearer": []} in doc["paths"]["/api/v1/user/preferences"]["get"]["security"]


def test_me_with_only_the_key_is_401_and_with_the_bearer_token_answers_the_account(server):
    status, _, body = http("GET", server.url + "/api/v1/auth/me", key=server.key)
    assert status == 401 and body["status"] == "unauthorized"
    status, _, login = http("POST", server.url + "/api/v1/auth/api-key-login", key=server.key, body={})
    assert status == 200
    status, _, me = http("GET", server.url + "/api/v1/auth/me",
                         headers={"authorization": f"Bearer {login['token']}"})
    assert status == 200 and me["user"]["id"] == login["user"]["id"]


# --- 2. "." and ".." ---------------------------------------------------------------------------


def test_dot_channel_ids_are_refused_in_bodies(server):
    for channel in (".", ".."):
        status, _, body = http("POST", server.url + "/api/v1/events/record", key=server.key,
                               body={"channel_id": channel, "event_type": "step", "payload": {}})
        assert status == 400 and body["status"] == "bad_request", (channel, body)
        status, _, body = http("POST", server.url + "/api/v1/channels/fork", key=server.key,
                               body={"source_channel_id": channel, "new_channel_id": "fine", "at_cursor": 0})
        assert status == 400, (channel, body)
    status, _, listed = http("GET", server.url + "/api/v1/channels", key=server.key)
    assert "." not in listed["channels"] and ".." not in listed["channels"]


def test_dot_channel_ids_are_refused_in_paths_and_dots_inside_ids_still_work(server, unique):
    for channel in (".", ".."):
        status, body = raw_get(server, f"/api/v1/state/{channel}", server.key)
        assert status in (400, 404) and body["status"] in ("bad_request", "not_found"), (channel, body)
    status, body = raw_get(server, "/api/v1/events/cursor/..", server.key)
    assert status == 400 and body["status"] == "bad_request", body
    for channel in (unique("a.b"), "..." + unique(), unique() + ".."):
        status, _, body = http("POST", server.url + "/api/v1/events/record", key=server.key,
                               body={"channel_id": channel, "event_type": "step", "payload": {}})
        assert status == 200 and body["event"]["channel_id"] == channel


# --- 3. the lifecycle envelope's clock ------------------------------------------------------------------


def envelope(kind: str, occurred_at: str, data: dict) -> dict:
    return {"schema": FRAMEWORK_EVENT, "kind": kind, "framework": "orchestrator", "run_id": "r",
            "parent_run_id": None, "agent_id": None, "occurred_at": occurred_at, "data": data}


def record(server, channel: str, payload: dict, operation_id: str):
    return http("POST", server.url + "/api/v1/events/record", key=server.key,
                body={"channel_id": channel, "event_type": "framework.run.started", "payload": payload,
                      "operation_id": operation_id})


def test_an_envelope_sent_again_at_another_time_answers_the_original_event(server, unique):
    channel = unique("envelope")
    status, _, first = record(server, channel, envelope("run.started", "2026-01-01T00:00:00+00:00", {"a": 1}), "op-1")
    assert status == 200
    status, _, again = record(server, channel, envelope("run.started", "2026-01-01T00:05:00+00:00", {"a": 1}), "op-1")
    assert status == 200 and again["event"] == first["event"], "the original event, its clock included"
    status, _, changed = record(server, channel, envelope("run.started", "2026-01-01T00:06:00+00:00", {"a": 2}), "op-1")
    assert status == 409 and changed["status"] == "idempotency_conflict"
    status, _, events = http("GET", server.url + f"/api/v1/events/replay/{channel}", key=server.key)
    assert [e["payload"]["occurred_at"] for e in events["events"]] == ["2026-01-01T00:00:00+00:00"]


def test_any_other_payload_with_a_changed_occurred_at_still_conflicts(server, unique):
    channel = unique("plain")
    payload = {"occurred_at": "2026-01-01T00:00:00+00:00", "data": {"a": 1}}
    assert record(server, channel, payload, "op-1")[0] == 200
    status, _, body = record(server, channel, {**payload, "occurred_at": "2026-01-01T00:05:00+00:00"}, "op-1")
    assert status == 409 and body["status"] == "idempotency_conflict"
    other = {**envelope("run.started", "2026-01-01T00:00:00+00:00", {}), "schema": "someone-else/v1"}
    assert record(server, channel, other, "op-2")[0] == 200
    status, _, body = record(server, channel, {**other, "occurred_at": "2026-01-01T00:09:00+00:00"}, "op-2")
    assert status == 409


def test_a_redelivered_job_enters_the_same_workflow_attempt_again_and_completes(with_client, unique):
    from actae_client import Actae

    workflow = unique("wf")

    async def body(client):
        actae = Actae(client)
        # The first delivery enters the workflow and its worker dies before it can leave it (in a
        # task of its own, so its scope does not stay this one's ambient run, as in another process).
        async def first_delivery():
            return (await actae.workflow(workflow, attempt=1).__aenter__()).channel_id

        channel = await asyncio.create_task(first_delivery())
        original = [e for e in await client.replay(channel) if e.event_type == "framework.run.started"]
        # The job is delivered again: the same attempt enters again (today's 409 failed it here).
        async with actae.workflow(workflow, attempt=1) as again:
            assert again.channel_id == channel
            await again.record("step", {"n": 1})
        return channel, original, await client.replay(channel)

    channel, original, events = with_client(body)
    started = [e for e in events if e.event_type == "framework.run.started"]
    assert len(original) == 1 and [e.id for e in started] == [original[0].id], "one run.started: the original"
    assert started[0].payload["occurred_at"] == original[0].payload["occurred_at"]
    kinds = [e.event_type for e in events]
    assert kinds[-1] == "framework.run.completed" and "framework.step" in kinds, kinds
    assert kinds.count("framework.run.completed") == 1
