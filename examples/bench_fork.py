"""Fork latency against parent size: a fork must cost the same for 10 steps or 10,000.

    ACTAE_URL=http://127.0.0.1:8002 ACTAE_API_KEY=sk-... python examples/bench_fork.py
    python examples/bench_fork.py --sizes 10,100 --forks 10      # a quick run

Builds one parent channel per size (a step event per step, recorded with its step number,
and a state snapshot every `--snapshot-every` steps plus at the first and last step), then
times `--forks` forks of each parent at its last step and at its first step, interleaving
the cells so drift hits them all alike. Prints the median and p90 latency per cell and the
ratio of the slowest median to the fastest (target: at most 1.3, since a fork is
copy-on-write: a lineage pointer plus one snapshot).

Exits 0, or 1 with `--strict` when the ratio misses the target.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

from actae_client import ActaeClient

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _connect  # noqa: E402  (examples/_connect.py: one line, not a traceback, for a refused key or a wrong address)

TARGET_RATIO = 1.3


async def build_parent(client: ActaeClient, channel: str, steps: int, batch: int, every: int) -> dict[int, int]:
    """Record `steps` step events (concurrently, `batch` at a time) plus snapshots.

    Returns step number -> cursor of that step's event.
    """
    cursors: dict[int, int] = {}
    filler = "x" * 512  # a constant-size state, so only the step count varies
    for start in range(1, steps + 1, batch):
        numbers = list(range(start, min(start + batch, steps + 1)))
        events = await asyncio.gather(*(
            client.record(channel, "bench.step", {"step_number": n}, actor="bench", step_number=n)
            for n in numbers))
        cursors.update((n, e.cursor) for n, e in zip(numbers, events))
        snapshots = [n for n in numbers if n % every == 0 or n in (1, steps)]
        await asyncio.gather(*(
            client.save_state(channel, cursors[n], {"step": n, "filler": filler}) for n in snapshots))
    return cursors


async def time_fork(client: ActaeClient, source: str, child: str, cursor: int) -> float:
    """Fork `source` at `cursor` into `child`; return the latency in milliseconds."""
    started = time.perf_counter()
    receipt = await client.fork(source, child, cursor)
    elapsed = (time.perf_counter() - started) * 1000
    if receipt.resolved_cursor != cursor:
        raise RuntimeError(f"fork of {source} at {cursor} resolved to {receipt.resolved_cursor}")
    return elapsed


async def bench(client: ActaeClient, prefix: str, sizes: list[int], forks: int, batch: int, every: int) -> dict:
    """Build the parents, time the forks; return the report dict."""
    parents = {}
    for size in sizes:
        channel = f"{prefix}-p{size}"
        started = time.perf_counter()
        cursors = await build_parent(client, channel, size, batch, every)
        seconds = time.perf_counter() - started
        parents[size] = (channel, cursors)
        print(f"built parent {channel}: {size} steps in {seconds:.1f} s", flush=True)

    warm_channel, warm_cursors = parents[sizes[0]]
    for i in range(3):  # connection setup and first-use costs stay out of the figures
        await time_fork(client, warm_channel, f"{warm_channel}-warm{i}", warm_cursors[1])

    cells = {(size, where): [] for size in sizes for where in ("last", "first")}
    for i in range(forks):
        for (size, where), samples in cells.items():
            channel, cursors = parents[size]
            step = size if where == "last" else 1
            samples.append(await time_fork(client, channel, f"{channel}-{where}{i}", cursors[step]))

    rows = [{
        "steps": size, "fork_at": where, "forks": len(samples),
        "median_ms": round(statistics.median(samples), 3),
        "p90_ms": round(sorted(samples)[int(0.9 * (len(samples) - 1))], 3),
        "min_ms": round(min(samples), 3),
    } for (size, where), samples in cells.items()]
    medians = [r["median_ms"] for r in rows]
    return {"benchmark": "bench_fork", "forks_per_cell": forks, "cells": rows,
            "ratio": round(max(medians) / min(medians), 3), "target_ratio": TARGET_RATIO}


def print_report(report: dict) -> None:
    print(f"\n{'parent steps':>12}  {'fork at':>7}  {'median ms':>9}  {'p90 ms':>8}  {'min ms':>8}")
    for r in report["cells"]:
        print(f"{r['steps']:>12}  {r['fork_at']:>7}  {r['median_ms']:>9.2f}  {r['p90_ms']:>8.2f}  {r['min_ms']:>8.2f}")
    verdict = "PASS" if report["ratio"] <= TARGET_RATIO else "FAIL"
    print(f"\nratio slowest/fastest median: {report['ratio']:.2f} (target <= {TARGET_RATIO}) {verdict}")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=os.environ.get("ACTAE_URL"), help="server URL (env ACTAE_URL)")
    p.add_argument("--key", default=os.environ.get("ACTAE_API_KEY"), help="API key (env ACTAE_API_KEY)")
    p.add_argument("--sizes", default="10,1000,10000", help="parent sizes in steps, comma-separated")
    p.add_argument("--forks", type=int, default=50, help="forks timed per cell (default 50)")
    p.add_argument("--batch", type=int, default=200, help="concurrent records while building")
    p.add_argument("--snapshot-every", type=int, default=10, help="save state every N steps")
    p.add_argument("--name", default=f"bench-{uuid.uuid4().hex[:8]}", help="channel prefix")
    p.add_argument("--out", help="also write the report as JSON to this file")
    p.add_argument("--strict", action="store_true", help="exit 1 when the ratio misses the target")
    args = p.parse_args(argv)
    if not args.url or not args.key:
        p.error("set ACTAE_URL and ACTAE_API_KEY (or pass --url and --key)")
    args.sizes = [int(s) for s in args.sizes.split(",")]
    return args


async def run(args) -> int:
    client = ActaeClient(endpoint=args.url, api_key=args.key)
    try:
        report = await bench(client, args.name, args.sizes, args.forks, args.batch, args.snapshot_every)
    finally:
        await client.disconnect()
    print_report(report)
    print(f"Dashboard:   {args.url.rstrip('/')}/?q={args.name}  (the parents and their forks)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 1 if args.strict and report["ratio"] > TARGET_RATIO else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    with _connect.plainly("bench_fork.py", args.url):
        return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
