"""What OTLP ingest costs the write path: a trace of 200 spans posted to /v1/traces, against the same
200 things recorded as events through the SDK, on one server, in one run.

    python examples/bench_ingest.py [--rounds 15] [--spans 200] [--json examples/out/bench-ingest.json]

Each round is a new trace: an agent span and, under it, model calls (with usage: each becomes a call of
the record, priced) and tool calls, encoded as OTLP protobuf before the clock starts, sent in one
request as an exporter sends a batch. The SDK side records as many events in one run with
`ActaeClient.record`: one after another (an agent recording as it goes), and all at once (200 in
flight, the group commit's best case). Figures per round, the median over `--rounds`: the wall time
until the last write was acknowledged (durable), the writer's time (running and committing the
round's write batches, from /metrics: the write path itself) and the server's whole CPU time (user +
system, read from /proc/PID/stat: Linux only). The server is `actae.py` on a fresh SQLite data dir
(examples/llm_fork_demo.py's start_actae). A run that never uses ingest pays nothing for it: no hook
runs on any other event type, and examples/bench.py's write figures against the previous code say
the rest.
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from llm_fork_demo import start_actae  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def server_cpu_ms(pid: int) -> float:
    """The process's user + system CPU time so far, in ms."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / TICKS


def writer_ms(url: str, key: str) -> float:
    """The writer's time so far (running and committing write batches), from /metrics: the write path."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    connection.request("GET", "/metrics", headers={"x-api-key": key})
    text = connection.getresponse().read().decode()
    connection.close()
    line = next(line for line in text.splitlines() if line.startswith("actae_commit_duration_seconds_sum"))
    return float(line.split()[-1]) * 1000


def trace_body(spans: int) -> bytes:
    """A trace of `spans` spans (an agent, then model and tool calls in turn), as OTLP protobuf."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

    def attribute(key, value):
        return KeyValue(key=key, value=AnyValue(int_value=value) if isinstance(value, int)
                        else AnyValue(string_value=value))
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.append(attribute("service.name", "bench"))
    scope = resource_spans.scope_spans.add()
    trace_id, root_id = os.urandom(16), os.urandom(8)
    start = time.time_ns()
    root = scope.spans.add(trace_id=trace_id, span_id=root_id, name="invoke_agent bench",
                           start_time_unix_nano=start, end_time_unix_nano=start + spans * 1_000_000)
    root.attributes.append(attribute("gen_ai.operation.name", "invoke_agent"))
    for n in range(1, spans):
        span = scope.spans.add(trace_id=trace_id, span_id=os.urandom(8), parent_span_id=root_id,
                               start_time_unix_nano=start + n * 1_000_000, end_time_unix_nano=start + n * 1_000_000 + 900_000)
        if n % 2:
            span.name = "chat gpt-4o-mini"
            for key, value in (("gen_ai.operation.name", "chat"), ("gen_ai.request.model", "gpt-4o-mini"),
                               ("gen_ai.provider.name", "openai"), ("gen_ai.usage.input_tokens", 1000 + n),
                               ("gen_ai.usage.output_tokens", 50),
                               ("gen_ai.input.messages", json.dumps([{"role": "user", "parts": [
                                   {"type": "text", "content": f"question {n} of the bench"}]}]))):
                span.attributes.append(attribute(key, value))
        else:
            span.name = "execute_tool lookup"
            for key, value in (("gen_ai.operation.name", "execute_tool"), ("gen_ai.tool.name", "lookup"),
                               ("gen_ai.tool.call.arguments", json.dumps({"n": n}))):
                span.attributes.append(attribute(key, value))
    return request.SerializeToString()


def ingest_round(url: str, key: str, pid: int, body: bytes) -> tuple:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    writer, cpu, started = writer_ms(url, key), server_cpu_ms(pid), time.perf_counter()
    connection.request("POST", "/v1/traces", body=body, headers={"x-api-key": key,
                                                                   "content-type": "application/x-protobuf"})
    answer = connection.getresponse()
    answer.read()
    wall = (time.perf_counter() - started) * 1000
    if answer.status != 200:
        raise SystemExit(f"bench_ingest: /v1/traces answered {answer.status}")
    connection.close()
    time.sleep(0.05)                              # the server's CPU counters settle (ticks of 10 ms)
    return wall, server_cpu_ms(pid) - cpu, writer_ms(url, key) - writer


async def sdk_round(client, url: str, key: str, pid: int, count: int, together: bool) -> tuple:
    run = f"bench-sdk-{uuid.uuid4().hex[:10]}"

    def one(n: int):
        payload = {"step_number": n, "output": {"input_tokens": 1000 + n, "output_tokens": 50}} if n % 2 else {"tool": "lookup", "n": n}
        return client.record(run, "chat" if n % 2 else "tool.call", payload, actor="bench")
    writer, cpu, started = writer_ms(url, key), server_cpu_ms(pid), time.perf_counter()
    if together:
        await asyncio.gather(*(one(n) for n in range(count)))
    else:
        for n in range(count):
            await one(n)
    wall = (time.perf_counter() - started) * 1000
    await asyncio.sleep(0.05)
    return wall, server_cpu_ms(pid) - cpu, writer_ms(url, key) - writer


def median(samples: list) -> float:
    return round(statistics.median(samples), 1)


async def measure(url: str, key: str, pid: int, rounds: int, spans: int) -> dict:
    from actae_client import ActaeClient

    bodies = [trace_body(spans) for _ in range(rounds + 1)]
    ingest_round(url, key, pid, bodies.pop())       # warm: the first priced call imports genai-prices
    results: dict = {"otlp": [], "sdk_sequential": [], "sdk_together": []}
    async with ActaeClient(endpoint=url, api_key=key) as client:
        await sdk_round(client, url, key, pid, 10, False)
        for body in bodies:
            results["otlp"].append(ingest_round(url, key, pid, body))
            results["sdk_sequential"].append(await sdk_round(client, url, key, pid, spans, False))
            results["sdk_together"].append(await sdk_round(client, url, key, pid, spans, True))
    return {name: {"wall_ms": median([w for w, _, _ in samples]), "server_cpu_ms": median([c for _, c, _ in samples]),
                   "writer_ms": median([t for _, _, t in samples])}
            for name, samples in results.items()}


def report(figures: dict, spans: int) -> None:
    otlp = figures["otlp"]
    print(f"\n{spans} spans in one OTLP request vs {spans} events through the SDK (median per round)\n")
    print(f"{'':34} {'wall ms':>9} {'writer ms':>10} {'writer vs OTLP':>15} {'server CPU ms':>14}")
    labels = {"otlp": "OTLP /v1/traces, one request", "sdk_sequential": "SDK record, one after another",
              "sdk_together": "SDK record, all in flight"}
    for name, label in labels.items():
        row = figures[name]
        ratio = row["writer_ms"] / otlp["writer_ms"] if otlp["writer_ms"] else float("nan")
        print(f"{label:34} {row['wall_ms']:>9} {row['writer_ms']:>10} {ratio:>14.2f}x {row['server_cpu_ms']:>14}")
    print("\nwriter ms: the time the server's writer spent running and committing the round's write batches"
          " (actae_commit_duration_seconds); server CPU: the whole process, in 10 ms ticks.")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--spans", type=int, default=200)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        process, url, key = start_actae(str(Path(scratch) / "data"), "http://127.0.0.1:9")
        try:
            figures = asyncio.run(measure(url, key, process.pid, args.rounds, args.spans))
        finally:
            process.terminate()
            process.wait(timeout=30)
    report(figures, args.spans)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"spans": args.spans, "rounds": args.rounds, **figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
