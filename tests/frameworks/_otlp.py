"""What each framework driver here shares: a tracer provider whose spans reach the Actae server at
`url` over OTLP/HTTP, named to the run `run` by the resource attribute actae.channel_id.

protobuf: the standard exporter (opentelemetry-exporter-otlp-proto-http) behind a batch processor,
as an application configures it. json: the same spans encoded as OTLP JSON (the Python exporter speaks
only protobuf) and posted to /v1/traces, as an exporter configured for http/json sends them.
"""
from __future__ import annotations

import argparse
import base64
import json
import urllib.request

from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def arguments():
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--encoding", choices=("protobuf", "json"), default="protobuf")
    return p.parse_args()


class Exporting:
    """The provider to instrument with; `finish()` sends what is left and says how many spans went."""

    def __init__(self, args, service: str):
        self.args = args
        self.provider = TracerProvider(resource=Resource.create({"service.name": service,
                                                                 "actae.channel_id": args.run}))
        if args.encoding == "protobuf":
            self.memory = None
            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
                endpoint=f"{args.url}/v1/traces", headers={"x-api-key": args.key})))
        else:
            self.memory = InMemorySpanExporter()
            self.provider.add_span_processor(SimpleSpanProcessor(self.memory))

    def finish(self) -> None:
        self.provider.force_flush()
        if self.memory is not None:
            post_json(self.args, self.memory.get_finished_spans())
        self.provider.shutdown()


def post_json(args, spans) -> None:
    document = json_format.MessageToDict(encode_spans(spans))

    def hex_ids(value):
        if isinstance(value, dict):
            return {k: (base64.b64decode(v).hex() if k in ("traceId", "spanId", "parentSpanId") else hex_ids(v))
                    for k, v in value.items()}
        return [hex_ids(v) for v in value] if isinstance(value, list) else value
    request = urllib.request.Request(f"{args.url}/v1/traces", data=json.dumps(hex_ids(document)).encode(),
                                     headers={"x-api-key": args.key, "content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 200, answer.status
