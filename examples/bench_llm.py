"""What the model-call gateway adds to a call: the same loopback upstream (the tiny model server of
examples/) called directly and through the gateway, non-streamed and streamed; and through the
gateway as of another commit (the baseline), in the same run.

    python examples/bench_llm.py [--calls 300] [--baseline REF|none] [--json examples/out/bench-llm.json]

Each figure is the median (and p90) of `--calls` sequential calls over one kept-alive connection:
a non-streamed call's whole time, and a streamed call's time to its first byte, the direct call and
each server's interleaved so that all see the same machine. Through the gateway every call is live
(each prompt differs, so nothing is replayed) and recorded: decided before it is sent, its bodies
and llm.call event written (one durable commit) before the answer is handed on. A replayed call
(the record answers, no upstream) is measured too. Each server is `actae.py` on a fresh SQLite data
dir (examples/llm_fork_demo.py's start_actae). The baseline is chosen as examples/bench.py chooses
its own (--baseline: the newest tag, else the newest commit before HEAD that changed actae.py), from
a git worktree; one without the gateway is left out, saying so.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402
import tiny_model_server  # noqa: E402
from llm_fork_demo import start_actae  # noqa: E402


def body(n: int, streamed: bool) -> dict:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"call number {n} of the bench"}],
            "stream": streamed}


def whole_call(client, url: str, n: int, headers: dict) -> float:
    started = time.perf_counter()
    answer = client.post(url, json=body(n, False), headers=headers)
    answer.raise_for_status()
    return (time.perf_counter() - started) * 1000


def first_byte(client, url: str, n: int, headers: dict) -> float:
    started = time.perf_counter()
    elapsed = None
    with client.stream("POST", url, json=body(n, True), headers=headers) as answer:
        answer.raise_for_status()
        for _ in answer.iter_raw():
            if elapsed is None:
                elapsed = (time.perf_counter() - started) * 1000
    return elapsed


def figures(samples: list) -> dict:
    ordered = sorted(samples)
    return {"median_ms": round(statistics.median(ordered), 3), "p90_ms": round(ordered[int(len(ordered) * 0.9) - 1], 3)}


class Gateway:
    """One Actae server in the run: its process, and where its gateway and API answer."""

    def __init__(self, label: str, process, url: str, key: str, worktree: Path | None = None):
        self.label, self.process, self.url, self.key, self.worktree = label, process, url, key, worktree
        self.run = f"bench-{uuid.uuid4().hex[:8]}"
        self.auth = {"authorization": f"Bearer {key}"}

    def calls(self, run: str | None = None) -> str:
        return f"{self.url}/llm/runs/{run or self.run}/tiny/v1/chat/completions"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(15)
        if self.worktree is not None:
            bench.remove_worktree(self.worktree)


def start_baseline(asked: str, scratch: Path, upstream: str) -> tuple:
    """(the baseline's Gateway, or None, and what to say of it)."""
    baseline, why = bench.resolve_baseline(asked)
    if baseline is None:
        return None, f"no baseline: {why}"
    failed = bench.add_worktree(baseline, scratch)
    if failed:
        return None, f"no baseline: {failed}"
    try:
        process, url, key = start_actae(str(scratch / "baseline-data"), upstream, baseline.root / "actae.py")
    except BaseException:
        bench.remove_worktree(baseline.worktree)
        raise
    gateway = Gateway(f"baseline {baseline.short}", process, url, key, baseline.worktree)
    import httpx
    probe = httpx.post(gateway.calls(), json=body(-1, False), headers=gateway.auth, timeout=30)
    if probe.status_code != 200:
        gateway.stop()
        return None, f"no baseline: {baseline.describe()} has no model-call gateway (it answered {probe.status_code})"
    return gateway, f"baseline: {baseline.describe()}"


def replayed_calls(client, gateway: Gateway, count: int) -> list:
    """A fresh run per call, forked after its one call: the fork's same call is answered from the record."""
    replayed = []
    for n in range(count):
        source, child = f"{gateway.run}-r{n}", f"{gateway.run}-again-{n}"
        whole_call(client, gateway.calls(source), n, gateway.auth)
        client.post(f"{gateway.url}/api/v1/state/{source}", headers={"x-api-key": gateway.key},
                    json={"cursor": 1, "state": {"n": n}}).raise_for_status()
        client.post(f"{gateway.url}/api/v1/channels/fork", headers={"x-api-key": gateway.key},
                    json={"source_channel_id": source, "new_channel_id": child, "at_cursor": 1}).raise_for_status()
        replayed.append(whole_call(client, gateway.calls(child), n, gateway.auth))
    return replayed


def main() -> int:
    import httpx

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--baseline", default=bench.BASELINE_AUTO, metavar="REF",
                        help="also measure the gateway as of REF (default: as examples/bench.py chooses); none: not")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    model_server, _ = tiny_model_server.serve()
    upstream = f"http://127.0.0.1:{model_server.server_address[1]}"
    direct = f"{upstream}/v1/chat/completions"
    gateways: list = []
    with tempfile.TemporaryDirectory(prefix="actae-llm-bench-") as scratch:
        try:
            process, url, key = start_actae(str(Path(scratch) / "data"), upstream)
            gateways.append(Gateway("ours", process, url, key))
            other, said = start_baseline(args.baseline, Path(scratch), upstream)
            print(said)
            gateways += [other] if other else []
            results = {}
            with httpx.Client(timeout=30) as client:
                for warm in range(20):
                    whole_call(client, direct, warm, {})
                    for gateway in gateways:
                        whole_call(client, gateway.calls(), -1 - warm, gateway.auth)
                for name, measure in (("call", whole_call), ("first_byte", first_byte)):
                    theirs, ours = [], {gateway.label: [] for gateway in gateways}
                    for n in range(args.calls):           # interleaved: all see the same machine
                        theirs.append(measure(client, direct, n, {}))
                        for gateway in gateways:
                            ours[gateway.label].append(
                                measure(client, gateway.calls(), 10_000 * (name == "first_byte") + n, gateway.auth))
                    results[name] = {"direct": figures(theirs), **{
                        label: {**figures(samples), "added_median_ms":
                                round(statistics.median(samples) - statistics.median(theirs), 3)}
                        for label, samples in ours.items()}}
                results["replayed_call"] = {gateway.label: figures(replayed_calls(client, gateway, min(args.calls, 100)))
                                            for gateway in gateways}
        finally:
            for gateway in gateways:
                gateway.stop()
            model_server.shutdown()
    report(results, [gateway.label for gateway in gateways])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"calls": args.calls, **results}, indent=2))
    return 0


def report(results: dict, labels: list) -> None:
    for name, label in (("call", "a non-streamed call"), ("first_byte", "a streamed call's first byte")):
        r = results[name]
        print(f"{label}: direct {r['direct']['median_ms']:.2f} ms (p90 {r['direct']['p90_ms']:.2f})")
        for system in labels:
            print(f"  through the gateway, {system:18} {r[system]['median_ms']:6.2f} ms (p90 {r[system]['p90_ms']:.2f}):"
                  f" +{r[system]['added_median_ms']:.2f} ms at the median")
        if len(labels) > 1:
            print(f"  added, ours / baseline: {r['ours']['added_median_ms'] / r[labels[1]]['added_median_ms']:.2f}")
    for system in labels:
        replayed = results["replayed_call"][system]
        print(f"a replayed call (no upstream), {system:18} {replayed['median_ms']:6.2f} ms (p90 {replayed['p90_ms']:.2f})")


if __name__ == "__main__":
    sys.exit(main())
