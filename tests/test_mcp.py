"""The MCP endpoint: the official `mcp` client over Streamable HTTP at /mcp, with an Actae key. It lists the
tools, finds a failed run, reads where it went wrong (the failing values and the step that set them),
plans a fork and makes it with the plan's digest (a stale digest is refused with the new plan), and
decides an approval. A read-only key sees only the reading tools and is refused writing ones by the
protocol's error; a run outside a key's scope does not exist for it; a malformed message gets the
protocol's error, never a 500; no key gets 401.
"""
from __future__ import annotations

import asyncio
import contextlib
import json

import httpx2
import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from conftest import api, http, record, run_example

WRITING = {"fork_run", "bulk_fork", "decide_approval"}


@contextlib.asynccontextmanager
async def connected(server, key: str):
    async with httpx2.AsyncClient(headers={"authorization": f"Bearer {key}"}, timeout=30) as client:
        async with streamable_http_client(f"{server.url}/mcp", http_client=client) as streams:
            async with ClientSession(streams[0], streams[1]) as session:
                await session.initialize()
                yield session


def with_session(server, key, work):
    async def run():
        async with connected(server, key) as session:
            return await work(session)
    return asyncio.run(run())


def answer_of(result) -> dict:
    assert not result.is_error, result.content
    return result.structured_content if result.structured_content is not None else json.loads(result.content[0].text)


def error_of(result) -> str:
    assert result.is_error, result
    return result.content[0].text


@pytest.fixture(scope="module")
def demo(server, tmp_path_factory):
    name = f"mcp-{tmp_path_factory.mktemp('m').name[-6:]}"
    proc = run_example(server, "fork_demo.py", "--name", name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return f"{name}-base"


def test_an_agent_finds_reads_plans_and_forks_a_failed_run(server, demo):
    async def work(session):
        tools = {t.name: t for t in (await session.list_tools()).tools}
        assert WRITING <= set(tools) and {"find_runs", "read_run", "read_step", "plan_fork"} <= set(tools)
        assert all(t.description and t.input_schema.get("type") == "object" for t in tools.values())
        assert tools["read_run"].output_schema is not None
        injected = error_of(await session.call_tool("find_runs", {"metadata": {"x') = 1 OR (1": "1"}}))
        assert "metadata keys are" in injected, injected
        found = answer_of(await session.call_tool("find_runs", {"status": "failed", "text": demo}))
        assert answer_of(await session.call_tool("find_runs", {"metadata": {"session_name": demo}}))[
            "runs"][0]["channel_id"] == demo
        assert [r["channel_id"] for r in found["runs"]] == [demo], found
        run = answer_of(await session.call_tool("read_run", {"channel_id": demo}))
        assert run["failure"]["last_good_step"] == 5 and run["cause"]["fork_after"] == 3, run["cause"]
        assert [p["path"] for p in run["cause"]["paths"]] == ["decision"]
        step = answer_of(await session.call_tool("read_step", {"channel_id": demo, "step": 4}))
        changed = {c["key"] for c in step["state"]["changes"]["keys"]}
        assert "decision" in changed and step["events"][0]["step_number"] == 4, step
        policies = {"charge_customer": "block", "*": "auto"}
        plan = answer_of(await session.call_tool("plan_fork", {"channel_id": demo, "at_step": 3,
                                                              "tool_policies": policies,
                                                              "intervention": {"model": "slow"}}))
        assert plan["boundary"]["step"] == 3 and plan["digest"]
        stale = await session.call_tool("fork_run", {"channel_id": demo, "new_channel_id": f"{demo}-mcp",
                                                      "at_step": 3, "plan_digest": "0" * 64, "tool_policies": policies,
                                                      "intervention": {"model": "slow"}})
        assert "409 plan_changed" in error_of(stale) and plan["digest"] in error_of(stale)
        made = answer_of(await session.call_tool("fork_run", {
            "channel_id": demo, "new_channel_id": f"{demo}-mcp", "at_step": 3, "plan_digest": plan["digest"],
            "tool_policies": policies, "intervention": {"model": "slow"}}))
        assert made["receipt"]["child_channel_id"] == f"{demo}-mcp", made
        prompts = [p.name for p in (await session.list_prompts()).prompts]
        assert prompts == ["investigate_failed_run"]
        text = (await session.get_prompt("investigate_failed_run", {"channel_id": demo})).messages[0].content.text
        assert "read_run" in text and "plan_fork" in text
        read = await session.read_resource(f"actae://runs/{demo}")
        assert json.loads(read.contents[0].text)["run"]["channel_id"] == demo
    with_session(server, server.key, work)
    status, _, meta = api(server, "GET", f"/api/v1/channels/{demo}-mcp/metadata")
    assert status == 200 and meta["experiment_metadata"]["intervention"] == {"model": "slow"}, meta


def test_an_approval_is_decided_over_mcp(server, unique):
    run = unique("approve")
    record(server, run, "approval.requested", {"request_id": unique("rq"), "summary": "ship it?"})

    async def work(session):
        listed = answer_of(await session.call_tool("list_approvals", {"status": "pending", "channel_id": run}))
        assert [a["request_id"] for a in listed["approvals"]] == [unique("rq")], listed
        decided = answer_of(await session.call_tool("decide_approval", {"request_id": unique("rq"),
                                                                        "decision": "approved", "reason": "fine"}))
        assert decided["approval"]["decision"] == "approved" and decided["approval"]["status"] == "decided", decided
    with_session(server, server.key, work)


def test_a_read_only_key_sees_only_reading_tools_and_cannot_write(server, demo, unique):
    reader = api(server, "POST", "/api/v1/keys", body={"name": unique("ro"), "scopes": {"read": ["*"]}})[2]["key"]
    forks_before = api(server, "GET", f"/api/v1/channels/{demo}/forks")[2]

    async def work(session):
        names = {t.name for t in (await session.list_tools()).tools}
        assert not (names & WRITING) and "read_run" in names, names
        with pytest.raises(MCPError) as refused:
            await session.call_tool("fork_run", {"channel_id": demo, "new_channel_id": f"{demo}-ro", "at_step": 3,
                                                 "plan_digest": "x"})
        assert "may not write" in str(refused.value)
        assert not answer_of(await session.call_tool("read_run", {"channel_id": demo}))["run"]["channel_id"] != demo
    with_session(server, reader, work)
    assert api(server, "GET", f"/api/v1/channels/{demo}/forks")[2] == forks_before


def test_a_run_outside_the_key_s_scope_does_not_exist_for_it(server, demo, unique):
    mine = unique("mine")
    record(server, mine)
    narrow = api(server, "POST", "/api/v1/keys", body={"name": unique("narrow"),
                                                         "scopes": {"read": [mine], "write": [mine]}})[2]["key"]

    async def work(session):
        found = answer_of(await session.call_tool("find_runs", {}))
        assert [r["channel_id"] for r in found["runs"]] == [mine], found
        assert "404" in error_of(await session.call_tool("read_run", {"channel_id": demo}))
        refused = error_of(await session.call_tool("plan_fork", {"channel_id": demo}))
        assert refused.startswith("Error executing tool plan_fork: 40"), refused        # 403 or 404, as the API
        assert "decision" not in refused and "charge" not in refused, refused            # nothing of the run
    with_session(server, narrow, work)


def test_no_key_and_malformed_messages(server):
    status, headers, answer = http("POST", f"{server.url}/mcp", body={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert status == 401 and "bearer" in headers.get("www-authenticate", "").lower(), answer
    status, _, answer = http("POST", f"{server.url}/mcp", raw=b"{not json", decode=False,
                             headers={"authorization": f"Bearer {server.key}",
                                      "accept": "application/json, text/event-stream"})
    assert status < 500 and b"jsonrpc" in answer, (status, answer)
    status, _, answer = http("POST", f"{server.url}/mcp", decode=False, body={"jsonrpc": "2.0", "id": 7, "method": "no/such"},
                             headers={"authorization": f"Bearer {server.key}",
                                      "accept": "application/json, text/event-stream"})
    assert status < 500, (status, answer)
