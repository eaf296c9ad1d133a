"""examples/bench_streams.py --quick runs end to end and reports a write rate for each subscriber count.

The figures move with the machine, so nothing here asserts a speed: the run must exit 0, and its
JSON report must hold, for each subscriber count asked for, a finite positive events/s and every
frame delivered to every subscriber (for 10 subscribers: each counted every event, in position
order, none cut off). No baseline (--baseline none): no git worktree, and the run stays short.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow

COUNTS = (0, 10)


def test_quick_run_reports_every_count(tmp_path):
    report_path = tmp_path / "bench-streams.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "bench_streams.py"), "--quick", "--baseline", "none",
         "--subscribers", ",".join(map(str, COUNTS)), "--json", str(report_path), "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    report = json.loads(report_path.read_text())

    assert report["meta"]["baseline"] is None and report["meta"]["baseline_skipped"]
    results = report["results"]
    assert set(results) == {"ours"}
    for n in COUNTS:
        figures = results["ours"][str(n)]
        rate = figures["events_per_s"]
        assert isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0, (n, figures)
        assert figures["all_frames_arrived"] is True, (n, figures)
        assert figures["server_cpu_s_per_1k_events"] > 0, (n, figures)

    events = report["meta"]["plan"]["events"]
    (streamed,) = [m for m in report["measurements"] if m["subscribers"] == 10]
    assert streamed["frames_min"] == streamed["frames_max"] == events
    assert streamed["frames_total"] == 10 * events
    assert streamed["ordered"] and streamed["closed_streams"] == 0 and streamed["unpositioned_frames"] == 0
    assert "| 10 |" in done.stdout                 # the table was printed
    assert not list(tmp_path.glob("bench-streams-*")), "the bench left its temporary folder behind"
