"""Cross-origin attacks on the dashboard, in a real browser (Debian's Chromium driven by Playwright).

A run with 3 steps is made with the real SDK, and a browser context logs in through the real
/login page. An "attacker" site runs on another loopback port (http.server in a thread). Its pages
auto-submit the run page's fork form at the dashboard, and frame the run page. Another port on
127.0.0.1 is another origin but the same site, so the SameSite=Strict session cookie goes along with
both requests. Only the server's origin and CSRF checks, CSP `frame-ancestors 'none'` and
`X-Frame-Options: DENY` can stop them (hardening contract, "Host and origin safety").
The dashboard's own fork form must keep working, and its pages must run without CSP violations.
Screenshots go to `screenshots/security-*.png` (git-ignored).
"""
from __future__ import annotations

import html
import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from conftest import SESSION_COOKIE, http, page_sleep, poll, run_sdk, shot, submit_login

STEPS = ["research", "draft", "review"]
RUN_PAGE_TEXT = ("Fork this run", "Timeline", "Side-effect ledger")  # headings only the run page has


# --- data, built once with the real SDK ---------------------------------------------------

async def _make_run(url: str, key: str, channel: str) -> None:
    from actae_client import ActaeClient, AgentSession

    client = ActaeClient(endpoint=url, api_key=key)
    try:
        state = {"done": 0, "notes": {}}
        session = AgentSession(client, channel, state_fn=lambda: json.loads(json.dumps(state)),
                               snapshot_interval=1, params={"model": "fast"})
        async with session:
            for n, name in enumerate(STEPS, start=1):
                state["done"], state["notes"][name] = n, f"{name} done"
                await session.step(name, input={"n": n}, output={"text": f"{name} done"})
    finally:
        await client.disconnect()


@pytest.fixture(scope="module")
def run_id(server):
    channel = "sec" + uuid.uuid4().hex[:8] + "-run"
    run_sdk(_make_run(server.url, server.key, channel))
    status, _, steps = http("GET", f"{server.url}/api/v1/channels/{channel}/steps/3", key=server.key)
    assert status == 200, steps
    return channel


def _metadata(server, channel: str):
    status, _, body = http("GET", f"{server.url}/api/v1/channels/{channel}/metadata", key=server.key)
    return status, body


def _event_count(server, channel: str) -> int:
    status, _, body = http("GET", f"{server.url}/api/v1/events/replay/{channel}?limit=500", key=server.key)
    assert status == 200, body
    return len(body["events"])


# --- the attacker site: another origin (another port on 127.0.0.1) -------------------------

class AttackerSite:
    """A tiny HTTP server on 127.0.0.1:<free port> serving whatever HTML is put in `.pages`."""

    def __init__(self):
        self.pages: dict[str, str] = {}
        site = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = site.pages.get(urlsplit(self.path).path)
                data = (body or "not found").encode()
                self.send_response(200 if body is not None else 404)
                self.send_header("content-type", "text/html; charset=utf-8")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def attacker(server):
    site = AttackerSite()
    assert urlsplit(site.url).port != urlsplit(server.url).port
    yield site
    site.close()


def _fork_form_page(action: str, fields: dict, auto_submit: bool = True) -> str:
    inputs = "\n".join(f'  <input type="hidden" name="{html.escape(k)}" value="{html.escape(v)}">'
                       for k, v in fields.items())
    script = ("<script>window.addEventListener('load', function () "
              "{ document.getElementById('evil').submit(); });</script>") if auto_submit else ""
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Free prize</title></head>
<body style="font-family: sans-serif; background: #fee">
<h1>You won a prize! (attacker page on another origin)</h1>
<p>This page posts the dashboard's fork form to <code>{html.escape(action)}</code> as soon as it loads.</p>
<form id="evil" method="post" action="{html.escape(action)}">
{inputs}
  <button type="submit">claim</button>
</form>
{script}
</body></html>"""


def _frame_page(src: str) -> str:
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Framing</title></head>
<body style="font-family: sans-serif; background: #eef">
<h1>Attacker page framing the run page</h1>
<p><code>&lt;iframe src="{html.escape(src)}"&gt;</code></p>
<iframe id="victim" src="{html.escape(src)}" width="1200" height="600" style="border: 3px solid red"></iframe>
</body></html>"""


# --- the browser, logged in through the real /login page ------------------------------------

class Console:
    """Console messages, page errors and `securitypolicyviolation` events seen on one page."""

    INIT = """document.addEventListener('securitypolicyviolation', function (e) {
      (window.__csp_violations = window.__csp_violations || []).push(
        e.violatedDirective + ' blocked ' + e.blockedURI + ' at ' + e.sourceFile + ':' + e.lineNumber);
    }, true);"""

    def __init__(self, page):
        self.messages: list[str] = []
        self.errors: list[str] = []
        page.on("console", lambda msg: self.messages.append(f"{msg.type}: {msg.text}"))
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))

    def csp(self) -> list[str]:
        return [m for m in self.messages if "content security policy" in m.lower()]


@pytest.fixture(scope="module")
def context(browser, server):
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    ctx.add_init_script(Console.INIT)
    yield ctx
    ctx.close()


@pytest.fixture(scope="module")
def page(context, server, run_id):
    """One logged-in tab: the login form filled and submitted like a user would."""
    pg = context.new_page()
    pg.console = Console(pg)
    pg.goto(server.url + "/login")
    assert submit_login(pg, server.key).status == 200, pg.content()[:500]
    assert urlsplit(pg.url).path == "/", pg.url
    assert [c for c in context.cookies() if c["name"] == SESSION_COOKIE]
    yield pg
    pg.close()


# --- cross-origin attacks ------------------------------------------------------------------

def test_cross_origin_auto_submitted_fork_form_creates_nothing(browser, page, server, run_id, attacker):
    new_id = "sec" + uuid.uuid4().hex[:8] + "-csrf"
    fork_url = f"{server.url}/runs/{run_id}/fork"
    fields = {"step": "2", "name": new_id, "intervention": json.dumps({"x": 1}),
              "tool_policies": json.dumps({"*": "live"})}
    attacker.pages["/fork.html"] = _fork_form_page(fork_url, fields)
    attacker.pages["/fork-still.html"] = _fork_form_page(fork_url, fields, auto_submit=False)
    events_before = _event_count(server, run_id)

    # What the attacker page looks like (script off, so it does not submit itself).
    still = browser.new_context(viewport={"width": 1280, "height": 800}, java_script_enabled=False)
    try:
        sp = still.new_page()
        sp.goto(attacker.url + "/fork-still.html")
        shot(sp, "security-01-attacker-fork-page")
    finally:
        still.close()

    # The logged-in browser visits the attacker page, which posts the form on load.
    responses, failures = [], []

    def on_response(r):
        if r.url == fork_url:
            responses.append(r)

    def on_failed(req):
        if req.url == fork_url:
            failures.append(req.failure)

    page.on("response", on_response)
    page.on("requestfailed", on_failed)
    try:
        page.goto(attacker.url + "/fork.html")
        poll(lambda: responses or failures, 15, what="the attacker page to post the form", every=0.1,
             sleep=page_sleep(page))
        page.wait_for_url(lambda u: not u.startswith(attacker.url), timeout=15_000)
        page.wait_for_load_state("load")
    finally:
        page.remove_listener("response", on_response)
        page.remove_listener("requestfailed", on_failed)
    shot(page, "security-02-attacker-fork-result")

    status, meta = _metadata(server, new_id)
    assert status == 404, f"a cross-origin form post created run {new_id}: {meta}"
    assert _event_count(server, run_id) == events_before, "the source run changed"
    if responses:
        assert responses[0].status == 403, (
            f"the cross-origin fork POST answered {responses[0].status}, not 403 (now at {page.url})")
    assert urlsplit(page.url).path != f"/runs/{new_id}"
    assert new_id not in page.locator("body").inner_text()


def _frame_text(frame) -> str | None:
    """The visible text of a frame's document, or None when the document cannot be reached."""
    try:
        return frame.evaluate("document.body ? document.body.innerText : ''")
    except Exception:  # a detached or unreachable error frame: nothing shown to read either
        return None


def test_cross_origin_frame_of_the_run_page_shows_nothing(page, server, run_id, attacker):
    run_url = f"{server.url}/runs/{run_id}"
    attacker.pages["/frame.html"] = _frame_page(run_url)
    frame_responses = []

    def on_response(r):
        if r.url == run_url:
            frame_responses.append(r)

    page.on("response", on_response)
    try:
        page.goto(attacker.url + "/frame.html")
        page.wait_for_load_state("load")                 # the frame's own load comes before its parent's
        poll(lambda: frame_responses, 10, what="the framed run page's answer", sleep=page_sleep(page))
    finally:
        page.remove_listener("response", on_response)
    shot(page, "security-03-attacker-frame")

    children = page.main_frame.child_frames
    assert len(children) == 1, [f.url for f in page.frames]
    frame = children[0]
    text = _frame_text(frame)
    shown = [t for t in (run_id, *RUN_PAGE_TEXT) if text and t in text]
    assert not shown, f"the framed run page is visible on another origin (frame at {frame.url}): {shown}"
    assert frame.url in ("about:blank", run_url) or frame.url.startswith("chrome-error://"), frame.url
    # The run page did reach the browser, and said "never frame me".
    assert frame_responses, "the frame's request never got an answer"
    for r in frame_responses:
        headers = r.all_headers()
        assert "frame-ancestors 'none'" in headers.get("content-security-policy", ""), headers
        assert headers.get("x-frame-options", "").upper() == "DENY", headers


def test_run_page_headers_forbid_framing(page, server, run_id):
    response = page.goto(f"{server.url}/runs/{run_id}")
    assert response.status == 200
    headers = response.all_headers()
    csp = headers.get("content-security-policy", "")
    assert "frame-ancestors 'none'" in csp, headers
    assert "form-action 'self'" in csp and "script-src 'self'" in csp, csp
    assert headers.get("x-frame-options", "").upper() == "DENY", headers


# --- the dashboard's own form and pages ----------------------------------------------------

def test_own_fork_form_still_works(page, server, run_id):
    name = "sec" + uuid.uuid4().hex[:8] + "-own"
    page.goto(f"{server.url}/runs/{run_id}")
    page.click("nav.actions a[href='#fork']")  # "fork…" in the run's action bar
    form = page.locator("form.fork-form")
    assert form.is_visible()
    form.locator("select[name=step]").select_option("2")
    form.locator("input[name=name]").fill(name)
    form.locator("textarea[name=intervention]").fill('{"model": "slow"}')
    with page.expect_navigation() as nav:
        form.locator("button[type=submit]").click()
    shot(page, "security-04-own-fork-result")
    assert nav.value.status == 200, page.locator("body").inner_text()[:500]
    assert urlsplit(page.url).path == f"/runs/{name}", page.url
    assert name in page.locator("h1").inner_text()
    assert page.locator("#receipt").is_visible()
    status, meta = _metadata(server, name)
    assert status == 200, meta
    assert meta["parent_channel_id"] == run_id
    assert meta["experiment_metadata"]["forked_at_step"] == 2
    assert meta["experiment_metadata"]["intervention"] == {"model": "slow"}


@pytest.mark.parametrize("what, path", [("runs", "/"), ("run", "/runs/{run}"), ("ledger", "/ledger")])
def test_pages_run_without_csp_violations(page, server, run_id, what, path):
    console = page.console
    console.messages.clear()
    console.errors.clear()
    response = page.goto(server.url + path.format(run=run_id))
    assert response.status == 200
    page.wait_for_load_state("load")
    if what == "run":
        # Use the page's script: the "Fork from step 1" link picks step 1 in the form, and the
        # live refresh (every 3 s) fetches the page once.
        page.locator("details.step[data-step='1'] > summary").click()
        page.click("details.step[data-step='1'] a.fork-here")
        assert page.locator("#fork-step").input_value() == "1"
        page.wait_for_event("requestfinished", lambda request: request.resource_type == "fetch", timeout=15_000)
    # Time must pass here: violations and errors are reported asynchronously, and nothing
    # signals that no more will come.
    page.wait_for_timeout(300)
    stylesheet = page.evaluate("document.styleSheets.length")
    assert stylesheet >= 1, "the stylesheet did not load"
    shot(page, f"security-05-{what}")
    violations = page.evaluate("window.__csp_violations || []")
    assert not console.csp(), console.csp()
    assert not violations, violations
    assert not console.errors, console.errors
