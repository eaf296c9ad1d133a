"""The first day without a stumble: what a new user hit on a fresh clone, each mended where a test can
see it. Resumed forks keep their own names; a failed run a completed fork handled says so and bulk
fork leaves it; errors say what is allowed in words; a mistyped flag before its value is named; the
durations of the list, the run page and a fork's own steps are one definition; a page's JSON twin
answers an API key as the API does; the OpenAPI document has no required member with a default and
no free-form object without additionalProperties.
"""
from __future__ import annotations

import sys

import pytest

from conftest import ROOT, api, cli, fork, http, record, run_example, save_state

sys.path.insert(0, str(ROOT))
import actae  # noqa: E402  - its OpenAPI document, read in process


def test_a_fork_made_by_resume_shows_its_own_name(server, unique):
    name = unique("named")
    proc = run_example(server, "fork_demo.py", "--resume", "--name", name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status, _, meta = api(server, "GET", f"/api/v1/channels/{name}-fork/metadata")
    assert status == 200 and meta["display_name"] == f"{name}-fork", meta
    status, _, forks = api(server, "GET", f"/api/v1/channels/{name}-base/forks")
    assert [f["display_name"] for f in forks["forks"]] == [f"{name}-fork"], forks
    # a name other than the parent's is still written as asked
    status, _, renamed = api(server, "PUT", f"/api/v1/channels/{name}-fork/metadata", body={"display_name": "mine"})
    assert status == 200 and renamed["display_name"] == "mine", renamed


def failed_run(server, run: str) -> None:
    for step in (1, 2, 3):
        event = record(server, run, payload={"step": step}, step=step)
        save_state(server, run, event["cursor"], {"status": "failed" if step == 3 else "running", "n": step})


def test_a_failed_run_whose_fork_completed_is_handled(server, unique):
    run, retry, other = unique("handled"), unique("handled-fixed"), unique("unhandled")
    failed_run(server, run)
    failed_run(server, other)
    fork(server, run, retry, 4)
    event = record(server, retry, payload={"step": 3}, step=3)
    save_state(server, retry, event["cursor"], {"status": "completed", "n": 3})
    # what AgentSession writes as it leaves a run that went well
    api(server, "PUT", f"/api/v1/channels/{retry}/metadata", body={"experiment_metadata": {"status": "completed"}})
    status, _, page = api(server, "GET", f"/runs/{run}?format=json")
    assert status == 200 and page["handled_by"]["channel_id"] == retry, page.get("handled_by")
    assert api(server, "GET", f"/runs/{other}?format=json")[2]["handled_by"] is None
    status, _, listed = api(server, "GET", f"/?format=json&status=failed&q={unique('')}")
    by_id = {r["channel_id"]: r for r in listed["runs"]}
    assert by_id[run]["handled_by"]["channel_id"] == retry and by_id[other]["handled_by"] is None, by_id
    preview = {"filter": {"channel_ids": [run, other]}, "dry_run": True}
    status, _, answer = api(server, "POST", "/api/v1/forks/bulk", body=preview)
    assert status == 200, answer
    assert [f["source_channel_id"] for f in answer["forks"]] == [other], answer
    assert answer["skipped"] == [{"channel_id": run, "reason": f"handled: its fork {retry} completed"
                                                              " (include_handled takes it again)"}], answer
    preview["filter"]["include_handled"] = True
    answer = api(server, "POST", "/api/v1/forks/bulk", body=preview)[2]
    assert sorted(f["source_channel_id"] for f in answer["forks"]) == sorted([run, other]), answer


def test_errors_say_what_is_allowed_in_words(server, unique):
    run = unique("words")
    record(server, run)
    status, _, answer = api(server, "PATCH", f"/api/v1/channels/{run}/outcome", body={"outcome": "failed"})
    assert status == 400 and "must be one of crashed, inconclusive, promoted, rejected" in answer["error"], answer
    status, _, answer = api(server, "POST", "/api/v1/events/record",
                            body={"channel_id": "has a space", "event_type": "step", "payload": {}})
    assert status == 400, answer
    assert "channel_id must be 1-256 characters of A-Z a-z 0-9 . _ : -" in answer["error"], answer
    assert "regex" not in answer["error"] and "\\Z" not in answer["error"], answer
    status, _, answer = api(server, "GET", "/api/v1/events/cursor/bad%20id")
    assert status == 400 and "regex" not in answer["error"] and "A-Z a-z 0-9" in answer["error"], answer


@pytest.mark.parametrize("argv, said, unsaid", [
    (["--prot", "8003"], "unrecognized argument '--prot' (did you mean --port?)", "invalid choice"),
    (["--data-dri", "/tmp/x"], "unrecognized argument '--data-dri' (did you mean --data-dir?)", "invalid choice"),
    (["--verbose"], "unrecognized argument '--verbose'", "--version"),
])
def test_a_mistyped_flag_is_named(argv, said, unsaid):
    done = cli(*argv, check=False)
    line = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and said in line and unsaid not in line, done.stderr


def test_durations_are_one_definition(server, unique):
    run, child = unique("timed"), unique("timed-fork")
    for step in (1, 2):
        event = record(server, run, payload={"step": step}, step=step)
        save_state(server, run, event["cursor"], {"n": step})
    fork(server, run, child, 4)
    import time
    time.sleep(0.5)                               # the fork waits for its tail: not the fork's work
    for step in (3, 4):
        event = record(server, child, payload={"step": step}, step=step)
        save_state(server, child, event["cursor"], {"n": step})
    listed = {r["channel_id"]: r for r in api(server, "GET", f"/?format=json&q={unique('timed')}")[2]["runs"]}
    for channel in (run, child):
        page = api(server, "GET", f"/runs/{channel}?format=json")[2]
        assert page["run"]["duration_ms"] == listed[channel]["duration_ms"], (channel, page["run"], listed[channel])
    page = api(server, "GET", f"/runs/{child}?format=json")[2]
    assert page["run"]["duration_ms"] < 500, page["run"]          # from its first own step, not the fork
    assert abs(page["saving"]["tail"]["wall_seconds"] * 1000 - page["run"]["duration_ms"]) < 1.5, page["saving"]
    assert page["picture"]["total_ms"] <= page["run"]["duration_ms"], page["picture"]


def test_a_page_json_twin_answers_an_api_key_as_the_api_does(server, unique):
    run = unique("twin")
    record(server, run)
    status, _, answer = http("GET", f"{server.url}/runs/{run}?format=json", key=server.key)
    assert status == 200 and answer["run"]["channel_id"] == run
    status, _, answer = http("GET", f"{server.url}/runs/{run}?format=json", key="sk-not-a-key")
    assert status == 401 and "login" not in answer["error"], answer
    scoped = api(server, "POST", "/api/v1/keys", body={"name": unique("k"), "scopes": {"read": [run]}})[2]["key"]
    status, _, answer = http("GET", f"{server.url}/runs/{run}?format=json", key=scoped)
    assert status == 403 and "every run" in answer["error"], answer
    status, _, answer = http("GET", f"{server.url}/runs/{run}?format=json")
    assert status == 401 and "x-api-key" in answer["error"], answer


def test_the_openapi_document_has_no_required_default_and_no_unsaid_free_form_object():
    document = actae.openapi_document(actae.api_routes())
    required_defaults, free_forms = [], []

    def walk(node, where):
        if isinstance(node, dict):
            kinds = node.get("type")
            if (kinds == "object" or (isinstance(kinds, list) and "object" in kinds)) and not node.get("properties") \
                    and not any(k in node for k in ("additionalProperties", "patternProperties", "$ref")):
                free_forms.append(where)
            required = node.get("required") if isinstance(node.get("required"), list) else []
            for name, member in (node.get("properties") or {}).items():
                if isinstance(member, dict) and "default" in member and name in required:
                    required_defaults.append(f"{where}.{name}")
            for key, value in node.items():
                walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}[{i}]")
    walk(document, "#")
    assert not required_defaults, required_defaults
    assert not free_forms, free_forms
    empty = document["components"]["schemas"]["Empty"]
    assert empty.get("additionalProperties") is True, empty
