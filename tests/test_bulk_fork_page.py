"""The bulk fork from the dashboard, in Chromium: filter the runs list to the failed runs, select
them all, fork them with an intervention after seeing what will be made, and find the six forks
listed with links. Also: ticking single runs, a form error, a second post of the same form, and the
new pages (bulk fork, approvals, storage) at phone width without inline script.
"""
from __future__ import annotations

import re
import uuid
from urllib.parse import urlsplit

import pytest

from conftest import PHONE, http, import_example, logged_in, login, run_sdk, shot, using_async

example = import_example("fork_failed.py")


def build(server, prefix: str) -> dict:
    """The example's ten runs (six fail at steps 1..6); {failed run: last good step}."""
    async def main(client):
        for i in range(example.RUNS):
            await example.original_run(client, f"{prefix}-run{i}",
                                       example.OUTAGES[i] if i < len(example.OUTAGES) else None)
    run_sdk(using_async(server, main))                          # off Playwright's loop
    return {f"{prefix}-run{i}": step for i, (_, step) in enumerate(example.OUTAGES)}


@pytest.fixture(scope="module")
def outage(server):
    prefix = f"page{uuid.uuid4().hex[:8]}"
    return prefix, build(server, prefix)


def test_filter_failed_select_all_fork_with_an_intervention(browser, server, outage):
    prefix, expected = outage
    context, page = logged_in(browser, server)
    page.goto(server.url + "/")
    page.fill("input[name=q]", f"{prefix}-run")
    page.select_option("select[name=status]", "failed")
    with page.expect_navigation():
        page.click("form.filters button[type=submit]")
    listed = page.locator("tr.run-row").evaluate_all("rows => rows.map(r => r.dataset.channel)")
    assert sorted(listed) == sorted(expected)
    shot(page, "bulk-01-failed-runs")

    with page.expect_navigation():
        page.click("#fork-all")                                   # every run this filter matches
    assert urlsplit(page.url).path == "/forks/bulk"
    rows = page.locator("tr.bulk-fork")
    assert rows.count() == 6
    shown = {r["source"]: r for r in rows.evaluate_all("rows => rows.map(r => ({source: r.dataset.source, "
                                                       "fork: r.dataset.fork, step: r.cells[1].innerText}))")}
    assert {s: int(r["step"]) for s, r in shown.items()} == expected
    assert all(r["fork"] == f"{s}-retry" for s, r in shown.items())
    assert page.locator("a.fork-link").count() == 0               # nothing made yet
    assert "Fork 6 runs" in page.locator("#bulk-fork-submit").inner_text()

    page.fill("textarea[name=intervention]", '{"model": "fallback", "note": "after the outage"}')
    page.fill("textarea[name=tool_policies]", '{"charge_customer": "block"}')
    with page.expect_navigation():
        page.click("form.bulk-preview button[type=submit]")       # the preview again, with them
    assert page.locator("tr.bulk-fork").count() == 6
    shot(page, "bulk-02-preview")
    with page.expect_navigation():
        page.click("#bulk-fork-submit")
    assert "done=" in page.url
    links = page.locator("a.fork-link").evaluate_all("links => links.map(a => a.getAttribute('href'))")
    assert sorted(links) == sorted(f"/runs/{s}-retry" for s in expected)
    shot(page, "bulk-03-made")

    with page.expect_navigation():
        page.click(f"a.fork-link[href='/runs/{prefix}-run2-retry']")
    assert urlsplit(page.url).path == f"/runs/{prefix}-run2-retry"
    context.close()
    for source, step in expected.items():
        status, _, meta = http("GET", f"{server.url}/api/v1/channels/{source}-retry/metadata", key=server.key)
        assert status == 200 and meta["parent_channel_id"] in (source,) and meta["restorable"] is True
        assert meta["experiment_metadata"]["intervention"] == {"model": "fallback", "note": "after the outage"}
        assert meta["experiment_metadata"]["forked_at_step"] == step
        assert meta["tool_policies"] == {"charge_customer": "block"}


def test_tick_two_runs_and_fork_only_those(browser, server, outage):
    prefix, expected = outage
    context, page = logged_in(browser, server)
    page.goto(f"{server.url}/?q={prefix}-run&status=failed")
    for run_id in (f"{prefix}-run1", f"{prefix}-run4"):
        page.check(f"tr.run-row[data-channel='{run_id}'] input[type=checkbox]")
    with page.expect_navigation():
        page.click("#fork-selected")
    page.fill("input[name=name]", "{channel_id}-picked")
    with page.expect_navigation():
        page.click("form.bulk-preview button[type=submit]")
    picked = page.locator("tr.bulk-fork").evaluate_all("rows => rows.map(r => r.dataset.fork)")
    assert sorted(picked) == [f"{prefix}-run1-picked", f"{prefix}-run4-picked"]
    with page.expect_navigation():
        page.click("#bulk-fork-submit")
    assert page.locator("a.fork-link").count() == 2
    context.close()
    assert http("GET", f"{server.url}/api/v1/channels/{prefix}-run4-picked/metadata", key=server.key)[0] == 200
    assert http("GET", f"{server.url}/api/v1/channels/{prefix}-run0-picked/metadata", key=server.key)[0] == 404


def test_a_bad_intervention_is_shown_and_a_second_post_makes_nothing_new(server, outage):
    prefix, expected = outage
    c = login(server)
    try:
        page = c.get(f"/forks/bulk?run={prefix}-run3&intervention=%7Bnot%20json")
        assert page.status_code == 400 and "Intervention" in page.text and "bulk-fork-submit" not in page.text
        page = c.get(f"/forks/bulk?run={prefix}-run3&name=%7Bchannel_id%7D-twice")
        form = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"', page.text))
        assert form["runs"] == f"{prefix}-run3" and form["operation_id"]
        for _ in range(2):                                        # a browser re-sending the form
            done = c.post("/forks/bulk", data=form)
            assert done.status_code == 303 and "done=" in done.headers["location"]
        made = c.get(done.headers["location"])
        assert made.text.count('class="fork-link"') == 1
        status, _, listed = http("GET", server.url + "/api/v1/channels", key=server.key)
        assert [c for c in listed["channels"] if c.endswith("-twice")] == [f"{prefix}-run3-twice"]
        stale = c.post("/forks/bulk", data={**form, "csrf_token": "nope"})
        assert stale.status_code == 403
        assert c.get("/forks/bulk?done=no-such-operation").status_code == 404
    finally:
        c.close()


@pytest.mark.parametrize("path", ["/forks/bulk?all=1&status=failed&q={prefix}", "/approvals", "/storage",
                                  "/?status=failed&q={prefix}"])
def test_the_pages_fit_a_phone_and_have_no_inline_script(browser, server, outage, path):
    prefix, _ = outage
    c = login(server)
    try:
        html = c.get(path.format(prefix=prefix)).text
        assert not re.search(r"<script(?![^>]*\bsrc=)", html) and "style=" not in html
    finally:
        c.close()
    context, page = logged_in(browser, server, PHONE)
    page.goto(server.url + path.format(prefix=prefix))
    name = re.sub(r"\W+", "-", path.split("?")[0].strip("/")) or "runs"
    shot(page, f"many-{name}-phone")
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"] + 1, f"{path} scrolls sideways ({width}px)"
    context.close()


def test_the_storage_page_is_for_admins(server, outage):
    prefix, _ = outage
    c = login(server)
    try:
        data = c.get("/storage?format=json").json()["storage"]
        assert data["bytes"] > 0 and data["runs"] >= 10 and len(data["largest"]) > 0 and len(data["oldest"]) > 0
        assert {"channel_id", "events", "states", "bytes", "last_activity"} <= set(data["largest"][0])
    finally:
        c.close()
    status, _, created = http("POST", server.url + "/api/v1/keys", key=server.key,
                              body={"name": "storage-reader", "scopes": {"read": ["*"], "write": ["*"]}})
    reader = login(server, key=created["key"])
    try:
        assert reader.get("/storage").status_code == 403
        assert "/storage" not in reader.get("/").text
    finally:
        reader.close()
