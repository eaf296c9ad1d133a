"""Forks a worker runs: a fork made with `hand_off` (the API, the dashboard's fork form, bulk fork, MCP)
is announced as a `fork.job` event on actae.fork-jobs, read by the consumer group actae.fork-workers;
examples/fork_worker.py claims it, resumes the fork with AgentSession.resume and fork_demo's step
function, and acknowledges it. The hand-off's state (waiting, claimed, running, done, failed) is read
from the group's reservation and the fork's run, over the API and live on the fork's page. A worker
killed mid-job (after its charge, before it recorded the step) loses the job when its lease runs out;
the next worker resumes the fork, and the charge is not made twice.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import (DESKTOP, PHONE, ROOT, api, logged_in, new_key, page_sleep, poll, record, run_example)
from test_mcp import answer_of, with_session

JOBS, GROUP = "actae.fork-jobs", "actae.fork-workers"


@pytest.fixture
def tag(unique):
    return unique()


@pytest.fixture
def base(server, tag):
    """A failed run of fork_demo's pipeline (six steps; step 4 charged the customer): `<name>-base`."""
    proc = run_example(server, "fork_demo.py", "--name", tag)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return f"{tag}-base"


def boundary(server, run: str, step: int) -> dict:
    status, _, plan = api(server, "POST", "/api/v1/forks/plan", body={"source_channel_id": run, "at_step": step})
    assert status == 200, plan
    return plan["boundary"]


def fork(server, run: str, name: str, *, step: int = 3, hand_off: bool = True, model: str = "slow", key=None) -> dict:
    """A fork of `run` after `step`, as the SDK makes one, with the intervention's model (and hand_off)."""
    at = boundary(server, run, step)
    body = {"source_channel_id": at["channel_id"], "new_channel_id": name, "at_cursor": at["requested_cursor"],
            "experiment_metadata": {"status": "created", "forked_at_step": step, "intervention": {"model": model}},
            **({"hand_off": True} if hand_off else {})}
    status, _, receipt = api(server, "POST", "/api/v1/channels/fork", body=body, **({"key": key} if key else {}))
    assert status == 200, receipt
    return receipt


def hand_off(server, channel: str, key=None) -> dict:
    status, _, answer = api(server, "GET", f"/api/v1/channels/{channel}/hand-off", **({"key": key} if key else {}))
    assert status == 200, answer
    return answer


def jobs_for(server, channel: str) -> list:
    status, _, answer = api(server, "GET", f"/api/v1/events/replay/{JOBS}?limit=1000")
    assert status == 200, answer
    return [e for e in answer["events"] if e["type"] == "fork.job" and e["payload"]["fork_channel_id"] == channel]


def group_call(server, action: str, consumer: str, **body) -> dict:
    status, _, answer = api(server, "POST", f"/api/v1/groups/{GROUP}/{action}", body={"consumer_id": consumer, **body})
    assert status == 200, answer
    return answer


def claim_until(server, consumer: str, channel: str) -> dict:
    """Claim one job at a time as `consumer`, acknowledging the others', until it holds `channel`'s job."""
    group_call(server, "join", consumer, lease_seconds=60)
    for _ in range(1000):
        work = group_call(server, "work", consumer, limit=1)
        assert work["events"], f"no job of {channel} to claim"
        event = work["events"][0]
        if event["payload"]["fork_channel_id"] == channel:
            return event
        group_call(server, "ack", consumer, cursor=event["cursor"])
    raise AssertionError("the job was never claimed")


def drain(server, consumer: str) -> None:
    """Every job waiting now claimed and acknowledged by `consumer`: the next one a worker claims is the
    test's own (the group is the server's, shared by this module's tests)."""
    group_call(server, "join", consumer, lease_seconds=60)
    while (work := group_call(server, "work", consumer, limit=1000))["events"]:
        group_call(server, "ack", consumer, cursor=work["events"][-1]["cursor"])


def start_worker(server, worker: str, *flags) -> subprocess.Popen:
    env = {**os.environ, "ACTAE_URL": server.url, "ACTAE_API_KEY": server.key}
    return subprocess.Popen([sys.executable, str(ROOT / "examples" / "fork_worker.py"), "--worker-id", worker, *flags],
                            env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(proc: subprocess.Popen, timeout: float = 120) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


def own_steps(server, channel: str) -> list:
    status, _, answer = api(server, "GET", f"/api/v1/events/replay/{channel}?limit=1000")
    assert status == 200, answer
    return [e["step_number"] for e in answer["events"] if e.get("step_number")]


def test_a_handed_off_fork_is_a_job_and_its_state_follows_the_group_and_the_run(server, base, tag):
    fork(server, base, f"{tag}-f")
    state = hand_off(server, f"{tag}-f")
    assert (state["state"], state["worker"], state["jobs_channel_id"], state["group_id"]) == (
        "waiting", None, JOBS, GROUP), state
    [job] = jobs_for(server, f"{tag}-f")
    assert job["cursor"] == state["job_cursor"] and job["payload"] == {
        "fork_channel_id": f"{tag}-f", "source_channel_id": base, "forked_at_step": 3}
    # the fork says it was handed off, in its own first event
    status, _, replayed = api(server, "GET", f"/api/v1/events/replay/{tag}-f?limit=5")
    assert replayed["events"][0]["type"] == "fork.started" and replayed["events"][0]["payload"]["hand_off"] is True

    claim_until(server, f"{tag}-w", f"{tag}-f")
    state = hand_off(server, f"{tag}-f")
    assert (state["state"], state["worker"]) == ("claimed", f"{tag}-w"), state
    record(server, f"{tag}-f", "recommendations", {"step_number": 4}, step=4)
    assert hand_off(server, f"{tag}-f")["state"] == "running"
    status, _, _ = api(server, "PUT", f"/api/v1/channels/{tag}-f/metadata",
                       body={"experiment_metadata": {"status": "completed"}})
    assert status == 200
    group_call(server, "ack", f"{tag}-w", cursor=job["cursor"])
    state = hand_off(server, f"{tag}-f")
    assert state["state"] == "done" and "completed" in state["detail"], state


def test_a_job_let_go_unfinished_is_failed_and_may_be_handed_off_again(server, base, tag):
    fork(server, base, f"{tag}-f")
    job = claim_until(server, f"{tag}-w", f"{tag}-f")
    group_call(server, "ack", f"{tag}-w", cursor=job["cursor"])
    state = hand_off(server, f"{tag}-f")
    assert state["state"] == "failed" and "without completing" in state["detail"], state
    status, _, again = api(server, "POST", f"/api/v1/channels/{tag}-f/hand-off")
    assert status == 200 and again["state"] == "waiting" and again["job_cursor"] > job["cursor"], again
    # while that job is not over, handing off again answers it: one job at a time
    status, _, same = api(server, "POST", f"/api/v1/channels/{tag}-f/hand-off", body={})
    assert status == 200 and same["job_cursor"] == again["job_cursor"], same
    assert len(jobs_for(server, f"{tag}-f")) == 2


def test_a_fork_made_without_hand_off_announces_nothing_until_handed_off(server, base, tag):
    fork(server, base, f"{tag}-f", hand_off=False)
    assert jobs_for(server, f"{tag}-f") == []
    status, _, answer = api(server, "GET", f"/api/v1/channels/{tag}-f/hand-off")
    assert status == 404 and "not handed off" in answer["error"], answer
    status, _, answer = api(server, "POST", f"/api/v1/channels/{tag}-f/hand-off")
    assert status == 200 and answer["state"] == "waiting", answer
    assert len(jobs_for(server, f"{tag}-f")) == 1
    # a run that is no fork is refused; a hand-off never writes to it
    before = api(server, "GET", f"/api/v1/events/cursor/{base}")[2]
    status, _, answer = api(server, "POST", f"/api/v1/channels/{base}/hand-off")
    assert status == 409 and answer["status"] == "not_a_fork", answer
    assert api(server, "GET", f"/api/v1/events/cursor/{base}")[2] == before


def test_the_scope_rule_holds_for_the_hand_off(server, base, tag):
    fork(server, base, f"{tag}-f")
    other = new_key(server, read=[f"{tag}-other*"], write=[f"{tag}-other*"])
    for method in ("GET", "POST"):
        status, _, answer = api(server, method, f"/api/v1/channels/{tag}-f/hand-off", key=other)
        assert status in (403, 404) and "job_cursor" not in answer and JOBS not in json.dumps(answer), answer
    reader = new_key(server, read=[f"{tag}-*"])
    assert hand_off(server, f"{tag}-f", key=reader)["state"] == "waiting"
    status, _, answer = api(server, "POST", f"/api/v1/channels/{tag}-f/hand-off", key=reader)
    assert status == 403, answer
    # a fork with hand_off needs what any fork needs: writing the source and the new run
    status, _, answer = api(server, "POST", "/api/v1/channels/fork", key=reader, body={
        "source_channel_id": base, "new_channel_id": f"{tag}-g", "at_cursor": 1, "hand_off": True})
    assert status == 403 and jobs_for(server, f"{tag}-g") == [], answer


def test_bulk_fork_and_mcp_hand_off_their_forks(server, base, tag):
    status, _, answer = api(server, "POST", "/api/v1/forks/bulk", body={
        "filter": {"channel_ids": [base], "include_handled": True}, "name": "{channel_id}-bulk", "hand_off": True, "intervention": {"model": "slow"}})
    assert status == 200 and [f["channel_id"] for f in answer["forks"]] == [f"{base}-bulk"], answer
    assert hand_off(server, f"{base}-bulk")["state"] == "waiting"

    async def work(session):
        plan = answer_of(await session.call_tool("plan_fork", {"channel_id": base, "at_step": 3}))
        made = answer_of(await session.call_tool("fork_run", {
            "channel_id": base, "new_channel_id": f"{tag}-mcp", "at_step": 3, "plan_digest": plan["digest"],
            "hand_off": True}))
        read = answer_of(await session.call_tool("read_run", {"channel_id": f"{tag}-mcp"}))
        return made, read
    made, read = with_session(server, server.key, work)
    assert made["receipt"]["channel_id"] == f"{tag}-mcp"
    assert read["hand_off"]["state"] == "waiting" and read["hand_off"]["group_id"] == GROUP, read["hand_off"]


def test_a_worker_killed_mid_job_is_replaced_and_the_charge_runs_once(server, base, tag, tmp_path):
    fork(server, base, f"{tag}-f", hand_off=False)
    api(server, "POST", f"/api/v1/groups", body={"group_id": GROUP, "channel_id": JOBS})
    drain(server, f"{tag}-drain")
    status, _, _ = api(server, "POST", f"/api/v1/channels/{tag}-f/hand-off")
    assert status == 200
    effects = tmp_path / "effects.jsonl"
    first = start_worker(server, f"{tag}-a", "--lease", "2", "--slow", "2", "--effects-log", str(effects))
    try:
        poll(lambda: effects.exists() and f"{tag}-f" in effects.read_text(), timeout=90, what="worker a's charge")
        assert hand_off(server, f"{tag}-f")["worker"] == f"{tag}-a"
    finally:
        first.kill()                       # after its charge, before it recorded step 4
        first.wait()
    assert 4 not in own_steps(server, f"{tag}-f")
    poll(lambda: hand_off(server, f"{tag}-f")["state"] == "waiting", timeout=30, what="the lease to run out")
    state = hand_off(server, f"{tag}-f")
    assert f"{tag}-a" in state["detail"] and "lease ran out" in state["detail"], state
    out = finished(start_worker(server, f"{tag}-b", "--lease", "2", "--jobs", "1", "--effects-log", str(effects)))
    assert f"{tag}-f completed" in out, out
    state = hand_off(server, f"{tag}-f")
    assert (state["state"], state["worker"]) == ("done", f"{tag}-b"), state
    charges = [json.loads(line) for line in effects.read_text().splitlines() if f'"{tag}-f"' in line]
    assert [c["worker"] for c in charges] == [f"{tag}-a"], charges      # once, by the killed worker
    assert own_steps(server, f"{tag}-f") == [4, 5, 6]
    status, _, latest = api(server, "GET", f"/api/v1/state/{tag}-f")
    assert latest["state"]["status"] == "completed" and latest["state"]["charge"]["result"] == charges[0]["charge"]["result"]


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_a_fork_handed_off_from_the_dashboard_is_run_by_the_worker_and_its_page_shows_each_state(
        server, browser, base, tag, viewport):
    api(server, "POST", f"/api/v1/groups", body={"group_id": GROUP, "channel_id": JOBS})
    drain(server, f"{tag}-drain")
    context, page = logged_in(browser, server, viewport)
    try:
        page.goto(f"{server.url}/runs/{base}#fork")
        page.select_option("#fork-step", "3")
        page.fill("#fork-name", f"{tag}-d")
        page.fill("#fork-intervention", '{"model": "slow"}')
        page.check("#fork-hand-off")
        with page.expect_navigation():
            page.click("form.fork-form button[type=submit]")
        assert page.url.endswith(f"/runs/{tag}-d?created=1#hand-off"), page.url
        card = page.locator("#hand-off")
        assert card.get_attribute("data-state") == "waiting" and "Waiting for a worker" in card.inner_text()
        worker = start_worker(server, f"{tag}-w", "--jobs", "1000", "--slow", "1.5", "--poll", "0.2")
        seen = ["waiting"]
        try:
            def state_now():
                now = page.locator("#hand-off").get_attribute("data-state")
                if now != seen[-1]:
                    seen.append(now)
                return now == "done"
            poll(state_now, timeout=120, every=0.1, sleep=page_sleep(page), what="the card to say done")
        finally:
            worker.kill()
            worker.wait()
        assert seen[0] == "waiting" and seen[-1] == "done" and "running" in seen, seen
        assert seen == sorted(seen, key=["waiting", "claimed", "running", "done"].index), seen
        assert f"{tag}-w" in page.locator("#hand-off").inner_text()
        assert page.locator("#hand-off").get_attribute("data-poll") is None       # over: no more fetching
        assert own_steps(server, f"{tag}-d") == [4, 5, 6]
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= viewport["width"], f"the page scrolls sideways: {width} px"
    finally:
        context.close()


def test_no_key_can_take_the_workers_group_for_a_channel_of_its_own(server, base, tag):
    squatter = new_key(server, read=[f"{tag}-*"], write=[f"{tag}-*"])
    status, _, answer = api(server, "POST", "/api/v1/groups", key=squatter,
                            body={"group_id": GROUP, "channel_id": f"{tag}-mine"})
    assert status == 409 and answer["status"] == "channel_conflict", answer     # made with the database
    fork(server, base, f"{tag}-f")
    assert hand_off(server, f"{tag}-f")["group_id"] == GROUP
