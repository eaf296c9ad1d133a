"""A Python client generated from the server's own /openapi.json by a third-party generator.

At test time: GET /openapi.json from the shared server -> `openapi-python-client
generate` (PyPI `openapi-python-client`, not ours) into a tmp dir -> that package imported from
there -> through its `AuthenticatedClient` (the key in `x-api-key`, without a "Bearer" prefix):

A. the generator runs on the document with no warning and generates every operation of it,
   the export (its NDJSON answer read as bytes) and the import (a file body) among them;
B. record two steps, replay, save state, read the latest state, resolve step 1, fork after it,
   read the fork's receipt, replay the fork and read its state. Every answer must come back as
   the generator's typed models (`.parsed` attributes, not raw dicts), hold what the flow
   expects, and agree field by field with what the server answers to plain HTTP (every field the
   server sends must be declared in the document, with the value it has on the wire);
C. error answers come back as the generated `{status, error}` model;
D. a run exported through the generated client (bytes) and imported through it again: the answer
   is the generated `Imported` model, the run already there unchanged.

The endpoints are found by method and path in the generated code, not by operationId, so that
renaming operations or tags does not break the test.

Run:  python -m pytest tests/test_openapi_client.py -q -s
"""
from __future__ import annotations

import datetime
import enum
import importlib
import inspect
import io
import json
import re
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import attrs        # the generated models are attrs classes
import httpx        # the generated client's transport
import pytest

from conftest import ServerProcess, http

PACKAGE = "actae_openapi_generated"
RECORD = ("POST", "/api/v1/events/record")
REPLAY = ("GET", "/api/v1/events/replay/{channel_id}")
SAVE_STATE = ("POST", "/api/v1/state/{channel_id}")
LATEST_STATE = ("GET", "/api/v1/state/{channel_id}")
STEP = ("GET", "/api/v1/channels/{channel_id}/steps/{step_number}")
FORK = ("POST", "/api/v1/channels/fork")
RECEIPT = ("GET", "/api/v1/channels/{channel_id}/receipt")
LIST_CHANNELS = ("GET", "/api/v1/channels")
EXPORT = ("GET", "/api/v1/channels/{channel_id}/export")
IMPORT = ("POST", "/api/v1/import")
NEEDED = (RECORD, REPLAY, SAVE_STATE, LATEST_STATE, STEP, FORK, RECEIPT, LIST_CHANNELS, EXPORT, IMPORT)
ENDPOINT = re.compile(r'"method":\s*"(\w+)",\s*"url":\s*"([^"]+)"')


# --------------------------------------------------------------------------------------------
# Generating and importing the client
# --------------------------------------------------------------------------------------------

@dataclass
class Generated:
    package: object = field(repr=False)     # the imported generated package
    directory: Path                         # the folder holding it (on sys.path)
    output: str = field(repr=False)         # everything the generator printed
    endpoints: dict = field(default_factory=dict, repr=False)   # (METHOD, path template) -> endpoint module

    def endpoint(self, operation: tuple):
        assert operation in self.endpoints, (
            f"the generator made no function for {operation[0]} {operation[1]}:\n{self.output}")
        return self.endpoints[operation]

    def warnings(self) -> list[str]:
        """The generator's warnings, one block each (each starts with a `WARNING` line)."""
        text = self.output.split("Warning(s) encountered", 1)
        if len(text) < 2:
            return []
        blocks = re.split(r"\n(?=WARNING )", text[1].split("\n", 1)[-1])
        return [b.strip() for b in blocks if b.strip().startswith("WARNING")]


def generate_client(doc: dict, where: Path, package: str = PACKAGE) -> Generated:
    """Run `openapi-python-client generate` on `doc` into `where/package` and import the result."""
    where.mkdir(parents=True, exist_ok=True)
    document, config = where / "openapi.json", where / "generator-config.json"
    document.write_text(json.dumps(doc))
    # No post hooks: they run ruff (formatting only) from PATH; the generated code works without.
    config.write_text(json.dumps({"package_name_override": package, "post_hooks": []}))
    out = subprocess.run(
        [sys.executable, "-m", "openapi_python_client", "generate", "--path", str(document),
         "--output-path", str(where / package), "--meta", "none", "--config", str(config), "--overwrite"],
        capture_output=True, text=True, timeout=300, cwd=str(where))
    output = out.stdout + out.stderr
    assert out.returncode == 0, f"openapi-python-client failed (exit {out.returncode}):\n{output}"
    assert (where / package / "client.py").is_file(), f"no client generated:\n{output}"

    forget(package)
    sys.path.insert(0, str(where))
    importlib.invalidate_caches()
    pkg = importlib.import_module(package)
    importlib.import_module(f"{package}.client")
    generated = Generated(package=pkg, directory=where, output=output)
    for source in sorted((where / package / "api").rglob("*.py")):
        if m := ENDPOINT.search(source.read_text()):
            relative = source.relative_to(where).with_suffix("")
            generated.endpoints[(m.group(1).upper(), m.group(2))] = importlib.import_module(".".join(relative.parts))
    return generated


def forget(package: str) -> None:
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def document(server) -> dict:
    status, _, doc = http("GET", server.url + "/openapi.json")
    assert status == 200 and isinstance(doc, dict), (status, str(doc)[:300])
    return doc


@pytest.fixture(scope="module")
def generated(document, tmp_path_factory):
    where = tmp_path_factory.mktemp("openapi-client")
    gen = generate_client(document, where)
    yield gen
    forget(PACKAGE)
    if str(where) in sys.path:
        sys.path.remove(str(where))


def client_for(gen: Generated, url: str, key: str):
    """The generated AuthenticatedClient, sending the key as `x-api-key: <key>` (no "Bearer" prefix)."""
    return gen.package.client.AuthenticatedClient(
        base_url=url, token=key, prefix="", auth_header_name="x-api-key",
        timeout=httpx.Timeout(30.0), raise_on_unexpected_status=True)


def body_model(endpoint):
    """The generated model class of an endpoint's JSON body."""
    kind = inspect.signature(endpoint.sync_detailed).parameters["body"].annotation
    assert hasattr(kind, "from_dict"), f"{endpoint.__name__}: body is {kind!r}, not a generated model"
    return kind


# --------------------------------------------------------------------------------------------
# Typed answers against the wire
# --------------------------------------------------------------------------------------------

def is_model(gen: Generated, value) -> bool:
    kind = type(value)
    return attrs.has(kind) and kind.__module__.startswith(gen.package.__name__ + ".models")


def declared_fields(value) -> set:
    return {f.name for f in attrs.fields(type(value))} - {"additional_properties"}


def attribute_for(value, key: str) -> str | None:
    """The attribute the generator made for JSON member `key` (it suffixes builtin names: type_)."""
    names = declared_fields(value)
    return next((n for n in (key, key + "_") if n in names), None)


def mismatches(gen: Generated, value, raw, where: str) -> list[str]:
    """How the typed `value` differs from the JSON `raw` the server sent: a member not declared in
    the document (left in `additional_properties`), a value that is not what was sent, a nested
    object left a dict where the document declares it."""
    unset = gen.package.types.Unset
    if isinstance(value, unset):
        return [f"{where}: sent as {json.dumps(raw)[:120]}, but left unset by the generated model"]
    if is_model(gen, value):
        if not isinstance(raw, dict):
            return [f"{where}: parsed as {type(value).__name__} from {json.dumps(raw)[:120]}"]
        if not declared_fields(value):      # a free-form map: {additionalProperties: ...}
            return [] if value.to_dict() == raw else [f"{where}: {value.to_dict()!r} != {raw!r}"[:300]]
        out = []
        for key, item in raw.items():
            name = attribute_for(value, key)
            if name is None:
                out.append(f"{where}.{key}: sent, but not declared in the document "
                           f"({type(value).__name__} has {sorted(declared_fields(value))})")
            else:
                out += mismatches(gen, getattr(value, name), item, f"{where}.{key}")
        return out
    if isinstance(value, list):
        if not isinstance(raw, list) or len(raw) != len(value):
            return [f"{where}: {len(value)} items parsed, sent {json.dumps(raw)[:120]}"]
        return [m for i, (v, r) in enumerate(zip(value, raw)) for m in mismatches(gen, v, r, f"{where}[{i}]")]
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, (datetime.datetime, datetime.date)):
        from dateutil.parser import isoparse      # what the generated code parses date-times with

        try:
            same = isinstance(raw, str) and isoparse(raw) == value
        except ValueError:
            same = False
        return [] if same else [f"{where}: parsed {value!r}, sent {raw!r}"]
    if (value != raw) or (isinstance(value, bool) != isinstance(raw, bool)):
        return [f"{where}: parsed {value!r}, sent {json.dumps(raw)[:120]}"]
    return []


class Flow:
    """Calls through the generated client; collects what is wrong instead of stopping at the first."""

    def __init__(self, gen: Generated, srv: ServerProcess, client):
        self.gen, self.srv, self.client = gen, srv, client
        self.problems: list[str] = []

    def call(self, operation: tuple, *args, body: dict | None = None, **kwargs):
        """(typed answer or None, the JSON it was parsed from). A status other than 200 ends the test."""
        endpoint = self.gen.endpoint(operation)
        if body is not None:
            kwargs["body"] = body_model(endpoint).from_dict(body)
        response = endpoint.sync_detailed(*args, client=self.client, **kwargs)
        label = f"{operation[0]} {operation[1]}"
        text = response.content.decode("utf-8", "replace")
        assert response.status_code == 200, f"{label} {args} answered {int(response.status_code)}: {text[:500]}"
        raw = json.loads(text)
        parsed = response.parsed
        if not is_model(self.gen, parsed):
            self.problems.append(
                f"{label}: the 200 answer came back as {type(parsed).__name__}, not a model generated from "
                f"/openapi.json (is its response schema empty?): {text[:160]}")
            return None, raw
        self.problems += mismatches(self.gen, parsed, raw, label)
        return parsed, raw

    def direct(self, path: str) -> dict:
        """The same answer read with plain HTTP (urllib, the key in x-api-key)."""
        status, _, body = http("GET", self.srv.url + path, key=self.srv.key)
        assert status == 200, f"GET {path} answered {status}: {str(body)[:300]}"
        return body

    def agrees(self, what: str, typed, raw_direct) -> None:
        """The typed answer against the server's plain-HTTP answer."""
        if typed is not None:
            self.problems += [f"{what} (against plain HTTP): {m}" for m in mismatches(self.gen, typed, raw_direct, what)]

    def expect(self, what: str, check) -> None:
        """`check()` on the typed models must be true (an AttributeError is reported, not raised)."""
        try:
            ok = check()
        except Exception as exc:  # noqa: BLE001 - a missing attribute is what this reports
            self.problems.append(f"{what}: {type(exc).__name__}: {exc}")
            return
        if not ok:
            self.problems.append(f"{what}: not so")


# --------------------------------------------------------------------------------------------
# A. The generator on the document
# --------------------------------------------------------------------------------------------

def test_the_generator_runs_on_the_document(generated, document):
    warnings = generated.warnings()
    operations = {(m.upper(), p) for p, item in document["paths"].items() for m in item
                  if m in ("get", "put", "post", "delete", "patch")}
    missing = sorted(operations - set(generated.endpoints))
    print(f"\nopenapi-python-client: {len(generated.endpoints)} of {len(operations)} operations generated, "
          f"{len(warnings)} warnings")
    for warning in warnings:
        print("  " + warning.replace("\n", "\n  "))
    if missing:
        print("not generated: " + ", ".join(f"{m} {p}" for m, p in missing))
    absent = [f"{m} {p}" for m, p in NEEDED if (m, p) not in generated.endpoints]
    assert not absent, f"the generator made no function for {absent}:\n{generated.output}"
    assert not warnings, f"{len(warnings)} generator warnings:\n" + "\n\n".join(warnings)
    assert not missing, f"not generated: {missing}"
    assert "Warning" not in generated.output, generated.output
    with client_for(generated, "http://127.0.0.1:9", "sk-x") as client:
        headers = client.get_httpx_client().headers
        assert headers.get("x-api-key") == "sk-x" and "authorization" not in headers, dict(headers)


# --------------------------------------------------------------------------------------------
# B. Record, replay, save state, fork through the generated client
# --------------------------------------------------------------------------------------------

def record_replay_state_fork(gen: Generated, srv: ServerProcess, tag: str) -> list[str]:
    """The flow; returns the problems found (empty when everything is typed and right)."""
    channel, fork = f"oapi-{tag}", f"oapi-{tag}-fork"
    ch, fk = quote(channel, safe=""), quote(fork, safe="")
    with client_for(gen, srv.url, srv.key) as client:
        flow = Flow(gen, srv, client)
        expect = flow.expect

        # Record two steps.
        steps = []
        for n, answer in ((1, "draft"), (2, "final")):
            typed, raw = flow.call(RECORD, body={
                "channel_id": channel, "event_type": "agent.step", "payload": {"step": n, "answer": answer},
                "metadata": {"actor": "openapi-client", "agent_id": None, "user_id": None, "metadata": None},
                "step_number": n})
            steps.append(raw["event"])
            if typed is not None:
                event = typed.event
                expect(f"record {n}: event.channel_id", lambda: event.channel_id == channel)
                expect(f"record {n}: event.type", lambda: event.type_ == "agent.step")
                expect(f"record {n}: event.payload", lambda: event.payload == {"step": n, "answer": answer})
                expect(f"record {n}: event.actor", lambda: event.actor == "openapi-client")
                expect(f"record {n}: event.step_number", lambda: event.step_number == n)
                expect(f"record {n}: event.cursor is an int > 0",
                       lambda: isinstance(event.cursor, int) and event.cursor > 0)
                expect(f"record {n}: event.id", lambda: isinstance(event.id, str) and event.id)
        first, second = steps

        # Save state at step 1.
        state = {"memory": ["draft"], "step": 1}
        typed, raw = flow.call(SAVE_STATE, channel, body={"channel_id": channel, "cursor": first["cursor"],
                                                          "state": state})
        version = raw["version"]
        if typed is not None:
            expect("save state: version is an int >= 1", lambda: isinstance(typed.version, int) and typed.version >= 1)

        # Replay.
        typed, raw = flow.call(REPLAY, channel)
        flow.agrees("replay", typed, flow.direct(f"/api/v1/events/replay/{ch}?limit=100&cursor=0"))
        if typed is not None:
            expect("replay: the two recorded events, in order",
                   lambda: [e.id for e in typed.events] == [first["id"], second["id"]])
            expect("replay: cursors increase", lambda: typed.events[0].cursor < typed.events[1].cursor)
            expect("replay: step numbers", lambda: [e.step_number for e in typed.events] == [1, 2])
            expect("replay: payloads", lambda: [e.payload["answer"] for e in typed.events] == ["draft", "final"])
            # What record answered is what replay reads back.
            for i, event in enumerate(steps):
                flow.problems += [f"record answer vs replay: {m}"
                                  for m in mismatches(gen, typed.events[i], event, f"events[{i}]")]

        # Latest state.
        typed, raw = flow.call(LATEST_STATE, channel)
        flow.agrees("latest state", typed, flow.direct(f"/api/v1/state/{ch}"))
        if typed is not None:
            expect("latest state: cursor is step 1's", lambda: typed.cursor == first["cursor"])
            expect("latest state: state as saved", lambda: typed.state == state)
            expect("latest state: version as saved", lambda: typed.version == version)

        # Fork after step 1: its cursor from the step index, then fork there.
        typed, raw = flow.call(STEP, channel, 1)
        flow.agrees("step 1", typed, flow.direct(f"/api/v1/channels/{ch}/steps/1"))
        at_cursor = raw["cursor"]
        if typed is not None:
            expect("step 1: cursor", lambda: typed.cursor == first["cursor"])
            expect("step 1: event_id", lambda: typed.event_id == first["id"])

        typed, raw = flow.call(FORK, body={"source_channel_id": channel, "new_channel_id": fork,
                                           "at_cursor": at_cursor, "operation_id": str(uuid.uuid4()),
                                           "reason": "generated-client fork after step 1"})
        forked = typed
        if typed is not None:
            expect("fork: source_channel_id", lambda: typed.source_channel_id == channel)
            expect("fork: child_channel_id", lambda: typed.child_channel_id == fork)
            expect("fork: requested_cursor", lambda: typed.requested_cursor == at_cursor)
            expect("fork: resolved_cursor is step 1's", lambda: typed.resolved_cursor == first["cursor"])
            expect("fork: resolved_event_id is step 1's", lambda: typed.resolved_event_id == first["id"])
            expect("fork: source_state_version", lambda: typed.source_state_version == version)
            expect("fork: restorable", lambda: typed.restorable is True)
            expect("fork: not a replay", lambda: typed.replayed is False)

        # The fork's receipt: as the fork answered, and as plain HTTP reads it.
        typed, raw = flow.call(RECEIPT, fork)
        direct = flow.direct(f"/api/v1/channels/{fk}/receipt")
        flow.agrees("receipt", typed, direct)
        flow.agrees("fork answer vs receipt", forked, direct)
        if typed is not None:
            expect("receipt: child_channel_id", lambda: typed.child_channel_id == fork)
            expect("receipt: source_channel_id", lambda: typed.source_channel_id == channel)
            expect("receipt: resolved_cursor", lambda: typed.resolved_cursor == first["cursor"])
            expect("receipt: source_state_sha256 is a hex digest",
                   lambda: re.fullmatch(r"[0-9a-f]{64}", typed.source_state_sha256 or "") is not None)

        # Replay the fork: its lineage marker, pointing at step 1.
        typed, raw = flow.call(REPLAY, fork)
        flow.agrees("fork replay", typed, flow.direct(f"/api/v1/events/replay/{fk}?limit=100&cursor=0"))
        if typed is not None:
            expect("fork replay: one event", lambda: len(typed.events) == 1)
            marker = typed.events[0] if typed.events else None
            expect("fork replay: fork.started first", lambda: marker.type_ == "fork.started")
            expect("fork replay: on the fork", lambda: marker.channel_id == fork)
            expect("fork replay: depends on step 1", lambda: marker.depends_on == first["id"])
            expect("fork replay: names its source", lambda: marker.payload["source_channel_id"] == channel)

        # The fork's state: the snapshot it inherited.
        typed, raw = flow.call(LATEST_STATE, fork)
        flow.agrees("fork state", typed, flow.direct(f"/api/v1/state/{fk}"))
        if typed is not None:
            expect("fork state: as saved on the source", lambda: typed.state == state)
    return list(dict.fromkeys(flow.problems))     # each distinct problem once, in order


def test_record_replay_save_state_and_fork_through_the_generated_client(generated, server):
    problems = record_replay_state_fork(generated, server, uuid.uuid4().hex[:8])
    assert not problems, f"{len(problems)} problems through the generated client:\n" + "\n".join(problems)


# --------------------------------------------------------------------------------------------
# C. Errors through the generated client
# --------------------------------------------------------------------------------------------

def test_errors_come_back_as_the_generated_error_model(generated, server):
    with client_for(generated, server.url, server.key) as client:
        response = generated.endpoint(RECEIPT).sync_detailed("oapi-no-such-channel", client=client)
    assert response.status_code == 404, response.content[:300]
    error = response.parsed
    assert is_model(generated, error), f"404 parsed as {type(error).__name__}: {response.content[:300]!r}"
    assert isinstance(error.status, str) and error.status and isinstance(error.error, str), error
    assert error.to_dict() == json.loads(response.content)

    with client_for(generated, server.url, "sk-not-the-key") as client:
        response = generated.endpoint(LIST_CHANNELS).sync_detailed(client=client)
    assert response.status_code == 401, response.content[:300]
    assert is_model(generated, response.parsed), f"401 parsed as {type(response.parsed).__name__}"
    assert response.parsed.to_dict() == json.loads(response.content)


# --------------------------------------------------------------------------------------------
# D. Export and import through the generated client
# --------------------------------------------------------------------------------------------

def test_export_and_import_through_the_generated_client(generated, server):
    channel = f"oapi-move-{uuid.uuid4().hex[:8]}"
    status, _, _ = http("POST", server.url + "/api/v1/events/record", key=server.key,
                        body={"channel_id": channel, "event_type": "agent.step", "payload": {"n": 1}})
    assert status == 200
    with client_for(generated, server.url, server.key) as client:
        exported = generated.endpoint(EXPORT).sync_detailed(channel, client=client)
        assert exported.status_code == 200, exported.content[:300]
        assert exported.headers["content-type"].startswith("application/x-ndjson")
        file = exported.parsed
        assert isinstance(file, generated.package.types.File), f"the export parsed as {type(file).__name__}"
        data = file.payload.read()
        assert data == exported.content and json.loads(data.splitlines()[0])["format"] == "actae-export"

        upload = generated.package.types.File(payload=io.BytesIO(data), file_name=f"{channel}.jsonl")
        imported = generated.endpoint(IMPORT).sync_detailed(client=client, body=upload)
    assert imported.status_code == 200, imported.content[:300]
    answer = imported.parsed
    assert is_model(generated, answer), f"the import answer parsed as {type(answer).__name__}"
    assert answer.unchanged == [channel] and answer.imported == [], answer.to_dict()
    assert answer.to_dict() == json.loads(imported.content)
