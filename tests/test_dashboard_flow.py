"""Where a run went wrong, what each step changed, and forking from the page, in real Chromium.

The runs are made with the real SDK against the real server: one that raises inside
`AgentSession` after step 5, one that completes with a final state whose status is "failed",
and a base run whose fork replays a charge. The tests then read the pages the way a user
would, fork from the page (an error first, then a fork whose continue snippet is run as a real
program), delete a run with its forks, and screenshot every page at 1280×800 and 390×844
(`screenshots/flow-*.png`), checking that nothing scrolls sideways on the phone.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from conftest import DESKTOP, PHONE, form_token, http, run_sdk, shot, submit_login, watch

CRASH_MESSAGE = "the model returned an empty plan"


async def _build_runs(url: str, key: str, tag: str) -> dict:
    from actae_client import ActaeClient, AgentSession

    client = ActaeClient(endpoint=url, api_key=key)
    names = {"tag": tag, "crash": f"{tag}-crash", "failed": f"{tag}-failed", "base": f"{tag}-base",
             "replay": f"{tag}-replay", "resumed": f"{tag}-resumed", "doomed": f"{tag}-doomed"}
    try:
        # Steps change: 1 adds a, b, c; 2 changes a; 3 changes b and c; 4 and 5 change a.
        state = {"a": 0, "b": "", "c": []}
        crash = AgentSession(client, names["crash"], state_fn=lambda: json.loads(json.dumps(state)),
                             snapshot_interval=1, params={"model": "fast"})
        with pytest.raises(RuntimeError):
            async with crash:
                for n in range(1, 6):
                    if n == 3:
                        state.update(b="plan", c=[1, 2])
                    else:
                        state["a"] = n
                    await crash.step(f"step-{n}", input={"n": n}, output={"ok": True})
                raise RuntimeError(CRASH_MESSAGE)

        final = {"status": "running", "done": 0}
        failed = AgentSession(client, names["failed"], state_fn=lambda: dict(final), snapshot_interval=1)
        async with failed:
            for n in range(1, 4):
                final["done"] = n
                if n == 3:
                    final.update(status="failed", error="the report was rejected by the checker")
                await failed.step(f"step-{n}", output={"n": n})

        # A base run that charges at step 2, and a fork whose identical charge is replayed (policy auto).
        base_state = {"status": "running", "n": 0}
        base = AgentSession(client, names["base"], state_fn=lambda: dict(base_state), snapshot_interval=1,
                            display_name="shared name")
        async with base:
            for n in range(1, 5):
                if n == 2:
                    claim = await client.claim_execution(names["base"], "inv-9", "charge_customer", {"cents": 100})
                    await client.complete_execution(claim.execution.id, claim.claim_token, {"charge_id": "ch_9"})
                base_state["n"] = n
                await base.step(f"step-{n}", output={"n": n})
        fork = await base.fork(3, name=names["replay"], tool_policies={"*": "auto"})
        async with fork:
            replayed = await client.claim_execution(names["replay"], "inv-9", "charge_customer", {"cents": 100})
            assert replayed.status == "replayed"
            await fork.step("step-4", output={"n": 4})
        # resume(name=X) keeps the parent's display name: the list must still tell the two apart.
        resumed = await AgentSession.resume(client, names["base"], fork_at_step=2, name=names["resumed"])
        async with resumed:
            await resumed.step("step-3", output={"again": True})

        doomed = AgentSession(client, names["doomed"], state_fn=lambda: {"x": 1}, snapshot_interval=1)
        async with doomed:
            await doomed.step("only", output=1)
        await doomed.fork(1, name=names["doomed"] + "-child")
        return names
    finally:
        await client.disconnect()


@pytest.fixture(scope="module")
def runs(server):
    return run_sdk(_build_runs(server.url, server.key, "fl" + uuid.uuid4().hex[:8]))


@pytest.fixture(scope="module")
def storage(browser, server):
    """A logged-in browser session (its cookies), shared by the contexts below."""
    context = browser.new_context(viewport=DESKTOP)
    page = context.new_page()
    page.goto(server.url + "/login")
    submit_login(page, server.key)
    state = context.storage_state()
    context.close()
    return state


@pytest.fixture
def tab(browser, storage, visits):
    context = browser.new_context(viewport=DESKTOP, storage_state=storage)
    page = context.new_page()
    watch(page, visits)
    yield page
    context.close()


# --- 1. a run that raised after step 5 ------------------------------------------------------

def test_crashed_run_leads_with_the_message_and_the_last_good_step(tab, server, runs):
    tab.goto(f"{server.url}/runs/{runs['crash']}")
    banner = tab.locator("#failure")
    assert banner.is_visible()                                   # nothing expanded
    text = banner.inner_text()
    assert CRASH_MESSAGE in text and "RuntimeError" in text
    assert tab.locator("#failure .last-good").inner_text() == "step 5"
    # The timeline shows the crash as a row after the last step.
    row = tab.locator("#timeline details#failure-row")
    assert row.is_visible() and CRASH_MESSAGE in row.inner_text()
    assert tab.locator("#live-facts").inner_text().count("failed") == 1
    shot(tab, "flow-run-crashed")
    tab.locator("#failure a.fork-from-failure").click()
    assert tab.locator("#fork-step").input_value() == "5"
    assert tab.locator("#fork").is_visible()


def test_the_fork_button_works_without_javascript(web, server, runs):
    page = web.get(f"/runs/{runs['crash']}").text
    start = page.index('class="btn fork-from-failure" href="') + len('class="btn fork-from-failure" href="')
    href = page[start:page.index('"', start)].replace("&amp;", "&")
    assert parse_qs(urlsplit(href).query) == {"fork_step": ["5"]}
    preset = web.get(href).text
    assert '<option value="5" selected>' in preset


def test_crashed_run_is_failed_in_the_list_and_the_filter(web, tab, server, runs):
    tab.goto(f"{server.url}/?q={runs['crash']}")
    row = tab.locator(f"tr[data-channel='{runs['crash']}']")
    assert row.get_attribute("data-status") == "failed"
    assert "failed" in row.inner_text() and "crashed after step 5" in row.inner_text()
    tab.goto(f"{server.url}/?status=failed")
    assert tab.locator(f"tr[data-channel='{runs['crash']}']").count() == 1
    assert tab.locator(f"tr[data-channel='{runs['base']}']").count() == 0
    shot(tab, "flow-runs-failed-filter")
    listed = web.get("/?status=failed&format=json").json()["runs"]
    crash = next(r for r in listed if r["channel_id"] == runs["crash"])
    assert crash["failure"]["kind"] == "crashed" and crash["failure"]["last_good_step"] == 5
    assert web.get("/?status=crashed&format=json").status_code == 200


# --- 2. a final state that says failed -------------------------------------------------------

def test_failed_final_state_shows_as_failed(tab, server, runs):
    tab.goto(f"{server.url}/?q={runs['failed']}")
    row = tab.locator(f"tr[data-channel='{runs['failed']}']")
    assert row.get_attribute("data-status") == "failed" and "completed" not in row.inner_text()
    tab.goto(f"{server.url}/runs/{runs['failed']}")
    banner = tab.locator("#failure")
    assert banner.is_visible() and "the report was rejected by the checker" in banner.inner_text()
    assert tab.locator("#failure .last-good").inner_text() == "step 2"
    assert tab.locator("details.step[data-step='3']").get_attribute("class").count("failure") == 1
    shot(tab, "flow-run-failed-state")


# --- 3. the fork form: errors, refresh, the continue snippet --------------------------------

def test_fork_form_error_keeps_values_names_the_field_and_a_refresh_does_not_post(tab, server, runs):
    name = runs["tag"] + "-web"
    tab.goto(f"{server.url}/runs/{runs['crash']}")
    form = tab.locator("form.fork-form")
    assert form.locator("input[name=name]").input_value() == f"{runs['crash']}-fork-1"   # pre-filled
    assert form.locator("select[name=step]").input_value() == "5"                        # last good step
    form.locator("select[name=step]").select_option("4")
    form.locator("input[name=name]").fill(name)
    form.locator("textarea[name=intervention]").fill('{"model": "slow",')
    form.locator("textarea[name=tool_policies]").fill('{"*": "block"}')
    posts = []
    tab.on("request", lambda req: posts.append(req.url) if req.method == "POST" else None)
    with tab.expect_navigation():
        form.locator("button[type=submit]").click()
    assert len(posts) == 1 and "fork_error=" in tab.url
    error = tab.locator("#fork-error")
    assert error.is_visible() and "Intervention" in error.inner_text()
    assert tab.locator("label.has-error textarea[name=intervention]").count() == 1
    assert form.locator("select[name=step]").input_value() == "4"
    assert form.locator("input[name=name]").input_value() == name
    assert form.locator("textarea[name=intervention]").input_value() == '{"model": "slow",'
    assert form.locator("textarea[name=tool_policies]").input_value() == '{"*": "block"}'
    shot(tab, "flow-run-fork-error")
    tab.reload()
    assert len(posts) == 1, "a refresh must not post the form again"
    assert tab.locator("#fork-error").is_visible()
    status, _, _ = http("GET", f"{server.url}/api/v1/channels/{name}/metadata", key=server.key)
    assert status == 404


def test_a_fork_made_on_the_page_continues_with_the_snippet(tab, server, runs, tmp_path):
    name = runs["tag"] + "-cont"
    tab.goto(f"{server.url}/runs/{runs['crash']}")
    form = tab.locator("form.fork-form")
    form.locator("input[name=name]").fill(name)
    form.locator("textarea[name=intervention]").fill('{"model": "slow"}')
    with tab.expect_navigation():
        form.locator("button[type=submit]").click()
    assert urlsplit(tab.url).path == f"/runs/{name}" and "created=1" in tab.url
    card = tab.locator("#continue")
    assert card.is_visible() and "keeps steps 1–5" in card.inner_text()
    assert card.locator(f"a[href='/diff?left={runs['crash']}&right={name}']").count() == 1
    snippet = tab.locator("#continue-snippet").inner_text()
    assert f'AgentSession.resume(client, "{name}"' in snippet
    shot(tab, "flow-run-fork-created")
    program = tmp_path / "continue_fork.py"
    program.write_text(snippet)
    env = {**os.environ, "ACTAE_API_KEY": server.key}
    done = subprocess.run([sys.executable, str(program)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    _, _, step6 = http("GET", f"{server.url}/api/v1/channels/{name}/steps/6", key=server.key)
    assert step6["channel_id"] == name, step6                    # the fork continued at step 5 + 1
    _, _, step5 = http("GET", f"{server.url}/api/v1/channels/{name}/steps/5", key=server.key)
    assert step5["channel_id"] == runs["crash"]                  # steps 1..5 stay the parent's
    _, _, latest = http("GET", f"{server.url}/api/v1/state/{name}", key=server.key)
    assert latest["state"]["resumed_at_step"] == 6 and latest["state"]["b"] == "plan"
    tab.reload()
    assert tab.locator("details.step[data-step='6']").count() == 1


# --- 4. what a step changed ------------------------------------------------------------------

def test_a_step_that_changed_two_keys_lists_exactly_those(tab, server, runs):
    tab.goto(f"{server.url}/runs/{runs['crash']}")
    step3 = tab.locator("details.step[data-step='3']")
    step3.locator(":scope > summary").click()
    paths = step3.locator(".changed-key").evaluate_all("els => els.map(e => e.dataset.path)")
    assert sorted(paths) == ["b", "c"]
    step2 = tab.locator("details.step[data-step='2']")
    assert step2.locator(".changed-key").evaluate_all("els => els.map(e => e.dataset.path)") == ["a"]
    # The state is a coloured, foldable tree whose text is the JSON.
    tree = step3.locator(".state .jtree")
    assert json.loads(tree.inner_text()) == {"a": 2, "b": "plan", "c": [1, 2]}
    assert tree.locator(".jk").count() == 3 and tree.locator("details").count() >= 2
    assert step3.locator(".copy-btn").count() == 1
    assert step3.locator(".c-took").inner_text().endswith(("ms", "s"))
    shot(tab, "flow-run-step-open")


def test_jump_to_a_step_and_filter_by_type(tab, server, runs):
    tab.goto(f"{server.url}/runs/{runs['replay']}")
    tab.fill("input[name=step]", "2")                            # inherited: lives on the parent's page
    with tab.expect_navigation():
        tab.locator("input[name=step]").press("Enter")
    assert urlsplit(tab.url).path == f"/runs/{runs['base']}"
    assert urlsplit(tab.url).fragment.startswith("cursor-")
    tab.goto(f"{server.url}/runs/{runs['crash']}?type=steps")
    types = tab.locator("#timeline details.event").evaluate_all("els => els.map(e => e.dataset.type)")
    assert types == [f"step-{n}" for n in range(1, 6)]


def test_replayed_effect_shows_on_the_fork_timeline(tab, server, runs):
    tab.goto(f"{server.url}/runs/{runs['replay']}")
    row = tab.locator("#timeline details.replayed")
    assert row.count() == 1 and "charge_customer" in row.inner_text() and "inv-9" in row.inner_text()


def test_forks_group_under_their_root_and_shared_names_show_the_id(tab, server, runs):
    tab.goto(server.url + "/")
    group = tab.locator(f"tbody.group[data-root='{runs['base']}']")
    resumed = group.locator(f"tr[data-channel='{runs['resumed']}']")
    assert resumed.count() == 1 and not resumed.is_visible()     # folded until asked for
    group.locator(".group-toggle").click()
    assert resumed.is_visible() and group.locator(f"tr[data-channel='{runs['replay']}']").is_visible()
    assert resumed.locator("a.run-link").inner_text() == runs["resumed"]
    shot(tab, "flow-runs-grouped")


# --- delete ------------------------------------------------------------------------------

def test_delete_a_run_and_its_forks_after_confirming(tab, server, runs):
    doomed = runs["doomed"]
    tab.goto(f"{server.url}/runs/{doomed}")
    with tab.expect_navigation():
        tab.click(f"a[href='/runs/{doomed}/delete']")
    assert f"{doomed}-child" in tab.locator(".doomed").inner_text()
    shot(tab, "flow-delete-confirm")
    with tab.expect_navigation():
        tab.click("form.confirm-form button[type=submit]")
    assert urlsplit(tab.url).path == "/" and "Deleted" in tab.locator("main").inner_text()
    for channel in (doomed, f"{doomed}-child"):
        status, _, _ = http("GET", f"{server.url}/api/v1/channels/{channel}/metadata", key=server.key)
        assert status == 404


def test_delete_without_the_confirmation_deletes_nothing(web, server, runs):
    r = web.post(f"/runs/{runs['failed']}/delete", data={"csrf_token": form_token(web)})
    assert r.status_code == 303 and r.headers["location"] == f"/runs/{runs['failed']}/delete"
    status, _, _ = http("GET", f"{server.url}/api/v1/channels/{runs['failed']}/metadata", key=server.key)
    assert status == 200


# --- gzip, CSP-safe markup -------------------------------------------------------------------

@pytest.mark.parametrize("path, api", [("/", False), ("/runs/{crash}", False), ("/runs/{crash}?format=json", False),
                                       ("/api/v1/events/replay/{crash}", True)])
def test_pages_and_json_are_gzipped(web, server, runs, path, api):
    r = web.get(path.format(**runs), headers={"accept-encoding": "gzip",
                                               **({"x-api-key": server.key} if api else {})})
    assert r.status_code == 200 and r.headers.get("content-encoding") == "gzip"


@pytest.mark.parametrize("path", ["/", "/runs/{crash}", "/runs/{replay}?created=1", "/runs/{crash}/tree",
                                  "/ledger", "/runs/{crash}/delete", "/diff?left={base}&right={replay}"])
def test_pages_have_no_inline_script_or_style(web, server, runs, path):
    html = web.get(path.format(**runs)).text
    assert "style=" not in html and "<style" not in html
    assert " onclick=" not in html and " onload=" not in html
    assert html.count("<script") == html.count('<script src="/static/')
    for form in html.split("<form")[1:]:
        if 'method="post"' in form.split(">")[0]:
            assert 'name="csrf_token"' in form.split("</form>")[0]


# --- 5 and 6. every page at both sizes -------------------------------------------------------

PAGES = {"runs": "/", "runs-search": "/?q={tag}", "run-crashed": "/runs/{crash}", "run-failed": "/runs/{failed}",
         "run-fork": "/runs/{replay}", "run-fork-created": "/runs/{replay}?created=1",
         "tree": "/runs/{replay}/tree", "diff": "/diff?left={base}&right={replay}", "ledger": "/ledger",
         "ledger-filtered": "/ledger?tool=charge_customer&status=completed&since=24h",
         "delete": "/runs/{failed}/delete", "not-found": "/runs/{tag}-missing"}


@pytest.mark.parametrize("size", ["desktop", "phone"])
@pytest.mark.parametrize("name", list(PAGES))
def test_every_page_fits_the_screen(browser, storage, server, runs, visits, name, size):
    viewport = DESKTOP if size == "desktop" else PHONE
    context = browser.new_context(viewport=viewport, storage_state=storage, is_mobile=size == "phone")
    page = context.new_page()
    watch(page, visits)
    page.goto(server.url + PAGES[name].format(**runs))
    for summary in page.locator("details.step > summary").all()[:2]:
        summary.click()
    shot(page, f"flow-{name}-{viewport['width']}")
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= viewport["width"] + 1, f"{name} scrolls sideways at {viewport['width']}px ({width}px)"
    padding = page.evaluate("parseFloat(getComputedStyle(document.querySelector('.topbar-inner')).paddingLeft)")
    brand = page.locator(".brand").bounding_box()
    assert padding >= 8 and brand["x"] >= 8, "the top bar touches the screen edge"
    context.close()


def test_login_page_fits_the_phone(browser, server):
    for viewport in (DESKTOP, PHONE):
        context = browser.new_context(viewport=viewport)
        page = context.new_page()
        page.goto(server.url + "/login")
        shot(page, f"flow-login-{viewport['width']}")
        assert page.evaluate("document.documentElement.scrollWidth") <= viewport["width"] + 1
        context.close()


def test_live_updates_refresh_the_header_and_status(tab, server, runs):
    channel = runs["tag"] + "-live"
    http("POST", f"{server.url}/api/v1/events/record", key=server.key, body={
        "channel_id": channel, "event_type": "step", "payload": {"n": 1}, "step_number": 1})
    tab.goto(f"{server.url}/runs/{channel}")
    assert tab.locator("#failure").count() == 0
    http("POST", f"{server.url}/api/v1/events/record", key=server.key, body={
        "channel_id": channel, "event_type": "run.failed", "payload": {"error": "disk full"}})
    tab.locator("#failure").wait_for(timeout=10_000)             # no reload
    assert "disk full" in tab.locator("#failure").inner_text()
    facts = dict(zip(tab.locator("#live-facts dt").all_text_contents(), tab.locator("#live-facts dd").all_text_contents()))
    assert facts["Status"] == "failed" and facts["Events"] == "2"
    assert httpx.get(f"{server.url}/static/live.js").status_code == 200
