"""Forks: the six-step walkthrough, boundaries, tool policies, resume, idempotency
and the lineage surface (receipt, lists, tree, trail, outcome, promote, delete, compare, experiments).

Real `actae-client` SDK against the real server subprocess (`server` fixture).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import uuid

import pytest
from actae_client import AgentSession, APIError, ForkToolBlockedError, SnapshotBoundaryError, VersionConflictError
# Not re-exported by the package root in 1.3.0.
from actae_client.errors import ChannelConflictError, IdempotencyConflictError, NoRestorableCheckpointError

from conftest import http, run_program, state_sha256

STEP_NAMES = ("research", "insights", "risks", "recommendations", "summary", "finalize")
POLICIES = {"charge_customer": "block", "*": "auto"}
CHARGE = ("inv-1", "charge_customer", {"amount_cents": 4900})


async def events(client, channel):
    return await client.replay(channel, limit=1000)


async def types(client, channel):
    return [e.event_type for e in await events(client, channel)]


async def parent_record(client, channel):
    """Everything a fork must never change on its parent: events, state versions, each state."""
    evs = [dataclasses.asdict(e) for e in await events(client, channel)]
    versions = await client.list_states(channel, limit=100)
    states = {v["version"]: await client.get_state(channel, v["version"]) for v in versions}
    return evs, versions, states


class Agent:
    """The walkthrough's agent: a 6-step pipeline whose state is snapshotted after every step.

    Steps 1-3 don't depend on the model; step 4 charges the customer through the ledger and
    decides with `model`; step 5 writes the report; step 6 marks the run failed (model "fast")
    or succeeded. `effects` is the real downstream: one entry per charge actually performed.
    """

    def __init__(self, client, effects, model="fast", state=None):
        self.client = client
        self.effects = effects
        self.model = model
        self.state = copy.deepcopy(state) if state else {"status": "running", "step": 0, "notes": [], "report": None}
        self.history = {}

    def snapshot(self):
        return copy.deepcopy(self.state)

    async def charge(self, channel):
        try:
            claim = await self.client.claim_execution(channel, *CHARGE)
        except ForkToolBlockedError:
            return {"status": "blocked"}
        if claim.status == "replayed":
            return {"status": "replayed", **claim.result}
        assert claim.status in ("claimed", "reclaimed"), claim.status
        self.effects.append(channel)
        result = {"charge_id": f"ch-{len(self.effects)}"}
        await self.client.complete_execution(claim.execution.id, claim.claim_token, result)
        return {"status": "charged", **result}

    async def run_step(self, session, n):
        name = STEP_NAMES[n - 1]
        s = self.state
        s["step"] = n
        if n <= 3:
            s["notes"].append(f"{n}:{name}")
            s[name] = [f"{name}-finding", "naïve café ☕"]  # non-ASCII: the sha must not escape it
        else:
            s["notes"].append(f"{n}:{name}:{self.model}")
        if name == "recommendations":
            s["charge"] = await self.charge(session.channel_id)
            s["decision"] = "refund everyone" if self.model == "fast" else "keep the plan"
        elif name == "summary":
            s["report"] = f"report from {self.model}"
        elif name == "finalize":
            s["status"] = "failed" if self.model == "fast" else "succeeded"
        event = await session.step(name, input={"step": n}, output={"note": s["notes"][-1]},
                                   metadata={"model": self.model} if n > 3 else None)
        self.history[n] = self.snapshot()
        return event


async def run_base(client, channel, effects, **session_kw):
    """Run the 6-step base pipeline on `channel`; returns (completed session, agent)."""
    agent = Agent(client, effects)
    session_kw.setdefault("state_fn", agent.snapshot)
    session_kw.setdefault("snapshot_interval", 1)
    async with AgentSession(client, channel, **session_kw) as base:
        for n in range(1, 7):
            await agent.run_step(base, n)
    return base, agent


async def fork_session(client, session, at_step, name, effects, model="slow", **kw):
    """`session.fork(...)` with a fresh Agent seeded from the inherited state; returns (fork, agent)."""
    agent = Agent(client, effects, model=model)
    fork = await session.fork(at_step, name, state_fn=agent.snapshot, **kw)
    agent.state = copy.deepcopy(fork.inherited_state)
    return fork, agent


async def parent_with_charge(client, channel):
    """A plain channel: one event, the inv-1 charge completed, then a state snapshot. Returns its cursor."""
    await client.record(channel, "plan", {"step": 1}, actor="test")
    claim = await client.claim_execution(channel, *CHARGE)
    await client.complete_execution(claim.execution.id, claim.claim_token, {"charge_id": "ch_1"})
    cursor = await client.get_cursor(channel)
    await client.save_state(channel, cursor, {"status": "running", "charged": True})
    return cursor


async def parent_with_state(client, channel, state=None):
    await client.record(channel, "plan", {"step": 1}, actor="test")
    cursor = await client.get_cursor(channel)
    await client.save_state(channel, cursor, state or {"status": "running", "n": 1})
    return cursor


# ── 1. the walkthrough ─────────────────────────────────────────────────────────────────────────

INHERITED_KEYS = {"research", "insights", "risks"}


def is_tail_path(path):
    """True when `path` names something the pipeline writes after step 3."""
    if path[0] in INHERITED_KEYS:
        return False
    if path[0] == "notes":
        return len(path) > 1 and int(path[1]) >= 3
    return path[0] in {"step", "report", "status", "charge", "decision"}


def test_walkthrough_fork_after_step_3(with_client, unique):
    base_ch, fork_ch = unique("base"), unique("fork")

    async def body(c):
        effects = []
        base, agent = await run_base(c, base_ch, effects)
        step3 = agent.history[3]
        assert agent.state["status"] == "failed" and agent.state["charge"]["status"] == "charged"
        assert effects == [base_ch]
        before = await parent_record(c, base_ch)
        assert sorted(v["version"] for v in before[1]) == [1, 2, 3, 4, 5, 6]
        assert before[2][3]["state"] == step3 and before[2][3]["cursor"] == base.cursors[2]

        fork, fork_agent = await fork_session(c, base, 3, fork_ch, effects, intervention={"model": "slow"},
                                              tool_policies=POLICIES)
        receipt = fork.fork_receipt
        assert receipt.restorable is True and receipt.replayed is False
        assert receipt.requested_cursor == receipt.resolved_cursor == base.cursors[2]
        assert (receipt.source_channel_id, receipt.child_channel_id) == (base_ch, fork_ch)
        assert receipt.source_state_version == 3
        assert receipt.source_state_sha256 == state_sha256(step3)
        assert receipt.tool_policies == POLICIES
        assert receipt.reproducibility == "state_exact"
        assert fork.inherited_state == step3
        assert fork.intervention == {"model": "slow"}
        assert await c.latest_step_number(fork_ch) == 3

        fork_agent.model = fork.intervention["model"]
        async with fork:
            for n in range(4, 7):
                await fork_agent.run_step(fork, n)

        # The fork's log: marker at cursor 1, its own session, one refusal, steps 4..6.
        fork_events = await events(c, fork_ch)
        assert [e.event_type for e in fork_events] == [
            "fork.started", "session.started", "tool.blocked", "recommendations", "summary", "finalize",
            "session.completed"]
        assert [e.cursor for e in fork_events] == list(range(1, 8))
        assert fork_events[0].depends_on == receipt.resolved_event_id
        boundary_event = next(e for e in await events(c, base_ch) if e.cursor == base.cursors[2])
        assert receipt.resolved_event_id == boundary_event.id
        assert fork_events[2].payload["policy"] == "block"
        assert [e.payload["step_number"] for e in fork_events[3:6]] == [4, 5, 6]

        # The charge ran exactly once, on the parent.
        assert fork_agent.state["charge"] == {"status": "blocked"}
        assert effects == [base_ch]
        [charge] = await c.list_executions(base_ch)
        assert (charge.key_name, charge.status, charge.attempts) == ("inv-1", "completed", 1)
        assert [e for e in await c.list_executions(fork_ch) if e.status in ("running", "completed")] == []

        # State: the copied snapshot is the fork's version 1, then one version per step.
        fork_versions = await c.list_states(fork_ch)
        assert sorted(v["version"] for v in fork_versions) == [1, 2, 3, 4]
        assert (await c.get_state(fork_ch, 1))["state"] == step3
        latest = await c.latest_state(fork_ch)
        assert latest["state"]["report"] == "report from slow" and latest["state"]["status"] == "succeeded"

        meta = await c.get_channel_metadata(fork_ch)
        assert meta.parent_channel_id == meta.origin_run_id == base_ch
        assert meta.forked_at_cursor == base.cursors[2]
        assert meta.experiment_metadata["intervention"] == {"model": "slow"}
        assert meta.experiment_metadata["forked_at_step"] == 3
        assert meta.experiment_metadata["status"] == "completed"
        assert meta.tool_policies == POLICIES

        diff = await c.diff_states(base_ch, fork_ch)
        assert diff["common"]["channel_id"] == base_ch
        assert diff["common"]["cursor"] == base.cursors[2]
        assert diff["common"]["state"] == step3 and diff["common"]["state"]["status"] == "running"
        assert diff["left"]["state"] == agent.state and diff["right"]["state"] == fork_agent.state
        entries = diff["entries"]
        assert entries and all(is_tail_path(e["path"]) for e in entries), [e["path"] for e in entries]
        by_path = {tuple(e["path"]): e for e in entries}
        assert by_path[("report",)] == {"path": ["report"], "kind": "changed",
                                        "left": "report from fast", "right": "report from slow"}
        assert (by_path[("status",)]["left"], by_path[("status",)]["right"]) == ("failed", "succeeded")
        assert by_path[("notes", "3")]["kind"] == "changed"
        assert diff["truncated"] is False and diff["entry_count_total"] == len(entries)
        # The parent is the ancestor (null); the fork left it at its boundary.
        assert (diff["left_diverged_at_cursor"], diff["right_diverged_at_cursor"]) == (None, base.cursors[2])

        # The parent is untouched: same events, same versions, same states.
        assert await parent_record(c, base_ch) == before
        assert (await c.latest_state(base_ch))["state"]["report"] == "report from fast"

    with_client(body)


# ── 2. boundary modes ──────────────────────────────────────────────────────────────────────────

# "no-state-fn": the parent never saved state. "sparse": snapshot_interval=3, so the snapshots are
# at steps 3 (version 1) and 6 (version 2), none at or before the step-2 boundary.
PARENTS = {
    "no-state-fn": dict(state_fn=None),
    "sparse": dict(snapshot_interval=3),
}


@pytest.mark.parametrize("parent", list(PARENTS))
def test_exact_boundary_without_snapshot_raises(with_client, unique, parent):
    base_ch, fork_ch = unique("base"), unique("fork")

    async def body(c):
        base, _ = await run_base(c, base_ch, [], **PARENTS[parent])
        before = await parent_record(c, base_ch)
        with pytest.raises(NoRestorableCheckpointError):
            await base.fork(2, fork_ch, boundary_mode="exact")
        assert await c.get_channel_metadata(fork_ch) is None
        assert await c.list_forks(base_ch) == []
        assert await parent_record(c, base_ch) == before

    with_client(body)


@pytest.mark.parametrize("mode", ["approximate", "lineage_only"])
@pytest.mark.parametrize("parent, restorable, resolved_step, version", [
    ("no-state-fn", False, None, 0),
    ("sparse", True, 6, 2),
])
def test_approximate_boundary_reports_the_drift(with_client, unique, mode, parent, restorable, resolved_step, version):
    base_ch, fork_ch = unique("base"), unique("fork")

    async def body(c):
        base, agent = await run_base(c, base_ch, [], **PARENTS[parent])
        fork = await base.fork(2, fork_ch, boundary_mode=mode)
        receipt = fork.fork_receipt
        # The SDK re-forks at cursor 0 (latest state) and restores the requested cursor client-side.
        assert receipt.requested_cursor == base.cursors[1]
        assert receipt.restorable is restorable and fork.boundary_restorable is restorable
        assert receipt.source_state_version == version
        if restorable:
            assert receipt.resolved_cursor == base.cursors[resolved_step - 1] > receipt.requested_cursor
            assert receipt.source_state_sha256 == state_sha256(agent.history[resolved_step])
            assert receipt.reproducibility == "state_exact"
        else:
            assert receipt.resolved_cursor == 0
            assert receipt.source_state_sha256 is None
            assert receipt.reproducibility == "best_effort"
        # Contaminated (later) state is never handed out as the step-2 state.
        assert fork.inherited_state is None
        server_receipt = await c.get_fork_receipt(fork_ch)
        assert server_receipt.requested_cursor == 0
        assert server_receipt.resolved_cursor == receipt.resolved_cursor

    with_client(body)


# ── 3. tool policies on a fork ─────────────────────────────────────────────────────────────────

CLAIMS = {
    "inherited": ("inv-1", {"amount_cents": 4900}),
    "changed-params": ("inv-1", {"amount_cents": 5000}),
    "new-key": ("inv-2", {"amount_cents": 4900}),
}
POLICY_MATRIX = [
    ({"charge_customer": "auto"}, "inherited", "replayed"),
    ({"charge_customer": "auto"}, "changed-params", "claimed"),
    ({"charge_customer": "auto"}, "new-key", "claimed"),
    ({"charge_customer": "replay"}, "inherited", "replayed"),
    ({"charge_customer": "replay"}, "changed-params", "blocked:replay"),
    ({"charge_customer": "replay"}, "new-key", "blocked:replay"),
    ({"charge_customer": "block"}, "inherited", "blocked:block"),
    ({"charge_customer": "block"}, "changed-params", "blocked:block"),
    ({"charge_customer": "block"}, "new-key", "blocked:block"),
    ({"charge_customer": "live"}, "inherited", "claimed"),
    ({"charge_customer": "live"}, "changed-params", "claimed"),
    ({"charge_customer": "live"}, "new-key", "claimed"),
    # The wildcard applies when the tool has no entry; a tool entry beats the wildcard;
    # no entry and no wildcard means auto.
    ({"*": "block"}, "inherited", "blocked:block"),
    ({"*": "block", "charge_customer": "live"}, "inherited", "claimed"),
    ({"other_tool": "block"}, "inherited", "replayed"),
    ({"*": "replay"}, "new-key", "blocked:replay"),
]


def policy_case_id(policies, claim):
    return ",".join(f"{k}={v}" for k, v in sorted(policies.items())) + f"-{claim}"


@pytest.mark.parametrize("policies, claim, expected", POLICY_MATRIX,
                         ids=[policy_case_id(p, c) for p, c, _ in POLICY_MATRIX])
def test_fork_tool_policy(with_client, unique, policies, claim, expected):
    parent, child = unique("parent"), unique("child")
    key, params = CLAIMS[claim]

    async def body(c):
        cursor = await parent_with_charge(c, parent)
        receipt = await c.fork(parent, child, cursor, tool_policies=policies)
        assert receipt.tool_policies == policies
        parent_before = await events(c, parent)

        if expected.startswith("blocked:"):
            with pytest.raises(ForkToolBlockedError):
                await c.claim_execution(child, key, "charge_customer", params)
        else:
            result = await c.claim_execution(child, key, "charge_customer", params)
            assert result.status == expected
            if expected == "replayed":
                assert result.result == {"charge_id": "ch_1"} and result.claim_token is None
            else:
                assert result.claim_token

        child_events = await events(c, child)
        blocked = [e for e in child_events if e.event_type == "tool.blocked"]
        started = [e for e in child_events if e.event_type == "tool.started"]
        if expected.startswith("blocked:"):
            assert len(blocked) == 1 and blocked[0].payload["policy"] == expected.split(":")[1]
        else:
            assert blocked == []
        # Only a live claim starts the tool on the child; a replay or a refusal never does.
        assert len(started) == (1 if expected == "claimed" else 0)
        assert await events(c, parent) == parent_before

    with_client(body)


@pytest.mark.parametrize("policy, expected", [("auto", "claimed"), ("replay", "blocked")])
def test_an_effect_completed_after_the_boundary_is_not_inherited(with_client, unique, policy, expected):
    """The fork's boundary predates the charge, so from the fork's point of view it never happened."""
    parent, child = unique("parent"), unique("child")

    async def body(c):
        boundary = await parent_with_state(c, parent)
        claim = await c.claim_execution(parent, *CHARGE)
        await c.complete_execution(claim.execution.id, claim.claim_token, {"charge_id": "ch_late"})
        await c.fork(parent, child, boundary, tool_policies={"charge_customer": policy})
        if expected == "blocked":
            with pytest.raises(ForkToolBlockedError):
                await c.claim_execution(child, *CHARGE)
            [refusal] = [e for e in await events(c, child) if e.event_type == "tool.blocked"]
            assert refusal.payload["policy"] == policy
        else:
            result = await c.claim_execution(child, *CHARGE)
            assert result.status == "claimed" and result.result is None

    with_client(body)


# ── 4. resume and lineage ──────────────────────────────────────────────────────────────────────

RESUME_CHILD = r'''
import asyncio, json, sys
from actae_client import ActaeClient, AgentSession

async def main():
    base, name = sys.argv[1], sys.argv[2]
    client = ActaeClient.from_env()
    try:
        session = await AgentSession.resume(client, base, fork_at_step=3, name=name,
                                            intervention={"model": "slow"},
                                            tool_policies={"charge_customer": "block"})
        out = {"step_count": session.step_count, "inherited": session.inherited_state,
               "intervention": session.intervention, "tool_policies": session.tool_policies,
               "restorable": session.boundary_restorable}
        async with session:
            event = await session.step("recommendations", output={"model": session.intervention["model"]})
        out["first_step"] = event.payload["step_number"]
        out["first_cursor"] = event.cursor
    finally:
        await client.disconnect()
    print(json.dumps(out))

asyncio.run(main())
'''


def test_resume_fork_at_step_from_a_new_process(server, with_client, unique):
    base_ch, fork_ch = unique("base"), unique("fork")
    base, agent = with_client(lambda c: run_base(c, base_ch, []))

    proc = run_program(server, "-c", RESUME_CHILD, base_ch, fork_ch, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["step_count"] == 3
    assert out["first_step"] == 4
    assert out["inherited"] == agent.history[3]
    assert out["intervention"] == {"model": "slow"}
    assert out["tool_policies"] == {"charge_customer": "block"}
    assert out["restorable"] is True

    async def body(c):
        steps = [e for e in await events(c, fork_ch) if e.event_type in STEP_NAMES]
        assert [e.payload["step_number"] for e in steps] == [4]
        assert steps[0].cursor == out["first_cursor"]
        meta = await c.get_channel_metadata(fork_ch)
        assert meta.parent_channel_id == base_ch
        assert meta.experiment_metadata["intervention"] == {"model": "slow"}
        assert await c.resolve_step(fork_ch, 4) == (fork_ch, out["first_cursor"], steps[0].id)
        assert (await c.resolve_step(fork_ch, 2))[:2] == (base_ch, base.cursors[1])
        assert await c.latest_step_number(fork_ch) == 4

    with_client(body)


class Crash(Exception):
    pass


def test_resume_from_fork_after_a_crash_continues_numbering(with_client, unique):
    base_ch, fork_ch = unique("base"), unique("fork")

    async def body(c):
        effects = []
        base, _ = await run_base(c, base_ch, effects)
        fork, fork_agent = await fork_session(c, base, 3, fork_ch, effects, intervention={"model": "slow"},
                                              tool_policies={"charge_customer": "block"})
        # A fresh fork already sits at its boundary step.
        assert await c.latest_step_number(fork_ch) == 3
        fresh = await AgentSession.resume_from_fork(c, fork.fork_receipt)
        assert fresh.step_count == 3

        with pytest.raises(Crash):
            async with fork:
                await fork_agent.run_step(fork, 4)
                raise Crash("the fork's process died after step 4")
        meta = await c.get_channel_metadata(fork_ch)
        assert meta.experiment_metadata["status"] == "crashed" and meta.outcome == "crashed"

        resumed_agent = Agent(c, effects, model="slow")
        resumed = await AgentSession.resume_from_fork(c, fork.fork_receipt, state_fn=resumed_agent.snapshot)
        assert resumed.step_count == 4
        assert resumed.intervention == {"model": "slow"}
        assert resumed.inherited_state == fork_agent.history[4]
        resumed_agent.state = copy.deepcopy(resumed.inherited_state)
        async with resumed:
            event = await resumed_agent.run_step(resumed, 5)
        assert event.payload["step_number"] == 5
        steps = [e.payload["step_number"] for e in await events(c, fork_ch) if e.event_type in STEP_NAMES]
        assert steps == [4, 5]
        assert await c.latest_step_number(fork_ch) == 5
        assert effects == [base_ch]

    with_client(body)


def test_fork_of_fork_of_fork_resolves_inherited_steps_to_their_owner(with_client, unique):
    root, f1_ch, f2_ch, f3_ch = unique("root"), unique("f1"), unique("f2"), unique("f3")
    block = {"charge_customer": "block"}

    async def body(c):
        effects = []
        base, _ = await run_base(c, root, effects)
        f1, a1 = await fork_session(c, base, 2, f1_ch, effects, tool_policies=block)
        async with f1:
            for n in range(3, 7):
                await a1.run_step(f1, n)
        f2, a2 = await fork_session(c, f1, 4, f2_ch, effects, tool_policies=block)
        async with f2:
            for n in range(5, 7):
                await a2.run_step(f2, n)
        f3, a3 = await fork_session(c, f2, 5, f3_ch, effects, tool_policies=block)
        assert await c.latest_step_number(f3_ch) == 5
        async with f3:
            await a3.run_step(f3, 6)
        assert effects == [root]

        owners = {1: (root, base), 2: (root, base), 3: (f1_ch, f1), 4: (f1_ch, f1), 5: (f2_ch, f2), 6: (f3_ch, f3)}
        for step, (owner, session) in owners.items():
            resolved = await c.resolve_step(f3_ch, step)
            assert resolved[:2] == (owner, session.cursors[step - 1]), step
            event = next(e for e in await events(c, owner) if e.cursor == resolved[1])
            assert (event.id, event.payload["step_number"]) == (resolved[2], step)
        assert await c.resolve_step(f3_ch, 7) is None
        assert await c.latest_step_number(f3_ch) == 6

        tree = await c.get_fork_tree(root)
        assert tree.channel_id == root
        assert [n.channel_id for n in tree.children] == [f1_ch]
        assert [n.channel_id for n in tree.children[0].children] == [f2_ch]
        assert [n.channel_id for n in tree.children[0].children[0].children] == [f3_ch]
        leaf = tree.children[0].children[0].children[0]
        assert leaf.children == []
        assert leaf.event_count == len(await events(c, f3_ch))
        assert leaf.forked_at_cursor == f2.cursors[4]

        trail = await c.decision_trail(f3_ch)
        assert trail["channel_id"] == f3_ch and trail["origin_run_id"] == root
        parents = {a["channel_id"]: a["parent_channel_id"] for a in trail["ancestry"]}
        # The chain back to the root (whether it lists the channel itself is left open).
        assert parents.pop(f3_ch, f2_ch) == f2_ch
        assert parents == {f2_ch: f1_ch, f1_ch: root, root: None}
        assert trail["boundary"]["channel_id"] == f2_ch
        assert trail["boundary"]["cursor"] == f2.cursors[4]
        assert trail["boundary"]["state"] == a2.history[5]

    with_client(body)


# ── 5. fork idempotency and boundaries on plain channels ───────────────────────────────────────

async def counts(client, *channels):
    out = []
    for ch in channels:
        out += [len(await events(client, ch)), len(await client.list_states(ch)), len(await client.list_forks(ch))]
    return out


def test_fork_retry_replays_and_creates_nothing(with_client, unique):
    parent, child = unique("parent"), unique("child")

    async def body(c):
        cursor = await parent_with_state(c, parent)
        op = str(uuid.uuid4())
        first = await c.fork(parent, child, cursor, operation_id=op, tool_policies={"*": "block"})
        assert first.replayed is False and first.restorable is True
        before = await counts(c, parent, child)
        assert await types(c, child) == ["fork.started"]

        same_op = await c.fork(parent, child, cursor, operation_id=op, tool_policies={"*": "block"})
        assert same_op.replayed is True
        assert dataclasses.replace(same_op, replayed=False) == first
        # AgentSession retries with a new operation id: the child-name rule replays too.
        new_op = await c.fork(parent, child, cursor, tool_policies={"*": "block"})
        assert new_op.replayed is True
        assert dataclasses.replace(new_op, replayed=False) == first
        assert await counts(c, parent, child) == before

        stored = await c.get_fork_receipt(child)
        assert stored == first

    with_client(body)


@pytest.mark.parametrize("change", ["tool_policies", "manifest"])
def test_same_operation_id_with_a_different_request_conflicts(with_client, unique, change):
    parent, child = unique("parent"), unique("child")

    async def body(c):
        cursor = await parent_with_state(c, parent)
        op = str(uuid.uuid4())
        await c.fork(parent, child, cursor, operation_id=op, tool_policies={"*": "block"}, manifest={"model": "m1"})
        before = await counts(c, parent, child)
        kw = {"tool_policies": {"*": "block"}, "manifest": {"model": "m1"}}
        kw[change] = {"tool_policies": {"*": "live"}, "manifest": {"model": "m2"}}[change]
        with pytest.raises(IdempotencyConflictError):
            await c.fork(parent, child, cursor, operation_id=op, **kw)
        assert await counts(c, parent, child) == before

    with_client(body)


def test_an_operation_id_reused_for_another_fork_creates_nothing(with_client, unique):
    parent, other, child, second = unique("parent"), unique("other"), unique("child"), unique("second")

    async def body(c):
        cursor = await parent_with_state(c, parent)
        other_cursor = await parent_with_state(c, other)
        op = str(uuid.uuid4())
        first = await c.fork(parent, child, cursor, operation_id=op)
        # A different request under the same operation id is a 409
        # (Go docs: or the ORIGINAL child is returned). Never a second fork.
        try:
            again = await c.fork(other, second, other_cursor, operation_id=op)
        except IdempotencyConflictError:
            pass
        else:
            assert again.replayed is True and again.child_channel_id == first.child_channel_id
        assert await c.get_channel_metadata(second) is None
        assert await c.list_forks(other) == []

    with_client(body)


@pytest.mark.parametrize("conflict", ["other-boundary", "other-source", "other-policy", "ordinary-channel"])
def test_reusing_a_child_name_for_another_definition_conflicts(with_client, unique, conflict):
    parent, other, child = unique("parent"), unique("other"), unique("child")

    async def body(c):
        early = await parent_with_state(c, parent, {"n": 1})
        await c.record(parent, "more", {"step": 2}, actor="test")
        late = await c.get_cursor(parent)
        await c.save_state(parent, late, {"n": 2})
        await parent_with_state(c, other)
        if conflict == "ordinary-channel":
            await c.record(child, "plain", {}, actor="test")
        else:
            await c.fork(parent, child, late)
        before = await counts(c, parent, other, child)
        with pytest.raises(ChannelConflictError):
            if conflict == "other-source":
                await c.fork(other, child, 0)
            elif conflict == "other-policy":   # replaying would keep the old policy behind the caller's back
                await c.fork(parent, child, late, tool_policies={"charge": "live"})
            else:
                await c.fork(parent, child, early)
        assert await counts(c, parent, other, child) == before

    with_client(body)


def test_fork_at_zero_of_a_stateless_channel_is_not_restorable(with_client, unique):
    parent, child = unique("parent"), unique("child")

    async def body(c):
        await c.record(parent, "plan", {"step": 1}, actor="test")
        receipt = await c.fork(parent, child, 0)
        assert receipt.restorable is False and receipt.resolved_cursor == 0
        assert receipt.source_state_version == 0 and receipt.source_state_sha256 is None
        assert receipt.reproducibility == "best_effort"
        assert await c.latest_state(child) is None
        assert [(e.cursor, e.event_type) for e in await events(c, child)] == [(1, "fork.started")]
        assert len(await events(c, parent)) == 1

    with_client(body)


def test_fork_before_the_first_snapshot_needs_a_boundary(with_client, unique):
    parent, child = unique("parent"), unique("child")

    async def body(c):
        for n in range(3):
            await c.record(parent, "plan", {"step": n}, actor="test")
        await c.save_state(parent, 3, {"n": 3})
        before = await counts(c, parent)
        with pytest.raises(SnapshotBoundaryError):
            await c.fork(parent, child, 2)
        assert await c.get_channel_metadata(child) is None
        assert await counts(c, parent) == before
        # At the snapshot's own cursor the same fork works (the boundary is inclusive).
        receipt = await c.fork(parent, child, 3)
        assert (receipt.restorable, receipt.resolved_cursor, receipt.source_state_version) == (True, 3, 1)

    with_client(body)


# ── lineage surface ────────────────────────────────────────────────────────────────────────────

def test_receipts_and_direct_fork_lists(with_client, unique):
    root, a, b, sibling = unique("root"), unique("a"), unique("b"), unique("sibling")

    async def body(c):
        cursor = await parent_with_state(c, root, {"n": 1})
        ra = await c.fork(root, a, cursor, reason="try a", display_name="A")
        rb = await c.fork(a, b, 0)
        await c.fork(root, sibling, cursor)
        assert sorted(m.channel_id for m in await c.list_forks(root)) == sorted([a, sibling])
        assert [m.channel_id for m in await c.list_forks(a)] == [b]
        assert await c.list_forks(b) == []
        [meta_a] = [m for m in await c.list_forks(root) if m.channel_id == a]
        assert (meta_a.parent_channel_id, meta_a.origin_run_id) == (root, root)
        assert (meta_a.display_name, meta_a.reason) == ("A", "try a")

        assert await c.get_fork_receipt(a) == ra
        assert await c.get_fork_receipt(b) == rb
        assert rb.source_channel_id == a and rb.restorable is True
        with pytest.raises(APIError) as err:
            await c.get_fork_receipt(root)
        assert err.value.status_code == 404
        assert (await c.get_channel_metadata(b)).origin_run_id == root

        claim = await c.claim_execution(b, "job-1", "send_email", {"to": "x@example.com"})
        await c.complete_execution(claim.execution.id, claim.claim_token, {"sent": True})
        trail = await c.decision_trail(b)
        assert trail["boundary"]["channel_id"] == a
        assert trail["boundary"]["cursor"] == rb.resolved_cursor
        assert trail["boundary"]["state"] == {"n": 1}
        [row] = trail["executions"]
        assert (row["id"], row["key_name"], row["tool_name"], row["status"], row["result"]) == (
            claim.execution.id, "job-1", "send_email", "completed", {"sent": True})
        assert row["started_cursor"] < row["completed_cursor"]

    with_client(body)


def test_outcome_and_promote(with_client, unique):
    parent, child = unique("parent"), unique("child")

    async def body(c):
        cursor = await parent_with_state(c, parent, {"answer": 1})
        await c.fork(parent, child, cursor)
        await c.record(child, "work", {"better": True}, actor="test")
        await c.save_state(child, await c.get_cursor(child), {"answer": 42})

        await c.set_outcome(child, "inconclusive", score=0.25)
        meta = await c.get_channel_metadata(child)
        assert (meta.outcome, meta.result_score) == ("inconclusive", 0.25)
        with pytest.raises(APIError) as err:
            await c.set_outcome(child, "maybe")
        assert err.value.status_code == 400

        parent_events = await events(c, parent)
        parent_versions = await c.list_states(parent)
        await c.promote_channel(child)
        after = await events(c, parent)
        assert after[:-1] == parent_events and after[-1].event_type == "channel.promoted"
        assert child in json.dumps(after[-1].payload)
        assert len(await c.list_states(parent)) == len(parent_versions) + 1
        assert (await c.latest_state(parent))["state"] == {"answer": 42}
        assert (await c.get_channel_metadata(child)).outcome == "promoted"
        promoted = await events(c, parent)
        again = await c.promote_channel(child)         # a retry merges nothing twice
        assert again["replayed"] is True and await events(c, parent) == promoted
        await c.save_state(child, await c.get_cursor(child), {"answer": 43})
        newer = await c.promote_channel(child)         # a newer fork state is a new promotion
        assert newer["replayed"] is False and (await c.latest_state(parent))["state"] == {"answer": 43}

        with pytest.raises(APIError) as err:
            await c.promote_channel(parent)  # a root has nothing to merge into
        assert 400 <= err.value.status_code < 500

    with_client(body)


def test_delete_channel_recursive(with_client, unique):
    root, a, b, keep = unique("root"), unique("a"), unique("b"), unique("keep")

    async def body(c):
        cursor = await parent_with_state(c, root)
        await c.fork(root, a, cursor)
        await c.fork(a, b, 0)
        await parent_with_state(c, keep)
        await c.delete_channel(root, recursive=True)
        listed = await c.list_channels()
        assert keep in listed
        for ch in (root, a, b):
            assert ch not in listed
            assert await c.get_channel_metadata(ch) is None
            assert await events(c, ch) == []
        assert await c.get_channel_metadata(keep) is not None

    with_client(body)


def test_diff_of_siblings_uses_the_boundary_they_share(with_client, unique):
    parent, early, late = unique("parent"), unique("early"), unique("late")

    async def body(c):
        first = await parent_with_state(c, parent, {"n": 1, "tag": "a"})
        await c.record(parent, "more", {}, actor="test")
        second = await c.get_cursor(parent)
        await c.save_state(parent, second, {"n": 2, "tag": "a"})
        await c.fork(parent, early, first)
        await c.fork(parent, late, second)
        diff = await c.diff_states(early, late)
        assert diff["common"]["channel_id"] == parent
        assert diff["common"]["state"] == {"n": 1, "tag": "a"}
        assert (diff["left_diverged_at_cursor"], diff["right_diverged_at_cursor"]) == (first, second)
        assert diff["entries"] == [{"path": ["n"], "kind": "changed", "left": 1, "right": 2}]
        # Unrelated channels share nothing.
        stranger = unique("stranger")
        await parent_with_state(c, stranger, {"n": 1})
        unrelated = await c.diff_states(parent, stranger)
        assert unrelated["common"] is None
        kinds = {(tuple(e["path"]), e["kind"]) for e in unrelated["entries"]}
        assert kinds == {(("n",), "changed"), (("tag",), "removed")}

    with_client(body)


def test_fork_guards_compare_with_the_latest_state(with_client, unique):
    parent, child = unique("parent"), unique("child")

    async def body(c):
        first = await parent_with_state(c, parent, {"n": 1})
        await c.save_state(parent, first, {"n": 2})  # version 2, same cursor
        for guard in ({"expected_version": 1}, {"expected_cursor": first + 1}):
            with pytest.raises(VersionConflictError):
                await c.fork(parent, child, 0, **guard)
            assert await c.get_channel_metadata(child) is None
        receipt = await c.fork(parent, child, 0, expected_version=2, expected_cursor=first)
        assert receipt.source_state_version == 2
        assert (await c.latest_state(child))["state"] == {"n": 2}

    with_client(body)


BAD_FORKS = {
    "unknown-policy": {"tool_policies": {"charge_customer": "sometimes"}},
    "policy-not-a-string": {"tool_policies": {"charge_customer": 1}},
    "policies-not-an-object": {"tool_policies": ["block"]},
    "negative-cursor": {"at_cursor": -1},
    "cursor-string": {"at_cursor": "3"},
    "bad-child-id": {"new_channel_id": "a/b"},
    "child-id-newline": {"new_channel_id": "child\n"},
    "metadata-not-an-object": {"experiment_metadata": ["x"]},
}


@pytest.mark.parametrize("case", list(BAD_FORKS))
def test_bad_fork_request_is_rejected_with_json_400(server, with_client, unique, case):
    parent, child = unique("parent"), unique("child")
    cursor = with_client(lambda c: parent_with_state(c, parent))
    body = {"source_channel_id": parent, "new_channel_id": child, "at_cursor": cursor,
            "operation_id": str(uuid.uuid4()), **BAD_FORKS[case]}
    status, headers, answer = http("POST", server.url + "/api/v1/channels/fork", key=server.key, body=body)
    assert status == 400, answer
    assert "application/json" in headers.get("content-type", "")
    assert isinstance(answer["status"], str) and isinstance(answer["error"], str) and answer["error"]
    _, _, forks = http("GET", f"{server.url}/api/v1/channels/{parent}/forks", key=server.key)
    assert forks["forks"] == []


def test_compare_channels(with_client, unique):
    parent, child = unique("parent"), unique("child")

    async def body(c):
        cursor = await parent_with_state(c, parent, {"answer": 1, "same": True})
        await c.fork(parent, child, cursor, manifest={"model": "slow"})
        await c.record(child, "work", {"output": "better"}, actor="test")
        await c.save_state(child, await c.get_cursor(child), {"answer": 2, "same": True})
        result = await c.compare_channels(parent, child)
        assert {"left_channel_id", "right_channel_id", "state_diff", "manifest_diff", "tool_diff",
                "output_diff", "metrics"} <= set(result)
        assert (result["left_channel_id"], result["right_channel_id"]) == (parent, child)
        diff = await c.diff_states(parent, child)
        assert [e["path"] for e in diff["entries"]] == [["answer"]]
        assert [e["path"] for e in result["state_diff"]["entries"]] == [["answer"]]

    with_client(body)


def ranked_channel_ids(ranking):
    """The channel ids of a rank response, in rank order (the shape is server-defined)."""
    members = ranking if isinstance(ranking, list) else next(
        ranking[k] for k in ("ranking", "ranked", "results", "members") if isinstance(ranking.get(k), list))
    return [m["channel_id"] for m in members]


def test_experiment_ranks_members_by_score(with_client, unique):
    parent = unique("parent")
    low, high, unscored = unique("low"), unique("high"), unique("unscored")

    async def body(c):
        cursor = await parent_with_state(c, parent)
        for ch in (low, high, unscored):
            await c.fork(parent, ch, cursor)
        await c.set_outcome(low, "rejected", score=0.2)
        await c.set_outcome(high, "promoted", score=0.9)
        exp = await c.create_experiment(unique("exp"), description="model sweep", baseline_channel_id=parent)
        exp_id = exp.get("id") or exp.get("group_id")
        assert exp_id
        for ch in (unscored, low, high):
            await c.add_experiment_member(exp_id, ch, declared_delta={"model": ch})
        got = await c.get_experiment(exp_id)
        assert {low, high, unscored} <= {m["channel_id"] for m in got["members"]}
        assert exp_id in {e.get("id") or e.get("group_id") for e in await c.list_experiments()}
        order = [ch for ch in ranked_channel_ids(await c.rank_experiment(exp_id)) if ch in (low, high, unscored)]
        assert order == [high, low, unscored]

    with_client(body)
