"""Every dashboard page fits a phone (390×844) and a desktop (1280×800), in real Chromium.

One gateway with one remote server registered on it (so the fleet page has two instances) gets
data that makes every page non-trivial: a base run with steps and a ledger charge, a fork of it
whose charge a policy blocks, a crashed run, two pending approval requests and a decided one, and a
second API key with long patterns and an expiry. Every page the server serves (the runs list, run
pages, the fork tree, the delete confirmation, the diff, the ledger, the API reference, keys, fleet,
the bulk fork preview, approvals, storage, the login page and the error page) is then opened at
both widths: the page must not scroll sideways, no table may scroll inside its box, and every
visible action (buttons, submit inputs, link-styled actions, form fields) must lie inside the
viewport's width. A full-page screenshot of each goes to the test's tmp_path (named in the
assertion messages). The base template links an SVG favicon from /static.
"""
from __future__ import annotations

import json
import uuid

import pytest

from conftest import DESKTOP, PHONE, http, login, run_sdk, start_fleet, submit_login

SIZES = {"phone": PHONE, "desktop": DESKTOP}

# Everything a user can act on: buttons, submit inputs, the link-styled actions the templates use
# (.btn / .btn-quiet links, the JSON "twin" links, page action bars, filter "Clear" links, delete
# links) and the form fields themselves.
ACTIONS = ("button, input:not([type=hidden]), select, textarea, a.btn, a.btn-quiet, a.twin, "
           ".actions a, .bulk-bar a, a.clear, a.danger-link")

# `width` is the viewport asked for: a mobile browser widens window.innerWidth to fit a page that
# overflows (it zooms out), so that is checked too, against the same width.
MEASURE = """([selector, width]) => {
  const outside = [];
  for (const el of document.querySelectorAll(selector)) {
    const box = el.getBoundingClientRect();
    const style = getComputedStyle(el);
    if ((box.width === 0 && box.height === 0) || style.visibility === "hidden" || el.closest(".sr-only")) continue;
    if (box.left < -0.5 || box.right > width + 0.5) {
      outside.push(`${el.tagName.toLowerCase()}.${el.className || "-"} "${(el.textContent || el.name || "").trim().slice(0, 30)}"`
                   + ` at ${Math.round(box.left)}..${Math.round(box.right)}`);
    }
  }
  const scrolled = [];
  for (const box of document.querySelectorAll(".scroll")) {
    if (box.scrollWidth > box.clientWidth + 1) {
      const table = box.querySelector("table");
      scrolled.push(`${table ? "table." + table.className.replace(/ /g, ".") : "div.scroll"}`
                    + ` ${box.scrollWidth}px in ${box.clientWidth}px`);
    }
  }
  return {width, innerWidth: window.innerWidth, scrollWidth: document.documentElement.scrollWidth, outside, scrolled};
}"""


# --- data -----------------------------------------------------------------------------------

async def _build(url: str, key: str, tag: str) -> dict:
    from actae_client import ActaeClient, AgentSession, ForkToolBlockedError

    names = {"tag": tag, "base": f"{tag}-customer-refund-pipeline-base",
             "fork": f"{tag}-customer-refund-pipeline-fork-after-step-2",
             "crash": f"{tag}-nightly-report-crashed", "missing": f"{tag}-no-such-run"}
    client = ActaeClient(endpoint=url, api_key=key)
    try:
        state = {"status": "running", "done": 0, "notes": {}}
        base = AgentSession(client, names["base"], state_fn=lambda: json.loads(json.dumps(state)),
                            snapshot_interval=1, params={"model": "fast", "customer": "cus_0123456789abcdef"},
                            display_name="Customer refund pipeline")
        async with base:
            for n in range(1, 5):
                if n == 3:
                    claim = await client.claim_execution(names["base"], "refund-inv-0001", "charge_customer",
                                                         {"amount_cents": 4900, "currency": "EUR"})
                    await client.complete_execution(claim.execution.id, claim.claim_token,
                                                    {"charge_id": "ch_1NvXq2LkdIwHu7ix0a1b2c3d"})
                state["done"] = n
                state["notes"][f"step_{n}"] = f"note number {n} " * 3
                await base.step(f"step-{n}", input={"n": n}, output={"ok": True, "n": n})

        holder: dict = {}
        fork = await base.fork(2, name=names["fork"], intervention={"model": "slow"},
                               tool_policies={"charge_customer": "block", "*": "auto"},
                               state_fn=lambda: json.loads(json.dumps(holder["state"])))
        holder["state"] = json.loads(json.dumps(fork.inherited_state))
        async with fork:
            try:
                await client.claim_execution(names["fork"], "refund-inv-0001", "charge_customer",
                                             {"amount_cents": 4900, "currency": "EUR"})
            except ForkToolBlockedError:
                pass
            holder["state"]["done"] = 3
            await fork.step("step-3", input={"n": 3}, output={"ok": True, "model": "slow"})

        crash = AgentSession(client, names["crash"], state_fn=lambda: {"pages": 2}, snapshot_interval=1)
        with pytest.raises(RuntimeError):
            async with crash:
                await crash.step("fetch", output={"pages": 2})
                await crash.step("render", output={"pages": 2})
                raise RuntimeError("the renderer ran out of memory while drawing page 3 of the report")

        names["pending"] = await client.request_approval(
            names["base"], summary="Refund 49 EUR to cus_0123456789abcdef",
            details={"amount_cents": 4900, "customer": "cus_0123456789abcdef", "why": "double charge"})
        names["pending2"] = await client.request_approval(names["crash"], summary="Re-run the nightly report")
        names["decided"] = await client.request_approval(names["fork"], summary="Send the contract")
        await client.decide_approval(names["fork"], names["decided"], decision="rejected", actor="reviewer",
                                     reason="the contract still has the old prices")
    finally:
        await client.disconnect()
    return names


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with start_fleet(tmp_path_factory.mktemp("phone"), remotes=1, names="remote-eu-west-{n}") as f:
        yield f


@pytest.fixture(scope="module")
def data(fleet):
    srv = fleet.gateway
    names = run_sdk(_build(srv.url, srv.key, f"ph{uuid.uuid4().hex[:6]}"))
    status, _, created = http("POST", srv.url + "/api/v1/keys", key=srv.key, body={
        "name": "ci-reader-for-the-customer-refund-pipelines",
        "scopes": {"read": ["customer-refund-*", "nightly-report-*"], "write": ["customer-refund-*"],
                   "delete": ["customer-refund-pipeline-base"]},
        "expires_in_days": 30})
    assert status == 200, created
    return names


@pytest.fixture(scope="module")
def storage(browser, fleet, data):
    """A logged-in session (the browser's storage state), signed in through the login form."""
    context = browser.new_context(viewport=DESKTOP)
    page = context.new_page()
    page.goto(fleet.gateway.url + "/login")
    submit_login(page, fleet.gateway.key)
    state = context.storage_state()
    context.close()
    return state


PAGES = {
    "runs": "/", "runs-search": "/?q={tag}", "run": "/runs/{base}", "run-fork": "/runs/{fork}",
    "run-crashed": "/runs/{crash}", "tree": "/runs/{fork}/tree", "delete": "/runs/{base}/delete",
    "diff": "/diff?left={base}&right={fork}", "ledger": "/ledger", "api": "/api", "keys": "/keys",
    "fleet": "/fleet", "bulk-fork": "/forks/bulk?run={crash}&run={base}", "approvals": "/approvals",
    "approvals-all": "/approvals?status=all", "storage": "/storage", "error": "/runs/{missing}",
    "login": "/login",
}


# --- the pages --------------------------------------------------------------------------------

@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("name", list(PAGES))
def test_every_page_fits_the_screen_with_its_actions_in_reach(browser, fleet, data, storage, tmp_path, name, size):
    viewport = SIZES[size]
    context = browser.new_context(viewport=viewport, is_mobile=size == "phone",
                                  storage_state=None if name == "login" else storage)
    page = context.new_page()
    try:
        answer = page.goto(fleet.gateway.url + PAGES[name].format(**data))
        assert answer.status == (404 if name == "error" else 200), (name, answer.status)
        for summary in page.locator("details.step > summary").all()[:1]:
            summary.click()                     # an opened step: panes, state tree, copy button
        picture = tmp_path / f"{name}-{viewport['width']}.png"
        page.screenshot(path=str(picture), full_page=True)
        seen = page.evaluate(MEASURE, [ACTIONS, viewport["width"]])
        where = f"{name} ({PAGES[name]}) at {viewport['width']}px, screenshot {picture}"
        problems = (([f"the page is {seen['scrollWidth']}px wide"] if seen["scrollWidth"] > seen["width"] else [])
                    + ([f"window.innerWidth is {seen['innerWidth']}px"] if seen["innerWidth"] > seen["width"] else [])
                    + [f"scrolls sideways: {s}" for s in seen["scrolled"]]
                    + [f"outside the screen: {o}" for o in seen["outside"]])
        assert not problems, f"{where}:\n  " + "\n  ".join(problems)
        icon = page.evaluate("() => [...document.querySelectorAll('link[rel=icon]')].map(l => l.getAttribute('href'))")
        assert icon == ["/static/favicon.svg"], f"{where}: icon links {icon}"
    finally:
        context.close()


def test_the_approve_and_reject_buttons_are_on_the_phone_screen(browser, fleet, data, storage, tmp_path):
    context = browser.new_context(viewport=PHONE, is_mobile=True, storage_state=storage)
    page = context.new_page()
    try:
        page.goto(fleet.gateway.url + "/approvals")
        row = page.locator(f"tr.approval[data-request='{data['pending']}']")
        picture = tmp_path / "approvals-row.png"
        page.screenshot(path=str(picture), full_page=True)
        for label in ("Approve", "Reject"):
            button = row.locator("button", has_text=label)
            assert button.is_visible(), picture
            box = button.bounding_box()
            assert box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"], (label, box, str(picture))
            assert box["width"] >= 44 or box["height"] >= 30, (label, box, "too small to tap")
        reason = row.locator("input[name=reason]").bounding_box()
        assert reason["width"] >= 150, (reason, "the reason field is too narrow to type in", str(picture))
    finally:
        context.close()


def test_the_favicon_is_an_svg_in_static(fleet):
    status, headers, body = http("GET", fleet.gateway.url + "/static/favicon.svg")
    assert status == 200 and headers["content-type"].startswith("image/svg+xml"), (status, headers)
    assert body.lstrip().startswith("<svg") and "<script" not in body and len(body) < 2000
    c = login(fleet.gateway)
    try:
        for path in ("/", "/keys", "/login"):
            assert '<link rel="icon" href="/static/favicon.svg" type="image/svg+xml">' in c.get(path).text, path
    finally:
        c.close()
