"""Fork fidelity: does forking at step k keep what a full re-run would lose, and at what cost?

    ACTAE_URL=http://127.0.0.1:8002 ACTAE_API_KEY=sk-... python examples/fork_fidelity.py
    python examples/fork_fidelity.py --scenarios support_triage --repeats 1

Five multi-step agent scenarios run on a seeded stochastic stub model (no API key): each step
the model samples a few options whose preferences depend on the earlier steps' output, so a
re-run drifts from its first sampling just as a real model would. For every scenario:

  canonical   one run, recorded in an AgentSession that snapshots every step;
  fork        fork the canonical run at step k (`AgentSession.resume(fork_at_step=k)`) and run
              only steps k+1..N from the inherited state, sampling with a new seed;
  rerun       a fresh session that runs every step again with that same new seed.

A deterministic scorer (no LLM) compares each final output with the canonical one: the token
Jaccard of the compiled report and an exact match of the final decision. The model counts its
own calls and tokens, and every path is timed, so the savings printed are measured, not
assumed. The stub sleeps `--latency-ms` per call plus `--ms-per-token` per token to stand in
for a networked model (0 and 0 measure only Actae's overhead).

Writes a JSON report (--out, default examples/out/fork_fidelity.json).
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import hashlib
import json
import math
import os
import random
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from actae_client import ActaeClient, AgentSession

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _connect  # noqa: E402  (examples/_connect.py: one line, not a traceback, for a refused key or a wrong address)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "examples" / "out" / "fork_fidelity.json"
CANONICAL_SEED = 0


@dataclass(frozen=True)
class Scenario:
    """An agent task: ordered steps, the words its options are made of, and where to fork."""
    name: str
    task: str
    steps: tuple[str, ...]
    vocabulary: tuple[str, ...]
    fork_at: int
    picks: int = 2


SCENARIOS = {s.name: s for s in [
    Scenario("research_report", "write a literature report on battery recycling",
             ("search", "read", "extract", "contradictions", "outline", "draft", "cite", "conclude"),
             ("lithium", "cobalt", "hydrometallurgy", "pyrolysis", "cost", "policy", "yield",
              "safety", "supply", "emissions", "startups", "patents"), fork_at=6),
    Scenario("support_triage", "resolve a customer's failed payment ticket",
             ("classify", "account", "knowledge_base", "diagnose", "propose_fix", "reply"),
             ("card", "declined", "3ds", "refund", "retry", "limit", "fraud", "bank", "currency",
              "invoice", "apology", "escalate"), fork_at=4),
    Scenario("code_review", "review a pull request that adds caching",
             ("read_diff", "risks", "tests", "style", "security", "verdict"),
             ("invalidation", "ttl", "race", "memory", "coverage", "naming", "docs", "injection",
              "timeout", "approve", "request_changes", "benchmark"), fork_at=4),
    Scenario("trip_planner", "plan a five-day trip to Lisbon on a budget",
             ("destinations", "dates", "flights", "hotels", "activities", "budget", "itinerary"),
             ("alfama", "belem", "sintra", "cascais", "tram", "fado", "museum", "hostel",
              "airbnb", "may", "october", "food"), fork_at=5),
    Scenario("data_cleaning", "clean a sales dataset for a quarterly forecast",
             ("profile", "nulls", "outliers", "imputation", "transform", "validate", "summarize"),
             ("median", "mean", "drop", "winsorize", "log", "zscore", "dedupe", "currency",
              "timezone", "schema", "seasonality", "holdout"), fork_at=5),
]}


def unit_hash(*parts: str) -> float:
    """A stable pseudo-random number in [0, 1) for `parts`."""
    digest = hashlib.sha256("\x00".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64


class StubModel:
    """A seeded stochastic stand-in for an LLM that counts its calls and tokens.

    Each option's logit is a fixed preference for the step plus an affinity to every item
    picked earlier (so early differences shift later choices); sampling is Gumbel-top-k at
    `temperature`, with noise seeded by (seed, scenario, step): two paths that share a seed
    and a context sample alike.
    """

    def __init__(self, seed: int, *, temperature=0.8, latency_ms=30.0, ms_per_token=0.2):
        self.seed = seed
        self.temperature = temperature
        self.latency_ms = latency_ms
        self.ms_per_token = ms_per_token
        self.calls = 0
        self.tokens = 0

    async def choose(self, scenario: Scenario, step: str, context: list[str]) -> list[str]:
        """Return `scenario.picks` options for `step`, given the earlier picks in `context`."""
        prompt = f"Task: {scenario.task}. Step: {step}. So far: {' '.join(context)}"
        options = [f"{step}:{word}" for word in scenario.vocabulary]
        rng = random.Random(f"{self.seed}:{scenario.name}:{step}")

        def logit(option: str) -> float:
            base = 6.0 * unit_hash(scenario.name, option)
            affinity = sum(unit_hash(c, option) - 0.5 for c in context) / max(1, len(context))
            return base + 3.0 * affinity

        noisy = {o: logit(o) / self.temperature - math.log(-math.log(rng.random() or 1e-12))
                 for o in options}
        picks = sorted(options, key=noisy.get, reverse=True)[:scenario.picks]
        used = len(prompt.split()) + len(picks)
        self.calls += 1
        self.tokens += used
        await asyncio.sleep((self.latency_ms + self.ms_per_token * used) / 1000)
        return picks


class Agent:
    """Runs a scenario's steps; its `state` is what the session snapshots."""

    def __init__(self, scenario: Scenario, model: StubModel):
        self.scenario = scenario
        self.model = model
        self.state = {"scenario": scenario.name, "picks": {}, "report": [], "decision": None}

    def snapshot(self) -> dict:
        return copy.deepcopy(self.state)

    async def run(self, session: AgentSession, first: int) -> None:
        """Run steps `first`..N (1-based), recording each in `session`."""
        for number in range(first, len(self.scenario.steps) + 1):
            step = self.scenario.steps[number - 1]
            picks = await self.model.choose(self.scenario, step, self.state["report"])
            self.state["picks"][step] = picks
            self.state["report"] = self.state["report"] + picks
            self.state["decision"] = picks[0]
            await session.step(step, output={"picks": picks}, metadata={"seed": self.model.seed})


def score(canonical: dict, other: dict) -> dict:
    """Compare a final state with the canonical one.

    Returns the Jaccard index of the two reports' items (`step:option`), the share of steps
    whose picks match exactly, and whether the final decision matches.
    """
    left, right = set(canonical["report"]), set(other["report"])
    steps = canonical["picks"]
    return {"jaccard": round(len(left & right) / len(left | right), 4) if left | right else 1.0,
            "step_match": round(sum(other["picks"].get(s) == p for s, p in steps.items()) / len(steps), 4),
            "decision_match": canonical["decision"] == other["decision"]}


def new_model(seed: int, args) -> StubModel:
    return StubModel(seed, temperature=args.temperature, latency_ms=args.latency_ms,
                     ms_per_token=args.ms_per_token)


async def run_full(client, scenario: Scenario, channel: str, seed: int, args) -> dict:
    """Run every step in a fresh session with `seed` (the canonical run, or a full re-run)."""
    model = new_model(seed, args)
    agent = Agent(scenario, model)
    started = time.perf_counter()
    async with AgentSession(client, channel, state_fn=agent.snapshot, snapshot_interval=1) as session:
        await agent.run(session, 1)
    return {"state": agent.state, "model_calls": model.calls, "tokens": model.tokens,
            "seconds": time.perf_counter() - started}


async def run_fork(client, scenario: Scenario, source: str, channel: str, seed: int, args) -> dict:
    """Fork `source` after step k and run only the tail with `seed`."""
    model = new_model(seed, args)
    started = time.perf_counter()
    agent = Agent(scenario, model)
    fork = await AgentSession.resume(client, source, fork_at_step=scenario.fork_at, name=channel,
                                     state_fn=agent.snapshot, intervention={"sampling_seed": seed})
    agent.state = copy.deepcopy(fork.inherited_state)  # steps 1..k come from the fork, not the model
    async with fork:
        await agent.run(fork, scenario.fork_at + 1)
    return {"state": agent.state, "model_calls": model.calls, "tokens": model.tokens,
            "seconds": time.perf_counter() - started}


def path_summary(runs: list[dict], canonical: dict) -> dict:
    """Aggregate one path's runs: scores against the canonical state, calls, tokens, time."""
    scores = [score(canonical["state"], r["state"]) for r in runs]
    return {
        "runs": len(runs),
        "jaccard": [s["jaccard"] for s in scores],
        "mean_jaccard": round(statistics.mean(s["jaccard"] for s in scores), 4),
        "mean_step_match": round(statistics.mean(s["step_match"] for s in scores), 4),
        "decision_match_rate": round(sum(s["decision_match"] for s in scores) / len(scores), 4),
        "model_calls_per_run": statistics.mean(r["model_calls"] for r in runs),
        "tokens_per_run": statistics.mean(r["tokens"] for r in runs),
        "seconds_per_run": round(statistics.mean(r["seconds"] for r in runs), 4),
    }


def saving(fork: float, rerun: float) -> float:
    return round(1 - fork / rerun, 4) if rerun else 0.0


async def run_scenario(client, scenario: Scenario, prefix: str, args) -> dict:
    base = f"{prefix}-{scenario.name}"
    canonical = await run_full(client, scenario, f"{base}-canon", CANONICAL_SEED, args)
    forks, reruns = [], []
    for r in range(args.repeats):
        seed = args.seed + r + 1
        forks.append(await run_fork(client, scenario, f"{base}-canon", f"{base}-fork{r}", seed, args))
        reruns.append(await run_full(client, scenario, f"{base}-rerun{r}", seed, args))
    fork, rerun = path_summary(forks, canonical), path_summary(reruns, canonical)
    return {
        "name": scenario.name, "steps": len(scenario.steps), "fork_at": scenario.fork_at,
        "tail_steps": len(scenario.steps) - scenario.fork_at,
        "canonical": {"channel": f"{base}-canon", "decision": canonical["state"]["decision"],
                      "model_calls": canonical["model_calls"], "tokens": canonical["tokens"],
                      "seconds": round(canonical["seconds"], 4)},
        "fork": fork, "rerun": rerun,
        "savings": {k: saving(fork[f], rerun[f]) for k, f in
                    (("model_calls", "model_calls_per_run"), ("tokens", "tokens_per_run"),
                     ("seconds", "seconds_per_run"))},
    }


def print_report(report: dict) -> None:
    print(f"\n{'scenario':<16} {'k/N':>5}  {'Jaccard f/r':>11}  {'exact steps f/r':>15}  {'decision f/r':>12}"
          f"  {'calls f/r':>9}  {'tokens f/r':>10}  {'ms f/r':>9}")
    for s in report["scenarios"]:
        f, r = s["fork"], s["rerun"]
        pair = lambda key, fmt: f"{format(f[key], fmt)}/{format(r[key], fmt)}"
        print(f"{s['name']:<16} {s['fork_at']:>2}/{s['steps']:<2}  {pair('mean_jaccard', '.2f'):>11}"
              f"  {pair('mean_step_match', '.2f'):>15}  {pair('decision_match_rate', '.2f'):>12}"
              f"  {pair('model_calls_per_run', '.0f'):>9}  {pair('tokens_per_run', '.0f'):>10}"
              f"  {1000 * f['seconds_per_run']:.0f}/{1000 * r['seconds_per_run']:.0f}")
    m = report["mean"]
    print(f"\nmean vs canonical: report Jaccard fork {m['fork_jaccard']:.3f}, re-run {m['rerun_jaccard']:.3f}; "
          f"exact steps fork {m['fork_step_match']:.2f}, re-run {m['rerun_step_match']:.2f}; "
          f"decision fork {m['fork_decision_match']:.2f}, re-run {m['rerun_decision_match']:.2f}")
    print(f"fork path saves {100 * m['model_call_savings']:.0f}% of model calls, "
          f"{100 * m['token_savings']:.0f}% of tokens, {100 * m['time_savings']:.0f}% of wall time (measured)")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=os.environ.get("ACTAE_URL"), help="server URL (env ACTAE_URL)")
    p.add_argument("--key", default=os.environ.get("ACTAE_API_KEY"), help="API key (env ACTAE_API_KEY)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"subset of: {', '.join(SCENARIOS)}")
    p.add_argument("--repeats", type=int, default=5, help="fork and re-run paths per scenario (default 5)")
    p.add_argument("--seed", type=int, default=100, help="first sampling seed of the repeats")
    p.add_argument("--temperature", type=float, default=0.8, help="stub sampling temperature")
    p.add_argument("--latency-ms", type=float, default=30.0, help="stub latency per call (ms)")
    p.add_argument("--ms-per-token", type=float, default=0.2, help="stub latency per token (ms)")
    p.add_argument("--name", default=f"fid-{uuid.uuid4().hex[:8]}", help="channel prefix")
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"JSON report (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    if not args.url or not args.key:
        p.error("set ACTAE_URL and ACTAE_API_KEY (or pass --url and --key)")
    unknown = set(args.scenarios.split(",")) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    return args


async def run(args) -> int:
    client = ActaeClient(endpoint=args.url, api_key=args.key)
    started = time.perf_counter()
    try:
        scenarios = []
        for name in args.scenarios.split(","):
            scenarios.append(await run_scenario(client, SCENARIOS[name], args.name, args))
            print(f"done {name}", flush=True)
    finally:
        await client.disconnect()
    mean = lambda path, key: round(statistics.mean(s[path][key] for s in scenarios), 4)
    report = {
        "benchmark": "fork_fidelity", "model": "stub", "repeats": args.repeats,
        "config": {"seed": args.seed, "temperature": args.temperature, "latency_ms": args.latency_ms,
                   "ms_per_token": args.ms_per_token},
        "seconds": round(time.perf_counter() - started, 2),
        "scenarios": scenarios,
        "mean": {
            "fork_jaccard": mean("fork", "mean_jaccard"), "rerun_jaccard": mean("rerun", "mean_jaccard"),
            "fork_step_match": mean("fork", "mean_step_match"),
            "rerun_step_match": mean("rerun", "mean_step_match"),
            "fork_decision_match": mean("fork", "decision_match_rate"),
            "rerun_decision_match": mean("rerun", "decision_match_rate"),
            "model_call_savings": mean("savings", "model_calls"), "token_savings": mean("savings", "tokens"),
            "time_savings": mean("savings", "seconds"),
        },
    }
    print_report(report)
    print(f"Dashboard:   {args.url.rstrip('/')}/?q={args.name}  (every canonical run, fork and re-run)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out} ({report['seconds']} s)")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    with _connect.plainly("fork_fidelity.py", args.url):
        return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
