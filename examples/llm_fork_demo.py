"""A crashed agent forked and re-run from the start, without paying twice for its model calls.

    pip install -r requirements.txt openai && python examples/llm_fork_demo.py

Offline: it starts the tiny model server of examples/ (a deterministic OpenAI-compatible server on
loopback) and an Actae server of its own on a fresh data dir with that server as the upstream
`tiny`. The agent is a plain `openai.OpenAI` client whose only change is its base URL:

    OpenAI(base_url=f"{actae}/llm/runs/{run}/tiny/v1", api_key=<Actae key>)

It runs five steps (a model call each, then the step and its state recorded with the SDK) and
crashes at step 4. The run is forked after step 3 and the same agent code runs again on the fork,
from the start, with step 4's prompt fixed: steps 1 to 3's calls come back from the record (no
upstream request, `x-actae-replayed: true`), step 4's changed call and step 5's go to the upstream.
It prints what the re-run did not spend, as the gateway measured it, and exits 0 when every
promise held.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import tiny_model_server  # noqa: E402

PROMPTS = ["plan the trip", "book the flight", "book the hotel", "charge the card twice", "send the summary"]
FIXED = "charge the card once"
MODEL = "gpt-4o-mini"          # the tiny server answers as any model; this one genai-prices knows


def start_actae(data_dir: str, upstream: str, program: Path = HERE.parent / "actae.py") -> tuple:
    """`python actae.py` (or another checkout's `program`) on a free port with the tiny server as
    upstream `tiny`: (process, URL, key)."""
    process = subprocess.Popen(
        [sys.executable, str(program), "--port", "0", "--data-dir", data_dir,
         "--llm-upstream", f"tiny={upstream}", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={k: v for k, v in os.environ.items() if k not in ("ACTAE_API_KEY", "ACTAE_DATABASE_URL")})
    url = key = None
    for line in process.stdout:
        if match := re.match(r"Dashboard:\s+(\S+)", line):
            url = match.group(1)
        if match := re.match(r"API key:\s+(sk-\S+)", line):
            key = match.group(1)
            break
    if not (url and key):
        process.kill()
        raise SystemExit("llm_fork_demo: the server did not start")
    # Its log goes on (a line a request): read it, or the pipe fills and the server waits on it.
    threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
    return process, url, key


def agent(actae_url: str, key: str, run: str, prompts: list, crash_at: int | None) -> list:
    """The application: five model calls, each answer recorded as its step (state included). Returns
    (prompt, answer, replayed) per call made."""
    from actae_client import ActaeClient
    from openai import OpenAI

    llm = OpenAI(base_url=f"{actae_url}/llm/runs/{run}/tiny/v1", api_key=key, max_retries=0)
    made, messages = [], []

    async def record(step: int, answer: str) -> None:
        client = ActaeClient(endpoint=actae_url, api_key=key)
        try:
            event = await client.record(run, "step", {"answer": answer}, actor="agent", step_number=step)
            await client.save_state(run, event.cursor, {"step": step, "messages": messages})
        finally:
            await client.disconnect()
    for step, prompt in enumerate(prompts, start=1):
        if step == crash_at:
            raise RuntimeError(f"crashed at step {step}: '{prompt}' is a mistake")
        messages.append({"role": "user", "content": prompt})
        raw = llm.chat.completions.with_raw_response.create(model=MODEL, messages=messages)
        answer = raw.parse().choices[0].message.content
        messages.append({"role": "assistant", "content": answer})
        made.append((prompt, answer, raw.headers.get("x-actae-replayed") == "true"))
        asyncio.run(record(step, answer))
    return made


async def fork_after_step(actae_url: str, key: str, run: str, child: str, step: int) -> None:
    from actae_client import ActaeClient

    client = ActaeClient(endpoint=actae_url, api_key=key)
    try:
        _, cursor, _ = await client.resolve_step(run, step)
        await client.fork(run, child, cursor, reason=f"re-run with step {step + 1} fixed")
    finally:
        await client.disconnect()


def measured(actae_url: str, key: str, run: str) -> list:
    import httpx
    events = httpx.get(f"{actae_url}/api/v1/events/replay/{run}", params={"cursor": 0, "limit": 1000},
                       headers={"x-api-key": key}).json()["events"]
    return [e["payload"] for e in events if e["type"] == "llm.call"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", help="where the demo's server keeps its data (default: a fresh temporary dir)")
    args = parser.parse_args()
    model_server, stats = tiny_model_server.serve()
    upstream = f"http://127.0.0.1:{model_server.server_address[1]}"
    with tempfile.TemporaryDirectory(prefix="actae-llm-demo-") as scratch:
        process, url, key = start_actae(args.data_dir or scratch, upstream)
        try:
            return demo(url, key, stats)
        finally:
            process.terminate()
            process.wait(15)
            model_server.shutdown()


def demo(url: str, key: str, stats) -> int:
    run, child = f"demo-{uuid.uuid4().hex[:8]}", f"demo-fix-{uuid.uuid4().hex[:8]}"
    print(f"Actae at {url}; the agent's one change: OpenAI(base_url=\"{url}/llm/runs/{run}/tiny/v1\", ...)")
    try:
        agent(url, key, run, PROMPTS, crash_at=4)
    except RuntimeError as crash:
        print(f"run {run}: {crash}")
    calls_before = stats.calls
    asyncio.run(fork_after_step(url, key, run, child, 3))
    print(f"forked {run} after step 3 as {child}; the same agent runs again from the start on the fork")
    made = agent(url, key, child, PROMPTS[:3] + [FIXED] + PROMPTS[4:], crash_at=None)
    for step, (prompt, answer, replayed) in enumerate(made, start=1):
        print(f"  step {step}: {prompt!r:28} -> {answer!r:34} {'replayed from the record' if replayed else 'called upstream'}")
    upstream_calls = stats.calls - calls_before
    replays = [c for c in measured(url, key, child) if c["replayed"]]
    tokens_in = sum(c["saved"]["input_tokens"] or 0 for c in replays)
    tokens_out = sum(c["saved"]["output_tokens"] or 0 for c in replays)
    costs = [c["saved"]["cost"] for c in replays]
    cost = f"${sum(costs):.6f}" if costs and None not in costs else "an unknown amount"
    print(f"not spent again: {len(replays)} model calls, {tokens_in} tokens in, {tokens_out} out, {cost}"
          f" (measured by the gateway); upstream calls on the re-run: {upstream_calls}")
    checks = {
        "steps 1-3 replayed, 4-5 called upstream": [r for _, _, r in made] == [True, True, True, False, False],
        "the re-run made 2 upstream calls": upstream_calls == 2,
        "the replays' measured tokens are counted": len(replays) == 3 and tokens_in > 0 and tokens_out > 0,
    }
    for name, held in checks.items():
        print(f"{'PASS' if held else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
