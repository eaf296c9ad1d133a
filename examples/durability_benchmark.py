"""Crash-consistency benchmark: how many side effects does a crashed agent apply twice?

    python examples/durability_benchmark.py --matrix        # worst case, about 30 s
    python examples/durability_benchmark.py --sweep         # every step and crash point
    python examples/durability_benchmark.py --cell ledger:3:after_effect:ignore

A 6-step agent applies one effect per step to a real downstream service (a stdlib HTTP server
on SQLite, started here, that records every application; it either honours or ignores the
idempotency key each request carries, and answers `GET /status?key=` for any key). The agent
runs in a worker process that is killed with `os._exit(137)` at a chosen step and crash point:

  after_effect    the effect was applied, the ledger not yet told
  after_complete  the effect was applied and completed in the ledger
  transport_drop  the service applied the effect but the response never reached the worker
  transport_fail  the worker died right before sending: the request never arrived

then a new worker runs the agent to completion. Strategies:

  naive           re-run from the start, no ledger
  ledger          claim/complete each step in the Actae ledger (key per step, 1 s lease);
                  on `in_progress` wait until the lease lapses and the claim is `reclaimed`
  ledger_query    as ledger, but a reclaimed step first asks the service's status endpoint
                  whether its effect already landed, and re-applies only if it did not

Duplicates are counted from the service's own records. Expected: naive duplicates every
effect before the crash; ledger at most 1, only at after_effect and transport_drop (the
effect is done but the ledger cannot know); ledger_query 0 everywhere. With a service that
honours keys, everything is 0.

Uses ACTAE_URL / ACTAE_API_KEY (or --url / --key) when given; otherwise starts
`python actae.py --port 0` on a temporary data directory and stops it at the end. Prints a
table, writes a JSON report (--out, default examples/out/durability.json) and exits 0 when
every cell matches the expected count.
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from actae_client import ActaeClient

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _connect  # noqa: E402  (examples/_connect.py: one line, not a traceback, for a refused key or a wrong address)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "examples" / "out" / "durability.json"
STRATEGIES = ["naive", "ledger", "ledger_query"]
POINTS = ["after_effect", "after_complete", "transport_drop", "transport_fail"]
DOWNSTREAMS = ["ignore", "honour"]
CRASH_EXIT = 137
TOOL = "apply_effect"


# Downstream service ---------------------------------------------------------------------

class Downstream:
    """A local HTTP service that applies effects and records every application in SQLite.

    `POST /apply` with `{"run", "step", "key"}` applies the effect (a new row) unless
    `honour_keys` is set and the key was seen, in which case it answers the first
    application. `?drop=1` applies, then closes the connection without answering.
    `GET /status?key=K` answers `{"key", "applied", "application"}`.
    """

    def __init__(self, db_path: Path, honour_keys: bool):
        self.honour_keys = honour_keys
        self.lock = threading.Lock()
        self.db = sqlite3.connect(db_path, check_same_thread=False, isolation_level=None)
        self.db.execute("CREATE TABLE IF NOT EXISTS applications (id INTEGER PRIMARY KEY, "
                        "run TEXT NOT NULL, step INTEGER NOT NULL, key TEXT NOT NULL, at REAL NOT NULL)")
        self.db.execute("CREATE INDEX IF NOT EXISTS applications_key ON applications (key)")
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def first_application(self, key: str):
        """Return the first application recorded under `key`, or None."""
        with self.lock:
            row = self.db.execute("SELECT id, run, step FROM applications WHERE key = ? "
                                  "ORDER BY id LIMIT 1", (key,)).fetchone()
        return {"id": row[0], "run": row[1], "step": row[2]} if row else None

    def apply(self, run: str, step: int, key: str) -> dict:
        """Apply the effect (or answer the first application when honouring keys)."""
        with self.lock:
            if self.honour_keys:
                row = self.db.execute("SELECT id FROM applications WHERE key = ? ORDER BY id LIMIT 1",
                                      (key,)).fetchone()
                if row:
                    return {"id": row[0], "run": run, "step": step, "deduplicated": True}
            cur = self.db.execute("INSERT INTO applications (run, step, key, at) VALUES (?, ?, ?, ?)",
                                  (run, step, key, time.time()))
            return {"id": cur.lastrowid, "run": run, "step": step, "deduplicated": False}

    def counts(self, run: str) -> dict[int, int]:
        """Return step -> number of times its effect was applied for `run`."""
        with self.lock:
            rows = self.db.execute("SELECT step, COUNT(*) FROM applications WHERE run = ? GROUP BY step",
                                   (run,)).fetchall()
        return dict(rows)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.db.close()

    def _handler(self):
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep the benchmark's output to its own table
                pass

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                url = urllib.parse.urlsplit(self.path)
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                if url.path != "/apply":
                    return self._answer(404, {"error": "not found"})
                result = service.apply(body["run"], int(body["step"]), self.headers["idempotency-key"])
                if "drop=1" in url.query:
                    self.close_connection = True  # applied and committed; the answer is lost
                    return
                self._answer(200, result)

            def do_GET(self):
                url = urllib.parse.urlsplit(self.path)
                if url.path != "/status":
                    return self._answer(404, {"error": "not found"})
                key = urllib.parse.parse_qs(url.query).get("key", [""])[0]
                first = service.first_application(key)
                self._answer(200, {"key": key, "applied": first is not None, "application": first})

        return Handler


# The worker: a 6-step agent that may die ------------------------------------------------

def die() -> None:
    """Crash the worker the hard way: no cleanup, no flush, exit status 137."""
    os._exit(CRASH_EXIT)


def post_json(url: str, body: dict, key: str) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", "idempotency-key": key})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def apply_effect(service: str, run: str, step: int, crash: str | None) -> dict:
    """Ask the downstream to apply this step's effect; die before or after sending if told to."""
    body, key = {"run": run, "step": step}, f"{run}:{step}"
    if crash == "transport_fail":
        die()
    if crash == "transport_drop":
        try:
            post_json(f"{service}/apply?drop=1", body, key)
        except (OSError, http.client.HTTPException):
            pass  # expected: the service applied the effect and hung up without answering
        die()
    return post_json(f"{service}/apply", body, key)


def applied_status(service: str, run: str, step: int) -> dict | None:
    """Ask the downstream whether this step's effect landed; return it, or None."""
    key = urllib.parse.quote(f"{run}:{step}")
    with urllib.request.urlopen(f"{service}/status?key={key}", timeout=10) as r:
        body = json.loads(r.read())
    return body["application"] if body["applied"] else None


async def claim_step(client, channel: str, run: str, step: int, lease: int):
    """Claim the step in the ledger; while another attempt holds the lease, wait and retry."""
    deadline = time.monotonic() + 30 + lease
    while True:
        claim = await client.claim_execution(channel, f"step-{step}", TOOL, {"run": run, "step": step},
                                             lease_seconds=lease, emit_replay_event=True)
        if claim.status != "in_progress":
            return claim
        if time.monotonic() > deadline:
            raise RuntimeError(f"step {step} still in progress after {30 + lease} s")
        await asyncio.sleep(0.2)


async def ledger_step(client, cfg: dict, step: int, crash: str | None) -> None:
    """Run one step through the ledger: replay it if done, else apply and complete."""
    run, service = cfg["run"], cfg["service"]
    claim = await claim_step(client, cfg["channel"], run, step, cfg["lease"])
    if claim.status == "replayed":
        return
    result = None
    # A takeover (or any claim after an earlier attempt) may follow an effect that landed.
    retaken = claim.status == "reclaimed" or claim.execution.attempts > 1
    if retaken and cfg["strategy"] == "ledger_query":
        result = applied_status(service, run, step)
    if result is None:
        result = apply_effect(service, run, step, crash)
    if crash == "after_effect":
        die()
    await client.complete_execution(claim.execution.id, claim.claim_token, result)
    if crash == "after_complete":
        die()


async def run_agent(cfg: dict) -> None:
    """The agent: steps 1..N, each applying one effect, crashing where `cfg` says."""
    client = ActaeClient(endpoint=cfg["url"], api_key=os.environ["ACTAE_API_KEY"])
    try:
        for step in range(1, cfg["steps"] + 1):
            crash = cfg["point"] if step == cfg["crash_step"] else None
            if cfg["strategy"] == "naive":
                apply_effect(cfg["service"], cfg["run"], step, crash)
                if crash in ("after_effect", "after_complete"):
                    die()
            else:
                await ledger_step(client, cfg, step, crash)
    finally:
        await client.disconnect()


# Cells ----------------------------------------------------------------------------------

def expected_duplicates(strategy: str, step: int, point: str, downstream: str) -> int:
    """The duplicate count each strategy should show for a crash at (step, point)."""
    if downstream == "honour":
        return 0
    landed = point != "transport_fail"
    if strategy == "naive":
        return (step - 1) + int(landed)  # re-runs every step before the crash, and the crash step
    if strategy == "ledger":
        return int(point in ("after_effect", "transport_drop"))
    return 0


def spawn_worker(cfg: dict, key: str) -> tuple[int, str]:
    """Run the agent in a fresh Python process; return (exit code, tail of stderr)."""
    env = {**os.environ, "ACTAE_API_KEY": key}
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)],
                          env=env, capture_output=True, text=True, timeout=180)
    return proc.returncode, proc.stderr.strip()[-600:]


def run_cell(ctx: dict, strategy: str, step: int, point: str, downstream: str) -> dict:
    """Crash a worker at (step, point), re-run it to completion, count what the service applied."""
    started = time.monotonic()
    run = f"{ctx['prefix']}-{strategy}-s{step}-{point}-{downstream}"
    service = ctx["services"][downstream]
    cfg = {"url": ctx["url"], "service": service.url, "channel": run, "run": run,
           "strategy": strategy, "steps": ctx["steps"], "crash_step": step, "point": point,
           "lease": ctx["lease"]}
    first, err1 = spawn_worker(cfg, ctx["key"])
    second, err2 = spawn_worker({**cfg, "crash_step": None}, ctx["key"])
    counts = service.counts(run)
    duplicates = sum(max(0, n - 1) for n in counts.values())
    missing = sum(1 for s in range(1, ctx["steps"] + 1) if counts.get(s, 0) == 0)
    expected = expected_duplicates(strategy, step, point, downstream)
    cell = {
        "strategy": strategy, "crash_step": step, "crash_point": point, "downstream": downstream,
        "applications": {str(s): counts.get(s, 0) for s in range(1, ctx["steps"] + 1)},
        "duplicates": duplicates, "missing": missing, "expected_duplicates": expected,
        "worker_exit_codes": [first, second],
        "ok": duplicates == expected and missing == 0 and (first, second) == (CRASH_EXIT, 0),
        "seconds": round(time.monotonic() - started, 2),
    }
    if (first, second) != (CRASH_EXIT, 0):
        cell["worker_errors"] = [e for e in (err1, err2) if e]
    return cell


def run_cells(ctx: dict, cells: list[tuple], jobs: int) -> list[dict]:
    """Run the cells `jobs` at a time, printing each as it finishes; return them in order."""
    results = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_cell, ctx, *cell): cell for cell in cells}
        for done, future in enumerate(as_completed(futures), 1):
            cell = future.result()
            results[futures[future]] = cell
            print(f"[{done:>3}/{len(cells)}] {cell['strategy']:<12} step {cell['crash_step']} "
                  f"{cell['crash_point']:<14} {cell['downstream']:<6} duplicates {cell['duplicates']} "
                  f"(expected {cell['expected_duplicates']}, missing {cell['missing']}) "
                  f"{'ok' if cell['ok'] else 'MISMATCH'}  {cell['seconds']:.1f} s", flush=True)
            for err in cell.get("worker_errors", []):
                print("      worker: " + err.replace("\n", "\n      "), flush=True)
    return [results[c] for c in cells]


def summarize(cells: list[dict]) -> dict:
    """Return {downstream: {strategy: {point: {"max", "total", "cells"}}}} of duplicates."""
    summary: dict = {}
    for c in cells:
        slot = summary.setdefault(c["downstream"], {}).setdefault(c["strategy"], {}).setdefault(
            c["crash_point"], {"max": 0, "total": 0, "cells": 0})
        slot["max"] = max(slot["max"], c["duplicates"])
        slot["total"] += c["duplicates"]
        slot["cells"] += 1
    return summary


def print_tables(summary: dict, title: str) -> None:
    for downstream, by_strategy in summary.items():
        print(f"\nduplicate applications, {title}; downstream {downstream}s keys (max / total over cells)")
        print(f"{'strategy':<13}" + "".join(f"{p:>16}" for p in POINTS))
        for strategy in STRATEGIES:
            row = by_strategy.get(strategy)
            if row:
                print(f"{strategy:<13}" + "".join(
                    f"{row[p]['max']:>10} / {row[p]['total']:<3}" if p in row else f"{'-':>16}"
                    for p in POINTS))


# The Actae server, when this benchmark starts its own -----------------------------------

def start_server(data_dir: str) -> tuple[subprocess.Popen, str, str]:
    """Start `actae.py --port 0`; return (process, URL, API key) from the two printed lines."""
    env = {k: v for k, v in os.environ.items() if k not in ("ACTAE_API_KEY", "ACTAE_DATA_DIR")}
    proc = subprocess.Popen([sys.executable, str(ROOT / "actae.py"), "--port", "0", "--data-dir", data_dir],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**env, "PYTHONUNBUFFERED": "1"}, cwd=str(ROOT))
    found: dict = {}
    ready = threading.Event()

    def drain():
        for line in proc.stdout:
            if m := re.match(r"^Dashboard:\s+(http://\S+)", line):
                found["url"] = m.group(1).rstrip("/")
            elif (m := re.match(r"^API key:\s+(sk-\S+)", line)):
                found["key"] = m.group(1)
            if "url" in found and "key" in found:
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    if not ready.wait(30) or "key" not in found:
        proc.kill()
        raise RuntimeError("actae.py printed no Dashboard/API key lines")
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(found["url"] + "/healthz", timeout=2).close()
            return proc, found["url"], found["key"]
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("actae.py never became healthy")
            time.sleep(0.05)


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def check_server(url: str, key: str, channel: str) -> None:
    """One authenticated read through the SDK (the cursor of `channel`, which no cell writes), so that a key
    the server refuses or an address where nothing answers is said before any cell runs."""
    client = ActaeClient(endpoint=url, api_key=key)
    try:
        await client.get_cursor(channel)
    finally:
        await client.disconnect()


# Command line ---------------------------------------------------------------------------

def parse_cell(text: str) -> tuple:
    strategy, step, point, downstream = text.split(":")
    if strategy not in STRATEGIES or point not in POINTS or downstream not in DOWNSTREAMS:
        raise argparse.ArgumentTypeError(f"bad cell {text!r}: strategy:step:point:downstream")
    return strategy, int(step), point, downstream


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--matrix", action="store_true",
                      help="worst case (default): crash at --crash-step, downstream ignoring keys, "
                           "every strategy x crash point")
    mode.add_argument("--sweep", action="store_true", help="every step x crash point x downstream behaviour x strategy")
    mode.add_argument("--cell", type=parse_cell, action="append", help="one cell strategy:step:point:downstream (repeatable)")
    mode.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--url", default=os.environ.get("ACTAE_URL"),
                   help="use this server (env ACTAE_URL) instead of starting one")
    p.add_argument("--key", default=os.environ.get("ACTAE_API_KEY"), help="API key (env ACTAE_API_KEY)")
    p.add_argument("--steps", type=int, default=6, help="steps in the agent (default 6)")
    p.add_argument("--crash-step", type=int, default=3, help="crash step for --matrix (default 3)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="subset, comma-separated")
    p.add_argument("--points", default=",".join(POINTS), help="subset of crash points")
    p.add_argument("--lease", type=int, default=1, help="ledger lease in seconds (default 1)")
    p.add_argument("--jobs", type=int, default=4, help="cells run in parallel (default 4)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"JSON report (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    if args.url and not args.key:
        p.error("--url needs an API key (ACTAE_API_KEY or --key)")
    return args


def plan_cells(args) -> tuple[str, list[tuple]]:
    strategies = args.strategies.split(",")
    points = args.points.split(",")
    if args.cell:
        return "cell", args.cell
    if args.sweep:
        return "sweep", [(s, step, p, d) for d in DOWNSTREAMS for s in strategies
                         for step in range(1, args.steps + 1) for p in points]
    return "matrix", [(s, args.crash_step, p, "ignore") for s in strategies for p in points]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        asyncio.run(run_agent(json.loads(args.worker)))
        return 0
    mode, cells = plan_cells(args)
    if args.url:   # a server of the user's: its address and key are checked before any cell runs
        with _connect.plainly("durability_benchmark.py", args.url):
            asyncio.run(check_server(args.url, args.key, "dur-check"))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="actae-durability-") as tmp:
        proc = None
        url, key = args.url, args.key
        if not url:
            proc, url, key = start_server(str(Path(tmp) / "actae"))
            print(f"started actae.py at {url}")
        services = {d: Downstream(Path(tmp) / f"downstream-{d}.db", honour_keys=(d == "honour"))
                    for d in DOWNSTREAMS}
        ctx = {"url": url, "key": key, "services": services, "steps": args.steps,
               "lease": args.lease, "prefix": f"dur-{uuid.uuid4().hex[:8]}"}
        print(f"{len(cells)} cell(s), {args.steps}-step agent, lease {args.lease} s, {args.jobs} at a time")
        try:
            results = run_cells(ctx, cells, args.jobs)
        finally:
            for service in services.values():
                service.stop()
            if proc:
                stop_server(proc)
    summary = summarize(results)
    title = f"crash at step {args.crash_step} of {args.steps}" if mode == "matrix" else f"{mode}, {args.steps} steps"
    print_tables(summary, title)
    report = {
        "benchmark": "durability", "mode": mode, "steps": args.steps, "lease_seconds": args.lease,
        "server": url, "seconds": round(time.monotonic() - started, 1),
        "ok": all(c["ok"] for c in results), "summary": summary, "cells": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    bad = sum(not c["ok"] for c in results)
    print(f"\n{len(results) - bad}/{len(results)} cells as expected in {report['seconds']} s; wrote {out}")
    if args.url:   # a server this script started is gone by now: no page to link to
        print(f"Dashboard:   {url.rstrip('/')}/?q={ctx['prefix']}  (one run per cell)")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
