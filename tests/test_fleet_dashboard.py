"""The Fleet page in a real browser (Debian's Chromium driven by Playwright).

A gateway with two remotes, one of them then stopped: the admin logs in, follows the nav's Fleet
link and sees each instance with its reachability, version, backend and run count (each read back
from that server's own API), and a link to its dashboard; the stopped one shows as unreachable.
A key that is not admin gets 403 and no Fleet link.
"""
from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from conftest import ROOT, ServerProcess, http

CHROMIUM = os.environ.get("ACTAE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SHOTS = ROOT / "screenshots"


def actae_cli(srv: ServerProcess, *args: str) -> str:
    command = [sys.executable, str(ROOT / "actae.py"), *args, "--data-dir", str(srv.data_dir)]
    if srv.database:
        command += ["--database", srv.database]
    done = subprocess.run(command, capture_output=True, text=True, env=srv.env, cwd=str(ROOT), timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    gateway = ServerProcess(tmp_path_factory.mktemp("fd-g")).start()
    remotes = [ServerProcess(tmp_path_factory.mktemp(f"fd-r{n}")).start() for n in (1, 2)]
    try:
        for n, (remote, runs) in enumerate(zip(remotes, (3, 1)), 1):
            actae_cli(gateway, "instance", "add", remote.url, "--key", remote.key, "--name", f"remote-{n}",
                      "--timeout", "1")
            for r in range(runs):
                http("POST", remote.url + "/api/v1/events/record", key=remote.key,
                     body={"channel_id": f"run-{r}-{uuid.uuid4().hex[:6]}", "event_type": "x", "payload": {}})
        http("POST", gateway.url + "/api/v1/events/record", key=gateway.key,
             body={"channel_id": "local-run", "event_type": "x", "payload": {}})
        ids = [http("GET", s.url + "/api/v1/instance", key=s.key)[2]["instance_id"] for s in (gateway, *remotes)]
        remotes[1].stop()
        yield {"gateway": gateway, "remotes": remotes, "ids": ids}
    finally:
        for srv in (gateway, *remotes):
            srv.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail(f"no Chromium at {CHROMIUM}: .ci/run installs Debian's chromium")
        pytest.skip(f"no Chromium at {CHROMIUM}")
    SHOTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


def test_the_fleet_page_shows_each_instance(browser, fleet):
    gateway, remotes, ids = fleet["gateway"], fleet["remotes"], fleet["ids"]
    own = http("GET", gateway.url + "/api/v1/instance", key=gateway.key)[2]
    runs = {ids[0]: len(http("GET", gateway.url + "/api/v1/channels", key=gateway.key)[2]["channels"]),
            ids[1]: len(http("GET", remotes[0].url + "/api/v1/channels", key=remotes[0].key)[2]["channels"])}
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.goto(gateway.url + "/login")
    page.fill("input[name=api_key]", gateway.key)
    page.click("button[type=submit]")
    page.wait_for_url(gateway.url + "/")
    page.click("nav >> text=Fleet")
    page.wait_for_url(gateway.url + "/fleet")
    page.screenshot(path=str(SHOTS / "fleet.png"), full_page=True)
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
    gateway = fleet["gateway"]
    out = actae_cli(gateway, "key", "create", "--name", "reader", "--read", "*")
    key = next(line.split()[2] for line in out.splitlines() if line.startswith("API key:"))
    with httpx.Client(base_url=gateway.url, follow_redirects=False, headers={"Origin": gateway.url}) as c:
        assert c.post("/login", data={"api_key": key}).status_code == 303
        assert c.get("/fleet").status_code == 403
        assert 'href="/fleet"' not in c.get("/").text
        twin = c.get("/fleet", params={"format": "json"})
        assert twin.status_code == 403 and twin.json()["status"] == "forbidden"
