"""Actae community server: record agent runs, fork them at an exact step, never fire a side effect twice.

One Starlette module holds the whole server: storage on WAL-mode SQLite (or on PostgreSQL, shared by
several servers, with --database postgresql://...), the HTTP API and
WebSocket that the `actae-client` SDK (1.3.0) speaks, the execution ledger, writer fencing, the
copy-on-write fork engine, the server-rendered dashboard and the command line.

Run it:  pip install -r requirements.txt && python actae.py
It prints the dashboard URL and, on first start, a one-time API key for the SDK:

    from actae_client import ActaeClient, AgentSession
    client = ActaeClient(endpoint="http://127.0.0.1:8002", api_key="sk-...")

The map: the kernel first, then the regions. The kernel holds what every capability needs and
nothing more; it names no region. Each region holds one capability whole (its records, queries,
domain functions, handlers, routes, pages and commands, under banners of its own) and plugs into
the kernel through one `declare(Region(...))` at its end; the regions come in dependency order. A
name is defined before the sections that read it at import time.

Kernel
Constants and vocabulary — limits, file names; run, execution, claim, ledger and failure states, grades, each once
Errors — ActaeError and its family; error_response (the request path) maps each to its HTTP answer, once
Small helpers — time, ids, canonical JSON, the event chain's hash
Regions — the Region record a capability declares once; the hooks the kernel builds from the declared ones
Request records — the bodies, queries and frames more than one region (or the kernel) decodes
Response records — the answers more than one region (or the kernel) gives; /openapi.json documents them all
Schema and migrations — the schema's one numbered history (the tables written before regions were; a region adds its parts by number)
Storage — the connection interface, one Dialect per backend, SQLite's and PostgreSQL's connections, the state cache
Database — the one writer path (group commit), a read on the writer between batches, the engines, backend_for, the CommitPolicy
Store — the queries more than one region (or the kernel's streams) needs, one named function each
Principals — API keys, accounts, login tokens, dashboard sessions: in the kernel, as every door asks them
Authentication — the key ring, token and session checks, same-origin and form tokens
HTTP API: the kernel's handlers — health, the instance, sign-in, preferences, keys, the OpenAPI document
HTTP API: the route table — Api, scopes, authorization, api_routes(), the OpenAPI document
Streams — the hub: in-band auth, shared frames bounded in bytes, one feed for "*", guarded credentials
Dashboard — rendering, sign-in, the keys and API pages, the forms' checks
Connections — BoundedHttp: each request's head and body bounded, in front of uvicorn's own protocol
The request path — ActaeApp, a plain ASGI app: Host check, routes, errors, gzip, headers, request notes, once
App factory — Services and create_app: the regions' hooks, the commit policy, the installers, the lifespan; the keys cipher
Command line — main(): serve, key, user, and the regions' subcommands

Regions
Runs: records — region: channels, events and state; the bodies and answers only it uses
Runs: channels, events and state — append_event (cursor, chain, the regions' event hooks), snapshots, state blame, metadata, steps, delete
Runs: the failure rule, runs by activity — what the runs list and a run's page show: a failure, the values it names, the fork that handled it
Runs: handlers, routes, pages and the /ws stream — the SDK's events and state, the runs pages, the WebSocket
Forks: records — region: copy-on-write forks
Forks: copy-on-write forks — receipts, the fork tree, what a fork saved (usage kept per step)
Forks: handlers, routes, the tree page and the fork form
Diff and outcome: records — region: diff, compare, trail, outcome, promote
Diff and outcome: diff, compare — the decision trail, outcome, promote
Diff and outcome: handlers, routes and the diff page
Ledger: records — region: the execution ledger and fork tool policies
Ledger: the execution ledger — claims, leases, replay, block, fork tool policies
Ledger: handlers, routes and the ledger page
Wake-ups: records — region: scheduled wake-ups
Wake-ups: stored wake-ups — the write that fires them, the scheduler task (one per app), across restarts
Wake-ups: handlers and routes
Groups: records — region: consumer groups and execution groups
Groups: consumer groups — at-least-once workers on one channel
Groups: execution groups — fenced member leases, durable messages, group forks
Groups: handlers and routes
Experiments — region: named groups of runs, ranked by score, side by side on a page, the winner promoted
Model calls: records and schema — region: the gateway in front of the model APIs; passes, its tables
Model calls: recording and replay — a call claimed, answered from the record or sent, its llm.call event, its price
Model calls: a run's calls on its page — each under its step, and a call's page: what the model was given and answered
Model calls: the gateway, its routes and commands — provider-shaped answers and errors, streams relayed and kept
Fork plans: records — region: the effect plan, what a fork would do before it is made
Fork plans: what a fork would do — the boundary, each effect's fate under the tool policies, the calls it would replay, the forecast
Fork plans: handlers, routes and the fork form's plan — POST /api/v1/forks/plan, the plan page, a fork's plan
Hand-offs: records and schema — region: forks the application's workers run; the jobs channel and group, the hand-off's row
Hand-offs: the job, and where it stands — announced in the fork's transaction (an event hook); waiting, claimed, running, done, failed from what is stored
Hand-offs: handlers, routes and the fork page's card — GET/POST /api/v1/channels/{id}/hand-off, the live card
Many runs: records and schema — region: the approvals inbox, bulk fork, retention; their records and tables
Many runs: the approvals inbox — the index of approval events (an event hook), listing, deciding
Many runs: bulk fork from failure — select by status, fork each run after its own last good step
Many runs: retention — prune whole runs that nothing needs, return the space, the daily prune
Many runs: handlers, routes, pages and commands — and its Region
MCP: the runs an agent can find, read and act on — region: /mcp (the official SDK, mounted), tools through the API's routes
Moving runs: export and import — region: JSON Lines files of a run and its lineage
Moving runs: routes and commands — over HTTP and from the command line
Observability: metrics — region: Prometheus /metrics, one registry per app, the stored-data gauges
Observability: traces — every run as an OpenTelemetry trace, live and backfilled
Observability: handlers, routes and commands — /metrics, /metrics.json, otel-export, the installer
Fleet: records and schema — region: the fleet gateway's records, its tables, its queries
Fleet: remote instances, organisation tokens — keys encrypted beside the database, fleet tokens, tickets
Fleet: the gateway's manifest, dispatch — local in process, remote over HTTP; keyset queries; the handlers
Fleet: event streams — the ticketed WebSocket and the NDJSON stream, local or relayed
Fleet: enrollment — an instance links itself to a gateway (enrollment tokens, enroll, unenroll, the release notice)
Fleet: routes, the Fleet page and commands — instance, org-token, and its Region
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import base64
import collections
import concurrent.futures
import contextlib
import difflib
import functools
import gzip
import hashlib
import hmac
import http.client
import importlib
import itertools
import json
import logging
import math
import os
import platform
import re
import secrets
import select
import socket
import sqlite3
import sys
import threading
import time
import typing
import uuid
import weakref
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Annotated, Any, Callable, ClassVar, Literal, Optional, Union
from urllib.parse import parse_qs, quote as urllib_quote, urlencode, urlsplit

import aiosqlite
import jinja2
import markupsafe
import msgspec
import prometheus_client
import uvicorn
import httptools
from starlette.requests import ClientDisconnect, HTTPConnection, Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import compile_path
from starlette.staticfiles import StaticFiles
from msgspec import UNSET, Meta, Struct, UnsetType
from starlette.websockets import WebSocket
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
# Traces: spans are built from the record (ReadableSpan) and sent by the SDK's batch processor
# through its OTLP/HTTP exporter (see "Observability: traces").
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

try:                                   # the PostgreSQL backend; SQLite needs nothing more
    import psycopg
    import psycopg_pool
    from psycopg.pq import TransactionStatus
except ImportError:                    # pragma: no cover - `--database postgresql://...` says what to install
    psycopg = psycopg_pool = None


# What the tests, the examples and the executable use; every other name is the module's own.
__all__ = ["ActaeApp", "ACTIVE_AT_CHARS", "api_routes", "app_endpoints", "append_event", "APPROVAL_DECISIONS",
           "APPROVAL_INDEXED", "APPROVAL_STATUSES", "backfill_chain", "BATCH_LEAD_MAX", "blocked_attempts",
           "BLOCKING_EVENT_TYPES", "bulk_fork_candidates", "BulkForkFilter", "canonical_json", "chain_parts",
           "chain_step", "channel_by_id", "CIRCUIT_FAILURES", "CIRCUIT_OPEN_SECONDS", "CLAIM_OUTCOMES",
           "CommitPolicy", "configure_sqlite", "Conflict", "connect_sync", "CountingExporter", "create_app",
           "Database", "DELTA_MIN_BYTES", "DOCUMENT_DEPTH_MAX", "event_facts_args", "EventHook", "EventQuery",
           "events_after_position", "EVERYWHERE", "EXECUTION_GROUP_STATUSES", "EXECUTION_STATES", "failure_event_sql",
           "FAILURE_STATES", "FLEET_MANIFEST", "fleet_operation_routes", "free_dependents", "GROUP_MESSAGE_STATUSES",
           "heads_from_events", "index_approval_event", "is_failure_event", "Job", "LEDGER_OUTCOMES",
           "list_approvals", "list_executions", "list_forks", "LLM_CALL_STATES", "completed_call_at",
           "delete_llm_calls", "Location", "main", "MAX_BODY_BYTES", "member_inbox",
           "Metrics", "MIGRATIONS", "next_wakeup_at", "observe_request", "openapi_document", "OUTCOMES", "page_routes",
           "POSTGRES",
           "prune_runs", "put_metadata", "PutMetadata", "query_events", "record_event", "RecordEvent",
           "Region", "REGIONS", "ReleaseNotice", "REPRODUCIBILITY_GRADES", "require_approval", "resolve_step",
           "Retention", "revoke_key", "run_jobs", "runs_page", "serve", "Services", "Settings", "sql_list", "SQLITE",
           "state_facts_args", "state_row_at", "TraceExport", "Tx", "usage_of", "uvicorn_config", "verify_chain",
           "WAKEUP_STATUSES", "WriteQueue", "WS_BACKLOG_BYTES", "__version__"]


def bundle_dir() -> Optional[Path]:
    """Where a PyInstaller executable unpacked its data (`sys._MEIPASS`, which PyInstaller documents
    for this), or None when running from source."""
    unpacked = getattr(sys, "_MEIPASS", None)
    return Path(unpacked) if unpacked else None


def stamped_version() -> Optional[str]:
    """The version .github/package.sh stamped into a release build (bundled as VERSION), else None."""
    try:
        return (bundle_dir() / "VERSION").read_text(encoding="utf-8").strip() or None
    except (TypeError, OSError):           # from source (no bundle), or a build nobody stamped
        return None


__version__ = stamped_version() or "0.1.0"


# =============================================================================
# Constants and vocabulary
# =============================================================================
# A free JSON document (a payload, a state, metadata, a tool's result) as the SDK sent it: msgspec
# decodes it to dict, list, str, int, float, bool or None, and nothing narrower can be said of it.
Json = Any

# A frozen executable unpacks its data into its bundle; from source, ui/ sits beside us.
UI_DIR = (bundle_dir() or Path(__file__).resolve().parent) / "ui"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8002
DB_FILE = "actae.db"

MAX_BODY_BYTES = 4 * 1024 * 1024       # a whole request
MAX_DOCUMENT_BYTES = 1024 * 1024       # one payload or state: the SDK caps WebSocket frames at 1 MiB
DRAIN_BYTES_MAX = 64 * 1024 * 1024     # an oversized body is read this far so its 413 reaches the client
REPLAY_LIMIT_MAX = 1000                # clamped, never rejected
EXECUTIONS_LIMIT_MAX = 100
LEASE_DEFAULT, LEASE_MIN, LEASE_MAX = 60, 1, 86400
INT64_MAX = 2**63 - 1                  # SQLite's INTEGER (and PostgreSQL's BIGINT) range
USAGE_COUNT_MAX = 10**15               # a step's token count above this is no count (and sums stay exact)
KEY_NAME_MAX_BYTES = 512
LINEAGE_MAX_DEPTH = 64                 # forks of forks; every lineage walk stops here
ID_BATCH = 500                         # ids per query where a list of ids is looked up or deleted in batches
DIFF_MAX_ENTRIES = 1000
WRITE_BATCH_MAX = 256
BATCH_TICK = timedelta(milliseconds=1)       # stored times' resolution: a writer's batches this apart,
BATCH_LEAD_MAX = timedelta(milliseconds=10)   # and at most this far ahead of the clock (batch_instant)
HERE_COMMIT_SECONDS_MAX = 0.002        # a lone write commits on the event loop's thread while commits take less
WS_QUEUE_MAX = 10_000                  # frames one WebSocket subscriber may leave unsent
WS_BACKLOG_BYTES = 8 * 1024 * 1024     # and bytes: past either, it is cut off (1013) and catches up on reconnect
CREDENTIAL_CHECK_SECONDS = 0.5         # an open stream's credential is checked again this often
STREAM_RETRY_SECONDS_MAX = 2.0         # a stream waiting for the database asks again at most this far apart
STREAM_IDLE_CHECK_SECONDS = 0.25       # an idle NDJSON stream looks this often whether it was ended
SESSION_COOKIE = "actae_session"
SESSION_MAX_AGE = 7 * 24 * 3600
KEY_REFRESH_SECONDS = 1.0              # a key revoked by another process stops working within this
KEY_MISS_RELOAD_SECONDS = 0.1          # an unknown key re-reads the keys when they are older than this
TOKEN_SECRET_FILE = "token_secret"     # signs login tokens; beside the database, never inside it
# Encrypts the keys of other servers kept in the database (the fleet's remote instances, the model
# gateway's upstreams); beside the database, never inside it. Named for its first user, and kept so.
KEYS_CIPHER_FILE = "fleet_key"
TOKEN_TTL_SECONDS = 24 * 3600
KEY_TOUCH_SECONDS = 60                 # a key's last_used_at is written at most this often
# scrypt at 2**14 x 8 x 1 costs 16 MiB and tens of milliseconds: slow for a guesser, fine for a login.
SCRYPT_N, SCRYPT_R, SCRYPT_P, SCRYPT_MAXMEM = 2**14, 8, 1, 64 * 1024 * 1024
ACTIONS = ("read", "write", "delete", "admin")
ADMIN_SCOPES = {action: ["*"] for action in ACTIONS}
CHAIN_GENESIS = "0" * 64               # the "previous hash" of a run's first event

# Used with fullmatch ("abc\n" must fail). Not "." or "..": browsers and proxies rewrite /runs/.. away.
CHANNEL_ID = re.compile(r"(?!\.\.?\Z)[A-Za-z0-9._:-]{1,256}")
TOOL_POLICIES = ("auto", "replay", "block", "live")
# The vocabulary of states, one tuple each, for the SQL, the Python checks and the records alike.
OUTCOMES = ("promoted", "rejected", "inconclusive", "crashed")
WAKEUP_STATUSES = ("pending", "done", "failed", "cancelled")
EXECUTION_GROUP_STATUSES = ("active",)                 # the first is a new group's
GROUP_MESSAGE_STATUSES = ("delivered", "acknowledged")
# An execution in the ledger: running (claimed; its token holder may complete it), completed (its
# result is stored; claims replay it), failed, cancelled, interrupted, expired (a claim takes them over).
EXECUTION_STATES = ("running", "completed", "failed", "cancelled", "interrupted", "expired")
EXECUTION_RETRYABLE = ("running", "failed", "interrupted", "expired")   # what cancel releases
CLAIM_OUTCOMES = ("claimed", "reclaimed", "replayed", "in_progress")
# What the ledger answered a claim, as actae_ledger_claims_total counts it: a claim's outcome, or the
# 409 for a key reused with other params (mismatch), or a fork's tool policy refusing it (blocked).
LEDGER_OUTCOMES = (*CLAIM_OUTCOMES, "mismatch", "blocked")
# A fork's reproducibility, strongest first (see reproducibility_grade).
REPRODUCIBILITY_GRADES = ("state_exact", "context_exact", "execution_replayable", "best_effort")
# A run as the dashboard and the lists show it (computed by run_state_sql). "failed" as a filter
# is every failure, crashes included; "crashed" only those.
RUN_STATES = ("created", "started", "stepping", "completed", "failed", "crashed", "blocked", "recorded")
WAKEUP_BATCH = 100                     # wake-ups fired per write transaction
MEMBER_POLICIES = ("fork", "share")    # group fork: a member's channel is forked, or shared as it is
# The ledger row AgentSession(fence_owner=...) claims as its writer lock: a fence, not a side effect.
SESSION_FENCE = ("__session_lock__", "agent.session")
# Keys a fork manifest must name for the strongest reproducibility grade, `context_exact`.
CONTEXT_EXACT_KEYS = ("model", "environment", "dependencies", "seed")


log = logging.getLogger("actae")

@dataclass(frozen=True)
class Settings:
    """What the command line tunes: who may reach the server, and the bounds on each connection."""

    host: str = DEFAULT_HOST
    allow_hosts: tuple = ()            # Host names served besides the bound address and loopback names
    max_connections: int = 2048        # beyond this, requests get 503 until connections close
    header_timeout: float = 10.0       # seconds for a request's headers (and for a WebSocket's auth frame)
    keepalive_timeout: float = 20.0    # idle keep-alive; above the SDK's 15 s pool, or its reused sockets race the close
    body_timeout: float = 30.0         # seconds a request body may take to arrive, all of it
    max_header_bytes: int = 64 * 1024  # request line and headers
    max_headers: int = 100
    open_signup: bool = False          # anyone may create an account (else only an admin key may)


# The run states that went wrong: a status filter's "failed" takes both, and so does a bulk fork.
FAILURE_STATES = ("failed", "crashed")
# What makes a run failed (the runs page, its trace's status, bulk fork's selection and /metrics all
# read the one run_state column this decides): an event whose type is `error` or ends in `.error` or
# `.failed` (`llm.error`, `step.failed`, any framework adapter's), except the ledger's own
# `tool.failed` (a failed attempt that the next claim takes over, not the run's end); a latest state
# snapshot whose `status` is failed or error; the SDK marking the session failed (its metadata's
# `status`, as when the code it runs raised). `crashed` is the SDK's status or the run's outcome.
FAILURE_EVENT_SUFFIXES = (".error", ".failed")
FAILURE_EVENT_EXCEPTIONS = ("tool.failed",)
# The events that leave a run waiting (run_state "blocked") while they are its last.
BLOCKING_EVENT_TYPES = ("tool.blocked", "approval.requested", "approval.expired")
# A stored timestamp's first characters, "YYYY-MM-DDTHH:MM:SS": the second a run was last active
# (its row's active_at, what the runs pages' indexes hold; kept by a trigger: see activity_second_schema).
ACTIVE_AT_CHARS = 19
# What a step spent, by one rule (usage_of): each figure under the names agents, framework adapters
# (Codex CLI's `*_token_count`), the SDK's own OTel bridge and the OpenTelemetry GenAI conventions give
# it, looked up in the event's payload, its `output`, `input` and `usage`, then the event's metadata;
# the first place that has it wins. Token counts may be decimal strings: OTLP's JSON writes 64-bit
# integers so, and adapters pass them on. A step is an event with a step number, or one that reports
# a token count or a cost without one (an adapter's model call); a numbered step that names none of
# them spent an unknown amount, never zero. A payload marked `"measured": true` (a model call the
# server itself recorded, and priced) is no step's report: its figures are kept apart, so usage an
# application reports for the same call is never counted twice.
USAGE_NAMES = (
    ("input_tokens", ("input_tokens", "prompt_tokens", "tokens", "input_token_count", "gen_ai.usage.input_tokens"),
     int),
    ("output_tokens", ("output_tokens", "completion_tokens", "output_token_count", "gen_ai.usage.output_tokens"),
     int),
    ("cost", ("cost", "cost_usd", "gen_ai.usage.cost"), float),
    ("model", ("model", "request_model", "gen_ai.request.model", "gen_ai.response.model"), str),
    ("duration_ms", ("duration_ms", "latency_ms"), float),
)
SPEND_FIGURES = ("input_tokens", "output_tokens", "cost")
SPEND_NAMES = frozenset(name for figure, names, _ in USAGE_NAMES if figure in SPEND_FIGURES for name in names)


FAILED_STATE_STATUSES = ("failed", "error")


# =============================================================================
# Errors: one exception family, mapped to HTTP in one place (error_response)
# =============================================================================

class ActaeError(Exception):
    """A failure the client should see as `{"status": code, "error": message}` with `status` HTTP.
    A subclass names its own: `class NotFound(ActaeError, status=404, code="not_found")`."""

    status = 500
    code = "internal"

    def __init_subclass__(cls, status: Optional[int] = None, code: Optional[str] = None, **kwargs: object):
        super().__init_subclass__(**kwargs)
        cls.status = status or cls.status
        cls.code = code or cls.code

    def __init__(self, message: str, *, code: Optional[str] = None, status: Optional[int] = None):
        super().__init__(message)
        self.message = message
        self.code = code or self.code
        self.status = status or self.status


class BadRequest(ActaeError, status=400, code="bad_request"):
    """The input is not what the route takes: its shape, a bound, an unknown name."""


class Unauthorized(ActaeError, status=401, code="unauthorized"):
    """No credential, or one that is wrong, expired or revoked."""


class Forbidden(ActaeError, status=403, code="forbidden"):
    """A valid credential whose scopes do not grant the action (on a run it may read)."""


class NotFound(ActaeError, status=404, code="not_found"):
    """What was named does not exist, or the caller may not read it: the two are one answer."""


class Conflict(ActaeError, status=409):
    """`code` names the SDK exception (version_conflict, idempotency_conflict, ...)."""

    def __init__(self, code: str, message: str):
        super().__init__(message, code=code)


class TooLarge(ActaeError, status=413, code="payload_too_large"):
    """A body, a document or a header over its limit."""


class Internal(ActaeError, status=500, code="internal"):
    """A bug: answered like any other error (the connection stays usable), logged where it happened."""


class ShuttingDown(ActaeError, status=503, code="shutting_down"):
    def __init__(self):
        super().__init__("the server is shutting down; retry against the next instance")


class DatabaseUnavailable(ActaeError, status=503, code="database_unavailable"):
    """The database cannot be reached. A write that met it may or may not have committed;
    retrying with the same operation_id is safe."""


class UnsupportedOperation(ActaeError, status=426, code="unsupported_operation"):
    """The fleet gateway does not dispatch this manifest operation (logins, sessions: not fleet commands)."""


def error_body(code: str, message: str) -> bytes:
    """The one error shape every refusal carries, whoever writes it (handler, protocol, Host check)."""
    return msgspec.json.encode({"status": code, "error": message})


def execution_not_found(execution_id: str) -> NotFound:
    # The Python SDK looks for this word in the message, the Go SDK in the status: send both.
    return NotFound(f"execution_not_found: execution {execution_id} does not exist", code="execution_not_found")


def channel_closed(channel_id: str) -> Conflict:
    return Conflict("channel_closed", f"run {channel_id} is closed: it takes no more events or states "
                                      "(reads, forks and diffs still work; fork it to continue)")


# =============================================================================
# Small helpers: time, ids, canonical JSON
# =============================================================================

def is_failure_event(event_type: str) -> bool:
    """Whether an event says its run went wrong (see FAILURE_EVENT_SUFFIXES): append_event notes a
    run's first one on the channel row (error_cursor)."""
    return event_type == "error" or (event_type.endswith(FAILURE_EVENT_SUFFIXES)
                                     and event_type not in FAILURE_EVENT_EXCEPTIONS)


def failure_event_sql(dialect: "Dialect", column: str) -> str:
    """is_failure_event as SQL over an event type `column` (case-sensitive, as in Python)."""
    ends = " OR ".join(dialect.ends_with(column, suffix) for suffix in FAILURE_EVENT_SUFFIXES)
    return f"({column} = 'error' OR (({ends}) AND {column} NOT IN ({sql_list(FAILURE_EVENT_EXCEPTIONS)})))"


def usage_places(payload: Json, metadata: Json) -> list:
    """Where a step's usage and gen_ai figures are looked for, in order (see USAGE_NAMES)."""
    places = []
    if isinstance(payload, dict):
        places.append(payload)
        for key in ("output", "input"):
            if isinstance(payload.get(key), dict):
                places.append(payload[key])
        places += [p["usage"] for p in list(places) if isinstance(p.get("usage"), dict)]
    if isinstance(metadata, dict):
        places.append(metadata)
    return places


def usage_of(payload: Json, metadata: Json) -> Optional[dict]:
    """A step's usage by the one rule (USAGE_NAMES): {figure: value} of those it names, None when it
    names no token count and no cost (its spend is unknown)."""
    places = usage_places(payload, metadata)
    if all(SPEND_NAMES.isdisjoint(place) for place in places):   # most events: no spend named, ~1 us
        return None
    if isinstance(payload, dict) and payload.get("measured") is True:
        return None
    found = {}
    for figure, names, kind in USAGE_NAMES:
        for place in places:
            value = next((place[n] for n in names if n in place), None)
            if isinstance(value, bool) or value is None or value == "":
                continue
            if kind is float and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0:
                found[figure] = float(value)
                break
            if kind is int and isinstance(value, str) and value.isascii() and value.isdigit() and len(value) < 19:
                value = int(value)
            if kind is int and isinstance(value, int) and 0 <= value <= USAGE_COUNT_MAX:
                found[figure] = value
                break
            if kind is str and isinstance(value, str):
                found[figure] = value[:200]
                break
    return found if found.keys() & SPEND_FIGURES else None


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def iso(moment: datetime) -> str:
    """RFC 3339 UTC with milliseconds; fixed width (year 210 is 0210), so these strings sort like the instants."""
    m = moment.astimezone(timezone.utc)
    return (f"{m.year:04d}-{m.month:02d}-{m.day:02d}T{m.hour:02d}:{m.minute:02d}:{m.second:02d}."
            f"{m.microsecond // 1000:03d}Z")


def parse_iso(text: str) -> datetime:
    """Parse an RFC 3339 timestamp that names its zone; raises BadRequest otherwise."""
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
        if moment.tzinfo is None:
            raise BadRequest(f"timestamp needs a zone (Z or +00:00): {text!r}")
        return moment.astimezone(timezone.utc)
    except (ValueError, AttributeError, OverflowError):      # OverflowError: year 1 or 9999 moved to UTC
        raise BadRequest(f"not an RFC 3339 timestamp: {text!r:.80}")


def stored_instant(text: object) -> Optional[datetime]:
    """A stored timestamp as an instant, or None when it is not one (a damaged row): whatever reads
    what is stored shows such a value as missing instead of failing."""
    try:
        return parse_iso(text)
    except BadRequest:
        return None


def seconds_since(stamp: Optional[str], now: float) -> float:
    """Seconds from a stored instant to `now` (a Unix time); 0 for none, or a damaged one."""
    moment = stored_instant(stamp) if stamp else None
    return max(0.0, now - moment.timestamp()) if moment else 0.0


def uuid7() -> str:
    """A time-ordered UUID (version 7): event ids sort by creation, which keeps indexes compact."""
    value = (time.time_ns() // 1_000_000) << 80 | int.from_bytes(secrets.token_bytes(10), "big")
    value = (value & ~(0xF << 76)) | (0x7 << 76)          # version
    value = (value & ~(0x3 << 62)) | (0x2 << 62)          # RFC 4122 variant
    return str(uuid.UUID(int=value))


def is_number(value: Json) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def canonical_json(value: Json) -> str:
    """Keys sorted, `,`/`:` separators, UTF-8 text (no ASCII escaping): the form we hash and document.

    It is json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False),
    written by msgspec (a tenth of the time: the hash of every event and state is on the write
    path) wherever msgspec writes the same bytes. It does, but for floats in exponent form (1e16
    for 1e+16, 0.00001 for 1e-05) and NaN or infinities (null, where json refuses them), and it
    refuses what json takes (lone surrogates, keys that are not strings): an output that may hold
    any of those, or a refusal, is written by json instead. tests/test_canonical_json.py holds
    the two equal."""
    try:
        out = _SORTED_JSON.encode(value)
    except (TypeError, ValueError, OverflowError):    # json's own error, or json's own answer
        return reference_canonical_json(value)
    if b"0.0000" in out or b"null" in out or _FLOAT_EXPONENT.search(out):
        return reference_canonical_json(value)
    return out.decode("utf-8")


def reference_canonical_json(value: Json) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


_SORTED_JSON = msgspec.json.Encoder(order="sorted")
_FLOAT_EXPONENT = re.compile(rb"e[-0-9]")               # msgspec's exponent: 1e16, 1.5e-7


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def same_secret(given: str, expected: str) -> bool:
    """Constant-time comparison of two secrets, on bytes (compare_digest refuses non-ASCII str)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))


def dump(value: Json) -> Optional[str]:
    """Serialise a stored JSON column (compact UTF-8, keys in the order given); None stays SQL NULL."""
    return None if value is None else msgspec.json.encode(value).decode("utf-8")


def load(text: Optional[str]) -> Json:
    return None if text is None else json.loads(text)


DAMAGED = "this stored value does not parse as JSON: it was changed outside Actae"


def load_stored(text: Optional[str]) -> Json:
    """A stored JSON column for reading: one that no longer parses (a row edited by hand) reads as
    {"actae_damaged": ...}, so the list or page showing it renders the rest."""
    try:
        return load(text)
    except ValueError:
        return {"actae_damaged": DAMAGED}


STATE_PACK_MIN = 256                   # shorter states are stored as text: compression would not pay


def pack_state(text: Optional[str]) -> Union[str, bytes, None]:
    """A state snapshot as stored: zlib-compressed when that is smaller (agent states are wordy and
    repetitive, and a snapshot per step dominates the disk). The API, the canonical JSON and the
    sha256 are computed from the JSON, never from these bytes."""
    if text is None or len(text) < STATE_PACK_MIN:
        return text
    raw = text.encode("utf-8")
    packed = zlib.compress(raw, 1)
    return packed if len(packed) < len(raw) else text


def load_state(stored: Union[str, bytes, None]) -> Json:
    return json.loads(zlib.decompress(stored)) if isinstance(stored, bytes) else load(stored)


def state_status(state: Json) -> Optional[str]:
    """A snapshot's top-level "status", kept beside it so pages can filter without unpacking it."""
    status = state.get("status") if isinstance(state, dict) else None
    return status if isinstance(status, str) else None


def canonical_dump(value: Json) -> Optional[str]:
    """A stored JSON column in canonical form, so the event chain can hash the stored text as it is."""
    return None if value is None else canonical_json(value)


_encode_string = json.encoder.encode_basestring   # C-accelerated; what json.dumps(ensure_ascii=False) writes


def json_scalar(value: Union[str, int, None]) -> str:
    """json.dumps(value, ensure_ascii=False) for a string, an integer or None, without its set-up cost."""
    if value is None:
        return "null"
    return _encode_string(value) if isinstance(value, str) else str(value)


def chain_parts(*, channel_id: str, event_id: str, event_type: str, payload_text: Optional[str], actor: str,
                agent_id: Optional[str], user_id: Optional[str], metadata_text: Optional[str],
                step_number: Optional[int], depends_on: Optional[str], timestamp: str) -> tuple:
    """The canonical JSON of an event's immutable fields, split around its cursor: (head, tail).

    head + str(cursor) + tail == canonical_json({actor, agent_id, channel_id, cursor, depends_on, id,
    metadata, payload, step_number, timestamp, type, user_id}) when the payload and metadata texts are
    canonical (as append_event stores them), so a payload is never encoded twice.
    """
    text = json_scalar
    head = f'{{"actor":{text(actor)},"agent_id":{text(agent_id)},"channel_id":{text(channel_id)},"cursor":'
    tail = (f',"depends_on":{text(depends_on)},"id":{text(event_id)},"metadata":{metadata_text or "null"},'
            f'"payload":{payload_text or "null"},"step_number":{text(step_number)},"timestamp":{text(timestamp)},'
            f'"type":{text(event_type)},"user_id":{text(user_id)}}}')
    return head, tail


def chain_step(previous: Optional[str], head: str, cursor: int, tail: str) -> str:
    """SHA-256 over the previous chain hash (64 hex characters) then the event's canonical JSON (UTF-8)."""
    digest = hashlib.sha256((previous or CHAIN_GENESIS).encode("ascii"))
    digest.update(head.encode("utf-8", "surrogatepass"))
    digest.update(str(cursor).encode("ascii"))
    digest.update(tail.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def row_chain_hash(previous: Optional[str], row: Row) -> str:
    """The chain hash a stored event row (a Row or a dict of its columns) should carry, from its stored text."""
    head, tail = chain_parts(
        channel_id=row["channel_id"], event_id=row["id"], event_type=row["type"], payload_text=row["payload"],
        actor=row["actor"], agent_id=row["agent_id"], user_id=row["user_id"], metadata_text=row["metadata"],
        step_number=row["step_number"], depends_on=row["depends_on"], timestamp=row["created_at"])
    return chain_step(previous, head, row["cursor"], tail)


def quote_segment(value: str) -> str:
    """One path segment, percent-encoded (an id in a URL this server writes)."""
    return urllib_quote(value, safe="")


def is_int(value: Json) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def valid_channel(value: Json, what: str = "channel_id") -> str:
    if not isinstance(value, str) or not CHANNEL_ID.fullmatch(value):
        raise BadRequest(f"{what} must be 1-256 characters of A-Z a-z 0-9 . _ : -, not . or .. (got {value!r:.80})")
    return value


MISSING = object()


# =============================================================================
# Regions: the one declaration by which a capability plugs into the kernel
# =============================================================================
# The kernel names no region. A region (after the command line) ends with `declare(Region(...))`:
# one record of everything it adds. create_app builds one app's hooks (Hooks) from the regions it
# serves (every declared one unless `regions=` names fewer), so a region left out is simply absent.
# Two things are the database's, not an app's: every declared region's schema is migrated, and its
# rows of a deleted run are deleted, whichever regions an app serves, so a database served once
# without a region is whole again when served with it.

@dataclass(frozen=True)
class SchemaPart:
    """What a region adds to migration step `number` (see MIGRATIONS), after the kernel's part:
    the SQL `schema(words)` renders for each backend, then `run(conn)`."""

    number: int
    schema: Optional[Callable[["SchemaWords"], str]] = None
    run: Optional[Callable[["Conn"], None]] = None


@dataclass(frozen=True)
class EventHook:
    """`hook(tx, event)` inside append_event's transaction, for each event of these types."""

    types: tuple[str, ...]
    hook: Callable[["Tx", "Event"], None]


@dataclass(frozen=True)
class Installed:
    """What a region's installer built into one app: its services (kept by their types: the app's
    `services.region(Kind)`), what runs once the database is open, what runs before it closes, and
    who hears each committed batch (its jobs, their outcomes, its seconds)."""

    services: tuple[object, ...] = ()
    starts: tuple[Callable, ...] = ()
    stops: tuple[Callable, ...] = ()
    on_batch: Optional[Callable[[list, list, float], None]] = None


@dataclass(frozen=True)
class NavLink:
    """A link of the dashboard's top bar: its text, its page, the `active` name its page renders with,
    and its place (the kernel's and the regions' links are shown by place)."""

    label: str
    path: str
    active: str
    place: int
    admin: bool = False                         # shown to an admin only


@dataclass(frozen=True)
class Region:
    """One capability's whole tie to the kernel, declared once. Every field is optional."""

    name: str
    features: tuple[str, ...] = ()              # what /api/v1/instance lists for it
    schema: tuple[SchemaPart, ...] = ()
    event_hooks: tuple[EventHook, ...] = ()
    # `reindex(conn, channel_id)` after a run's events were written without append_event (an import):
    # what the event hooks would have kept for them.
    reindexers: tuple[Callable[["Conn", str], None], ...] = ()
    # `delete(tx, channel_id)` inside the transaction that deletes a run: the rows the region keeps of it.
    deleters: tuple[Callable[["Tx", str], None], ...] = ()
    routes: tuple["Api", ...] = ()              # the HTTP API's routes, after the kernel's
    pages: tuple[tuple[str, str, Callable], ...] = ()    # the dashboard's (method, path, handler)
    endpoints: tuple["Endpoint", ...] = ()      # neither a route nor a page (streams, WebSockets)
    # Paths answered with the JSON error body, not an error page (a trailing "/": every path under it).
    json_paths: tuple[str, ...] = ()
    wrappers: tuple[Callable[["Api", Callable], Callable], ...] = ()   # around every API route's endpoint
    authenticators: tuple[tuple[str, Callable[["Request", "Api"], typing.Awaitable["Principal"]]], ...] = ()
    # `observe(services, route, method, status, seconds)` for every finished request.
    request_observers: tuple[Callable[["Services", str, str, int, float], None], ...] = ()
    # `install(services, options) -> Installed`: its service in one app; `options` are create_app's
    # keywords the kernel does not take (`otlp=`, `organization=`).
    installers: tuple[Callable[["Services", dict], Installed], ...] = ()
    # The command line: `add(commands, common, scoped)` adds its subcommands (each `set_defaults(run=...)`),
    # `flag(parser)` a flag of `serve`, `read(args) -> dict` turns them into create_app's keywords.
    commands: tuple[Callable[..., None], ...] = ()
    serve_flags: tuple[Callable[[argparse.ArgumentParser], None], ...] = ()
    options: tuple[Callable[[argparse.Namespace], dict], ...] = ()
    banner_lines: tuple[Callable[[dict], Optional[str]], ...] = ()     # `line(options)`, before the key
    page_notices: tuple[Callable[["Services"], Optional[str]], ...] = ()   # a line atop every page
    nav: tuple[NavLink, ...] = ()               # its pages' links in the top bar
    # What it adds to a run's page: `part(conn, channel_id) -> dict`, merged into the page's context.
    run_page_parts: tuple[Callable[["Conn", str], dict], ...] = ()
    # What it measured a fork did not spend again: `measure(conn, channel_id) -> MeasuredSpend | None`
    # (the model-call gateway's recorded calls), shown beside what the steps reported.
    savings_measures: tuple[Callable[["Conn", str], Optional["MeasuredSpend"]], ...] = ()
    # Its writes that are small, quick, and on the path of a run that waits for each (an SDK step, a
    # fork, a ledger call): alone on the server, one of these commits on the event loop's thread.
    lone_writes: tuple[Callable, ...] = ()
    # Its writes that change only their own channels' rows (and read others' committed ones), each
    # with `channels_of(*args)`: on PostgreSQL a batch of these locks those channels, not the instance
    # (see POSTGRES_WRITE_LOCK). An event's hooks must then write rows of its channel only.
    channel_writes: tuple[tuple[Callable, Callable[..., tuple]], ...] = ()


# The kernel's links in the dashboard's top bar (a region adds its own: Region.nav).
KERNEL_NAV = (NavLink("API", "/api", "api", place=60), NavLink("Keys", "/keys", "keys", place=70, admin=True))

# Every declared region, in file (dependency) order.
REGIONS: list[Region] = []


def declare(region: Region) -> Region:
    if any(known.name == region.name for known in REGIONS):
        raise RuntimeError(f"region {region.name!r} is declared twice")
    REGIONS.append(region)
    return region


@dataclass(frozen=True)
class StoreHooks:
    """What storage runs for the regions: event hooks and reindexers (the app's regions), deleters
    (every declared region: its tables are there whether an app serves it or not)."""

    events: dict[str, tuple[Callable[["Tx", "Event"], None], ...]]
    reindexers: tuple[Callable[["Conn", str], None], ...]
    deleters: tuple[Callable[["Tx", str], None], ...]


@functools.lru_cache(maxsize=None)
def store_hooks(regions: tuple[Region, ...], declared: tuple[Region, ...]) -> StoreHooks:
    events: dict[str, tuple] = {}
    for region in regions:
        for event_hook in region.event_hooks:
            for event_type in event_hook.types:
                events[event_type] = events.get(event_type, ()) + (event_hook.hook,)
    return StoreHooks(events=events, reindexers=tuple(r for region in regions for r in region.reindexers),
                      deleters=tuple(d for region in declared for d in region.deleters))


def declared_store_hooks() -> StoreHooks:
    """The command line's (and any write outside an app's): every declared region's."""
    return store_hooks(tuple(REGIONS), tuple(REGIONS))


def schema_parts(number: int) -> list[SchemaPart]:
    """What the declared regions add to migration step `number`, in declaration order."""
    return [part for region in REGIONS for part in region.schema if part.number == number]


@dataclass(frozen=True)
class Hooks:
    """One app's regions, and what the request path and the app factory read of them."""

    regions: tuple[Region, ...]
    store: StoreHooks
    routes: tuple["Api", ...]
    pages: tuple[tuple[str, str, Callable], ...]
    endpoints: tuple["Endpoint", ...]
    json_paths: tuple[str, ...]
    features: tuple[str, ...]
    wrappers: tuple[Callable, ...]
    authenticators: dict[str, Callable]
    request_observers: tuple[Callable, ...]
    page_notices: tuple[Callable, ...]
    nav: tuple[NavLink, ...]                    # the kernel's links and the regions', by place
    run_page_parts: tuple[Callable, ...]
    savings_measures: tuple[Callable, ...]
    lone_writes: tuple[Callable, ...]
    channel_writes: tuple[tuple[Callable, Callable], ...]


def hooks_of(regions: Optional[typing.Sequence[Region]] = None) -> Hooks:
    """The hooks of `regions` (by default every declared region)."""
    chosen = tuple(REGIONS if regions is None else regions)

    def every(name: str) -> tuple:
        return tuple(item for region in chosen for item in getattr(region, name))
    return Hooks(regions=chosen, store=store_hooks(chosen, tuple(REGIONS)), routes=every("routes"),
                 pages=every("pages"), endpoints=every("endpoints"), json_paths=every("json_paths"),
                 features=every("features"), wrappers=every("wrappers"), authenticators=dict(every("authenticators")),
                 request_observers=every("request_observers"), page_notices=every("page_notices"),
                 nav=tuple(sorted((*KERNEL_NAV, *every("nav")), key=lambda link: link.place)),
                 run_page_parts=every("run_page_parts"), savings_measures=every("savings_measures"),
                 lone_writes=every("lone_writes"),
                 channel_writes=every("channel_writes"))


# =============================================================================
# Request records: every body, query string, path and WebSocket frame, declared once
# =============================================================================
# Each record is decoded by `decode_body` / `decode_params` / `decode_frame` and nothing else:
# types, int64 ranges, string and list lengths come from the annotations, the nesting depth of
# free-form documents from `check_documents`. The same declarations generate /openapi.json.

INT64_MIN = -(2**63)
DOCUMENT_DEPTH_MAX = 64                # one limit for payloads, states, metadata, interventions, frames
LIST_MAX = 1000                        # channel_ids, dedup_fields, dependencies
CHANNEL_PATTERN = rf"^{CHANNEL_ID.pattern}\Z"   # \Z, not $: "abc\n" must fail

Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Meta(ge=0, le=INT64_MAX)]
Positive = Annotated[int, Meta(ge=1, le=INT64_MAX)]
Limit = Annotated[int, Meta(ge=1, le=INT64_MAX, description="clamped to the route's maximum, never rejected")]
Lease = Annotated[int, Meta(ge=LEASE_MIN, le=LEASE_MAX, description="seconds")]
ChannelId = Annotated[str, Meta(pattern=CHANNEL_PATTERN,
                                 description="1-256 characters of A-Z a-z 0-9 . _ : -, not . or ..")]
Topic = Annotated[str, Meta(pattern=rf"^(?:\*\Z|{CHANNEL_ID.pattern}\Z)",
                             description='a channel id, or "*": every channel the key may read')]
Id = Annotated[str, Meta(min_length=1, max_length=256)]
Name = Annotated[str, Meta(min_length=1, max_length=512)]          # event types, tools, keys, owners
Token = Annotated[str, Meta(max_length=512)]                       # operation ids, claim tokens
Label = Annotated[str, Meta(max_length=4096)]                      # display names, actors, roles
LongText = Annotated[str, Meta(max_length=MAX_DOCUMENT_BYTES)]     # reasons, messages, stack traces
Document = Annotated[Json, Meta(description=f"any JSON value, at most {DOCUMENT_DEPTH_MAX} levels deep")]
JsonObject = Annotated[dict[str, Json], Meta(description=f"a JSON object, at most {DOCUMENT_DEPTH_MAX} levels deep")]
Timestamp = Annotated[datetime, Meta(tz=True, description="RFC 3339 with a zone (Z or +00:00)")]
ToolPolicies = dict[Label, Literal[TOOL_POLICIES]]


class Record(Struct, kw_only=True, forbid_unknown_fields=False):
    """A request shape. Unknown fields are ignored: newer SDKs may send more than we read."""


class Empty(Record):
    """No fields: the SDK sends nothing, or an object we do not read."""


class Idempotent(Record):
    operation_id: Optional[Token] = None

    def __post_init__(self):
        self.operation_id = self.operation_id or None       # an empty operation id counts as none


class ClampedLimit(Record):
    """Replay and list limits are clamped to LIMIT_MAX, never rejected (the SDK asks for more)."""

    LIMIT_MAX: ClassVar[int] = REPLAY_LIMIT_MAX
    limit: Limit = 100

    def __post_init__(self):
        self.limit = min(self.limit, self.LIMIT_MAX)


# --- events and state ---------------------------------------------------------------


class EventMeta(Record):
    actor: Optional[Label] = None
    agent_id: Optional[Label] = None
    user_id: Optional[Label] = None
    metadata: Optional[JsonObject] = None


class EventFields(Idempotent, kw_only=True):
    """What record, transition and WebSocket publish share."""

    channel_id: ChannelId
    payload: Document = None
    metadata: Optional[EventMeta] = None

    def meta(self) -> EventMeta:
        return self.metadata or EventMeta()

    def actor(self) -> str:
        return self.meta().actor or "system"


class RecordEvent(EventFields, kw_only=True):
    event_type: Name
    step_number: Optional[Positive] = None
    dependencies: Optional[Annotated[list[dict[Label, Label]], Meta(max_length=LIST_MAX)]] = None


class EventQuery(ClampedLimit):
    channel_ids: Optional[Annotated[list[ChannelId], Meta(max_length=LIST_MAX)]] = None
    event_type: Optional[Name] = None
    actor: Optional[Label] = None
    cursor_start: Optional[Count] = None
    cursor_end: Optional[Count] = None
    since: Optional[Timestamp] = msgspec.field(default=None, name="from")
    until: Optional[Timestamp] = msgspec.field(default=None, name="to")
    offset: Count = 0

    def __post_init__(self):
        super().__post_init__()
        check_utc(self.since)
        check_utc(self.until)


class SaveState(Idempotent, kw_only=True):
    channel_id: Optional[ChannelId] = None   # the SDK repeats the path's channel; another one is refused
    cursor: Count
    state: Document = None
    expected_version: Optional[Count] = None
    expected_cursor: Optional[Count] = None


class Fork(Idempotent, kw_only=True):
    """POST /channels/fork; the dashboard's fork form builds the same record."""

    source_channel_id: ChannelId
    new_channel_id: ChannelId
    at_cursor: Count = 0
    display_name: Optional[Label] = None
    reason: Optional[LongText] = None
    experiment_metadata: Optional[JsonObject] = None
    manifest: Optional[JsonObject] = None
    tool_policies: Optional[ToolPolicies] = None
    expected_version: Optional[Count] = None
    expected_cursor: Optional[Count] = None
    # Hand the fork to the application's workers: its fork.started says so, and a region that runs
    # handed-off forks announces it as a job (the hand-offs region).
    hand_off: bool = False

    def __post_init__(self):
        super().__post_init__()
        self.tool_policies = self.tool_policies or None


# --- keys, accounts, preferences --------------------------------------------------------------

# A scope pattern: "*", a prefix ending in "*", or one exact channel id.
ScopePattern = Annotated[str, Meta(pattern=r"^(\*|[A-Za-z0-9._:-]{1,256}\*?)\Z",
                                   description='"*", a prefix ending in "*", or an exact channel id')]
Patterns = Annotated[list[ScopePattern], Meta(max_length=100)]


class Scopes(Record):
    """Channel patterns per action; any admin pattern grants every action on what it matches."""

    read: Patterns = msgspec.field(default_factory=list)
    write: Patterns = msgspec.field(default_factory=list)
    delete: Patterns = msgspec.field(default_factory=list)
    admin: Patterns = msgspec.field(default_factory=list)


class CreateKey(Record):
    name: Annotated[str, Meta(min_length=1, max_length=200)]
    scopes: Scopes
    expires_in_days: Optional[Annotated[float, Meta(gt=0, le=36500)]] = None


class Signup(Record):
    email: Annotated[str, Meta(max_length=320, pattern=r"^[^@\s]+@[^@\s]+\Z")]
    password: Annotated[str, Meta(min_length=8, max_length=1024)]
    name: Optional[Label] = None
    scopes: Optional[Scopes] = None       # only an admin key may grant them; the SDK never sends any


class Login(Record):
    # Loose on purpose: a malformed address is a wrong login (401), like any other.
    email: Annotated[str, Meta(max_length=320)]
    password: Annotated[str, Meta(max_length=1024)]


class ApiKeyLogin(Record):
    api_key: Optional[Token] = None       # else the x-api-key header's key


class PutPreferences(Record):
    preferences: JsonObject


# --- WebSocket frames (tagged by "type") ------------------------------------------------


class Frame(Record, tag_field="type", kw_only=True):
    request_id: Optional[Union[Id, Int64]] = None


class AuthFrame(Frame, tag="auth", kw_only=True):
    api_key: Optional[Token] = None


class SubscribeFrame(Frame, tag="subscribe", kw_only=True):
    topic: Topic                               # "*": every channel the key may read; `cursor` is then a position
    cursor: Optional[Count] = None


class UnsubscribeFrame(Frame, tag="unsubscribe", kw_only=True):
    topic: Topic


class PublishFrame(Frame, tag="broadcast", kw_only=True):
    topic: ChannelId
    payload: Document = None
    operation_id: Optional[Token] = None


class PingFrame(Frame, tag="ping", kw_only=True):
    pass


ClientFrame = Union[AuthFrame, SubscribeFrame, UnsubscribeFrame, PublishFrame, PingFrame]


# --- dashboard pages -------------------------------------------------------------------------


class TimelineQuery(Record):
    start: Positive = 1


PageText = Annotated[str, Meta(max_length=4096)]       # a page's free query text; the page checks what it means


class RunPageQuery(TimelineQuery):
    type: Annotated[str, Meta(max_length=256)] = ""     # only events of this type ("steps": only steps)
    step: Optional[Positive] = None                       # jump to this step
    fork_step: Optional[Positive] = None                  # open the fork form at this step
    fork_error: Optional[PageText] = None                 # the flash id of a refused fork form
    created: PageText = ""                                # "1" right after the fork was made


class ErrorBody(Struct):
    """Every error answer: `status` names the error (the SDK maps it to an exception), `error` says why."""

    status: str
    error: str


# --- decoding: the one place input becomes a record ---------------------------------------


def check_utc(moment: Optional[datetime]) -> None:
    """A timestamp must also be representable in UTC (year 1 at +05:00 is not)."""
    if moment is not None:
        try:
            moment.astimezone(timezone.utc)
        except OverflowError:
            raise ValueError("timestamp is out of range once moved to UTC") from None


def may_be_deep(raw: Union[bytes, str]) -> bool:
    """False when the text has too few brackets to nest past the limit (most bodies): no walk needed."""
    square, curly = (b"[", b"{") if isinstance(raw, bytes) else ("[", "{")
    return raw.count(square) + raw.count(curly) > DOCUMENT_DEPTH_MAX


def document_problem(value: Json) -> Optional[str]:
    """Why a free-form JSON value cannot be stored (nested too deeply), or None.

    Its numbers are stored as written: a document's integers may exceed 64 bits and round-trip.
    """
    pending = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)):
            if depth >= DOCUMENT_DEPTH_MAX:
                return f"is nested more than {DOCUMENT_DEPTH_MAX} levels deep"
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return None


def check_documents(record: Struct, *, measure: bool) -> None:
    """Every free-form value in a record: its depth (400); with `measure`, its size (413)."""
    for name in record.__struct_fields__:
        value = getattr(record, name)
        if isinstance(value, Struct):
            check_documents(value, measure=measure)
        elif isinstance(value, (dict, list)):
            problem = document_problem(value)
            if problem:
                raise BadRequest(f"{name} {problem}")
            if measure and len(msgspec.json.encode(value)) > MAX_DOCUMENT_BYTES:
                raise TooLarge(f"{name} is larger than {MAX_DOCUMENT_BYTES} bytes")
        elif measure and isinstance(value, str) and len(value) > MAX_DOCUMENT_BYTES // 4:
            # A bare string is a document too (a payload or a state may be one); short ones cost nothing.
            if len(msgspec.json.encode(value)) > MAX_DOCUMENT_BYTES:
                raise TooLarge(f"{name} is larger than {MAX_DOCUMENT_BYTES} bytes")


@functools.cache
def decoder_for(kind: type) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(kind)


def unwrapped(info: object, fixed_set: bool = False) -> Optional[object]:
    """A msgspec.inspect type without its Meta and its Optional: the first member of a union that is
    not null (with `fixed_set`, the first that is a Literal or an Enum)."""
    mi = msgspec.inspect
    wanted = ((lambda t: isinstance(t, (mi.LiteralType, mi.EnumType, mi.Metadata))) if fixed_set
              else (lambda t: not isinstance(t, mi.NoneType)))
    while isinstance(info, (mi.Metadata, mi.UnionType)):
        info = info.type if isinstance(info, mi.Metadata) else next(filter(wanted, info.types), None)
    return info


def type_at(kind: object, where: str) -> Optional[object]:
    """The msgspec.inspect type of the value at `where` (msgspec's error path: `.name`, `[0]`) in `kind`."""
    mi = msgspec.inspect
    info = mi.type_info(kind)
    for step in re.findall(r"\.([^.\[]+)|\[([^\]]*)\]", where):
        name, index = step
        info = unwrapped(info)
        if name and isinstance(info, mi.StructType):
            info = next((f.type for f in info.fields if f.encode_name == name), None)
        elif index and isinstance(info, (mi.ListType, mi.SetType, mi.VarTupleType)):
            info = info.item_type
        elif index and isinstance(info, mi.DictType):
            info = info.value_type
        else:
            return None
    return info


def in_words(exc: msgspec.ValidationError, kind: object) -> str:
    """msgspec's message, saying in words what the field takes where it names only a regular
    expression, and listing a fixed set's values where it says only that one was not among them."""
    text = str(exc)
    try:
        return explained(text, kind)
    except Exception:  # noqa: BLE001 - explaining an error never makes one: msgspec's own message, then
        return text


def explained(text: str, kind: object) -> str:
    message, _, where = text.partition(" - at `$")
    where = where.rstrip("`")
    info, mi = type_at(kind, where), msgspec.inspect
    names = re.sub(r"\[[^\]]*\]", "", where).split(".")
    field = names[-1] or "the value"
    described = info.extra_json_schema.get("description") if isinstance(info, mi.Metadata) and info.extra_json_schema else None
    info = unwrapped(info, fixed_set=True)
    if message.startswith("Invalid enum value") and isinstance(info, (mi.LiteralType, mi.EnumType)):
        values = info.values if isinstance(info, mi.LiteralType) else [m.value for m in info.cls]
        return f"{text}: {field} must be one of {', '.join(map(str, values))}"
    if "matching regex" in message and described:
        return f"{field} must be {described}" + (f" (at `${where}`)" if where.count(".") > 1 or "[" in where else "")
    return text


def decode_json(raw: bytes, kind: object, what: str) -> Json:
    """Strict JSON (no NaN, no lone surrogates, finite numbers) into `kind`; BadRequest otherwise."""
    try:
        return decoder_for(kind).decode(raw)
    except RecursionError:
        raise BadRequest(f"{what} is nested too deeply") from None
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid {what}: {in_words(exc, kind)}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"{what} is not valid JSON: {exc}") from None


def decode_body(raw: bytes, kind: type, *, optional: bool = False) -> Struct:
    """A JSON body as a record; an empty body is allowed only where the SDK sends none."""
    if not raw.strip():
        if optional:
            return kind()
        raise BadRequest("request body is empty; a JSON object is required")
    try:
        raw.decode("utf-8")     # fields we skip are not decoded, so msgspec would not notice bad bytes in them
    except UnicodeDecodeError as exc:
        raise BadRequest(f"request body is not UTF-8: {exc.reason} at byte {exc.start}") from None
    record = decode_json(raw, kind, "request body")
    large = len(raw) > MAX_DOCUMENT_BYTES
    if large or may_be_deep(raw):
        check_documents(record, measure=large)
    return record


def decode_params(params: Json, kind: type, what: str) -> Struct:
    """Path or query parameters (strings) as a record; numbers and booleans are parsed from text."""
    try:
        return msgspec.convert(dict(params), kind, strict=False)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid {what}: {in_words(exc, kind)}") from None


def record_from(kind: type, value: dict, what: str) -> Struct:
    """A record from values the server assembled itself (the dashboard's forms), checked like a body."""
    try:
        record = msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid {what}: {in_words(exc, kind)}") from None
    check_documents(record, measure=True)
    return record


def decode_frame(text: str) -> Frame:
    frame = decode_json(text, ClientFrame, "frame")
    if may_be_deep(text):
        check_documents(frame, measure=False)
    return frame


PATH_PARAMETERS = {
    "channel_id": ChannelId, "group_id": ChannelId, "member_id": ChannelId, "fork_group_id": ChannelId,
    "version": Count, "step_number": Positive,
    "event_id": Id, "execution_id": Id, "wakeup_id": Id, "message_id": Id, "key_id": Positive,
    "organization_id": Id, "instance_id": Id, "operation_id": Id,     # the fleet gateway's routes
    "request_id": Id,
}


@functools.cache
def path_record(path: str) -> Optional[type]:
    """The record of a route's path parameters, built from their names (one type per name), once per path."""
    names = re.findall(r"{(\w+)}", path)
    if not names:
        return None
    return msgspec.defstruct("Path_" + "_".join(names), [(n, PATH_PARAMETERS[n]) for n in names],
                             kw_only=True, forbid_unknown_fields=False)


# =============================================================================
# Response records: every API answer, declared once
# =============================================================================
# Domain functions build these; `api_response` encodes them (msgspec, one path) and
# /openapi.json documents each route's 2xx answer from the same declarations. Field names,
# types and nullability are what the SDK reads: a field that is absent in some answers is
# `UNSET` (left out), one that may be null is Optional. Free-form documents are `Json`.

class Answer(Struct, kw_only=True):
    """A response shape."""


class Done(Answer):
    ok: bool = True


# --- events and state ---------------------------------------------------------------


class Event(Answer):
    """The one event shape every parser of the SDK accepts (REST replay, query, WebSocket broadcast)."""

    id: str
    channel_id: str
    type: str
    payload: Json
    actor: str
    cursor: int
    channel_cursor: int
    timestamp: str
    agent_id: Optional[str]
    user_id: Optional[str]
    metadata: Json
    depends_on: Optional[str]
    step_number: Optional[int]
    chain_hash: Optional[str]


class EventAnswer(Answer):
    event: Event


class SavedState(Answer):
    version: int


class DeletedId(Done, kw_only=True):
    deleted: str


# --- channels, forks, diffs -----------------------------------------------------------------


class ChannelIds(Answer):
    channels: list[str]


class ChannelMetadata(Answer):
    """The STRICT shape: the SDK passes these keys to a fixed constructor, so no others."""

    channel_id: str
    parent_channel_id: Optional[str]
    origin_run_id: str
    forked_at_cursor: Optional[int]
    forked_at: str
    display_name: Optional[str]
    reason: Optional[str]
    experiment_metadata: Json
    requested_at_cursor: Optional[int]
    resolved_cursor: Optional[int]
    resolved_state_cursor: Optional[int]
    resolved_event_id: Optional[str]
    source_state_version: Optional[int]
    source_state_sha256: Optional[str]
    restorable: bool
    manifest: Json
    reproducibility: Optional[str]
    tool_policies: Optional[dict[str, str]]
    outcome: Optional[str]
    result_score: Optional[float]
    deleted_at: None = None


class Forks(Answer):
    forks: list[ChannelMetadata]


class Receipt(Answer):
    """The immutable fork receipt: what the fork asked for, what it inherited, how faithful it is."""

    fork_id: str
    channel_id: str
    child_channel_id: str
    source_channel_id: Optional[str]
    origin_run_id: str
    requested_cursor: Optional[int]
    resolved_cursor: Optional[int]
    resolved_state_cursor: Optional[int]
    resolved_event_id: Optional[str]
    forked_at_step: Optional[int]
    source_state_version: Optional[int]
    source_state_sha256: Optional[str]
    restorable: bool
    replayed: bool
    manifest: Json
    reproducibility: Optional[str]
    tool_policies: Optional[dict[str, str]]
    forked_at: Optional[str]


# --- experiments ---------------------------------------------------------------------------


# --- the execution ledger ------------------------------------------------------------------------


class Execution(Answer):
    id: str
    channel_id: str
    key_name: str
    tool_name: str
    status: Literal[EXECUTION_STATES]
    attempts: int
    lease_until: Optional[str]
    started_cursor: Optional[int]
    completed_cursor: Optional[int]
    started_event_id: Optional[str]
    completed_event_id: Optional[str]
    replay_emitted: bool
    params: Json
    result: Json
    error: Json
    inherited_from: Optional[str]
    created_at: str
    updated_at: str
    completed_at: Optional[str]


class Claimed(Answer):
    """A claim: `claim_token` when this caller now owns the execution, `result` when it replayed."""

    status: Literal[CLAIM_OUTCOMES]
    execution: Execution
    claim_token: Union[str, UnsetType] = UNSET
    result: Json = UNSET


# --- principals, keys, accounts -----------------------------------------------------------------


class Permissions(Answer):
    read: list[str]
    write: list[str]
    delete: list[str]
    admin: list[str]


class Capabilities(Answer):
    """The caller's true scopes and expiry, in the grammar the SDK's can_read/can_write evaluate."""

    permissions: Permissions
    auth_method: str
    key_id: str
    key_source: str
    expires_at: Optional[str]


class KeyInfo(Answer):
    """A key as `key list` and the Keys page show it: never the key itself."""

    id: int
    name: Optional[str]
    prefix: str
    scopes: Permissions
    created_at: str
    last_used_at: Optional[str]
    expires_at: Optional[str]
    revoked_at: Optional[str]


class NewKey(KeyInfo):
    """A created key: its listing plus, this once, the key itself."""

    key: str


class Keys(Answer):
    keys: list[KeyInfo]


class UserInfo(Answer, kw_only=True):
    """The SDK's UserInfo (a key exchanged for a token answers as a user without an address)."""

    id: str
    email: Optional[str]
    email_verified: bool = False
    name: Optional[str]
    image: Optional[str] = None
    created_at: str


class GrantedUser(UserInfo, kw_only=True):
    scopes: Permissions


class LoggedIn(Answer):
    user: UserInfo
    token: str


class Me(Answer):
    user: UserInfo


class AuthConfig(Answer):
    methods: list[str]
    signup: Literal["open", "admin"]
    open_signup: bool
    token_type: str
    token_ttl_seconds: int
    password_min_length: int
    email_verification: bool


class Preferences(Answer):
    preferences: dict[str, Json]
    updated_at: Optional[str]


# --- this server ------------------------------------------------------------------------------------


# What a server says of itself, bounded: a gateway decodes a remote's answer with this record, and
# shows and stores what it says (a remote's 5,000-digit version is refused, never rendered).
ShortText = Annotated[str, Meta(max_length=64)]


class Instance(Answer):
    version: ShortText
    api_version: ShortText
    instance_id: Annotated[str, Meta(min_length=1, max_length=128)]
    backend: Literal["sqlite", "postgresql"]
    started_at: ShortText
    uptime_seconds: int
    features: Annotated[list[ShortText], Meta(max_length=256)]
    open_signup: bool


class ComponentStatus(Answer):
    status: str
    connections: Union[int, UnsetType] = UNSET


class Components(Answer):
    database: ComponentStatus
    websocket: ComponentStatus


class ReadinessChecks(Answer):
    database_ready: bool
    capacity_available: bool
    uptime_seconds: int
    connection_utilization: float
    active_connections: int
    max_connections: int


class Health(Answer):
    """/healthz carries `version` and `components`, /readyz `readiness_checks`."""

    status: str
    timestamp: str
    instance_id: str
    check_duration_ms: int
    version: Union[str, UnsetType] = UNSET
    components: Union[Components, UnsetType] = UNSET
    readiness_checks: Union[ReadinessChecks, UnsetType] = UNSET


class OpenApiDocument(Answer):
    """This server's OpenAPI 3.1 description: every path, body, query, answer and error shape."""

    openapi: str
    info: dict[str, Json]
    paths: dict[str, Json]
    components: dict[str, Json]
    security: list[dict[str, Json]]


# =============================================================================
# Schema and migrations: the one place the SQL schema lives
# =============================================================================

def backfill_chain(conn: Conn) -> None:
    """Chain the events written before the chain existed: parents before their forks, payload and
    metadata rewritten in canonical form (the same JSON values), so every run verifies.
    """
    pending = [r for r in conn.execute("SELECT id, parent_id, resolved_cursor FROM channels ORDER BY created_at, id")]
    done: set = set()
    while pending:
        ready = [r for r in pending if r["parent_id"] is None or r["parent_id"] in done
                 or conn.execute("SELECT 1 FROM channels WHERE id = ?", (r["parent_id"],)).fetchone() is None]
        if not ready:
            ready = pending               # a parent cycle cannot be built by the API; do not loop for ever
        for channel in ready:
            previous = None
            if channel["parent_id"] is not None and channel["resolved_cursor"] > 0:
                at = conn.execute("SELECT chain_hash FROM events WHERE channel_id = ? AND cursor = ?",
                                  (channel["parent_id"], channel["resolved_cursor"])).fetchone()
                previous = at["chain_hash"] if at else None
            for row in channel_event_rows(conn, channel["id"]):
                fields = dict(row)
                fields["payload"], fields["metadata"] = (canonical_dump(load(fields["payload"])),
                                                         canonical_dump(load(fields["metadata"])))
                previous = row_chain_hash(previous, fields)
                conn.execute("UPDATE events SET payload = ?, metadata = ?, chain_hash = ? WHERE channel_id = ?"
                             " AND cursor = ?", (fields["payload"], fields["metadata"], previous, row["channel_id"],
                                                 row["cursor"]))
            conn.execute("UPDATE channels SET chain_head = ? WHERE id = ?", (previous, channel["id"]))
            done.add(channel["id"])
        pending = [r for r in pending if r["id"] not in done]


# One schema for both backends: each step is written once, as a template rendered with the words
# its backend spells differently (SchemaWords), and runs as one transaction on SQLite. PostgreSQL's
# INTEGER is 32 bits, so BIGINT wherever SQLite has its (64-bit) INTEGER; a state's column holds text
# or zlib bytes on SQLite (TEXT affinity keeps either), always the bytes on PostgreSQL (BYTEA: one
# column there cannot hold both).
@dataclass(frozen=True)
class SchemaWords:
    name: str                  # the backend's name (Backend.name): what Migration.only is keyed by
    dialect: "Dialect"         # for the expressions (json_text, run_state_sql)
    integer: str
    real: str
    serial: str                # an integer primary key the database numbers itself
    packed: str                # a state's column
    generated: str             # how a computed column is kept


def schema_words(dialect: "Dialect") -> SchemaWords:
    if dialect is SQLITE:
        return SchemaWords("sqlite", dialect, "INTEGER", "REAL", "INTEGER PRIMARY KEY", "TEXT", "VIRTUAL")
    return SchemaWords("postgresql", dialect, "BIGINT", "DOUBLE PRECISION",
                       "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY", "BYTEA", "STORED")


def sql_list(values: tuple) -> str:
    """A vocabulary constant as a CHECK's IN list, so the schema and the code share one vocabulary."""
    return ", ".join(f"'{value}'" for value in values)


@dataclass(frozen=True)
class Migration:
    """One step of the schema: the SQL both backends render from `schema`, then `run` (a function of
    the connection, for what SQL cannot compute), then what one backend alone needs (`only`: its name
    to SQL text or a function of the connection)."""

    number: int                                         # its place in MIGRATIONS, from 1 (SQLite's user_version)
    schema: Optional[Callable[[SchemaWords], str]] = None
    run: Optional[Callable[["Conn"], None]] = None
    only: dict[str, Union[str, Callable[["Conn"], None]]] = field(default_factory=dict)

    @property
    def postgres(self) -> int:
        """Its version in PostgreSQL's actae_migrations: steps 1-5 are version 1 (PostgreSQL started
        there, in one script), every later step the next version of its own."""
        return max(1, self.number - POSTGRES_FIRST_STEPS + 1)

    def parts(self, dialect: "Dialect") -> list:
        """What this step runs on `dialect`'s backend, in order: SQL text, or functions of the
        connection; the core's part first, then what the declared regions add to it (Region.schema)."""
        words = schema_words(dialect)
        parts = ([self.schema(words)] if self.schema else []) + ([self.run] if self.run else []) + (
            [self.only[words.name]] if words.name in self.only else [])
        for part in schema_parts(self.number):
            parts += ([part.schema(words)] if part.schema else []) + ([part.run] if part.run else [])
        return parts


def run_script(conn: "Conn", script: str) -> None:
    """A script's statements one at a time, inside the caller's transaction (sqlite3's executescript
    would commit it first); SQLite's tokenizer says where each ends, so a `;` in a comment is no end."""
    statement = ""
    for line in script.splitlines(keepends=True):
        statement += line
        if sqlite3.complete_statement(statement):
            conn.execute(statement)
            statement = ""
    if statement.strip():
        conn.execute(statement)


# What a runs page shows per run lives on the channel row, kept there by the write path (the facts
# UPDATEs after append_event and insert_state), so listing, filtering and selecting runs costs
# one page of an index, not a pass over every run.
def run_facts(w: SchemaWords) -> str:
    # The type of the event at last_cursor; the first failure event (is_failure_event); the latest snapshot's
    # "status". One ALTER a column: SQLite's takes no more. (No comment after a column: SQLite keeps
    # the text, and the table's definition with it.)
    return f"""
    ALTER TABLE channels ADD COLUMN last_event_type TEXT;
    ALTER TABLE channels ADD COLUMN error_cursor {w.integer};
    ALTER TABLE channels ADD COLUMN last_state_status TEXT
    """


# The first runs page lists roots by last activity, from an index of the roots only (a fork's events
# do not touch it). SQLite's planner takes it with parent_id in front (its IS NULL is an equality
# there, and it preferred channels_by_parent and a sort while that held the roots); PostgreSQL's
# orders only without.
# (The key's time column was updated_at until the activity second; see activity_second_schema.)
def roots_index_key(w: SchemaWords, time_column: str) -> str:
    return {"sqlite": f"parent_id, {time_column}, id", "postgresql": f"{time_column}, id"}[w.name]


def run_fact_indexes(w: SchemaWords) -> str:
    return f"""
    CREATE INDEX channels_by_state ON channels (run_state, updated_at, id);
    CREATE INDEX channels_by_origin ON channels (origin_id, created_at, id);
    CREATE INDEX channels_roots_by_activity ON channels ({roots_index_key(w, "updated_at")}) WHERE parent_id IS NULL
    """


def run_state_column(w: SchemaWords) -> str:
    """The run-state column, computed by the database from the row (see run_state_sql)."""
    return f"""
    ALTER TABLE channels ADD COLUMN run_state TEXT GENERATED ALWAYS AS ({run_state_sql(w.dialect)}) {w.generated}
    """


# PostgreSQL computes every stored generated column again on every UPDATE of its row, whatever the
# UPDATE names, and run_state_sql reads the SDK's status out of experiment_metadata four times, each
# a JSON parse (eight with the object test): on every event's counter UPDATE. A plpgsql function,
# which the planner never inlines, parses it once. Backend CPU per event: about 50 µs less.
def run_state_by_function(conn: "Conn") -> None:
    conn.execute(f"""
CREATE OR REPLACE FUNCTION actae_run_state(experiment_metadata TEXT, outcome TEXT, last_state_status TEXT,
                                error_cursor BIGINT, last_event_type TEXT) RETURNS TEXT
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    metadata JSONB := experiment_metadata::jsonb;
    sdk_status TEXT := CASE WHEN jsonb_typeof(metadata) = 'object' THEN metadata ->> 'status' END;
BEGIN
    RETURN {run_state_sql(POSTGRES, "sdk_status")};
END $$;
DROP INDEX channels_by_state;
ALTER TABLE channels DROP COLUMN run_state;
{RUN_STATE_BY_FUNCTION};
{CHANNELS_BY_STATE}
""")


# actae_run_state's arguments: the columns of a channel's row its state is computed from.
RUN_STATE_INPUTS = ("experiment_metadata", "outcome", "last_state_status", "error_cursor", "last_event_type")


def run_state_call(row: str = "") -> str:
    """actae_run_state over RUN_STATE_INPUTS, each read from `row` (e.g. "NEW.") or the table."""
    return f"actae_run_state({', '.join(row + column for column in RUN_STATE_INPUTS)})"


RUN_STATE_BY_FUNCTION = f"ALTER TABLE channels ADD COLUMN run_state TEXT GENERATED ALWAYS AS ({run_state_call()}) STORED"


def migrate_run_facts(conn: "Conn") -> None:
    """The columns and indexes of the runs list, filled in for the runs already stored: a page of an
    old database shows after this exactly what it showed before."""
    words = schema_words(conn.dialect)
    run_script(conn, run_facts(words))
    refresh_run_facts(conn)
    run_script(conn, run_state_column(words))
    run_script(conn, run_fact_indexes(words))


def base_schema(w: SchemaWords) -> str:
    return f"""
    CREATE TABLE settings (
        name  TEXT PRIMARY KEY,
        value TEXT NOT NULL
    );

    CREATE TABLE api_keys (
        id          {w.serial},
        key_hash    TEXT NOT NULL UNIQUE,      -- sha256 of the key; the key itself is never stored
        prefix      TEXT NOT NULL,             -- first characters, to tell keys apart
        created_at  TEXT NOT NULL,
        revoked_at  TEXT                       -- set by `key rotate`
    );

    -- A run. A fork is a row with a parent pointer and a boundary, never a copy of history.
    CREATE TABLE channels (
        id                   TEXT PRIMARY KEY,
        parent_id            TEXT REFERENCES channels(id),
        origin_id            TEXT NOT NULL,    -- root of the lineage (itself for roots)
        created_at           TEXT NOT NULL,
        updated_at           TEXT NOT NULL,    -- last activity
        last_cursor          {w.integer} NOT NULL DEFAULT 0,  -- per-channel gapless cursor counter
        state_version        {w.integer} NOT NULL DEFAULT 0,  -- per-channel state version counter
        display_name         TEXT,
        reason               TEXT,
        experiment_metadata  TEXT,             -- JSON object owned by the SDK, stored verbatim
        forked_at            TEXT,
        requested_cursor     {w.integer} NOT NULL DEFAULT 0,
        resolved_cursor      {w.integer} NOT NULL DEFAULT 0,  -- parent snapshot cursor inherited
        resolved_event_id    TEXT,
        forked_at_step       {w.integer},          -- steps 1..k are owned by the ancestors
        source_state_version {w.integer} NOT NULL DEFAULT 0,
        source_state_sha256  TEXT,
        restorable           {w.integer} NOT NULL DEFAULT 0 CHECK (restorable IN (0, 1)),
        manifest             TEXT,
        reproducibility      TEXT CHECK (reproducibility IN ({sql_list(REPRODUCIBILITY_GRADES)})),
        tool_policies        TEXT,             -- JSON map tool|"*" -> auto|replay|block|live
        fork_operation_id    TEXT,
        fork_request_hash    TEXT,
        outcome              TEXT CHECK (outcome IN ({sql_list(OUTCOMES)})),
        result_score         {w.real},
        promoted_event_id    TEXT,             -- the parent's channel.promoted event, once promoted
        promoted_version     {w.integer}           -- which of this fork's state versions was promoted
    );
    CREATE INDEX channels_by_parent ON channels (parent_id);
    CREATE INDEX channels_by_activity ON channels (updated_at, id);
    CREATE UNIQUE INDEX channels_fork_operation ON channels (fork_operation_id);  -- a fork op id names one fork

    -- The append-only log: per-channel gapless cursors from 1.
    CREATE TABLE events (
        channel_id    TEXT NOT NULL REFERENCES channels(id),
        cursor        {w.integer} NOT NULL,
        id            TEXT NOT NULL UNIQUE,
        type          TEXT NOT NULL,
        payload       TEXT,
        actor         TEXT NOT NULL,
        agent_id      TEXT,
        user_id       TEXT,
        metadata      TEXT,
        operation_id  TEXT,
        request_hash  TEXT,
        step_number   {w.integer} CHECK (step_number >= 1),
        depends_on    TEXT,
        dependencies  TEXT,
        created_at    TEXT NOT NULL,
        PRIMARY KEY (channel_id, cursor)
    );
    CREATE UNIQUE INDEX events_operation ON events (channel_id, operation_id);
    CREATE INDEX events_by_step ON events (channel_id, step_number);
    CREATE INDEX events_by_type ON events (type, created_at);
    CREATE INDEX events_by_time ON events (created_at);

    -- Immutable state snapshots, each aligned with an event cursor.
    CREATE TABLE states (
        channel_id    TEXT NOT NULL REFERENCES channels(id),
        version       {w.integer} NOT NULL,
        cursor        {w.integer} NOT NULL,
        state         {w.packed},
        sha256        TEXT NOT NULL,
        operation_id  TEXT,
        created_at    TEXT NOT NULL,
        PRIMARY KEY (channel_id, version)
    );
    CREATE INDEX states_by_cursor ON states (channel_id, cursor, version);
    CREATE UNIQUE INDEX states_operation ON states (channel_id, operation_id);
    """


def sessions_schema(w: SchemaWords) -> str:
    return """
    -- Dashboard sessions live on the server: the cookie holds a random id, this table only its hash,
    -- so reading the database does not give anyone a session.
    CREATE TABLE sessions (
        id_hash     TEXT PRIMARY KEY,          -- sha256 of the cookie's id
        key_ref     TEXT NOT NULL,             -- sha256 of the API key that logged in, or 'env'
        created_at  TEXT NOT NULL,
        expires_at  TEXT NOT NULL
    );
    CREATE INDEX sessions_by_key ON sessions (key_ref);
    DELETE FROM settings WHERE name = 'session_secret';   -- the signed cookies it made are void
    """


def accounts_schema(w: SchemaWords) -> str:
    return f"""
    -- Scoped keys. scopes is {{"read": [pattern...], "write": [...], "delete": [...], "admin": [...]}};
    -- a pattern is "*", a prefix ending in "*", or an exact channel id. Keys issued before scopes
    -- existed were the one key that could do everything: they stay admin.
    ALTER TABLE api_keys ADD COLUMN name TEXT;
    ALTER TABLE api_keys ADD COLUMN scopes TEXT NOT NULL DEFAULT '{{}}';
    ALTER TABLE api_keys ADD COLUMN expires_at TEXT;          -- NULL: never expires
    ALTER TABLE api_keys ADD COLUMN last_used_at TEXT;        -- written at most once a minute per key
    UPDATE api_keys SET name = 'admin', scopes = '{{"read":["*"],"write":["*"],"delete":["*"],"admin":["*"]}}';

    -- User accounts: a password login that yields a token carrying the scopes an admin granted.
    CREATE TABLE users (
        id             TEXT PRIMARY KEY,
        email          TEXT NOT NULL,          -- as the user typed it
        email_key      TEXT NOT NULL UNIQUE,   -- lower-cased: one account per address, whatever its case
        name           TEXT,
        password_hash  TEXT NOT NULL,          -- scrypt$N$r$p$salt-hex$hash-hex, a salt per user
        scopes         TEXT NOT NULL DEFAULT '{{}}',
        created_at     TEXT NOT NULL,
        updated_at     TEXT NOT NULL
    );

    -- Live login tokens, by the token's random id (jti). The token is signed with a secret kept
    -- outside this database, so the ids stored here cannot be turned into tokens. Logout deletes.
    CREATE TABLE tokens (
        jti         TEXT PRIMARY KEY,
        user_id     TEXT REFERENCES users(id),     -- a password login
        key_id      {w.integer} REFERENCES api_keys(id),  -- or an exchanged API key (api-key-login)
        created_at  TEXT NOT NULL,
        expires_at  TEXT NOT NULL,
        CHECK ((user_id IS NULL) <> (key_id IS NULL))
    );

    -- One JSON document per owner: 'user:<id>', 'key:<id>' or 'env'.
    CREATE TABLE preferences (
        owner       TEXT PRIMARY KEY,
        document    TEXT NOT NULL,
        updated_at  TEXT NOT NULL
    );

    -- The tamper-evident log: each event's chain_hash = SHA-256(previous chain hash || canonical
    -- JSON of its immutable fields); the channel carries its latest one so appending needs no read.
    ALTER TABLE events ADD COLUMN chain_hash TEXT;
    ALTER TABLE channels ADD COLUMN chain_head TEXT;           -- NULL: no event yet (the genesis value)
    ALTER TABLE channels ADD COLUMN closed_at TEXT;            -- a closed run takes no more events or states
    """


# The chain step the cursor UPDATE computes (see append_event), as PostgreSQL's SQL function:
# chain_step() in SQL, byte for byte. SQLite calls chain_step itself (configure_sqlite registers it).
CHAIN_FUNCTION = f"""
    CREATE FUNCTION actae_chain(previous TEXT, head TEXT, at_cursor BIGINT, tail TEXT) RETURNS TEXT
        LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
        SELECT encode(sha256(convert_to(COALESCE(previous, '{CHAIN_GENESIS}') || head || at_cursor::text || tail,
                                        'UTF8')), 'hex') $$
    """

# The planner inlines an IMMUTABLE SQL function only when its body is immutable too, and convert_to
# is STABLE: declared IMMUTABLE, actae_chain ran through the SQL-function executor once per event
# (about 30 µs of the backend's CPU). STABLE, it is inlined into the statement that appends the event.
CHAIN_FUNCTION_INLINED = "ALTER FUNCTION actae_chain(TEXT, TEXT, BIGINT, TEXT) STABLE"


def step_lookup_schema(w: SchemaWords) -> str:
    return """
    -- Step lookups (resume at step k) walk (channel, step) then the cursor: no scan of the channel.
    DROP INDEX events_by_step;
    CREATE INDEX events_by_step ON events (channel_id, step_number, cursor);

    -- States may be stored zlib-compressed (a BLOB) from now on; their top-level "status" is kept
    -- beside them so the pages can find failed runs without unpacking every snapshot.
    ALTER TABLE states ADD COLUMN status TEXT;
    """


# SQLite's states were JSON text until then; PostgreSQL's were packed from the start, their status beside.
STATE_STATUS_BACKFILL = """
    UPDATE states SET status = json_extract(state, '$.status')
     WHERE json_valid(state) AND json_type(state, '$.status') = 'text'
    """


def state_storage_schema(w: SchemaWords) -> str:
    return f"""
    -- A state may be stored as a delta on an earlier version of its channel, or as a reference to
    -- the row that holds it (a fork's first snapshot); rows before this are whole (NULLs). See
    -- "state storage" in the domain for the columns.
    ALTER TABLE states ADD COLUMN delta_base {w.integer};
    ALTER TABLE states ADD COLUMN chain_start {w.integer};
    ALTER TABLE states ADD COLUMN ref_channel TEXT;
    ALTER TABLE states ADD COLUMN ref_version {w.integer};
    ALTER TABLE states ADD COLUMN chain_bytes {w.integer} NOT NULL DEFAULT 0;
    ALTER TABLE states ADD COLUMN base_bytes {w.integer} NOT NULL DEFAULT 0;
    CREATE INDEX states_by_ref ON states (ref_channel, ref_version);
    CREATE INDEX states_by_base ON states (channel_id, delta_base);
    """


def step_usage_schema(w: SchemaWords) -> str:
    return f"""
    -- What a step spent (usage_of), one row per event that names any of it: a numbered step with
    -- none has no row, so its spend is unknown, never zero.
    CREATE TABLE step_usage (
        channel_id     TEXT NOT NULL,
        cursor         {w.integer} NOT NULL,
        input_tokens   {w.integer},
        output_tokens  {w.integer},
        cost           {w.real},
        model          TEXT,
        duration_ms    {w.real},
        PRIMARY KEY (channel_id, cursor)
    )
    """


def migrate_step_usage(conn: "Conn") -> None:
    """What the events stored before usage was kept (or before the rule read adapters' events) spent,
    read once."""
    index_usage(conn)


def step_usage_again(w: SchemaWords) -> str:
    """The table again, for the events the rule reads since (adapters' unnumbered ones), and without the
    step number the first version kept (the event has it)."""
    return "DROP TABLE step_usage;" + step_usage_schema(w)


def sparse_state_indexes(w: SchemaWords) -> str:
    return """
    -- The state indexes most rows have nothing for (no operation id, no delta base, no reference to
    -- another row) hold only the rows that have it: every lookup names the column's value, which
    -- implies it is not NULL, so each still serves; a state commit writes three index pages fewer.
    DROP INDEX states_operation;
    CREATE UNIQUE INDEX states_operation ON states (channel_id, operation_id) WHERE operation_id IS NOT NULL;
    DROP INDEX states_by_ref;
    CREATE INDEX states_by_ref ON states (ref_channel, ref_version) WHERE ref_channel IS NOT NULL;
    DROP INDEX states_by_base;
    CREATE INDEX states_by_base ON states (channel_id, delta_base) WHERE delta_base IS NOT NULL
    """


def fork_only_channel_indexes(w: SchemaWords) -> str:
    return """
    -- A root's parent is NULL and its origin is itself: the indexes that find forks (by parent; under
    -- their root, for the first runs page) hold forks alone, so a new run writes two index pages
    -- fewer. Every lookup names a parent, which implies one, or asks for a root's forks by parent_id
    -- IS NOT NULL (fork_group).
    DROP INDEX channels_by_parent;
    CREATE INDEX channels_by_parent ON channels (parent_id) WHERE parent_id IS NOT NULL;
    DROP INDEX channels_by_origin;
    CREATE INDEX channels_by_origin ON channels (origin_id, created_at, id) WHERE parent_id IS NOT NULL
    """


def heads_from_events(w: SchemaWords) -> str:
    return """
    -- A channel's last cursor and chain head are its last event's, read off the events' primary key
    -- (CHANNEL_HEAD), as a state's version is: appending an event writes no channel row, one page
    -- fewer per commit. What the row keeps is the chain a channel's own events go on from (a fork's:
    -- its parent's hash at the boundary), which the old head column holds for a channel with no event
    -- of its own, and which its last event's hash supersedes for every other.
    ALTER TABLE channels RENAME COLUMN chain_head TO chain_base;
    ALTER TABLE channels DROP COLUMN last_cursor
    """


def migrate_failure_rule(conn: "Conn") -> None:
    """The runs stored before the failure rule took every `*.error` and `*.failed` event (see
    is_failure_event): their first failure event noted again, so they show as they would now."""
    refresh_run_facts(conn)


# Every event's place in the instance's commit order, for a stream of every channel (follow_instance).
# SQLite's rowid is that already (one writer appends in commit order); PostgreSQL numbers its rows
# (the write lock every server takes makes the numbers commit order), indexed by BRIN: the numbers
# follow the rows' physical order, so the index costs next to nothing to keep.
EVENT_POSITIONS = """
ALTER TABLE events ADD COLUMN seq BIGINT GENERATED BY DEFAULT AS IDENTITY;
CREATE INDEX events_by_seq ON events USING brin (seq)
"""


# The runs pages' status index since the activity second (step 16; again where run_state is rebuilt).
CHANNELS_BY_STATE = "CREATE INDEX channels_by_state ON channels (run_state, active_at, id)"


def activity_second_schema(w: SchemaWords) -> str:
    return f"""
    -- A run's last activity is kept twice on its row: updated_at, exact, which writes set and no
    -- index holds; and active_at, the same instant cut to the second, which the runs pages' indexes
    -- hold. A trigger keeps active_at (whoever sets updated_at) and writes it only when the second
    -- changes: an SDK step's commits then write the channel row alone, not three index pages more.
    ALTER TABLE channels ADD COLUMN active_at TEXT;
    UPDATE channels SET active_at = substr(updated_at, 1, {ACTIVE_AT_CHARS});
    DROP INDEX channels_by_activity;
    CREATE INDEX channels_by_activity ON channels (active_at, id);
    DROP INDEX channels_by_state;
    {CHANNELS_BY_STATE};
    DROP INDEX channels_roots_by_activity;
    CREATE INDEX channels_roots_by_activity ON channels ({roots_index_key(w, "active_at")}) WHERE parent_id IS NULL;
    -- last_event_type now holds the last event's type only while it blocks the run (run_state reads
    -- no more of it), so most events leave it, and channels_by_state, as they are.
    UPDATE channels SET last_event_type = NULL WHERE last_event_type NOT IN ({sql_list(BLOCKING_EVENT_TYPES)});
    -- Events by type served one lookup, the blocked tool calls: a partial index of those alone.
    DROP INDEX events_by_type;
    CREATE INDEX events_blocked ON events (created_at) WHERE type = 'tool.blocked';
    -- The indexes of a column many rows leave empty hold only the rows that have it (every lookup
    -- names a value, which implies one): an event without an operation id or a step number (a fork's
    -- first, a session's start and end), and a fork without an operation id, write fewer pages.
    DROP INDEX events_operation;
    CREATE UNIQUE INDEX events_operation ON events (channel_id, operation_id) WHERE operation_id IS NOT NULL;
    DROP INDEX events_by_step;
    CREATE INDEX events_by_step ON events (channel_id, step_number, cursor) WHERE step_number IS NOT NULL;
    DROP INDEX channels_fork_operation;
    CREATE UNIQUE INDEX channels_fork_operation ON channels (fork_operation_id) WHERE fork_operation_id IS NOT NULL
    """


# PostgreSQL: an event's position from its transaction, as the write lock's order no longer is the
# commit order (batches on different channels commit at once): the transaction id times 2^20, plus
# the event's ordinal in its transaction (a transaction-local setting counts them). Transaction ids
# are taken after the batch's locks, so one channel's positions follow its cursors; a stream reads
# only positions below the oldest transaction still running (settled_positions), so none it has
# passed can appear later. Positions stored before stay as they were (all below the new ones).
EVENT_POSITIONS_BY_TRANSACTION = """
CREATE OR REPLACE FUNCTION actae_event_position() RETURNS BIGINT LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    ordinal BIGINT := COALESCE(NULLIF(current_setting('actae.event_ordinal', true), ''), '0')::bigint + 1;
BEGIN
    IF ordinal >= 1048576 THEN
        RAISE EXCEPTION 'one transaction may append at most 1048575 events';
    END IF;
    PERFORM set_config('actae.event_ordinal', ordinal::text, true);
    RETURN pg_current_xact_id()::text::bigint * 1048576 + ordinal;
END $$;
ALTER TABLE events ALTER COLUMN seq DROP IDENTITY;
ALTER TABLE events ALTER COLUMN seq SET DEFAULT actae_event_position()
"""


# The trigger that keeps channels.active_at the second of updated_at (see activity_second_schema).
# SQLite's writes active_at only when its second changes (an UPDATE naming it rewrites its indexes'
# pages); PostgreSQL's sets it on the new row version, which stays heap-only while it is unchanged.
ACTIVE_AT_TRIGGERS = {
    "sqlite": f"""
CREATE TRIGGER channels_active_at_new AFTER INSERT ON channels
WHEN NEW.active_at IS NOT substr(NEW.updated_at, 1, {ACTIVE_AT_CHARS})
BEGIN UPDATE channels SET active_at = substr(NEW.updated_at, 1, {ACTIVE_AT_CHARS}) WHERE id = NEW.id; END;
CREATE TRIGGER channels_active_at AFTER UPDATE OF updated_at ON channels
WHEN NEW.active_at IS NOT substr(NEW.updated_at, 1, {ACTIVE_AT_CHARS})
BEGIN UPDATE channels SET active_at = substr(NEW.updated_at, 1, {ACTIVE_AT_CHARS}) WHERE id = NEW.id; END
""",
    "postgresql": f"""
CREATE OR REPLACE FUNCTION actae_active_at() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.active_at := substr(NEW.updated_at, 1, {ACTIVE_AT_CHARS});
    RETURN NEW;
END $$;
CREATE TRIGGER channels_active_at BEFORE INSERT OR UPDATE OF updated_at ON channels
FOR EACH ROW EXECUTE FUNCTION actae_active_at()
""",
}

# PostgreSQL called actae_active_at for every UPDATE of updated_at, so for every event (about 12 us of
# the backend's CPU each); the trigger's WHEN, evaluated without a function call, leaves it to the
# UPDATEs that move the second (step 19).
ACTIVE_AT_TRIGGER_WHEN_MOVED = f"""
DROP TRIGGER IF EXISTS channels_active_at ON channels;
CREATE TRIGGER channels_active_at BEFORE INSERT OR UPDATE OF updated_at ON channels
FOR EACH ROW WHEN (NEW.active_at IS DISTINCT FROM substr(NEW.updated_at, 1, {ACTIVE_AT_CHARS}))
EXECUTE FUNCTION actae_active_at()
"""


# PostgreSQL checks every CHECK constraint of a table on every row an INSERT or UPDATE writes, and
# builds each from its stored text again for every statement: on the channel's counter UPDATE and the
# event's INSERT, about a tenth of the backend's CPU per event (perf: ExecConstraints, stringToNode).
# A domain's constraint is checked only where a value is given to its column, and is built once per
# connection: the same rules, paid only by the statements that set those columns (step 20). The
# run-state column, which reads outcome, is taken off and put back around the change of its type.
CHECKS_AS_DOMAINS = f"""
CREATE DOMAIN actae_flag AS BIGINT CHECK (VALUE IN (0, 1));
CREATE DOMAIN actae_reproducibility AS TEXT CHECK (VALUE IN ({sql_list(REPRODUCIBILITY_GRADES)}));
CREATE DOMAIN actae_outcome AS TEXT CHECK (VALUE IN ({sql_list(OUTCOMES)}));
CREATE DOMAIN actae_step AS BIGINT CHECK (VALUE >= 1);
DROP INDEX channels_by_state;
ALTER TABLE channels DROP COLUMN run_state;
ALTER TABLE channels DROP CONSTRAINT channels_restorable_check, ALTER COLUMN restorable TYPE actae_flag,
    DROP CONSTRAINT channels_reproducibility_check, ALTER COLUMN reproducibility TYPE actae_reproducibility,
    DROP CONSTRAINT channels_outcome_check, ALTER COLUMN outcome TYPE actae_outcome;
{RUN_STATE_BY_FUNCTION};
{CHANNELS_BY_STATE};
ALTER TABLE events DROP CONSTRAINT events_step_number_check, ALTER COLUMN step_number TYPE actae_step
"""


# PostgreSQL computes a stored generated column again on every UPDATE of its row, and builds its
# expression from the stored text for every statement: run_state, on every event's counter UPDATE,
# parsed the run's metadata as JSON once more (perf: ExecComputeStoredGenerated, about a tenth of the
# event statement's backend CPU, more with larger metadata). A trigger keeps it instead, called only
# by an UPDATE that changes a column it reads (or sets the metadata, the outcome or the latest
# snapshot's status at all, which few statements do); the same trigger keeps active_at, which had a
# trigger of its own, so the counter UPDATE evaluates one WHEN (step 21).
RUN_STATE_BY_TRIGGER = f"""
CREATE OR REPLACE FUNCTION actae_channel_facts() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.active_at := substr(NEW.updated_at, 1, {ACTIVE_AT_CHARS});
    NEW.run_state := {run_state_call("NEW.")};
    RETURN NEW;
END $$;
DROP TRIGGER channels_active_at ON channels;
DROP FUNCTION actae_active_at();
DROP INDEX channels_by_state;
ALTER TABLE channels DROP COLUMN run_state;
ALTER TABLE channels ADD COLUMN run_state TEXT;
UPDATE channels SET run_state = {run_state_call()};
CREATE TRIGGER channels_facts_new BEFORE INSERT ON channels FOR EACH ROW EXECUTE FUNCTION actae_channel_facts();
CREATE TRIGGER channels_facts BEFORE UPDATE OF updated_at, last_event_type, error_cursor ON channels FOR EACH ROW
    WHEN (NEW.active_at IS DISTINCT FROM substr(NEW.updated_at, 1, {ACTIVE_AT_CHARS})
          OR NEW.last_event_type IS DISTINCT FROM OLD.last_event_type
          OR NEW.error_cursor IS DISTINCT FROM OLD.error_cursor)
    EXECUTE FUNCTION actae_channel_facts();
CREATE TRIGGER channels_facts_given BEFORE UPDATE OF experiment_metadata, outcome, last_state_status ON channels
    FOR EACH ROW EXECUTE FUNCTION actae_channel_facts();
{CHANNELS_BY_STATE}
"""


# PostgreSQL: room on each channel page for a new row version, so the counter UPDATEs (which change
# no indexed column now) stay heap-only: no index entry written per event.
CHANNELS_FILLFACTOR = "ALTER TABLE channels SET (fillfactor = 70)"


# The schema, step by step: append, never edit. One numbering: a step's number is its place here,
# and a region adds its part to a step by that number (a SchemaPart), after the kernel's. SQLite runs
# every step, one transaction each, and PRAGMA user_version counts them. PostgreSQL started later, at
# steps 1-5 in one script: there they are version 1 in actae_migrations and step n > 5 is version
# n - 4 (Migration.postgres), each in one transaction. A step one backend does not need is still a
# step on both: it runs nothing there (`only`).
POSTGRES_FIRST_STEPS = 5
MIGRATIONS = [
    Migration(1, base_schema),
    Migration(2, sessions_schema),
    Migration(3, accounts_schema, only={"postgresql": CHAIN_FUNCTION}),
    Migration(4, only={"sqlite": backfill_chain}),        # PostgreSQL's events were chained from the first
    Migration(5, step_lookup_schema, only={"sqlite": STATE_STATUS_BACKFILL}),
    Migration(6, state_storage_schema),
    Migration(7),                                         # the approvals' answers (Many runs)
    Migration(8),                                         # the fleet's tables (Fleet)
    Migration(9, run=migrate_run_facts),                  # and the approvals and bulk forks (Many runs)
    Migration(10, only={"postgresql": EVENT_POSITIONS}),
    Migration(11, run=migrate_failure_rule),
    Migration(12, step_usage_schema),                      # filled by the step after enrollments
    Migration(13),                                         # enrollments (Fleet)
    Migration(14, step_usage_again, run=migrate_step_usage),   # reads every stored event once
    Migration(15, sparse_state_indexes),
    Migration(16, activity_second_schema, only={
        "sqlite": ACTIVE_AT_TRIGGERS["sqlite"],
        "postgresql": ";".join((ACTIVE_AT_TRIGGERS["postgresql"], CHANNELS_FILLFACTOR, EVENT_POSITIONS_BY_TRANSACTION))}),
    Migration(17, only={"postgresql": CHAIN_FUNCTION_INLINED}),
    Migration(18, only={"postgresql": run_state_by_function}),
    Migration(19, only={"postgresql": ACTIVE_AT_TRIGGER_WHEN_MOVED}),
    Migration(20, only={"postgresql": CHECKS_AS_DOMAINS}),
    Migration(21, only={"postgresql": RUN_STATE_BY_TRIGGER}),
    Migration(22, fork_only_channel_indexes),
    Migration(23, heads_from_events),
    Migration(24),                                        # enrollments' failed tries (Fleet)
    Migration(25),                                        # model calls and their bodies (Model calls)
    Migration(26),                                        # the upstreams `actae llm add` keeps (Model calls)
    Migration(27),                                        # forks handed to workers (Hand-offs)
]
if [step.number for step in MIGRATIONS] != list(range(1, len(MIGRATIONS) + 1)):
    raise RuntimeError("MIGRATIONS must be numbered 1, 2, 3, ... in order")


# A run's status in one SQL expression over its own channels row: the column run_state (generated on
# SQLite, kept by a trigger on PostgreSQL: RUN_STATE_BY_TRIGGER), so the runs list, its filter, the
# fork tree and the run page always agree, and an index answers a status filter. Its inputs are
# columns the write path keeps: the SDK's status (a field of a JSON column, per dialect), the outcome,
# the latest snapshot's status, the first error event and the last event's type.
def run_state_sql(dialect: Dialect, sdk_status: Optional[str] = None) -> str:
    """A run's state from its row's columns; `sdk_status`: an expression for the SDK's status, when
    not read out of experiment_metadata here."""
    sdk_status = sdk_status or dialect.json_text("experiment_metadata", "status")
    return f"""CASE
    WHEN {sdk_status} = 'crashed' OR outcome = 'crashed' THEN 'crashed'
    WHEN {sdk_status} IN ({sql_list(FAILED_STATE_STATUSES)})
      OR last_state_status IN ({sql_list(FAILED_STATE_STATUSES)})
      OR error_cursor IS NOT NULL
      THEN 'failed'
    WHEN COALESCE({sdk_status}, '') <> 'completed' AND last_event_type IN ({sql_list(BLOCKING_EVENT_TYPES)})
      THEN 'blocked'
    ELSE COALESCE({sdk_status}, 'recorded') END"""


# =============================================================================
# Storage: one connection interface, one dialect per backend
# =============================================================================
# Domain code is plain synchronous functions of a connection: `conn.execute(sql, args)` returning
# rows readable by name or position, and `conn.dialect` for the little SQL that differs. SQLite's
# connection is that already (a subclass adds the dialect); PostgreSQL's is a thin wrapper over a
# psycopg connection. Whole functions cross to a database thread, never single statements.

# Transaction control: the same words on every backend.
BEGIN, COMMIT, ROLLBACK = "BEGIN", "COMMIT", "ROLLBACK"


@functools.lru_cache(maxsize=256)
def insert_sql(table: str, columns: tuple) -> str:
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


class Dialect:
    """What differs between the backends, in one place. Domain SQL is written for both."""

    begin_write: ClassVar[tuple]         # statements that open a write transaction
    begin_snapshot: ClassVar[str]        # opens a read transaction that sees one committed moment
    # Statements cost a network round trip: a batch is first tried pipelined (see run_jobs).
    pipelined: ClassVar[bool] = False
    like: ClassVar[str]                  # case-insensitive (for ASCII) LIKE
    greatest: ClassVar[str]              # the larger of two values
    differs: ClassVar[str]               # NULL-safe inequality: `a {differs} b` is true when NULL meets a value
    # A channel `c` joined to its last event `h` (NULLs before its first): the greatest cursor, then
    # that row, two seeks of the events' primary key where there is no LATERAL.
    last_event_join: ClassVar[str] = ("LEFT JOIN events h ON h.channel_id = c.id"
                                      " AND h.cursor = (SELECT MAX(m.cursor) FROM events m WHERE m.channel_id = c.id)")

    def json_text(self, column: str, key: str) -> str:
        """SQL for the text value of a top-level key of a JSON object column (NULL when absent)."""
        raise NotImplementedError

    def parameter(self, sql_type: Optional[str]) -> str:
        """A parameter of INSERT ... SELECT holding a value of `sql_type` (None: text)."""
        return "?"

    def begin_batch(self, jobs: list) -> list:
        """(sql, args) that open the write transaction of `jobs` (see Job.channels)."""
        return [(statement, ()) for statement in self.begin_write]

    # SQL of a condition on events' position: only positions no transaction still running can come
    # before (None: every committed position is final, as on SQLite, where commits are serial).
    settled_positions: ClassVar[Optional[str]] = None

    def pack_state(self, text: Optional[str]) -> Union[str, bytes, None]:
        return pack_state(text)

    def is_unique_violation(self, exc: BaseException) -> bool:
        raise NotImplementedError

    def announce(self, conn: "Conn", events: list) -> None:
        """Tell other servers, inside the transaction, which channels got events (no-op on SQLite)."""


class SqliteDialect(Dialect):
    # IMMEDIATE takes the write lock at BEGIN: every write transaction runs alone, so each
    # check-then-act in the domain sees everything committed before it.
    begin_write = ("BEGIN IMMEDIATE",)
    begin_snapshot = BEGIN               # WAL: the first read fixes what the transaction sees
    like = "LIKE"
    greatest = "max"
    differs = "IS NOT"
    event_position = "rowid"             # an event's place in the instance's commit order (EVENT_POSITIONS)

    @staticmethod
    def ends_with(column: str, suffix: str) -> str:
        return f"{column} GLOB '*{suffix}'"          # GLOB is case-sensitive, as str.endswith is

    def json_text(self, column: str, key: str) -> str:
        return f"json_extract({column}, '$.{key}')"

    def is_unique_violation(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.IntegrityError) and "UNIQUE" in str(exc)


# The instance lock every PostgreSQL write transaction takes first (pg_advisory_xact_lock's key). A
# batch whose every job names the channels it changes (Job.channels: an SDK step, a state, a fork, a
# claim) takes it shared, then a lock of each of those channels, in one order (sorted keys: no two
# batches wait on each other); any other batch takes it alone, as BEGIN IMMEDIATE is on SQLite.
# Batches of several servers on different channels then run and commit at once, one channel's writes
# stay one at a time (its cursor and chain gapless), and what has no lock protocol of its own (keys,
# groups, wake-ups, deletes) still runs with nothing else beside it. Group commit keeps it cheap:
# one lock statement per batch.
POSTGRES_WRITE_LOCK = 0x61637461               # "acta"
# The channels' locks: pg_advisory_xact_lock(space, key) of two integers, a key space apart from
# the instance lock's one bigint.
POSTGRES_CHANNEL_LOCKS = 0x61637462
POSTGRES_MIGRATION_LOCK = POSTGRES_WRITE_LOCK + 1
POSTGRES_CHANNEL = "actae_events"              # NOTIFY: the sending server's id, then "channel_id<TAB>cursor" lines
NOTIFY_PAYLOAD_MAX = 7000                      # PostgreSQL refuses payloads of 8000 bytes and more
# A server tells the others of its commits only once it has heard of one (Peers): a listener says
# PEER_HELLO (its id, then this line) when it starts listening and the others answer PEER_HERE; what
# was committed before the news arrived is read PEER_SETTLE_SECONDS later (PostgresEngine.listen).
PEER_HELLO, PEER_HERE = "hello", "here"
PEER_SETTLE_SECONDS = 1.0


class Peers:
    """Whether this server has heard of another one listening to its database. A server alone sends
    no notices: each costs a transaction, a signal to every listener and a wake-up of its own (B1b on
    one server ran 14% faster without them)."""

    present = False


def channel_lock_key(channel_id: str) -> int:
    """A channel's key among the channels' locks (two channels may share one: they then wait on each other)."""
    return int.from_bytes(hashlib.blake2b(channel_id.encode(), digest_size=4).digest(), "big", signed=True)


class PostgresDialect(Dialect):
    begin_write = (BEGIN, f"SELECT pg_advisory_xact_lock({POSTGRES_WRITE_LOCK})")
    # One statement takes both, in either order: a batch that holds the instance lock alone waits on
    # no channel's lock, so neither order lets two batches wait on each other.
    begin_channels = (f"SELECT pg_advisory_xact_lock_shared({POSTGRES_WRITE_LOCK}),"
                      f" (SELECT COUNT(pg_advisory_xact_lock({POSTGRES_CHANNEL_LOCKS}, k))"
                      " FROM unnest(CAST(? AS INTEGER[])) AS k)")
    # Positions are numbered by transaction id (see EVENT_POSITIONS_BY_TRANSACTION): every transaction
    # older than the snapshot's oldest running one has ended, so no position below it can still appear.
    settled_positions = "seq < (CAST(CAST(pg_snapshot_xmin(pg_current_snapshot()) AS TEXT) AS BIGINT) * 1048576)"
    begin_snapshot = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"
    pipelined = True
    like = "ILIKE"
    greatest = "GREATEST"
    differs = "IS DISTINCT FROM"
    event_position = "seq"
    # One backward step of the primary key (and a subplan fewer to start for every event).
    last_event_join = ("LEFT JOIN LATERAL (SELECT m.cursor, m.chain_hash FROM events m WHERE m.channel_id = c.id"
                       " ORDER BY m.cursor DESC LIMIT 1) h ON true")

    @staticmethod
    def ends_with(column: str, suffix: str) -> str:
        return f"{column} LIKE '%{suffix}'"          # the suffixes hold no _ or %

    def json_text(self, column: str, key: str) -> str:
        # CASE: ->> on a JSON array or scalar is NULL, as json_extract's '$.key' is.
        return f"(CASE WHEN jsonb_typeof({column}::jsonb) = 'object' THEN {column}::jsonb ->> '{key}' END)"

    def pack_state(self, text: Optional[str]) -> Optional[bytes]:
        return None if text is None else zlib.compress(text.encode("utf-8"), 1)

    def parameter(self, sql_type: Optional[str]) -> str:
        # PostgreSQL types a parameter of INSERT ... SELECT as text unless told.
        return f"CAST(? AS {sql_type})" if sql_type else "?"

    def begin_batch(self, jobs: list) -> list:
        if any(job.channels is None for job in jobs):
            return super().begin_batch(jobs)
        keys = sorted({channel_lock_key(channel) for job in jobs for channel in job.channels})
        return [(BEGIN, ()), (self.begin_channels, (keys,))]

    def is_unique_violation(self, exc: BaseException) -> bool:
        return isinstance(exc, psycopg.errors.UniqueViolation)

    def announce(self, conn: "Conn", events: list) -> None:
        if conn.peers is not None and not conn.peers.present:
            return
        latest: dict = {}
        for event in events:
            latest[event.channel_id] = max(event.cursor, latest.get(event.channel_id, 0))
        lines = [f"{channel}\t{cursor}" for channel, cursor in latest.items()]
        with conn.pipeline():            # one transaction of its own, sent the cheap way (PqPipeline)
            for chunk in notify_chunks(lines):
                # A notice is a hint (a lost one costs a stream a second, see FOLLOW_POLL_SECONDS), yet
                # its transaction commits like any other: without waiting for the disk, it costs no fsync.
                conn.execute("SELECT set_config('synchronous_commit', 'off', true), pg_notify(?, ?)",
                             (POSTGRES_CHANNEL, f"{conn.origin}\n{chunk}"))


SQLITE, POSTGRES = SqliteDialect(), PostgresDialect()


def notify_chunks(lines: list) -> list:
    """Newline-joined lines in payloads under NOTIFY's size limit (with room for the server id)."""
    chunks, current, size = [], [], 0
    for line in lines:
        if current and size + len(line.encode()) + 1 > NOTIFY_PAYLOAD_MAX:
            chunks.append("\n".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line.encode()) + 1
    return chunks + (["\n".join(current)] if current else [])


class SqliteConnection(sqlite3.Connection):
    """sqlite3's connection, carrying its dialect like the PostgreSQL wrapper does."""

    dialect = SQLITE
    usable = True                    # a file: nothing to lose between statements
    states: Optional["StateCache"] = None   # its engine's cache of rebuilt states (see state_cache)
    known_channels: Optional[set] = None    # no batch leaves an answer for later here (see Tx.later)
    last_batch_at: Optional[datetime] = None    # see batch_instant

    def pipeline(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()     # a statement costs no round trip here


def configure_sqlite(conn: Conn) -> None:
    # synchronous=FULL: an acknowledged write survives kill -9 and power loss.
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("PRAGMA busy_timeout=10000")
    conn.row_factory = sqlite3.Row
    # The chain hash is computed inside the UPDATE that allocates the cursor (see append_event);
    # PostgreSQL has it as a SQL function (its first migration).
    conn.create_function("actae_chain", 4, chain_step, deterministic=True)


def user_version(number: int) -> str:
    return f"PRAGMA user_version={number}"


def migrate_sqlite(conn: Conn) -> None:
    """Run the migrations this file has not run, each in one transaction; PRAGMA user_version counts them."""
    current = conn.execute("PRAGMA user_version").fetchone()[0]
    for step in MIGRATIONS[current:]:
        conn.execute(SQLITE.begin_write[0])
        try:
            for part in step.parts(SQLITE):
                part(conn) if callable(part) else run_script(conn, part)
            conn.execute(user_version(step.number))
            conn.execute(COMMIT)
        except BaseException:
            conn.execute(ROLLBACK)
            raise


class PostgresRow:
    """A PostgreSQL row as domain code reads sqlite3.Row: by column name, by position, dict(row)."""

    __slots__ = ("_values", "_index")

    def __init__(self, values: tuple, index: dict):
        self._values, self._index = values, index

    def __getitem__(self, key: Union[int, str]) -> object:
        return self._values[key if isinstance(key, int) else self._index[key]]

    def keys(self):
        return self._index.keys()

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


class RowShape:
    """psycopg row factory of one statement: its name -> position index is built from the first
    result and shared by every later one (building it per result was a tenth of the writer's time)."""

    __slots__ = ("index",)

    def __init__(self):
        self.index: Optional[dict] = None

    def __call__(self, cursor: "psycopg.Cursor") -> Callable:
        index = self.index
        if index is None:
            index = self.index = {column.name: i for i, column in enumerate(cursor.description or ())}
        return lambda values: PostgresRow(values, index)


@functools.lru_cache(maxsize=4096)
def postgres_statement(sql: str, with_args: bool) -> tuple:
    """(text, row factory) of a domain statement on PostgreSQL, made once per statement."""
    return postgres_sql(sql, with_args), RowShape()


@functools.lru_cache(maxsize=4096)
def numbered_statement(sql: str, with_args: bool) -> tuple:
    """(text with $1, $2 ... placeholders, as libpq takes it, UTF-8; row factory) of a domain statement."""
    return postgres_sql(sql, with_args, numbered=True).encode(), postgres_statement(sql, with_args)[1]


def postgres_sql(sql: str, with_args: bool, numbered: bool = False) -> str:
    """Domain SQL (qmark placeholders) in psycopg's format style (? -> %s, % -> %%) or, `numbered`,
    libpq's ($1, $2 ...); never inside literals."""
    if not with_args:
        return sql
    out, quoted, count = [], False, 0
    for char in sql:
        if char == "'":
            quoted = not quoted
        if char == "?" and not quoted:
            count += 1
            out.append(f"${count}" if numbered else "%s")
        elif char == "%" and not numbered:
            out.append("%%")
        else:
            out.append(char)
    return "".join(out)


# The type a parameter is sent as, the one psycopg gives the same value (so a statement means the
# same on either path): integers by their size, booleans as integers (BoolAsInteger), str untyped.
PG_INT2, PG_INT4, PG_INT8, PG_NUMERIC, PG_FLOAT8, PG_BYTEA = 21, 23, 20, 1700, 701, 17
TEXT_RESULTS = frozenset({25, 1043, 19, 18})             # text, varchar, name, char: decoded as is
INTEGER_RESULTS = frozenset({20, 21, 23, 26})            # int8, int2, int4, oid
PREPARED_MAX = 512                   # statements a writer connection keeps prepared; later ones go unnamed
NUL_IN_TEXT = "text fields cannot contain NUL (\\u0000) characters"


def integer_type(value: int) -> int:
    if -0x8000 <= value < 0x8000:
        return PG_INT2
    if -0x80000000 <= value < 0x80000000:
        return PG_INT4
    return PG_INT8 if -0x8000000000000000 <= value < 0x8000000000000000 else PG_NUMERIC


class PqAnswer:
    """One statement sent down a PqPipeline: its rows (or its error) once read, read when first asked
    for; domain code reads it as a cursor (fetchone, fetchall, iteration)."""

    __slots__ = ("pipe", "shape", "rows", "error", "commit", "taken")

    def __init__(self, pipe: "PqPipeline", shape: RowShape, commit: bool):
        self.pipe, self.shape, self.commit = pipe, shape, commit
        self.rows: Optional[list] = None
        self.error: Optional[BaseException] = None
        self.taken = 0                   # rows fetched so far: a cursor hands each row out once

    def unread(self) -> list:
        while self.rows is None and self.error is None:
            self.pipe.read_next()
        if self.error is not None:
            raise self.error
        return self.rows[self.taken:]

    def fetchall(self) -> list:
        rows = self.unread()
        self.taken += len(rows)
        return rows

    def fetchone(self) -> Optional[PostgresRow]:
        rows = self.unread()
        self.taken += bool(rows)
        return rows[0] if rows else None

    def __iter__(self):
        return iter(self.fetchall())


class PqPipeline:
    """A write batch's statements over libpq's pipeline mode (psycopg.pq, its documented libpq layer).

    psycopg's own pipeline costs about 40 us of client CPU per statement (a cursor, its query object,
    and a wait on the socket after each one), as much as the server spends on an event; this sends a
    statement for about 8 and waits only when an answer is read. Answers come back in the order sent:
    reading one reads every answer before it (a Sync first, if none followed the last statement). As
    with psycopg, an error makes the server skip what follows until the next Sync, so a batch whose
    statement failed never runs its COMMIT. Parameters go with the types psycopg would give them;
    values come back through the connection's own loaders, so a row reads the same on either path."""

    SYNC = object()

    def __init__(self, raw: "psycopg.Connection"):
        self.raw, self.pg = raw, raw.pgconn
        known = PIPELINED_CONNECTIONS.get(raw)
        if known is None:
            known = PIPELINED_CONNECTIONS[raw] = PipelinedConnection()
        self.prepared, self.loaders = known.prepared, known.loaders
        self.waiting: collections.deque = collections.deque()   # (prepared key | SYNC | None, answer)
        self.unsynced = False
        self.failure: Optional[BaseException] = None
        self.poll = select.poll()
        self.poll.register(self.pg.socket, select.POLLIN)
        self.pg.enter_pipeline_mode()

    def send(self, sql: str, args: typing.Sequence[object]) -> PqAnswer:
        text, shape = numbered_statement(sql, bool(args))
        values, types, formats = [], [], []
        for value in args or ():
            sent, oid, binary = self.parameter(value)
            values.append(sent), types.append(oid), formats.append(binary)
        key = (text, tuple(types))
        name = self.prepared.get(key)
        if name is None and len(self.prepared) < PREPARED_MAX:
            name = self.prepared[key] = f"actae_{next(PREPARED_NAMES)}".encode()
            self.pg.send_prepare(name, text, types)
            self.waiting.append((key, None))
        if name is None:
            self.pg.send_query_params(text, values, types, formats)
        else:
            self.pg.send_query_prepared(name, values, formats)
        answer = PqAnswer(self, shape, commit=text == b"COMMIT")
        self.waiting.append((None, answer))
        self.unsynced = True
        self.pg.flush()                  # under way while Python builds the next statement
        return answer

    def parameter(self, value: object) -> tuple:
        """(bytes or None, type oid, format) of one parameter."""
        kind = type(value)
        if kind is str:
            if "\x00" in value:
                raise BadRequest(NUL_IN_TEXT)
            return value.encode(), 0, 0
        if value is None:
            return None, 0, 0
        if kind is int:
            return str(value).encode(), integer_type(value), 0
        if kind is bool:
            return (b"1" if value else b"0"), PG_INT8, 0
        if kind is bytes:
            return value, PG_BYTEA, 1
        if kind is float:
            return repr(value).encode(), PG_FLOAT8, 0
        dumper = self.raw.adapters.get_dumper(kind, psycopg.adapt.PyFormat.TEXT)(kind, self.raw)
        dumper = dumper.upgrade(value, psycopg.adapt.PyFormat.TEXT)
        return bytes(dumper.dump(value)), dumper.oid, 0

    def read_next(self) -> None:
        """Read the next answer due (after a Sync, if the statements before it have none)."""
        if self.unsynced:
            self.pg.pipeline_sync()
            self.waiting.append((self.SYNC, None))
            self.unsynced = False
        key, answer = self.waiting.popleft()
        self.flush()
        result = self.result()
        if key is self.SYNC:
            return
        while self.result() is not None:     # a statement's results end with a None
            pass
        if result.status in (psycopg.pq.ExecStatus.TUPLES_OK, psycopg.pq.ExecStatus.COMMAND_OK):
            if answer is not None:
                answer.rows = self.rows(result, answer.shape)
                if answer.commit and result.command_status != b"COMMIT":
                    answer.error = self.failure = psycopg.errors.InFailedSqlTransaction("the batch was rolled back")
            return
        error = (self.error_of(result) if result.status == psycopg.pq.ExecStatus.FATAL_ERROR
                 else self.failure or psycopg.errors.PipelineAborted("skipped after an earlier error"))
        self.failure = self.failure or error
        if key is not None:
            self.prepared.pop(key, None)       # never prepared: the next use prepares it again
        if answer is not None:
            answer.error = error

    def flush(self) -> None:
        while self.pg.flush():
            self.wait(select.POLLIN | select.POLLOUT)
            self.pg.consume_input()

    def result(self) -> "psycopg.pq.abc.PGresult":
        while self.pg.is_busy():
            self.wait(select.POLLIN)
            self.pg.consume_input()
        return self.pg.get_result()

    def wait(self, events: int) -> None:
        self.poll.modify(self.pg.socket, events)
        self.poll.poll()

    def rows(self, result: object, shape: RowShape) -> list:
        if result.status != psycopg.pq.ExecStatus.TUPLES_OK:
            return []
        columns = range(result.nfields)
        if shape.index is None:
            shape.index = {result.fname(i).decode(): i for i in columns}
        loads = [self.loader(result.ftype(i)) for i in columns]
        value = result.get_value
        return [PostgresRow(tuple(None if (v := value(row, i)) is None else loads[i](v) for i in columns), shape.index)
                for row in range(result.ntuples)]

    def loader(self, oid: int) -> Callable:
        load = self.loaders.get(oid)
        if load is None:
            if oid in TEXT_RESULTS:
                load = bytes.decode
            elif oid in INTEGER_RESULTS:
                load = int
            else:
                kind = self.raw.adapters.get_loader(oid, psycopg.pq.Format.TEXT)
                load = kind(oid, self.raw).load if kind is not None else bytes.decode
            self.loaders[oid] = load
        return load

    @staticmethod
    def error_of(result: object) -> Exception:
        state = result.error_field(psycopg.pq.DiagnosticField.SQLSTATE)
        try:
            kind = psycopg.errors.lookup(state.decode()) if state else psycopg.DatabaseError
        except KeyError:
            kind = psycopg.DatabaseError
        return kind((result.error_message or b"").decode(errors="replace").strip())

    def drain(self) -> None:
        """Read every answer still due (a statement's error is kept, not raised: only a lost
        connection raises) and leave pipeline mode."""
        while self.waiting or self.unsynced:
            self.read_next()
        self.pg.exit_pipeline_mode()

    def finish(self) -> None:
        """drain(), then raise the first error, if any."""
        self.drain()
        if self.failure is not None:
            raise self.failure

    def abandon(self) -> None:
        """drain() after a failure (the caller rolls back); a connection that cannot be brought back
        to idle is closed, and its pool replaces it."""
        try:
            self.drain()
        except Exception:  # noqa: BLE001 - the caller's exception is the one that goes on
            self.raw.close()


@dataclass
class PipelinedConnection:
    """What a PqPipeline keeps of a connection between batches, while the connection lives: the
    statements prepared on it ((text, parameter types) -> name, names unique in the process) and
    how to load each result type."""

    prepared: dict = field(default_factory=dict)
    loaders: dict = field(default_factory=dict)


PIPELINED_CONNECTIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
PREPARED_NAMES = itertools.count()


class PostgresConnection:
    """A psycopg connection behind the interface domain code uses (see Dialect, Row)."""

    dialect = POSTGRES

    def __init__(self, raw: "psycopg.Connection", origin: str = "cli", states: Optional["StateCache"] = None,
                 known_channels: Optional[set] = None, peers: Optional[Peers] = None):
        self.raw = raw
        self.states = states
        self.origin = origin               # names this server in its NOTIFYs (see PostgresEngine.listen)
        self.known_channels = known_channels   # channels this engine wrote to (see Tx.may_settle_later)
        self.peers = peers                 # None (the command line): whoever listens is told
        self.last_batch_at: Optional[datetime] = None    # see batch_instant
        self._pipe: Optional[PqPipeline] = None

    def execute(self, sql: str, args: typing.Sequence[object] = ()) -> Cursor:
        if self._pipe is not None:
            return self._pipe.send(sql, args)
        text, shape = postgres_statement(sql, bool(args))
        try:
            return self.raw.cursor(row_factory=shape).execute(text, args or None)
        except psycopg.DataError as exc:
            # PostgreSQL text cannot hold NUL characters (SQLite's can); say so instead of a 500.
            if "NUL" in str(exc) or isinstance(exc, psycopg.errors.UntranslatableCharacter):
                raise BadRequest(NUL_IN_TEXT) from None
            raise

    @property
    def in_transaction(self) -> bool:
        return self.raw.info.transaction_status in (TransactionStatus.INTRANS, TransactionStatus.INERROR)

    @contextlib.contextmanager
    def pipeline(self):
        """Statements go out without waiting, reading an answer waits (PqPipeline); every answer is
        read by the end of the block."""
        pipe = self._pipe = PqPipeline(self.raw)
        try:
            yield
            pipe.finish()
        except BaseException:
            pipe.abandon()
            raise
        finally:
            self._pipe = None

    @property
    def usable(self) -> bool:
        return not (self.raw.closed or self.raw.broken)

    def close(self) -> None:
        self.raw.close()


Conn = Union[SqliteConnection, PostgresConnection]   # what every domain function takes
Row = Union[sqlite3.Row, PostgresRow]                 # what it reads: row["column"], row[0], dict(row)


class Cursor(typing.Protocol):
    """What a statement answers on either backend: sqlite3's cursor, psycopg's, or a pipelined answer."""

    def fetchone(self) -> Optional[Row]: ...

    def fetchall(self) -> list: ...


# A writer holds the one write lock for its transaction: if its server vanishes without closing
# the connection (a machine gone, a network cut), PostgreSQL ends the transaction after this long
# instead of waiting for TCP to notice, and the other servers write again. Our transactions never
# sit idle this long; a batch sends its next statement as soon as Python has it.
POSTGRES_IDLE_IN_TRANSACTION = "60s"


def configure_postgres(raw: "psycopg.Connection") -> None:
    """Every PostgreSQL connection: autocommit (run_jobs says BEGIN); booleans as integers (SQLite's
    columns are 0/1 integers, and domain code passes True/False); statements prepared early; an
    idle transaction does not hold the write lock for ever."""
    raw.autocommit = True
    raw.adapters.register_dumper(bool, BoolAsInteger)
    raw.prepare_threshold = 2
    raw.execute(f"SET idle_in_transaction_session_timeout = '{POSTGRES_IDLE_IN_TRANSACTION}'")


if psycopg is not None:
    class BoolAsInteger(psycopg.adapt.Dumper):
        oid = psycopg.adapters.types["int8"].oid

        def dump(self, obj: bool) -> bytes:
            return b"1" if obj else b"0"


def check_postgres(raw: "psycopg.Connection") -> None:
    encoding = raw.execute("SHOW server_encoding").fetchone()[0]
    if encoding.upper() not in ("UTF8", "UTF-8"):
        raise SystemExit(f"actae: the PostgreSQL database must be UTF8 (it is {encoding}): create it with"
                         " CREATE DATABASE ... ENCODING 'UTF8' TEMPLATE template0")


def migrate_postgres(raw: "psycopg.Connection") -> None:
    """Run the migrations this database has not run, recorded in actae_migrations; a session lock
    keeps servers starting together from running one twice."""
    raw.execute(f"SELECT pg_advisory_lock({POSTGRES_MIGRATION_LOCK})")
    try:
        raw.execute("CREATE TABLE IF NOT EXISTS actae_migrations (version BIGINT PRIMARY KEY, applied_at TEXT NOT NULL)")
        done = raw.execute("SELECT COALESCE(MAX(version), 0) FROM actae_migrations").fetchone()[0]
        for version in sorted({step.postgres for step in MIGRATIONS if step.postgres > done}):
            with raw.transaction():
                for step in MIGRATIONS:
                    if step.postgres == version:
                        for part in step.parts(POSTGRES):
                            part(PostgresConnection(raw)) if callable(part) else raw.execute(part)
                raw.execute("INSERT INTO actae_migrations (version, applied_at) VALUES (%s, %s)",
                            (version, iso(utc_now())))
    finally:
        raw.execute(f"SELECT pg_advisory_unlock({POSTGRES_MIGRATION_LOCK})")


def connect_postgres(url: str) -> PostgresConnection:
    """A configured, migrated connection for the command line."""
    raw = psycopg.connect(url)
    configure_postgres(raw)
    check_postgres(raw)
    migrate_postgres(raw)
    return PostgresConnection(raw)


STATE_CACHE_BYTES = 64 * 1024 * 1024   # rebuilt states kept in memory (by channel, version, sha256)


class StateCache:
    """Rebuilt states by (channel, version, sha256), least recently used first out, bounded in bytes.

    Versions never change once committed, so an entry is never stale; only committed states are
    put (readers see nothing else; writes put theirs after COMMIT). Callers never mutate a state."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.size = max_bytes, 0
        self.entries: "collections.OrderedDict" = collections.OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: tuple) -> Json:
        with self.lock:
            hit = self.entries.get(key)
            if hit is None:
                return MISSING
            self.entries.move_to_end(key)
            return hit[0]

    def put(self, key: tuple, value: Json, size: int) -> None:
        if size > self.max_bytes // 4:
            return
        with self.lock:
            old = self.entries.pop(key, None)
            self.size += size - (old[1] if old else 0)
            self.entries[key] = (value, size)
            while self.size > self.max_bytes:
                _, (_, dropped) = self.entries.popitem(last=False)
                self.size -= dropped

    def forget_channel(self, channel_id: str) -> None:
        with self.lock:
            for key in [k for k in self.entries if k[0] == channel_id]:
                self.size -= self.entries.pop(key)[1]


# =============================================================================
# Database: one writer path (group commit), pooled readers, either backend
# =============================================================================

@dataclass
class Tx:
    """What a write function gets: the connection, one clock reading, the events it appends, and
    what to do once (and only if) its work is committed."""

    conn: Conn
    now: datetime
    ts: str                          # `now` as stored: formatted once per batch, not per row
    events: list = field(default_factory=list)
    after_commit: list = field(default_factory=list)     # callables, run after COMMIT succeeded
    # Where statements cost a round trip (PostgreSQL) and the batch runs together: the answers a job
    # left for the batch to read after its COMMIT (see Later); None: every answer is read when sent.
    later: Optional[list] = None
    # What the regions keep in a write's transaction (the app's; every declared region's by default).
    hooks: StoreHooks = field(default_factory=lambda: declared_store_hooks())

    def may_settle_later(self, channel_id: str) -> bool:
        """Whether a write to this channel may leave its answer to the end of the batch: the channel
        was seen on this engine (a first write creates it, which needs the answer at once)."""
        known = self.conn.known_channels
        return self.later is not None and known is not None and channel_id in known


class Later:
    """The answer to a statement sent and not yet read: pipelined, a batch's appends and saves go out
    one after another, its COMMIT right behind them, and every answer comes back in one round trip.
    Such a statement is strict: where the one read at once inserts nothing (the channel missing or
    closed, the operation id used), it fails (a NULL key), so the COMMIT never runs and the batch runs
    again, each job answered at once (run_jobs). `make(row)` turns the answer into the job's value."""

    __slots__ = ("cursor", "make", "value")

    def __init__(self, cursor: Cursor, make: Callable[[tuple], object]):
        self.cursor, self.make, self.value = cursor, make, MISSING

    def settle(self) -> None:
        row = self.cursor.fetchone()
        if row is None:        # a strict statement either answers a row or fails
            raise RuntimeError("a strict statement answered no row")
        self.value = self.make(tuple(row))


def settled(value: object) -> object:
    """`value`, or what it stands for when it is a Later."""
    return value.value if isinstance(value, Later) else value


def committed(txs: list) -> None:
    """What the committed jobs asked for once committed; a failure there is logged, never the write's."""
    for tx in txs:
        for action in tx.after_commit:
            try:
                action()
            except Exception:  # noqa: BLE001 - the write is committed whatever happens here
                log.exception("an after-commit action failed")


@dataclass
class Job:
    work: Callable
    args: tuple
    future: asyncio.Future
    exclude: object = None              # a WebSocket connection that must not get its own events back
    bare: bool = False               # `work(conn, *args)` alone, outside any transaction (see Database.on_writer)
    # The channels it changes, when it changes no other row another channel's write could touch
    # (Database.channels_of says; PostgreSQL locks only these, see POSTGRES_WRITE_LOCK); None: any.
    channels: Optional[tuple] = None


def run_jobs(conn: Conn, jobs: list, hooks: Optional[StoreHooks] = None) -> list:
    """Run write jobs in ONE transaction (one fsync, one commit); returns, per job, `(result, events)`
    or `(exception, None)`, and raises if the commit itself fails.

    The batch is first run together: no savepoint per job (two statements of an event's four), and
    where a statement costs a round trip (PostgreSQL) pipelined, statements whose rows no job reads
    riding along with the next one that is read. Any failure in it rolls the whole batch back; a
    lone job's failure is then its outcome, and a batch runs again isolated, which gives each job
    exactly the outcome it would have had alone. `hooks`: what the regions keep in each job's
    transaction (an app's; every declared region's by default).
    """
    hooks = hooks or declared_store_hooks()
    try:
        return run_jobs_together(conn, jobs, hooks)
    except JobFailed as failed:
        if len(jobs) == 1 and not conn.dialect.pipelined:   # pipelined, an error may surface late: isolate
            return [(job_error(conn, failed.error), None)]
    except Exception:  # noqa: BLE001 - retried isolated below, which reports each job's own error
        if not conn.usable:
            raise          # the connection is gone: nothing committed, nothing to retry on
    return run_jobs_isolated(conn, jobs, hooks)


class JobFailed(Exception):
    """A job of a batch run together raised `error` (the batch is rolled back)."""

    def __init__(self, error: Exception):
        super().__init__(error)
        self.error = error


def batch_instant(conn: Conn) -> datetime:
    """The clock reading a batch stores: now, or a millisecond past the connection's previous batch
    where the clock has not moved on a millisecond since. Stored times have millisecond resolution
    and the runs pages list by last activity, so batches one after the other on one writer do not tie
    (the SDK's next write often commits within the millisecond). Never more than BATCH_LEAD_MAX ahead
    of the clock: leases, expiries and retention read these times against the clock, and only a
    writer committing over a thousand batches a second for a while would reach it."""
    now, previous = utc_now(), conn.last_batch_at
    if previous is not None and now < previous + BATCH_TICK:
        now = min(previous + BATCH_TICK, now + BATCH_LEAD_MAX)
    conn.last_batch_at = now.replace(microsecond=now.microsecond // 1000 * 1000)
    return now


def run_jobs_together(conn: Conn, jobs: list, hooks: StoreHooks) -> list:
    now = batch_instant(conn)
    ts = iso(now)
    outcomes, txs = [], []
    try:
        with conn.pipeline():
            for statement, args in conn.dialect.begin_batch(jobs):
                conn.execute(statement, args)
            for job in jobs:
                tx = Tx(conn, now, ts, later=[] if conn.dialect.pipelined else None, hooks=hooks)
                try:
                    outcomes.append((job.work(tx, *job.args), tx.events))
                except Exception as exc:  # noqa: BLE001 - rolled back below, the caller decides
                    raise JobFailed(exc) from exc
                txs.append(tx)
            conn.execute(COMMIT)             # pipelined: sent before any Later is read
            for tx in txs:
                for later in tx.later or ():
                    later.settle()
    except BaseException:
        if conn.usable and conn.in_transaction:
            conn.execute(ROLLBACK)
        raise
    for tx in txs:
        tx.events[:] = [settled(event) for event in tx.events]        # the lists outcomes hold
    outcomes = [(settled(result), events) for result, events in outcomes]
    announce_committed(conn, [event for _, events in outcomes for event in events])
    committed(txs)
    return outcomes


def announce_committed(conn: Conn, events: list) -> None:
    """Tell the other servers which channels got events, once committed. Not inside the transaction:
    PostgreSQL serialises the commits of every transaction that notifies (they would no longer
    overlap). A notice lost to a crash right after a commit only delays the other servers' streams
    until their next read (see FOLLOW_POLL_SECONDS); it never fails the committed write."""
    if not events:
        return
    try:
        conn.dialect.announce(conn, events)
    except Exception as exc:  # noqa: BLE001 - the write is committed whatever happens here
        log.warning("telling the other servers about a commit failed: %s", first_line(exc))


def job_error(conn: Conn, exc: Exception) -> Exception:
    """What a job that raised `exc` answers: a unique constraint's refusal is the caller's conflict."""
    if conn.dialect.is_unique_violation(exc):
        log.warning("a unique constraint refused a write: %s", first_line(exc))
        return Conflict("conflict", f"that already exists: {first_line(exc)}")
    return exc


def run_jobs_isolated(conn: Conn, jobs: list, hooks: StoreHooks) -> list:
    """Each job in a savepoint, so one failure rolls back alone."""
    outcomes, txs = [], []
    for statement, args in conn.dialect.begin_batch(jobs):
        conn.execute(statement, args)
    try:
        now = batch_instant(conn)
        ts = iso(now)
        for job in jobs:
            tx = Tx(conn, now, ts, hooks=hooks)
            conn.execute("SAVEPOINT job")
            try:
                outcome = (job.work(tx, *job.args), tx.events)
                txs.append(tx)
            except Exception as exc:  # noqa: BLE001 - handed to the caller, never swallowed
                if not conn.in_transaction:
                    raise              # the database aborted the whole transaction (disk full, I/O): all fail
                conn.execute("ROLLBACK TO job")
                outcome = (job_error(conn, exc), None)
            conn.execute("RELEASE job")
            outcomes.append(outcome)
        conn.execute(COMMIT)
    except BaseException:
        if conn.in_transaction:
            conn.execute(ROLLBACK)
        raise
    announce_committed(conn, [event for _, events in outcomes if events for event in events])
    committed(txs)
    return outcomes


@dataclass(frozen=True)
class Location:
    """Where the data lives: a PostgreSQL URL, or (without one) the SQLite file in the data dir."""

    data_dir: Path
    url: Optional[str] = None

    @property
    def backend(self) -> str:
        return backend_for(self).name

    @property
    def shared(self) -> bool:
        """Whether other servers may write this database too (PostgreSQL), or only this one (SQLite)."""
        return self.url is not None

    @property
    def sqlite_path(self) -> Path:
        return self.data_dir / DB_FILE

    def describe(self) -> str:
        if not self.url:
            return str(self.data_dir)
        parts = urlsplit(self.url)
        return f"postgresql://{parts.hostname or 'localhost'}{':' + str(parts.port) if parts.port else ''}{parts.path}"


def connect_sync(location: Location) -> Conn:
    """A configured, migrated connection for the command line (before or beside the server)."""
    return backend_for(location).connect(location)


def connect_sqlite(location: Location) -> SqliteConnection:
    conn = sqlite3.connect(location.sqlite_path, isolation_level=None, check_same_thread=False,
                           factory=SqliteConnection)
    configure_sqlite(conn)
    migrate_sqlite(conn)
    return conn


class Engine:
    """How a backend's connections meet asyncio: whole domain functions cross to database threads,
    one writer at a time, readers beside it."""

    def __init__(self, location: Location):
        self.location = location
        self.states = StateCache(STATE_CACHE_BYTES)    # rebuilt states, shared by this engine's connections

    async def open(self) -> None:
        """Connect, configure and migrate; fail fast with the database's own message."""
        raise NotImplementedError

    async def read(self, fn: Callable, *args):
        raise NotImplementedError

    writers = 1                          # writer loops at once (see WriteQueue)

    async def run_writer(self, writer: Callable[[Callable], None]) -> None:
        """Run `writer(on_connection)` on a writer's thread until it returns; `on_connection(fn, *args)`
        there runs `fn(conn, *args)` on a writer connection. Called once per writer."""
        raise NotImplementedError

    def on_writer_here(self) -> Optional[Callable]:
        """An `on_connection` for the calling thread, where a lone write may commit on the event loop's
        thread (see Database._committed_here); None where a statement is a network round trip."""
        return None

    async def listen(self, on_notify: Callable) -> None:
        """Hear other servers' commits until cancelled (a backend only one server writes hears none)."""

    async def close(self) -> None:
        raise NotImplementedError


def aiosqlite_internals(conn: aiosqlite.Connection) -> tuple:
    """aiosqlite's private pair: the call that runs a whole function on the connection's own thread,
    and the sqlite3 connection it wraps. Its public API crosses threads once per statement; a domain
    function (often a dozen statements) crosses once this way. The only use of aiosqlite's
    internals: requirements.txt bounds aiosqlite to the versions the suite runs on."""
    return conn._execute, conn._conn


class SqliteEngine(Engine):
    """SQLite threads through aiosqlite: one writer connection, a few readers (WAL lets them overlap)."""

    READERS = 2                          # readers wait on the disk: more threads do not pay

    def __init__(self, location: Location):
        super().__init__(location)
        self.path, self._reader_count = location.sqlite_path, self.READERS
        self._writer: Optional[aiosqlite.Connection] = None
        self._readers: list = []
        self._next_reader = 0

    async def open(self) -> None:
        self._writer = await self._connect()
        await self._call(self._writer, lambda conn: (configure_sqlite(conn), migrate_sqlite(conn)))
        for _ in range(self._reader_count):
            reader = await self._connect()
            await self._call(reader, configure_sqlite)
            self._readers.append(reader)
        for conn in (self._writer, *self._readers):
            aiosqlite_internals(conn)[1].states = self.states

    async def _connect(self) -> aiosqlite.Connection:
        # check_same_thread=False: a lone write may run on the event loop's thread (Database._committed_here).
        return await aiosqlite.connect(self.path, isolation_level=None, factory=SqliteConnection,
                                       check_same_thread=False)

    @staticmethod
    async def _call(conn: aiosqlite.Connection, fn: Callable, *args):
        ship, raw = aiosqlite_internals(conn)
        return await ship(fn, raw, *args)

    async def read(self, fn: Callable, *args):
        reader = self._readers[self._next_reader % len(self._readers)]
        self._next_reader += 1
        return await self._call(reader, fn, *args)

    async def run_writer(self, writer: Callable[[Callable], None]) -> None:
        await self._call(self._writer, lambda conn: writer(lambda fn, *args: fn(conn, *args)))

    def on_writer_here(self) -> Optional[Callable]:
        _, conn = aiosqlite_internals(self._writer)   # shared with the writer's thread, never at once (WriteQueue)
        return lambda fn, *args: fn(conn, *args)

    async def close(self) -> None:
        for conn in [*self._readers, self._writer]:
            if conn is not None:
                await conn.close()


POSTGRES_RECONNECT_SECONDS = 1.0
POSTGRES_IDLE_CHECK_SECONDS = 1.0      # a pooled connection idle this long is asked whether it still works
KNOWN_CHANNELS_MAX = 100_000


class PostgresEngine(Engine):
    """psycopg connections from psycopg_pool pools, each call on a thread of its own pool.

    Domain functions are synchronous (the same ones SQLite runs), so they run on threads with
    synchronous connections, a whole function per crossing; the LISTEN side is asyncio (psycopg's
    AsyncConnection), as it only waits.
    """

    READERS = 4                          # readers wait on the network: more threads pay there
    # One writer, as on SQLite: since a batch's statements cost little to send (PqPipeline), the jobs
    # that queue while it waits for its COMMIT make the next batch bigger, which costs less per write
    # than a second writer's smaller batches (measured: B1b on one server 8% faster with one, on three
    # the same; two had paid while each statement cost a round trip's worth of psycopg's work).

    def __init__(self, location: Location):
        super().__init__(location)
        self.url, self._reader_count = location.url, self.READERS
        self.origin = secrets.token_hex(8)
        self.known_channels: set = set()        # a hint only: a channel deleted since costs a batch a rerun
        self.peers = Peers()
        self._writer_pool = self._reader_pool = None
        self._writer_thread = concurrent.futures.ThreadPoolExecutor(self.writers, thread_name_prefix="actae-pg-writer")
        self._reader_threads = concurrent.futures.ThreadPoolExecutor(self._reader_count,
                                                                    thread_name_prefix="actae-pg-reader")

    async def open(self) -> None:
        with psycopg.connect(self.url) as raw:        # fails fast, with PostgreSQL's own message
            configure_postgres(raw)
            check_postgres(raw)
            migrate_postgres(raw)
        self._writer_pool = self._pool(self.writers, "actae-writer")
        self._reader_pool = self._pool(self._reader_count, "actae-readers")
        loop = asyncio.get_running_loop()
        await asyncio.gather(loop.run_in_executor(self._writer_thread, self._writer_pool.wait),
                             loop.run_in_executor(self._reader_threads, self._reader_pool.wait))

    def _pool(self, size: int, name: str) -> "psycopg_pool.ConnectionPool":
        # A connection the server lost (a restart, a network cut) is replaced by the pool. Before each
        # use it is looked at (a restart leaves its goodbye to read), and one idle for
        # POSTGRES_IDLE_CHECK_SECONDS is also asked (one round trip; a busy server pays nothing), so
        # the first write after a restart goes to a fresh connection instead of failing; a batch that
        # still meets a lost connection fails (503), and nothing of it was committed.
        returned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

        def note_return(conn: "psycopg.Connection") -> None:
            returned[conn] = time.monotonic()

        def check_if_idle(conn: "psycopg.Connection") -> None:
            # An idle connection has nothing to read; one whose server went away (a restart) has its
            # goodbye or its end waiting (one syscall tells): then, or after a while idle, ask it.
            if (select.select([conn.fileno()], [], [], 0)[0]
                    or time.monotonic() - returned.get(conn, -math.inf) > POSTGRES_IDLE_CHECK_SECONDS):
                psycopg_pool.ConnectionPool.check_connection(conn)
        return psycopg_pool.ConnectionPool(self.url, min_size=size, max_size=size, name=name, open=True,
                                           configure=configure_postgres, check=check_if_idle, reset=note_return,
                                           reconnect_timeout=3600)

    def _run(self, pool: "psycopg_pool.ConnectionPool", fn: Callable, args: tuple):
        try:
            with pool.connection() as raw:
                return fn(PostgresConnection(raw, self.origin, self.states, self.known_channels, self.peers), *args)
        except (psycopg.OperationalError, psycopg_pool.PoolTimeout) as exc:
            raise DatabaseUnavailable(f"PostgreSQL is unavailable: {first_line(exc)}") from exc

    async def read(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(
            self._reader_threads, self._run, self._reader_pool, fn, args)

    async def run_writer(self, writer: Callable[[Callable], None]) -> None:
        await asyncio.get_running_loop().run_in_executor(
            self._writer_thread, writer, lambda fn, *args: self._run(self._writer_pool, fn, args))

    async def listen(self, on_notify: Callable) -> None:
        """Hear the channels other servers wrote to, until cancelled; after a lost connection,
        `on_notify(None, None)` says anything may have been missed. This server's own commits are
        skipped: they reach the hub from the writer, in order, knowing who published them.

        Listening, it says hello, and answers another's; hearing of another server for the first
        time, it starts telling of its commits (Peers). Commits either side made before the news
        arrived told nobody, so on_notify(None, None) reads again PEER_SETTLE_SECONDS after each."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as conn:
                    await conn.execute(f"LISTEN {POSTGRES_CHANNEL}")
                    await self.tell_peers(PEER_HELLO)
                    on_notify(None, None)
                    loop.call_later(PEER_SETTLE_SECONDS, on_notify, None, None)
                    async for note in conn.notifies():
                        origin, _, lines = note.payload.partition("\n")
                        if origin == self.origin:
                            continue
                        if not self.peers.present:
                            self.peers.present = True
                            loop.call_later(PEER_SETTLE_SECONDS, on_notify, None, None)
                        if lines == PEER_HELLO:
                            await self.tell_peers(PEER_HERE)
                        for line in lines.split("\n"):
                            channel_id, _, cursor = line.rpartition("\t")
                            if channel_id and cursor.isdigit():
                                on_notify(channel_id, int(cursor))
            except psycopg.OperationalError as exc:
                log.warning("listening for other servers' writes failed (%s); retrying", first_line(exc))
                await asyncio.sleep(POSTGRES_RECONNECT_SECONDS)

    async def tell_peers(self, word: str) -> None:
        """PEER_HELLO or PEER_HERE to the other servers' listeners, from a reader's connection (the
        listening one is busy listening)."""
        payload = f"{self.origin}\n{word}"
        try:
            await self.read(lambda conn: conn.execute("SELECT pg_notify(?, ?)", (POSTGRES_CHANNEL, payload)).fetchone())
        except Exception as exc:  # noqa: BLE001 - unsure who listens, tell of every commit
            self.peers.present = True
            log.warning("telling the other servers this one listens failed: %s", first_line(exc))

    async def close(self) -> None:
        for pool in (self._writer_pool, self._reader_pool):
            if pool is not None:
                pool.close()
        self._writer_thread.shutdown(wait=False)
        self._reader_threads.shutdown(wait=False)


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class WriteQueue:
    """The write jobs waiting for a writer, and the batches being written.

    One writer (each engine's now) takes the jobs at the front, in the order they came: a bare job
    alone, None (stop) ends a batch. Several (PostgreSQL's batches on different channels can commit
    at once, so one batch's COMMIT could overlap the next one's statements) take only jobs whose
    channels no batch in flight holds, and skip the others with every later job of their channels:
    one channel's jobs are then written one batch after another, in the order they came, each batch
    committed and handed back before the next begins. A batch with a job that names no channels runs with no other
    beside it; a bare job runs alone."""

    def __init__(self, writers: int):
        self.writers = writers
        self._ready = threading.Condition()
        self._jobs: collections.deque = collections.deque()   # Jobs; None: a writer stops there
        self._held: dict = {}          # id of a batch in flight -> its channels (a set), or None: every one

    def put(self, job: Optional[Job]) -> None:
        with self._ready:
            self._jobs.append(job)
            self._ready.notify()

    def take(self) -> Optional[list]:
        """The next batch (in flight until `done`), once there is one; None: stop."""
        with self._ready:
            while True:
                if self._jobs and self._jobs[0] is None:
                    self._jobs.popleft()
                    return None
                batch = self._takeable()
                if batch:
                    self._held[id(batch)] = self._channels(batch)
                    return batch
                self._ready.wait()

    def take_alone(self, job: Job) -> Optional[list]:
        """`job` as a batch of its own, if nothing is queued or in flight (else None)."""
        with self._ready:
            if self._jobs or self._held:
                return None
            batch = [job]
            self._held[id(batch)] = None
            return batch

    def done(self, batch: list) -> None:
        with self._ready:
            del self._held[id(batch)]
            self._ready.notify_all()

    def drain(self) -> list:
        with self._ready:
            jobs = [job for job in self._jobs if job is not None]
            self._jobs.clear()
            return jobs

    def _takeable(self) -> list:
        if any(channels is None for channels in self._held.values()):
            return []
        held = set().union(*self._held.values())
        taken, blocked = [], set()
        for job in self._jobs:
            if job is None or len(taken) >= WRITE_BATCH_MAX:
                break
            if job.bare:
                if not taken and not self._held:
                    taken.append(job)
                break
            if self._held:                       # several writers, one batch in flight
                if job.channels is None:
                    break                        # it may change any channel: after that batch
                if not (held.isdisjoint(job.channels) and blocked.isdisjoint(job.channels)):
                    blocked.update(job.channels)
                    continue
            taken.append(job)
        if taken:
            chosen = {id(job) for job in taken}
            self._jobs = collections.deque(job for job in self._jobs if id(job) not in chosen)
        return taken

    def _channels(self, batch: list) -> Optional[set]:
        if self.writers == 1 or any(job.bare or job.channels is None for job in batch):
            return None
        return {channel for job in batch for channel in job.channels}


@dataclass(frozen=True)
class CommitListeners:
    """Who hears the writer, given when the Database is built: `commits(events, exclude)` this server's
    committed events, `notices(channel_id, cursor)` the channels other servers wrote to (PostgreSQL
    only), `batches(jobs, outcomes, seconds)` every committed batch (the regions' metrics, traces)."""

    commits: list[Callable[[list, object], None]] = field(default_factory=list)
    notices: list[Callable[[Optional[str], Optional[int]], None]] = field(default_factory=list)
    batches: list[Callable[[list, list, float], None]] = field(default_factory=list)


@dataclass(frozen=True)
class CommitPolicy:
    """What the writer asks of whoever it serves, given when the Database is built (by the app
    factory; storage knows nothing of HTTP): whether a job alone on the server may commit on the
    event loop's thread, and which runs a job changes (None: it may change any)."""

    alone: Callable[[Job], bool] = lambda job: False
    channels_of: Callable[[Job], Optional[tuple]] = lambda job: None


class Database:
    """The only code that touches the database.

    Writes: `await db.write(fn, *args)` queues `fn(tx, *args)`; a writer, a loop on one of the
    engine's writer threads, runs the queued jobs in one transaction and answers each caller after
    that batch commits (group commit; WriteQueue says which jobs share a batch, and where the engine
    has several writers, which batches may run at once). The loop lives on that thread, so a job
    crosses threads once each way, with no writer task on the event loop to wake in between; a quick
    write alone on the server does not cross at all (`_committed_here`).
    Reads: `await db.read(fn, *args)` runs `fn(conn, *args)` on a pooled reader connection.
    `listeners` hear its commits (CommitListeners); `hooks` are what the regions keep in a write's
    transaction (StoreHooks: every declared region's unless the app factory says).
    """

    def __init__(self, location: Location, policy: CommitPolicy = CommitPolicy(),
                 hooks: Optional[StoreHooks] = None, listeners: Optional[CommitListeners] = None):
        self.location = location
        self.policy = policy
        self.hooks = hooks or declared_store_hooks()
        self.listeners = listeners or CommitListeners()
        self.engine = backend_for(location).engine(location)
        self._jobs = WriteQueue(self.engine.writers)
        self._here: Optional[Callable] = None     # the engine's on_writer_here (None: always the writer's thread)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.last_batch_seconds = math.inf
        self.here_seconds_max = HERE_COMMIT_SECONDS_MAX   # a batch quicker than this lets the next lone one commit here
        self._writer_tasks: list = []
        self._listener_task: Optional[asyncio.Task] = None
        self._closed = False
        self.batches = 0
        self.batched_jobs = 0

    async def open(self) -> "Database":
        await self.engine.open()
        self._loop = asyncio.get_running_loop()
        self._here = self.engine.on_writer_here()
        for _ in range(self.engine.writers):
            task = asyncio.create_task(self.engine.run_writer(self._writer))
            task.add_done_callback(self._writer_ended)
            self._writer_tasks.append(task)
        self._listener_task = asyncio.create_task(self.engine.listen(self._notified))
        return self

    async def close(self) -> None:
        """Commit what is queued, refuse what comes later, close the connections."""
        self._closed = True
        try:
            if self._listener_task:
                self._listener_task.cancel()
                await asyncio.gather(self._listener_task, return_exceptions=True)
            for _ in self._writer_tasks:
                self._jobs.put(None)
            await asyncio.gather(*self._writer_tasks, return_exceptions=True)
        finally:
            self._refuse_queued()
            await self.engine.close()

    async def read(self, fn: Callable, *args):
        return await self.engine.read(fn, *args)

    async def write(self, fn: Callable, *args, exclude: object = None):
        return await self._queue(Job(fn, args, None, exclude))

    def read_here(self, fn: Callable, *args):
        """`fn(conn, *args)` on the writer's connection on this (the event loop's) thread, outside any
        transaction, when the writer is idle and the engine runs lone writes here (SQLite); None
        otherwise, and the caller goes to the writer. No write can commit between this read and the
        caller's next await, so what it decides from the read holds as if decided in a transaction."""
        if self._here is None or self.location.shared:
            return None
        batch = self._jobs.take_alone(Job(fn, args, None, bare=True))
        if batch is None:
            return None                            # a batch is queued or being written
        try:
            return self._here(fn, *args)
        finally:
            self._jobs.done(batch)

    async def on_writer(self, fn: Callable, *args):
        """`fn(conn, *args)` on the writer's connection between two batches, outside any transaction
        (what SQLite cannot do inside one, such as returning freed pages)."""
        return await self._queue(Job(fn, args, None, bare=True))

    async def _queue(self, job: Job):
        if self._closed:
            raise ShuttingDown()
        job.future = self._loop.create_future()
        if self.location.shared and not job.bare:
            job.channels = self.policy.channels_of(job)
        if not self._committed_here(job):
            self._jobs.put(job)
        return await job.future

    def _committed_here(self, job: Job) -> bool:
        """Commit `job` alone on this (the event loop's) thread when that costs nobody a wait: nothing
        queued or being written, nothing else in flight (`policy.alone`), the last batch quick.
        A lone request then skips two thread switches (a tenth of its time on a two-core VM); the
        loop waits on the disk meanwhile, which is why a slow commit sends the next ones to the
        writer's thread until one is quick again."""
        if (self._here is None or job.bare or self.last_batch_seconds > self.here_seconds_max
                or not self.policy.alone(job)):
            return False
        batch = self._jobs.take_alone(job)
        if batch is None:
            return False                           # queued or being written: join the next batch
        try:
            self._settle(*self._run_batch(batch, self._here))
        finally:
            self._jobs.done(batch)
        return True

    # --- on the writer's thread ---

    def _writer(self, on_connection: Callable) -> None:
        """Batches until told to stop: each is handed back to the event loop once committed, before
        the next batch of its channels can begin (WriteQueue)."""
        while True:
            jobs = self._jobs.take()
            if jobs is None:
                return
            try:
                self._loop.call_soon_threadsafe(self._settle, *self._run_batch(jobs, on_connection))
            finally:
                self._jobs.done(jobs)

    def _notified(self, channel_id: Optional[str], cursor: Optional[int]) -> None:
        for hear in self.listeners.notices:
            hear(channel_id, cursor)

    def _run_batch(self, jobs: list, on_connection: Callable) -> tuple:
        """(jobs, their outcomes or None, the failure or None, seconds): what _settle takes."""
        started, first = time.perf_counter(), jobs[0]
        try:
            if first.bare:
                outcomes, failure = [(on_connection(first.work, *first.args), [])], None
            else:
                outcomes, failure = on_connection(run_jobs, jobs, self.hooks), None
        except Exception as exc:  # noqa: BLE001 - the commit failed: nobody's write happened
            outcomes, failure = None, exc
        return jobs, outcomes, failure, time.perf_counter() - started

    # --- back on the event loop ---

    def _settle(self, jobs: list, outcomes: Optional[list], failure: Optional[Exception], seconds: float) -> None:
        self.last_batch_seconds = seconds
        if failure is not None:
            if not isinstance(failure, DatabaseUnavailable):
                log.error("write batch failed", exc_info=failure)
            for job in jobs:
                if not job.future.done():
                    job.future.set_exception(failure)
            return
        if jobs[0].bare:
            if not jobs[0].future.done():
                jobs[0].future.set_result(outcomes[0][0])
            return
        self.batches += 1
        self.batched_jobs += len(jobs)
        for job, (result, events) in zip(jobs, outcomes):
            if events:
                try:
                    for hear in self.listeners.commits:
                        hear(events, job.exclude)
                except Exception:  # noqa: BLE001 - a broadcast problem must not leave writers waiting
                    log.exception("broadcasting committed events failed")
            if job.future.done():
                continue
            if events is None:
                job.future.set_exception(result)
            else:
                job.future.set_result(result)
        try:
            for hear in self.listeners.batches:
                hear(jobs, outcomes, seconds)
        except Exception:  # noqa: BLE001 - metrics and traces must not break the writer
            log.exception("observing a committed batch failed")

    def _writer_ended(self, task: asyncio.Task) -> None:
        if not self._closed and not task.cancelled():
            log.error("the database writer stopped", exc_info=task.exception())
            self._closed = True
            self._refuse_queued()

    def _refuse_queued(self) -> None:
        for job in self._jobs.drain():
            if not job.future.done():
                job.future.set_exception(ShuttingDown())


@dataclass(frozen=True)
class Backend:
    """One storage backend, whole: adding one means one of these, a Dialect (its connections carry it,
    and each of MIGRATIONS' steps renders its SQL with it) and an Engine."""

    name: str                                # what /api/v1/instance reports
    engine: type                             # an Engine subclass: the server's connections
    connect: Callable[[Location], Conn]      # a configured, migrated connection for the command line


SQLITE_BACKEND = Backend("sqlite", SqliteEngine, connect_sqlite)
POSTGRES_BACKEND = Backend("postgresql", PostgresEngine, lambda location: connect_postgres(location.url))


def backend_for(location: Location) -> Backend:
    """The one place a backend is chosen: a database URL names PostgreSQL, else the data dir's SQLite file."""
    return POSTGRES_BACKEND if location.url else SQLITE_BACKEND


# =============================================================================
# Store: the queries more than one place needs, one named function each
# =============================================================================
# Domain functions call these and decide what a row (or its absence) means; a query only one
# function needs stays in that function.

def state_version_row(conn: Conn, channel_id: str, version: int) -> Optional[Row]:
    return conn.execute("SELECT * FROM states WHERE channel_id = ? AND version = ?", (channel_id, version)).fetchone()


def row_where(conn: Conn, table: str, **columns: object) -> Optional[Row]:
    """The row of `table` whose columns hold these values (by a unique key). Table and column names
    are the schema's, never a name from input."""
    where = " AND ".join(f"{name} = ?" for name in columns)
    return conn.execute(f"SELECT * FROM {table} WHERE {where}", tuple(columns.values())).fetchone()


def rows_where(conn: Conn, table: str, order_by: str, **columns: object) -> list:
    """Every row of `table` whose columns hold these values, in `order_by` order."""
    where = " AND ".join(f"{name} = ?" for name in columns)
    return conn.execute(f"SELECT * FROM {table} WHERE {where} ORDER BY {order_by}", tuple(columns.values())).fetchall()


def last_event_value(column: str, alias: str) -> str:
    """SQL for one column of a channel's last event (NULL before its first); `alias` names the
    channels table, with its dot."""
    return f"(SELECT e.{column} FROM events e WHERE e.channel_id = {alias}id ORDER BY e.cursor DESC LIMIT 1)"


# A channel's row as every reader sees it: its columns, and its last cursor and chain head, which are
# its last event's (see heads_from_events). `c` is the channel's row. Lists need the cursor alone.
LAST_CURSOR = "COALESCE((SELECT MAX(h.cursor) FROM events h WHERE h.channel_id = c.id), 0) AS last_cursor"
CHANNEL_HEAD = f"{LAST_CURSOR}, COALESCE({last_event_value('chain_hash', 'c.')}, c.chain_base) AS chain_head"
CHANNEL_ROW = f"SELECT c.*, {CHANNEL_HEAD} FROM channels c"
CHANNEL_BY_ID = f"{CHANNEL_ROW} WHERE c.id = ?"


def activity_sql(alias: str) -> str:
    """SQL for a run's exact last activity: its row's updated_at (which events move only when its
    second changes, see event_facts_sql; other writes set it exactly) or its last event's time,
    whichever is later. `alias` names the channels table, with its dot."""
    last = last_event_value("created_at", alias)
    return f"(CASE WHEN {last} > {alias}updated_at THEN {last} ELSE {alias}updated_at END)"


def channel_by_id(conn: Conn, channel_id: str) -> Optional[Row]:
    return conn.execute(CHANNEL_BY_ID, (channel_id,)).fetchone()


def events_after(conn: Conn, channel_id: str, after: int, limit: int, *, event_type: Optional[str] = None,
                 upto: Optional[int] = None) -> list:
    """A channel's event rows with cursor in (after, upto], in cursor order, at most `limit`."""
    sql, args = "SELECT * FROM events WHERE channel_id = ? AND cursor > ?", [channel_id, after]
    if event_type is not None:
        sql, args = sql + " AND type = ?", args + [event_type]
    if upto is not None:
        sql, args = sql + " AND cursor <= ?", args + [upto]
    return conn.execute(sql + " ORDER BY cursor LIMIT ?", (*args, limit)).fetchall()


def channel_event_rows(conn: Conn, channel_id: str) -> list:
    """Every event row of a channel, in cursor order (export, the chain backfill)."""
    return conn.execute("SELECT * FROM events WHERE channel_id = ? ORDER BY cursor", (channel_id,)).fetchall()


# A run's duration, wherever a page shows one (the runs list, a run's page and its chart, what a fork's
# own steps took): from its first event to its last, where a fork's first is the one after its
# fork.started marker (cursor 1, written when the fork is made: its tail may start days later).
FIRST_OWN_EVENT = "CASE WHEN {c}parent_id IS NULL THEN 1 ELSE 2 END"


def first_event_at(conn: Conn, channel_id: str) -> Optional[str]:
    """When a run's own work began (see FIRST_OWN_EVENT)."""
    row = conn.execute(f"SELECT e.created_at FROM channels c JOIN events e ON e.channel_id = c.id"
                       f" AND e.cursor = {FIRST_OWN_EVENT.format(c='c.')} WHERE c.id = ?", (channel_id,)).fetchone()
    return row[0] if row else None


def last_step_at(conn: Conn, channel_id: str, cursor: int) -> Optional[int]:
    """The step number of the last step event at or before `cursor` on this channel itself."""
    row = conn.execute("SELECT step_number FROM events WHERE channel_id = ? AND cursor <= ?"
                       " AND step_number IS NOT NULL ORDER BY cursor DESC LIMIT 1", (channel_id, cursor)).fetchone()
    return row[0] if row else None


def refresh_run_facts(conn: Conn, channel_id: Optional[str] = None) -> None:
    """Recompute what the write path keeps on a channel row (the type of its last event while that
    blocks the run, its first error event, its latest snapshot's status) from its rows; None: every
    channel (the migrations that added them)."""
    where, args = ("", ()) if channel_id is None else (" WHERE id = ?", (channel_id,))
    conn.execute(
        "UPDATE channels SET"
        " last_event_type = (SELECT e.type FROM events e WHERE e.channel_id = channels.id"
        " AND e.cursor = (SELECT MAX(m.cursor) FROM events m WHERE m.channel_id = channels.id)"
        f" AND e.type IN ({sql_list(BLOCKING_EVENT_TYPES)})),"
        " error_cursor = (SELECT MIN(e.cursor) FROM events e WHERE e.channel_id = channels.id"
        f" AND {failure_event_sql(conn.dialect, 'e.type')}),"
        " last_state_status = (SELECT s.status FROM states s WHERE s.channel_id = channels.id"
        f" ORDER BY s.version DESC LIMIT 1){where}", args)


def event_at(conn: Conn, channel_id: str, cursor: int) -> Optional[Row]:
    return conn.execute("SELECT * FROM events WHERE channel_id = ? AND cursor = ?", (channel_id, cursor)).fetchone()


def union_of_pages(conn: Conn, pages: list, order: str, limit: int) -> list:
    """Rows of several `(sql, args)` queries, each one ordered page of an index, merged by the database
    in `order` (their common ORDER BY) and cut at `limit`; one query runs as it is."""
    if len(pages) == 1:
        return conn.execute(*pages[0]).fetchall()
    sql = " UNION ALL ".join(f"SELECT * FROM ({page}) AS part{i}" for i, (page, _) in enumerate(pages))
    return conn.execute(f"{sql} ORDER BY {order} LIMIT ?", [arg for _, args in pages for arg in args] + [limit]).fetchall()


def present(row: Optional[Row], missing: Callable[[], ActaeError]) -> Row:
    """`row`, or `missing()` raised when there is none (built only then: these lookups sit on every
    ledger and channel request)."""
    if row is None:
        raise missing()
    return row


@contextlib.contextmanager
def read_snapshot(conn: Conn):
    """The SELECTs inside see one committed state (a read transaction): an export, or a prune's plan, never
    mixes two moments."""
    if conn.in_transaction:
        yield
        return
    conn.execute(conn.dialect.begin_snapshot)
    try:
        yield
    finally:
        conn.execute(COMMIT)


def database_bytes(conn: Conn) -> int:
    """The database's size: SQLite's pages in use by the file, PostgreSQL's pg_database_size."""
    if conn.dialect is SQLITE:
        return sqlite_pragma(conn, "page_count") * sqlite_pragma(conn, "page_size")
    return conn.execute("SELECT pg_database_size(current_database())").fetchone()[0]


def sqlite_pragma(conn: Conn, name: str) -> object:
    """A SQLite PRAGMA's value (`name` is one of ours, never input); the whole result is read, so a
    pragma that works row by row (incremental_vacuum, wal_checkpoint) runs to its end."""
    rows = conn.execute(f"PRAGMA {name}").fetchall()
    return rows[0][0] if rows else None


def events_after_position(conn: Conn, position: int, reach: "Reach", limit: int) -> list:
    """[(position, Event)] of every channel `reach` sees, after `position` in commit order, at most `limit`."""
    column = conn.dialect.event_position
    where = Where().add(f"{column} > ?", position).within(reach, "channel_id")
    if conn.dialect.settled_positions:
        where.add(conn.dialect.settled_positions)
    rows = conn.execute(f"SELECT {column} AS position, * FROM events{where} ORDER BY {column} LIMIT ?",
                        (*where.args, limit)).fetchall()
    return [(row["position"], event_of(row)) for row in rows]


def latest_position(conn: Conn) -> int:
    """Where a stream "from now on" starts: after every position that is final (see settled_positions)."""
    column = conn.dialect.event_position
    where = Where().add(conn.dialect.settled_positions) if conn.dialect.settled_positions else Where()
    return conn.execute(f"SELECT COALESCE(MAX({column}), 0) FROM events{where}").fetchone()[0]


def replay_events(conn: Conn, channel_id: str, after: int, limit: int,
                  event_type: Optional[str] = None) -> list[Event]:
    return [event_of(r) for r in events_after(conn, channel_id, after, limit, event_type=event_type)]


class Where:
    """AND-ed filter clauses and their arguments, for queries whose filters are all optional."""

    def __init__(self):
        self.clauses: list = []
        self.args: list = []

    def add(self, clause: str, *args) -> "Where":
        self.clauses.append(clause)
        self.args += args
        return self

    def add_if(self, value: object, clause: str) -> "Where":
        return self.add(clause, value) if value is not None else self

    def within(self, reach: "Reach", column: str) -> "Where":
        """Only rows whose `column` names a channel `reach` sees."""
        seen = reach.where(column)
        return self if seen is None else self.add(seen[0], *seen[1])

    def __str__(self) -> str:
        return f" WHERE {' AND '.join(self.clauses)}" if self.clauses else ""


def fetch_or_raise(conn: Conn, missing: Callable[[], ActaeError], sql: str, *args) -> Row:
    """The one row a lookup only one place makes selects, or `missing()` raised."""
    return present(conn.execute(sql, args).fetchone(), missing)


def keep_usage(conn: Conn, channel_id: str, cursor: Optional[int], payload: Json, metadata: Json) -> None:
    """An event's usage, kept beside it (nothing for one that records none), so what a run or a fork
    spent is a sum of stored numbers, not a read of every payload. A cursor of None: the event the
    channel appended last (one whose answer is not read yet)."""
    usage = usage_of(payload, metadata)
    if usage is not None:
        at = "?" if cursor is not None else "(SELECT MAX(cursor) FROM events WHERE channel_id = ?)"
        conn.execute("INSERT INTO step_usage (channel_id, cursor, input_tokens, output_tokens, cost, model, duration_ms)"
                     f" VALUES (?, {at}, ?, ?, ?, ?, ?)",
                     (channel_id, channel_id if cursor is None else cursor, usage.get("input_tokens"),
                      usage.get("output_tokens"), usage.get("cost"), usage.get("model"), usage.get("duration_ms")))


def index_usage(conn: Conn, channel_id: Optional[str] = None) -> None:
    """Keep the usage of the events already stored (a run imported, a database from before usage was
    kept, or from before the rule read adapters' events)."""
    where = Where().add_if(channel_id, "channel_id = ?")
    conn.execute(f"DELETE FROM step_usage{where}", where.args)
    for row in conn.execute(f"SELECT channel_id, cursor, payload, metadata FROM events{where}", where.args).fetchall():
        keep_usage(conn, row["channel_id"], row["cursor"], load(row["payload"]), load(row["metadata"]))


def event_of(row: Row) -> Event:
    return Event(id=row["id"], channel_id=row["channel_id"], type=row["type"], payload=load_stored(row["payload"]),
                 actor=row["actor"], cursor=row["cursor"], channel_cursor=row["cursor"], timestamp=row["created_at"],
                 agent_id=row["agent_id"], user_id=row["user_id"], metadata=load_stored(row["metadata"]),
                 depends_on=row["depends_on"], step_number=row["step_number"], chain_hash=row["chain_hash"])


# =============================================================================
# Principals: API keys, accounts, login tokens, dashboard sessions (the kernel's: every door asks them)
# =============================================================================

Item = typing.TypeVar("Item")


@dataclass(frozen=True)
class Reach:
    """The channels one principal may see (read) and change (write), as domain code asks it. Every door
    (the direct routes, the gateway, bulk fork, the inbox, the pages, the streams) asks this one
    question; a channel a principal may not see is answered as one that does not exist."""

    read: tuple                        # patterns of the SDK's grammar (see pattern_matches)
    write: tuple
    delete: tuple = ()

    def sees(self, channel_id: str) -> bool:
        return any(pattern_matches(p, channel_id) for p in self.read)

    def changes(self, channel_id: str) -> bool:
        return any(pattern_matches(p, channel_id) for p in self.write)

    def removes(self, channel_id: str) -> bool:
        return any(pattern_matches(p, channel_id) for p in self.delete)

    @property
    def sees_all(self) -> bool:
        return "*" in self.read

    @property
    def everywhere(self) -> bool:
        """It reads and changes every channel (an admin's, the command line's)."""
        return "*" in self.read and "*" in self.write

    def seen(self, items: typing.Iterable[Item], channel_of: Callable[[Item], str] = lambda channel_id: channel_id) -> list[Item]:
        """The ones of `items` (channel ids, or records `channel_of` names the channel of) it sees, in order."""
        return list(items) if self.sees_all else [item for item in items if self.sees(channel_of(item))]

    def where(self, column: str) -> Optional[tuple]:
        """(SQL clause, args) limiting `column` to the channels it sees; None when it sees every one."""
        if self.sees_all:
            return None
        clauses, args = [], []
        for pattern in dict.fromkeys(self.read):
            if pattern.endswith("*"):
                clauses.append(f"substr({column}, 1, ?) = ?")
                args += [len(pattern) - 1, pattern[:-1]]
            else:
                clauses.append(f"{column} = ?")
                args.append(pattern)
        return (f"({' OR '.join(clauses)})", args) if clauses else ("1 = 0", [])


EVERYWHERE = Reach(("*",), ("*",), ("*",))      # the command line's and the admin's


def pattern_matches(pattern: str, channel_id: str) -> bool:
    """The SDK's grammar: "*" matches every channel, "abc*" every id starting "abc", else one exact id."""
    if pattern == "*":
        return True
    if pattern.endswith("*"):
        return channel_id.startswith(pattern[:-1])
    return pattern == channel_id


def scopes_of(stored: Json) -> dict:
    """Scopes (stored JSON text, a dict or a Scopes record) as {action: [pattern, ...]} for all four actions."""
    value = load(stored) if isinstance(stored, str) else stored
    if isinstance(value, Struct):
        value = msgspec.structs.asdict(value)
    value = value if isinstance(value, dict) else {}
    return {action: [p for p in value.get(action) or [] if isinstance(p, str)] for action in ACTIONS}


def permissions_of(scopes: dict) -> Permissions:
    return Permissions(**{action: list(scopes[action]) for action in ACTIONS})


@dataclass(frozen=True)
class Principal:
    """Who is calling and what they may do: a stored key, the environment key, a user or a login token."""

    key_id: str                        # "env", "<n>" (a stored key), "user:<id>", or "key:<n>" through a token
    scopes: dict                       # {action: [pattern, ...]} for read, write, delete and admin
    source: str                        # environment | database | user | token
    auth_method: str = "api_key"       # api_key | jwt | password (a dashboard session)
    expires_at: Optional[str] = None
    user_id: Optional[str] = None
    key_row: Optional[int] = None      # the api_keys row behind it, if any

    def can(self, action: str, channel_id: str) -> bool:
        return any(pattern_matches(p, channel_id) for p in (*self.scopes[action], *self.scopes["admin"]))

    @property
    def reach(self) -> Reach:
        return Reach(read=(*self.scopes["read"], *self.scopes["admin"]), write=(*self.scopes["write"], *self.scopes["admin"]),
                     delete=(*self.scopes["delete"], *self.scopes["admin"]))

    def can_everywhere(self, action: str) -> bool:
        return "*" in self.scopes[action] or "*" in self.scopes["admin"]

    def can_somewhere(self, action: str) -> bool:
        return bool(self.scopes[action] or self.scopes["admin"])

    @property
    def is_admin(self) -> bool:
        return "*" in self.scopes["admin"]

    @property
    def actor(self) -> str:
        """How events this principal causes name it (never the key itself)."""
        return f"key:{self.key_id}" if self.source == "database" else self.key_id

    @property
    def owner(self) -> str:
        """Whose preferences these are: the user's, else the key's."""
        if self.user_id:
            return f"user:{self.user_id}"
        return "env" if self.key_id == "env" else f"key:{self.key_row}"

    def require(self, action: str, channel_id: Optional[str]) -> None:
        """Forbidden unless the scopes allow `action` on the channel (None: on every channel)."""
        if channel_id is None:
            if not self.can_everywhere(action):
                raise Forbidden(f"this credential may not {action} every channel ('*'), which this call needs")
        elif not self.can(action, channel_id):
            raise Forbidden(f"this credential may not {action} channel {channel_id}")

    def capabilities(self) -> Capabilities:
        return Capabilities(permissions=permissions_of(self.scopes), auth_method=self.auth_method, key_id=self.key_id,
                            key_source=self.source, expires_at=self.expires_at)


ENV_PRINCIPAL = Principal("env", ADMIN_SCOPES, "environment")


# --- API keys --------------------------------------------------------------------------


def key_hash(key: str) -> str:
    # Keys are 190+ random bits: a plain SHA-256 is enough, no slow KDF needed.
    return sha256_hex(key)


def key_fields(row: Row) -> dict:
    return {"id": row["id"], "name": row["name"], "prefix": row["prefix"], "scopes": permissions_of(scopes_of(row["scopes"])),
            "created_at": row["created_at"], "last_used_at": row["last_used_at"], "expires_at": row["expires_at"],
            "revoked_at": row["revoked_at"]}


def key_of(row: Row) -> KeyInfo:
    return KeyInfo(**key_fields(row))


def key_principal(row: Row) -> Principal:
    return Principal(str(row["id"]), scopes_of(row["scopes"]), "database", expires_at=row["expires_at"],
                     key_row=row["id"])


def issue_key(tx: Tx, *, name: str, scopes: dict, expires_at: Optional[str] = None) -> tuple:
    """Create a key and store only its hash; returns (id, key)."""
    key = "sk-" + secrets.token_urlsafe(32)
    key_id = tx.conn.execute(
        "INSERT INTO api_keys (key_hash, prefix, created_at, name, scopes, expires_at) VALUES (?, ?, ?, ?, ?, ?)"
        " RETURNING id", (key_hash(key), key[:7], tx.ts, name, dump(scopes_of(scopes)), expires_at)).fetchone()[0]
    return key_id, key


def require_key(conn: Conn, key_id: int) -> Row:
    return fetch_or_raise(conn, lambda: NotFound(f"key {key_id} not found"), "SELECT * FROM api_keys WHERE id = ?", key_id)


def create_key(tx: Tx, name: str, scopes: Json, expires_in_days: Optional[float]) -> NewKey:
    """`key create`: the new key's listing plus, this once, the key itself."""
    expires_at = iso(tx.now + timedelta(days=expires_in_days)) if expires_in_days else None
    key_id, key = issue_key(tx, name=name, scopes=scopes_of(scopes), expires_at=expires_at)
    return NewKey(**key_fields(require_key(tx.conn, key_id)), key=key)


def list_keys(conn: Conn) -> list[KeyInfo]:
    return [key_of(r) for r in conn.execute("SELECT * FROM api_keys WHERE revoked_at IS NULL ORDER BY id")]


def revoke_key(tx: Tx, key_id: int) -> KeyInfo:
    """End a key now, with the dashboard sessions and login tokens it opened; revoking twice is fine."""
    row = require_key(tx.conn, key_id)
    if row["revoked_at"] is None:
        tx.conn.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ?", (tx.ts, key_id))
        tx.conn.execute("DELETE FROM sessions WHERE key_ref = ?", (row["key_hash"],))
        tx.conn.execute("DELETE FROM tokens WHERE key_id = ?", (key_id,))
    return key_of(require_key(tx.conn, key_id))


def rotate_key(tx: Tx) -> str:
    """A new admin key; the admin keys before it end now (with their sessions). Scoped keys stay."""
    for row in tx.conn.execute("SELECT id, scopes FROM api_keys WHERE revoked_at IS NULL").fetchall():
        if "*" in scopes_of(row["scopes"])["admin"]:
            revoke_key(tx, row["id"])
    return issue_key(tx, name="admin", scopes=ADMIN_SCOPES)[1]


def first_key(tx: Tx) -> Optional[str]:
    """The one-time admin key on a fresh data dir; None when a key exists already."""
    if tx.conn.execute("SELECT 1 FROM api_keys LIMIT 1").fetchone():
        return None
    return issue_key(tx, name="admin", scopes=ADMIN_SCOPES)[1]


def active_keys(conn: Conn) -> dict:
    """Every key that is not revoked, as {hash: row}: the whole set the server checks keys against."""
    return {r["key_hash"]: dict(r) for r in conn.execute("SELECT * FROM api_keys WHERE revoked_at IS NULL")}


def active_key(conn: Conn, hashed: str, now: str) -> Optional[Row]:
    """The stored key with this hash if it is neither revoked nor expired."""
    return conn.execute("SELECT * FROM api_keys WHERE key_hash = ? AND revoked_at IS NULL"
                        " AND (expires_at IS NULL OR expires_at > ?)", (hashed, now)).fetchone()


def touch_key(tx: Tx, key_id: int) -> None:
    tx.conn.execute("UPDATE api_keys SET last_used_at = ? WHERE id = ?", (tx.ts, key_id))


# --- accounts and login tokens -------------------------------------------------------------


def email_key(email: str) -> str:
    return email.strip().lower()


def hash_password(password: str, salt: Optional[bytes] = None) -> str:
    """scrypt with a random 16-byte salt, stored as scrypt$N$r$p$salt$hash (hex), so parameters can grow."""
    salt = salt if salt is not None else secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode("utf-8", "surrogatepass"), salt=salt, n=SCRYPT_N, r=SCRYPT_R,
                            p=SCRYPT_P, maxmem=SCRYPT_MAXMEM, dklen=32)
    return f"scrypt${SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${salt.hex()}${digest.hex()}"


# Checked when the email is unknown, so a miss runs the same KDF as a wrong password (same time).
UNKNOWN_USER_HASH = f"scrypt${SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${'00' * 16}${'00' * 32}"


def password_matches(stored: str, password: str) -> bool:
    _, n, r, p, salt, digest = stored.split("$")
    given = hashlib.scrypt(password.encode("utf-8", "surrogatepass"), salt=bytes.fromhex(salt), n=int(n), r=int(r),
                           p=int(p), maxmem=SCRYPT_MAXMEM, dklen=len(digest) // 2)
    return hmac.compare_digest(given, bytes.fromhex(digest))


def user_of(row: Row) -> UserInfo:
    return UserInfo(id=row["id"], email=row["email"], name=row["name"], created_at=row["created_at"])


def key_user_of(row: Row) -> UserInfo:
    """A key exchanged for a token (api-key-login) answers as a user without an address."""
    return UserInfo(id=f"key:{row['id']}", email=None, name=row["name"], created_at=row["created_at"])


def user_principal(row: Row, *, auth_method: str, expires_at: Optional[str] = None) -> Principal:
    return Principal(f"user:{row['id']}", scopes_of(row["scopes"]), "user", auth_method, expires_at=expires_at,
                     user_id=row["id"])


def user_by_email(conn: Conn, email: str) -> Optional[Row]:
    return conn.execute("SELECT * FROM users WHERE email_key = ?", (email_key(email),)).fetchone()


def user_by_id(conn: Conn, user_id: str) -> Optional[Row]:
    return conn.execute("SELECT * FROM users WHERE id = ?", (user_id,)).fetchone()


def create_user(tx: Tx, email: str, name: Optional[str], password_hash: str, scopes: dict) -> Row:
    """A new account; Conflict(email_taken) when the address (in any case) has one."""
    user_id = str(uuid.uuid4())
    created = tx.conn.execute(
        "INSERT INTO users (id, email, email_key, name, password_hash, scopes, created_at, updated_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (email_key) DO NOTHING RETURNING id",
        (user_id, email.strip(), email_key(email), name, password_hash, dump(scopes_of(scopes)), tx.ts, tx.ts),
    ).fetchone()
    if created is None:
        raise Conflict("email_taken", "an account with this email exists already; log in instead")
    return user_by_id(tx.conn, user_id)


def grant_user(tx: Tx, email: str, scopes: dict) -> GrantedUser:
    """`actae user grant`: replace an account's scopes; its live tokens carry the new ones at once."""
    row = user_by_email(tx.conn, email)
    if row is None:
        raise NotFound(f"no account for {email}")
    tx.conn.execute("UPDATE users SET scopes = ?, updated_at = ? WHERE id = ?", (dump(scopes_of(scopes)), tx.ts, row["id"]))
    return GrantedUser(**msgspec.structs.asdict(user_of(row)), scopes=permissions_of(scopes_of(scopes)))


def b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


TOKEN_HEADER = b64url(b'{"alg":"HS256","typ":"JWT"}')


def sign_token(secret: bytes, claims: dict) -> str:
    """A JWT (HS256): header.claims.signature, each base64url without padding."""
    body = b64url(json.dumps(claims, separators=(",", ":"), sort_keys=True).encode("utf-8"))
    signature = hmac.new(secret, f"{TOKEN_HEADER}.{body}".encode("ascii"), hashlib.sha256).digest()
    return f"{TOKEN_HEADER}.{body}.{b64url(signature)}"


def token_claims(secret: bytes, token: str, now: datetime) -> Optional[dict]:
    """The claims of a token we signed that has not expired, else None (whatever is wrong with it)."""
    try:
        header, body, signature = token.split(".")
        if header != TOKEN_HEADER:         # pins the algorithm: no "none", no other key type
            return None
        expected = hmac.new(secret, f"{header}.{body}".encode("ascii"), hashlib.sha256).digest()
        if not same_secret(signature, b64url(expected)):
            return None
        claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except (ValueError, UnicodeError, TypeError):
        return None
    if not isinstance(claims, dict) or not is_int(claims.get("exp")) or claims["exp"] <= now.timestamp():
        return None
    return claims if isinstance(claims.get("jti"), str) else None


def looks_like_token(credential: str) -> bool:
    return credential.startswith(TOKEN_HEADER + ".")


def store_token(tx: Tx, jti: str, user_id: Optional[str], key_id: Optional[int], expires_at: str) -> None:
    tx.conn.execute("DELETE FROM tokens WHERE expires_at <= ?", (tx.ts,))
    tx.conn.execute("INSERT INTO tokens (jti, user_id, key_id, created_at, expires_at) VALUES (?, ?, ?, ?, ?)",
                    (jti, user_id, key_id, tx.ts, expires_at))


def drop_token(tx: Tx, jti: str) -> None:
    tx.conn.execute("DELETE FROM tokens WHERE jti = ?", (jti,))


def token_identity(conn: Conn, jti: str, now: str) -> Optional[tuple]:
    """(Principal, UserInfo) of a live token, or None once it is logged out, expired or its key revoked."""
    row = conn.execute("SELECT * FROM tokens WHERE jti = ? AND expires_at > ?", (jti, now)).fetchone()
    if row is None:
        return None
    if row["user_id"] is not None:
        user = user_by_id(conn, row["user_id"])
        return (user_principal(user, auth_method="jwt", expires_at=row["expires_at"]), user_of(user)) if user else None
    key = conn.execute("SELECT * FROM api_keys WHERE id = ? AND revoked_at IS NULL AND (expires_at IS NULL"
                       " OR expires_at > ?)", (row["key_id"], now)).fetchone()
    if key is None:
        return None
    principal = Principal(f"key:{key['id']}", scopes_of(key["scopes"]), "token", "jwt",
                          expires_at=row["expires_at"], key_row=key["id"])
    return principal, key_user_of(key)


def get_preferences(conn: Conn, owner: str) -> Preferences:
    row = conn.execute("SELECT * FROM preferences WHERE owner = ?", (owner,)).fetchone()
    return Preferences(preferences=load(row["document"]) if row else {}, updated_at=row["updated_at"] if row else None)


def put_preferences(tx: Tx, owner: str, document: dict) -> Preferences:
    """Replace the one preferences document of `owner`."""
    tx.conn.execute("INSERT INTO preferences (owner, document, updated_at) VALUES (?, ?, ?) ON CONFLICT (owner)"
                    " DO UPDATE SET document = excluded.document, updated_at = excluded.updated_at",
                    (owner, dump(document), tx.ts))
    return get_preferences(tx.conn, owner)


# --- dashboard sessions ---------------------------------------------------------------------


def open_session(tx: Tx, key_ref: str) -> str:
    """A dashboard session for `key_ref` ("env", a key's hash, or "user:<id>"); returns the cookie's id.

    Only the id's hash is stored: a copy of the database opens no session.
    """
    session_id = secrets.token_urlsafe(32)
    tx.conn.execute("DELETE FROM sessions WHERE expires_at <= ?", (tx.ts,))
    tx.conn.execute("INSERT INTO sessions (id_hash, key_ref, created_at, expires_at) VALUES (?, ?, ?, ?)",
                    (sha256_hex(session_id), key_ref, tx.ts, iso(tx.now + timedelta(seconds=SESSION_MAX_AGE))))
    return session_id


def close_session(tx: Tx, session_id: str) -> None:
    tx.conn.execute("DELETE FROM sessions WHERE id_hash = ?", (sha256_hex(session_id),))


def session_principal(conn: Conn, session_id: str, now: str, env_key: bool) -> Optional[Principal]:
    """Who a live session acts for (the key or account still valid), else None."""
    row = conn.execute("SELECT key_ref FROM sessions WHERE id_hash = ? AND expires_at > ?",
                       (sha256_hex(session_id), now)).fetchone()
    if row is None:
        return None
    ref = row["key_ref"]
    if ref == "env":
        return ENV_PRINCIPAL if env_key else None
    if ref.startswith("user:"):
        user = user_by_id(conn, ref[5:])
        return user_principal(user, auth_method="password") if user else None
    key = active_key(conn, ref, now)
    return key_principal(key) if key else None


# =============================================================================
# Authentication: API keys for the API, server-side sessions for the dashboard
# =============================================================================

@dataclass
class RequestContext:
    """What the request path learns of one request, for what runs after it: a typed record in the
    ASGI scope (context_of), made on first use."""

    principal: Optional["Principal"] = None        # who asks (None: a public route, or no key where one is optional)
    user: Optional["UserInfo"] = None                     # the account a Bearer login token names (UserInfo)
    bearer: Optional[str] = None                   # that login token
    session_id: Optional[str] = None               # the dashboard session of the request's cookie
    logged_in: bool = False
    csrf_token: str = ""                           # the session's form token, for the page's forms
    form: Optional[dict] = None                    # the request's form fields, read once
    org_token: Optional[Row] = None                # the organisation token of a fleet token exchange
    error_shape: Optional[Callable[["ActaeError"], Response]] = None   # a region's own error body


def context_of(request: HTTPConnection) -> RequestContext:
    """The context of a request (or WebSocket): one per ASGI scope, whichever Request object reads it."""
    context = request.scope.get("actae")
    if context is None:
        context = request.scope["actae"] = RequestContext()
    return context


def reach_of(request: HTTPConnection) -> "Reach":
    """The runs the request's principal may read, change and delete: what every store function that
    reads across runs is given."""
    return context_of(request).principal.reach


class KeyRing:
    """The valid API keys by hash, as principals, in memory: checking a key reads nothing from disk.

    `key rotate`, `key create` and `key revoke` may run in another process, so the set is read
    again when it is more than KEY_REFRESH_SECONDS old, and on a miss when it is more than
    KEY_MISS_RELOAD_SECONDS old (so a key just created elsewhere works at once, and a flood of
    wrong keys costs at most a few reads a second); each read is shared by every request waiting
    on it. A change made by this server calls `reload` itself and takes effect at once.
    """

    def __init__(self, db: Database, on_revoked: Callable[[], None] = lambda: None):
        self.db = db
        self.on_revoked = on_revoked     # a key that worked is gone: the open streams are checked at once
        self.by_hash: dict = {}
        self.by_key: dict = {}           # keys seen since the last reload: no hashing per request
        self.loaded_at = -math.inf
        self.loading: Optional[asyncio.Future] = None

    async def reload(self) -> None:
        rows = await self.db.read(active_keys)
        before, self.by_hash = self.by_hash, {hashed: key_principal(row) for hashed, row in rows.items()}
        self.by_key = {}
        self.loaded_at = time.monotonic()
        if before.keys() - self.by_hash.keys() or any(self.by_hash[h] != p for h, p in before.items() if h in self.by_hash):
            self.on_revoked()

    async def fresh(self, max_age: float) -> None:
        if time.monotonic() - self.loaded_at > max_age:
            if self.loading is None or self.loading.done():
                self.loading = asyncio.ensure_future(self.reload())
            await asyncio.shield(self.loading)

    async def lookup(self, key: str) -> Optional[Principal]:
        await self.fresh(KEY_REFRESH_SECONDS)
        found = self.by_key.get(key)
        if found is None:
            hashed = key_hash(key)
            found = self.by_hash.get(hashed)
            if found is None:
                await self.fresh(KEY_MISS_RELOAD_SECONDS)
                found = self.by_hash.get(hashed)
            if found is not None and len(self.by_key) < 1024:
                self.by_key[key] = found
        return found


async def check_key(app: "ActaeApp", key: Optional[str]) -> Principal:
    """Who a credential (an API key, or a login token) is; Unauthorized when it is missing, wrong,
    expired or revoked."""
    if not isinstance(key, str) or not key:
        raise Unauthorized("missing API key: send it in the x-api-key header")
    if looks_like_token(key):
        return (await check_token(app, key))[0]
    env_key = app.services.env_key
    if env_key and same_secret(key, env_key):
        return ENV_PRINCIPAL
    found = await app.services.keys.lookup(key)
    if found is None or (found.expires_at is not None and found.expires_at <= iso(utc_now())):
        raise Unauthorized("invalid, expired or revoked API key")
    note_key_use(app, found.key_row)
    return found


async def check_token(app: "ActaeApp", token: str) -> tuple:
    """(Principal, UserInfo) of a live login token; Unauthorized otherwise."""
    claims = token_claims(app.services.token_secret, token, utc_now())
    identity = await app.services.db.read(token_identity, claims["jti"], iso(utc_now())) if claims else None
    if identity is None:
        raise Unauthorized("invalid, expired or logged-out token: log in again")
    return identity


def note_key_use(app: "ActaeApp", key_id: int) -> None:
    """Record a key's last use at most once a minute, off the request's path (never a write per request)."""
    now, touched = time.monotonic(), app.services.key_touched
    if now - touched.get(key_id, -KEY_TOUCH_SECONDS) < KEY_TOUCH_SECONDS:
        return
    touched[key_id] = now
    task = asyncio.get_running_loop().create_task(app.services.db.write(touch_key, key_id))
    app.services.background.add(task)

    def done(finished: asyncio.Task) -> None:
        app.services.background.discard(finished)
        if not finished.cancelled() and not isinstance(finished.exception(), (ShuttingDown, type(None))):
            log.warning("recording a key's last use failed: %s", finished.exception())
    task.add_done_callback(done)


def bearer_token(request: Request) -> Optional[str]:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def key_ref(app: "ActaeApp", key: str) -> str:
    """How a session names the key it was opened with: "env", or the key's hash."""
    return "env" if app.services.env_key and same_secret(key, app.services.env_key) else key_hash(key)


def form_token(session_id: str) -> str:
    """The per-session token every dashboard form carries; only the session's own pages can know it."""
    return sha256_hex("form:" + session_id)


async def current_session(request: Request) -> Optional[str]:
    """The session id of the request's cookie when it names a live session of a valid key or account;
    sets its context's principal to whom it acts for."""
    session_id = request.cookies.get(SESSION_COOKIE)
    if not session_id:
        return None
    principal = await db_of(request).read(session_principal, session_id, iso(utc_now()),
                                          bool(request.app.services.env_key))
    if principal is None:
        return None
    context_of(request).principal = principal
    return session_id


# --- what a page may be asked by another origin: nothing --------------------------------------


def served_origin(request: Request) -> str:
    return f"{request.url.scheme}://{request.headers.get('host', '')}"


def require_same_origin(request: Request) -> None:
    """A state-changing dashboard POST must come from one of our own pages (Origin, else Referer).

    SameSite cookies do not separate two ports of 127.0.0.1, so the origin is checked as well.
    """
    origin = request.headers.get("origin")
    if origin is None:
        referer = urlsplit(request.headers.get("referer", ""))
        origin = f"{referer.scheme}://{referer.netloc}" if referer.netloc else None
    if origin != served_origin(request):
        raise Forbidden("this form can only be sent from the dashboard's own pages")


def require_form_token(request: Request, form: dict) -> None:
    expected = form_token(context_of(request).session_id)
    if not same_secret(form.get("csrf_token", ""), expected):
        raise Forbidden("the form's token is missing or stale: reload the page and submit again")


# =============================================================================
# HTTP API: the kernel's handlers (health, the instance, sign-in, preferences, keys)
# =============================================================================
# A handler gets the request and the records its route declares (`path`, `query`, `body`),
# already decoded and checked, and returns the JSON value to answer with.

def db_of(request) -> Database:
    return request.app.services.db


async def read_capped(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, at most `limit` bytes (413 beyond), read as it streams in."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > DRAIN_BYTES_MAX:
            break    # past this, the client is not worth waiting for: the connection just closes
    if size > limit:
        # The oversized body was read (and dropped), so the client can read this answer.
        raise TooLarge(f"request body is larger than {limit} bytes")
    return b"".join(chunks)


def same_channel(body_channel: Optional[str], path_channel: str) -> None:
    """The SDK repeats the path's channel in some bodies; a different one is a client bug."""
    if body_channel not in (None, path_channel):
        raise BadRequest(f"body channel_id {body_channel!r} differs from the path's {path_channel!r}")


# --- health, metrics, capabilities ------------------------------------------------


async def database_ready(db: Database) -> bool:
    try:
        await db.read(lambda conn: conn.execute("SELECT 1").fetchone())
        return True
    except Exception:  # noqa: BLE001 - readiness reports, it does not raise
        return False


def health_of(request: Request, started: float, status: str, **parts) -> Health:
    return Health(status=status, timestamp=iso(utc_now()), instance_id=request.app.services.instance_id,
                  check_duration_ms=int((time.perf_counter() - started) * 1000), **parts)


async def healthz(request: Request) -> Health:
    """Liveness: the server's status, version and components (no credential needed)."""
    started = time.perf_counter()
    ok = await database_ready(db_of(request))
    hub = request.app.services.hub
    return health_of(request, started, "ok" if ok else "degraded", version=__version__, components=Components(
        database=ComponentStatus(status="ok" if ok else "error"),
        websocket=ComponentStatus(status="ok", connections=len(hub.connections))))


async def readyz(request: Request) -> Health:
    """Readiness: whether the database answers and connections are left (200, with the reasons in the body)."""
    # 200 with readiness in the body: the SDK raises on 503, and users should be able to read why.
    started = time.perf_counter()
    ok = await database_ready(db_of(request))
    hub, limit = request.app.services.hub, request.app.services.settings.max_connections
    return health_of(request, started, "ok" if ok else "unavailable", readiness_checks=ReadinessChecks(
        database_ready=ok, capacity_available=len(hub.connections) < limit,
        uptime_seconds=int(time.monotonic() - request.app.services.started),
        connection_utilization=len(hub.connections) / limit, active_connections=len(hub.connections),
        max_connections=limit))


async def api_auth_capabilities(request: Request) -> Capabilities:
    """The caller's true scopes and expiry, in the grammar the SDK's can_read/can_write evaluate."""
    return context_of(request).principal.capabilities()


# What /api/v1/instance lists besides its regions' features.
KERNEL_FEATURES = ("scoped_keys", "accounts")


async def api_instance(request: Request) -> Instance:
    """This server: version, instance id, storage backend, start time and features."""
    state = request.app.services
    return Instance(version=__version__, api_version="v1", instance_id=state.instance_id,
                    backend=state.db.location.backend, started_at=state.started_at,
                    uptime_seconds=int(time.monotonic() - state.started), features=[*state.hooks.features, *KERNEL_FEATURES],
                    open_signup=state.settings.open_signup)


# --- accounts, login tokens, preferences, keys ------------------------------------------------


async def issue_token(request: Request, *, user_id: Optional[str] = None, key_row: Optional[int] = None,
                      not_after: Optional[str] = None) -> str:
    """A signed token for an account (or an exchanged key), live until it expires or is logged out."""
    now = utc_now()
    expires = now + timedelta(seconds=TOKEN_TTL_SECONDS)
    if not_after is not None:
        expires = min(expires, parse_iso(not_after))
    jti = secrets.token_urlsafe(18)
    token = sign_token(request.app.services.token_secret, {
        "iss": "actae", "sub": f"user:{user_id}" if user_id else f"key:{key_row}", "jti": jti,
        "iat": int(now.timestamp()), "exp": int(expires.timestamp())})
    await db_of(request).write(store_token, jti, user_id, key_row, iso(expires))
    return token


async def api_auth_signup(request: Request, body: Signup) -> LoggedIn:
    """Create an account (an admin key is needed unless the server runs with --open-signup)."""
    principal = context_of(request).principal
    if not request.app.services.settings.open_signup:
        if principal is None:
            raise Unauthorized("signup needs an admin key in x-api-key (or a server started with --open-signup)")
        if not principal.is_admin:
            raise Forbidden("only an admin key may create accounts on this server")
    if body.scopes is not None and not (principal is not None and principal.is_admin):
        raise Forbidden("only an admin key may grant scopes to an account")
    password_hash = await asyncio.to_thread(hash_password, body.password)
    user = await db_of(request).write(create_user, body.email, body.name, password_hash, scopes_of(body.scopes))
    return LoggedIn(user=user_of(user), token=await issue_token(request, user_id=user["id"]))


async def verified_user(request: Request, email: str, password: str) -> Optional[Row]:
    """The account whose email and password these are, else None.

    An unknown email runs the same KDF as a wrong password: same answer, same time.
    """
    user = await db_of(request).read(user_by_email, email)
    stored = user["password_hash"] if user is not None else UNKNOWN_USER_HASH
    matches = await asyncio.to_thread(password_matches, stored, password)
    return user if user is not None and matches else None


async def api_auth_login(request: Request, body: Login) -> LoggedIn:
    """Log in with email and password; the token carries the scopes an admin granted the account."""
    user = await verified_user(request, body.email, body.password)
    if user is None:
        raise Unauthorized("wrong email or password")
    return LoggedIn(user=user_of(user), token=await issue_token(request, user_id=user["id"]))


async def api_auth_api_key_login(request: Request, body: ApiKeyLogin) -> LoggedIn:
    """Exchange a stored API key for a login token with the key's scopes (never beyond its expiry)."""
    key = body.api_key or request.headers.get("x-api-key") or ""
    row = await db_of(request).read(active_key, key_hash(key), iso(utc_now())) if key else None
    if row is None:
        raise Unauthorized("invalid, expired or revoked API key")
    token = await issue_token(request, key_row=row["id"], not_after=row["expires_at"])
    return LoggedIn(user=key_user_of(row), token=token)


async def api_auth_config(request: Request) -> AuthConfig:
    """How this server lets people in."""
    open_signup = request.app.services.settings.open_signup
    return AuthConfig(methods=["api_key", "password"], signup="open" if open_signup else "admin",
                      open_signup=open_signup, token_type="jwt", token_ttl_seconds=TOKEN_TTL_SECONDS,
                      password_min_length=8, email_verification=False)


def bearer_user(request: Request) -> UserInfo:
    user = context_of(request).user
    if user is None:
        raise Unauthorized("send the login token as `authorization: Bearer <token>`")
    return user


async def api_auth_me(request: Request) -> Me:
    """The account behind the Bearer token."""
    return Me(user=bearer_user(request))


async def api_auth_logout(request: Request) -> Done:
    """End the Bearer token now."""
    bearer_user(request)
    claims = token_claims(request.app.services.token_secret, context_of(request).bearer, utc_now())
    if claims is None:                     # it expired since it was checked: nothing left to end
        raise Unauthorized("invalid, expired or logged-out token: log in again")
    await db_of(request).write(drop_token, claims["jti"])
    return Done()


async def api_preferences_get(request: Request) -> Preferences:
    """The caller's preferences document (the Bearer account's, else the key's)."""
    return await db_of(request).read(get_preferences, context_of(request).principal.owner)


async def api_preferences_put(request: Request, body: PutPreferences) -> Preferences:
    """Replace the caller's preferences document."""
    return await db_of(request).write(put_preferences, context_of(request).principal.owner, body.preferences)


async def api_keys_list(request: Request) -> Keys:
    """Active keys with their scopes, creation, last use and expiry; never the key."""
    return Keys(keys=await db_of(request).read(list_keys))


async def change_keys(request: Request, work: Callable, *args) -> object:
    """A write to the keys, then the in-memory key ring reloaded: this server applies it at once."""
    result = await db_of(request).write(work, *args)
    await request.app.services.keys.reload()
    return result


async def api_keys_create(request: Request, body: CreateKey) -> NewKey:
    """Create a scoped key; the answer holds the key, this once."""
    return await change_keys(request, create_key, body.name, body.scopes, body.expires_in_days)


async def api_keys_revoke(request: Request, path) -> KeyInfo:
    """Revoke a key now, with the sessions and tokens it opened."""
    return await change_keys(request, revoke_key, path.key_id)


async def openapi_json(request: Request) -> OpenApiDocument:
    """This server's OpenAPI 3.1 description, generated from the route table."""
    return request.app.services.openapi


# =============================================================================
# HTTP API: the route table, scopes, authorization, and the OpenAPI document generated from it
# =============================================================================

EVERY = "*"            # a call that is not about one channel needs the action on every channel
SOMEWHERE = "any"      # ... or only some pattern for it (the answer is filtered to what the scopes match)


def reads(*where: str) -> tuple:
    return tuple(("read", w) for w in where)


def writes(*where: str) -> tuple:
    return tuple(("write", w) for w in where)


def deletes(*where: str) -> tuple:
    return tuple(("delete", w) for w in where)


ADMIN = (("admin", EVERY),)


def instance_wide(method: str, path: str, handler: Callable, **options: object) -> Api:
    """A route about no one channel (an experiment, an execution group: they span their members'):
    a GET needs the read action on every channel, any other method the write action."""
    action = reads if method == "GET" else writes
    return Api(method, path, handler, scopes=action(EVERY), **options)

# Where a route's channel is when it is not in the request: one row away.
CHANNEL_LOOKUPS = {
    "event": "SELECT channel_id FROM events WHERE id = ?",
    "execution": "SELECT channel_id FROM executions WHERE id = ?",
    "wakeup": "SELECT channel_id FROM wakeups WHERE id = ?",
    "group": "SELECT channel_id FROM consumer_groups WHERE id = ?",
    "parent": "SELECT parent_id FROM channels WHERE id = ?",
}


def looked_up_channel(conn: Conn, sql: str, value: object) -> Optional[str]:
    row = conn.execute(sql, (value,)).fetchone()
    return row[0] if row else None


@dataclass(frozen=True)
class TextBody:
    """A request body that is a file, not one JSON value: documented as `name`, parsed by `parse`."""

    name: str                          # its schema in /openapi.json (a string)
    description: str
    media_types: tuple                 # documented; the body is read whatever content-type it is sent with
    max_bytes: int
    parse: Callable[[bytes], object]      # bytes -> what the handler gets as `body`; BadRequest when bad
    file_type: Optional[str] = None    # the file's own media type (the schema's contentMediaType)


@dataclass(frozen=True)
class Api:
    """One API route: how to call it, what it takes, who may."""

    method: str
    path: str
    handler: Callable
    body: Optional[type] = None        # the JSON body's record
    text_body: Optional[TextBody] = None   # or a body in another format
    query: Optional[type] = None       # the query string's record
    answers: str = "application/json"  # the media type of a 200 answer
    # Other media types the 200 answer is documented under (a file: also as plain bytes, which every
    # generator reads); the server sends `answers`.
    answers_also: tuple = ()
    body_optional: bool = False        # the SDK may send no body at all
    # (action, where) pairs the credential's scopes must allow; () = any valid credential. `where`
    # names the channel: "path.channel_id", "body.source_channel_id", "query.left", a lookup
    # ("execution.execution_id" finds the execution's channel), EVERY or SOMEWHERE.
    scopes: tuple = ()
    # key: x-api-key (a key or a login token); user: the Bearer login token when one is sent, else
    # the key; bearer: the Bearer login token only (the account it names); optional: a key if one is
    # valid (signup); public: none (probes, logins, the API description); fleet: a fleet token (the
    # gateway's routes); org: an organisation token (the fleet token exchange).
    auth: str = "key"
    group: Optional[str] = None        # the OpenAPI tag, where the path does not say it (a region's routes)
    # A route that answers what other routes answer (the gateway's operations): () -> those records.
    answers_as: Optional[Callable[[], tuple]] = None

    @property
    def public(self) -> bool:
        return self.auth == "public"

    @property
    def answer(self) -> object:
        """The 2xx answer's record: the handler's return annotation, the one place it is declared.
        A handler that returns a Response (a file, the Prometheus text) answers `answers` as text."""
        return answer_type(self.handler)

    @property
    def path_params(self) -> Optional[type]:
        return path_record(self.path)

    @property
    def tag(self) -> str:
        if self.group is not None:
            return self.group
        parts = self.path.split("/")
        return parts[3] if len(parts) > 3 and parts[1] == "api" else "server"

    @property
    def doc_lines(self) -> list:
        """The handler's docstring, dedented as `inspect.cleandoc` does: its lines."""
        first, *rest = (self.handler.__doc__ or "").strip().splitlines() or [""]
        indent = min((len(line) - len(line.lstrip()) for line in rest if line.strip()), default=0)
        return [first.strip(), *(line[indent:].rstrip() for line in rest)] if first.strip() else []

    @property
    def summary(self) -> str:
        """The docstring's first line (what an SDK shows as the method's one-liner)."""
        doc = self.doc_lines
        return doc[0] if doc else self.handler.__name__.replace("_", " ")

    @property
    def description(self) -> str:
        """The rest of the docstring; the summary again where the docstring is that one line."""
        return "\n".join(self.doc_lines[1:]).strip() or self.summary


@functools.cache
def answer_type(handler: Callable) -> object:
    return typing.get_type_hints(handler)["return"]


P, B = "path.channel_id", "body.channel_id"
API_ROUTES = [
    Api("GET", "/api/v1/auth/capabilities", api_auth_capabilities),
    Api("POST", "/api/v1/auth/signup", api_auth_signup, body=Signup, auth="optional"),
    Api("POST", "/api/v1/auth/login", api_auth_login, body=Login, auth="public"),
    Api("POST", "/api/v1/auth/api-key-login", api_auth_api_key_login, body=ApiKeyLogin, body_optional=True,
        auth="public"),
    Api("GET", "/api/v1/auth/config", api_auth_config, auth="public"),
    Api("GET", "/api/v1/auth/me", api_auth_me, auth="bearer"),
    Api("POST", "/api/v1/auth/logout", api_auth_logout, auth="bearer"),
    Api("GET", "/api/v1/user/preferences", api_preferences_get, auth="user"),
    Api("PUT", "/api/v1/user/preferences", api_preferences_put, body=PutPreferences, auth="user"),
    Api("GET", "/api/v1/keys", api_keys_list, scopes=ADMIN),
    Api("POST", "/api/v1/keys", api_keys_create, body=CreateKey, scopes=ADMIN),
    Api("DELETE", "/api/v1/keys/{key_id}", api_keys_revoke, scopes=ADMIN),
    Api("GET", "/api/v1/instance", api_instance),
    Api("GET", "/readyz", readyz),
    Api("GET", "/healthz", healthz, auth="public"),
    Api("GET", "/openapi.json", openapi_json, auth="public"),
]


def api_routes(hooks: Optional[Hooks] = None) -> list[Api]:
    """The one route table: the kernel's routes, then each region's (every declared region's by default)."""
    return [*API_ROUTES, *(hooks or hooks_of()).routes]


ERROR_RESPONSES = {
    "400": "bad input: malformed JSON, a wrong type, a value out of range, a bad channel id",
    "401": "missing, invalid, expired or revoked API key (or login token)",
    "403": "the credential is valid but its scopes do not allow this call on this channel",
    "404": "the named channel, execution, group or route does not exist",
    "409": "a conflict the SDK raises as its own exception: idempotency_conflict, version_conflict, "
           "fork_tool_blocked, execution_not_owned, channel_conflict, ...",
    "413": "the body is over 4 MiB, or one document over 1 MiB",
}


def ecma_patterns(schema: Json) -> Json:
    """JSON Schema patterns are ECMA-262: `\\Z` (our exact end) becomes `$`, which ECMA (without the
    m flag) anchors there too."""
    if isinstance(schema, dict):
        return {k: (v.replace("\\Z", "$") if k == "pattern" and isinstance(v, str) else ecma_patterns(v))
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [ecma_patterns(v) for v in schema]
    return schema


def record_parameters(kind: Optional[type], where: str, components: dict) -> list:
    """OpenAPI parameters (in: path or query) from a record's fields."""
    if kind is None:
        return []
    (ref,), defs = msgspec.json.schema_components([kind], ref_template="#/components/schemas/{name}")
    schema = defs[ref["$ref"].rsplit("/", 1)[1]]
    components.update({k: v for k, v in defs.items() if k != kind.__name__})
    required = set(schema.get("required", ()))
    return [{"name": name, "in": where, "required": where == "path" or name in required, "schema": prop}
            for name, prop in schema.get("properties", {}).items()]


def answer_schema(route: Api, refs: dict) -> dict:
    if route.answer is Response:
        return {"type": "string"}
    if route.answers_as is not None:
        return {"anyOf": [refs[kind] for kind in dict.fromkeys(route.answers_as()) if kind in refs]}
    return refs[route.answer]


SCHEMA_REF = "#/components/schemas/"
BYTES = "application/octet-stream"     # a file as plain bytes: every generator sends and reads it


def schema_refs(schema: Json) -> set:
    """The component names a schema refers to, directly."""
    if isinstance(schema, dict):
        found = {schema["$ref"][len(SCHEMA_REF):]} if isinstance(schema.get("$ref"), str) else set()
        return found.union(*(schema_refs(v) for v in schema.values()))
    if isinstance(schema, list):
        return set().union(*(schema_refs(v) for v in schema))
    return set()


def reachable(roots: set, components: dict) -> set:
    """The components `roots` name, and those they name, all the way down."""
    seen, todo = set(), set(roots)
    while todo:
        name = todo.pop()
        if name in components and name not in seen:
            seen.add(name)
            todo |= schema_refs(components[name])
    return seen


def object_schemas(schema: Json):
    """Every schema object inside `schema` (itself included) that is a JSON object with members."""
    if isinstance(schema, dict):
        if isinstance(schema.get("properties"), dict):
            yield schema
        for value in schema.values():
            yield from object_schemas(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from object_schemas(value)


def free_form_objects(schema: Json) -> Json:
    """An object schema that names no members is a free-form map: say so (`additionalProperties:
    true`), or generators type it as an empty object (openapi-typescript: Record<string, never>)."""
    if isinstance(schema, list):
        return [free_form_objects(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: free_form_objects(v) for k, v in schema.items()}
    kinds = out.get("type")
    # `properties: {}` names no member either (Empty: an object whose members are not read)
    if (kinds == "object" or (isinstance(kinds, list) and "object" in kinds)) and not out.get("properties") and not any(
            k in out for k in ("additionalProperties", "patternProperties", "$ref")):
        out["additionalProperties"] = True
    return out


def default_said(member: dict) -> None:
    """A member's `default` moved into its description (a null default goes unsaid)."""
    default = member.pop("default")
    if default is not None:
        said = f"default: {json.dumps(default)}"
        member["description"] = f"{member['description']}; {said}" if member.get("description") else said


def optional_when_written(schema: dict) -> None:
    """A request record's members with a default are optional to send: no `default` on them, which
    openapi-typescript (--default-non-nullable, on by default) would type as required. A default
    other than null is said in the member's description instead."""
    for shape in object_schemas(schema):
        required = set(shape.get("required", ()))
        for name, member in shape["properties"].items():
            if isinstance(member, dict) and "default" in member and name not in required:
                default_said(member)


def always_answered(schema: dict) -> None:
    """An answer record's members with a default are always sent (answers omit nothing but UNSET
    members, which have no default): required, so generators type them as present, and so without
    their `default` (a required member has none to fall back on; a non-null one is said in words)."""
    for shape in object_schemas(schema):
        members = shape["properties"]
        defaulted = [name for name, member in members.items() if isinstance(member, dict) and "default" in member]
        if defaulted:
            shape["required"] = [name for name in members if name in {*shape.get("required", ()), *defaulted}]
            for name in defaulted:
                default_said(members[name])


def openapi_document(routes: list) -> dict:
    """OpenAPI 3.1 for the route table: every path, body, query, answer and error shape, typed the way
    generators (openapi-typescript, openapi-python-client) read it: a free-form object says so, a
    request member with a default is optional, a nullable member is an anyOf with {"type": "null"},
    every operation has the summary and description its handler's docstring gives."""
    bodies = sorted({r.body for r in routes if r.body is not None}, key=lambda k: k.__name__)
    answers = list(dict.fromkeys(r.answer for r in routes if r.answer is not Response and r.answers_as is None))
    refs, components = msgspec.json.schema_components([*bodies, *answers, ErrorBody],
                                                      ref_template=SCHEMA_REF + "{name}")
    shapes = dict(zip([*bodies, *answers], refs))
    error = {"content": {"application/json": {"schema": {"$ref": SCHEMA_REF + "ErrorBody"}}}}
    paths: dict = {}
    for route in routes:
        content = {route.answers: {"schema": answer_schema(route, shapes)}}
        for media in route.answers_also:
            content[media] = {"schema": {"type": "string", "format": "binary"}}
        described = (f"the file, sent as {route.answers} (documented as {', '.join(route.answers_also)} too)"
                     if route.answers_also else answer_doc(route.answer))
        answer = {"description": described, "content": content}
        operation = {
            "operationId": route.handler.__name__, "summary": route.summary, "description": route.description,
            "tags": [route.tag],
            "parameters": record_parameters(route.path_params, "path", components)
                          + record_parameters(route.query, "query", components),
            "responses": {"200": answer,
                          **{code: {"description": text, **error} for code, text in ERROR_RESPONSES.items()}},
        }
        if route.body is not None:
            operation["requestBody"] = {"required": not route.body_optional,
                                        "content": {"application/json": {"schema": shapes[route.body]}}}
        elif route.text_body is not None:
            text = route.text_body
            components[text.name] = {"title": text.name, "type": "string", "description": text.description,
                                     **({"format": "binary"} if BYTES in text.media_types else {}),
                                     **({"contentMediaType": text.file_type} if text.file_type else {})}
            operation["requestBody"] = {"required": True, "content": {
                media: {"schema": {"$ref": SCHEMA_REF + text.name}} for media in text.media_types}}
        if route.scopes:
            operation["x-actae-scopes"] = [{"action": action, "channel": where} for action, where in route.scopes]
        operation["security"] = {"public": [], "optional": [{}, {"apiKey": []}],
                                 "user": [{"bearer": []}, {"apiKey": []}],
                                 "bearer": [{"bearer": []}], "fleet": [{"bearer": []}],
                                 "org": [{"bearer": []}]}.get(route.auth, [{"apiKey": []}])
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    written = reachable(schema_refs([op.get("requestBody") for item in paths.values() for op in item.values()])
                        | schema_refs([op["parameters"] for item in paths.values() for op in item.values()]),
                        components)
    answered = reachable(schema_refs([op["responses"] for item in paths.values() for op in item.values()]),
                         components) - written
    for name in written:
        optional_when_written(components[name])
    for name in answered:
        always_answered(components[name])
    components = free_form_objects(components)
    return ecma_patterns({
        "openapi": "3.1.0",
        "info": {"title": "Actae community server", "version": __version__,
                 "description": "Record agent runs, fork them at an exact step, never fire a side effect twice."},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
                                           "bearer": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT"}}},
        "security": [{"apiKey": []}],
    })


def answer_doc(kind: object) -> str:
    doc = getattr(kind, "__doc__", None) if isinstance(kind, type) and issubclass(kind, Answer) else None
    return doc.strip().splitlines()[0] if doc and doc.strip() else "the answer"


def api_response(value: object, status: int = 200) -> Response:
    if isinstance(value, Response):
        return value
    return Response(msgspec.json.encode(value), status_code=status, media_type="application/json")


async def authenticate(request: Request, route: Api) -> Optional[Principal]:
    """The route's principal (None where none is needed); Unauthorized when a needed one is missing."""
    if route.auth == "public":
        return None
    check = request.app.services.hooks.authenticators.get(route.auth)
    if check is not None:                      # a kind of credential a region checks (the fleet's tokens)
        return await check(request, route)
    if route.auth in ("user", "bearer"):
        bearer = bearer_token(request)
        if bearer is not None:
            asked = context_of(request)
            principal, asked.user = await check_token(request.app, bearer)
            asked.bearer = bearer
            return principal
        if route.auth == "bearer":
            raise Unauthorized("send the login token as `authorization: Bearer <token>`")
    try:
        return await check_key(request.app, request.headers.get("x-api-key"))
    except Unauthorized:
        if route.auth == "optional":
            return None
        raise


async def channels_named(request: Request, where: str, parts: dict) -> list:
    """The channels a route acts on, per its table entry; [None] when it names none (every channel)."""
    kind, _, name = where.partition(".")
    if kind in ("path", "query", "body"):
        value = getattr(parts.get(kind), name, None)
        if not value:
            return [None]
        return list(value) if isinstance(value, list) else [value]
    found = await db_of(request).read(looked_up_channel, CHANNEL_LOOKUPS[kind], getattr(parts["path"], name))
    return [] if found is None else [found]      # nothing there: the handler answers 404 (or 400)


async def authorize(request: Request, route: Api, parts: dict) -> None:
    """Forbidden (403) unless the principal's scopes cover every (action, channel) the route declares."""
    principal = context_of(request).principal
    if principal is None:                  # optional auth: the handler decides
        return
    for action, where in route.scopes:
        if principal.can_everywhere(action):
            continue                       # the usual admin key: no channel to find
        if where == SOMEWHERE:
            if not principal.can_somewhere(action):
                raise Forbidden(f"this credential may not {action} any channel")
            continue
        for channel in ([None] if where == EVERY else await channels_named(request, where, parts)):
            principal.require(action, channel)


async def route_parts(request: Request, route: Api) -> dict:
    """The records a route declares (path, query, body), decoded and checked."""
    parts = {}
    if route.path_params is not None:
        parts["path"] = decode_params(request.path_params, route.path_params, "path")
    if route.query is not None:
        parts["query"] = decode_params(request.query_params, route.query, "query string")
    if route.body is not None:
        parts["body"] = decode_body(await read_capped(request), route.body, optional=route.body_optional)
    elif route.text_body is not None:     # a file may be large: parsed off the event loop
        parts["body"] = await asyncio.to_thread(route.text_body.parse,
                                                await read_capped(request, route.text_body.max_bytes))
    return parts


def fill_path(template: str, params: dict) -> str:
    """A route path with its parameters in place, each percent-encoded as one segment."""
    return re.sub(r"\{(\w+)\}", lambda m: quote_segment(str(params[m.group(1)])), template)


def query_text(query: dict) -> str:
    """A query object as a query string: null left out, booleans as true/false, lists repeated."""
    pairs = []
    for name, value in query.items():
        for item in value if isinstance(value, list) else [value]:
            if item is not None:
                pairs.append((name, ("true" if item else "false") if isinstance(item, bool)
                              else item if isinstance(item, str) else json.dumps(item) if isinstance(item, dict)
                              else str(item)))
    return urlencode(pairs)


def internal_request(app: "ActaeApp", route: Api, params: dict, query: str, raw: Optional[bytes]) -> Request:
    """A Request for `route` made in process: what serve_route reads of an HTTP one."""
    path = fill_path(route.path, params)
    scope = {"type": "http", "http_version": "1.1", "method": route.method, "scheme": "http", "path": path,
             "raw_path": path.encode("ascii"), "root_path": "", "query_string": query.encode("ascii"),
             "headers": [(b"content-type", b"application/json")], "app": app, "path_params": dict(params),
             "client": None, "server": None}
    chunks = [raw or b""]

    async def receive() -> dict:
        return {"type": "http.request", "body": chunks.pop() if chunks else b"", "more_body": False}
    return Request(scope, receive)


async def serve_route(request: Request, route: Api, principal: Optional[Principal]) -> object:
    """A route's answer for `principal`: its records decoded, its scopes checked, its handler run.
    HTTP requests come here after their credential is checked; the fleet gateway calls it in process."""
    context_of(request).principal = principal
    parts = await route_parts(request, route)
    if route.scopes:
        await authorize(request, route, parts)
    return await route.handler(request, **parts)


def api_endpoint(route: Api) -> Callable:
    """The endpoint of a route: key check, then the declared records decoded, then the handler."""

    async def endpoint(request: Request) -> Response:
        return api_response(await serve_route(request, route, await authenticate(request, route)))

    endpoint.__name__ = route.handler.__name__
    return endpoint


# =============================================================================
# Streams: the hub every WebSocket and stream shares (in-band auth, shared frames, one feed for "*", guarded credentials)
# =============================================================================

ALL_CHANNELS = "*"       # the topic of every channel a key may read, in commit order


def broadcast_frame(topic: str, event: Event, position: Optional[int] = None) -> dict:
    frame = {"type": "broadcast", "topic": topic,
             "payload": {"event": {**msgspec.structs.asdict(event), "event_type": event.type}}}
    if position is not None:
        frame["position"] = position       # where a subscription to every channel resumes (its `cursor`)
    return frame


def broadcast_text(topic: str, event: Event, position: Optional[int] = None) -> str:
    """A broadcast frame encoded once: every subscriber it goes to holds this one text."""
    return msgspec.json.encode(broadcast_frame(topic, event, position)).decode("utf-8")


Answered = typing.TypeVar("Answered")


async def read_until_answered(db: "Database", fn: Callable[..., Answered], *args: object) -> Answered:
    """db.read for a stream: while the database is unavailable (PostgreSQL restarting), ask again after
    a growing pause, so an open stream resumes where it was instead of ending."""
    pause = 0.1
    while True:
        try:
            return await db.read(fn, *args)
        except DatabaseUnavailable as exc:
            log.warning("a stream waits for the database: %s", exc.message)
            await asyncio.sleep(pause)
            pause = min(pause * 2, STREAM_RETRY_SECONDS_MAX)


# Where servers share a database, a stream of every channel also reads again after this long without
# a commit it heard of: a commit held back behind an older transaction that then rolled back (see
# settled_positions), or one whose notice was lost (announce_committed), is read then.
FOLLOW_POLL_SECONDS = 1.0


async def wait_for_commit(wake: asyncio.Event, shared: bool) -> None:
    if not shared:
        await wake.wait()
        return
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(wake.wait(), FOLLOW_POLL_SECONDS)


class Outbox:
    """What one subscriber has not been sent yet, bounded in bytes (WS_BACKLOG_BYTES) and in frames
    (WS_QUEUE_MAX). A frame is shared by every subscriber it goes to (encoded once), so a backlog holds
    references and its bound counts their sizes. Live delivery never waits (`offer`: False past the
    bounds); a catch-up the client asked for waits for room (`put`)."""

    def __init__(self, limit_bytes: int = WS_BACKLOG_BYTES, limit_frames: int = WS_QUEUE_MAX):
        self.items: collections.deque = collections.deque()
        self.bytes = 0
        self.limit_bytes, self.limit_frames = limit_bytes, limit_frames
        self._ready, self._room = asyncio.Event(), asyncio.Event()
        self._room.set()

    def offer(self, item: object, size: int) -> bool:
        if self.items and (self.bytes + size > self.limit_bytes or len(self.items) >= self.limit_frames):
            return False
        self._add(item, size)
        return True

    async def put(self, item: object, size: int) -> None:
        while self.items and not self._roomy():
            self._room.clear()
            await self._room.wait()
        self._add(item, size)

    async def get(self) -> object:
        while not self.items:
            self._ready.clear()
            await self._ready.wait()
        item, size = self.items.popleft()
        self.bytes -= size
        if self._roomy():
            self._room.set()
        return item

    def clear(self) -> None:
        self.items.clear()
        self.bytes = 0
        self._room.set()

    def _roomy(self) -> bool:
        return self.bytes < self.limit_bytes // 2 and len(self.items) < self.limit_frames // 2

    def _add(self, item: object, size: int) -> None:
        self.items.append((item, size))
        self.bytes += size
        self._ready.set()


@dataclass
class Subscription:
    """Per connection and topic: events go out in cursor order, each once, none skipped."""

    last_cursor: int = 0
    catching_up: bool = True
    pending: list = field(default_factory=list)
    own: set = field(default_factory=set)    # ids of events this connection published: not echoed


class WsConnection:
    def __init__(self, websocket: WebSocket, hub: "Hub"):
        self.websocket = websocket
        self.hub = hub
        self.id = str(uuid.uuid4())
        self.subscriptions: dict = {}
        self.outbox = Outbox()
        self.pump_task: Optional[asyncio.Task] = None
        self.cut = False
        self.ended: Optional[str] = None     # why the server closed it (its credential no longer holds)
        self.key: Optional[str] = None
        self.principal: Optional[Principal] = None   # re-read on every frame: revoking a key ends it
        self.following: Optional[asyncio.Task] = None   # its subscription to every channel (follow_instance)

    def send(self, frame: dict) -> None:
        """Queue a frame of its own (an answer, an error)."""
        text = msgspec.json.encode(frame).decode("utf-8")
        self.offer(text, len(text))

    def send_event(self, event: Event, position: Optional[int], text: str) -> None:
        """Live delivery of a broadcast frame's `text`, shared with every subscriber it goes to."""
        self.offer(text, len(text))

    async def send_event_paced(self, event: Event, position: Optional[int]) -> None:
        """Catch-up waits for room in the backlog instead of dropping a client that asked for history.
        If the client goes away meanwhile, the pump dies and ws_endpoint cancels this wait."""
        text = broadcast_text(event.channel_id, event, position)
        await self.outbox.put(text, len(text))

    def offer(self, item: object, size: int) -> None:
        """A client too slow to drain WS_BACKLOG_BYTES (or WS_QUEUE_MAX frames) is cut off: it catches
        up on reconnect, and what it had not read is let go at once."""
        if not self.cut and self.ended is None and not self.outbox.offer(item, size):
            self.cut_off()

    def cut_off(self) -> None:
        self.cut = True
        self.outbox.clear()
        self.hub.dropped += 1
        self.hub.leave(self)
        if self.pump_task is not None:
            self.pump_task.cancel()          # ws_endpoint then closes the socket with 1013 (try again later)

    def end(self, reason: str) -> None:
        """Close it from the server's side, saying why (a revoked or expired credential)."""
        if self.ended is None and not self.cut:
            self.ended = reason
            self.outbox.clear()
            self.hub.leave(self)
            if self.pump_task is not None:
                self.pump_task.cancel()      # ws_endpoint sends the reason, then closes with 1008

    def deliver(self, topic: str, event: Event, text: Optional[str] = None, *, echo: bool = True) -> None:
        """Send the event if it is the next one; a later one means another server's commit has not
        been heard yet: the hub reads the missing ones from the table instead."""
        sub = self.subscriptions.get(topic)
        if sub is None:
            return
        if not echo:
            sub.own.add(event.id)
        if sub.catching_up:
            if len(sub.pending) >= WS_QUEUE_MAX:
                self.cut_off()
                return
            sub.pending.append(event)
        elif event.cursor == sub.last_cursor + 1:
            sub.last_cursor = event.cursor
            if event.id in sub.own:
                sub.own.discard(event.id)
            else:
                self.send_event(event, None, text or broadcast_text(topic, event))
        elif event.cursor > sub.last_cursor:
            self.hub.fill(topic)

    async def pump(self) -> None:
        while True:
            await self.websocket.send_text(await self.outbox.get())
            self.hub.messages_sent += 1


@dataclass(eq=False)
class Follower:
    """One stream of every channel `reach` sees: caught up from the log, then fed by the InstanceFeed."""

    reach: "Reach"
    position: int                          # the last position it was given (or had nothing to give)
    conn: WsConnection
    live: bool = False
    covers_from: Optional[int] = None      # the feed's position when it joined: all after reaches it
    buffered: list = field(default_factory=list)   # [(position, event, text)] the feed gave while it caught up
    buffered_bytes: int = 0


class InstanceFeed:
    """The one reader of every channel's new events for the streams of every channel (topic "*"):
    after each commit it reads the log once, encodes each frame once, and hands it to every follower
    whose reach sees its channel. So a commit costs one read whatever the number of such streams, and
    none of it happens on the writer."""

    def __init__(self, db: "Database"):
        self.db = db
        self.position: Optional[int] = None
        self.followers: set = set()
        self.wake = asyncio.Event()
        self.task: Optional[asyncio.Task] = None

    def join(self, follower: Follower) -> None:
        """Take `follower` on at once; it gets what the feed reads from now on (buffered until it is live)."""
        follower.covers_from = self.position
        self.followers.add(follower)
        if self.task is None:
            self.position = None
            self.task = asyncio.get_running_loop().create_task(self.run())

    def leave(self, follower: Follower) -> None:
        self.followers.discard(follower)

    async def run(self) -> None:
        try:
            self.position = await read_until_answered(self.db, latest_position)
            while self.followers:
                for follower in self.followers:
                    if follower.covers_from is None:
                        follower.covers_from = self.position
                self.wake.clear()
                batch = await read_until_answered(self.db, events_after_position, self.position, EVERYWHERE,
                                                  REPLAY_LIMIT_MAX)
                for position, event in batch:
                    self.hand_out(position, event)
                    self.position = position
                if len(batch) < REPLAY_LIMIT_MAX:
                    await wait_for_commit(self.wake, self.db.location.shared)
        except Exception:  # noqa: BLE001 - its followers are cut off, to resume from where they were
            log.exception("the feed of every channel's events failed")
            for follower in list(self.followers):
                follower.conn.cut_off()
        finally:
            self.task = None

    def hand_out(self, position: int, event: Event) -> None:
        text = None
        for follower in list(self.followers):
            if position <= follower.position or not follower.reach.sees(event.channel_id):
                continue
            text = text or broadcast_text(event.channel_id, event, position)
            if follower.live:
                follower.position = position
                follower.conn.send_event(event, position, text)
            elif len(follower.buffered) >= WS_QUEUE_MAX or follower.buffered_bytes + len(text) > WS_BACKLOG_BYTES:
                follower.conn.cut_off()
            else:
                follower.buffered.append((position, event, text))
                follower.buffered_bytes += len(text)


async def follow_instance(db: "Database", hub: "Hub", reach: "Reach", position: Optional[int],
                          conn: WsConnection) -> None:
    """Every event of every channel `reach` sees, in commit order, after `position` (None: from now
    on), to `conn`, until cancelled. It joins the hub's feed first (what the feed reads from then on
    waits for it), catches up from the log until it has read past where the feed stood, then takes
    the feed's frames: nothing is missed, reordered or sent twice, and a stream that resumes at its
    last position goes on exactly there."""
    follower = Follower(reach, await read_until_answered(db, latest_position) if position is None else position, conn)
    hub.feed.join(follower)
    try:
        while True:
            ceiling = await read_until_answered(db, latest_position)
            while True:
                batch = await read_until_answered(db, events_after_position, follower.position, reach, REPLAY_LIMIT_MAX)
                for at, event in batch:
                    await conn.send_event_paced(event, at)
                    follower.position = at
                if len(batch) < REPLAY_LIMIT_MAX:
                    break
            # Every position up to `ceiling` was visible to that read, so none of them is left for it.
            follower.position = max(follower.position, ceiling)
            if follower.covers_from is not None and ceiling >= follower.covers_from:
                break
            await asyncio.sleep(0.01)          # the feed is reading where it starts: once more after it
        for at, event, text in follower.buffered:
            if at > follower.position:
                follower.position = at
                conn.send_event(event, at, text)
        follower.buffered.clear()
        follower.live = True
        await asyncio.Event().wait()          # the feed delivers from here on, until cancelled
    finally:
        hub.feed.leave(follower)


@dataclass(eq=False)
class Guard:
    """An open stream, and how to tell that the credential it was opened with still holds."""

    credential: str                        # one check a round per credential, however many streams
    check: Callable[[], typing.Awaitable[object]]               # awaitable; raises Unauthorized once the credential does not hold
    end: Callable[[str], None]             # closes the stream, saying why


class Hub:
    """Who listens to which channel. Fed by this server's commits (in cursor order), and on
    PostgreSQL by other servers' notifications, which only say "channel X reached cursor N": the
    events themselves are read from the table, after each subscriber's last cursor.

    The writer only hands a committed batch over (on_commit); the fan-out to subscribers runs on
    the hub's own task, each frame encoded once for all of them. Every open stream is guarded: its
    credential is checked again every CREDENTIAL_CHECK_SECONDS (at once when a key is revoked here),
    and a stream whose credential no longer holds is closed."""

    def __init__(self, db: "Database"):
        self.db = db
        self.connections: set = set()
        self.topics: dict = {}
        self.feed = InstanceFeed(db)
        self.guards: set = set()
        self._committed: collections.deque = collections.deque()   # (events, exclude) not yet fanned out
        self._fan_out_wake = asyncio.Event()
        self._recheck = asyncio.Event()
        self._tasks: list = []
        self._filling: dict = {}             # topic -> the task reading its missed events
        self._refill: set = set()            # topics told of more while their task was reading
        self.messages_sent = self.messages_received = self.dropped = 0

    def start(self, credential_ring: "KeyRing") -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self.fan_out()), loop.create_task(self.watch_credentials(credential_ring))]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def on_commit(self, events: list, exclude: Optional[WsConnection]) -> None:
        """This server committed `events` (on the event loop, from the writer): a constant cost here.
        The publisher's own events are marked at once, not on the fan-out's turn: a read of missed
        events (another server's notice) may reach its connection first, and must not echo them."""
        if self.feed.followers:
            self.feed.wake.set()
        if exclude is not None:
            for event in events:
                sub = exclude.subscriptions.get(event.channel_id)
                if sub is not None:
                    sub.own.add(event.id)
        if self.topics:
            self._committed.append((events, exclude))
            self._fan_out_wake.set()

    async def fan_out(self) -> None:
        while True:
            while not self._committed:
                self._fan_out_wake.clear()
                await self._fan_out_wake.wait()
            events, exclude = self._committed.popleft()
            try:
                for event in events:
                    listeners = self.topics.get(event.channel_id)
                    if listeners:
                        text = broadcast_text(event.channel_id, event)
                        for conn in list(listeners):
                            conn.deliver(event.channel_id, event, text, echo=conn is not exclude)
            except Exception:  # noqa: BLE001 - one bad batch must not end delivery for every subscriber
                log.exception("delivering committed events to subscribers failed")
            await asyncio.sleep(0)           # a long run of batches lets the rest of the server in

    def on_notify(self, channel_id: Optional[str], cursor: Optional[int]) -> None:
        """Another server committed up to `cursor` on `channel_id` (None, None: maybe missed anything)."""
        self.feed.wake.set()
        for topic in ([channel_id] if channel_id is not None else list(self.topics)):
            subs = [c.subscriptions[topic] for c in self.topics.get(topic, ()) if topic in c.subscriptions]
            if any(not sub.catching_up and (cursor is None or sub.last_cursor < cursor) for sub in subs):
                self.fill(topic)

    def fill(self, topic: str) -> None:
        """Read what the topic's subscribers have not had yet; one reader task per topic."""
        if topic in self._filling:
            self._refill.add(topic)
        else:
            self._filling[topic] = asyncio.get_running_loop().create_task(self._fill(topic))

    async def _fill(self, topic: str) -> None:
        try:
            while True:
                self._refill.discard(topic)
                subs = [c.subscriptions[topic] for c in self.topics.get(topic, ()) if topic in c.subscriptions]
                live = [sub.last_cursor for sub in subs if not sub.catching_up]
                if not live:
                    return
                batch = await read_until_answered(self.db, replay_events, topic, min(live), REPLAY_LIMIT_MAX)
                for event in batch:
                    for conn in list(self.topics.get(topic, ())):
                        conn.deliver(topic, event)
                if len(batch) < REPLAY_LIMIT_MAX and topic not in self._refill:
                    return
        except Exception:  # noqa: BLE001 - the next notification or commit tries again
            log.exception("reading missed events of %s failed", topic)
        finally:
            self._filling.pop(topic, None)

    def watch(self, conn: WsConnection, topic: str, cursor: int) -> Subscription:
        sub = conn.subscriptions[topic] = Subscription(last_cursor=cursor)
        self.topics.setdefault(topic, set()).add(conn)
        return sub

    def unwatch(self, conn: WsConnection, topic: str) -> None:
        conn.subscriptions.pop(topic, None)
        listeners = self.topics.get(topic)
        if listeners is not None:
            listeners.discard(conn)
            if not listeners:
                del self.topics[topic]

    def leave(self, conn: WsConnection) -> None:
        for topic in list(conn.subscriptions):
            self.unwatch(conn, topic)
        if conn.following is not None:
            conn.following.cancel()
        self.connections.discard(conn)

    def guard(self, guard: Guard) -> Guard:
        self.guards.add(guard)
        return guard

    def unguard(self, guard: Optional[Guard]) -> None:
        self.guards.discard(guard)

    def count_received(self) -> None:
        """A frame arrived on one of this hub's WebSockets (/metrics counts them)."""
        self.messages_received += 1

    def recheck(self) -> None:
        """A credential was revoked here: check every open stream now, not at the next round."""
        self._recheck.set()

    async def watch_credentials(self, keys: "KeyRing") -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._recheck.wait(), CREDENTIAL_CHECK_SECONDS)
            self._recheck.clear()
            if self.guards:
                try:
                    await self.check_guards(keys)
                except Exception:  # noqa: BLE001 - the next round checks again
                    log.exception("checking open streams' credentials failed")

    async def check_guards(self, keys: "KeyRing") -> None:
        try:
            await keys.fresh(CREDENTIAL_CHECK_SECONDS)    # another server's revocation is seen within the round
        except DatabaseUnavailable:
            return                                        # unknown is not revoked: the next round asks again
        verdicts: dict = {}
        for guard in list(self.guards):
            if guard.credential not in verdicts:
                try:
                    await guard.check()
                    verdicts[guard.credential] = None
                except Unauthorized as exc:
                    verdicts[guard.credential] = exc.message
                except Exception:  # noqa: BLE001 - a database hiccup is no revocation
                    verdicts[guard.credential] = None
            if verdicts[guard.credential] is not None and guard in self.guards:
                self.guards.discard(guard)
                guard.end(verdicts[guard.credential])


async def ws_authenticate(websocket: WebSocket, conn: WsConnection, app) -> bool:
    try:
        message = await asyncio.wait_for(websocket.receive(), timeout=app.services.settings.header_timeout)
        if message["type"] == "websocket.disconnect":
            return False
        frame = decode_frame(message.get("text") or "null")
        if not isinstance(frame, AuthFrame):
            raise BadRequest("expected {\"type\": \"auth\", \"api_key\": ...} first")
        conn.principal = await check_key(app, frame.api_key)
        conn.key = frame.api_key
    except (asyncio.TimeoutError, ActaeError) as exc:
        reason = exc.message if isinstance(exc, ActaeError) else "expected {\"type\": \"auth\", \"api_key\": ...} first"
        await websocket.send_text(json.dumps({"type": "error", "message": reason}))
        await websocket.close(code=1008)
        return False
    await websocket.send_text(json.dumps({"type": "connection", "event": "authenticated",
                                          "payload": {"connection_id": conn.id}}))
    return True


async def close_stream_socket(websocket: WebSocket, revoked: Optional[str], cut: bool) -> None:
    """Close a stream's socket saying why: its credential no longer holds (an error frame, then 1008),
    the client was too slow for its backlog (1013: try again later, from where it was), or it is done."""
    with contextlib.suppress(Exception):
        if revoked is not None:
            await websocket.send_text(json.dumps({"type": "error", "message": revoked, "status": "unauthorized"}))
            await websocket.close(code=1008, reason=revoked.encode("utf-8")[:120].decode("utf-8", "ignore"))
        else:
            await websocket.close(code=1013 if cut else 1000)


# =============================================================================
# Dashboard: rendering, sign-in, the keys and API pages
# =============================================================================

JSON_TREE_NODES = 3000                 # larger documents are shown as plain JSON text
JSON_TREE_DEPTH = 24


FLASH_MAX = 64                         # fork-form errors kept for the redirect that shows them
FLASH_TTL_SECONDS = 900
FLASH_VALUE_MAX = 256 * 1024


def millis_between(earlier: Optional[str], later: Optional[str]) -> Optional[int]:
    """Milliseconds between two stored instants; None when either is missing or damaged."""
    start, end = stored_instant(earlier), stored_instant(later)
    if start is None or end is None:
        return None
    return max(0, round((end - start).total_seconds() * 1000))


PAGE_JSON_CHARS = 16 * 1024               # of one document shown on a page; the API has it whole


def pretty_json(value: Json) -> str:
    """A document as a page shows it: indented, and cut at PAGE_JSON_CHARS (a run of large payloads
    makes a page of a bounded size; the whole document is one API call away)."""
    text = json.dumps(value, indent=2, ensure_ascii=False, default=str)
    if len(text) <= PAGE_JSON_CHARS:
        return text
    return (f"{text[:PAGE_JSON_CHARS]}\n… {len(text) - PAGE_JSON_CHARS:,} more characters not shown here:"
            " the API answers the whole document")


def _json_leaf(value: Json) -> str:
    kind = ("jz" if value is None else "jb" if isinstance(value, bool) else
            "jn" if isinstance(value, (int, float)) else "js" if isinstance(value, str) else "jx")
    return f'<span class="{kind}">{markupsafe.escape(json.dumps(value, ensure_ascii=False, default=str))}</span>'


def _json_node(value: Json, key_html: str, comma: str, depth: int, budget: list) -> str:
    budget[0] -= 1
    if budget[0] < 0:
        return ""
    if isinstance(value, dict) and value and depth < JSON_TREE_DEPTH:
        opener, closer, unit = "{", "}", "key"
        items = [(f'<span class="jk">{markupsafe.escape(json.dumps(str(k), ensure_ascii=False))}</span>: ', v)
                 for k, v in value.items()]
    elif isinstance(value, list) and value and depth < JSON_TREE_DEPTH:
        opener, closer, unit = "[", "]", "item"
        items = [("", v) for v in value]
    else:
        return f'<div class="jl">{key_html}{_json_leaf(value)}{comma}</div>'
    last = len(items) - 1
    inner = "".join(_json_node(v, k, "," if i < last else "", depth + 1, budget) for i, (k, v) in enumerate(items))
    count = f"{len(items)} {unit}{'' if len(items) == 1 else 's'}"
    opened = " open" if depth == 0 or len(items) <= 12 else ""
    return (f'<details class="jo"{opened}><summary data-n="{count}" data-close="{closer}">{key_html}{opener}</summary>'
            f'{inner}<div class="jc">{closer}{comma}</div></details>')


def json_tree(value: Json) -> markupsafe.Markup:
    """A JSON value as coloured HTML whose objects and arrays fold (<details>, no JavaScript).

    The element's text is the JSON itself (counts and fold marks come from CSS), so copying it copies
    valid JSON. Documents over JSON_TREE_NODES values are shown as plain pretty-printed text instead.
    """
    budget = [JSON_TREE_NODES]
    html = _json_node(value, "", "", 0, budget)
    if budget[0] < 0:
        return markupsafe.Markup('<pre class="json-box jtext">{}</pre>').format(pretty_json(value))
    return markupsafe.Markup(f'<div class="jtree">{html}</div>')


def duration_text(ms: Optional[float]) -> str:
    """850 ms, 2.4 s, 3 min 12 s, 2 h 5 min."""
    if ms is None:
        return "—"
    if ms < 1000:
        return f"{ms} ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


BRIEF_CHARS = 40                      # a value shown inline, in a step's row: its JSON cut to this


def brief_json(value: Json, chars: int = BRIEF_CHARS) -> str:
    """A value as one short line of JSON (cut with an ellipsis): a step row's old and new values."""
    text = json.dumps(value, ensure_ascii=False, separators=(", ", ": "), default=str)
    return text if len(text) <= chars else text[:chars - 1] + "…"


def template_env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(UI_DIR)), autoescape=True)
    env.filters["pretty"] = pretty_json
    env.filters["brief"] = brief_json
    env.filters["jsontree"] = json_tree
    env.filters["duration"] = duration_text
    return env


# The paths answered with the JSON error body besides the regions' (a trailing "/": every path under it).
KERNEL_JSON_PATHS = ("/api/", "/healthz", "/readyz", "/openapi.json")


def is_page(request: Request) -> bool:
    """Dashboard requests get HTML errors; the API, probes and JSON twins get the JSON error body."""
    path = request.url.path
    json_path = any(path.startswith(known) if known.endswith("/") else path == known
                    for known in (*KERNEL_JSON_PATHS, *request.app.services.hooks.json_paths))
    return not (json_path or request.query_params.get("format") == "json")


def render(request: Request, template: str, context: dict, status: int = 200) -> Response:
    """A page, or its JSON twin with `?format=json` (the same context the template gets)."""
    if request.query_params.get("format") == "json":
        return Response(msgspec.json.encode(context), status_code=status, media_type="application/json")
    # Every POST form carries the session's form token; the request's context holds it once issued.
    asked, services = context_of(request), request.app.services
    notices = [text for text in (notice(services) for notice in services.hooks.page_notices) if text]
    page = services.templates.get_template(template).render(
        **context, version=__version__, notices=notices, nav=services.hooks.nav, logged_in=asked.logged_in,
        csrf_token=asked.csrf_token,
        is_admin=bool(asked.principal and asked.principal.is_admin))
    return HTMLResponse(page, status_code=status)


def dashboard(handler: Callable) -> Callable:
    """Pages need a session; without one a browser goes to /login, a JSON twin gets 401.

    A POST must also come from our own origin and carry the session's form token.
    """
    async def endpoint(request: Request) -> Response:
        session_id = await current_session(request)
        if session_id is None:
            if request.query_params.get("format") != "json":
                return RedirectResponse("/login", status_code=303)
            if request.method != "GET" or not (request.headers.get("x-api-key") or bearer_token(request)):
                raise Unauthorized("log in at /login first, or send an API key as x-api-key (as the API takes it)")
            context_of(request).principal = await twin_principal(request)
            return await handler(request)
        asked = context_of(request)
        asked.logged_in, asked.session_id, asked.csrf_token = True, session_id, form_token(session_id)
        if request.method == "POST":
            require_same_origin(request)
            require_form_token(request, await read_form(request))
        return await handler(request)
    endpoint.__name__ = handler.__name__
    return endpoint


async def twin_principal(request: Request) -> Principal:
    """A page's JSON twin asked with a credential, answered as the API answers one: a login token as
    `authorization: Bearer`, else the key in x-api-key (401 when it is not valid). Every page lists
    runs across the server, so, as at /login, it must read every run (403 when it may not)."""
    bearer = bearer_token(request)
    if bearer is not None:
        principal, context_of(request).user = await check_token(request.app, bearer)
    else:
        principal = await check_key(request.app, request.headers.get("x-api-key"))
    if not principal.can_everywhere("read"):
        raise Forbidden("a page's JSON shows runs across the server: it needs a credential that may read every"
                        " run ('*'); this one has less (the API's routes answer it within its scopes)")
    return principal


async def read_form(request: Request) -> dict:
    """URL-encoded form fields (python-multipart is not needed for this one content type), read once."""
    asked = context_of(request)
    if asked.form is None:
        raw = await read_capped(request)
        asked.form = {k: v[0] for k, v in parse_qs(raw.decode("utf-8", "replace"), keep_blank_values=True).items()}
    return asked.form


def path_channel(request: Request, name: str = "channel_id") -> str:
    return valid_channel(request.path_params[name], name)


class FlashStore:
    """What a POST wants the page after its redirect to show (a form's error and typed values).

    In memory and short-lived: at most FLASH_MAX entries for FLASH_TTL_SECONDS each, looked up by a
    random id in the redirect's query string, so a refresh shows the error again but never re-posts.
    """

    def __init__(self):
        self.entries: dict = {}

    def put(self, value: dict) -> str:
        now = time.monotonic()
        self.entries = {k: v for k, v in self.entries.items() if now - v[0] < FLASH_TTL_SECONDS}
        while len(self.entries) >= FLASH_MAX:
            self.entries.pop(next(iter(self.entries)))
        flash_id = secrets.token_urlsafe(12)
        self.entries[flash_id] = (now, value)
        return flash_id

    def get(self, flash_id: Optional[str]) -> Optional[dict]:
        hit = self.entries.get(flash_id or "")
        if hit is None or time.monotonic() - hit[0] >= FLASH_TTL_SECONDS:
            return None
        return hit[1]


def flash_store(app: "ActaeApp") -> FlashStore:
    return app.services.flash


async def page_login(request: Request) -> Response:
    return render(request, "login.html", {"title": "Log in", "error": None})


async def login_principal(request: Request, form: dict) -> tuple:
    """(principal, session key_ref) for the login form's key, or its email and password."""
    email = form.get("email", "").strip()
    if email:
        user = await verified_user(request, email, form.get("password", ""))
        if user is None:
            raise Unauthorized("That email and password do not match an account.")
        return user_principal(user, auth_method="password"), f"user:{user['id']}"
    key = form.get("api_key", "").strip()
    if looks_like_token(key):
        raise Unauthorized("Log in with an API key, or with your email and password.")
    try:
        return await check_key(request.app, key), key_ref(request.app, key)
    except Unauthorized:
        raise Unauthorized("That key is not valid.") from None


async def page_login_submit(request: Request) -> Response:
    require_same_origin(request)
    try:
        principal, ref = await login_principal(request, await read_form(request))
    except Unauthorized as exc:
        return render(request, "login.html", {"title": "Log in", "error": exc.message}, status=401)
    if not principal.can_everywhere("read"):
        # Every page lists runs across the server; a narrower credential would see beyond its scopes.
        return render(request, "login.html", {"title": "Log in", "error": "The dashboard needs read access to "
                                              "every run ('*'); this credential has less."}, status=403)
    session_id = await db_of(request).write(open_session, ref)
    response = RedirectResponse("/", status_code=303)
    response.set_cookie(SESSION_COOKIE, session_id, max_age=SESSION_MAX_AGE,
                        httponly=True, samesite="strict", secure=request.url.scheme == "https")
    return response


async def favicon(request: Request) -> Response:
    """Browsers ask for /favicon.ico whatever a page links: the dashboard's icon."""
    return RedirectResponse("/static/favicon.svg", status_code=301)


async def page_logout(request: Request) -> Response:
    await db_of(request).write(close_session, context_of(request).session_id)
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, httponly=True, samesite="strict")
    return response


def page_query(request: Request, kind: type) -> Struct:
    """The page's query parameters as a record; a form's blank field counts as absent."""
    return decode_params({k: v for k, v in request.query_params.items() if v != ""}, kind, "query string")


class FormError(BadRequest):
    """A fork-form problem, naming the field it is about (None: the form as a whole)."""

    def __init__(self, field_name: Optional[str], message: str, status: int = 400):
        super().__init__(message, status=status)
        self.field = field_name


def form_json_object(form: dict, field_name: str, label: str) -> Optional[dict]:
    text = form.get(field_name, "").strip()
    if not text:
        return None
    try:
        value = decode_json(text.encode("utf-8", "surrogatepass"), Json, label)
    except ActaeError as exc:
        raise FormError(field_name, exc.message)
    if not isinstance(value, dict):
        raise FormError(field_name, f"{label} must be a JSON object, like {{\"model\": \"slow\"}}")
    return value


def api_groups(document: dict) -> list:
    """The OpenAPI document's operations as rows for the API page, grouped by tag in route order."""
    groups: dict = {}
    for path, methods in document["paths"].items():
        for method, op in methods.items():
            body = op.get("requestBody")
            ref = next(iter(body["content"].values()))["schema"]["$ref"].rsplit("/", 1)[1] if body else None
            groups.setdefault(op["tags"][0], []).append({
                "method": method.upper(), "path": path, "public": op.get("security") == [],
                "parameters": op["parameters"], "body": ref, "body_required": bool(body and body["required"])})
    return list(groups.items())


async def page_api(request: Request) -> Response:
    document = request.app.services.openapi
    return render(request, "api.html", {"title": "API", "groups": api_groups(document),
                                        "schemas": document["components"]["schemas"]})


def require_admin_page(request: Request) -> None:
    if not context_of(request).principal.is_admin:
        raise Forbidden("only an admin may manage keys")


def scopes_from_form(form: dict) -> dict:
    """Comma- or space-separated patterns per action, checked like the API's scopes."""
    fields = {action: [p for p in re.split(r"[\s,]+", form.get(action, "")) if p] for action in ACTIONS[:3]}
    fields["admin"] = ["*"] if form.get("admin") else []
    return msgspec.structs.asdict(record_from(Scopes, fields, "scopes"))


async def keys_context(request: Request, created: Optional[dict] = None, error: Optional[str] = None) -> dict:
    return {"title": "Keys", "active": "keys", "keys": await db_of(request).read(list_keys), "created": created,
            "error": error}


async def page_keys(request: Request) -> Response:
    require_admin_page(request)
    return render(request, "keys.html", await keys_context(request))


async def page_keys_create(request: Request) -> Response:
    require_admin_page(request)
    form = await read_form(request)
    try:
        name = form.get("name", "").strip()
        if not name:
            raise BadRequest("give the key a name")
        days_text = form.get("expires_in_days", "").strip()
        days = record_from(CreateKey, {"name": name, "scopes": {}, "expires_in_days": float(days_text)},
                           "key").expires_in_days if days_text else None
        created = await change_keys(request, create_key, name, scopes_from_form(form), days)
    except (ActaeError, ValueError) as exc:
        message = exc.message if isinstance(exc, ActaeError) else "expiry must be a number of days"
        return render(request, "keys.html", await keys_context(request, error=message), status=400)
    return render(request, "keys.html", await keys_context(request, created=created))


async def page_keys_revoke(request: Request) -> Response:
    require_admin_page(request)
    key_id = decode_params(request.path_params, path_record("/{key_id}"), "path").key_id
    await change_keys(request, revoke_key, key_id)
    return RedirectResponse("/keys", status_code=303)


# =============================================================================
# Connections: bounds an unauthenticated client cannot pass, around uvicorn's protocol
# =============================================================================
# uvicorn has a keep-alive timeout and a concurrency limit, but no bound on a request's head, no
# deadline for headers or body, and it waits for a silent connection for ever. BoundedHttp stands
# between the socket and uvicorn's own httptools protocol: it reads each request's head with a
# parser of its own (httptools' callbacks), holds every request to the bounds, and hands the bytes
# on. uvicorn answers everything (the ASGI cycle, keep-alive, pipelining, 100-continue, upgrades).

REFUSALS = {
    408: ("Request Timeout", "request_timeout", "the request did not arrive in time"),
    431: ("Request Header Fields Too Large", "headers_too_large", "the request's headers are too large or too many"),
}


def refusal(status: int) -> bytes:
    """A complete response with the JSON error body, written by the connection itself."""
    reason, code, message = REFUSALS[status]
    body = error_body(code, message)
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("ascii") + body


def uvicorn_http_protocol() -> type:
    """uvicorn's httptools protocol, the class `uvicorn --http httptools` runs. BoundedHttp makes it
    with the keywords uvicorn hands a protocol and speaks to it only as an asyncio.Protocol."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    return HttpToolsProtocol


class HeadTooLarge(Exception):
    """Raised in a parser callback: a request's head passed a bound (httptools stops there)."""


class ConnectionTransport:
    """The transport uvicorn's protocol writes to: the socket's, with the writes of one turn of the
    event loop joined (an answer's head and body leave in one send, not two), and nothing written
    once the connection is closing, so an answer to a client that went away is simply dropped."""

    def __init__(self, transport: asyncio.Transport, connection: "BoundedHttp"):
        self.transport, self.connection = transport, connection
        self.pending: list = []
        self.closed = False

    def write(self, data: bytes) -> None:
        if self.closed or not data:
            return
        if not self.pending:
            self.connection.loop.call_soon(self.flush)
        self.pending.append(data)
        self.connection.answered = True

    def writelines(self, lines) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        if self.pending and not self.transport.is_closing():
            data = self.pending[0] if len(self.pending) == 1 else b"".join(self.pending)
            self.pending = []
            self.transport.write(data)
        self.pending = []

    def close(self) -> None:
        if not self.closed:
            self.flush()
            self.closed = True
            self.transport.close()

    def abort(self) -> None:
        self.pending, self.closed = [], True
        self.transport.abort()

    def is_closing(self) -> bool:
        return self.closed or self.transport.is_closing()

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self.transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self.connection.reading_paused = True
        self.transport.pause_reading()

    def resume_reading(self) -> None:
        self.connection.reading_paused = False
        self.transport.resume_reading()

    def is_reading(self) -> bool:
        return self.transport.is_reading()

    def set_write_buffer_limits(self, high: Optional[int] = None, low: Optional[int] = None) -> None:
        self.transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self.transport.get_write_buffer_size() + sum(len(data) for data in self.pending)

    def get_write_buffer_limits(self) -> tuple:
        return self.transport.get_write_buffer_limits()

    def can_write_eof(self) -> bool:
        return self.transport.can_write_eof()

    def write_eof(self) -> None:
        self.flush()
        self.transport.write_eof()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.connection.upgraded(protocol)       # the WebSocket's protocol takes the connection over

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.connection.inner


class BoundedHttp(asyncio.Protocol):
    """One connection: uvicorn's protocol behind bounds on each request's head (bytes and count:
    431), a deadline for the head (from the connection, or from the next request's first byte)
    and one for the whole body (408), so dripping a byte at a time holds nothing for long. Any
    number of pipelined requests in one read are each measured on their own. `settings` is set on
    the subclass that `bounded_http` makes."""

    settings: Settings
    arrivals: Optional[Arrivals] = None

    def __init__(self, **uvicorn_keywords):
        self.inner: asyncio.BaseProtocol = uvicorn_http_protocol()(**uvicorn_keywords)
        self.loop = uvicorn_keywords.get("_loop") or asyncio.get_event_loop()
        self.parser = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):    # as uvicorn's parser: answer a request sent before a close
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.watching = True                        # False after an upgrade or a request uvicorn refuses
        self.in_head = self.body_expected = self.answered = self.reading_paused = self.too_large = False
        self.head_bytes = self.head_count = self.head_read = self.head_carried = self.reads = 0
        self.deadline: Optional[asyncio.TimerHandle] = None
        self.transport: Optional[ConnectionTransport] = None

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = ConnectionTransport(transport, self)
        self.inner.connection_made(self.transport)
        self.arm(self.settings.header_timeout, self.headers_timed_out)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.disarm()
        self.transport.closed = True
        self.inner.connection_lost(exc)

    def eof_received(self) -> Optional[bool]:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if self.watching and not self.watch(data):
            return
        self.inner.data_received(data)

    def upgraded(self, protocol: asyncio.BaseProtocol) -> None:
        self.watching, self.inner = False, protocol
        self.disarm()

    # --- the head of each request, read by our own parser ---

    def watch(self, data: bytes) -> bool:
        """Measure the requests in `data`; False when a bound was broken (the connection is refused)."""
        self.reads += 1
        if not self.in_head and self.deadline is None:    # the first byte of the next request
            self.arm(self.settings.header_timeout, self.headers_timed_out)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.watching = False
        except httptools.HttpParserError:
            if self.too_large:
                self.refuse(431)
                return False
            self.watching = False                      # malformed: uvicorn's parser answers 400
        if self.in_head:
            # An unfinished head: its bytes in earlier reads count whole, this read's from its start.
            self.head_carried += len(data) if self.head_read < self.reads else 0
            if max(self.head_bytes, self.head_carried) > self.settings.max_header_bytes:
                self.refuse(431)
                return False
        return True

    def on_message_begin(self) -> None:
        self.in_head, self.body_expected, self.answered, self.too_large = True, False, False, False
        self.head_bytes = self.head_count = self.head_carried = 0
        self.head_read = self.reads
        if self.deadline is None:
            self.arm(self.settings.header_timeout, self.headers_timed_out)

    def on_url(self, url: bytes) -> None:
        self.head_bytes += len(url) + 16            # the method and version around it
        self.check_head()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_count += 1
        self.head_bytes += len(name) + len(value) + 4
        if len(name) in (14, 17) and name.lower() in (b"content-length", b"transfer-encoding"):
            self.body_expected = name.lower() == b"transfer-encoding" or value.strip() not in (b"", b"0")
        self.check_head()

    def check_head(self) -> None:
        if self.head_bytes > self.settings.max_header_bytes or self.head_count > self.settings.max_headers:
            self.too_large = True
            raise HeadTooLarge()

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.disarm()
        if self.arrivals is not None and not self.parser.should_upgrade():
            self.arrivals.heads += 1
        if self.body_expected and not self.parser.should_upgrade():
            self.arm(self.settings.body_timeout, self.body_timed_out)

    def on_message_complete(self) -> None:
        self.disarm()

    # --- deadlines and refusals ---

    def arm(self, seconds: float, callback: Callable) -> None:
        self.disarm()
        self.deadline = self.loop.call_later(seconds, callback)

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def headers_timed_out(self) -> None:
        self.deadline = None
        if self.in_head:
            self.refuse(408)
        elif not self.transport.is_closing():
            self.transport.close()                  # a silent connection gets no answer, just closed

    def body_timed_out(self) -> None:
        self.deadline = None
        if self.reading_paused:                     # uvicorn stopped reading (the app is slow), not the client
            self.arm(self.settings.body_timeout, self.body_timed_out)
        else:
            self.refuse(408)

    def refuse(self, status: int) -> None:
        """Answer (unless an answer to this request has begun) and close: the client broke a bound."""
        self.disarm()
        self.watching = False
        if not self.transport.is_closing():
            if not self.answered:
                self.transport.write(refusal(status))
            self.transport.close()


def bounded_http(settings: Settings, arrivals: Optional["Arrivals"] = None) -> type:
    return type("ActaeHttp", (BoundedHttp,), {"settings": settings, "arrivals": arrivals})


@dataclass
class Arrivals:
    """Requests whose head this server's connections have read: with the answers the app has
    finished, it says how many are in flight, tasks uvicorn made and has not run yet included
    (a lone write commits on the event loop only when it is the one)."""

    heads: int = 0


def raise_open_file_limit() -> None:
    """Each connection is a file descriptor: the default soft limit (often 1024) starves new clients."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
    except (ImportError, ValueError, OSError):
        pass                                      # not on this platform, or not allowed: keep the default


# =============================================================================
# The request path: one for every route (API, pages, streams, static files, WebSocket)
# =============================================================================
# Each concern of a request is defined once here and applies to every kind of route: the Host
# check (host_refusal), the route table (RouteIndex), errors mapped to HTTP (error_response), gzip
# (gzipped), the security headers (SECURITY_HEADERS) and the note each finished request leaves
# (note_request, which the regions' request observers hear). ActaeApp is a plain ASGI app: wrapped in any
# ASGI middleware, or served by another ASGI server, it answers the same.

SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                 b"frame-ancestors 'none'; form-action 'self'; base-uri 'none'; object-src 'none'"),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
]
GZIP_MIN_BYTES = 1024                  # replays and pages shrink several times over; small answers do not pay
REFUSED_CODING = re.compile(rb"\s*q\s*=\s*0(\.0*)?\s*")     # an Accept-Encoding entry's ";q=0"


def host_name(host: str) -> str:
    """The name part of a Host header, lower-case: `[::1]:8002` -> `[::1]`, `Localhost:80` -> `localhost`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host.partition("]")[0] + "]"
    return host.partition(":")[0]


def host_header(scope: dict) -> str:
    return next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")


def served_hosts(settings: Settings) -> frozenset:
    bound = f"[{settings.host}]" if ":" in settings.host else settings.host
    return frozenset({"localhost", "127.0.0.1", "[::1]", bound.lower(), *(h.lower() for h in settings.allow_hosts)})


def host_refusal(hosts: frozenset, scope: dict) -> Optional[BadRequest]:
    """None for a Host we serve, else the 400 that refuses it (a DNS-rebinding page names its own)."""
    host = host_header(scope)
    if host_name(host) in hosts:
        return None
    return BadRequest(f"host {host[:100]!r} is not served here; start the server with --allow-host NAME to serve it")


def accepts_gzip(scope: dict) -> bool:
    """Whether Accept-Encoding accepts gzip: named (or, when it is not named, `*`) with a q-value
    above 0; coding names are case-insensitive."""
    accepted: dict = {}
    for name, value in scope["headers"]:
        if name == b"accept-encoding":
            for coding in value.lower().split(b","):
                token, _, params = coding.partition(b";")
                accepted[token.strip()] = not REFUSED_CODING.fullmatch(params)
    return accepted.get(b"gzip", accepted.get(b"*", False))


def gzipped(scope: dict, headers: list, body: bytes) -> tuple:
    """(headers, body), gzipped when the client accepts it and the body is worth it. Level 1: a 300 KB
    state compresses in 3 ms at it, 13 ms at level 5 (on the event loop, for 15% fewer bytes)."""
    if len(body) < GZIP_MIN_BYTES or not accepts_gzip(scope):
        return headers, body
    body = gzip.compress(body, compresslevel=1, mtime=0)
    headers = [(k, v) for k, v in headers if k != b"content-length"]
    return headers + [(b"content-length", str(len(body)).encode()), (b"content-encoding", b"gzip"),
                      (b"vary", b"accept-encoding")], body


class MethodNotAllowed(ActaeError, status=405, code="method_not_allowed"):
    """The path exists; the method is not one it answers."""


def error_response(request: Request, exc: Exception) -> Response:
    """The one mapping of a failure to its HTTP answer, for every kind of route: an ActaeError is
    its status and `{"status": code, "error": message}` (a page gets the error page instead, a
    region its own shape through `context_of(request).error_shape`); anything else is a bug, logged once
    and answered as an Internal error, so the connection stays sound."""
    if isinstance(exc, ClientDisconnect):
        return Response(status_code=499)          # nobody is left to read it: not a bug, nothing to log
    if not isinstance(exc, ActaeError):
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        exc = Internal(f"internal error ({type(exc).__name__}); the server log has the details")
    shape = context_of(request).error_shape
    if shape is not None:
        return shape(exc)
    if is_page(request) and exc.status != 401:
        try:
            return render(request, "error.html", {"title": f"Error {exc.status}", "status": exc.status,
                                                  "message": exc.message}, status=exc.status)
        except jinja2.TemplateError:
            log.exception("error page failed to render")
    return Response(error_body(exc.code, exc.message), status_code=exc.status, media_type="application/json")


ACCESS_LOG = logging.getLogger("actae.access")


class AccessLines:
    """The access log of a server that main() started: each request leaves a tuple here, and one
    thread turns them into lines and writes them together a few times a second, as the log's own
    lines read (text or JSON). A request pays for an append to a deque (thread-safe without a lock),
    not for a log record, a format and a write; the thread writes each line straight from its tuple,
    not through a LogRecord and a Formatter (those were 4% of server CPU per write under 32 writers).
    The thread lives as long as the process (a timer thread per batch made the event loop wait for
    each new thread to start)."""

    FLUSH_SECONDS = 0.25

    def __init__(self, handler: "BatchedLines", form: str):
        self.handler, self.pending = handler, collections.deque()
        self.line_of = self.json_line if form == "json" else self.text_line
        self.second, self.stamp = -1, ""
        self.writer: Optional[threading.Thread] = None
        self.starting = threading.Lock()

    def add(self, entry: tuple) -> None:
        self.pending.append(entry)
        if self.writer is None:
            self.start_writer()

    def start_writer(self) -> None:
        with self.starting:
            if self.writer is None:
                self.writer = threading.Thread(target=self.write_every_while, name="actae-access-log", daemon=True)
                self.writer.start()

    def write_every_while(self) -> None:
        while True:
            time.sleep(self.FLUSH_SECONDS)
            self.flush()

    def flush(self) -> None:
        entries = [self.pending.popleft() for _ in range(len(self.pending))]
        if entries:
            self.handler.write_lines_now([self.line_of(*entry) for entry in entries])

    def text_line(self, at: float, method: str, route: str, status: int, seconds: float, who: str) -> str:
        """As logging.Formatter's "%(asctime)s %(levelname)s %(name)s: %(message)s" reads it."""
        second = int(at)
        if second != self.second:                   # strftime once a second, not once a line
            self.second, self.stamp = second, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        return (f"{self.stamp},{int((at - second) * 1000):03d} INFO {ACCESS_LOG.name}: "
                + access_message(method, route, status, seconds, who))

    @staticmethod
    def json_line(at: float, method: str, route: str, status: int, seconds: float, who: str) -> str:
        return json_log_line(at, "info", ACCESS_LOG.name, access_message(method, route, status, seconds, who),
                             {"method": method, "route": route, "status": status,
                              "duration_ms": round(seconds * 1000, 2), "principal": who})


def access_message(method: str, route: str, status: int, seconds: float, who: str) -> str:
    return f"{method} {route} {status} {seconds * 1000:.1f}ms {who}"


ACCESS_LINES: list = []               # the one AccessLines of a process main() configured (else none)


def note_request(services: "Services", route: str, method: str, status: int, seconds: float,
                 scope: Optional[dict] = None) -> None:
    """A finished request: one access line (the route's template, never its values: no key or ticket
    in a query string reaches the log; who asked, by name), then whoever listens (metrics)."""
    if ACCESS_LINES:
        context = (scope or {}).get("actae")
        principal = context.principal if context is not None else None
        ACCESS_LINES[0].add((time.time(), method, route, status, seconds,
                             principal.actor if principal is not None else "-"))
    for hear in services.hooks.request_observers:
        hear(services, route, method, status, seconds)


@dataclass(frozen=True)
class Endpoint:
    """A route of the table as the request path calls it: `handle(request)` answers a Response;
    a WebSocket route's `handle(websocket)` runs the connection."""

    method: str                        # "WS" for a WebSocket route
    path: str                          # the template, as /metrics labels it
    handle: Callable


class RouteIndex:
    """(method, path) -> the endpoint and its path parameters: exact paths in a dict, templates in
    table order. One table for the API, the pages, the streams and the WebSockets."""

    def __init__(self, endpoints: list):
        self.static: dict = {}
        self.dynamic: dict = {}
        self.paths: dict = {}                 # path or template -> methods served there (405 vs 404)
        for endpoint in endpoints:
            self.paths.setdefault(endpoint.path, set()).add(endpoint.method)
            if "{" in endpoint.path:
                regex = compile_path(endpoint.path)[0]
                self.dynamic.setdefault(endpoint.method, []).append((regex, endpoint))
            else:
                earlier = [regex for regex, _ in self.dynamic.get(endpoint.method, ()) if regex.match(endpoint.path)]
                assert not earlier, f"{endpoint.path} is shadowed by an earlier route"   # static-first is then exact
                self.static[(endpoint.method, endpoint.path)] = endpoint
        self.templates = [(compile_path(path)[0], methods) for path, methods in self.paths.items()]

    def find(self, method: str, path: str) -> Optional[tuple]:
        """(endpoint, path parameters), or None."""
        endpoint = self.static.get((method, path))
        if endpoint is not None:
            return endpoint, {}
        for regex, endpoint in self.dynamic.get(method, ()):
            match = regex.match(path)
            if match:
                return endpoint, match.groupdict()
        return None

    def refusal(self, method: str, path: str) -> ActaeError:
        """Why nothing answers `method path`: 405 where another method is served, else 404."""
        if any(regex.match(path) and methods - {"WS"} for regex, methods in self.templates):
            return MethodNotAllowed(f"{method} is not allowed on {path}")
        return NotFound(f"no route for {method} {path}")


class ActaeApp:
    """The whole server as one plain ASGI app. Every HTTP request takes `answer_http`, every
    WebSocket `answer_websocket`: the Host check, the route table, the handler, errors mapped
    once, gzip where accepted, the security headers, and the request noted. Everything one app
    shares lives in `services`; nothing is shared between apps in one process."""

    def __init__(self, services: "Services", endpoints: list, lifespan: Callable):
        self.services = services
        self.routes = RouteIndex(endpoints)
        self.lifespan = lifespan
        self.static = StaticFiles(directory=str(UI_DIR / "static"))
        self.in_flight = 0                    # HTTP requests being answered (a lone write may commit here)
        self.arrivals = Arrivals()            # heads BoundedHttp read, when it serves this app (uvicorn_config)
        self.answered = 0                     # HTTP requests answered since

    def requests_in_flight(self) -> int:
        """Requests being answered, or read and waiting for their turn (when BoundedHttp counts them:
        under another server only those already inside the app)."""
        waiting = self.arrivals.heads - self.answered if self.arrivals.heads else 0
        return max(self.in_flight, waiting)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        scope["app"] = self
        if scope["type"] == "http":
            await self.answer_http(scope, receive, send)
        elif scope["type"] == "websocket":
            await self.answer_websocket(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self.run_lifespan(receive, send)

    async def answer_http(self, scope: dict, receive: Callable, send: Callable) -> None:
        started, noted = time.perf_counter(), []
        self.in_flight += 1
        try:
            route = await self.respond(scope, receive, self.noting_send(send, noted))
        finally:
            self.in_flight -= 1
            self.answered += 1
        note_request(self.services, route, scope["method"], noted[0] if noted else 500, time.perf_counter() - started,
                     scope)

    async def respond(self, scope: dict, receive: Callable, send: Callable) -> str:
        """Answer one HTTP request; returns the route template it took ("other" off the table)."""
        request = Request(scope, receive)
        method = "GET" if scope["method"] == "HEAD" else scope["method"]
        refused = host_refusal(self.services.hosts, scope)
        if refused is not None:
            await self.reply(scope, receive, send, error_response(request, refused))
            return "other"
        if scope["path"].startswith("/static/") and method == "GET":
            await self.static({**scope, "root_path": scope.get("root_path", "") + "/static"}, receive, send)
            return "other"
        found = self.routes.find(method, scope["path"])
        if found is None:
            refusal = self.routes.refusal(scope["method"], scope["path"])
            await self.reply(scope, receive, send, error_response(request, refusal))
            return "other"
        endpoint, scope["path_params"] = found
        try:
            response = await endpoint.handle(request)
        except Exception as exc:  # noqa: BLE001 - mapped to its answer in one place
            response = error_response(request, exc)
        await self.reply(scope, receive, send, response)
        return endpoint.path

    @staticmethod
    async def reply(scope: dict, receive: Callable, send: Callable, response: Response) -> None:
        """A response on the wire; a whole body is gzipped where it pays, a stream goes as it is."""
        if isinstance(response, StreamingResponse) or not hasattr(response, "body"):
            await response(scope, receive, send)
            return
        headers, body = gzipped(scope, response.raw_headers, response.body)
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

    @staticmethod
    def noting_send(send: Callable, noted: list) -> Callable:
        """`send` with the security headers on every answer, noting its status."""
        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                noted.append(message["status"])
                message = {**message, "headers": [*message.get("headers", ()), *SECURITY_HEADERS]}
            await send(message)
        return sending

    async def answer_websocket(self, scope: dict, receive: Callable, send: Callable) -> None:
        started = time.perf_counter()
        found = None if host_refusal(self.services.hosts, scope) else self.routes.find("WS", scope["path"])
        if found is None:
            await send({"type": "websocket.close", "code": 1008})
            note_request(self.services, "other", "GET", 403, time.perf_counter() - started)
            return
        endpoint, scope["path_params"] = found
        try:
            await endpoint.handle(WebSocket(scope, receive, send))
        except Exception:  # noqa: BLE001 - a bug in one connection; the others go on
            log.exception("unhandled error on WebSocket %s", scope["path"])
            with contextlib.suppress(Exception):
                await send({"type": "websocket.close", "code": 1011})
        note_request(self.services, endpoint.path, "GET", 101, time.perf_counter() - started)

    async def run_lifespan(self, receive: Callable, send: Callable) -> None:
        """ASGI's lifespan: start the services, serve until told to stop, stop them."""
        await receive()                                       # lifespan.startup
        phase = "startup"
        try:
            async with self.lifespan(self):
                await send({"type": "lifespan.startup.complete"})
                phase = "shutdown"
                await receive()                               # lifespan.shutdown
        except Exception as exc:  # noqa: BLE001 - told to the server, which stops
            log.exception("the server could not %s cleanly", "start" if phase == "startup" else "stop")
            await send({"type": f"lifespan.{phase}.failed", "message": f"{type(exc).__name__}: {exc}"})
            return
        await send({"type": "lifespan.shutdown.complete"})


# =============================================================================
# App factory: the services, the route table, the lifespan
# =============================================================================

def token_secret(data_dir: Path) -> bytes:
    """The login tokens' signing secret: a file beside the database (mode 0600), made on first start.

    Kept out of the database so that a copy of it (or a backup) cannot mint tokens.
    """
    path = data_dir / TOKEN_SECRET_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return bytes.fromhex(path.read_text().strip())
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32))
    return bytes.fromhex(path.read_text().strip())


def keys_cipher(data_dir: Path) -> "cryptography.fernet.Fernet":
    """The Fernet key that encrypts other servers' keys kept in the database (a remote instance's, a
    model upstream's): a file beside the database (0600), made on first use. A copy of the database
    alone cannot decrypt them."""
    from cryptography.fernet import Fernet        # imported here: only a stored key needs it

    path = Path(data_dir) / KEYS_CIPHER_FILE
    if not path.exists():
        # Written whole under another name, then linked into place: a second process starting at the
        # same moment finds no file or the whole key, never a half-written one (the first link wins).
        draft = path.with_name(f".{KEYS_CIPHER_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(Fernet.generate_key())
                out.flush()
                os.fsync(out.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(draft, path)
        finally:
            draft.unlink()
    return Fernet(path.read_bytes().strip())


def instance_identity(tx: Tx) -> str:
    """This data dir's instance id, made once and kept across restarts."""
    tx.conn.execute("INSERT INTO settings (name, value) VALUES ('instance_id', ?) ON CONFLICT (name) DO NOTHING",
                    (str(uuid.uuid4()),))
    return tx.conn.execute("SELECT value FROM settings WHERE name = 'instance_id'").fetchone()[0]


RegionService = typing.TypeVar("RegionService")


@dataclass
class Services:
    """What every request of one app shares, built once by create_app (one app's, never another's).
    A region keeps its own service in `regions`, by its type (`services.region(FleetState)`)."""

    db: Database
    hub: Hub
    keys: KeyRing
    settings: Settings
    templates: jinja2.Environment
    flash: "FlashStore"
    hosts: frozenset
    data_dir: Path
    token_secret: bytes
    env_key: Optional[str]
    hooks: Hooks = field(default_factory=hooks_of)   # the regions it serves
    instance_id: str = ""              # read from the database when the app starts
    started: float = field(default_factory=time.monotonic)
    started_at: str = field(default_factory=lambda: iso(utc_now()))
    key_touched: dict = field(default_factory=dict)
    background: set = field(default_factory=set)
    openapi: dict = field(default_factory=dict)
    regions: dict[type, object] = field(default_factory=dict)

    def region(self, kind: type[RegionService]) -> RegionService:
        """The service a region's installer keeps in this app, by its type."""
        return typing.cast(RegionService, self.regions[kind])


PAGE_ROUTES = [
    ("GET", "/api", page_api),
    ("GET", "/keys", page_keys),
    ("POST", "/keys", page_keys_create),
    ("POST", "/keys/{key_id}/revoke", page_keys_revoke),
    ("POST", "/logout", page_logout),
]


def page_routes(hooks: Optional[Hooks] = None) -> list[tuple[str, str, Callable]]:
    """The dashboard's pages: the kernel's, then each region's."""
    return [*PAGE_ROUTES, *(hooks or hooks_of()).pages]


def page_endpoint(method: str, path: str, handler: Callable) -> Endpoint:
    return Endpoint(method, path, dashboard(handler))


def app_endpoints(hooks: Optional[Hooks] = None) -> list[Endpoint]:
    """The one route table: the API's routes, the pages, the WebSockets and streams, the regions' too."""
    hooks = hooks or hooks_of()
    endpoints = [Endpoint(route.method, route.path, wrapped_endpoint(route, hooks)) for route in api_routes(hooks)]
    endpoints += [page_endpoint(method, path, handler) for method, path, handler in page_routes(hooks)]
    return endpoints + [Endpoint("GET", "/login", page_login), Endpoint("POST", "/login", page_login_submit),
                        Endpoint("GET", "/favicon.ico", favicon), *hooks.endpoints]


def wrapped_endpoint(route: Api, hooks: Hooks) -> Callable:
    """A route's endpoint with what the regions wrap around every one."""
    endpoint = api_endpoint(route)
    for wrap in hooks.wrappers:
        endpoint = wrap(route, endpoint)
    return endpoint


# The kernel's own write that changes no channel's rows: a key's last use is one row, which its own
# row lock keeps (the regions name theirs: Region.channel_writes).
KERNEL_CHANNEL_WRITES = ((touch_key, lambda key_id: ()),)


def commit_policy(hooks: Hooks, in_flight: Callable[[], int]) -> CommitPolicy:
    """What the writer asks of this app: a lone write the regions name quick (Region.lone_writes)
    commits on the event loop's thread while no other request waits (`in_flight`, counted by the
    app); a write the regions say changes only some channels' rows names them (Region.channel_writes)."""
    lone = frozenset(hooks.lone_writes)
    named = dict((*KERNEL_CHANNEL_WRITES, *hooks.channel_writes))

    def channels_written(job: Job) -> Optional[tuple]:
        channels_of = named.get(job.work)
        return None if channels_of is None else channels_of(*job.args)
    return CommitPolicy(alone=lambda job: job.work in lone and in_flight() <= 1, channels_of=channels_written)


def create_app(data_dir: Path, *, database_url: Optional[str] = None, env_key: Optional[str] = None,
               settings: Settings = Settings(), regions: Optional[typing.Sequence[Region]] = None,
               **region_options: object) -> ActaeApp:
    """The whole server: on the SQLite file in `data_dir`, or on PostgreSQL at `database_url`
    (several servers may share that database). `env_key` is accepted besides stored keys; `regions`
    are the regions it serves (every declared one by default); `region_options` go to the regions
    that take them (`otlp=` turns on trace export, `organization=` names the fleet's organisation)."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    hooks, listeners = hooks_of(regions), CommitListeners()
    # A lone SDK write commits on the event loop's thread while no other request waits (the app,
    # built below, counts them; the policy is asked only once it serves).
    db = Database(Location(data_dir, database_url), commit_policy(hooks, lambda: app.requests_in_flight()),
                  hooks.store, listeners)
    hub = Hub(db)
    listeners.commits.append(hub.on_commit)
    listeners.notices.append(hub.on_notify)
    services = Services(db=db, hub=hub, keys=KeyRing(db, hub.recheck), settings=settings,
                        templates=template_env(), flash=FlashStore(), hosts=served_hosts(settings), data_dir=data_dir,
                        token_secret=token_secret(data_dir), env_key=env_key or None, hooks=hooks,
                        openapi=openapi_document(api_routes(hooks)))
    starting, stopping = [lambda: hub.start(services.keys)], [hub.stop]
    for install in (install for region in hooks.regions for install in region.installers):
        installed = install(services, region_options)
        services.regions.update((type(service), service) for service in installed.services)
        starting += installed.starts
        stopping[:0] = installed.stops
        if installed.on_batch is not None:
            listeners.batches.append(installed.on_batch)

    @contextlib.asynccontextmanager
    async def lifespan(app: ActaeApp):
        await db.open()
        services.instance_id = await db.write(instance_identity)
        for start in starting:
            await start() if asyncio.iscoroutinefunction(start) else start()
        try:
            yield
        finally:
            for stop in stopping:
                await stop() if asyncio.iscoroutinefunction(stop) else stop()
            await db.close()

    app = ActaeApp(services, app_endpoints(hooks), lifespan)
    return app


# =============================================================================
# Command line
# =============================================================================

class Subcommands(typing.Protocol):
    """The subcommands of `actae` (what argparse's add_subparsers answers): a region adds its own."""

    choices: dict

    def add_parser(self, name: str, **kwargs: object) -> argparse.ArgumentParser: ...


def program_name() -> str:
    """The command as the user runs it, for hints: `python actae.py` from source, else the executable."""
    if bundle_dir() is None:
        return "python actae.py"
    invoked = sys.argv[0] if sys.argv and sys.argv[0] else "actae"
    return invoked if os.sep in invoked else "actae"


class CommandLine(argparse.ArgumentParser):
    """argparse that refuses bad input in one line (`actae: ...`, exit 2, never a traceback); a flag
    it does not know gets the nearest one it does and the usage of the (sub)command it was given to."""

    NEAR = 0.75      # how alike a mistyped name and a known one must be to suggest it (--prot: --port; not --verbose: --version)
    argv: Optional[list] = None

    def error(self, message: str) -> typing.NoReturn:
        wrong = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if wrong:
            mistyped = self.flag_before(wrong.group(1))
            if mistyped is not None:     # `--prot 8003`: the flag was mistyped, its value taken for a command
                self.unknown([mistyped])
            near = difflib.get_close_matches(wrong.group(1), re.findall(r"'([^']*)'", wrong.group(2)), n=1,
                                             cutoff=self.NEAR)
            message += f" (did you mean {near[0]}?)" if near else ""
        self.exit(2, f"{self.prog}: {message}\n")

    def flag_before(self, value: str) -> Optional[str]:
        """The flag just before `value` on the command line when this parser knows no such flag."""
        argv, known = self.argv or [], self.known_flags()
        for before, token in zip(argv, argv[1:]):
            if token == value and before.startswith("-") and before.split("=", 1)[0] not in known:
                return before
        return None

    def known_flags(self) -> list:
        return re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", self.format_help())

    def parse_known_args(self, args: Optional[typing.Sequence[str]] = None, namespace: Optional[argparse.Namespace] = None) -> tuple:
        """As argparse's, noting which (sub)command parsed them: the deepest one, which parses first."""
        self.argv = list(sys.argv[1:] if args is None else args)
        parsed, extra = super().parse_known_args(args, namespace)
        if getattr(parsed, "parsed_by", None) is None:
            parsed.parsed_by = self
        return parsed, extra

    def unknown(self, extra: list) -> typing.NoReturn:
        known = self.known_flags()
        flag = extra[0].split("=", 1)[0]
        near = difflib.get_close_matches(flag, known, n=1, cutoff=self.NEAR)
        hint = f" (did you mean {near[0]}?)" if near else ""
        self.exit(2, f"{self.format_usage()}{self.prog}: unrecognized argument {extra[0]!r}{hint}\n")


def whole(low: int, high: int) -> Callable[[str], int]:
    """A flag's type: a whole number from `low` to `high`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"takes a whole number from {low} to {high}, got {value}")
        return value
    return parse


def bounded_number(text: str, low: float, high: float, unit: str, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of {unit}, got {text!r}") from None
    if not (math.isfinite(value) and (value > low if positive else value >= low) and value <= high):
        raise argparse.ArgumentTypeError(f"takes a number of {unit} {'above' if positive else 'from'} {low:g}"
                                         f" {'and at most' if positive else 'to'} {high:g}, got {text}")
    return value


def seconds(high: float) -> Callable[[str], float]:
    return lambda text: bounded_number(text, 0, high, "seconds", positive=True)


def days(positive: bool = False) -> Callable[[str], float]:
    return lambda text: bounded_number(text, 0, 36500, "days", positive=positive)


def build_parser(regions: tuple[Region, ...]) -> argparse.ArgumentParser:
    # SUPPRESS: `--data-dir` may come before or after `key rotate` without one erasing the other.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--data-dir", default=argparse.SUPPRESS, metavar="DIR",
                        help="folder holding the SQLite database and the token secret"
                             " (default: $ACTAE_DATA_DIR or ~/.actae)")
    common.add_argument("--database", default=argparse.SUPPRESS, metavar="URL",
                        help="a postgresql://user:password@host:port/name URL: keep the data in PostgreSQL,"
                             " which several servers may share (default: $ACTAE_DATABASE_URL, else SQLite)")
    parser = CommandLine(
        prog="actae", parents=[common],
        description="Actae community server: record agent runs, fork them at a step, never repeat a side effect.")
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"interface to listen on (default: {DEFAULT_HOST})")
    parser.add_argument("--port", type=whole(0, 65535), default=DEFAULT_PORT,
                        help=f"port to listen on; 0 picks a free one (default: {DEFAULT_PORT})")
    parser.add_argument("--version", action="version", version=f"actae {__version__}",
                        help="print the version and exit")
    limits, default = parser.add_argument_group("who may connect, and for how long"), Settings()
    limits.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                        help="also answer requests for this Host name (repeatable); loopback names and the "
                             "bound address are always served, any other name gets 400 (DNS rebinding)")
    limits.add_argument("--max-connections", type=whole(1, 1_000_000), default=default.max_connections, metavar="N",
                        help=f"open connections before new requests get 503 (default: {default.max_connections})")
    limits.add_argument("--header-timeout", type=seconds(3600), default=default.header_timeout, metavar="SECONDS",
                        help=f"time for a request's headers (default: {default.header_timeout:g})")
    limits.add_argument("--keepalive-timeout", type=seconds(3600), default=default.keepalive_timeout, metavar="SECONDS",
                        help=f"how long an idle connection stays open (default: {default.keepalive_timeout:g})")
    limits.add_argument("--body-timeout", type=seconds(86400), default=default.body_timeout, metavar="SECONDS",
                        help=f"time for a request's whole body (default: {default.body_timeout:g})")
    limits.add_argument("--max-header-bytes", type=whole(1024, 16 * 1024 * 1024), default=default.max_header_bytes, metavar="BYTES",
                        help=f"request line and headers together (default: {default.max_header_bytes})")
    parser.add_argument("--open-signup", action="store_true",
                        help="let anyone create an account (by default only an admin key may)")
    logs = parser.add_argument_group("what the server logs (to standard error)")
    logs.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                      help="the least severe lines written: debug, info (one access line per request), warning or"
                           " error (default: info)")
    logs.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                      help="text, or json: one JSON object a line (time, level, logger, message and fields) for a"
                           " log shipper (default: text)")
    for add_flags in (flag for region in regions for flag in region.serve_flags):
        add_flags(parser)
    # The same scope flags for a key and for an account.
    scoped = argparse.ArgumentParser(add_help=False)
    for action in ACTIONS[:3]:
        scoped.add_argument(f"--{action}", action="append", default=[], metavar="PATTERN",
                            help=f"channels it may {action}: '*', a prefix ending in '*', or an id (repeatable)")
    scoped.add_argument("--admin", action="store_true", help="every action on every channel, plus keys and users")
    commands = parser.add_subparsers(dest="command", parser_class=CommandLine)
    add_core_commands(commands, common, scoped)
    for add_commands in (add for region in regions for add in region.commands):
        add_commands(commands, common, scoped)
    commands.metavar = "{" + ",".join(commands.choices) + "}"
    return parser


def parse_command_line(argv: Optional[list], regions: tuple[Region, ...]) -> argparse.Namespace:
    parser = build_parser(regions)
    args, extra = parser.parse_known_args(argv)
    if extra:
        args.parsed_by.unknown(extra)
    return args


def add_core_commands(commands: Subcommands, common: argparse.ArgumentParser, scoped: argparse.ArgumentParser) -> None:
    """`actae key ...` and `actae user ...`: keys and accounts."""
    key = add_command(commands, "key", key_command, [common], "manage API keys: create, list, revoke, rotate")
    key_commands = add_credential_commands(key, "key", "key_id", "a key", "keys", (common, scoped), ("rotate",))
    key_commands.add_parser("rotate", parents=[common],
                            help="issue and print a new admin key; the old admin key stops working")
    user = add_command(commands, "user", user_command, [common], "manage accounts: grant")
    user_commands = user.add_subparsers(dest="user_command", required=True, metavar="{grant}")
    grant = user_commands.add_parser("grant", parents=[common, scoped],
                                     help="set the scopes an account's login tokens carry")
    grant.add_argument("email")


LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")


def json_log_line(created: float, level: str, logger: str, message: str, fields: dict) -> str:
    """A JSON log line: time, level, logger, message, and the record's fields beside them."""
    return json.dumps({"time": iso(datetime.fromtimestamp(created, timezone.utc)), "level": level,
                       "logger": logger, "message": message, **fields}, ensure_ascii=False, default=str)


class JsonLines(logging.Formatter):
    """One JSON object a line (json_log_line), a record's `fields` and its exception included."""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", {})
        if record.exc_info:
            fields = {**fields, "exception": self.formatException(record.exc_info)}
        return json_log_line(record.created, record.levelname.lower(), record.name, record.getMessage(), fields)


class BatchedLines(logging.StreamHandler):
    """Standard error in batches: info lines (one access line a request) leave together at most a
    quarter of a second later, in one write, not one write each; a warning or worse flushes at once."""

    FLUSH_SECONDS, BATCH_MAX = 0.25, 256

    def __init__(self, stream: typing.TextIO):
        super().__init__(stream)
        self.lines: list = []
        self.timer: Optional[threading.Timer] = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # noqa: BLE001 - as logging's own handlers: a bad record is reported, not raised
            self.handleError(record)
            return
        with self.lock:
            self.lines.append(line)
            if record.levelno >= logging.WARNING or len(self.lines) >= self.BATCH_MAX:
                self.write_lines()
            elif self.timer is None:
                self.timer = threading.Timer(self.FLUSH_SECONDS, self.flush)
                self.timer.daemon = True
                self.timer.start()

    def write_lines_now(self, lines: list) -> None:
        """Lines that come batched already (the access log's): written now, in one write, no timer."""
        with self.lock:
            self.lines += lines
            self.write_lines()

    def write_lines(self) -> None:
        if self.lines:
            self.stream.write("\n".join(self.lines) + "\n")
            self.lines = []
        self.stream.flush()

    def flush(self) -> None:
        with self.lock:
            self.timer = None
            self.write_lines()


def configure_logging(level: str, form: str) -> None:
    """The process's log: to standard error, text or JSON lines, uvicorn's own lines included."""
    handler = BatchedLines(sys.stderr)
    handler.setFormatter(JsonLines() if form == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    ACCESS_LINES[:] = [AccessLines(handler, form)] if ACCESS_LOG.isEnabledFor(logging.INFO) else []
    atexit.register(lambda: [lines.flush() for lines in ACCESS_LINES])
    logging.getLogger("uvicorn").setLevel(max(logging.WARNING, root.level))


def settings_of(args: argparse.Namespace) -> Settings:
    return Settings(host=args.host, allow_hosts=tuple(args.allow_host), max_connections=args.max_connections,
                    header_timeout=args.header_timeout, keepalive_timeout=args.keepalive_timeout,
                    body_timeout=args.body_timeout, max_header_bytes=args.max_header_bytes,
                    open_signup=args.open_signup)


def options_of(args: argparse.Namespace, regions: tuple[Region, ...]) -> dict:
    """create_app's keywords for the regions (`otlp=`, `fleet=`), from the flags they added."""
    options: dict = {}
    for read in (read for region in regions for read in region.options):
        options.update(read(args))
    return options


def uvicorn_config(app: ActaeApp, settings: Settings) -> uvicorn.Config:
    """uvicorn behind the connection's bounds (BoundedHttp); what it cannot bound itself is bounded there."""
    arrivals = app.arrivals if isinstance(app, ActaeApp) else None
    return uvicorn.Config(app, http=bounded_http(settings, arrivals), log_config=None, access_log=False,
                          lifespan="on", ws_max_size=MAX_BODY_BYTES, timeout_graceful_shutdown=10,
                          limit_concurrency=settings.max_connections,
                          timeout_keep_alive=settings.keepalive_timeout)


def serve(port: int, location: Location, settings: Settings, options: Optional[dict] = None,
          regions: Optional[tuple[Region, ...]] = None) -> int:
    """Bind first (so --port 0 prints the real port), print the banner, then serve until Ctrl-C."""
    options = options or {}
    host = settings.host
    try:
        sock = bind_socket(host, port)
    except OSError as exc:
        print(f"actae: cannot listen on {host}:{port}: {exc.strerror}", file=sys.stderr)
        return 1
    raise_open_file_limit()
    try:
        key = write_once(location, first_key)
    except (ActaeError, OSError, sqlite3.Error, *((psycopg.Error,) if psycopg else ())) as exc:
        print(f"actae: cannot open the database at {location.describe()}: {exc}", file=sys.stderr)
        return 1
    shown_host = f"[{host}]" if ":" in host else host
    print(f"Actae {__version__} — data in {location.describe()}")
    print(f"Dashboard:   http://{shown_host}:{sock.getsockname()[1]}")
    regions = tuple(REGIONS) if regions is None else regions
    for line in (line for region in regions for line in region.banner_lines):
        text = line(options)
        if text:
            print(text)
    print_key_line(key)
    sys.stdout.flush()
    app = create_app(location.data_dir, database_url=location.url, env_key=os.environ.get("ACTAE_API_KEY"),
                     settings=settings, regions=regions, **options)
    log.info("listening on http://%s:%d (Press Ctrl-C to quit)", shown_host, sock.getsockname()[1],
             extra={"fields": {"host": host, "port": sock.getsockname()[1], "backend": location.backend}})
    try:
        uvicorn.Server(uvicorn_config(app, settings)).run(sockets=[sock])
    except KeyboardInterrupt:   # uvicorn re-raises Ctrl-C after its graceful shutdown has finished
        pass
    log.info("stopped: every answered write is on disk", extra={"fields": {"event": "shutdown"}})
    return 0


def main(argv: Optional[list] = None, regions: Optional[typing.Sequence[Region]] = None) -> int:
    """The command line; `regions`: the regions the server and its commands have (every declared one
    by default; the schema is every declared region's whatever they are)."""
    regions = tuple(REGIONS if regions is None else regions)
    args = parse_command_line(argv, regions)
    configure_logging(args.log_level, args.log_format)
    try:
        location = location_of(args)
        run = getattr(args, "run", None)
        if run is not None:
            return run(args, location)
        settings, options = settings_of(args), options_of(args, regions)
    except ActaeError as exc:           # a refused command or a bad flag's value: one line, as argparse's
        raise SystemExit(f"actae: {exc.message}") from None
    return serve(args.port, location, settings, options, regions)


def add_command(commands: Subcommands, name: str, run: Callable, parents: list, help: str) -> argparse.ArgumentParser:
    """A subcommand of `actae`: main calls `run(args, location)` for it."""
    parser = commands.add_parser(name, parents=parents, help=help)
    parser.set_defaults(run=run)
    return parser


def add_credential_commands(parser: argparse.ArgumentParser, command: str, id_name: str, one: str, many: str,
                            parents: tuple, more: tuple = ()) -> Subcommands:
    """`actae COMMAND create|list|revoke` for a secret shown once at its creation (a key, an organisation
    token); `more` names the further subcommands the caller adds to what this returns."""
    common, scoped = parents
    metavar = "{" + ",".join(("create", "list", "revoke", *more)) + "}"
    kinds = parser.add_subparsers(dest=command.replace("-", "_") + "_command", required=True, metavar=metavar)
    create = kinds.add_parser("create", parents=[common, scoped], help=f"issue {one} and print it once")
    create.add_argument("--name", required=True, help=f"what it is for (shown by `{command} list`)")
    create.add_argument("--expires-in", type=days(positive=True), metavar="DAYS", help="it stops working after DAYS days")
    listing = kinds.add_parser("list", parents=[common], help=f"the active {many} (never the secrets themselves)")
    listing.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    revoke = kinds.add_parser("revoke", parents=[common], help=f"end {one} now")
    revoke.add_argument(id_name, type=whole(1, INT64_MAX), metavar="ID", help=f"the id `{command} list` shows")
    return kinds


def print_listing(as_json: bool, document: Json, heading: str, lines: typing.Iterable[str]) -> None:
    """A list command's answer: the JSON document with --json, else a table (its heading, then its lines)."""
    if as_json:
        print_json(document)
        return
    print(heading)
    for line in lines:
        print(line)


def print_issued(noun: str, issued: object) -> None:
    expires = f", expires {issued.expires_at}" if issued.expires_at else ""
    print(f"{noun} {issued.id} ({issued.name}): {scopes_text(issued.scopes)}{expires}")


def print_revoked(noun: str, revoked: object) -> None:
    print(f"{noun} {revoked.id} ({revoked.name}) revoked at {revoked.revoked_at}")


def print_passed_over(heading: str, items: list) -> None:
    """The runs a command left alone, each with its reason; nothing when there are none."""
    if items:
        print(f"{heading}:")
        for item in items:
            print(f"  {item.channel_id}: {item.reason}")


def print_json(value: Json) -> None:
    """A command's --json answer: the API's encoding, indented for a reader."""
    print(msgspec.json.format(msgspec.json.encode(value), indent=2).decode())


def scopes_of_args(args: argparse.Namespace) -> dict:
    """The scope flags as checked scopes (a bad pattern is a BadRequest: main says it in one line)."""
    fields = {action: getattr(args, action) for action in ACTIONS[:3]}
    fields["admin"] = ["*"] if args.admin else []
    return msgspec.structs.asdict(record_from(Scopes, fields, "scopes"))


def scopes_text(scopes: Permissions) -> str:
    granted = [(action, getattr(scopes, action)) for action in ACTIONS]
    return "; ".join(f"{action}={','.join(patterns)}" for action, patterns in granted if patterns) or "(none)"


def key_command(args: argparse.Namespace, location: Location) -> int:
    """`actae key create|list|revoke|rotate`."""
    if args.key_command == "rotate":
        print_key_line(write_once(location, rotate_key))
    elif args.key_command == "create":
        created = write_once(location, create_key, args.name, scopes_of_args(args), args.expires_in)
        print_issued("Key", created)
        print_key_line(created.key)
    elif args.key_command == "list":
        keys = read_once(location, list_keys)
        print_listing(args.json, Keys(keys=keys),
                      f"{'ID':>4}  {'NAME':<20} {'SCOPES':<40} {'CREATED':<25} {'LAST USED':<25} EXPIRES",
                      (f"{k.id:>4}  {k.name or '':<20} {scopes_text(k.scopes):<40} {k.created_at:<25} "
                       f"{k.last_used_at or 'never':<25} {k.expires_at or 'never'}" for k in keys))
    else:
        print_revoked("Key", write_once(location, revoke_key, args.key_id))
    return 0


def user_command(args: argparse.Namespace, location: Location) -> int:
    """`actae user grant EMAIL [scope flags]`."""
    granted = write_once(location, grant_user, args.email, scopes_of_args(args))
    print(f"{granted.email}: {scopes_text(granted.scopes)}")
    return 0


def location_of(args: argparse.Namespace) -> Location:
    """--database (or $ACTAE_DATABASE_URL) picks PostgreSQL; otherwise the SQLite file in the data dir."""
    url = getattr(args, "database", None) or os.environ.get("ACTAE_DATABASE_URL") or None
    if url is not None:
        if urlsplit(url).scheme not in ("postgresql", "postgres"):
            raise SystemExit(f"actae: --database takes a postgresql://user:password@host:port/name URL (got {url!r});"
                             " without it the server uses SQLite in the data dir")
        if psycopg is None:
            raise SystemExit("actae: PostgreSQL needs psycopg: pip install 'psycopg[binary]' psycopg_pool")
    return Location(data_dir_of(args), url)


def data_dir_of(args: argparse.Namespace) -> Path:
    """The data folder, made when missing; exits (2) with one line when it cannot be used."""
    chosen = getattr(args, "data_dir", None) or os.environ.get("ACTAE_DATA_DIR") or "~/.actae"
    path = Path(chosen).expanduser()
    if path.exists() and not path.is_dir():
        refuse_flag(f"--data-dir {chosen} is a file, not a folder: name a folder (it is made when missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        refuse_flag(f"--data-dir {chosen}: cannot make that folder: {exc.strerror or exc}")
    if not os.access(path, os.W_OK | os.X_OK):
        refuse_flag(f"--data-dir {chosen}: this user may not write in that folder")
    return path


def refuse_flag(message: str) -> typing.NoReturn:
    print(f"actae: {message}", file=sys.stderr)
    raise SystemExit(2)


def key_of_args(key_file: Optional[str], key: Optional[str], variable: str, prompt: str) -> Optional[str]:
    """Another server's key for a command that stores it: --key-file (- reads standard input), else
    --key, else $variable, else asked for on a terminal without echo; None when there is none."""
    if key_file:
        try:
            text = sys.stdin.read() if key_file == "-" else Path(key_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SystemExit(f"actae: cannot read the key file {key_file}: {getattr(exc, 'strerror', exc)}")
        key = text.strip()
    else:
        key = (key or os.environ.get(variable) or "").strip()
    if not key and sys.stdin.isatty():
        import getpass
        key = getpass.getpass(prompt).strip()
    return key or None


def write_once(location: Location, work: Callable, *args):
    """One write transaction from the command line, on the same job runner the server uses."""
    conn = connect_sync(location)
    try:
        ((result, events),) = run_jobs(conn, [Job(work, args, None)])
    finally:
        conn.close()
    if events is None:
        raise result
    return result


def read_once(location: Location, work: Callable, *args):
    conn = connect_sync(location)
    try:
        return work(conn, *args)
    finally:
        conn.close()


def print_key_line(key: Optional[str]) -> None:
    if key:
        print(f"API key:     {key}   (shown once — store it now)")
    else:
        print(f"API key:     already issued at first start (run `{program_name()} key rotate` for a new one)")


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


# =============================================================================
# Runs: records (the bodies and answers of runs, events and state)
# =============================================================================

class Transition(EventFields, kw_only=True):
    type: Name
    state: Document = None
    expected_version: Optional[Count] = None
    expected_cursor: Optional[Count] = None


class ReplayQuery(ClampedLimit):
    cursor: Count = 0
    event_type: Optional[Name] = None


class CausalQuery(Record):
    max_nodes: Limit = 1000

    def __post_init__(self):
        self.max_nodes = min(self.max_nodes, 10_000)


class PageQuery(ClampedLimit):
    offset: Count = 0


# --- channels, forks, experiments ------------------------------------------------------


class PutMetadata(Record):
    """Only the keys present change (UNSET = absent; null clears)."""

    channel_id: Optional[ChannelId] = None
    display_name: Union[Label, None, UnsetType] = UNSET
    reason: Union[LongText, None, UnsetType] = UNSET
    experiment_metadata: Union[JsonObject, None, UnsetType] = UNSET


class DeleteQuery(Record):
    recursive: bool = False


class RunsPageQuery(Record):
    q: PageText = ""                  # a substring of the run's id or name
    status: PageText = ""             # one of RUN_STATES ("failed": crashes too)
    after: Optional[PageText] = None  # the next page's token
    deleted: PageText = ""            # the run the delete just before removed
    count: Count = 0                  # how many runs that delete removed


class FlashQuery(Record):
    error: Optional[PageText] = None        # the flash id of a refused form


class Events(Answer):
    events: list[Event]


class LatestCursor(Answer):
    latest_cursor: Optional[int]


class TransitionAnswer(Answer):
    event: Event
    state_version: int


class ChainCheck(Answer):
    """A run's recomputed hash chain: `ok`, or the first channel and cursor that do not hold."""

    channel_id: str
    ok: bool
    valid: bool
    verified_events: int
    first_broken_channel_id: Optional[str]
    first_broken_cursor: Optional[int]
    head: Optional[str]
    algorithm: str


class CausalEdge(Answer):
    event_id: str
    depends_on_event_id: str
    dependency_type: str


class CausalGraph(Answer):
    root_event_id: str
    events: list[Event]
    dependencies: list[CausalEdge]
    truncated: bool


class StateAnswer(Answer):
    """A snapshot; with none yet, `cursor` and `state` are null and `version` is absent."""

    cursor: Optional[int]
    state: Json
    version: Union[int, UnsetType] = UNSET


class StateVersion(Answer):
    version: int
    cursor: int
    timestamp: str


class StateVersions(Answer):
    versions: list[StateVersion]


class DeletedCount(Done, kw_only=True):
    deleted: int


class DeletedChannels(Done, kw_only=True):
    deleted: list[str]


class LastStep(Answer):
    channel_id: str
    last_step_number: int


class BlameQuery(Record):
    at_step: Optional[Positive] = None        # the state as it was after this step (default: the latest)


class BlameLine(Answer):
    """One path of a run's state, its current value, and the step whose snapshot set it."""

    path: list[str]                           # keys and list indexes from the top, as the diff names them
    value: Json
    step: Optional[int]                       # None: set before the run's first step
    cursor: int                               # the snapshot that set it
    channel_id: str                           # whose snapshot: an ancestor's, for a value a fork inherited


class Blame(Answer):
    """Every path of a run's state (as of `at_step`) with the step that set its current value."""

    channel_id: str
    at_step: Optional[int]                    # the last step the blamed state includes
    version: Optional[int]                    # the snapshot blamed (None: the run has no state)
    cursor: Optional[int]
    paths: list[BlameLine]
    total: int                                # paths in all; `paths` holds the first BLAME_PATHS_MAX


class StepLocation(Answer):
    """Step n of a channel: the channel that recorded it (an ancestor for inherited steps) and where."""

    channel_id: str
    cursor: int
    event_id: str
    step_number: int


class Closed(Done, kw_only=True):
    """A closed run; `event` (its `channel.closed`) only on the call that closed it."""

    channel_id: str
    closed_at: str
    replayed: bool
    event: Union[Event, UnsetType] = UNSET


# =============================================================================
# Runs: channels, events and state (plain functions of a connection or a Tx)
# =============================================================================


def require_channel(conn: Conn, channel_id: str) -> Row:
    return present(channel_by_id(conn, channel_id), lambda: NotFound(f"channel {channel_id} not found"))


def returned_row(cursor: Cursor) -> Optional[tuple]:
    """The one row a statement's RETURNING answered, as a tuple; None when it wrote nothing."""
    row = cursor.fetchone()
    return None if row is None else tuple(row)


def bump_channel(tx: Tx, channel_id: str, insert: Callable[[], Optional[tuple]],
                 used: Optional[Callable[[], bool]] = None) -> Optional[tuple]:
    """Run `insert`, which writes a row numbered by its channel (an event, a state) and returns its
    numbers, or None when the channel is missing, closed, or (with `used`) the request's operation id
    is taken: then `used()` confirms it and None is returned, for a replay. Creates the channel on
    its first write (most writes find it, so the insert is not tried first); Conflict(channel_closed)
    when the run is closed."""
    bumped = insert()
    if bumped is None and used is not None and used():
        return None
    if bumped is None and channel_by_id(tx.conn, channel_id) is None:
        ensure_channel(tx, channel_id)
        bumped = insert()
    if bumped is None:
        raise channel_closed(channel_id)
    known = tx.conn.known_channels
    if known is not None:
        if len(known) >= KNOWN_CHANNELS_MAX:
            known.clear()                # a hint: forgetting costs the next write to each a round trip
        known.add(channel_id)
    return bumped


# An event's columns the caller gives; its cursor and chain hash come from its channel's last event.
EVENT_COLUMNS = ("channel_id", "id", "type", "payload", "actor", "agent_id", "user_id", "metadata", "operation_id",
                 "request_hash", "step_number", "depends_on", "dependencies", "created_at")
EVENT_TYPES = {"step_number": "BIGINT"}


def last_event_sql(dialect: "Dialect") -> str:
    """A channel's last event, as the next one needs it: its cursor (0 before the first) and the chain
    hash it goes on from (before the first: the chain the channel starts from, see heads_from_events),
    read off the events' primary key. `c` is the channel's row; the caller adds the WHERE."""
    return ("SELECT COALESCE(h.cursor, 0) AS cursor, COALESCE(h.chain_hash, c.chain_base) AS chain FROM channels c"
            f" {dialect.last_event_join}")

# A state's version is the next above every version its channel has had: above the greatest stored,
# and above the channel's state_version, which keeps the greatest one ever deleted (see
# delete_state_version; on a database from before, the counter it was), so a number never names two
# states. The insert reads it off the states' primary key: a state commit writes no channel row.
STATE_COLUMNS = ("channel_id", "cursor", "sha256", "status", "operation_id", "created_at", "state", "delta_base",
                 "chain_start", "ref_channel", "ref_version", "chain_bytes", "base_bytes")
STATE_TYPES = {"cursor": "BIGINT", "state": "BYTEA", "delta_base": "BIGINT", "chain_start": "BIGINT",
               "ref_version": "BIGINT", "chain_bytes": "BIGINT", "base_bytes": "BIGINT"}


@functools.lru_cache(maxsize=16)
def next_state_sql(dialect: "Dialect", new_operation: bool, strict: bool = False, facts: bool = False) -> str:
    """INSERT of the channel's next state version (arguments: STATE_COLUMNS' values, the channel id,
    and with `new_operation` the channel id and operation id again); returns the version, or nothing
    when the channel is missing or closed, or the operation id is used on it. `strict` (PostgreSQL,
    see Later), it fails there instead (a NULL version), and with `facts` note_state_facts' UPDATE
    rides in the same statement (its arguments first): one statement per state."""
    given = ", ".join(dialect.parameter(STATE_TYPES.get(column)) for column in STATE_COLUMNS)
    refuse_used = unused_operation("states") if new_operation else ""
    version = (f"{dialect.greatest}(c.state_version,"
               " COALESCE((SELECT MAX(s.version) FROM states s WHERE s.channel_id = c.id), 0)) + 1"
               f" FROM channels c WHERE c.id = ? AND c.closed_at IS NULL{refuse_used}")
    ride = f"WITH facts AS ({state_facts_sql(dialect)}) " if facts else ""
    rows = f"VALUES ({given}, (SELECT {version}))" if strict else f"SELECT {given}, {version}"
    return f"{ride}INSERT INTO states ({', '.join(STATE_COLUMNS)}, version) {rows} RETURNING version"


def unused_operation(table: str) -> str:
    """The WHERE clause a numbered INSERT adds so that it allocates nothing for an operation id
    already used on the channel: the common case (a new operation) then costs no lookup."""
    return f" AND NOT EXISTS (SELECT 1 FROM {table} WHERE channel_id = ? AND operation_id = ?)"


@functools.lru_cache(maxsize=16)
def next_event_sql(dialect: "Dialect", new_operation: bool, strict: bool = False, facts: bool = False) -> str:
    """INSERT of the channel's next event (arguments: the channel id, with `new_operation` the channel
    id and operation id again, with `facts` event_facts_args, then EVENT_COLUMNS' values and the chain
    step's head and tail); returns its cursor and chain hash, or nothing when the channel is missing
    or closed, or the operation id is used on it. `strict` (PostgreSQL, see Later), it fails there
    instead (a NULL cursor), and with `facts` event_facts_sql's UPDATE rides in the same statement:
    one statement per event."""
    given = ", ".join(dialect.parameter(EVENT_TYPES.get(column)) for column in EVENT_COLUMNS)
    refuse_used = unused_operation("events") if new_operation else ""
    ride = f", facts AS ({event_facts_sql(dialect, True)})" if facts else ""
    last = f"WITH last AS ({last_event_sql(dialect)} WHERE c.id = ? AND c.closed_at IS NULL{refuse_used}){ride}"
    cursor, chain = "last.cursor + 1", "actae_chain(last.chain, ?, last.cursor + 1, ?)"
    rows = (f"VALUES ({given}, (SELECT {cursor} FROM last), (SELECT {chain} FROM last))" if strict
            else f"SELECT {given}, {cursor}, {chain} FROM last")
    return (f"{last} INSERT INTO events ({', '.join(EVENT_COLUMNS)}, cursor, chain_hash) {rows}"
            " RETURNING cursor, chain_hash")


# What a run's row holds of its events: their activity second (updated_at, from which a trigger keeps
# active_at, see activity_second_schema), the type of the last one while it blocks the run (else
# NULL: run_state reads no more of it) and the first failure's cursor. The row is written only when
# one of them changes: SQLite rewrites an index page for every UPDATE that names one of the index's
# columns, changed or not, and PostgreSQL writes a row version; an UPDATE that matches no row writes
# nothing. A run's events within one second, none of them failing or blocking, then write no channel
# row at all. `ride`: the UPDATE rides in the event's INSERT (a data-modifying WITH on PostgreSQL),
# which does not see that event: the failure's cursor is the one after the last (next_event_sql's).
@functools.lru_cache(maxsize=4)
def event_facts_sql(dialect: "Dialect", ride: bool = False) -> str:
    failure_at = ("(SELECT last.cursor + 1 FROM last)" if ride
                  else "(SELECT MAX(e.cursor) FROM events e WHERE e.channel_id = channels.id)")
    return ("UPDATE channels SET updated_at = ?, last_event_type = ?, error_cursor = COALESCE(error_cursor,"
            f" CASE WHEN CAST(? AS INTEGER) = 1 THEN {failure_at} END) WHERE id = ? AND (active_at {dialect.differs} ?"
            f" OR last_event_type {dialect.differs} ? OR (CAST(? AS INTEGER) = 1 AND error_cursor IS NULL))")


def event_facts_args(tx: Tx, channel_id: str, event_type: str) -> tuple:
    """event_facts_sql's arguments: the run's activity, the blocking event's type, whether it failed."""
    waiting, failure = (event_type if event_type in BLOCKING_EVENT_TYPES else None), int(is_failure_event(event_type))
    return tx.ts, waiting, failure, channel_id, tx.ts[:ACTIVE_AT_CHARS], waiting, failure


def note_event_facts(tx: Tx, channel_id: str, event_type: str) -> None:
    """After a new event: its facts on the channel's row, where they changed (event_facts_sql)."""
    tx.conn.execute(event_facts_sql(tx.conn.dialect), event_facts_args(tx, channel_id, event_type))


@functools.lru_cache(maxsize=4)
def state_facts_sql(dialect: "Dialect") -> str:
    return ("UPDATE channels SET updated_at = ?, last_state_status = ? WHERE id = ?"
            f" AND (active_at {dialect.differs} ? OR last_state_status {dialect.differs} ?)")


def note_state_facts(tx: Tx, channel_id: str, status: Optional[str]) -> None:
    """After a new state: its latest snapshot's status, and the run's activity when its second changed
    (a run's states keep its activity time to the second, as its events do: see event_facts_sql)."""
    facts = state_facts_args(tx, channel_id, status)
    if facts is not None:
        tx.conn.execute(state_facts_sql(tx.conn.dialect), facts)


def state_facts_args(tx: Tx, channel_id: str, status: Optional[str]) -> Optional[tuple]:
    """state_facts_sql's arguments (None: nothing to keep; examples/bench_without.py prices run-state so)."""
    return tx.ts, status, channel_id, tx.ts[:ACTIVE_AT_CHARS], status


def ensure_channel(tx: Tx, channel_id: str) -> None:
    """Channels are created by their first write; there is no 'create channel' call."""
    tx.conn.execute(
        "INSERT INTO channels (id, origin_id, created_at, updated_at) VALUES (?, ?, ?, ?)"
        " ON CONFLICT (id) DO NOTHING",
        (channel_id, channel_id, tx.ts, tx.ts),
    )


def request_hash(value: Json) -> str:
    return sha256_hex(canonical_json(value))


def append_event(tx: Tx, channel_id: str, event_type: str, payload: Json, *, actor: str = "system",
                 metadata: Json = None, agent_id: Optional[str] = None, user_id: Optional[str] = None,
                 operation_id: Optional[str] = None, hashed: Optional[str] = None,
                 step_number: Optional[int] = None, depends_on: Optional[str] = None,
                 dependencies: Optional[list] = None, payload_text: Optional[str] = None,
                 new_operation: bool = False, settle_later: bool = False) -> Union[Event, Later, None]:
    """Append one event at the channel's next cursor and return it.

    `payload_text` is the payload's canonical JSON when the caller has it already (it hashed it).
    With `new_operation`, nothing is appended and None is returned when `operation_id` is used
    already (the caller replays it). Raises Conflict(channel_closed) on a closed run. With
    `settle_later`, a caller that reads nothing of the event may get a Later instead (see Tx.later).
    """
    event_id = uuid7()
    if depends_on is None and dependencies:
        depends_on = next((d.get("event_id") for d in dependencies if isinstance(d, dict) and d.get("event_id")), None)
    payload_text = canonical_dump(payload) if payload_text is None else payload_text
    metadata_text = canonical_dump(metadata)
    head, tail = chain_parts(
        channel_id=channel_id, event_id=event_id, event_type=event_type, payload_text=payload_text, actor=actor,
        agent_id=agent_id, user_id=user_id, metadata_text=metadata_text, step_number=step_number,
        depends_on=depends_on, timestamp=tx.ts)
    checked = new_operation and operation_id is not None
    key, used = (channel_id,), None
    if checked:
        key += (channel_id, operation_id)
        used = lambda: event_by_operation(tx.conn, channel_id, operation_id) is not None  # noqa: E731
    values = (channel_id, event_id, event_type, payload_text, actor, agent_id, user_id, metadata_text,
              operation_id, hashed, step_number, depends_on, dump(dependencies), tx.ts)
    args, dialect, hooks = key + values + (head, tail), tx.conn.dialect, tx.hooks.events.get(event_type)

    def event_at(counters: tuple) -> Event:
        cursor, chain_hash = counters
        return Event(id=event_id, channel_id=channel_id, type=event_type, payload=payload, actor=actor, cursor=cursor,
                     channel_cursor=cursor, timestamp=tx.ts, agent_id=agent_id, user_id=user_id, metadata=metadata,
                     depends_on=depends_on, step_number=step_number, chain_hash=chain_hash)
    if settle_later and hooks is None and tx.may_settle_later(channel_id):
        sql = next_event_sql(dialect, checked, strict=True, facts=True)
        args = key + event_facts_args(tx, channel_id, event_type) + values + (head, tail)
        later = Later(tx.conn.execute(sql, args), event_at)
        tx.later.append(later)
        tx.events.append(later)
        keep_usage(tx.conn, channel_id, None, payload, metadata)
        return later
    sql = next_event_sql(dialect, checked)
    bumped = bump_channel(tx, channel_id, lambda: returned_row(tx.conn.execute(sql, args)), used)
    if bumped is None:
        return None
    event = event_at(bumped)
    tx.events.append(event)
    note_event_facts(tx, channel_id, event_type)
    keep_usage(tx.conn, channel_id, event.cursor, payload, metadata)
    if hooks is not None:
        for hook in hooks:
            hook(tx, event)
    return event


def event_by_operation(conn: Conn, channel_id: str, operation_id: str) -> Optional[Row]:
    return conn.execute(
        "SELECT * FROM events WHERE channel_id = ? AND operation_id = ?", (channel_id, operation_id)
    ).fetchone()


def require_same_request(stored: str, hashed: str, operation_id: str, what: str) -> None:
    """A reused operation id replays only the request it was first used for; another is refused."""
    if stored != hashed:
        raise Conflict("idempotency_conflict", f"operation_id {operation_id} was already used for a different {what}")


def replay_or_conflict(row: Row, hashed: str, what: str) -> Event:
    require_same_request(row["request_hash"], hashed, row["operation_id"], what)
    return event_of(row)


FRAMEWORK_EVENT_SCHEMA = "actae.framework-event/v1"


def envelope_hash(req: RecordEvent, stored: Row) -> Optional[str]:
    """The SDK runtime's lifecycle envelope (payload "schema": FRAMEWORK_EVENT_SCHEMA) carries the clock
    of the attempt that sent it (`occurred_at`) beside a deterministic operation id, so a redelivered job
    that enters the same workflow again sends the same event at another time. Its identity leaves the
    clock out: the hash of this request with the stored event's `occurred_at`, or None for other payloads."""
    payload = req.payload
    if not (isinstance(payload, dict) and payload.get("schema") == FRAMEWORK_EVENT_SCHEMA and "occurred_at" in payload):
        return None
    original = load(stored["payload"])
    if not isinstance(original, dict) or "occurred_at" not in original:
        return None
    return request_hash({"type": req.event_type, "payload": {**payload, "occurred_at": original["occurred_at"]}})


def record_event(tx: Tx, req: RecordEvent) -> Event:
    """POST /events/record. Returns the new event, or the original one for a replayed operation id."""
    payload_text = canonical_dump(req.payload)
    # == request_hash({"type": ..., "payload": ...}): canonical JSON sorts "payload" before "type".
    hashed = sha256_hex(f'{{"payload":{payload_text or "null"},"type":{json_scalar(req.event_type)}}}')
    meta = req.meta()
    event = append_event(
        tx, req.channel_id, req.event_type, req.payload, actor=req.actor(), metadata=meta.metadata,
        agent_id=meta.agent_id, user_id=meta.user_id, operation_id=req.operation_id, hashed=hashed,
        step_number=req.step_number, dependencies=req.dependencies, payload_text=payload_text,
        new_operation=True, settle_later=True,
    )
    if event is None:
        stored = event_by_operation(tx.conn, req.channel_id, req.operation_id)
        return replay_or_conflict(stored, envelope_hash(req, stored) or hashed, "event")
    return event


def query_events(conn: Conn, q: EventQuery) -> list[Event]:
    """POST /events/query: newest first; every filter optional."""
    where = Where()
    if q.channel_ids:
        where.add(f"channel_id IN ({','.join('?' * len(q.channel_ids))})", *q.channel_ids)
    for value, clause in ((q.event_type, "type = ?"), (q.actor, "actor = ?"),
                          (q.cursor_start, "cursor >= ?"), (q.cursor_end, "cursor <= ?"),
                          (q.since and iso(q.since), "created_at >= ?"), (q.until and iso(q.until), "created_at <= ?")):
        where.add_if(value, clause)
    rows = conn.execute(
        f"SELECT * FROM events{where} ORDER BY created_at DESC, channel_id, cursor DESC LIMIT ? OFFSET ?",
        (*where.args, q.limit, q.offset),
    ).fetchall()
    return [event_of(r) for r in rows]


def latest_cursor(conn: Conn, channel_id: str) -> Optional[int]:
    row = channel_by_id(conn, channel_id)
    return row["last_cursor"] if row is not None and row["last_cursor"] > 0 else None


def causal_graph(conn: Conn, event_id: str, max_nodes: int, reach: "Reach") -> CausalGraph:
    """Bounded ancestry walk over `depends_on` and the recorded `dependencies` edges, among the runs
    `reach` sees: an edge into a run it may not read stays an edge to an event that is not there,
    exactly as an edge to an id that never existed."""
    root = present(visible_event(conn, event_id, reach), lambda: NotFound(f"event {event_id} not found"))
    seen, order, edges, frontier, truncated = {root["id"]: root}, [root], [], [root], False
    while frontier:
        row = frontier.pop(0)
        parents = [(d.get("event_id"), d.get("dependency_type", "causal"))
                   for d in (load(row["dependencies"]) or []) if isinstance(d, dict) and d.get("event_id")]
        if row["depends_on"] and all(p != row["depends_on"] for p, _ in parents):
            parents.append((row["depends_on"], "causal"))
        for parent_id, kind in parents:
            edges.append(CausalEdge(event_id=row["id"], depends_on_event_id=parent_id, dependency_type=kind))
            if parent_id in seen:
                continue
            if len(order) >= max_nodes:
                truncated = True
                continue
            parent = visible_event(conn, parent_id, reach)
            if parent is not None:
                seen[parent_id] = parent
                order.append(parent)
                frontier.append(parent)
    return CausalGraph(root_event_id=root["id"], events=[event_of(r) for r in order], dependencies=edges,
                       truncated=truncated)


def visible_event(conn: Conn, event_id: str, reach: "Reach") -> Optional[Row]:
    """The event row with this id, if it lies in a run `reach` sees."""
    row = row_where(conn, "events", id=event_id)
    return row if row is not None and reach.sees(row["channel_id"]) else None


def verify_chain(conn: Conn, channel_id: str) -> ChainCheck:
    """GET /events/verify/{channel}: recompute the chain from the stored rows, across the lineage.

    The inherited part (each ancestor up to where the line below left it) is checked first, so an
    edit in a parent's history before the boundary breaks the fork's chain too. Returns `ok` and,
    when it does not hold, the first channel and cursor whose stored hash disagrees.
    """
    segments = list(reversed(lineage(conn, channel_id)))        # root first
    previous, checked = None, 0
    for index, (row, leave) in enumerate(segments):
        child = segments[index + 1][0] if index + 1 < len(segments) else None
        upto = leave if leave is not None else INT64_MAX
        boundary_hash = None
        for event in conn.execute("SELECT * FROM events WHERE channel_id = ? AND cursor <= ? ORDER BY cursor",
                                  (row["id"], upto)):
            expected = row_chain_hash(previous, event)
            if event["chain_hash"] != expected:
                return chain_verdict(channel_id, checked, broken=(row["id"], event["cursor"]))
            previous, checked = expected, checked + 1
            if child is not None and event["cursor"] == child["resolved_cursor"]:
                boundary_hash = expected
        if child is not None:
            previous = boundary_hash            # the fork went on from the hash at its boundary cursor
    return chain_verdict(channel_id, checked, head=previous)


def chain_verdict(channel_id: str, checked: int, *, broken: Optional[tuple] = None,
                  head: Optional[str] = None) -> ChainCheck:
    ok = broken is None
    broken_channel, broken_cursor = broken or (None, None)
    return ChainCheck(channel_id=channel_id, ok=ok, valid=ok, verified_events=checked,
                      first_broken_channel_id=broken_channel, first_broken_cursor=broken_cursor, head=head,
                      algorithm="sha256-chain-v1")


# --- state -------------------------------------------------------------------


def state_row_at(conn: Conn, channel_id: str, cursor: Optional[int]) -> Optional[Row]:
    """The snapshot with the greatest cursor <= `cursor` (ties: highest version); None = the latest."""
    if cursor is None:
        return conn.execute(
            "SELECT * FROM states WHERE channel_id = ? ORDER BY version DESC LIMIT 1", (channel_id,)
        ).fetchone()
    return conn.execute(
        "SELECT * FROM states WHERE channel_id = ? AND cursor <= ? ORDER BY cursor DESC, version DESC LIMIT 1",
        (channel_id, cursor),
    ).fetchone()


def state_of(conn: Conn, row: Optional[Row]) -> StateAnswer:
    if row is None:
        return StateAnswer(cursor=None, state=None)
    return StateAnswer(cursor=row["cursor"], state=state_value(conn, row), version=row["version"])


def latest_state(conn: Conn, channel_id: str) -> StateAnswer:
    return state_of(conn, state_row_at(conn, channel_id, None))


# --- state storage: whole, a delta, or another row's ---------------------------------
# An agent's state mostly grows a little each step (a conversation), so storing each version
# whole costs the square of the run's length. A version is stored as one of:
#   whole   `state` holds its packed JSON (every row written before deltas existed is one);
#   delta   `state` holds the packed JSON of a delta against version `delta_base` of the same
#           channel (the channel's latest when it was saved); `chain_start` is where its chain's
#           whole (or shared) state is;
#   shared  `ref_channel`/`ref_version` name the row whose state this is (a fork's first snapshot:
#           a fork copies nothing).
# A chain ends (the next version is stored whole) once its deltas' bytes pass DELTA_CHAIN_RATIO
# times its start's: reading a version costs at most about that many times its start, and the
# whole versions of a growing state add up geometrically, not quadratically. Small states are
# always whole (a delta would not pay). Every read answers exactly the JSON that was saved.

DELTA_MIN_BYTES = 4096                 # states smaller than this are stored whole
DELTA_CHAIN_RATIO = 2                  # a chain's deltas may add up to this many times its start


@dataclass(frozen=True)
class StoredState:
    """How one states row stores its state (see above)."""

    data: Union[str, bytes, None]         # packed JSON of the whole state or of the delta; None when shared
    delta_base: Optional[int] = None
    chain_start: Optional[int] = None
    ref_channel: Optional[str] = None
    ref_version: Optional[int] = None
    chain_bytes: int = 0                  # delta bytes since the chain's start, this row's included
    base_bytes: int = 0                   # the size of the chain's start

    @property
    def columns(self) -> tuple:
        return (self.data, self.delta_base, self.chain_start, self.ref_channel, self.ref_version, self.chain_bytes,
                self.base_bytes)


def state_cache(conn: Conn) -> StateCache:
    """The connection's engine's cache of rebuilt states (one per app, never shared); a connection of
    no engine's (the command line's, an upgrade's) gets an empty one that keeps nothing."""
    return getattr(conn, "states", None) or StateCache(0)


def state_key(row: Row) -> tuple:
    return row["channel_id"], row["version"], row["sha256"]


def state_delta(old: Json, new: Json) -> Optional[dict]:
    """A delta that turns `old` into `new` (apply_delta), or None when only the whole will do.

    {"=": v}: the value is v. {"+": [...]}: the list goes on with these items (after its first "n"
    items, when "n" is given). {"k": {key: delta}, "x": [removed keys], "o": [every key, in
    order]}: a JSON object's changes ("o" only when the order is not the one the changes leave).
    Values are compared by their JSON text, so 1 and 1.0, or 1 and true, are different values (and
    read back as they were saved)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return dict_delta(old, new)
    return None


def dict_delta(old: dict, new: dict) -> dict:
    changes = {}
    for key, value in new.items():
        if key not in old:
            changes[key] = {"=": value}
            continue
        change = value_delta(old[key], value)
        if change is not None:
            changes[key] = change
    delta: dict = {}
    if changes:
        delta["k"] = changes
    removed = [key for key in old if key not in new]
    if removed:
        delta["x"] = removed
    left_order = [key for key in old if key in new] + [key for key in new if key not in old]
    if left_order != list(new):
        delta["o"] = list(new)
    return delta


def value_delta(old: Json, new: Json) -> Optional[dict]:
    """None when `new` is `old` exactly; else the delta from one to the other."""
    if old is new:
        return None
    old_text, new_text = msgspec.json.encode(old), msgspec.json.encode(new)
    if old_text == new_text:
        return None
    if isinstance(old, dict) and isinstance(new, dict):
        return dict_delta(old, new)
    if isinstance(old, list) and isinstance(new, list):
        kept = kept_items(old, new, old_text, new_text)
        if kept * 2 >= len(old) and kept > 0:
            return {"+": new[kept:]} if kept == len(old) else {"n": kept, "+": new[kept:]}
    return {"=": new}


def kept_items(old: list, new: list, old_text: bytes, new_text: bytes) -> int:
    """How many leading items the two lists share, to the byte."""
    if len(new) > len(old) and new_text.startswith(old_text[:-1]) and new_text[len(old_text) - 1:len(old_text)] == b",":
        # The new list's text begins with the old one's items and a comma: its first len(old) items
        # are the old ones (JSON values delimit themselves). An append, the usual step.
        return len(old)
    kept = 0
    for before, after in zip(old, new):
        if msgspec.json.encode(before) != msgspec.json.encode(after):
            break
        kept += 1
    return kept


def apply_delta(old: Json, delta: dict) -> Json:
    """`old` changed by `delta` (state_delta's form); `old` itself is left as it is."""
    if "=" in delta:
        return delta["="]
    if "+" in delta:
        return (old[:delta["n"]] if "n" in delta else old) + delta["+"]
    removed = set(delta.get("x", ()))
    out = {key: value for key, value in old.items() if key not in removed}
    for key, change in delta.get("k", {}).items():
        out[key] = apply_delta(out.get(key), change)
    if "o" in delta:
        out = {key: out[key] for key in delta["o"]}
    return out


def stored_size(data: Union[str, bytes, None]) -> int:
    return 0 if data is None else len(data)


def whole_state(conn: Conn, value: Json, text: Optional[str] = None) -> StoredState:
    return StoredState(conn.dialect.pack_state(dump(value) if text is None else text))


def whole_copy(conn: Conn, row: Row) -> StoredState:
    """`row`'s state stored whole (a promotion's copy outlives the fork it came from)."""
    if row["delta_base"] is None and row["ref_channel"] is None:
        return StoredState(row["state"])          # already whole: the stored bytes as they are
    return whole_state(conn, state_value(conn, row, remember=False))


def encode_state(conn: Conn, channel_id: str, value: Json, text: Optional[str]) -> StoredState:
    """How to store `value` (whose JSON is `text`; None for a null state) as the channel's next version."""
    if text is None or len(text) < DELTA_MIN_BYTES:
        return whole_state(conn, value, text)
    latest = state_row_at(conn, channel_id, None)
    if latest is None:
        return whole_state(conn, value, text)
    delta = state_delta(state_value(conn, latest, remember=False), value)
    if delta is None:
        return whole_state(conn, value, text)
    packed = conn.dialect.pack_state(dump(delta))
    chained = latest["delta_base"] is not None or latest["ref_channel"] is not None
    base_bytes = latest["base_bytes"] if chained else stored_size(latest["state"])
    chain_bytes = (latest["chain_bytes"] if chained else 0) + stored_size(packed)
    if chain_bytes > DELTA_CHAIN_RATIO * max(base_bytes, DELTA_MIN_BYTES // 4):
        return whole_state(conn, value, text)
    start = latest["version"] if latest["delta_base"] is None else latest["chain_start"]
    return StoredState(packed, delta_base=latest["version"], chain_start=start, chain_bytes=chain_bytes,
                       base_bytes=base_bytes)


def shared_state(row: Row) -> StoredState:
    """The same state as `row`, stored as a reference to the row that holds it (never a chain of them)."""
    if row["ref_channel"] is not None:
        target = (row["ref_channel"], row["ref_version"])
    else:
        target = (row["channel_id"], row["version"])
    chained = row["delta_base"] is not None or row["ref_channel"] is not None
    return StoredState(None, ref_channel=target[0], ref_version=target[1],
                       chain_bytes=row["chain_bytes"] if chained else 0,
                       base_bytes=row["base_bytes"] if chained else stored_size(row["state"]))


def state_value(conn: Conn, row: Row, *, remember: bool = True) -> Json:
    """The state a states row holds, whatever its stored form. `remember`: keep a rebuilt one in
    the connection's StateCache (only for committed rows: a write transaction passes False)."""
    if row["delta_base"] is None and row["ref_channel"] is None:
        return load_state(row["state"])
    key = state_key(row)
    hit = state_cache(conn).get(key)
    if hit is not MISSING:
        return hit
    if row["ref_channel"] is not None:
        value = state_value(conn, require_state_version(conn, row["ref_channel"], row["ref_version"]),
                            remember=remember)
    else:
        value = rebuilt_state(conn, row, remember)
    if remember:
        state_cache(conn).put(key, value, row["base_bytes"] * 4 + row["chain_bytes"])
    return value


def rebuilt_state(conn: Conn, row: Row, remember: bool) -> Json:
    """A delta row's state: its chain's start, then each delta up to it (from the latest one cached)."""
    chain = state_rows_between(conn, row["channel_id"], row["chain_start"], row["version"])
    start = 0
    for index in range(len(chain) - 1, 0, -1):
        hit = state_cache(conn).get(state_key(chain[index]))
        if hit is not MISSING:
            value, start = hit, index
            break
    else:
        value = state_value(conn, chain[0], remember=remember)
    for link in chain[start + 1:]:
        value = apply_delta(value, load_state(link["state"]))
    return value


def state_rows_between(conn: Conn, channel_id: str, first: int, last: int) -> list:
    return conn.execute("SELECT * FROM states WHERE channel_id = ? AND version BETWEEN ? AND ? ORDER BY version",
                        (channel_id, first, last)).fetchall()


def require_state_version(conn: Conn, channel_id: str, version: int) -> Row:
    return present(state_version_row(conn, channel_id, version),
                   lambda: NotFound(f"state version {version} of {channel_id} is gone"))


def remember_saved(tx: Tx, channel_id: str, version: Union[int, Later], sha: str, value: Json,
                   text: Optional[str]) -> None:
    """A saved large state goes into the StateCache once committed: the next save diffs against it."""
    if text is not None and len(text) >= DELTA_MIN_BYTES:
        tx.after_commit.append(lambda: state_cache(tx.conn).put((channel_id, settled(version), sha), value, len(text)))


def make_whole(tx: Tx, row: Row) -> None:
    """Store a delta or shared row's state whole (before what it depends on is deleted)."""
    value = state_value(tx.conn, row, remember=False)
    tx.conn.execute("UPDATE states SET state = ?, delta_base = NULL, chain_start = NULL, ref_channel = NULL,"
                    " ref_version = NULL, chain_bytes = 0, base_bytes = 0 WHERE channel_id = ? AND version = ?",
                    (tx.conn.dialect.pack_state(dump(value)), row["channel_id"], row["version"]))


def free_dependents(tx: Tx, channel_id: str, version: int) -> None:
    """Before a version is deleted: the delta stored on it, and every fork snapshot shared from it,
    are stored whole; the later deltas of that chain start from the one made whole."""
    for row in tx.conn.execute("SELECT * FROM states WHERE ref_channel = ? AND ref_version = ?",
                               (channel_id, version)).fetchall():
        make_whole(tx, row)
    after = tx.conn.execute("SELECT * FROM states WHERE channel_id = ? AND delta_base = ?",
                            (channel_id, version)).fetchone()
    if after is not None:
        make_whole(tx, after)
        tx.conn.execute("UPDATE states SET chain_start = ? WHERE channel_id = ? AND chain_start = ? AND version > ?",
                        (after["version"], channel_id, after["chain_start"], after["version"]))


def check_guards(conn: Conn, channel_id: str, expected_version: Optional[int],
                 expected_cursor: Optional[int]) -> None:
    """Optimistic concurrency against the channel's latest snapshot (0 = no snapshot yet)."""
    if expected_version is None and expected_cursor is None:
        return
    latest = state_row_at(conn, channel_id, None)
    version, cursor = (latest["version"], latest["cursor"]) if latest else (0, 0)
    if expected_version is not None and expected_version != version:
        raise Conflict("version_conflict", f"expected state version {expected_version}, latest is {version}")
    if expected_cursor is not None and expected_cursor != cursor:
        raise Conflict("version_conflict", f"expected state cursor {expected_cursor}, latest is {cursor}")


def insert_state(tx: Tx, channel_id: str, cursor: int, stored: StoredState, sha: str,
                 status: Optional[str], operation_id: Optional[str] = None, *,
                 new_operation: bool = False, settle_later: bool = False) -> Union[int, Later, None]:
    """A new state version, stored as `stored` says; raises Conflict(channel_closed) on a closed run.
    With `new_operation`, None when `operation_id` is used already (nothing is written). With
    `settle_later`, a caller that reads nothing of the version may get a Later (see Tx.later)."""
    checked = new_operation and operation_id is not None
    args = (channel_id, cursor, sha, status, operation_id, tx.ts, *stored.columns, channel_id)
    if checked:
        args += (channel_id, operation_id)
    if settle_later and tx.may_settle_later(channel_id):
        facts = state_facts_args(tx, channel_id, status)
        sql = next_state_sql(tx.conn.dialect, checked, strict=True, facts=facts is not None)
        later = Later(tx.conn.execute(sql, (facts or ()) + args), lambda row: row[0])
        tx.later.append(later)
        return later
    sql = next_state_sql(tx.conn.dialect, checked)
    used = (lambda: state_by_operation(tx.conn, channel_id, operation_id) is not None) if checked else None
    bumped = bump_channel(tx, channel_id, lambda: tx.conn.execute(sql, args).fetchone(), used)
    if bumped is None:
        return None
    note_state_facts(tx, channel_id, status)
    return bumped[0]


def state_by_operation(conn: Conn, channel_id: str, operation_id: str) -> Optional[Row]:
    return conn.execute("SELECT version, cursor, sha256 FROM states WHERE channel_id = ? AND operation_id = ?",
                        (channel_id, operation_id)).fetchone()


def replayed_state(row: Row, cursor: int, sha: str, operation_id: str) -> int:
    require_same_request(f"{row['cursor']}:{row['sha256']}", f"{cursor}:{sha}", operation_id, "state")
    return row["version"]


def save_state(tx: Tx, channel_id: str, req: SaveState) -> Union[int, Later]:
    """POST /state/{channel}: a new immutable version; an operation id replays its version."""
    sha = sha256_hex(canonical_json(req.state))
    guarded = req.expected_version is not None or req.expected_cursor is not None
    if req.operation_id is not None and guarded:      # a replay answers before the guards are checked
        row = state_by_operation(tx.conn, channel_id, req.operation_id)
        if row is not None:
            return replayed_state(row, req.cursor, sha, req.operation_id)
    check_guards(tx.conn, channel_id, req.expected_version, req.expected_cursor)
    text = dump(req.state)
    stored = encode_state(tx.conn, channel_id, req.state, text)
    version = insert_state(tx, channel_id, req.cursor, stored, sha, state_status(req.state), req.operation_id,
                           new_operation=True, settle_later=True)
    if version is None:
        return replayed_state(state_by_operation(tx.conn, channel_id, req.operation_id), req.cursor, sha,
                              req.operation_id)
    remember_saved(tx, channel_id, version, sha, req.state, text)
    return version


def transition(tx: Tx, req: Transition) -> TransitionAnswer:
    """POST /events/transition: one event and the snapshot at its cursor, atomically."""
    channel_id = req.channel_id
    hashed = request_hash({"type": req.type, "payload": req.payload, "state": req.state})
    if req.operation_id is not None:
        existing = event_by_operation(tx.conn, channel_id, req.operation_id)
        if existing is not None:
            event = replay_or_conflict(existing, hashed, "transition")
            version = tx.conn.execute("SELECT version FROM states WHERE channel_id = ? AND cursor = ?"
                                      " ORDER BY version LIMIT 1", (channel_id, event.cursor)).fetchone()
            return TransitionAnswer(event=event, state_version=version["version"] if version else 0)
    check_guards(tx.conn, channel_id, req.expected_version, req.expected_cursor)
    meta = req.meta()
    event = append_event(tx, channel_id, req.type, req.payload, actor=req.actor(), metadata=meta.metadata,
                         agent_id=meta.agent_id, user_id=meta.user_id, operation_id=req.operation_id, hashed=hashed)
    text, sha = dump(req.state), sha256_hex(canonical_json(req.state))
    stored = encode_state(tx.conn, channel_id, req.state, text)
    version = insert_state(tx, channel_id, event.cursor, stored, sha, state_status(req.state))
    remember_saved(tx, channel_id, version, sha, req.state, text)
    return TransitionAnswer(event=event, state_version=version)


def list_states(conn: Conn, channel_id: str, limit: int, offset: int) -> list[StateVersion]:
    rows = conn.execute(
        "SELECT version, cursor, created_at FROM states WHERE channel_id = ? ORDER BY version DESC LIMIT ? OFFSET ?",
        (channel_id, limit, offset),
    ).fetchall()
    return [StateVersion(version=r["version"], cursor=r["cursor"], timestamp=r["created_at"]) for r in rows]


def get_state_version(conn: Conn, channel_id: str, version: int) -> StateAnswer:
    return state_of(conn, state_version_row(conn, channel_id, version))


def delete_state_version(tx: Tx, channel_id: str, version: int) -> DeletedCount:
    if state_version_row(tx.conn, channel_id, version) is not None:
        free_dependents(tx, channel_id, version)
    deleted = tx.conn.execute("DELETE FROM states WHERE channel_id = ? AND version = ? RETURNING version",
                              (channel_id, version)).fetchall()
    if deleted:
        refresh_run_facts(tx.conn, channel_id)      # the latest snapshot may be another one now
        tx.conn.execute(f"UPDATE channels SET state_version = {tx.conn.dialect.greatest}(state_version, ?)"
                        " WHERE id = ?", (version, channel_id))   # never given to another state
    return DeletedCount(deleted=len(deleted))


# --- channel metadata -----------------------------------------------------------


def experiment_of(row: Row) -> dict:
    """The SDK's experiment_metadata of a channel, {} when it has none."""
    meta = load_stored(row["experiment_metadata"])
    return meta if isinstance(meta, dict) else {}


def metadata_of(row: Row) -> ChannelMetadata:
    return ChannelMetadata(
        channel_id=row["id"], parent_channel_id=row["parent_id"], origin_run_id=row["origin_id"],
        forked_at_cursor=row["resolved_cursor"], forked_at=row["forked_at"] or row["created_at"],
        display_name=row["display_name"], reason=row["reason"], experiment_metadata=load_stored(row["experiment_metadata"]),
        requested_at_cursor=row["requested_cursor"], resolved_cursor=row["resolved_cursor"],
        resolved_state_cursor=row["resolved_cursor"], resolved_event_id=row["resolved_event_id"],
        source_state_version=row["source_state_version"], source_state_sha256=row["source_state_sha256"],
        restorable=bool(row["restorable"]), manifest=load(row["manifest"]), reproducibility=row["reproducibility"],
        tool_policies=load(row["tool_policies"]), outcome=row["outcome"], result_score=row["result_score"])


def get_metadata(conn: Conn, channel_id: str) -> ChannelMetadata:
    return metadata_of(require_channel(conn, channel_id))


def put_metadata(tx: Tx, channel_id: str, changes: PutMetadata) -> ChannelMetadata:
    """PUT /channels/{id}/metadata: upsert; only the keys present change."""
    ensure_channel(tx, channel_id)
    given = {column: dump(value) if column == "experiment_metadata" else value
             for column, value in (("display_name", changes.display_name), ("reason", changes.reason),
                                   ("experiment_metadata", changes.experiment_metadata)) if value is not UNSET}
    if "display_name" in given and parents_name_over_own(tx.conn, channel_id, given["display_name"]):
        del given["display_name"]
    if given:
        # One UPDATE (each one names run_state's column, experiment_metadata: an index rewrite each).
        sets = ", ".join(f"{column} = ?" for column in given)
        tx.conn.execute(f"UPDATE channels SET {sets}, updated_at = ? WHERE id = ?", (*given.values(), tx.ts, channel_id))
    return metadata_of(channel_by_id(tx.conn, channel_id))


def parents_name_over_own(conn: Conn, channel_id: str, name: Optional[str]) -> bool:
    """Whether `name` is a fork's parent's name about to replace the fork's own. AgentSession.resume(...,
    fork_at_step=k, name=X) makes the fork X under its own name, then hands the session it returns the
    parent's display name, which the session writes back on entering and leaving: the fork keeps its
    own (a name other than the parent's is written as asked)."""
    row = channel_by_id(conn, channel_id)
    if row is None or row["parent_id"] is None or not row["display_name"] or name is None:
        return False
    parent = channel_by_id(conn, row["parent_id"])
    return parent is not None and name in (parent["display_name"], parent["id"]) and row["display_name"] != name


def list_channels(conn: Conn) -> list:
    return [r["id"] for r in conn.execute(f"SELECT c.id FROM channels c ORDER BY {by_activity('c.', True)}").fetchall()]


# --- step index (derived from events, walked across lineage) ---------------------


def lineage(conn: Conn, channel_id: str) -> list:
    """[(channel row, cursor where the line below left it)], from the channel up to its root."""
    row = require_channel(conn, channel_id)
    chain, leave_at = [], None
    for _ in range(LINEAGE_MAX_DEPTH + 1):
        chain.append((row, leave_at))
        if row["parent_id"] is None:
            break
        leave_at = row["resolved_cursor"]
        row = channel_by_id(conn, row["parent_id"])
        if row is None:
            break
    return chain


def own_step(conn: Conn, channel_id: str, step_number: int) -> Optional[Row]:
    # The first event carrying a step number wins if a step number repeats.
    return conn.execute(
        "SELECT cursor, id FROM events WHERE channel_id = ? AND step_number = ? ORDER BY cursor LIMIT 1",
        (channel_id, step_number),
    ).fetchone()


def resolve_step(conn: Conn, channel_id: str, step_number: int) -> StepLocation:
    """Step n -> (owner channel, cursor). Inherited steps resolve on the ancestor that recorded them."""
    for row, _ in lineage(conn, channel_id):
        inherited = (row["parent_id"] is not None and row["forked_at_step"] is not None
                     and step_number <= row["forked_at_step"])
        if not inherited:
            hit = own_step(conn, row["id"], step_number)
            if hit is not None:
                return StepLocation(channel_id=row["id"], cursor=hit["cursor"], event_id=hit["id"],
                                    step_number=step_number)
            break
    raise NotFound(f"step {step_number} of {channel_id} is not indexed")


def last_step_number(conn: Conn, channel_id: str) -> int:
    """Highest step on this channel, counting the steps a fork inherited (resume continues at k+1)."""
    row = require_channel(conn, channel_id)
    own = conn.execute("SELECT MAX(step_number) FROM events WHERE channel_id = ? AND step_number IS NOT NULL",
                       (channel_id,)).fetchone()[0]
    return max(own or 0, row["forked_at_step"] or 0)


BLAME_PATHS_MAX = 5000                 # paths a blame answer lists (its total counts them all)


def state_leaves(value: Json, path: tuple = ()) -> dict:
    """Path -> value of every leaf (a scalar, or an empty object or list), keys and indexes as the diff
    names them."""
    if isinstance(value, dict) and value:
        return {leaf: found for key, item in value.items() for leaf, found in state_leaves(item, (*path, str(key))).items()}
    if isinstance(value, list) and value:
        return {leaf: found for i, item in enumerate(value) for leaf, found in state_leaves(item, (*path, str(i))).items()}
    return {path: value}


def state_history(conn: Conn, channel_id: str) -> list:
    """(channel row, version, cursor) of every snapshot a run's state went through, in order: each
    ancestor's up to where the line below it left, then the run's own."""
    history = []
    for row, upto in reversed(lineage(conn, channel_id)):
        history += [(row, r["version"], r["cursor"]) for r in conn.execute(
            "SELECT version, cursor FROM states WHERE channel_id = ? AND cursor <= ? ORDER BY cursor, version",
            (row["id"], INT64_MAX if upto is None else upto))]
    return history


def same_value(left: Json, right: Json) -> bool:
    return type(left) is type(right) and left == right


def state_blame(conn: Conn, channel_id: str, reach: "Reach", at_step: Optional[int] = None,
                upto: Optional[int] = None, wanted: Optional[Callable[[tuple, Json], bool]] = None) -> Blame:
    """Like `git blame` for a run's state: each path of its state (after step `at_step`, or as of its
    own cursor `upto`; default the latest) with the step whose snapshot set its current value, from the
    stored snapshots alone (nothing re-runs). Walked back from the end, each path until an earlier
    snapshot held another value (or none): a value set, changed and set back is blamed on the step
    that set it back; a step that wrote a value without changing it is not blamed. `wanted`: only the
    paths it keeps (the failure banner's). A run `reach` may not read is one that does not exist; what
    it inherited is its own history."""
    if not reach.sees(channel_id):
        raise NotFound(f"channel {channel_id} not found")
    require_channel(conn, channel_id)
    history, steps = state_history(conn, channel_id), {}

    def step_of(i: int) -> Optional[int]:
        if i not in steps:
            row, _, cursor = history[i]
            steps[i] = step_at(conn, row, cursor)
        return steps[i]

    def leaves_of(i: int) -> dict:
        row, version, _ = history[i]
        return state_leaves(state_value(conn, require_state_version(conn, row["id"], version)))

    end = len(history)
    while end and ((upto is not None and history[end - 1][0]["id"] == channel_id and history[end - 1][2] > upto)
                   or (at_step is not None and (step_of(end - 1) or 0) > at_step)):
        end -= 1
    if not end:
        return Blame(channel_id=channel_id, at_step=None, version=None, cursor=None, paths=[], total=0)
    current = {path: value for path, value in leaves_of(end - 1).items() if wanted is None or wanted(path, value)}
    setter, open_paths, i = dict.fromkeys(current, end - 1), set(current), end - 2
    while open_paths and i >= 0:
        earlier = leaves_of(i)
        for path in list(open_paths):
            if path in earlier and same_value(earlier[path], current[path]):
                setter[path] = i
            else:
                open_paths.discard(path)
        i -= 1
    lines = [BlameLine(path=list(path), value=value, step=step_of(setter[path]), cursor=history[setter[path]][2],
                       channel_id=history[setter[path]][0]["id"]) for path, value in current.items()]
    return Blame(channel_id=channel_id, at_step=step_of(end - 1), version=history[end - 1][1],
                 cursor=history[end - 1][2], paths=lines[:BLAME_PATHS_MAX], total=len(lines))


def step_list(conn: Conn, channel_id: str) -> list:
    """Every step visible on a channel, inherited ones resolved to their owners (for the dashboard)."""
    steps, upper = [], None          # each ancestor owns the steps between its fork point and `upper`
    for row, _ in lineage(conn, channel_id):
        lower = (row["forked_at_step"] or 0) if row["parent_id"] else 0
        where = Where().add("channel_id = ?", row["id"]).add("step_number > ?", lower).add_if(upper, "step_number <= ?")
        owned = conn.execute(f"SELECT step_number, MIN(cursor) AS cursor FROM events{where} GROUP BY step_number",
                             where.args)
        steps += [{"channel_id": row["id"], "cursor": r["cursor"], "step_number": r["step_number"]} for r in owned]
        if lower == 0:
            break
        upper = lower
    return sorted(steps, key=lambda step: step["step_number"])


def close_channel(tx: Tx, channel_id: str, actor: str) -> Closed:
    """POST /channels/{id}/close: a last `channel.closed` event, then no more events or states.

    Closing a closed run answers the first close again.
    """
    row = require_channel(tx.conn, channel_id)
    if row["closed_at"] is not None:
        return Closed(channel_id=channel_id, closed_at=row["closed_at"], replayed=True)
    event = append_event(tx, channel_id, "channel.closed", {"closed_by": actor}, actor=actor)
    tx.conn.execute("UPDATE channels SET closed_at = ?, updated_at = ? WHERE id = ?", (tx.ts, tx.ts, channel_id))
    return Closed(channel_id=channel_id, closed_at=tx.ts, replayed=False, event=event)


def delete_channel(tx: Tx, channel_id: str, recursive: bool, reach: "Reach") -> DeletedChannels:
    """Delete a run: its events, states, ledger rows and experiment memberships; its pending
    wake-ups are cancelled. Forks of it go too with recursive=true, else it is refused, and so is
    a run that a consumer group or an execution group still works on (delete those first). Every
    fork deleted with it must be one `reach` may delete; a refusal names only the forks it reads.
    """
    require_channel(tx.conn, channel_id)
    users = [f"consumer group {r[0]}" for r in tx.conn.execute(
        "SELECT id FROM consumer_groups WHERE channel_id = ?", (channel_id,))]
    users += [f"execution group {r[0]} (member {r[1]})" for r in tx.conn.execute(
        "SELECT group_id, member_id FROM execution_group_members WHERE channel_id = ?", (channel_id,))]
    if users:
        raise Conflict("channel_conflict", f"channel {channel_id} is in use by {', '.join(users)}")
    children = child_ids(tx.conn, channel_id)
    if children and not recursive:
        raise Conflict("channel_conflict", f"channel {channel_id} has forks ({named_runs(children, reach)}); "
                                           "delete with recursive=true")
    barred = [run for run in descendants(tx.conn, channel_id) if not reach.removes(run)] if children else []
    if barred:
        raise Forbidden(f"channel {channel_id} has forks this credential may not delete ({named_runs(barred, reach)})")
    deleted = []
    for child in children:                 # every fork below was checked against `reach` just above
        deleted += delete_channel(tx, child, True, EVERYWHERE).deleted
    for table in ("events", "states", "executions", "step_usage"):
        tx.conn.execute(f"DELETE FROM {table} WHERE channel_id = ?", (channel_id,))
    for delete in tx.hooks.deleters:
        delete(tx, channel_id)
    tx.conn.execute("UPDATE wakeups SET status = 'cancelled', error = 'channel deleted'"
                    " WHERE channel_id = ? AND status = 'pending'", (channel_id,))
    tx.conn.execute("DELETE FROM channels WHERE id = ?", (channel_id,))
    tx.after_commit.append(lambda: state_cache(tx.conn).forget_channel(channel_id))
    return DeletedChannels(deleted=deleted + [channel_id])


def named_runs(runs: list, reach: "Reach") -> str:
    """Runs as an error names them: those `reach` reads by id, the others only counted."""
    seen = reach.seen(runs)
    hidden = len(runs) - len(seen)
    return ", ".join(seen + ([f"{hidden} it may not read"] if hidden else []))


# =============================================================================
# Runs: the failure rule, runs by activity, what the runs pages show
# =============================================================================

RUNS_PAGE_SIZE = 50
TIMELINE_PAGE_SIZE = 200


STEP_CHANGES_SHOWN = 20                # changed keys listed per step (the count says how many in all)


PICTURE_BARS_MAX = 240                 # steps are bucketed beyond this, so a 10,000-step run stays small


# What a listed run's row carries: the channel (with run_state) and a few lookups by its own key.
RUN_COLUMNS = (f"c.*, {LAST_CURSOR}, {activity_sql('c.')} AS active_time,"   # run_state among them
               " (SELECT MAX(e.step_number) FROM events e WHERE e.channel_id = c.id AND e.step_number IS NOT NULL)"
               " AS last_step,"
               " (SELECT COUNT(*) FROM channels k WHERE k.parent_id = c.id) AS forks,"
               f" (SELECT e.created_at FROM events e WHERE e.channel_id = c.id AND e.cursor = {FIRST_OWN_EVENT.format(c='c.')})"
               " AS first_event_at,"
               f" {last_event_value('created_at', 'c.')} AS last_event_at")


def shown_status(run_state: Optional[str]) -> str:
    """The status a page shows: every failure reads "failed" (the failure's kind says crashed or not)."""
    return "failed" if run_state in FAILURE_STATES else str(run_state)


def listed_states(status: str) -> tuple:
    """The run_state values a list's status filter takes ("failed": crashes too); (None,) for no filter."""
    if not status:
        return (None,)
    return FAILURE_STATES if status == "failed" else (status,)


# --- failures: why a run went wrong, and the step a fork should keep -------------------


@dataclass(frozen=True)
class Failure:
    """Why a run shows as failed or blocked; `cursor` is the event that shows it (None: after the last one)."""

    kind: str                        # crashed | failed | blocked
    message: str
    last_good_step: Optional[int]    # the fork form's preset; None when not even step 1 completed
    cursor: Optional[int] = None

    def as_json(self) -> dict:
        return {"kind": self.kind, "message": self.message, "last_good_step": self.last_good_step,
                "cursor": self.cursor}


def failure_message(document: Json) -> Optional[str]:
    """The human message a failed document carries, under the names agents use for it."""
    if not isinstance(document, dict):
        return None
    for name in ("error", "crash_reason", "message", "reason", "exception"):
        value = document.get(name)
        if isinstance(value, dict):
            value = value.get("message") or value.get("error")
        if isinstance(value, str) and value.strip():
            return value.strip()[:2000]
    return None


def step_at(conn: Conn, row: Row, cursor: int) -> Optional[int]:
    """The last step completed at or before `cursor` (a fork's inherited steps count)."""
    hit = last_step_at(conn, row["id"], cursor)
    if hit is not None:
        return hit
    return (row["forked_at_step"] or None) if row["parent_id"] else None


def crash_failure(conn: Conn, row: Row) -> Failure:
    # AgentSession records a crash only in its metadata (status, crash_reason) and the outcome:
    # no event, so the steps it completed are all the steps there are.
    reason = experiment_of(row).get("crash_reason")
    message = str(reason)[:2000] if reason else "the run's process raised; the session recorded a crash"
    return Failure("crashed", message, last_step_number(conn, row["id"]) or None)


def error_event_failure(conn: Conn, row: Row) -> Optional[Failure]:
    if row["error_cursor"] is None:           # the write path notes the run's first error event
        return None
    event = event_at(conn, row["id"], row["error_cursor"])
    if event is None:
        return None
    message = failure_message(load(event["payload"])) or f"the run recorded {event['type']}"
    return Failure("failed", message, step_at(conn, row, event["cursor"] - 1), event["cursor"])


def failed_state_failure(conn: Conn, row: Row) -> Optional[Failure]:
    """The first snapshot after the last one whose status is not failed/error."""
    good = conn.execute(
        "SELECT version, cursor FROM states WHERE channel_id = ? AND COALESCE(status, '')"
        f" NOT IN ({sql_list(FAILED_STATE_STATUSES)}) ORDER BY version DESC LIMIT 1", (row["id"],)).fetchone()
    bad = conn.execute("SELECT * FROM states WHERE channel_id = ? AND version > ? ORDER BY version LIMIT 1",
                       (row["id"], good["version"] if good else 0)).fetchone()
    if bad is None:
        return None
    state = state_value(conn, bad)
    status = state.get("status") if isinstance(state, dict) else None
    at_step = step_at(conn, row, bad["cursor"])
    message = failure_message(state) or f'the state saved at step {at_step} has status "{status}"'
    last_good = step_at(conn, row, good["cursor"]) if good else None
    return Failure("failed", message, last_good, bad["cursor"])


def blocked_failure(conn: Conn, row: Row) -> Failure:
    event = event_at(conn, row["id"], row["last_cursor"])
    payload = load(event["payload"])
    payload = payload if isinstance(payload, dict) else {}
    if event["type"] == "tool.blocked":
        message = (f"fork tool policy '{payload.get('policy')}' refused {payload.get('tool_name')} "
                   f"(key {payload.get('key_name')}): {payload.get('reason')}")
    else:
        summary = payload.get("summary") or failure_message(payload) or ""
        message = f"{event['type'].replace('.', ' ')}{': ' + str(summary) if summary else ''}"
    return Failure("blocked", message, step_at(conn, row, event["cursor"] - 1), event["cursor"])


def run_failure(conn: Conn, row: Row, run_state: str) -> Optional[Failure]:
    """What went wrong with a run whose status (run_state_sql) is crashed, failed or blocked; else None."""
    if run_state == "crashed":
        return crash_failure(conn, row)
    if run_state == "blocked":
        return blocked_failure(conn, row)
    if run_state != "failed":
        return None
    found = error_event_failure(conn, row) or failed_state_failure(conn, row)
    if found is not None:
        return found
    meta = experiment_of(row)
    return Failure("failed", failure_message(meta) or f"the session's status is {meta.get('status')}",
                   last_step_number(conn, row["id"]) or None)


# --- a failure already handled: a fork of it that completed -------------------------------


def handling_fork(conn: Conn, channel_id: str, reach: "Reach") -> Optional[Row]:
    """The first fork below a run (forks of forks too) that completed, among those `reach` sees: a
    failed run with one is handled (its page and the runs list say so; bulk fork leaves it)."""
    where = Where().add("c.run_state = 'completed'").within(reach, "c.id")
    return conn.execute(
        "WITH RECURSIVE below(id, depth) AS (SELECT id, 1 FROM channels WHERE parent_id = ?"
        " UNION ALL SELECT k.id, b.depth + 1 FROM channels k JOIN below b ON k.parent_id = b.id WHERE b.depth < ?)"
        f" SELECT c.id, c.display_name FROM channels c JOIN below b ON c.id = b.id{where}"
        " ORDER BY c.created_at, c.id LIMIT 1", (channel_id, LINEAGE_MAX_DEPTH, *where.args)).fetchone()


def handled_by(conn: Conn, row: Row, reach: "Reach") -> Optional[dict]:
    """{channel_id, display_name} of the completed fork that handled a failed run (None: not failed, or not handled)."""
    if row["run_state"] not in FAILURE_STATES or not row["forks"]:
        return None
    found = handling_fork(conn, row["id"], reach)
    return {"channel_id": found["id"], "display_name": found["display_name"] or found["id"]} if found else None


# --- where a failure came from: the values it names, and the steps that set them -----------


CAUSES_SHOWN = 3                      # values a failure banner names (the earliest set first)


@dataclass(frozen=True)
class FailureCause:
    """The state values a failure's message names (by key or by value) and the steps that set them,
    earliest first; the fork a banner offers first keeps none of them: after `fork_after`."""

    paths: list                       # BlameLine, set at or before the last good step
    fork_after: int                   # 0: the earliest was set at step 1 (only a run from the start drops it)
    last_good_step: int

    def as_json(self) -> dict:
        return {"paths": [{"path": ".".join(line.path), "step": line.step, "value": line.value}
                          for line in self.paths], "fork_after": self.fork_after,
                "other_forks": self.other_forks()}

    def other_forks(self) -> list:
        """The other fork points, one click away: before each other value's step, and the last good step."""
        points = {line.step - 1 for line in self.paths} | {self.last_good_step}
        return sorted(point for point in points if point >= 1 and point != self.fork_after)


def named_in(message: str) -> Callable[[tuple, Json], bool]:
    """Whether a state path is one a failure message names: its key as a word of the message (three
    letters or more), or its value as text in it (a string of eight characters or more, or of several
    words; a number of three digits or more). Booleans, nulls, list indexes and single short words
    ("plan", "done") never match: too common in a message to mean the value."""
    text = message.lower()
    words = set(re.findall(r"[a-z0-9_]+", text))

    def named(path: tuple, value: Json) -> bool:
        key = path[-1].lower() if path else ""
        if len(key) >= 3 and not key.isdigit() and key in words:
            return True
        if isinstance(value, str):
            said = value.strip().lower()
            return (len(said) >= 8 or (" " in said and len(said) >= 4)) and said in text
        if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) >= 100:
            return re.search(rf"(?<![0-9.]){re.escape(str(value))}(?![0-9])", text) is not None
        return False
    return named


def failure_cause(conn: Conn, row: Row, failure: Optional[Failure], reach: "Reach") -> Optional[FailureCause]:
    """Where a failure came from, as far as the stored state tells (state_blame over the snapshots up
    to where it showed): the values its message names that steps before it set. None when it names
    none: the banner then offers the last good step, as it always did."""
    if failure is None or not failure.last_good_step:
        return None
    blame = state_blame(conn, row["id"], reach, upto=failure.cursor, wanted=named_in(failure.message))
    causes = sorted((line for line in blame.paths if line.step is not None and line.step <= failure.last_good_step),
                    key=lambda line: (line.step, line.path))
    if not causes:
        return None
    return FailureCause(paths=causes[:CAUSES_SHOWN], fork_after=causes[0].step - 1,
                        last_good_step=failure.last_good_step)


# --- the runs list ----------------------------------------------------------------------


def after_page_token(token: str, time_column: str, id_column: str) -> tuple:
    """Keyset pagination, newest first: (SQL condition, *args) for the rows after a `<time>|<id>` token."""
    stamp, _, last_id = token.partition("|")
    return f"({time_column} < ? OR ({time_column} = ? AND {id_column} < ?))", stamp, stamp, last_id


def after_runs_token(token: str, alias: str) -> tuple:
    """Keyset pagination of runs, most recently active first: (SQL condition, *args) for the rows after
    an `<updated_at>|<id>` token. The activity second bounds the index range; the rest is exact."""
    after, *args = after_page_token(token, activity_sql(alias), f"{alias}id")
    return (f"{alias}active_at <= ? AND {after}", token[:ACTIVE_AT_CHARS], *args)


def by_activity(alias: str = "", descending: bool = False) -> str:
    """ORDER BY for runs by last activity: the indexed second, then the exact time (activity_sql; ties
    within the second, unindexed), then the id. The same order as by the exact time: the second is its
    prefix. With no `alias`, of rows that carry the exact time as active_time (merged pages)."""
    way = " DESC" if descending else ""
    exact = activity_sql(alias) if alias else "active_time"
    return ", ".join(f"{column}{way}" for column in (f"{alias}active_at", exact, f"{alias}id"))


def runs_by_activity_sql(where: "Where", descending: bool = False) -> str:
    """One page of listed runs (RUN_COLUMNS) that `where` selects, by last activity; its last argument the limit."""
    return f"SELECT {RUN_COLUMNS} FROM channels c{where} ORDER BY {by_activity('c.', descending)} LIMIT ?"


def next_page_token(rows: list, time_column: str) -> Optional[str]:
    """The token of the last row shown, when a row beyond the page (fetched as a probe) exists."""
    if len(rows) <= RUNS_PAGE_SIZE:
        return None
    last = rows[RUNS_PAGE_SIZE - 1]
    return f"{last[time_column]}|{last['id']}"


def run_summary(row: Row, last_own_step: Optional[int], fork_count: int) -> dict:
    """One run as the dashboard lists it; steps count like /steps does (inherited ones included)."""
    meta = experiment_of(row)
    return {
        "channel_id": row["id"], "display_name": row["display_name"] or row["id"],
        "status": meta.get("status") or "recorded",
        "step_count": max(last_own_step or 0, (row["forked_at_step"] or 0) if row["parent_id"] else 0),
        "event_count": row["last_cursor"], "last_activity": row["active_time"], "outcome": row["outcome"],
        "fork_count": fork_count, "parent_channel_id": row["parent_id"], "origin_run_id": row["origin_id"],
        "forked_at_step": row["forked_at_step"] if row["parent_id"] else None,
        "closed_at": row["closed_at"],
    }


def listed_run(conn: Conn, row: Row, depth: int = 0) -> dict:
    """A RUN_COLUMNS row as the list shows it: status as the run page says it, failure (and the fork
    that handled it), duration. The runs pages read every run (the dashboard's credential may)."""
    failure = run_failure(conn, row, row["run_state"])
    return {**run_summary(row, row["last_step"], row["forks"]), "status": shown_status(row["run_state"]),
            "sdk_status": experiment_of(row).get("status"),
            "failure": failure.as_json() if failure else None, "depth": depth,
            "handled_by": handled_by(conn, row, EVERYWHERE),
            "duration_ms": millis_between(row["first_event_at"], row["last_event_at"]),
            "damaged": damaged_stamps(row, ("first_event_at", "last_event_at", "active_time"))}


def damaged_stamps(row: Row, columns: tuple) -> list:
    """The columns of a row whose stored time is not an instant (a row edited by hand): shown, not fatal."""
    return [name for name in columns if row[name] and stored_instant(row[name]) is None]


def fork_group(conn: Conn, root_id: str) -> tuple:
    """A root's descendants in tree order (each with its depth), at most GROUP_FORKS_MAX; and how many in all."""
    rows = conn.execute(f"SELECT {RUN_COLUMNS} FROM channels c WHERE c.origin_id = ? AND c.parent_id IS NOT NULL"
                        " ORDER BY c.created_at, c.id LIMIT ?", (root_id, GROUP_FORKS_MAX)).fetchall()
    total = conn.execute("SELECT COUNT(*) FROM channels WHERE origin_id = ? AND parent_id IS NOT NULL",
                         (root_id,)).fetchone()[0]
    children: dict = {}
    for r in rows:
        children.setdefault(r["parent_id"], []).append(r)
    ordered, stack = [], [(r, 1) for r in reversed(children.get(root_id, []))]
    while stack:
        r, depth = stack.pop()
        ordered.append(listed_run(conn, r, depth))
        stack += [(c, depth + 1) for c in reversed(children.get(r["id"], []))]
    return ordered, total


def mark_shared_names(runs: list) -> None:
    """A display name two listed runs share (resumed forks keep the parent's) is not enough to tell them apart."""
    counts: dict = {}
    for run in runs:
        counts[run["display_name"]] = counts.get(run["display_name"], 0) + 1
    for run in runs:
        run["name_shared"] = counts[run["display_name"]] > 1 and run["display_name"] != run["channel_id"]


def runs_page(conn: Conn, q: str, status: str, after: Optional[str]) -> tuple:
    """One page of runs, most recent activity first (keyset pagination on (updated_at, id), see by_activity).

    Unfiltered, the page lists root runs, each with its forks grouped under it; a search or a status
    filter lists every matching run on its own.
    """
    grouped = not q and not status
    pages = []                            # one index range per run_state; "failed" merges two of them
    for state in listed_states(status):
        where = Where()
        if grouped:
            where.add("c.parent_id IS NULL")
        if q:
            like = conn.dialect.like
            where.add(f"(c.id {like} ? OR c.display_name {like} ?)", f"%{q}%", f"%{q}%")
        where.add_if(state, "c.run_state = ?")
        if after:
            where.add(*after_runs_token(after, "c."))
        pages.append((runs_by_activity_sql(where, descending=True), [*where.args, RUNS_PAGE_SIZE + 1]))
    rows = union_of_pages(conn, pages, by_activity("", True), RUNS_PAGE_SIZE + 1)
    runs = [listed_run(conn, r) for r in rows[:RUNS_PAGE_SIZE]]
    everyone = list(runs)
    for run in runs:
        run["group"], run["group_total"] = (fork_group(conn, run["channel_id"]) if grouped and run["fork_count"]
                                            else ([], 0))
        everyone += run["group"]
    mark_shared_names(everyone)
    return runs, next_page_token(rows, "active_time")


def deletion_plan(conn: Conn, channel_id: str, reach: "Reach") -> dict:
    """The run and every fork below it: what deleting it removes (the runs `reach` reads by name, the
    others counted: a deletion that would take one the credential may not delete is refused)."""
    row = require_channel(conn, channel_id)
    doomed = conn.execute(
        "WITH RECURSIVE tree(id) AS (SELECT CAST(? AS TEXT) UNION ALL SELECT k.id FROM channels k JOIN tree t ON k.parent_id = t.id)"
        f" SELECT c.id, c.display_name, {LAST_CURSOR} FROM channels c JOIN tree t ON c.id = t.id ORDER BY c.created_at",
        (channel_id,)).fetchall()
    executions = conn.execute(
        "WITH RECURSIVE tree(id) AS (SELECT CAST(? AS TEXT) UNION ALL SELECT k.id FROM channels k JOIN tree t ON k.parent_id = t.id)"
        " SELECT COUNT(*) FROM executions x JOIN tree t ON x.channel_id = t.id", (channel_id,)).fetchone()[0]
    return {"channel_id": channel_id, "display_name": row["display_name"] or channel_id,
            "runs": [{"channel_id": r["id"], "display_name": r["display_name"] or r["id"],
                      "event_count": r["last_cursor"]} for r in doomed if reach.sees(r["id"])],
            "hidden": sum(1 for r in doomed if not reach.sees(r["id"])),
            "event_count": sum(r["last_cursor"] for r in doomed), "execution_count": executions}


# --- the run page -------------------------------------------------------------------------


def execution_marks(execution: dict) -> list:
    marks = []
    if execution["inherited_from"]:
        marks.append("replayed from parent")
    elif execution["replay_emitted"]:
        marks.append("replayed")
    if execution["attempts"] > 1:
        marks.append(f"reclaimed ×{execution['attempts'] - 1}")
    return marks


def with_marks(execution: Execution) -> dict:
    fields = msgspec.structs.asdict(execution)
    return {**fields, "marks": execution_marks(fields)}


def blocked_attempts(conn: Conn, channel_id: Optional[str], limit: int = 100) -> list:
    where = Where().add("type = 'tool.blocked'").add_if(channel_id, "channel_id = ?")
    rows = conn.execute(f"SELECT * FROM events{where} ORDER BY created_at DESC LIMIT ?", (*where.args, limit))
    return [event_of(r) for r in rows.fetchall()]


def timeline_events(conn: Conn, channel_id: str, start: int, event_type: str) -> tuple:
    """One page of events from cursor `start` (only steps, or one type, when asked); and the next page's start."""
    where = Where().add("channel_id = ?", channel_id).add("cursor >= ?", start)
    if event_type == "steps":
        where.add("step_number IS NOT NULL")
    elif event_type:
        where.add("type = ?", event_type)
    rows = conn.execute(f"SELECT * FROM events{where} ORDER BY cursor LIMIT ?",
                        (*where.args, TIMELINE_PAGE_SIZE + 1)).fetchall()
    more = rows[TIMELINE_PAGE_SIZE]["cursor"] if len(rows) > TIMELINE_PAGE_SIZE else None
    return rows[:TIMELINE_PAGE_SIZE], more


def step_durations(conn: Conn, channel_id: str, first: int, last: int) -> dict:
    """cursor -> milliseconds since the previous step (the first step: since the run's first event)."""
    before = conn.execute("SELECT created_at FROM events WHERE channel_id = ? AND step_number IS NOT NULL"
                          " AND cursor < ? ORDER BY cursor DESC LIMIT 1", (channel_id, first)).fetchone()
    previous = before["created_at"] if before else first_event_at(conn, channel_id)
    durations = {}
    for r in conn.execute("SELECT cursor, created_at FROM events WHERE channel_id = ? AND step_number IS NOT NULL"
                          " AND cursor BETWEEN ? AND ? ORDER BY cursor", (channel_id, first, last)):
        durations[r["cursor"]] = millis_between(previous, r["created_at"]) if r["cursor"] != 1 else None
        previous = r["created_at"]
    return durations


CHANGES_PER_KEY = 5                   # a changed key's inner changes a step row shows


def state_changes(before: Json, after: Json) -> dict:
    """The top-level keys a snapshot changed against the one before it, each with the paths inside it
    that changed and their old and new values: {keys: [{key, kind, paths, changes: [{path, kind, old,
    new}]}], total}."""
    changed: dict = {}
    for entry in diff_values(before if before is not None else {}, after):
        path = entry.path
        key = path[0] if path else "(whole state)"
        hit = changed.setdefault(key, {"key": key, "kind": entry.kind if len(path) <= 1 else "changed",
                                       "paths": [], "changes": [], "more": 0})
        if len(path) > 1 and len(hit["paths"]) < CHANGES_PER_KEY:
            hit["paths"].append(".".join(path[1:]))
        if len(hit["changes"]) < CHANGES_PER_KEY:
            hit["changes"].append({"path": ".".join(path) or key, "kind": entry.kind, "old": entry.left,
                                   "new": entry.right})
        else:
            hit["more"] += 1
    return {"keys": list(changed.values())[:STEP_CHANGES_SHOWN], "total": len(changed)}


def snapshots(conn: Conn, channel_id: str, first: int, last: int) -> dict:
    """cursor -> {state, version, cursor, changes} for the snapshots saved between two cursors.

    Each is compared with the snapshot before it (for the first on the page, the one saved before
    `first`; a fork's first own step compares with the state it inherited).
    """
    previous_row = state_row_at(conn, channel_id, first - 1) if first > 1 else None
    previous = state_value(conn, previous_row) if previous_row else None
    latest: dict = {}
    for r in conn.execute("SELECT * FROM states WHERE channel_id = ? AND cursor BETWEEN ? AND ? ORDER BY cursor, version",
                          (channel_id, first, last)):
        latest[r["cursor"]] = r             # a step saved twice: its last snapshot is the step's
    shown = {}
    for cursor in sorted(latest):
        answer = state_of(conn, latest[cursor])
        shown[cursor] = {**msgspec.structs.asdict(answer), "changes": state_changes(previous, answer.state)}
        state = answer.state
        previous = state
    return shown


def replayed_rows(conn: Conn, channel_id: str) -> list:
    """Effects a fork replayed from an ancestor without a tool.replayed event (the SDK asks for one only
    with emit_replay_event), as timeline rows derived from the ledger."""
    rows = conn.execute("SELECT * FROM executions WHERE channel_id = ? AND inherited_from IS NOT NULL"
                        " AND replay_emitted = 0 ORDER BY created_at", (channel_id,)).fetchall()
    return [{"kind": "replayed", "id": r["id"], "type": "tool.replayed", "timestamp": r["created_at"],
             "tool_name": r["tool_name"], "key_name": r["key_name"], "inherited_from": r["inherited_from"],
             "result": load(r["result"])} for r in rows]


def place_derived(items: list, derived: list, start: int, more: Optional[int]) -> list:
    """Merge derived rows into the page's event rows by time; rows that belong to another page are left out."""
    out, pending = [], list(derived)
    for item in items:
        while pending and pending[0]["timestamp"] < item["event"]["timestamp"]:
            row = pending.pop(0)
            if out or start == 1:
                out.append(row)
        out.append(item)
    return out + (pending if more is None else [])


def timeline(conn: Conn, row: Row, start: int, event_type: str,
             failure: Optional[Failure]) -> tuple:
    """The timeline rows of one page: events with their step's duration, snapshot and changed keys,
    plus rows derived from the ledger (replays) and from the metadata (a crash after the last event)."""
    channel_id = row["id"]
    events, more = timeline_events(conn, channel_id, start, event_type)
    if not events:
        return [], more
    first, last = events[0]["cursor"], events[-1]["cursor"]
    durations = step_durations(conn, channel_id, first, last)
    states = snapshots(conn, channel_id, first, last)
    items = [{"kind": "event", "event": msgspec.structs.asdict(event_of(e)), "step_number": e["step_number"],
              "state": states.get(e["cursor"]), "duration_ms": durations.get(e["cursor"]),
              "failure": failure is not None and failure.cursor == e["cursor"]} for e in events]
    if event_type in ("", "tool.replayed"):
        items = place_derived(items, replayed_rows(conn, channel_id), start, more)
    if failure is not None and failure.cursor is None and more is None and not event_type:
        items.append({"kind": "failure", "failure": failure.as_json(), "timestamp": row["updated_at"]})
    return items, more


def event_types(conn: Conn, channel_id: str) -> list:
    return [{"type": r[0], "count": r[1]} for r in conn.execute(
        "SELECT type, COUNT(*) FROM events WHERE channel_id = ? GROUP BY type ORDER BY type LIMIT 200", (channel_id,))]


def step_picture(conn: Conn, row: Row, failure: Optional[Failure], forks: list) -> Optional[dict]:
    """The run's own steps over time as bars (height: time the step took), for a small inline SVG.

    Beyond PICTURE_BARS_MAX steps, neighbouring steps share a bar. Forks of this run and the failure are
    marked at their step.
    """
    steps = conn.execute("SELECT step_number, created_at FROM events WHERE channel_id = ? AND step_number IS NOT NULL"
                         " ORDER BY cursor", (row["id"],)).fetchall()
    if not steps:
        return None
    origin = first_event_at(conn, row["id"])
    previous, spans = origin, []
    for s in steps:
        spans.append((s["step_number"], millis_between(previous, s["created_at"]) or 0))
        previous = s["created_at"]
    per = -(-len(spans) // PICTURE_BARS_MAX)
    buckets = [spans[i:i + per] for i in range(0, len(spans), per)]
    longest = max(sum(ms for _, ms in b) for b in buckets) or 1
    width, height, slot = 1000, 60, 1000 / len(buckets)
    first_step, last_step = spans[0][0], spans[-1][0]
    bad_after = failure.last_good_step if failure is not None else None

    def x_after(step: int) -> float:
        """Where "after step k" is: the right edge of the bar holding step k."""
        return round(min(len(buckets), (max(0, step - first_step) // per) + 1) * slot, 1)

    bars = []
    for b in buckets:
        ms = sum(ms for _, ms in b)
        h = round(2 + (height - 4) * ms / longest, 1)
        bars.append({"first": b[0][0], "last": b[-1][0], "ms": ms, "x": round(len(bars) * slot, 1),
                     "y": round(height - h, 1), "width": round(max(slot * 0.8, 0.8), 1), "height": h,
                     "bad": bad_after is not None and b[-1][0] > bad_after})
    marks = [{"x": x_after(f["forked_at_step"]), "label": f"fork {f['channel_id']} after step {f['forked_at_step']}"}
             for f in forks if f.get("forked_at_step")]
    return {"width": width, "height": height, "bars": bars, "marks": marks, "first_step": first_step,
            "last_step": last_step, "total_ms": millis_between(origin, steps[-1]["created_at"]),
            "per_bar": per, "any_bad": any(b["bad"] for b in bars)}


def default_fork_name(conn: Conn, channel_id: str, fork_count: int) -> str:
    """`<run>-fork-<n>`, the first n not taken (the name field starts with it)."""
    stem = channel_id[:240]
    for n in range(fork_count + 1, fork_count + 50):
        name = f"{stem}-fork-{n}"
        if channel_by_id(conn, name) is None:
            return name
    return f"{stem}-fork-{uuid.uuid4().hex[:8]}"


def run_page(conn: Conn, channel_id: str, start: int, event_type: str, reach: "Reach",
             parts: tuple[Callable[[Conn, str], dict], ...] = (), measures: tuple = ()) -> dict:
    """Everything the run page shows; the timeline is one page of TIMELINE_PAGE_SIZE events."""
    row = fetch_or_raise(conn, lambda: NotFound(f"channel {channel_id} not found"),
                         f"SELECT {RUN_COLUMNS} FROM channels c WHERE c.id = ?", channel_id)
    meta = experiment_of(row)
    run_state = row["run_state"]
    failure = run_failure(conn, row, run_state)
    cause = failure_cause(conn, row, failure, reach)
    items, more = timeline(conn, row, start, event_type, failure)
    forks = [msgspec.structs.asdict(f) for f in list_forks(conn, channel_id, reach)]
    for f in forks:
        em = f["experiment_metadata"] if isinstance(f["experiment_metadata"], dict) else {}
        f["forked_at_step"] = em.get("forked_at_step")
    return {
        "run": {**run_summary(row, row["last_step"], len(forks)), "latest_cursor": row["last_cursor"] or None,
                "status": shown_status(run_state), "sdk_status": meta.get("status"),
                "metadata": metadata_of(row), "params": meta.get("params"),
                "intervention": meta.get("intervention"),
                "duration_ms": millis_between(row["first_event_at"], row["last_event_at"])},
        "failure": failure.as_json() if failure else None,
        "cause": cause.as_json() if cause else None,
        "handled_by": handled_by(conn, row, reach),
        "receipt": receipt_of(row) if row["parent_id"] else None,
        "saving": fork_saving(conn, channel_id, measures) if row["parent_id"] else None,
        "timeline": items, "more": more, "event_types": event_types(conn, channel_id),
        "total": row["last_cursor"], "start": start,
        "end": max((i["event"]["cursor"] for i in items if i["kind"] == "event"), default=start),
        "executions": [with_marks(e) for e in channel_executions(conn, channel_id)],
        "blocked": blocked_attempts(conn, channel_id), "forks": forks,
        "steps": step_list(conn, channel_id), "picture": step_picture(conn, row, failure, forks),
        "default_fork_name": default_fork_name(conn, channel_id, len(forks)),
        **{name: value for part in parts for name, value in part(conn, channel_id).items()},
    }


# =============================================================================
# Runs: handlers, routes, pages and the /ws stream
# =============================================================================

async def api_events_record(request: Request, body: RecordEvent) -> EventAnswer:
    """Record one event on a run (idempotent with operation_id); the answer is the stored event with its cursor."""
    return EventAnswer(event=await db_of(request).write(record_event, body))


async def api_events_replay(request: Request, path, query: ReplayQuery) -> Events:
    """Read a run's events in cursor order, from `cursor` on (the run's inherited history included)."""
    events = await db_of(request).read(replay_events, path.channel_id, query.cursor, query.limit, query.event_type)
    return Events(events=events)


async def api_events_query(request: Request, body: EventQuery) -> Events:
    """Search events across runs by channel, type, actor, cursor range and time."""
    return Events(events=await db_of(request).read(query_events, body))


async def api_events_cursor(request: Request, path) -> LatestCursor:
    """The latest cursor of a run (0 when it has no events yet)."""
    return LatestCursor(latest_cursor=await db_of(request).read(latest_cursor, path.channel_id))


async def api_events_transition(request: Request, body: Transition) -> TransitionAnswer:
    """Record one event and save the state at its cursor, atomically (one idempotent write)."""
    return await db_of(request).write(transition, body)


async def api_events_causal_graph(request: Request, path, query: CausalQuery) -> CausalGraph:
    """The events an event depends on (depends_on and recorded dependencies), walked back to max_nodes."""
    return await db_of(request).read(causal_graph, path.event_id, query.max_nodes, reach_of(request))


async def api_state_save(request: Request, path, body: SaveState) -> SavedState:
    """Save a state snapshot of a run at a cursor; the answer is the new state version."""
    same_channel(body.channel_id, path.channel_id)
    return SavedState(version=await db_of(request).write(save_state, path.channel_id, body))


async def api_state_latest(request: Request, path) -> StateAnswer:
    """The latest saved state of a run, with its cursor and version."""
    return await db_of(request).read(latest_state, path.channel_id)


async def api_state_versions(request: Request, path, query: PageQuery) -> StateVersions:
    """The saved state versions of a run, newest first, a page at a time."""
    return StateVersions(versions=await db_of(request).read(list_states, path.channel_id, query.limit, query.offset))


async def api_state_version(request: Request, path) -> StateAnswer:
    """One saved state version of a run."""
    return await db_of(request).read(get_state_version, path.channel_id, path.version)


async def api_state_delete(request: Request, path) -> DeletedCount:
    """Delete one saved state version of a run."""
    return await db_of(request).write(delete_state_version, path.channel_id, path.version)


async def api_channels_list(request: Request) -> ChannelIds:
    """List the channels this credential may read."""
    return ChannelIds(channels=reach_of(request).seen(await db_of(request).read(list_channels)))


async def api_channels_metadata(request: Request, path) -> ChannelMetadata:
    """A run's metadata: display name, reason, parent, fork point, outcome and experiment metadata."""
    return await db_of(request).read(get_metadata, path.channel_id)


async def api_channels_metadata_put(request: Request, path, body: PutMetadata) -> ChannelMetadata:
    """Change a run's display name, reason or experiment metadata (only the keys sent change; null clears)."""
    same_channel(body.channel_id, path.channel_id)
    return await db_of(request).write(put_metadata, path.channel_id, body)


async def api_channels_step(request: Request, path) -> StepLocation:
    """Where a step of a run is: its event, cursor and the state to fork from after it."""
    return await db_of(request).read(resolve_step, path.channel_id, path.step_number)


async def api_channels_steps(request: Request, path) -> LastStep:
    """The last step number recorded on a run."""
    return LastStep(channel_id=path.channel_id,
                    last_step_number=await db_of(request).read(last_step_number, path.channel_id))


async def api_channels_blame(request: Request, path, query: BlameQuery) -> Blame:
    """Every path of a run's state (after step `at_step`; default the latest) with the step that set
    its current value, from the stored snapshots (a fork's inherited ones included); nothing re-runs."""
    return await db_of(request).read(state_blame, path.channel_id, reach_of(request), query.at_step)


async def page_blame(request: Request) -> Response:
    channel_id = path_channel(request)
    at_step = page_query(request, BlameQuery).at_step
    blame = await db_of(request).read(state_blame, channel_id, reach_of(request), at_step)
    steps = await db_of(request).read(step_list, channel_id)
    return render(request, "blame.html", {"title": f"State blame of {channel_id}", "channel_id": channel_id,
                                          "blame": msgspec.to_builtins(blame), "steps": steps, "asked_step": at_step})


async def api_channels_delete(request: Request, path, query: DeleteQuery) -> DeletedChannels:
    """Delete a run with its events, states and ledger rows (recursive: its forks too)."""
    return await db_of(request).write(delete_channel, path.channel_id, query.recursive, reach_of(request))


async def api_channels_close(request: Request, path, body: Empty) -> Closed:
    """Close a run: it refuses new events and states (409 channel_closed); reads, forks and diffs go on."""
    return await db_of(request).write(close_channel, path.channel_id, context_of(request).principal.actor)


async def api_events_verify(request: Request, path) -> ChainCheck:
    """Recompute a run's hash chain (with the history it inherited) and name the first broken cursor."""
    return await db_of(request).read(verify_chain, path.channel_id)


async def ws_subscribe_all(conn: WsConnection, db: Database, frame: SubscribeFrame) -> None:
    """Topic "*": every channel the key may read, in commit order, after position `cursor` (or from now);
    each broadcast frame carries its `position`. The key's reach is the one it had when it subscribed."""
    if conn.following is not None:
        conn.following.cancel()
    latest = await read_until_answered(db, latest_position)
    conn.send({"type": "subscription", "event": "subscribed", "topic": ALL_CHANNELS, "cursor": latest,
               "payload": {"topic": ALL_CHANNELS, "cursor": latest}})
    conn.following = asyncio.create_task(follow_instance(db, conn.hub, conn.principal.reach,
                                                         latest if frame.cursor is None else frame.cursor, conn))


async def ws_subscribe(conn: WsConnection, db: Database, frame: SubscribeFrame) -> None:
    """Confirm, replay `cursor > N` from the log, then hand over to live delivery without gaps."""
    if frame.topic == ALL_CHANNELS:
        await ws_subscribe_all(conn, db, frame)
        return
    topic, start = frame.topic, frame.cursor
    conn.principal.require("read", topic)
    sub = conn.hub.watch(conn, topic, start or 0)
    latest = await db.read(latest_cursor, topic)
    if start is None:
        sub.last_cursor = latest or 0      # live only: what comes after the cursor we confirm
    conn.send({"type": "subscription", "event": "subscribed", "topic": topic, "cursor": latest,
               "payload": {"topic": topic, "cursor": latest}})
    if start is not None:
        while True:
            batch = await db.read(replay_events, topic, sub.last_cursor, REPLAY_LIMIT_MAX)
            for event in batch:
                sub.last_cursor = event.cursor
                await conn.send_event_paced(event, None)
            if len(batch) < REPLAY_LIMIT_MAX:
                break
    sub.catching_up = False
    for event in sorted(sub.pending, key=lambda e: e.cursor):
        conn.deliver(topic, event)
    sub.pending.clear()
    if db.location.shared:
        conn.hub.fill(topic)               # another server may have committed since the last read


async def ws_publish(conn: WsConnection, db: Database, frame: PublishFrame) -> None:
    conn.principal.require("write", frame.topic)
    req = RecordEvent(channel_id=frame.topic, event_type="broadcast", payload=frame.payload,
                      metadata=EventMeta(actor="websocket"), operation_id=frame.operation_id)
    event = await db.write(record_event, req, exclude=conn)
    # The event's own "type" must not overwrite the frame kind: the SDK reads the type from event_type.
    conn.send({**msgspec.structs.asdict(event), "event_type": event.type, "type": "ack", "request_id": frame.request_id})


async def ws_endpoint(websocket: WebSocket) -> None:
    """GET /ws. The SDK's handshake carries no credentials: the first frame authenticates."""
    app, hub, db = websocket.app, websocket.app.services.hub, websocket.app.services.db
    await websocket.accept()
    conn = WsConnection(websocket, hub)
    await websocket.send_text(json.dumps({"type": "connection", "event": "connected",
                                          "payload": {"connection_id": conn.id}}))
    if not await ws_authenticate(websocket, conn, app):
        return
    hub.connections.add(conn)
    guard = hub.guard(Guard(conn.key, lambda: check_key(app, conn.key), conn.end))
    conn.pump_task = asyncio.create_task(conn.pump())
    reader = asyncio.create_task(ws_read_frames(conn, db))
    try:
        # Whichever ends first (client gone, send failed, client cut off, credential ended) ends the other.
        await asyncio.wait({conn.pump_task, reader}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hub.unguard(guard)
        hub.leave(conn)
        for task in (conn.pump_task, reader):
            task.cancel()
        await asyncio.gather(conn.pump_task, reader, return_exceptions=True)
        if conn.cut or conn.ended is not None:
            await close_stream_socket(websocket, conn.ended, conn.cut)


async def ws_read_frames(conn: WsConnection, db: Database) -> None:
    """Handle the client's frames one at a time, in order, until it goes away."""
    while True:
        message = await conn.websocket.receive()
        if message["type"] == "websocket.disconnect":
            return
        conn.hub.count_received()
        if message.get("text") is None:
            conn.send({"type": "error", "message": "binary frames are not supported: send JSON text"})
            continue
        try:                            # a key revoked (or expired) stops working here too
            conn.principal = await check_key(conn.websocket.app, conn.key)
        except Unauthorized as exc:
            conn.end(exc.message)
            return
        await ws_handle_frame(conn, db, message["text"])


def frame_request_id(text: str) -> Json:
    """The request_id of a frame that failed to decode, so the SDK can match the error to its call."""
    try:
        frame = msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError):
        return None
    request_id = frame.get("request_id") if isinstance(frame, dict) else None
    return request_id if isinstance(request_id, str) and len(request_id) <= 256 else None


async def ws_handle_frame(conn: WsConnection, db: Database, text: str) -> None:
    try:
        frame = decode_frame(text)
        if isinstance(frame, SubscribeFrame):
            await ws_subscribe(conn, db, frame)
        elif isinstance(frame, UnsubscribeFrame):
            conn.hub.unwatch(conn, frame.topic)
            if frame.topic == ALL_CHANNELS and conn.following is not None:
                conn.following.cancel()
            conn.send({"type": "subscription", "event": "unsubscribed", "topic": frame.topic,
                       "payload": {"topic": frame.topic}})
        elif isinstance(frame, PublishFrame):
            await ws_publish(conn, db, frame)
        elif isinstance(frame, PingFrame):
            conn.send({"type": "connection", "event": "pong", "payload": {"connection_id": conn.id}})
        else:
            raise BadRequest("already authenticated")
    except ActaeError as exc:
        request_id = frame_request_id(text)
        conn.send({"type": "error", "message": exc.message, "status": exc.code,
                   **({"request_id": request_id} if request_id is not None else {})})
    except Exception:  # noqa: BLE001 - a bug answers this frame with an error; the socket stays up
        log.exception("WebSocket frame failed")
        conn.send({"type": "error", "message": "internal error", "status": "internal"})


async def page_runs(request: Request) -> Response:
    query = page_query(request, RunsPageQuery)
    q, status = query.q.strip(), query.status
    if status and status not in RUN_STATES:
        raise BadRequest(f"status must be one of {', '.join(RUN_STATES)}")
    runs, after = await db_of(request).read(runs_page, q, status, query.after)
    next_url = f"/?{urlencode({'q': q, 'status': status, 'after': after})}" if after else None
    return render(request, "runs.html", {"title": "Runs", "runs": runs, "q": q, "status": status,
                                         "statuses": list(RUN_STATES), "next_url": next_url,
                                         "grouped": not q and not status, "deleted": query.deleted[:256],
                                         "deleted_count": query.count, "selectable": status in FAILURE_STATES})


def timeline_links(channel_id: str, start: int, total: int, event_type: str, more: Optional[int]) -> dict:
    """Pager links. All events: by cursor ranges (first, previous, next, last). One type: first and next."""
    def at(cursor: int) -> str:
        query = {"start": cursor, **({"type": event_type} if event_type else {})}
        return f"/runs/{channel_id}?{urlencode(query)}#timeline"
    if event_type:
        return {"first_url": at(1) if start > 1 else None, "prev_url": None,
                "next_url": at(more) if more else None, "last_url": None}
    last_start = max(1, ((max(total, 1) - 1) // TIMELINE_PAGE_SIZE) * TIMELINE_PAGE_SIZE + 1)
    return {"first_url": at(1) if start > 1 else None,
            "prev_url": at(max(1, start - TIMELINE_PAGE_SIZE)) if start > 1 else None,
            "next_url": at(start + TIMELINE_PAGE_SIZE) if start + TIMELINE_PAGE_SIZE <= total else None,
            "last_url": at(last_start) if start < last_start else None}


def continue_snippet(base_url: str, channel_id: str, next_step: int) -> str:
    """The SDK code that continues a fork: AgentSession.resume picks up after the fork's last step."""
    return f'''import asyncio
import os

from actae_client import ActaeClient, AgentSession


async def main():
    client = ActaeClient(endpoint={json.dumps(base_url)}, api_key=os.environ["ACTAE_API_KEY"])
    try:
        session = await AgentSession.resume(client, {json.dumps(channel_id)}, state_fn=lambda: state)
        state = dict(session.inherited_state or {{}})   # the state the fork starts from
        # session.intervention holds the fork's intervention: apply it to your agent.
        async with session:
            # Your agent's next step goes here; it is recorded as step {next_step}.
            state["resumed_at_step"] = {next_step}
            await session.step("step-{next_step}", input=None, output={{"resumed": True}})
    finally:
        await client.disconnect()


asyncio.run(main())
'''


async def run_context(request: Request, channel_id: str, jump_error: Optional[str] = None) -> dict:
    query = page_query(request, RunPageQuery)
    start, event_type = query.start, query.type
    hooks = request.app.services.hooks
    data = await db_of(request).read(run_page, channel_id, start, event_type, reach_of(request),
                                     hooks.run_page_parts, hooks.savings_measures)
    total, more = data.pop("total"), data.pop("more")
    page = {**timeline_links(channel_id, start, total, event_type, more), "start": data.pop("start"),
            "end": data.pop("end"), "total": data["run"]["event_count"], "filtered": bool(event_type)}
    flash = flash_store(request.app).get(query.fork_error)
    run = data["run"]
    snippet = (continue_snippet(str(request.base_url).rstrip("/"), channel_id, run["step_count"] + 1)
               if run["parent_channel_id"] else None)
    return {"title": run["display_name"], **data, "page": page, "event_type": event_type,
            "form": fork_form_values(request, data, flash), "fork_error": flash["error"] if flash else None,
            "fork_field": flash["field"] if flash else None, "jump_error": jump_error,
            "created": query.created == "1", "snippet": snippet}


async def jump_to_step(request: Request, channel_id: str) -> Response:
    """`?step=n`: to the timeline page holding step n, on the run that recorded it (a fork's inherited
    steps are on an ancestor's page)."""
    step = page_query(request, RunPageQuery).step
    try:
        hit = await db_of(request).read(resolve_step, channel_id, step)
    except NotFound as exc:
        if "not indexed" not in exc.message:
            raise
        return render(request, "run.html", await run_context(request, channel_id, f"This run has no step {step}."),
                      status=404)
    start = (hit.cursor - 1) // TIMELINE_PAGE_SIZE * TIMELINE_PAGE_SIZE + 1
    return RedirectResponse(f"/runs/{hit.channel_id}?start={start}#cursor-{hit.cursor}", status_code=303)


async def page_run(request: Request) -> Response:
    channel_id = path_channel(request)
    if page_query(request, RunPageQuery).step is not None:
        return await jump_to_step(request, channel_id)
    return render(request, "run.html", await run_context(request, channel_id))


async def page_delete_confirm(request: Request) -> Response:
    channel_id = path_channel(request)
    plan = await db_of(request).read(deletion_plan, channel_id, reach_of(request))
    flash = flash_store(request.app).get(page_query(request, FlashQuery).error)
    return render(request, "delete.html", {"title": f"Delete {channel_id}", "plan": plan,
                                           "error": flash["error"] if flash else None})


async def page_delete(request: Request) -> Response:
    """Delete a run and its forks; only with the confirmation the confirm page's form sends."""
    channel_id = path_channel(request)
    form = await read_form(request)
    if form.get("confirm") != channel_id:
        return RedirectResponse(f"/runs/{channel_id}/delete", status_code=303)
    try:
        result = await db_of(request).write(delete_channel, channel_id, True, reach_of(request))
    except (Conflict, Forbidden) as exc:
        flash_id = flash_store(request.app).put({"error": exc.message})
        return RedirectResponse(f"/runs/{channel_id}/delete?{urlencode({'error': flash_id})}", status_code=303)
    query = urlencode({"deleted": channel_id, "count": len(result.deleted)})
    return RedirectResponse(f"/?{query}", status_code=303)


RUNS_API_ROUTES = (
    Api("POST", "/api/v1/events/record", api_events_record, body=RecordEvent, scopes=writes(B)),
    Api("GET", "/api/v1/events/replay/{channel_id}", api_events_replay, query=ReplayQuery, scopes=reads(P)),
    Api("POST", "/api/v1/events/query", api_events_query, body=EventQuery, scopes=reads("body.channel_ids")),
    Api("GET", "/api/v1/events/cursor/{channel_id}", api_events_cursor, scopes=reads(P)),
    Api("POST", "/api/v1/events/transition", api_events_transition, body=Transition, scopes=writes(B)),
    Api("GET", "/api/v1/events/verify/{channel_id}", api_events_verify, scopes=reads(P)),
    Api("GET", "/api/v1/events/{event_id}/causal-graph", api_events_causal_graph, query=CausalQuery,
        scopes=reads("event.event_id")),
    Api("POST", "/api/v1/state/{channel_id}", api_state_save, body=SaveState, scopes=writes(P)),
    Api("GET", "/api/v1/state/{channel_id}", api_state_latest, scopes=reads(P)),
    Api("GET", "/api/v1/state/{channel_id}/versions", api_state_versions, query=PageQuery, scopes=reads(P)),
    Api("GET", "/api/v1/state/{channel_id}/version/{version}", api_state_version, scopes=reads(P)),
    Api("DELETE", "/api/v1/state/{channel_id}/version/{version}", api_state_delete, scopes=deletes(P)),
    Api("GET", "/api/v1/channels", api_channels_list, scopes=reads(SOMEWHERE)),
    Api("GET", "/api/v1/channels/{channel_id}/metadata", api_channels_metadata, scopes=reads(P)),
    Api("PUT", "/api/v1/channels/{channel_id}/metadata", api_channels_metadata_put, body=PutMetadata,
        scopes=writes(P)),
    Api("GET", "/api/v1/channels/{channel_id}/steps", api_channels_steps, scopes=reads(P)),
    Api("GET", "/api/v1/channels/{channel_id}/steps/{step_number}", api_channels_step, scopes=reads(P)),
    Api("GET", "/api/v1/channels/{channel_id}/blame", api_channels_blame, query=BlameQuery, scopes=reads(P)),
    Api("POST", "/api/v1/channels/{channel_id}/close", api_channels_close, body=Empty, body_optional=True,
        scopes=writes(P)),
    Api("DELETE", "/api/v1/channels/{channel_id}", api_channels_delete, query=DeleteQuery, scopes=deletes(P)),
)


RUNS_PAGE_ROUTES = (
    ("GET", "/", page_runs),
    ("GET", "/runs/{channel_id}", page_run),
    ("GET", "/runs/{channel_id}/delete", page_delete_confirm),
    ("GET", "/runs/{channel_id}/blame", page_blame),
    ("POST", "/runs/{channel_id}/delete", page_delete),
)

RUNS = declare(Region(
    "runs", features=("events", "state", "websocket", "event_chain", "close"), routes=RUNS_API_ROUTES,
    pages=RUNS_PAGE_ROUTES, endpoints=(Endpoint("WS", "/ws", ws_endpoint),), json_paths=("/ws",),
    nav=(NavLink("Runs", "/", "runs", place=10),),
    lone_writes=(record_event, save_state, transition, put_metadata),
    channel_writes=((record_event, lambda req: (req.channel_id,)), (save_state, lambda channel_id, req: (channel_id,)),
                    (transition, lambda req: (req.channel_id,)),
                    (put_metadata, lambda channel_id, changes: (channel_id,)))))


# =============================================================================
# Forks: records
# =============================================================================

class ForkTree(Answer):
    """A channel and all its descendants, each with where it forked and how far it got."""

    channel_id: str
    display_name: Optional[str]
    reason: Optional[str]
    parent_channel_id: Optional[str]
    forked_at_cursor: Optional[int]
    forked_at_step: Optional[int]
    event_count: int
    latest_cursor: Optional[int]
    status: Json                       # the SDK's own status in its metadata, as it wrote it
    outcome: Optional[str]
    children: list[ForkTree]


class Spend(Answer):
    """What a stretch of a run's steps spent: sums over the steps that recorded it. A step that
    recorded no usage is counted in steps_without_usage, never as zero."""

    steps: int
    steps_without_usage: int
    input_tokens: int
    output_tokens: int
    cost: Optional[float]              # None: no step in it recorded a cost
    wall_seconds: float                # from its first event to its last


class MeasuredSpend(Answer):
    """What a fork did not spend again, as the server measured it (the model calls the gateway recorded
    in the prefix it kept, and those it answered from the record), each call counted once."""

    calls: int
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int
    cost: Optional[float]              # None: none of the calls has a known cost
    calls_without_cost: int


class ForkSaving(Answer):
    """A fork's inherited prefix (steps it did not run, or pay for, again) and its own tail, as the
    steps reported them; `measured`: what the server itself measured (None: nothing measured)."""

    channel_id: str
    parent_channel_id: str
    forked_at_step: Optional[int]
    saved: Spend
    tail: Spend
    measured: Optional[MeasuredSpend] = None


class Savings(Answer):
    """What forking saved: this run's own (when it is a fork), and its forks' with their totals."""

    channel_id: str
    fork: Optional[ForkSaving]
    forks: list[ForkSaving]
    forks_saved: Spend
    forks_measured: Optional[MeasuredSpend] = None


# =============================================================================
# Forks: copy-on-write forks, receipts, the fork tree, what a fork saved
# =============================================================================

def list_forks(conn: Conn, channel_id: str, reach: "Reach") -> list[ChannelMetadata]:
    """The run's direct forks that `reach` sees, oldest first."""
    require_channel(conn, channel_id)
    where = Where().add("c.parent_id = ?", channel_id).within(reach, "c.id")
    rows = conn.execute(f"{CHANNEL_ROW}{where} ORDER BY c.created_at, c.id", where.args).fetchall()
    return [metadata_of(r) for r in rows]


def reproducibility_grade(restorable: bool, manifest: Optional[dict]) -> str:
    if not restorable:
        return "best_effort"
    if isinstance(manifest, dict) and all(manifest.get(k) not in (None, "", {}, []) for k in CONTEXT_EXACT_KEYS):
        return "context_exact"
    return "state_exact"


def receipt_of(row: Row, *, replayed: bool = False) -> Receipt:
    return Receipt(
        fork_id=row["id"], channel_id=row["id"], child_channel_id=row["id"], source_channel_id=row["parent_id"],
        origin_run_id=row["origin_id"], requested_cursor=row["requested_cursor"],
        resolved_cursor=row["resolved_cursor"], resolved_state_cursor=row["resolved_cursor"],
        resolved_event_id=row["resolved_event_id"], forked_at_step=row["forked_at_step"],
        source_state_version=row["source_state_version"], source_state_sha256=row["source_state_sha256"],
        restorable=bool(row["restorable"]), replayed=replayed, manifest=load(row["manifest"]),
        reproducibility=row["reproducibility"], tool_policies=load(row["tool_policies"]), forked_at=row["forked_at"])


def get_receipt(conn: Conn, channel_id: str) -> Receipt:
    row = require_channel(conn, channel_id)
    if row["parent_id"] is None:
        raise NotFound(f"channel {channel_id} is not a fork")
    return receipt_of(row)


def fork_step_boundary(conn: Conn, source: Row, boundary_cursor: int,
                       experiment_metadata: Json) -> Optional[int]:
    """How many steps the child inherits: the SDK's forked_at_step, else the source's last step at the boundary."""
    if isinstance(experiment_metadata, dict):
        declared = experiment_metadata.get("forked_at_step")
        if is_int(declared) and 0 <= declared <= INT64_MAX:
            return declared
    # Walk back from the boundary to the nearest step event: a few rows, not the whole history.
    own = last_step_at(conn, source["id"], boundary_cursor)
    return own if own is not None else source["forked_at_step"]


def fork_snapshot(conn: Conn, source: Row, at_cursor: int) -> Optional[Row]:
    """The snapshot a fork of `source` at `at_cursor` starts from (0: its latest), which fixes its
    boundary (None: a fork at 0 of a run without state starts afresh)."""
    # The boundary lies within the source's history as it is now: a snapshot saved at a cursor past
    # its last event would make the fork inherit whatever the source records next.
    last = source["last_cursor"]
    snapshot = state_row_at(conn, source["id"], min(at_cursor, last) if at_cursor else None)
    if snapshot is not None and snapshot["cursor"] > last:
        snapshot = state_row_at(conn, source["id"], last)
    if snapshot is None and at_cursor > 0:
        raise Conflict("snapshot_boundary_required",
                       f"no state snapshot of {source['id']} at or before cursor {at_cursor}; fork at a "
                       "snapshotted step or use boundary_mode='approximate'")
    return snapshot


def fork_channel(tx: Tx, req: Fork) -> Receipt:
    """POST /channels/fork. Never writes to the source; cost is independent of the source's history."""
    conn = tx.conn
    source_id, child_id, at_cursor = req.source_channel_id, req.new_channel_id, req.at_cursor
    # hand_off is hashed only when set: a fork made before it existed replays under its old hash.
    hashed = request_hash({k: v for k, v in msgspec.structs.asdict(req).items()
                           if k != "operation_id" and (k != "hand_off" or v)})
    if req.operation_id is not None:
        earlier = conn.execute(f"{CHANNEL_ROW} WHERE c.fork_operation_id = ?", (req.operation_id,)).fetchone()
        if earlier is not None:
            require_same_request(earlier["fork_request_hash"], hashed, req.operation_id, "fork")
            return receipt_of(earlier, replayed=True)
    existing = channel_by_id(conn, child_id)
    if existing is not None:
        # AgentSession retries with a fresh operation id, so the child's name is the retry key.
        # Same source and boundary is the same fork (the SDK's own retry); a different tool policy is
        # not: replaying it would leave the caller believing its policy is in force.
        if (existing["parent_id"] == source_id and existing["requested_cursor"] == at_cursor
                and load(existing["tool_policies"]) == req.tool_policies):
            return receipt_of(existing, replayed=True)
        raise Conflict("channel_conflict", f"channel {child_id} already exists with a different definition")
    if child_id == source_id:
        raise BadRequest("new_channel_id must differ from source_channel_id")
    source = require_channel(conn, source_id)
    if len(lineage(conn, source_id)) > LINEAGE_MAX_DEPTH:
        raise Conflict("channel_conflict", f"{source_id} is already {LINEAGE_MAX_DEPTH} forks deep; fork an ancestor")
    check_guards(conn, source_id, req.expected_version, req.expected_cursor)

    snapshot = fork_snapshot(conn, source, at_cursor)
    resolved = snapshot["cursor"] if snapshot else 0
    boundary_event = conn.execute("SELECT id, chain_hash FROM events WHERE channel_id = ? AND cursor = ?",
                                  (source_id, resolved)).fetchone()
    resolved_event_id = boundary_event["id"] if boundary_event else None
    restorable = snapshot is not None
    # The child's chain goes on from the parent's hash at the boundary (a fork at 0 starts afresh).
    conn.execute(
        "INSERT INTO channels (id, parent_id, origin_id, created_at, updated_at, display_name, reason,"
        " experiment_metadata, forked_at, requested_cursor, resolved_cursor, resolved_event_id, forked_at_step,"
        " source_state_version, source_state_sha256, restorable, manifest, reproducibility, tool_policies,"
        " fork_operation_id, fork_request_hash, chain_base)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (child_id, source_id, source["origin_id"], tx.ts, tx.ts, req.display_name, req.reason,
         dump(req.experiment_metadata), tx.ts, at_cursor, resolved, resolved_event_id,
         fork_step_boundary(conn, source, at_cursor or resolved, req.experiment_metadata),
         snapshot["version"] if snapshot else 0, snapshot["sha256"] if snapshot else None, int(restorable),
         dump(req.manifest), reproducibility_grade(restorable, req.manifest), dump(req.tool_policies),
         req.operation_id, hashed, boundary_event["chain_hash"] if boundary_event else None),
    )
    marker = append_event(tx, child_id, "fork.started", {
        "source_channel_id": source_id, "requested_cursor": at_cursor, "resolved_cursor": resolved,
        "source_state_version": snapshot["version"] if snapshot else 0, "restorable": restorable,
        **({"hand_off": True} if req.hand_off else {}),
    }, depends_on=resolved_event_id)
    if snapshot is not None:
        insert_state(tx, child_id, marker.cursor, shared_state(snapshot), snapshot["sha256"], snapshot["status"])
    return receipt_of(channel_by_id(conn, child_id))


def stretch_row(conn: Conn, channel_id: str, upto: Optional[int], after: int = 0) -> Row:
    """A channel's own events after cursor `after` up to cursor `upto` (all, with None) in one read: how
    many (n), how many steps (numbered, or reporting usage: usage_of), how many numbered steps kept
    none (unknown), their tokens (tin, tout) and cost, the first and last event's times."""
    limit, args = " AND e.cursor > ?", (channel_id, after)
    if upto is not None:
        limit, args = limit + " AND e.cursor <= ?", (*args, upto)
    return conn.execute(
        "SELECT COUNT(*) AS n, COUNT(CASE WHEN e.step_number IS NOT NULL OR u.cursor IS NOT NULL THEN 1 END) AS steps,"
        " COUNT(CASE WHEN e.step_number IS NOT NULL AND u.cursor IS NULL THEN 1 END) AS unknown,"
        # Summed as floating point (SQLite) or numeric (PostgreSQL): 64-bit counts never overflow a sum.
        " COALESCE(SUM(u.input_tokens * 1.0), 0) AS tin, COALESCE(SUM(u.output_tokens * 1.0), 0) AS tout,"
        " SUM(u.cost) AS cost,"
        # the first event a duration counts from: a fork's fork.started marker is not its work (FIRST_OWN_EVENT)
        " MIN(CASE WHEN e.type <> 'fork.started' THEN e.created_at END) AS first, MAX(e.created_at) AS last"
        " FROM events e LEFT JOIN step_usage u"
        f" ON u.channel_id = e.channel_id AND u.cursor = e.cursor WHERE e.channel_id = ?{limit}", args).fetchone()


def spend_of(conn: Conn, stretches: list) -> Spend:
    """What these stretches of steps spent: [(channel, highest cursor or None)] (or (channel, highest,
    after)), each a channel's own events up to that cursor (after the other)."""
    steps = without = input_tokens = output_tokens = 0
    cost, wall = None, 0.0
    for channel_id, upto, *after in stretches:
        row = stretch_row(conn, channel_id, upto, *after)
        steps, without = steps + row["steps"], without + row["unknown"]
        input_tokens, output_tokens = input_tokens + int(row["tin"]), output_tokens + int(row["tout"])
        if row["cost"] is not None:
            cost = (cost or 0.0) + float(row["cost"])
        wall += (millis_between(row["first"], row["last"]) or 0) / 1000
    return Spend(steps=steps, steps_without_usage=without, input_tokens=input_tokens, output_tokens=output_tokens,
                 cost=None if cost is None else round(cost, 9), wall_seconds=round(wall, 6))


def fork_saving(conn: Conn, channel_id: str, measures: tuple = ()) -> Optional[ForkSaving]:
    """What a fork did not spend again (the history it inherited, across every ancestor it reaches)
    and what its own tail spent; None for a run that is no fork. `measures`: the regions' own
    measurements of it (Region.savings_measures), the first that measured anything."""
    chain = lineage(conn, channel_id)
    row = chain[0][0]
    if row["parent_id"] is None:
        return None
    measured = next((m for m in (measure(conn, channel_id) for measure in measures) if m is not None), None)
    return ForkSaving(channel_id=channel_id, parent_channel_id=row["parent_id"], forked_at_step=row["forked_at_step"],
                      saved=spend_of(conn, [(ancestor["id"], upto) for ancestor, upto in chain[1:]]),
                      tail=spend_of(conn, [(channel_id, None)]), measured=measured)


def measured_total(figures: list) -> Optional[MeasuredSpend]:
    """The sum of measured savings (None when none was measured)."""
    found = [figure for figure in figures if figure is not None]
    if not found:
        return None
    costs = [figure.cost for figure in found if figure.cost is not None]
    return MeasuredSpend(calls=sum(f.calls for f in found), input_tokens=sum(f.input_tokens for f in found),
                         output_tokens=sum(f.output_tokens for f in found),
                         cached_input_tokens=sum(f.cached_input_tokens for f in found),
                         cost=round(sum(costs), 9) if costs else None,
                         calls_without_cost=sum(f.calls_without_cost for f in found))


def savings_of(conn: Conn, channel_id: str, reach: "Reach", measures: tuple = ()) -> Savings:
    """GET /channels/{id}/savings: the run's own saving as a fork, and its forks' (those `reach` sees)
    with their totals."""
    require_channel(conn, channel_id)
    forks = [fork_saving(conn, child, measures) for child in child_ids(conn, channel_id, reach)]
    totals = {"steps": 0, "steps_without_usage": 0, "input_tokens": 0, "output_tokens": 0, "wall_seconds": 0.0}
    cost = None
    for fork in forks:
        for name in totals:
            totals[name] += getattr(fork.saved, name)
        if fork.saved.cost is not None:
            cost = (cost or 0.0) + fork.saved.cost
    return Savings(channel_id=channel_id, fork=fork_saving(conn, channel_id, measures), forks=forks,
                   forks_saved=Spend(**totals, cost=cost), forks_measured=measured_total([f.measured for f in forks]))


def lineage_tree(conn: Conn, channel_id: str, reach: "Reach") -> ForkTree:
    """The fork tree a channel belongs to as `reach` sees it: from its highest ancestor reached through
    runs it sees (the root, for a credential that reads the whole line)."""
    top = channel_id
    for row, _ in lineage(conn, channel_id)[1:]:
        if not reach.sees(row["id"]):
            break
        top = row["id"]
    return fork_tree(conn, top, reach)


def descendants(conn: Conn, channel_id: str, reach: Optional["Reach"] = None) -> list:
    """Every fork below a channel (forks of forks too) that `reach` sees, when given, each after its
    parent: depth first, oldest first."""
    found, pending = [], [(channel_id, 0)]
    while pending:
        parent, depth = pending.pop()
        if parent != channel_id:
            found.append(parent)
        if depth < LINEAGE_MAX_DEPTH:
            pending.extend((child, depth + 1) for child in reversed(child_ids(conn, parent, reach)))
    return found


def child_ids(conn: Conn, channel_id: str, reach: Optional["Reach"] = None) -> list:
    """The channel's own forks (those `reach` sees, when given), oldest first."""
    where = Where().add("parent_id = ?", channel_id)
    if reach is not None:
        where.within(reach, "id")
    return [r["id"] for r in conn.execute(f"SELECT id FROM channels{where} ORDER BY created_at, id", where.args)]


def fork_tree(conn: Conn, channel_id: str, reach: "Reach", depth: int = 0) -> ForkTree:
    """A channel and its descendants that `reach` sees (a fork it may not read is left out with its
    own forks), each with where it forked and how far it got."""
    row = require_channel(conn, channel_id)
    meta = experiment_of(row)
    children = child_ids(conn, channel_id, reach)
    return ForkTree(
        channel_id=row["id"], display_name=row["display_name"], reason=row["reason"],
        parent_channel_id=row["parent_id"], forked_at_cursor=row["resolved_cursor"],
        forked_at_step=row["forked_at_step"] if row["parent_id"] else None,
        event_count=row["last_cursor"], latest_cursor=row["last_cursor"] or None,
        status=meta.get("status"), outcome=row["outcome"],
        children=[fork_tree(conn, c, reach, depth + 1) for c in children] if depth < LINEAGE_MAX_DEPTH else [])


GROUP_FORKS_MAX = 100                  # forks listed under one root run; the fork tree has them all


def tree_page(conn: Conn, channel_id: str, reach: "Reach") -> dict:
    """The fork tree with each run's status as the runs list shows it, and the picture of its branches."""
    root = msgspec.to_builtins(lineage_tree(conn, channel_id, reach))     # nodes gain what the page shows
    nodes, stack = [], [root]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack += node["children"]
    ids = [n["channel_id"] for n in nodes]
    marks = ", ".join("?" for _ in ids)
    found = {r["id"]: r for r in conn.execute(f"SELECT {RUN_COLUMNS} FROM channels c WHERE c.id IN ({marks})", ids)}
    for node in nodes:
        r = found[node["channel_id"]]
        failure = run_failure(conn, r, r["run_state"])
        node.update(status=shown_status(r["run_state"]), failure=failure.as_json() if failure else None,
                    end_step=max(r["last_step"] or 0, node["forked_at_step"] or 0))
    return {"root": root, "picture": tree_picture(root)}


def tree_picture(root: dict) -> dict:
    """One horizontal line per run, from the step it forked after to its last step; a branch leaves its
    parent's line at that step. Rows in tree order."""
    rows: list = []

    def walk(node: dict, parent_row: Optional[int]) -> None:
        rows.append({"node": node, "parent_row": parent_row})
        here = len(rows) - 1
        for child in node["children"]:
            walk(child, here)
    walk(root, None)
    longest = max(r["node"]["end_step"] for r in rows) or 1
    left, right, row_height = 12, 408, 40

    def x_of(step: int) -> float:
        return round(left + (right - left) * step / longest, 1)
    lines = []
    for i, r in enumerate(rows):
        node = r["node"]
        begin = (node["forked_at_step"] or 0) if r["parent_row"] is not None else 0
        y = 26 + i * row_height
        lines.append({"channel_id": node["channel_id"], "label": node["channel_id"],
                      "status": node["status"], "x1": x_of(begin), "x2": x_of(max(begin, node["end_step"])),
                      "y": y, "text_y": y - 8, "begin": begin, "end": node["end_step"],
                      "parent_y": 26 + r["parent_row"] * row_height if r["parent_row"] is not None else None})
    # 420 units wide: scaled to a phone's width the labels stay readable, and at most 560px on a desktop.
    return {"width": 420, "height": 16 + len(rows) * row_height, "lines": lines, "longest": longest}


# =============================================================================
# Forks: handlers, routes, the tree page and the fork form
# =============================================================================

async def api_channels_forks(request: Request, path) -> Forks:
    """The direct forks of a run that this credential may read."""
    return Forks(forks=await db_of(request).read(list_forks, path.channel_id, reach_of(request)))


async def api_channels_fork(request: Request, body: Fork) -> Receipt:
    """Fork a run at a cursor into a new run that inherits its history and state; the answer is the fork receipt."""
    return await db_of(request).write(fork_channel, body)


async def api_channels_receipt(request: Request, path) -> Receipt:
    """The fork receipt of a run that is a fork: its source, resolved cursor and inherited state."""
    return await db_of(request).read(get_receipt, path.channel_id)


async def api_channels_savings(request: Request, path) -> Savings:
    """What forking saved: the fork's inherited steps, tokens, cost and time, its tail's, and its forks'."""
    return await db_of(request).read(savings_of, path.channel_id, reach_of(request),
                                     request.app.services.hooks.savings_measures)


async def api_channels_fork_tree(request: Request, path) -> ForkTree:
    """A run and all its forks, forks of forks too, each with where it forked and how far it got."""
    return await db_of(request).read(fork_tree, path.channel_id, reach_of(request))


def fork_form_values(request: Request, data: dict, flash: Optional[dict]) -> dict:
    """The fork form's fields: what was typed (after an error), else the step asked for (the failure
    banner's button), else the last good step of a failed run, else its last step; a free name."""
    typed = dict(flash["form"]) if flash else {}
    asked = page_query(request, RunPageQuery).fork_step
    steps = [s["step_number"] for s in data["steps"]]
    failure = data["failure"]
    default = failure["last_good_step"] if failure and failure["last_good_step"] else (steps[-1] if steps else None)
    step = asked if asked is not None else (typed.get("step") or default)
    return {"step": str(step) if step is not None else "", "name": typed.get("name") or data["default_fork_name"],
            "intervention": typed.get("intervention", ""), "tool_policies": typed.get("tool_policies", ""),
            "hand_off": typed.get("hand_off") == "1"}


async def page_tree(request: Request) -> Response:
    channel_id = path_channel(request)
    data = await db_of(request).read(tree_page, channel_id, reach_of(request))
    return render(request, "tree.html", {"title": f"Fork tree of {channel_id}", **data, "current": channel_id})


def form_tool_policies(form: dict) -> Optional[dict]:
    policies = form_json_object(form, "tool_policies", "Tool policies")
    for tool, policy in (policies or {}).items():
        if policy not in TOOL_POLICIES:
            raise FormError("tool_policies", f"Tool policies: {tool!r} must map to one of {', '.join(TOOL_POLICIES)}")
    return policies


def dashboard_fork_request(conn: Conn, channel_id: str, form: dict) -> Fork:
    """Turn the run page's fork form into the same request the SDK sends; each problem names its field."""
    step_text = form.get("step", "").strip()
    if not (step_text.isascii() and step_text.isdigit()) or int(step_text) < 1:
        raise FormError("step", "Choose the step to fork after.")
    step = int(step_text)
    try:
        name = valid_channel(form.get("name", "").strip(), "name")
    except ActaeError:
        raise FormError("name", "Name: use 1 to 256 letters, digits, '.', '_', ':' or '-'.")
    if name == channel_id:
        raise FormError("name", "Name: the fork needs a name of its own.")
    try:
        boundary = resolve_step(conn, channel_id, step)
    except NotFound:
        require_channel(conn, channel_id)
        raise FormError("step", f"This run has no step {step} to fork after.")
    intervention = form_json_object(form, "intervention", "Intervention")
    policies = form_tool_policies(form)
    source_meta = experiment_of(require_channel(conn, channel_id))
    experiment = {"session_name": name, "params": source_meta.get("params"),
                  "forked_from": boundary.channel_id, "forked_from_channel": channel_id, "forked_at_step": step,
                  "forked_at_cursor": boundary.cursor, "status": "created"}
    if intervention is not None:
        experiment["intervention"] = intervention
    return record_from(Fork, {
        "source_channel_id": boundary.channel_id, "new_channel_id": name, "at_cursor": boundary.cursor,
        "operation_id": str(uuid.uuid4()), "display_name": name,
        "reason": f"Forked from {channel_id} after step {step} (dashboard)", "experiment_metadata": experiment,
        "manifest": {"source": "dashboard"}, "tool_policies": policies, "hand_off": form.get("hand_off") == "1",
    }, "fork form")


def form_field_of(exc: ActaeError) -> Optional[str]:
    """Which fork-form field a server refusal is about."""
    if isinstance(exc, FormError):
        return exc.field
    if isinstance(exc, Conflict) and "already exists" in exc.message:
        return "name"
    if isinstance(exc, Conflict) and exc.code == "snapshot_boundary_required":
        return "step"
    for field_name in ("tool_policies", "intervention", "name"):
        if field_name in exc.message:
            return field_name
    return None


async def page_fork(request: Request) -> Response:
    """POST the fork form, then redirect (so a refresh never posts again): to the new fork, or back to
    the form with what was typed and the error, kept server-side under a random id."""
    channel_id = path_channel(request)
    form = await read_form(request)
    try:
        req = await db_of(request).read(dashboard_fork_request, channel_id, form)
        for target in (req.source_channel_id, req.new_channel_id):
            context_of(request).principal.require("write", target)
        await db_of(request).write(fork_channel, req)
    except ActaeError as exc:
        if isinstance(exc, NotFound) and not isinstance(exc, FormError):
            raise
        field_name = form_field_of(exc)
        message = (exc.message if isinstance(exc, FormError) else
                   f"{field_name.replace('_', ' ').capitalize() + ': ' if field_name else ''}{exc.message}")
        typed = {k: form.get(k, "")[:FLASH_VALUE_MAX] for k in ("step", "name", "intervention", "tool_policies",
                                                                 "hand_off")}
        flash_id = flash_store(request.app).put({"form": typed, "error": message, "field": field_name})
        return RedirectResponse(f"/runs/{channel_id}?{urlencode({'fork_error': flash_id})}#fork", status_code=303)
    return RedirectResponse(f"/runs/{req.new_channel_id}?created=1#{'hand-off' if req.hand_off else 'continue'}",
                            status_code=303)


FORKS_API_ROUTES = (
    Api("POST", "/api/v1/channels/fork", api_channels_fork, body=Fork,
        scopes=writes("body.source_channel_id", "body.new_channel_id")),
    Api("GET", "/api/v1/channels/{channel_id}/forks", api_channels_forks, scopes=reads(P)),
    Api("GET", "/api/v1/channels/{channel_id}/receipt", api_channels_receipt, scopes=reads(P)),
    Api("GET", "/api/v1/channels/{channel_id}/fork-tree", api_channels_fork_tree, scopes=reads(P)),
    Api("GET", "/api/v1/channels/{channel_id}/savings", api_channels_savings, scopes=reads(P)),
)


FORKS_PAGE_ROUTES = (
    ("GET", "/runs/{channel_id}/tree", page_tree),
    ("POST", "/runs/{channel_id}/fork", page_fork),
)


def fork_channels(req: Fork) -> Optional[tuple]:
    """The channels a fork writes: its source's and its own; a handed-off fork's job goes to a channel
    of its own (an event hook's), so that one takes the instance's lock."""
    return None if req.hand_off else (req.source_channel_id, req.new_channel_id)


FORKS = declare(Region(
    "forks", features=("forks",), routes=FORKS_API_ROUTES, pages=FORKS_PAGE_ROUTES, lone_writes=(fork_channel,),
    channel_writes=((fork_channel, fork_channels),)))


# =============================================================================
# Diff and outcome: records
# =============================================================================

class PairQuery(Record):
    left: ChannelId
    right: ChannelId


class SetOutcome(Record):
    outcome: Literal[OUTCOMES]
    score: Optional[float] = None


class DiffPageQuery(Record):
    left: PageText = ""
    right: PageText = ""


class StateAt(Answer):
    channel_id: str
    cursor: Optional[int]
    state: Json


class Ancestor(Answer):
    channel_id: str
    parent_channel_id: Optional[str]
    forked_at_cursor: Optional[int]
    display_name: Optional[str]
    reason: Optional[str]


class DiffEntry(Answer):
    path: list[str]
    kind: Literal["added", "removed", "changed"]
    left: Json
    right: Json


class ChannelDiff(Answer):
    left_channel_id: str
    right_channel_id: str
    left: StateAt
    right: StateAt
    common: Optional[StateAt]
    left_diverged_at_cursor: Optional[int]
    right_diverged_at_cursor: Optional[int]
    entries: list[DiffEntry]
    truncated: bool
    entry_count_total: int
    max_entries: int


class ToolSummary(Answer):
    key_name: str
    tool_name: str
    status: str


class ToolChange(Answer):
    key_name: str
    left: ToolSummary
    right: ToolSummary


class ToolDiff(Answer):
    only_left: list[ToolSummary]
    only_right: list[ToolSummary]
    changed: list[ToolChange]


class OutputDiff(Answer):
    left: Json
    right: Json
    entries: list[DiffEntry]


class RunFigures(Answer):
    """Counts and duration of a run; tokens and cost summed from step payloads that report them."""

    event_count: int
    step_count: int
    tool_calls: int
    duration_seconds: float
    tokens: float
    cost: float


class FiguresDiff(Answer):
    left: RunFigures
    right: RunFigures
    delta: RunFigures


class Comparison(Answer):
    left_channel_id: str
    right_channel_id: str
    state_diff: ChannelDiff
    manifest_diff: list[DiffEntry]
    tool_diff: ToolDiff
    output_diff: OutputDiff
    metrics: FiguresDiff


class OutcomeAnswer(Done, kw_only=True):
    channel_id: str
    outcome: Optional[str]
    result_score: Optional[float]


class Promotion(Done, kw_only=True):
    replayed: bool
    parent_channel_id: str
    child_channel_id: str
    event: Event
    state_version: Optional[int]


class Trail(Answer):
    channel_id: str
    origin_run_id: str
    ancestry: list[Ancestor]
    boundary: Optional[StateAt]
    executions: list[Execution]


# =============================================================================
# Diff and outcome: diff, compare, the decision trail, outcome, promote
# =============================================================================

def diff_values(left: Json, right: Json, path: tuple = ()) -> list[DiffEntry]:
    """Keys/indexes only on the right are added, only on the left removed, on both but unequal changed."""
    if isinstance(left, dict) and isinstance(right, dict):
        entries = []
        for key in sorted(set(left) | set(right), key=str):
            sub = (*path, str(key))
            if key not in left:
                entries.append(DiffEntry(path=list(sub), kind="added", left=None, right=right[key]))
            elif key not in right:
                entries.append(DiffEntry(path=list(sub), kind="removed", left=left[key], right=None))
            else:
                entries += diff_values(left[key], right[key], sub)
        return entries
    if isinstance(left, list) and isinstance(right, list):
        entries = []
        for i in range(max(len(left), len(right))):
            sub = (*path, str(i))
            if i >= len(left):
                entries.append(DiffEntry(path=list(sub), kind="added", left=None, right=right[i]))
            elif i >= len(right):
                entries.append(DiffEntry(path=list(sub), kind="removed", left=left[i], right=None))
            else:
                entries += diff_values(left[i], right[i], sub)
        return entries
    if type(left) is type(right) and left == right:
        return []
    return [DiffEntry(path=list(path), kind="changed", left=left, right=right)]


def common_ancestor(conn: Conn, left_id: str, right_id: str) -> dict:
    """The lowest common ancestor of two channels and the cursor on it where each side left."""
    left_chain, right_chain = lineage(conn, left_id), lineage(conn, right_id)
    right_by_id = {row["id"]: leave for row, leave in right_chain}
    for row, left_leave in left_chain:
        if row["id"] in right_by_id:
            right_leave = right_by_id[row["id"]]
            shared = min((c for c in (left_leave, right_leave) if c is not None), default=None)
            return {"channel_id": row["id"], "cursor": shared, "left": left_leave, "right": right_leave}
    return {}


def diff_channels(conn: Conn, left_id: str, right_id: str) -> ChannelDiff:
    """GET /channels/diff: latest states compared, plus the state both sides share."""
    left, right = latest_state(conn, left_id), latest_state(conn, right_id)
    ancestor = common_ancestor(conn, left_id, right_id)
    common = None
    if ancestor:
        at = state_row_at(conn, ancestor["channel_id"], ancestor["cursor"])
        cursor = ancestor["cursor"] if ancestor["cursor"] is not None else (at["cursor"] if at else 0)
        common = StateAt(channel_id=ancestor["channel_id"], cursor=cursor, state=state_value(conn, at) if at else None)
    entries = diff_values(left.state, right.state)
    return ChannelDiff(
        left_channel_id=left_id, right_channel_id=right_id,
        left=StateAt(channel_id=left_id, cursor=left.cursor, state=left.state),
        right=StateAt(channel_id=right_id, cursor=right.cursor, state=right.state),
        common=common,
        left_diverged_at_cursor=ancestor.get("left"), right_diverged_at_cursor=ancestor.get("right"),
        entries=entries[:DIFF_MAX_ENTRIES], truncated=len(entries) > DIFF_MAX_ENTRIES,
        entry_count_total=len(entries), max_entries=DIFF_MAX_ENTRIES)


def decision_trail(conn: Conn, channel_id: str, reach: "Reach") -> Trail:
    """A run's ancestry (an ancestor `reach` does not see keeps its id, which the fork's own record
    holds, and nothing else of its own), the state it forked from, and its tool executions."""
    chain = lineage(conn, channel_id)
    row = chain[0][0]
    boundary = None
    if row["parent_id"] is not None:
        at = state_row_at(conn, row["parent_id"], row["resolved_cursor"]) if row["restorable"] else None
        boundary = StateAt(channel_id=row["parent_id"], cursor=row["resolved_cursor"],
                           state=state_value(conn, at) if at else None)
    return Trail(
        channel_id=channel_id, origin_run_id=row["origin_id"],
        ancestry=[Ancestor(channel_id=r["id"], parent_channel_id=r["parent_id"], forked_at_cursor=r["resolved_cursor"],
                           display_name=r["display_name"] if reach.sees(r["id"]) else None,
                           reason=r["reason"] if reach.sees(r["id"]) else None) for r, _ in chain],
        boundary=boundary, executions=channel_executions(conn, channel_id))


def run_figures(conn: Conn, channel_id: str, tool_calls: int) -> RunFigures:
    row = stretch_row(conn, channel_id, None)              # usage as the one rule kept it (usage_of)
    cost = 0 if row["cost"] is None else round(float(row["cost"]), 9)
    duration = (millis_between(row["first"], row["last"]) or 0) / 1000
    return RunFigures(event_count=row["n"], step_count=row["steps"], tool_calls=tool_calls, duration_seconds=duration,
                      tokens=int(row["tin"]) + int(row["tout"]), cost=cost)


def last_output(conn: Conn, channel_id: str) -> Json:
    row = conn.execute("SELECT payload FROM events WHERE channel_id = ? AND step_number IS NOT NULL"
                       " ORDER BY cursor DESC LIMIT 1", (channel_id,)).fetchone()
    payload = load(row["payload"]) if row else None
    return payload.get("output") if isinstance(payload, dict) else None


def tool_summary(execution: Execution) -> ToolSummary:
    return ToolSummary(key_name=execution.key_name, tool_name=execution.tool_name, status=execution.status)


def figures_delta(left: RunFigures, right: RunFigures) -> RunFigures:
    return RunFigures(**{name: getattr(right, name) - getattr(left, name) for name in RunFigures.__struct_fields__})


def compare_channels(conn: Conn, left_id: str, right_id: str) -> Comparison:
    left_meta, right_meta = get_metadata(conn, left_id), get_metadata(conn, right_id)
    left_tools, right_tools = ({e.key_name: tool_summary(e) for e in channel_executions(conn, cid)}
                               for cid in (left_id, right_id))
    left_metrics, right_metrics = run_figures(conn, left_id, len(left_tools)), run_figures(conn, right_id, len(right_tools))
    outputs = (last_output(conn, left_id), last_output(conn, right_id))
    return Comparison(
        left_channel_id=left_id, right_channel_id=right_id,
        state_diff=diff_channels(conn, left_id, right_id),
        manifest_diff=diff_values(left_meta.manifest, right_meta.manifest),
        tool_diff=ToolDiff(
            only_left=[t for k, t in left_tools.items() if k not in right_tools],
            only_right=[t for k, t in right_tools.items() if k not in left_tools],
            changed=[ToolChange(key_name=k, left=t, right=right_tools[k])
                     for k, t in left_tools.items() if k in right_tools and t != right_tools[k]]),
        output_diff=OutputDiff(left=outputs[0], right=outputs[1], entries=diff_values(*outputs)),
        metrics=FiguresDiff(left=left_metrics, right=right_metrics, delta=figures_delta(left_metrics, right_metrics)))


def set_outcome(tx: Tx, channel_id: str, outcome: str, score: Optional[float]) -> OutcomeAnswer:
    require_channel(tx.conn, channel_id)
    tx.conn.execute("UPDATE channels SET outcome = ?, result_score = COALESCE(?, result_score), updated_at = ?"
                    " WHERE id = ?", (outcome, score, tx.ts, channel_id))
    row = channel_by_id(tx.conn, channel_id)
    return OutcomeAnswer(channel_id=channel_id, outcome=row["outcome"], result_score=row["result_score"])


def promote_channel(tx: Tx, child_id: str) -> Promotion:
    """Merge a fork into its parent, append-only: the parent gets a `channel.promoted` event and a
    new state version equal to the fork's latest state (its history is untouched); the fork's
    outcome becomes `promoted`. Promoting the same fork state again replays the first promotion.
    """
    child = require_channel(tx.conn, child_id)
    parent_id = child["parent_id"]
    if parent_id is None:
        raise BadRequest(f"channel {child_id} is not a fork; only a fork can be promoted into its parent")
    latest = state_row_at(tx.conn, child_id, None)
    latest_version = latest["version"] if latest else None
    if child["promoted_event_id"] is not None and child["promoted_version"] == latest_version:
        event = event_of(present(row_where(tx.conn, "events", id=child["promoted_event_id"]),
                                 lambda: NotFound("promotion event is gone")))
        version = tx.conn.execute("SELECT MAX(version) FROM states WHERE channel_id = ? AND cursor = ?",
                                  (parent_id, event.cursor)).fetchone()[0]
        return Promotion(replayed=True, parent_channel_id=parent_id, child_channel_id=child_id, event=event,
                         state_version=version)
    event = append_event(tx, parent_id, "channel.promoted", {
        "child_channel_id": child_id, "child_state_version": latest_version,
        "child_latest_cursor": child["last_cursor"],
    })
    version = insert_state(tx, parent_id, event.cursor, whole_copy(tx.conn, latest), latest["sha256"],
                           latest["status"]) if latest else None
    tx.conn.execute("UPDATE channels SET outcome = 'promoted', promoted_event_id = ?, promoted_version = ?,"
                    " updated_at = ? WHERE id = ?", (event.id, latest_version, tx.ts, child_id))
    return Promotion(replayed=False, parent_channel_id=parent_id, child_channel_id=child_id, event=event,
                     state_version=version)


# =============================================================================
# Diff and outcome: handlers, routes and the diff page
# =============================================================================

async def api_channels_diff(request: Request, query: PairQuery) -> ChannelDiff:
    """Compare the latest states of two runs, with the state they share."""
    return await db_of(request).read(diff_channels, query.left, query.right)


async def api_channels_compare(request: Request, query: PairQuery) -> Comparison:
    """Compare two runs side by side: state, manifest, tool calls, outputs and figures."""
    return await db_of(request).read(compare_channels, query.left, query.right)


async def api_channels_trail(request: Request, path) -> Trail:
    """A run's decision trail: its ancestry, the state it forked from and the tool executions on it."""
    return await db_of(request).read(decision_trail, path.channel_id, reach_of(request))


async def api_channels_outcome(request: Request, path, body: SetOutcome) -> OutcomeAnswer:
    """Set a run's outcome (and score)."""
    return await db_of(request).write(set_outcome, path.channel_id, body.outcome, body.score)


async def api_channels_promote(request: Request, path, body: Empty) -> Promotion:
    """Promote a fork into its parent: the parent gets the fork's latest state as a new version."""
    return await db_of(request).write(promote_channel, path.channel_id)


async def page_diff(request: Request) -> Response:
    query = page_query(request, DiffPageQuery)
    left, right = query.left, query.right
    diff, error, savings = None, None, None
    if left and right:
        try:
            diff = await db_of(request).read(diff_channels, valid_channel(left, "left"), valid_channel(right, "right"))
            savings = [("Left", await db_of(request).read(fork_saving, left)),
                       ("Right", await db_of(request).read(fork_saving, right))]
        except ActaeError as exc:
            error = exc.message
    channels = await db_of(request).read(list_channels)
    return render(request, "diff.html", {"title": "Diff", "left": left, "right": right, "channels": channels[:1000],
                                         "diff": diff, "error": error,
                                         "savings": savings if savings and any(f for _, f in savings) else None},
                    status=400 if error else 200)


DIFF_API_ROUTES = (
    Api("GET", "/api/v1/channels/diff", api_channels_diff, query=PairQuery, scopes=reads("query.left", "query.right")),
    Api("GET", "/api/v1/channels/compare", api_channels_compare, query=PairQuery,
        scopes=reads("query.left", "query.right")),
    Api("GET", "/api/v1/channels/{channel_id}/trail", api_channels_trail, scopes=reads(P)),
    Api("PATCH", "/api/v1/channels/{channel_id}/outcome", api_channels_outcome, body=SetOutcome, scopes=writes(P)),
    Api("POST", "/api/v1/channels/{channel_id}/promote", api_channels_promote, body=Empty, body_optional=True,
        scopes=writes(P, "parent.channel_id")),
)


DIFF_PAGE_ROUTES = (
    ("GET", "/diff", page_diff),
)

DIFF = declare(Region("diff and outcome", routes=DIFF_API_ROUTES, pages=DIFF_PAGE_ROUTES,
                      nav=(NavLink("Diff", "/diff", "diff", place=30),)))


# =============================================================================
# Ledger: records
# =============================================================================
# --- the execution ledger ---------------------------------------------------------------


class Claim(Record):
    channel_id: ChannelId
    key_name: Annotated[str, Meta(min_length=1, max_length=KEY_NAME_MAX_BYTES)]
    tool_name: Name
    params: Document = None
    dedup_fields: Optional[Annotated[list[Label], Meta(max_length=LIST_MAX)]] = None
    lease_seconds: Lease = LEASE_DEFAULT
    emit_replay_event: bool = False
    actor: Optional[Label] = None

    def __post_init__(self):
        if len(self.key_name.encode("utf-8", "surrogatepass")) > KEY_NAME_MAX_BYTES:   # bytes, not characters
            raise ValueError(f"key_name must be at most {KEY_NAME_MAX_BYTES} bytes as UTF-8")


class ClaimToken(Record):
    claim_token: Optional[Token] = None


class Complete(ClaimToken):
    result: Document = None


class Fail(ClaimToken):
    message: Optional[LongText] = None
    error_type: Optional[Label] = None
    stack: Optional[LongText] = None


class Heartbeat(ClaimToken):
    lease_seconds: Optional[Lease] = None


class ExecutionsQuery(Record):
    channel_id: Optional[ChannelId] = None
    limit: Annotated[int, Meta(ge=1, le=EXECUTIONS_LIMIT_MAX)] = 50


class LedgerPageQuery(Record):
    channel_id: Optional[PageText] = None
    tool: Optional[PageText] = None
    status: Optional[PageText] = None       # one of EXECUTION_STATES
    since: Optional[PageText] = None        # one of LEDGER_SINCE
    before: Optional[PageText] = None       # the next page's token


class ExecutionAnswer(Answer):
    execution: Execution


class Executions(Answer):
    executions: list[Execution]


# =============================================================================
# Ledger: the execution ledger and fork tool policies
# =============================================================================

def execution_of(row: Row) -> Execution:
    return Execution(
        id=row["id"], channel_id=row["channel_id"], key_name=row["key_name"], tool_name=row["tool_name"],
        status=row["status"], attempts=row["attempts"], lease_until=row["lease_until"],
        started_cursor=row["started_cursor"], completed_cursor=row["completed_cursor"],
        started_event_id=row["started_event_id"], completed_event_id=row["completed_event_id"],
        replay_emitted=bool(row["replay_emitted"]), params=load(row["params"]), result=load(row["result"]),
        error=load(row["error"]), inherited_from=row["inherited_from"], created_at=row["created_at"],
        updated_at=row["updated_at"], completed_at=row["completed_at"])


def channel_executions(conn: Conn, channel_id: str) -> list[Execution]:
    return [execution_of(r) for r in rows_where(conn, "executions", "created_at, id", channel_id=channel_id)]


def executions_schema(w: SchemaWords) -> str:
    """The ledger's table (in the first step, as it was before the ledger was a region)."""
    return f"""
    -- The execution ledger: one row per (channel, key); the unique index is the idempotency.
    CREATE TABLE executions (
        id                  TEXT PRIMARY KEY,
        channel_id          TEXT NOT NULL REFERENCES channels(id),
        key_name            TEXT NOT NULL,
        tool_name           TEXT NOT NULL,
        request_hash        TEXT NOT NULL,
        params              TEXT,
        -- running: claimed, the token holder may complete it; completed: result stored, claims
        -- replay it; failed (error stored) and cancelled (released by its owner): a claim takes it
        -- over. The SDK's vocabulary also has interrupted and expired; this server never writes
        -- them (a lapsed lease stays 'running' until someone reclaims it), but a claim would take
        -- them over like 'failed'.
        status              TEXT NOT NULL CHECK (status IN ({sql_list(EXECUTION_STATES)})),
        claim_token         TEXT,
        lease_seconds       {w.integer} NOT NULL,
        lease_until         TEXT,
        attempts            {w.integer} NOT NULL DEFAULT 0,
        result              TEXT,
        error               TEXT,
        started_cursor      {w.integer},
        completed_cursor    {w.integer},
        started_event_id    TEXT,
        completed_event_id  TEXT,
        replay_emitted      {w.integer} NOT NULL DEFAULT 0 CHECK (replay_emitted IN (0, 1)),
        inherited_from      TEXT,             -- ancestor execution replayed onto a fork
        created_at          TEXT NOT NULL,
        updated_at          TEXT NOT NULL,
        completed_at        TEXT,
        UNIQUE (channel_id, key_name)
    );
    CREATE INDEX executions_by_time ON executions (channel_id, created_at);
    """


def execution_identity(tool_name: str, params: Json, dedup_fields: Optional[list]) -> str:
    """Request hash over tool + params, projected on `dedup_fields` so volatile fields don't count."""
    if dedup_fields is not None and isinstance(params, dict):
        params = {k: params[k] for k in dedup_fields if k in params}
    return request_hash({"tool": tool_name, "params": params})


def require_execution(conn: Conn, execution_id: str) -> Row:
    return fetch_or_raise(conn, lambda: execution_not_found(execution_id), "SELECT * FROM executions WHERE id = ?",
                          execution_id)


def lease_expired(row: Row, now: datetime) -> bool:
    return row["lease_until"] is None or row["lease_until"] <= iso(now)


def effective_policy(policies: Optional[dict], tool_name: str) -> str:
    policies = policies or {}
    return policies.get(tool_name) or policies.get("*") or "auto"


def ancestor_execution(conn: Conn, channel: Row, key_name: str) -> Optional[tuple]:
    """(row, boundary cursor) of the nearest ancestor that has this key, or None."""
    for ancestor, boundary in lineage(conn, channel["id"])[1:]:
        row = row_where(conn, "executions", channel_id=ancestor["id"], key_name=key_name)
        if row is not None:
            return row, boundary
    return None


def lifecycle_event(tx: Tx, row_id: str, channel_id: str, event_type: str, payload: dict,
                    depends_on: Optional[str] = None) -> Event:
    return append_event(tx, channel_id, event_type, payload, actor="ledger",
                        metadata={"execution_id": row_id}, depends_on=depends_on)


def start_attempt(tx: Tx, req: Claim, hashed: str, existing: Optional[Row]) -> Claimed:
    """A new owner for (channel, key): a fresh token and lease, `tool.started` on the channel."""
    token = secrets.token_urlsafe(24)
    lease_until = iso(tx.now + timedelta(seconds=req.lease_seconds))
    execution_id = existing["id"] if existing else str(uuid.uuid4())
    attempts = (existing["attempts"] if existing else 0) + 1
    started = lifecycle_event(tx, execution_id, req.channel_id, "tool.started", {
        "execution_id": execution_id, "key_name": req.key_name, "tool_name": req.tool_name,
        "attempt": attempts, "actor": req.actor,
    })
    if existing is None:
        tx.conn.execute(
            "INSERT INTO executions (id, channel_id, key_name, tool_name, request_hash, params, status, claim_token,"
            " lease_seconds, lease_until, attempts, started_cursor, started_event_id, created_at, updated_at)"
            " VALUES (?, ?, ?, ?, ?, ?, 'running', ?, ?, ?, 1, ?, ?, ?, ?)",
            (execution_id, req.channel_id, req.key_name, req.tool_name, hashed, dump(req.params), token,
             req.lease_seconds, lease_until, started.cursor, started.id, tx.ts, tx.ts))
    else:
        tx.conn.execute(
            "UPDATE executions SET status = 'running', claim_token = ?, lease_seconds = ?, lease_until = ?,"
            " attempts = ?, started_cursor = ?, started_event_id = ?, error = NULL, updated_at = ? WHERE id = ?",
            (token, req.lease_seconds, lease_until, attempts, started.cursor, started.id, tx.ts, execution_id))
    row = require_execution(tx.conn, execution_id)
    return Claimed(status="reclaimed" if existing else "claimed", execution=execution_of(row), claim_token=token)


def replay_completed(tx: Tx, row: Row, emit_event: bool) -> Claimed:
    if emit_event and not row["replay_emitted"]:
        lifecycle_event(tx, row["id"], row["channel_id"], "tool.replayed",
                        {"execution_id": row["id"], "key_name": row["key_name"], "tool_name": row["tool_name"]},
                        depends_on=row["completed_event_id"])
        tx.conn.execute("UPDATE executions SET replay_emitted = 1, updated_at = ? WHERE id = ?", (tx.ts, row["id"]))
        row = require_execution(tx.conn, row["id"])
    return Claimed(status="replayed", execution=execution_of(row), result=load(row["result"]))


@dataclass(frozen=True)
class Refused:
    """A write that commits (its audit event stays) and still answers the caller with an error."""

    error: ActaeError


def refuse_by_policy(tx: Tx, req: Claim, policy: str, reason: str) -> Refused:
    """The refusal is recorded (`tool.blocked` commits) even though the caller gets a 409."""
    lifecycle = {"policy": policy, "tool_name": req.tool_name, "key_name": req.key_name, "reason": reason}
    append_event(tx, req.channel_id, "tool.blocked", lifecycle, actor="ledger")
    return Refused(Conflict("fork_tool_blocked", f"fork tool policy '{policy}' refused {req.tool_name} ({reason})"))


def copy_inherited(tx: Tx, req: Claim, source: Row) -> Claimed:
    """Replay an ancestor's completed effect onto the fork without running it (no tool.started).

    The copy counts as completed at the fork's first cursor: the effect is part of everything the
    fork inherited, so a fork of this fork inherits it too, whatever its boundary.
    """
    execution_id = str(uuid.uuid4())
    tx.conn.execute(
        "INSERT INTO executions (id, channel_id, key_name, tool_name, request_hash, params, status, lease_seconds,"
        " attempts, result, completed_cursor, inherited_from, created_at, updated_at, completed_at)"
        " VALUES (?, ?, ?, ?, ?, ?, 'completed', ?, 0, ?, 1, ?, ?, ?, ?)",
        (execution_id, req.channel_id, req.key_name, source["tool_name"], source["request_hash"],
         source["params"], source["lease_seconds"], source["result"], source["id"], tx.ts, tx.ts, tx.ts))
    return replay_completed(tx, require_execution(tx.conn, execution_id), req.emit_replay_event)


def claim_on_fork(tx: Tx, req: Claim, hashed: str, channel: Row) -> Union[Claimed, Refused, None]:
    """Apply the fork's tool policy to a first claim; None means 'run it live as usual'."""
    if (req.key_name, req.tool_name) == SESSION_FENCE:
        return None                     # AgentSession's writer lock, not a side effect
    policy = effective_policy(load(channel["tool_policies"]), req.tool_name)
    if policy == "live":
        return None
    if policy == "block":
        # Even an exact inherited match is refused: a payment must never re-fire on a counterfactual.
        return refuse_by_policy(tx, req, policy, "blocked")
    found = ancestor_execution(tx.conn, channel, req.key_name)
    row, boundary = found or (None, None)
    if (row is not None and row["request_hash"] == hashed and row["status"] == "completed"
            and row["completed_cursor"] is not None and row["completed_cursor"] <= boundary):
        return copy_inherited(tx, req, row)
    if policy == "auto":
        return None
    return refuse_by_policy(tx, req, policy, "mismatch" if row is not None and row["request_hash"] != hashed else "miss")


def claim_execution(tx: Tx, req: Claim) -> Union[Claimed, Refused]:
    """POST /executions/claim: claimed | replayed | in_progress | reclaimed, or Refused on a fork."""
    ensure_channel(tx, req.channel_id)
    hashed = execution_identity(req.tool_name, req.params, req.dedup_fields)
    row = row_where(tx.conn, "executions", channel_id=req.channel_id, key_name=req.key_name)
    if row is None:
        channel = channel_by_id(tx.conn, req.channel_id)
        if channel["parent_id"] is not None:
            decided = claim_on_fork(tx, req, hashed, channel)
            if decided is not None:
                return decided
        return start_attempt(tx, req, hashed, None)
    if row["request_hash"] != hashed:
        raise Conflict("idempotency_key_mismatch",
                       f"key {req.key_name} on {req.channel_id} was claimed with a different request "
                       "(tool or params differ); use a new key or the same request")
    if row["status"] == "completed":
        return replay_completed(tx, row, req.emit_replay_event)
    if row["status"] == "running" and not lease_expired(row, tx.now):
        return Claimed(status="in_progress", execution=execution_of(row))
    return start_attempt(tx, req, hashed, row)


def owned_execution(tx: Tx, execution_id: str, token: Optional[str]) -> Row:
    row = require_execution(tx.conn, execution_id)
    if token is None or row["claim_token"] is None or not same_secret(token, row["claim_token"]):
        raise Conflict("execution_not_owned", f"execution {execution_id} is not owned by this claim token "
                                              "(stale, missing, or taken over after its lease expired)")
    return row


def finish_execution(tx: Tx, execution_id: str, token: Optional[str], status: str,
                     result: Json = None, error: Json = None) -> Execution:
    """Complete or fail a running execution; repeating the same terminal call returns it unchanged."""
    row = owned_execution(tx, execution_id, token)
    if row["status"] == status:
        return execution_of(row)
    if row["status"] != "running":
        raise Conflict("execution_not_owned", f"execution {execution_id} is {row['status']}, not running")
    event_type = "tool.completed" if status == "completed" else "tool.failed"
    event = lifecycle_event(tx, execution_id, row["channel_id"], event_type, {
        "execution_id": execution_id, "key_name": row["key_name"], "tool_name": row["tool_name"],
        **({"result": result} if status == "completed" else {"error": error}),
    }, depends_on=row["started_event_id"])
    tx.conn.execute(
        "UPDATE executions SET status = ?, result = ?, error = ?, completed_cursor = ?, completed_event_id = ?,"
        " completed_at = ?, lease_until = NULL, updated_at = ? WHERE id = ?",
        (status, dump(result), dump(error), event.cursor, event.id, tx.ts, tx.ts, execution_id))
    return execution_of(require_execution(tx.conn, execution_id))


def heartbeat_execution(tx: Tx, execution_id: str, token: Optional[str], lease_seconds: Optional[int]) -> Execution:
    row = owned_execution(tx, execution_id, token)
    if row["status"] != "running":
        raise Conflict("execution_not_owned", f"execution {execution_id} is {row['status']}, not running")
    seconds = lease_seconds or row["lease_seconds"]
    tx.conn.execute("UPDATE executions SET lease_until = ?, lease_seconds = ?, updated_at = ? WHERE id = ?",
                    (iso(tx.now + timedelta(seconds=seconds)), seconds, tx.ts, execution_id))
    return execution_of(require_execution(tx.conn, execution_id))


def cancel_execution(tx: Tx, execution_id: str, token: Optional[str]) -> Execution:
    """Release a claim (no lifecycle event); the next claim of the key takes it over.

    A running claim can only be released by its owner: otherwise a second worker could cancel the
    first one's claim and run the effect beside it.
    """
    row = require_execution(tx.conn, execution_id)
    must_own = row["status"] == "running"            # a live claim: only its token may release it
    if must_own or token is not None:                # any token that is given must be the current one
        row = owned_execution(tx, execution_id, token)
    if row["status"] in EXECUTION_RETRYABLE:
        tx.conn.execute("UPDATE executions SET status = 'cancelled', lease_until = NULL, updated_at = ? WHERE id = ?",
                        (tx.ts, execution_id))
    return execution_of(require_execution(tx.conn, execution_id))


def list_executions(conn: Conn, channel_id: Optional[str], limit: int) -> list[Execution]:
    """Newest first; claims made in the same millisecond on a channel by the cursor of their start."""
    where = Where().add_if(channel_id, "channel_id = ?")
    rows = conn.execute(f"SELECT * FROM executions{where} ORDER BY created_at DESC, started_cursor DESC, id"
                        " LIMIT ?", (*where.args, limit))
    return [execution_of(r) for r in rows.fetchall()]


def delete_execution(tx: Tx, execution_id: str) -> DeletedId:
    require_execution(tx.conn, execution_id)
    tx.conn.execute("DELETE FROM executions WHERE id = ?", (execution_id,))
    return DeletedId(deleted=execution_id)


# A run that has not completed and whose last event is one of these is stuck on a refusal or a human.
LEDGER_SINCE = {"1h": timedelta(hours=1), "24h": timedelta(days=1), "7d": timedelta(days=7)}


def ledger_page(conn: Conn, filters: dict, before: Optional[str]) -> tuple:
    """One page of ledger rows, newest first, filtered by run, tool, status and age."""
    where = Where().add_if(filters.get("channel_id"), "channel_id = ?").add_if(filters.get("tool"), "tool_name = ?")
    where.add_if(filters.get("status"), "status = ?").add_if(filters.get("since_at"), "created_at >= ?")
    if before:
        where.add(*after_page_token(before, "created_at", "id"))
    rows = conn.execute(f"SELECT * FROM executions{where} ORDER BY created_at DESC, id DESC LIMIT ?",
                        (*where.args, RUNS_PAGE_SIZE + 1)).fetchall()
    executions = [with_marks(execution_of(r)) for r in rows[:RUNS_PAGE_SIZE]]
    tools = [r[0] for r in conn.execute("SELECT DISTINCT tool_name FROM executions ORDER BY tool_name LIMIT 200")]
    return executions, blocked_attempts(conn, filters.get("channel_id")), next_page_token(rows, "created_at"), tools


# =============================================================================
# Ledger: handlers, routes and the ledger page
# =============================================================================

async def api_executions_claim(request: Request, body: Claim) -> Claimed:
    """Claim a tool call before running it, so its side effect never runs twice (a replay gets the stored result)."""
    outcome = await db_of(request).write(claim_execution, body)
    if isinstance(outcome, Refused):
        raise outcome.error
    return outcome


async def api_executions_complete(request: Request, path, body: Complete) -> ExecutionAnswer:
    """Complete a claimed tool execution with its result."""
    execution = await db_of(request).write(finish_execution, path.execution_id, body.claim_token, "completed",
                                           body.result)
    return ExecutionAnswer(execution=execution)


async def api_executions_fail(request: Request, path, body: Fail) -> ExecutionAnswer:
    """Mark a claimed tool execution failed, with its error."""
    error = {"message": body.message or "", "error_type": body.error_type, "stack": body.stack}
    execution = await db_of(request).write(finish_execution, path.execution_id, body.claim_token, "failed",
                                           None, error)
    return ExecutionAnswer(execution=execution)


async def api_executions_heartbeat(request: Request, path, body: Heartbeat) -> ExecutionAnswer:
    """Extend the lease of a claimed tool execution."""
    execution = await db_of(request).write(heartbeat_execution, path.execution_id, body.claim_token,
                                           body.lease_seconds)
    return ExecutionAnswer(execution=execution)


async def api_executions_cancel(request: Request, path, body: ClaimToken) -> ExecutionAnswer:
    """Release a claimed tool execution without completing it; the next claim takes it over."""
    return ExecutionAnswer(execution=await db_of(request).write(cancel_execution, path.execution_id, body.claim_token))


async def api_executions_get(request: Request, path) -> ExecutionAnswer:
    """One tool execution from the ledger."""
    return ExecutionAnswer(execution=execution_of(await db_of(request).read(require_execution, path.execution_id)))


async def api_executions_list(request: Request, query: ExecutionsQuery) -> Executions:
    """The tool executions in the ledger, newest first (one run's, with channel_id)."""
    return Executions(executions=await db_of(request).read(list_executions, query.channel_id, query.limit))


async def api_executions_delete(request: Request, path) -> DeletedId:
    """Delete one tool execution from the ledger."""
    return await db_of(request).write(delete_execution, path.execution_id)


def ledger_filters(query: LedgerPageQuery) -> dict:
    filters = {"channel_id": query.channel_id, "tool": query.tool, "status": query.status, "since": query.since}
    if filters["channel_id"]:
        valid_channel(filters["channel_id"])
    if filters["status"] and filters["status"] not in EXECUTION_STATES:
        raise BadRequest(f"status must be one of {', '.join(EXECUTION_STATES)}")
    if filters["since"] and filters["since"] not in LEDGER_SINCE:
        raise BadRequest(f"since must be one of {', '.join(LEDGER_SINCE)}")
    filters["since_at"] = iso(utc_now() - LEDGER_SINCE[filters["since"]]) if filters["since"] else None
    return filters


async def page_ledger(request: Request) -> Response:
    query = page_query(request, LedgerPageQuery)
    filters = ledger_filters(query)
    executions, blocked, before, tools = await db_of(request).read(ledger_page, filters, query.before)
    shown = {k: v for k, v in filters.items() if v and k != "since_at"}
    next_url = f"/ledger?{urlencode({**shown, 'before': before})}" if before else None
    return render(request, "ledger.html", {
        "title": "Ledger", "executions": executions, "blocked": blocked, "channel_id": filters["channel_id"] or "",
        "tool": filters["tool"] or "", "status": filters["status"] or "", "since": filters["since"] or "",
        "tools": tools, "statuses": list(EXECUTION_STATES), "since_choices": list(LEDGER_SINCE),
        "filtered": bool(shown), "next_url": next_url})


LEDGER_API_ROUTES = (
    Api("POST", "/api/v1/executions/claim", api_executions_claim, body=Claim, scopes=writes(B)),
    Api("GET", "/api/v1/executions", api_executions_list, query=ExecutionsQuery, scopes=reads("query.channel_id")),
    Api("GET", "/api/v1/executions/{execution_id}", api_executions_get, scopes=reads("execution.execution_id")),
    Api("DELETE", "/api/v1/executions/{execution_id}", api_executions_delete,
        scopes=deletes("execution.execution_id")),
    Api("POST", "/api/v1/executions/{execution_id}/complete", api_executions_complete, body=Complete,
        body_optional=True, scopes=writes("execution.execution_id")),
    Api("POST", "/api/v1/executions/{execution_id}/fail", api_executions_fail, body=Fail, body_optional=True,
        scopes=writes("execution.execution_id")),
    Api("POST", "/api/v1/executions/{execution_id}/heartbeat", api_executions_heartbeat, body=Heartbeat,
        body_optional=True, scopes=writes("execution.execution_id")),
    Api("POST", "/api/v1/executions/{execution_id}/cancel", api_executions_cancel, body=ClaimToken,
        body_optional=True, scopes=writes("execution.execution_id")),
)


LEDGER_PAGE_ROUTES = (
    ("GET", "/ledger", page_ledger),
)

LEDGER = declare(Region(
    "ledger", features=("ledger",), schema=(SchemaPart(1, executions_schema),), routes=LEDGER_API_ROUTES, pages=LEDGER_PAGE_ROUTES,
    nav=(NavLink("Ledger", "/ledger", "ledger", place=20),),
    lone_writes=(claim_execution, finish_execution, heartbeat_execution),
    channel_writes=((claim_execution, lambda req: (req.channel_id,)),)))


# =============================================================================
# Wake-ups: records
# =============================================================================
# --- wake-ups ---------------------------------------------------------------------------


class ScheduleWakeup(Record):
    channel_id: ChannelId
    run_at: Timestamp
    payload: Optional[JsonObject] = None

    def __post_init__(self):
        check_utc(self.run_at)


class WakeupsQuery(Record):
    channel_id: Optional[ChannelId] = None
    status: Optional[Literal[WAKEUP_STATUSES]] = None


# --- wake-ups and consumer groups ---------------------------------------------------------------


class Wakeup(Answer):
    id: str
    channel_id: str
    run_at: str
    status: Literal[WAKEUP_STATUSES]
    payload: Json
    created_at: str
    executed_at: Optional[str]
    attempts: int
    error: Optional[str]


class Wakeups(Answer):
    wakeups: list[Wakeup]


class WakeupCancelled(Done, kw_only=True):
    wakeup: Wakeup


# =============================================================================
# Wake-ups: stored wake-ups, and the scheduler that fires them across restarts
# =============================================================================

WAKEUP_EVENT = "scheduler.wakeup"      # what a due wake-up appends to its channel


def wakeups_schema(w: SchemaWords) -> str:
    """The wake-ups' table (in the first step, as it was before wake-ups were a region)."""
    return f"""
    -- Scheduled wake-ups: at run_at a `scheduler.wakeup` event is appended to the channel.
    CREATE TABLE wakeups (
        id           TEXT PRIMARY KEY,
        channel_id   TEXT NOT NULL,
        run_at       TEXT NOT NULL,            -- normalised UTC, so it compares as text
        status       TEXT NOT NULL CHECK (status IN ({sql_list(WAKEUP_STATUSES)})),
        payload      TEXT,
        attempts     {w.integer} NOT NULL DEFAULT 0,
        error        TEXT,
        created_at   TEXT NOT NULL,
        executed_at  TEXT
    );
    CREATE INDEX wakeups_due ON wakeups (status, run_at);
    """


def wakeup_of(row: Row) -> Wakeup:
    return Wakeup(id=row["id"], channel_id=row["channel_id"], run_at=row["run_at"], status=row["status"],
                  payload=load(row["payload"]), created_at=row["created_at"], executed_at=row["executed_at"],
                  attempts=row["attempts"], error=row["error"])


def require_wakeup(conn: Conn, wakeup_id: str) -> Row:
    return fetch_or_raise(conn, lambda: NotFound(f"wake-up {wakeup_id} not found"),
                          "SELECT * FROM wakeups WHERE id = ?", wakeup_id)


def schedule_wakeup(tx: Tx, channel_id: str, run_at: str, payload: Optional[dict]) -> Wakeup:
    wakeup_id = str(uuid.uuid4())
    tx.conn.execute("INSERT INTO wakeups (id, channel_id, run_at, status, payload, created_at)"
                    " VALUES (?, ?, ?, 'pending', ?, ?)", (wakeup_id, channel_id, run_at, dump(payload), tx.ts))
    return wakeup_of(require_wakeup(tx.conn, wakeup_id))


def list_wakeups(conn: Conn, channel_id: Optional[str], status: Optional[str]) -> list[Wakeup]:
    where = Where().add_if(channel_id, "channel_id = ?").add_if(status, "status = ?")
    rows = conn.execute(f"SELECT * FROM wakeups{where} ORDER BY run_at, id LIMIT 1000", where.args)
    return [wakeup_of(r) for r in rows.fetchall()]


def cancel_wakeup(tx: Tx, wakeup_id: str) -> WakeupCancelled:
    row = require_wakeup(tx.conn, wakeup_id)
    if row["status"] != "pending":
        raise Conflict("wakeup_not_pending", f"wake-up {wakeup_id} is {row['status']}; only a pending one can be cancelled")
    tx.conn.execute("UPDATE wakeups SET status = 'cancelled' WHERE id = ?", (wakeup_id,))
    return WakeupCancelled(wakeup=wakeup_of(require_wakeup(tx.conn, wakeup_id)))


def fire_due_wakeups(tx: Tx) -> int:
    """Append `scheduler.wakeup` for up to WAKEUP_BATCH due wake-ups; returns how many were due.

    Each fires in its own savepoint: one that cannot be delivered is marked failed with the
    reason, and the others still fire.
    """
    due = tx.conn.execute("SELECT * FROM wakeups WHERE status = 'pending' AND run_at <= ? ORDER BY run_at LIMIT ?",
                          (tx.ts, WAKEUP_BATCH)).fetchall()
    for row in due:
        payload = load(row["payload"])
        tx.conn.execute("SAVEPOINT wakeup")
        appended = len(tx.events)
        try:
            append_event(tx, row["channel_id"], WAKEUP_EVENT,
                         {**(payload if isinstance(payload, dict) else {}), "wakeup_id": row["id"],
                          "run_at": row["run_at"]}, actor="scheduler")
            status, error = "done", None
        except Exception as exc:  # noqa: BLE001 - recorded on the wake-up, which then stops retrying
            if not tx.conn.in_transaction:
                raise
            tx.conn.execute("ROLLBACK TO wakeup")
            del tx.events[appended:]
            status, error = "failed", f"{type(exc).__name__}: {exc}"
        tx.conn.execute("RELEASE wakeup")
        tx.conn.execute("UPDATE wakeups SET status = ?, error = ?, executed_at = ?, attempts = attempts + 1"
                        " WHERE id = ?", (status, error, tx.ts, row["id"]))
    return len(due)


def next_wakeup_at(conn: Conn) -> Optional[str]:
    row = conn.execute("SELECT MIN(run_at) FROM wakeups WHERE status = 'pending'").fetchone()
    return row[0]
def seconds_until(stamp: str) -> float:
    """Seconds from now to a stored timestamp; one that cannot be read counts as a second away."""
    try:
        return (parse_iso(stamp) - utc_now()).total_seconds()
    except ActaeError:
        return 1.0


class Scheduler:
    """Sleeps until the earliest pending wake-up (at most a second), then fires what is due."""

    def __init__(self, db: Database):
        self.db = db
        self._nudged = asyncio.Event()
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 - shutting down must still close the database
                log.exception("the wake-up scheduler had failed")

    def nudge(self) -> None:
        """A new wake-up may be due sooner than the one we sleep for."""
        self._nudged.set()

    async def _run(self) -> None:
        while True:
            self._nudged.clear()
            try:
                upcoming = await self.fire_due()
            except Exception:  # noqa: BLE001 - a failed round is retried; the loop must not die
                log.exception("firing wake-ups failed")
                upcoming = None
            delay = 1.0 if upcoming is None else seconds_until(upcoming)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._nudged.wait(), timeout=min(max(delay, 0.01), 1.0))

    async def fire_due(self) -> Optional[str]:
        """Fire what is due; the next pending wake-up's time. A write only when one is due: the write
        takes the instance lock on PostgreSQL (every server's scheduler looks each second)."""
        upcoming = await self.db.read(next_wakeup_at)
        while upcoming is not None and seconds_until(upcoming) <= 0:
            if await self.db.write(fire_due_wakeups) == 0:
                break                    # due by this clock, not yet by the write's: the next round
            upcoming = await self.db.read(next_wakeup_at)
        return upcoming


# =============================================================================
# Wake-ups: handlers and routes
# =============================================================================

async def api_wakeups_schedule(request: Request, body: ScheduleWakeup) -> Wakeup:
    """Schedule a wake-up of a run at a time (run_at), with a payload."""
    wakeup = await db_of(request).write(schedule_wakeup, body.channel_id, iso(body.run_at), body.payload)
    request.app.services.region(Scheduler).nudge()
    return wakeup


async def api_wakeups_list(request: Request, query: WakeupsQuery) -> Wakeups:
    """The scheduled wake-ups (one run's, or of one status)."""
    return Wakeups(wakeups=await db_of(request).read(list_wakeups, query.channel_id, query.status))


async def api_wakeups_get(request: Request, path) -> Wakeup:
    """One scheduled wake-up."""
    return wakeup_of(await db_of(request).read(require_wakeup, path.wakeup_id))


async def api_wakeups_cancel(request: Request, path) -> WakeupCancelled:
    """Cancel a pending wake-up."""
    return await db_of(request).write(cancel_wakeup, path.wakeup_id)


WAKEUPS_API_ROUTES = (
    Api("POST", "/api/v1/scheduler/wakeups", api_wakeups_schedule, body=ScheduleWakeup, scopes=writes(B)),
    Api("GET", "/api/v1/scheduler/wakeups", api_wakeups_list, query=WakeupsQuery, scopes=reads("query.channel_id")),
    Api("GET", "/api/v1/scheduler/wakeups/{wakeup_id}", api_wakeups_get, scopes=reads("wakeup.wakeup_id")),
    Api("DELETE", "/api/v1/scheduler/wakeups/{wakeup_id}", api_wakeups_cancel, scopes=deletes("wakeup.wakeup_id")),
)


def install_scheduler(services: Services, options: dict) -> Installed:
    """The task that fires due wake-ups, one per app."""
    scheduler = Scheduler(services.db)
    return Installed(services=(scheduler,), starts=(scheduler.start,), stops=(scheduler.stop,))


WAKEUPS = declare(Region("wake-ups", features=("scheduler",), schema=(SchemaPart(1, wakeups_schema),),
                         routes=WAKEUPS_API_ROUTES, installers=(install_scheduler,)))


# =============================================================================
# Groups: records
# =============================================================================
# --- consumer groups and execution groups ---------------------------------------------------


class ChannelFilter(Record):
    channel_id: Optional[ChannelId] = None


class CreateConsumerGroup(Record):
    group_id: ChannelId
    channel_id: ChannelId
    metadata: Optional[JsonObject] = None


class Consumer(Record):
    consumer_id: Name
    lease_seconds: Lease = LEASE_DEFAULT


class ClaimWork(ClampedLimit, kw_only=True):
    consumer_id: Name


class AckWork(Record):
    consumer_id: Name
    cursor: Count


class CreateExecutionGroup(Record):
    group_id: ChannelId
    metadata: Optional[JsonObject] = None


class AddGroupMember(Record):
    member_id: ChannelId
    channel_id: ChannelId
    role: Optional[Label] = None
    metadata: Optional[JsonObject] = None


class LeaseClaim(Record):
    owner_id: Name
    lease_seconds: Lease = LEASE_DEFAULT


class LeaseHolder(Record):
    owner_id: Name
    generation: Count
    lease_seconds: Lease = LEASE_DEFAULT


class SendMessage(Idempotent, kw_only=True):
    from_member_id: ChannelId
    to_member_id: ChannelId
    type: Name
    payload: Document = None
    causal_context: Optional[JsonObject] = None


class InboxQuery(ClampedLimit):
    after: Optional[Id] = None


class ForkExecutionGroup(Record):
    fork_group_id: ChannelId
    source_group_id: ChannelId
    intervention_member_id: ChannelId
    intervention_cursor: Count
    member_policies: Optional[dict[ChannelId, Literal[MEMBER_POLICIES]]] = None
    tool_policies: Optional[ToolPolicies] = None

    def __post_init__(self):
        self.member_policies = self.member_policies or {}
        self.tool_policies = self.tool_policies or {}


class ConsumerGroup(Answer):
    group_id: str
    channel_id: str
    created_at: str
    metadata: Json
    committed_cursor: int


class ConsumerGroups(Answer):
    groups: list[ConsumerGroup]


class Offset(Answer):
    group_id: str
    consumer_id: str
    last_cursor: int
    claimed_cursor: int
    lease_until: str
    updated_at: str


class Offsets(Answer):
    offsets: list[Offset]


class Work(Answer):
    group_id: str
    consumer_id: str
    events: list[Event]
    lease_until: str


# --- execution groups ------------------------------------------------------------------------------


class ExecutionGroup(Answer):
    group_id: str
    status: str
    metadata: Json
    created_at: str
    updated_at: str


class ExecutionGroups(Answer):
    groups: list[ExecutionGroup]


class MemberLease(Answer):
    group_id: str
    member_id: str
    owner_id: Optional[str]
    generation: int
    lease_until: Optional[str]


class Member(MemberLease):
    channel_id: str
    role: Optional[str]
    metadata: Json


class Members(Answer):
    members: list[Member]


class Released(Done, kw_only=True):
    member: Member


class Message(Answer):
    message_id: str
    group_id: str
    from_member_id: str
    to_member_id: str
    type: str
    payload: Json
    causal_context: Json
    source_event_id: Optional[str]
    delivery_event_id: Optional[str]
    status: str
    acknowledged_at: Optional[str]
    created_at: str


class Messages(Answer):
    messages: list[Message]


class ForkedMember(Answer):
    policy: Literal[MEMBER_POLICIES]
    source_channel_id: str
    channel_id: str
    receipt: Optional[Receipt]


class GroupFork(Answer):
    """A group fork's one receipt, stored as it was first answered."""

    fork_group_id: str
    source_group_id: str
    intervention_member_id: str
    intervention_cursor: int
    member_policies: dict[str, Literal[MEMBER_POLICIES]]
    tool_policies: Optional[dict[str, str]]
    members: dict[str, ForkedMember]
    promoted: list[str]
    created_at: str


class GroupForkAnswer(Answer):
    fork: GroupFork


# =============================================================================
# Groups: consumer groups (at-least-once workers on one channel)
# =============================================================================

def groups_schema(w: SchemaWords) -> str:
    """The groups' tables (in the first step, as they were before groups were a region)."""
    return f"""
    -- Consumer groups: competing consumers share one channel; each claim reserves a cursor range.
    CREATE TABLE consumer_groups (
        id                TEXT PRIMARY KEY,
        channel_id        TEXT NOT NULL,
        metadata          TEXT,
        committed_cursor  {w.integer} NOT NULL DEFAULT 0,   -- acked watermark: work at or below is done
        created_at        TEXT NOT NULL
    );
    CREATE TABLE group_consumers (
        group_id       TEXT NOT NULL REFERENCES consumer_groups(id),
        consumer_id    TEXT NOT NULL,
        lease_until    TEXT NOT NULL,
        reserved_from  {w.integer} NOT NULL DEFAULT 0,     -- reservation is (reserved_from, claimed_cursor]
        claimed_cursor {w.integer} NOT NULL DEFAULT 0,
        acked_cursor   {w.integer} NOT NULL DEFAULT 0,     -- processed up to here within the reservation
        updated_at     TEXT NOT NULL,
        PRIMARY KEY (group_id, consumer_id)
    );

    -- Execution groups: members (each one channel), leased to one owner at a time, exchanging messages.
    CREATE TABLE execution_groups (
        id          TEXT PRIMARY KEY,
        status      TEXT NOT NULL DEFAULT '{EXECUTION_GROUP_STATUSES[0]}'
                        CHECK (status IN ({sql_list(EXECUTION_GROUP_STATUSES)})),
        metadata    TEXT,
        fork        TEXT,                      -- the group-fork receipt when this group is a fork
        created_at  TEXT NOT NULL,
        updated_at  TEXT NOT NULL
    );
    CREATE TABLE execution_group_members (
        group_id     TEXT NOT NULL REFERENCES execution_groups(id),
        member_id    TEXT NOT NULL,
        channel_id   TEXT NOT NULL,
        role         TEXT,
        metadata     TEXT,
        owner_id     TEXT,
        generation   {w.integer} NOT NULL DEFAULT 0,   -- bumped by every claim: fences stale owners
        lease_until  TEXT,
        created_at   TEXT NOT NULL,
        PRIMARY KEY (group_id, member_id)
    );
    CREATE TABLE group_messages (
        seq                {w.serial},     -- delivery order
        id                 TEXT NOT NULL UNIQUE,
        group_id           TEXT NOT NULL REFERENCES execution_groups(id),
        from_member_id     TEXT NOT NULL,
        to_member_id       TEXT NOT NULL,
        type               TEXT NOT NULL,
        payload            TEXT,
        causal_context     TEXT,
        source_event_id    TEXT NOT NULL,
        delivery_event_id  TEXT NOT NULL,
        status             TEXT NOT NULL CHECK (status IN ({sql_list(GROUP_MESSAGE_STATUSES)})),
        operation_id       TEXT,
        request_hash       TEXT NOT NULL,
        created_at         TEXT NOT NULL,
        acknowledged_at    TEXT,
        UNIQUE (group_id, operation_id)
    );
    CREATE INDEX group_messages_inbox ON group_messages (group_id, to_member_id, seq);
    """


def consumer_acks_schema(w: SchemaWords) -> str:
    """Step 2: a consumer's own last acknowledged cursor."""
    return f"""
    -- acked_cursor restarts with each reservation; this one does not.
    ALTER TABLE group_consumers ADD COLUMN last_acked_cursor {w.integer} NOT NULL DEFAULT 0;
    """


def consumer_group_of(row: Row) -> ConsumerGroup:
    return ConsumerGroup(group_id=row["id"], channel_id=row["channel_id"], created_at=row["created_at"],
                         metadata=load(row["metadata"]), committed_cursor=row["committed_cursor"])


def require_consumer_group(conn: Conn, group_id: str) -> Row:
    return present(row_where(conn, "consumer_groups", id=group_id), lambda: NotFound(f"consumer group {group_id} not found"))


def create_consumer_group(tx: Tx, group_id: str, channel_id: str, metadata: Optional[dict]) -> ConsumerGroup:
    existing = row_where(tx.conn, "consumer_groups", id=group_id)
    if existing is not None:
        if existing["channel_id"] != channel_id:
            raise Conflict("channel_conflict", f"consumer group {group_id} already reads {existing['channel_id']}")
        return consumer_group_of(existing)
    tx.conn.execute("INSERT INTO consumer_groups (id, channel_id, metadata, created_at) VALUES (?, ?, ?, ?)",
                    (group_id, channel_id, dump(metadata), tx.ts))
    return consumer_group_of(require_consumer_group(tx.conn, group_id))


def list_consumer_groups(conn: Conn, channel_id: Optional[str]) -> list[ConsumerGroup]:
    rows = conn.execute("SELECT * FROM consumer_groups WHERE CAST(? AS TEXT) IS NULL OR channel_id = ? ORDER BY id",
                        (channel_id, channel_id))
    return [consumer_group_of(r) for r in rows.fetchall()]


def delete_consumer_group(tx: Tx, group_id: str) -> DeletedId:
    require_consumer_group(tx.conn, group_id)
    tx.conn.execute("DELETE FROM group_consumers WHERE group_id = ?", (group_id,))
    tx.conn.execute("DELETE FROM consumer_groups WHERE id = ?", (group_id,))
    return DeletedId(deleted=group_id)


def offset_of(group: Row, consumer: Row) -> Offset:
    return Offset(group_id=group["id"], consumer_id=consumer["consumer_id"], last_cursor=consumer["last_acked_cursor"],
                  claimed_cursor=consumer["claimed_cursor"], lease_until=consumer["lease_until"],
                  updated_at=consumer["updated_at"])


def active_consumer(tx: Tx, group_id: str, consumer_id: str) -> Row:
    row = tx.conn.execute("SELECT * FROM group_consumers WHERE group_id = ? AND consumer_id = ?",
                          (group_id, consumer_id)).fetchone()
    if row is None or row["lease_until"] <= tx.ts:
        raise Conflict("consumer_not_found", f"consumer {consumer_id} has no active lease in group {group_id}; join first")
    return row


def join_group(tx: Tx, group_id: str, consumer_id: str, lease_seconds: int) -> Offset:
    group = require_consumer_group(tx.conn, group_id)
    lease_until = iso(tx.now + timedelta(seconds=lease_seconds))
    tx.conn.execute(
        "INSERT INTO group_consumers (group_id, consumer_id, lease_until, updated_at) VALUES (?, ?, ?, ?)"
        " ON CONFLICT (group_id, consumer_id) DO UPDATE SET lease_until = excluded.lease_until,"
        " updated_at = excluded.updated_at", (group_id, consumer_id, lease_until, tx.ts))
    return offset_of(group, active_consumer(tx, group_id, consumer_id))


def release_lapsed(tx: Tx, group: Row) -> None:
    """A consumer whose lease ran out loses its reservation: its unacked events are free to claim."""
    tx.conn.execute("UPDATE group_consumers SET reserved_from = ?, claimed_cursor = ?, acked_cursor = ?"
                    " WHERE group_id = ? AND lease_until <= ? AND claimed_cursor > ?",
                    (group["committed_cursor"],) * 3 + (group["id"], tx.ts, group["committed_cursor"]))


def first_unreserved(tx: Tx, group: Row) -> tuple:
    """(start, stop): the lowest cursor range above the watermark that no reservation covers.

    Fully acked reservations still count until the watermark passes them: that work is done.
    """
    held = tx.conn.execute(
        "SELECT reserved_from, claimed_cursor FROM group_consumers WHERE group_id = ? AND claimed_cursor > ?"
        " ORDER BY reserved_from", (group["id"], group["committed_cursor"]))
    start = group["committed_cursor"]
    for lower, upper in held.fetchall():
        if lower > start:
            return start, lower
        start = max(start, upper)
    return start, None


def claim_work(tx: Tx, group_id: str, consumer_id: str, limit: int) -> Work:
    """Reserve the next events for this consumer (at-least-once, competing consumers).

    Each consumer holds at most one reservation, the cursor range (reserved_from, claimed_cursor].
    Its own unacked rest is handed back first (a restarted worker resumes where it was); otherwise
    it gets the lowest range above the group's watermark that no reservation covers. Lapsed
    consumers' reservations are released first, so a crashed worker's events are redelivered.
    Delivery is at-least-once: a consumer that takes over such a range gives up the record of its
    own finished range above it, which is then delivered again.
    """
    group = require_consumer_group(tx.conn, group_id)
    consumer = active_consumer(tx, group_id, consumer_id)
    release_lapsed(tx, group)
    if consumer["acked_cursor"] < consumer["claimed_cursor"]:
        start = max(consumer["reserved_from"], consumer["acked_cursor"], group["committed_cursor"])
        stop = consumer["claimed_cursor"]
    else:
        start, stop = first_unreserved(tx, group)
    events = [event_of(r) for r in events_after(tx.conn, group["channel_id"], start, limit, upto=stop)]
    if events:
        tx.conn.execute("UPDATE group_consumers SET reserved_from = ?, claimed_cursor = ?, acked_cursor = ?,"
                        " updated_at = ? WHERE group_id = ? AND consumer_id = ?",
                        (start, events[-1].cursor, start, tx.ts, group_id, consumer_id))
    return Work(group_id=group_id, consumer_id=consumer_id, events=events, lease_until=consumer["lease_until"])


def advance_watermark(tx: Tx, group_id: str) -> None:
    """Move the group's watermark over every reservation that is fully acked, in cursor order."""
    group = require_consumer_group(tx.conn, group_id)
    position = group["committed_cursor"]
    for lower, upper, acked in tx.conn.execute(
            "SELECT reserved_from, claimed_cursor, acked_cursor FROM group_consumers WHERE group_id = ?"
            " AND claimed_cursor > ? ORDER BY reserved_from", (group_id, position)).fetchall():
        if lower > position:
            break                       # nobody processed the events in between yet
        position = max(position, acked)
        if acked < upper:
            break
    tx.conn.execute("UPDATE consumer_groups SET committed_cursor = ? WHERE id = ?", (position, group_id))


def ack_work(tx: Tx, group_id: str, consumer_id: str, cursor: int) -> Offset:
    """Mark this consumer's events up to `cursor` processed; the group watermark follows when it can."""
    require_consumer_group(tx.conn, group_id)
    consumer = active_consumer(tx, group_id, consumer_id)
    if cursor > consumer["claimed_cursor"]:
        raise Conflict("ack_beyond_claim", f"consumer {consumer_id} holds events up to cursor "
                                           f"{consumer['claimed_cursor']}, not {cursor}; claim work first")
    tx.conn.execute("UPDATE group_consumers SET acked_cursor = ?, last_acked_cursor = ?, updated_at = ?"
                    " WHERE group_id = ? AND consumer_id = ?",
                    (max(consumer["acked_cursor"], cursor), max(consumer["last_acked_cursor"], cursor), tx.ts,
                     group_id, consumer_id))
    advance_watermark(tx, group_id)
    return offset_of(require_consumer_group(tx.conn, group_id), active_consumer(tx, group_id, consumer_id))


def heartbeat_consumer(tx: Tx, group_id: str, consumer_id: str, lease_seconds: int) -> Offset:
    group = require_consumer_group(tx.conn, group_id)
    active_consumer(tx, group_id, consumer_id)
    tx.conn.execute("UPDATE group_consumers SET lease_until = ?, updated_at = ? WHERE group_id = ? AND consumer_id = ?",
                    (iso(tx.now + timedelta(seconds=lease_seconds)), tx.ts, group_id, consumer_id))
    return offset_of(group, active_consumer(tx, group_id, consumer_id))


def group_offsets(conn: Conn, group_id: str) -> list[Offset]:
    group = require_consumer_group(conn, group_id)
    rows = conn.execute("SELECT * FROM group_consumers WHERE group_id = ? ORDER BY consumer_id", (group_id,))
    return [offset_of(group, r) for r in rows.fetchall()]


# =============================================================================
# Groups: execution groups (members with fenced leases, durable messages, group forks)
# =============================================================================

def execution_group_of(row: Row) -> ExecutionGroup:
    return ExecutionGroup(group_id=row["id"], status=row["status"], metadata=load(row["metadata"]) or {},
                          created_at=row["created_at"], updated_at=row["updated_at"])


def member_of(row: Row) -> Member:
    return Member(group_id=row["group_id"], member_id=row["member_id"], channel_id=row["channel_id"], role=row["role"],
                  metadata=load(row["metadata"]) or {}, owner_id=row["owner_id"], generation=row["generation"],
                  lease_until=row["lease_until"])


def lease_of(row: Row) -> MemberLease:
    return MemberLease(group_id=row["group_id"], member_id=row["member_id"], owner_id=row["owner_id"],
                 generation=row["generation"], lease_until=row["lease_until"])


def message_of(row: Row) -> Message:
    return Message(message_id=row["id"], group_id=row["group_id"], from_member_id=row["from_member_id"],
                   to_member_id=row["to_member_id"], type=row["type"], payload=load(row["payload"]),
                   causal_context=load(row["causal_context"]), source_event_id=row["source_event_id"],
                   delivery_event_id=row["delivery_event_id"], status=row["status"],
                   acknowledged_at=row["acknowledged_at"], created_at=row["created_at"])


def require_execution_group(conn: Conn, group_id: str) -> Row:
    return present(row_where(conn, "execution_groups", id=group_id), lambda: NotFound(f"execution group {group_id} not found"))


def require_member(conn: Conn, group_id: str, member_id: str) -> Row:
    return present(row_where(conn, "execution_group_members", group_id=group_id, member_id=member_id),
                   lambda: NotFound(f"member {member_id} of execution group {group_id} not found"))


def list_execution_groups(conn: Conn) -> list[ExecutionGroup]:
    return [execution_group_of(r) for r in conn.execute("SELECT * FROM execution_groups ORDER BY created_at, id")]


def list_group_members(conn: Conn, group_id: str) -> list[Member]:
    require_execution_group(conn, group_id)
    return [member_of(r) for r in rows_where(conn, "execution_group_members", "member_id", group_id=group_id)]


def create_execution_group(tx: Tx, group_id: str, metadata: Optional[dict], fork: Optional[dict] = None) -> ExecutionGroup:
    tx.conn.execute("INSERT INTO execution_groups (id, metadata, fork, created_at, updated_at) VALUES (?, ?, ?, ?, ?)"
                    " ON CONFLICT (id) DO NOTHING", (group_id, dump(metadata or {}), dump(fork), tx.ts, tx.ts))
    return execution_group_of(require_execution_group(tx.conn, group_id))


def add_group_member(tx: Tx, group_id: str, member_id: str, channel_id: str, role: Optional[str],
                     metadata: Optional[dict]) -> Member:
    require_execution_group(tx.conn, group_id)
    existing = row_where(tx.conn, "execution_group_members", group_id=group_id, member_id=member_id)
    if existing is not None and existing["channel_id"] != channel_id:
        raise Conflict("channel_conflict", f"member {member_id} already runs on channel {existing['channel_id']}")
    ensure_channel(tx, channel_id)
    tx.conn.execute(
        "INSERT INTO execution_group_members (group_id, member_id, channel_id, role, metadata, created_at)"
        " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (group_id, member_id) DO UPDATE SET role = excluded.role,"
        " metadata = excluded.metadata", (group_id, member_id, channel_id, role, dump(metadata or {}), tx.ts))
    return member_of(require_member(tx.conn, group_id, member_id))


def claim_member(tx: Tx, group_id: str, member_id: str, owner_id: str, lease_seconds: int) -> MemberLease:
    """Lease a member to one owner; every claim bumps the generation, so older leases go stale."""
    member = require_member(tx.conn, group_id, member_id)
    held = member["owner_id"] is not None and member["lease_until"] is not None and member["lease_until"] > tx.ts
    if held and member["owner_id"] != owner_id:
        raise Conflict("execution_not_owned", f"member {member_id} is leased to another owner until "
                                              f"{member['lease_until']}")
    tx.conn.execute("UPDATE execution_group_members SET owner_id = ?, generation = generation + 1, lease_until = ?"
                    " WHERE group_id = ? AND member_id = ?",
                    (owner_id, iso(tx.now + timedelta(seconds=lease_seconds)), group_id, member_id))
    return lease_of(require_member(tx.conn, group_id, member_id))


def current_lease(tx: Tx, group_id: str, member_id: str, owner_id: Optional[str], generation: Optional[int]) -> Row:
    member = require_member(tx.conn, group_id, member_id)
    if (member["owner_id"] != owner_id or member["generation"] != generation
            or member["lease_until"] is None or member["lease_until"] <= tx.ts):
        raise Conflict("execution_not_owned", f"owner {owner_id} generation {generation} no longer holds "
                                              f"member {member_id} (stale, released or expired lease)")
    return member


def heartbeat_member(tx: Tx, group_id: str, member_id: str, owner_id: str, generation: int,
                     lease_seconds: int) -> MemberLease:
    current_lease(tx, group_id, member_id, owner_id, generation)
    tx.conn.execute("UPDATE execution_group_members SET lease_until = ? WHERE group_id = ? AND member_id = ?",
                    (iso(tx.now + timedelta(seconds=lease_seconds)), group_id, member_id))
    return lease_of(require_member(tx.conn, group_id, member_id))


def release_member(tx: Tx, group_id: str, member_id: str, owner_id: str, generation: int) -> Released:
    current_lease(tx, group_id, member_id, owner_id, generation)
    tx.conn.execute("UPDATE execution_group_members SET owner_id = NULL, lease_until = NULL"
                    " WHERE group_id = ? AND member_id = ?", (group_id, member_id))
    return Released(member=member_of(require_member(tx.conn, group_id, member_id)))


def send_group_message(tx: Tx, group_id: str, req: SendMessage) -> Message:
    """A source event on the sender's channel, `message.received` on the recipient's, one inbox row."""
    require_execution_group(tx.conn, group_id)
    hashed = request_hash({k: getattr(req, k) for k in ("from_member_id", "to_member_id", "type", "payload", "causal_context")})
    if req.operation_id is not None:
        earlier = tx.conn.execute("SELECT * FROM group_messages WHERE group_id = ? AND operation_id = ?",
                                  (group_id, req.operation_id)).fetchone()
        if earlier is not None:
            require_same_request(earlier["request_hash"], hashed, req.operation_id, "message")
            return message_of(earlier)
    sender = require_member(tx.conn, group_id, req.from_member_id)
    recipient = require_member(tx.conn, group_id, req.to_member_id)
    message_id = str(uuid.uuid4())
    body = {"message_id": message_id, "group_id": group_id, "from": {"member": sender["member_id"]},
            "to": {"member": recipient["member_id"]}, "type": req.type, "payload": req.payload,
            "causal_context": req.causal_context}
    source = append_event(tx, sender["channel_id"], "message.sent", body, actor=sender["member_id"])
    delivery = append_event(tx, recipient["channel_id"], "message.received", body, actor=sender["member_id"],
                            depends_on=source.id)
    tx.conn.execute(
        "INSERT INTO group_messages (id, group_id, from_member_id, to_member_id, type, payload, causal_context,"
        " source_event_id, delivery_event_id, status, operation_id, request_hash, created_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'delivered', ?, ?, ?)",
        (message_id, group_id, sender["member_id"], recipient["member_id"], req.type, dump(req.payload),
         dump(req.causal_context), source.id, delivery.id, req.operation_id, hashed, tx.ts))
    return message_of(row_where(tx.conn, "group_messages", id=message_id))


def member_inbox(conn: Conn, group_id: str, member_id: str, after: Optional[str], limit: int) -> list[Message]:
    """Messages to a member, oldest first, strictly after the message `after` (a durable cursor)."""
    require_member(conn, group_id, member_id)
    after_seq = 0
    if after:
        row = conn.execute("SELECT seq FROM group_messages WHERE id = ? AND group_id = ?", (after, group_id)).fetchone()
        if row is None:
            raise NotFound(f"message {after} not found in execution group {group_id}")
        after_seq = row["seq"]
    rows = conn.execute("SELECT * FROM group_messages WHERE group_id = ? AND to_member_id = ? AND seq > ?"
                        " ORDER BY seq LIMIT ?", (group_id, member_id, after_seq, limit))
    return [message_of(r) for r in rows.fetchall()]


def acknowledge_message(tx: Tx, message_id: str, owner_id: str, generation: int) -> Message:
    row = present(row_where(tx.conn, "group_messages", id=message_id), lambda: NotFound(f"message {message_id} not found"))
    current_lease(tx, row["group_id"], row["to_member_id"], owner_id, generation)
    if row["status"] != "acknowledged":
        tx.conn.execute("UPDATE group_messages SET status = 'acknowledged', acknowledged_at = ? WHERE id = ?",
                        (tx.ts, message_id))
    return message_of(row_where(tx.conn, "group_messages", id=message_id))


def fork_execution_group(tx: Tx, req: ForkExecutionGroup) -> GroupFork:
    """Fork a whole group: the intervention member at its cursor, the others at their latest state
    (or shared as-is with policy "share"); one receipt, recovered as-is when asked again."""
    fork_id, source_id = req.fork_group_id, req.source_group_id
    definition = {k: getattr(req, k) for k in ("source_group_id", "intervention_member_id", "intervention_cursor",
                                               "member_policies", "tool_policies")}
    existing = row_where(tx.conn, "execution_groups", id=fork_id)
    if existing is not None:
        receipt = load(existing["fork"])
        if receipt is None or {k: receipt.get(k) for k in definition} != definition:
            raise Conflict("channel_conflict", f"execution group {fork_id} already exists with another definition")
        return group_fork_of(receipt)
    require_execution_group(tx.conn, source_id)
    members = rows_where(tx.conn, "execution_group_members", "member_id", group_id=source_id)
    member_ids = {m["member_id"] for m in members}
    if req.intervention_member_id not in member_ids:
        raise NotFound(f"member {req.intervention_member_id} of execution group {source_id} not found")
    unknown = sorted(set(req.member_policies) - member_ids)
    if unknown:
        raise BadRequest(f"member_policies name members that {source_id} does not have: {', '.join(unknown)}")
    if req.member_policies.get(req.intervention_member_id, "fork") != "fork":
        raise BadRequest("the intervention member is always forked (at intervention_cursor); it cannot be shared")
    create_execution_group(tx, fork_id, {"forked_from": source_id})
    forked = {}
    for member in members:
        policy = req.member_policies.get(member["member_id"], "fork")
        channel_id = member["channel_id"]
        receipt = None
        if policy == "fork":
            at = req.intervention_cursor if member["member_id"] == req.intervention_member_id else 0
            receipt = fork_channel(tx, Fork(
                source_channel_id=channel_id, new_channel_id=valid_channel(f"{fork_id}.{member['member_id']}"),
                at_cursor=at, display_name=f"{fork_id}/{member['member_id']}",
                reason=f"group fork {fork_id} of {source_id}", manifest={"group_fork": fork_id},
                tool_policies=req.tool_policies or None))
            channel_id = receipt.child_channel_id
        add_group_member(tx, fork_id, member["member_id"], channel_id, member["role"], load(member["metadata"]))
        forked[member["member_id"]] = ForkedMember(policy=policy, source_channel_id=member["channel_id"],
                                                   channel_id=channel_id, receipt=receipt)
    fork = GroupFork(fork_group_id=fork_id, **definition, members=forked, promoted=[], created_at=tx.ts)
    tx.conn.execute("UPDATE execution_groups SET fork = ? WHERE id = ?", (dump(fork), fork_id))
    return fork


def group_fork_of(stored: dict) -> GroupFork:
    """A group fork's receipt as it was stored (the JSON of the first answer)."""
    return msgspec.convert(stored, GroupFork)


def require_group_fork(conn: Conn, fork_id: str) -> GroupFork:
    fork = load(require_execution_group(conn, fork_id)["fork"])
    if fork is None:
        raise NotFound(f"execution group {fork_id} is not a group fork")
    return group_fork_of(fork)


def promote_group_fork_member(tx: Tx, fork_id: str, member_id: str) -> GroupFork:
    fork = require_group_fork(tx.conn, fork_id)
    member = fork.members.get(member_id)
    if member is None:
        raise NotFound(f"member {member_id} of group fork {fork_id} not found")
    if member.receipt is None:
        raise BadRequest(f"member {member_id} was shared, not forked: there is nothing to promote")
    if member_id not in fork.promoted:
        promote_channel(tx, member.channel_id)
        fork.promoted.append(member_id)
        tx.conn.execute("UPDATE execution_groups SET fork = ?, updated_at = ? WHERE id = ?",
                        (dump(fork), tx.ts, fork_id))
    return fork


# =============================================================================
# Groups: handlers and routes
# =============================================================================

async def api_groups_create(request: Request, body: CreateConsumerGroup) -> ConsumerGroup:
    """Create a consumer group that reads a run's events at least once across competing consumers."""
    return await db_of(request).write(create_consumer_group, body.group_id, body.channel_id, body.metadata)


async def api_groups_list(request: Request, query: ChannelFilter) -> ConsumerGroups:
    """The consumer groups (one run's, with channel_id)."""
    return ConsumerGroups(groups=await db_of(request).read(list_consumer_groups, query.channel_id))


async def api_groups_delete(request: Request, path) -> DeletedId:
    """Delete a consumer group."""
    return await db_of(request).write(delete_consumer_group, path.group_id)


async def api_groups_join(request: Request, path, body: Consumer) -> Offset:
    """Join a consumer group as a consumer (with a lease); the answer is its offset."""
    return await db_of(request).write(join_group, path.group_id, body.consumer_id, body.lease_seconds)


async def api_groups_work(request: Request, path, body: ClaimWork) -> Work:
    """Reserve the next events of the group's run for this consumer."""
    return await db_of(request).write(claim_work, path.group_id, body.consumer_id, body.limit)


async def api_groups_ack(request: Request, path, body: AckWork) -> Offset:
    """Mark this consumer's events up to a cursor processed."""
    return await db_of(request).write(ack_work, path.group_id, body.consumer_id, body.cursor)


async def api_groups_heartbeat(request: Request, path, body: Consumer) -> Offset:
    """Extend a consumer's lease in its group."""
    return await db_of(request).write(heartbeat_consumer, path.group_id, body.consumer_id, body.lease_seconds)


async def api_groups_offsets(request: Request, path) -> Offsets:
    """Each consumer's offset in a consumer group."""
    return Offsets(offsets=await db_of(request).read(group_offsets, path.group_id))


async def api_execution_groups_create(request: Request, body: CreateExecutionGroup) -> ExecutionGroup:
    """Create an execution group: runs of several agents that work and message together."""
    return await db_of(request).write(create_execution_group, body.group_id, body.metadata)


async def api_execution_groups_list(request: Request) -> ExecutionGroups:
    """The execution groups on this server."""
    return ExecutionGroups(groups=await db_of(request).read(list_execution_groups))


async def api_execution_groups_add_member(request: Request, path, body: AddGroupMember) -> Member:
    """Add a member (an agent's run) to an execution group."""
    return await db_of(request).write(add_group_member, path.group_id, body.member_id, body.channel_id,
                                      body.role, body.metadata)


async def api_execution_groups_members(request: Request, path) -> Members:
    """The members of an execution group, with their leases."""
    return Members(members=await db_of(request).read(list_group_members, path.group_id))


async def api_execution_groups_claim(request: Request, path, body: LeaseClaim) -> MemberLease:
    """Lease a member of an execution group to one owner; each claim bumps its generation."""
    return await db_of(request).write(claim_member, path.group_id, path.member_id, body.owner_id, body.lease_seconds)


async def api_execution_groups_heartbeat(request: Request, path, body: LeaseHolder) -> MemberLease:
    """Extend an owner's lease on an execution group member."""
    return await db_of(request).write(heartbeat_member, path.group_id, path.member_id, body.owner_id,
                                      body.generation, body.lease_seconds)


async def api_execution_groups_release(request: Request, path, body: LeaseHolder) -> Released:
    """Release an owner's lease on an execution group member."""
    return await db_of(request).write(release_member, path.group_id, path.member_id, body.owner_id,
                                      body.generation)


async def api_execution_groups_send(request: Request, path, body: SendMessage) -> Message:
    """Send a message from one member of an execution group to another."""
    return await db_of(request).write(send_group_message, path.group_id, body)


async def api_execution_groups_inbox(request: Request, path, query: InboxQuery) -> Messages:
    """The messages to a member, oldest first, after a message (a durable cursor)."""
    messages = await db_of(request).read(member_inbox, path.group_id, path.member_id, query.after, query.limit)
    return Messages(messages=messages)


async def api_execution_group_messages_ack(request: Request, path, body: LeaseHolder) -> Message:
    """Acknowledge a message received by a member of an execution group."""
    return await db_of(request).write(acknowledge_message, path.message_id, body.owner_id, body.generation)


async def api_execution_group_forks_create(request: Request, body: ForkExecutionGroup) -> GroupForkAnswer:
    """Fork a whole execution group at one member's cursor; the answer is the group fork receipt."""
    return GroupForkAnswer(fork=await db_of(request).write(fork_execution_group, body))


async def api_execution_group_forks_get(request: Request, path) -> GroupForkAnswer:
    """One execution group fork with its members."""
    return GroupForkAnswer(fork=await db_of(request).read(require_group_fork, path.fork_group_id))


async def api_execution_group_forks_promote(request: Request, path, body: Empty) -> GroupForkAnswer:
    """Promote one forked member of an execution group fork into its source run."""
    return GroupForkAnswer(fork=await db_of(request).write(promote_group_fork_member, path.fork_group_id, path.member_id))


GROUPS_API_ROUTES = (
    Api("POST", "/api/v1/groups", api_groups_create, body=CreateConsumerGroup, scopes=writes(B)),
    Api("GET", "/api/v1/groups", api_groups_list, query=ChannelFilter, scopes=reads("query.channel_id")),
    Api("DELETE", "/api/v1/groups/{group_id}", api_groups_delete, scopes=deletes("group.group_id")),
    Api("POST", "/api/v1/groups/{group_id}/join", api_groups_join, body=Consumer, scopes=writes("group.group_id")),
    Api("POST", "/api/v1/groups/{group_id}/work", api_groups_work, body=ClaimWork, scopes=writes("group.group_id")),
    Api("POST", "/api/v1/groups/{group_id}/ack", api_groups_ack, body=AckWork, scopes=writes("group.group_id")),
    Api("POST", "/api/v1/groups/{group_id}/heartbeat", api_groups_heartbeat, body=Consumer,
        scopes=writes("group.group_id")),
    Api("GET", "/api/v1/groups/{group_id}/offsets", api_groups_offsets, scopes=reads("group.group_id")),
    instance_wide("POST", "/api/v1/execution-groups", api_execution_groups_create, body=CreateExecutionGroup),
    instance_wide("GET", "/api/v1/execution-groups", api_execution_groups_list),
    instance_wide("POST", "/api/v1/execution-groups/{group_id}/members", api_execution_groups_add_member,
                  body=AddGroupMember),
    instance_wide("GET", "/api/v1/execution-groups/{group_id}/members", api_execution_groups_members),
    instance_wide("POST", "/api/v1/execution-groups/{group_id}/members/{member_id}/claim", api_execution_groups_claim,
                  body=LeaseClaim),
    instance_wide("POST", "/api/v1/execution-groups/{group_id}/members/{member_id}/heartbeat", api_execution_groups_heartbeat,
                  body=LeaseHolder),
    instance_wide("POST", "/api/v1/execution-groups/{group_id}/members/{member_id}/release", api_execution_groups_release,
                  body=LeaseHolder),
    instance_wide("POST", "/api/v1/execution-groups/{group_id}/messages", api_execution_groups_send, body=SendMessage),
    instance_wide("GET", "/api/v1/execution-groups/{group_id}/members/{member_id}/messages", api_execution_groups_inbox,
                  query=InboxQuery),
    instance_wide("POST", "/api/v1/execution-group-messages/{message_id}/ack", api_execution_group_messages_ack,
                  body=LeaseHolder),
    instance_wide("POST", "/api/v1/execution-group-forks", api_execution_group_forks_create, body=ForkExecutionGroup),
    instance_wide("GET", "/api/v1/execution-group-forks/{fork_group_id}", api_execution_group_forks_get),
    instance_wide("POST", "/api/v1/execution-group-forks/{fork_group_id}/members/{member_id}/promote", api_execution_group_forks_promote,
                  body=Empty, body_optional=True),
)

GROUPS = declare(Region("groups", features=("consumer_groups", "execution_groups"),
                        schema=(SchemaPart(1, groups_schema), SchemaPart(2, consumer_acks_schema)),
                        routes=GROUPS_API_ROUTES))


# =============================================================================
# Experiments: named groups of runs, compared side by side and ranked
# =============================================================================
# Region: an experiment names a baseline run and its variants (forks, mostly); the API ranks them by
# result score, the dashboard shows them side by side and promotes the winner (promote_channel).

class CreateExperiment(Record):
    name: Annotated[str, Meta(min_length=1, max_length=4096)]
    description: Optional[LongText] = None
    baseline_channel_id: Optional[ChannelId] = None


class AddExperimentMember(Record):
    channel_id: ChannelId
    role: Optional[Label] = None
    declared_delta: Optional[JsonObject] = None


class ExperimentPageQuery(Record):
    promoted: PageText = ""                 # the fork just promoted from this page


class ExperimentMember(Answer):
    channel_id: str
    role: Optional[str]
    declared_delta: Json
    result_score: Optional[float]
    outcome: Optional[str]
    added_at: str


class Experiment(Answer):
    id: str
    group_id: str
    name: str
    description: Optional[str]
    baseline_channel_id: Optional[str]
    created_at: str
    members: list[ExperimentMember]


class Experiments(Answer):
    experiments: list[Experiment]


class RankedMember(ExperimentMember):
    rank: int


class RankedExperiment(Experiment):
    ranking: list[RankedMember]


def experiment_answer(conn: Conn, row: Row) -> Experiment:
    members = conn.execute(
        "SELECT m.*, c.result_score, c.outcome FROM experiment_members m LEFT JOIN channels c ON c.id = m.channel_id"
        " WHERE m.experiment_id = ? ORDER BY m.added_at, m.channel_id", (row["id"],)).fetchall()
    return Experiment(
        id=row["id"], group_id=row["id"], name=row["name"], description=row["description"],
        baseline_channel_id=row["baseline_channel_id"], created_at=row["created_at"],
        members=[ExperimentMember(channel_id=m["channel_id"], role=m["role"], declared_delta=load(m["declared_delta"]),
                                  result_score=m["result_score"], outcome=m["outcome"], added_at=m["added_at"])
                 for m in members])


def require_experiment(conn: Conn, experiment_id: str) -> Row:
    return fetch_or_raise(conn, lambda: NotFound(f"experiment {experiment_id} not found"),
                          "SELECT * FROM experiments WHERE id = ?", experiment_id)


def add_member(tx: Tx, experiment_id: str, channel_id: str, role: str, declared_delta: Json) -> None:
    tx.conn.execute(
        "INSERT INTO experiment_members (experiment_id, channel_id, role, declared_delta, added_at)"
        " VALUES (?, ?, ?, ?, ?) ON CONFLICT (experiment_id, channel_id) DO UPDATE SET role = excluded.role,"
        " declared_delta = excluded.declared_delta",
        (experiment_id, channel_id, role, dump(declared_delta), tx.ts))


def create_experiment(tx: Tx, name: str, description: Optional[str], baseline: Optional[str]) -> Experiment:
    experiment_id = str(uuid.uuid4())
    tx.conn.execute("INSERT INTO experiments (id, name, description, baseline_channel_id, created_at)"
                    " VALUES (?, ?, ?, ?, ?)", (experiment_id, name, description, baseline, tx.ts))
    if baseline:
        add_member(tx, experiment_id, baseline, "baseline", None)
    return experiment_answer(tx.conn, require_experiment(tx.conn, experiment_id))


def add_experiment_member(tx: Tx, experiment_id: str, channel_id: str, role: str, declared_delta: Json) -> Experiment:
    require_experiment(tx.conn, experiment_id)
    add_member(tx, experiment_id, channel_id, role, declared_delta)
    return experiment_answer(tx.conn, require_experiment(tx.conn, experiment_id))


def list_experiments(conn: Conn) -> list[Experiment]:
    return [experiment_answer(conn, r) for r in conn.execute("SELECT * FROM experiments ORDER BY created_at DESC")]


def get_experiment(conn: Conn, experiment_id: str) -> Experiment:
    return experiment_answer(conn, require_experiment(conn, experiment_id))


def rank_experiment(conn: Conn, experiment_id: str) -> RankedExperiment:
    experiment = experiment_answer(conn, require_experiment(conn, experiment_id))
    ranked = sorted(experiment.members, key=lambda m: (m.result_score is None, -(m.result_score or 0)))
    ranking = [RankedMember(**msgspec.structs.asdict(member), rank=rank) for rank, member in enumerate(ranked, start=1)]
    fields = msgspec.structs.asdict(experiment)
    # Members of the answer carry their rank too, as the ranking lists them.
    fields["members"] = [next(r for r in ranking if r.channel_id == m.channel_id) for m in experiment.members]
    return RankedExperiment(**fields, ranking=ranking)


async def api_experiments_create(request: Request, body: CreateExperiment) -> Experiment:
    """Create an experiment: a named group of runs compared against a baseline run."""
    return await db_of(request).write(create_experiment, body.name, body.description, body.baseline_channel_id)


async def api_experiments_list(request: Request) -> Experiments:
    """The experiments on this server."""
    return Experiments(experiments=await db_of(request).read(list_experiments))


async def api_experiments_get(request: Request, path) -> Experiment:
    """One experiment with its member runs."""
    return await db_of(request).read(get_experiment, path.group_id)


async def api_experiments_member(request: Request, path, body: AddExperimentMember) -> Experiment:
    """Add a run to an experiment as a variant (or another role), with the change it declares."""
    return await db_of(request).write(add_experiment_member, path.group_id, body.channel_id,
                                      body.role or "variant", body.declared_delta)


async def api_experiments_rank(request: Request, path) -> RankedExperiment:
    """Rank an experiment's runs by result score, best first."""
    return await db_of(request).read(rank_experiment, path.group_id)


EXPERIMENT_PATHS_SHOWN = 20                # state paths listed per variant where it left the baseline


def experiments_page(conn: Conn) -> dict:
    """Every experiment group, newest first, with its size."""
    groups = list_experiments(conn)
    return {"experiments": [{"id": g.id, "name": g.name, "description": g.description, "created_at": g.created_at,
                             "baseline_channel_id": g.baseline_channel_id, "members": len(g.members)} for g in groups]}


def experiment_column(conn: Conn, channel_id: str, baseline: Optional[Json], rank: Optional[int]) -> dict:
    """One run of an experiment as its column: what it was asked to do differently, how it ended,
    what it spent, and where its state left the baseline's."""
    row = channel_by_id(conn, channel_id)
    if row is None:
        return {"channel_id": channel_id, "missing": True}
    meta = experiment_of(row)
    spent = spend_of(conn, [(channel_id, None)])
    state = latest_state(conn, channel_id).state
    paths = ["/".join(map(str, entry.path)) for entry in diff_values(baseline, state)] if baseline is not None else []
    return {"channel_id": channel_id, "missing": False, "is_fork": row["parent_id"] is not None,
            "parent_channel_id": row["parent_id"], "intervention": meta.get("intervention"),
            "tool_policies": load(row["tool_policies"]) or {}, "outcome": row["outcome"],
            "score": row["result_score"], "status": shown_status(row["run_state"]), "spent": spent,
            "diverged": paths[:EXPERIMENT_PATHS_SHOWN], "diverged_total": len(paths), "rank": rank,
            "last_output": last_output(conn, channel_id), "promoted": row["promoted_event_id"] is not None}


def experiment_page(conn: Conn, experiment_id: str) -> dict:
    """One experiment side by side: its baseline first, then each variant, with the ranking
    rank_experiment answers (best score first) and the winner, the fork a promote would merge."""
    ranked = rank_experiment(conn, experiment_id)
    ranks = {member.channel_id: member.rank for member in ranked.members}
    order = [m.channel_id for m in ranked.members if m.channel_id == ranked.baseline_channel_id]
    order += [m.channel_id for m in ranked.members if m.channel_id != ranked.baseline_channel_id]
    if ranked.baseline_channel_id and ranked.baseline_channel_id not in order:
        order.insert(0, ranked.baseline_channel_id)
    baseline = (latest_state(conn, ranked.baseline_channel_id).state
                if ranked.baseline_channel_id and channel_by_id(conn, ranked.baseline_channel_id) else None)
    columns = [experiment_column(conn, channel_id, baseline if channel_id != ranked.baseline_channel_id else None,
                                 ranks.get(channel_id)) for channel_id in order]
    scored = [c for c in columns if not c["missing"] and c["score"] is not None]
    winner = max(scored, key=lambda c: c["score"])["channel_id"] if scored else None
    return {"experiment": {"id": ranked.id, "name": ranked.name, "description": ranked.description,
                           "baseline_channel_id": ranked.baseline_channel_id, "created_at": ranked.created_at},
            "columns": columns, "ranking": [{"channel_id": r.channel_id, "rank": r.rank, "score": r.result_score}
                                            for r in ranked.ranking], "winner": winner}


def experiments_of_run(conn: Conn, channel_id: str) -> list:
    """The experiment groups a run belongs to (as baseline or member), for links from its page."""
    return [{"id": r["id"], "name": r["name"]} for r in conn.execute(
        "SELECT DISTINCT e.id, e.name, e.created_at FROM experiments e LEFT JOIN experiment_members m"
        " ON m.experiment_id = e.id WHERE m.channel_id = ? OR e.baseline_channel_id = ?"
        " ORDER BY e.created_at DESC", (channel_id, channel_id))]


async def page_experiments(request: Request) -> Response:
    data = await db_of(request).read(experiments_page)
    return render(request, "experiments.html", {"title": "Experiments", **data, "experiment": None})


async def page_experiment(request: Request) -> Response:
    query = page_query(request, ExperimentPageQuery)
    data = await db_of(request).read(experiment_page, request.path_params["group_id"])
    return render(request, "experiments.html", {"title": f"Experiment {data['experiment']['name']}", **data,
                                                "promoted": query.promoted[:256]})


async def page_experiment_promote(request: Request) -> Response:
    """Promote one fork of the experiment into its parent (the API's promote), then show the experiment."""
    group_id = request.path_params["group_id"]
    channel_id = valid_channel((await read_form(request)).get("channel_id", ""), "channel_id")
    experiment = await db_of(request).read(get_experiment, group_id)
    if channel_id not in {m.channel_id for m in experiment.members}:
        raise BadRequest(f"run {channel_id} is not in experiment {experiment.name}")
    context_of(request).principal.require("write", channel_id)
    row = await db_of(request).read(channel_by_id, channel_id)
    if row is not None and row["parent_id"]:
        context_of(request).principal.require("write", row["parent_id"])
    await db_of(request).write(promote_channel, channel_id)
    return RedirectResponse(f"/experiments/{quote_segment(group_id)}?{urlencode({'promoted': channel_id})}",
                            status_code=303)


def experiments_schema(w: SchemaWords) -> str:
    return """
    CREATE TABLE experiments (
        id                   TEXT PRIMARY KEY,
        name                 TEXT NOT NULL,
        description          TEXT,
        baseline_channel_id  TEXT,
        created_at           TEXT NOT NULL
    );
    CREATE TABLE experiment_members (
        experiment_id   TEXT NOT NULL REFERENCES experiments(id),
        channel_id      TEXT NOT NULL,
        role            TEXT NOT NULL,
        declared_delta  TEXT,
        added_at        TEXT NOT NULL,
        PRIMARY KEY (experiment_id, channel_id)
    );
    """


def delete_memberships(tx: Tx, channel_id: str) -> None:
    """A deleted run leaves the experiments it was in (the experiment stays)."""
    tx.conn.execute("DELETE FROM experiment_members WHERE channel_id = ?", (channel_id,))


def experiment_links(conn: Conn, channel_id: str) -> dict:
    """What a run's page shows of its experiments: a link to each."""
    return {"experiments": experiments_of_run(conn, channel_id)}


EXPERIMENTS_ROUTES = (
    instance_wide("POST", "/api/v1/experiments", api_experiments_create, body=CreateExperiment),
    instance_wide("GET", "/api/v1/experiments", api_experiments_list),
    instance_wide("GET", "/api/v1/experiments/{group_id}", api_experiments_get),
    instance_wide("POST", "/api/v1/experiments/{group_id}/members", api_experiments_member, body=AddExperimentMember),
    instance_wide("GET", "/api/v1/experiments/{group_id}/rank", api_experiments_rank),
)
# The tables were part of the first step, before experiments were a region: they stay in step 1.
EXPERIMENTS = declare(Region(
    "experiments", features=("experiments",), schema=(SchemaPart(1, experiments_schema),),
    deleters=(delete_memberships,), routes=EXPERIMENTS_ROUTES,
    pages=(("GET", "/experiments", page_experiments), ("GET", "/experiments/{group_id}", page_experiment),
           ("POST", "/experiments/{group_id}/promote", page_experiment_promote)),
    nav=(NavLink("Experiments", "/experiments", "experiments", place=40),), run_page_parts=(experiment_links,)))


# =============================================================================
# Model calls: records and schema
# =============================================================================
# Region: a gateway in front of the model APIs. An application points its provider client's base
# URL at `/llm/runs/{run}/{upstream}/v1` and changes nothing else; each call it makes is sent to the
# configured upstream, recorded into the run (an `llm.call` event and a row of llm_calls, its bodies
# stored once per distinct content), priced, and, when the run re-runs its code (a fork from the
# start, a re-entered session), answered from the record instead of paid for again.
#
# Replay follows passes. A run's calls fall into passes: its first pass begins when it does (a fork's
# at its fork point), and each `session.started` the SDK records when an AgentSession is entered
# begins another. A call of a pass is compared with the call at the same position of the pass before
# it (a fork's first pass: the source's pass at the fork point, the calls it kept): the same request
# (its canonical JSON, the API included) is answered with the recorded bytes; the first call that
# differs, and every call after it in that pass, goes to the upstream. Only completed calls are
# positions (a failed or abandoned call is recorded, never replayed, and its retry takes its place).
# A fork's `tool_policies` name the tool `llm`: `live` (always the upstream), `replay` (a call that is
# not an exact replay is refused), `block` (no model call at all).

LLM_CALL_EVENT = "llm.call"
LLM_TOOL = "llm"                               # the model calls' name in a fork's tool_policies
LLM_CALL_STATES = ("running", "completed", "failed", "incomplete")
LLM_TIMEOUT_DEFAULT = 300.0                    # seconds an upstream has for one call (--llm-timeout)
LLM_STALE_SECONDS = 30.0                       # past its timeout by this much, a running call is abandoned
LLM_WAIT_SECONDS = 0.05                        # an identical call waits for the running one this often
LLM_KEY_VARIABLE = "ACTAE_LLM_KEY_{}"          # an upstream's key, by its name in capitals
# The APIs the gateway speaks, by the path after /v1/: the provider whose shape it is, its name.
LLM_APIS = {"chat/completions": ("openai", "chat.completions"), "responses": ("openai", "responses"),
            "messages": ("anthropic", "messages")}
LLM_FORCE_HEADER = "x-actae-llm"               # `live`: this call goes to the upstream whatever the record


@dataclass(frozen=True)
class Upstream:
    """A model server the gateway may call: its name in the path, its root URL (the API's own path,
    `/v1/chat/completions`, is added to it), the key it is called with (never shown). `unreadable`:
    kept by `actae llm add`, its key can no longer be decrypted (the keys cipher file was lost)."""

    name: str
    url: str
    key: Optional[str] = field(default=None, repr=False)
    unreadable: bool = False


class StoredUpstream(Record):
    """An upstream `actae llm add` keeps (`llm list`): never its key, only whether it has one."""

    name: str
    url: str
    has_key: bool
    added_at: str


@dataclass(frozen=True)
class LlmSettings:
    """The gateway's upstreams and bound (the `serve` flags --llm-upstream, --llm-key-file, --llm-timeout;
    create_app's `llm=`)."""

    upstreams: tuple[Upstream, ...] = ()
    timeout: float = LLM_TIMEOUT_DEFAULT

    def upstream(self, name: str) -> Optional[Upstream]:
        return next((upstream for upstream in self.upstreams if upstream.name == name), None)


@dataclass(frozen=True)
class LlmRequest:
    """One call as the application sent it, decoded once."""

    channel_id: str
    upstream: Upstream
    provider: str                              # whose API shape: openai | anthropic
    api: str                                   # chat.completions | responses | messages
    path: str                                  # after /v1/: what is called on the upstream
    body: bytes
    model: Optional[str]
    streamed: bool
    sha256: str                                # of the canonical request (the API and its JSON)
    forced_live: bool
    headers: tuple[tuple[str, str], ...]       # what goes upstream besides the key


@dataclass(frozen=True)
class Recorded:
    """A completed call's answer as it was recorded: what a replay sends again."""

    call_id: str
    body: bytes
    content_type: str
    http_status: int
    streamed: bool


@dataclass(frozen=True)
class LlmDecision:
    """What begin_llm_call decided: `replay` (the record answers), `live` (claimed: call the upstream),
    `wait` (an identical call at this position is running: wait for it), or `refused`."""

    action: Literal["replay", "live", "wait", "refused"]
    call_id: str = ""
    recorded: Optional[Recorded] = None
    refusal: str = ""
    position: int = 0
    claim: Optional["LlmClaim"] = None         # a live call claimed in memory, not yet a row (see LlmGateway)


@dataclass(frozen=True)
class LlmClaim:
    """A live call claimed in this server's memory: its row is written whole when it ends, with this."""

    req: "LlmRequest"
    pass_start: int
    position: int
    claim_key: str
    matched: bool
    claimed_at: str

    @property
    def key(self) -> tuple:
        return self.req.channel_id, self.pass_start, self.claim_key


@dataclass(frozen=True)
class LlmOutcome:
    """How a live call ended: its status, what the upstream answered, and when."""

    status: Literal["completed", "failed", "incomplete"]
    http_status: Optional[int]
    body: bytes
    content_type: str
    latency_ms: int
    first_byte_ms: Optional[int]
    error: Optional[str] = None


class UpstreamFailed(ActaeError, status=502, code="upstream_unavailable"):
    """The upstream model server is down, too slow (504), or answered what is no answer."""


def llm_schema(w: SchemaWords) -> str:
    # IF NOT EXISTS: a database rewound to an earlier step (the upgrade tests do) runs this step again.
    return f"""
    -- Bodies of model calls, once per distinct content (a long agent loop resends most of its
    -- context each call): the bytes as they crossed the wire, zlib-compressed.
    CREATE TABLE IF NOT EXISTS llm_bodies (
        sha256  TEXT PRIMARY KEY,
        packed  {w.packed} NOT NULL,
        size    {w.integer} NOT NULL
    );
    -- Each model call a run made through the gateway, claimed before it is sent.
    CREATE TABLE IF NOT EXISTS llm_calls (
        id               TEXT PRIMARY KEY,
        channel_id       TEXT NOT NULL,
        pass_start       {w.integer} NOT NULL,   -- the cursor its pass began after
        position         {w.integer} NOT NULL,   -- completed: its place among the pass's; else where it was decided
        claim_key        TEXT NOT NULL,          -- position and request: an identical call waits for it
        request_sha256   TEXT NOT NULL,
        matched          {w.integer} NOT NULL CHECK (matched IN (0, 1)),   -- the pass before had it there
        upstream         TEXT NOT NULL,
        provider         TEXT NOT NULL,
        api              TEXT NOT NULL,
        model            TEXT,
        streamed         {w.integer} NOT NULL CHECK (streamed IN (0, 1)),
        status           TEXT NOT NULL CHECK (status IN ({sql_list(LLM_CALL_STATES)})),
        request_body     TEXT NOT NULL,          -- llm_bodies.sha256
        response_body    TEXT,
        content_type     TEXT,
        http_status      {w.integer},
        replayed_from    TEXT,                   -- the call whose record answered it
        input_tokens     {w.integer},
        output_tokens    {w.integer},
        cached_input_tokens {w.integer},
        cost             {w.real},
        latency_ms       {w.integer},
        first_byte_ms    {w.integer},
        error            TEXT,
        event_id         TEXT,                   -- its llm.call event, once it ended
        cursor           {w.integer},
        created_at       TEXT NOT NULL,
        ended_at         TEXT
    );
    CREATE INDEX IF NOT EXISTS llm_calls_by_pass ON llm_calls (channel_id, pass_start, position);
    CREATE INDEX IF NOT EXISTS llm_calls_by_request_body ON llm_calls (request_body);
    CREATE INDEX IF NOT EXISTS llm_calls_by_response_body ON llm_calls (response_body) WHERE response_body IS NOT NULL;
    -- Where each run's current pass began (kept by session.started's event hook).
    CREATE TABLE IF NOT EXISTS llm_passes (
        channel_id  TEXT PRIMARY KEY,
        pass_start  {w.integer} NOT NULL
    );
    -- Each pass's calls counted as they end, so a call is decided in constant time however long the
    -- run: its completed calls (the next one's position), whether one went astray of the pass
    -- before, and the cursor of its first completed call (what a fork at a cursor kept of it).
    CREATE TABLE IF NOT EXISTS llm_tallies (
        channel_id    TEXT NOT NULL,
        pass_start    {w.integer} NOT NULL,
        completed     {w.integer} NOT NULL DEFAULT 0,
        diverged      {w.integer} NOT NULL DEFAULT 0,
        first_cursor  {w.integer},
        PRIMARY KEY (channel_id, pass_start)
    );
    """


def llm_upstreams_schema(w: SchemaWords) -> str:
    return """
    -- The upstreams `actae llm add` keeps (a --llm-upstream flag of the same name wins). The key is
    -- encrypted (Fernet) with the keys cipher beside the database (KEYS_CIPHER_FILE), never in clear.
    CREATE TABLE IF NOT EXISTS llm_upstreams (
        name            TEXT PRIMARY KEY,
        url             TEXT NOT NULL,
        key_ciphertext  TEXT,
        added_at        TEXT NOT NULL
    );
    """


def add_llm_upstream(tx: Tx, name: str, url: str, ciphertext: Optional[str]) -> StoredUpstream:
    """`llm add`: keep an upstream (again: its URL and key are replaced)."""
    tx.conn.execute("INSERT INTO llm_upstreams (name, url, key_ciphertext, added_at) VALUES (?, ?, ?, ?)"
                    " ON CONFLICT (name) DO UPDATE SET url = excluded.url, key_ciphertext = excluded.key_ciphertext,"
                    " added_at = excluded.added_at", (name, url, ciphertext, tx.ts))
    return StoredUpstream(name=name, url=url, has_key=ciphertext is not None, added_at=tx.ts)


def remove_llm_upstream(tx: Tx, name: str) -> StoredUpstream:
    row = tx.conn.execute("SELECT * FROM llm_upstreams WHERE name = ?", (name,)).fetchone()
    if row is None:
        raise NotFound(f"no upstream named {name!r} is kept (`llm list` shows them)")
    tx.conn.execute("DELETE FROM llm_upstreams WHERE name = ?", (name,))
    return stored_upstream(row)


def llm_upstream_rows(conn: Conn) -> list:
    return conn.execute("SELECT * FROM llm_upstreams ORDER BY name").fetchall()


def stored_upstream(row: Row) -> StoredUpstream:
    return StoredUpstream(name=row["name"], url=row["url"], has_key=row["key_ciphertext"] is not None,
                          added_at=row["added_at"])


# =============================================================================
# Model calls: recording and replay
# =============================================================================

def canonical_llm_request(api: str, body: Json) -> str:
    """The request's identity: the API and its JSON, canonical (key order and spacing do not count)."""
    return sha256_hex(canonical_json({"api": api, "body": body}))


@dataclass(frozen=True)
class PackedBody:
    """A body compressed and named, ready to keep (a live call's request is packed while the upstream
    works on it, off the time the call waits for)."""

    digest: str
    packed: bytes
    size: int


def pack_body(data: bytes) -> PackedBody:
    return PackedBody(hashlib.sha256(data).hexdigest(), zlib.compress(data, 6), len(data))


def keep_body(conn: Conn, body: PackedBody) -> str:
    """Store a body once (by its SHA-256) and name it."""
    conn.execute("INSERT INTO llm_bodies (sha256, packed, size) VALUES (?, ?, ?) ON CONFLICT (sha256) DO NOTHING",
                 (body.digest, body.packed, body.size))
    return body.digest


def body_of(conn: Conn, digest: Optional[str]) -> bytes:
    if digest is None:
        return b""
    row = conn.execute("SELECT packed FROM llm_bodies WHERE sha256 = ?", (digest,)).fetchone()
    return zlib.decompress(bytes(row[0])) if row is not None else b""


def note_pass(tx: Tx, event: Event) -> None:
    """session.started's hook: a new pass of model calls begins after this event."""
    tx.conn.execute("INSERT INTO llm_passes (channel_id, pass_start) VALUES (?, ?) ON CONFLICT (channel_id)"
                    " DO UPDATE SET pass_start = excluded.pass_start", (event.channel_id, event.cursor))


def forget_pass(conn: Conn, channel_id: str) -> None:
    conn.execute("DELETE FROM llm_passes WHERE channel_id = ?", (channel_id,))


def reindex_passes(conn: Conn, channel_id: str) -> None:
    """An imported run's pass: its last session.started."""
    forget_pass(conn, channel_id)
    conn.execute("INSERT INTO llm_passes (channel_id, pass_start) SELECT channel_id, MAX(cursor) FROM events"
                 " WHERE channel_id = ? AND type = 'session.started' GROUP BY channel_id", (channel_id,))


def delete_llm_calls(tx: Tx, channel_id: str) -> None:
    """A deleted run's calls, and the bodies no other call holds."""
    bodies = {digest for row in tx.conn.execute(
        "SELECT request_body, response_body FROM llm_calls WHERE channel_id = ?", (channel_id,)).fetchall()
        for digest in row if digest is not None}
    tx.conn.execute("DELETE FROM llm_calls WHERE channel_id = ?", (channel_id,))
    tx.conn.execute("DELETE FROM llm_tallies WHERE channel_id = ?", (channel_id,))
    forget_pass(tx.conn, channel_id)
    for digest in sorted(bodies):
        tx.conn.execute("DELETE FROM llm_bodies WHERE sha256 = ? AND NOT EXISTS (SELECT 1 FROM llm_calls WHERE"
                        " request_body = ?) AND NOT EXISTS (SELECT 1 FROM llm_calls WHERE response_body = ?)",
                        (digest, digest, digest))


def current_pass(conn: Conn, channel: Row) -> int:
    """The cursor the run's current pass began after: its last session.started, else its fork point."""
    row = conn.execute("SELECT pass_start FROM llm_passes WHERE channel_id = ?", (channel["id"],)).fetchone()
    fork_point = channel["resolved_cursor"] if channel["parent_id"] is not None else 0
    return max(row[0] if row is not None else 0, fork_point or 0)


def completed_call_at(conn: Conn, channel_id: str, pass_start: int, position: int, upto: int) -> Optional[Row]:
    """The pass's completed call at `position` (the order they completed in), if at or before cursor `upto`."""
    return conn.execute(
        "SELECT * FROM llm_calls WHERE channel_id = ? AND pass_start = ? AND position = ? AND status = 'completed'"
        " AND cursor <= ?", (channel_id, pass_start, position, upto)).fetchone()


def tally_of(conn: Conn, channel_id: str, pass_start: int) -> tuple:
    """(completed calls, whether one went astray) of a pass."""
    row = conn.execute("SELECT completed, diverged FROM llm_tallies WHERE channel_id = ? AND pass_start = ?",
                       (channel_id, pass_start)).fetchone()
    return (row[0], bool(row[1])) if row is not None else (0, False)


def tally(tx: Tx, channel_id: str, pass_start: int, completed_at: Optional[int], astray: bool) -> None:
    """Count a call in its pass's tally: one that completed (its llm.call event's cursor), one whose
    request went astray of the pass before (what follows in the pass goes upstream), or both."""
    tx.conn.execute(
        "INSERT INTO llm_tallies (channel_id, pass_start, completed, diverged, first_cursor) VALUES (?, ?, ?, ?, ?)"
        " ON CONFLICT (channel_id, pass_start) DO UPDATE SET completed = llm_tallies.completed + excluded.completed,"
        " diverged = CASE WHEN excluded.diverged = 1 THEN 1 ELSE llm_tallies.diverged END,"
        " first_cursor = COALESCE(llm_tallies.first_cursor, excluded.first_cursor)",
        (channel_id, pass_start, int(completed_at is not None), int(astray), completed_at))


def script_source(conn: Conn, channel: Row, pass_start: int) -> Optional[tuple]:
    """Whose pass the pass beginning after `pass_start` is compared with, as (run, its pass, the
    highest cursor seen): the run's previous pass that completed calls; for a fork's first pass,
    its source's last pass with completed calls at the fork point, and so on up its lineage."""
    previous = conn.execute("SELECT MAX(pass_start) FROM llm_tallies WHERE channel_id = ? AND pass_start < ?"
                            " AND completed > 0", (channel["id"], pass_start)).fetchone()[0]
    if previous is not None:
        return channel["id"], previous, INT64_MAX
    upto = channel["resolved_cursor"] or 0
    for row, _ in lineage(conn, channel["id"])[1:] if channel["parent_id"] is not None else ():
        found = last_pass_by(conn, row["id"], upto)
        if found is not None:
            return row["id"], found, upto
        upto = min(upto, row["resolved_cursor"] or 0)
    return None


def last_pass_by(conn: Conn, channel_id: str, upto: int) -> Optional[int]:
    """The last pass of a run whose first completed call is at or before cursor `upto` (what a fork there kept)."""
    return conn.execute("SELECT MAX(pass_start) FROM llm_tallies WHERE channel_id = ? AND first_cursor <= ?",
                        (channel_id, upto)).fetchone()[0]


def recorded_answer(conn: Conn, row: Row) -> Recorded:
    return Recorded(call_id=row["id"], body=body_of(conn, row["response_body"]),
                    content_type=row["content_type"] or "application/json", http_status=row["http_status"] or 200,
                    streamed=bool(row["streamed"]))


def stale(row: Row, now: datetime, timeout: float) -> bool:
    return row["created_at"] <= iso(now - timedelta(seconds=timeout + LLM_STALE_SECONDS))


@dataclass(frozen=True)
class LlmPlan:
    """What a call is in its run, as read: the pass it falls in, its position, the recorded call at
    that position of the pass it follows (and whether the request is that one's), the fork's policy."""

    closed: bool
    pass_start: int
    position: int
    expected: Optional[Row]
    matched: bool
    policy: str

    @property
    def where(self) -> str:
        return f"position {self.position} of the pass after cursor {self.pass_start}"

    def replays(self, req: LlmRequest) -> bool:
        return self.matched and self.policy != "live" and not req.forced_live

    def live(self) -> bool:
        """Sent to the upstream (claimed), neither refused nor answered from the record."""
        return not self.closed and self.policy != "block" and (self.matched or self.policy != "replay")

    def claim(self, req: LlmRequest, claimed_at: str) -> LlmClaim:
        return LlmClaim(req=req, pass_start=self.pass_start, position=self.position,
                        claim_key=f"{self.position}:{req.sha256}", matched=self.matched, claimed_at=claimed_at)


def plan_llm_call(conn: Conn, req: LlmRequest, reach: Reach) -> Optional[LlmPlan]:
    """The call's plan, or None for a run that does not exist yet (its first call makes it). A run
    `reach` may not change is answered as one that does not exist."""
    if not reach.changes(req.channel_id):
        raise NotFound(f"run {req.channel_id} not found")
    channel = channel_by_id(conn, req.channel_id)
    if channel is None:
        return None
    pass_start = current_pass(conn, channel)
    position, diverged = tally_of(conn, req.channel_id, pass_start)
    source = None if diverged else script_source(conn, channel, pass_start)
    expected = completed_call_at(conn, source[0], source[1], position, source[2]) if source else None
    return LlmPlan(closed=channel["closed_at"] is not None, pass_start=pass_start, position=position,
                   expected=expected, matched=expected is not None and expected["request_sha256"] == req.sha256,
                   policy=effective_policy(load(channel["tool_policies"]), LLM_TOOL) if channel["parent_id"] else "auto")


def claim_in_memory(conn: Conn, req: LlmRequest, reach: Reach) -> Optional[LlmDecision]:
    """The common call, decided by a read (Database.read_here): a live call of an existing run, claimed
    in this server's memory, writes nothing until it ends, so it needs no write transaction. None: the
    call needs begin_llm_call (a new run, a replay, a refusal)."""
    plan = plan_llm_call(conn, req, reach)
    if plan is None or not plan.live() or plan.replays(req):
        return None
    return LlmDecision("live", call_id=str(uuid.uuid4()), position=plan.position,
                       claim=plan.claim(req, iso(utc_now())))


def begin_llm_call(tx: Tx, req: LlmRequest, reach: Reach, timeout: float, claim_in_database: bool) -> LlmDecision:
    """Decide one call in the run's transaction: answered from the record, or claimed for the
    upstream (an identical call already running at its position: wait for that one). Where other
    servers share the database the claim is a committed row; where this server alone writes it, the
    claim is kept in its memory (LlmGateway.claims) and the call's row written once, as it ends: a
    live call then costs one durable commit, not two."""
    plan = plan_llm_call(tx.conn, req, reach)
    if plan is None:                 # a run's first call makes it, as its first event would
        ensure_channel(tx, req.channel_id)
        plan = plan_llm_call(tx.conn, req, reach)
    if plan.closed:
        return LlmDecision("refused", refusal=f"run {req.channel_id} is closed")
    if plan.policy == "block":
        return refuse_llm_call(tx, req, plan.policy, f"no model call on this fork ({plan.where})", plan.position)
    if plan.replays(req):
        return replay_llm_call(tx, req, plan.expected, plan.pass_start, plan.position)
    if not plan.live():
        return refuse_llm_call(tx, req, plan.policy, f"not an exact replay of the recorded call at {plan.where}",
                               plan.position)
    claim = plan.claim(req, tx.ts)
    if not claim_in_database:
        return LlmDecision("live", call_id=str(uuid.uuid4()), position=plan.position, claim=claim)
    running = tx.conn.execute("SELECT * FROM llm_calls WHERE channel_id = ? AND pass_start = ? AND claim_key = ?"
                              " AND status = 'running'", (req.channel_id, plan.pass_start, claim.claim_key)).fetchone()
    if running is not None:
        if not stale(running, tx.now, timeout):
            return LlmDecision("wait", call_id=running["id"], position=plan.position)
        end_abandoned(tx, running)
    call_id = str(uuid.uuid4())
    insert_claimed(tx, call_id, claim)
    if not plan.matched:
        tally(tx, req.channel_id, plan.pass_start, None, astray=True)
    return LlmDecision("live", call_id=call_id, position=plan.position)


LLM_CALL_COLUMNS = ("id", "channel_id", "pass_start", "position", "claim_key", "request_sha256", "matched",
                    "upstream", "provider", "api", "model", "streamed", "status", "request_body", "response_body",
                    "content_type", "http_status", "replayed_from", "input_tokens", "output_tokens",
                    "cached_input_tokens", "cost", "latency_ms", "first_byte_ms", "error", "event_id", "cursor",
                    "created_at", "ended_at")
INSERT_LLM_CALL = (f"INSERT INTO llm_calls ({', '.join(LLM_CALL_COLUMNS)})"
                   f" VALUES ({', '.join('?' for _ in LLM_CALL_COLUMNS)})")
UPDATE_LLM_CALL = (f"UPDATE llm_calls SET {', '.join(f'{name} = ?' for name in LLM_CALL_COLUMNS[1:])}"
                   " WHERE id = ?")


def claimed_call(tx: Tx, call_id: str, claim: LlmClaim, request: Optional[PackedBody] = None) -> dict:
    """A live call's row as it is claimed (running): its columns by name."""
    req = claim.req
    return dict.fromkeys(LLM_CALL_COLUMNS) | {
        "id": call_id, "channel_id": req.channel_id, "pass_start": claim.pass_start, "position": claim.position,
        "claim_key": claim.claim_key, "request_sha256": req.sha256, "matched": int(claim.matched),
        "upstream": req.upstream.name, "provider": req.provider, "api": req.api, "model": req.model,
        "streamed": int(req.streamed), "status": "running",
        "request_body": keep_body(tx.conn, request or pack_body(req.body)), "created_at": claim.claimed_at}


def insert_claimed(tx: Tx, call_id: str, claim: LlmClaim) -> None:
    """A live call's row, running, claimed in the database (other servers share it)."""
    call = claimed_call(tx, call_id, claim)
    tx.conn.execute(INSERT_LLM_CALL, tuple(call[name] for name in LLM_CALL_COLUMNS))


def store_ended_call(tx: Tx, call: dict, new: bool) -> Event:
    """An ended call's llm.call event, then its row with the event's place in one statement: inserted
    whole (a replay, or a call claimed in memory) or updated (a claim the database holds)."""
    event = append_event(tx, call["channel_id"], LLM_CALL_EVENT, call_payload(call), actor="gateway")
    call = call | {"event_id": event.id, "cursor": event.cursor}
    if new:
        tx.conn.execute(INSERT_LLM_CALL, tuple(call[name] for name in LLM_CALL_COLUMNS))
    else:
        tx.conn.execute(UPDATE_LLM_CALL, tuple(call[name] for name in LLM_CALL_COLUMNS[1:]) + (call["id"],))
    return event


def refuse_llm_call(tx: Tx, req: LlmRequest, policy: str, reason: str, position: int) -> LlmDecision:
    """The refusal is part of the run (`tool.blocked`, as the ledger records one)."""
    append_event(tx, req.channel_id, "tool.blocked", {"policy": policy, "tool_name": LLM_TOOL, "reason": reason,
                                                      "model": req.model, "request_sha256": req.sha256},
                 actor="gateway")
    return LlmDecision("refused", refusal=f"fork tool policy '{policy}' for {LLM_TOOL}: {reason}", position=position)


def replay_llm_call(tx: Tx, req: LlmRequest, source: Row, pass_start: int, position: int) -> LlmDecision:
    """Answer from `source`'s record; the replay is a call of this run too (it spent nothing)."""
    call_id = str(uuid.uuid4())
    claim = LlmClaim(req=req, pass_start=pass_start, position=position, claim_key=f"{position}:{req.sha256}",
                     matched=True, claimed_at=tx.ts)
    call = claimed_call(tx, call_id, claim) | {
        "status": "completed", "replayed_from": source["replayed_from"] or source["id"], "latency_ms": 0,
        "first_byte_ms": 0, "ended_at": tx.ts,
        **{name: source[name] for name in ("response_body", "content_type", "http_status", "input_tokens",
                                           "output_tokens", "cached_input_tokens", "cost")}}
    tally(tx, req.channel_id, pass_start, store_ended_call(tx, call, new=True).cursor, astray=False)
    return LlmDecision("replay", call_id=call_id, recorded=recorded_answer(tx.conn, source), position=position)


def require_call(conn: Conn, call_id: str) -> Row:
    found = call_state(conn, call_id)
    if found is None:
        raise NotFound(f"model call {call_id} not found")
    return found


def end_abandoned(tx: Tx, row: Row) -> None:
    """A running call whose server went away before it ended: incomplete (counted astray, or not,
    when it was claimed)."""
    store_ended_call(tx, dict(row) | {"status": "incomplete", "ended_at": tx.ts,
                                      "error": "abandoned: the server stopped before the call ended"}, new=False)


def finish_llm_call(tx: Tx, call_id: str, outcome: LlmOutcome, claim: Optional[LlmClaim] = None,
                    request: Optional[PackedBody] = None) -> None:
    """A live call ended: its answer stored, its usage and cost, its llm.call event. Claimed in
    memory, its row is written whole now (`request`: its body, packed while the upstream worked)."""
    if claim is not None:
        call = claimed_call(tx, call_id, claim, request)
    else:
        call = dict(require_call(tx.conn, call_id))
        if call["status"] != "running":
            return                               # ended already (abandoned, then answered late)
    completed = outcome.status == "completed"
    usage = call_usage(call["api"], outcome.body, bool(call["streamed"])) if completed else CallUsage()
    model = usage.model or call["model"]
    # A completed call takes the next place among its pass's completed calls (what a replay follows).
    position = tally_of(tx.conn, call["channel_id"], call["pass_start"])[0] if completed else call["position"]
    call |= {"status": outcome.status, "response_body": keep_body(tx.conn, pack_body(outcome.body)) if outcome.body
             else None, "content_type": outcome.content_type, "http_status": outcome.http_status,
             "input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens,
             "cached_input_tokens": usage.cached_input_tokens, "cost": call_cost(call["provider"], model, usage),
             "latency_ms": outcome.latency_ms, "first_byte_ms": outcome.first_byte_ms, "error": outcome.error,
             "model": model, "position": position, "ended_at": tx.ts}
    event = store_ended_call(tx, call, new=claim is not None)
    tally(tx, call["channel_id"], call["pass_start"], event.cursor if completed else None, astray=not call["matched"])


def call_payload(call: dict) -> dict:
    """The call's llm.call event: what it was and how it ended. A live call's usage and cost are in
    `usage` and `cost` (what the run spent, which the savings and /metrics sum); a replayed one's are
    in `saved` (what it did not spend)."""
    figures = {"input_tokens": call["input_tokens"], "output_tokens": call["output_tokens"],
               "cached_input_tokens": call["cached_input_tokens"]}
    replayed = call["replayed_from"] is not None
    return {
        "call_id": call["id"], "provider": call["provider"], "upstream": call["upstream"], "api": call["api"],
        "model": call["model"], "request_sha256": call["request_sha256"], "request_body": call["request_body"],
        "response_body": call["response_body"], "streamed": bool(call["streamed"]), "status": call["status"],
        "http_status": call["http_status"], "latency_ms": call["latency_ms"], "first_byte_ms": call["first_byte_ms"],
        "pass_start": call["pass_start"], "position": call["position"], "replayed": replayed,
        "replayed_from": call["replayed_from"], "measured": True,
        **({"saved": {**figures, "cost": call["cost"]}} if replayed else {"usage": figures, "cost": call["cost"]}),
        **({"error": call["error"]} if call["error"] else {}),
    }


def measured_saving(conn: Conn, channel_id: str) -> Optional[MeasuredSpend]:
    """What a fork did not pay for again, as the gateway measured it: the calls of the prefix it kept
    (each ancestor's own, up to where the line below it left) and the calls it answered from the
    record, each original call once (a replay names the call that was paid for)."""
    chain = lineage(conn, channel_id)
    if chain[0][0]["parent_id"] is None:
        return None
    originals: dict = {}
    for ancestor, upto in chain[1:]:
        for row in conn.execute("SELECT * FROM llm_calls WHERE channel_id = ? AND status = 'completed' AND cursor <= ?",
                                (ancestor["id"], upto)).fetchall():
            originals.setdefault(row["replayed_from"] or row["id"], row)
    for row in conn.execute("SELECT * FROM llm_calls WHERE channel_id = ? AND status = 'completed'"
                            " AND replayed_from IS NOT NULL", (channel_id,)).fetchall():
        originals.setdefault(row["replayed_from"], row)
    return measured_of(list(originals.values()))


def measured_of(rows: list) -> Optional[MeasuredSpend]:
    """What these recorded calls used, summed (None: no call)."""
    if not rows:
        return None
    costs = [row["cost"] for row in rows if row["cost"] is not None]
    return MeasuredSpend(calls=len(rows), input_tokens=sum(row["input_tokens"] or 0 for row in rows),
                         output_tokens=sum(row["output_tokens"] or 0 for row in rows),
                         cached_input_tokens=sum(row["cached_input_tokens"] or 0 for row in rows),
                         cost=round(sum(costs), 9) if costs else None, calls_without_cost=len(rows) - len(costs))


def followed_calls(conn: Conn, source_id: str, resolved: int) -> list:
    """The completed calls a fork of `source_id` at cursor `resolved` follows when it re-runs from the
    start (script_source's pass, found from the fork's side before the fork exists), in order: what
    its calls would be answered with from the record."""
    for row, leave in lineage(conn, source_id):
        upto = resolved if leave is None else leave
        found = last_pass_by(conn, row["id"], upto)
        if found is not None:
            return conn.execute("SELECT * FROM llm_calls WHERE channel_id = ? AND pass_start = ? AND status = 'completed'"
                                " AND cursor <= ? ORDER BY position", (row["id"], found, upto)).fetchall()
    return []


def paid_calls_after(conn: Conn, channel_id: str, after: int) -> list:
    """The calls a run paid for (completed, not answered from a record) after cursor `after`."""
    return conn.execute("SELECT * FROM llm_calls WHERE channel_id = ? AND status = 'completed' AND cursor > ?"
                        " AND replayed_from IS NULL ORDER BY cursor", (channel_id, after)).fetchall()


def call_state(conn: Conn, call_id: str) -> Optional[Row]:
    return conn.execute("SELECT * FROM llm_calls WHERE id = ?", (call_id,)).fetchone()


@dataclass(frozen=True)
class CallUsage:
    """What one answer says it used: tokens in (cached ones among them) and out, and the model."""

    input_tokens: Optional[int] = None
    output_tokens: Optional[int] = None
    cached_input_tokens: Optional[int] = None
    model: Optional[str] = None


def sse_documents(body: bytes) -> list:
    """The JSON documents of a server-sent-events stream's `data:` lines, in order ([DONE] left out)."""
    documents = []
    for line in body.decode("utf-8", "replace").splitlines():
        if line.startswith("data:"):
            text = line[5:].strip()
            if text and text != "[DONE]":
                try:
                    documents.append(json.loads(text))
                except ValueError:
                    continue
    return documents


def whole_count(value: object) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= USAGE_COUNT_MAX else None


def usage_fields(usage: object) -> dict:
    """Tokens under the names each API gives them (chat: prompt/completion; responses and messages:
    input/output; cached input: prompt_tokens_details, input_tokens_details, cache_read_input_tokens)."""
    if not isinstance(usage, dict):
        return {}
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    found = {"input_tokens": whole_count(usage.get("prompt_tokens", usage.get("input_tokens"))),
             "output_tokens": whole_count(usage.get("completion_tokens", usage.get("output_tokens"))),
             "cached_input_tokens": whole_count(details.get("cached_tokens") if isinstance(details, dict) else None)
             if "cache_read_input_tokens" not in usage else whole_count(usage.get("cache_read_input_tokens"))}
    return {name: value for name, value in found.items() if value is not None}


def call_usage(api: str, body: bytes, streamed: bool) -> CallUsage:
    """Usage and model from an answer: a whole JSON answer, or a stream's events (a chat stream's
    last chunk; a responses stream's response.completed; a messages stream's message_start and
    message_delta, whose counts add up)."""
    try:
        documents = sse_documents(body) if streamed else [json.loads(body)]
    except ValueError:
        return CallUsage()
    found: dict = {}
    model = None
    for document in documents:
        if not isinstance(document, dict):
            continue
        inner = document.get("response") or document.get("message") or document
        if isinstance(inner, dict):
            model = inner.get("model") or model
            for name, value in usage_fields(inner.get("usage")).items():
                found[name] = value if api != "messages" else max(found.get(name, 0), value)
        for name, value in usage_fields(document.get("usage")).items():
            found[name] = value if api != "messages" else max(found.get(name, 0), value)
    return CallUsage(model=model, **found)


def call_cost(provider: str, model: Optional[str], usage: CallUsage) -> Optional[float]:
    """The call's price in USD from genai-prices' own data (no network), or None: a model it does not
    know, or an answer without counts, has an unknown cost, never zero."""
    if model is None or usage.input_tokens is None or usage.output_tokens is None:
        return None
    cached = usage.cached_input_tokens or 0
    import genai_prices        # imported here: a tenth of a second, paid by the first priced call only

    try:
        price = genai_prices.calc_price(
            genai_prices.Usage(input_tokens=usage.input_tokens, output_tokens=usage.output_tokens,
                               cache_read_tokens=cached or None),
            model_ref=model, provider_id=provider if provider in ("openai", "anthropic") else None)
    except (LookupError, ValueError):
        return None
    return float(price.total_price)



# =============================================================================
# Model calls: a run's calls on its page, and a call's page (what the model was given and answered)
# =============================================================================

LLM_CALLS_SHOWN = 200                          # a run page lists this many of its model calls


# A call with the step it belongs to: the step whose event the application records next (NULL: it
# came after the run's last step).
CALLS_WITH_STEP = (
    "SELECT c.*, (SELECT e.step_number FROM events e WHERE e.channel_id = c.channel_id AND e.cursor > c.cursor"
    " AND e.step_number IS NOT NULL ORDER BY e.cursor LIMIT 1) AS step FROM llm_calls c")


def run_llm_calls(conn: Conn, channel_id: str) -> dict:
    """A run page's part: its model calls, each under its step, and what its replayed ones saved."""
    rows = conn.execute(f"{CALLS_WITH_STEP} WHERE c.channel_id = ? AND c.cursor IS NOT NULL ORDER BY c.cursor"
                        " LIMIT ?", (channel_id, LLM_CALLS_SHOWN + 1)).fetchall()
    if not rows:
        return {}
    calls = [{"id": row["id"], "step": row["step"], "cursor": row["cursor"],
              "model": row["model"], "api": row["api"], "status": row["status"], "streamed": bool(row["streamed"]),
              "replayed": row["replayed_from"] is not None, "input_tokens": row["input_tokens"],
              "output_tokens": row["output_tokens"], "cost": row["cost"], "latency_ms": row["latency_ms"]}
             for row in rows[:LLM_CALLS_SHOWN]]
    replayed = [call for call in calls if call["replayed"]]
    costs = [call["cost"] for call in replayed]
    return {"llm_calls": calls, "llm_calls_more": len(rows) > LLM_CALLS_SHOWN,
            "llm_replayed": {"calls": len(replayed), "input_tokens": sum(c["input_tokens"] or 0 for c in replayed),
                             "output_tokens": sum(c["output_tokens"] or 0 for c in replayed),
                             "cost": None if not costs or None in costs else round(sum(costs), 9)}}


def text_of(content: object) -> str:
    """A message's text: a string, or the text of its parts (text, input_text, output_text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict) and "text" in part)
    return ""


def shown(role: str, text: str = "", tools: tuple = (), answers: Optional[str] = None) -> dict:
    return {"role": role, "text": text, "tools": [{"name": name, "arguments": arguments} for name, arguments in tools],
            "answers": answers}


def arguments_text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def chat_messages(messages: list) -> list:
    found = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        calls = tuple((str((c.get("function") or {}).get("name")), arguments_text((c.get("function") or {}).get("arguments")))
                      for c in message.get("tool_calls") or [] if isinstance(c, dict))
        found.append(shown(str(message.get("role")), text_of(message.get("content")), calls,
                           message.get("tool_call_id")))
    return found


def anthropic_blocks(role: str, content: object) -> list:
    if not isinstance(content, list):
        return [shown(role, text_of(content))]
    text = "\n".join(block.get("text", "") for block in content if isinstance(block, dict) and block.get("type") == "text")
    tools = tuple((str(block.get("name")), arguments_text(block.get("input"))) for block in content
                  if isinstance(block, dict) and block.get("type") == "tool_use")
    found = [shown(role, text, tools)] if text or tools else []
    found += [shown("tool", text_of(block.get("content")), answers=block.get("tool_use_id")) for block in content
              if isinstance(block, dict) and block.get("type") == "tool_result"]
    return found


def response_items(items: object) -> list:
    if isinstance(items, str):
        return [shown("user", items)]
    found = []
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "function_call":
            found.append(shown("assistant", tools=((str(item.get("name")), arguments_text(item.get("arguments"))),)))
        elif item.get("type") == "function_call_output":
            found.append(shown("tool", arguments_text(item.get("output")), answers=item.get("call_id")))
        elif item.get("role") or item.get("type") == "message":
            found.append(shown(str(item.get("role", "assistant")), text_of(item.get("content"))))
    return found


def asked_messages(api: str, body: Json) -> list:
    """What the model was given, readable: each message's role, its text, the tools it called and
    the results it was handed."""
    if not isinstance(body, dict):
        return []
    if api == "messages":
        system = [shown("system", text_of(body.get("system")))] if body.get("system") else []
        return system + [m for message in body.get("messages") or [] if isinstance(message, dict)
                         for m in anthropic_blocks(str(message.get("role")), message.get("content"))]
    if api == "responses":
        system = [shown("system", str(body["instructions"]))] if body.get("instructions") else []
        return system + response_items(body.get("input"))
    return chat_messages(body.get("messages") or [])


def streamed_answer(api: str, body: bytes) -> Json:
    """A streamed answer put back together as the whole answer it stands for."""
    documents = sse_documents(body)
    if api == "responses":
        done = [d["response"] for d in documents if isinstance(d, dict) and d.get("type") == "response.completed"]
        return done[-1] if done else {}
    if api == "messages":
        blocks: dict = {}
        for d in (d for d in documents if isinstance(d, dict)):
            if d.get("type") == "content_block_start":
                blocks[d.get("index")] = dict(d.get("content_block") or {})
            elif d.get("type") == "content_block_delta":
                block, delta = blocks.setdefault(d.get("index"), {"type": "text"}), d.get("delta") or {}
                block["text"] = block.get("text", "") + str(delta.get("text", ""))
                block["partial"] = block.get("partial", "") + str(delta.get("partial_json", ""))
        for block in blocks.values():
            if block.get("type") == "tool_use" and block.get("partial"):
                block["input"] = block["partial"]
        return {"content": [blocks[i] for i in sorted(blocks, key=lambda index: (index is None, index))]}
    text, tools = "", {}
    for d in (d for d in documents if isinstance(d, dict)):
        for choice in d.get("choices") or []:
            delta = (choice or {}).get("delta") or {}
            text += str(delta.get("content") or "")
            for call in delta.get("tool_calls") or []:
                entry = tools.setdefault(call.get("index"), {"function": {"name": "", "arguments": ""}})
                function = call.get("function") or {}
                entry["function"]["name"] += str(function.get("name") or "")
                entry["function"]["arguments"] += str(function.get("arguments") or "")
    return {"choices": [{"message": {"role": "assistant", "content": text, "tool_calls": list(tools.values())}}]}


def answered_messages(api: str, body: bytes, streamed: bool) -> list:
    """What the model answered, readable (as asked_messages)."""
    try:
        document = streamed_answer(api, body) if streamed else json.loads(body)
    except ValueError:
        return [shown("assistant", body.decode("utf-8", "replace")[:PAGE_JSON_CHARS])]
    if not isinstance(document, dict):
        return []
    if api == "messages":
        return anthropic_blocks("assistant", document.get("content"))
    if api == "responses":
        return response_items(document.get("output"))
    choices = document.get("choices") or [{}]
    return chat_messages([(choices[0] or {}).get("message") or {}])


def call_page(conn: Conn, channel_id: str, call_id: str, reach: Reach) -> dict:
    """One model call: what it was, what the model was given and what it answered."""
    row = conn.execute(f"{CALLS_WITH_STEP} WHERE c.id = ?", (call_id,)).fetchone()
    if row is None or row["channel_id"] != channel_id or not reach.sees(channel_id):
        raise NotFound(f"model call {call_id} of run {channel_id} not found")
    asked = body_of(conn, row["request_body"])
    answered = body_of(conn, row["response_body"])
    try:
        request_document = json.loads(asked)
    except ValueError:
        request_document = None
    return {"call": {"id": row["id"], "channel_id": channel_id, "model": row["model"], "api": row["api"],
                     "upstream": row["upstream"], "status": row["status"], "streamed": bool(row["streamed"]),
                     "replayed_from": row["replayed_from"], "http_status": row["http_status"],
                     "input_tokens": row["input_tokens"], "output_tokens": row["output_tokens"],
                     "cached_input_tokens": row["cached_input_tokens"], "cost": row["cost"],
                     "latency_ms": row["latency_ms"], "first_byte_ms": row["first_byte_ms"], "error": row["error"],
                     "step": row["step"],
                     "request_sha256": row["request_sha256"], "created_at": row["created_at"]},
            "asked": asked_messages(row["api"], request_document),
            "answered": answered_messages(row["api"], answered, bool(row["streamed"])) if answered else []}


async def page_llm_call(request: Request) -> Response:
    channel_id = path_channel(request)
    data = await db_of(request).read(call_page, channel_id, request.path_params["call_id"], reach_of(request))
    return render(request, "llm_call.html", {"title": f"Model call of {channel_id}", **data})


# =============================================================================
# Model calls: the gateway, its routes and commands
# =============================================================================

class LlmGateway:
    """The gateway in one app: its settings, the upstreams `actae llm add` keeps (read again when
    KEY_REFRESH_SECONDS old: the command may run while the server does), and the HTTP client every
    upstream call goes through."""

    def __init__(self, settings: LlmSettings, db: Database, data_dir: Path):
        self.settings, self.db, self.data_dir = settings, db, data_dir
        self.stored: dict[str, Upstream] = {}
        self.stored_at = -math.inf
        self.loading: Optional[asyncio.Future] = None
        self._http: Optional["aiohttp.ClientSession"] = None
        # The live calls claimed in memory (a database no other server writes), by (run, pass, claim
        # key): each resolves to its call's id when the call's row is written.
        self.claims: dict[tuple, asyncio.Future] = {}
        self.background: set = set()       # the ends of streams whose client went away, being recorded

    async def upstream(self, name: str) -> Optional[Upstream]:
        """The upstream called `name`: a --llm-upstream flag's, else one `actae llm add` keeps."""
        flagged = self.settings.upstream(name)
        if flagged is not None:
            return flagged
        await self.fresh(KEY_REFRESH_SECONDS)
        if name not in self.stored:
            await self.fresh(KEY_MISS_RELOAD_SECONDS)
        return self.stored.get(name)

    async def fresh(self, max_age: float) -> None:
        """The kept upstreams read again when older than `max_age`, one read shared by every call waiting."""
        if time.monotonic() - self.stored_at > max_age:
            if self.loading is None or self.loading.done():
                self.loading = asyncio.ensure_future(self.reload())
            await asyncio.shield(self.loading)

    async def reload(self) -> None:
        rows = await self.db.read(llm_upstream_rows)
        cipher = None
        if any(row["key_ciphertext"] is not None for row in rows):
            cipher = await asyncio.to_thread(keys_cipher, self.data_dir)
        self.stored = {row["name"]: kept_upstream(row, cipher) for row in rows}
        self.stored_at = time.monotonic()

    def release(self, claim: Optional[LlmClaim], call_id: str) -> None:
        """An in-memory claim's call ended (its row written, or not): whoever waits on it reads it."""
        if claim is not None:
            waiting = self.claims.pop(claim.key, None)
            if waiting is not None and not waiting.done():
                waiting.set_result(call_id)

    def http(self) -> "aiohttp.ClientSession":
        """One connection pool for every upstream, made by the first call (a server that never calls
        one does not import aiohttp). It follows no redirect, keeps no cookie from one run's answer
        for the next, and passes bodies on as they came (no decompression). The timeout bounds each
        wait on the upstream (its first byte, and each gap in a stream), not a whole stream."""
        if self._http is None:
            import aiohttp
            timeout = self.settings.timeout
            self._http = aiohttp.ClientSession(
                cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False, trust_env=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(10.0, timeout), sock_read=timeout))
        return self._http

    async def send(self, req: LlmRequest) -> "aiohttp.ClientResponse":
        """The call sent to its upstream: the answer's status and headers (its body still to read)."""
        return await self.http().post(upstream_url(req), data=req.body, headers=upstream_headers(req),
                                      allow_redirects=False)

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.close()


def provider_error(provider: str, status: int, message: str, kind: str) -> Response:
    """An error in the provider's own shape (its clients read the message from there)."""
    if provider == "anthropic":
        document = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        document = {"error": {"message": message, "type": kind, "param": None, "code": kind}}
    return Response(msgspec.json.encode(document), status_code=status, media_type="application/json",
                    headers={"x-actae-replayed": "false"})


PROVIDER_ERROR_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                        404: "not_found_error", 413: "request_too_large", 502: "api_error", 503: "overloaded_error",
                        504: "api_error"}


def error_for(provider: str, exc: ActaeError) -> Response:
    return provider_error(provider, exc.status, exc.message, PROVIDER_ERROR_KINDS.get(exc.status, "api_error"))


def llm_credential(request: Request) -> Optional[str]:
    """The Actae key, sent as the provider client sends its own: OpenAI's `Authorization: Bearer`,
    Anthropic's `x-api-key`."""
    return request.headers.get("x-api-key") or bearer_token(request)


def kept_upstream(row: Row, cipher: Optional["cryptography.fernet.Fernet"]) -> Upstream:
    """A kept upstream with its key decrypted (none kept: $ACTAE_LLM_KEY_<NAME>, as for a flag's)."""
    from cryptography.fernet import InvalidToken

    if row["key_ciphertext"] is None:
        return Upstream(name=row["name"], url=row["url"], key=upstream_key_variable(row["name"]))
    try:
        key = cipher.decrypt(row["key_ciphertext"].encode("ascii")).decode("utf-8")
    except (InvalidToken, ValueError):
        return Upstream(name=row["name"], url=row["url"], unreadable=True)
    return Upstream(name=row["name"], url=row["url"], key=key)


def key_variable(name: str) -> str:
    """The environment variable that holds upstream `name`'s key: ACTAE_LLM_KEY_<NAME>."""
    return LLM_KEY_VARIABLE.format(re.sub(r"[^A-Z0-9]", "_", name.upper()))


def upstream_key_variable(name: str) -> Optional[str]:
    return os.environ.get(key_variable(name)) or None


async def llm_request(request: Request, channel_id: str, upstream_name: str, path: str) -> LlmRequest:
    provider, api = LLM_APIS[path]
    upstream = await request.app.services.region(LlmGateway).upstream(upstream_name)
    if upstream is None:
        raise NotFound(f"no upstream named {upstream_name!r} is configured (--llm-upstream NAME=URL, or"
                       f" `actae llm add NAME --url URL`)")
    if upstream.unreadable:
        raise UpstreamFailed(f"the key of upstream {upstream_name} cannot be decrypted with {KEYS_CIPHER_FILE}:"
                             f" run `actae llm add {upstream_name} --url URL --key-file FILE` again")
    body = await read_capped(request)
    document = decode_json(body, Json, "the request body")
    if not isinstance(document, dict):
        raise BadRequest("the request body is not a JSON object")
    problem = document_problem(document)
    if problem is not None:
        raise BadRequest(f"the request body: {problem}")
    model = document.get("model") if isinstance(document.get("model"), str) else None
    passed = [(name, value) for name, value in request.headers.items()
              if name.startswith("anthropic-") or name in ("openai-organization", "openai-project")]
    return LlmRequest(channel_id=channel_id, upstream=upstream, provider=provider, api=api, path=path, body=body,
                      model=model, streamed=document.get("stream") is True,
                      sha256=canonical_llm_request(api, document),
                      forced_live=request.headers.get(LLM_FORCE_HEADER, "").lower() == "live",
                      headers=tuple(passed))


def upstream_headers(req: LlmRequest) -> dict:
    headers = {"content-type": "application/json", "accept-encoding": "identity", **dict(req.headers)}
    if req.upstream.key:
        if req.provider == "anthropic":
            headers["x-api-key"] = req.upstream.key
        else:
            headers["authorization"] = f"Bearer {req.upstream.key}"
    if req.provider == "anthropic":
        headers.setdefault("anthropic-version", "2023-06-01")
    return headers


def upstream_url(req: LlmRequest) -> str:
    root = req.upstream.url.rstrip("/")
    return (root[:-3] if root.endswith("/v1") else root) + "/v1/" + req.path


def replayed_response(recorded: Recorded, call_id: str) -> Response:
    """The recorded bytes again; a stream as it was recorded, event by event."""
    headers = {"x-actae-replayed": "true", "x-actae-call-id": call_id}
    if not recorded.streamed:
        return Response(recorded.body, status_code=recorded.http_status, media_type=recorded.content_type,
                        headers=headers)

    async def events():
        for piece in re.split(rb"(?<=\n\n)", recorded.body):
            if piece:
                yield piece
    return StreamingResponse(events(), status_code=recorded.http_status, media_type=recorded.content_type,
                             headers={**headers, "content-encoding": "identity", "cache-control": "no-store"})


async def decided(db: Database, gateway: LlmGateway, req: LlmRequest, reach: Reach) -> LlmDecision:
    """begin_llm_call, waiting out an identical running call at the same position (then answered by
    its record, or, when it failed, decided again). A live decision claimed in memory is registered
    before anything else runs on the loop, so an identical call decided next finds it."""
    timeout = gateway.settings.timeout
    deadline = time.monotonic() + timeout + LLM_STALE_SECONDS
    while True:
        decision = db.read_here(claim_in_memory, req, reach) or await db.write(
            begin_llm_call, req, reach, timeout, db.location.shared)
        if decision.action == "live" and decision.claim is not None:
            running = gateway.claims.get(decision.claim.key)
            if running is None:
                gateway.claims[decision.claim.key] = asyncio.get_running_loop().create_future()
                return decision
            row = await ended_claim(db, running, deadline)
        elif decision.action == "wait":
            row = await ended_row(db, decision.call_id, deadline)
        else:
            return decision
        if row is not None and row["status"] == "completed":
            recorded = await db.read(recorded_answer, row)
            return LlmDecision("replay", call_id=row["id"], recorded=recorded, position=decision.position)
        if time.monotonic() >= deadline:
            raise UpstreamFailed("an identical call at this position did not end in time", status=504)


async def ended_claim(db: Database, running: asyncio.Future, deadline: float) -> Optional[Row]:
    """The row of an identical call claimed in memory, once it ended (None: it did not in time)."""
    try:
        call_id = await asyncio.wait_for(asyncio.shield(running), max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        return None
    return await db.read(call_state, call_id)


async def ended_row(db: Database, call_id: str, deadline: float) -> Optional[Row]:
    """An identical call's committed claim, once it is no longer running (or at the deadline)."""
    row = None
    while time.monotonic() < deadline:
        await asyncio.sleep(LLM_WAIT_SECONDS)
        row = await db.read(call_state, call_id)
        if row is None or row["status"] != "running":
            break
    return row


def llm_endpoint(path: str) -> Callable:
    """The handler of POST /llm/runs/{channel_id}/{upstream}/v1/{path}, one per API (LLM_APIS)."""
    async def llm_call(request: Request) -> Response:
        return await answer_llm_call(request, path)
    return llm_call


async def answer_llm_call(request: Request, path: str) -> Response:
    params, provider = request.path_params, LLM_APIS[path][0]
    try:
        channel_id = valid_channel(params["channel_id"])
        principal = await check_key(request.app, llm_credential(request))
        req = await llm_request(request, channel_id, params["upstream"], path)
        gateway = request.app.services.region(LlmGateway)
        decision = await decided(request.app.services.db, gateway, req, principal.reach)
    except ActaeError as exc:
        return error_for(provider, exc)
    if decision.action == "refused":
        return provider_error(provider, 403, decision.refusal, "permission_error")
    if decision.action == "replay":
        return replayed_response(decision.recorded, decision.call_id)
    ending = CallEnding(request.app.services.db, gateway, decision.call_id, decision.claim)
    try:
        return await live_call(gateway, req, ending)
    except BaseException:
        ending.abandon()
        raise


@dataclass
class CallEnding:
    """How a live call's end is recorded: its row finished (or written whole, claimed in memory), then
    its in-memory claim released, once."""

    db: Database
    gateway: LlmGateway
    call_id: str
    claim: Optional[LlmClaim]
    streaming: bool = False            # a stream records its own end, after the response was handed over
    request: Optional[PackedBody] = None   # claimed in memory: the request's body, packed while the upstream works

    async def record(self, outcome: "LlmOutcome") -> None:
        try:
            await self.db.write(finish_llm_call, self.call_id, outcome, self.claim, self.request)
        finally:
            self.gateway.release(self.claim, self.call_id)

    def abandon(self) -> None:
        """The handler failed before the call ended: nobody waits on it any more."""
        if not self.streaming:
            self.gateway.release(self.claim, self.call_id)


async def live_call(gateway: LlmGateway, req: LlmRequest, ending: CallEnding) -> Response:
    """Send the call upstream and answer what it answers, recording it as it ends."""
    import aiohttp

    started = time.perf_counter()
    elapsed = lambda: int((time.perf_counter() - started) * 1000)  # noqa: E731
    headers = {"x-actae-replayed": "false", "x-actae-call-id": ending.call_id}
    try:
        upstream = await sent_while_packing(gateway, req, ending)
    except asyncio.TimeoutError:
        return await failed_call(ending, req, elapsed(), 504, f"the upstream {req.upstream.name} did not answer"
                                                              f" within {gateway.settings.timeout:g} s")
    except aiohttp.ClientError as exc:
        return await failed_call(ending, req, elapsed(), 502,
                                 f"the upstream {req.upstream.name} is unavailable ({type(exc).__name__})")
    first_byte = elapsed()
    content_type = upstream.headers.get("content-type", "application/json")
    if not (req.streamed and upstream.status < 400):
        try:
            body = await upstream.read()
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            upstream.close()
            return await failed_call(ending, req, elapsed(), 502,
                                     f"the upstream {req.upstream.name} broke off its answer ({type(exc).__name__})")
        upstream.release()
        ok = upstream.status < 400
        if ok and not json_answer(body):
            return await failed_call(ending, req, elapsed(), 502,
                                     f"the upstream {req.upstream.name} answered what is not JSON")
        await ending.record(LlmOutcome("completed" if ok else "failed", upstream.status, body, content_type,
                                       elapsed(), first_byte, None if ok else f"the upstream answered {upstream.status}"))
        return Response(body, status_code=upstream.status, media_type=content_type, headers=headers)
    ending.streaming = True
    return StreamingResponse(relayed(ending, upstream, started, first_byte), status_code=upstream.status,
                             media_type=content_type,
                             headers={**headers, "content-encoding": "identity", "cache-control": "no-store"})


async def sent_while_packing(gateway: LlmGateway, req: LlmRequest, ending: CallEnding) -> "aiohttp.ClientResponse":
    """The upstream's answer (its headers; the body still to read). A call claimed in memory has its
    request packed for its row meanwhile: the request is on its way first, so a long context's
    compression costs the call nothing while the upstream works on it."""
    sending = asyncio.ensure_future(gateway.send(req))
    try:
        if ending.claim is not None:
            await asyncio.sleep(0)                # the request goes out before the body is packed
            ending.request = pack_body(req.body)
        return await sending
    except BaseException:
        sending.cancel()                          # the client went away: so does the upstream request
        raise


def json_answer(body: bytes) -> bool:
    try:
        return isinstance(json.loads(body), dict)
    except ValueError:
        return False


async def relayed(ending: CallEnding, upstream: "aiohttp.ClientResponse", started: float, first_byte: int):
    """The upstream's stream, passed on as it comes and kept; a client that goes away ends it
    (the upstream connection is closed) and the call is recorded as incomplete."""
    import aiohttp

    chunks: list = []

    def ended(status: str, error: Optional[str]) -> LlmOutcome:
        return LlmOutcome(status, upstream.status, b"".join(chunks),
                          upstream.headers.get("content-type", "text/event-stream"),
                          int((time.perf_counter() - started) * 1000), first_byte, error)
    try:
        async for chunk in upstream.content.iter_any():
            chunks.append(chunk)
            yield chunk
    except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
        upstream.close()
        outcome = ended("failed", f"the upstream broke off its stream ({type(exc).__name__})")
    except BaseException:
        # The client went away (the response was cancelled): every await here would be cancelled
        # too, so the upstream is closed now and the call recorded on a task of its own.
        upstream.close()
        background = ending.gateway.background
        finishing = asyncio.get_running_loop().create_task(
            ending.record(ended("incomplete", "the client went away before the stream ended")))
        background.add(finishing)
        finishing.add_done_callback(background.discard)
        raise
    else:
        upstream.release()
        outcome = ended("completed", None)
    await ending.record(outcome)


async def failed_call(ending: CallEnding, req: LlmRequest, latency_ms: int, status: int, message: str) -> Response:
    await ending.record(LlmOutcome("failed", None, b"", "", latency_ms, None, message))
    response = provider_error(req.provider, status, message, PROVIDER_ERROR_KINDS[status])
    response.headers["x-actae-call-id"] = ending.call_id
    return response


async def llm_unknown(request: Request) -> Response:
    """Any other path under a run's upstream (models, embeddings, ...): not served (404), in the
    provider's shape: the gateway forwards only the calls it records."""
    provider = "anthropic" if request.path_params.get("upstream") == "anthropic" else "openai"
    return provider_error(provider, 404, f"the gateway does not serve {request.method} {request.url.path}: it"
                                         " forwards chat/completions, responses and messages", "not_found_error")


def upstream_flag(text: str) -> tuple:
    name, sep, url = text.partition("=")
    parts = urlsplit(url)
    well_named = re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name)
    extra = parts.query or parts.fragment or parts.username
    if not (sep and well_named and parts.scheme in ("http", "https") and parts.hostname) or extra:
        raise argparse.ArgumentTypeError("takes NAME=URL: a name of letters, digits, . _ -, and an http(s) URL"
                                         " with no query or user (e.g. ollama=http://127.0.0.1:11434)")
    return name, url


def key_file_flag(text: str) -> tuple:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError("takes NAME=PATH: the upstream's name and a file holding its key")
    return name, path


def add_llm_flags(parser: argparse.ArgumentParser) -> None:
    llm = parser.add_argument_group("the model-call gateway (/llm/runs/RUN/NAME/v1/...)")
    llm.add_argument("--llm-upstream", type=upstream_flag, action="append", default=[], metavar="NAME=URL",
                     help="a model server the gateway may call as NAME (repeatable): openai=https://api.openai.com,"
                          " anthropic=https://api.anthropic.com, or any OpenAI-compatible server; its key comes"
                          " from $ACTAE_LLM_KEY_<NAME> or --llm-key-file")
    llm.add_argument("--llm-key-file", type=key_file_flag, action="append", default=[], metavar="NAME=PATH",
                     help="read upstream NAME's key from this file (repeatable)")
    llm.add_argument("--llm-timeout", type=seconds(3600), default=LLM_TIMEOUT_DEFAULT, metavar="SECONDS",
                     help=f"time an upstream has for one call (default: {LLM_TIMEOUT_DEFAULT:g})")


def llm_settings_of(args: argparse.Namespace) -> dict:
    files = dict(getattr(args, "llm_key_file", []))
    upstreams = []
    for name, url in getattr(args, "llm_upstream", []):
        key = upstream_key_variable(name)
        if name in files:
            try:
                key = Path(files[name]).read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise SystemExit(f"actae: cannot read the key file of upstream {name}: {exc.strerror}") from None
        upstreams.append(Upstream(name=name, url=url, key=key or None))
    unknown = sorted(set(files) - {upstream.name for upstream in upstreams})
    if unknown:
        raise SystemExit(f"actae: --llm-key-file names no --llm-upstream: {', '.join(unknown)}")
    return {"llm": LlmSettings(upstreams=tuple(upstreams), timeout=getattr(args, "llm_timeout", LLM_TIMEOUT_DEFAULT))}


def llm_banner(options: dict) -> Optional[str]:
    settings = options.get("llm")
    if not settings or not settings.upstreams:
        return None
    served = ", ".join(f"{upstream.name} ({upstream.url})" for upstream in settings.upstreams)
    return f"Model calls: {served} at /llm/runs/RUN/NAME/v1"


def install_llm_gateway(services: Services, options: dict) -> Installed:
    gateway = LlmGateway(typing.cast(LlmSettings, options.get("llm") or LlmSettings()), services.db,
                         services.data_dir)
    return Installed(services=(gateway,), stops=(gateway.stop,))


def add_llm_commands(commands: Subcommands, common: argparse.ArgumentParser, scoped: argparse.ArgumentParser) -> None:
    llm = add_command(commands, "llm", llm_command, [common], "the model-call gateway's upstreams: add, list, remove")
    kinds = llm.add_subparsers(dest="llm_command", required=True, metavar="{add,list,remove}")
    add = kinds.add_parser("add", parents=[common], help="keep an upstream the gateway may call as NAME (its key"
                                                         " encrypted beside the database); a running server sees it"
                                                         " within a second")
    add.add_argument("name", metavar="NAME", help="its name in the path: /llm/runs/RUN/NAME/v1/...")
    add.add_argument("--url", required=True, metavar="URL",
                     help="its root URL, such as https://api.openai.com or http://127.0.0.1:11434")
    given = add.add_mutually_exclusive_group()
    given.add_argument("--key-file", metavar="PATH",
                       help="a file holding its API key (preferred: the key stays out of `ps` and shell history);"
                            " - reads standard input. Default: $ACTAE_LLM_KEY_<NAME>, else a prompt on a terminal,"
                            " else none (a local server needs none)")
    given.add_argument("--key", metavar="KEY",
                       help="the key itself, for scripts (it shows in `ps` and shell history: prefer --key-file)")
    listing = kinds.add_parser("list", parents=[common], help="the upstreams kept (never their keys)")
    listing.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    remove = kinds.add_parser("remove", parents=[common], help="forget a kept upstream and its key")
    remove.add_argument("name", metavar="NAME")


def llm_command(args: argparse.Namespace, location: Location) -> int:
    """`actae llm add|list|remove`."""
    if args.llm_command == "add":
        try:
            name, url = upstream_flag(f"{args.name}={args.url}")
        except argparse.ArgumentTypeError as exc:
            raise SystemExit(f"actae: llm add {exc}") from None
        key = key_of_args(args.key_file, args.key, key_variable(name), f"API key of upstream {name} (none: press Enter): ")
        ciphertext = keys_cipher(location.data_dir).encrypt(key.encode("utf-8")).decode("ascii") if key else None
        kept = write_once(location, add_llm_upstream, name, url, ciphertext)
        print(f"Upstream {kept.name} at {kept.url} ({'its key stored encrypted' if kept.has_key else 'no key'}):"
              f" /llm/runs/RUN/{kept.name}/v1")
    elif args.llm_command == "list":
        kept = [stored_upstream(row) for row in read_once(location, llm_upstream_rows)]
        print_listing(args.json, {"upstreams": kept}, f"{'NAME':<20} {'URL':<48} {'KEY':<4} ADDED",
                      (f"{u.name:<20} {u.url:<48} {'yes' if u.has_key else 'no':<4} {u.added_at}" for u in kept))
    else:
        removed = write_once(location, remove_llm_upstream, args.name)
        print(f"Upstream {removed.name} ({removed.url}) removed")
    return 0


LLM_PREFIX = "/llm/runs/{channel_id}/{upstream}/v1"
MODEL_CALLS = declare(Region(
    "model calls", features=("llm_gateway",), schema=(SchemaPart(25, llm_schema), SchemaPart(26, llm_upstreams_schema)),
    event_hooks=(EventHook(("session.started",), note_pass),), reindexers=(reindex_passes,),
    deleters=(delete_llm_calls,),
    endpoints=(*(Endpoint("POST", f"{LLM_PREFIX}/{path}", llm_endpoint(path)) for path in LLM_APIS),
               Endpoint("POST", LLM_PREFIX + "/{rest:path}", llm_unknown),
               Endpoint("GET", LLM_PREFIX + "/{rest:path}", llm_unknown)),
    json_paths=("/llm/",), pages=(("GET", "/runs/{channel_id}/calls/{call_id}", page_llm_call),),
    run_page_parts=(run_llm_calls,), savings_measures=(measured_saving,), installers=(install_llm_gateway,),
    serve_flags=(add_llm_flags,), commands=(add_llm_commands,),
    options=(llm_settings_of,), banner_lines=(llm_banner,), lone_writes=(begin_llm_call, finish_llm_call)))


# =============================================================================
# Fork plans: records
# =============================================================================
# Region: the effect plan. What a fork would do, before it is made, writing nothing: the boundary it
# resolves to, the fate of every effect in the source's ledger under its tool policies (replayed,
# refused, run again; an effect claimed and never completed is "outcome unknown": it may have
# happened downstream, and a fork that runs it again is flagged), the model calls it would answer
# from the record, and what the source's steps after the boundary spent last time (a forecast).
# POST /api/v1/forks/plan; bulk fork's dry run carries one per run, summed; the run page's fork form
# shows one for the step and policies chosen, and a fork's page the plan it was made under.

PLAN_FATES = ("replayed", "refused", "runs_again")


class ForkPlanRequest(Record):
    """What a fork takes, less what it would be called: the source, the step or the cursor to fork
    after (neither: its latest snapshot), the tool policies, the intervention (carried into the digest)."""

    source_channel_id: ChannelId
    at_step: Optional[Positive] = None
    at_cursor: Optional[Count] = None
    tool_policies: Optional[ToolPolicies] = None
    intervention: Optional[JsonObject] = None

    def __post_init__(self):
        if self.at_step is not None and self.at_cursor is not None:
            raise ValueError("give at_step or at_cursor, not both")
        self.tool_policies = self.tool_policies or None


class PlanBoundary(Answer):
    """Where the fork would begin: the run it would fork (an ancestor, for a step the source inherited),
    the cursor asked and the one it resolves to (its snapshot's), the step, whether its state is kept."""

    channel_id: str
    requested_cursor: int
    resolved_cursor: int
    step: Optional[int]
    restorable: bool
    state_version: Optional[int]


class PlannedEffect(Answer):
    """One effect of the source's ledger and its fate on the fork."""

    execution_id: str
    channel_id: str                        # whose ledger holds it (an ancestor's, for one the source inherited)
    key_name: str
    tool_name: str
    params: Json
    status: str                            # as the ledger has it
    place: Literal["inherited", "after_boundary"]
    policy: Literal[TOOL_POLICIES]         # the fork's tool policy for it
    fate: Literal[PLAN_FATES]
    outcome_unknown: bool                  # claimed, never completed: it may have happened downstream
    flagged: bool                          # it would run again although it may have happened already
    why: str


class PlannedCalls(Answer):
    """The model calls the fork follows when it re-runs from the start, with their recorded usage."""

    policy: Literal[TOOL_POLICIES]         # the fork's policy for the tool `llm`
    fate: Literal["replayed", "paid_again", "refused"]
    spend: MeasuredSpend


class PlanCounts(Answer):
    effects: int = 0
    replayed: int = 0
    refused: int = 0
    runs_again: int = 0
    outcome_unknown: int = 0
    flagged: int = 0


class ForkPlan(Answer):
    """What a fork would do (POST /api/v1/forks/plan); `digest` names this plan (the same arguments on an
    unchanged source give the same one)."""

    source_channel_id: str
    boundary: PlanBoundary
    effects: list[PlannedEffect]
    counts: PlanCounts
    model_calls: Optional[PlannedCalls]    # None: the gateway recorded no call the fork would follow
    forecast: Spend                        # what the source's steps after the boundary spent last time
    forecast_calls: Optional[MeasuredSpend]   # the model calls among them, as the gateway recorded them
    digest: str


class PlanTotals(Answer):
    """A bulk fork's plans summed."""

    runs: int
    counts: PlanCounts
    model_calls: Optional[MeasuredSpend]   # the calls the forks would replay
    forecast: Spend


# =============================================================================
# Fork plans: what a fork would do
# =============================================================================

def plan_fork(conn: Conn, req: ForkPlanRequest, reach: Reach) -> ForkPlan:
    """The plan of a fork of `req.source_channel_id`, read from the ledger and the records as they are;
    writes nothing. A source `reach` may not read is one that does not exist."""
    if not reach.sees(req.source_channel_id):
        raise NotFound(f"channel {req.source_channel_id} not found")
    source = require_channel(conn, req.source_channel_id)
    if req.at_step is not None:
        located = resolve_step(conn, source["id"], req.at_step)      # NotFound: no such step
        source, requested = require_channel(conn, located.channel_id), located.cursor
    else:
        requested = req.at_cursor or 0
    snapshot = fork_snapshot(conn, source, requested)
    resolved = snapshot["cursor"] if snapshot else 0
    policies = req.tool_policies or {}
    effects = [planned_effect(row, place, effective_policy(policies, row["tool_name"]))
               for row, place in ledger_as_forked(conn, source["id"], resolved)]
    calls = followed_calls(conn, source["id"], resolved)
    llm_policy = effective_policy(policies, LLM_TOOL)
    model_calls = PlannedCalls(policy=llm_policy, fate={"block": "refused", "live": "paid_again"}.get(
        llm_policy, "replayed"), spend=measured_of(list(calls))) if calls else None
    boundary = PlanBoundary(channel_id=source["id"], requested_cursor=requested, resolved_cursor=resolved,
                            step=step_at(conn, source, resolved) if resolved else None,
                            restorable=snapshot is not None, state_version=snapshot["version"] if snapshot else None)
    plan = ForkPlan(source_channel_id=source["id"], boundary=boundary, effects=effects, counts=counted(effects),
                    model_calls=model_calls, forecast=spend_of(conn, [(source["id"], None, resolved)]),
                    forecast_calls=measured_of(paid_calls_after(conn, source["id"], resolved)), digest="")
    plan.digest = sha256_hex(canonical_json({"plan": msgspec.to_builtins(plan), "intervention": req.intervention,
                                             "tool_policies": req.tool_policies}))
    return plan


def ledger_as_forked(conn: Conn, source_id: str, resolved: int) -> list:
    """(execution row, place) of every effect in the ledger a fork at `resolved` would see: the source's
    own (inherited when it completed, or was claimed, at or before the boundary; else after it), then
    each ancestor's the source inherited (a key the source holds itself shadows its ancestors')."""
    seen, found = set(), []
    for row, leave in lineage(conn, source_id):
        upto = resolved if leave is None else leave
        for execution in conn.execute("SELECT * FROM executions WHERE channel_id = ? ORDER BY created_at, id",
                                      (row["id"],)).fetchall():
            if execution["key_name"] in seen or (execution["key_name"], execution["tool_name"]) == SESSION_FENCE:
                continue
            seen.add(execution["key_name"])
            mark = execution["completed_cursor"] if execution["status"] == "completed" else execution["started_cursor"]
            before = mark is not None and mark <= upto
            if before or leave is None:          # an ancestor's effect after where the line left is not the fork's
                found.append((execution, "inherited" if before else "after_boundary"))
    return found


def planned_effect(row: Row, place: str, policy: str) -> PlannedEffect:
    """An effect's fate on the fork, as claim_on_fork will decide it when the fork claims the same key."""
    completed = row["status"] == "completed"
    unknown = place == "inherited" and row["status"] not in ("completed", "failed", "cancelled")
    if policy == "block":
        fate, why = "refused", "block refuses every claim of it on the fork"
    elif policy == "live":
        fate, why = "runs_again", "live runs it again" + (" although it completed" if completed and place == "inherited"
                                                          else "")
    elif place == "inherited" and completed:
        fate, why = "replayed", "its recorded result answers the fork's claim"
    elif policy == "replay":
        fate, why = "refused", "replay refuses a claim the record does not answer"
    else:
        fate, why = "runs_again", ("recorded after the boundary: auto runs it again" if place == "after_boundary"
                                   else f"it {'failed' if row['status'] == 'failed' else 'was not completed'}"
                                        " before the boundary: auto runs it again")
    if unknown:
        why = f"outcome unknown (claimed, no result, {'lease gone' if row['lease_until'] is None else 'lease until ' + row['lease_until']}): {why}"
    return PlannedEffect(execution_id=row["id"], channel_id=row["channel_id"], key_name=row["key_name"],
                         tool_name=row["tool_name"], params=load(row["params"]), status=row["status"], place=place,
                         policy=policy, fate=fate, outcome_unknown=unknown,
                         flagged=unknown and fate == "runs_again", why=why)


def counted(effects: list) -> PlanCounts:
    return PlanCounts(effects=len(effects), replayed=sum(e.fate == "replayed" for e in effects),
                      refused=sum(e.fate == "refused" for e in effects),
                      runs_again=sum(e.fate == "runs_again" for e in effects),
                      outcome_unknown=sum(e.outcome_unknown for e in effects), flagged=sum(e.flagged for e in effects))


def plan_totals(plans: list) -> PlanTotals:
    """Plans summed, as a bulk fork's dry run carries them."""
    spends = [plan.model_calls.spend for plan in plans if plan.model_calls is not None]
    return PlanTotals(runs=len(plans), counts=summed(PlanCounts, [plan.counts for plan in plans]),
                      model_calls=summed(MeasuredSpend, spends) if spends else None,
                      forecast=summed(Spend, [plan.forecast for plan in plans]))


def summed(kind: type, records: list) -> Struct:
    """Records of one kind added field by field; a cost is unknown (None) only when every one's is."""
    def total(name: str) -> object:
        values = [getattr(record, name) for record in records]
        if name == "cost":
            known = [value for value in values if value is not None]
            return round(sum(known), 9) if known else None
        return round(sum(values), 6) if name == "wall_seconds" else sum(values)
    return kind(**{f.name: total(f.name) for f in msgspec.structs.fields(kind)})


# =============================================================================
# Fork plans: handlers, routes and the fork form's plan
# =============================================================================

async def api_forks_plan(request: Request, body: ForkPlanRequest) -> ForkPlan:
    """What a fork with these arguments would do, without making it: its boundary, the fate of every
    effect in the source's ledger under the tool policies (replayed, refused, run again; claimed and
    never completed: outcome unknown, flagged if it would run again), the model calls it would replay
    and what the source's steps after the boundary spent last time. Writes nothing."""
    return await db_of(request).read(plan_fork, body, reach_of(request))


class PlanPageQuery(Record):
    """The fork form's fields, as its "Plan it" button sends them (GET)."""

    step: Optional[Positive] = None
    name: PageText = ""
    intervention: PageText = ""
    tool_policies: PageText = ""
    fragment: bool = False               # only the plan's table (the form fetches it as its fields change)
    hand_off: bool = False


async def page_fork_plan(request: Request) -> Response:
    """The fork form's plan: the plan for the step and policies typed, then the form again with the
    button that makes the fork."""
    channel_id = path_channel(request)
    query = page_query(request, PlanPageQuery)
    context = {"title": f"Plan a fork of {channel_id}", "channel_id": channel_id, "plan": None, "error": None,
               "form": {"step": str(query.step or ""), "name": query.name, "intervention": query.intervention,
                        "tool_policies": query.tool_policies, "hand_off": query.hand_off}, "fragment": query.fragment}
    try:
        policies = form_tool_policies(msgspec.structs.asdict(query))
        plan = await db_of(request).read(plan_fork, ForkPlanRequest(
            source_channel_id=channel_id, at_step=query.step, tool_policies=policies), reach_of(request))
        context["plan"] = msgspec.to_builtins(plan)
    except (BadRequest, Conflict) as exc:
        context["error"] = exc.message
    return render(request, "fork_plan_fragment.html" if query.fragment else "fork_plan.html", context)


def fork_plan_part(conn: Conn, channel_id: str) -> dict:
    """A fork's page: the plan it was made under (its parent's ledger as it stands, its boundary, its
    policies); nothing for a run that is no fork."""
    row = require_channel(conn, channel_id)
    if row["parent_id"] is None:
        return {}
    plan = plan_fork(conn, ForkPlanRequest(source_channel_id=row["parent_id"], at_cursor=row["resolved_cursor"] or 0,
                                           tool_policies=load(row["tool_policies"]) or None), EVERYWHERE)
    return {"fork_plan": msgspec.to_builtins(plan)}


FORK_PLANS = declare(Region(
    "fork plans",
    routes=(Api("POST", "/api/v1/forks/plan", api_forks_plan, body=ForkPlanRequest,
                scopes=reads("body.source_channel_id")),),
    pages=(("GET", "/runs/{channel_id}/fork/plan", page_fork_plan),), run_page_parts=(fork_plan_part,)))


# =============================================================================
# Hand-offs: records and schema
# =============================================================================
# Region: forks the application's own workers run. A fork made with `hand_off` (the API, the fork
# form, bulk fork, MCP), or handed off once made, is announced in the same transaction as a
# `fork.job` event on one jobs channel that one consumer group reads: the Groups region's competing
# consumers, so a worker built on the SDK's create_group / join_group / claim_work / ack_work takes
# each job alone, and a job whose worker's lease ran out goes to the next worker (at-least-once; the
# ledger keeps the fork's side effects single across the takeover). Where a job stands is read from
# what is stored already (the group's reservations, the fork's own run): a claim, a heartbeat and an
# acknowledgement write nothing more.

FORK_JOBS_CHANNEL = "actae.fork-jobs"            # one `fork.job` event per hand-off
FORK_WORKERS_GROUP = "actae.fork-workers"        # the consumer group the workers join
FORK_JOB_EVENT = "fork.job"
HAND_OFF_STATES = ("waiting", "claimed", "running", "done", "failed")


def hand_offs_schema(w: SchemaWords) -> str:
    return f"""
    -- A fork handed to the application's workers: its job (the cursor of its fork.job event on the
    -- jobs channel) and the fork's last cursor when it was handed off (what it records after is the
    -- worker's). One row per fork: handing off again a fork whose job failed replaces it.
    CREATE TABLE IF NOT EXISTS fork_hand_offs (
        channel_id     TEXT PRIMARY KEY,
        group_id       TEXT NOT NULL,
        jobs_channel   TEXT NOT NULL,
        job_cursor     {w.integer} NOT NULL,
        run_cursor     {w.integer} NOT NULL,
        handed_off_at  TEXT NOT NULL
    );
    """


class HandOff(Answer):
    """A fork handed to the application's workers and where its job stands: `waiting` for a worker,
    `claimed` by one (`worker`), `running` (the worker records on the fork), `done` (the fork
    completed), `failed` (the fork crashed or failed, or its worker let the job go unfinished)."""

    channel_id: str
    state: Literal[HAND_OFF_STATES]
    detail: str                        # the state in words, as the fork's page says it
    worker: Optional[str]              # the worker (consumer id) that holds the job, or held it last
    lease_until: Optional[str]         # until when it holds it, unless it renews
    jobs_channel_id: str
    group_id: str
    job_cursor: int
    handed_off_at: str


# =============================================================================
# Hand-offs: the job, and where it stands
# =============================================================================

def announce_fork_job(tx: Tx, fork: Row, run_cursor: int) -> None:
    """The fork's job: a fork.job event on the jobs channel, and its row. The workers' group is made
    with the first job, so every job is above its watermark."""
    conn = tx.conn
    if channel_by_id(conn, FORK_JOBS_CHANNEL) is None and row_where(conn, "consumer_groups", id=FORK_WORKERS_GROUP):
        # The jobs channel was deleted: its new first jobs would lie below the old group's watermark.
        delete_consumer_group(tx, FORK_WORKERS_GROUP)
    create_consumer_group(tx, FORK_WORKERS_GROUP, FORK_JOBS_CHANNEL, {"purpose": "forks handed to workers"})
    job = append_event(tx, FORK_JOBS_CHANNEL, FORK_JOB_EVENT, {
        "fork_channel_id": fork["id"], "source_channel_id": fork["parent_id"],
        "forked_at_step": fork["forked_at_step"]})
    delete_hand_off(tx, fork["id"])            # a fork handed off again: its new job replaces the failed one
    conn.execute("INSERT INTO fork_hand_offs (channel_id, group_id, jobs_channel, job_cursor, run_cursor,"
                 " handed_off_at) VALUES (?, ?, ?, ?, ?, ?)",
                 (fork["id"], FORK_WORKERS_GROUP, FORK_JOBS_CHANNEL, job.cursor, run_cursor, tx.ts))


def announce_handed_off_fork(tx: Tx, event: Event) -> None:
    """fork.started of a fork made with hand_off: its job, in the fork's transaction."""
    if not (isinstance(event.payload, dict) and event.payload.get("hand_off") is True):
        return
    fork = channel_by_id(tx.conn, event.channel_id)
    # Only a fork's own first event: a fork.started recorded by hand later, or on a run that is no
    # fork, announces nothing (POST .../hand-off is the way to hand off a fork made without it).
    if fork is None or fork["parent_id"] is None or event.cursor != 1:
        return
    announce_fork_job(tx, fork, event.cursor)


def job_holder(conn: Conn, row: Row) -> tuple[Optional[Row], bool]:
    """(the worker whose reservation covers the job, or None; whether the job is acknowledged)."""
    group = row_where(conn, "consumer_groups", id=row["group_id"])
    if group is None:
        return None, False
    job = row["job_cursor"]
    holder = conn.execute("SELECT * FROM group_consumers WHERE group_id = ? AND reserved_from < ?"
                          " AND claimed_cursor >= ? ORDER BY updated_at DESC, consumer_id",
                          (row["group_id"], job, job)).fetchone()
    return holder, job <= group["committed_cursor"] or (holder is not None and holder["acked_cursor"] >= job)


def hand_off_of(conn: Conn, row: Row, run: Row, now: str) -> HandOff:
    """Where the job stands, from the fork's run first (completed is done, whoever ran it), then from
    the group's reservation of the job."""
    holder, acked = job_holder(conn, row)
    worker = holder["consumer_id"] if holder is not None else None
    lease = holder["lease_until"] if holder is not None else None
    live = holder is not None and lease > now and not acked
    progressed = (run["last_cursor"] or 0) > row["run_cursor"]
    state, run_state = run["run_state"], run["run_state"]
    if run_state == "completed":
        state, detail = "done", "The fork completed" + (f" on worker {worker}." if worker else ".")
    elif acked:
        state = "failed"
        detail = (f"The fork {run_state}" + (f" on worker {worker}" if worker else "") + "."
                  if run_state in FAILURE_STATES else
                  f"Worker {worker or '(gone)'} let the job go without completing the fork (it is {run_state}).")
    elif live and progressed and run_state in FAILURE_STATES:
        state, detail = "failed", f"The fork {run_state} on worker {worker}."
    elif live:
        state = "running" if progressed else "claimed"
        doing = f"Worker {worker} is running it" if progressed else f"Claimed by worker {worker}"
        detail = f"{doing} (its lease runs until {lease} unless it renews)."
    elif holder is not None:
        state, detail = "waiting", (f"Waiting for a worker: {worker}'s lease ran out at {lease}; the next worker"
                                    " to claim work takes the job and resumes the fork where it stands.")
    else:
        state, detail = "waiting", (f"Waiting for a worker to claim it from the group {row['group_id']} (on the"
                                    f" channel {row['jobs_channel']}).")
    return HandOff(channel_id=row["channel_id"], state=state, detail=detail, worker=worker, lease_until=lease,
                   jobs_channel_id=row["jobs_channel"], group_id=row["group_id"], job_cursor=row["job_cursor"],
                   handed_off_at=row["handed_off_at"])


def hand_off_state(conn: Conn, channel_id: str, reach: Reach, now: Optional[str] = None) -> HandOff:
    """Where a handed-off fork's job stands; 404 for a run `reach` may not read, or never handed off."""
    if not reach.sees(channel_id):
        raise NotFound(f"channel {channel_id} not found")
    run = require_channel(conn, channel_id)
    row = present(row_where(conn, "fork_hand_offs", channel_id=channel_id),
                  lambda: NotFound(f"run {channel_id} was not handed off to a worker"))
    return hand_off_of(conn, row, run, now or iso(utc_now()))


def hand_off_fork(tx: Tx, channel_id: str, reach: Reach) -> HandOff:
    """Hand a fork made without hand_off to the workers. One job at a time: a fork whose job is still
    waiting, claimed or running answers that job; one whose job failed gets a new job."""
    if not reach.sees(channel_id):
        raise NotFound(f"channel {channel_id} not found")
    run = require_channel(tx.conn, channel_id)
    if run["parent_id"] is None:
        raise Conflict("not_a_fork", f"{channel_id} is not a fork: a worker resumes a fork from its boundary")
    row = row_where(tx.conn, "fork_hand_offs", channel_id=channel_id)
    if row is not None:
        current = hand_off_of(tx.conn, row, run, tx.ts)
        if current.state != "failed":
            return current
    if run["run_state"] == "completed":
        raise Conflict("run_completed", f"{channel_id} completed already: fork it again to run its tail anew")
    announce_fork_job(tx, run, run["last_cursor"] or 0)
    return hand_off_of(tx.conn, row_where(tx.conn, "fork_hand_offs", channel_id=channel_id), run, tx.ts)


def delete_hand_off(tx: Tx, channel_id: str) -> None:
    """A deleted fork's row (its job stays on the jobs channel: the worker finds no fork and lets it go)."""
    tx.conn.execute("DELETE FROM fork_hand_offs WHERE channel_id = ?", (channel_id,))


def hand_off_part(conn: Conn, channel_id: str) -> dict:
    """A fork's page: where its job stands, or the button that hands it off (a fork not yet completed)."""
    run = require_channel(conn, channel_id)
    row = row_where(conn, "fork_hand_offs", channel_id=channel_id)
    if row is not None:
        return {"hand_off": msgspec.to_builtins(hand_off_of(conn, row, run, iso(utc_now())))}
    return {"hand_off": None, "may_hand_off": run["parent_id"] is not None and run["run_state"] != "completed"}


# =============================================================================
# Hand-offs: handlers, routes and the fork page's card
# =============================================================================

async def api_hand_off(request: Request, path) -> HandOff:
    """Where a handed-off fork's job stands: waiting for a worker, claimed by which worker, running, done
    or failed (404 for a run never handed off)."""
    return await db_of(request).read(hand_off_state, path.channel_id, reach_of(request))


async def api_hand_off_fork(request: Request, path, body: Empty) -> HandOff:
    """Hand a fork to the application's workers: a `fork.job` event on the jobs channel actae.fork-jobs,
    claimed through the consumer group actae.fork-workers. A fork whose job is not over answers that job;
    409 for a run that is no fork, or a fork that completed."""
    return await db_of(request).write(hand_off_fork, path.channel_id, reach_of(request))


async def page_hand_off_card(request: Request) -> Response:
    """The fork page's hand-off card alone: live.js fetches it again until the job is over."""
    channel_id = path_channel(request)
    handed = await db_of(request).read(hand_off_state, channel_id, reach_of(request))
    return render(request, "_hand_off.html", {"hand_off": msgspec.to_builtins(handed), "may_hand_off": False,
                                               "run": {"channel_id": channel_id}})


async def page_hand_off(request: Request) -> Response:
    """The fork page's "Hand it to a worker" button."""
    channel_id = path_channel(request)
    await read_form(request)
    context_of(request).principal.require("write", channel_id)
    await db_of(request).write(hand_off_fork, channel_id, reach_of(request))
    return RedirectResponse(f"/runs/{channel_id}#hand-off", status_code=303)


HAND_OFFS = declare(Region(
    "hand-offs", features=("fork_hand_off",), schema=(SchemaPart(27, hand_offs_schema),),
    event_hooks=(EventHook(("fork.started",), announce_handed_off_fork),), deleters=(delete_hand_off,),
    routes=(Api("GET", "/api/v1/channels/{channel_id}/hand-off", api_hand_off, scopes=reads(P)),
            Api("POST", "/api/v1/channels/{channel_id}/hand-off", api_hand_off_fork, body=Empty, body_optional=True,
                scopes=writes(P))),
    pages=(("GET", "/runs/{channel_id}/hand-off", page_hand_off_card),
           ("POST", "/runs/{channel_id}/hand-off", page_hand_off)),
    run_page_parts=(hand_off_part,)))


# =============================================================================
# Many runs: records and schema
# =============================================================================
# Region: the approvals inbox, bulk fork from failure, retention. Each plugs into the core through
# its hook lists (see the region's last section): nothing in the core names it.

# Many runs: the bulk fork, the approvals inbox, retention.
BULK_FORK_MAX = 1000                             # runs one bulk fork may take; a wider filter is refused
APPROVAL_STATUSES = ("pending", "decided", "expired")
APPROVAL_DECISIONS = ("approved", "rejected")
APPROVALS_LIMIT_MAX = 1000
APPROVAL_PENDING = "status = 'pending' AND (timeout_at IS NULL OR timeout_at > ?)"   # ?: now; past it, expired
PRUNE_STATUSES = ("completed", "failed", "any")
PRUNE_BATCH = 100                                # runs deleted per write transaction
PRUNE_LISTED_MAX = 1000                          # run ids an answer lists (its counts cover them all)
RETENTION_INTERVAL_SECONDS = 24 * 3600           # --retain-days prunes at start, then this often


# --- many runs: the bulk fork, the approvals inbox, retention ----------------------------------

RunStatus = Literal[RUN_STATES]
Days = Annotated[float, Meta(ge=0, le=36500, description="days (fractions allowed)")]


class BulkForkFilter(Record):
    """Which runs a bulk fork takes; every field narrows the selection (AND)."""

    status: Annotated[list[RunStatus], Meta(min_length=1, max_length=32)] = (
        msgspec.field(default_factory=lambda: list(FAILURE_STATES)))
    since: Optional[Timestamp] = None         # last activity at or after
    until: Optional[Timestamp] = None         # last activity at or before
    channel_prefix: Optional[Annotated[str, Meta(max_length=256, pattern=r"^[A-Za-z0-9._:-]*\Z")]] = None
    failure_contains: Optional[Label] = None  # a substring of the failure's message (any case)
    channel_ids: Optional[Annotated[list[ChannelId], Meta(max_length=BULK_FORK_MAX)]] = None   # only these runs
    include_handled: bool = False             # also a failed run that a completed fork of it already handled

    def __post_init__(self):
        check_utc(self.since)
        check_utc(self.until)


class BulkFork(Idempotent):
    """POST /forks/bulk and `actae fork-failed`: fork every selected run after its own last good step
    (or after step `at`), with one intervention, one tool policy and one name pattern."""

    filter: BulkForkFilter = msgspec.field(default_factory=BulkForkFilter)
    at: Union[Literal["last_good_step"], Positive] = "last_good_step"
    intervention: Optional[JsonObject] = None
    tool_policies: Optional[ToolPolicies] = None
    name: Annotated[str, Meta(min_length=1, max_length=512,
                              description="the fork's id: {channel_id} is the run's id, {step} the step")] = (
        "{channel_id}-retry")
    dry_run: bool = False
    hand_off: bool = False                    # hand each fork to the application's workers (a job each)

    def __post_init__(self):
        super().__post_init__()
        self.tool_policies = self.tool_policies or None
        if "{channel_id}" not in self.name:
            raise ValueError("name must contain {channel_id}, so that each fork gets a name of its own")


class ApprovalsQuery(ClampedLimit):
    LIMIT_MAX: ClassVar[int] = APPROVALS_LIMIT_MAX
    status: Optional[Literal[APPROVAL_STATUSES]] = None     # none: every approval
    channel_id: Optional[ChannelId] = None


class DecideApproval(Record):
    decision: Literal[APPROVAL_DECISIONS]
    reason: Optional[LongText] = None
    channel_id: Optional[ChannelId] = None    # needed only when several runs used the same request id


class Prune(Record):
    """POST /admin/prune and `actae prune`: delete whole runs idle longer than `older_than_days`."""

    older_than_days: Days
    status: Literal[PRUNE_STATUSES] = "any"
    keep_failed_days: Optional[Days] = None   # failed and crashed runs are kept this long instead
    dry_run: bool = False


class BulkForkPageQuery(Record):
    """The bulk fork form: the runs ticked on the runs list (`run`, repeated: read as a list by the
    page), or with `all` every run its filter matches."""

    q: PageText = ""                  # with `all`: the runs list's search ...
    status: PageText = ""             # ... and status filter
    all: bool = False
    intervention: PageText = ""
    tool_policies: PageText = ""
    name: PageText = "{channel_id}-retry"
    done: PageText = ""               # the operation id of the bulk fork just made


class ApprovalsPageQuery(Record):
    status: PageText = "pending"      # one of APPROVAL_STATUSES, or "all"
    error: Optional[PageText] = None  # the flash id of a refused decision


# --- many runs: the bulk fork, the approvals inbox, retention -----------------------------------


class BulkForked(Answer):
    """One run of a bulk fork: the fork made after `step` (in a dry run, the fork it would make: no receipt)."""

    source_channel_id: str
    channel_id: str
    step: int
    receipt: Optional[Receipt]
    plan: Optional[ForkPlan] = None        # a dry run's: what the fork would do (Fork plans)


class BulkSkipped(Answer):
    channel_id: str
    reason: str


class BulkForkAnswer(Answer):
    """What a bulk fork made (or, with dry_run, would make), and the runs it left alone and why."""

    forks: list[BulkForked]
    skipped: list[BulkSkipped]
    dry_run: bool
    plan_totals: Optional[PlanTotals] = None     # a dry run's plans, summed


class Approval(Answer):
    """An approval request as the inbox shows it: `status` is expired once its timeout has passed."""

    request_id: str
    channel_id: str
    summary: Optional[str]
    details: Json
    requester: str
    requested_at: str
    timeout_at: Optional[str]
    age_seconds: float
    status: Literal[APPROVAL_STATUSES]
    decision: Optional[Literal[APPROVAL_DECISIONS]]
    decided_by: Optional[str]
    reason: Optional[str]
    decided_at: Optional[str]


class Approvals(Answer):
    approvals: list[Approval]


class ApprovalDecision(Answer):
    """A decided approval and its `approval.decided` event (the first one, when it was decided before)."""

    approval: Approval
    event: Event
    replayed: bool


class PrunedRows(Answer):
    runs: int
    events: int
    states: int
    executions: int
    approvals: int
    wakeups: int


class KeptRun(Answer):
    channel_id: str
    reason: str


class PruneAnswer(Answer):
    """What a prune deleted (a dry run: would delete), the old runs it kept and why, and the space."""

    dry_run: bool
    deleted: list[str]                 # at most PRUNE_LISTED_MAX ids; `rows.runs` counts them all
    kept: list[KeptRun]
    rows: PrunedRows
    bytes_before: int
    bytes_after: int
    bytes_freed: int
    space: str                         # how the space went back to the disk, or what to run for it


def bulk_fork_by_operation(conn: Conn, operation_id: str) -> Optional[Row]:
    return conn.execute("SELECT * FROM bulk_forks WHERE operation_id = ?", (operation_id,)).fetchone()


def approval_answers_index(w: SchemaWords) -> str:
    return f"""
    -- The answers to approvals by (channel, request_id), so /metrics finds the approvals still pending
    -- with one probe each (stored_figures); only approval.decided and approval.expired rows are in it.
    CREATE INDEX events_approval_answers ON events (channel_id, {w.dialect.json_text('payload', 'request_id')})
     WHERE type IN ('approval.decided', 'approval.expired');
    """


def approval_answers_unindexed(w: SchemaWords) -> str:
    # /metrics counts pending approvals from the approvals table now; no query reads this index.
    return "DROP INDEX IF EXISTS events_approval_answers"


def many_runs_schema(w: SchemaWords) -> str:
    """The approvals index (kept in each approval event's transaction) and the bulk forks' answers."""
    return f"""
    CREATE TABLE approvals (
        channel_id        TEXT NOT NULL REFERENCES channels(id),
        request_id        TEXT NOT NULL,
        summary           TEXT,
        details           TEXT,                   -- JSON, as the request carried it
        requester         TEXT NOT NULL,          -- the approval.requested event's actor
        requested_at      TEXT NOT NULL,
        requested_cursor  {w.integer} NOT NULL,
        timeout_at        TEXT,                   -- requested_at + timeout_seconds, past it: expired
        -- pending: waiting for a decision; decided: its first approval.decided event is recorded;
        -- expired: approval.expired, or the SDK's timeout wake-up fired.
        status            TEXT NOT NULL CHECK (status IN ({sql_list(APPROVAL_STATUSES)})),
        decision          TEXT CHECK (decision IN ({sql_list(APPROVAL_DECISIONS)})),
        decided_by        TEXT,                   -- the approval.decided event's actor
        reason            TEXT,
        decided_at        TEXT,
        decided_cursor    {w.integer},
        PRIMARY KEY (channel_id, request_id)
    );
    CREATE TABLE bulk_forks (
        operation_id  TEXT PRIMARY KEY,           -- the request's operation id: one answer each
        request_hash  TEXT NOT NULL,
        answer        TEXT NOT NULL,              -- the answer as first given (JSON)
        created_at    TEXT NOT NULL
    )
    """


def many_runs_indexes(w: SchemaWords) -> str:
    return """
    CREATE INDEX approvals_by_status ON approvals (status, requested_at, channel_id, request_id);
    CREATE INDEX approvals_by_time ON approvals (requested_at, channel_id, request_id);
    CREATE INDEX approvals_by_request ON approvals (request_id)
    """


# =============================================================================
# Many runs: the approvals inbox (an index of approval events, kept in each event's transaction)
# =============================================================================
# The SDK's approvals are events: `approval.requested` {request_id, summary, details?,
# timeout_seconds?} under operation id = request_id; `approval.decided` {request_id, decision,
# reason?} under a deterministic operation id; `approval.expired` {request_id}; and, with a timeout,
# a wake-up that fires `scheduler.wakeup` {approval_request_id, kind: "approval_timeout"} at the
# deadline. append_event hands each of these to index_approval inside the event's own transaction,
# so the inbox reads one small table and never scans logs.

APPROVAL_REQUESTED, APPROVAL_DECIDED, APPROVAL_EXPIRED = "approval.requested", "approval.decided", "approval.expired"
APPROVAL_INDEXED = frozenset({APPROVAL_REQUESTED, APPROVAL_DECIDED, APPROVAL_EXPIRED, WAKEUP_EVENT})
OPERATION_NAMESPACE = uuid.UUID("3f74e5f1-9b2c-4a7e-8f1d-000000000001")   # the SDKs' deterministic ids


def deterministic_operation_key(scope: str, action: str, *identity: object) -> str:
    """The SDKs' deterministic operation id: a UUIDv5 over the NUL-joined parts, capped at 256 bytes."""
    parts = [scope, action, *("" if v is None else v if isinstance(v, str) else str(v) for v in identity)]
    name = "\x00".join(parts).encode("utf-8", "surrogatepass")[:256]
    raw = bytearray(hashlib.sha1(OPERATION_NAMESPACE.bytes + name).digest()[:16])
    raw[6] = (raw[6] & 0x0F) | 0x50
    raw[8] = (raw[8] & 0x3F) | 0x80
    return str(uuid.UUID(bytes=bytes(raw)))


def approval_deadline(requested_at: str, timeout: Json) -> Optional[str]:
    """requested_at + `timeout` seconds; None without a number, or for a deadline past the year 9999."""
    if not is_number(timeout):
        return None
    try:
        return iso(parse_iso(requested_at) + timedelta(seconds=timeout))
    except (OverflowError, ValueError):
        return None


def inbox_text(value: Json) -> Optional[str]:
    """A payload value as the inbox stores it: text as it is, anything else as JSON; no NUL (PostgreSQL
    text cannot hold one, and the event itself keeps the exact value)."""
    if value is None:
        return None
    text = value if isinstance(value, str) else canonical_json(value)
    return text.replace("\x00", "\ufffd")


def index_approval(conn: Conn, channel_id: str, cursor: int, event_type: str, payload: Json, actor: str,
                   ts: str) -> None:
    """Keep the inbox in step with one event of APPROVAL_INDEXED (any payload: what is not an
    approval's changes nothing). A request is pending until its first decision, an approval.expired
    or its timeout wake-up; a later event does not change that first outcome."""
    if not isinstance(payload, dict):
        return
    if event_type == WAKEUP_EVENT:
        if payload.get("kind") != "approval_timeout":
            return
        request_id, event_type = payload.get("approval_request_id"), APPROVAL_EXPIRED
    else:
        request_id = payload.get("request_id")
    if not isinstance(request_id, str) or not request_id or "\x00" in request_id:
        return
    if event_type == APPROVAL_REQUESTED:
        conn.execute(
            "INSERT INTO approvals (channel_id, request_id, summary, details, requester, requested_at,"
            " requested_cursor, timeout_at, status) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'pending')"
            " ON CONFLICT (channel_id, request_id) DO NOTHING",
            (channel_id, request_id, inbox_text(payload.get("summary")), inbox_text(payload.get("details")),
             actor, ts, cursor, approval_deadline(ts, payload.get("timeout_seconds"))))
    elif event_type == APPROVAL_DECIDED:
        decision = payload.get("decision")
        if decision in APPROVAL_DECISIONS:
            conn.execute("UPDATE approvals SET status = 'decided', decision = ?, decided_by = ?, reason = ?,"
                         " decided_at = ?, decided_cursor = ? WHERE channel_id = ? AND request_id = ?"
                         " AND status <> 'decided'",
                         (decision, actor, inbox_text(payload.get("reason")), ts, cursor, channel_id, request_id))
    else:
        conn.execute("UPDATE approvals SET status = 'expired' WHERE channel_id = ? AND request_id = ?"
                     " AND status = 'pending'", (channel_id, request_id))


def reindex_approvals(conn: Conn, channel_id: Optional[str] = None) -> None:
    """The inbox rows of stored events (one channel, or all: the migration), as append_event keeps them."""
    where = Where().add(f"type IN ({sql_list(tuple(sorted(APPROVAL_INDEXED)))})").add_if(channel_id, "channel_id = ?")
    rows = conn.execute(f"SELECT channel_id, cursor, type, payload, actor, created_at FROM events{where}"
                        " ORDER BY channel_id, cursor", where.args).fetchall()
    for row in rows:
        index_approval(conn, row["channel_id"], row["cursor"], row["type"], load(row["payload"]), row["actor"],
                       row["created_at"])


def delete_approvals(tx: Tx, channel_id: str) -> None:
    """A run deleted: its requests leave the inbox with it."""
    tx.conn.execute("DELETE FROM approvals WHERE channel_id = ?", (channel_id,))


def approval_status(row: Row, now: str) -> str:
    """pending, decided or expired: a pending request past its timeout is expired."""
    if row["status"] == "pending" and row["timeout_at"] is not None and row["timeout_at"] <= now:
        return "expired"
    return row["status"]


def approval_of(row: Row, now: datetime) -> Approval:
    requested = stored_instant(row["requested_at"])
    age = max(0.0, (now - requested).total_seconds()) if requested else 0.0
    return Approval(request_id=row["request_id"], channel_id=row["channel_id"], summary=row["summary"],
                    details=load(row["details"]), requester=row["requester"], requested_at=row["requested_at"],
                    timeout_at=row["timeout_at"], age_seconds=round(age, 3), status=approval_status(row, iso(now)),
                    decision=row["decision"], decided_by=row["decided_by"], reason=row["reason"],
                    decided_at=row["decided_at"])


def list_approvals(conn: Conn, status: Optional[str], channel_id: Optional[str], limit: int,
                   now: datetime) -> list[Approval]:
    """GET /approvals: oldest request first; each status is one range of approvals_by_status (expired:
    two, merged), so a page costs what one page costs."""
    ts = iso(now)
    if status == "pending":
        parts = [Where().add(f"({APPROVAL_PENDING})", ts)]
    elif status == "decided":
        parts = [Where().add("status = 'decided'")]
    elif status == "expired":
        parts = [Where().add("status = 'expired'"), Where().add("status = 'pending'").add("timeout_at <= ?", ts)]
    else:
        parts = [Where()]
    order = "requested_at, channel_id, request_id"
    pages = [(f"SELECT * FROM approvals{w.add_if(channel_id, 'channel_id = ?')} ORDER BY {order} LIMIT ?",
              [*w.args, limit]) for w in parts]
    return [approval_of(r, now) for r in union_of_pages(conn, pages, order, limit)]


def require_approval(conn: Conn, request_id: str, channel_id: Optional[str], reach: Reach = EVERYWHERE) -> Row:
    """The approval request with this id (on `channel_id`, when given) among the runs `reach` sees (an
    approval of a run it may not read is not there); 409 when several of those runs use the id."""
    where = Where().add("request_id = ?", request_id).add_if(channel_id, "channel_id = ?").within(reach, "channel_id")
    rows = conn.execute(f"SELECT * FROM approvals{where} ORDER BY channel_id LIMIT 2", where.args).fetchall()
    if not rows:
        raise NotFound(f"approval request {request_id} not found" + (f" on run {channel_id}" if channel_id else ""))
    if len(rows) > 1:
        raise Conflict("approval_ambiguous", f"runs {rows[0]['channel_id']} and {rows[1]['channel_id']} both have "
                                             f"approval request {request_id}: name the run with channel_id")
    return rows[0]


def decide_approval(tx: Tx, request_id: str, channel_id: Optional[str], decision: str, reason: Optional[str],
                    actor: str) -> ApprovalDecision:
    """Record the decision exactly as the SDK's decide_approval does (same payload, same deterministic
    operation id), with `actor` as the one who decided. The same decision again changes nothing and
    answers the first; another decision of a decided request, or any of an expired one, is refused."""
    row = require_approval(tx.conn, request_id, channel_id)
    channel_id = row["channel_id"]
    if row["status"] == "decided":
        if row["decision"] != decision:
            raise Conflict("approval_decided", f"approval request {request_id} was {row['decision']} already, by "
                                               f"{row['decided_by']} at {row['decided_at']}")
        event = present(event_at(tx.conn, channel_id, row["decided_cursor"]),
                        lambda: NotFound(f"the decision of approval request {request_id} is gone"))
        return ApprovalDecision(approval=approval_of(row, tx.now), event=event_of(event), replayed=True)
    if approval_status(row, tx.ts) == "expired":
        raise Conflict("approval_expired", f"approval request {request_id} has expired"
                                           + (f" (its timeout passed at {row['timeout_at']})" if row["status"] == "pending"
                                              else "") + ": nothing waits for a decision any more")
    payload = {"request_id": request_id, "decision": decision}
    if reason is not None:
        payload["reason"] = reason
    event = record_event(tx, RecordEvent(
        channel_id=channel_id, event_type=APPROVAL_DECIDED, payload=payload, metadata=EventMeta(actor=actor),
        operation_id=deterministic_operation_key("approval", decision, request_id)))
    return ApprovalDecision(approval=approval_of(require_approval(tx.conn, request_id, channel_id), tx.now),
                            event=event, replayed=False)


# =============================================================================
# Many runs: bulk fork from failure (every selected run forked after its own last good step)
# =============================================================================
# One write job: the selection (indexed by run_state), every fork and the answer, kept under the
# request's operation id, commit together or not at all; a run whose fork is refused (a name taken
# by another run, no snapshot at the step) is skipped with the reason, in its own savepoint. The
# forks are the ones the dashboard's fork form makes, so AgentSession.resume(client, fork) continues
# each one after the step it kept.

def bulk_fork_candidates(conn: Conn, selection: BulkForkFilter, reach: Reach = EVERYWHERE) -> list:
    """The runs the filter selects among those `reach` sees (RUN_COLUMNS rows), least recently active
    first, at most BULK_FORK_MAX + 1: one range of channels_by_state per status."""
    if selection.channel_ids is not None and not selection.channel_ids:
        return []
    pages = []
    for state in dict.fromkeys(selection.status):
        where = Where().add("c.run_state = ?", state).within(reach, "c.id")
        if selection.since:             # the second bounds the index range, the time is exact
            since = iso(selection.since)
            where.add(f"c.active_at >= ? AND {activity_sql('c.')} >= ?", since[:ACTIVE_AT_CHARS], since)
        if selection.until:
            until = iso(selection.until)
            where.add(f"c.active_at <= ? AND {activity_sql('c.')} <= ?", until[:ACTIVE_AT_CHARS], until)
        if selection.channel_prefix:
            where.add("substr(c.id, 1, ?) = ?", len(selection.channel_prefix), selection.channel_prefix)
        if selection.channel_ids:
            ids = list(dict.fromkeys(selection.channel_ids))
            where.add(f"c.id IN ({', '.join('?' * len(ids))})", *ids)
        pages.append((runs_by_activity_sql(where), [*where.args, BULK_FORK_MAX + 1]))
    return union_of_pages(conn, pages, by_activity(), BULK_FORK_MAX + 1)


@dataclass(frozen=True)
class PlannedFork:
    source_channel_id: str           # the run that went wrong
    step: int                        # the fork keeps steps 1..step
    fork: Fork                       # the fork request (its source is the run that recorded that step)


def plan_bulk_fork(conn: Conn, req: BulkFork, reach: Reach) -> tuple:
    """([PlannedFork], [BulkSkipped]): what the request would fork, and which selected runs it leaves and
    why. Only runs `reach` sees are selected, counted or matched (a run it may not read is not there)."""
    wanted = req.filter.failure_contains.lower() if req.filter.failure_contains else None
    needs_failure = wanted is not None or req.at == "last_good_step"
    picked = []
    for row in bulk_fork_candidates(conn, req.filter, reach):
        failure = run_failure(conn, row, row["run_state"]) if needs_failure else None
        if wanted is None or (failure is not None and wanted in failure.message.lower()):
            picked.append((row, failure))
    if len(picked) > BULK_FORK_MAX:
        raise BadRequest(f"more than {BULK_FORK_MAX} runs match: narrow the filter (since, until, channel_prefix, "
                         "failure_contains or channel_ids)")
    planned, skipped = [], []
    for row, failure in picked:
        run_id = row["id"]
        handled = None if req.filter.include_handled else handled_by(conn, row, reach)
        if handled is not None:
            skipped.append(BulkSkipped(channel_id=run_id, reason=f"handled: its fork {handled['channel_id']} completed"
                                                                  " (include_handled takes it again)"))
            continue
        last = max(row["last_step"] or 0, (row["forked_at_step"] or 0) if row["parent_id"] else 0)
        if req.at == "last_good_step":
            step = failure.last_good_step if failure is not None else last
            if not step:
                skipped.append(BulkSkipped(channel_id=run_id, reason="no step completed before it went wrong"))
                continue
        elif req.at > last:
            skipped.append(BulkSkipped(channel_id=run_id, reason=f"it has no step {req.at} (its last is {last})"))
            continue
        else:
            step = req.at
        name = req.name.replace("{channel_id}", run_id).replace("{step}", str(step))
        if not CHANNEL_ID.fullmatch(name) or name == run_id:
            skipped.append(BulkSkipped(channel_id=run_id, reason=f"the name pattern gives {name[:300]!r}, which is "
                                                                 "not a channel id of its own"))
            continue
        if not (reach.changes(run_id) and reach.changes(name)):
            skipped.append(BulkSkipped(channel_id=run_id, reason=f"this credential may not write {run_id} and {name}"))
            continue
        try:
            boundary = resolve_step(conn, run_id, step)
        except NotFound:
            skipped.append(BulkSkipped(channel_id=run_id, reason=f"step {step} is not in the step index"))
            continue
        if not reach.changes(boundary.channel_id):
            # The step lies in an ancestor's history: the fork would be that ancestor's, which a direct
            # fork with this credential may not make either. It is not named.
            skipped.append(BulkSkipped(channel_id=run_id, reason=f"step {step} of {run_id} was inherited from a run"
                                                                 " this credential may not fork"))
            continue
        experiment = {"session_name": name, "params": experiment_of(row).get("params"),
                      "forked_from": boundary.channel_id, "forked_from_channel": run_id, "forked_at_step": step,
                      "forked_at_cursor": boundary.cursor, "status": "created"}
        if req.intervention is not None:
            experiment["intervention"] = req.intervention
        planned.append(PlannedFork(run_id, step, Fork(
            source_channel_id=boundary.channel_id, new_channel_id=name, at_cursor=boundary.cursor, display_name=name,
            reason=f"Bulk fork of {run_id} after step {step}", experiment_metadata=experiment,
            manifest={"source": "bulk_fork"}, tool_policies=req.tool_policies, hand_off=req.hand_off)))
    return planned, skipped


def preview_bulk_fork(conn: Conn, req: BulkFork, reach: Reach = EVERYWHERE) -> BulkForkAnswer:
    """A dry run: what the request would fork, writing nothing (its operation id included). A fork that
    exists already with the same definition is listed with its receipt: the real run answers it again."""
    planned, skipped = plan_bulk_fork(conn, req, reach)
    forks = []
    for item in planned:
        fork = item.fork
        existing = channel_by_id(conn, fork.new_channel_id)
        if existing is not None:
            if (existing["parent_id"] == fork.source_channel_id and existing["requested_cursor"] == fork.at_cursor
                    and load(existing["tool_policies"]) == fork.tool_policies):
                forks.append(BulkForked(source_channel_id=item.source_channel_id, channel_id=fork.new_channel_id,
                                        step=item.step, receipt=receipt_of(existing, replayed=True)))
            else:
                skipped.append(BulkSkipped(channel_id=item.source_channel_id,
                                           reason=f"channel {fork.new_channel_id} already exists with a different "
                                                  "definition"))
        elif state_row_at(conn, fork.source_channel_id, fork.at_cursor) is None:
            skipped.append(BulkSkipped(channel_id=item.source_channel_id,
                                       reason=f"no state snapshot of {fork.source_channel_id} at step {item.step}"))
        else:
            forks.append(BulkForked(source_channel_id=item.source_channel_id, channel_id=fork.new_channel_id,
                                    step=item.step, receipt=None))
    by_source = {item.source_channel_id: item.fork for item in planned}
    for made in forks:
        fork = by_source[made.source_channel_id]
        made.plan = plan_fork(conn, ForkPlanRequest(source_channel_id=fork.source_channel_id, at_cursor=fork.at_cursor,
                                                    tool_policies=fork.tool_policies, intervention=req.intervention),
                              reach)
    return BulkForkAnswer(forks=forks, skipped=skipped, dry_run=True,
                          plan_totals=plan_totals([made.plan for made in forks]))


def bulk_fork(tx: Tx, req: BulkFork, reach: Reach = EVERYWHERE) -> BulkForkAnswer:
    """POST /forks/bulk (not a dry run): fork every planned run in this one transaction. The same
    operation id again answers the first answer and forks nothing; without one, a fork named like an
    earlier one of the same run and step replays that fork. The reach is part of what the operation
    id names: another credential's answer is never replayed to this one."""
    conn = tx.conn
    hashed = request_hash({**{k: v for k, v in msgspec.to_builtins(req).items()
                              if k != "operation_id" and (k != "hand_off" or v)},
                           **({} if reach.everywhere else {"reach": [list(reach.read), list(reach.write)]})})
    if req.operation_id is not None:
        stored = bulk_fork_by_operation(conn, req.operation_id)
        if stored is not None:
            require_same_request(stored["request_hash"], hashed, req.operation_id, "bulk fork")
            return msgspec.json.decode(stored["answer"], type=BulkForkAnswer)
    planned, skipped = plan_bulk_fork(conn, req, reach)
    forks = []
    for item in planned:
        conn.execute("SAVEPOINT bulk_fork")
        appended = len(tx.events)
        try:
            receipt = fork_channel(tx, item.fork)
        except ActaeError as exc:
            if not conn.in_transaction:
                raise
            conn.execute("ROLLBACK TO bulk_fork")
            del tx.events[appended:]
            skipped.append(BulkSkipped(channel_id=item.source_channel_id, reason=exc.message))
        else:
            forks.append(BulkForked(source_channel_id=item.source_channel_id, channel_id=item.fork.new_channel_id,
                                    step=item.step, receipt=receipt))
        conn.execute("RELEASE bulk_fork")
    answer = BulkForkAnswer(forks=forks, skipped=skipped, dry_run=False)
    if req.operation_id is not None:
        conn.execute("INSERT INTO bulk_forks (operation_id, request_hash, answer, created_at) VALUES (?, ?, ?, ?)",
                     (req.operation_id, hashed, dump(answer), tx.ts))
    return answer


# =============================================================================
# Many runs: retention (prune whole runs, never one that a kept run or live work still needs)
# =============================================================================
# A run is deleted whole (events, states, ledger rows, approvals, wake-ups; the step index is its
# events) when it was last active before the cutoff, has the status asked for, and nothing needs it:
# no pending approval, live claim, pending wake-up or group uses it, and every fork of it goes too
# (a fork's history lives in its parents). The plan is read first; the deletions follow in batches
# of PRUNE_BATCH runs, children before parents, each batch one write transaction that checks every
# rule again, so a run that became active or needed meanwhile stays. Then the space goes back: on
# SQLite by incremental vacuum on the writer connection between batches of writes (or one VACUUM
# that switches an older file to incremental vacuum); PostgreSQL's operator runs VACUUM (FULL).

PRUNE_GUARDS = (        # (why a run is kept, its table, the condition); `?` is the prune's now
    ("a pending approval", "approvals", APPROVAL_PENDING),
    ("a live claim", "executions", "status = 'running' AND lease_until > ?"),
    ("a pending wake-up", "wakeups", "status = 'pending'"),
    ("a consumer group reading it", "consumer_groups", ""),
    ("an execution group member on it", "execution_group_members", ""),
)


def guard_sql(table: str, condition: str, one_channel: bool) -> str:
    where = " AND ".join(c for c in (condition, "channel_id = ?" if one_channel else "") if c)
    return f"SELECT DISTINCT channel_id FROM {table}{' WHERE ' + where if where else ''}"


def prune_cutoffs(req: Prune, now: datetime) -> tuple:
    """(the cutoff, the failed runs' cutoff or None) as stored timestamps."""
    cutoff = iso(now - timedelta(days=req.older_than_days))
    failed = iso(now - timedelta(days=req.keep_failed_days)) if req.keep_failed_days is not None else None
    return cutoff, failed


def prune_eligible(row: Row, req: Prune, cutoffs: tuple) -> bool:
    """Old enough, and of the status asked for (failed: crashed too)."""
    failed = row["run_state"] in FAILURE_STATES
    if (req.status == "completed" and row["run_state"] != "completed") or (req.status == "failed" and not failed):
        return False
    cutoff, failed_cutoff = cutoffs
    return row["updated_at"] < (failed_cutoff if failed and failed_cutoff is not None else cutoff)


def run_guard(conn: Conn, channel_id: str, now: str) -> Optional[str]:
    """Why a run must stay whatever its age (one of PRUNE_GUARDS, or forks of it), else None."""
    for reason, table, condition in PRUNE_GUARDS:
        args = (now, channel_id) if "?" in condition else (channel_id,)
        if conn.execute(guard_sql(table, condition, True), args).fetchone() is not None:
            return f"it has {reason}"
    if conn.execute("SELECT 1 FROM channels WHERE parent_id = ? LIMIT 1", (channel_id,)).fetchone() is not None:
        return "it has forks that are kept"
    return None


@dataclass
class PrunePlan:
    deletable: list                  # channel ids, every fork before its parent
    kept: list                       # [KeptRun] of the old runs that stay


def plan_prune(conn: Conn, req: Prune, now: datetime) -> PrunePlan:
    """Which runs the rules let a prune delete, read at one moment (a read transaction)."""
    cutoffs, ts = prune_cutoffs(req, now), iso(now)
    latest = max(c for c in cutoffs if c is not None)
    with read_snapshot(conn):
        # A run's age is its row's activity: to the second, which is all a cutoff in days asks of it.
        rows = conn.execute("SELECT c.id, c.parent_id, c.run_state, c.updated_at FROM channels c"
                            f" WHERE c.active_at <= ? AND c.updated_at < ? ORDER BY {by_activity('c.')}",
                            (latest[:ACTIVE_AT_CHARS], latest)).fetchall()
        eligible = {r["id"]: r for r in rows if prune_eligible(r, req, cutoffs)}
        guarded: dict = {}
        for reason, table, condition in PRUNE_GUARDS:
            for (channel_id,) in conn.execute(guard_sql(table, condition, False), (ts,) if "?" in condition else ()):
                guarded.setdefault(channel_id, f"it has {reason}")
        children: dict = {}
        ids = list(eligible)
        for start in range(0, len(ids), ID_BATCH):
            batch = ids[start:start + ID_BATCH]
            for child, parent in conn.execute(f"SELECT id, parent_id FROM channels WHERE parent_id IN"
                                              f" ({', '.join('?' * len(batch))})", batch):
                children.setdefault(parent, []).append(child)
    verdict: dict = {}

    def decide(run_id: str) -> Optional[str]:
        """None when the run may go; else why it stays (a fork that stays keeps its whole lineage)."""
        if run_id not in verdict:
            reason = guarded.get(run_id) if run_id in eligible else "it is newer than the cutoff, or of another status"
            for child in children.get(run_id, ()) if reason is None else ():
                if decide(child) is not None:
                    reason = f"it is an ancestor of {child}, which is kept"
                    break
            verdict[run_id] = reason
        return verdict[run_id]

    depth: dict = {}

    def depth_of(run_id: str) -> int:
        if run_id not in depth:
            parent = eligible[run_id]["parent_id"]
            depth[run_id] = depth_of(parent) + 1 if parent in eligible else 0
        return depth[run_id]

    deletable = [run_id for run_id in eligible if decide(run_id) is None]
    deletable.sort(key=depth_of, reverse=True)              # forks (deeper) before their parents
    kept = [KeptRun(channel_id=run_id, reason=verdict[run_id]) for run_id in eligible if verdict[run_id] is not None]
    return PrunePlan(deletable, kept)


def run_rows(conn: Conn, channel_id: str) -> tuple:
    """(states, executions, approvals, wake-ups) a run holds."""
    return tuple(conn.execute(
        "SELECT (SELECT COUNT(*) FROM states WHERE channel_id = ?), (SELECT COUNT(*) FROM executions WHERE channel_id = ?),"
        " (SELECT COUNT(*) FROM approvals WHERE channel_id = ?), (SELECT COUNT(*) FROM wakeups WHERE channel_id = ?)",
        (channel_id,) * 4).fetchone())


def add_rows(total: dict, events: int, held: tuple) -> None:
    total["runs"] += 1
    total["events"] += events
    for name, count in zip(("states", "executions", "approvals", "wakeups"), held):
        total[name] += count


def prune_runs(tx: Tx, ids: list, req: Prune, now: str) -> tuple:
    """Delete these runs (forks first), each only if every rule still lets it go at `now` (the plan's
    instant); returns (deleted ids, kept [KeptRun], row counts)."""
    conn, cutoffs = tx.conn, prune_cutoffs(req, parse_iso(now))
    deleted, kept, total = [], [], dict.fromkeys(PrunedRows.__struct_fields__, 0)
    for run_id in ids:
        row = channel_by_id(conn, run_id)
        if row is None:
            continue                     # deleted meanwhile
        reason = None if prune_eligible(row, req, cutoffs) else "it was active again after the plan"
        reason = reason or run_guard(conn, run_id, now)
        if reason is not None:
            kept.append(KeptRun(channel_id=run_id, reason=reason))
            continue
        add_rows(total, row["last_cursor"], run_rows(conn, run_id))
        delete_channel(tx, run_id, False, EVERYWHERE)
        conn.execute("DELETE FROM wakeups WHERE channel_id = ?", (run_id,))
        deleted.append(run_id)
    return deleted, kept, total


def planned_rows(conn: Conn, ids: list) -> dict:
    """What deleting these runs would delete (a dry run's counts)."""
    total = dict.fromkeys(PrunedRows.__struct_fields__, 0)
    for run_id in ids:
        row = channel_by_id(conn, run_id)
        if row is not None:
            add_rows(total, row["last_cursor"], run_rows(conn, run_id))
    return total


POSTGRES_SPACE = ("PostgreSQL keeps the freed pages for new rows (autovacuum marks them free); to give the disk back "
                  "run VACUUM (FULL, ANALYZE) channels, events, states, executions, approvals, wakeups (it locks each "
                  "table while it rewrites it), or pg_repack, which does not")
INCREMENTAL_VACUUM_PAGES = 2000           # pages freed per step: a few milliseconds of the writer's time


def reclaim_step(conn: Conn) -> Optional[str]:
    """One step of giving freed SQLite pages back (outside any transaction, on the writer connection):
    None while there is more to do, else what was done. A file made before incremental vacuum (or
    one where it makes no progress) is rewritten once by VACUUM, which switches it over."""
    free = sqlite_pragma(conn, "freelist_count")
    incremental = sqlite_pragma(conn, "auto_vacuum") == 2            # 2: INCREMENTAL
    if incremental and free:
        sqlite_pragma(conn, f"incremental_vacuum({INCREMENTAL_VACUUM_PAGES})")
        left = sqlite_pragma(conn, "freelist_count")
        if 0 < left < free:
            return None
        free = left
    if free:
        sqlite_pragma(conn, "auto_vacuum = INCREMENTAL")
        conn.execute("VACUUM")
    sqlite_pragma(conn, "wal_checkpoint(TRUNCATE)")
    if free:
        return "VACUUM rewrote the database (from now on it vacuums incrementally); WAL checkpointed"
    return "incremental vacuum returned the freed pages to the file system; WAL checkpointed"


def prune_answer(req: Prune, deleted: list, kept: list, rows: dict, before: int, after: int, space: str) -> PruneAnswer:
    return PruneAnswer(dry_run=req.dry_run, deleted=deleted[:PRUNE_LISTED_MAX], kept=kept[:PRUNE_LISTED_MAX],
                       rows=PrunedRows(**rows), bytes_before=before, bytes_after=after,
                       bytes_freed=max(0, before - after), space=space)


async def prune_database(db: Database, req: Prune, now: datetime) -> PruneAnswer:
    """The server's prune: plan, batches through the writer (other writes go on between them), then the space."""
    plan = await db.read(plan_prune, req, now)
    before = await db.read(database_bytes)
    if req.dry_run:
        rows = await db.read(planned_rows, plan.deletable)
        return prune_answer(req, plan.deletable, plan.kept, rows, before, before, "a dry run: nothing was deleted")
    deleted, kept, rows = [], list(plan.kept), dict.fromkeys(PrunedRows.__struct_fields__, 0)
    for start in range(0, len(plan.deletable), PRUNE_BATCH):
        gone, stayed, counted = await db.write(prune_runs, plan.deletable[start:start + PRUNE_BATCH], req, iso(now))
        deleted += gone
        kept += stayed
        rows = {k: rows[k] + counted[k] for k in rows}
    if db.location.backend != "sqlite":
        space = POSTGRES_SPACE
    elif not deleted:
        space = "nothing was deleted"
    else:
        space = None
        while space is None:             # each step is one call on the writer's thread, between write batches
            space = await db.on_writer(reclaim_step)
    return prune_answer(req, deleted, kept, rows, before, await db.read(database_bytes), space)


class Retention:
    """Prunes one at a time; with --retain-days, at start and then every `interval` seconds. `clock`
    is the prune's idea of now (tests move it on instead of waiting days)."""

    def __init__(self, db: Database, retain_days: Optional[float], *, clock: Callable[[], datetime] = utc_now,
                 interval: float = RETENTION_INTERVAL_SECONDS):
        self.db, self.retain_days, self.clock, self.interval = db, retain_days, clock, interval
        self.lock = asyncio.Lock()
        self.last: Optional[PruneAnswer] = None
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        if self.retain_days is not None:
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def prune(self, req: Prune) -> PruneAnswer:
        async with self.lock:
            return await prune_database(self.db, req, self.clock())

    async def _run(self) -> None:
        while True:
            try:
                self.last = await self.prune(Prune(older_than_days=self.retain_days))
                rows = self.last.rows
                log.info("retention: deleted %d runs idle over %g days (%d events), %d bytes freed",
                         rows.runs, self.retain_days, rows.events, self.last.bytes_freed)
            except (ShuttingDown, asyncio.CancelledError):
                raise
            except Exception:  # noqa: BLE001 - a failed prune is tried again at the next interval
                log.exception("the daily prune failed")
            await asyncio.sleep(self.interval)


# =============================================================================
# Many runs: handlers, routes, pages and commands
# =============================================================================
# --- many runs: the bulk fork, the approvals inbox, retention ------------------------------------

async def api_forks_bulk(request: Request, body: BulkFork) -> BulkForkAnswer:
    """Fork every selected run after its own last good step (dry_run: only say what would be forked)."""
    reach = reach_of(request)
    if body.dry_run:
        return await db_of(request).read(preview_bulk_fork, body, reach)
    return await db_of(request).write(bulk_fork, body, reach)


async def api_approvals_list(request: Request, query: ApprovalsQuery) -> Approvals:
    """The approval requests across runs, oldest first: pending, decided or expired."""
    return Approvals(approvals=await db_of(request).read(list_approvals, query.status, query.channel_id, query.limit,
                                                         utc_now()))


async def decide_for(request: Request, request_id: str, body: DecideApproval) -> ApprovalDecision:
    """Decide as the caller: write on the approval's run is checked on the run the id names (one id may
    be used on several runs, so the route table cannot look it up)."""
    principal = context_of(request).principal
    row = await db_of(request).read(require_approval, request_id, body.channel_id, principal.reach)
    principal.require("write", row["channel_id"])
    return await db_of(request).write(decide_approval, request_id, row["channel_id"], body.decision, body.reason,
                                      principal.actor)


async def api_approvals_decide(request: Request, path, body: DecideApproval) -> ApprovalDecision:
    """Approve or reject a pending request: the approval.decided event the SDK's decide_approval records."""
    return await decide_for(request, path.request_id, body)


async def api_admin_prune(request: Request, body: Prune) -> PruneAnswer:
    """Delete whole runs idle longer than older_than_days (never one a kept run or live work needs)."""
    return await request.app.services.region(Retention).prune(body)


# --- many runs: the bulk fork form, the approvals inbox, the storage page --------------------------


def matching_run_ids(conn: Conn, q: str, status: str) -> list:
    """The ids of every run the runs list's search and status filter match (at most BULK_FORK_MAX + 1),
    most recently active first: what "fork all that match this filter" forks."""
    pages = []
    for state in listed_states(status):
        where = Where()
        if q:
            like = conn.dialect.like
            where.add(f"(c.id {like} ? OR c.display_name {like} ?)", f"%{q}%", f"%{q}%")
        where.add_if(state, "c.run_state = ?")
        pages.append((f"SELECT c.id, c.active_at, {activity_sql('c.')} AS active_time FROM channels c{where}"
                      f" ORDER BY {by_activity('c.', True)} LIMIT ?", [*where.args, BULK_FORK_MAX + 1]))
    return [r["id"] for r in union_of_pages(conn, pages, by_activity("", True), BULK_FORK_MAX + 1)]


def stored_size_sql(dialect: Dialect, column: str) -> str:
    """SQL for the bytes a text or blob column holds."""
    return f"length(CAST({column} AS BLOB))" if dialect is SQLITE else f"octet_length({column})"


STORAGE_LISTED = 20


def storage_page(conn: Conn) -> dict:
    """The database's size, and the runs that hold the most and that were idle the longest."""
    sqlite = conn.dialect is SQLITE
    free = sqlite_pragma(conn, "freelist_count") * sqlite_pragma(conn, "page_size") if sqlite else None
    counted = conn.execute("SELECT (SELECT COUNT(*) FROM channels), (SELECT COUNT(*) FROM events)").fetchone()
    pending = conn.execute("SELECT COUNT(*) FROM approvals WHERE status = 'pending'").fetchone()[0]

    def listed(sql: str) -> list:
        runs = []
        for row in conn.execute(sql, (STORAGE_LISTED,)).fetchall():
            held = conn.execute(
                f"SELECT (SELECT COALESCE(SUM({stored_size_sql(conn.dialect, 'payload')}), 0) FROM events"
                f" WHERE channel_id = ?), (SELECT COALESCE(SUM({stored_size_sql(conn.dialect, 'state')}), 0)"
                " FROM states WHERE channel_id = ?), (SELECT COUNT(*) FROM states WHERE channel_id = ?)",
                (row["id"],) * 3).fetchone()
            runs.append({"channel_id": row["id"], "events": row["last_cursor"], "states": held[2],
                         "bytes": int(held[0]) + int(held[1]), "last_activity": row["active_time"]})
        return runs
    return {"backend": "sqlite" if sqlite else "postgresql", "bytes": database_bytes(conn), "free_bytes": free,
            "runs": counted[0], "events": int(counted[1]), "pending_approvals": pending,
            "largest": listed(f"SELECT c.id, {LAST_CURSOR}, {activity_sql('c.')} AS active_time FROM channels c"
                              " ORDER BY last_cursor DESC, c.id LIMIT ?"),
            "oldest": listed(f"SELECT c.id, {LAST_CURSOR}, {activity_sql('c.')} AS active_time FROM channels c"
                             f" ORDER BY {by_activity('c.')} LIMIT ?"),
            "space": "" if sqlite else POSTGRES_SPACE}


def bulk_fork_of_form(fields: dict, runs: list, dry_run: bool, operation_id: Optional[str] = None) -> BulkFork:
    """The bulk fork form as the request POST /api/v1/forks/bulk takes: exactly these runs, whatever their status."""
    return record_from(BulkFork, {
        "filter": {"status": list(RUN_STATES), "channel_ids": runs},
        "intervention": form_json_object(fields, "intervention", "Intervention"),
        "tool_policies": form_tool_policies(fields), "name": fields.get("name") or "{channel_id}-retry",
        "operation_id": operation_id, "dry_run": dry_run}, "bulk fork form")


def picked_runs(values: list) -> list:
    runs = list(dict.fromkeys(v for value in values for v in value.split() if v))
    if len(runs) > BULK_FORK_MAX:
        raise BadRequest(f"at most {BULK_FORK_MAX} runs at once: filter the runs list further")
    return [valid_channel(run, "run") for run in runs]


async def page_bulk_fork_form(request: Request) -> Response:
    """GET /forks/bulk: what a bulk fork of the ticked runs (or of every run the list's filter matches)
    would make, and the form that makes it; `?done=<operation id>`: what one made."""
    query = page_query(request, BulkForkPageQuery)
    db = db_of(request)
    fields = {"intervention": query.intervention, "tool_policies": query.tool_policies, "name": query.name}
    context = {"title": "Bulk fork", "form": fields, "error": None, "done": bool(query.done), "runs": [],
               "operation_id": str(uuid.uuid4()), "answer": BulkForkAnswer(forks=[], skipped=[], dry_run=True)}
    if query.done:
        stored = await db.read(bulk_fork_by_operation, query.done)
        if stored is None:
            raise NotFound(f"no bulk fork with operation id {query.done}")
        context["answer"] = msgspec.json.decode(stored["answer"], type=BulkForkAnswer)
        return render(request, "bulk_fork.html", context)
    if query.all:
        if query.status and query.status not in RUN_STATES:
            raise BadRequest(f"status must be one of {', '.join(RUN_STATES)}")
        runs = await db.read(matching_run_ids, query.q.strip(), query.status)
    else:
        runs = request.query_params.getlist("run")
    try:
        context["runs"] = picked_runs(runs)
        req = bulk_fork_of_form(fields, context["runs"], True)
        context["answer"] = await db.read(preview_bulk_fork, req, reach_of(request))
    except BadRequest as exc:
        context["error"] = exc.message
        return render(request, "bulk_fork.html", context, status=400)
    return render(request, "bulk_fork.html", context)


async def page_bulk_fork(request: Request) -> Response:
    """POST /forks/bulk: make the forks the form previewed (its operation id makes a second post a replay)."""
    form = await read_form(request)
    try:
        req = bulk_fork_of_form(form, picked_runs([form.get("runs", "")]), False, form.get("operation_id") or None)
    except BadRequest as exc:
        return render(request, "bulk_fork.html", {
            "title": "Bulk fork", "form": {k: form.get(k, "") for k in ("intervention", "tool_policies", "name")},
            "error": exc.message, "done": False, "runs": [], "operation_id": str(uuid.uuid4()),
            "answer": BulkForkAnswer(forks=[], skipped=[], dry_run=True)}, status=400)
    if req.operation_id is None:
        raise BadRequest("the form has no operation id: open the bulk fork page again")
    await db_of(request).write(bulk_fork, req, reach_of(request))
    return RedirectResponse(f"/forks/bulk?{urlencode({'done': req.operation_id})}", status_code=303)


async def page_approvals(request: Request) -> Response:
    query = page_query(request, ApprovalsPageQuery)
    if query.status not in (*APPROVAL_STATUSES, "all"):
        raise BadRequest(f"status must be one of {', '.join(APPROVAL_STATUSES)} or all")
    approvals = await db_of(request).read(list_approvals, None if query.status == "all" else query.status, None,
                                          APPROVALS_LIMIT_MAX, utc_now())
    flash = flash_store(request.app).get(query.error)
    return render(request, "approvals.html", {
        "title": "Approvals", "approvals": approvals, "status": query.status, "statuses": [*APPROVAL_STATUSES, "all"],
        "error": flash["error"] if flash else None, "decided": request.query_params.get("decided", "")[:256]})


async def page_approval_decide(request: Request) -> Response:
    """POST /approvals/{request_id}/decide: the signed-in key or account decides; back to the inbox."""
    form = await read_form(request)
    request_id = decode_params(request.path_params, path_record("/{request_id}"), "path").request_id
    try:
        body = record_from(DecideApproval, {"decision": form.get("decision", ""), "reason": form.get("reason") or None,
                                            "channel_id": form.get("channel_id") or None}, "decision")
        await decide_for(request, request_id, body)
    except (BadRequest, Conflict) as exc:
        flash_id = flash_store(request.app).put({"error": exc.message})
        return RedirectResponse(f"/approvals?{urlencode({'error': flash_id})}", status_code=303)
    return RedirectResponse(f"/approvals?{urlencode({'decided': request_id})}", status_code=303)


async def page_storage(request: Request) -> Response:
    if not context_of(request).principal.is_admin:
        raise Forbidden("only an admin may see the storage page")
    storage = await db_of(request).read(storage_page)
    storage["retain_days"] = request.app.services.region(Retention).retain_days
    return render(request, "storage.html", {"title": "Storage", "storage": storage})


def add_many_runs_commands(commands: Subcommands, common: argparse.ArgumentParser, scoped: argparse.ArgumentParser) -> None:
    """`actae fork-failed` and `actae prune`: the bulk fork and retention, beside a running server too."""
    fork = add_command(commands, "fork-failed", fork_failed_command, [common],
                       "fork every run that went wrong after its own last good step")
    fork.add_argument("--status", action="append", choices=RUN_STATES, metavar="STATUS",
                      help=f"runs of this status (repeatable; default: {' and '.join(FAILURE_STATES)})")
    fork.add_argument("--since", metavar="ISO", help="last active at or after this RFC 3339 time")
    fork.add_argument("--until", metavar="ISO", help="last active at or before this RFC 3339 time")
    fork.add_argument("--prefix", metavar="P", help="runs whose id starts with P")
    fork.add_argument("--contains", metavar="TEXT", help="runs whose failure message contains TEXT (any case)")
    fork.add_argument("--include-handled", action="store_true",
                      help="also a run a completed fork of it already handled (left out by default)")
    fork.add_argument("--at", type=whole(1, INT64_MAX), metavar="K", help="fork after step K instead of each run's last good step")
    fork.add_argument("--intervention", metavar="JSON", help="the forks' intervention, a JSON object")
    fork.add_argument("--policy", action="append", default=[], metavar="TOOL=POLICY",
                      help=f"a tool policy of the forks ({'|'.join(TOOL_POLICIES)}; TOOL may be *; repeatable)")
    fork.add_argument("--name", default="{channel_id}-retry", metavar="PATTERN",
                      help="the forks' ids: {channel_id} is the run's id, {step} the step (default: %(default)s)")
    fork.add_argument("--operation-id", metavar="ID", help="an idempotency key: the same one again forks nothing new")
    fork.add_argument("--dry-run", action="store_true", help="list what would be forked; record nothing")
    fork.add_argument("--json", action="store_true", help="print the answer as JSON")
    prune = add_command(commands, "prune", prune_command, [common],
                        "delete whole runs idle longer than --older-than days (and return the space)")
    prune.add_argument("--older-than", type=days(), required=True, metavar="DAYS",
                       help="runs last active more than DAYS ago (0: every run last active before now)")
    prune.add_argument("--status", choices=PRUNE_STATUSES, default="any", help="only runs of this status (default: any)")
    prune.add_argument("--keep-failed-days", type=days(), metavar="DAYS",
                       help="keep failed and crashed runs until they are DAYS old instead")
    prune.add_argument("--dry-run", action="store_true", help="list what would be deleted; delete nothing")
    prune.add_argument("--json", action="store_true", help="print the answer as JSON")


def bulk_fork_of_args(args: argparse.Namespace) -> BulkFork:
    """The command line's flags as the request POST /forks/bulk takes; exits with a message when one is bad."""
    policies = {}
    for item in args.policy:
        tool, _, policy = item.partition("=")
        if not tool or policy not in TOOL_POLICIES:
            raise SystemExit(f"actae: --policy takes TOOL=POLICY with POLICY one of {', '.join(TOOL_POLICIES)} "
                             f"(got {item!r})")
        policies[tool] = policy
    intervention = decode_json(args.intervention.encode(), Json, "--intervention") if args.intervention else None
    selection = {"status": args.status or list(FAILURE_STATES), "since": args.since, "until": args.until,
                 "channel_prefix": args.prefix, "failure_contains": args.contains,
                 "include_handled": args.include_handled or None}
    return record_from(BulkFork, {"filter": {k: v for k, v in selection.items() if v is not None},
                                  "at": args.at if args.at is not None else "last_good_step",
                                  "intervention": intervention, "tool_policies": policies or None,
                                  "name": args.name, "operation_id": args.operation_id,
                                  "dry_run": args.dry_run}, "arguments")


def fork_failed_command(args: argparse.Namespace, location: Location) -> int:
    """`actae fork-failed [--status S]... [--since ISO] [--prefix P] [--contains TEXT] [--at K] ...`."""
    req = bulk_fork_of_args(args)
    replayed = (not (req.dry_run or args.json) and req.operation_id is not None
                and read_once(location, bulk_fork_by_operation, req.operation_id) is not None)
    answer = read_once(location, preview_bulk_fork, req) if req.dry_run else write_once(location, bulk_fork, req)
    if args.json:
        print_json(answer)
        return 0
    print(f"{bulk_fork_summary(answer, req.operation_id, replayed)}:")
    for item in answer.forks:
        print(f"  {item.source_channel_id} after step {item.step} -> {item.channel_id}")
    print_passed_over(f"Skipped {len(answer.skipped)}", answer.skipped)
    return 0


def bulk_fork_summary(answer: BulkForkAnswer, operation_id: Optional[str], replayed: bool) -> str:
    """How many forks a bulk fork made now, and how many were there already (`replayed`: its operation
    id's answer again; or the same fork asked for again)."""
    if answer.dry_run:
        return f"Would fork {len(answer.forks)} run(s)"
    made = 0 if replayed else sum(1 for item in answer.forks if not (item.receipt and item.receipt.replayed))
    again = len(answer.forks) - made
    if not again:
        return f"Forked {made} run(s), all new"
    by = f"by operation id {operation_id}" if replayed else "by an earlier request for the same forks"
    return f"Forked {len(answer.forks)} run(s): {made} new, {again} already made {by}"


def prune_with(conn: Conn, req: Prune, now: datetime) -> PruneAnswer:
    """The command line's prune on its own connection: the server's steps, each batch its own transaction."""
    plan = plan_prune(conn, req, now)
    before = database_bytes(conn)
    if req.dry_run:
        return prune_answer(req, plan.deletable, plan.kept, planned_rows(conn, plan.deletable), before, before,
                            "a dry run: nothing was deleted")
    deleted, kept, rows = [], list(plan.kept), dict.fromkeys(PrunedRows.__struct_fields__, 0)
    for start in range(0, len(plan.deletable), PRUNE_BATCH):
        ((outcome, events),) = run_jobs(conn, [Job(prune_runs, (plan.deletable[start:start + PRUNE_BATCH], req,
                                                                 iso(now)), None)])
        if events is None:
            raise outcome
        deleted, kept, rows = deleted + outcome[0], kept + outcome[1], {k: rows[k] + outcome[2][k] for k in rows}
    space = POSTGRES_SPACE if conn.dialect is not SQLITE else "nothing was deleted"
    while conn.dialect is SQLITE and deleted and (step := reclaim_step(conn)) is None:
        pass
    if conn.dialect is SQLITE and deleted:
        space = step
    return prune_answer(req, deleted, kept, rows, before, database_bytes(conn), space)


def prune_command(args: argparse.Namespace, location: Location) -> int:
    """`actae prune --older-than DAYS [--status completed|failed|any] [--keep-failed-days DAYS] [--dry-run]`."""
    req = record_from(Prune, {"older_than_days": args.older_than, "status": args.status,
                              "keep_failed_days": args.keep_failed_days, "dry_run": args.dry_run}, "arguments")
    conn = connect_sync(location)
    try:
        answer = prune_with(conn, req, utc_now())
    finally:
        conn.close()
    if args.json:
        print_json(answer)
        return 0
    rows = answer.rows
    print(f"{'Would delete' if answer.dry_run else 'Deleted'} {rows.runs} run(s): {rows.events} events, "
          f"{rows.states} states, {rows.executions} ledger rows, {rows.approvals} approvals, {rows.wakeups} wake-ups")
    for channel_id in answer.deleted:
        print(f"  {channel_id}")
    print_passed_over(f"Kept {len(answer.kept)} old run(s)", answer.kept)
    print(f"Space: {answer.bytes_before} -> {answer.bytes_after} bytes ({answer.bytes_freed} freed); {answer.space}")
    return 0

# --- how many runs plug into the core -----------------------------------------------------------

# A bulk fork skips each run the credential may not write (or whose fork it may not); deciding
# checks write on the approval's run itself; pruning is the admin's.
MANY_RUNS_ROUTES = [
    Api("POST", "/api/v1/forks/bulk", api_forks_bulk, body=BulkFork, scopes=writes(SOMEWHERE)),
    Api("GET", "/api/v1/approvals", api_approvals_list, query=ApprovalsQuery, scopes=reads("query.channel_id")),
    Api("POST", "/api/v1/approvals/{request_id}/decide", api_approvals_decide, body=DecideApproval,
        scopes=writes(SOMEWHERE)),
    Api("POST", "/api/v1/admin/prune", api_admin_prune, body=Prune, scopes=ADMIN),
]


def index_approval_event(tx: Tx, event: Event) -> None:
    """append_event's hook: the approvals index kept in the event's own transaction."""
    index_approval(tx.conn, event.channel_id, event.cursor, event.type, event.payload, event.actor, tx.ts)


def install_retention(services: Services, options: dict) -> Installed:
    """The daily prune (--retain-days; create_app's `retain_days=`), one per app."""
    retain_days = options.get("retain_days")
    retention = Retention(services.db, typing.cast(Optional[float], retain_days))
    return Installed(services=(retention,), starts=(retention.start,), stops=(retention.stop,))


def add_retention_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--retain-days", type=days(), metavar="DAYS",
                        help="prune runs idle longer than DAYS, at start and then daily (the rules of `actae prune`)")


def retention_settings_of(args: argparse.Namespace) -> dict:
    return {"retain_days": getattr(args, "retain_days", None)}


# Schema: step 7 indexes the answers to approvals; step 9 adds the approvals index and the bulk forks'
# answers (after the core's run facts) and fills the index in for the events already stored; step 16
# drops step 7's index, which no query uses since.
MANY_RUNS = declare(Region(
    "many runs", features=("bulk_fork", "approvals", "retention"),
    schema=(SchemaPart(7, approval_answers_index), SchemaPart(9, many_runs_schema),
            SchemaPart(9, many_runs_indexes, reindex_approvals), SchemaPart(16, approval_answers_unindexed)),
    event_hooks=(EventHook(APPROVAL_INDEXED, index_approval_event),), reindexers=(reindex_approvals,),
    deleters=(delete_approvals,), routes=tuple(MANY_RUNS_ROUTES),
    pages=(("GET", "/forks/bulk", page_bulk_fork_form), ("POST", "/forks/bulk", page_bulk_fork),
           ("GET", "/approvals", page_approvals), ("POST", "/approvals/{request_id}/decide", page_approval_decide),
           ("GET", "/storage", page_storage)),
    nav=(NavLink("Approvals", "/approvals", "approvals", place=50),
         NavLink("Storage", "/storage", "storage", place=80, admin=True)),
    installers=(install_retention,), commands=(add_many_runs_commands,), serve_flags=(add_retention_flag,),
    options=(retention_settings_of,)))


# =============================================================================
# MCP: the runs an agent can find, read and act on
# =============================================================================
# Region: the Model Context Protocol endpoint, /mcp over Streamable HTTP: the official `mcp` SDK's
# server mounted in the app (stateless, JSON answers), so a coding agent beside a developer can find a
# failed run, read where it went wrong, plan and make a fork, and decide approvals. The credential is
# an Actae key, sent as x-api-key or `Authorization: Bearer`. A tool answers what an API route answers,
# through that route in process (serve_route with the caller's principal): its scopes are the API's
# by construction, and a run the key may not read does not exist for it. The tools that change runs
# are listed only to a key that may write somewhere; called by one that may not, they are refused by
# the protocol's own error, before anything runs.

MCP_PATH = "/mcp"
MCP_WRITING_TOOLS = frozenset({"fork_run", "bulk_fork", "decide_approval"})
MCP_FIND_LIMIT = 100
MCP_APP_KEY, MCP_PRINCIPAL_KEY = "actae.app", "actae.principal"   # what the endpoint leaves in the request's scope


class FoundRuns(typing.TypedDict):
    """find_runs' answer: each run as the runs list shows it."""

    runs: list[dict]


class RunRead(typing.TypedDict):
    """read_run's answer (run_digest)."""

    run: dict
    failure: Optional[dict]
    cause: Optional[dict]
    handled_by: Optional[dict]
    forks: list[dict]
    steps: list[dict]
    more_steps: bool
    hand_off: Optional[dict]           # a fork handed to a worker: where its job stands


class StepRead(typing.TypedDict):
    """read_step's answer (step_digest)."""

    channel_id: str
    step: int
    recorded_by: str
    events: list[dict]
    state: Optional[dict]


class ForkMade(typing.TypedDict):
    """fork_run's answer: the fork's receipt and the plan it was made under."""

    receipt: dict
    plan: dict


def find_runs(conn: Conn, text: str, status: str, since: Optional[str], until: Optional[str], metadata: dict,
              limit: int, reach: Reach) -> list:
    """Runs `reach` sees, most recently active first, as the runs list shows them, narrowed by a
    substring of their id or name, a status ("failed": crashes too), last activity and metadata values."""
    pages = []
    for state in listed_states(status):
        where = Where().within(reach, "c.id").add_if(state, "c.run_state = ?")
        if text:
            like = conn.dialect.like
            where.add(f"(c.id {like} ? OR c.display_name {like} ?)", f"%{text}%", f"%{text}%")
        if since:
            where.add(f"{activity_sql('c.')} >= ?", since)
        if until:
            where.add(f"{activity_sql('c.')} <= ?", until)
        for name, value in metadata.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", str(name)):   # a key is SQL text here: words only
                raise BadRequest(f"metadata keys are 1-64 letters, digits and _, starting with a letter (got {name!r:.80})")
            where.add(f"{conn.dialect.json_text('c.experiment_metadata', name)} = ?", str(value))
        pages.append((runs_by_activity_sql(where, descending=True), [*where.args, limit]))
    rows = union_of_pages(conn, pages, by_activity("", True), limit)
    return [listed_run(conn, row) for row in rows]


def run_digest(conn: Conn, channel_id: str, reach: Reach) -> dict:
    """A run as an agent reads it first: its summary, its failure and the values it names, and its
    steps, each with what it changed (old and new values)."""
    if not reach.sees(channel_id):
        raise NotFound(f"channel {channel_id} not found")
    page = run_page(conn, channel_id, 1, "steps", reach)
    steps = [{"step": item["step_number"], "cursor": item["event"]["cursor"], "type": item["event"]["type"],
              "duration_ms": item["duration_ms"], "changes": (item["state"] or {}).get("changes")}
             for item in page["timeline"] if item["kind"] == "event"]
    return {"run": page["run"], "failure": page["failure"], "cause": page["cause"], "handled_by": page["handled_by"],
            "forks": [{"channel_id": f["channel_id"], "forked_at_step": f["forked_at_step"]} for f in page["forks"]],
            "steps": steps, "more_steps": page["more"] is not None,
            "hand_off": hand_off_part(conn, channel_id).get("hand_off")}


def step_digest(conn: Conn, channel_id: str, step: int, reach: Reach) -> dict:
    """One step of a run: its events (the step's own and what followed it up to the next step), the
    state it saved and what that changed, and the model calls made under it."""
    if not reach.sees(channel_id):
        raise NotFound(f"channel {channel_id} not found")
    located = resolve_step(conn, channel_id, step)
    owner = located.channel_id
    following = conn.execute("SELECT MIN(cursor) FROM events WHERE channel_id = ? AND cursor > ? AND step_number"
                             " IS NOT NULL", (owner, located.cursor)).fetchone()[0]
    last = (following - 1) if following else INT64_MAX
    events = [msgspec.structs.asdict(event_of(row)) for row in conn.execute(
        "SELECT * FROM events WHERE channel_id = ? AND cursor BETWEEN ? AND ? ORDER BY cursor LIMIT 200",
        (owner, located.cursor, last)).fetchall()]
    saved = snapshots(conn, owner, located.cursor, located.cursor)
    return {"channel_id": channel_id, "step": step, "recorded_by": owner, "events": events,
            "state": saved.get(located.cursor)}


def tool_error(message: str) -> Exception:
    """A tool's anticipated failure: the call answers is_error with `message` for the model to read."""
    from mcp.server.mcpserver.exceptions import ToolError      # imported here: only /mcp needs the SDK
    return ToolError(message)


def protocol_error(message: str) -> Exception:
    """A refusal in the protocol's own terms (a JSON-RPC error), before any tool runs."""
    from mcp.shared.exceptions import MCPError
    from mcp.types import INVALID_REQUEST
    return MCPError(INVALID_REQUEST, message)


def mcp_caller(request: Optional[Request]) -> tuple:
    """(the app, the caller's principal) the MCP endpoint left in the request it handed the SDK."""
    if request is None or MCP_PRINCIPAL_KEY not in request.scope:
        raise protocol_error("no credential: call /mcp with an Actae key")
    return request.scope[MCP_APP_KEY], request.scope[MCP_PRINCIPAL_KEY]


def may_write(principal: Principal) -> bool:
    return principal.can_somewhere("write")


async def route_answer(ctx: "McpContext", method: str, path: str, params: Optional[dict] = None,
                       query: Optional[dict] = None, body: Optional[dict] = None) -> dict:
    """What the API route (method, path) answers the caller, called in process with its principal."""
    app, principal = mcp_caller(ctx.request_context.request)
    route = next(r for r in api_routes(app.services.hooks) if (r.method, r.path) == (method, path))
    raw = msgspec.json.encode(body) if body is not None else None
    try:
        answer = await serve_route(internal_request(app, route, params or {}, query_text(query or {}), raw),
                                   route, principal)
    except ActaeError as exc:
        raise tool_error(f"{exc.status} {exc.code}: {exc.message}") from None
    return msgspec.to_builtins(answer)


async def read_with_reach(ctx: "McpContext", fn: Callable, *args) -> dict:
    """A store function of the caller's reach, its refusal as the tool's error."""
    app, principal = mcp_caller(ctx.request_context.request)
    try:
        return msgspec.to_builtins(await app.services.db.read(fn, *args, principal.reach))
    except ActaeError as exc:
        raise tool_error(f"{exc.status} {exc.code}: {exc.message}") from None


def dry_run_digest(answer: dict) -> str:
    """A bulk fork's dry run named: the forks it would make, each fork's plan, and their sum."""
    return sha256_hex(canonical_json({"forks": [(f["source_channel_id"], f["channel_id"], f["step"],
                                                  (f.get("plan") or {}).get("digest")) for f in answer["forks"]],
                                      "totals": answer.get("plan_totals")}))


def mcp_server() -> "MCPServer":
    """The MCP server of one app: its tools, resources and prompt (they find the app and the caller in
    the request, so one definition serves any app)."""
    # The tools' annotations are read by the SDK from this module's globals: the Context class goes there.
    global McpContext
    from mcp.server.mcpserver import Context as McpContext, MCPServer

    server = MCPServer("actae", title="Actae", version=__version__, instructions=(
        "Actae records agent runs step by step and forks a run at an exact step without re-running or re-paying"
        " for its prefix and without re-firing its side effects. Find failed runs, read where one went wrong"
        " (read_run names the values its failure shows and the steps that set them), plan a fork (plan_fork:"
        " what each side effect would do on it), then make it with the plan's digest (fork_run)."))

    @server.tool(name="find_runs", description="Find runs this key may read, most recently active first. Filter by status"
                             " (failed includes crashed runs; also completed, blocked, recorded, running states),"
                             " by text in the run's id or display name, by last activity (since/until, RFC 3339)"
                             " and by exact values of its metadata (e.g. {\"model\": \"fast\"}).")
    async def find_runs_tool(ctx: McpContext, status: str = "", text: str = "", since: Optional[str] = None,
                             until: Optional[str] = None, metadata: Optional[dict] = None,
                             limit: int = 20) -> FoundRuns:
        if status and status not in (*RUN_STATES, "failed"):
            raise tool_error(f"status must be one of {', '.join(RUN_STATES)}")
        runs = await read_with_reach(ctx, find_runs, text, status, since, until, metadata or {},
                                     max(1, min(limit, MCP_FIND_LIMIT)))
        return {"runs": runs}

    @server.tool(name="read_run", description="Read a run: its status and summary, its failure (the message,"
                 " the last good step, the state values the failure names and the steps that set them, the fork"
                 " to make first), the fork that handled it, its forks, and each step with what it changed in the"
                 " state (old and new values).")
    async def read_run(ctx: McpContext, channel_id: str) -> RunRead:
        return await read_with_reach(ctx, run_digest, channel_id)

    @server.tool(name="read_step", description="Read one step of a run: its events (the step's own and what"
                 " followed it up to the next step: tool calls, model calls, errors), the state it saved and what"
                 " that changed.")
    async def read_step(ctx: McpContext, channel_id: str, step: int) -> StepRead:
        return await read_with_reach(ctx, step_digest, channel_id, step)

    @server.tool(name="diff_runs", description="Compare the latest states of two runs (a run and its fork, say),"
                 " path by path, with the state they share.")
    async def diff_runs(ctx: McpContext, left: str, right: str) -> dict:
        return await route_answer(ctx, "GET", "/api/v1/channels/diff", query={"left": left, "right": right})

    @server.tool(name="fork_tree", description="A run's fork tree (its ancestors and forks this key may read)"
                 " and what the run, if a fork, saved: the inherited steps' tokens and cost, measured model calls.")
    async def fork_tree_tool(ctx: McpContext, channel_id: str) -> dict:
        tree = await route_answer(ctx, "GET", "/api/v1/channels/{channel_id}/fork-tree", {"channel_id": channel_id})
        saved = await route_answer(ctx, "GET", "/api/v1/channels/{channel_id}/savings", {"channel_id": channel_id})
        return {"tree": tree, "savings": saved}

    @server.tool(name="verify_run", description="Recompute a run's tamper-evident hash chain (with the history"
                 " it inherited) and name the first broken cursor, if any.")
    async def verify_run(ctx: McpContext, channel_id: str) -> dict:
        return await route_answer(ctx, "GET", "/api/v1/events/verify/{channel_id}", {"channel_id": channel_id})

    @server.tool(name="plan_fork", description="What a fork of a run after `at_step` would do, before it is"
                 " made (nothing is written): each side effect of its ledger replayed, refused or run again"
                 " under the tool policies ({tool: auto|replay|block|live, \"*\": default}); effects claimed and"
                 " never completed are 'outcome unknown' (they may have happened) and flagged if the fork would"
                 " run them again; the model calls it would replay; what the steps after it cost last time. Its"
                 " digest is what fork_run asks for.")
    async def plan_fork_tool(ctx: McpContext, channel_id: str, at_step: Optional[int] = None,
                             tool_policies: Optional[dict] = None, intervention: Optional[dict] = None) -> dict:
        return await route_answer(ctx, "POST", "/api/v1/forks/plan", body={
            "source_channel_id": channel_id, "at_step": at_step, "tool_policies": tool_policies,
            "intervention": intervention})

    @server.tool(name="fork_run", description="Fork a run after `at_step` into a new run `new_channel_id`, with"
                 " the tool policies and intervention of the plan you read: `plan_digest` must be that plan's"
                 " digest (plan_fork). If the run's ledger or records changed since, the fork is refused and the"
                 " new plan is returned: read it before trying again. With hand_off true the application's"
                 " workers run the fork's tail (a job on the consumer group actae.fork-workers); read_run then"
                 " shows where that job stands.")
    async def fork_run(ctx: McpContext, channel_id: str, new_channel_id: str, at_step: int, plan_digest: str,
                       tool_policies: Optional[dict] = None, intervention: Optional[dict] = None,
                       reason: Optional[str] = None, hand_off: bool = False) -> ForkMade:
        plan = await plan_fork_tool(ctx, channel_id, at_step, tool_policies, intervention)
        if plan["digest"] != plan_digest:
            raise tool_error("409 plan_changed: the plan changed since it was read (or the digest is not this"
                            f" plan's); the plan now: {json.dumps(plan)}")
        boundary = plan["boundary"]
        experiment = {"session_name": new_channel_id, "forked_from": boundary["channel_id"],
                      "forked_from_channel": channel_id, "forked_at_step": at_step,
                      "forked_at_cursor": boundary["requested_cursor"], "status": "created", "plan_digest": plan_digest,
                      **({"intervention": intervention} if intervention else {})}
        receipt = await route_answer(ctx, "POST", "/api/v1/channels/fork", body={
            "source_channel_id": boundary["channel_id"], "new_channel_id": new_channel_id,
            "at_cursor": boundary["requested_cursor"], "display_name": new_channel_id, "tool_policies": tool_policies,
            "reason": reason or f"Forked from {channel_id} after step {at_step} (MCP)", "experiment_metadata": experiment,
            "manifest": {"source": "mcp"}, "hand_off": hand_off})
        return {"receipt": receipt, "plan": plan}

    @server.tool(name="bulk_fork", description="Fork every run a filter selects (default: failed and crashed"
                 " runs this key may write), each after its own last good step. First call it with dry_run true:"
                 " it answers the forks it would make with each one's plan and a digest; then call it again with"
                 " dry_run false and that `plan_digest` to make them (refused, with the new dry run, if anything"
                 " changed).")
    async def bulk_fork_tool(ctx: McpContext, filter: Optional[dict] = None, dry_run: bool = True,
                             plan_digest: Optional[str] = None, tool_policies: Optional[dict] = None,
                             intervention: Optional[dict] = None, name: str = "{channel_id}-retry",
                             hand_off: bool = False) -> dict:
        body = {"filter": filter or {}, "tool_policies": tool_policies, "intervention": intervention, "name": name,
                "hand_off": hand_off}
        preview = await route_answer(ctx, "POST", "/api/v1/forks/bulk", body={**body, "dry_run": True})
        digest = dry_run_digest(preview)
        if dry_run:
            return {**preview, "digest": digest}
        if plan_digest != digest:
            raise tool_error("409 plan_changed: the dry run changed since it was read (or no plan_digest was"
                            f" given); the dry run now: {json.dumps({**preview, 'digest': digest})}")
        return await route_answer(ctx, "POST", "/api/v1/forks/bulk", body={**body, "dry_run": False,
                                                                          "operation_id": digest})

    @server.tool(name="list_approvals", description="The approval requests (a run waiting for a human), oldest"
                 " first: status pending, decided or expired (default: every one), of one run or all.")
    async def list_approvals_tool(ctx: McpContext, status: Optional[str] = None,
                                  channel_id: Optional[str] = None, limit: int = 50) -> dict:
        return await route_answer(ctx, "GET", "/api/v1/approvals",
                                  query={"status": status, "channel_id": channel_id, "limit": limit})

    @server.tool(name="decide_approval", description="Approve or reject a pending approval request (decision:"
                 " approved or rejected), with a reason; the run waiting on it goes on.")
    async def decide_approval_tool(ctx: McpContext, request_id: str, decision: str, reason: Optional[str] = None,
                                   channel_id: Optional[str] = None) -> dict:
        return await route_answer(ctx, "POST", "/api/v1/approvals/{request_id}/decide", {"request_id": request_id},
                                  body={"decision": decision, "reason": reason, "channel_id": channel_id})

    @server.resource("actae://runs/{channel_id}", name="run", mime_type="application/json",
                     description="A run as read_run answers it.")
    async def run_resource(channel_id: str, ctx: McpContext) -> str:
        return json.dumps(await read_run(ctx, channel_id))

    @server.resource("actae://runs/{channel_id}/steps/{step}", name="step", mime_type="application/json",
                     description="One step of a run as read_step answers it.")
    async def step_resource(channel_id: str, step: str, ctx: McpContext) -> str:
        return json.dumps(await read_step(ctx, channel_id, int(step)))

    @server.prompt(name="investigate_failed_run", description="Find where a failed run went wrong and propose"
                   " the fork that keeps none of the mistake.")
    def investigate_failed_run(channel_id: str) -> str:
        return (f"Investigate the failed Actae run {channel_id}.\n"
                f"1. Call read_run with channel_id={channel_id!r}. Read its failure: the message, the last good step,"
                " and `cause`: the state values the failure names and the steps that set them.\n"
                "2. For the earliest of those steps, call read_step to see what that step did and what it changed"
                " (old and new values). The mistake is often made steps before the failure shows.\n"
                "3. Choose the step to fork after: the one before the step that made the mistake (cause.fork_after"
                " when present). Decide the intervention (what to change, such as the model or a parameter) and the"
                " tool policies (block any side effect that must not run twice).\n"
                "4. Call plan_fork with those. Read every effect's fate; any 'outcome unknown' effect that would run"
                " again is flagged: say so, and prefer blocking it unless its far side was checked.\n"
                "5. Propose the fork: the step, the intervention, the policies, what the plan says, and the plan's"
                " digest. Make it with fork_run only once the person agrees.")

    server.middleware.append(mcp_scope_guard)
    return server


async def mcp_scope_guard(ctx, call_next):
    """The writing tools, listed only to a key that may write somewhere; called by one that may not,
    refused by the protocol's error before the tool runs."""
    if ctx.method == "tools/call":
        _, principal = mcp_caller(ctx.request)
        tool = (ctx.params or {}).get("name")
        if tool in MCP_WRITING_TOOLS and not may_write(principal):
            raise protocol_error(f"this key may not write: {tool} changes runs, and is not offered to it")
    result = await call_next(ctx)
    if ctx.method == "tools/list" and not may_write(mcp_caller(ctx.request)[1]):
        if isinstance(result, dict):
            result = {**result, "tools": [t for t in result["tools"] if t["name"] not in MCP_WRITING_TOOLS]}
        else:
            result = result.model_copy(update={"tools": [t for t in result.tools if t.name not in MCP_WRITING_TOOLS]})
    return result


class McpDoor:
    """The MCP server of one app and the Starlette app the SDK serves it with, made by the first /mcp
    request: a server nobody asks over MCP never imports the SDK (half a second). Its session manager
    runs on a task of its own until the app stops."""

    def __init__(self):
        self.asgi: Optional[Callable] = None
        self.opening: Optional[asyncio.Future] = None
        self.serving: Optional[asyncio.Task] = None
        self.stopping = asyncio.Event()

    async def opened(self) -> Callable:
        if self.asgi is None:
            if self.opening is None:
                self.opening = asyncio.ensure_future(self.open())
            await asyncio.shield(self.opening)
        return self.asgi

    async def open(self) -> None:
        await asyncio.to_thread(importlib.import_module, "mcp.server.mcpserver")    # off the event loop
        server = mcp_server()
        asgi = server.streamable_http_app(streamable_http_path=MCP_PATH, stateless_http=True, json_response=True)
        started = asyncio.get_running_loop().create_future()

        async def serve() -> None:
            async with server.session_manager.run():
                started.set_result(None)
                await self.stopping.wait()
        self.serving = asyncio.ensure_future(serve())
        await asyncio.wait({started, self.serving}, return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            self.serving.result()                   # it failed before it served: say why
        self.asgi = asgi

    async def stop(self) -> None:
        if self.serving is not None:
            self.stopping.set()
            await self.serving


class McpAnswer:
    """The SDK's own answer to one /mcp request, given the request as it came (its body unread)."""

    def __init__(self, asgi: Callable, app: ActaeApp, principal: Principal):
        self.asgi, self.app, self.principal = asgi, app, principal

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        await self.asgi({**scope, MCP_APP_KEY: self.app, MCP_PRINCIPAL_KEY: self.principal}, receive, send)


async def mcp_endpoint(request: Request) -> Response:
    """/mcp: the caller's key checked (x-api-key, or `Authorization: Bearer` as MCP clients send a token),
    then the SDK answers. No key, or a bad one: 401 with the header MCP clients look for."""
    try:
        principal = await check_key(request.app, request.headers.get("x-api-key") or bearer_token(request))
    except Unauthorized as exc:
        answer = error_response(request, exc)
        answer.headers["www-authenticate"] = 'Bearer realm="actae", error="invalid_token"'
        return answer
    return McpAnswer(await request.app.services.region(McpDoor).opened(), request.app, principal)


def install_mcp(services: Services, options: dict) -> Installed:
    door = McpDoor()
    return Installed(services=(door,), stops=(door.stop,))


MCP = declare(Region(
    "mcp", features=("mcp",), json_paths=(MCP_PATH,), installers=(install_mcp,),
    # POST only: stateless, with JSON answers, the server has no session to end (DELETE) and nothing to
    # say unasked (GET's stream would outlive a revoked key); 405 tells MCP clients so.
    endpoints=(Endpoint("POST", MCP_PATH, mcp_endpoint),)))


# =============================================================================
# Moving runs: export and import (one JSON Lines file per run and its lineage)
# =============================================================================
# Region: export and import, over HTTP and from the command line.
# A file is a header line, then one line per stored row: each channel's row, its events (cursor
# order), its states (version order) and its ledger rows, parents before their forks. A fork's
# history lives in its ancestors (copy-on-write), so they always come along: a file is complete
# on its own. JSON columns travel as their stored text, so every event re-chains to the same
# hash and every state to the same sha256; import checks both, writes everything in one
# transaction or nothing, and skips a channel that is already here with the same rows.

class ImportRows(Answer):
    events: int
    states: int
    executions: int


class Imported(Done, kw_only=True):
    imported: list[str]
    unchanged: list[str]
    rows: ImportRows


EXPORT_FORMAT, EXPORT_VERSION = "actae-export", 1
EXPORT_MEDIA_TYPE = "application/x-ndjson"
IMPORT_BYTES_MAX = 32 * 1024 * 1024    # an import body: a whole run with its snapshots, so above MAX_BODY_BYTES


Stamp = Annotated[str, Meta(pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{3}Z\Z",
                            description="a stored timestamp: RFC 3339 UTC with milliseconds")]
Sha256 = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}\Z")]
JsonText = Annotated[str, Meta(min_length=1, max_length=MAX_BODY_BYTES, description="a JSON value as stored")]
KeyName = Annotated[str, Meta(min_length=1, max_length=KEY_NAME_MAX_BYTES)]


class ExportCounts(Struct, kw_only=True, forbid_unknown_fields=True):
    channels: Count
    events: Count
    states: Count
    executions: Count


class ExportHeader(Struct, kw_only=True):
    """Line 1. `channels` and `counts` say what follows, so a file cut short is noticed."""

    format: str
    version: int
    channel_id: ChannelId                  # the channel asked for
    with_forks: bool
    channels: list[ChannelId]              # every channel in the file, in file order
    counts: ExportCounts
    exported_at: Optional[Stamp] = None
    exported_by: Optional[Label] = None


class ExportLine(Struct, kw_only=True, forbid_unknown_fields=True, tag_field="kind"):
    """One stored row; `kind` names its table and the fields are its columns, every one of them:
    a line missing a column, or carrying one we do not know (which would be lost), is refused."""

    TABLE: ClassVar[str]
    JSON_TEXTS: ClassVar[dict] = {}        # column holding JSON text -> the shape of the value it holds
    FLAGS: ClassVar[tuple] = ()            # boolean columns (0/1 in the database)
    DERIVED: ClassVar[tuple] = ()          # fields the database derives from other rows: not stored


class ChannelLine(ExportLine, tag="channel"):
    TABLE: ClassVar[str] = "channels"
    JSON_TEXTS: ClassVar[dict] = {"experiment_metadata": dict[str, Json], "manifest": dict[str, Json],
                                  "tool_policies": ToolPolicies}
    FLAGS: ClassVar[tuple] = ("restorable",)
    DERIVED: ClassVar[tuple] = ("last_cursor", "chain_head")      # its last event's (CHANNEL_HEAD)
    id: ChannelId
    parent_id: Optional[ChannelId]
    origin_id: ChannelId
    created_at: Stamp
    updated_at: Stamp
    last_cursor: Count
    state_version: Count
    display_name: Optional[Label]
    reason: Optional[LongText]
    experiment_metadata: Optional[JsonText]
    forked_at: Optional[Stamp]
    requested_cursor: Count
    resolved_cursor: Count
    resolved_event_id: Optional[Id]
    forked_at_step: Optional[Count]
    source_state_version: Count
    source_state_sha256: Optional[Sha256]
    restorable: bool
    manifest: Optional[JsonText]
    reproducibility: Optional[Literal[REPRODUCIBILITY_GRADES]]
    tool_policies: Optional[JsonText]
    fork_operation_id: Optional[Token]
    fork_request_hash: Optional[Sha256]
    outcome: Optional[Literal[OUTCOMES]]
    result_score: Optional[float]
    promoted_event_id: Optional[Id]
    promoted_version: Optional[Count]
    chain_head: Optional[Sha256]
    closed_at: Optional[Stamp]


class EventLine(ExportLine, tag="event"):
    TABLE: ClassVar[str] = "events"
    JSON_TEXTS: ClassVar[dict] = {"payload": Json, "metadata": dict[str, Json], "dependencies": list[dict[str, str]]}
    channel_id: ChannelId
    cursor: Positive
    id: Id
    type: Name
    payload: Optional[JsonText]
    actor: Label
    agent_id: Optional[Label]
    user_id: Optional[Label]
    metadata: Optional[JsonText]
    operation_id: Optional[Token]
    request_hash: Optional[Sha256]
    step_number: Optional[Positive]
    depends_on: Optional[Id]
    dependencies: Optional[JsonText]
    created_at: Stamp
    chain_hash: Sha256


class StateLine(ExportLine, tag="state"):
    """`state` is the snapshot's JSON text (a compressed snapshot is unpacked); `sha256` is checked against it."""

    TABLE: ClassVar[str] = "states"
    channel_id: ChannelId
    version: Positive
    cursor: Count
    state: Optional[JsonText]
    sha256: Sha256
    operation_id: Optional[Token]
    created_at: Stamp


class ExecutionLine(ExportLine, tag="execution"):
    """A ledger row. The claim token stays behind: it is a live owner's secret, and no owner moves."""

    TABLE: ClassVar[str] = "executions"
    JSON_TEXTS: ClassVar[dict] = {"params": Json, "result": Json, "error": Json}
    FLAGS: ClassVar[tuple] = ("replay_emitted",)
    id: Id
    channel_id: ChannelId
    key_name: KeyName
    tool_name: Name
    request_hash: Sha256
    params: Optional[JsonText]
    status: Literal[EXECUTION_STATES]
    lease_seconds: Count
    lease_until: Optional[Stamp]
    attempts: Count
    result: Optional[JsonText]
    error: Optional[JsonText]
    started_cursor: Optional[Count]
    completed_cursor: Optional[Count]
    started_event_id: Optional[Id]
    completed_event_id: Optional[Id]
    replay_emitted: bool
    inherited_from: Optional[Id]
    created_at: Stamp
    updated_at: Stamp
    completed_at: Optional[Stamp]


RowLine = Union[ChannelLine, EventLine, StateLine, ExecutionLine]


class ExportQuery(Record):
    with_forks: bool = False


@dataclass
class RunRows:
    """One channel's rows, from the database or from a file (then with the line each came from)."""

    channel: ChannelLine
    line: int = 0                                   # the channel's line in the file
    events: dict = field(default_factory=dict)      # cursor -> EventLine
    states: dict = field(default_factory=dict)      # version -> StateLine
    executions: dict = field(default_factory=dict)  # key_name -> ExecutionLine
    lines: dict = field(default_factory=dict)       # (kind, key) -> line number

    def rows(self) -> list:
        return [self.channel, *self.events.values(), *self.states.values(), *self.executions.values()]


@dataclass(frozen=True)
class ExportFile:
    """A checked file, ready to import: the header and each channel's rows, parents first."""

    header: ExportHeader
    runs: list

    @property
    def channel_ids(self) -> list:           # the route's write scope is checked on each of these
        return [run.channel.id for run in self.runs]

    def run_of(self, channel_id: str) -> RunRows:
        return next(run for run in self.runs if run.channel.id == channel_id)


@dataclass(frozen=True)
class Exported:
    channel_ids: list
    data: bytes


# --- export ---------------------------------------------------------------------------------


def exported_channels(conn: Conn, channel_id: str, with_forks: bool, reach: "Reach") -> list:
    """The channel's ancestors (root first: its history lives in them), the channel, and with
    `with_forks` its descendants that `reach` sees (a fork it may not read is not there for it, nor
    are that fork's own forks)."""
    lineage_ids = [row["id"] for row, _ in reversed(lineage(conn, channel_id))]
    return lineage_ids + (descendants(conn, channel_id, reach) if with_forks else [])


def state_text(conn: Conn, row: Row) -> Optional[str]:
    """A snapshot's JSON text as it was saved, however it is stored."""
    if row["delta_base"] is None and row["ref_channel"] is None:
        stored = row["state"]
        return zlib.decompress(stored).decode("utf-8") if isinstance(stored, bytes) else stored
    return dump(state_value(conn, row))


def line_of_row(kind: type, row: Row, **columns) -> ExportLine:
    values = {name: row[name] for name in kind.__struct_fields__}
    values.update({name: bool(values[name]) for name in kind.FLAGS}, **columns)
    return kind(**values)


def stored_run(conn: Conn, channel_id: str) -> RunRows:
    """A channel's rows as export lines."""
    run = RunRows(line_of_row(ChannelLine, require_channel(conn, channel_id)))
    for row in channel_event_rows(conn, channel_id):
        run.events[row["cursor"]] = line_of_row(EventLine, row)
    for row in conn.execute("SELECT * FROM states WHERE channel_id = ? ORDER BY version", (channel_id,)):
        run.states[row["version"]] = line_of_row(StateLine, row, state=state_text(conn, row))
    if run.states and max(run.states) > run.channel.state_version:
        # The file carries the channel's version counter (what its next state version follows), which
        # the row keeps only past deleted versions (see next_state_sql).
        run.channel = msgspec.structs.replace(run.channel, state_version=max(run.states))
    for row in rows_where(conn, "executions", "created_at, id", channel_id=channel_id):
        run.executions[row["key_name"]] = line_of_row(ExecutionLine, row)
    return run


def export_run(conn: Conn, channel_id: str, with_forks: bool, reach: "Reach") -> Exported:
    """`actae export` and GET /channels/{id}/export: the file's bytes, and which channels it holds."""
    with read_snapshot(conn):
        runs = [stored_run(conn, c) for c in exported_channels(conn, channel_id, with_forks, reach)]
    rows = [row for run in runs for row in run.rows()]
    counts = ExportCounts(channels=len(runs), events=sum(len(r.events) for r in runs),
                          states=sum(len(r.states) for r in runs), executions=sum(len(r.executions) for r in runs))
    header = ExportHeader(format=EXPORT_FORMAT, version=EXPORT_VERSION, channel_id=channel_id, with_forks=with_forks,
                          channels=[r.channel.id for r in runs], counts=counts, exported_at=iso(utc_now()),
                          exported_by=f"actae {__version__}")
    return Exported([r.channel.id for r in runs], b"".join(msgspec.json.encode(line) + b"\n"
                                                         for line in (header, *rows)))


# --- reading and checking a file -------------------------------------------------------------


def file_lines(raw: bytes) -> list:
    """The file's lines: UTF-8 text, one JSON object per line, the last newline optional."""
    if not raw.strip():
        raise BadRequest("the export file is empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the export file is not UTF-8: {exc.reason} at byte {exc.start}") from None
    lines = text.split("\n")
    if lines[-1].strip() == "":
        lines.pop()
    return lines


def read_header(text: str) -> ExportHeader:
    found = decode_json(text, Json, "line 1")
    if not isinstance(found, dict) or found.get("format") != EXPORT_FORMAT:
        raise BadRequest(f'line 1 is not an export header: an export file starts with {{"format": "{EXPORT_FORMAT}", '
                         f'"version": {EXPORT_VERSION}, ...}}')
    if found.get("version") != EXPORT_VERSION:
        raise BadRequest(f"line 1: export format version {found.get('version')!r:.40} is not one this server "
                         f"reads (it reads version {EXPORT_VERSION})")
    return decode_json(text, ExportHeader, "header on line 1")


def json_text_value(text: str, kind: object, what: str) -> Json:
    """The value a JSON text column holds: strict JSON of the expected shape, at most 64 levels deep,
    no larger than the record path takes (MAX_DOCUMENT_BYTES)."""
    if len(text) > MAX_DOCUMENT_BYTES and len(text.encode("utf-8")) > MAX_DOCUMENT_BYTES:
        raise TooLarge(f"{what} is larger than {MAX_DOCUMENT_BYTES} bytes, which no write takes")
    value = decode_json(text, kind, what)
    problem = document_problem(value)
    if problem:
        raise BadRequest(f"{what} {problem}")
    return value


def check_state_hash(line: StateLine, number: int) -> None:
    """A snapshot must still be what its sha256 says (receipts and forks quote that hash)."""
    state = None if line.state is None else json_text_value(line.state, Json, f"state on line {number}")
    if sha256_hex(canonical_json(state)) != line.sha256:
        raise BadRequest(f"line {number}: state version {line.version} of {line.channel_id} does not match its "
                         "sha256 (the line was changed after export)")


@functools.cache
def stamp_fields(kind: type) -> tuple:
    """The fields of a line that hold a stored timestamp (Stamp)."""
    hints = typing.get_type_hints(kind, include_extras=True)
    return tuple(name for name in kind.__struct_fields__ if hints[name] in (Stamp, Optional[Stamp]))


def read_line(text: str, number: int) -> ExportLine:
    """One row line, decoded and checked on its own as the record path checks a write: types, lengths,
    real instants, JSON texts measured (strings too) and an event's payload in canonical form, no NUL."""
    if not text.strip():
        raise BadRequest(f"line {number} is empty; each line after the header is one row")
    line = decode_json(text, RowLine, f"line {number}")
    for name in line.__struct_fields__:
        value = getattr(line, name)
        if isinstance(value, str) and "\x00" in value:
            raise BadRequest(f"line {number}: {name} contains a NUL character, which cannot be stored")
    for name in stamp_fields(type(line)):
        value = getattr(line, name)
        if value is not None and stored_instant(value) is None:
            raise BadRequest(f"line {number}: {name} {value!r:.40} is not a real instant (RFC 3339 UTC)")
    for name, kind in line.JSON_TEXTS.items():
        if getattr(line, name) is not None:
            value = json_text_value(getattr(line, name), kind, f"{name} on line {number}")
            if name == "payload" and canonical_json(value) != line.payload:
                # The chain hashes the stored text; the documented offline check hashes its canonical form.
                raise BadRequest(f"line {number}: payload is not in canonical JSON form (keys sorted, no spaces),"
                                 " as every stored payload is")
    if isinstance(line, StateLine):
        check_state_hash(line, number)
    return line


def add_row(runs: dict, line: ExportLine, number: int) -> None:
    """File the line under its channel, refusing a second row with the same key."""
    if isinstance(line, ChannelLine):
        if line.id in runs:
            raise BadRequest(f"line {number}: channel {line.id} appears twice (line {runs[line.id].line} too)")
        runs[line.id] = RunRows(line, number)
        return
    run = runs.get(line.channel_id)
    if run is None:
        raise BadRequest(f"line {number}: a row of channel {line.channel_id} comes before that channel's own line")
    kind, rows, key = {EventLine: ("event", run.events, "cursor"), StateLine: ("state", run.states, "version"),
                       ExecutionLine: ("execution", run.executions, "key_name")}[type(line)]
    value = getattr(line, key)
    if value in rows:
        raise BadRequest(f"line {number}: channel {line.channel_id} has a second {kind} with {key} {value!r:.80} "
                         f"(line {run.lines[(kind, value)]} too)")
    rows[value] = line
    run.lines[(kind, value)] = number


def check_counts(file: ExportFile) -> None:
    """The header names what follows: a file cut short at a line boundary is noticed here."""
    header, runs = file.header, file.runs
    if not runs:
        raise BadRequest("the export file holds no channel")
    found = ExportCounts(channels=len(runs), events=sum(len(r.events) for r in runs),
                         states=sum(len(r.states) for r in runs), executions=sum(len(r.executions) for r in runs))
    if found != header.counts:
        announced, held = msgspec.structs.asdict(header.counts), msgspec.structs.asdict(found)
        differ = ", ".join(f"{n} {k}" for k, n in announced.items() if held[k] != n)
        raise BadRequest(f"line 1: the header announces {differ} but the file holds "
                         f"{', '.join(f'{held[k]} {k}' for k, n in announced.items() if held[k] != n)}: "
                         "the file is truncated or was edited")
    if header.channels != file.channel_ids:
        raise BadRequest("line 1: the header's channels are not the channels the file holds, in file order")


def check_counters(run: RunRows) -> None:
    """The channel's counters match its rows, so its next event and state version follow on from them.

    Cursors are distinct and positive, so n of them with the greatest at n are exactly 1..n.
    """
    channel, cursors = run.channel, run.events
    if len(cursors) != channel.last_cursor or (cursors and max(cursors) != channel.last_cursor):
        raise BadRequest(f"line {run.line}: channel {channel.id} has last_cursor {channel.last_cursor}, but its "
                         f"{len(cursors)} events in the file do not run 1..{channel.last_cursor}")
    if run.states and max(run.states) > channel.state_version:
        raise BadRequest(f"line {run.line}: channel {channel.id} has state_version {channel.state_version} but a "
                         f"state version {max(run.states)}")


def check_lineage(run: RunRows, runs: dict) -> None:
    """A fork's parent precedes it in the file, the origin is the lineage's root, and the line is not too deep."""
    channel, parent = run.channel, runs.get(run.channel.parent_id)
    if channel.parent_id is not None and (parent is None or parent.line > run.line):
        raise BadRequest(f"line {run.line}: channel {channel.id} is a fork of {channel.parent_id}, which is not in "
                         "the file before it (a fork's history lives in its ancestors; export brings them along)")
    origin = parent.channel.origin_id if parent else channel.id
    if channel.origin_id != origin:
        raise BadRequest(f"line {run.line}: channel {channel.id} names origin {channel.origin_id}, but its "
                         f"lineage starts at {origin}")
    depth, above = 0, parent
    while above is not None:
        depth, above = depth + 1, runs.get(above.channel.parent_id)
    if depth > LINEAGE_MAX_DEPTH:
        raise BadRequest(f"line {run.line}: channel {channel.id} is more than {LINEAGE_MAX_DEPTH} forks deep")


def check_fork_boundary(run: RunRows, runs: dict) -> None:
    """What a fork's receipt quotes of its parent (boundary event, source snapshot) is in the parent's rows."""
    channel = run.channel
    if channel.parent_id is None:
        return
    parent = runs[channel.parent_id]
    boundary = parent.events.get(channel.resolved_cursor) if channel.resolved_cursor > 0 else None
    if channel.resolved_event_id != (boundary.id if boundary else None):
        raise BadRequest(f"line {run.line}: fork {channel.id} names boundary event {channel.resolved_event_id}, "
                         f"which is not its parent's event at cursor {channel.resolved_cursor}")
    source = parent.states.get(channel.source_state_version)
    if source is not None and channel.restorable and source.sha256 != channel.source_state_sha256:
        raise BadRequest(f"line {run.line}: fork {channel.id} quotes a source state sha256 that is not the one "
                         f"of {parent.channel.id}'s state version {channel.source_state_version}")


def check_unique_ids(file: ExportFile) -> None:
    """What the schema keeps unique across channels (or within one) is unique in the file too."""
    seen: dict = {}
    for run in file.runs:
        keys = [(("event id", e.id), run.lines[("event", c)]) for c, e in run.events.items()]
        keys += [(("execution id", x.id), run.lines[("execution", k)]) for k, x in run.executions.items()]
        keys += [(("event operation_id", run.channel.id, e.operation_id), run.lines[("event", c)])
                 for c, e in run.events.items() if e.operation_id is not None]
        keys += [(("state operation_id", run.channel.id, s.operation_id), run.lines[("state", v)])
                 for v, s in run.states.items() if s.operation_id is not None]
        if run.channel.fork_operation_id is not None:
            keys.append((("fork_operation_id", run.channel.fork_operation_id), run.line))
        for key, number in keys:
            if key in seen:
                raise BadRequest(f"line {number}: {key[0]} {key[-1]!r:.80} is used twice (line {seen[key]} too)")
            seen[key] = number


def parse_export(raw: bytes) -> ExportFile:
    """Read and check a whole export file before anything is written; BadRequest names the line."""
    lines = file_lines(raw)
    header = read_header(lines[0])
    runs: dict = {}
    for number, text in enumerate(lines[1:], start=2):
        add_row(runs, read_line(text, number), number)
    file = ExportFile(header, list(runs.values()))
    check_counts(file)
    for run in file.runs:
        check_lineage(run, runs)
        check_counters(run)
        check_fork_boundary(run, runs)
    check_unique_ids(file)
    return file


# --- importing ---------------------------------------------------------------------------------


def first_difference(stored: RunRows, run: RunRows) -> Optional[int]:
    """The line of the first row of `run` that the stored channel does not have as it is, or None."""
    if stored.channel != run.channel:
        return run.line
    for kind, held, given in (("event", stored.events, run.events), ("state", stored.states, run.states),
                              ("execution", stored.executions, run.executions)):
        for key, line in given.items():
            if held.get(key) != line:
                return run.lines[(kind, key)]
        if len(held) != len(given):
            return run.line                # the server's copy has rows the file lacks
    return None


def already_here(conn: Conn, run: RunRows) -> bool:
    """True when the channel exists with exactly these rows; Conflict when it exists with others."""
    if channel_by_id(conn, run.channel.id) is None:
        return False
    differs = first_difference(stored_run(conn, run.channel.id), run)
    if differs is None:
        return True
    raise Conflict("channel_conflict", f"line {differs}: channel {run.channel.id} already exists on this server with "
                                       "different content; nothing was imported (delete it first, or import "
                                       "into another server)")


def taken_ids(conn: Conn, table: str, ids: list) -> dict:
    """Of `ids`, those `table` already holds: {id: channel_id}."""
    taken = {}
    for start in range(0, len(ids), ID_BATCH):
        batch = ids[start:start + ID_BATCH]
        taken.update((r["id"], r["channel_id"]) for r in conn.execute(
            f"SELECT id, channel_id FROM {table} WHERE id IN ({', '.join('?' * len(batch))})", batch))
    return taken


def check_ids_free(conn: Conn, runs: list, reach: "Reach") -> None:
    """The new channels' event and ledger ids (unique across the server) and fork operation ids are
    unused; a conflict names the channel holding one only to a credential that reads it."""
    for table, kind, attribute in (("events", "event", "events"), ("executions", "execution", "executions")):
        where = {row.id: (run, key) for run in runs for key, row in getattr(run, attribute).items()}
        for row_id, other in taken_ids(conn, table, list(where)).items():
            run, key = where[row_id]
            holder = f"channel {other}" if reach.sees(other) else "another channel"
            raise Conflict("channel_conflict", f"line {run.lines[(kind, key)]}: {kind} {row_id} already exists on this "
                                               f"server, in {holder}; nothing was imported")
    for run in runs:
        if run.channel.fork_operation_id is not None:
            other = conn.execute("SELECT id FROM channels WHERE fork_operation_id = ?",
                                 (run.channel.fork_operation_id,)).fetchone()
            if other is not None:
                holder = f"channel {other['id']}" if reach.sees(other["id"]) else "another channel"
                raise Conflict("channel_conflict", f"line {run.line}: fork operation id {run.channel.fork_operation_id}"
                                                   f" already names {holder} on this server; nothing was imported")


def insert_line(tx: Tx, line: ExportLine, **columns) -> None:
    values = msgspec.structs.asdict(line)
    values.update({name: int(values[name]) for name in line.FLAGS}, **columns)
    for name in line.DERIVED:
        del values[name]
    tx.conn.execute(insert_sql(line.TABLE, tuple(values)), tuple(values.values()))


def insert_run(tx: Tx, run: RunRows) -> None:
    insert_line(tx, run.channel)
    for event in run.events.values():
        insert_line(tx, event)
    for state in run.states.values():
        insert_line(tx, state, state=tx.conn.dialect.pack_state(state.state), status=state_status(load(state.state)))
    for execution in run.executions.values():
        insert_line(tx, execution)


def check_imported_chain(conn: Conn, run: RunRows, file: ExportFile) -> None:
    """The imported channel's chain, with the history it inherits, verifies and ends at its chain_head."""
    verdict = verify_chain(conn, run.channel.id)
    if not verdict.ok:
        broken, cursor = verdict.first_broken_channel_id, verdict.first_broken_cursor
        number = file.run_of(broken).lines.get(("event", cursor), run.line)
        raise BadRequest(f"line {number}: the event chain of {broken} breaks at cursor {cursor} (the line was "
                         "changed after export); nothing was imported")
    if verdict.head != run.channel.chain_head:
        raise BadRequest(f"line {run.line}: chain_head of channel {run.channel.id} is not the hash of its last "
                         "event; nothing was imported")


def import_runs(tx: Tx, file: ExportFile, reach: "Reach") -> Imported:
    """POST /import and `actae import`: the file's new channels, all in this one transaction.

    A channel already here with the same rows is left as it is (importing a file twice changes
    nothing); one here with other rows refuses the whole file (409). So does an id another
    channel uses; a chain that does not verify once written refuses it (400).
    """
    new = [run for run in file.runs if not already_here(tx.conn, run)]
    check_ids_free(tx.conn, new, reach)
    for run in new:
        insert_run(tx, run)
    for run in new:                                     # a fork's chain goes on from its parent's, maybe in the file
        tx.conn.execute("UPDATE channels SET chain_base = (SELECT e.chain_hash FROM events e WHERE e.channel_id ="
                        " channels.parent_id AND e.cursor = channels.resolved_cursor) WHERE id = ?", (run.channel.id,))
        refresh_run_facts(tx.conn, run.channel.id)      # what the write path would have kept on the row
        index_usage(tx.conn, run.channel.id)
        for reindex in tx.hooks.reindexers:
            reindex(tx.conn, run.channel.id)
    for run in new:
        check_imported_chain(tx.conn, run, file)
    fresh = {run.channel.id for run in new}
    return Imported(imported=[run.channel.id for run in new],
                    unchanged=[c for c in file.channel_ids if c not in fresh],
                    rows=ImportRows(events=sum(len(r.events) for r in new), states=sum(len(r.states) for r in new),
                                    executions=sum(len(r.executions) for r in new)))


# =============================================================================
# Moving runs: routes and commands
# =============================================================================

async def api_channels_export(request: Request, path, query: ExportQuery) -> Response:
    """Export a run with its ancestors (with_forks: and every fork below it) as a JSON Lines file."""
    exported = await db_of(request).read(export_run, path.channel_id, query.with_forks, reach_of(request))
    for channel_id in exported.channel_ids:
        context_of(request).principal.require("read", channel_id)
    return Response(exported.data, media_type=EXPORT_MEDIA_TYPE,
                    headers={"content-disposition": f'attachment; filename="{path.channel_id}.jsonl"'})


async def api_import(request: Request, body: ExportFile) -> Imported:
    """Import the runs of an export file: every channel in it, or nothing (already-present ones unchanged)."""
    return await db_of(request).write(import_runs, body, reach_of(request))


def export_command(args: argparse.Namespace, location: Location) -> int:
    """`actae export CHANNEL [--with-forks] > run.jsonl`."""
    exported = read_once(location, export_run, valid_channel(args.channel_id, "CHANNEL"), args.with_forks, EVERYWHERE)
    sys.stdout.buffer.write(exported.data)
    sys.stdout.flush()
    return 0


def import_command(args: argparse.Namespace, location: Location) -> int:
    """`actae import FILE` (`-` reads standard input)."""
    try:
        raw = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
    except OSError as exc:
        raise SystemExit(f"actae: cannot read {args.file}: {exc.strerror}")
    answer = write_once(location, import_runs, parse_export(raw), EVERYWHERE)
    if args.json:
        print_json(answer)
        return 0
    rows = answer.rows
    print(f"Imported {len(answer.imported)} channel(s): {', '.join(answer.imported) or '-'} "
          f"({rows.events} events, {rows.states} states, {rows.executions} ledger rows)")
    print(f"Already here, unchanged: {', '.join(answer.unchanged) or '-'}")
    return 0

def add_moving_commands(commands: Subcommands, common: argparse.ArgumentParser, scoped: argparse.ArgumentParser) -> None:
    export = add_command(commands, "export", export_command, [common],
                         "write a run, with its ancestors, to standard output as JSON Lines")
    export.add_argument("channel_id", metavar="CHANNEL")
    export.add_argument("--with-forks", action="store_true", help="also every fork below it, forks of forks too")
    imports = add_command(commands, "import", import_command, [common], "add the runs of an export file to this server")
    imports.add_argument("file", metavar="FILE", help="the file `actae export` wrote; - reads standard input")
    imports.add_argument("--json", action="store_true", help="print the answer as JSON")


MOVING_ROUTES = [
    # Export also needs read on each ancestor and fork it carries; import, write on every channel in the file.
    Api("GET", "/api/v1/channels/{channel_id}/export", api_channels_export, query=ExportQuery, scopes=reads(P),
        answers=EXPORT_MEDIA_TYPE, answers_also=(BYTES,)),
    # Documented as bytes (what every generator sends); the server reads it whatever its content-type.
    Api("POST", "/api/v1/import", api_import, scopes=writes("body.channel_ids"), text_body=TextBody(
        "ExportFile", f"JSON Lines ({EXPORT_MEDIA_TYPE}), as GET /api/v1/channels/{{channel_id}}/export writes it",
        (BYTES,), IMPORT_BYTES_MAX, parse_export, file_type=EXPORT_MEDIA_TYPE)),
]
MOVING_RUNS = declare(Region("moving runs", routes=tuple(MOVING_ROUTES), commands=(add_moving_commands,)))


# =============================================================================
# Observability: metrics (Prometheus at /metrics)
# =============================================================================
# Region: /metrics and every run as an OpenTelemetry trace.
# Metrics: prometheus_client, one registry per app. Counters and histograms count what THIS process
# did (servers sharing a PostgreSQL database each count their own; sum them in Prometheus); the
# gauges that describe stored data (runs by status, approvals waiting, wake-ups due, database size)
# are read from the database, at most every STORE_GAUGES_SECONDS, so every server reports the same.
#
# Traces: each run (channel) is one trace, its ids derived from the record: trace id from the
# channel, span id from (channel, cursor), the root's from (channel, 0). A batch that committed hands
# its events to `TraceExport` (a deque append: nothing else happens on the write path); a task of its
# own turns them into spans and gives them to a BatchSpanProcessor with a bounded queue, whose
# thread talks OTLP/HTTP. A slow or dead collector fills that queue and spans are dropped, and
# counted; writes never wait for it. `actae otel-export` builds the same spans from the stored run
# (`run_spans`), through the same `SpanMaker`, so live, backfill and a run that crashed halfway agree.
#
#   invoke_agent {name}        the run, from its first event to its end (see run_root_span)
#   ├── {step type}            one per AgentSession step: from the previous step's event (or the
#   │                          run's first event) to its own event; gen_ai.* lifted from the payload
#   └── execute_tool {tool}    one per ledger outcome event: tool.completed / tool.failed (from its
#                              tool.started), tool.replayed and tool.blocked (instants), with
#                              actae.ledger.outcome executed | failed | replayed | blocked
#
# A run ends, and its root span is sent, when `session.completed` is recorded, when the SDK marks
# the session crashed or failed in the run's metadata, or when the run is closed. A run that ends
# again (resumed after a crash) sends its root again, same ids, newer end and status. A fork is a
# trace of its own whose root links to the parent's span of the step it forked after.

class BackPressure(Answer):
    queue_limit: int
    dropped_connections: int


class WebSocketFigures(Answer):
    connections: int
    topics: int
    messages_sent: int
    messages_received: int
    total_messages: int
    back_pressure: BackPressure


class DatabaseFigures(Answer):
    write_batches: int
    write_jobs: int


class MetricsJson(Answer):
    status: str
    timestamp: str
    uptime_seconds: int
    websocket: WebSocketFigures
    database: DatabaseFigures


STORE_GAUGES_SECONDS = 5.0             # how stale the stored-data gauges may be
SPAN_QUEUE_MAX = 8192                  # spans the BatchSpanProcessor holds before it drops
SPAN_BATCH_MAX = 512                   # spans per OTLP request
PENDING_BATCHES_MAX = 4096             # committed batches waiting to become spans
RUN_CLOCKS_MAX = 10_000                # channels whose last step time is kept (else read back)
TOOL_STARTS_MAX = 256                  # tool.started times kept per channel
EVENT_TYPE_LABELS_MAX = 256            # distinct `type` labels; later types count under "other"
EXPORT_SHUTDOWN_SECONDS = 2.0          # what a stopping server gives the collector for queued spans
EXPORT_TIMEOUT_SECONDS = 5.0           # one OTLP request, retries included
CIRCUIT_FAILURES = 3                   # failed exports in a row that open the circuit (spans dropped at once)
CIRCUIT_OPEN_SECONDS = (2.0, 60.0)     # how long it stays open: doubling from the first to the second
OTLP_TRACES_PATH = "/v1/traces"
HTTP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOOL_SPAN_EVENTS = {"tool.completed": "executed", "tool.failed": "failed", "tool.replayed": "replayed",
                    "tool.blocked": "blocked"}
# gen_ai.* attributes lifted from a step, each under the names agents use for it (the SDK's own
# OTel bridge reads the same ones); looked up in the payload, its output, input and usage, then
# the event's metadata.
GEN_AI_LIFTS = (
    ("gen_ai.request.model", ("model", "request_model"), str),
    ("gen_ai.response.model", ("response_model",), str),
    ("gen_ai.provider.name", ("provider", "provider_name"), str),
    ("gen_ai.operation.name", ("operation", "operation_name"), str),
)


class Metrics:
    """The app's Prometheus registry: what the process counts, and the stored-data gauges' cache."""

    def __init__(self):
        prometheus_client.disable_created_metrics()      # no *_created series beside each counter
        self.registry = r = prometheus_client.CollectorRegistry()
        prometheus_client.ProcessCollector(registry=r)
        prometheus_client.PlatformCollector(registry=r)
        self.http = prometheus_client.Histogram(
            "actae_http_request_duration_seconds", "HTTP requests by route template (\"other\": outside the"
            " API table), method and status class", ("route", "method", "status_class"), buckets=HTTP_BUCKETS,
            registry=r)
        self.batch_jobs = prometheus_client.Histogram(
            "actae_write_batch_jobs", "Write jobs per committed batch (group commit)", buckets=BATCH_BUCKETS,
            registry=r)
        self.commit_seconds = prometheus_client.Histogram(
            "actae_commit_duration_seconds", "Time to run and commit one write batch", buckets=COMMIT_BUCKETS,
            registry=r)
        self.events = prometheus_client.Counter("actae_events_written", "Events committed by this process, by type",
                                                ("type",), registry=r)
        self.claims = prometheus_client.Counter("actae_ledger_claims", "Execution ledger claims by outcome",
                                                ("outcome",), registry=r)
        self.forks = prometheus_client.Counter("actae_forks_created", "Forks created by this process", registry=r)
        self.saved_tokens = prometheus_client.Counter(
            "actae_fork_saved_tokens", "Tokens (in and out) of the steps the forks this process made inherited"
            " instead of running again (steps with no recorded usage add nothing)", ("direction",), registry=r)
        self.saved_cost = prometheus_client.Counter(
            "actae_fork_saved_cost", "Cost of the steps the forks this process made inherited (as the steps"
            " recorded it: cost or cost_usd)", registry=r)
        for direction in ("input", "output"):
            self.saved_tokens.labels(direction)
        # the model-call gateway's calls, from their committed llm.call events (measured, not reported)
        self.llm_calls = prometheus_client.Counter(
            "actae_llm_calls", "Model calls through the gateway, by how they ended and whether the record answered",
            ("status", "replayed"), registry=r)
        self.llm_tokens = prometheus_client.Counter(
            "actae_llm_tokens", "Tokens of the model calls through the gateway: spent (sent upstream) or saved"
            " (answered from the record)", ("direction", "kind"), registry=r)
        self.llm_cost = prometheus_client.Counter(
            "actae_llm_cost", "USD of the model calls through the gateway with a known price: spent or saved",
            ("kind",), registry=r)
        # forks committed since the last scrape: what they saved is read when /metrics is asked, in one
        # read, so a fork's write path pays for a list append only
        self.forks_to_count: list = []
        self.spans_exported = prometheus_client.Counter(
            "actae_spans_exported", "Spans the OTLP collector accepted", registry=r)
        self.spans_dropped = prometheus_client.Counter(
            "actae_spans_dropped", "Spans given up: queue full, collector refused or unreachable", registry=r)
        for outcome in LEDGER_OUTCOMES:
            self.claims.labels(outcome)
        self._http_children: dict = {}
        self._event_children: dict = {}
        self.stored: dict = {}
        self.stored_at = -math.inf
        self._reading: Optional[asyncio.Task] = None

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        key = (route, method, status // 100)
        child = self._http_children.get(key)
        if child is None:
            child = self._http_children[key] = self.http.labels(route, method, f"{status // 100}xx")
        child.observe(seconds)

    def count_event(self, event_type: str) -> None:
        child = self._event_children.get(event_type)
        if child is None:
            label = event_type if len(self._event_children) < EVENT_TYPE_LABELS_MAX else "other"
            child = self._event_children.setdefault(label, self.events.labels(label))
            if label == event_type:
                self._event_children[event_type] = child
        child.inc()

    def observe_batch(self, jobs: list, outcomes: list, seconds: float) -> list:
        """One committed batch: the histograms, its events, claims and forks. Returns the channels whose
        run the batch ended through their metadata (the SDK marking a session crashed or failed)."""
        self.batch_jobs.observe(len(jobs))
        self.commit_seconds.observe(seconds)
        ended = []
        for job, (result, events) in zip(jobs, outcomes):
            for event in events or ():
                self.count_event(event.type)
                if event.type == "fork.started":
                    self.forks.inc()
                    self.forks_to_count.append(event.channel_id)
                elif event.type == LLM_CALL_EVENT:
                    self.count_llm_call(event.payload)
            if job.work is claim_execution:
                self.claims.labels(claim_outcome(result)).inc()
            elif job.work is put_metadata and isinstance(result, ChannelMetadata):
                meta = result.experiment_metadata
                if isinstance(meta, dict) and meta.get("status") in FAILURE_STATES:
                    ended.append(result.channel_id)
        return ended

    def count_llm_call(self, payload: Json) -> None:
        if not isinstance(payload, dict):
            return
        replayed = payload.get("replayed") is True
        self.llm_calls.labels(str(payload.get("status")), "true" if replayed else "false").inc()
        figures, kind = (payload.get("saved"), "saved") if replayed else (payload.get("usage"), "spent")
        if isinstance(figures, dict):
            for direction in ("input", "output"):
                count = figures.get(f"{direction}_tokens")
                if isinstance(count, int) and count > 0:
                    self.llm_tokens.labels(direction, kind).inc(count)
        cost = (figures or {}).get("cost") if replayed else payload.get("cost")
        if isinstance(cost, (int, float)) and cost > 0:
            self.llm_cost.labels(kind).inc(cost)

    async def refresh_stored(self, db: "Database") -> None:
        """Re-read the stored-data gauges when they are older than STORE_GAUGES_SECONDS (one read at a
        time: concurrent scrapes share it)."""
        if time.monotonic() - self.stored_at < STORE_GAUGES_SECONDS:
            return
        if self._reading is None:
            self._reading = asyncio.ensure_future(db.read(stored_figures, iso(utc_now())))
        reading = self._reading
        try:
            self.stored = await reading
            self.stored_at = time.monotonic()
        except Exception:  # noqa: BLE001 - /metrics still answers, with the last figures it had
            log.warning("reading the stored-data gauges failed", exc_info=True)
        finally:
            if self._reading is reading:
                self._reading = None

    async def count_savings(self, db: "Database") -> None:
        """Add what the forks made since the last scrape inherited to the saved-token and cost counters."""
        forks, self.forks_to_count = self.forks_to_count, []
        if not forks:
            return
        for saving in await db.read(fork_savings, forks):
            self.saved_tokens.labels("input").inc(saving.saved.input_tokens)
            self.saved_tokens.labels("output").inc(saving.saved.output_tokens)
            self.saved_cost.inc(saving.saved.cost or 0.0)

    def text(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


def claim_outcome(result: Json) -> str:
    """How a claim job ended, as actae_ledger_claims_total counts it."""
    if isinstance(result, Claimed):
        return result.status
    if isinstance(result, Refused):
        return "blocked"
    if isinstance(result, ActaeError) and result.code == "idempotency_key_mismatch":
        return "mismatch"
    return "error"


class LiveFigures:
    """The gauges read at scrape time: this process's connections and write counters, and the
    stored-data figures of the last read (Metrics.stored)."""

    def __init__(self, services: Services, metrics: "Metrics"):
        self.services, self.metrics = services, metrics

    def describe(self) -> list:
        return []                         # read only when scraped, never at registration

    def collect(self):
        state = self.services
        db, hub, stored = state.db, state.hub, self.metrics.stored
        now = time.time()
        build = GaugeMetricFamily("actae_build_info", "This server's version, storage backend and Python (always 1)",
                                  labels=("version", "backend", "python"))
        build.add_metric((__version__, db.location.backend, platform.python_version()), 1)
        yield build
        yield CounterMetricFamily("actae_write_batches", "Write batches (transactions) committed", value=db.batches)
        yield CounterMetricFamily("actae_write_jobs", "Write jobs in the committed batches", value=db.batched_jobs)
        yield GaugeMetricFamily("actae_websocket_connections", "Open WebSocket connections",
                                value=len(hub.connections))
        yield GaugeMetricFamily("actae_websocket_subscriptions", "Channel subscriptions over all WebSocket connections",
                                value=sum(len(c.subscriptions) for c in list(hub.connections)))
        yield CounterMetricFamily("actae_websocket_messages_sent", "WebSocket frames sent", value=hub.messages_sent)
        yield CounterMetricFamily("actae_websocket_messages_received", "WebSocket frames received",
                                  value=hub.messages_received)
        if not stored:
            return
        runs = GaugeMetricFamily("actae_runs", "Stored runs by status (as the dashboard shows it)", labels=("status",))
        for status in RUN_STATES:
            runs.add_metric((status,), stored["runs"].get(status, 0))
        yield runs
        oldest, due = stored["oldest_approval"], stored["oldest_due"]
        yield GaugeMetricFamily("actae_approvals_pending", "approval.requested events with no approval.decided"
                                " or approval.expired of the same request_id", value=stored["approvals"])
        yield GaugeMetricFamily("actae_approval_oldest_pending_age_seconds", "Age of the oldest pending approval",
                                value=seconds_since(oldest, now))
        yield GaugeMetricFamily("actae_wakeups_due", "Pending wake-ups whose time has come", value=stored["wakeups"])
        yield GaugeMetricFamily("actae_wakeup_oldest_lateness_seconds", "How late the oldest due wake-up is",
                                value=seconds_since(due, now))
        yield GaugeMetricFamily("actae_database_size_bytes", "Size of the database", value=stored["size"])


def stored_figures(conn: Conn, now: str) -> dict:
    """The stored-data gauges in one read, each an index walk: runs by their indexed run_state,
    pending approvals from the approvals index, due wake-ups by (status, run_at). Runs by status
    still counts every run's index entry, hence the cache (Metrics.refresh_stored)."""
    runs = {state: count for state, count in conn.execute(
        "SELECT run_state, COUNT(*) FROM channels GROUP BY run_state").fetchall()}
    approvals = conn.execute(f"SELECT COUNT(*), MIN(requested_at) FROM approvals WHERE {APPROVAL_PENDING}",
                             (now,)).fetchone()
    wakeups = conn.execute("SELECT COUNT(*), MIN(run_at) FROM wakeups WHERE status = 'pending' AND run_at <= ?",
                           (now,)).fetchone()
    return {"runs": runs, "approvals": approvals[0], "oldest_approval": approvals[1], "wakeups": wakeups[0],
            "oldest_due": wakeups[1], "size": database_bytes(conn)}


# =============================================================================
# Observability: traces (every run as an OTLP trace, live and backfilled)
# =============================================================================
# --- traces: configuration ---------------------------------------------------------

@dataclass(frozen=True)
class OtlpConfig:
    """Where spans go: the OTLP/HTTP traces URL, and the service name the resource carries."""

    endpoint: str
    service_name: str = "actae"
    project: str = "actae"             # openinference.project.name: the project Arize Phoenix files runs under


def otlp_config(flag: Optional[str], environ: Optional[dict] = None, project: Optional[str] = None) -> Optional[OtlpConfig]:
    """--otlp-endpoint, else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (the traces URL as it is), else
    OTEL_EXPORTER_OTLP_ENDPOINT (a base: /v1/traces is added); None when none is set, or when
    OTEL_SDK_DISABLED=true. --otlp-endpoint is a base like the latter, unless it already ends in
    /v1/traces. BadRequest names a URL that is not http(s)://host[:port][/path]."""
    env = os.environ if environ is None else environ
    if (env.get("OTEL_SDK_DISABLED") or "").strip().lower() == "true":
        return None
    if flag:
        source, url, base = "--otlp-endpoint", flag, not flag.rstrip("/").endswith(OTLP_TRACES_PATH)
    elif env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        source, url, base = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"], False
    elif env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        source, url, base = "OTEL_EXPORTER_OTLP_ENDPOINT", env["OTEL_EXPORTER_OTLP_ENDPOINT"], True
    else:
        return None
    url = url.strip()
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise BadRequest(f"{source} takes an OTLP/HTTP URL such as http://127.0.0.1:4318 (got {url!r})")
    if base:
        url = url.rstrip("/") + OTLP_TRACES_PATH
    service = (env.get("OTEL_SERVICE_NAME") or "").strip() or "actae"
    return OtlpConfig(url, service, (project or "").strip() or service)


# --- traces: ids and spans, the same for live export and backfill -------------------


def otel_trace_id(channel_id: str) -> int:
    """A run's trace id: 128 bits of sha256 over its channel id (never 0, which means "no trace")."""
    return int.from_bytes(hashlib.sha256(b"actae.trace\x00" + channel_id.encode()).digest()[:16], "big") or 1


def otel_span_id(channel_id: str, cursor: int) -> int:
    """The span of the event at `cursor` (0: the run's root span): 64 bits of sha256."""
    digest = hashlib.sha256(b"actae.span\x00%s\x00%d" % (channel_id.encode(), cursor)).digest()
    return int.from_bytes(digest[:8], "big") or 1


def iso_ns(stamp: str) -> int:
    """A stored timestamp (RFC 3339, milliseconds) as Unix nanoseconds."""
    moment = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    return round(moment.timestamp() * 1000) * 1_000_000


def lifted_gen_ai(payload: Json, metadata: Json) -> dict:
    """gen_ai.* attributes found in a step's payload (top level, output, input, usage) or metadata:
    the places usage_of looks in, in its order; the token counts are usage_of's own (the one rule)."""
    places = usage_places(payload, metadata)
    found = {}
    for attribute, names, kind in GEN_AI_LIFTS:
        for place in places:
            value = next((place[n] for n in names if n in place), None)
            if isinstance(value, kind) and not isinstance(value, bool) and value != "":
                found[attribute] = value
                break
    usage = usage_of(payload, metadata) or {}
    found.update({f"gen_ai.usage.{figure}": usage[figure] for figure in ("input_tokens", "output_tokens")
                  if figure in usage})
    return found


@dataclass
class RunClock:
    """What a run's next span needs from the events before it: when the run began, when its last
    step ended, when each recent tool.started was. Live export keeps one per channel it has seen
    in cursor order (`cursor` is the last one); otherwise it is read back (`clock_before`)."""

    channel_id: str
    cursor: int = 0
    start_ns: Optional[int] = None
    last_step_ns: Optional[int] = None
    tool_starts: dict = field(default_factory=dict)     # tool.started event id -> ns


def clock_before(conn: Conn, channel_id: str, cursor: int) -> RunClock:
    """The RunClock as it stands just before the event at `cursor` (for live export)."""
    first = conn.execute("SELECT created_at FROM events WHERE channel_id = ? AND cursor = 1", (channel_id,)).fetchone()
    first = first[0] if first else None            # the trace begins with the run's first event, a fork's marker too
    step = conn.execute("SELECT created_at FROM events WHERE channel_id = ? AND cursor < ?"
                        " AND step_number IS NOT NULL ORDER BY cursor DESC LIMIT 1", (channel_id, cursor)).fetchone()
    return RunClock(channel_id, cursor - 1, iso_ns(first) if first else None, iso_ns(step[0]) if step else None)


class SpanMaker:
    """ReadableSpans built directly: the ids are the record's (otel_trace_id, otel_span_id) and the
    times are the events', which the SDK's Tracer (random ids, times of the call) cannot give."""

    def __init__(self, service_name: str = "actae", project: Optional[str] = None, measures: tuple = ()):
        self.resource = Resource.create({"service.name": service_name, "service.version": __version__,
                                         "openinference.project.name": project or service_name})
        self.measures = measures           # the regions' measured savings of a fork (Region.savings_measures)
        self.scope = InstrumentationScope("actae", __version__)
        self.sampled = TraceFlags(TraceFlags.SAMPLED)

    def context(self, channel_id: str, cursor: int) -> SpanContext:
        return SpanContext(otel_trace_id(channel_id), otel_span_id(channel_id, cursor), is_remote=False,
                           trace_flags=self.sampled)

    def span(self, name: str, channel_id: str, cursor: int, start: int, end: int, attributes: dict,
             status: Optional[Status] = None, links: tuple = ()) -> ReadableSpan:
        parent = None if cursor == 0 else self.context(channel_id, 0)
        return ReadableSpan(name, self.context(channel_id, cursor), parent, self.resource, attributes, (), links,
                            SpanKind.INTERNAL, None, status or Status(StatusCode.UNSET), start, max(start, end),
                            self.scope)

    def advance(self, clock: RunClock, event: Event) -> list:
        """The spans `event` closes (a step, a ledger outcome; most events close none), and the clock
        moved past it."""
        at = iso_ns(event.timestamp)
        if clock.start_ns is None:
            clock.start_ns = at
        clock.cursor = event.cursor
        record = {"actae.channel_id": event.channel_id, "actae.cursor": event.cursor,
                  "actae.event_type": event.type, "actae.actor": event.actor}
        payload = event.payload if isinstance(event.payload, dict) else {}
        if event.step_number is not None:
            start = clock.last_step_ns if clock.last_step_ns is not None else clock.start_ns
            clock.last_step_ns = at
            lifted = lifted_gen_ai(event.payload, event.metadata)
            attributes = {**record, "actae.step_number": event.step_number, **lifted,
                          "openinference.span.kind": "LLM" if model_call(lifted) else "CHAIN"}
            return [self.span(event.type, event.channel_id, event.cursor, start, at, attributes)]
        if event.type == "tool.started":
            clock.tool_starts[event.id] = at
            while len(clock.tool_starts) > TOOL_STARTS_MAX:
                clock.tool_starts.pop(next(iter(clock.tool_starts)))
            return []
        outcome = TOOL_SPAN_EVENTS.get(event.type)
        tool = payload.get("tool_name")
        if outcome is None or not isinstance(tool, str) or (payload.get("key_name"), tool) == SESSION_FENCE:
            return []
        start = clock.tool_starts.pop(event.depends_on, at) if outcome in ("executed", "failed") else at
        attributes = {**record, "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": tool,
                      "actae.ledger.outcome": outcome, "openinference.span.kind": "TOOL"}
        for attribute, key in (("gen_ai.tool.call.id", "execution_id"), ("actae.ledger.key", "key_name"),
                               ("actae.ledger.policy", "policy"), ("actae.ledger.reason", "reason")):
            if isinstance(payload.get(key), str):
                attributes[attribute] = payload[key]
        status = None
        if outcome == "failed":
            error = payload.get("error") if isinstance(payload.get("error"), dict) else {}
            attributes["error.type"] = str(error.get("error_type") or "_OTHER")
            status = Status(StatusCode.ERROR, str(error.get("message") or "the tool failed"))
        return [self.span(f"execute_tool {tool}", event.channel_id, event.cursor, start, at, attributes, status)]


def model_call(lifted: dict) -> bool:
    """Whether a step recorded a model call (a model named, or tokens counted): an LLM span, else a CHAIN."""
    return any(name in lifted for name in ("gen_ai.request.model", "gen_ai.response.model", "gen_ai.usage.input_tokens",
                                           "gen_ai.usage.output_tokens"))


def run_root_span(conn: Conn, channel_id: str, maker: SpanMaker, trigger: str = "backfill") -> Optional[ReadableSpan]:
    """The run's root span `invoke_agent {name}`, from the record.

    It begins at the run's first event and ends at its first `session.completed`, else at its
    `channel.closed`, else at its last event (a crash the SDK recorded in the metadata; or, for a
    backfill, a run still going or whose process died). Status ERROR, with the failure's message,
    when the run failed or crashed (the dashboard's run_failure). None when there is nothing to
    send: no such run, no event yet, or `trigger` "closed" on a run that had completed already.
    """
    row = channel_by_id(conn, channel_id)          # run_state is a column the write path keeps
    if row is None or not row["last_cursor"]:
        return None
    completed = events_after(conn, channel_id, 0, 1, event_type="session.completed")
    if completed and trigger == "closed":
        return None
    closed = [] if completed else events_after(conn, channel_id, 0, 1, event_type="channel.closed")
    last = completed or closed or events_after(conn, channel_id, row["last_cursor"] - 1, 1)
    first = events_after(conn, channel_id, 0, 1)
    meta = experiment_of(row)
    status = row["run_state"]
    if completed and status not in FAILURE_STATES:
        status = "completed"        # the SDK writes its "completed" just after the event; the event decides
    first_payload = load(first[0]["payload"])
    name = (meta.get("session_name") or (first_payload.get("session_name") if isinstance(first_payload, dict) else None)
            or row["display_name"] or channel_id)
    attributes = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": str(name),
                  "openinference.span.kind": "AGENT",
                  "gen_ai.conversation.id": channel_id, "actae.channel_id": channel_id,
                  "actae.run.status": status, "actae.origin_run_id": row["origin_id"],
                  "actae.step_count": last_step_number(conn, channel_id)}
    if first[0]["agent_id"]:
        attributes["gen_ai.agent.id"] = first[0]["agent_id"]
    params = meta.get("params") if isinstance(meta.get("params"), dict) else {}
    step = conn.execute("SELECT payload, metadata FROM events WHERE channel_id = ? AND step_number IS NOT NULL"
                        " ORDER BY cursor LIMIT 1", (channel_id,)).fetchone()
    lifted = lifted_gen_ai(params, None) or (lifted_gen_ai(load(step["payload"]), load(step["metadata"])) if step else {})
    attributes.update({k: v for k, v in lifted.items() if k in ("gen_ai.request.model", "gen_ai.provider.name")})
    links = ()
    if row["parent_id"]:
        attributes.update({"actae.parent_channel_id": row["parent_id"], "actae.fork.at_step": row["forked_at_step"] or 0,
                           "actae.fork.at_cursor": row["resolved_cursor"] or 0})
        if row["source_state_sha256"]:
            attributes["actae.receipt_sha256"] = row["source_state_sha256"]
        links = (fork_boundary_link(conn, row, maker),)
        saving = fork_saving(conn, channel_id, maker.measures)
        if saving.measured is not None:
            attributes.update({"actae.fork.measured.calls": saving.measured.calls,
                               "actae.fork.measured.input_tokens": saving.measured.input_tokens,
                               "actae.fork.measured.output_tokens": saving.measured.output_tokens})
            if saving.measured.cost is not None:
                attributes["actae.fork.measured.cost"] = saving.measured.cost
        attributes.update({"actae.fork.saved.steps": saving.saved.steps,
                           "actae.fork.saved.steps_without_usage": saving.saved.steps_without_usage,
                           "actae.fork.saved.input_tokens": saving.saved.input_tokens,
                           "actae.fork.saved.output_tokens": saving.saved.output_tokens,
                           "actae.fork.saved.wall_seconds": saving.saved.wall_seconds})
        if saving.saved.cost is not None:
            attributes["actae.fork.saved.cost"] = saving.saved.cost
    failure = run_failure(conn, row, row["run_state"]) if status in FAILURE_STATES else None
    span_status = None
    if failure is not None:
        attributes["error.type"] = failure.kind
        span_status = Status(StatusCode.ERROR, failure.message)
    return maker.span(f"invoke_agent {name}", channel_id, 0, iso_ns(first[0]["created_at"]),
                      iso_ns(last[0]["created_at"]), attributes, span_status, links)


def fork_boundary_link(conn: Conn, row: Row, maker: SpanMaker) -> Link:
    """A fork's link to the span of the step it forked after (on whichever ancestor recorded that
    step), or to the parent's root when it forked before any step."""
    parent, at_step = row["parent_id"], row["forked_at_step"]
    target = (parent, 0)
    if at_step:
        try:
            found = resolve_step(conn, parent, at_step)
            target = (found.channel_id, found.cursor)
        except NotFound:
            pass
    return Link(maker.context(*target), {"actae.link": "fork_boundary", "actae.channel_id": target[0],
                                         "actae.cursor": target[1], "actae.step_number": at_step or 0})


def run_spans(conn: Conn, channel_id: str, maker: SpanMaker) -> list:
    """Every span of a stored run, root first: what live export sent, or would have (backfill)."""
    root = run_root_span(conn, channel_id, maker)
    if root is None:
        return []
    clock, spans, after = RunClock(channel_id), [root], 0
    while True:
        rows = events_after(conn, channel_id, after, REPLAY_LIMIT_MAX)
        for row in rows:
            spans += maker.advance(clock, event_of(row))
        if len(rows) < REPLAY_LIMIT_MAX:
            return spans
        after = rows[-1]["cursor"]


def backfill_spans(conn: Conn, channel_id: str, with_forks: bool, maker: SpanMaker) -> tuple:
    """(spans, runs) of `actae otel-export`: the run, and with `with_forks` every fork below it."""
    require_channel(conn, channel_id)
    runs = [channel_id] + (descendants(conn, channel_id) if with_forks else [])
    return [span for run in runs for span in run_spans(conn, run, maker)], runs


# --- traces: the way out ------------------------------------------------------------


class FoldedLog(logging.Handler):
    """Takes the OpenTelemetry SDK's own log lines (one or two per failed batch, some with a traceback)
    instead of the server's log: the server's one warning a minute says how many there were and the
    last one."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.held, self.last = 0, ""

    def emit(self, record: logging.LogRecord) -> None:
        self.held += 1
        self.last = record.getMessage()[:300]

    def take(self) -> str:
        held, self.held = self.held, 0
        return f"; the exporter said {held} time(s): {self.last}" if held else ""


OTEL_LOG = FoldedLog()


class CountingExporter(SpanExporter):
    """The OTLP exporter, counting what the collector took and what it refused (those spans are
    dropped: the BatchSpanProcessor does not send a batch twice). A collector that fails
    CIRCUIT_FAILURES times in a row opens the circuit: for a while (doubling, bounded) nothing is
    sent and spans are dropped before they are built (TraceExport.committed), then one batch tries
    again. Failures are logged at most once a minute, with the count, the SDK's own lines folded in."""

    def __init__(self, inner: SpanExporter, metrics: Optional[Metrics], endpoint: str,
                 clock: Callable[[], float] = time.monotonic):
        self.inner, self.metrics, self.endpoint, self.clock = inner, metrics, endpoint, clock
        self.exported = self.failed = self.failures_in_row = 0
        self.open_until, self.open_for = -math.inf, CIRCUIT_OPEN_SECONDS[0]
        self._warned_at = -math.inf
        self._closed = False

    @property
    def open(self) -> bool:
        """Whether the circuit is open: the collector failed lately, so spans are dropped unsent."""
        return self.clock() < self.open_until

    def export(self, spans) -> SpanExportResult:
        if self.open:
            self.dropped(len(spans))
            return SpanExportResult.FAILURE
        try:
            result = self.inner.export(spans)
        except Exception:  # noqa: BLE001 - the exporter's own failure is a refused batch too
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
            self.failures_in_row, self.open_for = 0, CIRCUIT_OPEN_SECONDS[0]
            if self.metrics:
                self.metrics.spans_exported.inc(len(spans))
            return result
        self.failures_in_row += 1
        if self.failures_in_row >= CIRCUIT_FAILURES:
            self.open_until = self.clock() + self.open_for
            self.open_for = min(self.open_for * 2, CIRCUIT_OPEN_SECONDS[1])
        self.dropped(len(spans))
        return result

    def dropped(self, count: int) -> None:
        self.failed += count
        if self.metrics:
            self.metrics.spans_dropped.inc(count)
        if self.clock() - self._warned_at > 60:
            self._warned_at = self.clock()
            log.warning("OTLP export to %s failed; %d span(s) dropped so far%s", self.endpoint, self.failed,
                        OTEL_LOG.take())

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def otlp_exporter(config: OtlpConfig, metrics: Optional[Metrics] = None) -> CountingExporter:
    # The SDK logs every failed request and every full queue; CountingExporter and the
    # actae_spans_dropped_total counter say it once a minute instead (OTEL_LOG folds its lines in).
    otel = logging.getLogger("opentelemetry")
    if OTEL_LOG not in otel.handlers:
        otel.addHandler(OTEL_LOG)
        otel.propagate = False
    return CountingExporter(OTLPSpanExporter(endpoint=config.endpoint, timeout=EXPORT_TIMEOUT_SECONDS),
                            metrics, config.endpoint)


def otel_queue_length(processor: BatchSpanProcessor) -> int:
    """Spans the BatchSpanProcessor holds (0 where it does not say). It drops its oldest span silently
    when full and has no public count of it; this reads its private queue so that /metrics counts
    every drop. The only use of the OpenTelemetry SDK's internals: requirements.txt bounds it."""
    queue = getattr(getattr(processor, "_batch_processor", None), "_queue", None)
    return len(queue) if queue is not None else 0


def spans_of(events: list) -> int:
    """How many spans these events would make: steps, ledger outcomes, a run's end."""
    return sum(1 for e in events if e.step_number is not None or e.type in TOOL_SPAN_EVENTS
               or e.type == "session.completed")


class TraceExport:
    """Live export: committed events in, spans out, never in the writer's way.

    `committed` runs on the write path and only appends to a bounded deque (a full one drops its
    oldest batch, counted as dropped spans); `run` is the task that turns batches into spans,
    reading the database where the clock of a channel is not known (first sight of it, or another
    server wrote to it in between), and hands them to the BatchSpanProcessor."""

    def __init__(self, db: "Database", config: OtlpConfig, metrics: Metrics, measures: tuple = ()):
        self.db, self.config, self.metrics = db, config, metrics
        self.maker = SpanMaker(config.service_name, config.project, measures)
        self.exporter = otlp_exporter(config, metrics)
        self.processor = BatchSpanProcessor(self.exporter, max_queue_size=SPAN_QUEUE_MAX,
                                            max_export_batch_size=SPAN_BATCH_MAX, schedule_delay_millis=500)
        self.pending: collections.deque = collections.deque()
        self.clocks: collections.OrderedDict = collections.OrderedDict()
        self._wake = asyncio.Event()         # committed() may run before start(): the app's first write
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    def committed(self, events: list, ended: list) -> None:
        """A batch's events (in commit order) and the runs its metadata writes ended. While the
        collector's circuit is open they are counted as dropped here, before any span is built."""
        if self.exporter.open:
            self.metrics.spans_dropped.inc(spans_of(events))
            return
        if len(self.pending) >= PENDING_BATCHES_MAX:
            dropped, _ = self.pending.popleft()
            self.metrics.spans_dropped.inc(spans_of(dropped))
        self.pending.append((events, ended))
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.pending:
                events, ended = self.pending.popleft()
                for event in events:
                    await self._guarded(self._event, event)
                for channel_id in ended:
                    await self._guarded(self._root, channel_id, "metadata")

    async def _guarded(self, step: Callable, *args) -> None:
        try:
            await step(*args)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a span is lost, never a write
            self.metrics.spans_dropped.inc()
            log.warning("building spans failed", exc_info=True)

    async def _event(self, event: Event) -> None:
        channel_id = event.channel_id
        clock = self.clocks.pop(channel_id, None)
        if clock is None or clock.cursor != event.cursor - 1:
            known = clock.tool_starts if clock else {}
            clock = await self.db.read(clock_before, channel_id, event.cursor)
            clock.tool_starts.update(known)
        if (event.type in ("tool.completed", "tool.failed") and event.depends_on
                and event.depends_on not in clock.tool_starts):
            started = await self.db.read(lambda conn: row_where(conn, "events", id=event.depends_on))
            if started is not None:
                clock.tool_starts[event.depends_on] = iso_ns(started["created_at"])
        self.clocks[channel_id] = clock
        while len(self.clocks) > RUN_CLOCKS_MAX:
            self.clocks.popitem(last=False)
        for span in self.maker.advance(clock, event):
            self.emit(span)
        if event.type in ("session.completed", "channel.closed"):
            await self._root(channel_id, "completed" if event.type == "session.completed" else "closed")

    async def _root(self, channel_id: str, trigger: str) -> None:
        span = await self.db.read(run_root_span, channel_id, self.maker, trigger)
        if span is not None:
            self.emit(span)

    def emit(self, span: ReadableSpan) -> None:
        if otel_queue_length(self.processor) >= SPAN_QUEUE_MAX:
            self.metrics.spans_dropped.inc()      # the processor drops its oldest span to take this one
        self.processor.on_end(span)

    async def stop(self) -> None:
        """Stop building spans (what was not built yet is left), then close the way out."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Give the collector up to EXPORT_SHUTDOWN_SECONDS for what is queued, then stop."""
        flusher = threading.Thread(target=self.processor.force_flush, daemon=True)
        flusher.start()
        flusher.join(EXPORT_SHUTDOWN_SECONDS)
        self.exporter.shutdown()            # ends a retry still waiting on a dead collector
        self.processor.shutdown()


def fork_savings(conn: Conn, channel_ids: list) -> list:
    """What each of these forks inherited (the ones still there)."""
    found = []
    for channel_id in channel_ids:
        try:
            saving = fork_saving(conn, channel_id)
        except ActaeError:
            continue                                   # deleted meanwhile
        if saving is not None:
            found.append(saving)
    return found


def observer(metrics: Metrics, traces: Optional[TraceExport]) -> Callable:
    """Database.on_batch: count the batch, and hand its events to the live export."""
    def on_batch(jobs: list, outcomes: list, seconds: float) -> None:
        ended = metrics.observe_batch(jobs, outcomes, seconds)
        if traces is not None:
            events = [event for _, events in outcomes if events for event in events]
            if events or ended:
                traces.committed(events, ended)
    return on_batch


# =============================================================================
# Observability: handlers, routes and commands
# =============================================================================

async def metrics_text(request: Request) -> Response:
    """Prometheus metrics (the list: see "Observability: metrics")."""
    metrics = request.app.services.region(Metrics)
    await metrics.refresh_stored(db_of(request))
    await metrics.count_savings(db_of(request))
    return Response(metrics.text(), media_type=prometheus_client.CONTENT_TYPE_LATEST)


async def metrics_json(request: Request) -> MetricsJson:
    """The server's metrics as JSON: uptime, WebSocket traffic and database write batches."""
    services = request.app.services
    hub, db = services.hub, services.db
    return MetricsJson(
        status="ok", timestamp=iso(utc_now()), uptime_seconds=int(time.monotonic() - services.started),
        websocket=WebSocketFigures(connections=len(hub.connections), topics=len(hub.topics),
                                   messages_sent=hub.messages_sent, messages_received=hub.messages_received,
                                   total_messages=hub.messages_sent + hub.messages_received,
                                   back_pressure=BackPressure(queue_limit=WS_QUEUE_MAX, dropped_connections=hub.dropped)),
        database=DatabaseFigures(write_batches=db.batches, write_jobs=db.batched_jobs))


def otel_export_command(args: argparse.Namespace, location: Location) -> int:
    """`actae otel-export CHANNEL [--with-forks] [--otlp-endpoint URL]`: send a stored run's spans."""
    config = otlp_option_of(args)["otlp"]
    if config is None:
        raise SystemExit("actae: otel-export needs a collector: --otlp-endpoint URL, or OTEL_EXPORTER_OTLP_ENDPOINT"
                         " (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)")
    spans, runs = read_once(location, backfill_spans, valid_channel(args.channel_id, "CHANNEL"),
                            args.with_forks, SpanMaker(config.service_name, config.project,
                                                       hooks_of().savings_measures))
    exporter = otlp_exporter(config)
    try:
        for start in range(0, len(spans), SPAN_BATCH_MAX):
            if exporter.export(spans[start:start + SPAN_BATCH_MAX]) is not SpanExportResult.SUCCESS:
                print(f"actae: the collector at {config.endpoint} did not take the spans"
                      f" ({exporter.exported} of {len(spans)} sent)", file=sys.stderr)
                return 1
    finally:
        exporter.shutdown()
    print(f"Exported {len(spans)} span(s) of {len(runs)} run(s) to {config.endpoint}")
    return 0

def add_otlp_flag(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: `actae --otlp-endpoint URL otel-export CHANNEL` keeps the URL.
    parser.add_argument("--otlp-endpoint", default=argparse.SUPPRESS, metavar="URL",
                        help="send every run as an OpenTelemetry trace to this OTLP/HTTP collector, e.g."
                             " http://127.0.0.1:4318 (/v1/traces is added); default:"
                             " $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else $OTEL_EXPORTER_OTLP_ENDPOINT, else none")
    parser.add_argument("--otel-project", default=argparse.SUPPRESS, metavar="NAME",
                        help="the project the traces are filed under (openinference.project.name, as Arize Phoenix"
                             " reads it); default: $OTEL_SERVICE_NAME, else actae")


def add_observability_commands(commands: Subcommands, common: argparse.ArgumentParser, scoped: argparse.ArgumentParser) -> None:
    otlp_flag = argparse.ArgumentParser(add_help=False)
    add_otlp_flag(otlp_flag)
    otel = add_command(commands, "otel-export", otel_export_command, [common, otlp_flag],
                       "send a stored run to an OTLP collector as the trace live export sends")
    otel.add_argument("channel_id", metavar="CHANNEL")
    otel.add_argument("--with-forks", action="store_true", help="also every fork below it, forks of forks too")


def otlp_option_of(args: argparse.Namespace) -> dict:
    return {"otlp": otlp_config(getattr(args, "otlp_endpoint", None), project=getattr(args, "otel_project", None))}


def traces_banner(options: dict) -> Optional[str]:
    otlp = options.get("otlp")
    return f"Traces:      every run to {otlp.endpoint} (OTLP/HTTP, service.name {otlp.service_name})" if otlp else None


def install_observability(services: Services, options: dict) -> Installed:
    """The app's Prometheus registry, and (with `otlp=`) the live trace export behind the writer."""
    metrics, otlp = Metrics(), options.get("otlp")
    traces = TraceExport(services.db, typing.cast(OtlpConfig, otlp), metrics,
                         services.hooks.savings_measures) if otlp else None
    metrics.registry.register(LiveFigures(services, metrics))
    if traces is None:
        return Installed(services=(metrics,), on_batch=observer(metrics, None))
    return Installed(services=(metrics, traces), starts=(traces.start,), stops=(traces.stop,),
                     on_batch=observer(metrics, traces))


def observe_request(services: Services, route: str, method: str, status: int, seconds: float) -> None:
    services.region(Metrics).observe_request(route, method, status, seconds)


OBSERVABILITY_ROUTES = [
    Api("GET", "/metrics", metrics_text, answers="text/plain"),
    Api("GET", "/metrics.json", metrics_json),
]
OBSERVABILITY = declare(Region(
    "observability", routes=tuple(OBSERVABILITY_ROUTES), json_paths=("/metrics", "/metrics.json"),
    installers=(install_observability,), request_observers=(observe_request,), commands=(add_observability_commands,),
    serve_flags=(add_otlp_flag,), options=(otlp_option_of,), banner_lines=(traces_banner,)))


# =============================================================================
# Fleet: records and schema
# =============================================================================
# Region: the fleet gateway, the SDK's FleetClient against this server and its registered remotes.

class InstanceFailed(ActaeError, status=502, code="instance_unavailable"):
    """An instance of the fleet gave the gateway no answer: down, too slow, or refusing the gateway's key.
    502 (504 when it was too slow); in a multi-instance answer, an entry of `errors` instead."""

    def __init__(self, instance_id: str, code: str, message: str, *, status: int = 502, retryable: bool = True):
        super().__init__(f"instance {instance_id}: {message}", code=code, status=status)
        self.instance_id, self.retryable = instance_id, retryable


# --- the fleet gateway (/v1/organizations/{organization_id}/..., /api/v1/fleet/...) ----------------

SdkScope = Annotated[str, Meta(max_length=64, description='a scope of the SDK\'s manifest ("events:read", '
                                                            '"forks:create", ...); "" asks for all the token grants')]
PageToken = Annotated[str, Meta(max_length=4096, description="opaque: pass it back unchanged")]


class FleetTokenRequest(Record):
    """The SDK's exchange of an organisation token (the Bearer credential) for a fleet token."""

    purpose: Optional[Literal["fleet_access"]] = None
    organization_id: Optional[Annotated[str, Meta(max_length=256)]] = None   # another one: 403
    scopes: Optional[Annotated[list[SdkScope], Meta(max_length=100)]] = None  # none or blank: all it grants


class OperationEnvelope(Record):
    """POST .../ops/{operation_id}: a manifest operation's path parameters, query and body, kept apart."""

    path_params: Optional[dict[Annotated[str, Meta(max_length=64)], Union[Label, Int64]]] = None
    query: Optional[JsonObject] = None
    body: Document = None
    params: Optional[JsonObject] = None   # the legacy combined form: path parameters, the rest the query


class FleetEventFilter(EventQuery):
    """The direct query's filters; `pagination: "keyset"` asks for per-instance continuation tokens."""

    pagination: Optional[Literal["keyset", "offset"]] = None


class FleetQuery(Record):
    instances: Annotated[list[Id], Meta(min_length=1, max_length=100)]
    query: FleetEventFilter = msgspec.field(default_factory=FleetEventFilter)
    page_tokens: Optional[dict[Id, PageToken]] = None   # instance id -> the token its last page gave


class StreamTicketRequest(Record):
    instance_id: Id
    channel_id: Optional[ChannelId] = None      # else the stream's own channel_id parameter
    resume_cursor: Optional[Count] = None       # events after this cursor (else only new ones)


class FleetStreamQuery(Record):
    """The gateway's streams: the WebSocket's ticket, the channel and where to resume."""

    ticket: Optional[Token] = None
    channel_id: Optional[ChannelId] = None
    resume_cursor: Optional[Count] = None
    cursor: Optional[Count] = None              # the NDJSON stream's name for resume_cursor
    instance_id: Optional[Id] = None            # the NDJSON stream's, else X-Actae-Instance-Id


# --- the fleet gateway ------------------------------------------------------------------------------


class FleetInstance(Answer):
    """One instance of the organisation: the gateway's own server, or a registered remote one."""

    instance_id: str
    name: str
    local: bool
    url: Optional[str]                 # a remote's base URL; null for the gateway's own server
    dashboard_url: str
    added_at: Optional[str]


class FleetInstances(Answer):
    organization_id: str
    gateway_protocol_version: str
    instances: list[FleetInstance]


class FleetCapabilities(Answer):
    """What an instance runs and which manifest operations the gateway dispatches to it."""

    organization_id: str
    instance_id: str
    local: bool
    gateway_protocol_version: str
    api_version: str
    version: str
    engine_version: str
    backend: str
    features: list[str]
    supported_fleet_operations: list[str]


class FleetToken(Answer):
    """A short-lived fleet token: the SDK sends it as `authorization: Bearer` to the gateway's routes."""

    token: str
    token_type: str
    expires_in: int
    organization_id: str
    scopes: list[str]


class StreamTicket(Answer):
    """A one-use ticket for the gateway's event stream (GET .../events/stream?ticket=...)."""

    ticket: str
    expires_in: int
    instance_id: str
    channel_id: Optional[str]
    resume_cursor: Optional[int]


class FleetEvent(Event):
    instance_id: str


class InstanceFailure(Answer):
    """An instance a multi-instance read could not include, and why."""

    instance_id: str
    code: str
    message: str
    retryable: bool


class FleetPage(Answer):
    next_page_tokens: dict[str, str]


class FleetEvents(Answer):
    """Events of one or more instances, newest first, beside an entry for each instance that failed."""

    events: list[FleetEvent]
    errors: list[InstanceFailure]
    page: FleetPage
    next_page_token: Optional[str]


# POST .../ops/{operation_id} answers what the operation's own direct route answers (documented there).
OperationAnswer = dict[str, Json]


class RemoteInstanceInfo(Answer):
    """A registered remote instance as `instance list` shows it: never its key."""

    instance_id: str
    name: str
    url: str
    key_prefix: str
    timeout_seconds: Optional[float]
    added_at: str


class OrgTokenInfo(Answer):
    """An organisation token as `org-token list` shows it: never the token itself."""

    id: int
    name: str
    prefix: str
    scopes: Permissions
    created_at: str
    expires_at: Optional[str]
    revoked_at: Optional[str]


class FleetErrorBody(Struct):
    """The gateway's error answers: the usual two fields, and `message` (what the SDK's FleetClient reads)."""

    status: str
    error: str
    message: str


# --- the fleet gateway's instances and organisation tokens ---------------------------------------


def fleet_instance_by_id(conn: Conn, instance_id: str) -> Optional[Row]:
    return conn.execute("SELECT * FROM fleet_instances WHERE id = ?", (instance_id,)).fetchone()


def fleet_instance_rows(conn: Conn) -> list:
    return conn.execute("SELECT * FROM fleet_instances ORDER BY added_at, id").fetchall()


def org_token_by_id(conn: Conn, token_id: int) -> Optional[Row]:
    return conn.execute("SELECT * FROM org_tokens WHERE id = ?", (token_id,)).fetchone()


def active_org_token_rows(conn: Conn) -> list:
    """Every organisation token not revoked (expired ones too: `org-token list` shows their expiry)."""
    return conn.execute("SELECT * FROM org_tokens WHERE revoked_at IS NULL ORDER BY id").fetchall()


def fleet_schema(w: SchemaWords) -> str:
    return f"""
    -- The fleet gateway. The remote instances this server's organisation reaches: each remote's
    -- API key is encrypted (Fernet) with the key in the file fleet_key beside the database, never
    -- in it, so a copy of the database does not reveal it.
    CREATE TABLE fleet_instances (
        id               TEXT PRIMARY KEY,         -- the remote server's own instance id
        name             TEXT NOT NULL,
        url              TEXT NOT NULL,            -- its base URL
        key_ciphertext   TEXT NOT NULL,            -- Fernet token of its API key
        key_prefix       TEXT NOT NULL,            -- first characters, to tell keys apart
        timeout_seconds  {w.real},                     -- NULL: the server's --fleet-timeout
        added_at         TEXT NOT NULL
    );
    -- Organisation tokens (the SDK's FleetClient exchanges one for a fleet token), by hash only.
    CREATE TABLE org_tokens (
        id          {w.serial},
        name        TEXT NOT NULL,
        token_hash  TEXT NOT NULL UNIQUE,          -- sha256 of the token
        prefix      TEXT NOT NULL,
        scopes      TEXT NOT NULL,                 -- {{"read": [...], "write": [...], "delete": [...], "admin": [...]}}
        created_at  TEXT NOT NULL,
        expires_at  TEXT,                          -- NULL: never expires
        revoked_at  TEXT
    );
    -- One-use, short-lived tickets for the gateway's event stream, by hash.
    CREATE TABLE fleet_tickets (
        ticket_hash    TEXT PRIMARY KEY,
        org_token_id   {w.integer} NOT NULL,
        scopes         TEXT NOT NULL,              -- the SDK scopes of the fleet token that minted it
        instance_id    TEXT NOT NULL,
        channel_id     TEXT,
        resume_cursor  {w.integer},
        created_at     TEXT NOT NULL,
        expires_at     TEXT NOT NULL,
        used_at        TEXT
    );
    """


# =============================================================================
# Fleet: remote instances, organisation tokens, fleet tokens, stream tickets
# =============================================================================
# Every server is also the gateway of one organisation (--organization, default "local"). Its
# instances are the server itself, under its own instance id, and the remote Actae servers
# registered with `actae instance add`. A remote's API key is stored encrypted (Fernet) with a key
# kept in KEYS_CIPHER_FILE beside the database, never inside it. Organisation tokens are stored as
# hashes, like API keys; the SDK's FleetClient exchanges one for a short-lived fleet token, signed
# (like login tokens, under a key of its own) and carrying the SDK's scope names, and a stream
# ticket is a one-use row that expires. The organisation's instances and tokens are held in memory
# and read again when more than FLEET_REFRESH_SECONDS old, as the key ring is.

FLEET_PROTOCOL_VERSION = "1"           # the gateway protocol this server speaks (capabilities report it)
FLEET_REFRESH_SECONDS = KEY_REFRESH_SECONDS
ORG_TOKEN_PREFIX = "ot-"
FLEET_TICKET_PREFIX = "tk-"
ORGANIZATION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
FLEET_PATHS = ("/v1/organizations/", "/api/v1/fleet/")   # the gateway's own routes

# The SDK's scope names (its manifest) onto this server's actions. A fleet token holds SDK scopes;
# each is granted when the organisation token has patterns for its action. An operation then needs
# its scope in the fleet token and, as its direct route does, the action on its channels from the
# organisation token's patterns. "manage" scopes are granted with write and carry the token's read,
# write and delete patterns (listing, creating, cancelling: the direct routes need each).
FLEET_SCOPES = {
    "events:read": "read", "state:read": "read", "channels:read": "read", "payloads:read": "read",
    "events:write": "write", "state:write": "write", "channels:write": "write",
    "forks:create": "write", "forks:promote": "write",
    "state:delete": "delete", "channels:delete": "delete",
    "groups:manage": "write", "execution_groups:manage": "write", "experiments:manage": "write",
    "scheduler:manage": "write", "executions:manage": "write",
}


def is_fleet_path(path: str) -> bool:
    return path.startswith(FLEET_PATHS)


def org_grant(stored: Json) -> dict:
    """An organisation token's channel patterns for read, write and delete (admin: all three on '*')."""
    scopes = scopes_of(stored)
    if "*" in scopes["admin"]:
        return {action: ["*"] for action in ACTIONS[:3]}
    return {action: list(dict.fromkeys(scopes[action] + scopes["admin"])) for action in ACTIONS[:3]}


def granted_scopes(grant: dict, requested: Optional[list]) -> list:
    """The SDK scopes a fleet token gets: those requested that the grant allows; none or only blank
    names (what the SDK sends with ACTAE_FLEET_SCOPES unset: [""]) mean all that it allows."""
    allowed = [name for name, action in FLEET_SCOPES.items() if grant[action]]
    wanted = {name.strip() for name in requested or () if name.strip()}
    return allowed if not wanted else [name for name in allowed if name in wanted]


def fleet_patterns(grant: dict, fleet_scopes: Json) -> dict:
    """The channel patterns a fleet token acts with: the grant's, for the actions its scopes name."""
    actions = set()
    for name in fleet_scopes:
        actions.update(ACTIONS[:3] if name.endswith(":manage") else [FLEET_SCOPES.get(name)])
    return {**{action: grant[action] if action in actions else [] for action in ACTIONS[:3]}, "admin": []}


@dataclass(frozen=True)
class FleetPrincipal(Principal):
    """A fleet token's caller: the organisation token behind it, with the SDK scopes it was granted."""

    organization_id: str = ""
    org_token_id: int = 0
    fleet_scopes: tuple = ()
    name: str = ""
    created_at: str = ""

    @property
    def actor(self) -> str:
        return f"org-token:{self.org_token_id}"

    @property
    def owner(self) -> str:
        return f"org-token:{self.org_token_id}"

    def user(self) -> UserInfo:
        """Who GET /auth/me names through the gateway: the organisation token (it is no account)."""
        return UserInfo(id=self.owner, email=None, name=self.name, created_at=self.created_at)

    def require_scope(self, scope: str) -> None:
        if scope not in self.fleet_scopes:
            raise Forbidden(f"this fleet token lacks the {scope} scope (it has {', '.join(self.fleet_scopes) or 'none'})")


def fleet_principal(row: Row, organization_id: str, fleet_scopes: Json) -> FleetPrincipal:
    scopes = tuple(fleet_scopes)
    return FleetPrincipal(f"fleet:{row['id']}", fleet_patterns(org_grant(row["scopes"]), scopes), "fleet",
                          "fleet_token", expires_at=row["expires_at"], organization_id=organization_id,
                          org_token_id=row["id"], fleet_scopes=scopes, name=row["name"], created_at=row["created_at"])


# --- remote instances: their keys encrypted beside the database ------------------------------------


@dataclass(frozen=True)
class RemoteInstance:
    """A registered remote instance, its key decrypted (None when this data dir's fleet_key cannot)."""

    id: str
    name: str
    url: str
    key: Optional[str]
    key_prefix: str
    timeout: Optional[float]
    added_at: str


def remote_of(row: Row, cipher: "cryptography.fernet.Fernet") -> RemoteInstance:
    try:
        key = cipher.decrypt(row["key_ciphertext"].encode("ascii")).decode("utf-8")
    except Exception:  # noqa: BLE001 - a fleet_key that is not the one it was encrypted with
        key = None
    return RemoteInstance(row["id"], row["name"], row["url"], key, row["key_prefix"], row["timeout_seconds"],
                          row["added_at"])


def remote_info(row: Row) -> RemoteInstanceInfo:
    return RemoteInstanceInfo(instance_id=row["id"], name=row["name"], url=row["url"], key_prefix=row["key_prefix"],
                              timeout_seconds=row["timeout_seconds"], added_at=row["added_at"])


def add_instance(tx: Tx, instance_id: str, name: str, url: str, ciphertext: str, prefix: str,
                 timeout: Optional[float]) -> RemoteInstanceInfo:
    """`instance add`: register a remote instance (again: its URL, key, name and timeout are replaced)."""
    tx.conn.execute(
        "INSERT INTO fleet_instances (id, name, url, key_ciphertext, key_prefix, timeout_seconds, added_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET name = excluded.name, url = excluded.url,"
        " key_ciphertext = excluded.key_ciphertext, key_prefix = excluded.key_prefix,"
        " timeout_seconds = excluded.timeout_seconds", (instance_id, name, url, ciphertext, prefix, timeout, tx.ts))
    return remote_info(fleet_instance_by_id(tx.conn, instance_id))


def remove_instance(tx: Tx, instance_id: str) -> RemoteInstanceInfo:
    row = present(fleet_instance_by_id(tx.conn, instance_id), lambda: NotFound(f"no instance {instance_id}"))
    tx.conn.execute("DELETE FROM fleet_instances WHERE id = ?", (instance_id,))
    return remote_info(row)


def list_instances(conn: Conn) -> list[RemoteInstanceInfo]:
    return [remote_info(row) for row in fleet_instance_rows(conn)]


# --- organisation tokens --------------------------------------------------------------------------


def org_token_info(row: Row) -> OrgTokenInfo:
    return OrgTokenInfo(id=row["id"], name=row["name"], prefix=row["prefix"],
                        scopes=permissions_of(scopes_of(row["scopes"])), created_at=row["created_at"],
                        expires_at=row["expires_at"], revoked_at=row["revoked_at"])


def create_org_token(tx: Tx, name: str, scopes: dict, expires_in_days: Optional[float]) -> tuple:
    """`org-token create`: store only the token's hash; returns (its listing, the token)."""
    token = ORG_TOKEN_PREFIX + secrets.token_urlsafe(32)
    expires_at = iso(tx.now + timedelta(days=expires_in_days)) if expires_in_days else None
    token_id = tx.conn.execute(
        "INSERT INTO org_tokens (name, token_hash, prefix, scopes, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?)"
        " RETURNING id", (name, key_hash(token), token[:7], dump(scopes_of(scopes)), tx.ts, expires_at)).fetchone()[0]
    return org_token_info(org_token_by_id(tx.conn, token_id)), token


def revoke_org_token(tx: Tx, token_id: int) -> OrgTokenInfo:
    """End an organisation token now (and the fleet tokens and tickets made from it); twice is fine."""
    present(org_token_by_id(tx.conn, token_id), lambda: NotFound(f"organisation token {token_id} not found"))
    tx.conn.execute("UPDATE org_tokens SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (tx.ts, token_id))
    return org_token_info(org_token_by_id(tx.conn, token_id))


def list_org_tokens(conn: Conn) -> list[OrgTokenInfo]:
    return [org_token_info(row) for row in active_org_token_rows(conn)]


def fleet_directory_rows(conn: Conn) -> tuple:
    return fleet_instance_rows(conn), active_org_token_rows(conn)


# --- fleet tokens (signed, short-lived) and stream tickets (stored, one use) --------------------------

FLEET_TOKEN_HEADER = b64url(b'{"alg":"HS256","typ":"actae-fleet"}')


def fleet_signing_key(secret: bytes) -> bytes:
    """Fleet tokens are signed with a key derived from the token secret: never valid as login tokens."""
    return hmac.new(secret, b"actae fleet tokens", hashlib.sha256).digest()


def sign_fleet_token(secret: bytes, claims: dict) -> str:
    body = b64url(json.dumps(claims, separators=(",", ":"), sort_keys=True).encode("utf-8"))
    signature = hmac.new(fleet_signing_key(secret), f"{FLEET_TOKEN_HEADER}.{body}".encode("ascii"),
                         hashlib.sha256).digest()
    return f"{FLEET_TOKEN_HEADER}.{body}.{b64url(signature)}"


def fleet_token_claims(secret: bytes, token: str, now: float) -> Optional[dict]:
    """The claims of a fleet token we signed that has not expired, else None."""
    try:
        header, body, signature = token.split(".")
        if header != FLEET_TOKEN_HEADER:
            return None
        expected = hmac.new(fleet_signing_key(secret), f"{header}.{body}".encode("ascii"), hashlib.sha256).digest()
        if not same_secret(signature, b64url(expected)):
            return None
        claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except (ValueError, UnicodeError, TypeError):
        return None
    if not isinstance(claims, dict) or not is_number(claims.get("exp")) or claims["exp"] <= now:
        return None
    if not (is_int(claims.get("otk")) and isinstance(claims.get("org"), str) and isinstance(claims.get("scp"), list)):
        return None
    return claims


def looks_like_fleet_token(credential: str) -> bool:
    return credential.startswith(FLEET_TOKEN_HEADER + ".")


def mint_ticket(tx: Tx, ticket_hash: str, org_token_id: int, scopes: list, instance_id: str,
                channel_id: Optional[str], resume_cursor: Optional[int], ttl: float) -> str:
    """Store a stream ticket's hash with what it opens; returns when it expires."""
    tx.conn.execute("DELETE FROM fleet_tickets WHERE expires_at <= ? OR used_at IS NOT NULL", (tx.ts,))
    expires_at = iso(tx.now + timedelta(seconds=ttl))
    tx.conn.execute(
        "INSERT INTO fleet_tickets (ticket_hash, org_token_id, scopes, instance_id, channel_id, resume_cursor,"
        " created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (ticket_hash, org_token_id, dump(scopes), instance_id, channel_id, resume_cursor, tx.ts, expires_at))
    return expires_at


def use_ticket(tx: Tx, ticket_hash: str) -> Optional[dict]:
    """The ticket's row, now marked used; None when it is unknown, used or expired (one use only)."""
    row = tx.conn.execute("UPDATE fleet_tickets SET used_at = ? WHERE ticket_hash = ? AND used_at IS NULL"
                          " AND expires_at > ? RETURNING *", (tx.ts, ticket_hash, tx.ts)).fetchone()
    return dict(row) if row is not None else None


# --- the organisation in memory ---------------------------------------------------------------------


class FleetDirectory:
    """The remote instances (keys decrypted) and live organisation tokens, in memory.

    `instance add|remove` and `org-token create|revoke` may run in another process: the directory is
    read again when more than FLEET_REFRESH_SECONDS old (an unknown token: when more than
    KEY_MISS_RELOAD_SECONDS old), each read shared by every request waiting on it, as KeyRing does.
    """

    def __init__(self, db: Database, data_dir: Path):
        self.db, self.data_dir = db, Path(data_dir)
        self.cipher: Optional["cryptography.fernet.Fernet"] = None
        self.instances: dict = {}          # id -> RemoteInstance
        self.tokens_by_hash: dict = {}     # token hash -> row (dict)
        self.tokens_by_id: dict = {}
        self.loaded_at = -math.inf
        self.loading: Optional[asyncio.Future] = None

    async def reload(self) -> None:
        instances, tokens = await self.db.read(fleet_directory_rows)
        if instances and self.cipher is None:
            self.cipher = await asyncio.to_thread(keys_cipher, self.data_dir)
        self.instances = {row["id"]: remote_of(row, self.cipher) for row in instances}
        rows = [dict(row) for row in tokens]
        self.tokens_by_hash = {row["token_hash"]: row for row in rows}
        self.tokens_by_id = {row["id"]: row for row in rows}
        self.loaded_at = time.monotonic()

    async def fresh(self, max_age: float = FLEET_REFRESH_SECONDS) -> "FleetDirectory":
        if time.monotonic() - self.loaded_at > max_age:
            if self.loading is None or self.loading.done():
                self.loading = asyncio.ensure_future(self.reload())
            await asyncio.shield(self.loading)
        return self


def live_org_token(row: Optional[dict]) -> Optional[dict]:
    if row is None or (row["expires_at"] is not None and row["expires_at"] <= iso(utc_now())):
        return None
    return row


async def check_org_token(app: "ActaeApp", token: str) -> dict:
    """The organisation token's row; Unauthorized when it is unknown, expired or revoked."""
    directory = await app.services.region(FleetState).directory.fresh()
    hashed = key_hash(token)
    row = directory.tokens_by_hash.get(hashed)
    if row is None:
        row = (await directory.fresh(KEY_MISS_RELOAD_SECONDS)).tokens_by_hash.get(hashed)
    if live_org_token(row) is None:
        raise Unauthorized("invalid, expired or revoked organisation token")
    return row


async def org_token_principal(app: "ActaeApp", token_id: int, organization_id: str, fleet_scopes: Json,
                              max_age: float = FLEET_REFRESH_SECONDS) -> FleetPrincipal:
    """The principal of a fleet token (or ticket) made from organisation token `token_id`, while that
    lives (as the directory read at most `max_age` seconds ago says)."""
    row = live_org_token((await app.services.region(FleetState).directory.fresh(max_age)).tokens_by_id.get(token_id))
    if row is None:
        raise Unauthorized("the organisation token behind this fleet token was revoked or expired")
    if organization_id != fleet_settings(app).organization:
        raise Forbidden(f"this token is for organisation {organization_id!r}; this gateway serves "
                        f"{fleet_settings(app).organization!r}")
    return fleet_principal(row, organization_id, fleet_scopes)


async def check_fleet_token(app: "ActaeApp", token: str, max_age: float = FLEET_REFRESH_SECONDS) -> FleetPrincipal:
    claims = fleet_token_claims(app.services.token_secret, token, time.time())
    if claims is None:
        raise Unauthorized("invalid or expired fleet token: exchange the organisation token again"
                           " (POST /api/v1/fleet/token)")
    return await org_token_principal(app, claims["otk"], claims["org"], claims["scp"], max_age)


async def fleet_authenticate(request: Request, route: Api) -> FleetPrincipal:
    """The gateway's credentials: a fleet token (auth "fleet"), or for the exchange an organisation token."""
    token = bearer_token(request)
    if token is None:
        kind = "organisation token" if route.auth == "org" else "fleet token (POST /api/v1/fleet/token)"
        raise Unauthorized(f"send the {kind} as `authorization: Bearer <token>`")
    app = request.app
    if route.auth == "org":
        row = context_of(request).org_token = await check_org_token(app, token)
        return fleet_principal(row, fleet_settings(app).organization, granted_scopes(org_grant(row["scopes"]), None))
    return await check_fleet_token(app, token)


@dataclass(frozen=True)
class FleetSettings:
    """The gateway's organisation and bounds (the `serve` flags of the same names; create_app's `fleet=`)."""

    organization: str = "local"        # --organization: the id in /v1/organizations/{id}/...
    fleet_token_ttl: float = 300.0     # seconds a fleet token (POST /api/v1/fleet/token) lives
    fleet_ticket_ttl: float = 30.0     # seconds a stream ticket waits for its one use
    fleet_timeout: float = 10.0        # seconds a remote instance has to answer one gateway request


class FleetState:
    """The gateway's per-server state: its settings, the directory, remote login tokens, the HTTP threads."""

    def __init__(self, db: Database, data_dir: Path, settings: FleetSettings):
        self.settings = settings
        self.directory = FleetDirectory(db, data_dir)
        self.remote_tokens: dict = {}      # instance id -> (login token, monotonic expiry) for Bearer-only routes
        # Remote instances are called with urllib (no HTTP client dependency) on these threads, each
        # call bounded by its instance's timeout.
        self.http = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="actae-fleet")


def fleet_settings(app: ActaeApp) -> FleetSettings:
    return app.services.region(FleetState).settings


# =============================================================================
# Fleet: the gateway's manifest, dispatch to an instance, multi-instance queries, the handlers
# =============================================================================
# A gateway request names an instance: the local one is served in process, through the same
# route (serve_route: its records, its scopes, its handler) an HTTP request takes; a remote one
# over HTTP with its stored key, the caller's Idempotency-Key passed on (and, where the route's
# body has an operation_id and the caller sent none, used as it, so a retried write lands once).
# Either way the answer is the direct route's own answer record. A multi-instance read never
# hides a failure: each instance that is down, too slow or refuses is an entry in `errors`.

# The SDK's manifest (actae_client/manifest.py, 1.3.0), the operations the gateway dispatches:
# "id method path scope", and " -" after the ones that are not fleet commands (refused, 426).
FLEET_MANIFEST_TEXT = """
auth.capabilities.get GET /api/v1/auth/capabilities events:read
auth.signup POST /api/v1/auth/signup public -
auth.login POST /api/v1/auth/login public -
auth.api_key_login POST /api/v1/auth/api-key-login public -
auth.config.get GET /api/v1/auth/config public -
auth.me.get GET /api/v1/auth/me events:read
auth.logout POST /api/v1/auth/logout public -
user.preferences.get GET /api/v1/user/preferences events:read
user.preferences.put PUT /api/v1/user/preferences events:write
instance.get GET /api/v1/instance events:read
events.record POST /api/v1/events/record events:write
events.transition POST /api/v1/events/transition events:write
events.replay GET /api/v1/events/replay/{channel_id} events:read
events.query POST /api/v1/events/query events:read
events.cursor.get GET /api/v1/events/cursor/{channel_id} events:read
events.verify_chain GET /api/v1/events/verify/{channel_id} payloads:read
events.causal_graph.get GET /api/v1/events/{event_id}/causal-graph events:read
channels.list GET /api/v1/channels channels:read
state.save POST /api/v1/state/{channel_id} state:write
state.load GET /api/v1/state/{channel_id} state:read
state.versions.list GET /api/v1/state/{channel_id}/versions state:read
state.version.get GET /api/v1/state/{channel_id}/version/{version} state:read
state.version.delete DELETE /api/v1/state/{channel_id}/version/{version} state:delete
forks.create POST /api/v1/channels/fork forks:create
channels.diff GET /api/v1/channels/diff state:read
channels.compare GET /api/v1/channels/compare channels:read
channels.outcome.set PATCH /api/v1/channels/{channel_id}/outcome channels:write
forks.promote POST /api/v1/channels/{channel_id}/promote forks:promote
channels.delete DELETE /api/v1/channels/{channel_id} channels:delete
channels.metadata.get GET /api/v1/channels/{channel_id}/metadata channels:read
channels.metadata.put PUT /api/v1/channels/{channel_id}/metadata channels:write
channels.steps.latest GET /api/v1/channels/{channel_id}/steps channels:read
channels.steps.resolve GET /api/v1/channels/{channel_id}/steps/{step_number} channels:read
channels.forks.list GET /api/v1/channels/{channel_id}/forks channels:read
channels.fork_tree.get GET /api/v1/channels/{channel_id}/fork-tree channels:read
channels.trail.get GET /api/v1/channels/{channel_id}/trail channels:read
channels.receipt.get GET /api/v1/channels/{channel_id}/receipt channels:read
channels.close POST /api/v1/channels/{channel_id}/close channels:write
groups.create POST /api/v1/groups groups:manage
groups.list GET /api/v1/groups groups:manage
groups.delete DELETE /api/v1/groups/{group_id} groups:manage
groups.join POST /api/v1/groups/{group_id}/join groups:manage
groups.claim_work POST /api/v1/groups/{group_id}/work groups:manage
groups.ack POST /api/v1/groups/{group_id}/ack groups:manage
groups.heartbeat POST /api/v1/groups/{group_id}/heartbeat groups:manage
groups.offsets.get GET /api/v1/groups/{group_id}/offsets groups:manage
execution_groups.create POST /api/v1/execution-groups execution_groups:manage
execution_groups.list GET /api/v1/execution-groups execution_groups:manage
execution_groups.members.add POST /api/v1/execution-groups/{group_id}/members execution_groups:manage
execution_groups.members.list GET /api/v1/execution-groups/{group_id}/members execution_groups:manage
execution_groups.members.claim POST /api/v1/execution-groups/{group_id}/members/{member_id}/claim execution_groups:manage
execution_groups.members.heartbeat POST /api/v1/execution-groups/{group_id}/members/{member_id}/heartbeat execution_groups:manage
execution_groups.members.release POST /api/v1/execution-groups/{group_id}/members/{member_id}/release execution_groups:manage
execution_groups.messages.send POST /api/v1/execution-groups/{group_id}/messages execution_groups:manage
execution_groups.messages.list GET /api/v1/execution-groups/{group_id}/members/{member_id}/messages execution_groups:manage
execution_groups.messages.ack POST /api/v1/execution-group-messages/{message_id}/ack execution_groups:manage
execution_groups.forks.create POST /api/v1/execution-group-forks forks:create
execution_groups.forks.get GET /api/v1/execution-group-forks/{fork_group_id} forks:create
execution_groups.forks.promote POST /api/v1/execution-group-forks/{fork_group_id}/members/{member_id}/promote forks:promote
experiments.create POST /api/v1/experiments experiments:manage
experiments.list GET /api/v1/experiments experiments:manage
experiments.get GET /api/v1/experiments/{group_id} experiments:manage
experiments.members.add POST /api/v1/experiments/{group_id}/members experiments:manage
experiments.rank GET /api/v1/experiments/{group_id}/rank experiments:manage
scheduler.wakeups.create POST /api/v1/scheduler/wakeups scheduler:manage
scheduler.wakeups.list GET /api/v1/scheduler/wakeups scheduler:manage
scheduler.wakeups.get GET /api/v1/scheduler/wakeups/{id} scheduler:manage
scheduler.wakeups.cancel DELETE /api/v1/scheduler/wakeups/{id} scheduler:manage
executions.claim POST /api/v1/executions/claim executions:manage
executions.list GET /api/v1/executions executions:manage
executions.get GET /api/v1/executions/{id} executions:manage
executions.delete DELETE /api/v1/executions/{id} executions:manage
executions.complete POST /api/v1/executions/{id}/complete executions:manage
executions.fail POST /api/v1/executions/{id}/fail executions:manage
executions.heartbeat POST /api/v1/executions/{id}/heartbeat executions:manage
executions.cancel POST /api/v1/executions/{id}/cancel executions:manage
"""


@dataclass(frozen=True)
class ManifestOperation:
    id: str
    method: str
    path: str
    scope: str
    fleet_supported: bool


FLEET_MANIFEST = {op.id: op for op in (
    ManifestOperation("actae.api.v1." + parts[0], parts[1], parts[2], parts[3], len(parts) == 4)
    for parts in (line.split() for line in FLEET_MANIFEST_TEXT.strip().splitlines()))}


def route_shape(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "{}", path)


@functools.cache
def fleet_operation_routes() -> dict:
    """Each fleet-supported manifest operation's route in API_ROUTES (matched by method and path shape)."""
    routes = {(r.method, route_shape(r.path)): r for r in api_routes()}
    return {op.id: routes[(op.method, route_shape(op.path))] for op in FLEET_MANIFEST.values() if op.fleet_supported}


@functools.cache
def route_operations() -> dict:
    """(method, path shape) of a route -> the manifest operation it serves."""
    return {(op.method, route_shape(op.path)): op for op in FLEET_MANIFEST.values()}


def fleet_route(operation_id: str) -> Api:
    return fleet_operation_routes()[operation_id]


def supported_operation(operation_id: str) -> ManifestOperation:
    op = FLEET_MANIFEST.get(operation_id)
    if op is None:
        raise NotFound(f"unknown API manifest operation: {operation_id}", code="unknown_operation")
    if not op.fleet_supported:
        raise UnsupportedOperation(f"unsupported API operation: {operation_id} is not a fleet command"
                                   " (sign-ins and sessions are made with each instance directly)")
    return op


# --- dispatch: in process for the local instance, HTTP for a remote one ------------------------------


@dataclass(frozen=True)
class Target:
    instance_id: str
    remote: Optional[RemoteInstance] = None      # None: this server itself


async def fleet_target(app: "ActaeApp", instance_id: str) -> Target:
    """The instance named: this server, or a registered remote one (NotFound otherwise)."""
    if instance_id == app.services.instance_id:
        return Target(instance_id)
    remote = (await app.services.region(FleetState).directory.fresh()).instances.get(instance_id)
    if remote is None:
        raise NotFound(f"instance {instance_id} is not in organisation {fleet_settings(app).organization}",
                       code="unknown_instance")
    if remote.key is None:
        raise InstanceFailed(instance_id, "key_unreadable", f"its key cannot be decrypted with this data dir's"
                             f" {KEYS_CIPHER_FILE}: run `actae instance add` for it again", retryable=False)
    return Target(instance_id, remote)


def with_operation_id(route: Api, raw: Optional[bytes], idempotency_key: Optional[str]) -> Optional[bytes]:
    """The Idempotency-Key as the body's operation_id where the route's body has one and none was sent."""
    if not idempotency_key or raw is None or route.body is None or "operation_id" not in route.body.__struct_fields__:
        return raw
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return raw                      # the route's own decoding answers 400
    if isinstance(value, dict) and not value.get("operation_id"):
        return msgspec.json.encode({**value, "operation_id": idempotency_key})
    return raw


async def fleet_dispatch(app: "ActaeApp", principal: FleetPrincipal, target: Target, route: Api, params: dict, query: str,
                         raw: Optional[bytes], *, idempotency_key: Optional[str] = None, verbatim: bool = False) -> object:
    """`route` on `target` for `principal`: the direct route's answer record, or its error raised. With
    `verbatim`, a remote's answer (checked against the record) is passed on byte for byte, so nothing
    it says beyond the record's declared fields is lost on the way."""
    raw = with_operation_id(route, raw, idempotency_key)
    request = internal_request(app, route, params, query, raw)
    if target.remote is None:
        if not any(route is served for served in api_routes(app.services.hooks)):   # its region left out
            raise NotFound(f"this instance does not serve {route.method} {route.path}")
        if route.auth == "bearer":         # GET /auth/me: the organisation token, as a user without an address
            asked = context_of(request)
            asked.user, asked.bearer = principal.user(), None
        return await serve_route(request, route, principal)
    authorize_remote(principal, route, await route_parts(request, route))
    answer, data = await remote_dispatch(app, target.remote, route, request.url.path, query, raw, idempotency_key)
    seen = seen_answer(principal, answer)
    if not verbatim:
        return seen
    return Response(data, media_type="application/json") if seen is answer else api_response(seen)


def seen_answer(principal: Principal, answer: object) -> object:
    """A remote's answer (made with the gateway's key for it) as the caller may see it: lists hold only
    the channels the caller's reach sees, and its capabilities are the scopes it really has there."""
    # Events need no filter: authorize_remote asked read of every channel a replay or query names.
    reach = principal.reach
    if isinstance(answer, ChannelIds):
        return ChannelIds(channels=reach.seen(answer.channels))
    if isinstance(answer, Forks):
        return Forks(forks=reach.seen(answer.forks, lambda fork: fork.channel_id))
    if isinstance(answer, Capabilities):
        theirs = scopes_of(answer.permissions)
        return msgspec.structs.replace(principal.capabilities(),
                                       permissions=permissions_of(overlap_scopes(principal.scopes, theirs)))
    return answer


def overlap(a: str, b: str) -> Optional[str]:
    """The pattern that matches exactly the channels both patterns match (None: no channel)."""
    if a == "*" or b == "*":
        return b if a == "*" else a
    if a.endswith("*") and b.endswith("*"):
        return a if a.startswith(b[:-1]) else b if b.startswith(a[:-1]) else None
    if a.endswith("*") or b.endswith("*"):
        prefix, exact = (a, b) if a.endswith("*") else (b, a)
        return exact if exact.startswith(prefix[:-1]) else None
    return a if a == b else None


def overlap_scopes(ours: dict, theirs: dict) -> dict:
    """What two sets of scopes both allow, action by action (admin patterns allow every action)."""
    both = {}
    for action in ACTIONS:
        mine = ours[action] + ours["admin"] if action != "admin" else ours["admin"]
        other = theirs[action] + theirs["admin"] if action != "admin" else theirs["admin"]
        found = (overlap(a, b) for a in mine for b in other)
        both[action] = list(dict.fromkeys(p for p in found if p is not None))
    return both


def authorize_remote(principal: Principal, route: Api, parts: dict) -> None:
    """The fleet token's channel patterns, checked at the gateway before a remote instance is asked (the
    remote checks its own key's scopes too). A channel the route finds by a lookup (an execution's,
    a wake-up's) is not known here: that needs the action on every channel."""
    for action, where in route.scopes:
        if principal.can_everywhere(action):
            continue
        if where == SOMEWHERE:
            if not principal.can_somewhere(action):
                raise Forbidden(f"this credential may not {action} any channel")
            continue
        kind, _, name = where.partition(".")
        if where == EVERY or kind not in ("path", "query", "body"):
            principal.require(action, None)
            continue
        value = getattr(parts.get(kind), name, None)
        for channel in (value if isinstance(value, list) else [value]) if value else [None]:
            principal.require(action, channel)


def remote_timeout(app: "ActaeApp", remote: RemoteInstance) -> float:
    return remote.timeout or fleet_settings(app).fleet_timeout


def http_exchange(method: str, url: str, headers: dict, body: Optional[bytes], timeout: float) -> tuple:
    """One HTTP request with urllib (blocking: run it on the fleet's threads); (status, body bytes).
    Redirects are not followed: the instance's key goes to its own URL only."""
    import urllib.error
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with opener.open(request, timeout=timeout) as answer:
            return answer.status, answer.read(MAX_BODY_BYTES + 1)
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read(MAX_BODY_BYTES + 1)


async def remote_http(app: "ActaeApp", remote: RemoteInstance, method: str, url: str, headers: dict, body: Optional[bytes],
                      timeout: Optional[float] = None) -> tuple:
    """(status, body) from a remote instance, within its timeout; InstanceFailed when it gives none."""
    timeout = timeout or remote_timeout(app, remote)
    loop = asyncio.get_running_loop()
    try:
        return await asyncio.wait_for(loop.run_in_executor(
            app.services.region(FleetState).http, http_exchange, method, url, headers, body, timeout), timeout + 0.5)
    except (asyncio.TimeoutError, TimeoutError, socket.timeout):
        raise InstanceFailed(remote.id, "timeout", f"no answer within {timeout:g} s", status=504) from None
    except OSError as exc:                   # refused, reset, unknown host: urllib's URLError is one
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, (TimeoutError, socket.timeout)):
            raise InstanceFailed(remote.id, "timeout", f"no answer within {timeout:g} s", status=504) from None
        raise InstanceFailed(remote.id, "unreachable", f"cannot reach {remote.url}: {reason}") from None


def remote_error(remote: RemoteInstance, status: int, data: bytes) -> ActaeError:
    """A remote instance's refusal as the gateway's: its status and code, except that its 401 (the
    gateway's key) and its 5xx are the gateway's 502 (a 401 would make the SDK drop its fleet token)."""
    try:
        body = msgspec.json.decode(data)
        code, message = str(body.get("status") or "error"), str(body.get("error") or body.get("message") or "")
    except (msgspec.DecodeError, AttributeError):
        code, message = "error", data[:200].decode("utf-8", "replace")
    if status == 401:
        return InstanceFailed(remote.id, "instance_unauthorized", f"it refused the gateway's key: {message}",
                              retryable=False)
    if status >= 500:
        return InstanceFailed(remote.id, code, message or f"it answered {status}", status=503 if status == 503 else 502)
    return ActaeError(message, code=code, status=status)


async def remote_login(app: "ActaeApp", remote: RemoteInstance, *, again: bool = False) -> str:
    """A login token for the remote's key (its Bearer-only routes), kept until shortly before it expires."""
    held = app.services.region(FleetState).remote_tokens.get(remote.id)
    if held is not None and not again and held[1] > time.monotonic():
        return held[0]
    status, data = await remote_http(app, remote, "POST", remote.url + "/api/v1/auth/api-key-login",
                                     {"x-api-key": remote.key, "content-type": "application/json"}, b"{}")
    if status != 200:
        raise remote_error(remote, status, data)
    token = msgspec.json.decode(data, type=LoggedIn).token
    app.services.region(FleetState).remote_tokens[remote.id] = (token, time.monotonic() + TOKEN_TTL_SECONDS / 2)
    return token


async def remote_dispatch(app: "ActaeApp", remote: RemoteInstance, route: Api, path: str, query: str, raw: Optional[bytes],
                          idempotency_key: Optional[str]) -> tuple:
    """(the answer record, its bytes) of `route` on a remote instance, asked with the gateway's key for it."""
    url = remote.url + path + (f"?{query}" if query else "")
    headers = {"x-api-key": remote.key, "accept": "application/json", "content-type": "application/json"}
    if idempotency_key:
        headers["idempotency-key"] = idempotency_key
    body = (raw or b"") if route.body is not None or route.text_body is not None or route.method != "GET" else None
    for attempt in (0, 1):
        if route.auth == "bearer":
            headers["authorization"] = "Bearer " + await remote_login(app, remote, again=attempt > 0)
        status, data = await remote_http(app, remote, route.method, url, headers, body)
        if status == 401 and route.auth == "bearer" and attempt == 0:
            continue                       # its login token ended (logout, restart): log in once more
        break
    if status != 200:
        raise remote_error(remote, status, data)
    try:
        answer = msgspec.json.decode(data, type=route.answer)     # typed: the direct route's answer record
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InstanceFailed(remote.id, "bad_answer", f"its answer is not a {getattr(route.answer, '__name__', 'JSON')}"
                             f" answer: {exc}", retryable=False) from None
    return answer, data


# --- multi-instance queries: keyset pages over the direct query route ---------------------------------


def query_fingerprint(q: EventQuery) -> str:
    """What a page token is bound to: the query's filters (not its limit, offset or pagination)."""
    filters = msgspec.to_builtins(q)
    for name in ("limit", "offset", "pagination"):
        filters.pop(name, None)
    return sha256_hex(canonical_json(filters))[:16]


def page_token(instance_id: str, fingerprint: str, key: Optional[tuple]) -> str:
    doc = {"v": 1, "i": instance_id, "f": fingerprint}
    if key is not None:
        doc.update(t=key[0], c=key[1], k=key[2])
    return b64url(json.dumps(doc, separators=(",", ":"), sort_keys=True).encode("utf-8"))


def read_page_token(token: str, instance_id: str, fingerprint: str) -> Optional[tuple]:
    """The (timestamp, channel, cursor) a page token continues after (None: from the start); 400 otherwise."""
    try:
        doc = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        assert isinstance(doc, dict) and doc.get("v") == 1
        if doc.get("i") != instance_id or doc.get("f") != fingerprint:
            raise BadRequest(f"page_tokens[{instance_id!r}] was made for another instance or query")
        if "t" not in doc:
            return None
        parse_iso(doc["t"])
        assert isinstance(doc["c"], str) and is_int(doc["k"])
        return doc["t"], doc["c"], doc["k"]
    except (ValueError, TypeError, KeyError, AssertionError, UnicodeError, BadRequest) as exc:
        if isinstance(exc, BadRequest) and "was made for" in exc.message:
            raise
        raise BadRequest(f"page_tokens[{instance_id!r}] is not a page token of this gateway") from None


def event_key(event: Event) -> tuple:
    return event.timestamp, event.channel_id, event.cursor


def newest_first(events: list, instance_of: Callable = lambda e: "") -> list:
    """The direct query's order (timestamp descending, then channel, then cursor descending), across instances."""
    ordered = sorted(events, key=lambda e: (instance_of(e), e.channel_id, -e.cursor))
    return sorted(ordered, key=lambda e: e.timestamp, reverse=True)      # stable: ties keep the order above


async def keyset_page(run: Callable, base: EventQuery, after: Optional[tuple], limit: int) -> tuple:
    """Up to `limit` events after the key `after`, in the direct query's order; (events, maybe more).

    Built on the direct query's own filters, so it works the same on every instance: the events of
    the key's millisecond that come after it (a `from`=`to` window), then those older than it."""
    found: list = []
    until = base.until
    if after is not None:
        moment, channel, cursor = parse_iso(after[0]), after[1], after[2]
        offset = 0
        while True:
            batch = await run(msgspec.structs.replace(base, since=moment, until=moment, limit=REPLAY_LIMIT_MAX,
                                                      offset=offset))
            found += [e for e in batch if (e.channel_id, -e.cursor) > (channel, -cursor)]
            if len(batch) < REPLAY_LIMIT_MAX:
                break
            offset += len(batch)
        if len(found) >= limit:
            return found[:limit], True
        until = moment - timedelta(milliseconds=1)
        if base.until is not None:
            until = min(until, base.until)
        if base.since is not None and until < base.since:
            return found, False
    need = limit - len(found)
    batch = await run(msgspec.structs.replace(base, until=until, limit=need, offset=0))
    return found + batch, len(batch) == need


def failure_of(instance_id: str, exc: ActaeError) -> InstanceFailure:
    retryable = exc.retryable if isinstance(exc, InstanceFailed) else exc.status >= 500
    return InstanceFailure(instance_id=instance_id, code=exc.code, message=exc.message, retryable=retryable)


async def fleet_query(app: "ActaeApp", principal: FleetPrincipal, body: FleetQuery) -> FleetEvents:
    """POST .../events/query: each instance's page of the direct query, merged newest first."""
    q = body.query
    keyset = q.pagination == "keyset" or bool(body.page_tokens)
    base = EventQuery(**{name: getattr(q, name) for name in EventQuery.__struct_fields__})
    if keyset:
        base = msgspec.structs.replace(base, offset=0)
    fingerprint = query_fingerprint(base)
    instance_ids = list(dict.fromkeys(body.instances))
    given = body.page_tokens or {}
    starts = {i: read_page_token(given[i], i, fingerprint) if i in given else None for i in instance_ids}
    route = fleet_route("actae.api.v1.events.query")

    async def one(instance_id: str) -> tuple:
        try:
            target = await fleet_target(app, instance_id)

            async def run(query: EventQuery) -> list:
                answer = await fleet_dispatch(app, principal, target, route, {}, "", msgspec.json.encode(query))
                return answer.events
            if keyset:
                events, more = await keyset_page(run, base, starts[instance_id], q.limit)
            else:
                events, more = await run(base), False
            return events, more, None
        except ActaeError as exc:
            return [], False, failure_of(instance_id, exc)

    results = dict(zip(instance_ids, await asyncio.gather(*(one(i) for i in instance_ids))))
    merged = [FleetEvent(**msgspec.structs.asdict(e), instance_id=i) for i, (events, _, _) in results.items()
              for e in events]
    shown = newest_first(merged, lambda e: e.instance_id)[:q.limit]
    tokens: dict = {}
    if keyset:
        for instance_id, (events, more, failure) in results.items():
            included = [e for e in shown if e.instance_id == instance_id]
            if failure is not None or (events and not included):     # not advanced: the same page again
                tokens[instance_id] = given.get(instance_id) or page_token(instance_id, fingerprint, None)
            elif included and (more or len(included) < len(events)):
                tokens[instance_id] = page_token(instance_id, fingerprint, event_key(included[-1]))
    errors = [failure for _, _, failure in results.values() if failure is not None]
    return FleetEvents(events=shown, errors=errors, page=FleetPage(next_page_tokens=tokens),
                       next_page_token=tokens.get(instance_ids[0]) if len(instance_ids) == 1 else None)


# --- the handlers ---------------------------------------------------------------------------------------


def fleet_caller(request: Request, path: Record) -> FleetPrincipal:
    """The fleet token's principal, when the path names the organisation it and this gateway belong to."""
    principal, organization = context_of(request).principal, fleet_settings(request.app).organization
    if path.organization_id != organization:
        raise Forbidden(f"this gateway serves organisation {organization!r}, not {path.organization_id!r}")
    return principal


def local_instance(app: "ActaeApp") -> FleetInstance:
    return FleetInstance(instance_id=app.services.instance_id, name="local", local=True, url=None, dashboard_url="/",
                         added_at=None)


async def fleet_token_exchange(request: Request, body: FleetTokenRequest) -> FleetToken:
    """Exchange an organisation token for a short-lived fleet token with the requested scopes it grants."""
    row, settings = context_of(request).org_token, fleet_settings(request.app)
    if body.organization_id not in (None, settings.organization):
        raise Forbidden(f"this gateway serves organisation {settings.organization!r}, not {body.organization_id!r}")
    scopes = granted_scopes(org_grant(row["scopes"]), body.scopes)
    if not scopes:
        raise Forbidden(f"the organisation token grants none of the requested scopes ({', '.join(body.scopes or ())})")
    now = time.time()
    expires = now + settings.fleet_token_ttl
    if row["expires_at"] is not None:
        expires = min(expires, parse_iso(row["expires_at"]).timestamp())
    token = sign_fleet_token(request.app.services.token_secret, {
        "iss": "actae", "org": settings.organization, "otk": row["id"], "scp": scopes, "exp": expires,
        "jti": secrets.token_urlsafe(12)})
    return FleetToken(token=token, token_type="Bearer", expires_in=max(0, int(expires - now)),
                      organization_id=settings.organization, scopes=scopes)


async def fleet_instances(request: Request, path) -> FleetInstances:
    """The organisation's instances: this server, then the registered remote ones."""
    fleet_caller(request, path)
    app = request.app
    directory = await app.services.region(FleetState).directory.fresh()
    remotes = [FleetInstance(instance_id=r.id, name=r.name, local=False, url=r.url, dashboard_url=r.url + "/",
                             added_at=r.added_at) for r in directory.instances.values()]
    return FleetInstances(organization_id=fleet_settings(app).organization,
                          gateway_protocol_version=FLEET_PROTOCOL_VERSION, instances=[local_instance(app), *remotes])


async def fleet_capabilities(request: Request, path) -> FleetCapabilities:
    """An instance's versions and the manifest operations the gateway dispatches to it."""
    principal, app = fleet_caller(request, path), request.app
    target = await fleet_target(app, path.instance_id)
    info = await fleet_dispatch(app, principal, target, fleet_route("actae.api.v1.instance.get"), {}, "", None)
    return FleetCapabilities(
        organization_id=fleet_settings(app).organization, instance_id=path.instance_id, local=target.remote is None,
        gateway_protocol_version=FLEET_PROTOCOL_VERSION, api_version=info.api_version, version=info.version,
        engine_version=info.version, backend=info.backend, features=info.features,
        supported_fleet_operations=[op.id for op in FLEET_MANIFEST.values() if op.fleet_supported])


async def fleet_operation(request: Request, path, body: OperationEnvelope) -> OperationAnswer:
    """Run one manifest operation on one instance; it answers what the operation's direct route answers."""
    principal, app = fleet_caller(request, path), request.app
    op = supported_operation(path.operation_id)
    principal.require_scope(op.scope)
    route = fleet_route(op.id)
    names, ours = re.findall(r"\{([^}]+)\}", op.path), re.findall(r"\{(\w+)\}", route.path)
    given = {**(body.params or {}), **(body.path_params or {})}
    missing = [name for name in names if name not in given]
    if missing:
        raise BadRequest(f"missing path parameters for {op.id}: {missing}")
    params = {our: str(given[name]) for name, our in zip(names, ours)}
    query = {**{k: v for k, v in (body.params or {}).items() if k not in names}, **(body.query or {})}
    raw = None
    if route.body is not None:
        raw = b"" if body.body is None or (body.body == {} and route.body_optional) else msgspec.json.encode(body.body)
    return await fleet_dispatch(app, principal, await fleet_target(app, path.instance_id), route, params,
                                query_text(query), raw, idempotency_key=request.headers.get("idempotency-key"),
                                verbatim=True)


async def fleet_resource(request: Request, path, operation_id: str, params: dict, record: Record) -> object:
    principal, app = fleet_caller(request, path), request.app
    principal.require_scope(FLEET_MANIFEST[operation_id].scope)
    return await fleet_dispatch(app, principal, await fleet_target(app, path.instance_id), fleet_route(operation_id),
                                params, "", msgspec.json.encode(record),
                                idempotency_key=request.headers.get("idempotency-key"), verbatim=True)


async def fleet_record(request: Request, path, body: RecordEvent) -> EventAnswer:
    """Record an event on one instance (its POST /api/v1/events/record)."""
    return await fleet_resource(request, path, "actae.api.v1.events.record", {}, body)


async def fleet_fork(request: Request, path, body: Fork) -> Receipt:
    """Fork a run on one instance (its POST /api/v1/channels/fork); the Idempotency-Key is the operation id."""
    return await fleet_resource(request, path, "actae.api.v1.forks.create", {}, body)


async def fleet_save_state(request: Request, path, body: SaveState) -> SavedState:
    """Save a state on one instance (its POST /api/v1/state/{channel_id}); the Idempotency-Key is the operation id."""
    same_channel(body.channel_id, path.channel_id)
    return await fleet_resource(request, path, "actae.api.v1.state.save", {"channel_id": path.channel_id}, body)


async def fleet_query_events(request: Request, path, body: FleetQuery) -> FleetEvents:
    """Query one or more instances; keyset pages carry a continuation token per instance."""
    principal = fleet_caller(request, path)
    principal.require_scope("events:read")
    return await fleet_query(request.app, principal, body)


async def fleet_stream_ticket(request: Request, path, body: StreamTicketRequest) -> StreamTicket:
    """A one-use ticket that opens the event stream of one instance (and channel) for a short while."""
    principal, app = fleet_caller(request, path), request.app
    principal.require_scope("events:read")
    await fleet_target(app, body.instance_id)
    if body.channel_id is not None:
        principal.require("read", body.channel_id)
    ticket, ttl = FLEET_TICKET_PREFIX + secrets.token_urlsafe(24), fleet_settings(app).fleet_ticket_ttl
    await db_of(request).write(mint_ticket, sha256_hex(ticket), principal.org_token_id, list(principal.fleet_scopes),
                               body.instance_id, body.channel_id, body.resume_cursor, ttl)
    return StreamTicket(ticket=ticket, expires_in=max(1, round(ttl)), instance_id=body.instance_id,
                        channel_id=body.channel_id, resume_cursor=body.resume_cursor)


# --- a direct route called with a fleet token (the SDK's FleetClient.call) -----------------------------


def fleet_error(exc: ActaeError) -> Response:
    """The gateway's error answer: {"status", "error"} and `message`, the field the SDK's FleetClient reads."""
    return Response(msgspec.json.encode(FleetErrorBody(status=exc.code, error=exc.message, message=exc.message)),
                    status_code=exc.status, media_type="application/json")


async def fleet_direct_call(request: Request, route: Api, token: str) -> object:
    """A direct route's request carrying a fleet token: the manifest operation it is, dispatched to the
    instance X-Actae-Instance-Id names (this server without one). Only fleet commands: no open proxy."""
    app = request.app
    principal = await check_fleet_token(app, token)
    op = route_operations().get((route.method, route_shape(route.path)))
    if op is None:
        raise UnsupportedOperation(f"{route.method} {route.path} is not a manifest operation: call the instance itself")
    supported_operation(op.id)
    principal.require_scope(op.scope)
    target = await fleet_target(app, request.headers.get("x-actae-instance-id") or app.services.instance_id)
    raw = await read_capped(request) if route.body is not None else None
    return await fleet_dispatch(app, principal, target, route, dict(request.path_params),
                                request.url.query, raw, idempotency_key=request.headers.get("idempotency-key"),
                                verbatim=True)


def fleet_endpoint(route: Api, endpoint: Callable) -> Callable:
    """A route's endpoint as the gateway needs it: its own routes answer errors in the SDK's fleet shape;
    a direct route sent a fleet token (`authorization: Bearer`) is dispatched as a fleet command."""
    if is_fleet_path(route.path):
        async def gateway(request: Request) -> Response:
            context_of(request).error_shape = fleet_error
            return await endpoint(request)
        gateway.__name__ = endpoint.__name__
        return gateway

    async def direct(request: Request) -> Response:
        token = bearer_token(request)
        if token is None or not looks_like_fleet_token(token):
            return await endpoint(request)
        context_of(request).error_shape = fleet_error
        return api_response(await fleet_direct_call(request, route, token))
    direct.__name__ = endpoint.__name__
    return direct


# =============================================================================
# Fleet: event streams (the ticketed WebSocket, the NDJSON stream)
# =============================================================================
# One channel of one instance, from a cursor: the local instance's events come from this server's
# hub (the same gapless, in-order delivery as /ws), a remote one's from that server's /ws, which
# the gateway subscribes to with its key. The subscription is in place before the client's
# stream opens, so nothing recorded after the client connected is missed; a resume cursor
# replays exactly the events after it. Without a channel, every channel of the instance the fleet
# token may read, in commit order: each frame then carries its `position` in that order, which is
# what such a stream resumes from (`resume_cursor`, the NDJSON stream's `cursor`); a remote's
# comes from its /ws subscription to "*", filtered here by the token's scopes.

def fleet_stream_event(frame: dict, instance_id: str) -> Optional[dict]:
    """A /ws broadcast frame as the fleet's event, naming its instance (and, in a stream of every
    channel, its position); None for any other frame."""
    if frame.get("type") != "broadcast" or not isinstance(frame.get("payload"), dict):
        return None
    event = frame["payload"].get("event")
    if not isinstance(event, dict):
        return None
    position = frame.get("position")
    return {**event, "instance_id": instance_id, **({"position": position} if isinstance(position, int) else {})}


def fleet_ws_frame(event: dict) -> dict:
    frame = {"type": "event", "instance_id": event["instance_id"], "channel_id": event["channel_id"], "event": event}
    if "position" in event:
        frame["position"] = event["position"]
    return frame


class FleetStreamConnection(WsConnection):
    """A gateway stream's subscription to this server's hub: only events go out, as fleet events
    (the stream's own pump sends them)."""

    def __init__(self, websocket: WebSocket, hub: Hub, instance_id: str, principal: Principal):
        super().__init__(websocket, hub)
        self.instance_id, self.principal = instance_id, principal

    def send(self, frame: dict) -> None:
        """A fleet stream carries events only, not the hub's answers to a subscription."""

    def send_event(self, event: Event, position: Optional[int], text: str) -> None:
        self.offer(self.fleet_frame(event, position), len(text))

    async def send_event_paced(self, event: Event, position: Optional[int]) -> None:
        frame = self.fleet_frame(event, position)
        await self.outbox.put(frame, len(msgspec.json.encode(frame)))

    def fleet_frame(self, event: Event, position: Optional[int]) -> dict:
        fleet_event = {**msgspec.structs.asdict(event), "event_type": event.type, "instance_id": self.instance_id}
        if position is not None:
            fleet_event["position"] = position
        return fleet_ws_frame(fleet_event)


async def recv_frame(ws: "websockets.asyncio.client.ClientConnection", timeout: float) -> dict:
    frame = json.loads(await asyncio.wait_for(ws.recv(), timeout))
    return frame if isinstance(frame, dict) else {}


async def remote_events(app: "ActaeApp", remote: RemoteInstance, channel_id: Optional[str], cursor: Optional[int],
                        emit: Callable, ready: asyncio.Future) -> None:
    """Relay a remote instance's events of `channel_id` (None: of every channel, after a position)
    after `cursor` to `emit`, from its /ws; `ready` is resolved once it has confirmed the subscription
    (or failed with the reason)."""
    from websockets.asyncio.client import connect      # websockets comes with uvicorn[standard]

    timeout = remote_timeout(app, remote)
    url = "ws" + remote.url[len("http"):] + "/ws"
    try:
        async with connect(url, open_timeout=timeout, max_size=MAX_BODY_BYTES, compression=None) as ws:
            await recv_frame(ws, timeout)                                   # connected
            await ws.send(json.dumps({"type": "auth", "api_key": remote.key}))
            if (await recv_frame(ws, timeout)).get("event") != "authenticated":
                raise InstanceFailed(remote.id, "instance_unauthorized", "its /ws refused the gateway's key",
                                     retryable=False)
            await ws.send(json.dumps({"type": "subscribe", "topic": channel_id or ALL_CHANNELS, "cursor": cursor,
                                      "request_id": "fleet"}))
            confirmed = await recv_frame(ws, timeout)
            if confirmed.get("type") == "error":
                status = {"forbidden": 403, "bad_request": 400, "not_found": 404}.get(confirmed.get("status"), 502)
                raise ActaeError(str(confirmed.get("message")), code=str(confirmed.get("status") or "error"),
                                 status=status)
            if not ready.done():
                ready.set_result(None)
            async for text in ws:
                event = fleet_stream_event(json.loads(text), remote.id)
                if event is not None:
                    await emit(event)
    except (OSError, asyncio.TimeoutError, TimeoutError) as exc:
        failure = InstanceFailed(remote.id, "unreachable", f"cannot stream from {remote.url}: {first_line(exc)}")
        if not ready.done():
            ready.set_exception(failure)
            return
        raise failure from None
    except Exception as exc:  # noqa: BLE001 - the reason goes to whoever waits for the stream to open
        if not ready.done():
            ready.set_exception(exc if isinstance(exc, ActaeError) else
                                InstanceFailed(remote.id, "stream_failed", first_line(exc)))
            return
        raise


async def open_fleet_stream(app: "ActaeApp", principal: Principal, target: Target, channel_id: Optional[str],
                            cursor: Optional[int], sink: WebSocket) -> tuple:
    """Subscribe to `channel_id` of the target from `cursor` (None: to every channel the principal
    may read, from a position); (the queue its fleet frames arrive on as dicts, the tasks feeding
    it). Raises (403, 502, ...) before anything is open when it cannot be."""
    reach = principal.reach
    if channel_id is not None:
        principal.require("read", channel_id)
    if target.remote is None:
        conn = FleetStreamConnection(sink, app.services.hub, target.instance_id, principal)
        if channel_id is None:             # every channel it may read, as /ws topic "*" follows them
            await ws_subscribe_all(conn, app.services.db, SubscribeFrame(topic=ALL_CHANNELS, cursor=cursor))
            return conn.outbox, [conn.following], conn

        async def subscribed() -> None:
            await ws_subscribe(conn, app.services.db, SubscribeFrame(topic=channel_id, cursor=cursor))
            await asyncio.Event().wait()   # then live delivery goes on until the stream ends
        subscribing = asyncio.create_task(subscribed())
        await asyncio.sleep(0)         # ws_subscribe watches the topic before its first wait: nothing is missed
        return conn.outbox, [subscribing], conn

    outbox = Outbox()

    async def emit(event: dict) -> None:
        if reach.sees(event["channel_id"]):          # the remote's key may see more than the token
            frame = fleet_ws_frame(event)
            await outbox.put(frame, len(msgspec.json.encode(frame)))
    ready = asyncio.get_running_loop().create_future()
    upstream = asyncio.create_task(remote_events(app, target.remote, channel_id, cursor, emit, ready))
    try:
        await asyncio.wait_for(asyncio.shield(ready), remote_timeout(app, target.remote) * 3)
    except asyncio.TimeoutError:
        upstream.cancel()
        raise InstanceFailed(target.instance_id, "timeout", "its stream did not open in time", status=504) from None
    except BaseException:
        upstream.cancel()
        raise
    return outbox, [upstream], None


async def close_fleet_stream(app: "ActaeApp", tasks: list, conn: Optional[FleetStreamConnection]) -> None:
    if conn is not None:
        app.services.hub.leave(conn)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def deny_websocket(websocket: WebSocket, exc: ActaeError) -> None:
    """Refuse the handshake with the gateway's JSON error (a close before accept where that cannot be sent)."""
    try:
        await websocket.send_denial_response(fleet_error(exc))
    except RuntimeError:
        await websocket.close(code=1008)


async def fleet_stream_endpoint(websocket: WebSocket) -> None:
    """GET /v1/organizations/{organization_id}/events/stream?ticket=...&resume_cursor=...&channel_id=...

    The ticket (one use, short-lived) says who and which instance; events go out as
    {"type": "event", "instance_id", "channel_id", "event"}, each once, in cursor order."""
    app = websocket.app
    try:
        organization = fleet_settings(app).organization
        if websocket.path_params.get("organization_id") != organization:
            raise Forbidden(f"this gateway serves organisation {organization!r}")
        query = decode_params(websocket.query_params, FleetStreamQuery, "query string")
        if not query.ticket:
            raise Unauthorized("a stream ticket is required: POST /v1/organizations/{organization_id}/events/stream/tickets")
        ticket = await app.services.db.write(use_ticket, sha256_hex(query.ticket))
        if ticket is None:
            raise Unauthorized("unknown, used or expired stream ticket: mint a new one")
        principal = await org_token_principal(app, ticket["org_token_id"], organization, load(ticket["scopes"]))
        principal.require_scope("events:read")
        if ticket["channel_id"] is not None and query.channel_id not in (None, ticket["channel_id"]):
            raise Forbidden(f"this ticket opens channel {ticket['channel_id']}, not {query.channel_id}")
        channel_id = query.channel_id or ticket["channel_id"]       # None: every channel it may read
        cursor = query.resume_cursor if query.resume_cursor is not None else ticket["resume_cursor"]
        target = await fleet_target(app, ticket["instance_id"])
        outbox, tasks, conn = await open_fleet_stream(app, principal, target, channel_id, cursor, websocket)
    except ActaeError as exc:
        await deny_websocket(websocket, exc)
        return
    ended: list = []
    running: list = []

    def end(reason: str) -> None:
        ended.append(reason)
        for task in running[:1]:
            task.cancel()                  # the pump: the stream closes, saying why
    guard = app.services.hub.guard(Guard(
        f"org-token:{ticket['org_token_id']}",
        lambda: org_token_principal(app, ticket["org_token_id"], organization, load(ticket["scopes"]),
                                    CREDENTIAL_CHECK_SECONDS), end))
    try:
        await websocket.accept()

        async def pump() -> None:
            while True:
                await websocket.send_text(json.dumps(await outbox.get()))

        async def until_closed() -> None:
            while (await websocket.receive())["type"] != "websocket.disconnect":
                pass
        running[:] = [asyncio.create_task(pump()), asyncio.create_task(until_closed()), *tasks]
        if conn is not None:
            conn.pump_task = running[0]    # a client too slow for its backlog is cut off, as on /ws
        if ended:
            running[0].cancel()
        await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        tasks = running
    finally:
        app.services.hub.unguard(guard)
        await close_fleet_stream(app, tasks, conn)
        await close_stream_socket(websocket, ended[0] if ended else None, conn is not None and conn.cut)


async def fleet_ndjson_stream(request: Request) -> Response:
    """GET /api/v1/fleet/stream?channel_id=...&cursor=...: the same events as JSON lines (the fleet token
    as `authorization: Bearer`, the instance in X-Actae-Instance-Id); without a channel, every channel
    the token may read, each line with its `position` (what `cursor` resumes from)."""
    app = request.app
    try:
        token = bearer_token(request)
        if token is None:
            raise Unauthorized("send the fleet token as `authorization: Bearer <token>`")
        principal = await check_fleet_token(app, token)
        principal.require_scope("events:read")
        query = decode_params(request.query_params, FleetStreamQuery, "query string")
        cursor = query.cursor if query.cursor is not None else query.resume_cursor
        instance_id = request.headers.get("x-actae-instance-id") or query.instance_id or app.services.instance_id
        target = await fleet_target(app, instance_id)
        outbox, tasks, conn = await open_fleet_stream(app, principal, target, query.channel_id, cursor, None)
    except ActaeError as exc:
        return fleet_error(exc)
    ended: list = []
    guard = app.services.hub.guard(Guard(f"fleet-token:{token}", lambda: check_fleet_token(app, token, CREDENTIAL_CHECK_SECONDS),
                                         ended.append))

    async def lines():
        # The stream ends with a last line {"type": "error", ...} when its token no longer holds, when
        # the client was too slow for its backlog, or when the remote's stream ended.
        try:
            while True:
                if ended or (conn is not None and conn.cut):
                    reason = ended[0] if ended else "too slow: the backlog passed its bound; resume from the last position"
                    yield msgspec.json.encode({"type": "error", "error": reason}) + b"\n"
                    return
                try:
                    frame = await asyncio.wait_for(outbox.get(), STREAM_IDLE_CHECK_SECONDS)
                except asyncio.TimeoutError:
                    if all(task.done() for task in tasks):
                        yield msgspec.json.encode({"type": "error", "error": "the instance's stream ended: resume "
                                                                             "from the last position"}) + b"\n"
                        return
                    continue
                yield msgspec.json.encode(frame["event"]) + b"\n"
        finally:
            app.services.hub.unguard(guard)
            await close_fleet_stream(app, tasks, conn)
    return StreamingResponse(lines(), media_type="application/x-ndjson",
                             headers={"content-encoding": "identity", "cache-control": "no-store"})


FLEET_STREAMS = [Endpoint("WS", "/v1/organizations/{organization_id}/events/stream", fleet_stream_endpoint),
                 Endpoint("GET", "/api/v1/fleet/stream", fleet_ndjson_stream)]


# =============================================================================
# Fleet: enrollment (an instance links itself to an organisation's gateway, opt-in)
# =============================================================================
# The gateway's admin makes an enrollment token (`actae enrollment create`: one use, expiring, with
# the scopes the gateway will have on the instance). The instance's `actae enroll TOKEN --gateway
# URL` asks the gateway what the token allows, mints itself a key with those scopes, and sends the
# gateway its URL and that key; the gateway checks the instance answers with it and registers it
# as `instance add` would (the key encrypted at rest), and gives back a link secret that lets the
# instance ask for the gateway's version (the release notice) and unenroll. An instance that never
# enrolled keeps no link and opens no connection to anyone.

ENROLLMENT_PREFIX = "en-"
ENROLLMENT_MINUTES = 60.0              # how long an enrollment token waits for its one use, by default
ENROLL_TRIES_MAX = 5                   # failed enrollments a token survives: it is spent at the fifth
HOST_NAME_MAX, HOST_LABEL_MAX = 253, 63                # DNS's bounds on a name and on each of its labels
VERSION_TEXT = re.compile(r"\d{1,6}(\.\d{1,6}){0,3}([-+][0-9A-Za-z.+-]{1,40})?\Z")
FLEET_LINK = "fleet_link"              # the settings row an enrolled instance keeps its link in
RELEASE_CHECK_SECONDS = 6 * 3600       # how often an enrolled instance asks its gateway's version


class EnrollmentToken(Record):
    token: Token


class EnrollRequest(Record):
    token: Token
    url: Annotated[str, Meta(min_length=8, max_length=2048, pattern=r"^https?://")]
    key: Token
    name: Optional[Name] = None


class LinkRequest(Record):
    instance_id: Id
    link: Token


class EnrollmentInfo(Answer):
    """What an enrollment token allows: the organisation, and the scopes the instance's key will carry."""

    organization_id: str
    name: str
    permissions: Permissions
    expires_at: str


class Enrolled(Answer):
    """An instance enrolled: where, as which instance, and its link secret (shown once)."""

    organization_id: str
    gateway_instance_id: str
    gateway_version: str
    instance_id: str
    link: str


class LinkState(Answer):
    organization_id: str
    gateway_version: str
    enrolled: bool


def enrollment_tries_schema(w: SchemaWords) -> str:
    return """
    -- Failed enrollments with a token (an instance that did not answer, or answered as another):
    -- at ENROLL_TRIES_MAX the token is spent. A table of its own, made only where it is missing, so
    -- running this step again changes nothing.
    CREATE TABLE IF NOT EXISTS fleet_enrollment_failures (
        token_hash   TEXT PRIMARY KEY,
        tries        INTEGER NOT NULL
    )
    """


def enrollment_schema(w: SchemaWords) -> str:
    return """
    -- One-use, expiring enrollment tokens (`actae enrollment create`), by hash; `scopes` is what the
    -- enrolling instance's key for this gateway carries.
    CREATE TABLE fleet_enrollments (
        token_hash   TEXT PRIMARY KEY,
        name         TEXT NOT NULL,
        scopes       TEXT NOT NULL,
        created_at   TEXT NOT NULL,
        expires_at   TEXT NOT NULL,
        used_at      TEXT,
        instance_id  TEXT
    );
    -- When an instance enrolled itself (NULL: added by `instance add`), and its link secret's hash.
    -- (No comment after a column: SQLite keeps the text, and the table's definition with it.)
    ALTER TABLE fleet_instances ADD COLUMN enrolled_at TEXT;
    ALTER TABLE fleet_instances ADD COLUMN link_hash TEXT
    """


def create_enrollment(tx: Tx, name: str, scopes: dict, minutes: float) -> tuple:
    """`actae enrollment create`: (expiry, the token), the token's hash stored."""
    token = ENROLLMENT_PREFIX + secrets.token_urlsafe(32)
    expires_at = iso(tx.now + timedelta(minutes=minutes))
    tx.conn.execute("INSERT INTO fleet_enrollments (token_hash, name, scopes, created_at, expires_at)"
                    " VALUES (?, ?, ?, ?, ?)", (key_hash(token), name, dump(scopes_of(scopes)), tx.ts, expires_at))
    return expires_at, token


def usable_enrollment(conn: Conn, token: str, now: str) -> Row:
    """The enrollment a token names, refused with why when it cannot be used (unknown, used, expired)."""
    row = conn.execute("SELECT e.*, COALESCE(f.tries, 0) AS failed_tries FROM fleet_enrollments e"
                       " LEFT JOIN fleet_enrollment_failures f ON f.token_hash = e.token_hash WHERE e.token_hash = ?",
                       (key_hash(token),)).fetchone()
    if row is None:
        raise Unauthorized("unknown enrollment token: ask the gateway's admin for one (actae enrollment create)")
    if row["used_at"] is not None:
        raise Unauthorized(f"this enrollment token was used already (at {row['used_at']}): each enrolls one instance")
    if row["expires_at"] <= now:
        raise Unauthorized(f"this enrollment token expired at {row['expires_at']}: ask for a new one")
    if row["failed_tries"] >= ENROLL_TRIES_MAX:
        raise Unauthorized(f"this enrollment token is spent: {ENROLL_TRIES_MAX} enrollments with it failed")
    return row


def count_failed_try(tx: Tx, token: str) -> None:
    tx.conn.execute("INSERT INTO fleet_enrollment_failures (token_hash, tries) VALUES (?, 1)"
                    " ON CONFLICT (token_hash) DO UPDATE SET tries = fleet_enrollment_failures.tries + 1",
                    (key_hash(token),))


def refuse_registered(conn: Conn, instance_id: str) -> None:
    """Enrollment registers an instance, never replaces one: an id already here is refused."""
    if fleet_instance_by_id(conn, instance_id) is not None:
        raise Conflict("instance_conflict", f"an instance with id {instance_id} is registered here already: an "
                                            "instance enrolls once (its admin can `actae instance remove` it first)")


def enroll_base_url(text: str) -> str:
    """The instance's base URL as the gateway will call it, rebuilt from its scheme, host and port alone
    (every path below it is ours); BadRequest for anything else."""
    try:
        parts = urlsplit(text)
        host, port = parts.hostname or "", parts.port
    except ValueError:
        raise BadRequest("url is not a URL: give the instance's base URL, such as http://10.0.0.5:8002") from None
    if (parts.scheme not in ("http", "https") or not host or parts.username is not None or parts.password is not None
            or parts.path not in ("", "/") or parts.query or parts.fragment or "?" in text or "#" in text):
        raise BadRequest("url must be the instance's base URL, scheme, host and port only (such as "
                         "http://10.0.0.5:8002): no path, query, fragment or user")
    labels = host.rstrip(".").split(".")
    if (not host.isascii() or len(host) > HOST_NAME_MAX
            or (":" not in host and any(not 0 < len(label) <= HOST_LABEL_MAX for label in labels))):
        raise BadRequest(f"url's host is not a host name (at most {HOST_NAME_MAX} ASCII characters, labels of 1 to "
                         f"{HOST_LABEL_MAX})")
    return f"{parts.scheme}://{f'[{host}]' if ':' in host else host}{'' if port is None else f':{port}'}"


def printable_key(key: str) -> str:
    """A key that can travel in a header: printable ASCII (an Actae key is), else BadRequest."""
    if not (key.isascii() and key.isprintable()):
        raise BadRequest("key must be printable ASCII, as an Actae API key is")
    return key


def bounded_version(text: object) -> Optional[str]:
    """A version a gateway sent back, if it is one (digits and dots, a short suffix); None otherwise."""
    return text if isinstance(text, str) and VERSION_TEXT.match(text) else None


def register_enrolled(tx: Tx, token: str, info: Instance, name: str, url: str, ciphertext: str, prefix: str,
                      link: str) -> None:
    """Take the token (once) and register the instance as `instance add` would, with its link's hash."""
    usable_enrollment(tx.conn, token, tx.ts)
    refuse_registered(tx.conn, info.instance_id)
    tx.conn.execute("UPDATE fleet_enrollments SET used_at = ?, instance_id = ? WHERE token_hash = ?",
                    (tx.ts, info.instance_id, key_hash(token)))
    add_instance(tx, info.instance_id, name, url, ciphertext, prefix, None)
    tx.conn.execute("UPDATE fleet_instances SET enrolled_at = ?, link_hash = ? WHERE id = ?",
                    (tx.ts, key_hash(link), info.instance_id))


def linked_instance(conn: Conn, body: LinkRequest) -> Row:
    """The enrolled instance a link secret belongs to; 401 for anything else."""
    row = fleet_instance_by_id(conn, body.instance_id)
    if row is None or row["link_hash"] is None or not same_secret(row["link_hash"], key_hash(body.link)):
        raise Unauthorized("this instance is not enrolled here with that link")
    return row


def drop_enrolled(tx: Tx, body: LinkRequest) -> None:
    linked_instance(tx.conn, body)
    remove_instance(tx, body.instance_id)


async def api_fleet_enrollment_inspect(request: Request, body: EnrollmentToken) -> EnrollmentInfo:
    """What an enrollment token allows (the first step of `actae enroll`), before it is used."""
    row = await db_of(request).read(usable_enrollment, body.token, iso(utc_now()))
    return EnrollmentInfo(organization_id=fleet_settings(request.app).organization, name=row["name"],
                          permissions=permissions_of(scopes_of(row["scopes"])), expires_at=row["expires_at"])


async def api_fleet_enroll(request: Request, body: EnrollRequest) -> Enrolled:
    """Register the instance at `url`, which answers with `key`, by a one-use enrollment token."""
    app, db = request.app, db_of(request)
    await db.read(usable_enrollment, body.token, iso(utc_now()))
    url, key = enroll_base_url(body.url), printable_key(body.key)
    fleet = app.services.region(FleetState)
    try:
        info = await asyncio.get_running_loop().run_in_executor(
            fleet.http, instance_info, url, key, fleet_settings(app).fleet_timeout)
        if not (0 < len(info.instance_id) <= 128 and info.instance_id.isascii() and info.instance_id.isprintable()):
            raise BadRequest(f"{url} does not answer like an Actae server")
        if info.instance_id == app.services.instance_id:
            raise BadRequest("that is this gateway itself: it is always an instance of its own fleet")
        await db.read(refuse_registered, info.instance_id)
    except (BadRequest, Conflict) as exc:
        await db.write(count_failed_try, body.token)     # a token is no free probe of other hosts
        if isinstance(exc, Conflict):
            raise
        raise BadRequest(f"{exc.message} (the gateway must reach the instance at the URL it gives: --url)") from None
    cipher = fleet.directory.cipher or await asyncio.to_thread(keys_cipher, fleet.directory.data_dir)
    ciphertext = cipher.encrypt(key.encode("utf-8")).decode("ascii")
    link = secrets.token_urlsafe(32)
    await db.write(register_enrolled, body.token, info, body.name or urlsplit(url).netloc, url, ciphertext, key[:7], link)
    return Enrolled(organization_id=fleet_settings(app).organization, gateway_instance_id=app.services.instance_id,
                    gateway_version=__version__, instance_id=info.instance_id, link=link)


async def api_fleet_link(request: Request, body: LinkRequest) -> LinkState:
    """An enrolled instance asks after its link: the gateway's version (its dashboard's release notice)."""
    await db_of(request).read(linked_instance, body)
    return LinkState(organization_id=fleet_settings(request.app).organization, gateway_version=__version__,
                     enrolled=True)


async def api_fleet_unenroll(request: Request, body: LinkRequest) -> LinkState:
    """An enrolled instance leaves the organisation: the gateway forgets it (and the key it held)."""
    await db_of(request).write(drop_enrolled, body)
    return LinkState(organization_id=fleet_settings(request.app).organization, gateway_version=__version__,
                     enrolled=False)


ENROLLMENT_ROUTES = [
    Api("POST", "/api/v1/fleet/enrollments/inspect", api_fleet_enrollment_inspect, body=EnrollmentToken,
        auth="public", group="fleet"),
    Api("POST", "/api/v1/fleet/enroll", api_fleet_enroll, body=EnrollRequest, auth="public", group="fleet"),
    Api("POST", "/api/v1/fleet/link", api_fleet_link, body=LinkRequest, auth="public", group="fleet"),
    Api("POST", "/api/v1/fleet/unenroll", api_fleet_unenroll, body=LinkRequest, auth="public", group="fleet"),
]


# --- the instance's side: enroll, its link, the release notice -------------------------------------


def post_json(url: str, body: dict, timeout: float = 15.0) -> dict:
    """POST JSON to a gateway's public enrollment routes; exits with the gateway's own reason."""
    try:
        status, data = http_exchange("POST", url, {"content-type": "application/json", "accept": "application/json"},
                                     msgspec.json.encode(body), timeout)
    except OSError as exc:
        raise SystemExit(f"actae: cannot reach {url}: {getattr(exc, 'reason', exc)}")
    try:
        answer = msgspec.json.decode(data)
    except msgspec.DecodeError:
        answer = {"error": data[:200].decode("utf-8", "replace")}
    if status != 200:
        raise SystemExit(f"actae: the gateway refused: {answer.get('error') or answer}")
    return answer


def fleet_link_of(conn: Conn) -> Optional[dict]:
    row = conn.execute("SELECT value FROM settings WHERE name = ?", (FLEET_LINK,)).fetchone()
    return load(row[0]) if row else None


def keep_fleet_link(tx: Tx, link: Optional[dict]) -> None:
    tx.conn.execute("DELETE FROM settings WHERE name = ?", (FLEET_LINK,))
    if link is not None:
        tx.conn.execute("INSERT INTO settings (name, value) VALUES (?, ?)", (FLEET_LINK, dump(link)))


def enroll_command(args: argparse.Namespace, location: Location) -> int:
    """`actae enroll TOKEN --gateway URL [--url URL] [--name NAME]`, `--status`; `actae unenroll`."""
    link = read_once(location, fleet_link_of)
    if args.command == "unenroll":
        return unenroll(location, link)
    if args.status:
        print(f"Enrolled in organisation {link['organization_id']} at {link['gateway']} as instance"
              f" {link['instance_id']} since {link['enrolled_at']} (key {link['key_id']})" if link else
              "Not enrolled: this instance is linked to no gateway and opens no connection to one")
        return 0
    if not args.token or not args.gateway:
        raise SystemExit("actae: give the enrollment token and --gateway URL (or --status)")
    if link:
        raise SystemExit(f"actae: already enrolled at {link['gateway']}: run `{program_name()} unenroll` first")
    gateway = args.gateway.rstrip("/")
    allowed = gateway_answer(post_json(gateway + "/api/v1/fleet/enrollments/inspect", {"token": args.token}),
                             GatewayEnrollment)
    organization, scopes = allowed.organization_id, scopes_of(allowed.permissions)
    agree_to_scopes(args, organization, scopes)
    made = write_once(location, create_key, f"fleet:{organization}", scopes, None)
    try:
        enrolled = gateway_answer(post_json(gateway + "/api/v1/fleet/enroll",
                                            {"token": args.token, "url": args.url.rstrip("/"), "key": made.key,
                                             "name": args.name}), GatewayEnrolled)
    except SystemExit:
        write_once(location, revoke_key, made.id)      # no gateway holds it: it goes again
        raise
    write_once(location, keep_fleet_link, {"gateway": gateway, "organization_id": organization,
                                           "instance_id": enrolled.instance_id, "key_id": made.id,
                                           "link": enrolled.link, "enrolled_at": iso(utc_now()),
                                           "gateway_version": bounded_version(enrolled.gateway_version)})
    print(f"Enrolled in organisation {organization} at {gateway} as instance {enrolled.instance_id}"
          f" (the gateway holds key {made.id}: {scopes_text(made.scopes)})")
    return 0


# What a gateway answers `actae enroll`, bounded before anything of it is stored or shown.
GatewayText = Annotated[str, Meta(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")]


class GatewayPermissions(Struct, kw_only=True):
    read: Annotated[list[GatewayText], Meta(max_length=64)] = []
    write: Annotated[list[GatewayText], Meta(max_length=64)] = []
    delete: Annotated[list[GatewayText], Meta(max_length=64)] = []
    admin: Annotated[list[GatewayText], Meta(max_length=64)] = []


class GatewayEnrollment(Struct, kw_only=True):
    organization_id: GatewayText
    permissions: GatewayPermissions


class GatewayEnrolled(Struct, kw_only=True):
    instance_id: GatewayText
    link: GatewayText
    gateway_version: str = ""                          # kept only if bounded_version takes it


def gateway_answer(answer: dict, kind: type) -> object:
    try:
        return msgspec.convert(answer, kind)
    except msgspec.ValidationError as exc:
        raise SystemExit(f"actae: the gateway's answer is not one this server takes ({exc})")


def agree_to_scopes(args: argparse.Namespace, organization: str, scopes: dict) -> None:
    """Show the scopes the gateway's key would carry; mint it only on --yes or a typed yes."""
    print(f"Organisation {organization}'s gateway asks for a key of this instance with: "
          f"{scopes_text(permissions_of(scopes))}")
    if scopes["admin"]:
        print("  It asks for ADMIN: the gateway could make and revoke this instance's keys.")
    if args.yes:
        return
    if not sys.stdin.isatty():
        raise SystemExit("actae: no key made: run again with --yes to accept these scopes")
    if input("Make that key and enroll? [y/N] ").strip().lower() not in ("y", "yes"):
        raise SystemExit("actae: no key made, not enrolled")


def unenroll(location: Location, link: Optional[dict]) -> int:
    if not link:
        print("Not enrolled: nothing to undo")
        return 0
    write_once(location, revoke_key, link["key_id"])   # the gateway's key stops working first, whatever it says
    write_once(location, keep_fleet_link, None)
    try:
        post_json(link["gateway"] + "/api/v1/fleet/unenroll", {"instance_id": link["instance_id"], "link": link["link"]})
    except SystemExit as exc:
        print(f"Unenrolled here (key {link['key_id']} revoked); the gateway was not told: {exc}", file=sys.stderr)
        return 0
    print(f"Unenrolled from {link['gateway']}: key {link['key_id']} revoked, the gateway forgot this instance")
    return 0


def add_enrollment_commands(commands: Subcommands, common: argparse.ArgumentParser, scoped: argparse.ArgumentParser) -> None:
    enrollment = add_command(commands, "enrollment", enrollment_command, [common],
                             "on a gateway: one-use tokens an instance enrolls itself with")
    kinds = enrollment.add_subparsers(dest="enrollment_command", required=True, metavar="{create}")
    create = kinds.add_parser("create", parents=[common, scoped], help="make an enrollment token and print it once")
    create.add_argument("--name", required=True, help="what the instance to enroll is (shown by `instance list`)")
    create.add_argument("--expires-in", type=bounded_minutes, default=ENROLLMENT_MINUTES, metavar="MINUTES",
                        help=f"the token expires unused after MINUTES (default: {ENROLLMENT_MINUTES:g})")
    enroll = add_command(commands, "enroll", enroll_command, [common],
                         "link this instance to an organisation's gateway (opt-in; --status shows the link)")
    enroll.add_argument("token", nargs="?", metavar="TOKEN", help="the enrollment token the gateway's admin gave")
    enroll.add_argument("--gateway", metavar="URL", help="the gateway's base URL")
    enroll.add_argument("--url", default=f"http://{DEFAULT_HOST}:{DEFAULT_PORT}", metavar="URL",
                        help="where the gateway reaches this instance (default: %(default)s)")
    enroll.add_argument("--name", help="what the gateway calls it (default: its host and port)")
    enroll.add_argument("--status", action="store_true", help="show the link, if any, and exit")
    enroll.add_argument("--yes", action="store_true",
                        help="accept the scopes the gateway asks for without being asked (they are printed)")
    add_command(commands, "unenroll", enroll_command, [common], "leave the gateway: revoke the key it holds and tell it")


def bounded_minutes(text: str) -> float:
    return bounded_number(text, 0, 7 * 24 * 60, "minutes", positive=True)


def enrollment_command(args: argparse.Namespace, location: Location) -> int:
    scopes = scopes_of_args(args)
    if not any(scopes.values()):
        scopes = {"read": ["*"], "write": ["*"], "delete": [], "admin": []}
    expires_at, token = write_once(location, create_enrollment, args.name, scopes, args.expires_in)
    print(f"Enrollment token for {args.name}: {scopes_text(permissions_of(scopes))}, expires {expires_at}, one use")
    print(token)
    print(f"(shown once: on the instance, run `actae enroll {token[:10]}... --gateway URL --url ITS_URL`)")
    return 0


def version_tuple(version: str) -> tuple:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


class ReleaseNotice:
    """While this instance is enrolled, its gateway's version, asked at start and every
    RELEASE_CHECK_SECONDS (never when it is not enrolled: an unlinked instance calls no one)."""

    def __init__(self, db: Database):
        self.db, self.gateway_version, self._task = db, None, None

    async def start(self) -> None:
        if await self.db.read(fleet_link_of) is not None:
            self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def run(self) -> None:
        while True:
            link = await self.db.read(fleet_link_of)
            if link is None:
                return
            try:
                status, data = await asyncio.to_thread(
                    http_exchange, "POST", link["gateway"] + "/api/v1/fleet/link", {"content-type": "application/json"},
                    msgspec.json.encode({"instance_id": link["instance_id"], "link": link["link"]}), 10.0)
                if status == 200:
                    self.gateway_version = bounded_version(msgspec.json.decode(data, type=LinkState).gateway_version)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError):
                pass                                   # asked again at the next check
            await asyncio.sleep(RELEASE_CHECK_SECONDS)

    def notice(self) -> Optional[str]:
        newer = self.gateway_version and version_tuple(self.gateway_version) > version_tuple(__version__)
        return (f"Actae {self.gateway_version} is out: your organisation's gateway runs it (this server runs"
                f" {__version__})") if newer else None


def install_release_notice(services: Services, options: dict) -> Installed:
    notice = ReleaseNotice(services.db)
    return Installed(services=(notice,), starts=(notice.start,), stops=(notice.stop,))


def release_notice(services: Services) -> Optional[str]:
    notice = services.regions.get(ReleaseNotice)
    return notice.notice() if notice is not None else None


# =============================================================================
# Fleet: routes, the Fleet page and commands
# =============================================================================

FLEET_ORG_PATH = "/v1/organizations/{organization_id}"
FLEET_ROUTES = [
    Api("POST", "/api/v1/fleet/token", fleet_token_exchange, body=FleetTokenRequest, auth="org", group="fleet"),
    Api("GET", f"{FLEET_ORG_PATH}/instances", fleet_instances, auth="fleet", group="fleet"),
    Api("GET", f"{FLEET_ORG_PATH}/instances/{{instance_id}}/capabilities", fleet_capabilities, auth="fleet", group="fleet"),
    Api("POST", f"{FLEET_ORG_PATH}/instances/{{instance_id}}/ops/{{operation_id}}", fleet_operation, body=OperationEnvelope,
        auth="fleet", group="fleet", answers_as=lambda: tuple(r.answer for r in fleet_operation_routes().values())),
    Api("POST", f"{FLEET_ORG_PATH}/instances/{{instance_id}}/events", fleet_record, body=RecordEvent, auth="fleet", group="fleet"),
    Api("POST", f"{FLEET_ORG_PATH}/instances/{{instance_id}}/forks", fleet_fork, body=Fork, auth="fleet", group="fleet"),
    Api("PUT", f"{FLEET_ORG_PATH}/instances/{{instance_id}}/state/{{channel_id}}", fleet_save_state, body=SaveState,
        auth="fleet", group="fleet"),
    Api("POST", f"{FLEET_ORG_PATH}/events/query", fleet_query_events, body=FleetQuery, auth="fleet", group="fleet"),
    Api("POST", f"{FLEET_ORG_PATH}/events/stream/tickets", fleet_stream_ticket, body=StreamTicketRequest, auth="fleet", group="fleet"),
]


FLEET_PAGE_TIMEOUT = 3.0               # a slow instance shows as unreachable rather than holding the page


async def fleet_instance_row(app: "ActaeApp", principal: FleetPrincipal, instance: FleetInstance) -> dict:
    """One instance as the Fleet page shows it: reachable or why not, version, backend, run count."""
    row = {**msgspec.structs.asdict(instance), "reachable": False, "error": None, "version": None,
           "backend": None, "runs": None}
    try:
        target = await fleet_target(app, instance.instance_id)
        if target.remote is not None:
            target = Target(target.instance_id, dataclasses_replace(
                target.remote, timeout=min(remote_timeout(app, target.remote), FLEET_PAGE_TIMEOUT)))
        info = await fleet_dispatch(app, principal, target, fleet_route("actae.api.v1.instance.get"), {}, "", None)
        channels = await fleet_dispatch(app, principal, target, fleet_route("actae.api.v1.channels.list"), {}, "",
                                        None)
        row.update(reachable=True, version=info.version, backend=info.backend, runs=len(channels.channels))
    except ActaeError as exc:
        row["error"] = exc.message
    return row


Replaced = typing.TypeVar("Replaced")


def dataclasses_replace(value: Replaced, **changes: object) -> Replaced:
    import dataclasses
    return dataclasses.replace(value, **changes)


async def page_fleet(request: Request) -> Response:
    principal = context_of(request).principal
    if not principal.is_admin:
        raise Forbidden("only an admin may see the fleet")
    app = request.app
    directory = await app.services.region(FleetState).directory.fresh()
    instances = [local_instance(app)] + [
        FleetInstance(instance_id=r.id, name=r.name, local=False, url=r.url, dashboard_url=r.url + "/",
                      added_at=r.added_at) for r in directory.instances.values()]
    # The page asks each instance what any API caller with every scope would get.
    viewer = FleetPrincipal("dashboard", {**ADMIN_SCOPES, "admin": []}, "fleet", "session",
                            organization_id=fleet_settings(app).organization, fleet_scopes=tuple(FLEET_SCOPES),
                            name="dashboard")
    rows = await asyncio.gather(*(fleet_instance_row(app, viewer, i) for i in instances))
    return render(request, "fleet.html", {"title": "Fleet", "active": "fleet",
                                          "organization_id": fleet_settings(app).organization, "instances": rows})


# --- the fleet: --organization, `instance`, `org-token` ------------------------------------------------


def add_fleet_flags(parser: argparse.ArgumentParser) -> None:
    fleet, default = parser.add_argument_group("the fleet gateway (the SDK's FleetClient)"), FleetSettings()
    fleet.add_argument("--organization", default=default.organization, metavar="ID",
                       help=f"the organisation this server's gateway serves, /v1/organizations/ID/ "
                            f"(default: {default.organization})")
    fleet.add_argument("--fleet-token-ttl", type=seconds(86400), default=default.fleet_token_ttl, metavar="SECONDS",
                       help=f"how long a fleet token from POST /api/v1/fleet/token lives (default: "
                            f"{default.fleet_token_ttl:g})")
    fleet.add_argument("--fleet-ticket-ttl", type=seconds(86400), default=default.fleet_ticket_ttl, metavar="SECONDS",
                       help=f"how long a stream ticket waits for its one use (default: {default.fleet_ticket_ttl:g})")
    fleet.add_argument("--fleet-timeout", type=seconds(3600), default=default.fleet_timeout, metavar="SECONDS",
                       help=f"time a remote instance has to answer one gateway request, unless `instance add "
                            f"--timeout` set its own (default: {default.fleet_timeout:g})")


def fleet_settings_of(args: argparse.Namespace) -> dict:
    if not ORGANIZATION_ID.fullmatch(args.organization):
        raise SystemExit("actae: --organization takes 1-128 characters of A-Z a-z 0-9 . _ : -")
    return {"fleet": FleetSettings(organization=args.organization, fleet_token_ttl=args.fleet_token_ttl,
                                   fleet_ticket_ttl=args.fleet_ticket_ttl, fleet_timeout=args.fleet_timeout)}


def add_fleet_commands(commands: Subcommands, common: argparse.ArgumentParser, scoped: argparse.ArgumentParser) -> None:
    instance = add_command(commands, "instance", instance_command, [common],
                           "the fleet's remote instances: add, list, remove")
    instance_commands = instance.add_subparsers(dest="instance_command", required=True, metavar="{add,list,remove}")
    add = instance_commands.add_parser("add", parents=[common],
                                       help="register a remote Actae server (it must answer /api/v1/instance with the key)")
    add.add_argument("url", metavar="URL", help="the remote server's base URL, such as http://10.0.0.5:8002")
    given = add.add_mutually_exclusive_group()
    given.add_argument("--key-file", metavar="PATH",
                       help="a file holding an API key of the remote server (preferred: the key stays out of `ps` and"
                            " shell history); - reads standard input. Default: $ACTAE_REMOTE_KEY, else a prompt")
    given.add_argument("--key", metavar="KEY",
                       help="the key itself, for scripts (it shows in `ps` and shell history: prefer --key-file)")
    add.add_argument("--name", help="what to call it (default: its host and port)")
    add.add_argument("--timeout", type=seconds(3600), metavar="SECONDS",
                     help="time it has to answer one gateway request (default: the server's --fleet-timeout)")
    listing = instance_commands.add_parser("list", parents=[common], help="this server and the registered instances")
    listing.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    remove = instance_commands.add_parser("remove", parents=[common], help="unregister an instance")
    remove.add_argument("instance_id", metavar="ID", help="the id `instance list` shows")
    org = add_command(commands, "org-token", org_token_command, [common],
                      "organisation tokens for the SDK's FleetClient: create, list, revoke")
    add_credential_commands(org, "org-token", "token_id", "an organisation token", "organisation tokens", (common, scoped))


def instance_info(url: str, key: str, timeout: float = 10.0) -> Instance:
    """What a remote server says of itself at /api/v1/instance with `key`; BadRequest says why it cannot."""
    # One fixed sentence per failure: what the far end sent back is never repeated to the caller.
    try:
        status, data = http_exchange("GET", url + "/api/v1/instance", {"x-api-key": key, "accept": "application/json"},
                                     None, timeout)
    except (OSError, ValueError, http.client.HTTPException):
        raise BadRequest(f"cannot reach {url}") from None
    if status != 200:                       # its status is not repeated either: no probe of what answers there
        raise BadRequest(f"{url} did not answer /api/v1/instance with that key as an Actae server does")
    try:
        return msgspec.json.decode(data, type=Instance)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise BadRequest(f"{url} does not answer like an Actae server") from None


def instance_command(args: argparse.Namespace, location: Location) -> int:
    """`actae instance add|list|remove`."""
    if args.instance_command == "add":
        url = args.url.rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
            raise SystemExit(f"actae: give the server's base URL, such as http://10.0.0.5:8002 (got {args.url!r})")
        key = key_of_args(args.key_file, args.key, "ACTAE_REMOTE_KEY", "API key of the remote server: ")
        if not key:
            raise SystemExit("actae: give the remote server's API key: --key-file PATH, $ACTAE_REMOTE_KEY, or type"
                             " it when asked (on a terminal)")
        info = instance_info(url, key)
        if info.instance_id == write_once(location, instance_identity):
            raise SystemExit("actae: that is this server itself: it is always an instance of its own fleet")
        ciphertext = keys_cipher(location.data_dir).encrypt(key.encode("utf-8")).decode("ascii")
        added = write_once(location, add_instance, info.instance_id, args.name or parts.netloc, url, ciphertext,
                           key[:7], args.timeout)
        print(f"Instance {added.instance_id} ({added.name}) at {added.url}: Actae {info.version}, {info.backend}")
    elif args.instance_command == "list":
        local_id, remotes = write_once(location, instance_identity), read_once(location, list_instances)
        print_listing(args.json, {"local_instance_id": local_id, "instances": remotes},
                      f"{'ID':<38} {'NAME':<20} {'URL':<40} ADDED",
                      [f"{local_id:<38} {'(this server)':<20} {'-':<40} -"]
                      + [f"{r.instance_id:<38} {r.name:<20} {r.url:<40} {r.added_at}" for r in remotes])
    else:
        removed = write_once(location, remove_instance, args.instance_id)
        print(f"Instance {removed.instance_id} ({removed.name}) removed")
    return 0


def org_token_command(args: argparse.Namespace, location: Location) -> int:
    """`actae org-token create|list|revoke`."""
    if args.org_token_command == "create":
        created, token = write_once(location, create_org_token, args.name, scopes_of_args(args), args.expires_in)
        print_issued("Organisation token", created)
        print(token)
        print("(shown once: store it now; the SDK's FleetClient takes it as organization_token)")
    elif args.org_token_command == "list":
        tokens = read_once(location, list_org_tokens)
        print_listing(args.json, {"org_tokens": tokens}, f"{'ID':>4}  {'NAME':<20} {'SCOPES':<40} {'CREATED':<25} EXPIRES",
                      (f"{t.id:>4}  {t.name:<20} {scopes_text(t.scopes):<40} {t.created_at:<25} {t.expires_at or 'never'}"
                       for t in tokens))
    else:
        print_revoked("Organisation token", write_once(location, revoke_org_token, args.token_id))
    return 0


# --- how the fleet plugs into the core ----------------------------------------------------------


def install_fleet(services: Services, options: dict) -> Installed:
    settings = options.get("fleet") or FleetSettings()
    return Installed(services=(FleetState(services.db, services.data_dir, typing.cast(FleetSettings, settings)),))


def organization_banner(options: dict) -> str:
    organization = (options.get("fleet") or FleetSettings()).organization
    return f"Organization: {organization} (fleet gateway: /v1/organizations/{organization}/)"


# The gateway (the SDK's FleetClient): a fleet token each, whose scopes fleet_dispatch checks per
# operation; the exchange takes the organisation token. The streams are outside the API table.
# Enrollment (its own section) links this server to another's gateway.
FLEET = declare(Region(
    "fleet", schema=(SchemaPart(8, fleet_schema), SchemaPart(13, enrollment_schema),
                     SchemaPart(24, enrollment_tries_schema)),
    routes=(*ENROLLMENT_ROUTES, *FLEET_ROUTES), pages=(("GET", "/fleet", page_fleet),), endpoints=tuple(FLEET_STREAMS),
    nav=(NavLink("Fleet", "/fleet", "fleet", place=90, admin=True),),
    json_paths=("/v1/",), wrappers=(fleet_endpoint,),
    authenticators=(("fleet", fleet_authenticate), ("org", fleet_authenticate)),
    installers=(install_release_notice, install_fleet), page_notices=(release_notice,),
    commands=(add_enrollment_commands, add_fleet_commands), serve_flags=(add_fleet_flags,),
    options=(fleet_settings_of,), banner_lines=(organization_banner,)))


# Every region has registered itself by here: the command line sees them all.
if __name__ == "__main__":
    sys.exit(main())


