"""OTLP ingest: POST /v1/traces turns any framework's OpenTelemetry spans into runs. The standard
OTLP/HTTP exporter (protobuf) and OTLP JSON deliver GenAI-convention spans: each trace becomes a run
(`trace-<trace id>`, or the run `actae.channel_id` names), its agent spans steps, its model and tool
spans the calls inside them with usage priced as the model gateway prices it; an exception makes the
run failed and its stack trace is kept. The same spans shuffled, split across batches and sent twice
give the same run. Bad bodies get 400, oversize 413, keys without write 403, a rate limit 429 with
Retry-After that the standard exporter honours; a call seen by both the gateway and a span counts once.
The waterfall is drawn in a browser at desktop and phone widths; an ingested run forks lineage only from
its page, and moves to another server (export, import) with its model calls.
"""
from __future__ import annotations

import gzip
import json
import logging
import random
import time
import uuid

import pytest
from google.protobuf import json_format
from opentelemetry import trace as otel_trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                       ExportTraceServiceResponse)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import DESKTOP, PHONE, ServerProcess, api, http, import_example, logged_in, new_key, query_database

PROTOBUF = {"content-type": "application/x-protobuf"}


def agent_spans(run_name: str | None = None, *, fail: bool = True, service: str = "weather-bot") -> list:
    """A GenAI-convention agent run, as an instrumented application makes it: invoke_agent, then a
    chat call, a tool call and a second chat call that raises (when `fail`)."""
    memory = InMemorySpanExporter()
    attributes = {"service.name": service, **({"actae.channel_id": run_name} if run_name else {})}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("invoke_agent weather", attributes={"gen_ai.operation.name": "invoke_agent"}):
        with tracer.start_as_current_span("chat gpt-4o-mini", attributes={
                "gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o-mini", "gen_ai.provider.name": "openai",
                "gen_ai.usage.input_tokens": 1200, "gen_ai.usage.output_tokens": 80,
                "gen_ai.input.messages": json.dumps([{"role": "user", "parts": [{"type": "text", "content": "Weather in Paris?"}]}]),
                "gen_ai.output.messages": json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": "Let me look."}]}])}):
            time.sleep(0.002)
        with tracer.start_as_current_span("execute_tool get_weather", attributes={
                "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "get_weather",
                "gen_ai.tool.call.arguments": '{"city": "Paris"}', "gen_ai.tool.call.result": '{"celsius": 21}'}):
            time.sleep(0.002)
        with tracer.start_as_current_span("chat gpt-4o-mini", attributes={
                "gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o-mini", "gen_ai.provider.name": "openai",
                "gen_ai.usage.input_tokens": 1300, "gen_ai.usage.output_tokens": 40}) as last:
            if fail:
                try:
                    raise RuntimeError("the model answered in Klingon")
                except RuntimeError as exc:
                    last.record_exception(exc)
                    last.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, str(exc)))
    provider.shutdown()
    return list(memory.get_finished_spans())


def run_of(spans: list, named: str | None = None) -> str:
    return named or f"trace-{spans[0].context.trace_id:032x}"


def protobuf_of(spans: list) -> bytes:
    return encode_spans(spans).SerializeToString()


def json_of(spans: list) -> bytes:
    """OTLP JSON as the specification writes it: camelCase, ids in hex, 64-bit integers as strings."""
    document = json_format.MessageToDict(encode_spans(spans))

    def hex_ids(value):
        if isinstance(value, dict):
            return {k: (bytes(__import__("base64").b64decode(v)).hex() if k in ("traceId", "spanId", "parentSpanId")
                        else hex_ids(v)) for k, v in value.items()}
        if isinstance(value, list):
            return [hex_ids(v) for v in value]
        return value
    return json.dumps(hex_ids(document)).encode()


def post(server, raw: bytes, *, key=None, headers=None, json_body=False):
    kind = {"content-type": "application/json"} if json_body else dict(PROTOBUF)
    return http("POST", f"{server.url}/v1/traces", key=key if key is not None else server.key, raw=raw,
                headers={**kind, **(headers or {})}, decode=False)


def accepted(answer: tuple, json_body=False):
    status, headers, body = answer
    assert status == 200, (status, body)
    if json_body:
        return json.loads(body)
    return ExportTraceServiceResponse.FromString(body)


def run_page(server, run: str) -> dict:
    status, _, page = http("GET", f"{server.url}/runs/{run}?format=json", key=server.key)
    assert status == 200, page
    return page


def trace_of(server, run: str) -> dict:
    status, _, answer = api(server, "GET", f"/api/v1/channels/{run}/trace")
    assert status == 200, answer
    return answer


def test_the_standard_exporter_makes_a_run_of_steps_and_calls_with_usage_and_a_failure(server):
    spans = agent_spans()
    exporter = OTLPSpanExporter(endpoint=f"{server.url}/v1/traces", headers={"x-api-key": server.key})
    assert exporter.export(spans).name == "SUCCESS"
    run = run_of(spans)
    answer = trace_of(server, run)
    assert (answer["spans"], answer["status"], len(answer["steps"])) == (4, "error", 1), answer
    step = answer["steps"][0]
    assert (step["name"], step["kind"], step["input_tokens"], step["output_tokens"]) == (
        "invoke_agent weather", "agent", 2500, 120)
    calls = [(c["kind"], c["name"], c["input_tokens"], c["status"]) for c in step["calls"]]
    assert calls == [("llm", "chat gpt-4o-mini", 1200, "ok"), ("tool", "execute_tool get_weather", None, "ok"),
                     ("llm", "chat gpt-4o-mini", 1300, "error")], calls
    chat, tool, failed = step["calls"]
    # priced as the gateway prices (genai-prices): gpt-4o-mini at $0.15 in, $0.60 out per million tokens
    assert chat["cost"] == pytest.approx(1200 * 0.15e-6 + 80 * 0.6e-6) and chat["model"] == "gpt-4o-mini"
    assert chat["input"] == [{"role": "user", "content": "Weather in Paris?"}]
    assert chat["output"] == [{"role": "assistant", "content": "Let me look."}]
    assert (tool["tool"], tool["input"], tool["output"]) == ("get_weather", {"city": "Paris"}, {"celsius": 21})
    assert failed["error"]["type"] == "RuntimeError" and "Traceback" in failed["error"]["stacktrace"]
    # the run: failed with the exception's message; its calls are the gateway's record (the call page reads them)
    page = run_page(server, run)
    assert page["run"]["status"] == "failed" and "Klingon" in page["failure"]["message"], page["failure"]
    status, _, call = http("GET", f"{server.url}/runs/{run}/calls/{chat['call_id']}?format=json", key=server.key)
    assert status == 200 and call["call"]["input_tokens"] == 1200 and call["asked"][0]["text"] == "Weather in Paris?"


def test_json_and_gzip_give_the_same_run_as_protobuf(server):
    spans = agent_spans()
    named = f"json-{spans[0].context.trace_id:032x}"[:40]
    first = agent_spans(named, fail=False)
    second = agent_spans(named + "-pb", fail=False)
    answer = accepted(post(server, json_of(first), json_body=True), json_body=True)
    assert answer == {} or answer.get("partialSuccess", {}).get("rejectedSpans") in (None, "0"), answer
    accepted(post(server, gzip.compress(protobuf_of(second)), headers={"content-encoding": "gzip"}))
    by_json, by_protobuf = trace_of(server, named), trace_of(server, named + "-pb")

    def shape(t):
        return [(s["name"], s["input_tokens"], s["output_tokens"], s["cost"],
                 [(c["kind"], c["name"], c["input_tokens"], c["input"], c["output"]) for c in s["calls"]])
                for s in t["steps"]]
    assert shape(by_json) == shape(by_protobuf) and by_json["status"] == "ok" == by_protobuf["status"]
    assert run_page(server, named)["run"]["status"] == "completed"
    assert run_page(server, named)["run"]["display_name"] == "weather-bot · invoke_agent weather"


def named_batches(spans: list, run: str, sizes: list, seed: int) -> list:
    """The same spans (ids, times, attributes), named to `run` by their resource, shuffled and split into
    requests of `sizes` spans."""
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    message = encode_spans(spans)
    flat = []
    for resource_spans in message.resource_spans:
        resource_spans.resource.attributes.append(KeyValue(key="actae.channel_id", value=AnyValue(string_value=run)))
        for scope_spans in resource_spans.scope_spans:
            flat += [(resource_spans.resource, scope_spans.scope, span) for span in scope_spans.spans]
    random.Random(seed).shuffle(flat)
    requests = []
    for size in sizes:
        part, flat = flat[:size], flat[size:]
        request = ExportTraceServiceRequest()
        for resource, scope, span in part:
            resource_spans = request.resource_spans.add()
            resource_spans.resource.CopyFrom(resource)
            scope_spans = resource_spans.scope_spans.add()
            scope_spans.scope.CopyFrom(scope)
            scope_spans.spans.append(span)
        requests.append(request.SerializeToString())
    return requests


def comparable(trace: dict) -> dict:
    """A run's trace without what names the run (its id, its calls' ids in the call record)."""
    return {**trace, "channel_id": None,
            "steps": [{**step, "calls": [{**call, "call_id": None} for call in step["calls"]]} for step in trace["steps"]]}


def test_spans_shuffled_split_and_sent_twice_give_the_same_run(server):
    spans = agent_spans()
    reference = run_of(spans)
    accepted(post(server, protobuf_of(spans)))
    expected = comparable(trace_of(server, reference))
    for seed in (1, 2, 3):
        run = f"{reference}-shuffled-{seed}"
        batches = named_batches(spans, run, [1, 2, 1], seed)
        for raw in batches + batches[::-1]:                    # every span twice, in another order
            accepted(post(server, raw))
        assert comparable(trace_of(server, run)) == expected
        status, _, events = api(server, "GET", f"/api/v1/events/replay/{run}?limit=100")
        assert len(events["events"]) == 4                      # one event per span: the second sending changed nothing
        assert run_page(server, run)["run"]["status"] == "failed"
    # the same spans again, to the same run: nothing changes
    again = accepted(post(server, protobuf_of(spans)))
    assert not again.HasField("partial_success") or again.partial_success.rejected_spans == 0
    assert comparable(trace_of(server, reference)) == expected


def test_bad_bodies_sizes_and_keys(server):
    spans = agent_spans(fail=False)
    status, _, body = post(server, b"\x0a\xff\xff\xff garbage")
    assert status == 400
    status, _, body = post(server, b"{not json", json_body=True)
    assert status == 400 and json.loads(body)["status"] == "bad_request"
    status, _, body = post(server, b"\x1f\x8b not gzip", headers={"content-encoding": "gzip"})
    assert status == 400
    bomb = gzip.compress(b"\0" * (40 * 1024 * 1024))              # 40 KB that unzip to 40 MiB
    status, _, body = post(server, bomb, headers={"content-encoding": "gzip"})
    assert status == 413
    status, _, body = post(server, b"\0" * (5 * 1024 * 1024))
    assert status == 413
    status, _, body = post(server, protobuf_of(spans), key="")
    assert status == 401
    reader = new_key(server, read=["*"])
    status, _, body = post(server, protobuf_of(spans), key=reader)
    assert status == 403
    # a key that may write some runs: the others' spans are refused, the answer's partial success says so
    mine = agent_spans("ingest-mine-1", fail=False)
    theirs = agent_spans("ingest-theirs-1", fail=False)
    writer = new_key(server, read=["ingest-mine-*"], write=["ingest-mine-*"])
    answer = accepted(post(server, protobuf_of(mine + theirs), key=writer))
    assert answer.partial_success.rejected_spans == len(theirs)
    assert "ingest-theirs-1" in answer.partial_success.error_message
    assert trace_of(server, "ingest-mine-1")["spans"] == len(mine)
    assert api(server, "GET", "/api/v1/channels/ingest-theirs-1/trace")[0] == 404
    assert api(server, "GET", f"/api/v1/channels/{run_of(spans)}/trace", key=writer)[0] in (403, 404)
    # the server goes on serving
    assert accepted(post(server, protobuf_of(agent_spans(fail=False))))


def test_the_standard_exporter_honours_429_retry_after(tmp_path, caplog):
    # 2 spans a second: the first batch of 4 goes (a full bucket takes one batch over its burst), the
    # second must wait 2 s, which Retry-After says; the exporter's own first backoff would be about 1 s
    with ServerProcess(tmp_path, args=["--otlp-ingest-rate", "2"]).start() as srv:
        exporter = OTLPSpanExporter(endpoint=f"{srv.url}/v1/traces", headers={"x-api-key": srv.key}, timeout=30)
        first, second = agent_spans(fail=False), agent_spans(fail=False)
        assert exporter.export(first).name == "SUCCESS"
        started = time.monotonic()
        with caplog.at_level(logging.WARNING):
            assert exporter.export(second).name == "SUCCESS"      # 429, Retry-After: 2, then accepted
        waited = time.monotonic() - started
        assert waited >= 1.9, waited
        assert any("retrying in 2.00s" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
        assert trace_of(srv, run_of(second))["spans"] == 4
        exporter.shutdown()


def test_a_call_the_gateway_recorded_and_a_span_reported_counts_once(tmp_path):
    tiny = import_example("tiny_model_server.py")
    upstream, _ = tiny.serve()
    try:
        url = f"http://127.0.0.1:{upstream.server_address[1]}"
        with ServerProcess(tmp_path, args=["--llm-upstream", f"openai={url}"]).start() as srv:
            import openai
            client = openai.OpenAI(base_url=f"{srv.url}/llm/runs/both-1/openai/v1", api_key=srv.key, max_retries=0)
            answer = client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi there"}])
            memory = InMemorySpanExporter()
            provider = TracerProvider(resource=Resource.create({"actae.channel_id": "both-1"}))
            provider.add_span_processor(SimpleSpanProcessor(memory))
            with provider.get_tracer("t").start_as_current_span("chat gpt-4o-mini", attributes={
                    "gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o-mini", "gen_ai.provider.name": "openai",
                    "gen_ai.response.id": answer.id, "gen_ai.usage.input_tokens": answer.usage.prompt_tokens,
                    "gen_ai.usage.output_tokens": answer.usage.completion_tokens}):
                pass
            accepted(post(srv, protobuf_of(memory.get_finished_spans())))
            [call] = trace_of(srv, "both-1")["steps"][0]["calls"]
            calls = query_database(srv, "SELECT id, upstream FROM llm_calls WHERE channel_id = 'both-1'")
            assert [row[1] for row in calls] == ["openai"], calls              # one call: the gateway's
            assert call["call_id"] == calls[0][0]
    finally:
        upstream.shutdown()


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_the_run_page_draws_the_waterfall_and_a_crashed_step_s_stack_trace(server, browser, viewport):
    spans = agent_spans()
    accepted(post(server, protobuf_of(spans)))
    run = run_of(spans)
    context, page = logged_in(browser, server, viewport)
    try:
        page.goto(f"{server.url}/runs/{run}")
        waterfall = page.locator("#waterfall")
        assert waterfall.is_visible()
        rows = page.locator("#waterfall .wf-call")
        assert rows.count() == 3 and rows.nth(1).get_attribute("data-kind") == "tool"
        bars = page.locator("#waterfall .wf-call rect")
        xs = [float(bars.nth(i).get_attribute("x")) for i in range(3)]
        assert xs == sorted(xs) and xs[2] > xs[0], xs                   # one time axis, in start order
        stack = page.locator("#waterfall .wf-error .stack").first
        assert stack.is_visible() and "RuntimeError: the model answered in Klingon" in stack.inner_text()
        rows.nth(0).locator("summary").click()
        assert "Weather in Paris?" in rows.nth(0).inner_text()
        assert page.locator("#lineage-only").is_visible()               # forks keep its lineage only, and why
        assert "state_fn" in page.locator("#lineage-only").inner_text()
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= viewport["width"], f"the page scrolls sideways: {width} px"
    finally:
        context.close()


def test_an_ingested_run_forks_lineage_only_from_its_page(server, browser):
    spans = agent_spans(fail=False)
    accepted(post(server, protobuf_of(spans)))
    run = run_of(spans)
    context, page = logged_in(browser, server)
    try:
        page.goto(f"{server.url}/runs/{run}#fork")
        page.fill("#lineage-fork input[name=name]", f"{run}-again")
        with page.expect_navigation():
            page.click("#lineage-fork button[type=submit]")
        assert page.url.startswith(f"{server.url}/runs/{run}-again"), page.url
        assert "not restorable" in page.locator("#receipt").inner_text()
    finally:
        context.close()
    status, _, receipt = api(server, "GET", f"/api/v1/channels/{run}-again/receipt")
    assert status == 200 and (receipt["restorable"], receipt["source_channel_id"], receipt["resolved_cursor"]) == (
        False, run, 0), receipt
    assert receipt["manifest"]["boundary_mode"] == "lineage_only"


def test_an_ingested_run_moves_to_another_server_with_its_calls(server, tmp_path):
    spans = agent_spans()
    accepted(post(server, protobuf_of(spans)))
    run = run_of(spans)
    status, _, exported = http("GET", f"{server.url}/api/v1/channels/{run}/export", key=server.key, decode=False)
    assert status == 200
    with ServerProcess(tmp_path).start() as other:
        status, _, answer = http("POST", f"{other.url}/api/v1/import", key=other.key, raw=exported,
                                 headers={"content-type": "application/x-ndjson"})
        assert status == 200, answer
        assert comparable(trace_of(other, run)) == comparable(trace_of(server, run))
        for call in trace_of(other, run)["steps"][0]["calls"]:
            if call["kind"] == "llm":               # the call record travels with the run's events
                status, _, page = http("GET", f"{other.url}/runs/{run}/calls/{call['call_id']}?format=json",
                                       key=other.key)
                assert status == 200 and page["call"]["input_tokens"] == call["input_tokens"], page


def span_request(run: str, spans: list) -> bytes:
    """An export of hand-built spans (dicts of the proto's fields) named to `run`."""
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.append(KeyValue(key="actae.channel_id", value=AnyValue(string_value=run)))
    scope = resource_spans.scope_spans.add()
    for fields in spans:
        attributes = fields.pop("attributes", {})
        span = scope.spans.add(**fields)
        for key, value in attributes.items():
            span.attributes.append(KeyValue(key=key, value=value))
    return request.SerializeToString()


def test_odd_spans_are_refused_alone_and_deep_or_forged_ones_never_break_the_run(server, unique):
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue
    trace = bytes.fromhex("ab" * 16)
    odd = [{"trace_id": trace, "span_id": bytes([1] * 8), "name": "chat", "start_time_unix_nano": 1,
            "end_time_unix_nano": 2, "attributes": {
                "gen_ai.operation.name": AnyValue(string_value="chat"),
                "gen_ai.request.model": AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=1)])),
                "gen_ai.usage.input_tokens": AnyValue(int_value=10), "gen_ai.usage.output_tokens": AnyValue(int_value=2),
                "gen_ai.tool.name": AnyValue(double_value=float("nan")),
                "weird": AnyValue(double_value=float("inf"))}},
           {"trace_id": trace, "span_id": bytes([2] * 8), "name": "no ids", "start_time_unix_nano": 1,
            "end_time_unix_nano": 2, "trace_id": b""}]
    status, _, body = post(server, span_request(unique("odd"), odd))
    answer = ExportTraceServiceResponse.FromString(body)
    assert status == 200 and answer.partial_success.rejected_spans == 1, (status, answer)
    assert trace_of(server, unique("odd"))["steps"][0]["calls"][0]["model"] is None
    # a chain 1,500 spans deep: one request, one run, read without recursion
    deep = [{"trace_id": trace, "span_id": (n + 1).to_bytes(8, "big"), "name": f"s{n}",
             "parent_span_id": n.to_bytes(8, "big") if n else b"", "start_time_unix_nano": 10 + n,
             "end_time_unix_nano": 10_000 - n, "attributes": {"openinference.span.kind": AnyValue(string_value="CHAIN")}}
            for n in range(1500)]
    accepted(post(server, span_request(unique("deep"), deep)))
    assert trace_of(server, unique("deep"))["spans"] == 1500
    # a hand-made event that claims to be a span, twice, its own parent: the trace still answers
    for payload in ({"trace_id": "t", "span_id": "s", "parent_span_id": "s", "start_ns": 1, "end_ns": 2},
                    {"trace_id": "t", "span_id": "s", "start_ns": 1, "end_ns": 2, "kind": "agent"},
                    {"span_id": 7}):
        status, _, _ = api(server, "POST", "/api/v1/events/record", body={
            "channel_id": unique("forged"), "event_type": "span.agent", "payload": payload,
            "operation_id": f"otlp:{uuid.uuid4().hex}"})
        assert status == 200
    forged = trace_of(server, unique("forged"))
    assert forged["spans"] == 1 and len(forged["steps"]) == 1
    assert run_page(server, unique("forged"))["trace"]["spans"] == 1
