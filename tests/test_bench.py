"""examples/bench.py --quick reports every figure and target ratio, against the real peers.

The figures move with the machine, so nothing here asserts a speed: the test checks that each
figure is there for each system it names and is a finite positive number, that the targets are
issue #22's (in its order, with its thresholds) and each carries its value and the verdict that
value earns, that the floors and B2's ratios are computed from this run's own figures, that B4
grew about 1 KB a step and read and forked every system, and what the idempotency probe found. LangGraph and DBOS must be
importable (requirements-dev.txt installs examples/requirements-bench.txt); without them the
tests fail and say so rather than skip.

B1b on PostgreSQL (one server, three servers on one database): the bench takes its PostgreSQL from
ACTAE_TEST_DATABASE_URL when nothing else names one, so on the PostgreSQL pass every one of those
figures and both ratios must be there, with fsync and synchronous_commit reported. On the SQLite
pass they may be skipped, and then they must say so: null values and the reason.

The baseline row: by default every run also measures our server as of the newest tag, else the
newest commit before HEAD that changed actae.py, from a git worktree; every figure ours has (but
the floors) must then have the baseline's value beside it, ours ÷ baseline and which way is better,
in the table and in the report, and the worktree must be gone afterwards.

--feature-costs (one quick round, about 20 s, no peers needed): the table's rows are "all on", all on
against all on (the noise) and each of examples/bench_without.py's FEATURES off alone (spans beside all on, both
exporting), each with its figures and its pair's ratio, saving and share; each server was started
with its ACTAE_BENCH_WITHOUT (its /proc environ) whatever the bench's own environment holds, and ran
as switched: the kept databases of chain off and deltas off hold no chain hash and no delta, all
on's both. Its docs section has its own markers, which the full run's leaves alone.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import sqlite3
import subprocess
import sys

import pytest

from conftest import POSTGRES_URL, ROOT, import_example

pytestmark = pytest.mark.slow
bench = import_example("bench.py")            # its table's number format, `bench.number`

PEERS = ("langgraph", "langgraph.checkpoint.sqlite", "dbos")
SYSTEMS = {"ours", "langgraph", "dbos", "dbos_wal"}
B4 = {"ours", "langgraph", "dbos"}
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
    "b2_sdk_cpu_ms_per_fork": {"ours"},
    "b2_floor_ms": {"floor"},
    "bytes_in_per_step": SYSTEMS,
    "disk_bytes_per_step": SYSTEMS,
    "disk_per_step_over_bytes_in": SYSTEMS,
    **{name: B4 for name in ("b4_steps_per_s", "b4_bytes_added_per_step", "b4_disk_bytes_per_step",
                             "b4_disk_over_added", "b4_read_ms_early", "b4_read_ms_final", "b4_fork_ms")},
    "b4_server_cpu_ms_per_write": {"ours"},
    "b4_read_whole_ms": {"ours"},
}
# The targets of issue #22 in its order, then those still holding: name -> (op, target).
TARGETS = {
    "server_cpu_write_over_get": ("<=", 2),
    "b1a_time_over_floor": ("<=", 1.5),
    "b1b_over_langgraph": (">=", 2.5),
    "b2_over_floor": ("<=", 2),
    "b2_over_langgraph": ("<=", 1.25),
    "b4_disk_over_added": ("<=", 2),
    "b4_read_over_whole": ("<=", 1.3),
    "b4_fork_over_langgraph": ("<=", 1.25),
    "b1b_pg_over_sqlite": (">=", 0.7),
    "b1b_export_503_over_off": (">=", 0.9),      # issue #21: a collector in trouble must not slow writes
    "b1b_export_down_over_off": (">=", 0.9),
    "b1b_over_dbos": (">=", 4),
    "b2_large_over_small": ("<=", 1.2),
    "peak_rss_mb": ("<=", 150),
    "disk_over_bytes_in": ("<=", 1.5),
    "b3_pairs_per_s_64": (">=", 1000),
}
CONTEXT = ("b1b_pg3_over_pg1", "b1a_over_langgraph", "server_cpu_write_over_bare")   # ratios without a target
RATIOS = set(TARGETS) | set(CONTEXT)
PG = ("pg1", "pg3")
PG_FIGURES = {       # figure -> whether it needs PostgreSQL's own CPU (read from /proc: a local server only)
    "pg_b1b_steps_per_s": False,
    "pg_b1b_write_requests_per_s": False,
    "pg_server_cpu_ms_per_write": False,
    "pg_postgres_cpu_ms_per_write": True,
    "pg_cpu_ms_per_step": True,
    "pg_cores_busy": True,
    "pg_machine_cores_busy": False,
    "pg_jobs_per_commit": False,
}
PG_RATIOS = {"b1b_pg_over_sqlite": (">=", 0.7), "b1b_pg3_over_pg1": (None, None)}
SKIPPED = "skipped: no PostgreSQL (pass --postgres URL)"
# Figures of ours the baseline does not get (the SDK's floors), and ratios not measured on it.
NOT_BASELINED = {"b1a_floor_ms_per_step", "b2_floor_ms"}
RATIOS_NOT_BASELINED = {*PG_RATIOS, "b1b_export_503_over_off", "b1b_export_down_over_off"}


def git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def expected_columns(name: str) -> set:
    """The columns of a figure: those FIGURES names, and the baseline's wherever ours is."""
    return FIGURES[name] | ({"baseline"} if "ours" in FIGURES[name] else set())


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
    assert set(figure["values"]) == expected_columns(name), figure["values"]
    for column, value in figure["values"].items():
        assert positive(value), (name, column, value)
        assert figure["samples"][column] and all(positive(v) for v in figure["samples"][column]), (name, column)


def test_every_target_has_a_value_and_a_verdict(quick_run):
    report, _ = finished(quick_run)
    assert set(report["ratios"]) == RATIOS
    for name, check in report["ratios"].items():
        if name in PG_RATIOS:
            continue
        assert positive(check["value"]), (name, check)
        if name in CONTEXT:
            assert (check["op"], check["target"], check["pass"]) == (None, None, None), (name, check)
            continue
        assert check["op"] in ("<=", ">=") and positive(check["target"]), (name, check)
        assert isinstance(check["pass"], bool), (name, check)
        expected = check["value"] <= check["target"] if check["op"] == "<=" else check["value"] >= check["target"]
        assert check["pass"] is expected, (name, check)


def test_the_targets_are_the_issues_in_its_order(quick_run):
    report, _ = finished(quick_run)
    ratios = report["ratios"]
    assert [n for n in ratios if n not in CONTEXT] == list(TARGETS), list(ratios)
    assert list(ratios)[len(TARGETS):] == list(CONTEXT), list(ratios)
    for name, (op, target) in TARGETS.items():
        assert (ratios[name]["op"], ratios[name]["target"]) == (op, target), ratios[name]


def test_the_floors_and_the_b2_ratios_are_those_of_this_run(quick_run):
    report, _ = finished(quick_run)
    figures, ratios = report["figures"], report["ratios"]
    latency = figures["commit_latency_ms"]["values"]["raw"]
    floor = figures["b2_floor_ms"]["values"]["floor"]
    assert floor == pytest.approx(figures["b2_sdk_cpu_ms_per_fork"]["values"]["ours"] + latency)
    sizes = [str(n) for n in report["meta"]["plan"]["sizes"]]
    for name, over in (("b2_over_floor", lambda f: f["ours"] / floor),
                       ("b2_over_langgraph", lambda f: f["ours"] / f["langgraph"])):
        by_size = ratios[name]["by_size"]
        assert list(by_size) == sizes, by_size
        for which, size in zip(("small", "mid", "large"), sizes):
            assert by_size[size] == pytest.approx(over(figures[f"b2_fork_ms_{which}"]["values"])), (name, size)
        assert ratios[name]["value"] == max(by_size.values())
    assert ratios["server_cpu_write_over_get"]["value"] == pytest.approx(
        figures["server_cpu_ms_per_write"]["values"]["ours"] / figures["get_cpu_ms_per_request"]["values"]["ours"])


def test_b4_grows_a_conversation_and_reads_forks_every_system(quick_run):
    report, stdout = finished(quick_run)
    b4, plan, figures = report["b4"], report["meta"]["plan"], report["figures"]
    assert (b4["steps"], b4["early"]) == (plan["b4_steps"], plan["b4_early"]) and b4["steps"] > b4["early"]
    assert 900 <= b4["bytes_added_per_step"] <= 1200, b4["bytes_added_per_step"]   # about 1 KB a step
    for name in B4:
        assert b4[name]["checkpointed"], name
        assert b4[name]["start"]["steps"] + b4[name]["finish"]["steps"] == b4["steps"], name
        for phase in ("read_early", "read_final", "fork"):
            assert len(b4[phase][name]) == plan["b4_samples"], (phase, name)
    assert len(b4["read_final"]["ours_whole"]) == plan["b4_samples"]
    assert b4["ours"]["start"]["connection_errors"] == b4["ours"]["finish"]["connection_errors"] == 0
    assert b4["dbos_fork_statuses"] == ["ENQUEUED"], "a parked DBOS fork must not run"
    assert f"step {plan['b4_steps']}" in figures["b4_read_ms_final"]["label"]
    assert f"step {plan['b4_steps'] // 2}" in figures["b4_fork_ms"]["label"]
    raw = figures["sqlite_commits_per_s"]["values"]["raw"]
    assert "raw commit rate" in stdout and f"{raw:,.0f} commits/s" in stdout, "the raw commit rate beside the targets"


def measured_postgres(report: dict) -> bool:
    """Whether this run measured PostgreSQL; on the PostgreSQL pass it must have."""
    postgresql = report["postgresql"]
    if POSTGRES_URL:
        assert postgresql["skipped"] is None and postgresql["settings"], postgresql
    elif postgresql["skipped"] is not None:       # the SQLite pass: skipped, and saying so
        assert postgresql["skipped"] == SKIPPED and postgresql["settings"] is None, postgresql
        return False
    return True


@pytest.mark.parametrize("name", sorted(PG_FIGURES))
def test_every_postgresql_figure_is_reported_or_says_why_not(quick_run, name):
    report, _ = finished(quick_run)
    postgresql = report["postgresql"]
    figure = postgresql["figures"].get(name)
    assert figure and figure["label"] and figure["unit"], f"figure {name} missing: {sorted(postgresql['figures'])}"
    columns = set(PG) if name == "pg_postgres_cpu_ms_per_write" else {"sqlite", *PG}
    assert set(figure["values"]) == columns, figure["values"]
    if "sqlite" in columns:                        # the SQLite server's figure sits beside them always
        assert positive(figure["values"]["sqlite"]), figure
    if not measured_postgres(report):
        assert [figure["values"][c] for c in PG] == [None, None] and figure["skipped"] == SKIPPED, figure
        return
    if PG_FIGURES[name] and not postgresql["settings"]["cpu_measured"]:   # PostgreSQL on another machine
        assert figure["skipped"] == postgresql["settings"]["cpu_note"] and figure["skipped"], figure
        return
    assert figure["skipped"] is None, figure
    for column in columns:
        assert positive(figure["values"][column]), (name, column, figure["values"])
        assert figure["samples"][column] and all(positive(v) for v in figure["samples"][column]), (name, column)


def test_postgresql_ratios_and_durability_settings(quick_run):
    report, stdout = finished(quick_run)
    ratios = report["ratios"]
    for name, (op, target) in PG_RATIOS.items():
        assert (ratios[name]["op"], ratios[name]["target"]) == (op, target), ratios[name]
    if not measured_postgres(report):
        for name in PG_RATIOS:
            assert ratios[name]["value"] is None and ratios[name]["pass"] is None, ratios[name]
            assert ratios[name]["skipped"] == SKIPPED, ratios[name]
        assert SKIPPED in stdout
        return
    for name in PG_RATIOS:
        assert positive(ratios[name]["value"]) and ratios[name]["skipped"] is None, ratios[name]
    assert isinstance(ratios["b1b_pg_over_sqlite"]["pass"], bool)
    assert ratios["b1b_pg3_over_pg1"]["pass"] is None, "3 servers / 1 server has no target"
    settings = report["postgresql"]["settings"]
    assert settings["fsync"] in ("on", "off") and settings["synchronous_commit"], settings
    assert f"fsync={settings['fsync']}, synchronous_commit={settings['synchronous_commit']}" in stdout
    if settings["fsync"] == "off":                 # commits cheaper than SQLite's: the table must say so
        assert "WARNING: fsync=off" in stdout and "not like-for-like" in ratios["b1b_pg_over_sqlite"]["label"]
    elif settings["fsync_set_on_by_bench"]:
        assert settings["cluster_fsync"] == "off", settings
    rounds = report["rounds"]
    assert all(set(got["b1b_pg"]) == set(PG) for got in rounds), [sorted(got["b1b_pg"]) for got in rounds]
    spread = [got["b1b_pg"]["pg3"]["write_jobs_each"] for got in rounds]
    assert all(len(jobs) == 3 and all(n > 0 for n in jobs) for jobs in spread), (
        f"each of the three servers must have written some of the runs: {spread}")


def test_the_table_prints_every_figure_and_target(quick_run):
    report, stdout = finished(quick_run)
    for figure in [*report["figures"].values(), *report["postgresql"]["figures"].values()]:
        assert figure["label"] in stdout, figure["label"]
    verdicts = {cells[0]: cells[-1] for cells in table_rows(stdout, "target")}
    for check in report["ratios"].values():
        expected = "-" if check["pass"] is None else "PASS" if check["pass"] else "FAIL"
        assert verdicts.get(check["label"]) == expected, check["label"]


def table_rows(stdout: str, first_head: str) -> list[list[str]]:
    """The cells of every row of the printed tables whose first column is headed `first_head`."""
    rows, inside = [], False
    for line in stdout.splitlines():
        if not line.startswith("|"):
            inside = False
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] == first_head:
            inside, heads = True, cells
        elif inside and not set(line) <= set("|-"):
            rows.append(dict(zip(heads, cells)) if first_head == "figure" else cells)
    return rows


def test_the_baseline_row_is_our_server_at_the_default_ref(quick_run):
    """The default baseline, measured like ours: its figures, ours ÷ baseline and which way is
    better, in the report and in a "÷ baseline" column; its worktree removed at the end."""
    report, stdout = finished(quick_run)
    base = report["baseline"]
    expected = git("describe", "--tags", "--abbrev=0") or git("log", "-1", "--format=%H", "HEAD~1", "--", "actae.py")
    assert expected, "this checkout has neither a tag nor a commit before HEAD that changed actae.py"
    assert base["skipped"] is None and base["commit"] == git("rev-parse", f"{expected}^{{commit}}"), base
    assert report["meta"]["baseline_commit"] == base["commit"] and base["short"]
    assert all("baseline" in got["order"] and "baseline" in got["b1b_order"] for got in report["rounds"])
    for name, figure in report["figures"].items():
        if "ours" not in figure["values"] or name in NOT_BASELINED:
            assert name not in base["figures"], name
            continue
        compared = base["figures"][name]
        ours, theirs = figure["values"]["ours"], figure["values"]["baseline"]
        assert (compared["ours"], compared["baseline"]) == (ours, theirs), (name, compared)
        assert compared["ours_over_baseline"] == pytest.approx(ours / theirs), (name, compared)
        better = None if name in ("bytes_in_per_step", "b4_bytes_added_per_step") else figure["unit"].endswith("/s")
        assert compared["higher_is_better"] is better is figure["higher_is_better"], (name, compared)
    for name, check in report["ratios"].items():
        compared = base["ratios"][name]
        if name in RATIOS_NOT_BASELINED:
            assert compared["baseline"] is None and compared["ours_over_baseline"] is None, (name, compared)
            continue
        assert positive(compared["baseline"]), (name, compared)
        assert compared["ours_over_baseline"] == pytest.approx(check["value"] / compared["baseline"]), name
    head = f"baseline {base['short']}"
    rows = {row["figure"]: row for row in table_rows(stdout, "figure") if head in row}
    for name, compared in base["figures"].items():
        row = rows[report["figures"][name]["label"]]
        assert row["÷ baseline"] == bench.number(compared["ours_over_baseline"]), (name, row)
        assert row["higher is better?"] == {True: "yes", False: "no", None: "-"}[compared["higher_is_better"]]
    worktrees = git("worktree", "list", "--porcelain")
    assert "actae-bench-" not in worktrees, f"the baseline's worktree was left behind:\n{worktrees}"


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


EXPORT_COLUMNS = {"off", "503", "down", "ok"}


def test_b1b_with_export_on_against_off(quick_run):
    """B1b with OpenTelemetry export to a collector answering 503 slowly, to one that is down and to
    one that takes everything, beside export off: a figure per column; spans dropped where the
    collector refused, exported where it took them, none either way with export off."""
    report, stdout = finished(quick_run)
    figures = report["export"]
    for name in ("export_b1b_steps_per_s", "export_server_cpu_ms_per_write"):
        assert set(figures[name]["values"]) == EXPORT_COLUMNS, figures[name]
        assert all(positive(v) for v in figures[name]["values"].values()), figures[name]
    exported, dropped = figures["export_spans_exported"]["values"], figures["export_spans_dropped"]["values"]
    assert exported["off"] == dropped["off"] == 0
    assert exported["ok"] > 0 and dropped["ok"] == 0
    assert exported["503"] == exported["down"] == 0
    assert "B1b with OpenTelemetry export" in stdout


def test_b5_times_the_runs_list_the_filter_the_inbox_and_a_search_at_two_sizes(quick_run):
    report, stdout = finished(quick_run)
    b5 = report["b5"]
    small, large = b5["sizes"]
    assert 0 < small < large and b5["events_per_run"] == 6 and positive(b5["load_runs_per_s"])
    assert set(b5["figures"]) == {"b5_first_page_ms", "b5_failed_ms", "b5_inbox_ms", "b5_search_ms"}
    for figure in b5["figures"].values():
        assert figure["label"] in stdout and figure["unit"] == "ms"
        assert set(figure["values"]) == {f"{small:,} runs", f"{large:,} runs"}
        assert all(positive(v) for v in figure["values"].values())
        assert all(samples and all(positive(s) for s in samples) for samples in figure["samples"].values())
    assert set(b5["ratios"]) == {"b5_first_page_large_over_small", "b5_failed_large_over_small",
                                 "b5_inbox_large_over_small", "b5_search_ms_large"}
    for check in b5["ratios"].values():
        assert positive(check["value"]) and check["op"] == "<=" and isinstance(check["pass"], bool)
        assert check["label"] in stdout


# --------------------------------------------------------------------------------------------
# --feature-costs: B1b (and a growing state) with each write-path feature switched off in turn
# --------------------------------------------------------------------------------------------

FEATURE_CONFIGS = {"all on": "", "all on, again": "", "run-state": "run-state", "approvals": "approvals",
                   "request-metrics": "request-metrics", "deltas": "deltas", "chain": "chain",
                   "all on, exporting": "", "spans": "spans"}
REFERENCES = ("all on", "all on, exporting")
EXPORTING = ("all on, exporting", "spans")
FEATURE_HEADS = ["feature switched off", "steps/s", "server CPU per write request (ms)", "÷ all on",
                 "CPU saved per write (ms, all on minus off)", "share of a write (saved ÷ all on)"]


@pytest.fixture(scope="module")
def feature_run(tmp_path_factory):
    """One `--feature-costs --quick` run of one round (about 20 s), its servers' data directories kept,
    its tables written into a copy of docs/benchmarks.md; ACTAE_BENCH_WITHOUT=chain in the bench's own
    environment must reach none of its servers (each gets its configuration's value)."""
    folder = tmp_path_factory.mktemp("features")
    out, docs = folder / "features.json", folder / "benchmarks.md"
    docs.write_text((ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8"), encoding="utf-8")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "bench.py"), "--feature-costs", "--quick",
                           "--rounds", "1", "--json", str(out), "--docs", str(docs), "--dir", str(folder / "runs"),
                           "--keep"],
                          cwd=str(ROOT), capture_output=True, text=True, encoding="utf-8", timeout=300,
                          env={**os.environ, "ACTAE_BENCH_WITHOUT": "chain"})
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n--- stderr\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text()), proc.stdout, proc.stderr, docs


def test_feature_costs_rows_and_figures(feature_run):
    report, stdout, _, _ = feature_run
    import actae

    fc = report["feature_costs"]
    launcher = import_example("bench_without.py")
    assert fc["features"] == list(launcher.FEATURES), "the bench's configurations follow bench_without.py's FEATURES"
    assert fc["delta_min_bytes"] == actae.DELTA_MIN_BYTES
    assert list(fc["configs"]) == list(FEATURE_CONFIGS) and fc["rounds"] == 1
    assert set(report["rounds"][0]["pairs"]) == set(FEATURE_CONFIGS) - set(REFERENCES)
    rows = table_rows(stdout, "feature switched off")
    grown = [c for c in FEATURE_CONFIGS if c not in EXPORTING]
    assert [row[0] for row in rows] == [fc["configs"][c]["label"] for c in [*FEATURE_CONFIGS, *grown]], (
        "the B1b table's rows, then the growing state's")
    assert "What each write-path feature costs (B1b, SQLite)" in stdout and "WARNING" not in stdout
    heads = next(line for line in stdout.splitlines() if line.startswith("| feature switched off"))
    assert [cell.strip() for cell in heads.strip("|").split("|")] == FEATURE_HEADS
    for i, (config, row) in enumerate(zip([*FEATURE_CONFIGS, *grown], rows)):
        f = fc["configs"][config]
        phase = f["b1b"] if i < len(FEATURE_CONFIGS) else f["grow"]
        assert positive(phase["steps_per_s"]) and positive(phase["server_cpu_ms_per_write"]), (config, phase)
        assert row[3] == bench.number(phase["cpu_over_all_on"]), (config, row)
        if config in REFERENCES:          # every all-on server of the round, the reference of the others
            assert f["compared_with"] is None and phase["cpu_over_all_on"] == 1 and row[4] == row[5] == "-"
            assert f["servers"] == (1 if config in EXPORTING else len(grown) - 1), (config, f["servers"])
            continue
        assert f["compared_with"] == ("all on, exporting" if config in EXPORTING else "all on") and f["servers"] == 1
        (ours,), (reference,) = phase["samples"]["server_cpu_ms_per_write"], phase["samples"]["all_on_server_cpu_ms_per_write"]
        assert phase["cpu_over_all_on"] == pytest.approx(ours / reference), config
        assert phase["cpu_saved_ms_per_write"] == pytest.approx(reference - ours), config
        assert phase["share_of_a_write"] == pytest.approx((reference - ours) / reference), config
        assert row[5] == f"{round(phase['share_of_a_write'] * 100, 1) or 0.0:.1f}%", (config, row)
    for config in EXPORTING:
        assert fc["configs"][config]["grow"] is None, "the exporting servers run B1b only"
    assert fc["configs"]["deltas"]["grow"]["disk_over_all_on"] > 1.5, "states stored whole take more disk"


def test_each_server_ran_with_its_switch(feature_run):
    """The environment each server was started with (its /proc environ, as the bench read it), what
    the bench saw each feature do, and the kept databases read here: chain off leaves every
    chain_hash NULL, deltas off stores no state as a delta, where all on does both."""
    report, _, stderr, _ = feature_run
    fc, pairs = report["feature_costs"], report["rounds"][0]["pairs"]
    assert "ignoring ACTAE_BENCH_WITHOUT" in stderr
    for config, without in FEATURE_CONFIGS.items():
        f = fc["configs"][config]
        assert f["environ"] == [without] * f["servers"] and f["switch_ok"] and not f["mismatches"], (config, f)
        for seen in f["seen"]:
            for feature, at_work in seen.items():
                if at_work is not None:
                    assert at_work is (feature != without), (config, feature)
            assert (seen["spans"] is None) is (config not in EXPORTING), config
    assert [s["exported"] > 0 for s in fc["configs"]["all on, exporting"]["spans"]] == [True]
    assert [s["exported"] for s in fc["configs"]["spans"]["spans"]] == [0]

    def counts(server: dict) -> tuple:
        database = f"file:{server['data_dir']}/actae.db?mode=ro"
        with contextlib.closing(sqlite3.connect(database, uri=True)) as conn:
            return conn.execute("SELECT COUNT(*), COUNT(chain_hash), (SELECT COUNT(*) FROM states"
                                " WHERE delta_base IS NOT NULL) FROM events").fetchone()

    events, hashed, deltas = counts(pairs["chain"]["off"])
    assert events > 0 and hashed == 0 and deltas > 0, "chain off: events without a chain hash"
    events, hashed, deltas = counts(pairs["deltas"]["off"])
    assert hashed == events > 0 and deltas == 0, "deltas off: every state stored whole"
    events, hashed, deltas = counts(pairs["chain"]["reference"])
    assert hashed == events > 0 and deltas > 0, "all on, though the bench ran with ACTAE_BENCH_WITHOUT=chain"


def test_feature_costs_write_their_own_docs_section(feature_run):
    """--feature-costs writes between its own markers and leaves the bench's section as it was; the
    full run's write_docs leaves the feature-costs section as it was."""
    _, _, _, docs = feature_run
    original = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    text = docs.read_text(encoding="utf-8")
    start, end = text.index(bench.FEATURES_START), text.index(bench.FEATURES_END)
    section = text[start + len(bench.FEATURES_START):end]
    assert "What each write-path feature costs (B1b, SQLite)" in section and "--feature-costs --quick" in section

    def bench_section(body: str) -> str:
        return body[body.index(bench.DOCS_START):body.index(bench.DOCS_END)]

    assert bench_section(text) == bench_section(original)
    assert text[:text.index(bench.FEATURES_START)] == original[:original.index(bench.FEATURES_START)]
    bench.write_docs(docs, "the full run's tables")
    again = docs.read_text(encoding="utf-8")
    assert f"{bench.DOCS_START}\nthe full run's tables\n{bench.DOCS_END}" in again
    assert again[again.index(bench.FEATURES_START):again.index(bench.FEATURES_END)] == text[start:end]
