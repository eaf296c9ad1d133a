"""After an outage: fork every run that failed, each after its own last good step, and finish them.

    ACTAE_URL=http://127.0.0.1:8002 ACTAE_API_KEY=sk-... python examples/fork_failed.py

Ten runs of an 8-step invoicing agent run inside `AgentSession`s that snapshot their state after
every step; each charges its customer at step 1 through the execution ledger. A model outage hits
six of them at different steps, the three ways agents report it: the process raises (the session
records a crash), the agent records a `run.failed` event, or it saves a state whose status is
`failed`. Four complete.

Then one request, `POST /api/v1/forks/bulk`, forks every run that went wrong (status failed or
crashed) whose failure mentions the outage, each after its own last good step, with the
intervention `{"model": "fallback"}` and the tool policy `{"charge_customer": "block"}`: first as
a dry run (it lists the forks and makes none), then for real under an operation id, then again
(the same answer, nothing new). Each fork is continued by `AgentSession.resume(client, fork)`,
as a worker process would: it starts from the inherited state, applies the intervention, and runs
the remaining steps to completion; its attempt to charge again is refused by the policy, so the
ledger shows one charge per original run.

Channel names get a random prefix (or `--name`). Prints every check as PASS/FAIL and exits 0 only
when all of them hold.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import uuid
from pathlib import Path

import aiohttp
from actae_client import ActaeClient, AgentSession, ForkToolBlockedError

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _connect  # noqa: E402  (examples/_connect.py: one line, not a traceback, for a refused key or a wrong address)

STEPS = 8
# (how the run goes wrong, the step after which it does), for the six that fail; four complete.
OUTAGES = [("crash", 1), ("event", 2), ("state", 3), ("crash", 4), ("event", 5), ("crash", 6)]
RUNS = 10
POLICIES = {"charge_customer": "block"}
INTERVENTION = {"model": "fallback"}


def canonical_sha256(state) -> str:
    """The lowercase hex SHA-256 of `state` as canonical JSON: what a receipt quotes."""
    text = json.dumps(state, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def work(state: dict, step: int, model: str) -> dict:
    """A stand-in for one model call: the step's note goes into the state; returns the step's output."""
    note = f"line {step} priced by {model}"
    state["lines"].append(note)
    state["done"] = step
    return {"note": note, "model": model}


async def charge(client: ActaeClient, channel: str, key: str) -> str:
    """Charge the customer once, through the ledger: 'charged', 'replayed', or 'blocked' on a fork."""
    try:
        claim = await client.claim_execution(channel, key, "charge_customer", {"amount_cents": 4900})
    except ForkToolBlockedError:
        return "blocked"
    if claim.status == "replayed":
        return "replayed"
    await client.complete_execution(claim.execution.id, claim.claim_token, {"charge_id": f"ch-{key}"})
    return "charged"


async def original_run(client: ActaeClient, name: str, outage) -> None:
    """One run of the agent; `outage` is (how, after which step) or None."""
    state = {"status": "running", "model": "primary", "lines": [], "done": 0, "charged": None}
    session = AgentSession(client, name, state_fn=lambda: json.loads(json.dumps(state)), snapshot_interval=1,
                           params={"customer": name})
    try:
        async with session:
            for step in range(1, STEPS + 1):
                if step == 1:
                    state["charged"] = await charge(client, name, f"charge-{name}")
                if outage == ("state", step - 1):          # this step's state says it failed
                    state.update(status="failed", error="model outage: 503 from the primary model")
                    await session.step("price", input={"step": step}, output={"error": "model outage"})
                    return
                await session.step("price", input={"step": step}, output=work(state, step, "primary"))
                if outage == ("crash", step):
                    raise RuntimeError("model outage: 503 from the primary model")
                if outage == ("event", step):
                    await client.record(name, "run.failed", {"error": "model outage: 503 from the primary model"},
                                        actor="agent")
                    return
            state["status"] = "completed"
            await client.save_state(name, (await client.latest_cursor(name)) or 0, json.loads(json.dumps(state)))
    except RuntimeError:
        pass                                              # the session recorded the crash


async def continue_fork(client: ActaeClient, fork: str, source: str) -> dict:
    """What a worker does with a fork: resume it, apply its intervention, run the rest to completion."""
    holder: dict = {}
    session = await AgentSession.resume(client, fork, state_fn=lambda: json.loads(json.dumps(holder["state"])))
    holder["state"] = state = dict(session.inherited_state or {})
    model = session.intervention.get("model", "primary")
    state.update(status="running", model=model)
    state.pop("error", None)
    first = session.step_count + 1
    async with session:
        state["charged_again"] = await charge(client, fork, f"charge-{source}")
        for step in range(first, STEPS + 1):
            await session.step("price", input={"step": step}, output=work(state, step, model))
        state["status"] = "completed"
    return {"fork": fork, "first_step": first, "charge": state["charged_again"], "lines": len(state["lines"])}


async def bulk_fork(http: aiohttp.ClientSession, url: str, key: str, body: dict) -> dict:
    async with http.post(f"{url}/api/v1/forks/bulk", json=body, headers={"x-api-key": key}) as response:
        answer = await response.json()
        if response.status != 200:
            raise RuntimeError(f"bulk fork answered {response.status}: {answer}")
        return answer


async def state_at_step(client: ActaeClient, channel: str, step: int):
    """The state `channel` saved with step `step` (read back independently of any receipt)."""
    events = await client.replay(channel, cursor=0, limit=500)
    cursor = next(e.cursor for e in events if e.payload and e.payload.get("step_number") == step)
    versions = await client.list_states(channel, limit=100)
    version = max(v["version"] for v in versions if v["cursor"] == cursor)
    return (await client.get_state(channel, version))["state"]


async def walkthrough(client: ActaeClient, url: str, key: str, prefix: str) -> list:
    names = [f"{prefix}-run{i}" for i in range(RUNS)]
    expected = {names[i]: step for i, (_, step) in enumerate(OUTAGES)}       # run -> its last good step
    for i, name in enumerate(names):
        await original_run(client, name, OUTAGES[i] if i < len(OUTAGES) else None)
    before = set(await client.list_channels())
    body = {"filter": {"status": ["failed", "crashed"], "channel_prefix": f"{prefix}-",
                       "failure_contains": "outage"},
            "at": "last_good_step", "intervention": INTERVENTION, "tool_policies": POLICIES,
            "name": "{channel_id}-retry", "operation_id": f"{prefix}-bulk"}
    async with aiohttp.ClientSession() as http:
        dry = await bulk_fork(http, url, key, {**body, "dry_run": True})
        after_dry = set(await client.list_channels())
        first = await bulk_fork(http, url, key, body)
        after_first = set(await client.list_channels())
        again = await bulk_fork(http, url, key, body)
    after = set(await client.list_channels())
    forked = {f["source_channel_id"]: f for f in first["forks"]}
    sha_ok = []
    for source, item in forked.items():
        state = await state_at_step(client, source, item["step"])
        receipt = item["receipt"]
        sha_ok.append(receipt["restorable"] and receipt["source_state_sha256"] == canonical_sha256(state))
    finished = [await continue_fork(client, item["channel_id"], source) for source, item in forked.items()]
    statuses = [(await client.get_channel_metadata(f["fork"])).experiment_metadata.get("status") for f in finished]
    charges = {}
    for name in names + [f["fork"] for f in finished]:
        ran = [x for x in await client.list_executions(channel_id=name) if x.tool_name == "charge_customer"]
        charges[name] = sum(1 for x in ran if x.status == "completed" and x.attempts > 0)
    blocked = [len(await client.replay(f["fork"], cursor=0, limit=500, event_type="tool.blocked")) for f in finished]
    return [
        ("the dry run lists the six failed runs and makes nothing",
         sorted(f["source_channel_id"] for f in dry["forks"]) == sorted(expected) and after_dry == before
         and dry["dry_run"] is True, f"{len(dry['forks'])} listed"),
        ("the bulk fork forks exactly the six failed runs", sorted(forked) == sorted(expected),
         f"{len(forked)} forks, {len(first['skipped'])} skipped"),
        ("each after its own last good step", all(forked[s]["step"] == k for s, k in expected.items() if s in forked),
         ", ".join(f"{s.rsplit('-', 1)[1]}:{forked[s]['step']}" for s in sorted(forked))),
        ("each receipt is restorable with the parent's state sha256 at that step", all(sha_ok) and len(sha_ok) == 6,
         f"{sum(sha_ok)}/6"),
        ("the same request again answers the same forks and makes nothing new",
         again == first and after_first == before | {f["channel_id"] for f in first["forks"]} and after == after_first,
         f"{'the same' if again == first else 'other'} {len(again['forks'])} forks; {len(after - after_first)} new"
         f" (the first request made {len(after_first - before)})"),
        ("every fork continued to completion from the step after its boundary",
         statuses == ["completed"] * 6 and all(f["lines"] == STEPS for f in finished),
         ", ".join(f"{f['fork'].rsplit('-', 2)[1]} from step {f['first_step']}" for f in finished)),
        ("no fork charged again: the policy blocked each attempt",
         all(f["charge"] == "blocked" for f in finished) and blocked == [1] * 6, f"{blocked}"),
        ("the ledger shows one charge per original run and none on a fork",
         all(charges[n] == 1 for n in names) and all(charges[f["fork"]] == 0 for f in finished),
         f"{sum(charges.values())} charges in all"),
    ]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=os.environ.get("ACTAE_URL"), help="server URL (env ACTAE_URL)")
    p.add_argument("--key", default=os.environ.get("ACTAE_API_KEY"), help="API key (env ACTAE_API_KEY)")
    p.add_argument("--name", default=f"outage-{uuid.uuid4().hex[:8]}", help="channel prefix (default: random)")
    args = p.parse_args(argv)
    if not args.url or not args.key:
        p.error("set ACTAE_URL and ACTAE_API_KEY (or pass --url and --key)")
    return args


async def run(args) -> int:
    url = args.url.rstrip("/")
    client = ActaeClient(endpoint=url, api_key=args.key)
    try:
        checks = await walkthrough(client, url, args.key, args.name)
    finally:
        await client.disconnect()
    for name, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f"  [{detail}]" if detail else ""))
    failed = sum(not ok for _, ok, _ in checks)
    print(f"\n{len(checks) - failed}/{len(checks)} checks passed")
    print(f"Dashboard:   {url}/?q={args.name}&status=failed  (the failed runs)")
    print(f"             {url}/?q={args.name}-run0-retry  (a fork)")
    return 1 if failed else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    with _connect.plainly("fork_failed.py", args.url):
        return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
