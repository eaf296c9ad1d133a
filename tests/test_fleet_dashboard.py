"""The Fleet page in a real browser (Debian's Chromium driven by Playwright).

A gateway with two remotes, one of them then stopped: the admin logs in, follows the nav's Fleet
link and sees each instance with its reachability, version, backend and run count (each read back
from that server's own API), and a link to its dashboard; the stopped one shows as unreachable.
A key that is not admin gets 403 and no Fleet link.
"""
from __future__ import annotations

import uuid
from urllib.parse import urlsplit

import pytest

from conftest import cli, http, login, shot, start_fleet, submit_login


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A gateway with a run of its own and two remotes (3 runs and 1 run), the second one then stopped."""
    with start_fleet(tmp_path_factory.mktemp("fd"), 2, names="remote-{n}", add_args=["--timeout", "1"]) as f:
        for remote, runs in zip(f.remotes, (3, 1)):
            for r in range(runs):
                http("POST", remote.url + "/api/v1/events/record", key=remote.key,
                     body={"channel_id": f"run-{r}-{uuid.uuid4().hex[:6]}", "event_type": "x", "payload": {}})
        http("POST", f.gateway.url + "/api/v1/events/record", key=f.gateway.key,
             body={"channel_id": "local-run", "event_type": "x", "payload": {}})
        f.remotes[1].stop()
        yield f


def test_the_fleet_page_shows_each_instance(browser, fleet):
    gateway, remotes, ids = fleet.gateway, fleet.remotes, fleet.ids
    own = http("GET", gateway.url + "/api/v1/instance", key=gateway.key)[2]
    runs = {ids[0]: len(http("GET", gateway.url + "/api/v1/channels", key=gateway.key)[2]["channels"]),
            ids[1]: len(http("GET", remotes[0].url + "/api/v1/channels", key=remotes[0].key)[2]["channels"])}
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.goto(gateway.url + "/login")
    submit_login(page, gateway.key)
    page.wait_for_url(gateway.url + "/")
    page.click("nav >> text=Fleet")
    page.wait_for_url(gateway.url + "/fleet")
    shot(page, "fleet")
    rows = {ids[n]: page.locator(f"tr[data-instance='{ids[n]}']") for n in range(3)}
    for n in (0, 1):
        text = rows[ids[n]].inner_text()
        assert "reachable" in text and "unreachable" not in text, text
        assert own["version"] in text and own["backend"] in text
        assert rows[ids[n]].locator("td.runs").inner_text().strip() == str(runs[ids[n]])
    assert "this server" in rows[ids[0]].inner_text()
    assert rows[ids[1]].locator("a").get_attribute("href") == remotes[0].url + "/"
    assert rows[ids[0]].locator("a").get_attribute("href") == "/"
    down = rows[ids[2]].inner_text()
    assert "unreachable" in down and "cannot reach" in down, down
    assert rows[ids[2]].locator("td.runs").inner_text().strip() == "—"
    page.click(f"tr[data-instance='{ids[0]}'] a")
    assert urlsplit(page.url).path == "/"
    context.close()


def test_the_fleet_page_is_for_admins(fleet):
    gateway = fleet.gateway
    out = cli("key", "create", "--name", "reader", "--read", "*", data_dir=gateway).stdout
    key = next(line.split()[2] for line in out.splitlines() if line.startswith("API key:"))
    c = login(gateway, key=key)
    try:
        assert c.get("/fleet").status_code == 403
        assert 'href="/fleet"' not in c.get("/").text
        twin = c.get("/fleet", params={"format": "json"})
        assert twin.status_code == 403 and twin.json()["status"] == "forbidden"
    finally:
        c.close()
