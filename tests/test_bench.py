"""examples/bench.py --quick reports every figure and target ratio, against the real peers.

The figures move with the machine, so nothing here asserts a speed: the test checks that each
figure is there for each system it names and is a finite positive number, that every target
carries its value and verdict, and what the idempotency probe found. LangGraph and DBOS must be
importable (requirements-dev.txt installs examples/requirements-bench.txt); without them the
tests fail and say so rather than skip.
"""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow

PEERS = ("langgraph", "langgraph.checkpoint.sqlite", "dbos")
SYSTEMS = {"ours", "langgraph", "dbos", "dbos_wal"}
FIGURES = {
    "b1a_steps_per_s": SYSTEMS | {"floor"},
    "b1a_floor_ms_per_step": {"floor"},
    "b1b_steps_per_s": SYSTEMS,
    "b1b_write_requests_per_s": {"ours"},
    "get_requests_per_s": {"ours", "bare"},
    "get_cpu_ms_per_request": {"ours", "bare"},
    "sqlite_commits_per_s": {"raw"},
    "commit_latency_ms": {"raw"},
    "sdk_cpu_ms_per_request": {"ours"},
    "sdk_cpu_ms_per_step": {"ours"},
    "server_cpu_ms_per_write": {"ours"},
    "server_cpu_ms_per_write_b1a": {"ours"},
    "cpu_ms_per_step_b1b": SYSTEMS,
    "peak_rss_mb": {"ours"},
    "b3_pairs_per_s_1": {"ours"},
    "b3_pairs_per_s_8": {"ours"},
    "b3_pairs_per_s_64": {"ours"},
    **{f"b2_fork_ms_{n}": {"ours", "langgraph", "dbos"} for n in ("small", "mid", "large")},
    **{f"b2_session_fork_ms_{n}": {"ours"} for n in ("small", "mid", "large")},
    "bytes_in_per_step": SYSTEMS,
    "disk_bytes_per_step": SYSTEMS,
    "disk_per_step_over_bytes_in": SYSTEMS,
}
RATIOS = {
    "server_cpu_ms_per_write", "server_cpu_write_over_bare", "b1a_over_langgraph", "b1a_time_over_floor",
    "b1b_over_langgraph", "b1b_over_dbos", "b3_pairs_per_s_64", "b2_over_langgraph_small",
    "b2_over_langgraph_mid", "b2_over_langgraph_large", "b2_large_over_small", "peak_rss_mb",
    "disk_over_bytes_in",
}


def missing_peers() -> list[str]:
    missing = []
    for module in PEERS:
        try:
            if importlib.util.find_spec(module) is None:
                missing.append(module)
        except ModuleNotFoundError:
            missing.append(module)
    return missing


def require_peers() -> None:
    if missing := missing_peers():
        pytest.fail(f"the benchmark's peers are not installed ({', '.join(missing)}): "
                    f"pip install -r examples/requirements-bench.txt", pytrace=False)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One quick benchmark for the whole module: (process, report path), or None without the peers."""
    if missing_peers():
        return None
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "bench.py"), "--quick", "--json", str(out)],
                          cwd=str(ROOT), capture_output=True, text=True, encoding="utf-8", timeout=600)
    return proc, out


def finished(quick_run) -> tuple[dict, str]:
    """The quick run's (report, stdout); fails the calling test when it could not run."""
    require_peers()
    proc, out = quick_run
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n--- stderr\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text()), proc.stdout


def positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def test_the_peers_are_importable():
    require_peers()


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_every_figure_is_reported_for_each_system(quick_run, name):
    report, _ = finished(quick_run)
    figure = report["figures"].get(name)
    assert figure, f"figure {name} missing; reported: {sorted(report['figures'])}"
    assert figure["label"] and figure["unit"]
    assert set(figure["values"]) == FIGURES[name], figure["values"]
    for column, value in figure["values"].items():
        assert positive(value), (name, column, value)
        assert figure["samples"][column] and all(positive(v) for v in figure["samples"][column]), (name, column)


def test_every_target_has_a_value_and_a_verdict(quick_run):
    report, _ = finished(quick_run)
    assert set(report["ratios"]) == RATIOS
    for name, check in report["ratios"].items():
        assert positive(check["value"]), (name, check)
        assert check["op"] in ("<=", ">=") and positive(check["target"]), (name, check)
        assert isinstance(check["pass"], bool), (name, check)


def test_the_table_prints_every_figure_and_target(quick_run):
    report, stdout = finished(quick_run)
    for figure in report["figures"].values():
        assert figure["label"] in stdout, figure["label"]
    verdicts = {line.split("|")[1].strip(): line.rstrip(" |").split("|")[-1].strip()
                for line in stdout.splitlines() if line.startswith("|") and line.count("|") == 5}
    for check in report["ratios"].values():
        assert verdicts.get(check["label"]) == ("PASS" if check["pass"] else "FAIL"), check["label"]


def test_the_probe_finds_our_ledger_rejects_a_reused_key_and_reports_dbos(quick_run):
    report, _ = finished(quick_run)
    ours, dbos = report["probes"]["ours"], report["probes"]["dbos"]
    assert ours["mismatch_rejected"] is True, ours
    assert "IdempotencyKeyMismatchError" in ours["mismatch"], ours
    assert ours["same_params"] == "replayed", ours
    assert dbos["behaviour"], dbos


def test_every_system_commits_with_fsync(quick_run):
    report, _ = finished(quick_run)
    workers = report["meta"]["workers"]
    assert workers["langgraph"]["journal_mode"] == "wal" and workers["langgraph"]["synchronous"] == 2
    assert workers["dbos"]["synchronous"] == 2
    assert workers["dbos_wal"]["journal_mode"] == "wal" and workers["dbos_wal"]["synchronous"] == 2
    assert report["meta"]["dbos_fork_statuses"] == ["ENQUEUED"], "a parked DBOS fork must not run"
