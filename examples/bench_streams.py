"""What open instance-wide WebSocket subscribers cost the write path.

    python examples/bench_streams.py                   # the full run: about 4 minutes on 2 cores
    python examples/bench_streams.py --quick           # small sizes, one round: about 20 s
    python examples/bench_streams.py --baseline REF    # the baseline: our server as of REF (default cec2355)
    python examples/bench_streams.py --baseline none   # no baseline
    python examples/bench_streams.py --subscribers 0,10,200 --writers 8 --events 4000 --rounds 3
    python examples/bench_streams.py --json PATH       # where the report goes (default examples/out/bench-streams.json)

Systems: "ours" is the working tree's actae.py; "baseline" is our server as of REF, checked out with
`git worktree add --detach` into the bench's temporary folder (removed with `git worktree remove
--force` and `git worktree prune` at the end, also when the run fails) and started with the same
Python and the same flags (it needs no install: same dependencies). bench.py's conventions.

One measurement, for a system and a subscriber count N:

  server       a fresh `python <system>/actae.py --port 0 --data-dir <tmp>` (SQLite in a new data
               directory), its URL and new API key read from the `Dashboard:` and `API key:` lines
  warm-up      untimed: each writer records 5 events on its own channel (bench-<i>), so the channels
               exist and the timed writes are all appends; before any subscriber, so none sees them
  subscribers  N WebSocket connections to /ws, all in ONE separate process (asyncio, `websockets`,
               no per-message compression, as the SDK's aiohttp client asks for none), so their CPU
               is not the writer's. Each sends {"type":"auth","api_key":KEY} first, waits for the
               `connected` and `authenticated` frames, subscribes to every channel
               ({"type":"subscribe","topic":"*"}), waits for `subscribed`, then drains its frames
               and counts the broadcasts, checking that their positions only grow
  writes       W concurrent writers (default 8), each on one raw HTTP/1.1 keep-alive connection from
               this process, POST /api/v1/events/record (x-api-key) with {"channel_id": "bench-<i>",
               "event_type": "step", "payload": <a seeded, varied ~2 KB JSON document, bench.py's,
               the same bytes for every system>}, one request in flight per writer, E events in all
               (4,000; 600 with --quick). events/s = E ÷ the wall time from the first request sent
               to the last answer received
  delivery     then the bench waits until every subscriber has counted E broadcasts, or until no
               subscriber received anything for --settle seconds (default 5). "all frames arrived"
               means every subscriber counted exactly E broadcasts, in position order, none cut off.
               delivery lag = when the last subscriber got its last frame - the last write's answer
  server CPU   utime + stime of the server process (all threads, /proc/<pid>/stat), seconds per
               1,000 events: from the first write to the end of delivery (what the writes cost,
               the fan-out they caused included: ours fans out after the answer), and, as context,
               over the write window alone

Rounds (--rounds, default 3; 1 with --quick): each round measures every (system, N) once, the
systems in an order that rotates from round to round (bench.py's `rotated`); the tables show
medians over rounds, and "all frames arrived" only when it held in every round. Everything runs on
this machine: the server, the subscriber process and the writers share its cores, so absolute
figures move with the machine; the ratios are the point (ours ÷ baseline at the same N, and each
system at N ÷ itself at 0 subscribers). Nothing exits non-zero because of a figure; a measurement
that fails does.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (examples/bench.py: documents, /proc CPU, the git worktree helpers)

ROOT = bench.ROOT
DEFAULT_JSON = ROOT / "examples" / "out" / "bench-streams.json"
DEFAULT_BASELINE = "cec2355"
SYSTEMS = ("ours", "baseline")
RECORD_PATH = "/api/v1/events/record"
WARM_EVENTS = 5                        # untimed events per writer before any subscriber connects
START_TIMEOUT = 60.0                   # a server's banner and /healthz; a subscriber process's "ready"
WRITE_TIMEOUT = 120.0                  # one write's answer
DELIVERY_CAP = 120.0                   # however steady the progress, delivery waits no longer than this
POLL_SECONDS = 0.1


class Plan:
    def __init__(self, args: argparse.Namespace):
        self.quick = args.quick
        self.events = args.events or (600 if args.quick else 4000)
        self.rounds = args.rounds or (1 if args.quick else 3)
        self.writers = args.writers
        self.subscribers = args.subscribers
        self.settle = args.settle

    def asdict(self) -> dict:
        return {"quick": self.quick, "events": self.events, "rounds": self.rounds, "writers": self.writers,
                "subscribers": list(self.subscribers), "settle_seconds": self.settle,
                "warm_events_per_writer": WARM_EVENTS}


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


try:                                        # loaded here, so that a child between fork and exec only calls it
    PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):
    PRCTL = None


def die_with_parent() -> None:
    """In a child, before exec: killed when the bench dies, however it dies (Linux PR_SET_PDEATHSIG,
    1): the finally of main() covers every other ending."""
    if PRCTL is not None:
        PRCTL(1, signal.SIGKILL)


# =============================================================================
# The subscriber process (python bench_streams.py --subscriber-process URL KEY N)
# =============================================================================


class Stream:
    """One subscriber: its broadcasts counted, their positions checked to only grow."""

    def __init__(self):
        self.count = 0
        self.position = 0
        self.ordered = True
        self.unpositioned = 0                # broadcasts without a position (none expected on a "*" stream)
        self.last_at = 0.0
        self.closed: Optional[str] = None


POSITION = re.compile(rb'"position":\s*(\d+)')


async def subscribe(url: str, key: str, stream: Stream, ready: asyncio.Event, errors: list) -> None:
    from websockets.asyncio.client import connect

    ws_url = "ws" + url[len("http"):] + "/ws"
    try:
        async with connect(ws_url, compression=None, max_size=None, ping_interval=None,
                           open_timeout=START_TIMEOUT, close_timeout=2) as ws:
            first = json.loads(await ws.recv())
            if first.get("event") != "connected":
                raise RuntimeError(f"first frame was not `connected`: {first}")
            await ws.send(json.dumps({"type": "auth", "api_key": key}))
            answer = json.loads(await ws.recv())
            if answer.get("event") != "authenticated":
                raise RuntimeError(f"auth answered {answer}")
            await ws.send(json.dumps({"type": "subscribe", "topic": "*", "request_id": "r1"}))
            while True:
                frame = json.loads(await ws.recv())
                if frame.get("event") == "subscribed":
                    break
                if frame.get("type") == "error":
                    raise RuntimeError(f"subscribe answered {frame}")
            ready.set()
            while True:
                data = await ws.recv(decode=False)
                if data.startswith(b'{"type":"broadcast"') or b'"broadcast"' in data[:48]:
                    stream.count += 1
                    stream.last_at = time.monotonic()
                    tail = data.rfind(b'"position"')
                    match = POSITION.match(data, tail) if tail >= 0 else None
                    if match:
                        position = int(match.group(1))
                        if position <= stream.position:
                            stream.ordered = False
                        stream.position = position
                    else:
                        stream.unpositioned += 1
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the bench decides what it means
        code = getattr(getattr(exc, "rcvd", None), "code", None)
        stream.closed = f"{type(exc).__name__}: {exc}" + (f" (code {code})" if code else "")
        if not ready.is_set():
            errors.append(stream.closed)
            ready.set()


async def subscriber_main(url: str, key: str, count: int) -> int:
    streams = [Stream() for _ in range(count)]
    errors: list = []
    readies = [asyncio.Event() for _ in range(count)]
    tasks = []
    for i, stream in enumerate(streams):                 # a few at a time: a burst of handshakes is no test
        tasks.append(asyncio.create_task(subscribe(url, key, stream, readies[i], errors)))
        if i % 25 == 24:
            await asyncio.gather(*(r.wait() for r in readies[:i + 1]))
    await asyncio.gather(*(r.wait() for r in readies))
    out = sys.stdout
    if errors:
        out.write(json.dumps({"ready": False, "errors": errors[:5]}) + "\n")
        out.flush()
        return 1
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()

    loop = asyncio.get_running_loop()
    commands: asyncio.Queue = asyncio.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(commands.put_nowait, line.strip())
        loop.call_soon_threadsafe(commands.put_nowait, "quit")    # the bench went away

    threading.Thread(target=read_stdin, daemon=True).start()
    while (command := await commands.get()) != "quit":
        if command == "status":
            counts = [s.count for s in streams]
            out.write(json.dumps({
                "min": min(counts), "max": max(counts), "total": sum(counts),
                "ordered": all(s.ordered for s in streams),
                "unpositioned": sum(s.unpositioned for s in streams),
                "last_at": max(s.last_at for s in streams),
                "closed": [s.closed for s in streams if s.closed][:5],
                "closed_count": sum(1 for s in streams if s.closed),
                "cpu_seconds": time.process_time(),
            }) + "\n")
            out.flush()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return 0


# =============================================================================
# The bench's children: servers and the subscriber process
# =============================================================================


def start_server(root: Path, data_dir: Path) -> "bench.Server":
    """`python <root>/actae.py --port 0 --data-dir DIR` as bench.py starts its servers: output drained
    so it never blocks, its URL and new key read off the lines it prints."""
    server = bench.Server(f"actae ({root.name})", [sys.executable, str(root / "actae.py"), "--port", "0", "--data-dir",
                                                    str(data_dir)], {"url": bench.URL_LINE, "key": bench.KEY_LINE},
                          cwd=root).wait(START_TIMEOUT)
    server.url, server.key = server.found["url"], server.found["key"]
    return server


class Subscribers:
    """The subscriber process: N streams, asked for their counts over its stdin/stdout."""

    def __init__(self, url: str, key: str, count: int):
        self.count = count
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--subscriber-process",
                                      url, key, str(count)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, preexec_fn=die_with_parent)
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        self._lines: list = []
        self._line = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._line:
                self._lines.append(line)
                self._line.notify_all()
        with self._line:
            self._lines.append(None)
            self._line.notify_all()

    def _next(self, timeout: float) -> dict:
        with self._line:
            if not self._line.wait_for(lambda: self._lines, timeout):
                raise RuntimeError(f"the subscriber process said nothing in {timeout:.0f} s")
            line = self._lines.pop(0)
        if line is None:
            raise RuntimeError("the subscriber process exited:\n" + "".join(self.stderr[-20:]))
        return json.loads(line)

    def wait_ready(self) -> None:
        answer = self._next(START_TIMEOUT)
        if not answer.get("ready"):
            raise RuntimeError(f"the subscribers could not subscribe: {answer.get('errors')}")

    def status(self) -> dict:
        self.proc.stdin.write("status\n")
        self.proc.stdin.flush()
        return self._next(30.0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# =============================================================================
# The writers: raw HTTP/1.1 keep-alive connections
# =============================================================================


def request_bytes(host: str, key: str, body: bytes) -> bytes:
    return (f"POST {RECORD_PATH} HTTP/1.1\r\nHost: {host}\r\nx-api-key: {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """(status, body, whether the server keeps the connection open) of one HTTP/1.1 answer."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = b""
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            body += await reader.readexactly(size + 2)
        await reader.readuntil(b"\r\n")
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, body, headers.get("connection", "").lower() != "close"


async def write_events(url: str, key: str, bodies: list[list[bytes]]) -> dict:
    """Writer i sends bodies[i] one after another on its own connection; timing from the first
    request sent to the last answer received."""
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port
    connections = [await asyncio.open_connection(host, port) for _ in bodies]
    header_host = f"{host}:{port}"
    failures: list = []

    async def writer(i: int) -> None:
        reader, stream = connections[i]
        for body in bodies[i]:
            stream.write(request_bytes(header_host, key, body))
            status, answer, keep = await asyncio.wait_for(read_answer(reader), WRITE_TIMEOUT)
            if status != 200:
                failures.append(f"{status}: {answer[:200]!r}")
                return
            if not keep:
                stream.close()
                reader, stream = connections[i] = await asyncio.open_connection(host, port)

    started = time.monotonic()
    await asyncio.gather(*(writer(i) for i in range(len(bodies))))
    finished = time.monotonic()
    for _, stream in connections:
        stream.close()
    if failures:
        raise RuntimeError(f"{len(failures)} writer(s) failed; the first: {failures[0]}")
    return {"started": started, "finished": finished}


def spread(bodies: list[bytes], writers: int) -> list[list[bytes]]:
    return [bodies[i::writers] for i in range(writers)]


def event_bodies(channel_of: list[str], docs: list[dict]) -> list[bytes]:
    return [bench.compact({"channel_id": channel, "event_type": "step", "payload": doc}).encode()
            for channel, doc in zip(channel_of, docs, strict=True)]


# =============================================================================
# One measurement, the rounds, the report
# =============================================================================


class Bench:
    def __init__(self, plan: Plan, folder: Path, roots: dict):
        self.plan, self.folder, self.roots = plan, folder, roots
        self.children: list = []
        docs = bench.make_docs("bench-streams", plan.events)
        channels = [f"bench-{i % plan.writers}" for i in range(plan.events)]
        self.bodies = spread(event_bodies(channels, docs), plan.writers)
        warm_docs = bench.make_docs("bench-streams-warm", WARM_EVENTS * plan.writers)
        warm_channels = [f"bench-{i % plan.writers}" for i in range(len(warm_docs))]
        self.warm_bodies = spread(event_bodies(warm_channels, warm_docs), plan.writers)
        self.doc_bytes = bench.doc_bytes(docs) / len(docs)

    def measure(self, system: str, subscribers: int, number: int) -> dict:
        plan = self.plan
        data_dir = self.folder / f"data-{system}-{subscribers}-r{number}"
        source = hashlib.sha1((self.roots[system] / "actae.py").read_bytes()).hexdigest()[:12]
        server = start_server(self.roots[system], data_dir)
        self.children.append(server)
        subs: Optional[Subscribers] = None
        try:
            server.wait()
            asyncio.run(write_events(server.url, server.key, self.warm_bodies))
            if subscribers:
                subs = Subscribers(server.url, server.key, subscribers)
                self.children.append(subs)
                subs.wait_ready()
            cpu_before, ticks_before = bench.cpu_seconds(server.pid), bench.machine_ticks()
            sub_cpu_before = subs.status()["cpu_seconds"] if subs else 0.0
            timing = asyncio.run(write_events(server.url, server.key, self.bodies))
            cpu_writes = bench.cpu_seconds(server.pid) - cpu_before
            busy = bench.cores_busy(ticks_before, bench.machine_ticks())
            wall = timing["finished"] - timing["started"]
            result = {"system": system, "subscribers": subscribers, "round": number, "events": plan.events,
                      "actae_py_sha1": source,
                      "wall_seconds": wall, "events_per_s": plan.events / wall,
                      "server_cpu_s_per_1k_events_writes": cpu_writes / plan.events * 1000}
            if subs:
                status, lag = self.delivered(subs, timing["finished"])
                result.update(delivery_lag_s=lag, frames_min=status["min"], frames_max=status["max"],
                              frames_total=status["total"], ordered=status["ordered"],
                              unpositioned_frames=status["unpositioned"],
                              closed_streams=status["closed_count"], closed_examples=status["closed"],
                              subscriber_cpu_seconds=status["cpu_seconds"] - sub_cpu_before,
                              all_frames_arrived=(status["min"] == status["max"] == plan.events and status["ordered"]
                                                  and not status["closed_count"]))
            else:
                result.update(delivery_lag_s=None, all_frames_arrived=True)
            cpu_all = bench.cpu_seconds(server.pid) - cpu_before
            result["server_cpu_s_per_1k_events"] = cpu_all / plan.events * 1000
            result["machine_cores_busy_writes"] = busy
            return result
        finally:
            if subs:
                subs.stop()
            server.stop()
            shutil.rmtree(data_dir, ignore_errors=True)

    def delivered(self, subs: Subscribers, writes_done: float) -> tuple[dict, Optional[float]]:
        """Wait until every stream has every event, or none moved for --settle seconds (or the cap)."""
        target = self.plan.events
        last_total, moved_at = -1, time.monotonic()
        while True:
            status = subs.status()
            now = time.monotonic()
            if status["min"] >= target or status["closed_count"] == subs.count:
                break                                 # all there, or every stream gone: no more will come
            if status["total"] != last_total:
                last_total, moved_at = status["total"], now
            if now - moved_at > self.plan.settle or now - writes_done > DELIVERY_CAP:
                break
            time.sleep(POLL_SECONDS)
        complete = status["min"] >= target
        return status, (max(0.0, status["last_at"] - writes_done) if complete else None)


def median(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(rows: list[dict], systems: list[str], counts: list[int]) -> dict:
    results: dict = {}
    for system in systems:
        results[system] = {}
        for n in counts:
            mine = [r for r in rows if r["system"] == system and r["subscribers"] == n]
            results[system][str(n)] = {
                "events_per_s": median([r["events_per_s"] for r in mine]),
                "events_per_s_rounds": [round(r["events_per_s"], 1) for r in mine],
                "server_cpu_s_per_1k_events": median([r["server_cpu_s_per_1k_events"] for r in mine]),
                "server_cpu_s_per_1k_events_writes": median([r["server_cpu_s_per_1k_events_writes"] for r in mine]),
                "machine_cores_busy_writes": median([r["machine_cores_busy_writes"] for r in mine]),
                "subscriber_cpu_s_per_1k_events": median([r["subscriber_cpu_seconds"] / r["events"] * 1000
                                                          for r in mine]) if n else None,
                "delivery_lag_s": median([r["delivery_lag_s"] for r in mine]) if n else None,
                "all_frames_arrived": all(r["all_frames_arrived"] for r in mine),
                "rounds": len(mine),
            }
    return results


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def ratios(results: dict, counts: list[int]) -> dict:
    zero = str(min(counts))
    out: dict = {"vs_fewest_subscribers": {}, "ours_over_baseline": {}}
    for system, by_count in results.items():
        out["vs_fewest_subscribers"][system] = {str(n): ratio(by_count[str(n)]["events_per_s"], by_count[zero]["events_per_s"])
                                                for n in counts}
    if "baseline" in results:
        for n in counts:
            ours, base = results["ours"][str(n)], results["baseline"][str(n)]
            out["ours_over_baseline"][str(n)] = {
                "events_per_s": ratio(ours["events_per_s"], base["events_per_s"]),
                "server_cpu_s_per_1k_events": ratio(ours["server_cpu_s_per_1k_events"], base["server_cpu_s_per_1k_events"]),
            }
    return out


def fmt(value: Optional[float], digits: int = 0, suffix: str = "") -> str:
    if value is None:
        return "—"
    return f"{value:,.{digits}f}{suffix}"


def arrived(result: dict, n: int) -> str:
    if n == 0:
        return "n/a (none open)"
    return "yes" if result["all_frames_arrived"] else "**NO**"


def tables(results: dict, rat: dict, counts: list[int], plan: Plan, baseline_label: Optional[str]) -> str:
    zero = min(counts)
    base = "baseline" in results
    bl = baseline_label or "baseline"
    lines = [f"Write rate: {plan.events:,} events by {plan.writers} writers, medians of {plan.rounds} round(s)"
             f" (ratios vs {zero} subscribers: each system against itself)", ""]
    head = ["subscribers", "ours events/s"]
    if base:
        head += [f"baseline ({bl}) events/s", "ours ÷ baseline"]
    head += [f"ours ÷ ours@{zero}"]
    if base:
        head += [f"baseline ÷ baseline@{zero}"]
    head += ["all frames arrived (ours)"] + (["all frames arrived (baseline)"] if base else [])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in counts:
        ours = results["ours"][str(n)]
        row = [str(n), fmt(ours["events_per_s"])]
        if base:
            b = results["baseline"][str(n)]
            row += [fmt(b["events_per_s"]), fmt(rat["ours_over_baseline"][str(n)]["events_per_s"], 2)]
        row += [fmt(rat["vs_fewest_subscribers"]["ours"][str(n)], 2)]
        if base:
            row += [fmt(rat["vs_fewest_subscribers"]["baseline"][str(n)], 2)]
        row += [arrived(ours, n)] + ([arrived(results["baseline"][str(n)], n)] if base else [])
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Server CPU seconds per 1,000 events (first write to end of delivery; write window alone in"
              " brackets), delivery lag (last frame at the last subscriber after the last write's answer) and"
              f" the machine's busy cores (of {os.cpu_count()}, every process, over the write window)", ""]
    head = ["subscribers", "ours CPU s/1k"]
    if base:
        head += ["baseline CPU s/1k", "ours ÷ baseline"]
    head += ["ours lag s"] + (["baseline lag s"] if base else [])
    head += ["cores busy, ours"] + (["cores busy, baseline"] if base else [])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in counts:
        ours = results["ours"][str(n)]
        row = [str(n), f'{fmt(ours["server_cpu_s_per_1k_events"], 2)} ({fmt(ours["server_cpu_s_per_1k_events_writes"], 2)})']
        if base:
            b = results["baseline"][str(n)]
            row += [f'{fmt(b["server_cpu_s_per_1k_events"], 2)} ({fmt(b["server_cpu_s_per_1k_events_writes"], 2)})',
                    fmt(rat["ours_over_baseline"][str(n)]["server_cpu_s_per_1k_events"], 2)]
        row += [fmt(ours["delivery_lag_s"], 2) if n else "—"]
        if base:
            row += [fmt(results["baseline"][str(n)]["delivery_lag_s"], 2) if n else "—"]
        row += [fmt(results[s][str(n)]["machine_cores_busy_writes"], 2) for s in (["ours", "baseline"] if base else ["ours"])]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def counts_arg(text: str) -> list[int]:
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of whole numbers: {text!r}") from None
    if not counts or counts[0] < 0:
        raise argparse.ArgumentTypeError("give at least one count, none negative")
    return counts


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="600 events, 1 round: under a minute")
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, metavar="REF",
                        help=f"also measure our server as of REF (default {DEFAULT_BASELINE}); none: skip it")
    parser.add_argument("--subscribers", type=counts_arg, default=[0, 10, 200], metavar="N,N,...",
                        help="subscriber counts (default 0,10,200)")
    parser.add_argument("--writers", type=int, default=8, help="concurrent writers (default 8)")
    parser.add_argument("--events", type=int, default=None, help="events per measurement (default 4000; 600 with --quick)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3; 1 with --quick)")
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds without a frame after which delivery is over (default 5)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, metavar="PATH",
                        help=f"the report (default {DEFAULT_JSON.relative_to(ROOT)})")
    parser.add_argument("--dir", type=Path, default=None, help="where the temporary folder goes")
    args = parser.parse_args(argv)
    if args.writers < 1 or (args.events is not None and args.events < args.writers) or (args.rounds is not None and args.rounds < 1):
        parser.error("--writers, --rounds must be at least 1 and --events at least --writers")
    return args


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--subscriber-process"]:
        url, key, count = argv[1], argv[2], int(argv[3])
        return asyncio.run(subscriber_main(url, key, count))

    args = parse_args(argv)
    plan = Plan(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))        # so the cleanup below runs
    folder = Path(tempfile.mkdtemp(prefix="bench-streams-", dir=args.dir))
    baseline, why = bench.resolve_baseline(args.baseline)
    the_bench: Optional[Bench] = None
    started, load_before = time.monotonic(), os.getloadavg()
    try:
        if baseline is not None and (failed := bench.add_worktree(baseline, folder)):
            baseline, why = None, f"git worktree add of {baseline.short} failed: {failed}"
        roots = {"ours": ROOT, **({"baseline": baseline.root} if baseline else {})}
        systems = list(roots)
        say(f"ours: {ROOT}/actae.py; baseline: "
            + (f"{baseline.describe()} at {baseline.worktree}" if baseline else f"none ({why})"))
        the_bench = Bench(plan, folder, roots)
        rows: list[dict] = []
        for number in range(plan.rounds):
            for system in bench.rotated(systems, number):
                for n in plan.subscribers:
                    row = the_bench.measure(system, n, number)
                    rows.append(row)
                    say(f"round {number + 1}/{plan.rounds} {system:8} {n:4} subscribers: "
                        f"{row['events_per_s']:8,.0f} events/s, server CPU {row['server_cpu_s_per_1k_events']:.2f} s/1k"
                        + (f", frames {row['frames_min']}..{row['frames_max']} of {plan.events}"
                           f"{'' if row['all_frames_arrived'] else ' INCOMPLETE'}"
                           + (f", lag {row['delivery_lag_s']:.2f} s" if row['delivery_lag_s'] is not None else "")
                           if n else ""))
        results = summarize(rows, systems, plan.subscribers)
        rat = ratios(results, plan.subscribers)
        table = tables(results, rat, plan.subscribers, plan, baseline.short if baseline else None)
        head = bench.git("rev-parse", "--short", "HEAD")
        dirty = bool(bench.git("status", "--porcelain", "--", "actae.py"))
        # Another hand may edit actae.py while the bench runs: say which versions ours measured.
        versions = sorted({r["actae_py_sha1"] for r in rows if r["system"] == "ours"})
        if len(versions) > 1:
            table += (f"\n\nWARNING: the working tree's actae.py changed during the run: ours measured"
                      f" {len(versions)} versions of it ({', '.join(versions)}; sha1 per measurement in the report)")
        report = {
            "meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                     "ours": {"head": head, "actae_py_modified": dirty, "actae_py_sha1": versions},
                     "baseline": ({"ref": baseline.ref, "commit": baseline.commit, "short": baseline.short,
                                   "source": baseline.source} if baseline else None),
                     "baseline_skipped": None if baseline else why,
                     "plan": plan.asdict(), "doc_bytes": round(the_bench.doc_bytes),
                     "python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
                     "loadavg_before": [round(x, 2) for x in load_before],
                     "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                     "seconds": round(time.monotonic() - started, 1)},
            "results": results,
            "ratios": rat,
            "measurements": rows,
            "table": table,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(table)
        print(f"\nreport: {args.json}  ({report['meta']['seconds']:.0f} s)")
        return 0
    finally:
        for child in reversed(the_bench.children if the_bench else []):
            with contextlib.suppress(Exception):
                child.stop()
        if baseline is not None and baseline.worktree is not None:
            bench.remove_worktree(baseline.worktree)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
