"""Actae against LangGraph (SqliteSaver) and DBOS (SQLite) on one machine and one disk.

    pip install -r requirements.txt -r examples/requirements-bench.txt
    python examples/bench.py                  # the full run: 7 minutes on 2 cores, more with the baseline row
    python examples/bench.py --quick          # every figure at small sizes, about a minute on 2 busy cores
    python examples/bench.py --json PATH      # where the report goes (default examples/out/bench.json)
    python examples/bench.py --postgres URL   # also B1b on PostgreSQL, one server and three
    python examples/bench.py --baseline REF   # the baseline row: our server as of REF (default below)
    python examples/bench.py --baseline none  # no baseline row
    python examples/bench.py --docs PATH      # the tables into PATH (default docs/benchmarks.md, full runs)
    python examples/bench.py --feature-costs  # only: what each write-path feature costs (about 8 minutes)

One invocation starts `python actae.py --port 0` on a fresh data directory, a bare Starlette
JSON endpoint under uvicorn, and one worker process per measured system, all inside one
temporary folder, so everything writes to the same disk (`--dir` picks where that folder goes):

  ours       the real `actae-client` SDK talking to the server: AgentSession for runs,
             ActaeClient for forks and the execution ledger
  langgraph  one StateGraph node looping N times; SqliteSaver on its own sqlite3 connection
             with journal_mode=WAL and synchronous=FULL set explicitly; invoked with
             durability="sync", so each checkpoint is committed before the next step runs
  dbos       one DBOS workflow of N steps on a SQLite system database exactly as DBOS
             configures it: a rollback journal and SQLite's default synchronous=FULL (fsync of
             journal and database on every commit); 64 executor threads so 32 workflows can
             really run at once
  dbos_wal   the same on a system database file switched to WAL before DBOS opens it;
             synchronous stays FULL, so every commit still fsyncs the WAL

With a PostgreSQL (`--postgres URL`, else $ACTAE_BENCH_DATABASE_URL, else $ACTAE_TEST_DATABASE_URL:
a maintenance-database URL whose user may CREATE DATABASE) B1b is also measured on our server
backed by PostgreSQL, with one server and with three servers sharing one database: each such
measurement, taking its turn in each round's rotating B1b order, gets a fresh database
(`bench_<pid>_<round>_<pg1|pg3>`), its servers, an untimed warm-up, the timed B1b, and then the
servers stop and the database is dropped. Without a URL those rows print as skipped and their
JSON values (report["postgresql"], and the two PostgreSQL ratios) are null, with the reason.

The baseline: every run also measures our server as of another commit, as a second "ours" row,
so that each table says what the working tree changed against it (ours ÷ baseline, beside a
column saying whether higher is better for that row). REF is --baseline's value; without one, and
without the flag, it is the newest git tag, else the newest commit before HEAD that changed
actae.py (`git log -1 HEAD~1 -- actae.py`, the write path's last change). The bench checks REF out
with `git worktree add --detach` into its temporary folder (removed, and `git worktree prune`d,
at the end) and starts `<worktree>/actae.py` with the Python and the flags ours gets, on its own
data directory, with its own SDK worker (the same SDK and code as ours). It takes its turn in the
same rotating order as every other system (and trades places with ours every other round, so
neither always follows the same system) in B1a, B1b, GET, B3, B2, disk and B4; whatever ours
measures there, it measures too. Not repeated for it: the peers, the floors (the SDK's CPU), B1b
with export and on PostgreSQL (fresh servers per measurement), B5 (loaded through actae's Python
API, which another commit need not share). Outside a git checkout, or when REF names no commit,
one line says so and the run goes on without it. --quick measures it too, at quick sizes.

--docs PATH (default docs/benchmarks.md for a full run; a --quick run writes no file unless given
one) writes the date, the commits of ours and of the baseline, the raw commit rate and every table
between the markers <!-- bench:start --> and <!-- bench:end -->, leaving the rest of the file as it
is (a file without them gets them appended; a missing one is created with a title).

--feature-costs (with --quick: small sizes; --rounds, --run-steps) measures only what each feature of
the write path costs, switched off in turn from outside the server: every server of it runs as
examples/bench_without.py, which imports actae, takes out the features ACTAE_BENCH_WITHOUT names (a
comma list of its FEATURES, in that server's environment) and runs actae's main(). The server has no
such switch: a server without a feature keeps less than it promises. It is not part of the full run, which it would make
about 8 minutes longer. Its report goes to examples/out/bench-feature-costs.json unless --json says
otherwise, and its tables between <!-- feature-costs:start --> and <!-- feature-costs:end --> (--docs
as above), which the full run's --docs leaves as they are. See "Feature costs" below.

Every system fsyncs on commit: our server runs WAL with synchronous=FULL and answers each
write after its commit. The pragmas are read back from each peer's own connection and stored
in the report under meta.

Each round runs every timed phase once per system, in an order that rotates from round to
round so drift hits every system alike; the table shows medians over rounds (B2: median over
its samples; disk: one dedicated run per system after the rounds). Every step hands every
system the same document: seeded, varied JSON text of about 2 KB (sentences from a fixed word
list, numbers, nested lists), the same bytes for all of them.

Figures
  B1a steps/s      one run of N steps, wall time of the whole run (setup and completion
                   included): AgentSession with snapshot_interval=1 (a step event and a state
                   snapshot per step), LangGraph's loop, DBOS's N-step workflow.
  B1a floor        the best a client/server design can do for one run: the SDK's own CPU per
                   step (time.process_time of the client process over the run, ÷ steps) plus two
                   commit latencies (a step is two sequential writes: record, then save_state).
  B1b steps/s      32 concurrent runs of M steps: 32 AgentSessions on one asyncio loop, 32
                   LangGraph threads sharing one SqliteSaver, 32 DBOS workflows started at once;
                   and our write requests/s over the same window.
  B1b export       the same 32 AgentSessions against a fresh server per measurement (a new data
                   dir, an untimed warm-up, the timed B1b, then it stops), each round once with
                   OpenTelemetry export off and once with --otlp-endpoint pointing at each of three
                   loopback collectors: one that answers 503 after a second ("503"), a port where
                   nothing listens ("down"), and one that takes every span at once ("ok"). The
                   targets are 503 / off and down / off (>= 0.9: a collector that is slow or gone
                   must not slow the writes); ok / off is shown beside them, as is what each
                   server's /metrics says it exported and dropped.
  B1b PostgreSQL   the same 32 AgentSessions against `actae.py --database <fresh database>`:
                   one server, then three servers on one database with the 32 runs spread
                   round-robin over their URLs (one SDK process, one client per server). Beside
                   them the SQLite server's figures of the same rounds; server CPU is summed over
                   the servers; PostgreSQL CPU is that of the client backends connected to the
                   measured database (utime + stime from /proc/<pid>/stat, so only when PostgreSQL
                   runs on this machine; the cluster's shared WAL writer and checkpointer are not
                   counted); cores busy is the CPU of the SDK, the servers and those backends ÷
                   wall time, and machine cores busy the same from /proc/stat for every process
                   (other load on the machine included); jobs per commit is write jobs ÷ write
                   batches from each server's /metrics.json (one batch = one transaction = one
                   commit). fsync and synchronous_commit are read and printed with the figures.
                   When fsync is off (pg_virtualenv's clusters) and the user is a superuser, the
                   bench turns it on for its duration (ALTER SYSTEM + pg_reload_conf(): fsync
                   needs no restart) and puts the previous setting back at the end; otherwise
                   the table says commits there are not flushed, so the ratio is not like-for-like.
  GET req/s        32 concurrent loops of GET on the bare endpoint and on our lightest
                   authenticated GET (/api/v1/auth/capabilities: the key is checked, no other
                   work), one aiohttp load generator for both; server CPU ms per request.
  SQLite commits/s one connection, WAL, synchronous=FULL, one 2 KB row per transaction, same
                   disk; commit latency is the median commit.
  SDK CPU          client process CPU ms per request (and per step) during B1a.
  server CPU       our server's CPU (utime + stime of the process, all threads, from
                   /proc/<pid>/stat) during B1b ÷ write requests sent; the few reads each
                   session makes are charged to the writes. The same during B1a, as a context
                   row, and CPU per step of each system (ours: client + server).
  peak RSS         the server's VmHWM (/proc/<pid>/status), reset before B1b and read after.
  B2 fork ms       fork a parent of N steps at k = N/2. Ours: ActaeClient.fork at the cursor
                   of step k (one request; the child inherits the snapshot at k). LangGraph:
                   update_state on the checkpoint of step k (a new branch checkpoint). DBOS:
                   fork_workflow(id, k) (a new workflow with the steps before k copied), parked
                   under an application version no executor serves, so the fork does not then
                   re-run in the background while other systems are measured. Context row:
                   AgentSession.resume(parent, fork_at_step=k), which also resolves the step and
                   loads the inherited state (four requests). Ours and LangGraph's forks
                   alternate (each first half the time); DBOS's are timed after them, on their own:
                   each copies the steps before k in one large transaction (megabytes at
                   N=10,000, committed through a rollback journal on the same disk), which slowed
                   whichever fork came next, the more the larger N. Interleaved with DBOS in a
                   rotation that put ours right after it two times in three and LangGraph never,
                   one run had our fork at N=10,000 1.4x as long as at N=10 after a DBOS fork and
                   1.06x when ours went first.
  B2 floor         the best a client/server fork can do: the SDK's own CPU per fork request
                   (time.process_time of the client process around each of our B2 fork calls,
                   median over every N) plus one commit latency (a fork is one write).
  B3 pairs/s       claim_execution + complete_execution pairs per second with 1, 8 and 64
                   pairs in flight, a new key per pair. The probe claims a used key with other
                   params (we must raise IdempotencyKeyMismatchError) and runs a DBOS workflow
                   again under a used workflow id with another input.
  disk per step    used bytes of a database ((page_count - freelist_count) × page_size) plus
                   its WAL file after a TRUNCATE checkpoint (ours: every file of the data
                   directory), before and after one more B1a run of D steps, ÷ D; then ÷ the bytes
                   handed in (the compact JSON of a step's document).
  WAL frames       ours: frames in the WAL file ((size - 32) ÷ (page size + 24)) after a TRUNCATE
                   checkpoint and one B1a run of 20 steps (short enough that SQLite's
                   autocheckpoint, at 1,000 frames, never restarts the WAL inside it), ÷ the
                   events it committed: what one committed event (with its state save and
                   the session's own writes) costs in pages written.
  B4 growing state one run of 200 steps (40 with --quick) whose state is a conversation,
                   {"messages": [...]}, one message of about 1 KB appended per step (seeded,
                   varied text: the same bytes for every system). Ours: AgentSession with
                   snapshot_interval=1, as B1a (a step event and the whole state saved per step,
                   as a user of the SDK saves it; the server decides how to store it). LangGraph:
                   the messages in the graph state (an operator.add list), a checkpoint per step,
                   durability="sync". DBOS: a workflow whose every step returns the whole state,
                   which is what DBOS stores per step. Each system runs its first 10 steps in
                   turn and holds (LangGraph: a first invoke of 10 steps, then a second invoke
                   on the same thread; DBOS: the workflow waits after step 10); then the early
                   reads; then each runs to the end in turn.
                   disk: as for "disk per step" (the same files), before the run and after it,
                   ÷ steps, then ÷ the bytes the state grows by per step (the compact JSON of the
                   final state minus that of the empty one, ÷ steps).
                   latest-state read at step 10 and at the end: ours client.latest_state(channel);
                   LangGraph graph.get_state(thread config); DBOS the last step's output through
                   DBOS.list_workflow_steps(id, offset=steps - 1, limit=1). Every read is checked
                   against the state that was saved (untimed).
                   whole: our final state saved once in a fresh channel (one version, stored
                   whole), read with latest_state: the cost a read of that state pays anyway.
                   fork at step N/2: ours ActaeClient.fork at that step's cursor; LangGraph
                   update_state on that step's checkpoint; DBOS fork_workflow from step N/2 + 1
                   (the N/2 steps before it copied), parked like B2's.
                   The reads are interleaved across systems, and so are ours and LangGraph's
                   forks, DBOS's coming after them as in B2; 15 samples each (3 with --quick)
                   after a warm-up round; the table shows medians.

Feature costs (--feature-costs)
  configurations   "all on" and each of run-state, approvals, request-metrics, deltas and chain off
                   alone, on servers that do not export; "spans" off beside "all on, exporting", both
                   exporting to a loopback collector that answers ok (span building does nothing on a
                   server that does not export); and all on beside all on, the noise row. Every
                   server, all on too, is examples/bench_without.py; the bench's own environment never
                   passes ACTAE_BENCH_WITHOUT on: every server gets it from the bench ("" for all on).
  measurement      each round, in an order that rotates, each configuration is paired with all on:
                   two fresh SQLite servers started together (data directories in the temporary
                   folder), an untimed warm-up of 10 steps per run on each, then B1b (32 AgentSessions
                   x M steps, as B1b with export) twice on each in the order A B B A (B A A B every
                   other round; 6 rounds, so each order as often): on this shared 2-core VM a server's
                   CPU per write drifts by 10% within seconds, and the order puts the drift on both
                   alike (the first pass of a pair costs a few percent more: A is each role in turn).
                   Server CPU from /proc ÷ write requests over the server's two passes. Then, on
                   servers that do not export, B4's growing conversation as one AgentSession run of
                   200 steps (40 with --quick; the same bytes on every server) on each: server CPU per
                   write and disk per step (as B4's disk), since deltas engage only from 4 KB and
                   B1b's 2 KB states never use them. ÷ all on is the pair's ratio; it, CPU saved per
                   write (all on minus off) and its share of a write are medians over the rounds'
                   pairs, steps/s and CPU per write medians over servers (all on: every all-on
                   server). The noise row's spread is the smallest cost this machine can tell from
                   nothing.
  switch check     after the timed runs each server gets one approval.requested event; once it has
                   stopped, its database says whether run-state (the probe's channel row keeps the
                   blocking type), the approvals index (the inbox row), deltas (states stored as
                   deltas) and the chain (events with a chain hash) were at work, /metrics whether
                   request metrics counted requests and spans were exported; with ACTAE_BENCH_WITHOUT
                   from the server's /proc/<pid>/environ this is in the report, and a server that did
                   not run as switched gets a WARNING under the tables.

Under the tables come the performance targets: issue #22's in its order, then those still holding,
then context ratios without a target, each with its value and PASS or FAIL, and above them the
machine's raw commit rate. A B2 ratio is the largest over the three parent sizes (each under
`by_size` in the report). Nothing exits non-zero on a FAIL: absolute figures move with the
machine, the ratios are the point.
"""
from __future__ import annotations

import argparse
import asyncio
import http.server
import contextlib
import importlib.metadata
import importlib.util
import json
import operator
import os
import platform
import queue
import random
import re
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
import zlib
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Optional
from urllib.parse import urlsplit, urlunsplit

# =============================================================================
# Constants and plans
# =============================================================================

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "examples" / "out" / "bench.json"
SYSTEMS = ("ours", "langgraph", "dbos", "dbos_wal")
OURS = ("ours", "baseline")              # the systems our server's code serves: the working tree's, REF's
B4_SYSTEMS = ("ours", "langgraph", "dbos")   # B4: the journal mode does not change what DBOS stores
PEER_MODULES = ("langgraph", "langgraph.checkpoint.sqlite", "dbos")
PARKED_VERSION = "bench-parked"          # no executor serves it: a parked fork stays ENQUEUED
URL_LINE = re.compile(r"^Dashboard:\s+(http://\S+)")
KEY_LINE = re.compile(r"^API key:\s+(\S+)")
BARE_LINE = re.compile(r"^Bare:\s+(http://\S+)")
OP_TIMEOUT = 900.0                      # one worker operation; the largest is a 10,000-step build
BATCH = 64                              # requests in flight while building a B2 parent
PG_SERVERS = {"pg1": 1, "pg3": 3}       # a PostgreSQL column: how many servers share its database
PG_SOURCES = ("ACTAE_BENCH_DATABASE_URL", "ACTAE_TEST_DATABASE_URL")   # after --postgres, in order
PG_SKIPPED = "skipped: no PostgreSQL (pass --postgres URL)"
WARM_STEPS = 1                          # steps of each run of the untimed B1b on fresh PostgreSQL servers
# B1b with OpenTelemetry export: column -> the loopback collector it exports to (None: export off)
EXPORT_COLUMNS = {"off": None, "503": "slow503", "down": "down", "ok": "ok"}
EXPORT_SLOW_SECONDS = 1.0               # how long the "503" collector takes to refuse a request
BASELINE_AUTO = "auto"                  # --baseline without a REF (and its absence): the newest tag, else ...
BASELINE_OFF = "none"
DEFAULT_DOCS = ROOT / "docs" / "benchmarks.md"
DOCS_START, DOCS_END = "<!-- bench:start -->", "<!-- bench:end -->"
# --feature-costs: the write path's features examples/bench_without.py takes out of a server (its FEATURES,
# named in that server's ACTAE_BENCH_WITHOUT), each off alone on a fresh server, beside all on.
BENCH_WITHOUT_VAR = "ACTAE_BENCH_WITHOUT"
BENCH_WITHOUT_PY = ROOT / "examples" / "bench_without.py"
BENCH_FEATURES = ("run-state", "approvals", "request-metrics", "deltas", "chain", "spans")   # bench_without.FEATURES
ALL_ON, ALL_ON_EXPORTING = "all on", "all on, exporting"
NOISE = "all on, again"                 # all on paired with all on: what a feature that costs nothing measures as
# configuration -> the feature its server runs without (None: every feature on); the last two export
# to a loopback collector that answers ok (span building does nothing on a server that does not export)
FEATURE_CONFIGS = {ALL_ON: None, NOISE: None, **{f: f for f in BENCH_FEATURES if f != "spans"},
                   ALL_ON_EXPORTING: None, "spans": "spans"}
EXPORTING_CONFIGS = (ALL_ON_EXPORTING, "spans")
DELTA_MIN_BYTES = 4096                  # actae.DELTA_MIN_BYTES: smaller states are stored whole, never as deltas
SWITCH_PROBE = "bench-switch-probe"     # the channel of the approval request that shows run-state and the inbox at work
FEATURE_ROUNDS = 6                      # even: each pair's two pass orders (A B B A, B A A B) as often
FEATURE_WARM_STEPS = 10                 # untimed steps of each of the 32 runs on each server before its passes
DEFAULT_FEATURES_JSON = ROOT / "examples" / "out" / "bench-feature-costs.json"
FEATURES_START, FEATURES_END = "<!-- feature-costs:start -->", "<!-- feature-costs:end -->"


@dataclass
class Plan:
    """Sizes of one invocation."""

    rounds: int = 5
    steps: int = 2000                     # B1a: steps of the one run
    runs: int = 32                        # B1b: concurrent runs, also the GET load's concurrency
    run_steps: int = 50                   # B1b: steps of each run
    get_requests: int = 4000
    commits: int = 300                    # raw SQLite commits per round
    b3_pairs: dict = field(default_factory=lambda: {1: 150, 8: 600, 64: 2000})
    sizes: tuple = (10, 1000, 10000)      # B2 parents
    forks: int = 15                       # B2 samples per system and size
    disk_steps: int = 1000
    b4_steps: int = 200                   # B4: steps of the growing run
    b4_early: int = 10                    # B4: the step of the early latest-state read
    b4_samples: int = 15                  # B4: samples of each read and of the fork
    b5_sizes: tuple = (2000, 100_000)     # B5: runs before and after the second load


QUICK = Plan(rounds=2, steps=100, run_steps=5, get_requests=500, commits=60,
             b3_pairs={1: 10, 8: 40, 64: 128}, sizes=(10, 100, 1000), forks=3, disk_steps=100,
             b4_steps=40, b4_samples=3, b5_sizes=(500, 5000))

# =============================================================================
# The state every system is handed
# =============================================================================

WORDS = """the a an agent tool call result plan step memory context token model prompt search file
read write answer user query retrieve rank score summary error retry cache vector index chunk page
document source citation claim evidence check verify draft revise review approve reject budget limit
timeout latency request response server client database table row column key value list item order
invoice customer account payment refund ticket issue bug fix patch test build deploy release branch
commit merge report chart metric trend week month year price cost revenue growth risk market region
team owner because while after before until unless although therefore however instead meanwhile
finally quickly carefully briefly clearly often rarely never always again only also still found need
should could would might will must can may not more less most least first last next previous new old
large small fast slow high low open closed pending done failed ready""".split()
TOOLS = ("web_search", "sql_query", "read_file", "write_file", "http_get", "send_email", "calculator",
         "vector_lookup")
ROLES = ("planner", "researcher", "critic", "writer", "executor")
DOC_BYTES = 2048


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def make_doc(seed: int, step: int) -> dict:
    """One step's agent state: varied JSON of about DOC_BYTES compact bytes, fixed by (seed, step)."""
    rng = random.Random(seed * 1_000_003 + step)

    def sentence() -> str:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 16)))
        return words.capitalize() + rng.choice(".....?!")

    def paragraph(low: int, high: int) -> str:
        return " ".join(sentence() for _ in range(rng.randint(low, high)))

    doc = {
        "step": step,
        "role": rng.choice(ROLES),
        "thought": paragraph(2, 4),
        "messages": [{"role": rng.choice(("user", "assistant", "tool")), "content": paragraph(1, 2),
                      "tokens": rng.randint(5, 900)} for _ in range(rng.randint(2, 3))],
        "tool_call": {"name": rng.choice(TOOLS),
                      "args": {"query": sentence(), "top_k": rng.randint(1, 20),
                               "filters": [rng.choice(WORDS) for _ in range(rng.randint(0, 4))]},
                      "latency_ms": round(rng.uniform(3, 2500), 2), "ok": rng.random() > 0.1},
        "scores": [round(rng.random(), 4) for _ in range(rng.randint(6, 14))],
        "matrix": [[rng.randint(-500, 50_000) for _ in range(rng.randint(2, 5))]
                   for _ in range(rng.randint(2, 5))],
        "usage": {"prompt_tokens": rng.randint(200, 8000), "completion_tokens": rng.randint(10, 1200),
                  "cost_usd": round(rng.uniform(0, 0.2), 6)},
        "notes": [],
    }
    size = len(compact(doc).encode())
    while size < DOC_BYTES - 60:
        note = sentence()
        size += len(compact(note).encode()) + (1 if doc["notes"] else 0)
        doc["notes"].append(note)
    return doc


def make_docs(key: str, count: int) -> list[dict]:
    """The documents of run `key`: the same list in every process that asks."""
    seed = zlib.crc32(key.encode())
    return [make_doc(seed, i) for i in range(count)]


def doc_bytes(docs: list[dict]) -> int:
    return sum(len(compact(d).encode()) for d in docs)


MESSAGE_BYTES = 1024
CHAT_ROLES = ("user", "assistant", "assistant", "tool")


def make_messages(key: str, count: int) -> list[dict]:
    """B4's conversation: `count` messages of about MESSAGE_BYTES compact bytes each (varied text,
    ids and numbers), fixed by `key`: the same list in every process that asks."""
    rng = random.Random(zlib.crc32(key.encode()) ^ 0xB4)

    def sentence() -> str:
        words = [rng.choice(WORDS) if rng.random() > 0.08 else str(rng.randint(0, 99_999))
                 for _ in range(rng.randint(6, 16))]
        return " ".join(words).capitalize() + rng.choice(".....?!")

    messages = []
    for i in range(count):
        role = rng.choice(CHAT_ROLES)
        message = {"id": f"msg-{i:04d}-{rng.getrandbits(40):010x}", "role": role, "content": ""}
        if role == "tool":
            message["name"] = rng.choice(TOOLS)
        message["tokens"] = rng.randint(20, 400)
        target, parts = rng.randint(MESSAGE_BYTES - 200, MESSAGE_BYTES + 200), []
        while len(compact(message).encode()) < target:
            parts.append(sentence())
            message["content"] = " ".join(parts)
        messages.append(message)
    return messages


def grown_state(messages: list[dict], steps: int) -> dict:
    """B4's state after `steps` steps: the conversation so far."""
    return {"messages": messages[:steps]}


def state_bytes(state: Any) -> int:
    return len(compact(state).encode())


# =============================================================================
# Measured systems, one per worker process
# =============================================================================


def measured(steps: int, bytes_in: int, run) -> dict:
    """Run `run()`; return its wall seconds and this process's CPU seconds with the counts given."""
    cpu, started = time.process_time(), time.perf_counter()
    run()
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {"seconds": seconds, "steps": steps, "cpu_seconds": cpu, "bytes_in": bytes_in}


class OursBench:
    """The real SDK against the server: AgentSession runs, ActaeClient forks and ledger pairs."""

    def __init__(self, url: Optional[str], key: Optional[str]):
        self.url, self.key = url, key
        self.loop = asyncio.new_event_loop()
        self.requests: Counter = Counter()
        self.connection_errors = 0
        self.parents: dict[int, tuple[str, dict[int, int]]] = {}
        # Without a URL (--feature-costs) there is no server of its own, only `targets`.
        self.client = self.loop.run_until_complete(self._client(url, key)) if url else None
        self.targets: dict[str, list] = {}      # other servers (PostgreSQL ones): name -> a client each

    async def _client(self, url: str, key: str):
        """An ActaeClient whose requests are counted, with the pool of `_pool`, checked once."""
        from actae_client import ActaeClient, ActaeConnectionError

        client = ActaeClient(endpoint=url, api_key=key, timeout=300)
        send = client._request

        async def counted(method, path, **kwargs):
            self.requests[method] += 1
            try:
                return await send(method, path, **kwargs)
            except ActaeConnectionError:
                self.connection_errors += 1     # AgentSession retries these after a pause: show them
                raise

        # Every SDK call goes through this one method, so this counts what reached the wire.
        client._request = counted
        self._pool(client)
        await client.health_check()
        return client

    def _pool(self, client) -> None:
        """Give the SDK the connection pool it would make, but one that drops a connection after 2
        idle seconds: the server closes one after 5, the SDK's default pool keeps it 15, and a
        request written while the server closes its connection fails. The other systems are
        measured in between our phases, so our connections sit idle for long stretches."""
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(keepalive_timeout=2.0))
        client._sessions_by_loop[id(self.loop)] = session

    def info(self) -> dict:
        return {"actae-client": importlib.metadata.version("actae-client")}

    def call(self, op: str, args: dict) -> dict:
        return self.loop.run_until_complete(getattr(self, "op_" + op)(**args))

    def close(self) -> None:
        for target in list(self.targets):
            self.loop.run_until_complete(self.op_disconnect(target))
        if self.client is not None:
            self.loop.run_until_complete(self.client.disconnect())
        self.loop.close()

    async def op_connect(self, target: str, urls: list[str], key: str) -> dict:
        """A client per server of `target` (servers sharing one database and one key)."""
        self.targets[target] = [await self._client(url, key) for url in urls]
        return {"servers": len(urls)}

    async def op_disconnect(self, target: str) -> dict:
        for client in self.targets.pop(target, []):
            await client.disconnect()
        return {}

    async def _measure(self, steps: int, bytes_in: int, coro) -> dict:
        """`measured` for a coroutine, plus the requests it sent (writes: anything but GET)."""
        before, errors = Counter(self.requests), self.connection_errors
        cpu, started = time.process_time(), time.perf_counter()
        await coro
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        sent = self.requests - before
        return {"seconds": seconds, "steps": steps, "cpu_seconds": cpu, "bytes_in": bytes_in,
                "requests": sum(sent.values()), "writes": sum(n for m, n in sent.items() if m != "GET"),
                "connection_errors": self.connection_errors - errors}

    async def _run(self, name: str, docs: list[dict], client=None) -> None:
        from actae_client import AgentSession

        current = [None]
        async with AgentSession(client or self.client, name, state_fn=lambda: current[0],
                                snapshot_interval=1) as session:
            for i, doc in enumerate(docs):
                current[0] = doc
                await session.step("agent.step", input={"step": i}, output={"role": doc["role"]})

    async def op_b1a(self, n: int, tag: str) -> dict:
        docs = make_docs(tag, n)
        return await self._measure(n, doc_bytes(docs), self._run(tag, docs))

    async def op_b1b(self, runs: int, n: int, tag: str, target: Optional[str] = None) -> dict:
        """`runs` concurrent runs of `n` steps; on `target`'s servers round-robin when named."""
        clients = self.targets[target] if target else [self.client]
        docs = {f"{tag}-{j}": make_docs(f"{tag}-{j}", n) for j in range(runs)}
        every = asyncio.gather(*(self._run(name, d, clients[j % len(clients)])
                                 for j, (name, d) in enumerate(docs.items())))
        return await self._measure(runs * n, sum(map(doc_bytes, docs.values())), every)

    async def op_grow(self, n: int, tag: str, target: str, messages_key: str = "b4") -> dict:
        """--feature-costs: B4's growing conversation (the messages of `messages_key`, the same bytes
        for every server) as one AgentSession run `tag` of `n` steps on `target`'s first server."""
        from actae_client import AgentSession

        messages, current = make_messages(messages_key, n), [None]

        async def run():
            async with AgentSession(self.targets[target][0], tag, state_fn=lambda: current[0],
                                    snapshot_interval=1) as session:
                for i in range(n):
                    current[0] = grown_state(messages, i + 1)
                    await session.step("agent.step", input={"step": i}, output={"role": messages[i]["role"]})

        return await self._measure(n, 0, run())

    async def op_record(self, target: str, channel: str, event_type: str, payload: dict) -> dict:
        """One event on `target`'s first server (--feature-costs' switch probe)."""
        event = await self.targets[target][0].record(channel, event_type, payload, actor="bench")
        return {"cursor": event.cursor}

    async def op_b3(self, inflight: int, pairs: int, tag: str) -> dict:
        channel, keys = f"{tag}-{inflight}", iter(range(pairs))

        async def lane():
            for i in keys:
                claim = await self.client.claim_execution(channel, f"k{i}", "charge",
                                                          {"amount": i, "currency": "EUR"})
                if claim.status != "claimed":
                    raise RuntimeError(f"a fresh key was {claim.status}, not claimed")
                await self.client.complete_execution(claim.execution.id, claim.claim_token,
                                                     {"ok": True, "receipt": f"r{i}"})

        return await self._measure(pairs, 0, asyncio.gather(*(lane() for _ in range(inflight))))

    async def op_probe(self, tag: str) -> dict:
        from actae_client import IdempotencyKeyMismatchError

        channel, params = f"{tag}-ledger", {"amount": 100, "currency": "EUR"}
        claim = await self.client.claim_execution(channel, "charge-1", "charge", params)
        await self.client.complete_execution(claim.execution.id, claim.claim_token, {"receipt": "r1"})
        try:
            other = await self.client.claim_execution(channel, "charge-1", "charge", {**params, "amount": 999})
            mismatch = f"accepted: status {other.status}"
        except IdempotencyKeyMismatchError as exc:
            mismatch = f"rejected: IdempotencyKeyMismatchError ({exc})"
        again = await self.client.claim_execution(channel, "charge-1", "charge", params)
        return {"mismatch_rejected": mismatch.startswith("rejected"), "mismatch": mismatch,
                "same_params": again.status, "same_params_result": again.result}

    async def op_load(self, url: str, concurrency: int, requests: int, with_key: bool,
                      key: Optional[str] = None) -> dict:
        """GET `url` from `concurrency` loops; `key` is that server's (default ours): one load
        generator, this process, for the bare endpoint, our server and the baseline's."""
        import aiohttp

        headers = {"x-api-key": key or self.key} if with_key else {}
        statuses: Counter = Counter()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:
            async def lane(count: int):
                for _ in range(count):
                    async with http.get(url, headers=headers) as response:
                        await response.read()
                        statuses[response.status] += 1

            await asyncio.gather(*(lane(2) for _ in range(concurrency)))  # open every connection
            shares = [requests // concurrency + (i < requests % concurrency) for i in range(concurrency)]
            started = time.perf_counter()
            await asyncio.gather(*(lane(n) for n in shares))
            seconds = time.perf_counter() - started
        if set(statuses) != {200}:
            raise RuntimeError(f"GET {url}: statuses {dict(statuses)}")
        return {"seconds": seconds, "requests": requests, "sent": requests + 2 * concurrency}

    async def op_build(self, sizes: list[int], tag: str) -> dict:
        """Parents shaped like an AgentSession run: a numbered step event and a snapshot per step."""
        for size in sizes:
            channel, docs, cursors = f"{tag}-n{size}", make_docs(f"{tag}-n{size}", size), {}
            for start in range(1, size + 1, BATCH):
                numbers = range(start, min(start + BATCH, size + 1))
                events = await asyncio.gather(*(
                    self.client.record(channel, "agent.step", {"step_number": n, "input": {"step": n - 1},
                                                               "output": {"role": docs[n - 1]["role"]}},
                                       actor="agent_session", step_number=n) for n in numbers))
                cursors.update((n, e.cursor) for n, e in zip(numbers, events))
                await asyncio.gather(*(self.client.save_state(channel, cursors[n], docs[n - 1]) for n in numbers))
            self.parents[size] = (channel, cursors)
        return {"steps": sum(sizes)}

    async def op_fork(self, size: int, child: str) -> dict:
        channel, cursors = self.parents[size]
        cursor = cursors[size // 2]
        cpu, started = time.process_time(), time.perf_counter()
        receipt = await self.client.fork(channel, child, cursor)
        ms, cpu = (time.perf_counter() - started) * 1000, (time.process_time() - cpu) * 1000
        if receipt.resolved_cursor != cursor or not receipt.restorable:
            raise RuntimeError(f"fork of {channel} at {cursor} resolved to {receipt.resolved_cursor}")
        return {"ms": ms, "cpu_ms": cpu}

    async def op_session_fork(self, size: int, child: str) -> dict:
        from actae_client import AgentSession

        channel, _ = self.parents[size]
        started = time.perf_counter()
        session = await AgentSession.resume(self.client, channel, fork_at_step=size // 2, name=child)
        ms = (time.perf_counter() - started) * 1000
        if (session.inherited_state or {}).get("step") != size // 2 - 1:
            raise RuntimeError(f"fork of {channel} at step {size // 2} inherited the wrong state")
        return {"ms": ms}

    # B4: one AgentSession (snapshot_interval=1: a step event and the whole state per step, as a
    # user of the SDK saves it) paused after `early` steps for the early reads, then run to the end.

    async def op_b4_start(self, n: int, early: int, tag: str) -> dict:
        from actae_client import AgentSession

        b4 = self.b4 = {"channel": tag, "messages": make_messages(tag, n), "n": n, "done": 0, "current": None}
        b4["session"] = AgentSession(self.client, tag, state_fn=lambda: b4["current"], snapshot_interval=1)

        async def run():
            await b4["session"].__aenter__()
            await self._grow(early)

        return await self._measure(early, 0, run())

    async def _grow(self, upto: int) -> None:
        b4 = self.b4
        for i in range(b4["done"], upto):
            b4["current"] = grown_state(b4["messages"], i + 1)
            await b4["session"].step("agent.step", input={"step": i}, output={"role": b4["messages"][i]["role"]})
        b4["done"] = upto

    async def op_b4_finish(self) -> dict:
        b4 = self.b4

        async def run():
            await self._grow(b4["n"])
            await b4["session"].__aexit__(None, None, None)

        return await self._measure(b4["n"] - b4["done"], 0, run())

    async def op_b4_whole(self) -> dict:
        """The final state saved once in a fresh channel: its one version is stored whole."""
        b4 = self.b4
        channel = b4["whole"] = b4["channel"] + "-whole"
        event = await self.client.record(channel, "state.whole", {"steps": b4["n"]}, actor="bench")
        await self.client.save_state(channel, event.cursor, grown_state(b4["messages"], b4["n"]))
        return {}

    async def op_b4_read(self, which: str) -> dict:
        """The latest state of the run's channel ("run") or of the fresh channel ("whole")."""
        b4 = self.b4
        channel = b4["channel"] if which == "run" else b4["whole"]
        started = time.perf_counter()
        got = await self.client.latest_state(channel)
        ms = (time.perf_counter() - started) * 1000
        steps = b4["done"] if which == "run" else b4["n"]
        if got is None or got["state"] != grown_state(b4["messages"], steps):
            raise RuntimeError(f"the latest state of {channel} is not the state of step {steps}")
        return {"ms": ms, "bytes": state_bytes(got["state"])}

    async def op_b4_fork(self, child: str) -> dict:
        b4 = self.b4
        cursor = b4["session"].cursors[b4["n"] // 2 - 1]
        started = time.perf_counter()
        receipt = await self.client.fork(b4["channel"], child, cursor)
        ms = (time.perf_counter() - started) * 1000
        if receipt.resolved_cursor != cursor or not receipt.restorable:
            raise RuntimeError(f"fork of {b4['channel']} at {cursor} resolved to {receipt.resolved_cursor}")
        return {"ms": ms}


class LangGraphBench:
    """One StateGraph node that loops N times, checkpointed by SqliteSaver with durability="sync"."""

    def __init__(self, folder: Path):
        from typing import TypedDict

        from langgraph.checkpoint.sqlite import SqliteSaver
        from langgraph.graph import END, START, StateGraph

        self.path = folder / "langgraph.db"
        self.conn = sqlite3.connect(self.path, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.saver = SqliteSaver(self.conn)
        self.saver.setup()
        self.docs: dict[str, list[dict]] = {}
        self.parents: dict[int, dict] = {}

        class State(TypedDict):
            i: int
            n: int
            key: str
            doc: dict

        def agent_step(state: State) -> dict:
            return {"i": state["i"] + 1, "doc": self.docs[state["key"]][state["i"]]}

        builder = StateGraph(State)
        builder.add_node("agent_step", agent_step)
        builder.add_edge(START, "agent_step")
        builder.add_conditional_edges("agent_step", lambda s: END if s["i"] >= s["n"] else "agent_step")
        self.graph = builder.compile(checkpointer=self.saver)

        class Chat(TypedDict):           # B4: the conversation in the graph state, appended to each step
            i: int
            n: int
            key: str
            messages: Annotated[list, operator.add]

        def chat_step(state: Chat) -> dict:
            return {"i": state["i"] + 1, "messages": [self.b4["messages"][state["i"]]]}

        builder = StateGraph(Chat)
        builder.add_node("chat_step", chat_step)
        builder.add_edge(START, "chat_step")
        builder.add_conditional_edges("chat_step", lambda s: END if s["i"] >= s["n"] else "chat_step")
        self.chat_graph = builder.compile(checkpointer=self.saver)
        self.b4: dict = {}

    def info(self) -> dict:
        return {"langgraph": importlib.metadata.version("langgraph"),
                "langgraph-checkpoint-sqlite": importlib.metadata.version("langgraph-checkpoint-sqlite"),
                "journal_mode": self.conn.execute("PRAGMA journal_mode").fetchone()[0],
                "synchronous": self.conn.execute("PRAGMA synchronous").fetchone()[0],
                "durability": "sync", "path": str(self.path)}

    def call(self, op: str, args: dict) -> dict:
        return getattr(self, "op_" + op)(**args)

    def close(self) -> None:
        self.conn.close()

    def _run(self, key: str, n: int) -> None:
        config = {"configurable": {"thread_id": key}, "recursion_limit": n + 10}
        out = self.graph.invoke({"i": 0, "n": n, "key": key, "doc": {}}, config, durability="sync")
        if out["i"] != n:
            raise RuntimeError(f"graph stopped at {out['i']} of {n}")

    def op_b1a(self, n: int, tag: str) -> dict:
        self.docs = {tag: make_docs(tag, n)}
        return measured(n, doc_bytes(self.docs[tag]), lambda: self._run(tag, n))

    def op_b1b(self, runs: int, n: int, tag: str) -> dict:
        self.docs = {f"{tag}-{j}": make_docs(f"{tag}-{j}", n) for j in range(runs)}

        def every():
            with ThreadPoolExecutor(max_workers=runs) as pool:
                list(pool.map(lambda key: self._run(key, n), list(self.docs)))

        return measured(runs * n, sum(map(doc_bytes, self.docs.values())), every)

    def op_build(self, sizes: list[int], tag: str) -> dict:
        for size in sizes:
            key = f"{tag}-n{size}"
            self.docs = {key: make_docs(key, size)}
            self._run(key, size)
            k = size // 2
            found = [t.config for t in self.saver.list({"configurable": {"thread_id": key}})
                     if t.metadata.get("step") == k]
            if len(found) != 1:
                raise RuntimeError(f"no single checkpoint at step {k} of {key}")
            self.parents[size] = found[0]
        self.docs = {}
        return {"steps": sum(sizes)}

    def op_fork(self, size: int, child: str) -> dict:
        started = time.perf_counter()
        self.graph.update_state(self.parents[size], {"n": size + 1})
        return {"ms": (time.perf_counter() - started) * 1000}

    # B4: the graph invoked for `early` steps, its state read, then invoked again on the same
    # thread to the end (the second invoke continues from the thread's checkpoint).

    def op_b4_start(self, n: int, early: int, tag: str) -> dict:
        config = {"configurable": {"thread_id": tag}, "recursion_limit": n + 10}
        self.b4 = {"key": tag, "messages": make_messages(tag, n), "n": n, "done": early, "config": config}

        def run():
            out = self.chat_graph.invoke({"i": 0, "n": early, "key": tag, "messages": []}, config, durability="sync")
            if out["i"] != early:
                raise RuntimeError(f"graph stopped at {out['i']} of {early}")

        return measured(early, 0, run)

    def op_b4_finish(self) -> dict:
        b4 = self.b4

        def run():
            out = self.chat_graph.invoke({"n": b4["n"]}, b4["config"], durability="sync")
            if out["i"] != b4["n"] or len(out["messages"]) != b4["n"]:
                raise RuntimeError(f"graph stopped at {out['i']} of {b4['n']}")

        result = measured(b4["n"] - b4["done"], 0, run)
        b4["done"] = b4["n"]
        return result

    def op_b4_read(self, which: str) -> dict:
        b4 = self.b4
        started = time.perf_counter()
        snapshot = self.chat_graph.get_state(b4["config"])
        ms = (time.perf_counter() - started) * 1000
        if snapshot.values["messages"] != b4["messages"][:b4["done"]]:
            raise RuntimeError(f"the thread's latest state is not the state of step {b4['done']}")
        return {"ms": ms, "bytes": state_bytes(grown_state(snapshot.values["messages"], b4["done"]))}

    def op_b4_fork(self, child: str) -> dict:
        b4, k = self.b4, self.b4["n"] // 2
        if "fork_config" not in b4:
            found = [s.config for s in self.chat_graph.get_state_history(b4["config"])
                     if s.values.get("i") == k and s.metadata.get("source") == "loop"]
            if len(found) != 1:
                raise RuntimeError(f"{len(found)} checkpoints at step {k} of {b4['key']}, not one")
            b4["fork_config"] = found[0]
        started = time.perf_counter()
        self.chat_graph.update_state(b4["fork_config"], {"n": b4["n"] + 1})
        return {"ms": (time.perf_counter() - started) * 1000}


class DbosBench:
    """One DBOS workflow of N steps, each step returning that step's document."""

    def __init__(self, folder: Path, wal: bool):
        from dbos import DBOS, SetWorkflowID

        self.path = folder / ("dbos-wal.db" if wal else "dbos.db")
        if wal:
            with contextlib.closing(sqlite3.connect(self.path)) as conn:
                conn.execute("PRAGMA journal_mode=WAL")   # a file property: DBOS's connections inherit it
        self.DBOS, self.SetWorkflowID = DBOS, SetWorkflowID
        DBOS(config={"name": "actae-bench", "system_database_url": f"sqlite:///{self.path}",
                     "log_level": "WARNING", "max_executor_threads": 64})
        docs = self.docs = {}

        @DBOS.step()
        def agent_step(key: str, i: int) -> dict:
            return docs[key][i]

        @DBOS.workflow()
        def agent_run(key: str, n: int) -> int:
            for i in range(n):
                agent_step(key, i)
            return n

        @DBOS.workflow()
        def charge(params: dict) -> dict:
            return {"charged": params}

        b4 = self.b4 = {"paused": threading.Event(), "resume": threading.Event()}

        @DBOS.step()
        def chat_step(i: int) -> dict:
            return grown_state(b4["messages"], i + 1)     # the step's output is the state

        @DBOS.workflow()
        def chat_run(n: int, early: int) -> int:
            for i in range(n):
                chat_step(i)
                if i + 1 == early:                       # wait (untimed) while the early reads are taken
                    b4["paused"].set()
                    if not b4["resume"].wait(OP_TIMEOUT):
                        raise RuntimeError("B4: never resumed")
            return n

        self.agent_run, self.charge, self.chat_run = agent_run, charge, chat_run
        self.parents: dict[int, str] = {}
        DBOS.launch()

    def info(self) -> dict:
        from dbos import _dbos

        pragmas = {}
        try:
            engine = _dbos._dbos_global_instance._sys_db.engine
            with engine.connect() as conn:
                for name in ("journal_mode", "synchronous"):
                    pragmas[name] = conn.exec_driver_sql(f"PRAGMA {name}").fetchone()[0]
        except Exception as exc:  # a private attribute: report, never fail the bench on it
            pragmas["error"] = repr(exc)
        return {"dbos": importlib.metadata.version("dbos"), "path": str(self.path), **pragmas}

    def call(self, op: str, args: dict) -> dict:
        return getattr(self, "op_" + op)(**args)

    def close(self) -> None:
        self.DBOS.destroy()

    def op_b1a(self, n: int, tag: str) -> dict:
        self.docs.clear()
        self.docs[tag] = make_docs(tag, n)
        return measured(n, doc_bytes(self.docs[tag]), lambda: self.agent_run(tag, n))

    def op_b1b(self, runs: int, n: int, tag: str) -> dict:
        self.docs.clear()
        self.docs.update({f"{tag}-{j}": make_docs(f"{tag}-{j}", n) for j in range(runs)})

        def every():
            handles = [self.DBOS.start_workflow(self.agent_run, key, n) for key in list(self.docs)]
            if [h.get_result() for h in handles] != [n] * runs:
                raise RuntimeError("a workflow returned the wrong step count")

        return measured(runs * n, sum(map(doc_bytes, self.docs.values())), every)

    def op_build(self, sizes: list[int], tag: str) -> dict:
        for size in sizes:
            key = f"{tag}-n{size}"
            self.docs.clear()
            self.docs[key] = make_docs(key, size)
            with self.SetWorkflowID(key):
                self.agent_run(key, size)
            self.parents[size] = key
        self.docs.clear()
        return {"steps": sum(sizes)}

    def op_fork(self, size: int, child: str) -> dict:
        started = time.perf_counter()
        handle = self.DBOS.fork_workflow(self.parents[size], size // 2, application_version=PARKED_VERSION)
        ms = (time.perf_counter() - started) * 1000
        return {"ms": ms, "status": handle.get_status().status}

    # B4: one workflow whose every step returns the whole conversation so far, held after `early`
    # steps for the early reads. A read is the last step's output through DBOS's own API:
    # DBOS.list_workflow_steps(id, offset=steps - 1, limit=1), one row.

    def op_b4_start(self, n: int, early: int, tag: str) -> dict:
        b4 = self.b4
        b4.update(id=tag, messages=make_messages(tag, n), n=n, done=early)
        b4["paused"].clear()
        b4["resume"].clear()

        def run():
            with self.SetWorkflowID(tag):
                b4["handle"] = self.DBOS.start_workflow(self.chat_run, n, early)
            if not b4["paused"].wait(OP_TIMEOUT):
                raise RuntimeError(f"B4: the workflow did not reach step {early}")

        return measured(early, 0, run)

    def op_b4_finish(self) -> dict:
        b4 = self.b4

        def run():
            b4["resume"].set()
            if b4["handle"].get_result() != b4["n"]:
                raise RuntimeError("B4: the workflow returned the wrong step count")

        result = measured(b4["n"] - b4["done"], 0, run)
        b4["done"] = b4["n"]
        return result

    def op_b4_read(self, which: str) -> dict:
        b4 = self.b4
        started = time.perf_counter()
        steps = self.DBOS.list_workflow_steps(b4["id"], offset=b4["done"] - 1, limit=1)
        ms = (time.perf_counter() - started) * 1000
        if len(steps) != 1 or steps[0]["output"] != grown_state(b4["messages"], b4["done"]):
            raise RuntimeError(f"the last step output of {b4['id']} is not the state of step {b4['done']}")
        return {"ms": ms, "bytes": state_bytes(steps[0]["output"])}

    def op_b4_fork(self, child: str) -> dict:
        """fork_workflow starting at step k + 1: the k steps before it (their outputs) are copied."""
        k = self.b4["n"] // 2
        started = time.perf_counter()
        handle = self.DBOS.fork_workflow(self.b4["id"], k + 1, application_version=PARKED_VERSION)
        ms = (time.perf_counter() - started) * 1000
        return {"ms": ms, "status": handle.get_status().status}

    def op_probe(self, tag: str) -> dict:
        workflow_id = f"{tag}-charge"
        with self.SetWorkflowID(workflow_id):
            first = self.charge({"amount": 100, "currency": "EUR"})
        try:
            with self.SetWorkflowID(workflow_id):
                second = self.charge({"amount": 999, "currency": "EUR"})
            raised = None
        except Exception as exc:
            second, raised = None, f"{type(exc).__name__}: {exc}"
        if raised:
            what = f"raised {raised}"
        elif second == first:
            what = "no error: returned the first run's result, the new input was ignored"
        else:
            what = f"no error: ran again and returned {second!r}"
        return {"raised": raised, "first_result": first, "second_result": second, "behaviour": what}


# =============================================================================
# Worker process side
# =============================================================================


def serve_worker(args: argparse.Namespace) -> int:
    """Answer one JSON line per operation read from stdin until `quit` or end of input."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the libraries print goes to stderr, never into the replies
    sys.stdout = sys.stderr

    def reply(message: dict) -> None:
        replies.write(json.dumps(message, default=str) + "\n")

    try:
        if args.worker in OURS:
            bench = OursBench(args.url, args.key)
        elif args.worker == "langgraph":
            bench = LangGraphBench(Path(args.dir))
        else:
            bench = DbosBench(Path(args.dir), wal=args.worker == "dbos_wal")
        reply({"ready": bench.info()})
    except Exception:
        reply({"error": traceback.format_exc()})
        return 1
    for line in sys.stdin:
        message = json.loads(line)
        op = message.pop("op")
        if op == "quit":
            break
        try:
            reply({"result": bench.call(op, message)})
        except Exception:
            reply({"error": traceback.format_exc()})
    bench.close()
    return 0


def serve_bare() -> int:
    """A bare Starlette JSON endpoint under uvicorn, the same loop and HTTP parser our server uses."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def hello(request):
        return JSONResponse({"status": "ok"})

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    print(f"Bare: http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(Starlette(routes=[Route("/json", hello)]), http="httptools", loop="auto",
                            log_level="warning", access_log=False, lifespan="off")
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.Server(config).run(sockets=[sock])
    return 0


# =============================================================================
# Bench process side: child processes, /proc, SQLite
# =============================================================================

STARTED = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)


def child_env() -> dict:
    # Without ACTAE_DATABASE_URL the SQLite server stays on SQLite; PostgreSQL ones get --database.
    # ACTAE_BENCH_WITHOUT reaches only the servers --feature-costs hands it to (Server's `env`).
    env = {k: v for k, v in os.environ.items()
           if k not in ("ACTAE_API_KEY", "ACTAE_DATA_DIR", "ACTAE_DATABASE_URL", BENCH_WITHOUT_VAR)}
    return {**env, "PYTHONUNBUFFERED": "1"}


class Server:
    """A server child process; its output is drained on a thread, `found` holds the named lines."""

    def __init__(self, name: str, argv: list[str], patterns: dict[str, re.Pattern], cwd: Path = ROOT,
                 env: Optional[dict] = None):
        self.name, self.patterns = name, patterns
        self.lines: deque = deque(maxlen=200)
        self.found: dict[str, str] = {}
        self.ready = threading.Event()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**child_env(), **(env or {})}, cwd=str(cwd))
        threading.Thread(target=self._drain, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _drain(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            for name, pattern in self.patterns.items():
                if name not in self.found and (m := pattern.match(line)):
                    self.found[name] = m.group(1).rstrip("/")
            if len(self.found) == len(self.patterns):
                self.ready.set()
        self.ready.set()

    def wait(self, timeout: float = 60.0) -> "Server":
        if not self.ready.wait(timeout) or len(self.found) != len(self.patterns):
            raise RuntimeError(f"{self.name} did not start:\n" + "\n".join(self.lines))
        url = self.found["url"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + self.probe_path, timeout=2) as response:
                    if response.status == 200:
                        return self
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} never answered:\n" + "\n".join(self.lines))

    probe_path = "/healthz"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Collector:
    """A loopback OTLP/HTTP collector for B1b with export: "ok" takes every request (and keeps
    nothing), "slow503" answers 503 after EXPORT_SLOW_SECONDS; "down" is a port nobody listens on."""

    def __init__(self, mode: str):
        self.mode = mode
        if mode == "down":
            with socket.socket() as probe:     # a free port, closed again: connections are refused
                probe.bind(("127.0.0.1", 0))
                self.url = f"http://127.0.0.1:{probe.getsockname()[1]}"
            self.server = None
            return
        slow = mode == "slow503"

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length") or 0))
                if slow:
                    time.sleep(EXPORT_SLOW_SECONDS)
                self.send_response(503 if slow else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def span_counts(url: str, key: str) -> dict:
    """actae_spans_exported_total and actae_spans_dropped_total from a server's /metrics."""
    request = urllib.request.Request(url + "/metrics", headers={"x-api-key": key})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    found = dict(re.findall(r"^actae_spans_(exported|dropped)_total (\S+)$", text, re.M))
    return {"exported": float(found.get("exported", 0)), "dropped": float(found.get("dropped", 0))}


def settled_spans(url: str, key: str, steps: int, timeout: float = 20.0) -> dict:
    """`span_counts` once every step's span has been exported or dropped (a refused batch is dropped
    when the exporter's retries run out, a few seconds on), or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        counts = span_counts(url, key)
        if counts["exported"] + counts["dropped"] >= steps or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


class Worker:
    """A measured system in its own process: one JSON line per operation in, one reply out."""

    def __init__(self, name: str, argv: list[str]):
        self.name = name
        self.replies: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", name, *argv],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=child_env(), cwd=str(ROOT))
        threading.Thread(target=self._read, daemon=True).start()
        self.info: dict = {}

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.replies.put(line)
        self.replies.put(None)

    def _next(self, timeout: float) -> dict:
        try:
            line = self.replies.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{self.name} worker: no reply in {timeout:.0f} s") from None
        if line is None:
            raise RuntimeError(f"{self.name} worker exited with {self.proc.wait()}")
        message = json.loads(line)
        if "error" in message:
            raise RuntimeError(f"{self.name} worker failed:\n{message['error']}")
        return message

    def wait_ready(self, timeout: float = 120.0) -> "Worker":
        self.info = self._next(timeout)["ready"]
        return self

    def send(self, op: str, **args) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = OP_TIMEOUT) -> dict:
        return self._next(timeout)["result"]

    def call(self, op: str, **args) -> dict:
        self.send(op, **args)
        return self.recv()

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.send("quit")
                self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads, from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int]:
    """(busy, all) clock ticks of every CPU of the machine since boot, from /proc/stat; busy is all
    but idle and iowait (guest time is already inside user)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def cores_busy(before: tuple[int, int], after: tuple[int, int]) -> float:
    """How many of the machine's cores were busy between two `machine_ticks`, every process counted."""
    busy, every = after[0] - before[0], after[1] - before[1]
    return busy / every * (os.cpu_count() or 1) if every else 0.0


def write_batches(url: str, key: str) -> tuple[int, int]:
    """(write batches committed, write jobs in them) since the server started, from /metrics.json."""
    request = urllib.request.Request(url + "/metrics.json", headers={"x-api-key": key})
    with urllib.request.urlopen(request, timeout=10) as response:
        database = json.loads(response.read())["database"]
    return database["write_batches"], database["write_jobs"]


def batches_between(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> dict:
    """Write batches (one transaction, one commit each) and write jobs, summed over servers."""
    jobs = [a[1] - b[1] for a, b in zip(after, before)]
    return {"write_batches": sum(a[0] - b[0] for a, b in zip(after, before)), "write_jobs": sum(jobs),
            "write_jobs_each": jobs}


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def reset_peak_rss(pid: int) -> bool:
    """Set the process's VmHWM back to its current RSS; False where the kernel refuses."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def used_bytes(path: Path) -> dict:
    """Bytes a SQLite database holds: in-use pages plus the WAL file, after a TRUNCATE checkpoint."""
    with contextlib.closing(sqlite3.connect(path, timeout=30)) as conn:
        busy = 1
        for _ in range(50):  # the owner may be finishing a read; it is idle otherwise
            busy = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
            if not busy:
                break
            time.sleep(0.1)
        pages = conn.execute("PRAGMA page_count").fetchone()[0] - conn.execute("PRAGMA freelist_count").fetchone()[0]
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    wal = Path(f"{path}-wal")
    wal_bytes = wal.stat().st_size if wal.exists() else 0
    return {"bytes": pages * page_size + wal_bytes, "wal_bytes": wal_bytes, "checkpointed": not busy}


WAL_STEPS = 20      # B1a steps whose WAL frames are counted: 2 commits a step stay far below 1,000 frames


def wal_frame_count(path: Path) -> int:
    """Frames in a database's WAL file: past its 32-byte header, a 24-byte header and a page each."""
    with contextlib.closing(sqlite3.connect(path, timeout=30)) as conn:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    wal = Path(f"{path}-wal")
    return max(0, (wal.stat().st_size if wal.exists() else 0) - 32) // (page_size + 24)


def count_events(path: Path) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as conn:
        return conn.execute("SELECT COUNT(*) FROM events").fetchone()[0]


def store_bytes(path: Path) -> dict:
    """`used_bytes` of a database file, or summed over every file of a data directory (a file that
    is not a SQLite database counts by its size; -shm files are an index in shared memory)."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    total, checkpointed = 0, True
    for file in files:
        if file.name.endswith(("-wal", "-shm", "-journal")):
            continue
        with file.open("rb") as handle:
            is_sqlite = handle.read(16) == b"SQLite format 3\x00"
        if is_sqlite:
            used = used_bytes(file)
            total, checkpointed = total + used["bytes"], checkpointed and used["checkpointed"]
        else:
            total += file.stat().st_size
    return {"bytes": total, "checkpointed": checkpointed}


def raw_commits(path: Path, count: int, texts: list[str]) -> dict:
    """`count` transactions of one 2 KB row each on a WAL, synchronous=FULL database."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("CREATE TABLE IF NOT EXISTS raw (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")
        latencies = []
        for i in range(count):
            started = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO raw (body) VALUES (?)", (texts[i % len(texts)],))
            conn.execute("COMMIT")
            latencies.append(time.perf_counter() - started)
    return {"commits_per_s": count / sum(latencies), "latency_ms": statistics.median(latencies) * 1000}


def stop_servers(servers: list) -> None:
    """Stop several servers at once: one SIGINT each (a second one would force uvicorn out), then
    wait for all, killing any that will not go."""
    for server in servers:
        if server.proc.poll() is None:
            with contextlib.suppress(OSError):
                server.proc.send_signal(signal.SIGINT)
    for server in servers:
        try:
            server.proc.wait(15)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


def is_postgres_process(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().startswith("postgres")
    except OSError:
        return False


def postgres_url(args: argparse.Namespace) -> tuple[Optional[str], Optional[str]]:
    """(maintenance-database URL, where it came from): --postgres, else the first variable of
    PG_SOURCES that is set; (None, None) without any."""
    if args.postgres:
        return args.postgres, "--postgres"
    for name in PG_SOURCES:
        if os.environ.get(name):
            return os.environ[name], name
    return None, None


def redacted(url: str) -> str:
    """The URL without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)))


class Postgres:
    """The PostgreSQL the bench was handed: its durability settings (fsync turned on for the bench's
    duration where it can be), fresh databases, and the CPU of the backends serving one of them."""

    def __init__(self, url: str, source: str):
        import psycopg
        from psycopg import sql

        self.psycopg, self.sql = psycopg, sql
        self.url, self.source = url, source
        self.made: list[str] = []
        self.restore = None                  # the statement that puts fsync back, while it is to be done
        self.fsync_set = False               # whether the bench turned fsync on
        self.conn = None
        self.fsync_at_end = None

    def open(self) -> None:
        """Connect, read the settings, turn fsync on where that is possible; `close` undoes it all,
        also after a failure here."""
        self.conn = self._connect()
        self.version = self._show("server_version")
        self.superuser = bool(self.conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
                              .fetchone()[0])
        self.cluster_fsync = self._show("fsync")
        self.fsync_context = self.conn.execute("SELECT context FROM pg_settings WHERE name = 'fsync'").fetchone()[0]
        self.fsync_note = None
        if self.cluster_fsync == "off":
            if not self.superuser:
                self.fsync_note = "fsync left off: the URL's user is not a superuser, so the bench cannot set it"
            elif self.fsync_context != "sighup":
                self.fsync_note = f"fsync left off: changing it here needs a restart (context {self.fsync_context})"
            else:
                self._fsync_on()
        self.fsync = self._fresh_show("fsync")
        self.synchronous_commit = self._show("synchronous_commit")
        # The backends' CPU is read from /proc: only if the server's pids are this machine's.
        self.local = is_postgres_process(self.conn.info.backend_pid)
        say(f"PostgreSQL {self.version} at {redacted(self.url)} (from {self.source}): fsync={self.fsync}"
            + (" (turned on by the bench, off in the cluster's configuration)" if self.fsync_set else "")
            + f", synchronous_commit={self.synchronous_commit}"
            + ("" if self.local else "; not on this machine: its CPU is not measured"))

    def _connect(self, database: Optional[str] = None):
        return self.psycopg.connect(self.url_of(database) if database else self.url, autocommit=True,
                                    connect_timeout=10)

    def _show(self, name: str) -> str:
        return self.conn.execute(f"SHOW {name}").fetchone()[0]      # names are this file's constants

    def _fresh_show(self, name: str) -> str:
        """SHOW on a new connection: what a backend started now (a server's) gets."""
        with contextlib.closing(self._connect()) as conn:
            return conn.execute(f"SHOW {name}").fetchone()[0]

    def _reload_until(self, fsync: str) -> None:
        self.conn.execute("SELECT pg_reload_conf()")
        deadline = time.monotonic() + 10
        while self._fresh_show("fsync") != fsync:     # the postmaster re-reads its files a moment later
            if time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL did not take fsync = {fsync} after pg_reload_conf()")
            time.sleep(0.05)

    def _fsync_on(self) -> None:
        """ALTER SYSTEM SET fsync = on and reload (fsync is a sighup setting); remember how to undo it:
        the value postgresql.auto.conf had for fsync, else RESET (back to postgresql.conf's)."""
        had = self.conn.execute("SELECT setting FROM pg_file_settings WHERE name = 'fsync'"
                                " AND sourcefile LIKE '%postgresql.auto.conf' ORDER BY seqno DESC LIMIT 1").fetchone()
        undo = "ALTER SYSTEM SET fsync = '" + had[0].replace("'", "''") + "'" if had else "ALTER SYSTEM RESET fsync"
        try:
            self.conn.execute("ALTER SYSTEM SET fsync = on")
        except self.psycopg.Error as exc:
            self.fsync_note = f"fsync left off: ALTER SYSTEM failed ({str(exc).strip().splitlines()[0]})"
            return
        self.restore, self.fsync_set = undo, True
        self._reload_until("on")

    def check_fsync(self) -> None:
        """Read fsync again at the end of the measurements: another client may have changed it."""
        self.fsync_at_end = self._fresh_show("fsync")

    def settings(self) -> dict:
        return {"url": redacted(self.url), "source": self.source, "version": self.version,
                "superuser": self.superuser, "fsync": self.fsync, "cluster_fsync": self.cluster_fsync,
                "fsync_at_end": self.fsync_at_end,
                "fsync_set_on_by_bench": self.fsync_set, "fsync_note": self.fsync_note,
                "synchronous_commit": self.synchronous_commit, "cpu_measured": self.local,
                "cpu_note": None if self.local else "PostgreSQL is not on this machine: its backends' pids are not in /proc"}

    def url_of(self, database: str) -> str:
        return urlunsplit(urlsplit(self.url)._replace(path="/" + database))

    def create(self, name: str) -> str:
        self.conn.execute(self.sql.SQL("CREATE DATABASE {} ENCODING 'UTF8' TEMPLATE template0")
                          .format(self.sql.Identifier(name)))
        self.made.append(name)
        return name

    def drop(self, name: str) -> None:
        self.conn.execute(self.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(self.sql.Identifier(name)))
        self.made.remove(name)

    def backends(self, database: str) -> list[int]:
        """The pids of the client backends connected to `database` (the servers' pools and listeners)."""
        rows = self.conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s"
                                 " AND backend_type = 'client backend'", (database,)).fetchall()
        return [pid for (pid,) in rows]

    def cpu(self, pids: list[int]) -> Optional[dict]:
        """{pid: CPU seconds} of the backends still there, or None where they cannot be read."""
        if not self.local:
            return None
        seconds = {}
        for pid in pids:
            with contextlib.suppress(OSError):
                seconds[pid] = cpu_seconds(pid)
        return seconds

    def close(self) -> None:
        """Drop what is left of our databases and put fsync back; report, never raise."""
        if not self.made and self.restore is None:
            if self.conn is not None:
                with contextlib.suppress(Exception):
                    self.conn.close()
            return
        try:
            if self.conn is None or self.conn.closed:
                self.conn = self._connect()
            for name in list(self.made):
                self.drop(name)
            if self.restore is not None:
                self.conn.execute(self.restore)
                self._reload_until(self.cluster_fsync)
                self.restore = None
                say(f"PostgreSQL: fsync is {self.cluster_fsync} again")
        except Exception as exc:  # noqa: BLE001 - the bench's figures are already taken
            say(f"PostgreSQL cleanup failed: {exc!r}; left: databases {self.made}"
                + (f"; fsync = on in postgresql.auto.conf (undo: {self.restore}; SELECT pg_reload_conf())"
                   if self.restore is not None else ""))
        finally:
            with contextlib.suppress(Exception):
                self.conn.close()


# =============================================================================
# The baseline: our server as of another commit, from a git worktree
# =============================================================================


def git(*argv: str, cwd: Path = ROOT) -> Optional[str]:
    """A git command's stripped stdout, or None when it fails (or git is missing): every question
    put to git here has an answer that may legitimately not exist (no tag, no HEAD~1, no checkout)."""
    try:
        proc = subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


@dataclass
class Baseline:
    """The commit measured as the second "ours" row, and where its worktree is once made."""

    ref: str                               # what was asked (or chosen), e.g. a tag or a commit id
    commit: str                            # the full commit id it resolved to
    short: str                             # the row's label
    source: str                            # why this REF: asked, the newest tag, the write path's last change
    worktree: Optional[Path] = None
    prefix: str = ""                       # where this project sits inside the repository

    @property
    def root(self) -> Path:
        return self.worktree / self.prefix

    def describe(self) -> str:
        return f"{self.short} ({self.source})"


def default_baseline_ref() -> tuple[Optional[str], str]:
    """(REF, why it): the newest tag if the repository has one, else the newest commit before HEAD
    that touched actae.py, the write path: a run then measures what the working tree changed."""
    tag = git("describe", "--tags", "--abbrev=0")
    if tag:
        return tag, f"the newest tag, {tag}"
    commit = git("log", "-1", "--format=%H", "HEAD~1", "--", "actae.py")
    if commit:
        return commit, "the newest commit before HEAD that changed actae.py"
    return None, "no tag, and no commit before HEAD changed actae.py (a shallow clone?)"


def resolve_baseline(asked: str) -> tuple[Optional[Baseline], str]:
    """(the baseline, "") or (None, why there is none) for --baseline `asked`."""
    if asked == BASELINE_OFF:
        return None, "turned off (--baseline none)"
    if git("rev-parse", "--is-inside-work-tree") != "true":
        return None, f"{ROOT} is not a git checkout"
    ref, source = default_baseline_ref() if asked == BASELINE_AUTO else (asked, f"--baseline {asked}")
    if ref is None:
        return None, source
    commit = git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    if not commit:
        return None, f"{ref!r} does not name a commit of this repository"
    short = git("rev-parse", "--short", commit) or commit[:7]
    return Baseline(ref, commit, short, source, prefix=git("rev-parse", "--show-prefix") or ""), ""


def add_worktree(baseline: Baseline, folder: Path) -> Optional[str]:
    """Check the baseline out, detached, into the bench's folder; None, or why it could not."""
    path = folder / f"baseline-{baseline.short}"
    proc = subprocess.run(["git", "worktree", "add", "--detach", str(path), baseline.commit], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    if not (path / baseline.prefix / "actae.py").is_file():
        remove_worktree(path)
        return f"{baseline.short} has no {baseline.prefix}actae.py"
    baseline.worktree = path
    return None


def remove_worktree(path: Path) -> None:
    """Remove the worktree and what git keeps of it, even when its folder went first (--keep or not,
    the repository must not keep pointing into a temporary folder)."""
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, capture_output=True)
    subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)


def rotated(names: list, number: int) -> list:
    """`names` rotated by `number`, so drift hits every system alike; ours and the baseline then
    trade places every other round, so that neither always runs right after the same system."""
    order = list(names[number % len(names):] + names[:number % len(names)])
    if number % 2 and "ours" in order and "baseline" in order:
        i, j = order.index("ours"), order.index("baseline")
        order[i], order[j] = order[j], order[i]
    return order


# =============================================================================
# Phases
# =============================================================================


class Bench:
    """Everything one invocation starts, and the raw results of its phases."""

    def __init__(self, plan: Plan, folder: Path, postgres: Optional[Postgres] = None,
                 baseline: Optional[Baseline] = None):
        self.plan, self.folder, self.postgres, self.baseline = plan, folder, postgres, baseline
        self.systems = [*SYSTEMS, *(["baseline"] if baseline else [])]   # every round's rotation
        self.ours = [name for name in OURS if name in self.systems]       # served by our server's code
        self.rounds: list[dict] = []
        self.once: dict = {}

    def start(self) -> None:
        data_dirs = {"ours": self.folder / "actae", "baseline": self.folder / "baseline"}
        scripts = {"ours": (ROOT / "actae.py", ROOT)}
        if self.baseline:
            scripts["baseline"] = (self.baseline.root / "actae.py", self.baseline.root)
        # The baseline gets exactly the flags ours gets, run by the same Python from its worktree.
        self.servers = {name: Server(f"actae ({name})", [sys.executable, str(script), "--port", "0",
                                                         "--data-dir", str(data_dirs[name])],
                                     {"url": URL_LINE, "key": KEY_LINE}, cwd=cwd)
                        for name, (script, cwd) in scripts.items()}
        self.server = self.servers["ours"]
        self.bare = Server("bare endpoint", [sys.executable, str(Path(__file__).resolve()), "--bare-server"],
                           {"url": BARE_LINE})
        self.bare.probe_path = "/json"
        peers = {name: Worker(name, ["--dir", str(self.folder)]) for name in SYSTEMS[1:]}
        self.bare.wait()
        self.urls, self.keys, ours = {}, {}, {}
        for name, server in self.servers.items():
            self.urls[name], self.keys[name] = self._started(name, server)
            ours[name] = Worker(name, ["--url", self.urls[name], "--key", self.keys[name]])
        self.url, self.key = self.urls["ours"], self.keys["ours"]
        self.workers = {**ours, **peers}
        for worker in self.workers.values():
            worker.wait_ready()
        self.paths = {**{name: data_dirs[name] for name in ours}, **{name: Path(w.info["path"]) for name, w in peers.items()}}
        self.collectors = {mode: Collector(mode) for mode in EXPORT_COLUMNS.values() if mode}
        say(f"started: server {self.url} (pid {self.server.pid}), "
            + (f"baseline {self.baseline.short} {self.urls['baseline']} (pid {self.servers['baseline'].pid}), "
               if self.baseline else "")
            + f"bare endpoint {self.bare.found['url']}, workers {', '.join(self.workers)}")

    def _started(self, name: str, server: Server) -> tuple[str, str]:
        """A started server's (URL, new key); a baseline that will not start says how to go without."""
        try:
            server.wait()
        except RuntimeError as exc:
            if name == "baseline":
                raise RuntimeError(f"the baseline {self.baseline.describe()} did not start with the flags"
                                   f" ours gets (measure without it: --baseline none):\n{exc}") from None
            raise
        url, key = server.found["url"], server.found["key"]
        if not key.startswith("sk-"):
            raise RuntimeError(f"the server ({name}) printed no new key: {key!r}")
        return url, key

    def stop(self) -> None:
        for collector in getattr(self, "collectors", {}).values():
            collector.stop()
        for child in [*getattr(self, "workers", {}).values(), *getattr(self, "servers", {}).values(),
                      getattr(self, "bare", None)]:
            if child is not None:
                with contextlib.suppress(Exception):
                    child.stop()

    def _ours(self, op: str, who: str = "ours", **args) -> tuple[dict, float]:
        """Run an op of ours (or of the baseline); return its result and the server CPU seconds it cost."""
        pid = self.servers[who].pid
        before = cpu_seconds(pid)
        result = self.workers[who].call(op, **args)
        return result, cpu_seconds(pid) - before

    def run_round(self, number: int) -> None:
        plan, tag = self.plan, f"r{number}"
        order = rotated(self.systems, number)
        got: dict = {"order": list(order)}

        texts = [compact(d) for d in make_docs(f"{tag}-raw", 50)]
        got["raw"] = raw_commits(self.folder / "raw.db", plan.commits, texts)
        loads = [("bare", self.bare.found["url"] + "/json", False, None, self.bare.pid),
                 *((name, self.urls[name] + "/api/v1/auth/capabilities", True, self.keys[name], self.servers[name].pid)
                   for name in self.ours)]
        got["get"] = {}
        for name, url, with_key, key, pid in rotated(loads, number):
            before = cpu_seconds(pid)
            result = self.workers["ours"].call("load", url=url, concurrency=plan.runs,
                                               requests=plan.get_requests, with_key=with_key, key=key)
            got["get"][name] = {**result, "server_cpu": cpu_seconds(pid) - before}
        say(f"round {number}: raw SQLite {got['raw']['commits_per_s']:.0f} commits/s, GET "
            + ", ".join(f"{n} {r['requests'] / r['seconds']:.0f}/s" for n, r in got["get"].items()))

        got["b1a"], got["b1b"] = {}, {}
        for name in order:
            if name in OURS:
                result, server_cpu = self._ours("b1a", name, n=plan.steps, tag=f"{tag}-b1a")
                result["server_cpu"] = server_cpu
            else:
                result = self.workers[name].call("b1a", n=plan.steps, tag=f"{tag}-b1a")
            got["b1a"][name] = result
        say(f"round {number}: B1a " + ", ".join(f"{n} {r['steps'] / r['seconds']:.0f}" for n, r in got["b1a"].items())
            + " steps/s")

        b1b_order = rotated([*self.systems, *(PG_SERVERS if self.postgres else ())], number)
        got["b1b_order"], got["b1b_pg"] = b1b_order, {}
        for name in b1b_order:
            if name in PG_SERVERS:
                got["b1b_pg"][name] = self.run_postgres(name, tag)
                continue
            if name in OURS:
                result = self.run_b1b_ours(name, tag)
                got["rss_reset"] = got.get("rss_reset", True) and result.pop("rss_reset")
            else:
                result = self.workers[name].call("b1b", runs=plan.runs, n=plan.run_steps, tag=f"{tag}-b1b")
            got["b1b"][name] = result
        say(f"round {number}: B1b " + ", ".join(f"{n} {r['steps'] / r['seconds']:.0f}"
                                                for n, r in {**got["b1b"], **got["b1b_pg"]}.items())
            + " steps/s")

        got["b1b_export"] = {column: self.run_export(column, tag) for column in rotated(list(EXPORT_COLUMNS), number)}
        say(f"round {number}: B1b with export " + ", ".join(f"{c} {r['steps'] / r['seconds']:.0f}"
                                                          for c, r in got["b1b_export"].items()) + " steps/s")

        got["b3"] = {name: {} for name in self.ours}
        for turn, (inflight, pairs) in enumerate(plan.b3_pairs.items()):
            for name in rotated(self.ours, number + turn):
                result, server_cpu = self._ours("b3", name, inflight=inflight, pairs=pairs, tag=f"{tag}-b3")
                got["b3"][name][str(inflight)] = {**result, "server_cpu": server_cpu}
        say(f"round {number}: B3 " + "; ".join(
            f"{name} " + ", ".join(f"{k} in flight {r['steps'] / r['seconds']:.0f}" for k, r in b3.items())
            for name, b3 in got["b3"].items()) + " pairs/s")
        self.rounds.append(got)

    def run_b1b_ours(self, name: str, tag: str) -> dict:
        """Our B1b on the server of `name` (ours or the baseline), with its CPU and peak RSS around it;
        the group-commit counters and machine load (for the PostgreSQL table) only for ours."""
        plan, server = self.plan, self.servers[name]
        reset = reset_peak_rss(server.pid)
        if name == "ours":
            batches, ticks = [write_batches(self.url, self.key)], machine_ticks()
        result, server_cpu = self._ours("b1b", name, runs=plan.runs, n=plan.run_steps, tag=f"{tag}-b1b")
        result.update(server_cpu=server_cpu, peak_rss_mb=peak_rss_mb(server.pid), rss_reset=reset)
        if name == "ours":
            result.update(machine_cores_busy=cores_busy(ticks, machine_ticks()),
                          **batches_between(batches, [write_batches(self.url, self.key)]))
        return result

    def run_export(self, column: str, tag: str) -> dict:
        """B1b on a fresh SQLite server exporting to EXPORT_COLUMNS[column]'s collector (or not
        exporting): start it, connect, an untimed warm-up, the timed B1b, its span counters, stop."""
        plan, mode = self.plan, EXPORT_COLUMNS[column]
        argv = [sys.executable, str(ROOT / "actae.py"), "--port", "0",
                "--data-dir", str(self.folder / f"export-{tag}-{column}")]
        if mode:
            argv += ["--otlp-endpoint", self.collectors[mode].url]
        server = Server(f"actae exporting ({column})", argv, {"url": URL_LINE, "key": KEY_LINE}).wait()
        ours, target = self.workers["ours"], f"export-{column}"
        try:
            url, key = server.found["url"], server.found["key"]
            ours.call("connect", target=target, urls=[url], key=key)
            try:
                ours.call("b1b", runs=plan.runs, n=WARM_STEPS, tag=f"{tag}-{column}-warm", target=target)
                before = cpu_seconds(server.pid)
                result = ours.call("b1b", runs=plan.runs, n=plan.run_steps, tag=f"{tag}-b1b-x", target=target)
                result["server_cpu"] = cpu_seconds(server.pid) - before
                result.update(spans=settled_spans(url, key, result["steps"]) if mode else span_counts(url, key))
            finally:
                ours.call("disconnect", target=target)
        finally:
            server.stop()
        return result

    def run_postgres(self, column: str, tag: str) -> dict:
        """B1b on PG_SERVERS[column] servers sharing a fresh database: start them (the first alone,
        as it issues the key; the others together), connect a client to each, run an untimed
        warm-up, time B1b with the runs spread round-robin over the servers, then stop the servers
        and drop the database."""
        plan, pg, count = self.plan, self.postgres, PG_SERVERS[column]
        database = pg.create(f"bench_{os.getpid()}_{tag}_{column}")
        data_dir = self.folder / f"pg-{tag}-{column}"        # one data dir for all, like the scale-out tests
        argv = [sys.executable, str(ROOT / "actae.py"), "--port", "0", "--data-dir", str(data_dir),
                "--database", pg.url_of(database)]
        patterns = {"url": URL_LINE, "key": KEY_LINE}
        servers: list[Server] = []
        ours = self.workers["ours"]
        try:
            servers.append(Server(f"actae on PostgreSQL ({column}, server 1)", argv, patterns).wait())
            key = servers[0].found["key"]
            if not key.startswith("sk-"):
                raise RuntimeError(f"the first server on {database} printed no new key: {key!r}")
            others = [Server(f"actae on PostgreSQL ({column}, server {i + 1})", argv, patterns) for i in range(1, count)]
            servers += others
            for server in others:
                server.wait()
                if server.found["key"].startswith("sk-"):
                    raise RuntimeError(f"a later server on {database} issued a key as well")
            ours.call("connect", target=column, urls=[s.found["url"] for s in servers], key=key)
            try:
                ours.call("b1b", runs=plan.runs, n=WARM_STEPS, tag=f"{tag}-{column}-warm", target=column)
                pids, urls = pg.backends(database), [s.found["url"] for s in servers]
                batches = [write_batches(url, key) for url in urls]
                server_before, pg_before = [cpu_seconds(s.pid) for s in servers], pg.cpu(pids)
                ticks = machine_ticks()
                result = ours.call("b1b", runs=plan.runs, n=plan.run_steps, tag=f"{tag}-b1b", target=column)
                busy = cores_busy(ticks, machine_ticks())
                server_cpu = [cpu_seconds(s.pid) - b for s, b in zip(servers, server_before)]
                pg_after = pg.cpu(pids)
                result.update(machine_cores_busy=busy,
                              **batches_between(batches, [write_batches(url, key) for url in urls]))
            finally:
                ours.call("disconnect", target=column)
        finally:
            stop_servers(servers)
            pg.drop(database)
        if pg_after is None:
            postgres_cpu = None
        else:   # a backend that went away mid-run (none should: the pools are fixed) is left out
            postgres_cpu = sum(pg_after[p] - pg_before[p] for p in pg_after if p in pg_before)
        return {**result, "servers": count, "server_cpu": sum(server_cpu), "server_cpu_each": server_cpu,
                "postgres_cpu": postgres_cpu, "backends": len(pids),
                "backends_read": None if pg_after is None else len(set(pg_after) & set(pg_before or {}))}

    def run_forks(self) -> None:
        """B2: build every parent at once (untimed), then time the forks: ours and LangGraph's
        interleaved, then DBOS's."""
        plan, sizes = self.plan, list(self.plan.sizes)
        forkers = (*self.ours, "langgraph", "dbos")
        for name in forkers:
            self.workers[name].send("build", sizes=sizes, tag="b2")
        for name in forkers:
            self.workers[name].recv()
        say(f"B2: built parents of {', '.join(map(str, sizes))} steps")
        sessions = [f"{name}_session" for name in self.ours]
        samples: dict = {(name, size): [] for name in (*forkers, *sessions) for size in sizes}
        sdk_cpu: dict = {(name, size): [] for name in self.ours for size in sizes}   # SDK CPU ms of each fork
        statuses = set()
        # Ours (and the baseline's) and LangGraph's forks take turns, each first as often as the
        # others; DBOS's come after them on their own: each copies the steps before k in one large
        # transaction on the same disk, which slowed whichever fork came next, the more the larger N
        # (see the docstring's B2).
        for group in ([*self.ours, "langgraph"], ["dbos"]):
            for rep in range(-1, plan.forks):  # rep -1 warms every path up and is not kept
                for turn, size in enumerate(sizes):
                    for name in rotated(group, rep + turn):
                        result = self.workers[name].call("fork", size=size, child=f"b2-n{size}-f{rep + 1}")
                        statuses.add(result.get("status", "-"))
                        if rep >= 0:
                            samples[name, size].append(result["ms"])
                            if name in OURS:
                                sdk_cpu[name, size].append(result["cpu_ms"])
                    for name in (rotated(self.ours, rep + turn) if "ours" in group else []):
                        result = self.workers[name].call("session_fork", size=size, child=f"b2-n{size}-s{rep + 1}")
                        if rep >= 0:
                            samples[f"{name}_session", size].append(result["ms"])
        self.once["b2"] = {f"{name}:{size}": ms for (name, size), ms in samples.items()}
        self.once["b2_sdk_cpu_ms"] = {name: {str(size): sdk_cpu[name, size] for size in sizes} for name in self.ours}
        self.once["dbos_fork_statuses"] = sorted(statuses - {"-"})
        say("B2: " + ", ".join(f"N={size} " + "/".join(f"{statistics.median(samples[n, size]):.1f}"
                                                        for n in forkers) for size in sizes)
            + f" ms ({'/'.join(forkers)})")

    def run_probes(self) -> None:
        self.once["probe"] = {"ours": self.workers["ours"].call("probe", tag="probe"),
                              "dbos": self.workers["dbos"].call("probe", tag="probe")}
        say(f"probe: ours {self.once['probe']['ours']['mismatch']}; "
            f"DBOS {self.once['probe']['dbos']['behaviour']}")

    def run_disk(self) -> None:
        disk = {}
        for name in self.systems:
            before = store_bytes(self.paths[name])
            result = self.workers[name].call("b1a", n=self.plan.disk_steps, tag="disk")
            after = store_bytes(self.paths[name])
            disk[name] = {"bytes": after["bytes"] - before["bytes"], "steps": result["steps"],
                          "bytes_in": result["bytes_in"],
                          "checkpointed": before["checkpointed"] and after["checkpointed"]}
        self.once["disk"] = disk
        say("disk per step / bytes in: " + ", ".join(f"{n} {d['bytes'] / d['bytes_in']:.2f}" for n, d in disk.items()))
        self.once["wal"] = {name: self.wal_frames(name) for name in self.ours}
        say("WAL frames per committed event: " + ", ".join(
            f"{n} {w['frames'] / w['events']:.1f}" for n, w in self.once["wal"].items() if w and w["events"]))

    def wal_frames(self, name: str) -> Optional[dict]:
        """The WAL frames a short B1a writes on our server `name` (see "WAL frames" above), and the
        events it committed; None when the checkpoint before it could not empty the WAL."""
        database = self.paths[name] / "actae.db"
        if not used_bytes(database)["checkpointed"]:
            return None
        before = count_events(database)
        self.workers[name].call("b1a", n=WAL_STEPS, tag="wal")
        return {"frames": wal_frame_count(database), "events": count_events(database) - before}

    def run_b4(self) -> None:
        """B4, a growing state: each system runs its first `b4_early` steps in turn and holds; the
        early reads, interleaved; each runs on to the end in turn (disk measured around its whole
        run); our final state saved whole in a fresh channel; the final reads and the forks at
        N/2, interleaved. The first round of reads and forks warms up and is not kept."""
        plan, growers = self.plan, (*B4_SYSTEMS, *self.ours[1:])
        n, early = plan.b4_steps, plan.b4_early
        messages = make_messages("b4", n)
        added = (state_bytes(grown_state(messages, n)) - state_bytes(grown_state(messages, 0))) / n
        got: dict = {name: {} for name in growers}
        before = {}
        for name in growers:
            before[name] = store_bytes(self.paths[name])
            if name in OURS:
                result, server_cpu = self._ours("b4_start", name, n=n, early=early, tag="b4")
                result["server_cpu"] = server_cpu
            else:
                result = self.workers[name].call("b4_start", n=n, early=early, tag="b4")
            got[name]["start"] = result
        got["read_early"] = self._interleaved(growers, "b4_read", lambda name, rep: {"which": "run"})
        for name in growers:
            if name in OURS:
                result, server_cpu = self._ours("b4_finish", name)
                result["server_cpu"] = server_cpu
            else:
                result = self.workers[name].call("b4_finish")
            after = store_bytes(self.paths[name])
            got[name].update(finish=result, disk_bytes=after["bytes"] - before[name]["bytes"],
                             checkpointed=before[name]["checkpointed"] and after["checkpointed"])
        wholes = tuple(f"{name}_whole" for name in self.ours)
        for name in self.ours:
            self.workers[name].call("b4_whole")
        got["read_final"] = self._interleaved((*growers, *wholes), "b4_read",
                                              lambda name, rep: {"which": "whole" if name in wholes else "run"})
        fork = lambda name, rep: {"child": f"b4-fork-{rep + 1}"}      # noqa: E731
        got["fork"] = self._interleaved((*self.ours, "langgraph"), "b4_fork", fork)   # DBOS's after, as in B2
        got["fork"].pop("results")
        dbos = self._interleaved(("dbos",), "b4_fork", fork)
        statuses = {r.get("status") for r in dbos.pop("results")} - {None}
        got["fork"].update(dbos)
        got.update(steps=n, early=early, bytes_added_per_step=added, dbos_fork_statuses=sorted(statuses),
                   systems=list(growers))
        for phase in ("read_early", "read_final"):
            got[phase].pop("results")
        self.once["b4"] = got
        disk = {name: got[name]["disk_bytes"] / n / added for name in growers}
        say("B4: disk per step / bytes added " + ", ".join(f"{k} {v:.2f}" for k, v in disk.items())
            + "; read at step " + f"{n}: " + "/".join(f"{statistics.median(got['read_final'][k]):.2f}"
                                                      for k in (*growers, *wholes))
            + f" ms ({'/'.join((*growers, *wholes))}); fork at {n // 2}: "
            + "/".join(f"{statistics.median(got['fork'][k]):.2f}" for k in growers) + " ms")

    def _interleaved(self, names: tuple, op: str, args) -> dict:
        """`op` on each named worker ("ours_whole" is ours, "baseline_whole" the baseline), b4_samples + 1
        rounds in an order that rotates; {name: [ms of each kept round]} and under "results" every reply."""
        samples: dict = {name: [] for name in names}
        samples["results"] = []
        for rep in range(-1, self.plan.b4_samples):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                worker = self.workers[name.removesuffix("_whole")]
                result = worker.call(op, **args(name, rep))
                samples["results"].append(result)
                if rep >= 0:
                    samples[name].append(result["ms"])
        return samples


# =============================================================================
# B5: many runs (the runs list, its status filter, the inbox, a search)
# =============================================================================
# Its own server on its own data directory. The runs are loaded by this process straight into the
# server's SQLite file through the server's own write path (actae.append_event and put_metadata in
# batched transactions, beside the running server, as `actae import` would), not by 600,000 HTTP
# calls: every column the write path keeps is kept exactly as an SDK's requests would keep it.

B5_EVENTS = 6                                   # per run: session.started, 4 steps, how it ended
B5_BATCH = 1000                                 # runs per write transaction while loading
B5_SAMPLES = 25                                 # timed requests per page (in rounds); the median is the figure
B5_WARM = 5                                     # untimed requests per page first (caches, prepared statements)
B5_PAGES = {                                    # figure -> (label, what is asked)
    "first_page": ("the first runs page (HTML)", "/"),
    "failed": ("?status=failed (HTML)", "/?status=failed"),
    "inbox": ("the approvals inbox, pending (API)", "/api/v1/approvals?status=pending&limit=50"),
    "search": ("a substring search of run ids (HTML)", None),
}


def b5_kind(i: int) -> str:
    """How run i ends: 1 in 10 failed, 1 in 10 waits for an approval, the rest completed (so that 500
    runs fill a page of each: 50 runs, 50 requests)."""
    return "failed" if i % 10 == 3 else "waiting" if i % 10 == 7 else "completed"


def b5_load(data_dir: Path, start: int, stop: int) -> float:
    """Add runs start..stop-1 (six events each) through actae's write path; returns the seconds it took."""
    sys.path.insert(0, str(ROOT))
    import actae

    def batch(tx, lo: int, hi: int) -> None:
        for i in range(lo, hi):
            name, kind = f"b5-{i:07d}", b5_kind(i)
            actae.append_event(tx, name, "session.started", {"session_name": name, "params": {"i": i}},
                               actor="agent_session")
            for step in range(1, B5_EVENTS - 1):
                actae.append_event(tx, name, "work", {"step_number": step, "input": {"i": i}, "output": {"ok": True}},
                                   actor="agent_session", step_number=step)
            if kind == "failed":
                actae.append_event(tx, name, "run.failed", {"error": "model outage: 503"}, actor="agent")
            elif kind == "waiting":
                actae.append_event(tx, name, "approval.requested", {"request_id": f"req-{i}", "summary": "refund?"},
                                   actor="agent", operation_id=f"req-{i}")
            else:
                actae.append_event(tx, name, "session.completed", {"total_steps": B5_EVENTS - 2}, actor="agent_session")
            status = {"failed": "stepping", "waiting": "stepping"}.get(kind, "completed")
            actae.put_metadata(tx, name, actae.PutMetadata(display_name=name,
                                                           experiment_metadata={"status": status, "step_count": 4}))

    began = time.perf_counter()
    conn = actae.connect_sync(actae.Location(data_dir))
    try:
        for lo in range(start, stop, B5_BATCH):
            ((result, events),) = actae.run_jobs(conn, [actae.Job(batch, (lo, min(stop, lo + B5_BATCH)), None)])
            if events is None:
                raise result
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()    # timings then read the database file
    finally:
        conn.close()
    return time.perf_counter() - began


class Pages:
    """One keep-alive HTTP connection with a dashboard session (and the key for the API)."""

    def __init__(self, url: str, key: str):
        import http.client

        parts = urlsplit(url)
        self.host, self.key = parts.netloc, key
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        body = f"api_key={key}"
        self.conn.request("POST", "/login", body=body, headers={
            "Origin": url, "Content-Type": "application/x-www-form-urlencoded"})
        response = self.conn.getresponse()
        response.read()
        cookie = response.getheader("set-cookie") or ""
        if response.status != 303 or "actae_session=" not in cookie:
            raise RuntimeError(f"B5: the dashboard login answered {response.status}")
        self.cookie = cookie.split(";", 1)[0]

    def get_ms(self, path: str) -> float:
        began = time.perf_counter()
        self.conn.request("GET", path, headers={"Cookie": self.cookie, "x-api-key": self.key})
        response = self.conn.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"B5: GET {path} answered {response.status}")
        return (time.perf_counter() - began) * 1000

    def medians(self, paths: dict) -> dict:
        """{name: (median ms, samples)}: the pages asked in turn, round after round, after a warm-up."""
        for _ in range(B5_WARM):
            for path in paths.values():
                self.get_ms(path)
        samples: dict = {name: [] for name in paths}
        for _ in range(B5_SAMPLES):
            for name, path in paths.items():
                samples[name].append(self.get_ms(path))
        return {name: (statistics.median(got), got) for name, got in samples.items()}

    def close(self) -> None:
        self.conn.close()


def run_b5(folder: Path, sizes: tuple) -> dict:
    """Load sizes[0] runs, time the pages, load up to sizes[1], time them again: the B5 section."""
    data_dir = folder / "b5"
    server = Server("actae (B5)", [sys.executable, str(ROOT / "actae.py"), "--port", "0", "--data-dir", str(data_dir)],
                    {"url": URL_LINE, "key": KEY_LINE}).wait()
    measured, loaded, load_seconds = {}, 0, 0.0
    try:
        url, key = server.found["url"], server.found["key"]
        for size in sizes:
            load_seconds += b5_load(data_dir, loaded, size)
            loaded = size
            pages = Pages(url, key)
            try:
                wanted = f"{size // 2:07d}"[-5:]                  # matches a handful of ids in the middle
                paths = {name: path or f"/?q={wanted}" for name, (_, path) in B5_PAGES.items()}
                measured[size] = pages.medians(paths)
            finally:
                pages.close()
            say(f"B5 at {size:,} runs: " + ", ".join(f"{n} {m[0]:.1f} ms" for n, m in measured[size].items()))
    finally:
        server.stop()
    small, large = sizes
    figures = {}
    for name, (label, _) in B5_PAGES.items():
        figures[f"b5_{name}_ms"] = {"label": f"B5 {label}", "unit": "ms",
                                    "values": {f"{small:,} runs": measured[small][name][0],
                                               f"{large:,} runs": measured[large][name][0]},
                                    "samples": {f"{small:,} runs": measured[small][name][1],
                                                f"{large:,} runs": measured[large][name][1]}}
    checks = {}
    for name in ("first_page", "failed", "inbox"):
        value = measured[large][name][0] / measured[small][name][0]
        checks[f"b5_{name}_large_over_small"] = {
            "label": f"B5 {B5_PAGES[name][0]}: {large:,} runs / {small:,}", "value": value, "op": "<=",
            "target": 1.5, "pass": value <= 1.5}
    search = measured[large]["search"][0]
    checks["b5_search_ms_large"] = {"label": f"B5 substring search at {large:,} runs, ms", "value": search,
                                    "op": "<=", "target": 100, "pass": search <= 100}
    return {"sizes": list(sizes), "events_per_run": B5_EVENTS, "load_runs_per_s": sizes[-1] / load_seconds,
            "figures": figures, "ratios": checks}


def b5_table(b5: dict) -> str:
    small, large = b5["sizes"]
    rows = [[f["label"], f["unit"], *(number(v) for v in f["values"].values())] for f in b5["figures"].values()]
    lines = [f"B5: {small:,} then {large:,} runs of {b5['events_per_run']} events, loaded at "
             f"{b5['load_runs_per_s']:,.0f} runs/s through the write path; medians of {B5_SAMPLES} requests",
             markdown(["figure", "unit", f"{small:,} runs", f"{large:,} runs"], rows), "",
             markdown(["target", "value", "target", "result"],
                      [[c["label"], number(c["value"]), f"{c['op']} {c['target']:g}", "PASS" if c["pass"] else "FAIL"]
                       for c in b5["ratios"].values()])]
    return "\n".join(lines)


# =============================================================================
# --feature-costs: what each write-path feature costs
# =============================================================================
# Each round measures, in an order that rotates, each feature off (FEATURE_CONFIGS, PAIRED) beside
# all on: two fresh SQLite servers started for the pair, one with ACTAE_BENCH_WITHOUT naming the
# feature and one with it empty (for spans both export to the loopback collector that answers ok);
# an untimed warm-up on each, B1b twice on each in the order A B B A (B A A B every other round), so
# that the drift of a shared machine, which moves a server's CPU per write by 10% within seconds,
# hits both alike; then on servers that do not export B4's growing conversation on each (deltas
# engage only from DELTA_MIN_BYTES, 4 KB: B1b's 2 KB states never use them); then one approval request
# on each (the switch probe), and both stop. What each database and /metrics then show says whether
# each feature was at work, so a switch the server ignored cannot pass for a cost of nothing. One pair
# is all on beside all on: what a feature that costs nothing measures as (the noise). The figures are
# medians over rounds; a feature's ratio, saving and share medians of its pairs.

FEATURE_LABELS = {
    ALL_ON: "none (all on)",
    NOISE: "none, against another all-on server (the noise)",
    "run-state": "run-state (the runs pages' columns)",
    "approvals": "approvals (the inbox's event hook)",
    "request-metrics": "request-metrics (per-request histogram, batch counters)",
    "deltas": "deltas (state delta encoding)",
    "chain": "chain (the chain hash per event)",
    ALL_ON_EXPORTING: "none (all on), exporting to a collector",
    "spans": "spans (exporting to a collector)",
}
REFERENCES = (ALL_ON, ALL_ON_EXPORTING)
PAIRED = tuple(c for c in FEATURE_CONFIGS if c not in REFERENCES)     # each measured beside a fresh all-on server


def reference_of(config: str) -> str:
    return ALL_ON_EXPORTING if config in EXPORTING_CONFIGS else ALL_ON


def process_environ(pid: int) -> dict:
    """The environment a process was started with, from /proc/<pid>/environ."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def requests_observed(url: str, key: str) -> float:
    """The requests a server's per-request histogram counted (actae_http_request_duration_seconds_count
    summed over its labels, from /metrics): none when request metrics are off."""
    request = urllib.request.Request(url + "/metrics", headers={"x-api-key": key})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    return sum(float(n) for n in re.findall(r"^actae_http_request_duration_seconds_count(?:\{[^}]*\})? (\S+)$",
                                            text, re.M))


def switches_seen(database: Path, result: dict) -> tuple[dict, dict]:
    """({feature: whether it was at work on that server, None where the run cannot show it}, the
    database's counts behind that), read from a stopped server's database and its last /metrics:
    run-state keeps the blocking event's type on the probe's channel row, the inbox holds the probe's
    request, request metrics counted requests, the growing run stored some states as deltas, events
    have chain hashes, the exporting server exported spans."""
    with contextlib.closing(sqlite3.connect(database, timeout=30)) as conn:
        events, hashed = conn.execute("SELECT COUNT(*), COUNT(chain_hash) FROM events").fetchone()
        deltas = conn.execute("SELECT COUNT(*) FROM states WHERE delta_base IS NOT NULL").fetchone()[0]
        row = conn.execute("SELECT last_event_type FROM channels WHERE id = ?", (SWITCH_PROBE,)).fetchone()
        inbox = conn.execute("SELECT COUNT(*) FROM approvals WHERE channel_id = ?", (SWITCH_PROBE,)).fetchone()[0]
    counts = {"events": events, "chain_hashed": hashed, "delta_states": deltas, "inbox_rows": inbox,
              "probe_last_event_type": row[0] if row else None}
    seen = {"run-state": counts["probe_last_event_type"] == "approval.requested",
            "approvals": inbox > 0,
            "request-metrics": result["requests_observed"] > 0,
            "deltas": deltas > 0 if "grow" in result else None,
            "chain": hashed > 0,
            "spans": result["spans"]["exported"] > 0 if result["exporting"] else None}
    return seen, counts


def switch_mismatches(result: dict) -> list[str]:
    """What a measurement's server did against what its switch asked: the feature switched off at
    work, or another one not."""
    return [f"{feature} {'at work' if at_work else 'not at work'}"
            for feature, at_work in result["seen"].items()
            if at_work is not None and at_work != (feature != result["without"])]


def combined(passes: list[dict]) -> dict:
    """One server's B1b passes as one measurement (their sums), each pass kept under `passes`."""
    total = {name: sum(p[name] for p in passes)
             for name in ("seconds", "steps", "requests", "writes", "cpu_seconds", "server_cpu", "connection_errors")}
    return {**total, "other_cores_busy": statistics.mean(p["other_cores_busy"] for p in passes), "passes": passes}


class FeatureCosts:
    """--feature-costs: one SDK worker (no server of its own), one collector that answers ok, and two
    fresh servers for each pair measured."""

    def __init__(self, plan: Plan, folder: Path, keep: bool = False):
        self.plan, self.folder, self.keep = plan, folder, keep
        self.rounds: list[dict] = []

    def start(self) -> None:
        self.collector = Collector("ok")
        self.worker = Worker("ours", []).wait_ready()
        say(f"feature costs: SDK worker {self.worker.proc.pid}, collector {self.collector.url}")

    def stop(self) -> None:
        for child in (getattr(self, "worker", None), getattr(self, "collector", None)):
            if child is not None:
                with contextlib.suppress(Exception):
                    child.stop()

    def run_round(self, number: int) -> None:
        """Every pair once, in an order that rotates."""
        got: dict = {"order": rotated(list(PAIRED), number), "pairs": {}}
        for config in got["order"]:
            got["pairs"][config] = self.measure_pair(config, f"r{number}", number)
        self.rounds.append(got)

        def ratio(pair: dict) -> float:
            off, on = pair["off"]["b1b"], pair["reference"]["b1b"]
            return (off["server_cpu"] / off["writes"]) / (on["server_cpu"] / on["writes"])

        say(f"round {number}: server CPU per write (B1b), off ÷ all on: "
            + ", ".join(f"{config} {ratio(pair):.3f}" for config, pair in got["pairs"].items()))

    def _timed(self, server: Server, op: str, **args) -> dict:
        """`op` on the worker with its server's CPU, and the cores the machine's other processes kept
        busy meanwhile (all of the machine's busy time but the server's and the SDK's, ÷ wall time)."""
        before, ticks = cpu_seconds(server.pid), machine_ticks()
        result = self.worker.call(op, **args)
        result["server_cpu"] = cpu_seconds(server.pid) - before
        busy = cores_busy(ticks, machine_ticks())
        result["other_cores_busy"] = max(0.0, busy - (result["server_cpu"] + result["cpu_seconds"]) / result["seconds"])
        return result

    def measure_pair(self, config: str, tag: str, number: int) -> dict:
        """`config` beside its all-on configuration, each on a fresh server started for it: both warmed
        up, B1b on each twice in the order A B B A (B A A B in even rounds), so that drift on a shared
        machine moves both alike; the growing run on each (not on exporting servers), the one whose
        B1b came last first; the switch probe on each; then both stop, and their databases say which
        features each ran."""
        exporting = config in EXPORTING_CONFIGS
        configs = {"reference": reference_of(config), "off": config}
        servers: dict[str, Server] = {}
        results: dict[str, dict] = {}
        try:
            for role, name in configs.items():
                without = FEATURE_CONFIGS[name]
                data_dir = self.folder / f"features-{tag}-{re.sub(r'[^a-z]+', '-', config)}-{role}"
                argv = [sys.executable, str(BENCH_WITHOUT_PY), "--port", "0", "--data-dir", str(data_dir),
                        *(["--otlp-endpoint", self.collector.url] if exporting else [])]
                servers[role] = Server(f"actae without {without or 'nothing'}", argv,
                                       {"url": URL_LINE, "key": KEY_LINE}, env={BENCH_WITHOUT_VAR: without or ""})
                results[role] = {"config": name, "without": without, "exporting": exporting,
                                 "data_dir": str(data_dir)}
            for role, server in servers.items():
                server.wait()
                results[role]["environ"] = process_environ(server.pid).get(BENCH_WITHOUT_VAR)
                self.worker.call("connect", target=role, urls=[server.found["url"]], key=server.found["key"])
            try:
                self._pair_runs(servers, results, tag, number)
            finally:
                for role in servers:
                    self.worker.call("disconnect", target=role)
        finally:
            stop_servers(list(servers.values()))
        for role, result in results.items():
            result["seen"], result["database"] = switches_seen(Path(result["data_dir"]) / "actae.db", result)
            if not self.keep:
                shutil.rmtree(result["data_dir"], ignore_errors=True)
        return results

    def _pair_runs(self, servers: dict, results: dict, tag: str, number: int) -> None:
        plan, exporting = self.plan, results["off"]["exporting"]
        for role in servers:
            self.worker.call("b1b", runs=plan.runs, n=min(FEATURE_WARM_STEPS, plan.run_steps), tag=f"{tag}-warm",
                             target=role)
        # The first timed pass of a pair costs a few percent more than the others (the servers are
        # still warming up): A B B A puts that on A, so A is each role in turn, round by round.
        order = (["off", "reference", "reference", "off"] if number % 2 == 0
                 else ["reference", "off", "off", "reference"])
        passes: dict = {role: [] for role in servers}
        for i, role in enumerate(order):
            passes[role].append(self._timed(servers[role], "b1b", runs=plan.runs, n=plan.run_steps,
                                            tag=f"{tag}-b1b-{i}", target=role))
        for role in servers:
            results[role]["b1b"] = combined(passes[role])
        if not exporting:
            for role in (order[1], order[0]):
                data_dir = Path(results[role]["data_dir"])
                before = store_bytes(data_dir)
                grow = self._timed(servers[role], "grow", n=plan.b4_steps, tag=f"{tag}-grow", target=role)
                after = store_bytes(data_dir)
                results[role]["grow"] = {**grow, "disk_bytes": after["bytes"] - before["bytes"],
                                         "checkpointed": before["checkpointed"] and after["checkpointed"]}
        for role, server in servers.items():
            self.worker.call("record", target=role, channel=SWITCH_PROBE, event_type="approval.requested",
                             payload={"request_id": SWITCH_PROBE, "summary": "does the inbox see it?"})
            results[role]["requests_observed"] = requests_observed(server.found["url"], server.found["key"])
        if exporting:
            # all on: every timed step's span exported (or 20 s are up); span building off: none, a pass
            # of the other server (and its spans' export) after its own last pass
            for role in ("reference", "off"):
                url, key = servers[role].found["url"], servers[role].found["key"]
                results[role]["spans"] = (settled_spans(url, key, results[role]["b1b"]["steps"]) if role == "reference"
                                          else span_counts(url, key))


def phase_costs(pairs: list[tuple[dict, dict]], phase: str, reference: bool) -> dict:
    """A configuration's figures in one phase ("b1b" or "grow"), from its measurements each paired
    with the all-on one beside it: steps/s and CPU per write as medians over its measurements; the
    ratio, the CPU saved and its share as medians over the pairs (for an all-on configuration itself
    1, 0 and 0)."""
    def cpu(r: dict) -> float:
        return r[phase]["server_cpu"] * 1000 / r[phase]["writes"]

    def disk(r: dict) -> float:
        return r[phase]["disk_bytes"] / r[phase]["steps"]

    steps = [r[phase]["steps"] / r[phase]["seconds"] for r, _ in pairs]
    ours, alls = [cpu(r) for r, _ in pairs], [cpu(a) for _, a in pairs]
    figures = {
        "steps_per_s": statistics.median(steps),
        "server_cpu_ms_per_write": statistics.median(ours),
        "cpu_over_all_on": 1.0 if reference else statistics.median(o / a for o, a in zip(ours, alls)),
        "cpu_saved_ms_per_write": 0.0 if reference else statistics.median(a - o for o, a in zip(ours, alls)),
        "share_of_a_write": 0.0 if reference else statistics.median((a - o) / a for o, a in zip(ours, alls)),
        "samples": {"steps_per_s": steps, "server_cpu_ms_per_write": ours, "all_on_server_cpu_ms_per_write": alls},
    }
    if phase == "grow":
        ours_disk, alls_disk = [disk(r) for r, _ in pairs], [disk(a) for _, a in pairs]
        figures.update(disk_bytes_per_step=statistics.median(ours_disk),
                       disk_over_all_on=1.0 if reference else statistics.median(
                           d / a for d, a in zip(ours_disk, alls_disk)),
                       checkpointed=all(r[phase]["checkpointed"] for r, _ in pairs))
        figures["samples"].update(disk_bytes_per_step=ours_disk, all_on_disk_bytes_per_step=alls_disk)
    return figures


def summarise_features(costs: FeatureCosts) -> dict:
    """The report's feature_costs section: per configuration, what its servers ran without, the
    configuration it is paired with, B1b's figures, the growing run's (not on exporting servers),
    each server's ACTAE_BENCH_WITHOUT as its /proc environ had it, and which features it was seen to
    run. An all-on configuration's figures are over every server of it (one in each pair with it)."""
    plan, configs = costs.plan, {}
    for config, without in FEATURE_CONFIGS.items():
        if config in REFERENCES:
            pairs = [(pair["reference"], pair["reference"]) for got in costs.rounds
                     for name, pair in got["pairs"].items() if reference_of(name) == config]
        else:
            pairs = [(got["pairs"][config]["off"], got["pairs"][config]["reference"]) for got in costs.rounds]
        runs = [r for r, _ in pairs]
        mismatches = sorted({m for r in runs for m in switch_mismatches(r)})
        configs[config] = {
            "label": FEATURE_LABELS[config], "without": without, "exporting": config in EXPORTING_CONFIGS,
            "compared_with": None if config in REFERENCES else reference_of(config), "servers": len(runs),
            "environ": [r["environ"] for r in runs], "seen": [r["seen"] for r in runs],
            "database": [r["database"] for r in runs],
            "switch_ok": not mismatches and all(r["environ"] == (without or "") for r in runs),
            "mismatches": mismatches,
            "b1b": phase_costs(pairs, "b1b", config in REFERENCES),
            "grow": None if config in EXPORTING_CONFIGS else phase_costs(pairs, "grow", config in REFERENCES),
            "spans": [r.get("spans") for r in runs],
            "connection_errors": sum(r[p].get("connection_errors", 0) for r in runs for p in ("b1b", "grow") if p in r),
        }
    messages = make_messages("b4", plan.b4_steps)
    others = [r["b1b"]["other_cores_busy"] for got in costs.rounds for pair in got["pairs"].values()
              for r in pair.values()]
    return {"rounds": len(costs.rounds), "runs": plan.runs, "run_steps": plan.run_steps, "b1b_passes": 2,
            "grow_steps": plan.b4_steps,
            "other_cores_busy": {"median": statistics.median(others), "max": max(others)} if others else None,
            "grow_bytes_added_per_step": (state_bytes(grown_state(messages, plan.b4_steps))
                                          - state_bytes(grown_state(messages, 0))) / plan.b4_steps,
            "delta_min_bytes": DELTA_MIN_BYTES, "features": list(BENCH_FEATURES), "configs": configs}


def ms3(value: Optional[float]) -> str:
    return "-" if value is None else f"{round(value, 3) or 0.0:.3f}"       # no "-0.000"


def percent(value: Optional[float]) -> str:
    return "-" if value is None else f"{round(value * 100, 1) or 0.0:.1f}%"


def feature_tables(fc: dict) -> str:
    """The two tables of --feature-costs: B1b, then the growing state, with what they rest on."""
    configs = fc["configs"]

    def cells(config: str, f: dict) -> list[str]:
        reference = config in REFERENCES
        return [configs[config]["label"], number(f["steps_per_s"]), ms3(f["server_cpu_ms_per_write"]),
                number(f["cpu_over_all_on"]), "-" if reference else ms3(f["cpu_saved_ms_per_write"]),
                "-" if reference else percent(f["share_of_a_write"])]

    def noise(phase: str) -> str:
        samples = configs[NOISE][phase]["samples"]
        shares = [(a - o) / a for o, a in zip(samples["server_cpu_ms_per_write"],
                                              samples["all_on_server_cpu_ms_per_write"])]
        return f"{percent(min(shares))} to {percent(max(shares))}"

    heads = ["feature switched off", "steps/s", "server CPU per write request (ms)", "÷ all on",
             "CPU saved per write (ms, all on minus off)", "share of a write (saved ÷ all on)"]
    rounds = f"{fc['rounds']} round{'s' if fc['rounds'] != 1 else ''}"
    lines = [f"What each write-path feature costs (B1b, SQLite): {fc['runs']} concurrent runs x {fc['run_steps']}"
             f" steps, twice on each server, medians of {rounds}",
             markdown(heads, [cells(c, f["b1b"]) for c, f in configs.items()], left=1),
             f"Each feature off is paired, each round, with all on: two fresh servers started together, B1b on"
             f" them in the order A B B A (B A A B every other round); spans with both servers exporting to the"
             f" same loopback collector (answering ok). ÷ all on is the pair's ratio of server CPU per write, and"
             f" it, the CPU saved and the share are medians over the pairs; the all-on rows hold every all-on"
             f" server's figures. The noise row pairs all on with all on: its pairs' shares ran from"
             f" {noise('b1b')}, so a share inside that range is not a cost this machine can measure. B1b's"
             f" states (2 KB) are below the {fc['delta_min_bytes']:,} bytes from which deltas engage, so its"
             f" deltas row measures only the size check; the growing state below is where deltas work.", ""]
    grown = {c: f["grow"] for c, f in configs.items() if f["grow"]}
    rows = [[*cells(c, f), number(f["disk_bytes_per_step"]), number(f["disk_over_all_on"])] for c, f in grown.items()]
    lines += [f"Growing state (B4's): one AgentSession run of {fc['grow_steps']} steps on each server of a pair after"
              f" its B1b, a conversation growing {fc['grow_bytes_added_per_step']:,.0f} bytes a step (a state a"
              f" step, from 1 KB to {fc['grow_steps'] * fc['grow_bytes_added_per_step'] / 1000:,.0f} KB)",
              markdown([*heads, "disk bytes per step", "disk ÷ all on"], rows, left=1),
              f"The noise row's pairs: shares from {noise('grow')}."]
    bad = {c: f for c, f in configs.items() if not f["switch_ok"]}
    for config, f in bad.items():
        lines.append(f"WARNING: {config}: a server did not run as switched (environ {f['environ']};"
                     f" {', '.join(f['mismatches']) or 'the environment differs'}): its row measures something else.")
    if not bad:
        lines.append("Every server ran as switched: its /proc environ held its ACTAE_BENCH_WITHOUT, and what it"
                     " wrote (chain hashes, deltas, the runs-page column, the inbox row, request metrics, spans)"
                     " showed the feature off and every other one at work.")
    return "\n".join(lines)


def machine_meta() -> dict:
    """When, on what, and which actae (its commit, +changes when actae.py differs from it)."""
    cpu_model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "actae.py"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip())
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{os.cpu_count()}-core {platform.machine()}", "cpu": cpu_model,
            "python": platform.python_version(), "sqlite": sqlite3.sqlite_version,
            "actae_commit": commit + ("+changes" if dirty else "")}


def feature_docs_section(report: dict, tables: str) -> str:
    m, others = report["meta"], report["feature_costs"]["other_cores_busy"]
    return "\n".join([
        f"Run of {m['date']} on {m['machine']} ({m['cpu']}), Python {m['python']}, SQLite {m['sqlite']}:"
        f" `--feature-costs{' --quick' if m['quick'] else ''}` in {m['seconds']:.0f} s, actae `{m['actae_commit']}`;"
        f" the machine's load average (1 minute) was {m['load_before'][0]:.2f} before it started, and during B1b"
        f" other processes kept {others['median']:.2f} of its {os.cpu_count()} cores busy (median over the"
        f" measurements; at most {others['max']:.2f}).",
        "",
        spaced(tables),
    ])


def feature_costs_only(args: argparse.Namespace) -> int:
    """`bench.py --feature-costs [--quick]`: the feature costs alone, printed, written as
    {"meta", "feature_costs", "rounds"} and, with --docs (a full run: by default), between the
    feature-costs markers."""
    plan = QUICK if args.quick else replace(Plan(), rounds=FEATURE_ROUNDS)
    plan = replace(plan, **{k: getattr(args, k) for k in ("rounds", "run_steps") if getattr(args, k)})
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="actae-bench-features-", dir=args.dir))
    costs = FeatureCosts(plan, folder, keep=args.keep)
    load, ticks, began = os.getloadavg(), machine_ticks(), time.monotonic()
    try:
        costs.start()
        for number in range(1, plan.rounds + 1):
            costs.run_round(number)
    finally:
        costs.stop()
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    report = {"meta": {**machine_meta(), "quick": args.quick, "seconds": round(time.monotonic() - began, 1),
                       "plan": asdict(plan), "load_before": load, "load_after": os.getloadavg(),
                       "machine_cores_busy": cores_busy(ticks, machine_ticks()),
                       "folder": str(folder) if args.keep else None},
              "feature_costs": summarise_features(costs), "rounds": costs.rounds}
    json_path = args.json or DEFAULT_FEATURES_JSON
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    tables = feature_tables(report["feature_costs"])
    print(tables)
    print(f"\nreport: {json_path}")
    docs = args.docs or (None if args.quick else DEFAULT_DOCS)
    if docs is not None:
        write_docs(docs, feature_docs_section(report, tables), FEATURES_START, FEATURES_END)
        print(f"tables: {docs}")
    return 0


# =============================================================================
# Report
# =============================================================================

LIMIT_COLUMNS = ("floor", "bare", "raw")
COLUMNS = (*SYSTEMS, "baseline", *LIMIT_COLUMNS)
INPUT_FIGURES = ("bytes_in_per_step", "b4_bytes_added_per_step")   # what every system is handed: no better


def per_round(got: dict, plan: Plan) -> dict:
    """The figures of one round: {figure: {column: value}}."""
    b1a, b1b, get = got["b1a"], got["b1b"], got["get"]
    ours_a = b1a["ours"]
    floor_ms = ours_a["cpu_seconds"] * 1000 / ours_a["steps"] + 2 * got["raw"]["latency_ms"]
    figures = {
        "b1a_steps_per_s": {**{n: r["steps"] / r["seconds"] for n, r in b1a.items()}, "floor": 1000 / floor_ms},
        "b1a_floor_ms_per_step": {"floor": floor_ms},
        "b1b_steps_per_s": {n: r["steps"] / r["seconds"] for n, r in b1b.items()},
        "cpu_ms_per_step_b1b": {n: (r["cpu_seconds"] + r.get("server_cpu", 0)) * 1000 / r["steps"]
                                for n, r in b1b.items()},
        "get_requests_per_s": {n: r["requests"] / r["seconds"] for n, r in get.items()},
        "get_cpu_ms_per_request": {n: r["server_cpu"] * 1000 / r["sent"] for n, r in get.items()},
        "sqlite_commits_per_s": {"raw": got["raw"]["commits_per_s"]},
        "commit_latency_ms": {"raw": got["raw"]["latency_ms"]},
    }
    for name in (n for n in OURS if n in b1a):      # ours, and the baseline when measured
        a, b = b1a[name], b1b[name]
        own = {
            "sdk_cpu_ms_per_request": a["cpu_seconds"] * 1000 / a["requests"],
            "sdk_cpu_ms_per_step": a["cpu_seconds"] * 1000 / a["steps"],
            "b1b_write_requests_per_s": b["writes"] / b["seconds"],
            "server_cpu_ms_per_write": b["server_cpu"] * 1000 / b["writes"],
            "server_cpu_ms_per_write_b1a": a["server_cpu"] * 1000 / a["writes"],
            "peak_rss_mb": b["peak_rss_mb"],
            **{f"b3_pairs_per_s_{k}": r["steps"] / r["seconds"] for k, r in got["b3"][name].items()},
        }
        for figure, value in own.items():
            figures.setdefault(figure, {})[name] = value
    return figures


def labels(plan: Plan) -> dict:
    """Figure name -> (label, unit), in table order."""
    small, mid, large = plan.sizes
    rows = {
        "b1a_steps_per_s": (f"B1a one run of {plan.steps:,} steps", "steps/s"),
        "b1a_floor_ms_per_step": ("B1a floor: SDK CPU per step + 2 commit latencies", "ms/step"),
        "b1b_steps_per_s": (f"B1b {plan.runs} concurrent runs x {plan.run_steps} steps", "steps/s"),
        "b1b_write_requests_per_s": ("B1b our write requests", "req/s"),
        "get_requests_per_s": (f"GET at {plan.runs} in flight (ours: /api/v1/auth/capabilities)", "req/s"),
        "get_cpu_ms_per_request": ("server CPU per GET", "ms"),
        "sqlite_commits_per_s": ("SQLite WAL FULL commits of a 2 KB row", "commits/s"),
        "commit_latency_ms": ("commit latency (median)", "ms"),
        "sdk_cpu_ms_per_request": ("SDK CPU per request (B1a)", "ms"),
        "sdk_cpu_ms_per_step": ("SDK CPU per step (B1a)", "ms"),
        "server_cpu_ms_per_write": ("server CPU per write request (B1b)", "ms"),
        "server_cpu_ms_per_write_b1a": ("server CPU per write request (B1a)", "ms"),
        "cpu_ms_per_step_b1b": ("CPU per step, all processes (B1b)", "ms"),
        "peak_rss_mb": ("server peak RSS under B1b", "MB"),
        "b3_pairs_per_s_1": ("B3 ledger claim+complete, 1 in flight", "pairs/s"),
        "b3_pairs_per_s_8": ("B3 ledger claim+complete, 8 in flight", "pairs/s"),
        "b3_pairs_per_s_64": ("B3 ledger claim+complete, 64 in flight", "pairs/s"),
    }
    for which, n in (("small", small), ("mid", mid), ("large", large)):
        rows[f"b2_fork_ms_{which}"] = (f"B2 fork at k=N/2, N={n:,}", "ms")
    for which, n in (("small", small), ("mid", mid), ("large", large)):
        rows[f"b2_session_fork_ms_{which}"] = (f"B2 AgentSession.resume(fork_at_step=k), N={n:,}", "ms")
    rows["b2_sdk_cpu_ms_per_fork"] = ("SDK CPU per fork request (B2, every N)", "ms")
    rows["b2_floor_ms"] = ("B2 floor: SDK CPU per fork + 1 commit latency", "ms")
    rows["bytes_in_per_step"] = ("bytes handed in per step", "bytes")
    rows["disk_bytes_per_step"] = ("bytes on disk per step", "bytes")
    rows["disk_per_step_over_bytes_in"] = ("disk per step / bytes handed in", "x")
    rows["wal_frames_per_event"] = ("SQLite WAL frames per committed event (B1a)", "frames")
    n, early = plan.b4_steps, plan.b4_early
    rows.update({
        "b4_steps_per_s": (f"B4 one run of {n} steps, a conversation growing ~1 KB a step", "steps/s"),
        "b4_server_cpu_ms_per_write": ("B4 server CPU per write request", "ms"),
        "b4_bytes_added_per_step": ("B4 bytes added to the state per step", "bytes"),
        "b4_disk_bytes_per_step": ("B4 bytes on disk per step", "bytes"),
        "b4_disk_over_added": ("B4 disk per step / bytes added per step", "x"),
        "b4_read_ms_early": (f"B4 latest-state read at step {early}", "ms"),
        "b4_read_ms_final": (f"B4 latest-state read at step {n}", "ms"),
        "b4_read_whole_ms": (f"B4 the step-{n} state read from a fresh channel holding it whole", "ms"),
        "b4_fork_ms": (f"B4 fork at step {n // 2}", "ms"),
    })
    return rows


def summarise(bench: Bench) -> dict:
    """Medians of every figure, with their samples."""
    plan = bench.plan
    samples: dict = {}
    for got in bench.rounds:
        for name, columns in per_round(got, plan).items():
            for column, value in columns.items():
                samples.setdefault(name, {}).setdefault(column, []).append(value)
    for which, size in zip(("small", "mid", "large"), plan.sizes):
        samples[f"b2_fork_ms_{which}"] = {n: bench.once["b2"][f"{n}:{size}"] for n in (*bench.ours, "langgraph", "dbos")}
        samples[f"b2_session_fork_ms_{which}"] = {n: bench.once["b2"][f"{n}_session:{size}"] for n in bench.ours}
    disk = bench.once["disk"]
    samples["bytes_in_per_step"] = {n: [d["bytes_in"] / d["steps"]] for n, d in disk.items()}
    samples["disk_bytes_per_step"] = {n: [d["bytes"] / d["steps"]] for n, d in disk.items()}
    samples["disk_per_step_over_bytes_in"] = {n: [d["bytes"] / d["bytes_in"]] for n, d in disk.items()}
    samples["wal_frames_per_event"] = {n: [w["frames"] / w["events"]] for n, w in bench.once["wal"].items()
                                       if w and w["events"]}
    latency = statistics.median(got["raw"]["latency_ms"] for got in bench.rounds)
    cpu = {n: [ms for size in plan.sizes for ms in bench.once["b2_sdk_cpu_ms"][n][str(size)]] for n in bench.ours}
    samples["b2_sdk_cpu_ms_per_fork"] = cpu
    samples["b2_floor_ms"] = {"floor": [ms + latency for ms in cpu["ours"]]}
    samples.update(b4_figures(bench.once["b4"]))
    figures = {}
    for name, (label, unit) in labels(plan).items():
        columns = samples[name]
        figures[name] = {"label": label, "unit": unit,
                         "values": {c: statistics.median(columns[c]) for c in COLUMNS if c in columns},
                         "samples": {c: columns[c] for c in COLUMNS if c in columns},
                         "higher_is_better": None if name in INPUT_FIGURES else unit.endswith("/s")}
    return figures


def b4_figures(b4: dict) -> dict:
    """B4's samples: {figure: {column: [values]}} (one value each for the run and the disk)."""
    n, added, systems = b4["steps"], b4["bytes_added_per_step"], b4["systems"]
    ours = [name for name in OURS if name in systems]
    runs = {name: b4[name]["start"]["seconds"] + b4[name]["finish"]["seconds"] for name in systems}

    def server_cpu_per_write(name: str) -> float:
        start, finish = b4[name]["start"], b4[name]["finish"]
        return (start["server_cpu"] + finish["server_cpu"]) * 1000 / (start["writes"] + finish["writes"])

    return {
        "b4_steps_per_s": {name: [n / seconds] for name, seconds in runs.items()},
        "b4_server_cpu_ms_per_write": {name: [server_cpu_per_write(name)] for name in ours},
        "b4_bytes_added_per_step": {name: [added] for name in systems},
        "b4_disk_bytes_per_step": {name: [b4[name]["disk_bytes"] / n] for name in systems},
        "b4_disk_over_added": {name: [b4[name]["disk_bytes"] / n / added] for name in systems},
        "b4_read_ms_early": {name: b4["read_early"][name] for name in systems},
        "b4_read_ms_final": {name: b4["read_final"][name] for name in systems},
        "b4_read_whole_ms": {name: b4["read_final"][f"{name}_whole"] for name in ours},
        "b4_fork_ms": {name: b4["fork"][name] for name in systems},
    }


PG_COLUMNS = ("sqlite", *PG_SERVERS)
PG_HEADS = {"sqlite": "SQLite server", "pg1": "PostgreSQL 1 server", "pg3": "PostgreSQL 3 servers"}


def pg_labels(plan: Plan) -> dict:
    """PostgreSQL figure name -> (label, unit, whether PostgreSQL's own CPU is in it), in table order."""
    return {
        "pg_b1b_steps_per_s": (f"B1b {plan.runs} concurrent runs x {plan.run_steps} steps, by backend",
                               "steps/s", False),
        "pg_b1b_write_requests_per_s": ("B1b write requests, by backend", "req/s", False),
        "pg_server_cpu_ms_per_write": ("server CPU per write request (B1b), summed over the servers", "ms", False),
        "pg_postgres_cpu_ms_per_write": ("PostgreSQL backends' CPU per write request (B1b)", "ms", True),
        "pg_cpu_ms_per_step": ("CPU per step: SDK + servers + PostgreSQL backends (B1b)", "ms", True),
        "pg_cores_busy": ("cores busy in B1b: that CPU / wall time", "cores", True),
        "pg_machine_cores_busy": (f"machine cores busy in B1b, every process (of {os.cpu_count()})", "cores",
                                  False),
        "pg_jobs_per_commit": ("write jobs per commit (group commit; all servers)", "jobs", False),
    }


def pg_round(got: dict) -> dict:
    """The PostgreSQL figures of one round, with the SQLite server's beside them: {figure: {column: value}}."""
    runs = {"sqlite": {**got["b1b"]["ours"], "postgres_cpu": 0.0}, **got.get("b1b_pg", {})}
    figures: dict = {name: {} for name in pg_labels(Plan())}
    for column, r in runs.items():
        figures["pg_b1b_steps_per_s"][column] = r["steps"] / r["seconds"]
        figures["pg_b1b_write_requests_per_s"][column] = r["writes"] / r["seconds"]
        figures["pg_server_cpu_ms_per_write"][column] = r["server_cpu"] * 1000 / r["writes"]
        figures["pg_machine_cores_busy"][column] = r["machine_cores_busy"]
        figures["pg_jobs_per_commit"][column] = r["write_jobs"] / r["write_batches"]
        if r["postgres_cpu"] is not None:
            every = r["cpu_seconds"] + r["server_cpu"] + r["postgres_cpu"]
            if column != "sqlite":
                figures["pg_postgres_cpu_ms_per_write"][column] = r["postgres_cpu"] * 1000 / r["writes"]
            figures["pg_cpu_ms_per_step"][column] = every * 1000 / r["steps"]
            figures["pg_cores_busy"][column] = every / r["seconds"]
    return figures


def summarise_postgres(bench: Bench) -> dict:
    """The PostgreSQL section: settings, and each figure's medians and samples per column; a column
    that could not be measured has the value null and the figure says why under `skipped`."""
    plan, pg = bench.plan, bench.postgres
    if pg is not None:
        pg.check_fsync()
    samples: dict = {}
    for got in bench.rounds:
        for name, columns in pg_round(got).items():
            for column, value in columns.items():
                samples.setdefault(name, {}).setdefault(column, []).append(value)
    figures = {}
    for name, (label, unit, own_cpu) in pg_labels(plan).items():
        columns = samples.get(name, {})
        wanted = [c for c in PG_COLUMNS if c != "sqlite" or name != "pg_postgres_cpu_ms_per_write"]
        skipped = PG_SKIPPED if pg is None else (pg.settings()["cpu_note"] if own_cpu and not pg.local else None)
        figures[name] = {"label": label, "unit": unit,
                         "values": {c: statistics.median(columns[c]) if columns.get(c) else None for c in wanted},
                         "samples": {c: columns.get(c, []) for c in wanted},
                         "skipped": skipped if any(not columns.get(c) for c in wanted) else None}
    return {"skipped": PG_SKIPPED if pg is None else None,
            "settings": pg.settings() if pg is not None else None, "figures": figures,
            "connection_errors": sum(r.get("connection_errors", 0) for got in bench.rounds
                                     for r in got.get("b1b_pg", {}).values())}


EXPORT_HEADS = {"off": "export off", "503": "503 after 1 s", "down": "collector down", "ok": "collector ok"}


def summarise_export(bench: Bench) -> dict:
    """B1b with OpenTelemetry export: each column's medians (steps/s, server CPU per write) and
    the spans its servers said they exported and dropped, summed over rounds."""
    rows = {"export_b1b_steps_per_s": ("B1b steps/s, fresh server", "steps/s"),
            "export_server_cpu_ms_per_write": ("server CPU per write request", "ms"),
            "export_spans_exported": ("spans exported (all rounds)", "spans"),
            "export_spans_dropped": ("spans dropped (all rounds)", "spans")}
    figures = {}
    for name, (label, unit) in rows.items():
        values, samples = {}, {}
        for column in EXPORT_COLUMNS:
            runs = [got["b1b_export"][column] for got in bench.rounds]
            if name == "export_b1b_steps_per_s":
                samples[column] = [r["steps"] / r["seconds"] for r in runs]
            elif name == "export_server_cpu_ms_per_write":
                samples[column] = [r["server_cpu"] * 1000 / r["writes"] for r in runs]
            else:
                samples[column] = [r["spans"][name.rsplit("_", 1)[1]] for r in runs]
            values[column] = (sum if name.startswith("export_spans") else statistics.median)(samples[column])
        figures[name] = {"label": label, "unit": unit, "values": values, "samples": samples}
    return figures


def export_table(figures: dict) -> str:
    return markdown(["B1b with OpenTelemetry export", "unit", *EXPORT_HEADS.values()],
                    [[f["label"], f["unit"], *(number(f["values"][c]) for c in EXPORT_COLUMNS)]
                     for f in figures.values()])


def ratios(figures: dict, plan: Plan, postgresql: Optional[dict] = None, export: Optional[dict] = None) -> dict:
    """The performance targets of issue #22, in its order, then those still holding, then context
    ratios without a target: {name: {label, value, op, target, pass}}; a ratio without a target has
    op, target and pass null; a PostgreSQL one not measured has value null and says why under
    `skipped`; a B2 ratio is the largest over the parents' sizes, each size's under `by_size`;
    issue #21's export ratios follow the PostgreSQL one when export was measured."""
    v = {name: f["values"] for name, f in figures.items()}
    pg_checks, pg_skipped = postgres_checks(postgresql)
    best_dbos = max(v["b1b_steps_per_s"]["dbos"], v["b1b_steps_per_s"]["dbos_wal"])
    small, _, large = plan.sizes
    n, sizes = plan.b4_steps, ", ".join(f"{size:,}" for size in plan.sizes)
    forks = {size: v[f"b2_fork_ms_{which}"] for which, size in zip(("small", "mid", "large"), plan.sizes)}
    over_floor = {str(size): fork["ours"] / v["b2_floor_ms"]["floor"] for size, fork in forks.items()}
    over_update = {str(size): fork["ours"] / fork["langgraph"] for size, fork in forks.items()}
    checks = [
        ("server_cpu_write_over_get", "server CPU per write request (B1b) / server CPU per authenticated GET",
         v["server_cpu_ms_per_write"]["ours"] / v["get_cpu_ms_per_request"]["ours"], "<=", 2),
        ("b1a_time_over_floor", "B1a our ms per step / floor (SDK CPU + 2 raw commits)",
         1000 / v["b1a_steps_per_s"]["ours"] / v["b1a_floor_ms_per_step"]["floor"], "<=", 1.5),
        ("b1b_over_langgraph", "B1b ours / LangGraph threads",
         v["b1b_steps_per_s"]["ours"] / v["b1b_steps_per_s"]["langgraph"], ">=", 2.5),
        ("b2_over_floor", f"B2 fork / floor (SDK CPU per request + 1 raw commit), largest of N={sizes}",
         max(over_floor.values()), "<=", 2, {"by_size": over_floor}),
        ("b2_over_langgraph", f"B2 fork / LangGraph update_state, largest of N={sizes}",
         max(over_update.values()), "<=", 1.25, {"by_size": over_update}),
        ("b4_disk_over_added", "B4 our disk per step / bytes added per step",
         v["b4_disk_over_added"]["ours"], "<=", 2),
        ("b4_read_over_whole", f"B4 latest-state read at step {n} / the same state read from a channel holding it whole",
         v["b4_read_ms_final"]["ours"] / v["b4_read_whole_ms"]["ours"], "<=", 1.3),
        ("b4_fork_over_langgraph", f"B4 fork at step {n // 2} / LangGraph update_state there",
         v["b4_fork_ms"]["ours"] / v["b4_fork_ms"]["langgraph"], "<=", 1.25),
        pg_checks[0],
        *export_checks(export),
        ("b1b_over_dbos", "still holding: B1b ours / DBOS (the faster of its two setups)",
         v["b1b_steps_per_s"]["ours"] / best_dbos, ">=", 4),
        ("b2_large_over_small", f"still holding: B2 fork flat in N, N={large:,} / N={small:,}",
         v["b2_fork_ms_large"]["ours"] / v["b2_fork_ms_small"]["ours"], "<=", 1.2),
        ("peak_rss_mb", "still holding: server peak RSS under B1b, MB", v["peak_rss_mb"]["ours"], "<=", 150),
        ("disk_over_bytes_in", "still holding: our disk per step / bytes handed in (2 KB states)",
         v["disk_per_step_over_bytes_in"]["ours"], "<=", 1.5),
        ("b3_pairs_per_s_64", "still holding: B3 pairs/s at 64 in flight", v["b3_pairs_per_s_64"]["ours"], ">=", 1000),
        pg_checks[1],
        ("b1a_over_langgraph", "context: B1a ours / LangGraph",
         v["b1a_steps_per_s"]["ours"] / v["b1a_steps_per_s"]["langgraph"], None, None),
        ("server_cpu_write_over_bare", "context: server CPU per write / bare endpoint CPU per request",
         v["server_cpu_ms_per_write"]["ours"] / v["get_cpu_ms_per_request"]["bare"], None, None),
    ]
    result = {}
    for name, label, value, op, target, *extra in checks:
        verdict = None if value is None or op is None else (value <= target if op == "<=" else value >= target)
        result[name] = {"label": label, "value": value, "op": op, "target": target, "pass": verdict,
                        **(extra[0] if extra else {})}
        if name in pg_skipped:
            result[name]["skipped"] = pg_skipped[name]
    return result


def export_checks(export: Optional[dict]) -> list[tuple]:
    """B1b with export to a slow (503) and to a dead collector, each over export off (>= 0.9)."""
    if not export:
        return []
    b1b = export["export_b1b_steps_per_s"]["values"]
    return [("b1b_export_503_over_off", "B1b with export to a collector answering 503 slowly / export off",
             b1b["503"] / b1b["off"], ">=", 0.9),
            ("b1b_export_down_over_off", "B1b with export to a collector that is down / export off",
             b1b["down"] / b1b["off"], ">=", 0.9)]


def postgres_checks(postgresql: Optional[dict]) -> tuple[list[tuple], dict]:
    """The two PostgreSQL ratios, 1 server / the SQLite server (target >= 0.7) and 3 servers / 1
    server (no target), as `ratios` rows; and {name: why it is null, or None}."""
    postgresql = postgresql or {"skipped": PG_SKIPPED, "settings": None, "figures": {}}
    settings = postgresql["settings"] or {}
    b1b = (postgresql["figures"].get("pg_b1b_steps_per_s") or {}).get("values", {})
    unflushed = " (PostgreSQL fsync=off: not like-for-like)" if settings.get("fsync") == "off" else ""
    one = b1b["pg1"] / b1b["sqlite"] if b1b.get("pg1") and b1b.get("sqlite") else None
    three = b1b["pg3"] / b1b["pg1"] if b1b.get("pg3") and b1b.get("pg1") else None
    why = postgresql["skipped"] or PG_SKIPPED
    return ([("b1b_pg_over_sqlite", "B1b on PostgreSQL, one server / SQLite" + unflushed, one, ">=", 0.7),
             ("b1b_pg3_over_pg1", "context: B1b PostgreSQL 3 servers / 1 server", three, None, None)],
            {"b1b_pg_over_sqlite": None if one else why, "b1b_pg3_over_pg1": None if three else why})


# A ratio without a target is better higher or lower as its meaning says; one with a target as its op.
CONTEXT_HIGHER_IS_BETTER = {"b1b_pg3_over_pg1": True, "b1a_over_langgraph": True, "server_cpu_write_over_bare": False}


def quotient(ours: Optional[float], baseline: Optional[float]) -> Optional[float]:
    return ours / baseline if ours is not None and baseline else None


def as_ours(figures: dict, name: str) -> dict:
    """The figures with `name`'s values (the baseline's) in ours's place, so that `ratios` computes
    the baseline's targets the way it computes ours; a figure only ours has keeps ours's (the floors:
    the same SDK's CPU)."""
    return {key: {**f, "values": {**f["values"], "ours": f["values"][name]}} if name in f["values"] else f
            for key, f in figures.items()}


def compare_baseline(baseline: Optional[Baseline], why: str, figures: dict, checks: dict, plan: Plan) -> dict:
    """The report's baseline section: which commit it was (or why there was none), and for every
    figure and target ratio measured on both, ours, the baseline's, ours ÷ baseline and whether
    higher is better (None for what every system is handed alike)."""
    if baseline is None:
        return {"skipped": why, "ref": None, "commit": None, "short": None, "source": None, "figures": {},
                "ratios": {}}
    theirs = ratios(as_ours(figures, "baseline"), plan)
    compared = {}
    for name, f in figures.items():
        if "baseline" in f["values"]:
            ours, base = f["values"]["ours"], f["values"]["baseline"]
            compared[name] = {"ours": ours, "baseline": base, "ours_over_baseline": quotient(ours, base),
                              "higher_is_better": f["higher_is_better"]}
    targets = {}
    for name, check in checks.items():
        base = theirs[name]["value"] if name in theirs else None
        better = CONTEXT_HIGHER_IS_BETTER.get(name) if check["op"] is None else check["op"] == ">="
        targets[name] = {"ours": check["value"], "baseline": base, "ours_over_baseline": quotient(check["value"], base),
                         "higher_is_better": better,
                         "baseline_pass": theirs[name]["pass"] if name in theirs else None}
    return {"skipped": None, "ref": baseline.ref, "commit": baseline.commit, "short": baseline.short,
            "source": baseline.source, "figures": compared, "ratios": targets,
            "not_measured": NOT_BASELINED}


NOT_BASELINED = ("not measured on the baseline: B1b with export and on PostgreSQL (each starts fresh servers"
                 " per measurement, as many again for the baseline), B5 (loaded through actae's Python API,"
                 " which another commit need not share)")


def baseline_heads(baseline: dict) -> list[str]:
    """The columns a table gains for the baseline: its figure, ours ÷ it, and which way is better."""
    return [f"baseline {baseline['short']}", "÷ baseline", "higher is better?"] if baseline["short"] else []


def baseline_cells(compared: Optional[dict]) -> list[str]:
    if compared is None or compared["ours_over_baseline"] is None:
        return [number(compared and compared["baseline"]), "-", "-"]
    better = compared["higher_is_better"]
    return [number(compared["baseline"]), number(compared["ours_over_baseline"]),
            "-" if better is None else "yes" if better else "no"]


def number(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def table(figures: dict, checks: dict, postgresql: dict, export: Optional[dict] = None,
          baseline: Optional[dict] = None) -> str:
    """Every table: the figures (with the baseline's beside ours), PostgreSQL, export, the targets."""
    baseline = baseline or {"short": None, "figures": {}, "ratios": {}}
    extra = baseline_heads(baseline)
    heads = ["figure", "unit", "ours", *extra, "LangGraph", "DBOS", "DBOS (WAL)", "bare / raw / floor"]
    rows = []
    for name, f in figures.items():
        values = f["values"]
        limit = next((f"{c} {number(values[c])}" for c in LIMIT_COLUMNS if c in values), "-")
        ours = [number(values.get("ours")), *(baseline_cells(baseline["figures"].get(name)) if extra else [])]
        rows.append([f["label"], f["unit"], *ours, *(number(values.get(s)) for s in SYSTEMS[1:]), limit])
    lines = [markdown(heads, rows), "", *pg_table(postgresql), "", raw_line(figures)]
    if export:
        b1b = export["export_b1b_steps_per_s"]["values"]
        lines += [export_table(export), f"  collector ok / export off: {b1b['ok'] / b1b['off']:.2f} (no target)", ""]
    lines.append(markdown(["target", "value", *extra, "target", "result"],
                          [[c["label"], c.get("skipped") or number(c["value"]),
                            *(baseline_cells(baseline["ratios"].get(name)) if extra else []),
                            "(none)" if c["op"] is None else f"{c['op']} {c['target']:g}",
                            "-" if c["pass"] is None else "PASS" if c["pass"] else "FAIL"]
                           for name, c in checks.items()]))
    if extra:
        lines.append(f"÷ baseline: ours / baseline {baseline['short']}; {baseline['not_measured']}.")
    return "\n".join(lines)


def raw_line(figures: dict) -> str:
    """The machine's raw commit rate, printed beside the targets: they are ratios, it is what moves."""
    return (f"Targets. This machine's raw commit rate (SQLite WAL, synchronous=FULL, one 2 KB row a commit, same disk):"
            f" {number(figures['sqlite_commits_per_s']['values']['raw'])} commits/s,"
            f" median commit {number(figures['commit_latency_ms']['values']['raw'])} ms.")


def pg_table(postgresql: dict) -> list[str]:
    """The PostgreSQL section: what PostgreSQL it was and how durable its commits were, then the
    figures beside the SQLite server's."""
    settings, lines = postgresql["settings"], []
    if settings is None:
        lines.append(f"PostgreSQL: {postgresql['skipped']}")
    else:
        lines.append(f"PostgreSQL {settings['version']} at {settings['url']} (from {settings['source']}): "
                     f"fsync={settings['fsync']}, synchronous_commit={settings['synchronous_commit']}.")
        if settings["fsync_set_on_by_bench"]:
            lines.append(f"  fsync is {settings['cluster_fsync']} in the cluster's configuration; the bench set it on"
                         f" (ALTER SYSTEM, pg_reload_conf) for its duration and put it back afterwards.")
        if settings["fsync"] == "off":
            lines.append("  WARNING: fsync=off: PostgreSQL does not flush its WAL to disk on commit, so its commits"
                         " cost less than SQLite's synchronous=FULL; the PostgreSQL / SQLite ratio is not"
                         " like-for-like." + (f" ({settings['fsync_note']})" if settings["fsync_note"] else ""))
        if settings["fsync_at_end"] not in (None, settings["fsync"]):
            lines.append(f"  WARNING: fsync was {settings['fsync_at_end']} at the end of the measurements, not"
                         f" {settings['fsync']}: someone else changed it during the run.")
        if settings["cpu_note"]:
            lines.append(f"  {settings['cpu_note']}: its CPU rows are skipped.")
    rows = []
    for f in postgresql["figures"].values():
        cells = []
        for column in PG_COLUMNS:
            if column not in f["values"]:
                cells.append("-")
            elif f["values"][column] is None:
                cells.append(PG_SKIPPED if postgresql["skipped"] else "skipped")
            else:
                cells.append(number(f["values"][column]))
        rows.append([f["label"], f["unit"], *cells])
    lines.append(markdown(["figure", "unit", *(PG_HEADS[c] for c in PG_COLUMNS)], rows))
    return lines


def markdown(heads: list[str], rows: list[list[str]], left: int = 2) -> str:
    """A markdown table, its first `left` columns aligned left and the rest right."""
    widths = [max(len(str(r[i])) for r in [heads, *rows]) for i in range(len(heads))]

    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) if i < left else str(c).rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    return "\n".join([line(heads), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def connection_errors(bench: Bench, name: str) -> int:
    """The connection errors the SDK of `name` (ours or the baseline) saw in B1a, B1b and B3."""
    return (sum(got[phase][name].get("connection_errors", 0) for got in bench.rounds for phase in ("b1a", "b1b"))
            + sum(r.get("connection_errors", 0) for got in bench.rounds for r in got["b3"][name].values()))


def meta(bench: Bench, quick: bool, seconds: float) -> dict:
    return {
        **machine_meta(), "quick": quick, "seconds": round(seconds, 1),
        "plan": asdict(bench.plan), "workers": {name: w.info for name, w in bench.workers.items()},
        "rss_reset_worked": all(r.get("rss_reset") for r in bench.rounds),
        "ours_connection_errors": connection_errors(bench, "ours"),
        "baseline_connection_errors": connection_errors(bench, "baseline") if bench.baseline else None,
        "baseline_commit": bench.baseline.commit if bench.baseline else None,
        "dbos_fork_statuses": bench.once.get("dbos_fork_statuses"),
        "b4_dbos_fork_statuses": bench.once["b4"]["dbos_fork_statuses"],
        "disk": bench.once["disk"], "wal": bench.once["wal"], "folder_device": os.stat(bench.folder).st_dev,
    }


def spaced(text: str) -> str:
    """`text` with a blank line wherever a table starts or ends right against other text, so that
    markdown renders each table as one."""
    out: list[str] = []
    for line in text.splitlines():
        if out and out[-1].strip() and out[-1].startswith("|") != line.startswith("|"):
            out.append("")
        out.append(line)
    return "\n".join(out)


def docs_section(report: dict, tables: str) -> str:
    """What goes between the markers: when, where, which commits, the raw commit rate, every table."""
    m, base, f = report["meta"], report["baseline"], report["figures"]
    baseline = (f"baseline `{base['short']}` ({base['commit']}, {base['source']})" if base["short"]
                else f"no baseline ({base['skipped']})")
    return "\n".join([
        f"Run of {m['date']} on {m['machine']} ({m['cpu']}), Python {m['python']}, SQLite {m['sqlite']}:"
        f" {'quick' if m['quick'] else 'full'} run in {m['seconds']:.0f} s, medians of {m['plan']['rounds']} rounds.",
        "",
        f"Ours: actae `{m['actae_commit']}`; {baseline}.",
        "",
        f"This machine's raw SQLite commit rate (WAL, synchronous=FULL, one 2 KB row a commit, same disk):"
        f" {number(f['sqlite_commits_per_s']['values']['raw'])} commits/s,"
        f" median commit {number(f['commit_latency_ms']['values']['raw'])} ms.",
        "",
        spaced(tables),
    ])


def write_docs(path: Path, section: str, start_marker: str = DOCS_START, end_marker: str = DOCS_END) -> None:
    """Put `section` between the markers of `path` (the bench's; --feature-costs has its own pair),
    leaving every other byte as it was (someone else may be writing the rest of the file); a file
    without the markers gets them at its end, a missing one is created with a title. Written whole
    and renamed into place."""
    block = f"{start_marker}\n{section}\n{end_marker}"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = None
    start = -1 if text is None else text.find(start_marker)
    end = -1 if start < 0 else text.find(end_marker, start)
    if text is None:
        text = ("# Benchmarks\n\nThe tables of `python examples/bench.py`, written by the bench itself"
                " (`--docs`): edit outside the markers, the next run replaces what is between them.\n\n"
                f"{block}\n")
    elif end >= 0:
        text = text[:start] + block + text[end + len(end_marker):]
    else:
        text = text.rstrip("\n") + ("\n\n" if text.strip() else "") + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


# =============================================================================
# Command line
# =============================================================================


def missing_peers() -> list[str]:
    missing = []
    for module in PEER_MODULES:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(module)
    return missing


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, every figure, under a minute")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help=f"where the report goes (default {DEFAULT_JSON.relative_to(ROOT)}; with --feature-costs"
                             f" {DEFAULT_FEATURES_JSON.relative_to(ROOT)})")
    parser.add_argument("--rounds", type=int,
                        help="rounds of B1a, B1b, B3 and the limits (--feature-costs: its rounds, default 6)")
    parser.add_argument("--steps", type=int, help="B1a: steps of the one run")
    parser.add_argument("--run-steps", type=int, help="B1b: steps of each of the 32 runs")
    parser.add_argument("--dir", type=Path, help="put the temporary folder (every database) here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--b5", action="store_true", help="run only B5 (many runs; needs no peers)")
    only.add_argument("--feature-costs", action="store_true",
                      help="run only the write path's feature costs: B1b and a growing state on a fresh server with"
                           " each of bench_without.py's FEATURES switched off in turn (ACTAE_BENCH_WITHOUT), beside all on;"
                           " needs no peers")
    parser.add_argument("--baseline", nargs="?", const=BASELINE_AUTO, default=BASELINE_AUTO, metavar="REF",
                        help="also measure our server as of REF (a git worktree of it) in the same rounds, and"
                             " show ours / baseline; default, and with no REF: the newest tag, else the newest"
                             " commit before HEAD that changed actae.py; 'none' turns it off")
    parser.add_argument("--docs", type=Path, metavar="PATH",
                        help=f"write the tables between the bench markers of PATH (default for a full run:"
                             f" {DEFAULT_DOCS.relative_to(ROOT)}; a --quick run writes none unless given);"
                             f" --feature-costs writes its own, between the feature-costs markers")
    parser.add_argument("--postgres", metavar="URL",
                        help="also measure B1b on PostgreSQL: a maintenance-database URL whose user may"
                             " CREATE DATABASE (default $ACTAE_BENCH_DATABASE_URL, else $ACTAE_TEST_DATABASE_URL)")
    # The same file runs the measured systems and the bare endpoint as child processes.
    parser.add_argument("--worker", choices=(*SYSTEMS, "baseline"), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--bare-server", action="store_true", help=argparse.SUPPRESS)
    return parser


def run_bench(args: argparse.Namespace, plan: Plan, postgres: Optional[Postgres]) -> dict:
    """Start everything, run every phase, stop everything; the report."""
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="actae-bench-", dir=args.dir))
    baseline, why = prepare_baseline(args.baseline, folder)
    bench = Bench(plan, folder, postgres, baseline)
    try:
        bench.start()
        for number in range(1, plan.rounds + 1):
            bench.run_round(number)
        bench.run_forks()
        bench.run_probes()
        bench.run_disk()
        bench.run_b4()
        b5 = run_b5(folder, plan.b5_sizes)
        figures = summarise(bench)
        postgresql = summarise_postgres(bench)
        export = summarise_export(bench)
        checks = ratios(figures, plan, postgresql, export)
        return {"meta": meta(bench, args.quick, time.monotonic() - STARTED), "figures": figures,
                "ratios": checks, "baseline": compare_baseline(baseline, why, figures, checks, plan),
                "postgresql": postgresql, "export": export, "probes": bench.once["probe"],
                "b4": bench.once["b4"], "b5": b5, "rounds": bench.rounds}
    except BaseException:
        if getattr(bench, "server", None) is not None:
            say("the server's last lines:\n" + "\n".join(bench.server.lines))
        raise
    finally:
        bench.stop()
        if baseline is not None and baseline.worktree is not None:
            remove_worktree(baseline.worktree)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


def prepare_baseline(asked: str, folder: Path) -> tuple[Optional[Baseline], str]:
    """The baseline checked out in `folder`, or None and one line saying why the run goes without."""
    baseline, why = resolve_baseline(asked)
    if baseline is not None and (failed := add_worktree(baseline, folder)):
        baseline, why = None, f"git worktree add of {baseline.short} failed: {failed}"
    if baseline is None:
        print(f"bench: no baseline row: {why}; measuring ours and the peers only", file=sys.stderr, flush=True)
    else:
        say(f"baseline: {baseline.describe()}, a worktree at {baseline.worktree}")
    return baseline, why


def b5_only(args: argparse.Namespace) -> int:
    """`bench.py --b5 [--quick]`: B5 alone, printed and written as {"b5": ...}."""
    plan = QUICK if args.quick else Plan()
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="actae-bench-b5-", dir=args.dir))
    try:
        b5 = run_b5(folder, plan.b5_sizes)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"b5": b5}, indent=2) + "\n")
    print(b5_table(b5))
    print(f"\nreport: {args.json}")
    return 0


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return serve_worker(args)
    if args.bare_server:
        return serve_bare()
    if os.environ.pop(BENCH_WITHOUT_VAR, None) is not None:    # only --feature-costs' servers take it
        print(f"bench: ignoring {BENCH_WITHOUT_VAR} in this environment: the bench sets it per server"
              f" (--feature-costs)", file=sys.stderr)
    if args.feature_costs:
        return feature_costs_only(args)
    args.json = args.json or DEFAULT_JSON
    if args.b5:
        return b5_only(args)
    if missing := missing_peers():
        print(f"bench: cannot import {', '.join(missing)}; install the peers first:\n"
              f"    pip install -r examples/requirements-bench.txt", file=sys.stderr)
        return 2
    plan = QUICK if args.quick else Plan()
    plan = replace(plan, **{k: getattr(args, k) for k in ("rounds", "steps", "run_steps") if getattr(args, k)})
    url, source = postgres_url(args)
    # SIGTERM unwinds like Ctrl-C, so the finally below still stops everything, drops the
    # PostgreSQL databases and puts fsync back.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        postgres = Postgres(url, source) if url else None
    except ImportError:
        print("bench: measuring PostgreSQL needs psycopg 3: pip install 'psycopg[binary]'", file=sys.stderr)
        return 2
    try:
        if postgres is not None:
            try:
                postgres.open()
            except postgres.psycopg.Error as exc:
                print(f"bench: cannot use the PostgreSQL at {redacted(url)} (from {source}): {exc}", file=sys.stderr)
                return 2
        report = run_bench(args, plan, postgres)
    finally:
        if postgres is not None:
            postgres.close()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    figures, checks, base = report["figures"], report["ratios"], report["baseline"]
    m = report["meta"]
    print(f"{m['machine']} ({m['cpu']}), {m['date']}, actae {m['actae_commit']}, "
          + (f"baseline {base['short']} ({base['source']}), " if base["short"] else f"no baseline ({base['skipped']}), ")
          + f"{'quick' if args.quick else 'full'} run in {m['seconds']:.0f} s, medians of {plan.rounds} rounds\n")
    tables = table(figures, checks, report["postgresql"], report["export"], base) + f"\n\n{b5_table(report['b5'])}"
    print(tables)
    probe = report["probes"]
    print(f"\nprobe: the same ledger key with other params: ours {probe['ours']['mismatch']}")
    print(f"probe: the same DBOS workflow id with another input: {probe['dbos']['behaviour']}")
    print(f"\nreport: {args.json}")
    docs = args.docs or (None if args.quick else DEFAULT_DOCS)
    if docs is not None:
        write_docs(docs, docs_section(report, tables))
        print(f"tables: {docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
