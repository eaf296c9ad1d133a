"""Trust by construction: the findings a review made against the server, each as the behaviour the
server has. Every test here starts real servers and talks HTTP
(or runs `actae ...`) to them; where an answer from elsewhere is needed, the test plays it itself:

- a fake *instance* (a small http.server on loopback answering /api/v1/instance as the test says:
  a chosen instance id, or a refusal carrying a marker text) for the enrollment findings;
- a fake *gateway* answering /api/v1/fleet/link with a 5,000-digit gateway_version, for the release
  notice. An instance asks its gateway's version when it starts (and then every 6 hours), so the test
  stores an enrolled instance's link in its database (the settings row `actae enroll` writes) and
  starts it; the fake gateway holds its answer until the test has logged in.

Findings covered: 1 (causal graph across runs), 2 (an enrolling instance replacing a registered one),
6 (the enroll fetch and its token), 7 (token sums), 8 (fork trees, exports and imports naming
unreadable runs) and 10 (a) a huge gateway version, (b) `actae enroll` asks first, (c) bare-string
documents over 1 MiB, (d) a fork's boundary within its source's history, (e) the fleet key file made twice at once.
"""
from __future__ import annotations

import http.server as http_server
import json
import os
import pty
import re
import select
import subprocess
import sys
import threading
import time
import uuid

import pytest
from conftest import (
    ACTAE_PY,
    ROOT,
    ServerProcess,
    api,
    cli,
    dashboard_cookie,
    fork,
    get_json,
    http,
    instance_id,
    new_key,
    org_token,
    poll,
    query_database,
    record,
    save_state,
    start_fleet,
)

ORG = "local"
MIB = 1024 * 1024
INT64_MAX = 2 ** 63 - 1
MARKER = "MARKER-7f3a-instance-text"          # what a fake instance says; the gateway must never repeat it


# --- a fake instance / gateway on loopback ---------------------------------------------------------------

def instance_document(iid: str) -> dict:
    """What an Actae server answers at GET /api/v1/instance (the fields the gateway decodes)."""
    return {"version": "0.0.0-fake", "api_version": "v1", "instance_id": iid, "backend": "sqlite",
            "started_at": "2026-01-01T00:00:00.000Z", "uptime_seconds": 1, "features": [], "open_signup": False}


class Fake:
    """An http.server on 127.0.0.1 playing an Actae instance (GET: `instance_id`, or `status` with `body`)
    or a gateway (POST /api/v1/fleet/link: `gateway_version`, once `release` is set). `.requests` is
    every (method, path) it was asked, `.link_answered` is set once it answered a link request."""

    def __init__(self, instance_id=None, *, status=200, body=None, content_type="application/json",
                 gateway_version=None):
        self.instance_id = instance_id or f"fake-{uuid.uuid4()}"
        self.status, self.body, self.content_type = status, body, content_type
        self.gateway_version = gateway_version
        self.requests: list = []
        self.release, self.link_answered = threading.Event(), threading.Event()
        fake = self

        class Handler(http_server.BaseHTTPRequestHandler):
            def answer(self, status, data: bytes, content_type):
                try:
                    self.send_response(status)
                    self.send_header("content-type", content_type)
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    self.wfile.flush()
                except OSError:                      # the asker went away (a test that ended early)
                    pass

            def do_GET(self):
                fake.requests.append(("GET", self.path))
                if fake.status == 200 and fake.body is None:
                    body = json.dumps(instance_document(fake.instance_id)).encode()
                else:
                    body = fake.body if isinstance(fake.body, bytes) else str(fake.body).encode()
                self.answer(fake.status, body, fake.content_type)

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length") or 0))
                fake.requests.append(("POST", self.path))
                if self.path == "/api/v1/fleet/link" and fake.gateway_version is not None:
                    fake.release.wait(30)
                    self.answer(200, json.dumps({"organization_id": ORG, "gateway_version": fake.gateway_version,
                                                 "enrolled": True}).encode(), "application/json")
                    fake.link_answered.set()
                else:
                    self.answer(404, b'{"status": "not_found", "error": "no"}', "application/json")

            def log_message(self, *args):
                pass

        self.server = http_server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


# --- helpers -----------------------------------------------------------------------------------------------

def tag() -> str:
    return uuid.uuid4().hex[:8]


def enrollment_token(gateway) -> str:
    done = cli("enrollment", "create", "--name", "edge", "--read", "*", "--write", "*", data_dir=gateway)
    return next(line for line in done.stdout.splitlines() if line.startswith("en-"))


def enroll_http(gateway, token, url, key="sk-fake-instance-key-0123456789abcdef"):
    """POST /api/v1/fleet/enroll (a public route) as an enrolling instance sends it: (status, body)."""
    status, _, answer = http("POST", gateway.url + "/api/v1/fleet/enroll", body={"token": token, "url": url, "key": key})
    return status, answer


def registered(gateway) -> list:
    """The gateway's registered instances as `instance list --json` shows them, and their stored rows."""
    listed = json.loads(cli("instance", "list", "--json", data_dir=gateway).stdout)["instances"]
    rows = query_database(gateway, "SELECT id, name, url, key_ciphertext, key_prefix FROM fleet_instances ORDER BY id")
    return [listed, [tuple(r) for r in rows]]


def numbers_in(value):
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from numbers_in(v)
    elif isinstance(value, list):
        for v in value:
            yield from numbers_in(v)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """A server of this module's own (the findings about runs, keys and documents)."""
    with ServerProcess(tmp_path_factory.mktemp("trust")).start() as server:
        yield server


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A gateway with one remote registered by `instance add` (the enrollment findings)."""
    with start_fleet(tmp_path_factory.mktemp("trust-fleet"), 1, names="r{n}") as f:
        yield f


# --- 1. the causal graph follows dependencies only into readable runs ----------------------------------------

def test_a_causal_graph_never_follows_an_edge_into_a_run_the_key_may_not_read(srv):
    t = tag()
    hidden, shown = f"priv-{t}", f"pub-{t}"
    secret = record(srv, hidden, "tool.result", {"secret": f"S3CRET-{t}"})
    into_hidden = record(srv, shown, "decide", {"n": 1},
                         dependencies=[{"event_id": secret["id"], "dependency_type": "causal"}])
    nowhere = str(uuid.uuid4())
    into_nothing = record(srv, shown, "decide", {"n": 2},
                          dependencies=[{"event_id": nowhere, "dependency_type": "causal"}])
    reader = new_key(srv, read=[f"pub-{t}*"])

    def graph(event):
        status, _, answer = http("GET", srv.url + f"/api/v1/events/{event['id']}/causal-graph", key=reader)
        assert status == 200, answer
        return answer

    hidden_graph, unknown_graph = graph(into_hidden), graph(into_nothing)
    # The edge stays, the event at its end is absent: exactly as for an id that never existed.
    assert [(d["event_id"], d["depends_on_event_id"]) for d in hidden_graph["dependencies"]] == [
        (into_hidden["id"], secret["id"])], hidden_graph
    assert [e["id"] for e in hidden_graph["events"]] == [into_hidden["id"]], (
        f"the graph shows events of {hidden}, which the key may not read: {hidden_graph['events']}")
    assert f"S3CRET-{t}" not in json.dumps(hidden_graph) and hidden not in json.dumps(hidden_graph), hidden_graph
    assert [e["id"] for e in unknown_graph["events"]] == [into_nothing["id"]], unknown_graph
    assert ({k: v for k, v in hidden_graph.items() if k not in ("root_event_id", "events", "dependencies")}
            == {k: v for k, v in unknown_graph.items() if k not in ("root_event_id", "events", "dependencies")})


# --- 2. an enrolling instance cannot take over a registered one ---------------------------------------------

def test_an_enrolling_instance_cannot_replace_a_registered_one(fleet):
    victim = fleet.remote_ids[0]
    before = registered(fleet.gateway)
    with Fake(victim) as impostor:
        status, answer = enroll_http(fleet.gateway, enrollment_token(fleet.gateway), impostor.url)
    assert status == 409, (status, answer)
    assert impostor.url not in json.dumps(answer)
    assert registered(fleet.gateway) == before, "the registered instance's URL, name or key changed"
    # and the gateway still reaches the real instance with its own key
    _, admin = org_token(fleet.gateway, "--admin")
    status, _, answer = http("POST", fleet.gateway.url + "/api/v1/fleet/token",
                             headers={"authorization": f"Bearer {admin}"},
                             body={"purpose": "fleet_access", "organization_id": ORG,
                                   "scopes": ["events:read", "state:read", "channels:read", "payloads:read"]})
    assert status == 200, answer
    status, _, info = http("POST", fleet.gateway.url + f"/v1/organizations/{ORG}/instances/{victim}/ops/"
                           "actae.api.v1.instance.get", headers={"authorization": f"Bearer {answer['token']}"}, body={})
    assert status == 200 and info["instance_id"] == victim and info["version"] != "0.0.0-fake", info


def test_an_enrollment_refused_as_a_duplicate_counts_as_a_failed_try(fleet):
    token = enrollment_token(fleet.gateway)
    with Fake(fleet.remote_ids[0]) as impostor:
        for attempt in range(5):
            status, answer = enroll_http(fleet.gateway, token, impostor.url)
            assert status == 409, (attempt, status, answer)
    with Fake() as honest:
        status, answer = enroll_http(fleet.gateway, token, honest.url)
        assert status == 401, (status, answer)
        assert honest.instance_id not in cli("instance", "list", "--json", data_dir=fleet.gateway).stdout


# --- 6. the enroll fetch: only scheme://host[:port]/api/v1/instance, one fixed sentence, five tries -----------

def test_enroll_fetches_only_the_instance_path_of_a_bare_base_url(fleet):
    with Fake() as instance:
        base = instance.url
        refused = {
            "a path": base + "/admin/reset",
            "a query": base + "?next=/admin",
            "a fragment": base + "#frag",
            "userinfo": f"http://user:pw@127.0.0.1:{instance.port}",
            "a broken IPv6 host": "http://[::1",
        }
        answers = {why: enroll_http(fleet.gateway, enrollment_token(fleet.gateway), url)
                   for why, url in refused.items()}
        wrong = {why: answer for why, answer in answers.items() if answer[0] != 400}
        assert not wrong, f"enroll URLs that should be refused with 400: {wrong}"
        assert all(answer[1]["status"] == "bad_request" for answer in answers.values()), answers
        assert instance.requests == [], f"the gateway fetched {instance.requests} for URLs it refuses"
        # A bare base URL, with or without its "/", is fetched at /api/v1/instance and nowhere else.
        status, answer = enroll_http(fleet.gateway, enrollment_token(fleet.gateway), base + "/")
        assert status == 200 and answer["instance_id"] == instance.instance_id, answer
        assert instance.requests == [("GET", "/api/v1/instance")], instance.requests


def test_an_enroll_url_with_an_overlong_host_name_is_refused_with_400(fleet):
    too_long = ".".join(["a" * 63] * 4) + ".example"          # 260 characters, every label <= 63
    long_label = "a" * 64 + ".example"
    answers = {host: enroll_http(fleet.gateway, enrollment_token(fleet.gateway), f"http://{host}:8080")
               for host in (too_long, long_label)}
    assert {host[:12] + "...": answer[0] for host, answer in answers.items()} == {
        too_long[:12] + "...": 400, long_label[:12] + "...": 400}, answers
    assert all(answer[1]["status"] == "bad_request" for answer in answers.values()), answers


@pytest.mark.parametrize("key", ["sk-line\r\nx-injected: 1", "sk-line\nbreak", "sk-cl\u00e9f-0123456789",
                                 "sk-snow\u2603man-0123456789"], ids=["crlf", "lf", "latin-1", "non-latin"])
def test_an_enroll_key_with_a_line_break_or_non_ascii_is_refused_with_400(fleet, key):
    with Fake() as instance:
        status, answer = enroll_http(fleet.gateway, enrollment_token(fleet.gateway), instance.url, key=key)
        assert status == 400 and answer["status"] == "bad_request", (status, answer)
        assert instance.requests == [], "the key was sent to the instance"
        assert instance.instance_id not in cli("instance", "list", "--json", data_dir=fleet.gateway).stdout


def failed_fetches(fleet) -> list:
    """Enroll answers for instances that answer 401 (a JSON error), 503 (an HTML page) and 200 with a body
    that is no Actae server's, each saying MARKER."""
    failing = [Fake(status=401, body=json.dumps({"status": "unauthorized", "error": f"{MARKER} json"})),
               Fake(status=503, body=f"<html>{MARKER} text</html>", content_type="text/html"),
               Fake(status=200, body=json.dumps({"hello": MARKER}))]           # not an Actae server
    try:
        return [enroll_http(fleet.gateway, enrollment_token(fleet.gateway), f.url) for f in failing]
    finally:
        for f in failing:
            f.__exit__()


def test_a_failed_enroll_fetch_never_repeats_the_instance_s_text(fleet):
    for status, answer in failed_fetches(fleet):
        assert 400 <= status < 500 and answer["error"], (status, answer)
        assert "MARKER" not in json.dumps(answer), f"the gateway repeated what the instance said: {answer}"


def test_a_failed_enroll_fetch_answers_one_fixed_sentence(fleet):
    """A failure of the fetch answers one fixed sentence: the same words whatever the
    instance answered (its status included), the URL aside."""
    answers = failed_fetches(fleet)
    for status, answer in answers:
        assert 400 <= status < 500 and "MARKER" not in json.dumps(answer), (status, answer)
    errors = {re.sub(r"127\.0\.0\.1:\d+", "HOST", answer["error"]) for _, answer in answers[:2]}
    assert len(errors) == 1, f"two failed fetches answered differently: {errors}"


def test_an_enrollment_token_is_spent_after_five_failed_tries(fleet):
    token = enrollment_token(fleet.gateway)
    with Fake(status=401, body=json.dumps({"status": "unauthorized", "error": "wrong key"})) as refusing:
        for attempt in range(5):
            status, answer = enroll_http(fleet.gateway, token, refusing.url)
            assert 400 <= status < 500 and status != 401, (attempt, status, answer)
    with Fake() as good:
        status, answer = enroll_http(fleet.gateway, token, good.url)
        assert status == 401, f"a sixth try with a good instance was let through: {status} {answer}"
        assert good.instance_id not in cli("instance", "list", "--json", data_dir=fleet.gateway).stdout


# --- 7. token sums cannot overflow ------------------------------------------------------------------------

def test_token_counts_beyond_any_sum_never_break_savings_compare_pages_experiments_or_metrics(srv):
    t = tag()
    root, child = f"big-{t}", f"big-{t}-fork"
    huge = 5_000_000_000_000_000_000                       # 5e18: fits int64, two of them do not
    for step in range(1, 5):
        event = record(srv, root, "agent.step", {"output": {"text": f"step {step}"},
                                                 "usage": {"input_tokens": huge, "output_tokens": huge}}, step=step)
        save_state(srv, root, event["cursor"], {"step": step})
    fork(srv, root, child, event["cursor"])
    status, _, group = http("POST", srv.url + "/api/v1/experiments", key=srv.key,
                            body={"name": f"big {t}", "baseline_channel_id": root})
    assert status == 200, group
    status, _, member = http("POST", srv.url + f"/api/v1/experiments/{group['id']}/members", key=srv.key,
                             body={"channel_id": child})
    assert status == 200, member
    cookie = {"cookie": dashboard_cookie(srv)}
    answers = {
        "savings of the fork": api(srv, "GET", f"/api/v1/channels/{child}/savings"),
        "savings of the parent": api(srv, "GET", f"/api/v1/channels/{root}/savings"),
        "diff": api(srv, "GET", f"/api/v1/channels/diff?left={root}&right={child}"),
        "compare": api(srv, "GET", f"/api/v1/channels/compare?left={root}&right={child}"),
        "the experiment": api(srv, "GET", f"/api/v1/experiments/{group['id']}"),
        "the fork's page": http("GET", srv.url + f"/runs/{child}", headers=cookie),
        "the fork's page as JSON": http("GET", srv.url + f"/runs/{child}?format=json", headers=cookie),
        "the parent's page": http("GET", srv.url + f"/runs/{root}", headers=cookie),
        "the diff page": http("GET", srv.url + f"/diff?left={root}&right={child}", headers=cookie),
        "the experiments page": http("GET", srv.url + "/experiments", headers=cookie),
        "the experiment's page": http("GET", srv.url + f"/experiments/{group['id']}", headers=cookie),
        "the experiment's page as JSON": http("GET", srv.url + f"/experiments/{group['id']}?format=json",
                                              headers=cookie),
        "/metrics": api(srv, "GET", "/metrics"),
    }
    failed = {what: (status, str(body)[:200]) for what, (status, _, body) in answers.items() if status != 200}
    assert not failed, f"answers that were not 200: {failed}"
    for what, (_, _, body) in answers.items():
        if isinstance(body, (dict, list)):
            beyond = [n for n in numbers_in(body) if abs(n) > INT64_MAX]
            assert not beyond, f"{what} carries a number no int64 holds: {beyond[:3]}"


# --- 8. fork trees, exports and imports never name an unreadable run ------------------------------------------

def test_a_fork_tree_omits_forks_the_key_may_not_read(srv):
    t = tag()
    root, mine, theirs = f"pub-{t}", f"pub-{t}-mine", f"hid-{t}"
    for step in (1, 2):
        event = record(srv, root, "agent.step", {"n": step}, step=step)
        save_state(srv, root, event["cursor"], {"n": step})
    fork(srv, root, mine, 1)
    fork(srv, root, theirs, 2, display_name=f"HIDDEN-NAME-{t}", reason=f"HIDDEN-REASON-{t}")
    reader = new_key(srv, read=[f"pub-{t}*"])
    status, _, tree = http("GET", srv.url + f"/api/v1/channels/{root}/fork-tree", key=reader)
    assert status == 200, tree
    assert [c["channel_id"] for c in tree["children"]] == [mine], tree["children"]
    text = json.dumps(tree)
    for hidden in (theirs, f"HIDDEN-NAME-{t}", f"HIDDEN-REASON-{t}"):
        assert hidden not in text, f"the fork tree names {hidden}: {tree}"
    # the admin key sees both, so the fork really is there
    assert {c["channel_id"] for c in get_json(srv, f"/api/v1/channels/{root}/fork-tree")["children"]} == {mine, theirs}


def test_an_export_with_forks_refused_for_an_unreadable_fork_does_not_name_it(srv):
    t = tag()
    root, theirs = f"pub-{t}", f"hid-{t}"
    event = record(srv, root, "agent.step", {"n": 1}, step=1)
    save_state(srv, root, event["cursor"], {"n": 1})
    fork(srv, root, theirs, 1)
    reader = new_key(srv, read=[f"pub-{t}*"])
    status, _, body = api(srv, "GET", f"/api/v1/channels/{root}/export?with_forks=true", key=reader, decode=False)
    # A refusal (403) or a file without the fork (as if it did not exist): either names it no more.
    assert status in (200, 403), (status, body[:300])
    assert theirs.encode() not in body, f"the answer ({status}) names the unreadable fork: {body[:300]!r}"
    if status == 200:
        assert json.loads(body.splitlines()[0])["channels"] == [root], body[:300]
    assert api(srv, "GET", f"/api/v1/channels/{root}/export?with_forks=false", key=reader, decode=False)[0] == 200


def test_an_import_colliding_with_an_unreadable_run_does_not_name_it(srv):
    t = tag()
    theirs, mine = f"hid-{t}", f"pub-{t}"
    record(srv, theirs, "agent.step", {"n": 1}, step=1)
    record(srv, theirs, "agent.step", {"n": 2}, step=2)
    status, _, data = api(srv, "GET", f"/api/v1/channels/{theirs}/export", decode=False)
    assert status == 200, data[:300]
    renamed = data.replace(theirs.encode(), mine.encode())      # the same event ids, under a channel of its own
    writer = new_key(srv, read=[f"pub-{t}*"], write=[f"pub-{t}*"])
    status, _, answer = api(srv, "POST", "/api/v1/import", key=writer, raw=renamed,
                            headers={"content-type": "application/x-ndjson"})
    assert status == 409, (status, answer)
    assert theirs not in json.dumps(answer), f"the conflict names the unreadable run: {answer}"
    assert http("GET", srv.url + f"/api/v1/channels/{mine}/metadata", key=srv.key)[0] == 404


def test_deleting_a_run_never_names_or_deletes_a_fork_the_key_may_not_touch(srv):
    t = tag()
    root, theirs = f"pub-{t}", f"hid-{t}"
    event = record(srv, root, "agent.step", {"n": 1}, step=1)
    save_state(srv, root, event["cursor"], {"n": 1})
    fork(srv, root, theirs, event["cursor"])
    owner = new_key(srv, read=[f"pub-{t}*"], write=[f"pub-{t}*"], delete=[f"pub-{t}*"])
    status, _, answer = http("DELETE", srv.url + f"/api/v1/channels/{root}", key=owner)
    assert status == 409 and theirs not in json.dumps(answer), (status, answer)
    status, _, answer = http("DELETE", srv.url + f"/api/v1/channels/{root}?recursive=true", key=owner)
    assert status == 403 and theirs not in json.dumps(answer), (status, answer)
    for run in (root, theirs):                                  # nothing went
        assert http("GET", srv.url + f"/api/v1/channels/{run}/metadata", key=srv.key)[0] == 200


# --- 10 (a). a gateway's version of 5,000 digits never breaks a page ---------------------------------------

def test_a_huge_gateway_version_never_makes_a_page_answer_500(tmp_path):
    data_dir = tmp_path / "edge"
    with ServerProcess(data_dir).start() as first:
        key = first.key                                         # its database and key, made (shown once)
    with Fake(gateway_version="9" * 5000) as gateway:
        # What `actae enroll` keeps (keep_fleet_link): the instance asks this gateway at start.
        link = {"gateway": gateway.url, "organization_id": ORG, "instance_id": "gw-instance", "key_id": 1,
                "link": "link-secret-0123456789", "enrolled_at": "2026-01-01T00:00:00.000Z",
                "gateway_version": "9" * 5000}
        query_database(data_dir, "INSERT INTO settings (name, value) VALUES (?, ?)", ("fleet_link", json.dumps(link)))
        with ServerProcess(data_dir).start() as edge:
            poll(lambda: ("POST", "/api/v1/fleet/link") in gateway.requests, 10, what="the release check")
            cookie = {"cookie": dashboard_cookie(edge, key)}   # logged in before the answer arrives

            def pages():
                return {path: http("GET", edge.url + path, headers=headers, redirects=False)[0]
                        for path, headers in (("/", cookie), ("/login", {}), ("/fleet", cookie))}
            assert all(status == 200 for status in pages().values()), pages()
            gateway.release.set()
            assert gateway.link_answered.wait(10)
            deadline = time.monotonic() + 1.5                  # the answer is read and kept within this
            while True:
                seen = pages()
                assert all(status == 200 for status in seen.values()), (
                    f"pages after the gateway said its version has 5,000 digits: {seen}")
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)


# --- 10 (b). `actae enroll` shows the scopes and asks before it makes the key -------------------------------

def fleet_keys(edge) -> list:
    keys = json.loads(cli("key", "list", "--json", data_dir=edge).stdout)
    return [k for k in (keys["keys"] if isinstance(keys, dict) else keys) if k["name"].startswith("fleet:")]


def test_enroll_without_a_terminal_or_yes_refuses_and_makes_no_key(tmp_path):
    """No terminal on stdin (a pipe: empty, or even one saying "y") and no --yes: nothing is made. The
    prompt reads an answer only from a terminal; a script says --yes."""
    with ServerProcess(tmp_path / "gw").start() as gateway, ServerProcess(tmp_path / "edge").start() as edge:
        token = enrollment_token(gateway)
        for stdin in ("", "y\n"):
            done = cli("enroll", token, "--gateway", gateway.url, "--url", edge.url, data_dir=edge, input=stdin,
                       check=False)
            assert done.returncode != 0, f"enrolled without being asked (stdin {stdin!r}): {done.stdout}{done.stderr}"
            assert fleet_keys(edge) == [], "a key was made before anyone agreed"
            assert "Not enrolled" in cli("enroll", "--status", data_dir=edge).stdout
        assert instance_id(edge) not in cli("instance", "list", "--json", data_dir=gateway).stdout
        done = cli("enroll", token, "--gateway", gateway.url, "--url", edge.url, "--yes", data_dir=edge, input="",
                   check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "[y/N]" not in done.stdout + done.stderr, "--yes asks nothing"
        assert len(fleet_keys(edge)) == 1 and instance_id(edge) in cli("instance", "list", "--json",
                                                                       data_dir=gateway).stdout


def on_a_terminal(argv, env, answer: str, timeout=60.0) -> tuple:
    """Run `argv` (in a session of its own) with a pseudo-terminal as its stdin, stdout and stderr; type
    `answer` once it asks "[y/N]". (exit code, everything it wrote)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=str(ROOT),
                            start_new_session=True, close_fds=True)
    os.close(slave)
    output, typed, deadline = b"", False, time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:                               # EIO: the terminal's other side is closed
                    chunk = b""
                if not chunk and proc.poll() is not None:
                    break
                output += chunk
            elif proc.poll() is not None:
                break
            if not typed and b"[y/N]" in output:
                os.write(master, answer.encode() + b"\n")
                typed = True
        proc.wait(5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return proc.returncode, output.decode("utf-8", "replace")


def test_enroll_on_a_terminal_shows_the_scopes_and_asks_before_making_the_key(tmp_path):
    with ServerProcess(tmp_path / "gw").start() as gateway, ServerProcess(tmp_path / "edge").start() as edge:
        token = enrollment_token(gateway)                  # --read '*' --write '*'
        argv = [*ACTAE_PY, "enroll", token, "--gateway", gateway.url, "--url", edge.url, "--data-dir",
                str(edge.data_dir)]
        code, said = on_a_terminal(argv, edge.env, "n")
        assert "[y/N]" in said, f"enroll did not ask: {said}"
        asked = said[:said.index("[y/N]")]
        assert "read" in asked and "write" in asked and "*" in asked, f"the question shows no scopes: {asked}"
        assert code != 0 and fleet_keys(edge) == [], (code, said)
        assert "Not enrolled" in cli("enroll", "--status", data_dir=edge).stdout
        code, said = on_a_terminal(argv, edge.env, "y")
        assert code == 0 and "[y/N]" in said, said
        assert len(fleet_keys(edge)) == 1 and instance_id(edge) in said


# --- 10 (c). a bare-string document over 1 MiB is refused ------------------------------------------------

def test_a_bare_string_payload_or_state_over_1_MiB_is_refused_with_413(srv):
    t = tag()
    big = "x" * (MIB + 16)
    status, _, answer = http("POST", srv.url + "/api/v1/events/record", key=srv.key,
                             body={"channel_id": f"doc-{t}", "event_type": "step", "payload": big})
    assert status == 413, (status, str(answer)[:300])
    event = record(srv, f"doc-{t}-s", "step", {"n": 1})
    status, _, answer = http("POST", srv.url + f"/api/v1/state/doc-{t}-s", key=srv.key,
                             body={"cursor": event["cursor"], "state": big})
    assert status == 413, (status, str(answer)[:300])
    status, _, versions = http("GET", srv.url + f"/api/v1/state/doc-{t}-s/versions", key=srv.key)
    assert status != 200 or not versions.get("versions"), versions


def test_a_run_of_large_payloads_makes_a_run_page_of_a_bounded_size(srv):
    """Each document a page shows is cut at 16 KiB (the API answers it whole): a run of 900 KB
    payloads, eight of them, made a page of over 7 MB; it is well under one now."""
    run = f"big-page-{tag()}"
    for step in range(1, 9):
        record(srv, run, "agent.step", {"text": f"{step}" + "x" * 900_000}, step=step)
    status, _, body = http("GET", srv.url + f"/runs/{run}", headers={"cookie": dashboard_cookie(srv)}, decode=False)
    assert status == 200 and b"more characters not shown here" in body
    assert len(body) < 1_000_000, f"the run page is {len(body):,} bytes"
    status, _, answer = http("GET", srv.url + f"/api/v1/events/replay/{run}", key=srv.key)
    assert status == 200 and len(answer["events"][0]["payload"]["text"]) == 900_001


# --- 10 (d). a fork's boundary lies within its source's history -------------------------------------------

def test_a_fork_never_takes_a_boundary_past_its_source_s_last_event(srv):
    """A snapshot saved at a cursor the source has not reached used to become the boundary, so the
    fork then inherited whatever the source recorded next. The boundary now lies within the
    source's history at the time of the fork: the latest snapshot at or before its last event."""
    t = tag()
    source, child, empty = f"src-{t}", f"src-{t}-late", f"src-{t}-ahead"
    for step in (1, 2, 3):
        event = record(srv, source, "agent.step", {"n": step}, step=step)
    save_state(srv, source, event["cursor"], {"n": 3})
    save_state(srv, source, event["cursor"] + 5, {"n": "ahead"})     # a snapshot past the last event
    status, _, answer = http("POST", srv.url + "/api/v1/channels/fork", key=srv.key,
                             body={"source_channel_id": source, "new_channel_id": child, "at_cursor": 1000})
    assert status == 200 and answer["resolved_cursor"] == event["cursor"], (status, answer)
    for step in (4, 5, 6):                                           # the source goes on
        record(srv, source, "agent.step", {"n": step}, step=step)
    status, _, meta = http("GET", srv.url + f"/api/v1/channels/{child}/metadata", key=srv.key)
    assert status == 200 and meta["forked_at_cursor"] == event["cursor"], meta
    status, _, answer = http("GET", srv.url + f"/api/v1/channels/{child}/steps/5", key=srv.key)
    assert status == 404, f"the fork inherited a step its source recorded after it: {answer}"
    # Only a snapshot past the end: no boundary within the history to fork from.
    record(srv, empty, "agent.step", {"n": 1}, step=1)
    save_state(srv, empty, 9, {"n": "ahead"})
    status, _, answer = http("POST", srv.url + "/api/v1/channels/fork", key=srv.key,
                             body={"source_channel_id": empty, "new_channel_id": f"{empty}-f", "at_cursor": 9})
    assert status == 409 and answer["status"] == "snapshot_boundary_required", (status, answer)


# --- 10 (e). two first uses of the fleet key at once ------------------------------------------------------

SLOW_KEY = """
import runpy, sys, time
from cryptography.fernet import Fernet
made = Fernet.generate_key
def slowly():                  # a writer that takes its time between making the file and filling it
    time.sleep(2.0)
    return made()
Fernet.generate_key = staticmethod(slowly)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_two_first_instance_adds_at_once_never_read_a_half_written_fleet_key(tmp_path):
    from cryptography.fernet import Fernet
    data_dir = tmp_path / "gw"
    env = ServerProcess(data_dir).env
    cli("instance", "list", data_dir=data_dir)            # the database, made; no fleet key yet
    key_file = data_dir / "fleet_key"
    assert not key_file.exists()
    with Fake() as first, Fake() as second:
        slow = subprocess.Popen([sys.executable, "-c", SLOW_KEY, *ACTAE_PY[1:], "instance", "add", first.url,
                                 "--key", "sk-first-0123456789", "--data-dir", str(data_dir)],
                                env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            # The first has begun its key file (the file itself, or the draft it fills before linking it
            # into place) and is inside the slow generator when the second starts.
            deadline = time.monotonic() + 20
            while (not any("fleet_key" in path.name for path in data_dir.iterdir()) and slow.poll() is None
                   and time.monotonic() < deadline):
                time.sleep(0.01)
            assert slow.poll() is None, "the first `instance add` ended before the second could start beside it"
            fast = cli("instance", "add", second.url, "--key", "sk-second-0123456789", data_dir=data_dir,
                       check=False)
            slow_output, _ = slow.communicate(timeout=60)
        finally:
            if slow.poll() is None:
                slow.kill()
                slow.wait()
        assert slow.returncode == 0, slow_output
        assert fast.returncode == 0, f"the second `instance add` failed: {fast.stdout}{fast.stderr}"
        cipher = Fernet(key_file.read_bytes().strip())
        rows = dict(query_database(data_dir, "SELECT id, key_ciphertext FROM fleet_instances"))
        assert set(rows) == {first.instance_id, second.instance_id}, rows
        assert cipher.decrypt(rows[first.instance_id].encode()) == b"sk-first-0123456789"
        assert cipher.decrypt(rows[second.instance_id].encode()) == b"sk-second-0123456789"
