"""Each optional region left out: the server starts without it (tests/without_regions.py builds the
app with every declared region but that one), serves the SDK's record / replay / state / fork /
ledger calls and the dashboard, lists none of the region's features or links, and answers 404 on
every route, page and stream the region declares. On SQLite, and on PostgreSQL on that pass.

The kernel's own pieces of the regions' plug-in (the Region record, its hooks) are checked by
test_module.py; this is the running server.
"""
from __future__ import annotations

import contextlib
import re
import sys
import uuid

import pytest

import actae
from conftest import ROOT, ServerProcess, api, login, using

OPTIONAL = ("many runs", "moving runs", "observability", "fleet", "experiments")
LAUNCHER = [sys.executable, str(ROOT / "tests" / "without_regions.py")]


def region_named(name: str) -> actae.Region:
    return next(region for region in actae.REGIONS if region.name == name)


def concrete(path: str) -> str:
    """A route's template with each `{name}` (or `{name:path}`) as a value no route treats specially."""
    return re.sub(r"\{[^}]+\}", "x-1", path)


def test_the_optional_regions_are_declared():
    assert {region.name for region in actae.REGIONS} >= set(OPTIONAL)


@pytest.fixture(scope="module", params=OPTIONAL)
def without(request, tmp_path_factory):
    name = request.param
    data = tmp_path_factory.mktemp("without-" + name.replace(" ", "-"))
    with ServerProcess(data, command=LAUNCHER, env={"ACTAE_WITHOUT_REGIONS": name}).start() as srv:
        yield name, srv


def sdk_round(srv) -> tuple:
    """A run recorded, its states saved, replayed, forked and a tool call claimed and finished, with
    the SDK; what each call answered."""
    channel, fork = f"kept-{uuid.uuid4().hex[:8]}", f"kept-fork-{uuid.uuid4().hex[:8]}"

    async def body(client):
        for step in (1, 2, 3):
            event = await client.record(channel, "step", {"n": step}, actor="t", step_number=step)
            await client.save_state(channel, event.cursor, {"n": step})
        claim = await client.claim_execution(channel, "pay-1", "charge", {"cents": 5})
        done = await client.complete_execution(claim.execution.id, claim.claim_token, {"ok": True})
        again = await client.claim_execution(channel, "pay-1", "charge", {"cents": 5})
        receipt = await client.fork(channel, fork, 2)
        return (await client.replay(channel, cursor=0), await client.latest_state(channel), done, again,
                receipt, await client.latest_state(fork))
    return channel, fork, using(srv, body)


def test_the_sdk_s_calls_are_served_without_the_region(without):
    name, srv = without
    channel, fork, (events, latest, done, again, receipt, forked) = sdk_round(srv)
    assert [e.payload["n"] for e in events if e.event_type == "step"] == [1, 2, 3], name
    assert latest["state"] == {"n": 3} and done.status == "completed", name
    assert again.status == "replayed" and again.result == {"ok": True}, (name, again)
    assert receipt.child_channel_id == fork and forked["state"] == {"n": 2}, name


def test_the_dashboard_serves_without_the_region(without):
    name, srv = without
    channel, _, _ = sdk_round(srv)
    region = region_named(name)
    with contextlib.closing(login(srv)) as client:
        for path in ("/", f"/runs/{channel}", f"/runs/{channel}/tree", "/ledger", "/diff", "/api", "/keys"):
            page = client.get(path)
            assert page.status_code == 200, (name, path, page.status_code, page.text[:300])
            for link in region.nav:
                assert f'href="{link.path}"' not in page.text, (name, path, link)
        assert client.get(f"/runs/{channel}?format=json").json()["run"]["channel_id"] == channel


def test_the_region_s_routes_pages_and_streams_answer_404(without):
    name, srv = without
    region = region_named(name)
    declared = ([(route.method, route.path) for route in region.routes]
                + [(method, path) for method, path, _ in region.pages]
                + [("GET", endpoint.path) for endpoint in region.endpoints])
    assert declared, f"region {name} declares no route"
    with contextlib.closing(login(srv)) as client:
        for method, path in declared:
            status, _, _ = api(srv, method, concrete(path), raw=b"{}" if method in ("POST", "PUT", "PATCH") else None)
            assert status == 404, (name, method, path, status)
            if not (path.startswith("/api/") or path.startswith("/v1/")):     # a page: as a signed-in browser
                assert client.request(method, concrete(path)).status_code == 404, (name, method, path)


def test_the_instance_lists_none_of_the_region_s_features(without):
    name, srv = without
    status, _, instance = api(srv, "GET", "/api/v1/instance")
    assert status == 200
    assert not set(region_named(name).features) & set(instance["features"]), (name, instance["features"])
    kept = [region for region in actae.REGIONS if region.name != name]
    assert {f for region in kept for f in region.features} <= set(instance["features"]), name
