"""The dashboard in a real browser (Debian's Chromium driven by Playwright) against the real server.

The module builds the fork walkthrough (examples/fork_demo.py) with the real SDK once (a 6-step base run that
charges `inv-1` at step 4, and a fork at step 3 whose charge is blocked), then walks the pages the
way a user would: log in, runs list, run page with step 3's state, fork tree, diff, ledger, a fork
made from the page. Screenshots of every page go to `screenshots/` (git-ignored). Raw HTTP checks
cover what a browser hides: redirects, 404s, escaping, cookie flags, the JSON twins, and a
10,000-step run page.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from urllib.parse import urlsplit

import httpx
import pytest
from markupsafe import escape as markup_escape

from conftest import form_token, http, run_sdk, shot, submit_login, watch

XSS = "<script>alert(1)</script>"
STEPS = ["research", "insights", "risks", "recommendations", "summary", "finalize"]
POLICIES = {"charge_customer": "block", "*": "auto"}


# --- data, built once with the real SDK ---------------------------------------------------

def _step(state: dict, number: int, model: str) -> tuple[str, dict]:
    """Advance the pipeline state by one step; returns (step name, output)."""
    name = STEPS[number - 1]
    text = f"{name} by {model}"
    state["notes"][name] = text
    state["done"] = number
    if name == "recommendations":
        state["decision"] = "ship without review" if model == "fast" else "ship after review"
    if name == "finalize":
        state["status"] = "failed" if model == "fast" else "completed"
        state["report"] = f"report written by {model}"
    return name, {"text": text, "model": model}


async def _build_walkthrough(url: str, key: str, tag: str) -> dict:
    from actae_client import ActaeClient, AgentSession, ForkToolBlockedError

    base, fork, xss = f"{tag}-base", f"{tag}-fork", f"{tag}-xss"
    client = ActaeClient(endpoint=url, api_key=key)
    try:
        state = {"status": "running", "done": 0, "notes": {}}
        session = AgentSession(client, base, state_fn=lambda: json.loads(json.dumps(state)),
                               snapshot_interval=1, params={"model": "fast"})
        async with session:
            for n in range(1, 7):
                if n == 4:
                    claim = await client.claim_execution(base, "inv-1", "charge_customer",
                                                         {"amount_cents": 4900})
                    assert claim.status == "claimed"
                    await client.complete_execution(claim.execution.id, claim.claim_token,
                                                    {"charge_id": "ch_1", "amount_cents": 4900})
                name, output = _step(state, n, "fast")
                await session.step(name, input={"topic": "pricing"}, output=output)
        base_events = len(await client.replay(base, cursor=0, limit=500))

        holder: dict = {}  # the fork's own state, known once the fork hands over its inheritance
        child = await session.fork(3, name=fork, intervention={"model": "slow"}, tool_policies=POLICIES,
                                   state_fn=lambda: json.loads(json.dumps(holder["state"])))
        receipt = child.fork_receipt
        assert receipt.restorable and receipt.requested_cursor == receipt.resolved_cursor
        fstate = holder["state"] = json.loads(json.dumps(child.inherited_state))
        blocked = False
        async with child:
            for n in range(4, 7):
                if n == 4:
                    try:
                        await client.claim_execution(fork, "inv-1", "charge_customer", {"amount_cents": 4900})
                    except ForkToolBlockedError:
                        blocked = True
                name, output = _step(fstate, n, child.intervention["model"])
                await child.step(name, input={"topic": "pricing"}, output=output)
        assert blocked, "the fork's charge must be refused by the block policy"
        assert len(await client.replay(base, cursor=0, limit=500)) == base_events

        evil = {"status": "running", "note": XSS}
        xsession = AgentSession(client, xss, display_name=XSS, state_fn=lambda: dict(evil))
        async with xsession:
            await xsession.step("research", input=XSS, output={"text": XSS})
        return {"tag": tag, "base": base, "fork": fork, "xss": xss, "receipt": receipt,
                "base_events": base_events}
    finally:
        await client.disconnect()


@pytest.fixture(scope="module")
def demo(server):
    tag = "ui" + uuid.uuid4().hex[:8]
    return run_sdk(_build_walkthrough(server.url, server.key, tag))


# --- the browser: one logged-in tab ---------------------------------------------------------

@pytest.fixture(scope="module")
def page(browser, server, demo, visits):
    """One logged-in desktop tab shared by the walkthrough tests, in file order."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = context.new_page()
    watch(pg, visits)
    pg.goto(server.url + "/")
    assert urlsplit(pg.url).path == "/login"
    shot(pg, "01-login")
    submit_login(pg, server.key)
    assert urlsplit(pg.url).path == "/"
    yield pg
    context.close()


# --- browser walkthrough -------------------------------------------------------------------

def test_wrong_key_shows_an_error_and_no_run_data(browser, server, demo, visits):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = context.new_page()
    watch(pg, visits)
    wrong = "sk-" + "x" * 40
    pg.goto(server.url + "/login")
    assert submit_login(pg, wrong).status == 401
    assert pg.locator(".alert").is_visible()
    html = pg.content()
    assert demo["base"] not in html and wrong not in html
    assert pg.locator("input[name=api_key]").count() == 1
    assert not [c for c in context.cookies() if c["name"] == "actae_session"]
    shot(pg, "02-login-wrong-key")
    # Still locked out: the runs list sends the browser back to the login form.
    pg.goto(server.url + "/")
    assert urlsplit(pg.url).path == "/login"
    context.close()


def test_session_cookie_is_httponly_strict_and_not_the_key(page, server):
    cookies = [c for c in page.context.cookies() if c["name"] == "actae_session"]
    assert len(cookies) == 1
    assert cookies[0]["httpOnly"] is True
    assert cookies[0]["sameSite"] == "Strict"
    assert server.key not in cookies[0]["value"]


def test_runs_list_shows_the_runs_and_the_fork(page, server, demo):
    page.goto(server.url + "/")
    assert page.locator("nav a[href='/ledger']").count() == 1
    page.fill("input[name=q]", demo["tag"])
    with page.expect_navigation():
        page.click("form.filters button[type=submit]")
    assert "q=" + demo["tag"] in page.url
    base_row = page.locator(f"tr[data-channel='{demo['base']}']")
    fork_row = page.locator(f"tr[data-channel='{demo['fork']}']")
    assert base_row.count() == 1 and fork_row.count() == 1
    assert "fork of" in fork_row.inner_text() and demo["base"] in fork_row.inner_text()
    # The base run's session completed, but its final state says failed: the list says failed.
    assert base_row.get_attribute("data-status") == "failed" and "failed" in base_row.inner_text()
    shot(page, "03-runs")


def test_run_page_shows_steps_and_the_state_at_step_3(page, server, demo):
    page.goto(server.url + "/")
    page.fill("input[name=q]", demo["tag"])
    with page.expect_navigation():
        page.click("form.filters button[type=submit]")
    with page.expect_navigation():
        page.click(f"a[href='/runs/{demo['base']}']")
    assert urlsplit(page.url).path == f"/runs/{demo['base']}"
    assert demo["base"] in page.locator("h1").inner_text()
    steps = page.locator("details.step")
    assert steps.count() == 6
    step3 = page.locator("details.step[data-step='3']")
    assert step3.count() == 1
    assert step3.get_attribute("id", timeout=1000).startswith("cursor-")
    state = step3.locator(".state .jtree")
    assert not state.is_visible()
    step3.locator(":scope > summary").click()
    assert state.is_visible()
    saved = json.loads(state.inner_text())
    assert saved["status"] == "running" and saved["done"] == 3
    assert set(saved["notes"]) == set(STEPS[:3])
    assert "risks" in step3.locator(":scope > summary").inner_text()
    # The run's own ledger row, and the fork listed below the timeline.
    charge = page.locator("#ledger tr.execution[data-key='inv-1']")
    assert charge.count() == 1 and "completed" in charge.inner_text()
    assert page.locator(f"#forks tr[data-channel='{demo['fork']}']").count() == 1
    shot(page, "04-run-base")


def test_fork_page_shows_receipt_intervention_and_blocked_call(page, server, demo):
    page.goto(f"{server.url}/runs/{demo['fork']}")
    receipt = page.locator("#receipt")
    assert receipt.is_visible()
    text = receipt.inner_text()
    assert "restorable" in text.lower()
    assert demo["receipt"].source_state_sha256 in text
    assert "charge_customer" in text and "block" in text
    assert '"slow"' in page.locator(".intervention").inner_text()
    blocked = page.locator("#ledger tr.blocked-row")
    assert blocked.count() == 1
    assert "charge_customer" in blocked.inner_text() and "block" in blocked.inner_text()
    # The fork's own steps continue at 4; steps 1..3 are inherited, not copied.
    assert sorted(int(s) for s in page.locator("details.step").evaluate_all(
        "els => els.map(e => e.dataset.step)")) == [4, 5, 6]
    assert page.locator(f"a[href^='/diff?left={demo['base']}']").count() >= 1
    shot(page, "05-run-fork")


def test_fork_tree(page, server, demo):
    page.goto(f"{server.url}/runs/{demo['fork']}")
    with page.expect_navigation():
        page.click(f"a[href='/runs/{demo['fork']}/tree']")
    tree = page.locator("ul.tree")
    assert tree.locator(f"a[href='/runs/{demo['base']}']").count() >= 1
    child = tree.locator(f"li:has(> .node-card a[href='/runs/{demo['fork']}'])")
    assert child.count() == 1
    assert "forked after step 3" in child.inner_text()
    assert "current" in (child.get_attribute("class") or "")
    shot(page, "06-tree")


def test_diff_of_base_and_fork(page, server, demo):
    page.goto(f"{server.url}/runs/{demo['fork']}")
    with page.expect_navigation():
        page.click("text=compare with parent")
    assert urlsplit(page.url).path == "/diff"
    rows = page.locator("tr.entry")
    assert rows.count() > 0
    paths = rows.evaluate_all("els => els.map(e => e.dataset.path)")
    tail = ("notes.recommendations", "notes.summary", "notes.finalize", "decision", "status",
            "report", "done")
    assert all(p.startswith(tail) for p in paths), paths
    assert "decision" in paths and "notes.recommendations" in paths
    decision = page.locator("tr.entry[data-path='decision']")
    assert "ship without review" in decision.inner_text() and "ship after review" in decision.inner_text()
    common = page.locator("details.common")
    common.locator(":scope > summary").click()
    ancestor = json.loads(common.locator("pre").inner_text())
    assert ancestor["status"] == "running" and ancestor["done"] == 3
    shot(page, "07-diff")


def test_ledger_shows_the_charge_once_and_the_blocked_attempt(page, server, demo):
    page.goto(server.url + "/")
    with page.expect_navigation():
        page.click("nav a[href='/ledger']")
    shot(page, "08-ledger")
    page.fill("input[name=channel_id]", demo["base"])
    with page.expect_navigation():
        page.click("form.filters button[type=submit]")
    charges = page.locator("#executions tr.execution[data-key='inv-1']")
    assert charges.count() == 1
    assert charges.get_attribute("data-status") == "completed"
    assert "charge_customer" in charges.inner_text()
    page.goto(f"{server.url}/ledger?channel_id={demo['fork']}")
    ran = page.locator(f"#executions tr.execution[data-channel='{demo['fork']}'][data-status='completed']")
    assert ran.count() == 0, "the charge must never run on the fork"
    blocked = page.locator(f"#blocked tr.blocked-row[data-channel='{demo['fork']}']")
    assert blocked.count() == 1
    assert "inv-1" in blocked.inner_text() and "block" in blocked.inner_text()
    shot(page, "09-ledger-fork")


def test_fork_from_the_page(page, server, demo):
    name = demo["tag"] + "-web"
    page.goto(f"{server.url}/runs/{demo['base']}")
    form = page.locator("form.fork-form")
    form.locator("select[name=step]").select_option("2")
    form.locator("input[name=name]").fill(name)
    form.locator("textarea[name=intervention]").fill('{"model": "slow"}')
    form.locator("textarea[name=tool_policies]").fill(json.dumps(POLICIES))
    with page.expect_navigation():
        form.locator("button[type=submit]").click()
    assert urlsplit(page.url).path == f"/runs/{name}"
    assert name in page.locator("h1").inner_text()
    assert page.locator("#receipt").is_visible()
    shot(page, "10-run-forked-from-page")
    status, _, meta = http("GET", f"{server.url}/api/v1/channels/{name}/metadata", key=server.key)
    assert status == 200 and meta["parent_channel_id"] == demo["base"]
    assert meta["tool_policies"] == POLICIES
    _, _, step2 = http("GET", f"{server.url}/api/v1/channels/{demo['base']}/steps/2", key=server.key)
    assert meta["forked_at_cursor"] == step2["cursor"]
    _, _, replay = http("GET", f"{server.url}/api/v1/events/replay/{demo['base']}?limit=500",
                        key=server.key)
    assert len(replay["events"]) == demo["base_events"], "forking appends nothing to the source"


def test_new_events_appear_on_an_open_run_page(page, server, demo):
    name = demo["tag"] + "-live"
    http("POST", f"{server.url}/api/v1/channels/fork", key=server.key,
         body={"source_channel_id": demo["base"], "new_channel_id": name, "at_cursor": 0})
    page.goto(f"{server.url}/runs/{name}")
    assert page.locator("details.event").count() == 1                        # fork.started
    page.locator("details#cursor-1").evaluate("row => row.open = true")      # what the user opened stays open
    status, _, _ = http("POST", f"{server.url}/api/v1/events/record", key=server.key, body={
        "channel_id": name, "event_type": "late.step", "payload": {"n": 1}, "metadata": {"actor": "agent"}})
    assert status == 200
    page.locator("details#cursor-2[data-type='late.step']").wait_for(timeout=10_000)   # no reload
    assert page.locator("details#cursor-1").evaluate("row => row.open")


def test_fork_form_error_is_shown_on_the_run_page(page, server, demo):
    page.goto(f"{server.url}/runs/{demo['base']}")
    form = page.locator("form.fork-form")
    form.locator("input[name=name]").fill(demo["tag"] + "-bad")
    form.locator("textarea[name=intervention]").fill("{not json")
    with page.expect_navigation():
        form.locator("button[type=submit]").click()
    assert urlsplit(page.url).path == f"/runs/{demo['base']}" and "fork_error=" in page.url
    assert page.locator("#fork-error").is_visible()
    assert page.locator("form.fork-form").count() == 1


def test_run_page_at_phone_width(browser, page, server, demo, visits):
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True,
                                  storage_state=page.context.storage_state())
    pg = context.new_page()
    watch(pg, visits)
    pg.goto(f"{server.url}/runs/{demo['fork']}")
    pg.locator("details.step").first.locator(":scope > summary").click()
    width = pg.evaluate("document.documentElement.scrollWidth")
    assert width <= 390 + 1, f"the run page scrolls sideways on a phone ({width}px)"
    shot(pg, "11-run-phone")
    context.close()


def test_hostile_run_is_escaped_in_the_browser(page, server, demo, visits):
    page.goto(f"{server.url}/runs/{demo['xss']}")
    assert XSS in page.locator("h1").inner_text()  # shown as text, not run
    page.locator("details.step").first.locator(":scope > summary").click()
    assert not visits.dialogs


def test_key_never_appears_in_a_url(page, server, visits):
    assert visits.urls, "the browser tests recorded no requests"
    leaked = [u for u in visits.urls if server.key in u]
    assert not leaked


def test_pages_fetch_nothing_from_the_network(page, server, visits):
    """No CDN, no web font: every request the pages made went to this server."""
    outside = {u for u in visits.urls if not u.startswith((server.url + "/", "about:", "data:"))}
    assert not outside
    assert any(u.endswith("/static/style.css") for u in visits.urls)


# --- raw HTTP ------------------------------------------------------------------------------

PAGES = ["/", "/runs/{base}", "/runs/{base}/tree", "/diff?left={base}&right={fork}",
         "/ledger", "/ledger?channel_id={base}"]


@pytest.mark.parametrize("path", PAGES)
def test_unauthenticated_page_redirects_to_login(server, demo, path):
    r = httpx.get(server.url + path.format(**demo), follow_redirects=False)
    assert r.status_code == 303
    assert urlsplit(r.headers["location"]).path == "/login"
    assert demo["base"] not in r.text


def test_login_sets_a_safe_cookie_and_logout_clears_it(server):
    c = httpx.Client(base_url=server.url, follow_redirects=False, headers={"Origin": server.url})
    r = c.post("/login", data={"api_key": server.key})
    assert r.status_code == 303 and urlsplit(r.headers["location"]).path == "/"
    assert server.key not in r.headers["location"]
    cookie = r.headers["set-cookie"]
    assert cookie.startswith("actae_session=")
    assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower()
    assert server.key not in cookie
    assert c.get("/").status_code == 200
    out = c.post("/logout", data={"csrf_token": form_token(c)})
    assert out.status_code == 303 and urlsplit(out.headers["location"]).path == "/login"
    c.cookies.clear()
    assert c.get("/").status_code == 303
    bad = httpx.post(server.url + "/login", data={"api_key": "sk-wrong"}, follow_redirects=False,
                     headers={"Origin": server.url})
    assert bad.status_code == 401 and "actae_session=" not in bad.headers.get("set-cookie", "")


def test_unknown_run_is_404(web):
    r = web.get("/runs/no-such-run-anywhere")
    assert r.status_code == 404
    assert "no-such-run-anywhere" in r.text or "not found" in r.text.lower()


def test_diff_of_an_unknown_run_shows_an_error(web, demo):
    r = web.get(f"/diff?left={demo['base']}&right=no-such-run-anywhere")
    assert r.status_code in (400, 404)
    assert 'class="alert"' in r.text and "no-such-run-anywhere" in r.text


@pytest.mark.parametrize("path", ["/runs/{xss}", "/?q={tag}", "/runs/{xss}/tree",
                                  "/diff?left={base}&right={xss}"])
def test_user_data_is_escaped(web, demo, path):
    r = web.get(path.format(**demo))
    assert r.status_code == 200, r.text[:300]
    assert XSS not in r.text
    if path.startswith("/runs/{xss}") and not path.endswith("tree"):
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in r.text
        assert r.text.count("&lt;script&gt;") >= 3  # display name, payload, state


@pytest.mark.parametrize("form, field", [
    ({"step": "2", "name": "{tag}-bad-json", "intervention": "{not json"}, "intervention"),
    ({"step": "2", "name": "{tag}-bad-policies", "tool_policies": '["block"]'}, "tool_policies"),
    ({"step": "2", "name": "{tag}-bad-policy", "tool_policies": '{"charge_customer": "explode"}'}, "tool_policies"),
    ({"step": "2", "name": "bad name!"}, "name"),
    ({"step": "99", "name": "{tag}-no-step"}, "step"),
    ({"step": "1", "name": "{fork}"}, "name"),  # the name of a run that exists with another definition
])
def test_fork_form_errors_redirect_back_to_the_form(web, demo, form, field):
    data = {**form, "name": form["name"].format(**demo), "csrf_token": form_token(web)}
    r = web.post(f"/runs/{demo['base']}/fork", data=data)
    assert r.status_code == 303, r.text[:300]
    location = r.headers["location"]
    assert urlsplit(location).path == f"/runs/{demo['base']}" and "fork_error=" in location
    page = web.get(location)
    assert page.status_code == 200
    assert 'id="fork-error"' in page.text and 'class="fork-form"' in page.text
    # The field in error is marked, and what was typed is back in the form.
    label = {"step": "select", "name": "input", "intervention": "textarea", "tool_policies": "textarea"}[field]
    marked = (page.text.split('class="has-error"')[1] if field in ("step", "name")
              else page.text.split("has-error")[1])
    assert marked.split(">", 1)[1].lstrip().startswith('<span class="label">')
    assert f'name="{field}"' in marked.split("</label>")[0] and label in marked.split("</label>")[0]
    for key, value in data.items():
        if key != "step":
            assert str(markup_escape(value)) in page.text
    assert web.get(location).status_code == 200        # a refresh shows it again, posting nothing


@pytest.mark.parametrize("path", PAGES + ["/runs/{fork}"])
def test_pages_never_contain_the_key(web, server, demo, path):
    r = web.get(path.format(**demo))
    assert r.status_code == 200
    assert server.key not in r.text


def test_json_twins(web, demo):
    def twin(path):
        path = path.format(**demo)
        r = web.get(path + ("&" if "?" in path else "?") + "format=json")
        assert r.status_code == 200 and "json" in r.headers["content-type"], r.text[:300]
        return r.json()

    base = twin("/runs/{base}")
    assert base["run"]["channel_id"] == demo["base"] and base["receipt"] is None
    assert [s["step_number"] for s in base["steps"]] == [1, 2, 3, 4, 5, 6]
    fork = twin("/runs/{fork}")
    assert fork["receipt"]["restorable"] is True
    assert fork["receipt"]["requested_cursor"] == fork["receipt"]["resolved_cursor"]
    assert fork["run"]["intervention"] == {"model": "slow"}
    assert len(fork["blocked"]) == 1 and fork["blocked"][0]["payload"]["policy"] == "block"
    tree = twin("/runs/{fork}/tree")
    assert tree["root"]["channel_id"] == demo["base"]
    assert any(c["channel_id"] == demo["fork"] for c in tree["root"]["children"])
    diff = twin("/diff?left={base}&right={fork}")["diff"]
    assert diff["common"]["state"]["status"] == "running"
    runs = twin("/?q={tag}")["runs"]
    assert {demo["base"], demo["fork"]} <= {r["channel_id"] for r in runs}
    ledger = twin("/ledger?channel_id={base}")
    assert [x["key_name"] for x in ledger["executions"]] == ["inv-1"]


async def _record_big_run(url: str, key: str, channel: str, steps: int, batch: int = 250):
    from actae_client import ActaeClient

    client = ActaeClient(endpoint=url, api_key=key)
    try:
        for start in range(1, steps + 1, batch):
            await asyncio.gather(*(
                client.record(channel, "step", {"step_number": n, "input": None, "output": {"n": n}},
                              actor="bench", metadata={"step_number": n}, step_number=n)
                for n in range(start, min(start + batch, steps + 1))))
    finally:
        await client.disconnect()


@pytest.mark.slow
def test_a_10000_step_run_page_renders(server, web):
    channel = "ui" + uuid.uuid4().hex[:8] + "-big"
    t0 = time.perf_counter()
    run_sdk(_record_big_run(server.url, server.key, channel, 10_000))
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    r = web.get(f"/runs/{channel}")
    first = time.perf_counter() - t0
    assert r.status_code == 200, r.text[:300]
    assert channel in r.text and 'id="cursor-1"' in r.text
    t0 = time.perf_counter()
    again = web.get(f"/runs/{channel}")
    second = time.perf_counter() - t0
    assert again.status_code == 200
    print(f"\n10,000-step run: recorded in {built:.1f} s; page rendered in {first * 1000:.0f} ms "
          f"(again {second * 1000:.0f} ms), {len(r.content) / 1024:.0f} KiB")


@pytest.mark.parametrize("name, kind", [("style.css", "text/css"), ("live.js", "javascript")])
def test_static_files_are_served(server, name, kind):
    r = httpx.get(f"{server.url}/static/{name}")
    assert r.status_code == 200 and kind in r.headers["content-type"]
    assert "http://" not in r.text and "https://" not in r.text  # nothing fetched from elsewhere


def test_runs_and_ledger_pages_paginate_by_keyset(server, web):
    """60 runs and 60 ledger rows: two pages each, every row exactly once, newest first."""
    tag = "page" + uuid.uuid4().hex[:8]
    channels = [f"{tag}-{i:02d}" for i in range(60)]
    for channel in channels:
        status, _, _ = http("POST", f"{server.url}/api/v1/executions/claim", key=server.key,
                            body={"channel_id": channel, "key_name": "k", "tool_name": "t"})
        assert status == 200

    def walk(first_url, rows_key):
        seen, url, pages = [], first_url, 0
        while url and pages < 100:
            data = web.get(url + ("&" if "?" in url else "?") + "format=json").json()
            seen += [row["channel_id"] for row in data[rows_key] if row["channel_id"].startswith(tag)]
            url, pages = data["next_url"], pages + 1
        return seen, pages

    runs, run_pages = walk(f"/?q={tag}", "runs")
    assert run_pages == 2 and runs == channels[::-1]
    executions, ledger_pages = walk("/ledger", "executions")
    # Claims in the same millisecond tie on time; the page token still lists each row once.
    assert ledger_pages >= 2 and sorted(executions) == channels
