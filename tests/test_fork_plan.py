"""The fork's effect plan: POST /api/v1/forks/plan answers, writing nothing, the boundary a fork would
resolve to and the fate of every effect of the source's ledger under the tool policies: inherited and
completed (replayed, or refused by block), inherited and never completed ("outcome unknown": claimed,
no result, flagged when the fork would run it again), after the boundary (runs again under auto), and
what the source's tail spent last time. Bulk fork's dry run carries one plan per run, summed; the run
page's fork form shows the plan as its step and policies change (a browser reads an outcome-unknown row).
"""
from __future__ import annotations

import pytest

from conftest import DESKTOP, PHONE, api, logged_in, record, save_state


def claim(server, run: str, key: str, tool: str, **params) -> dict:
    status, _, answer = api(server, "POST", "/api/v1/executions/claim",
                            body={"channel_id": run, "key_name": key, "tool_name": tool, "params": params})
    assert status == 200, answer
    return answer


def finish(server, claimed: dict, how: str = "complete", **body) -> None:
    execution = claimed["execution"]["id"]
    status, _, answer = api(server, "POST", f"/api/v1/executions/{execution}/{how}",
                            body={"claim_token": claimed["claim_token"], **body})
    assert status == 200, answer


def step(server, run: str, number: int, usage: dict | None = None) -> int:
    event = record(server, run, payload={"step": number, **({"output": {"usage": usage}} if usage else {})},
                   step=number)
    save_state(server, run, event["cursor"], {"step": number})
    return event["cursor"]


@pytest.fixture(scope="module")
def source(server, tmp_path_factory):
    """Step 1 charges (completed); step 2 sends an email that is claimed and never completed, and a
    report that failed; step 3; step 4 ships (completed, after a fork at step 3)."""
    run = f"plan-{tmp_path_factory.mktemp('p').name[-6:]}"
    step(server, run, 1, {"input_tokens": 100, "output_tokens": 10, "cost": 0.01})
    finish(server, claim(server, run, "charge-1", "charge_customer", cents=4900), result={"charge": "ch_1"})
    step(server, run, 2)
    claim(server, run, "email-1", "send_email", to="a@example.com")                 # never completed
    finish(server, claim(server, run, "report-1", "render_report"), "fail", error={"message": "boom"})
    step(server, run, 3)
    step(server, run, 4, {"input_tokens": 400, "output_tokens": 40, "cost": 0.04})
    finish(server, claim(server, run, "ship-1", "ship_order", sku="x"), result={"shipped": True})
    step(server, run, 5, {"input_tokens": 500, "output_tokens": 50, "cost": 0.05})
    return run


def plan(server, body: dict) -> dict:
    status, _, answer = api(server, "POST", "/api/v1/forks/plan", body=body)
    assert status == 200, answer
    return answer


def fates(answer: dict) -> dict:
    return {e["key_name"]: (e["place"], e["fate"], e["outcome_unknown"], e["flagged"]) for e in answer["effects"]}


def test_the_plan_names_each_effect_s_fate_and_writes_nothing(server, source):
    before = (api(server, "GET", f"/api/v1/events/cursor/{source}")[2],
              api(server, "GET", f"/api/v1/executions?channel_id={source}&limit=100")[2],
              api(server, "GET", f"/api/v1/channels/{source}/forks")[2])
    answer = plan(server, {"source_channel_id": source, "at_step": 3})
    assert answer["boundary"]["step"] == 3 and answer["boundary"]["restorable"] is True, answer["boundary"]
    assert fates(answer) == {
        "charge-1": ("inherited", "replayed", False, False),
        "email-1": ("inherited", "runs_again", True, True),        # may have happened: flagged
        "report-1": ("inherited", "runs_again", False, False),     # it failed: nothing happened
        "ship-1": ("after_boundary", "runs_again", False, False),
    }
    assert answer["counts"] == {"effects": 4, "replayed": 1, "refused": 0, "runs_again": 3, "outcome_unknown": 1,
                                "flagged": 1}
    unknown = next(e for e in answer["effects"] if e["key_name"] == "email-1")
    assert "outcome unknown" in unknown["why"] and unknown["params"] == {"to": "a@example.com"}
    # what the steps after step 3 spent last time: steps 4 and 5
    assert (answer["forecast"]["steps"], answer["forecast"]["input_tokens"]) == (2, 900), answer["forecast"]
    after = (api(server, "GET", f"/api/v1/events/cursor/{source}")[2],
             api(server, "GET", f"/api/v1/executions?channel_id={source}&limit=100")[2],
             api(server, "GET", f"/api/v1/channels/{source}/forks")[2])
    assert after == before


def test_policies_decide_the_fates(server, source):
    blocked = plan(server, {"source_channel_id": source, "at_step": 3,
                            "tool_policies": {"charge_customer": "block", "send_email": "replay", "*": "auto"}})
    assert fates(blocked)["charge-1"] == ("inherited", "refused", False, False)
    assert fates(blocked)["email-1"] == ("inherited", "refused", True, False)     # unknown, but not run again
    live = plan(server, {"source_channel_id": source, "at_step": 3, "tool_policies": {"*": "live"}})
    assert {k: v[1] for k, v in fates(live).items()} == dict.fromkeys(("charge-1", "email-1", "report-1", "ship-1"),
                                                                         "runs_again")
    assert fates(live)["email-1"][3] is True
    later = plan(server, {"source_channel_id": source, "at_step": 5})     # ship-1 completed during step 5
    assert fates(later)["ship-1"] == ("inherited", "replayed", False, False)


def test_the_digest_names_the_plan(server, source, unique):
    one = plan(server, {"source_channel_id": source, "at_step": 3})["digest"]
    assert plan(server, {"source_channel_id": source, "at_step": 3})["digest"] == one
    assert plan(server, {"source_channel_id": source, "at_step": 3, "tool_policies": {"*": "block"}})["digest"] != one


def test_bad_plans_are_refused(server, source, unique):
    status, _, answer = api(server, "POST", "/api/v1/forks/plan", body={"source_channel_id": unique("none")})
    assert status == 404, answer
    status, _, answer = api(server, "POST", "/api/v1/forks/plan",
                            body={"source_channel_id": source, "at_step": 3, "at_cursor": 2})
    assert status == 400 and "at_step or at_cursor" in answer["error"], answer
    status, _, answer = api(server, "POST", "/api/v1/forks/plan", body={"source_channel_id": source, "at_step": 99})
    assert status == 404, answer
    narrow = api(server, "POST", "/api/v1/keys", body={"name": unique("k"), "scopes": {"read": ["nothing-*"]}})[2]["key"]
    status, _, answer = api(server, "POST", "/api/v1/forks/plan", key=narrow, body={"source_channel_id": source})
    assert status in (403, 404) and source not in str(answer.get("effects", "")), answer


def test_bulk_fork_s_dry_run_carries_each_plan_summed(server, source):
    body = {"filter": {"channel_ids": [source], "status": ["recorded", "failed", "completed", "started", "stepping"]},
            "at": 3, "dry_run": True, "tool_policies": {"charge_customer": "block"}}
    status, _, answer = api(server, "POST", "/api/v1/forks/bulk", body=body)
    assert status == 200 and len(answer["forks"]) == 1, answer
    one = answer["forks"][0]["plan"]
    assert fates(one)["charge-1"][1] == "refused" and one["counts"]["outcome_unknown"] == 1
    assert answer["plan_totals"]["runs"] == 1 and answer["plan_totals"]["counts"] == one["counts"]


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_the_fork_form_shows_the_plan_with_an_outcome_unknown_row(browser, server, source, viewport):
    context, page = logged_in(browser, server, viewport)
    try:
        page.goto(f"{server.url}/runs/{source}?fork_step=3#fork")
        row = page.locator("#fork-plan tr.plan-effect.outcome-unknown")
        row.wait_for()
        assert "outcome unknown" in row.inner_text() and row.get_attribute("data-key") == "email-1"
        page.select_option("#fork-step", "5")
        page.locator("#fork-plan[data-step='5']").wait_for()
        assert page.locator("#fork-plan tr[data-key='ship-1']").get_attribute("data-fate") == "replayed"
        # without JavaScript's help: the "Plan it first" page, then its button makes the fork
        page.goto(f"{server.url}/runs/{source}/fork/plan?step=3&name={source}-planned")
        assert page.locator("tr.plan-effect.outcome-unknown").count() == 1
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= viewport["width"] + 1, width
    finally:
        context.close()


def test_a_fork_s_page_shows_the_plan_it_was_made_under(server, source):
    status, _, receipt = api(server, "POST", "/api/v1/channels/fork",
                             body={"source_channel_id": source, "new_channel_id": f"{source}-made",
                                   "at_cursor": 6, "tool_policies": {"send_email": "block"}})
    assert status == 200, receipt
    page = api(server, "GET", f"/runs/{source}-made?format=json")[2]
    assert fates(page["fork_plan"])["email-1"][1] == "refused", page["fork_plan"]
