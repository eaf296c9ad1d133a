"""The Experiments page, in Chromium: a baseline run and three forks of it with other interventions,
grouped by the SDK's experiment calls and scored; the page shows each of them in a column of its own
(intervention, tool policies, outcome, score, steps, tokens, cost, duration, where it left the
baseline, the last output), the ranking, and promotes the winner into the baseline from the page.
At desktop width and at 390 px, without sideways scrolling.
"""
from __future__ import annotations

import uuid

import pytest

from conftest import DESKTOP, PHONE, http, logged_in, run_sdk, using_async

FIGURES = ("rank", "score", "outcome", "intervention", "policies", "steps", "tokens", "cost", "duration",
           "diverged", "output", "promote")


async def an_experiment(client, tag: str) -> dict:
    """A 3-step baseline, three forks after step 1 that each ran steps 2..3 their own way."""
    from actae_client import AgentSession
    base = f"{tag}-base"
    state = {"answer": None, "status": "running"}
    async with AgentSession(client, base, state_fn=lambda: dict(state), snapshot_interval=1) as session:
        for n in (1, 2, 3):
            state["answer"] = f"base-{n}"
            await session.step(f"step-{n}", output={"answer": state["answer"],
                                                    "usage": {"input_tokens": 100 * n, "output_tokens": 10 * n,
                                                              "cost_usd": 0.001 * n}})
        forks = []
        for i, model in enumerate(("small", "medium", "large")):
            name = f"{tag}-v{i}"
            fork = await session.fork(1, name=name, state_fn=lambda: dict(state), intervention={"model": model},
                                      tool_policies={"charge": "block"} if i == 2 else None)
            async with fork:
                for n in (2, 3):
                    state["answer"] = f"{model}-{n}"
                    await fork.step(f"step-{n}", output={"answer": state["answer"],
                                                         "usage": {"input_tokens": 50 * n, "output_tokens": 5 * n}})
            forks.append(name)
    group = await client.create_experiment(f"{tag} models", baseline_channel_id=base)
    group_id = group["id"] if isinstance(group, dict) else group.id
    for score, name in zip((0.4, 0.9, 0.6), forks):
        await client.add_experiment_member(group_id, name)
        await client.set_outcome(name, "inconclusive", score=score)
    return {"group": group_id, "base": base, "forks": forks, "winner": forks[1]}


@pytest.fixture(scope="module")
def experiment(server):
    return run_sdk(using_async(server, lambda client: an_experiment(client, f"ex{uuid.uuid4().hex[:6]}")))


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_the_experiment_side_by_side(browser, server, experiment, viewport):
    context, page = logged_in(browser, server, viewport)
    try:
        page.goto(server.url + "/experiments")
        page.click(f"a[href='/experiments/{experiment['group']}']")
        columns = page.locator("table.experiment-columns thead th.run-id").evaluate_all(
            "cells => cells.map(c => c.dataset.channel)")
        assert columns == [experiment["base"], *experiment["forks"]]
        for figure in FIGURES:
            cells = page.locator(f"tr.figure-{figure} td[data-label]")
            assert cells.count() == 4, figure
        text = page.locator("table.experiment-columns").inner_text()
        assert '"model":"medium"' in text.replace(" ", "") and "medium-3" in text and "#1" in text
        assert page.locator("tr.figure-rank td", has_text="winner").count() == 1
        tokens = page.locator(f"tr.figure-tokens td[data-label='{experiment['forks'][0]}']").inner_text()
        assert tokens.strip().startswith("250 / 25"), tokens          # the fork's own steps 2 and 3
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= viewport["width"], f"{width} px wide at {viewport['width']}"
        for button in page.locator("tr.figure-promote button").all():
            box = button.bounding_box()
            assert box and box["x"] >= 0 and box["x"] + box["width"] <= viewport["width"], box
    finally:
        context.close()


def test_promote_the_winner_from_the_page(browser, server, experiment):
    context, page = logged_in(browser, server)
    try:
        page.goto(server.url + f"/experiments/{experiment['group']}")
        with page.expect_navigation():
            page.click(f"tr.figure-promote td[data-label='{experiment['winner']}'] button")
        assert "Promoted" in page.locator("main").inner_text()
        status, _, latest = http("GET", server.url + f"/api/v1/state/{experiment['base']}", key=server.key)
        assert status == 200 and latest["state"]["answer"] == "medium-3", latest      # the parent took the winner's state
        status, _, events = http("GET", server.url + f"/api/v1/events/replay/{experiment['base']}", key=server.key)
        assert any(e["type"] == "channel.promoted" for e in events["events"]), events
        page.goto(server.url + f"/runs/{experiment['winner']}")
        assert page.locator(f".experiments-of-run a[href='/experiments/{experiment['group']}']").count() == 1
    finally:
        context.close()
