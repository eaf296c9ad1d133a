"""The Actae walkthrough: run a 6-step agent, fork it after step 3 with a different model.

    ACTAE_URL=http://127.0.0.1:8002 ACTAE_API_KEY=sk-... python examples/fork_demo.py

The pipeline (research, insights, risks, recommendations, summary, finalize) runs inside an
`AgentSession` that snapshots its state after every step. At step 4 it charges the customer
through the execution ledger (key `inv-1`, tool `charge_customer`) and then makes a bad
decision with the `fast` model, so the run ends `failed`. The demo forks the run after step 3
with the intervention `{"model": "slow"}` and the policies `{"charge_customer": "block",
"*": "auto"}`, runs only steps 4..6 on the fork, and checks what Actae promises: a restorable
receipt whose sha256 is the step-3 state's, a diff that touches only the tail, an untouched
parent, and a charge that ran exactly once (the fork's claim is refused and logged as
`tool.blocked`).

With `--resume` the fork is made by `AgentSession.resume(client, "<name>-base",
fork_at_step=3, ...)`, as a separate process would do it. Channel names get a random suffix
(or `--name`), so the demo can run again and again against one server.

The stand-in model reports a usage per call (tokens in and out, a cost: what a real model's
answer carries), so the demo ends with what the fork measurably saved, as the server counts it
(GET /api/v1/channels/{fork}/savings): the steps 1..3 it inherited instead of running and paying
for them again.

Prints every check as PASS/FAIL and exits 0 only when all of them hold.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import hashlib
import json
import os
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Callable, Optional

from actae_client import ActaeClient, AgentSession, ForkToolBlockedError

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _connect  # noqa: E402  (examples/_connect.py: one line, not a traceback, for a refused key or a wrong address)

STEPS = ["research", "insights", "risks", "recommendations", "summary", "finalize"]
FORK_AFTER = 3
CHARGE = {"key": "inv-1", "tool": "charge_customer", "params": {"amount_cents": 4900}}
# Paths the tail (steps 4..6) writes; a diff of parent vs fork may touch nothing else.
TAIL_KEYS = {"status", "model", "charge", "decision", "report", "error"}


def canonical_sha256(state) -> str:
    """Return the lowercase hex SHA-256 of `state` as canonical JSON, the receipt's recipe."""
    text = json.dumps(state, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# The stand-in model's prices, per token, in dollars (of the order of today's hosted models).
PRICES = {"fast": (0.5e-6, 1.5e-6), "slow": (3e-6, 15e-6)}


def usage_of_call(model: str, step_number: int, state: dict) -> dict:
    """What the stand-in model call of step `step_number` spent: its prompt grows with the notes."""
    prompt = 1800 + 650 * step_number + 120 * len(state["notes"])
    completion = 240 + 35 * step_number
    price_in, price_out = PRICES[model]
    return {"input_tokens": prompt, "output_tokens": completion,
            "cost_usd": round(prompt * price_in + completion * price_out, 6), "model": model}


def think(model: str, step: str, state: dict) -> str:
    """A stand-in model call: returns the model's note for `step`, deterministic per model."""
    if step == "recommendations":
        return "refund and charge again" if model == "fast" else "hold the invoice for review"
    return f"{step} ({model}, {len(state['notes'])} notes so far)"


class Pipeline:
    """The demo agent. `state` is what the session snapshots; `charges` counts real charges."""

    def __init__(self, client: ActaeClient, model: str):
        self.client = client
        self.state = {"status": "running", "model": model, "notes": {}, "charge": None,
                      "decision": None, "report": None}
        self.charges = 0
        self.snapshots: dict[int, dict] = {}
        self.spent: dict[int, dict] = {}

    def restore(self, state: dict) -> None:
        """Continue from an inherited state, keeping this pipeline's model."""
        self.state = {**copy.deepcopy(state), "model": self.state["model"]}

    def snapshot(self) -> dict:
        """The `state_fn`: a copy of the current state (also kept locally, by step)."""
        return copy.deepcopy(self.state)

    async def charge_customer(self, channel: str) -> None:
        """Charge through the ledger: run the charge only when this caller owns the claim."""
        try:
            claim = await self.client.claim_execution(
                channel, CHARGE["key"], CHARGE["tool"], CHARGE["params"])
        except ForkToolBlockedError:
            self.state["charge"] = {"key": CHARGE["key"], "status": "blocked"}
            return
        if claim.status in ("claimed", "reclaimed"):
            self.charges += 1  # the real side effect would happen here
            result = {"charge_id": f"ch_{uuid.uuid4().hex[:8]}", **CHARGE["params"]}
            await self.client.complete_execution(claim.execution.id, claim.claim_token, result)
        else:
            result = claim.result
        self.state["charge"] = {"key": CHARGE["key"], "status": claim.status, "result": result}

    async def run_step(self, session: AgentSession, number: int) -> None:
        """Run step `number` (1-based) and record it; the session then snapshots the state."""
        name = STEPS[number - 1]
        model = self.state["model"]
        if name == "recommendations":
            await self.charge_customer(session.channel_id)
            self.state["decision"] = think(model, name, self.state)
        elif name == "summary":
            self.state["report"] = {"model": model, "text": f"Decision: {self.state['decision']}"}
        elif name == "finalize":
            bad = self.state["decision"] == "refund and charge again"
            self.state["status"] = "failed" if bad else "completed"
            if bad:  # what a real check would report: the value it refused, by name
                self.state["error"] = f"finalize failed: decision {self.state['decision']!r} would charge twice"
        else:
            self.state["notes"][name] = think(model, name, self.state)
        usage = self.spent[number] = usage_of_call(model, number, self.state)
        await session.step(name, input={"model": model}, output={"status": self.state["status"], "usage": usage},
                           metadata={"model": model})
        self.snapshots[number] = self.snapshot()


async def step_numbers(client: ActaeClient, channel: str) -> list[int]:
    """Return the step numbers recorded on `channel` itself, in order."""
    events = await client.replay(channel, limit=500)
    return [e.payload["step_number"] for e in events
            if isinstance(e.payload, dict) and "step_number" in e.payload]


def tail_path(path: list[str]) -> bool:
    """True when a diff path belongs to what steps 4..6 write."""
    if path[0] in TAIL_KEYS:
        return True
    return path[0] == "notes" and len(path) > 1 and path[1] in STEPS[FORK_AFTER:]


async def walkthrough(client: ActaeClient, base_name: str, fork_name: str,
                      from_new_process: bool = False, savings: Optional[Callable[[str], dict]] = None
                      ) -> list[tuple[str, bool, str]]:
    """Run the parent, fork it, run the tail; return (check, ok, detail) for every check.

    The fork comes from `base.fork(...)`, or with `from_new_process` from
    `AgentSession.resume(..., fork_at_step=3)`, as a separate process would do it. `savings(channel)`
    answers GET /api/v1/channels/{channel}/savings; with it, the measured saving is printed and checked.
    """
    agent = Pipeline(client, model="fast")
    async with AgentSession(client, base_name, state_fn=agent.snapshot, snapshot_interval=1) as base:
        for number in range(1, len(STEPS) + 1):
            await agent.run_step(base, number)
    parent_events = await client.replay(base_name, limit=500)
    parent_state = (await client.latest_state(base_name))["state"]

    intervention = {"model": "slow"}
    tail = Pipeline(client, model=intervention["model"])
    policies = {"charge_customer": "block", "*": "auto"}
    if from_new_process:  # what a separate process does: it only knows the parent's channel id
        fork = await AgentSession.resume(client, base_name, fork_at_step=FORK_AFTER, name=fork_name,
                                         state_fn=tail.snapshot, intervention=intervention,
                                         tool_policies=policies)
    else:
        fork = await base.fork(FORK_AFTER, name=fork_name, state_fn=tail.snapshot,
                               intervention=intervention, tool_policies=policies)
    inherited = fork.inherited_state
    tail.restore(inherited)
    async with fork:
        for number in range(FORK_AFTER + 1, len(STEPS) + 1):
            await tail.run_step(fork, number)

    receipt = fork.fork_receipt
    diff = await client.diff_states(base_name, fork_name)
    fork_events = await client.replay(fork_name, limit=500)
    blocked = [e for e in fork_events if e.event_type == "tool.blocked"]
    parent_after = await client.replay(base_name, limit=500)
    parent_state_after = (await client.latest_state(base_name))["state"]
    fork_state = (await client.latest_state(fork_name))["state"]
    step3 = agent.snapshots[FORK_AFTER]
    paths = [e["path"] for e in diff.get("entries", [])]
    common_state = (diff.get("common") or {}).get("state") or {}
    fork_steps = await step_numbers(client, fork_name)
    inherited_usage = [agent.spent[n] for n in range(1, FORK_AFTER + 1)]
    checks = []
    if savings is not None:
        saving = savings(fork_name)["fork"]
        print(saved_line(saving))
        checks.append(("saving == the usage steps 1..3 reported",
                       (saving["saved"]["steps"], saving["saved"]["input_tokens"], saving["saved"]["output_tokens"])
                       == (FORK_AFTER, sum(u["input_tokens"] for u in inherited_usage),
                           sum(u["output_tokens"] for u in inherited_usage))
                       and abs(saving["saved"]["cost"] - sum(u["cost_usd"] for u in inherited_usage)) < 1e-9,
                       f"{saving['saved']['input_tokens']} + {saving['saved']['output_tokens']} tokens"))

    return checks + [
        ("parent run ended failed", parent_state["status"] == "failed", parent_state["status"]),
        ("parent charged through the ledger", agent.state["charge"]["status"] == "claimed",
         str(agent.state["charge"]["status"])),
        ("fork inherited the step-3 state", inherited == step3, ""),
        ("fork policies echoed by the server", fork.tool_policies == policies, json.dumps(fork.tool_policies)),
        ("receipt restorable", receipt.restorable is True, str(receipt.restorable)),
        ("requested cursor == resolved cursor", receipt.requested_cursor == receipt.resolved_cursor,
         f"{receipt.requested_cursor} == {receipt.resolved_cursor}"),
        ("receipt sha256 == sha256(step-3 state)", receipt.source_state_sha256 == canonical_sha256(step3),
         f"{receipt.source_state_sha256}"),
        ("fork ran steps 4..6 only", fork_steps == [4, 5, 6], str(fork_steps)),
        ("diff has entries, all on tail paths", bool(paths) and all(tail_path(p) for p in paths),
         ", ".join("/".join(p) for p in paths)),
        ("diff common.state.status == running", common_state.get("status") == "running",
         str(common_state.get("status"))),
        ("parent report unchanged", parent_state_after["report"] == parent_state["report"],
         json.dumps(parent_state_after["report"])),
        ("fork report comes from slow", (fork_state.get("report") or {}).get("model") == "slow",
         json.dumps(fork_state.get("report"))),
        ("fork run ended completed", fork_state.get("status") == "completed", str(fork_state.get("status"))),
        ("parent event count unchanged by the fork", len(parent_after) == len(parent_events),
         f"{len(parent_events)} -> {len(parent_after)}"),
        ("fork charge refused (fork_tool_blocked)", tail.state["charge"]["status"] == "blocked",
         str(tail.state["charge"]["status"])),
        ("one tool.blocked event with policy block",
         len(blocked) == 1 and (blocked[0].payload or {}).get("policy") == "block",
         f"{len(blocked)} event(s)"),
        ("charge ran exactly once", agent.charges + tail.charges == 1,
         f"{agent.charges + tail.charges} charge(s)"),
    ]


def savings_reader(url: str, key: str) -> Callable[[str], dict]:
    """GET /api/v1/channels/{channel}/savings on this server (the SDK has no call for it yet)."""
    def read(channel: str) -> dict:
        request = urllib.request.Request(f"{url.rstrip('/')}/api/v1/channels/{channel}/savings",
                                         headers={"x-api-key": key})
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.loads(answer.read())
    return read


def saved_line(saving: dict) -> str:
    saved, tail = saving["saved"], saving["tail"]
    total_in = saved["input_tokens"] + tail["input_tokens"]
    share = 100 * saved["input_tokens"] / total_in if total_in else 0
    return (f"Measured saving: the fork did not re-run steps 1..{saving['forked_at_step']}:"
            f" {saved['input_tokens']:,} tokens in, {saved['output_tokens']:,} out, ${saved['cost']:.4f},"
            f" {saved['wall_seconds']:.2f} s ({share:.0f}% of the tokens in a full re-run);"
            f" its own tail spent {tail['input_tokens']:,} in, {tail['output_tokens']:,} out, ${tail['cost']:.4f}")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=os.environ.get("ACTAE_URL"), help="server URL (env ACTAE_URL)")
    p.add_argument("--key", default=os.environ.get("ACTAE_API_KEY"), help="API key (env ACTAE_API_KEY)")
    p.add_argument("--name", default=f"demo-{uuid.uuid4().hex[:8]}",
                   help="channel prefix: <name>-base and <name>-fork (default: random)")
    p.add_argument("--resume", action="store_true",
                   help="fork with AgentSession.resume(fork_at_step=3), as a new process would")
    args = p.parse_args(argv)
    if not args.url or not args.key:
        p.error("set ACTAE_URL and ACTAE_API_KEY (or pass --url and --key)")
    return args


async def run(args) -> int:
    client = ActaeClient(endpoint=args.url, api_key=args.key)
    with _connect.holding_websocket_errors():
        await client.connect()
    try:
        checks = await walkthrough(client, f"{args.name}-base", f"{args.name}-fork", args.resume,
                                   savings_reader(args.url, args.key))
    finally:
        await client.disconnect()
    for name, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f"  [{detail}]" if detail else ""))
    failed = sum(not ok for _, ok, _ in checks)
    print(f"\n{len(checks) - failed}/{len(checks)} checks passed "
          f"(channels {args.name}-base, {args.name}-fork)")
    base_url = args.url.rstrip("/")
    print(f"Dashboard:   {base_url}/runs/{args.name}-base  (the failed run)")
    print(f"             {base_url}/runs/{args.name}-fork  (the fork after step {FORK_AFTER})")
    return 1 if failed else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    with _connect.plainly("fork_demo.py", args.url):
        return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
