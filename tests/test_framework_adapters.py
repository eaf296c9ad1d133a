"""The SDK's framework adapters (actae-client 1.3.0, `actae_client.adapters`) driven offline against the
real server, and what each one stores, read back over the API: LangChain's `ActaeContextSaver` and
`ChainResumer`, LangGraph's `ActaeCheckpointSaver`, the OpenAI Agents SDK's `install_actae_tracing` and
the Codex CLI's `CodexOTLPReceiver`; beside them the two other ways to record a framework's run, the
model gateway (the Agents SDK's default Responses model, Pydantic AI) and OTLP ingest in the same run as
the SDK's state (LangGraph's checkpointer, an `AgentSession`), configured by the standard OTEL_*
environment variables alone.

Where an adapter stores nothing, or something other than what it says, in a common setup, the test
asserts that failure as it is (so docs/frameworks.md stays true to the SDK this project pins) and then
the workaround that works. Fake models throughout (LangChain's GenericFakeChatModel, the scripted
chat-completions server of tests/frameworks/fake_openai.py, the tiny model server of examples/). The
OpenAI Agents SDK with the adapter, and LangGraph with both the checkpointer and LangChain's
instrumentation, run in processes of their own (tests/frameworks/*_adapter_run.py), as each installs
something process-wide (a trace processor, an instrumentation). What docs/frameworks.md says "works" for
an adapter is what these tests check.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import operator
import socket
import subprocess
import sys
from typing import Annotated, TypedDict

import pytest

from conftest import ROOT, ServerProcess, api, client_for, fork, import_example, run, using

DRIVERS = ROOT / "tests" / "frameworks"


def state_of(server, run_id: str) -> dict:
    """GET /api/v1/state/{run}: {cursor, state, version} (state None when it has none)."""
    status, _, answer = api(server, "GET", f"/api/v1/state/{run_id}")
    assert status == 200, answer
    return answer


def versions_of(server, run_id: str) -> list:
    """Every saved state version of the run, newest first."""
    found, offset = [], 0
    while True:
        status, _, answer = api(server, "GET", f"/api/v1/state/{run_id}/versions?limit=100&offset={offset}")
        assert status == 200, answer
        found += answer["versions"]
        offset += len(answer["versions"])
        if len(answer["versions"]) < 100:
            return found


def events_of(server, run_id: str) -> list:
    status, _, answer = api(server, "GET", f"/api/v1/events/replay/{run_id}?limit=1000")
    assert status == 200, answer
    return answer["events"]


def drive(server, script: str, run_id: str, *extra) -> dict:
    """tests/frameworks/<script> against `server`, its last printed line as JSON."""
    done = subprocess.run([sys.executable, str(DRIVERS / script), "--url", server.url, "--key", server.key,
                           "--run", run_id, *extra], capture_output=True, text=True, timeout=180, cwd=str(ROOT),
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


async def new_tasks_done(before: set) -> None:
    """Await the tasks created since `before` was taken (what an adapter scheduled and left running)."""
    await asyncio.gather(*(asyncio.all_tasks() - before - {asyncio.current_task()}))


# =============================================================================================
# LangChain: ActaeContextSaver (a callback handler) and ChainResumer
# =============================================================================================

def weather_chain(answers: list, seen: list | None = None):
    """A LangChain chain: a tool, a prompt made of its result, a fake chat model answering `answers`
    in turn, a string parser. `seen` (when given) collects what the model was asked."""
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.runnables import RunnableLambda
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"21 degrees in {city}"

    def asked(text):
        if seen is not None:
            seen.append(text)
        return text
    model = GenericFakeChatModel(messages=iter([AIMessage(content=a) for a in answers]))
    prompt = RunnableLambda(lambda weather: f"Say it nicely: {weather}")
    return get_weather | prompt | RunnableLambda(asked) | model | StrOutputParser()


def test_the_langchain_context_saver_stores_nothing_from_invoke_or_ainvoke(server, unique):
    """Its saves are tasks put on the running event loop; with none running it returns without saving,
    and LangChain calls a synchronous handler during `ainvoke` on a worker thread, where none runs."""
    from actae_client.adapters.langchain import ActaeContextSaver

    plain, awaited = unique("invoke"), unique("ainvoke")
    client = client_for(server)
    saver = ActaeContextSaver(client, channel=plain, save_every_n=1)
    assert weather_chain(["It is 21 degrees."]).invoke({"city": "Paris"}, config={"callbacks": [saver]}) \
        == "It is 21 degrees."
    assert saver._context["messages"], "the handler was called (it kept the answer in memory)"

    async def ainvoke(client):
        saver = ActaeContextSaver(client, channel=awaited, save_every_n=1)
        answer = await weather_chain(["It is 21 degrees."]).ainvoke({"city": "Paris"}, config={"callbacks": [saver]})
        await asyncio.sleep(0.5)                       # time enough for any save it had scheduled
        return answer
    assert using(server, ainvoke) == "It is 21 degrees."
    for run_id in (plain, awaited):
        assert state_of(server, run_id)["state"] is None and events_of(server, run_id) == []
        assert api(server, "GET", f"/runs/{run_id}?format=json")[0] == 404      # no run at all


def test_the_langchain_context_saver_saves_a_sync_invoke_made_inside_a_coroutine(server, unique):
    """The workaround: call `invoke` from inside a coroutine (the handler then runs on the loop's thread)
    and await the tasks it scheduled before the client closes. Every save is of the finished context."""
    from actae_client.adapters.langchain import ActaeContextSaver

    chain_run = unique("chain")

    async def invoke_then_wait(client):
        saver = ActaeContextSaver(client, channel=chain_run)
        before = asyncio.all_tasks()
        answer = weather_chain(["It is 21 degrees in Paris."]).invoke({"city": "Paris"},
                                                                     config={"callbacks": [saver]})
        await new_tasks_done(before)
        return answer
    assert using(server, invoke_then_wait) == "It is 21 degrees in Paris."
    latest = state_of(server, chain_run)
    context = latest["state"]["context"]
    assert [m["content"] for m in context["messages"]] == ["It is 21 degrees in Paris."]
    assert [t["output"] for t in context["tool_outputs"]] == ["21 degrees in Paris"]
    assert context["chain_steps"][-1]["outputs"] == "It is 21 degrees in Paris."
    assert latest["state"]["_actae_adapter"]["framework"] == "langchain"
    # a snapshot per chain end (the two lambdas, the parser, the sequence), all at cursor 0: no event recorded
    assert len(versions_of(server, chain_run)) == 4 and latest["cursor"] == 0
    assert events_of(server, chain_run) == []


def test_chain_resumer_seeds_the_next_call_with_the_last_answer_and_its_snapshot_drops_the_earlier_context(
        server, unique):
    """ChainResumer.resume feeds the last saved answer to the chain as its input; its own saver starts
    empty, so the snapshots it saves hold the resumed call alone (the earlier context stays in older
    versions). fork() copies the latest context to a new run."""
    from actae_client.adapters.langchain import ActaeContextSaver, ChainResumer
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage
    from langchain_core.runnables import RunnableLambda

    chain_run, forked = unique("chain"), unique("fork")

    async def first(client):
        saver = ActaeContextSaver(client, channel=chain_run)
        before = asyncio.all_tasks()
        weather_chain(["It is 21 degrees in Paris."]).invoke({"city": "Paris"}, config={"callbacks": [saver]})
        await new_tasks_done(before)
    using(server, first)
    seen = []

    async def resumed(client):                         # a fresh process: a new client and resumer
        resumer = ChainResumer(client, channel=chain_run)
        model = GenericFakeChatModel(messages=iter([AIMessage(content="Bring a jumper.")]))
        before = asyncio.all_tasks()
        answer = await resumer.resume(RunnableLambda(lambda given: seen.append(given) or given) | model, "unused")
        await new_tasks_done(before)
        await resumer.fork(forked)
        return answer.content
    assert using(server, resumed) == "Bring a jumper."
    assert seen == ["It is 21 degrees in Paris."]      # the last answer, as the chain's input
    messages = [m["content"] for m in state_of(server, chain_run)["state"]["context"]["messages"]]
    assert messages == ["Bring a jumper."], messages    # the first call's context is not in the latest snapshot
    older = [api(server, "GET", f"/api/v1/state/{chain_run}/version/{v['version']}")[2]["state"]
             for v in versions_of(server, chain_run)]
    assert any([m["content"] for m in s["context"]["messages"]] == ["It is 21 degrees in Paris."] for s in older)
    assert state_of(server, forked)["state"]["context"] == state_of(server, chain_run)["state"]["context"]
    assert api(server, "GET", f"/api/v1/channels/{forked}/metadata")[2]["parent_channel_id"] == chain_run


# =============================================================================================
# LangGraph: ActaeCheckpointSaver (a BaseCheckpointSaver)
# =============================================================================================

class Log(TypedDict):
    log: Annotated[list, operator.add]


def default_channel(prefix: str, thread_id: str, checkpoint_ns: str = "") -> str:
    """The channel the saver names a thread by, by its documented rule (prefix, then 16 hex of a SHA-256)."""
    identity = f"{thread_id}\x00{checkpoint_ns}".encode()
    return f"{prefix}:{hashlib.sha256(identity).hexdigest()[:16]}"


def saver_for(server, prefix: str, **kw):
    from actae_client.adapters.langgraph import ActaeCheckpointSaver

    return ActaeCheckpointSaver(client_for(server), channel=prefix, **kw)


def linear_graph(saver, *nodes):
    """A graph of `nodes` ((name, function) pairs) run one after another, checkpointed by `saver`."""
    from langgraph.graph import END, START, StateGraph

    graph = StateGraph(Log)
    previous = START
    for name, function in nodes:
        graph.add_node(name, function)
        graph.add_edge(previous, name)
        previous = name
    graph.add_edge(previous, END)
    return graph.compile(checkpointer=saver)


def approval_graph(saver):
    """plan, then ask (which interrupts for an answer), then ship."""
    from langgraph.types import interrupt

    return linear_graph(saver, ("plan", lambda state: {"log": ["plan"]}),
                        ("ask", lambda state: {"log": [f"ask:{interrupt({'question': 'ship it?'})}"]}),
                        ("ship", lambda state: {"log": ["ship"]}))


def test_a_langgraph_interrupt_is_resumed_by_a_fresh_saver(server, unique):
    from langgraph.types import Command

    prefix, config = unique("lg"), {"configurable": {"thread_id": "ticket-7"}}
    first = approval_graph(saver_for(server, prefix)).invoke({"log": []}, config)
    assert first["log"] == ["plan"] and first["__interrupt__"][0].value == {"question": "ship it?"}
    channel = default_channel(prefix, "ticket-7")
    assert events_of(server, channel)[0]["type"] == "langgraph.checkpoint"

    graph = approval_graph(saver_for(server, prefix))   # a restarted process: a new client and saver
    waiting = graph.get_state(config)
    assert waiting.next == ("ask",) and waiting.tasks[0].interrupts[0].value == {"question": "ship it?"}
    assert graph.invoke(Command(resume="yes"), config)["log"] == ["plan", "ask:yes", "ship"]
    events = events_of(server, channel)
    assert {e["type"] for e in events} == {"langgraph.checkpoint", "langgraph.pending_writes"}
    # each event is a snapshot's cursor: every checkpoint is a state version at its own event
    checkpoints = [e["cursor"] for e in events if e["type"] == "langgraph.checkpoint"]
    assert set(checkpoints) <= {v["cursor"] for v in versions_of(server, channel)}
    assert state_of(server, channel)["state"]["_actae_adapter"]["framework"] == "langgraph"


def test_a_crashed_parallel_step_keeps_its_finished_sibling_s_writes(server, unique):
    """`a` and `b` run in one superstep; `b` raises. The resumed graph (a fresh saver, ainvoke) runs `b`
    again and not `a`: `a`'s pending writes were stored with the checkpoint."""
    from langgraph.graph import END, START, StateGraph

    prefix, config = unique("lg"), {"configurable": {"thread_id": "crash-1"}}
    calls = {"a": 0, "b": 0}
    broken = {"b": True}

    def a(state):
        calls["a"] += 1
        return {"log": ["a"]}

    def b(state):
        calls["b"] += 1
        if broken["b"]:
            raise RuntimeError("b crashed")
        return {"log": ["b"]}

    def build(saver):
        graph = StateGraph(Log)
        graph.add_node("start", lambda state: {"log": ["start"]})
        graph.add_node("a", a)
        graph.add_node("b", b)
        graph.add_node("end", lambda state: {"log": ["end"]})
        graph.add_edge(START, "start")
        graph.add_edge("start", "a")
        graph.add_edge("start", "b")
        graph.add_edge(["a", "b"], "end")
        graph.add_edge("end", END)
        return graph.compile(checkpointer=saver)

    async def scenario():
        with pytest.raises(RuntimeError, match="b crashed"):
            await build(saver_for(server, prefix)).ainvoke({"log": []}, config)
        broken["b"] = False
        return await build(saver_for(server, prefix)).ainvoke(None, config)
    assert sorted(run(scenario())["log"]) == ["a", "b", "end", "start"]
    assert calls == {"a": 1, "b": 2}


def test_fork_thread_resumes_a_fork_from_an_earlier_checkpoint(server, unique):
    """fork_thread forks the thread's channel at a checkpoint's own event (an exact state boundary);
    the fork resumes from there with a changed node. graph.invoke inside a running loop is refused."""
    from actae_client.errors import ActaeLangGraphSyncError

    prefix, config = unique("lg"), {"configurable": {"thread_id": "essay"}}

    def build(saver, draft):
        return linear_graph(saver, ("research", lambda state: {"log": ["research"]}),
                            ("write", lambda state: {"log": [draft]}), ("review", lambda state: {"log": ["review"]}))

    async def scenario():
        saver = saver_for(server, prefix)
        graph = build(saver, "draft v1")
        assert (await graph.ainvoke({"log": []}, config))["log"] == ["research", "draft v1", "review"]
        with pytest.raises(ActaeLangGraphSyncError):
            graph.invoke({"log": []}, {"configurable": {"thread_id": "essay-sync"}})
        history = [s async for s in graph.aget_state_history(config)]
        before_write = next(s for s in history if s.next == ("write",))
        fork_config = await saver.fork_thread(before_write.config, new_thread_id="essay-v2")
        fixed = build(saver, "draft v2")
        assert (await fixed.aget_state(fork_config)).values == {"log": ["research"]}
        return (await fixed.ainvoke(None, fork_config))["log"]
    assert run(scenario()) == ["research", "draft v2", "review"]
    source, forked = default_channel(prefix, "essay"), default_channel(prefix, "essay-v2")
    metadata = api(server, "GET", f"/api/v1/channels/{forked}/metadata")[2]
    assert (metadata["parent_channel_id"], metadata["reproducibility"], metadata["restorable"]) == (
        source, "state_exact", True)
    # and a fresh saver reads the fork's latest checkpoint
    assert approval_graph(saver_for(server, prefix)).get_state(
        {"configurable": {"thread_id": "essay-v2"}}).values == {"log": ["research", "draft v2", "review"]}


def counter_graph(saver, steps: int):
    from langgraph.graph import END, START, StateGraph

    class Count(TypedDict):
        n: int
    graph = StateGraph(Count)
    graph.add_node("count", lambda state: {"n": state["n"] + 1})
    graph.add_edge(START, "count")
    graph.add_conditional_edges("count", lambda state: END if state["n"] >= steps else "count")
    return graph.compile(checkpointer=saver)


def test_delete_thread_leaves_the_versions_past_its_first_page_and_delete_channel_removes_them(server, unique):
    """delete_thread lists 100 versions, deletes them, then asks for the next page at offset 100 of a
    list that is 100 shorter: a thread of more than 100 snapshots keeps the rest, and reads as its
    older checkpoint. Deleting the thread's channel removes everything."""
    prefix, config = unique("lg"), {"configurable": {"thread_id": "long"}}
    channel = default_channel(prefix, "long")
    saver = saver_for(server, prefix)
    assert counter_graph(saver, 55).invoke({"n": 0}, {**config, "recursion_limit": 200}) == {"n": 55}
    stored = len(versions_of(server, channel))
    assert stored > 100, stored

    saver.delete_thread("long")
    assert len(versions_of(server, channel)) == stored - 100        # the failure: these are left
    assert 0 < counter_graph(saver, 55).get_state(config).values["n"] < 55   # an old checkpoint reads as the thread's

    async def delete_channel(client):
        return await client.delete_channel(channel)
    assert using(server, delete_channel)["deleted"] == [channel]
    assert versions_of(server, channel) == [] and counter_graph(saver, 55).get_state(config).values == {}
    assert counter_graph(saver, 3).invoke({"n": 0}, config) == {"n": 3}     # the thread starts afresh


def subgraph_graph(saver):
    """A graph whose one node is a subgraph that interrupts: its checkpoints have a namespace of their own."""
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import interrupt

    inner = StateGraph(Log)
    inner.add_node("inner", lambda state: {"log": [f"inner:{interrupt('ok?')}"]})
    inner.add_edge(START, "inner")
    inner.add_edge("inner", END)
    outer = StateGraph(Log)
    outer.add_node("outer", inner.compile())
    outer.add_edge(START, "outer")
    outer.add_edge("outer", END)
    return outer.compile(checkpointer=saver)


def per_thread_channel(config: dict) -> str:
    """A channel_resolver that keeps every namespace of a thread under the thread's own name."""
    configurable = config["configurable"]
    namespace = configurable.get("checkpoint_ns") or ""
    return configurable["thread_id"] + (f".{hashlib.sha256(namespace.encode()).hexdigest()[:16]}" if namespace else "")


def test_delete_thread_from_another_process_leaves_a_subgraph_s_checkpoints(server, unique):
    """delete_thread deletes the namespaces this saver object wrote; a saver in another process knows
    the root namespace only. The workaround: a channel_resolver that names each namespace's channel
    after the thread, and delete every channel of that name."""
    from langgraph.types import Command

    prefix, config = unique("lg"), {"configurable": {"thread_id": "nested"}}
    writer = saver_for(server, prefix)
    assert subgraph_graph(writer).invoke({"log": []}, config)["__interrupt__"][0].value == "ok?"
    assert subgraph_graph(saver_for(server, prefix)).invoke(Command(resume="yes"), config) == {"log": ["inner:yes"]}
    [namespace] = [ns for ns in writer._thread_namespaces["nested"] if ns]
    root, inner = default_channel(prefix, "nested"), default_channel(prefix, "nested", namespace)
    assert versions_of(server, inner)

    saver_for(server, prefix).delete_thread("nested")                 # another process
    assert versions_of(server, root) == [] and len(versions_of(server, inner)) > 0   # the failure

    thread = unique("nested")
    by_name = {"configurable": {"thread_id": thread}}
    resolver = {"channel_resolver": per_thread_channel}
    subgraph_graph(saver_for(server, prefix, **resolver)).invoke({"log": []}, by_name)
    subgraph_graph(saver_for(server, prefix, **resolver)).invoke(Command(resume="yes"), by_name)

    async def delete_every_namespace(client):
        mine = [c for c in await client.list_channels() if c == thread or c.startswith(thread + ".")]
        for channel in mine:
            await client.delete_channel(channel)
        return mine
    deleted = using(server, delete_every_namespace)
    assert len(deleted) == 2 and all(versions_of(server, c) == [] for c in deleted)


def test_a_langgraph_run_keeps_its_checkpoints_and_its_spans_in_one_run(server, unique):
    """The checkpointer's channel_resolver names the run by the thread id; the spans name the same run by
    actae.channel_id. The run reads as the graph's nodes (its trace) and forks exactly at a checkpoint."""
    pytest.importorskip("openinference.instrumentation.langchain")
    thread = unique("weather")
    assert drive(server, "langgraph_adapter_run.py", thread)["final"] == "It is 21 degrees in Paris."
    status, _, trace = api(server, "GET", f"/api/v1/channels/{thread}/trace")
    assert status == 200 and [(s["name"], s["kind"]) for s in trace["steps"]] == [
        ("agent", "agent"), ("tools", "chain"), ("agent", "agent")], trace
    assert [c["output_tokens"] for s in trace["steps"] for c in s["calls"] if c["kind"] == "llm"] == [9, 8]
    events = events_of(server, thread)
    checkpoints = [e["cursor"] for e in events if e["type"] == "langgraph.checkpoint"]
    assert len(checkpoints) == 5 and len(versions_of(server, thread)) >= 5
    assert sum(e["type"].startswith("span.") for e in events) == trace["spans"]
    receipt = fork(server, thread, unique("after-tools"), checkpoints[3])
    assert (receipt["restorable"], receipt["reproducibility"]) == (True, "state_exact"), receipt
    assert state_of(server, unique("after-tools"))["state"]["checkpoint_id"] == state_of(
        server, thread)["state"]["parent_checkpoint_id"]


# =============================================================================================
# OTLP spans and an AgentSession in one run
# =============================================================================================

def export_chat_span(server, run_id: str, name: str, tokens: tuple) -> None:
    """One GenAI-convention model span, named to `run_id`, through the standard OTLP/HTTP exporter."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "bot", "actae.channel_id": run_id}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(
        endpoint=f"{server.url}/v1/traces", headers={"x-api-key": server.key})))
    with provider.get_tracer("test").start_as_current_span(name, attributes={
            "gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o-mini", "gen_ai.provider.name": "openai",
            "gen_ai.usage.input_tokens": tokens[0], "gen_ai.usage.output_tokens": tokens[1]}):
        pass
    provider.shutdown()


def test_the_standard_environment_variables_name_the_server_the_key_and_the_run(server, unique, monkeypatch):
    """The setup docs/frameworks.md gives every framework: no argument to the provider or the exporter,
    OTEL_EXPORTER_OTLP_ENDPOINT (the exporter adds /v1/traces), OTEL_EXPORTER_OTLP_HEADERS (the key) and
    OTEL_RESOURCE_ATTRIBUTES (the run's name)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    run_id = unique("env")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", server.url)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"x-api-key={server.key}")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", f"actae.channel_id={run_id},service.name=env-bot")
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    with provider.get_tracer("test").start_as_current_span("invoke_agent bot", attributes={
            "gen_ai.operation.name": "invoke_agent"}):
        pass
    provider.shutdown()
    status, _, trace = api(server, "GET", f"/api/v1/channels/{run_id}/trace")
    assert status == 200 and [(s["name"], s["kind"]) for s in trace["steps"]] == [("invoke_agent bot", "agent")]
    assert api(server, "GET", f"/runs/{run_id}?format=json")[2]["run"]["display_name"] == "env-bot · invoke_agent bot"


def test_an_ingested_run_forks_lineage_only_unless_an_agent_session_saves_its_state(server, unique):
    from actae_client import AgentSession

    spans_only = unique("spans")
    export_chat_span(server, spans_only, "chat plan", (100, 10))
    status, _, refused = api(server, "POST", "/api/v1/channels/fork", body={
        "source_channel_id": spans_only, "new_channel_id": unique("spans-fork"), "at_cursor": 1})
    assert (status, refused["status"]) == (409, "snapshot_boundary_required"), refused
    lineage = fork(server, spans_only, unique("spans-lineage"), 0)
    assert lineage["restorable"] is False and state_of(server, unique("spans-lineage"))["state"] is None

    both = unique("both")
    state = {"done": []}

    async def session_beside_spans(client):
        async with AgentSession(client, both, state_fn=lambda: json.loads(json.dumps(state))) as session:
            for step, tokens in (("plan", (100, 10)), ("act", (200, 20)), ("answer", (300, 30))):
                export_chat_span(server, both, f"chat {step}", tokens)
                state["done"].append(step)
                await session.step(step, output={"done": step})
            forked = await session.fork(2, unique("both-fork"))
            return forked.fork_receipt, forked.inherited_state
    receipt, inherited = using(server, session_beside_spans)
    assert (receipt.restorable, receipt.reproducibility) == (True, "state_exact")
    assert inherited == {"done": ["plan", "act"]}
    status, _, trace = api(server, "GET", f"/api/v1/channels/{both}/trace")
    assert status == 200 and [s["input_tokens"] for s in trace["steps"]] == [100, 200, 300]


# =============================================================================================
# The OpenAI Agents SDK: install_actae_tracing (an agents.tracing processor)
# =============================================================================================

def test_the_openai_agents_tracing_processor_stores_each_span_and_a_snapshot_per_trace(server, unique):
    """Two runs of a tool-using agent into one channel: every span as an `openai.span.end` event, each
    trace's spans as one snapshot at its `openai.trace.end`, fork_trace forking at the first. The
    model calls' usage is in the events, under payload.span.usage, where the server's usage rule does not
    look: the run counts no steps and its fork saved nothing, by the server's reckoning."""
    pytest.importorskip("agents")
    channel = unique("agents")
    out = drive(server, "openai_agents_adapter_run.py", channel)
    assert out["answers"] == ["It is 21 degrees in Paris."] * 2
    events = events_of(server, channel)
    kinds = [e["type"] for e in events]
    assert (kinds.count("openai.trace.start"), kinds.count("openai.span.end"), kinds.count("openai.trace.end")) == (
        2, 14, 2), kinds
    spans = [e["payload"]["span"] for e in events if e["type"] == "openai.span.end"
             and e["payload"]["trace_id"] == out["trace_ids"][0]]
    generations = [s for s in spans if s["type"] == "GenerationSpanData"]
    assert [(g["model"], g["usage"]["input_tokens"], g["usage"]["output_tokens"]) for g in generations] == [
        ("gpt-4o-mini", 60, 12), ("gpt-4o-mini", 70, 12)]
    [tool] = [s for s in spans if s["type"] == "FunctionSpanData"]
    assert (tool["name"], json.loads(tool["input"]), tool["output"]) == ("get_weather", {"city": "Paris"},
                                                                        "21 degrees in Paris")
    snapshots = sorted(versions_of(server, channel), key=lambda v: v["version"])
    assert len(snapshots) == 2
    first = api(server, "GET", f"/api/v1/state/{channel}/version/{snapshots[0]['version']}")[2]["state"]
    assert first["trace_id"] == out["trace_ids"][0] and len(first["spans"]) == 7
    metadata = api(server, "GET", f"/api/v1/channels/{out['fork']}/metadata")[2]
    assert (metadata["parent_channel_id"], metadata["forked_at_cursor"], metadata["reproducibility"]) == (
        channel, snapshots[0]["cursor"], "state_exact")
    # the failure: 130 tokens spent before the fork point, none of them visible to the server
    page = api(server, "GET", f"/runs/{channel}?format=json")[2]
    assert page["run"]["step_count"] == 0 and page["steps"] == []
    saved = api(server, "GET", f"/api/v1/channels/{out['fork']}/savings")[2]["fork"]["saved"]
    assert (saved["steps"], saved["input_tokens"], saved["output_tokens"]) == (0, 0, 0), saved


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """A server whose model gateway has the tiny model server of examples/ as its `openai` upstream."""
    tiny = import_example("tiny_model_server.py")
    upstream, _ = tiny.serve()
    try:
        with ServerProcess(tmp_path_factory.mktemp("gateway"), args=[
                "--llm-upstream", f"openai=http://127.0.0.1:{upstream.server_address[1]}"]).start() as srv:
            yield srv
    finally:
        upstream.shutdown()


def gateway_calls(srv, run_id: str) -> list:
    return [e["payload"] for e in events_of(srv, run_id) if e["type"] == "llm.call"]


def test_the_agents_sdk_s_responses_model_through_the_gateway_and_the_tracing_processor(gateway, unique):
    """OpenAIResponsesModel (the Agents SDK's default model class): the tracing processor's response span
    keeps the usage but neither the model nor the answer; the gateway records the call whole, priced."""
    pytest.importorskip("agents")
    run_id = unique("responses")
    base = f"{gateway.url}/llm/runs/{run_id}/openai/v1"
    out = drive(gateway, "openai_agents_adapter_run.py", run_id + "-spans", "--gateway", base)
    assert out["answers"] == ["echo: hello agents"]
    [response] = [e["payload"]["span"] for e in events_of(gateway, run_id + "-spans")
                  if e["type"] == "openai.span.end" and e["payload"]["span"]["type"] == "ResponseSpanData"]
    assert response["usage"]["input_tokens"] == 2 and "model" not in response and "output" not in response
    [call] = gateway_calls(gateway, run_id)
    assert (call["api"], call["model"], call["status"], call["usage"]["input_tokens"],
            call["usage"]["output_tokens"]) == ("responses", "gpt-4o-mini", "completed", 2, 3)
    assert call["cost"] == pytest.approx(2 * 0.15e-6 + 3 * 0.6e-6)


# =============================================================================================
# Pydantic AI (no SDK adapter): through the gateway
# =============================================================================================

def test_pydantic_ai_through_the_gateway_records_each_model_call(gateway, unique):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    run_id = unique("pydantic")
    agent = Agent(OpenAIChatModel("gpt-4o-mini", provider=OpenAIProvider(
        base_url=f"{gateway.url}/llm/runs/{run_id}/openai/v1", api_key=gateway.key)))
    assert agent.run_sync("hello pydantic").output == "echo: hello pydantic"
    assert agent.run_sync("and again").output == "echo: and again"
    calls = gateway_calls(gateway, run_id)
    assert [(c["api"], c["model"], c["usage"]["input_tokens"], c["usage"]["output_tokens"]) for c in calls] == [
        ("chat.completions", "gpt-4o-mini", 2, 3), ("chat.completions", "gpt-4o-mini", 2, 3)], calls
    assert all(c["cost"] == pytest.approx(2 * 0.15e-6 + 3 * 0.6e-6) for c in calls)


# =============================================================================================
# The Codex CLI: CodexOTLPReceiver (an OTLP/HTTP log receiver)
# =============================================================================================

def codex_log_record(conversation: str, *, body: bool) -> dict:
    """One `codex.sse_event` log record as Codex's exporter writes it: the event's name in the attribute
    `event.name` (its tracing event's fields become attributes; it has no message, so no body), int64
    figures as OTLP JSON's decimal strings. `body`: with the name also as the body, as an OpenTelemetry
    Collector's transform processor can set it (`set(body, attributes["event.name"])`)."""
    def kv(key, value):
        return {"key": key, "value": {"intValue": str(value)} if isinstance(value, int) else {"stringValue": value}}
    record = {"timeUnixNano": "1700000000000000000", "severityText": "INFO", "attributes": [
        kv("event.name", "codex.sse_event"), kv("event.kind", "response.completed"), kv("conversation.id", conversation),
        kv("model", "gpt-5-codex"), kv("input_token_count", 1200), kv("output_token_count", 300)]}
    if body:
        record["body"] = {"stringValue": "codex.sse_event"}
    return {"resourceLogs": [{"resource": {"attributes": [kv("service.name", "codex_cli_rs")]},
                              "scopeLogs": [{"scope": {"name": "codex_otel"}, "logRecords": [record]}]}]}


def test_the_codex_receiver_takes_the_event_name_from_the_body_only_and_json_only(server, unique):
    import aiohttp
    from actae_client.adapters.codex import CodexOTLPReceiver

    as_written, transformed = unique("codex"), unique("codex-body")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def export(client):
        receiver = CodexOTLPReceiver(client, host="127.0.0.1", port=port)
        await receiver.start()
        url, answers = f"http://127.0.0.1:{port}/v1/logs", []
        try:
            async with aiohttp.ClientSession() as session:
                for request in (session.post(url, json=codex_log_record(as_written, body=False)),
                                session.post(url, data=b"\x0a\x02\x0a\x00",
                                             headers={"content-type": "application/x-protobuf"}),
                                session.post(url, json=codex_log_record(transformed, body=True))):
                    async with request as answer:
                        answers.append((answer.status, await answer.json()))
        finally:
            await receiver.stop()
        return answers
    as_codex_writes_it, protobuf, with_a_body = using(server, export)
    assert as_codex_writes_it == (200, {"processed": 0})                          # the failure: nothing stored
    assert events_of(server, f"codex:{as_written}") == []
    assert protobuf[0] == 400 and protobuf[1] == {"error": "invalid JSON"}       # OTLP/HTTP protobuf
    assert with_a_body == (200, {"processed": 1})                                  # the workaround's shape
    [event] = events_of(server, f"codex:{transformed}")
    assert event["type"] == "codex.sse_event" and event["payload"]["input_token_count"] == "1200"
    assert state_of(server, f"codex:{transformed}")["state"]["tokens"] == {"input_token_count": 1200,
                                                                          "output_token_count": 300}
