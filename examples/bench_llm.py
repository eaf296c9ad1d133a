"""What the model-call gateway adds to a call: the same loopback upstream (the tiny model server of
examples/) called directly and through the gateway, non-streamed and streamed.

    python examples/bench_llm.py [--calls 300] [--json examples/out/bench-llm.json]

Each figure is the median (and p90) of `--calls` sequential calls over one kept-alive connection:
a non-streamed call's whole time, and a streamed call's time to its first byte. Through the gateway
every call is live (each prompt differs, so nothing is replayed) and recorded: claimed in the run's
transaction before it is sent, its bodies and llm.call event written after. A replayed call (the
record answers, no upstream) is measured too. It starts its own Actae server on a fresh SQLite data
dir (examples/llm_fork_demo.py's start_actae) and prints the overheads in milliseconds.
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


def main() -> int:
    import httpx

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    model_server, _ = tiny_model_server.serve()
    upstream = f"http://127.0.0.1:{model_server.server_address[1]}"
    with tempfile.TemporaryDirectory(prefix="actae-llm-bench-") as scratch:
        process, actae_url, key = start_actae(scratch, upstream)
        try:
            run = f"bench-{uuid.uuid4().hex[:8]}"
            gateway = f"{actae_url}/llm/runs/{run}/tiny/v1/chat/completions"
            direct = f"{upstream}/v1/chat/completions"
            auth = {"authorization": f"Bearer {key}"}
            results = {}
            with httpx.Client(timeout=30) as client:
                for warm in range(20):
                    whole_call(client, direct, warm, {})
                    whole_call(client, gateway, -1 - warm, auth)
                for name, measure in (("call", whole_call), ("first_byte", first_byte)):
                    ours, theirs = [], []
                    for n in range(args.calls):           # interleaved: both see the same machine
                        theirs.append(measure(client, direct, n, {}))
                        ours.append(measure(client, gateway, 10_000 * (name == "first_byte") + n, auth))
                    results[name] = {"direct": figures(theirs), "gateway": figures(ours),
                                     "added_median_ms": round(statistics.median(ours) - statistics.median(theirs), 3)}
                fork = f"{run}-again"
                replayed = []
                for n in range(min(args.calls, 100)):     # a fresh run per call: each is a first call's replay
                    source, child = f"{run}-r{n}", f"{fork}-{n}"
                    whole_call(client, f"{actae_url}/llm/runs/{source}/tiny/v1/chat/completions", n, auth)
                    client.post(f"{actae_url}/api/v1/state/{source}", headers={"x-api-key": key},
                                json={"cursor": 1, "state": {"n": n}}).raise_for_status()
                    client.post(f"{actae_url}/api/v1/channels/fork", headers={"x-api-key": key},
                                json={"source_channel_id": source, "new_channel_id": child,
                                      "at_cursor": 1}).raise_for_status()
                    replayed.append(whole_call(client, f"{actae_url}/llm/runs/{child}/tiny/v1/chat/completions", n, auth))
                results["replayed_call"] = figures(replayed)
        finally:
            process.terminate()
            process.wait(15)
            model_server.shutdown()
    for name, label in (("call", "a non-streamed call"), ("first_byte", "a streamed call's first byte")):
        r = results[name]
        print(f"{label:32} direct {r['direct']['median_ms']:7.2f} ms (p90 {r['direct']['p90_ms']:.2f}),"
              f" through the gateway {r['gateway']['median_ms']:7.2f} ms (p90 {r['gateway']['p90_ms']:.2f}):"
              f" +{r['added_median_ms']:.2f} ms at the median")
    print(f"{'a replayed call (no upstream)':32} {results['replayed_call']['median_ms']:7.2f} ms"
          f" (p90 {results['replayed_call']['p90_ms']:.2f})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"calls": args.calls, **results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
