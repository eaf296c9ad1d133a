"""The server with write-path features switched off, for `examples/bench.py --feature-costs` only.

    ACTAE_BENCH_WITHOUT=chain python examples/bench_without.py --port 0 --data-dir DIR

It imports actae, takes out what the features named in ACTAE_BENCH_WITHOUT (a comma list of
FEATURES) put on the write path, and runs `actae.main()` with the rest of the command line, so the
bench can price each feature by its absence. The server itself has no such switch: a server without
one of these keeps less than it promises (no chain to verify, no inbox, no metrics, ...), so it is
never a user's option, and the branches live here, not on its write path.

- run-state: what each event and state keeps on its run's row for the lists (the blocking event's
  type, the first failure, the latest snapshot's status); the activity time alone is kept.
- approvals: the approvals inbox's index, kept in each approval event's transaction.
- request-metrics: /metrics's count of requests and of committed batches.
- deltas: states stored as deltas of the previous one; every state is stored whole.
- chain: the event chain's hash (its canonical JSON and SHA-256).
- spans: live OpenTelemetry spans of committed events (only where --otlp-endpoint is given).
"""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import actae  # noqa: E402

VARIABLE = "ACTAE_BENCH_WITHOUT"
FEATURES = ("run-state", "approvals", "request-metrics", "deltas", "chain", "spans")


def features_named(text: str) -> frozenset:
    named = frozenset(filter(None, (part.strip() for part in text.split(","))))
    unknown = sorted(named - set(FEATURES))
    if unknown:
        raise SystemExit(f"bench_without: {VARIABLE} names {', '.join(unknown)}; the features are {', '.join(FEATURES)}")
    return named


def without_run_state() -> None:
    def activity_alone(tx, channel_id: str, event_type: str) -> tuple:
        return tx.ts, None, 0, channel_id, tx.ts[:actae.ACTIVE_AT_CHARS], None, 0
    actae.event_facts_args = activity_alone
    actae.state_facts_args = lambda tx, channel_id, status: None


def region_without(name: str, **fields) -> None:
    """Replace the declared region `name` by a copy with `fields` (hooks left out) before main() runs."""
    at = next(i for i, region in enumerate(actae.REGIONS) if region.name == name)
    actae.REGIONS[at] = dataclasses.replace(actae.REGIONS[at], **fields)


def without_approvals() -> None:
    region_without("many runs", event_hooks=())


def without_request_metrics() -> None:
    region_without("observability", request_observers=())
    actae.Metrics.observe_batch = lambda self, jobs, outcomes, seconds: []


def without_deltas() -> None:
    actae.DELTA_MIN_BYTES = sys.maxsize


def without_chain() -> None:
    actae.chain_parts = lambda **fields: ("", "")
    actae.chain_step = lambda previous, head, cursor, tail: None


def without_spans() -> None:
    actae.TraceExport.committed = lambda self, events, ended: None


SWITCHES = {"run-state": without_run_state, "approvals": without_approvals,
            "request-metrics": without_request_metrics, "deltas": without_deltas, "chain": without_chain,
            "spans": without_spans}


if __name__ == "__main__":
    for feature in sorted(features_named(os.environ.get(VARIABLE, ""))):
        SWITCHES[feature]()
    sys.exit(actae.main(sys.argv[1:]))
