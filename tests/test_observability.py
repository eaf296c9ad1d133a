"""Observability (issue 21): every run as an OpenTelemetry trace, and Prometheus metrics.

Each test starts real servers (conftest's ServerProcess) and, where traces are checked, a real
OTLP/HTTP collector on loopback (conftest's `Collector`: http.server in a thread, decoding each request with
opentelemetry-proto). The fork walkthrough runs through the real SDK (examples/fork_demo.py).

- the walkthrough's spans: a root per run, a span per step in order, gen_ai.* and actae.*
  attributes, the fork's link to the parent's boundary step, ERROR on the failed run, the blocked
  charge marked blocked and never executed; `actae otel-export` sends the same trace again
- a run that crashed (the SDK marks it) and one whose process died: their step spans agree with
  the backfill, and the crash is an ERROR root
- a collector that answers 503 slowly, or is not there: writes succeed, the server stays healthy,
  actae_spans_dropped_total rises (the speed is measured in examples/bench.py, not here)
- /metrics parses with prometheus_client's parser, and after a scripted sequence every named
  metric moved by exactly what the sequence did
- configuration errors are named at start
"""
from __future__ import annotations

import hashlib
import time
import uuid

import pytest

from conftest import (Collector, ServerProcess, cli, exporting_server, http, import_example, metric_values,
                      otel_export, poll, using, value, without_otel)


# --------------------------------------------------------------------------------------------
# A real OTLP/HTTP collector on loopback (conftest's `Collector`), and the traces it takes
# --------------------------------------------------------------------------------------------


@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.stop()


def trace_id(channel: str) -> str:
    return hashlib.sha256(b"actae.trace\x00" + channel.encode()).digest()[:16].hex()


def span_id(channel: str, cursor: int) -> str:
    return hashlib.sha256(b"actae.span\x00%s\x00%d" % (channel.encode(), cursor)).digest()[:8].hex()


def roots(spans):
    return [s for s in spans if not s["parent"]]


def comparable(spans):
    """Spans as a set of everything a backend shows (ids, names, times, attributes, status, links)."""
    return {(s["trace_id"], s["span_id"], s["parent"], s["name"], s["start"], s["end"], s["status"],
             tuple(sorted(s["attributes"].items())), repr(s["links"])) for s in spans}


# --------------------------------------------------------------------------------------------
# Acceptance 1 and 3: the walkthrough as traces, live and backfilled
# --------------------------------------------------------------------------------------------


def test_the_fork_walkthrough_as_traces_live_and_backfilled(tmp_path, collector):
    with exporting_server(tmp_path, collector.url) as server:
        demo = import_example("fork_demo.py")
        name = f"otel-{uuid.uuid4().hex[:8]}"
        base, fork = f"{name}-base", f"{name}-fork"
        checks = using(server, lambda client: demo.walkthrough(client, base, fork))
        assert all(ok for _, ok, _ in checks), [c for c in checks if not c[1]]
        spans = collector.wait_for(lambda got: len(roots(got)) >= 2, what="two roots")
        by_trace = {trace_id(base): [s for s in spans if s["trace_id"] == trace_id(base)],
                    trace_id(fork): [s for s in spans if s["trace_id"] == trace_id(fork)]}
        assert len(spans) == sum(map(len, by_trace.values())), "every span belongs to one of the two runs"

        # one root per run, named after the agent, the ids derived from the record
        for channel in (base, fork):
            (root,) = roots(by_trace[trace_id(channel)])
            assert root["name"] == f"invoke_agent {channel}"
            assert root["span_id"] == span_id(channel, 0)
            assert root["service"] == "actae" and root["scope"] == "actae"
            a = root["attributes"]
            assert a["gen_ai.operation.name"] == "invoke_agent" and a["gen_ai.agent.name"] == channel
            assert a["gen_ai.conversation.id"] == channel and a["actae.channel_id"] == channel
            assert all(s["parent"] == root["span_id"] for s in by_trace[trace_id(channel)] if s is not root)
            assert all(s["start"] <= s["end"] for s in by_trace[trace_id(channel)])
            assert all(root["start"] <= s["start"] and s["end"] <= root["end"] for s in by_trace[trace_id(channel)])

        # a span per step, in order, each from the previous step's end, with its record's attributes
        for channel, numbers, model in ((base, [1, 2, 3, 4, 5, 6], "fast"), (fork, [4, 5, 6], "slow")):
            steps = sorted((s for s in by_trace[trace_id(channel)] if "actae.step_number" in s["attributes"]),
                           key=lambda s: s["attributes"]["actae.cursor"])
            assert [s["attributes"]["actae.step_number"] for s in steps] == numbers
            assert [s["name"] for s in steps] == demo.STEPS[numbers[0] - 1:]
            for before, after in zip(steps, steps[1:]):
                assert before["end"] == after["start"]
            for s in steps:
                a = s["attributes"]
                assert a["actae.channel_id"] == channel and a["actae.event_type"] == s["name"]
                assert a["actae.actor"] == "agent_session" and a["gen_ai.request.model"] == model
                assert s["span_id"] == span_id(channel, a["actae.cursor"])
            assert roots(by_trace[trace_id(channel)])[0]["attributes"]["gen_ai.request.model"] == model

        base_root, fork_root = roots(by_trace[trace_id(base)])[0], roots(by_trace[trace_id(fork)])[0]
        # the failed parent: ERROR with the failure's message; the fork completed
        assert base_root["status"][0] == 2 and "failed" in base_root["status"][1]
        assert base_root["attributes"]["actae.run.status"] == "failed"
        assert fork_root["status"][0] == 0 and fork_root["attributes"]["actae.run.status"] == "completed"
        # the fork: its own trace, its root linked to the parent's span of step 3
        boundary = next(s for s in by_trace[trace_id(base)] if s["attributes"].get("actae.step_number") == 3)
        assert [(t, sid) for t, sid, _ in fork_root["links"]] == [(trace_id(base), boundary["span_id"])]
        assert fork_root["attributes"]["actae.parent_channel_id"] == base
        assert fork_root["attributes"]["actae.fork.at_step"] == 3
        status, _, receipt = http("GET", server.url + f"/api/v1/channels/{fork}/receipt", key=server.key)
        assert status == 200 and fork_root["attributes"]["actae.receipt_sha256"] == receipt["source_state_sha256"]

        # the charge: executed once on the parent, blocked (never executed) on the fork
        tools = [s for s in spans if s["attributes"].get("gen_ai.operation.name") == "execute_tool"]
        assert {s["name"] for s in tools} == {"execute_tool charge_customer"}
        executed = [s for s in tools if s["attributes"]["actae.ledger.outcome"] == "executed"]
        assert [s["trace_id"] for s in executed] == [trace_id(base)]
        assert executed[0]["attributes"]["gen_ai.tool.name"] == "charge_customer"
        assert executed[0]["attributes"]["actae.ledger.key"] == "inv-1"
        (blocked,) = [s for s in tools if s["trace_id"] == trace_id(fork)]
        assert blocked["attributes"]["actae.ledger.outcome"] == "blocked"
        assert blocked["attributes"]["actae.ledger.policy"] == "block"
        assert blocked["attributes"]["actae.event_type"] == "tool.blocked"

        # acceptance 3: the backfill sends the same trace, ids, names, times and attributes
        again = Collector()
        try:
            done = otel_export(server, again.url, base, "--with-forks")
            assert done.returncode == 0, done.stderr
            assert f"Exported {len(spans)} span(s) of 2 run(s)" in done.stdout
            backfilled = again.wait_for(lambda got: len(got) >= len(spans), what="backfilled spans")
            assert comparable(backfilled) == comparable(spans)
        finally:
            again.stop()


def test_a_crashed_run_and_one_whose_process_died(tmp_path, collector):
    """The SDK marks a crash in the run's metadata: the root is sent then, ERROR with the reason. A
    run whose process died sends its steps and no root; the backfill adds the root, same ids."""
    server = exporting_server(tmp_path, collector.url, via_env=True)
    crashed, died = f"crash-{uuid.uuid4().hex[:6]}", f"died-{uuid.uuid4().hex[:6]}"

    async def scenario(client):
        from actae_client import AgentSession

        with pytest.raises(RuntimeError):
            async with AgentSession(client, crashed) as session:
                await session.step("plan", input={"model": "m1"}, output={"usage": {"input_tokens": 7,
                                                                                    "output_tokens": 3}})
                raise RuntimeError("the model went away")
        # a process that died after two steps: session.started and steps, nothing after
        await client.record(died, "session.started", {"session_name": died}, actor="agent_session")
        for number in (1, 2):
            await client.record(died, "work", {"step_number": number}, actor="agent_session", step_number=number)

    with server:
        using(server, scenario)
        spans = collector.wait_for(lambda got: roots(got) and sum(s["trace_id"] == trace_id(died) for s in got) >= 2,
                                   what="the crash's root and the dead run's steps")
        (root,) = roots(spans)
        assert root["trace_id"] == trace_id(crashed) and root["service"] == "actae-test"
        assert root["status"][0] == 2 and "the model went away" in root["status"][1]
        assert root["attributes"]["actae.run.status"] == "crashed" and root["attributes"]["error.type"] == "crashed"
        (plan,) = [s for s in spans if s["trace_id"] == trace_id(crashed) and s["name"] == "plan"]
        assert plan["attributes"]["gen_ai.usage.input_tokens"] == 7
        assert plan["attributes"]["gen_ai.usage.output_tokens"] == 3
        live_died = [s for s in spans if s["trace_id"] == trace_id(died)]
        assert sorted(s["attributes"]["actae.step_number"] for s in live_died) == [1, 2]
        assert all(s["parent"] == span_id(died, 0) for s in live_died)

        for channel, live in ((crashed, [s for s in spans if s["trace_id"] == trace_id(crashed)]), (died, live_died)):
            again = Collector()
            try:
                assert otel_export(server, again.url, channel).returncode == 0
                backfilled = again.wait_for(lambda got: len(got) >= len(live) + (channel == died), what="backfill")
            finally:
                again.stop()
            assert comparable(live) <= comparable(backfilled)
            extra = comparable(backfilled) - comparable(live)
            if channel == died:     # the backfill closes the dead run's root at its last event
                (only,) = [s for s in backfilled if not s["parent"]]
                assert len(extra) == 1 and only["span_id"] == span_id(died, 0)
                assert only["end"] == max(s["end"] for s in live_died) and only["status"][0] == 0
            else:
                assert not extra


# --------------------------------------------------------------------------------------------
# Acceptance 2: a slow or dead collector never fails a write
# --------------------------------------------------------------------------------------------


def metrics_when(server, check, timeout, *, what) -> dict:
    """`metric_values(server)` as soon as `check(values)` holds."""
    def ready():
        values = metric_values(server)
        return values if check(values) else None
    return poll(ready, timeout, every=0.2, what=what)


@pytest.mark.parametrize("collector_state", ["answers 503 slowly", "is not there"])
def test_a_slow_or_dead_collector_drops_spans_and_never_a_write(tmp_path, collector_state):
    if collector_state == "is not there":
        gone = Collector()
        url = gone.url
        gone.stop()                          # nothing listens on that port any more
    else:
        gone = Collector("slow503", delay=2.0)
        url = gone.url
    try:
        with exporting_server(tmp_path, url) as server:
            channel = f"slow-{uuid.uuid4().hex[:6]}"
            for number in range(1, 41):
                status, _, body = http("POST", server.url + "/api/v1/events/record", key=server.key, body={
                    "channel_id": channel, "event_type": "work", "payload": {"n": number}, "step_number": number})
                assert status == 200, body
            metrics_when(server, lambda v: value(v, "actae_spans_dropped_total") >= 1, 60,
                         what="actae_spans_dropped_total to rise")
            figures = metric_values(server)
            assert value(figures, "actae_spans_exported_total") == 0
            assert value(figures, "actae_events_written_total", type="work") == 40
            status, _, health = http("GET", server.url + "/healthz")
            assert status == 200 and health["status"] == "ok"
            status, _, events = http("GET", server.url + f"/api/v1/events/replay/{channel}?limit=100", key=server.key)
            assert status == 200 and len(events["events"] if isinstance(events, dict) else events) == 40
            assert server.stop() == 0                # and it still stops promptly
    finally:
        if collector_state != "is not there":
            gone.stop()


# --------------------------------------------------------------------------------------------
# Acceptance 4: exact metric deltas after a scripted sequence
# --------------------------------------------------------------------------------------------


STORED = ("actae_runs", "actae_approvals_pending", "actae_wakeups_due", "actae_database_size_bytes")


def test_metrics_move_by_exactly_what_a_scripted_sequence_did(tmp_path):
    server = ServerProcess(tmp_path / "metrics").start()
    url, key = server.url, server.key
    tag = uuid.uuid4().hex[:6]
    writes, work, approvals, failed = f"w-{tag}", f"l-{tag}", f"a-{tag}", f"f-{tag}"

    def post(path, body, expect=200):
        status, _, answer = http("POST", url + path, key=key, body=body)
        assert status == expect, (path, status, answer)
        return answer

    with server:
        post("/api/v1/events/record", {"channel_id": writes, "event_type": "warm", "payload": {}})  # the key's touch
        started = time.monotonic()
        before = metric_values(server)
        n = 7
        for i in range(n):
            post("/api/v1/events/record", {"channel_id": writes, "event_type": "obs.write", "payload": {"i": i}})
        claim = {"channel_id": work, "key_name": "k1", "tool_name": "pay", "params": {"cents": 100}}
        first = post("/api/v1/executions/claim", claim)
        assert first["status"] == "claimed"
        post(f"/api/v1/executions/{first['execution']['id']}/complete",
             {"claim_token": first["claim_token"], "result": {"ok": True}})
        assert post("/api/v1/executions/claim", claim)["status"] == "replayed"
        mismatch = post("/api/v1/executions/claim", {**claim, "params": {"cents": 999}}, expect=409)
        assert "idempotency_key_mismatch" in str(mismatch)
        for request_id in ("r1", "r2"):
            post("/api/v1/events/record", {"channel_id": approvals, "event_type": "approval.requested",
                                           "payload": {"request_id": request_id, "summary": "ship it?"},
                                           "operation_id": request_id})
        post("/api/v1/events/record", {"channel_id": failed, "event_type": "run.failed",
                                       "payload": {"error": "boom"}})
        post("/api/v1/channels/fork", {"source_channel_id": writes, "new_channel_id": f"{writes}-fork",
                                       "at_cursor": 0})
        status, _, _ = http("GET", url + "/no/such/page", key=key)
        assert status == 404
        jobs = n + 3 + 1 + 2 + 1 + 1           # records, claim/complete/replay, the mismatch, approvals, failed, fork

        # the stored-data gauges are cached a few seconds
        after = metrics_when(server, lambda v: value(v, "actae_approvals_pending") == 2, 30,
                             what="actae_approvals_pending to reach 2")

        def delta(name, **labels):
            return value(after, name, **labels) - value(before, name, **labels)

        assert delta("actae_events_written_total", type="obs.write") == n
        assert delta("actae_events_written_total", type="approval.requested") == 2
        assert delta("actae_events_written_total", type="tool.started") == 1
        assert delta("actae_events_written_total", type="tool.completed") == 1
        assert delta("actae_events_written_total", type="tool.replayed") == 0     # emit_replay_event is off
        assert delta("actae_events_written_total", type="run.failed") == 1
        assert delta("actae_events_written_total", type="fork.started") == 1
        assert ({outcome: delta("actae_ledger_claims_total", outcome=outcome) for outcome in
                 ("claimed", "reclaimed", "replayed", "in_progress", "mismatch", "blocked")}
                == {"claimed": 1, "reclaimed": 0, "replayed": 1, "in_progress": 0, "mismatch": 1, "blocked": 0})
        assert delta("actae_forks_created_total") == 1
        # every write request was one batch of one job (sequential requests); beside them the wake-up
        # scheduler commits its own one-job batch about once a second, whatever the clients do
        batches = delta("actae_write_batch_jobs_count")
        assert jobs <= batches <= jobs + int(time.monotonic() - started) + 2
        assert delta("actae_write_batch_jobs_sum") == batches
        assert delta("actae_write_batch_jobs_bucket", le="1.0") == batches
        assert delta("actae_commit_duration_seconds_count") == batches
        assert delta("actae_commit_duration_seconds_sum") > 0
        assert delta("actae_write_batches_total") == batches and delta("actae_write_jobs_total") == batches
        record = {"route": "/api/v1/events/record", "method": "POST"}
        assert delta("actae_http_request_duration_seconds_count", status_class="2xx", **record) == n + 2 + 1
        claims = {"route": "/api/v1/executions/claim", "method": "POST"}
        assert delta("actae_http_request_duration_seconds_count", status_class="2xx", **claims) == 2
        assert delta("actae_http_request_duration_seconds_count", status_class="4xx", **claims) == 1
        assert delta("actae_http_request_duration_seconds_count", route="/api/v1/executions/{execution_id}/complete",
                     method="POST", status_class="2xx") == 1
        assert delta("actae_http_request_duration_seconds_count", route="other", method="GET",
                     status_class="4xx") == 1
        assert not any(name == "actae_http_request_duration_seconds_count" and ("route", "/no/such/page") in labels
                       for name, labels in after)
        # the stored-data gauges: a fresh database, so the values are the sequence's own
        assert value(after, "actae_approvals_pending") == 2
        assert 0 <= value(after, "actae_approval_oldest_pending_age_seconds") < 120
        assert value(after, "actae_runs", status="failed") == 1
        assert value(after, "actae_runs", status="blocked") == 1          # waiting on its approvals
        assert sum(v for (name, _), v in after.items() if name == "actae_runs") == 5   # writes, its fork, work...
        assert value(after, "actae_wakeups_due") == 0 and value(after, "actae_wakeup_oldest_lateness_seconds") == 0
        assert value(after, "actae_database_size_bytes") > 0
        assert value(after, "actae_websocket_connections") == 0 and value(after, "actae_websocket_subscriptions") == 0
        assert delta("actae_spans_exported_total") == 0 and delta("actae_spans_dropped_total") == 0
        assert value(after, "process_cpu_seconds_total") > 0             # the library's process collector

        # an approval answered leaves the count; an expired one too
        post("/api/v1/events/record", {"channel_id": approvals, "event_type": "approval.decided",
                                       "payload": {"request_id": "r1", "decision": "approved"}})
        metrics_when(server, lambda v: value(v, "actae_approvals_pending") == 1, 30,
                     what="the decided approval to leave actae_approvals_pending")
        # /metrics.json keeps its shape
        status, _, snapshot = http("GET", url + "/metrics.json", key=key)
        assert status == 200 and set(snapshot) >= {"status", "timestamp", "uptime_seconds", "websocket", "database"}
        assert set(snapshot["database"]) == {"write_batches", "write_jobs"}


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def test_bad_collector_urls_are_named_at_start(tmp_path):
    bad = cli("--otlp-endpoint", "ftp://collector", "--data-dir", str(tmp_path / "a"), "--port", "0",
              env=without_otel(), check=False)
    assert bad.returncode != 0 and "--otlp-endpoint takes an OTLP/HTTP URL" in bad.stderr
    bad = cli("--data-dir", str(tmp_path / "b"), "--port", "0",
              env=without_otel(OTEL_EXPORTER_OTLP_ENDPOINT="collector:4318"), check=False)
    assert bad.returncode != 0 and "OTEL_EXPORTER_OTLP_ENDPOINT takes an OTLP/HTTP URL" in bad.stderr
    missing = cli("otel-export", "some-run", "--data-dir", str(tmp_path / "c"), env=without_otel(), check=False)
    assert missing.returncode != 0 and "otel-export needs a collector" in missing.stderr


# --------------------------------------------------------------------------------------------
# A collector that is down: the circuit opens, the log stays quiet, no write is lost
# --------------------------------------------------------------------------------------------


class RefusingExporter:
    """The SDK's SpanExporter interface, failing every export (a collector that is down)."""

    def __init__(self):
        self.calls = 0

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult
        self.calls += 1
        return SpanExportResult.FAILURE

    def shutdown(self):
        pass


def test_the_circuit_opens_after_failures_in_a_row_and_half_opens_later():
    import actae
    now = [1000.0]
    inner = RefusingExporter()
    exporter = actae.CountingExporter(inner, None, "http://collector", clock=lambda: now[0])
    for _ in range(actae.CIRCUIT_FAILURES):
        exporter.export([object()])
    assert inner.calls == actae.CIRCUIT_FAILURES and exporter.open
    exporter.export([object(), object()])                 # open: dropped unsent
    assert inner.calls == actae.CIRCUIT_FAILURES and exporter.failed == actae.CIRCUIT_FAILURES + 2
    now[0] += actae.CIRCUIT_OPEN_SECONDS[0] + 0.01          # half-open: one batch tries again
    assert not exporter.open
    exporter.export([object()])
    assert inner.calls == actae.CIRCUIT_FAILURES + 1 and exporter.open
    now[0] += actae.CIRCUIT_OPEN_SECONDS[0] + 0.01          # the second opening lasts twice as long
    assert exporter.open
    now[0] += actae.CIRCUIT_OPEN_SECONDS[0]
    assert not exporter.open


def test_a_dead_collector_under_load_logs_once_and_loses_no_write(tmp_path):
    import concurrent.futures
    gone = Collector()
    url = gone.url
    gone.stop()                                           # nothing listens there any more
    with exporting_server(tmp_path, url) as server:
        channels = [f"load-{uuid.uuid4().hex[:6]}-{i}" for i in range(8)]
        deadline = time.monotonic() + 12

        def write(channel):
            written = 0
            while time.monotonic() < deadline:
                written += 1
                status, _, body = http("POST", server.url + "/api/v1/events/record", key=server.key, body={
                    "channel_id": channel, "event_type": "work", "payload": {"n": written}, "step_number": written})
                assert status == 200, body
            return written
        with concurrent.futures.ThreadPoolExecutor(len(channels)) as pool:
            written = dict(zip(channels, pool.map(write, channels)))
        for channel, count in written.items():
            status, _, latest = http("GET", server.url + f"/api/v1/events/cursor/{channel}", key=server.key)
            assert status == 200 and latest["latest_cursor"] == count, (channel, latest, count)
        figures = metric_values(server)
        assert value(figures, "actae_spans_exported_total") == 0 and value(figures, "actae_spans_dropped_total") > 0
    about_it = [line for line in server.lines if any(word in line.lower() for word in ("otlp", "opentelemetry",
                                                                                       "export", "traceback"))]
    about_it = [line for line in about_it if not line.startswith("Traces:")]
    assert 1 <= len(about_it) <= 2, about_it
