"""State blame: each path of a run's state with the step that set its current value, over the API and
on the run page; the failure banner names the values the failure shows and offers first the fork that
keeps none of them. The walkthrough (examples/fork_demo.py) is the run: its decision is made at step 4
("refund and charge again"), its failure shows at step 6 and says so, so the banner leads to
"decision was set at step 4: fork after step 3", not after step 5 (which keeps the mistake).
"""
from __future__ import annotations

import pytest

from conftest import DESKTOP, PHONE, api, logged_in, record, run_example, save_state


@pytest.fixture(scope="module")
def demo(server, tmp_path_factory):
    name = f"blame-{tmp_path_factory.mktemp('n').name[-6:]}"
    proc = run_example(server, "fork_demo.py", "--name", name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return f"{name}-base", f"{name}-fork"


def blame(server, run: str, at_step: int | None = None) -> dict:
    status, _, answer = api(server, "GET", f"/api/v1/channels/{run}/blame" + (f"?at_step={at_step}" if at_step else ""))
    assert status == 200, answer
    return answer


def steps_by_path(answer: dict) -> dict:
    return {".".join(line["path"]): line["step"] for line in answer["paths"]}


def test_blame_answers_each_path_with_the_step_that_set_it(server, demo):
    base, forked = demo
    latest = steps_by_path(blame(server, base))
    assert latest["decision"] == 4 and latest["status"] == 6 and latest["error"] == 6, latest
    assert latest["notes.research"] == 1 and latest["notes.risks"] == 3 and latest["charge.status"] == 4, latest
    assert latest["report.text"] == 5, latest
    early = blame(server, base, at_step=3)
    assert early["at_step"] == 3 and "error" not in steps_by_path(early), early
    # decision was null from the first snapshot until step 4 set it
    line = next(line for line in early["paths"] if line["path"] == ["decision"])
    assert line["value"] is None and line["step"] == 1, line
    # a fork: what it inherited is blamed on its parent's steps, what it changed on its own
    on_fork = {".".join(line["path"]): (line["step"], line["channel_id"]) for line in blame(server, forked)["paths"]}
    assert on_fork["notes.research"] == (1, base) and on_fork["decision"] == (4, forked), on_fork


def test_a_value_set_back_is_blamed_on_the_step_that_set_it_back(server, unique):
    run = unique("setback")
    for step, state in enumerate(({"mode": "a", "n": 1}, {"mode": "b", "n": 1}, {"mode": "a", "n": 1},
                                  {"mode": "a", "n": 1, "extra": [1, 2]}), start=1):
        event = record(server, run, payload={"step": step}, step=step)
        save_state(server, run, event["cursor"], state)
    assert steps_by_path(blame(server, run)) == {"mode": 3, "n": 1, "extra.0": 4, "extra.1": 4}


def test_blame_of_no_run_and_bad_steps(server, unique):
    assert api(server, "GET", f"/api/v1/channels/{unique('none')}/blame")[0] == 404
    run = unique("nostate")
    record(server, run, payload={"step": 1}, step=1)
    assert blame(server, run) == {"channel_id": run, "at_step": None, "version": None, "cursor": None,
                                  "paths": [], "total": 0}
    status, _, answer = api(server, "GET", f"/api/v1/channels/{run}/blame?at_step=0")
    assert status == 400 and "at_step" in answer["error"], answer


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_the_failure_banner_offers_the_fork_that_keeps_no_mistake(browser, server, demo, viewport):
    base, _ = demo
    context, page = logged_in(browser, server, viewport)
    try:
        page.goto(f"{server.url}/runs/{base}")
        cause = page.locator("#failure-cause")
        assert "decision was set at step 4" in cause.inner_text()
        first = page.locator("#failure a.fork-from-failure")
        assert first.get_attribute("data-fork-step") == "3" and first.inner_text().strip() == "Fork after step 3"
        assert first.is_visible()
        others = [a.get_attribute("data-fork-step") for a in page.locator("#failure a.fork-other").all()]
        assert "5" in others, others                        # the last good step, one click away
        # the step list shows each change's old and new values, short, in the step's row
        chip = page.locator("details[data-step='4'] .chg-item[data-key='decision']").first
        assert 'null → "refund and charge again"' in chip.inner_text(), chip.inner_text()
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= viewport["width"] + 1, f"the run page scrolls sideways at {viewport['width']} px: {width}"
        first.click()                                  # picks step 3 in the fork form below
        assert page.locator("#fork-step").input_value() == "3"
        page.goto(f"{server.url}/runs/{base}/blame")
        row = page.locator("tr.blame-line[data-path='decision']")
        assert row.get_attribute("data-step") == "4" and "refund and charge again" in row.inner_text()
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= viewport["width"] + 1, f"the blame page scrolls sideways at {viewport['width']} px: {width}"
    finally:
        context.close()


def test_a_failure_naming_no_value_offers_the_last_good_step(server, unique):
    run = unique("plain")
    for step in (1, 2):
        event = record(server, run, payload={"step": step}, step=step)
        save_state(server, run, event["cursor"], {"status": "running", "k": step})
    event = record(server, run, payload={"step": 3}, step=3)
    save_state(server, run, event["cursor"], {"status": "failed", "k": 3})
    status, _, page = api(server, "GET", f"/runs/{run}?format=json")      # the page's JSON twin, with the key
    assert status == 200, page
    assert page["failure"]["last_good_step"] == 2 and page["cause"] is None, page["failure"]
