"""Property-based fuzzing of the whole HTTP API from the server's own /openapi.json.

A. The document is valid OpenAPI 3.1 and lists exactly the route table (`actae.api_routes()`)
   plus `/healthz` and `/openapi.json`.
B. Schemathesis turns every operation of the document into a Hypothesis strategy (positive and
   negative cases); each generated case is sent with the real key to a server of this module's
   own, at least 5,000 requests in all and every operation exercised. Every response: no 5xx;
   every error (>= 400) is `application/json` with exactly `{"status": str, "error": str}`; and
   it conforms to the document, by schemathesis's own response checks (`CONFORMANCE_CHECKS`):
   its status code is one the operation documents, its content-type one documented for that
   status, its body valid against the schema documented for that status and content-type.
   After each accepted write naming a channel, that channel's replay, latest state, run page
   (JSON twin and HTML, through a dashboard session) and self-diff still answer 200; the API
   read-backs are judged by the same response checks (answers on real data, not only on the
   mostly empty or refused cases the generator reaches).
C. Targeted extremes the generator rarely reaches: documents nested 65 and 1000 deep in every
   free-form JSON body field, integers 2**63 and -2**63-1 in every integer field (body, query,
   path), 10,000-character strings in every string field: never a 5xx, every refusal the JSON
   error body. Nesting and integers must be refused (4xx); a long string must be refused
   wherever the document's own schema does not admit it (free text the document caps at 1 MiB,
   such as a channel's `reason`, may be stored). Timestamps at the ends of the RFC 3339 range
   in every date-time field: never a 5xx, and the wake-up scheduler keeps firing afterwards.
   And an early refusal (before the body was read) must not silently drop the keep-alive
   connection.

Generation is reproducible: fixed Hypothesis seeds, no example database, no shrinking (every
failure is collected with a curl line to reproduce it, instead of stopping at the first).

Run just the generation loop (it prints the request count, the statuses and the conformance
summary):  python -m pytest tests/test_fuzz.py -q -s -k every_operation
"""
from __future__ import annotations

import json
import math
import re
import socket
import sys
import time
import traceback
import zlib
from collections import Counter
from urllib.parse import quote, urlencode, urlsplit

import jsonschema
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.errors import FailureGroup

from conftest import ROOT, RawHTTP, ServerProcess

sys.path.insert(0, str(ROOT))
import actae  # noqa: E402  (only for its route table; the server itself runs as a subprocess)

HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
WRITE_METHODS = {"POST", "PUT", "PATCH", "DELETE"}
EXTRA_OPERATIONS = {("GET", "/healthz"), ("GET", "/openapi.json")}
FLEET_PATHS = ("/v1/organizations/", "/api/v1/fleet/")

TARGET_REQUESTS = 5000          # acceptance: at least this many generated requests
PLANNED_REQUESTS = 5400         # planned a little above, since some operations exhaust early
TIME_BUDGET_SECONDS = 300       # hard stop for the generation loop (the assertion then fails)
MAX_PASSES = 4                  # top-up passes for operations whose quota was not reached
BASE_SEED = 20260101
HTML_PAGE_EVERY = 5             # every n-th channel check also renders the HTML run page
# Schemathesis's response checks (by their CLI names, `--checks`), run on every generated answer.
CONFORMANCE_CHECKS = ("status_code_conformance", "content_type_conformance", "response_schema_conformance")

# Body fields (and path parameters) that name a channel; after an accepted write each must read back.
CHANNEL_FIELDS = ("channel_id", "source_channel_id", "new_channel_id", "topic", "baseline_channel_id")
CHANNEL_ID = re.compile(r"[A-Za-z0-9._:-]{1,256}")
DELETE_CHANNEL = ("DELETE", "/api/v1/channels/{channel_id}")
REVOKE_KEY = ("DELETE", "/api/v1/keys/{key_id}")
# Writes that only reference a channel (and neither create nor require it): after them a 404
# read-back is right exactly when the channel does not exist. Deleting a state version is
# idempotent: on a channel that never existed it answers 200 {"deleted": 0}. Every other accepted
# write names a channel it created or found, which must then read back with 200.
REFERENCE_ONLY = {("POST", "/api/v1/scheduler/wakeups"), ("POST", "/api/v1/groups"),
                  ("POST", "/api/v1/experiments"), ("POST", "/api/v1/experiments/{group_id}/members"),
                  ("DELETE", "/api/v1/state/{channel_id}/version/{version}")}


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------

def fetch_openapi(url: str) -> dict:
    """GET /openapi.json without a key (the contract says none is needed)."""
    r = requests.get(url + "/openapi.json", timeout=30)
    assert r.status_code == 200, f"GET /openapi.json answered {r.status_code}: {r.text[:300]}"
    assert content_type(r).startswith("application/json"), content_type(r)
    return r.json()


def document_operations(doc: dict) -> set:
    return {(method.upper(), path) for path, item in doc.get("paths", {}).items()
            for method in item if method in HTTP_METHODS}


def route_table() -> set:
    return {(r.method, r.path) for r in actae.api_routes()} | EXTRA_OPERATIONS


def content_type(response) -> str:
    """The content-type of a requests or schemathesis response (the latter keeps lists of values)."""
    value = response.headers.get("content-type") or ""
    return value[0] if isinstance(value, list) else value


def error_shape_problem(response) -> str | None:
    """None when `response` (>= 400) is JSON with exactly {"status": str, "error": str}."""
    ctype, text = content_type(response), response.content.decode("utf-8", "replace")
    if not ctype.startswith("application/json"):
        return f"error content-type is {ctype!r}, body {text[:200]!r}"
    try:
        body = json.loads(text)
    except ValueError:
        return f"error body is not JSON: {text[:200]!r}"
    # The fleet gateway's routes also say `message` (what the SDK's FleetClient reads), equal to `error`.
    fleet = (isinstance(body, dict) and set(body) == {"status", "error", "message"} and body["message"] == body["error"]
             and urlsplit(str(response.request.url)).path.startswith(FLEET_PATHS))
    if not isinstance(body, dict) or (set(body) != {"status", "error"} and not fleet):
        return f"error body is not exactly {{status, error}}: {str(body)[:300]}"
    if not isinstance(body["status"], str) or not isinstance(body["error"], str):
        return f"error body fields are not strings: {str(body)[:300]}"
    return None


def describe(method: str, url: str, body: bytes | str | None) -> str:
    if body is None:
        return f"{method} {url[:400]}"
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    return f"{method} {url[:400]} body={text[:400]!r}{'...' if len(text) > 400 else ''}"


def own_server(tmp_path_factory, name: str):
    """A server of this module's own: generated garbage never reaches the shared one. It must
    stop cleanly on Ctrl-C afterwards."""
    srv = ServerProcess(tmp_path_factory.mktemp(name)).start()
    assert srv.key, "\n".join(srv.lines)
    yield srv
    code = srv.stop()
    assert code == 0, f"the {name} server did not stop cleanly (exit {code}):\n" + "\n".join(srv.lines[-50:])


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    yield from own_server(tmp_path_factory, "actae-fuzz")


@pytest.fixture(scope="module")
def targeted_server(tmp_path_factory):
    """Apart from the fuzzed one, so that what the fuzz left behind cannot mask a targeted case."""
    yield from own_server(tmp_path_factory, "actae-targeted")


# --------------------------------------------------------------------------------------------
# A. The document
# --------------------------------------------------------------------------------------------

def test_openapi_document_is_valid_31_and_matches_the_route_table(server):
    from openapi_spec_validator import OpenAPIV31SpecValidator, validate

    doc = fetch_openapi(server.url)
    assert str(doc.get("openapi", "")).startswith("3.1"), doc.get("openapi")
    validate(doc, cls=OpenAPIV31SpecValidator)     # raises OpenAPIValidationError with the path

    listed, expected = document_operations(doc), route_table()
    assert listed == expected, (f"missing from /openapi.json: {sorted(expected - listed)}; "
                                f"not in the route table: {sorted(listed - expected)}")


# --------------------------------------------------------------------------------------------
# B. Schema-driven fuzzing
# --------------------------------------------------------------------------------------------

class Fuzzer:
    """Sends cases on one keep-alive session, checks every answer, collects failures."""

    def __init__(self, srv: ServerProcess, *, key_only: set):
        self.srv, self.url, self.key, self.key_only = srv, srv.url, srv.key, key_only
        self.own_key_id = None
        self.api = requests.Session()           # fuzz requests and API read-backs
        self.api.headers.update({"x-api-key": self.key})
        self.pages = self.login()                # dashboard session for the run page
        self.sent = Counter()                   # operation label -> generated requests sent
        self.statuses = Counter()               # (label, status) -> count
        self.checks = 0                         # read-back requests after accepted writes
        self.channel_checks = 0
        self.accepted_writes = 0
        self.http_seconds = 0.0                 # time spent waiting for the server
        self.failures: dict = {}                # (label, kind) -> first reproduction
        self.failure_counts = Counter()
        self.conformance = conformance_checks()
        self.operations: dict = {}              # (METHOD, path template) -> schemathesis operation
        self.conformance_runs = Counter()       # "generated" / "read-back" -> answers judged
        self.undocumented = Counter()           # (label, status) -> answers with an undocumented status

    def login(self) -> requests.Session:
        pages = requests.Session()
        form = {"api_key": self.key}
        login_page = pages.get(self.url + "/login", timeout=30)
        if m := re.search(r'name="csrf_token"\s+value="([^"]*)"', login_page.text):
            form["csrf_token"] = m.group(1)
        r = pages.post(self.url + "/login", data=form, headers={"Origin": self.url},
                       allow_redirects=False, timeout=30)
        assert r.status_code == 303, f"login answered {r.status_code}: {r.text[:300]}"
        assert "actae_session" in pages.cookies, r.headers
        return pages

    def fail(self, label: str, kind: str, detail: str) -> None:
        self.failure_counts[(label, kind)] += 1
        self.failures.setdefault((label, kind), detail)

    def check(self, label: str, response: requests.Response, request: str, *, page: bool = False) -> None:
        status = response.status_code
        if status >= 500:
            self.fail(label, f"{status}", f"{request}\n  -> {status} {response.text[:400]}")
        elif status >= 400 and not page and (problem := error_shape_problem(response)):
            self.fail(label, "malformed error", f"{request}\n  -> {status}: {problem}")

    # -- one generated case ------------------------------------------------------------------

    def send(self, operation, case) -> None:
        label = operation.label
        if self.srv.proc.poll() is not None:
            raise RuntimeError("the fuzzed server exited:\n" + "\n".join(self.srv.lines[-50:]))
        self.sent[label] += 1

        def request() -> str:   # the reproduction, built only when something is reported
            return case.as_curl_command(headers={"x-api-key": "KEY"}, base_url=self.url)

        started = time.monotonic()
        try:
            response = case.call(base_url=self.url, session=self.api, headers={"x-api-key": self.key},
                                 timeout=30, allow_redirects=False)
        except requests.RequestException as exc:
            self.fail(label, "connection", f"{request()}\n  -> {type(exc).__name__}: {exc}")
            return
        finally:
            self.http_seconds += time.monotonic() - started
        status = response.status_code
        self.statuses[(label, status)] += 1
        if status >= 500:
            self.fail(label, f"{status}", f"{request()}\n  -> {status} {response.content[:400]!r}")
        elif status == 401 and label in self.key_only:
            self.fail(label, "401 with the real key", f"{request()}\n  -> {response.content[:300]!r}")
        elif status >= 400 and (problem := error_shape_problem(response)):
            self.fail(label, "malformed error", f"{request()}\n  -> {status}: {problem}")
        if status < 500:        # a 5xx is a failure already; its conformance adds nothing
            self.check_conformance(label, case, response, request)
        if 200 <= status < 300 and operation.method.upper() in WRITE_METHODS:
            self.accepted_writes += 1
            self.after_write(operation, case, request)

    def check_conformance(self, label: str, case, response, request, *, source: str = "generated") -> None:
        """Schemathesis's own response checks, one at a time so that each failure names its check."""
        status = response.status_code
        self.conformance_runs[source] += 1
        for check in self.conformance:
            name = check.__name__
            try:
                case.validate_response(response, checks=[check])
            except FailureGroup as group:
                for failure in group.exceptions:
                    kind, what = conformance_kind(name, failure, status)
                    if kind.startswith("status_code_conformance"):
                        self.undocumented[(label, status)] += 1
                    self.fail(label, kind, f"{request()}\n  -> {status} {content_type(response) or '(no content-type)'}: "
                                           f"{what}\n  {response.content[:300]!r}")

    def conform_read(self, template: str, path_parameters: dict, query: dict, response, path: str) -> None:
        """The response checks on a read-back, as a case of the document's GET `template`."""
        operation = self.operations.get(("GET", template))
        if operation is None:
            return
        case = operation.Case(path_parameters=path_parameters, query=query or None)
        shown = f"curl -X GET -H 'x-api-key: KEY' '{self.url}{path}" + (f"?{urlencode(query)}" if query else "") + "'"
        self.check_conformance(operation.label, case, response, lambda: f"read-back after an accepted write\n  {shown}",
                               source="read-back")

    # -- read-backs after an accepted write --------------------------------------------------

    def after_write(self, operation, case, request) -> None:
        names = set()
        if "channel_id" in (case.path_parameters or {}) and "{channel_id}" in operation.path:
            names.add(case.path_parameters["channel_id"])
        if isinstance(case.body, dict):
            names.update(case.body.get(field) for field in CHANNEL_FIELDS)
        route = (operation.method.upper(), operation.path)
        for channel in sorted(n for n in names if isinstance(n, str) and CHANNEL_ID.fullmatch(n)):
            self.check_channel(operation.label, channel, request, deleted=route == DELETE_CHANNEL,
                               referenced=route in REFERENCE_ONLY)

    def read(self, session: requests.Session, path: str, **params) -> requests.Response:
        self.checks += 1
        started = time.monotonic()
        try:
            return session.get(self.url + path, params=params or None, timeout=30, allow_redirects=False)
        finally:
            self.http_seconds += time.monotonic() - started

    def check_channel(self, label: str, channel: str, request, *, deleted: bool, referenced: bool) -> None:
        """Replay, latest state, self-diff and the run page of `channel` after an accepted write."""
        self.channel_checks += 1
        # "." and ".." are valid channel ids, but as path segments every URL-normalising client
        # (requests, browsers) resolves them away; percent-encoded they reach the channel.
        ch = "%2E" * len(channel) if channel in (".", "..") else quote(channel, safe="")
        reads = [("replay", self.api, f"/api/v1/events/replay/{ch}", {}),
                 ("state", self.api, f"/api/v1/state/{ch}", {}),
                 ("diff", self.api, "/api/v1/channels/diff", {"left": channel, "right": channel}),
                 ("run page", self.pages, f"/runs/{ch}", {"format": "json"})]
        if self.channel_checks % HTML_PAGE_EVERY == 0:
            reads.append(("HTML run page", self.pages, f"/runs/{ch}", {}))
        # The API reads, as the document's operations (the run pages are the dashboard's, not in it).
        documented = {"replay": ("/api/v1/events/replay/{channel_id}", {"channel_id": channel}),
                      "state": ("/api/v1/state/{channel_id}", {"channel_id": channel}),
                      "diff": ("/api/v1/channels/diff", {})}
        # A referenced channel may not exist. Ask first: a due wake-up can create it at any moment,
        # so only a "no" given before a 404 read excuses that 404.
        exists = referenced and self.read(self.api, f"/api/v1/channels/{ch}/metadata").status_code != 404
        for what, session, path, params in reads:
            r = self.read(session, path, **params)
            shown = f"GET {path}" + (f"?{urlencode(params)}" if params else "")
            html = what.startswith("HTML")
            self.check(label, r, shown, page=html)
            if what in documented and r.status_code < 500:
                self.conform_read(*documented[what], params, r, path)
            if r.status_code == 200 and (not html or "text/html" in content_type(r)):
                continue
            if r.status_code == 404 and (deleted or (referenced and not exists)):
                continue
            self.fail(label, f"{what} read-back {r.status_code}",
                      f"after the accepted write\n  {request()}\n  {shown} -> {r.status_code} "
                      f"{content_type(r)} {r.text[:300]}")


def conformance_checks() -> list:
    """The check functions named in CONFORMANCE_CHECKS, from schemathesis's registry."""
    load_all_checks()       # registers the OpenAPI checks
    missing = sorted(set(CONFORMANCE_CHECKS) - set(CHECKS.get_all_names()))
    assert not missing, f"schemathesis {schemathesis.__version__} has no check named {missing}"
    return CHECKS.get_by_names(CONFORMANCE_CHECKS)


def conformance_kind(check: str, failure, status: int) -> tuple[str, str]:
    """(failure kind, what was found) for one schemathesis check failure: one kind per check and
    status (and undocumented content-type), so that every distinct non-conformance is listed."""
    what = " ".join(str(failure.message or failure.title).split())[:600]
    if (received := getattr(failure, "content_type", None)) is not None:
        return f"{check}: {status} answered as {received}", what
    if check == "status_code_conformance":
        return f"{check}: undocumented status {status}", what
    return f"{check}: {failure.title} ({status})", what


def load_schema(srv: ServerProcess, doc: dict):
    config = schemathesis.Config.from_dict({
        "base-url": srv.url,
        "headers": {"x-api-key": srv.key},
        # The key is fixed above; do not generate random ones for the security scheme.
        "generation": {"with-security-parameters": False, "mode": "all"},
    })
    # from_dict, not from_url: a schema loaded from a URL leaves out the operation serving it,
    # and GET /openapi.json is one of the operations to fuzz.
    return schemathesis.openapi.from_dict(json.loads(json.dumps(doc)), config=config)


def key_only_operations(doc: dict) -> set:
    """Labels of the operations whose only credential is the API key: there a 401 to the real key
    is a failure (other operations may want a login token instead)."""
    default = doc.get("security", [])
    return {f"{method.upper()} {path}" for path, item in doc["paths"].items() for method, op in item.items()
            if method in HTTP_METHODS and op.get("security", default) == [{"apiKey": []}]}


def own_key_id(fuzzer: Fuzzer) -> int:
    """The id of the key the fuzzer sends, so that no generated revocation can end the run."""
    r = fuzzer.api.get(fuzzer.url + "/api/v1/keys", timeout=30)
    assert r.status_code == 200, r.text[:300]
    ids = [k["id"] for k in r.json()["keys"] if fuzzer.key.startswith(k["prefix"])]
    assert len(ids) == 1, r.text[:500]
    return int(ids[0])


def not_revoking(key_id: int):
    """A filter for cases of DELETE /api/v1/keys/{key_id}: never the fuzzer's own key (however spelled)."""
    def keep(case) -> bool:
        try:
            return int(str(case.path_parameters.get("key_id")).strip()) != key_id
        except ValueError:
            return True
    return keep


def fuzz_operation(fuzzer: Fuzzer, operation, examples: int, pass_no: int) -> None:
    """Run `examples` generated cases (half positive, half negative on average) for one operation."""
    strategy = st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                         operation.as_strategy(GenerationMode.NEGATIVE))
    if (operation.method.upper(), operation.path) == REVOKE_KEY:
        strategy = strategy.filter(not_revoking(fuzzer.own_key_id))
    errors = []

    @seed(BASE_SEED + zlib.crc32(operation.label.encode()) + 7919 * pass_no)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck),
              verbosity=Verbosity.quiet, report_multiple_bugs=False)
    @given(case=strategy)
    def run(case):
        try:
            fuzzer.send(operation, case)
        except Exception:   # a harness error: keep it for the report instead of letting Hypothesis shrink
            errors.append(traceback.format_exc())

    try:
        run()
    except Exception as exc:   # e.g. Unsatisfiable: the operation's schema generated nothing
        fuzzer.fail(operation.label, "generation", f"{type(exc).__name__}: {exc}"[:2000])
    for error in errors[:1]:
        fuzzer.fail(operation.label, "harness", error[-2000:])


def scheduler_stopped(srv: ServerProcess, session: requests.Session) -> str | None:
    """None when the background scheduler still fires a wake-up that is due: none of the
    wake-ups sent before may have stopped it."""
    due = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 1))
    r = session.post(srv.url + "/api/v1/scheduler/wakeups", timeout=30, headers={"x-api-key": srv.key},
                     json={"channel_id": "fz-liveness", "run_at": due})
    if r.status_code != 200:
        return f"scheduling a wake-up answered {r.status_code}: {r.text[:300]}"
    wakeup, deadline = r.json(), time.monotonic() + 10
    while wakeup.get("status") == "pending" and time.monotonic() < deadline:
        time.sleep(0.2)
        wakeup = session.get(f"{srv.url}/api/v1/scheduler/wakeups/{wakeup['id']}", timeout=30,
                             headers={"x-api-key": srv.key}).json()
    if wakeup.get("status") == "pending":
        return ("a wake-up due now was still pending after 10s: the scheduler has stopped\n  "
                + "\n  ".join(srv.lines[-40:]))
    return None


def test_fuzz_every_operation_from_openapi(fuzz_server):
    started = time.monotonic()
    doc = fetch_openapi(fuzz_server.url)
    schema = load_schema(fuzz_server, doc)
    operations = []
    for result in schema.get_all_operations():
        operation = result.ok()     # an InvalidSchema here is a broken document: fail loudly
        operations.append(operation)
    labels = {(op.method.upper(), op.path) for op in operations}
    assert labels == route_table(), sorted(labels ^ route_table())

    fuzzer = Fuzzer(fuzz_server, key_only=key_only_operations(doc))
    fuzzer.operations = {(op.method.upper(), op.path): op for op in operations}
    fuzzer.own_key_id = own_key_id(fuzzer)
    quota = {op.label: math.ceil(PLANNED_REQUESTS / len(operations)) for op in operations}
    exhausted: set = set()
    for pass_no in range(MAX_PASSES):
        for op in operations:
            want = quota[op.label] - fuzzer.sent[op.label]
            if op.label in exhausted or want <= 0:
                continue
            if time.monotonic() - started > TIME_BUDGET_SECONDS:
                break       # the count assertion below reports it
            before = fuzzer.sent[op.label]
            fuzz_operation(fuzzer, op, want, pass_no)
            if fuzzer.sent[op.label] - before < want:
                exhausted.add(op.label)      # Hypothesis ran out of distinct inputs (e.g. no parameters)
        total = sum(fuzzer.sent.values())
        if total >= PLANNED_REQUESTS or time.monotonic() - started > TIME_BUDGET_SECONDS:
            break
        # Share what is missing among the operations that can still produce new inputs.
        open_ops = [op for op in operations if op.label not in exhausted]
        if not open_ops:
            break
        extra = math.ceil((PLANNED_REQUESTS - total) / len(open_ops))
        for op in open_ops:
            quota[op.label] = fuzzer.sent[op.label] + extra
    elapsed = time.monotonic() - started

    total = sum(fuzzer.sent.values())
    per_status = Counter(status for (_, status) in fuzzer.statuses.elements())
    print(f"\nfuzz: {total} generated requests over {len(operations)} operations, "
          f"{fuzzer.checks} read-backs after {fuzzer.accepted_writes} accepted writes "
          f"({fuzzer.channel_checks} channel checks), {elapsed:.1f}s ({fuzzer.http_seconds:.1f}s in HTTP); "
          f"statuses {dict(sorted(per_status.items()))}")
    assert fuzz_server.proc.poll() is None, "the fuzzed server died:\n" + "\n".join(fuzz_server.lines[-50:])
    if problem := scheduler_stopped(fuzz_server, fuzzer.api):
        fuzzer.fail("scheduler", "wake-ups no longer fire", problem)
    never_ok = sorted(op.label for op in operations
                      if not any(200 <= status < 300 for (label, status) in fuzzer.statuses if label == op.label))
    print(f"operations without any 2xx answer ({len(never_ok)}): {', '.join(never_ok)}")
    conformance_failures = sum(n for (_, kind), n in fuzzer.failure_counts.items()
                               if kind.startswith(CONFORMANCE_CHECKS))
    print(f"response conformance ({', '.join(CONFORMANCE_CHECKS)}): {fuzzer.conformance_runs['generated']} "
          f"generated and {fuzzer.conformance_runs['read-back']} read-back answers judged, "
          f"{conformance_failures} non-conformant")
    by_status: dict = {}
    for (label, status), n in sorted(fuzzer.undocumented.items()):
        by_status.setdefault(status, []).append(f"{label} (x{n})")
    for status, labels in sorted(by_status.items()):
        print(f"undocumented status {status} from {len(labels)} operations: {', '.join(labels)}")
    for (label, kind), detail in sorted(fuzzer.failures.items()):
        print(f"FAIL [{label}] {kind} (x{fuzzer.failure_counts[(label, kind)]}):\n  {detail}\n")

    not_sent = sorted(op.label for op in operations if fuzzer.sent[op.label] == 0)
    assert not not_sent, f"operations never exercised: {not_sent}"
    assert total >= TARGET_REQUESTS, f"only {total} requests in {elapsed:.0f}s (budget {TIME_BUDGET_SECONDS}s)"
    assert not fuzzer.failures, "\n\n".join(
        f"[{label}] {kind} (x{fuzzer.failure_counts[(label, kind)]}):\n  {detail}"
        for (label, kind), detail in sorted(fuzzer.failures.items()))


# --------------------------------------------------------------------------------------------
# C. Targeted extremes
# --------------------------------------------------------------------------------------------

SENTINEL = "\u0000actae-fuzz-sentinel\u0000"
BIG_INTS = (2**63, -2**63 - 1)
LONG_STRING = 10_000
NESTING = (65, 1000)
# Valid RFC 3339 instants at the ends of the range (a year below 1000 is still four digits).
EDGE_TIMESTAMPS = ("0210-08-25T16:04:48.940Z", "0001-01-01T00:00:00Z", "9999-12-31T23:59:59.999Z")


def deref(doc: dict, schema, seen=()):
    """Follow local `$ref`s (and fold `allOf`) so the walkers below see plain schemas."""
    while isinstance(schema, dict) and "$ref" in schema:
        ref = schema["$ref"]
        if not ref.startswith("#/") or ref in seen:
            return {}
        seen = (*seen, ref)
        target = doc
        for part in ref[2:].split("/"):
            target = target[part.replace("~1", "/").replace("~0", "~")]
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    if isinstance(schema, dict) and "allOf" in schema:
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            part = deref(doc, part, seen)
            for key, value in part.items():
                if key == "properties":
                    merged["properties"] = {**merged.get("properties", {}), **value}
                elif key == "required":
                    merged["required"] = [*merged.get("required", []), *value]
                else:
                    merged.setdefault(key, value)
        schema = merged
    return schema


def branches(doc: dict, schema) -> list:
    """The non-null alternatives of a schema (anyOf/oneOf, or one schema)."""
    schema = deref(doc, schema)
    if isinstance(schema, dict):
        for key in ("anyOf", "oneOf"):
            if key in schema:
                out = []
                for alt in schema[key]:
                    out += branches(doc, alt)
                return out
        if schema.get("type") == "null":
            return []
    return [schema]


def types_of(schema) -> set:
    if schema is True or schema == {}:
        return {"any"}
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    if t is None:
        if "properties" in schema:
            return {"object"}
        if "enum" in schema or "const" in schema:
            return {"enum"}
        return {"any"}
    return set([t] if isinstance(t, str) else t) - {"null"}


def minimal(doc: dict, schema, depth: int = 0):
    """A small value valid for `schema` (required members only)."""
    alts = branches(doc, schema)
    if not alts or depth > 8:
        return None
    schema = alts[0]
    if isinstance(schema, dict):
        if "const" in schema:
            return schema["const"]
        if schema.get("enum"):
            return next((v for v in schema["enum"] if v is not None), schema["enum"][0])
        if "default" in schema and schema["default"] is not None:
            return schema["default"]
        if schema.get("examples"):
            return schema["examples"][0]
    kinds = types_of(schema)
    if "object" in kinds:
        props = schema.get("properties", {})
        return {name: minimal(doc, props.get(name, {}), depth + 1) for name in schema.get("required", [])}
    if "array" in kinds:
        return [minimal(doc, schema.get("items", {}), depth + 1) for _ in range(schema.get("minItems", 0))]
    if "integer" in kinds or "number" in kinds:
        low = schema.get("minimum", schema.get("exclusiveMinimum", -1) + 1)
        value = max(low, 1) if "maximum" not in schema else min(max(low, 1), schema["maximum"])
        return int(value) if "integer" in kinds else float(value)
    if "boolean" in kinds:
        return False
    if "string" in kinds:
        if schema.get("format") == "date-time":
            return "2030-01-01T00:00:00Z"
        value = "fz-target"
        return value + "x" * max(0, schema.get("minLength", 0) - len(value))
    return {"fz": 1}


def body_fields(doc: dict, schema, prefix=(), depth=0):
    """(path, schema) for every member of the body, nested objects included."""
    for alt in branches(doc, schema)[:1]:
        if not isinstance(alt, dict):
            continue
        for name, sub in alt.get("properties", {}).items():
            yield (*prefix, name), sub
            if depth < 3:
                for sub_alt in branches(doc, sub)[:1]:
                    if isinstance(sub_alt, dict) and sub_alt.get("properties"):
                        yield from body_fields(doc, sub_alt, (*prefix, name), depth + 1)


def with_value(doc: dict, body_schema, base, path, value):
    """`base` with `value` at `path` (intermediate objects created from their schemas)."""
    body = json.loads(json.dumps(base))
    node, schema = body, deref(doc, body_schema)
    for name in path[:-1]:
        schema = next(iter(branches(doc, schema.get("properties", {}).get(name, {}))), {})
        if not isinstance(node.get(name), dict):
            node[name] = minimal(doc, schema) if isinstance(minimal(doc, schema), dict) else {}
        node = node[name]
    node[path[-1]] = value
    return body


def nested(kinds: set, n: int) -> str:
    if kinds == {"object"}:
        return '{"a":' * (n - 1) + "{}" + "}" * (n - 1)
    return "[" * n + "]" * n


def targeted_cases(doc: dict):
    """(label, method, path template, path params, query, raw body or None, what) for every extreme."""
    for template, item in doc["paths"].items():
        shared = item.get("parameters", [])
        for method, op in item.items():
            if method not in HTTP_METHODS:
                continue
            label = f"{method.upper()} {template}"
            params = [deref(doc, p) for p in [*shared, *op.get("parameters", [])]]
            path_base = {p["name"]: minimal(doc, p.get("schema", {})) for p in params if p["in"] == "path"}
            query_base = {p["name"]: minimal(doc, p.get("schema", {})) for p in params
                          if p["in"] == "query" and p.get("required")}
            body_schema = (deref(doc, op.get("requestBody", {})).get("content", {})
                           .get("application/json", {}).get("schema"))
            body_base = minimal(doc, body_schema) if body_schema is not None else None

            def raw(body):
                return None if body is None else json.dumps(body).encode()

            # Path and query parameters: huge integers, long strings.
            for p in params:
                if p["in"] not in ("path", "query"):
                    continue
                kinds = set()
                for alt in branches(doc, p.get("schema", {})):
                    kinds |= types_of(alt)
                values = []
                if kinds & {"integer"}:
                    values += [(str(v), f"{p['in']} {p['name']}={v}", None) for v in BIG_INTS]
                if kinds & {"string", "any"}:
                    values.append(("x" * LONG_STRING, f"{p['in']} {p['name']}=<{LONG_STRING} chars>",
                                   p.get("schema", {})))
                for value, what, declared in values:
                    path_params, query = dict(path_base), dict(query_base)
                    (path_params if p["in"] == "path" else query)[p["name"]] = value
                    yield label, method.upper(), template, path_params, query, raw(body_base), what, declared, value

            # Body members.
            if body_schema is None:
                continue
            for field, sub in body_fields(doc, body_schema):
                kinds = set()
                for alt in branches(doc, sub):
                    kinds |= types_of(alt)
                name = ".".join(field)
                cases = []
                free_form = "any" in kinds or (kinds == {"object"} and all(
                    isinstance(a, dict) and not a.get("properties")
                    and a.get("additionalProperties", True) in (True, {}) for a in branches(doc, sub)))
                if free_form:
                    for n in NESTING:
                        cases.append((SENTINEL, nested(kinds, n), f"body {name} nested {n} deep", None))
                if "integer" in kinds:
                    cases += [(v, None, f"body {name}={v}", None) for v in BIG_INTS]
                if "string" in kinds:
                    cases.append(("x" * LONG_STRING, None, f"body {name}=<{LONG_STRING} chars>", sub))
                if any(isinstance(a, dict) and a.get("format") == "date-time" for a in branches(doc, sub)):
                    cases += [(v, None, f"body {name}={v}", sub) for v in EDGE_TIMESTAMPS]
                for value, splice, what, declared in cases:
                    body = with_value(doc, body_schema, body_base if isinstance(body_base, dict) else {}, field, value)
                    data = json.dumps(body).encode()
                    if splice is not None:
                        data = data.replace(json.dumps(SENTINEL).encode(), splice.encode())
                    yield label, method.upper(), template, path_base, query_base, data, what, declared, value


def document_allows(doc: dict, schema, value) -> bool:
    """Whether the document's own schema for a field admits `value` (its $refs resolve in `doc`)."""
    root = {**schema, "components": doc.get("components", {})} if isinstance(schema, dict) else schema
    return jsonschema.Draft202012Validator(root).is_valid(value)


def test_targeted_extremes_are_refused_with_a_json_error(targeted_server):
    doc = fetch_openapi(targeted_server.url)
    session = requests.Session()
    session.headers.update({"x-api-key": targeted_server.key})
    failures, statuses, sent, covered, allowed, dropped = [], Counter(), 0, set(), [], 0
    for label, method, template, path_params, query, data, what, declared, value in targeted_cases(doc):
        # Nesting past 64 and integers past int64 are refused whatever a field's schema says (the
        # contract); a long string must be refused where the document's schema caps it below
        # 10,000 characters, and may be stored where the document allows it.
        must_refuse = declared is None or not document_allows(doc, declared, value)
        path = template
        for name, param in path_params.items():
            path = path.replace("{" + name + "}", quote(str(param), safe=""))
        url = targeted_server.url + path
        headers = {"content-type": "application/json"} if data is not None else {}
        try:
            try:
                r = session.request(method, url, params=query or None, data=data, headers=headers,
                                    timeout=60, allow_redirects=False)
            except requests.ConnectionError:
                # The keep-alive connection was dropped after the previous (early) answer; see
                # test_an_early_answer_keeps_the_connection_or_says_close. Once more, on a fresh one.
                dropped += 1
                session.close()
                r = session.request(method, url, params=query or None, data=data, headers=headers,
                                    timeout=60, allow_redirects=False)
        except requests.RequestException as exc:
            failures.append(f"[{label}] {what}: {type(exc).__name__}: {exc}\n  {describe(method, url, data)}")
            continue
        sent += 1
        covered.add(label)
        statuses[r.status_code] += 1
        request = describe(method, r.request.url, data)
        if r.status_code >= 500:
            failures.append(f"[{label}] {what}: {r.status_code} {r.text[:300]}\n  {request}")
        elif r.status_code < 400 and must_refuse:
            failures.append(f"[{label}] {what}: accepted with {r.status_code} {r.text[:200]}\n  {request}")
        elif r.status_code < 400:
            allowed.append(f"{label} {what}")
        elif problem := error_shape_problem(r):
            failures.append(f"[{label}] {what}: {r.status_code} {problem}\n  {request}")
    print(f"\ntargeted: {sent} requests over {len(covered)} operations, statuses {dict(sorted(statuses.items()))}"
          f", {dropped} sent again after a dropped keep-alive connection")
    if problem := scheduler_stopped(targeted_server, session):
        failures.append(f"[scheduler] after the targeted cases: {problem}")
    for case in allowed:
        print(f"accepted, as the document allows: {case}")
    for failure in failures:
        print("FAIL " + failure)
    assert targeted_server.proc.poll() is None, "the server died:\n" + "\n".join(targeted_server.lines[-50:])
    assert sent, "no targeted cases were generated from /openapi.json"
    assert not failures, f"{len(failures)} targeted cases failed:\n" + "\n".join(failures)


@pytest.mark.parametrize("path, key", [
    ("/api/v1/state/a%20b", "server"),              # refused on the path before the body is read
    ("/api/v1/no-such-route", "server"),            # no route
    ("/api/v1/events/record", "sk-not-the-key"),    # wrong key
], ids=["bad-path-parameter", "unknown-route", "wrong-key"])
def test_an_early_answer_keeps_the_connection_or_says_close(targeted_server, path, key):
    """A request refused before its body arrived (HTTP clients send the body as a second packet,
    so this races on every early refusal) may not leave a keep-alive connection that is silently
    closed: either the answer says `connection: close`, or the next request on the socket is
    served. Otherwise pooled clients (requests, the SDK) fail their next call with a reset."""
    body = b'{"channel_id": "fz-early", "event_type": "t"}'
    host = targeted_server.url.removeprefix("http://")
    address = host.rsplit(":", 1)
    api_key = targeted_server.key if key == "server" else key
    sock = socket.create_connection((address[0], int(address[1])), timeout=10)
    answers = RawHTTP(sock)
    try:
        sock.sendall((f"POST {path} HTTP/1.1\r\nHost: {host}\r\nx-api-key: {api_key}\r\n"
                      f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode())
        status, headers, _ = answers.read_response()    # answered before the body was sent
        assert 400 <= status < 500, status
        if "close" in headers.get("connection", "").lower():
            return                                      # announced: a client opens a new connection
        time.sleep(0.05)
        try:
            sock.sendall(body)
            sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            next_status, _, _ = answers.read_response()
        except OSError as exc:
            pytest.fail(f"POST {path} answered {status} without `connection: close`, then the server "
                        f"closed the keep-alive connection: the next request got {type(exc).__name__}: {exc}")
        assert next_status == 200, next_status
    finally:
        sock.close()
