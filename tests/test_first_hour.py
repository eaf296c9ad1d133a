"""The first hour and the operator's day: logs an operator can read, one-line refusals for every bad
flag, what counts as failed, a repeated fork-failed, the favicon, and what Phoenix and Prometheus read.

Each starts the real server (`python actae.py`) or runs its command line, and reads what it prints.
"""
from __future__ import annotations

import json
import re
import sys
import uuid

import pytest

from conftest import (ACTAE_PY, ROOT, Collector, ServerProcess, cli, dashboard_cookie, exporting_server, http,
                      metric_values, poll, run, using)

SECRET = re.compile(r"\b(sk|tk|ot|ft)-[A-Za-z0-9_-]{16,}|eyJ[A-Za-z0-9_-]{20,}")


def log_lines(server) -> list:
    """What the server logged (its banner's four lines, the key line among them, are not log lines)."""
    return [line for line in server.lines if not re.match(r"^(Actae |Dashboard:|Organization:|API key:|Traces:)", line)]


# --- logs ----------------------------------------------------------------------------------------

def test_one_access_line_per_request_and_the_start_and_stop_lines(tmp_path):
    with ServerProcess(tmp_path).start() as server:
        for path in ("/healthz", "/api/v1/channels", "/nope"):
            http("GET", server.url + path, key=server.key)
        http("GET", server.url + "/api/v1/events/replay/run-1?ticket=tk-" + "x" * 20, key=server.key)
        poll(lambda: sum(" /nope " in line or "GET other 404" in line for line in server.lines) >= 1, 10,
             what="the 404's access line")
        assert server.stop() == 0
    lines = log_lines(server)
    access = [line for line in lines if "actae.access" in line]
    assert any(re.search(r"GET /api/v1/channels 200 [0-9.]+ms key:1\b", line) for line in access), access
    assert any("GET /api/v1/events/replay/{channel_id} 200" in line for line in access), access
    assert any("GET other 404" in line for line in access), access
    assert not [line for line in lines if SECRET.search(line)], lines
    assert any("Press Ctrl-C to quit" in line for line in lines), lines
    assert "stopped" in lines[-1] or any("stopped" in line for line in lines[-3:]), lines[-5:]


def test_json_logs_are_one_object_a_line_and_the_level_holds(tmp_path):
    with ServerProcess(tmp_path / "json", args=["--log-format", "json"]).start() as server:
        http("GET", server.url + "/api/v1/channels", key=server.key)
        poll(lambda: any('"actae.access"' in line for line in server.lines), 10, what="a JSON access line")
        server.stop()
    objects = [json.loads(line) for line in log_lines(server)]
    access = [o for o in objects if o["logger"] == "actae.access"]
    assert access and {"time", "level", "message", "method", "route", "status", "duration_ms", "principal"} <= set(
        access[0]), access
    assert any(o["route"] == "/api/v1/channels" and o["status"] == 200 and o["principal"] == "key:1" for o in access)
    with ServerProcess(tmp_path / "quiet", args=["--log-level", "warning"]).start() as quiet:
        http("GET", quiet.url + "/api/v1/channels", key=quiet.key)
        quiet.stop()
    assert not [line for line in log_lines(quiet) if "actae.access" in line or "Press Ctrl-C" in line]


# --- every bad flag value is one line --------------------------------------------------------------

BAD_VALUES = {
    "--port": ["99999", "-1", "eighty"],
    "--max-connections": ["0", "x"],
    "--header-timeout": ["0", "-5", "soon", "nan"],
    "--keepalive-timeout": ["0", "1e9"],
    "--body-timeout": ["-1", "inf"],
    "--max-header-bytes": ["10", "1e3"],
    "--retain-days": ["-1", "99999", "week"],
    "--fleet-token-ttl": ["0", "x"],
    "--fleet-ticket-ttl": ["-3"],
    "--fleet-timeout": ["0"],
    "--log-level": ["loud"],
    "--log-format": ["xml"],
}
COMMAND_VALUES = [
    ["key", "create", "--name", "n", "--expires-in", "0"], ["key", "create", "--name", "n", "--expires-in", "x"],
    ["key", "revoke", "zero"], ["key", "revoke", "0"], ["org-token", "revoke", "x"],
    ["org-token", "create", "--name", "n", "--expires-in", "-1"],
    ["fork-failed", "--at", "0"], ["fork-failed", "--at", "one"], ["prune", "--older-than", "-1"],
    ["prune", "--older-than", "x"], ["prune", "--older-than", "1", "--keep-failed-days", "y"],
    ["instance", "add", "http://127.0.0.1:1", "--key", "k", "--timeout", "0"],
]


def refusal(argv, tmp_path) -> str:
    done = cli(*argv, data_dir=tmp_path / "d", check=False, timeout=30)
    assert done.returncode == 2, (argv, done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout, (argv, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("actae"), (argv, done.stderr)
    return lines[0]


@pytest.mark.parametrize("flag", list(BAD_VALUES))
def test_a_bad_value_of_a_server_flag_is_one_line(tmp_path, flag):
    for value in BAD_VALUES[flag]:
        line = refusal([flag, value], tmp_path)
        assert flag in line, line


@pytest.mark.parametrize("argv", COMMAND_VALUES, ids=lambda argv: " ".join(argv[:2]))
def test_a_bad_value_of_a_command_flag_is_one_line(tmp_path, argv):
    refusal(argv, tmp_path)


def test_a_data_dir_that_is_a_file_or_cannot_be_made_is_one_line(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("not a folder")
    for data_dir in (afile, afile / "below", "/proc/nope/actae"):
        done = cli("--data-dir", str(data_dir), "--port", "0", check=False, timeout=30)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "--data-dir" in done.stderr, done.stderr


def test_an_unknown_flag_gets_the_nearest_and_its_own_command_s_usage(tmp_path):
    done = cli("fork-failed", "--dryrun", data_dir=tmp_path, check=False)
    assert done.returncode == 2 and "usage: actae fork-failed" in done.stderr, done.stderr
    assert "did you mean --dry-run?" in done.stderr, done.stderr
    done = cli("--prot", "8002", data_dir=tmp_path, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    done = cli("frok-failed", data_dir=tmp_path, check=False)
    assert done.returncode == 2 and "did you mean fork-failed?" in done.stderr, done.stderr


def test_a_hint_names_the_command_as_the_user_ran_it(tmp_path):
    with ServerProcess(tmp_path).start() as server:
        server.stop()
    with ServerProcess(tmp_path).start() as again:
        key_line = next(line for line in again.lines if line.startswith("API key:"))
    assert "python actae.py key rotate" in key_line, key_line


# --- what counts as failed -------------------------------------------------------------------------

def test_a_run_that_recorded_llm_error_is_failed_everywhere(tmp_path):
    collector = Collector()
    try:
        with exporting_server(tmp_path, collector.url) as server:
            run_id = f"llm-{uuid.uuid4().hex[:6]}"

            async def record(client):
                await client.record(run_id, "step", {"n": 1}, actor="agent", step_number=1)
                await client.save_state(run_id, await client.get_cursor(run_id), {"status": "running"})
                await client.record(run_id, "llm.error", {"message": "rate limited"}, actor="agent")
                await client.record(run_id, "session.completed", {}, actor="agent")
            using(server, record)
            status, _, listed = http("GET", server.url + f"/?status=failed&format=json&q={run_id}",
                                     headers={"cookie": dashboard_cookie(server)})
            assert status == 200 and [r["channel_id"] for r in listed["runs"]] == [run_id], listed
            status, _, preview = http("POST", server.url + "/api/v1/forks/bulk", key=server.key,
                                      body={"filter": {"channel_ids": [run_id]}, "dry_run": True})
            assert status == 200 and [f["source_channel_id"] for f in preview["forks"]] == [run_id], preview
            roots = poll(lambda: [s for s in collector.spans if s["name"].startswith("invoke_agent")
                                  and s["attributes"].get("actae.channel_id") == run_id] or None, 20,
                         what="the run's root span")
            assert roots[-1]["status"][0] == 2 and roots[-1]["attributes"]["actae.run.status"] == "failed", roots[-1]
    finally:
        collector.stop()


# --- a repeated fork-failed -------------------------------------------------------------------------

def test_fork_failed_again_says_what_is_new_and_what_was_there(tmp_path):
    with ServerProcess(tmp_path).start() as server:
        async def failing(client):
            for i in range(3):
                await client.record(f"ff-{i}", "step", {"n": 1}, actor="agent", step_number=1)
                await client.save_state(f"ff-{i}", await client.get_cursor(f"ff-{i}"), {"status": "running"})
                await client.record(f"ff-{i}", "step.failed", {"message": "boom"}, actor="agent")
        using(server, failing)
        first = cli("fork-failed", "--operation-id", "op-1", data_dir=server.data_dir)
        again = cli("fork-failed", "--operation-id", "op-1", data_dir=server.data_dir)
    assert "Forked 3 run(s), all new" in first.stdout, first.stdout
    assert "Forked 3 run(s): 0 new, 3 already made by operation id op-1" in again.stdout, again.stdout


# --- the favicon, Prometheus, Phoenix ---------------------------------------------------------------

def test_the_favicon_build_info_and_no_second_uptime_gauge(tmp_path):
    with ServerProcess(tmp_path).start() as server:
        status, headers, _ = http("GET", server.url + "/favicon.ico", redirects=False)
        assert status == 301 and headers["location"] == "/static/favicon.svg"
        values = metric_values(server)
    build = [labels for (name, labels) in values if name == "actae_build_info"]
    assert build and dict(build[0])["version"] and dict(build[0])["backend"] in ("sqlite", "postgresql")
    assert dict(build[0])["python"] == ".".join(map(str, sys.version_info[:3]))
    assert not [name for (name, _) in values if name == "actae_uptime_seconds"]
    assert [name for (name, _) in values if name == "process_start_time_seconds"]


def test_phoenix_reads_the_project_and_the_span_kinds(tmp_path):
    collector = Collector()
    try:
        server = ServerProcess(tmp_path, args=["--otlp-endpoint", collector.url, "--otel-project", "support-bot"])
        with server.start():
            async def steps(client):
                await client.record("ph-1", "agent.step", {"n": 1}, actor="agent", step_number=1)
                await client.record("ph-1", "llm.call", {"model": "gpt-x", "usage": {"input_tokens": 12}},
                                    actor="agent", step_number=2)
                claim = await client.claim_execution("ph-1", "charge-1", "charge", {"amount": 1})
                await client.complete_execution(claim.execution.id, claim.claim_token, {"ok": True})
                await client.record("ph-1", "session.completed", {}, actor="agent")
            using(server, steps)
            spans = poll(lambda: (lambda got: got if {"AGENT", "CHAIN", "LLM", "TOOL"} <= {
                s["attributes"].get("openinference.span.kind") for s in got} else None)(
                [s for s in collector.spans if s["attributes"].get("actae.channel_id") == "ph-1"]), 20,
                what="every span kind")
        kinds = {s["name"]: s["attributes"]["openinference.span.kind"] for s in spans}
        assert kinds["agent.step"] == "CHAIN" and kinds["llm.call"] == "LLM", kinds
        assert all(s["resource"]["openinference.project.name"] == "support-bot" for s in spans)
    finally:
        collector.stop()
