"""Page frictions a new user reported, each checked in Chromium at 1280 px and at 390 px wide, on data
made through the real HTTP API with the SDK:

1. the ledger page's Result / error column is never cut off out of sight (it wraps inside its cell);
2. the Experiments page's "Promote this fork" button looks like the dashboard's other buttons;
3. the runs list's "2 forks" toggle is a disclosure (a summary with a caret), not a checkbox look-alike,
   and still folds the forks away and opens them;
4. on the fork tree picture, no dashed branch line shows through a run's label ("... after step 3 ...");
5. a decided approval shows its decision and when, never "times out ..." (an expired one "timed out").
"""
from __future__ import annotations

import struct
import uuid
import zlib

import pytest

from conftest import DESKTOP, PHONE, http, logged_in, poll, run_sdk, shot, using_async

VIEWPORTS = pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])


def tag() -> str:
    return f"pf{uuid.uuid4().hex[:6]}"


def sdk(server, body):
    """`await body(client)` on a fresh SDK client, off Playwright's loop."""
    return run_sdk(using_async(server, body))


# --- 1. the ledger's Result / error column ---------------------------------------------------

LONG_RESULT = {"charge_id": "ch_" + "7" * 40, "status": "succeeded",
               "receipt_url": "https://payments.example.com/receipts/" + "r" * 60 + "/END-OF-RESULT"}


@pytest.fixture(scope="module")
def ledger_run(server):
    """A run whose ledger has a long idempotency key and tool name, a long result, a long inline string
    and a failure with a long message."""
    channel = f"{tag()}-ledger"

    async def body(client):
        claim = await client.claim_execution(channel, "invoice-2024-000123-customer-8f14e45fceea167a",
                                             "charge_customer_with_a_long_tool_name",
                                             {"customer": "cus_" + "x" * 30, "amount_cents": 4900})
        await client.complete_execution(claim.execution.id, claim.claim_token, LONG_RESULT)
        claim = await client.claim_execution(channel, "email-welcome", "send_email", {"to": "a@example.com"})
        await client.complete_execution(claim.execution.id, claim.claim_token,
                                        "https://mail.example.com/messages/" + "m" * 100 + "/sent")
        claim = await client.claim_execution(channel, "refund-1", "refund", {"amount_cents": 100})
        await client.fail_execution(claim.execution.id, "the payment provider answered 502: " + "upstream " * 12,
                                    claim_token=claim.claim_token, error_type="ProviderError")
    sdk(server, body)
    return channel


@VIEWPORTS
def test_ledger_result_column_is_fully_visible(browser, server, ledger_run, viewport):
    context, page = logged_in(browser, server, viewport)
    try:
        page.goto(f"{server.url}/ledger?channel_id={ledger_run}")
        cells = page.locator("#executions tr.execution td[data-label='Result / error']")
        assert cells.count() == 3
        for summary in cells.locator("details > summary").all():      # the long values, opened
            summary.click()
        shot(page, f"frictions-ledger-{viewport['width']}")
        hidden = cells.evaluate_all("""cells => cells.flatMap(cell => {
            const box = cell.closest('.scroll').getBoundingClientRect(), c = cell.getBoundingClientRect();
            const out = [];
            if (c.left < box.left - 1 || c.right > box.right + 1 || c.right > innerWidth + 1)
                out.push(`cell ${c.left}-${c.right} outside the visible ${box.left}-${box.right}`);
            for (const el of [cell, ...cell.querySelectorAll('*')]) {
                const scrolls = ['auto', 'scroll'].includes(getComputedStyle(el).overflowX);
                if (el.scrollWidth > el.clientWidth + 1 && !scrolls)
                    out.push(`${el.tagName} overflows: ${el.scrollWidth} > ${el.clientWidth}`);
                const r = el.getBoundingClientRect();
                if (r.width && r.right > c.right + 1 && !el.parentElement.closest('pre, .json'))
                    out.push(`${el.tagName} sticks out: ${r.right} > ${c.right}`);
            }
            return out;
        })""")
        assert hidden == [], hidden
        text = cells.nth(0).inner_text() + cells.nth(1).inner_text() + cells.nth(2).inner_text()
        assert "END-OF-RESULT" in text and "/sent" in text and "upstream" in text
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= viewport["width"], f"the page is {width} px wide at {viewport['width']}"
    finally:
        context.close()


# --- 2. the Promote button -------------------------------------------------------------------

BUTTON_LOOK = """b => { const s = getComputedStyle(b);
    return [s.paddingTop, s.paddingRight, s.paddingBottom, s.paddingLeft, s.borderTopWidth, s.borderTopStyle,
            s.borderTopColor, s.borderRadius, s.backgroundColor, s.color, s.fontSize, s.fontWeight].join(' | '); }"""


@pytest.fixture(scope="module")
def experiment(server):
    """A 2-step baseline and two forks of it after step 1, scored, in one experiment (the second wins)."""
    from actae_client import AgentSession
    name = tag()

    async def body(client):
        base = f"{name}-base"
        state = {"answer": None}
        async with AgentSession(client, base, state_fn=lambda: dict(state), snapshot_interval=1) as session:
            for n in (1, 2):
                state["answer"] = f"base-{n}"
                await session.step(f"step-{n}", output={"answer": state["answer"]})
            forks = []
            for model in ("small", "large"):
                fork = await session.fork(1, name=f"{name}-{model}", state_fn=lambda: dict(state),
                                          intervention={"model": model})
                async with fork:
                    state["answer"] = f"{model}-2"
                    await fork.step("step-2", output={"answer": state["answer"]})
                forks.append(f"{name}-{model}")
        group = await client.create_experiment(f"{name} models", baseline_channel_id=base)
        group_id = group["id"] if isinstance(group, dict) else group.id
        for score, fork_id in zip((0.2, 0.8), forks):
            await client.add_experiment_member(group_id, fork_id)
            await client.set_outcome(fork_id, "inconclusive", score=score)
        return {"group": group_id, "forks": forks, "winner": forks[1]}
    return sdk(server, body)


@VIEWPORTS
def test_promote_buttons_look_like_the_dashboard_buttons(browser, server, experiment, viewport):
    context, page = logged_in(browser, server, viewport)
    try:
        page.goto(server.url + "/ledger")
        primary = page.locator("form.filters button.btn").evaluate(BUTTON_LOOK)          # "Filter"
        page.goto(f"{server.url}/experiments/{experiment['group']}")
        quiet = page.locator("form.logout button").evaluate(BUTTON_LOOK)                 # "Log out"
        shot(page, f"frictions-promote-{viewport['width']}")
        looks = {}
        for fork_id in experiment["forks"]:
            button = page.locator(f"tr.figure-promote td[data-label='{fork_id}'] button")
            assert button.inner_text().strip() == "Promote this fork"
            looks[fork_id] = button.evaluate(BUTTON_LOOK)
        loser = next(f for f in experiment["forks"] if f != experiment["winner"])
        assert looks[experiment["winner"]] == primary, (looks, primary)
        assert looks[loser] == quiet, (looks, quiet)             # not the browser's grey default button
    finally:
        context.close()


# --- 3 and 4. a run with two forks: the runs list's toggle, the fork tree's picture ------------

@pytest.fixture(scope="module")
def family(server):
    """A 5-step root with two forks: one after step 3 (with a long name, so that its picture label
    reaches past step 3) that ran steps 4 and 5, one after step 1 that ran step 2."""
    from actae_client import AgentSession
    name = tag()

    async def body(client):
        root = f"{name}-root"
        state = {"n": 0}
        async with AgentSession(client, root, state_fn=lambda: dict(state), snapshot_interval=1) as session:
            for n in range(1, 6):
                state["n"] = n
                await session.step(f"step-{n}", output={"n": n})
            late = await session.fork(3, name=f"{name}-retry-with-the-bigger-model", state_fn=lambda: dict(state))
            async with late:
                for n in (4, 5):
                    await late.step(f"step-{n}", output={"n": n})
            early = await session.fork(1, name=f"{name}-early", state_fn=lambda: dict(state))
            async with early:
                await early.step("step-2", output={"n": 2})
        return {"root": root, "late": f"{name}-retry-with-the-bigger-model", "early": f"{name}-early"}
    return sdk(server, body)


@VIEWPORTS
def test_the_forks_toggle_is_a_disclosure_not_a_checkbox(browser, server, family, viewport):
    context, page = logged_in(browser, server, viewport)
    try:
        page.goto(server.url + "/")
        group = page.locator(f"tbody.group[data-root='{family['root']}']")
        cell = group.locator(f"tr[data-channel='{family['root']}'] td.run-cell")
        assert cell.locator("input").count() == 0, "a checkbox in the run's own cell"
        toggle = cell.locator(".group-toggle")
        assert toggle.count() == 1
        assert toggle.evaluate("t => t.tagName") == "SUMMARY"
        assert toggle.inner_text().strip().startswith("2 forks")
        look = toggle.evaluate("""t => { const s = getComputedStyle(t), r = t.getBoundingClientRect();
            return {appearance: s.appearance, caret: getComputedStyle(t, '::before').content,
                    width: r.width, height: r.height}; }""")
        assert look["appearance"] in ("none", "auto") and "▸" in look["caret"], look
        assert look["width"] > 2 * look["height"], look                # a pill with text, not a square box

        def accessibility():
            """What Chromium tells a screen reader about the toggle: its role, name and expanded state."""
            cdp = context.new_cdp_session(page)
            try:
                handle = cdp.send("Runtime.evaluate", {"expression": (
                    f"document.querySelector(\"tbody.group[data-root='{family['root']}'] .group-toggle\")")})
                nodes = cdp.send("Accessibility.getPartialAXTree", {"objectId": handle["result"]["objectId"],
                                                                    "fetchRelatives": False})["nodes"]
            finally:
                cdp.detach()
            node = next(n for n in nodes if not n.get("ignored"))
            props = {p["name"]: p["value"].get("value") for p in node.get("properties", [])}
            return node["role"]["value"], node["name"]["value"], props
        role, name, props = accessibility()
        assert role in ("DisclosureTriangle", "button") and role != "checkbox", role
        assert name.startswith("2 forks") and family["root"] in name, name
        assert props.get("expanded") is False and props.get("focusable") is True, props
        assert "checked" not in props, props

        late = group.locator(f"tr[data-channel='{family['late']}']")
        assert late.count() == 1 and not late.is_visible()              # folded until asked for
        toggle.click()
        assert late.is_visible() and group.locator(f"tr[data-channel='{family['early']}']").is_visible()
        assert accessibility()[2].get("expanded") is True
        assert "▾" in toggle.evaluate("t => getComputedStyle(t, '::before').content")
        shot(page, f"frictions-forks-toggle-{viewport['width']}")
        toggle.click()
        assert not late.is_visible()
        toggle.focus()                                                  # and from the keyboard
        page.keyboard.press("Enter")
        assert late.is_visible()
    finally:
        context.close()


PANEL = (0xf6, 0xf8, 0xfa)      # the picture's background, --panel
# Where a dashed branch (a vertical line) and a label's box overlap on the page: {text, x, top, bottom}.
CROSSINGS = """() => {
    const boxes = [...document.querySelectorAll('.tree-svg .run-label')].map(t => [t.textContent, t.getBoundingClientRect()]);
    const out = [];
    for (const branch of document.querySelectorAll('.tree-svg .branch')) {
        const b = branch.getBoundingClientRect();
        for (const [text, l] of boxes) {
            const top = Math.max(b.top, l.top), bottom = Math.min(b.bottom, l.bottom);
            if (b.left >= l.left && b.left <= l.right && bottom > top) out.push({text, x: b.left, top, bottom});
        }
    }
    return out;
}"""


def png_pixels(data: bytes) -> tuple[int, int, list]:
    """(width, height, rows of (r, g, b)) of an 8-bit RGB or RGBA, non-interlaced PNG (a screenshot)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    size = 3 if colour == 2 else 4
    raw, stride, rows, previous = zlib.decompress(idat), width * size, [], bytearray(width * size)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - size] if i >= size else 0
            up, corner = previous[i], previous[i - size] if i >= size else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
        rows.append([tuple(line[x * size:x * size + 3]) for x in range(width)])
        previous = line
    return width, height, rows


@VIEWPORTS
def test_no_branch_line_crosses_a_label_on_the_fork_tree(browser, server, family, viewport):
    context, page = logged_in(browser, server, viewport)
    try:
        page.goto(f"{server.url}/runs/{family['late']}/tree")
        shot(page, f"frictions-tree-{viewport['width']}")
        labels = page.locator(".tree-svg .run-label")
        texts = labels.evaluate_all("ls => ls.map(l => l.textContent)")
        assert len(texts) == 3 and any("after step 3" in t for t in texts), texts
        # Where a branch's line and a label's box overlap on the page (the label of the fork after step 3
        # reaches past step 3, so there is at least one such place), the line must not show through.
        crossings = page.evaluate(CROSSINGS)
        assert any("after step 3" in c["text"] for c in crossings), crossings
        # The glyphs made transparent: what remains at each crossing is what the label hides the line with.
        labels.evaluate_all("ls => ls.forEach(l => l.style.setProperty('fill', 'transparent', 'important'))")
        picture = page.locator(".tree-svg")
        picture.scroll_into_view_if_needed()
        crossings = page.evaluate(CROSSINGS)
        seen = []
        for c in crossings:
            clip = {"x": max(0, round(c["x"]) - 2), "y": round(c["top"]) + 2, "width": 5,
                    "height": max(1, round(c["bottom"] - c["top"]) - 4)}
            _, _, rows = png_pixels(page.screenshot(clip=clip, scale="css"))
            off = [px for row in rows for px in row if max(abs(a - b) for a, b in zip(px, PANEL)) > 8]
            if off:
                seen.append((c["text"], clip, sorted(set(off))[:5]))
        assert seen == [], f"a branch line shows through a label: {seen}"
    finally:
        context.close()


# --- 5. decided approvals --------------------------------------------------------------------

@pytest.fixture(scope="module")
def approvals(server):
    """Four requests on one run, each with a timeout: one still pending, one approved, one rejected,
    and one that timed out. {what: the request as GET /api/v1/approvals answers it}."""
    channel = f"{tag()}-approvals"

    async def body(client):
        await client.record(channel, "step", {"step_number": 1, "input": None, "output": {"ok": True}},
                            actor="agent", step_number=1)
        ids = {}
        for what in ("pending", "approved", "rejected"):
            ids[what] = await client.request_approval(channel, summary=f"Request {what[:3]}", timeout_seconds=3600)
        ids["expired"] = await client.request_approval(channel, summary="Request exp", timeout_seconds=1)
        await client.decide_approval(channel, ids["approved"], decision="approved", actor="ops@example.com",
                                     reason="looks right")
        await client.decide_approval(channel, ids["rejected"], decision="rejected", actor="ops@example.com")
        return ids
    ids = sdk(server, body)

    def listed():
        status, _, answer = http("GET", f"{server.url}/api/v1/approvals?channel_id={channel}",
                                 key=server.key)
        assert status == 200, answer
        by_id = {a["request_id"]: a for a in answer["approvals"]}
        return by_id if by_id[ids["expired"]]["status"] == "expired" else None
    by_id = poll(listed, 10, every=0.2, what="the 1-second request to expire")
    return {what: by_id[request] for what, request in ids.items()}


@VIEWPORTS
def test_a_decided_approval_shows_its_decision_not_a_timeout(browser, server, approvals, viewport):
    context, page = logged_in(browser, server, viewport)
    try:
        page.goto(server.url + "/approvals?status=all")
        rows = {what: page.locator(f"tr.approval[data-request='{a['request_id']}']") for what, a in approvals.items()}
        shot(page, f"frictions-approvals-{viewport['width']}")
        text = {what: row.inner_text() for what, row in rows.items()}
        assert "times out" in text["pending"], text["pending"]               # still waiting: when it ends
        for what in ("approved", "rejected"):
            a = approvals[what]
            assert a["status"] == "decided" and a["timeout_at"] and a["decided_at"], a
            assert rows[what].get_attribute("data-status") == "decided"
            assert "times out" not in text[what], text[what]
            waiting = rows[what].locator("td[data-label='Waiting']")       # the decision, where the timeout was
            assert what in waiting.inner_text(), waiting.inner_text()
            assert waiting.locator(f"time[datetime='{a['decided_at']}']").count() == 1, waiting.inner_html()
        assert approvals["expired"]["status"] == "expired"
        assert "times out" not in text["expired"] and "timed out" in text["expired"], text["expired"]
        page.goto(server.url + "/approvals?status=decided")
        for what in ("approved", "rejected"):
            row = page.locator(f"tr.approval[data-request='{approvals[what]['request_id']}']")
            assert row.count() == 1 and "times out" not in row.inner_text()
    finally:
        context.close()
