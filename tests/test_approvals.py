"""The approvals inbox: the SDK's request_approval / wait_for_approval against the real server, the
API (GET /api/v1/approvals, POST /api/v1/approvals/{request_id}/decide) and the /approvals page in
Chromium.

Three runs ask for approval (one with a 1-second timeout). The inbox API and the page list the two
pending ones, oldest first; approving one in the page, signed in with an account, makes that run's
`wait_for_approval` return `approved` with the account as actor; rejecting the other through the
API makes its `wait_for_approval` return `rejected`; the timed-out one shows as expired; the same
decision again (from us or from the SDK's decide_approval) adds no event; a read-only key gets 403.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import uuid
from urllib.parse import quote, urlsplit

import pytest

from conftest import http, poll, run_sdk, shot, using, using_async


def sdk(server, body):
    """`await body(client)` on a fresh SDK client, on a thread of its own (Playwright keeps a loop on this one)."""
    return run_sdk(using_async(server, body))


def inbox(server, key=None, **query):
    status, _, body = http("GET", f"{server.url}/api/v1/approvals?" + "&".join(f"{k}={quote(v)}" for k, v in query.items()),
                           key=key or server.key)
    assert status == 200, body
    return body["approvals"]


def decide(server, request_id, key=None, **body):
    return http("POST", f"{server.url}/api/v1/approvals/{quote(request_id)}/decide", key=key or server.key, body=body)


def decided_events(server, channel):
    _, _, body = http("GET", f"{server.url}/api/v1/events/replay/{channel}?event_type=approval.decided",
                      key=server.key)
    return body["events"]


@pytest.fixture(scope="module")
def account(server):
    """An account that may read and write every run, signed up by the admin key."""
    email, password = f"approver-{uuid.uuid4().hex[:8]}@example.com", "correct horse battery"
    status, _, body = http("POST", server.url + "/api/v1/auth/signup", key=server.key,
                           body={"email": email, "password": password, "name": "Approver",
                                 "scopes": {"read": ["*"], "write": ["*"]}})
    assert status == 200, body
    return {"email": email, "password": password, "id": body["user"]["id"]}


@pytest.fixture(scope="module")
def requests_made(server):
    """Three runs that each record a step and ask for approval; the third times out after 1 second."""
    tag = f"ap{uuid.uuid4().hex[:8]}"
    runs = {"refund": f"{tag}-refund", "contract": f"{tag}-contract", "wipe": f"{tag}-wipe"}

    async def body(client):
        ids = {}
        for what, channel in runs.items():
            await client.record(channel, "step", {"step_number": 1, "input": None, "output": {"ok": True}},
                                actor="agent", step_number=1)
            ids[what] = await client.request_approval(
                channel, summary={"refund": "Refund 40 EUR", "contract": "Send the contract",
                                  "wipe": "Delete the workspace"}[what],
                details={"what": what}, timeout_seconds=1 if what == "wipe" else None)
            await asyncio.sleep(0.01)     # time must pass: distinct requested_at (oldest first)
        return ids
    return runs, sdk(server, body)


def wait_in_background(server, channel, request_id):
    """The agent side: wait_for_approval on its own thread; the future's result is the decided event."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    return pool.submit(using, server, lambda c: c.wait_for_approval(channel, request_id, timeout_seconds=60,
                                                                     poll_interval=0.2))


def test_the_inbox_lists_the_pending_requests_and_the_timed_out_one_as_expired(server, requests_made):
    runs, ids = requests_made

    def expired():
        return [a for a in inbox(server, status="expired") if a["request_id"] == ids["wipe"]]
    (wipe,) = poll(expired, 20, every=0.1, what="the 1-second request to show as expired")
    assert wipe["channel_id"] == runs["wipe"] and wipe["summary"] == "Delete the workspace"
    pending = [a for a in inbox(server, status="pending") if a["channel_id"] in runs.values()]
    assert [a["request_id"] for a in pending] == [ids["refund"], ids["contract"]]          # oldest first
    first = pending[0]
    assert first["details"] == {"what": "refund"} and first["requester"] == "agent"
    assert first["status"] == "pending" and first["decision"] is None and first["timeout_at"] is None
    assert first["age_seconds"] >= 0
    assert [a["request_id"] for a in inbox(server, channel_id=runs["wipe"])] == [ids["wipe"]]
    assert inbox(server, channel_id=runs["wipe"], status="pending") == []
    assert decide(server, ids["wipe"], decision="approved")[0] == 409      # nothing waits for it any more


def test_a_read_only_key_may_list_but_not_decide(server, requests_made):
    runs, ids = requests_made
    status, _, created = http("POST", server.url + "/api/v1/keys", key=server.key,
                              body={"name": "inbox-reader", "scopes": {"read": ["*"]}})
    reader = created["key"]
    assert any(a["request_id"] == ids["refund"] for a in inbox(server, key=reader, status="pending"))
    status, _, refused = decide(server, ids["refund"], key=reader, decision="approved")
    assert status == 403 and refused["status"] == "forbidden"
    status, _, created = http("POST", server.url + "/api/v1/keys", key=server.key,
                              body={"name": "other-writer", "scopes": {"read": ["*"], "write": ["elsewhere-*"]}})
    assert decide(server, ids["refund"], key=created["key"], decision="approved")[0] == 403
    assert decided_events(server, runs["refund"]) == []


def test_approve_in_the_page_reject_through_the_api(server, browser, account, requests_made):
    runs, ids = requests_made
    refund_wait = wait_in_background(server, runs["refund"], ids["refund"])
    contract_wait = wait_in_background(server, runs["contract"], ids["contract"])

    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.goto(server.url + "/login")
    page.fill("input[name=email]", account["email"])
    page.fill("input[name=password]", account["password"])
    with page.expect_navigation():
        page.click("form:has(input[name=email]) button[type=submit]")
    assert urlsplit(page.url).path == "/"
    page.click("nav a[href='/approvals']")
    assert urlsplit(page.url).path == "/approvals"
    shown = page.locator("tr.approval").evaluate_all("rows => rows.map(r => r.dataset.request)")
    assert ids["refund"] in shown and ids["contract"] in shown and ids["wipe"] not in shown
    assert shown.index(ids["refund"]) < shown.index(ids["contract"])
    shot(page, "approvals-pending")
    row = page.locator(f"tr.approval[data-request='{ids['refund']}']")
    row.locator("input[name=reason]").fill("the customer sent the receipt")
    with page.expect_navigation():
        row.locator("button[value=approved]").click()
    assert "decided" in page.url
    assert page.locator(f"tr.approval[data-request='{ids['refund']}']").count() == 0     # no longer pending
    page.goto(server.url + "/approvals?status=decided")
    decided_row = page.locator(f"tr.approval[data-request='{ids['refund']}']")
    assert "approved" in decided_row.inner_text() and "the customer sent the receipt" in decided_row.inner_text()
    shot(page, "approvals-decided")
    context.close()

    event = refund_wait.result(timeout=30)
    assert event is not None and event.payload["decision"] == "approved"
    assert event.payload == {"request_id": ids["refund"], "decision": "approved",
                             "reason": "the customer sent the receipt"}
    assert event.actor == f"user:{account['id']}"

    status, _, answer = decide(server, ids["contract"], decision="rejected", reason="not this quarter")
    assert status == 200 and answer["replayed"] is False
    assert answer["approval"]["status"] == "decided" and answer["approval"]["decision"] == "rejected"
    rejected = contract_wait.result(timeout=30)
    assert rejected.payload["decision"] == "rejected" and rejected.id == answer["event"]["id"]
    assert rejected.actor == answer["approval"]["decided_by"] and rejected.actor.startswith("key:")


def test_deciding_again_the_same_way_adds_no_event(server, requests_made):
    runs, ids = requests_made
    (first,) = decided_events(server, runs["contract"])
    status, _, again = decide(server, ids["contract"], decision="rejected", reason="not this quarter")
    assert status == 200 and again["replayed"] is True and again["event"]["id"] == first["id"]
    # The SDK's own decide_approval derives the same operation id from (request, decision): a replay.
    event = sdk(server, lambda c: c.decide_approval(runs["contract"], ids["contract"], decision="rejected",
                                                    actor="someone else", reason="not this quarter"))
    assert event.id == first["id"]
    assert len(decided_events(server, runs["contract"])) == 1
    status, _, refused = decide(server, ids["contract"], decision="approved")
    assert status == 409 and refused["status"] == "approval_decided"
    assert len(decided_events(server, runs["contract"])) == 1
    (approved,) = decided_events(server, runs["refund"])
    status, _, page_again = decide(server, ids["refund"], decision="approved", reason="the customer sent the receipt")
    assert status == 200 and page_again["event"]["id"] == approved["id"]
    assert len(decided_events(server, runs["refund"])) == 1


def test_a_decision_made_by_the_sdk_shows_in_the_inbox(server):
    channel = f"ap-sdk-{uuid.uuid4().hex[:8]}"

    async def body(client):
        request_id = await client.request_approval(channel, summary="Ship it", requester="planner")
        await client.decide_approval(channel, request_id, decision="approved", actor="ops@example.com",
                                     reason="green build")
        return request_id
    request_id = sdk(server, body)
    (found,) = inbox(server, channel_id=channel)
    assert ((found["request_id"], found["status"], found["decision"], found["decided_by"], found["reason"])
            == (request_id, "decided", "approved", "ops@example.com", "green build"))
    assert found["requester"] == "planner" and found["decided_at"] >= found["requested_at"]


@pytest.mark.parametrize("query", ["status=maybe", "limit=0", "channel_id=a%20b"])
def test_bad_inbox_queries_are_refused(server, query):
    status, _, body = http("GET", f"{server.url}/api/v1/approvals?{query}", key=server.key)
    assert status == 400 and set(body) == {"status", "error"}


def test_unknown_and_ambiguous_request_ids(server):
    status, _, body = decide(server, "no-such-request", decision="approved")
    assert status == 404
    shared = f"shared-{uuid.uuid4().hex[:8]}"
    channels = [f"{shared}-a", f"{shared}-b"]

    async def body(client):
        for channel in channels:
            await client.request_approval(channel, summary="same id", request_id=shared)
    sdk(server, body)
    status, _, body = decide(server, shared, decision="approved")
    assert status == 409 and body["status"] == "approval_ambiguous"
    status, _, body = decide(server, shared, decision="approved", channel_id=channels[1])
    assert status == 200 and body["approval"]["channel_id"] == channels[1]
    assert [a["status"] for a in inbox(server, channel_id=channels[0])] == ["pending"]
