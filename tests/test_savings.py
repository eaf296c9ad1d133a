"""What a fork saved: the steps it inherited instead of running (and paying for) again, measured from
the usage each step recorded, the same in the API, on the fork's page, in its trace and in /metrics.

A run records five steps through the SDK's AgentSession: three report their usage in the step's
output (`usage`: input_tokens, output_tokens, cost_usd), one the way OpenTelemetry-instrumented
frameworks name it (`gen_ai.usage.*` in the event's metadata, no cost), one none at all. A second
run comes through a framework adapter, the SDK's Codex CLI receiver, as Codex exports it over OTLP.
"""
from __future__ import annotations

import socket
import uuid

from conftest import Collector, dashboard_cookie, exporting_server, http, metric_values, poll, using, value

USAGE = {1: {"input_tokens": 1200, "output_tokens": 300, "cost_usd": 0.0081},
         2: {"input_tokens": 1850, "output_tokens": 410, "cost_usd": 0.0117},
         4: {"input_tokens": 3100, "output_tokens": 520, "cost_usd": 0.0171}}
GEN_AI = {3: {"gen_ai.usage.input_tokens": 2400, "gen_ai.usage.output_tokens": 350, "gen_ai.request.model": "m"}}
# step 5 records no usage: its spend is unknown, never zero


async def record_run(client, channel: str) -> None:
    from actae_client import AgentSession
    state = {"n": 0, "status": "running"}
    async with AgentSession(client, channel, state_fn=lambda: dict(state), snapshot_interval=1) as session:
        for n in range(1, 6):
            state["n"] = n
            output = {"text": f"step {n}", **({"usage": USAGE[n]} if n in USAGE else {})}
            await session.step(f"step-{n}", input={"n": n}, output=output, metadata=GEN_AI.get(n))


async def fork_at(client, parent: str, child: str, step: int) -> None:
    _, cursor, _ = await client.resolve_step(parent, step)
    await client.fork(parent, child, cursor)


def expected(steps: range) -> dict:
    inputs = [USAGE[n]["input_tokens"] if n in USAGE else GEN_AI[n]["gen_ai.usage.input_tokens"]
              for n in steps if n in USAGE or n in GEN_AI]
    outputs = [USAGE[n]["output_tokens"] if n in USAGE else GEN_AI[n]["gen_ai.usage.output_tokens"]
               for n in steps if n in USAGE or n in GEN_AI]
    return {"steps": len(steps), "steps_without_usage": sum(1 for n in steps if n not in USAGE and n not in GEN_AI),
            "input_tokens": sum(inputs), "output_tokens": sum(outputs),
            "cost": round(sum(USAGE[n]["cost_usd"] for n in steps if n in USAGE), 9)}


def test_what_a_fork_saved_is_the_sum_of_its_inherited_steps_everywhere(tmp_path):
    collector = Collector()
    try:
        with exporting_server(tmp_path, collector.url) as server:
            parent, at4, at5 = (f"sv-{uuid.uuid4().hex[:6]}{s}" for s in ("", "-at4", "-at5"))

            async def scenario(client):
                await record_run(client, parent)
                await fork_at(client, parent, at4, 4)
                await fork_at(client, parent, at5, 5)
            using(server, scenario)

            status, _, savings = http("GET", server.url + f"/api/v1/channels/{at4}/savings", key=server.key)
            assert status == 200 and savings["fork"]["forked_at_step"] == 4, savings
            saved = savings["fork"]["saved"]
            assert {k: saved[k] for k in expected(range(1, 5))} == expected(range(1, 5)), saved
            assert saved["wall_seconds"] >= 0 and savings["fork"]["tail"]["steps"] == 0
            saved5 = http("GET", server.url + f"/api/v1/channels/{at5}/savings", key=server.key)[2]["fork"]["saved"]
            assert saved5["steps"] == 5 and saved5["steps_without_usage"] == 1, saved5   # unknown, not zero
            assert saved5["input_tokens"] == expected(range(1, 6))["input_tokens"]

            whole = http("GET", server.url + f"/api/v1/channels/{parent}/savings", key=server.key)[2]
            assert whole["fork"] is None and sorted(f["channel_id"] for f in whole["forks"]) == sorted([at4, at5])
            assert whole["forks_saved"]["input_tokens"] == saved["input_tokens"] + saved5["input_tokens"]

            # the fork's page shows the same figures next to its receipt
            page = http("GET", server.url + f"/runs/{at4}?format=json", headers={"cookie": dashboard_cookie(server)})
            assert page[0] == 200 and page[2]["saving"]["saved"] == saved, page[2].get("saving")
            html = http("GET", server.url + f"/runs/{at4}", headers={"cookie": dashboard_cookie(server)}, decode=False)
            assert b"What this fork saved" in html[2] and f"{saved['input_tokens']} tokens in".encode() in html[2]

            # /metrics counts what the forks this server made inherited
            poll(lambda: value(metric_values(server), "actae_fork_saved_tokens_total", direction="input")
                 == saved["input_tokens"] + saved5["input_tokens"], 10, what="the saved-token counter")
            figures = metric_values(server)
            assert value(figures, "actae_fork_saved_tokens_total", direction="output") == (
                saved["output_tokens"] + saved5["output_tokens"])
            assert abs(value(figures, "actae_fork_saved_cost_total") - saved["cost"] - saved5["cost"]) < 1e-9

            # and its trace's root span carries them (the root goes out when the fork's run is closed)
            assert http("POST", server.url + f"/api/v1/channels/{at4}/close", key=server.key, body={})[0] == 200
            root = poll(lambda: next((s for s in collector.spans if s["name"].startswith("invoke_agent")
                                      and s["attributes"].get("actae.channel_id") == at4), None), 20,
                        what="the fork's root span")
            attributes = root["attributes"]
            assert attributes["actae.fork.saved.steps"] == 4
            assert attributes["actae.fork.saved.input_tokens"] == saved["input_tokens"]
            assert attributes["actae.fork.saved.output_tokens"] == saved["output_tokens"]
            assert abs(attributes["actae.fork.saved.cost"] - saved["cost"]) < 1e-9
    finally:
        collector.stop()


def test_a_step_s_usage_is_read_by_one_rule():
    import actae
    assert actae.usage_of({"usage": {"prompt_tokens": 5, "completion_tokens": 7, "cost": 0.1}}, None) == {
        "input_tokens": 5, "output_tokens": 7, "cost": 0.1}
    assert actae.usage_of({"output": {"text": "no usage"}}, {"gen_ai.usage.input_tokens": 3}) == {"input_tokens": 3}
    assert actae.usage_of({"model": "m"}, None) is None            # a model alone is no spend
    assert actae.usage_of({"input_tokens": True, "cost": -1}, None) is None
    # Codex CLI's names, its int64 figures as OTLP's JSON writes them (decimal strings)
    assert actae.usage_of({"input_token_count": "1200", "output_token_count": "300", "model": "gpt-5-codex"},
                          None) == {"input_tokens": 1200, "output_tokens": 300, "model": "gpt-5-codex"}
    assert actae.usage_of({"input_tokens": "12a", "output_tokens": "-3", "cost": "0.5"}, None) is None


def otlp_logs(conversation: str, events: list) -> dict:
    """Codex CLI's OTLP/HTTP JSON log export of `events` [(name, attributes)]: int64 values as
    decimal strings, as OTLP's JSON mapping writes them."""
    def kv(key, value):
        kind = "intValue" if isinstance(value, int) else "stringValue"
        return {"key": key, "value": {kind: str(value) if kind == "intValue" else value}}
    records = [{"timeUnixNano": str(n), "body": {"stringValue": name},
                "attributes": [kv("conversation.id", conversation)] + [kv(k, v) for k, v in attrs.items()]}
               for n, (name, attrs) in enumerate(events)]
    return {"resourceLogs": [{"scopeLogs": [{"logRecords": records}]}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CODEX_TURNS = [("codex.conversation_starts", {"model": "gpt-5-codex"}),
               ("codex.user_prompt", {"prompt_length": 40}),
               ("codex.sse_event", {"event.kind": "response.completed", "model": "gpt-5-codex",
                                    "input_token_count": 1200, "output_token_count": 300, "duration_ms": 900}),
               ("codex.tool_decision", {"tool_name": "shell", "decision": "approved"}),
               ("codex.tool_result", {"tool_name": "shell", "call_id": "c1", "duration_ms": 30, "success": "true"}),
               ("codex.sse_event", {"event.kind": "response.completed", "model": "gpt-5-codex",
                                    "input_token_count": 1850, "output_token_count": 410, "duration_ms": 1200}),
               ("codex.sse_event", {"event.kind": "response.completed", "model": "gpt-5-codex",
                                    "input_token_count": 2600, "output_token_count": 120})]


def test_a_framework_adapter_s_usage_is_what_its_fork_saved(server):
    """Codex reports each model call's usage on its own events, unnumbered: each is a step by the rule,
    and a fork after the second call saved exactly those two calls' tokens."""
    import aiohttp
    from actae_client.adapters.codex import CodexOTLPReceiver
    conversation = f"cx-{uuid.uuid4().hex[:8]}"
    parent, child = f"codex:{conversation}", f"codex:{conversation}-retry"

    async def scenario(client):
        receiver = CodexOTLPReceiver(client, host="127.0.0.1", port=free_port())
        await receiver.start()
        try:
            async with aiohttp.ClientSession() as session:
                async with session.post(f"http://127.0.0.1:{receiver.port}/v1/logs",
                                        json=otlp_logs(conversation, CODEX_TURNS)) as answer:
                    assert answer.status == 200 and (await answer.json())["processed"] == len(CODEX_TURNS)
        finally:
            await receiver.stop()
        calls = [e for e in await client.replay(parent) if e.event_type == "codex.sse_event"]
        await client.fork(parent, child, calls[1].cursor)
    using(server, scenario)

    savings = http("GET", server.url + f"/api/v1/channels/{child}/savings", key=server.key)[2]
    saved = savings["fork"]["saved"]
    assert {k: saved[k] for k in ("steps", "steps_without_usage", "input_tokens", "output_tokens", "cost")} == {
        "steps": 2, "steps_without_usage": 0, "input_tokens": 1200 + 1850, "output_tokens": 300 + 410,
        "cost": None}, saved                  # Codex reports no cost: unknown, not zero
    whole = http("GET", server.url + f"/api/v1/channels/{parent}/savings", key=server.key)[2]
    assert whole["forks_saved"]["input_tokens"] == 3050 and whole["fork"] is None
    page = http("GET", server.url + f"/runs/{child}?format=json", headers={"cookie": dashboard_cookie(server)})
    assert page[0] == 200 and page[2]["saving"]["saved"] == saved
