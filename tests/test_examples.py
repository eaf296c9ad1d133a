"""Every example in examples/ runs against the live server, so none of them can rot.

Each runs as a user would run it: a subprocess with ACTAE_URL and ACTAE_API_KEY set.
"""
from __future__ import annotations

import json
import re
import socket
from types import SimpleNamespace

import pytest

from conftest import http, poll, run_example

POINTS = ["after_effect", "after_complete", "transport_drop", "transport_fail"]


def output(proc) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-4000:]}"


def test_fork_demo_passes_every_check(server, unique):
    proc = run_example(server, "fork_demo.py", "--name", unique("demo"))
    assert proc.returncode == 0, output(proc)
    assert "FAIL" not in proc.stdout and proc.stdout.count("PASS") >= 10, output(proc)
    # It links the two runs it made on the dashboard.
    assert f"{server.url}/runs/{unique('demo')}-base" in proc.stdout, output(proc)
    assert f"{server.url}/runs/{unique('demo')}-fork" in proc.stdout, output(proc)


def test_fork_demo_forks_from_a_new_process_with_resume(server):
    proc = run_example(server, "fork_demo.py", "--resume")  # a fresh random channel prefix
    assert proc.returncode == 0, output(proc)
    assert "FAIL" not in proc.stdout, output(proc)


def test_bench_fork_prints_the_ratio(server, unique, tmp_path):
    out = tmp_path / "bench.json"
    proc = run_example(server, "bench_fork.py", "--sizes", "5,60", "--forks", "5", "--batch", "20",
                       "--name", unique("bench"), "--out", str(out))
    assert proc.returncode == 0, output(proc)
    assert re.search(r"ratio slowest/fastest median: \d+\.\d+", proc.stdout), output(proc)
    assert f"{server.url}/?q={unique('bench')}" in proc.stdout, output(proc)
    report = json.loads(out.read_text())
    assert {(c["steps"], c["fork_at"]) for c in report["cells"]} == {
        (5, "last"), (5, "first"), (60, "last"), (60, "first")}
    assert all(c["forks"] == 5 and c["median_ms"] > 0 for c in report["cells"])
    assert report["ratio"] >= 1.0


def test_durability_matrix_has_the_expected_shape(server, tmp_path):
    out = tmp_path / "durability.json"
    proc = run_example(server, "durability_benchmark.py", "--matrix", "--steps", "3",
                       "--crash-step", "2", "--out", str(out))
    report = json.loads(out.read_text())
    cells = {(c["strategy"], c["crash_point"]): c for c in report["cells"]}
    assert len(cells) == 12, output(proc)
    for point in POINTS:
        assert cells["naive", point]["duplicates"] > 0, point
        assert cells["ledger", point]["duplicates"] <= 1, point
        assert cells["ledger_query", point]["duplicates"] == 0, point
    for point in ("after_complete", "transport_fail"):
        assert cells["ledger", point]["duplicates"] == 0, point
    for cell in report["cells"]:
        assert cell["missing"] == 0 and cell["worker_exit_codes"] == [137, 0], cell
    assert proc.returncode == 0 and report["ok"], output(proc)


def test_durability_downstream_honouring_keys_has_no_duplicates(server, tmp_path):
    out = tmp_path / "cells.json"
    proc = run_example(server, "durability_benchmark.py", "--steps", "3", "--out", str(out),
                       "--cell", "naive:3:after_effect:honour", "--cell", "ledger:2:transport_drop:honour")
    assert proc.returncode == 0, output(proc)
    assert [c["duplicates"] for c in json.loads(out.read_text())["cells"]] == [0, 0]


def test_fork_fidelity_forks_run_only_the_tail(server, with_client, unique, tmp_path):
    out = tmp_path / "fidelity.json"
    prefix = unique("fid")
    proc = run_example(server, "fork_fidelity.py", "--scenarios", "support_triage", "--repeats", "1",
                       "--latency-ms", "0", "--ms-per-token", "0", "--name", prefix, "--out", str(out))
    assert proc.returncode == 0, output(proc)
    report = json.loads(out.read_text())
    assert report["benchmark"] == "fork_fidelity" and report["repeats"] == 1
    assert set(report["mean"]) >= {"fork_jaccard", "rerun_jaccard", "token_savings", "time_savings"}
    (scenario,) = report["scenarios"]
    assert scenario["name"] == "support_triage"
    steps, k = scenario["steps"], scenario["fork_at"]
    assert scenario["fork"]["model_calls_per_run"] == steps - k == scenario["tail_steps"]
    assert scenario["rerun"]["model_calls_per_run"] == steps
    assert scenario["fork"]["tokens_per_run"] < scenario["rerun"]["tokens_per_run"]
    for path in ("fork", "rerun"):
        assert all(0.0 <= j <= 1.0 for j in scenario[path]["jaccard"])
    assert scenario["fork"]["mean_step_match"] >= k / steps  # the inherited steps are exact

    events = with_client(lambda client: client.replay(f"{prefix}-support_triage-fork0", limit=100))
    fork_steps = [e.payload["step_number"] for e in events
                  if isinstance(e.payload, dict) and "step_number" in e.payload]
    assert fork_steps == list(range(k + 1, steps + 1))


def test_the_model_call_demo_replays_the_kept_calls_offline(tmp_path):
    """examples/llm_fork_demo.py starts its own server and tiny model server: every check passes and it
    says what the re-run did not spend."""
    import subprocess
    import sys

    from conftest import ROOT
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "llm_fork_demo.py"), "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=180, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout and proc.stdout.count("replayed from the record") == 3, proc.stdout
    assert "not spent again: 3 model calls" in proc.stdout, proc.stdout


def test_the_gateway_bench_prints_its_figures_against_a_baseline(tmp_path):
    """examples/bench_llm.py, a few calls: direct, ours and the baseline's gateway (HEAD's, from a git
    worktree it removes after), each with its added milliseconds, and the ratio of the two. No figure
    is judged here: the benchmark's figures are in docs/benchmarks.md."""
    import json
    import subprocess
    import sys

    from conftest import ROOT
    out = tmp_path / "bench-llm.json"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "bench_llm.py"), "--calls", "5", "--baseline", "HEAD",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(out.read_text())
    labels = [label for label in figures["call"] if label != "direct"]
    assert labels[0] == "ours" and (len(labels) == 2 or "no baseline" in proc.stdout), proc.stdout
    for name in ("call", "first_byte"):
        assert all(figures[name][label]["median_ms"] > 0 for label in labels), figures
    assert ("added, ours / baseline" in proc.stdout) == (len(labels) == 2), proc.stdout
    worktrees = subprocess.run(["git", "worktree", "list"], capture_output=True, text=True, cwd=str(ROOT)).stdout
    assert "baseline-" not in worktrees, worktrees


# --- a stale key, a wrong port: one line naming the fix, exit status 2 ---------------------------------

ADDRESSED = ["fork_demo.py", "fork_failed.py", "durability_benchmark.py"]    # the WebSocket, HTTP, a check first


def revoked_key(server) -> str:
    """A key the server issued (read and write on every channel) and then revoked: what a stale
    ACTAE_API_KEY is."""
    status, _, made = http("POST", server.url + "/api/v1/keys", key=server.key,
                           body={"name": "stale", "scopes": {"read": ["*"], "write": ["*"]}})
    assert status == 200, made
    status, _, answer = http("DELETE", server.url + f"/api/v1/keys/{made['id']}", key=server.key)
    assert status == 200, answer
    poll(lambda: http("GET", server.url + "/api/v1/channels", key=made["key"])[0] == 401, 5,
         what="the revoked key to get 401")
    return made["key"]


def closed_port() -> int:
    """A loopback port nothing listens on: bound, read, closed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def the_one_line(proc, script) -> str:
    """The program's whole output, which must be one line from `script`, exit status 2, no traceback."""
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, output(proc)
    assert len(lines) == 1 and lines[0].startswith(f"{script}: "), output(proc)
    return lines[0]


@pytest.mark.parametrize("script", ADDRESSED)
def test_a_stale_key_is_one_line_naming_the_fix(server, script):
    proc = run_example(SimpleNamespace(url=server.url, key=revoked_key(server)), script, timeout=120)
    line = the_one_line(proc, script)
    assert f"the server at {server.url} refused the API key (401)" in line, line
    assert "set ACTAE_API_KEY" in line and "python actae.py key create" in line, line


@pytest.mark.parametrize("script", ADDRESSED)
def test_a_wrong_port_is_one_line_naming_the_fix(server, script):
    url = f"http://127.0.0.1:{closed_port()}"
    proc = run_example(SimpleNamespace(url=url, key=server.key), script, timeout=120)
    line = the_one_line(proc, script)
    assert f"nothing answers at {url}: start the server (python actae.py) or set ACTAE_URL" in line, line


def test_fork_failed_says_the_second_bulk_fork_made_nothing(server, unique):
    """The check that the repeated bulk fork makes nothing new counts what the second request made
    (it said "[6 new]", the first request's forks, under "makes nothing new")."""
    proc = run_example(server, "fork_failed.py", "--name", unique("again"))
    assert proc.returncode == 0, output(proc)
    (line,) = [text for text in proc.stdout.splitlines() if "makes nothing new" in text]
    assert line == ("PASS  the same request again answers the same forks and makes nothing new"
                    "  [the same 6 forks; 0 new (the first request made 6)]"), line
