"""Frameworks' OpenTelemetry, offline, into runs: the OpenAI Agents SDK (OpenInference's instrumentation,
its model a scripted chat-completions server on loopback), a LangGraph graph (LangChain's OpenInference
instrumentation, a fake chat model) and Pydantic AI (its own GenAI-convention instrumentation, a
FunctionModel), each driven in a process of its own (tests/frameworks/) and exported to the server in
both encodings: the standard OTLP/HTTP exporter (protobuf) and OTLP JSON. Each becomes a run whose steps
hold their model calls (with usage, priced when the model is known) and tool calls (with arguments and
results). What docs/frameworks.md says "works" is what these tests check.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, api

DRIVERS = ROOT / "tests" / "frameworks"


def drive(server, framework: str, run: str, encoding: str) -> dict:
    done = subprocess.run([sys.executable, str(DRIVERS / f"{framework}_run.py"), "--url", server.url, "--key",
                           server.key, "--run", run, "--encoding", encoding], capture_output=True, text=True,
                          timeout=180, cwd=str(ROOT))
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["final"] == "It is 21 degrees in Paris."
    status, _, trace = api(server, "GET", f"/api/v1/channels/{run}/trace")
    assert status == 200, trace
    return trace


def calls_of(step: dict, kind: str) -> list:
    return [call for call in step["calls"] if call["kind"] == kind]


ENCODINGS = ["protobuf", "json"]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_the_openai_agents_sdk_run_is_a_run_of_turns_with_its_model_and_tool_calls(server, unique, encoding):
    trace = drive(server, "openai_agents", unique(encoding), encoding)
    assert trace["status"] == "ok" and [s["name"] for s in trace["steps"]] == ["turn", "turn"], trace["steps"]
    first, second = trace["steps"]
    [model] = calls_of(first, "llm")
    assert (model["model"], model["input_tokens"], model["output_tokens"]) == ("gpt-4o-mini", 60, 12)
    assert model["cost"] == pytest.approx(60 * 0.15e-6 + 12 * 0.6e-6)        # priced as the gateway prices
    assert model["input"][0] == {"role": "system", "content": "Answer with the weather."}
    assert "get_weather" in model["output"][0]["content"]                    # the tool call it asked for
    [tool] = calls_of(first, "tool")
    assert (tool["tool"], tool["input"], tool["output"]) == ("get_weather", {"city": "Paris"}, "21 degrees in Paris")
    [answer] = calls_of(second, "llm")
    assert (answer["input_tokens"], answer["output"][0]["content"]) == (70, "It is 21 degrees in Paris.")
    assert calls_of(second, "tool") == []


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_langgraph_graph_is_a_run_of_its_nodes(server, unique, encoding):
    trace = drive(server, "langgraph", unique(encoding), encoding)
    assert [(s["name"], s["kind"]) for s in trace["steps"]] == [("agent", "agent"), ("tools", "chain"),
                                                               ("agent", "agent")], trace["steps"]
    asked, tools, answered = trace["steps"]
    assert [(c["input_tokens"], c["output_tokens"]) for c in calls_of(asked, "llm")] == [(40, 9)]
    assert [(c["input_tokens"], c["output_tokens"]) for c in calls_of(answered, "llm")] == [(60, 8)]
    assert (asked["input_tokens"], answered["output_tokens"]) == (40, 8)
    [tool] = calls_of(tools, "tool")
    assert tool["tool"] == "get_weather" and "21 degrees in Paris" in json.dumps(tool["output"])
    assert calls_of(answered, "llm")[0]["output"][0]["content"] == "It is 21 degrees in Paris."


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_pydantic_ai_run_is_one_step_with_its_calls(server, unique, encoding):
    trace = drive(server, "pydantic_ai", unique(encoding), encoding)
    [step] = trace["steps"]
    assert (step["name"], step["kind"], step["input_tokens"], step["output_tokens"]) == (
        "invoke_agent agent", "agent", 110, 17)
    assert [(c["kind"], c["name"]) for c in step["calls"]] == [
        ("llm", "chat gpt-4o-mini"), ("tool", "execute_tool get_weather"), ("llm", "chat gpt-4o-mini")]
    tool = step["calls"][1]
    assert (tool["input"], tool["output"]) == ({"city": "Paris"}, "21 degrees in Paris")
    assert step["calls"][0]["output"][0]["content"] == 'get_weather({"city": "Paris"})'
    assert step["cost"] is not None
