"""A worker that runs the forks handed to it, built on the SDK's consumer groups.

    ACTAE_URL=http://127.0.0.1:8002 ACTAE_API_KEY=sk-... python examples/fork_worker.py --worker-id w1

Fork a run with "Hand it to a worker" ticked on the dashboard's fork form (or POST
/api/v1/channels/fork with "hand_off": true, POST /api/v1/channels/{fork}/hand-off, or the MCP
tool fork_run with hand_off): the server puts a `fork.job` event on the channel actae.fork-jobs,
which the consumer group actae.fork-workers reads. This worker joins that group, claims one job at
a time, resumes the fork with `AgentSession.resume` and the application's own step function, and
acknowledges the job once the fork's session has ended, completed or crashed. The application
here is fork_demo.py's pipeline (research ... finalize; step 4 charges the customer through the
execution ledger), with the model the fork's intervention names.

While it works it renews its lease every third of `--lease`. If a renewal is refused (the lease ran
out: the worker was paused or cut off), it stops before its next step and writes nothing more, since
another worker may hold the job now. A worker that dies stops renewing: once its lease has run out
the next worker's claim gets the job and resumes the fork where it stands. The steps recorded stay
recorded; a step run again after its side effect finds that effect completed in the ledger and
does not run it again.

The key needs read and write on actae.fork-jobs and on the forks it runs.
`--slow S` waits S seconds after claiming a job, in each step and after each charge (to watch the
fork's page change, or to stop a worker mid-job); `--effects-log FILE` appends a line per charge
this worker made for real.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from actae_client import ActaeClient, AgentSession, ConsumerError, SessionError

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _connect  # noqa: E402  (one line, not a traceback, for a refused key or a wrong address)
import fork_demo  # noqa: E402  (the application: its pipeline and its step function)

JOBS_CHANNEL = "actae.fork-jobs"
WORKERS_GROUP = "actae.fork-workers"
log = logging.getLogger("fork_worker")


class LeaseLost(Exception):
    """The job's lease ran out: another worker may run the fork now."""


class Application(fork_demo.Pipeline):
    """The application's step function (fork_demo's pipeline), slowed down and its charges logged."""

    def __init__(self, client: ActaeClient, model: str, slow: float, effects_log: Optional[Path], worker: str):
        super().__init__(client, model)
        self.slow, self.effects_log, self.worker = slow, effects_log, worker

    async def charge_customer(self, channel: str) -> None:
        before = self.charges
        await super().charge_customer(channel)
        if self.charges > before:                   # this worker charged for real (the ledger let it)
            if self.effects_log is not None:
                with self.effects_log.open("a") as out:
                    out.write(json.dumps({"worker": self.worker, "channel": channel, "charge": self.state["charge"]}) + "\n")
            await asyncio.sleep(self.slow)          # a worker stopped here has charged, not yet recorded the step

    async def run_step(self, session: AgentSession, number: int) -> None:
        await asyncio.sleep(self.slow)
        await super().run_step(session, number)


class Lease:
    """This worker's lease in the group, renewed every third of it while a job runs."""

    def __init__(self, client: ActaeClient, worker: str, seconds: int):
        self.client, self.worker, self.seconds = client, worker, seconds
        self.renewed = time.monotonic()
        self.lost = False

    async def renew(self) -> None:
        try:
            await self.client.heartbeat(WORKERS_GROUP, self.worker, lease_seconds=self.seconds)
        except ConsumerError:
            self.lost = True
            raise LeaseLost(f"worker {self.worker}'s lease ran out") from None
        self.renewed = time.monotonic()

    async def keep(self) -> None:
        while not self.lost:
            await asyncio.sleep(self.seconds / 3)
            try:
                await self.renew()
            except LeaseLost:
                return
            except Exception:  # noqa: BLE001 - the server may be back before the lease runs out
                log.warning("could not renew the lease; trying again")

    def check(self) -> None:
        if self.lost or time.monotonic() - self.renewed >= self.seconds:
            self.lost = True
            raise LeaseLost(f"worker {self.worker}'s lease ran out")


async def resume_fork(client: ActaeClient, fork: str, args, lease: Lease) -> str:
    """Run the fork's tail with the application's step function; what became of it."""
    app = Application(client, "fast", args.slow, args.effects_log, args.worker_id)
    try:
        session = await AgentSession.resume(client, fork, state_fn=app.snapshot)
    except SessionError as exc:                    # deleted, or completed by someone else: nothing to run
        return f"skipped ({exc})"
    inherited = session.inherited_state or {}
    app.state["model"] = (session.intervention or {}).get("model") or inherited.get("model") or "fast"
    app.restore(inherited)
    # The session is entered and left by hand: a worker that lost its lease must leave the fork as it
    # is (another worker runs it now), not mark it crashed as leaving `async with` on an error would.
    await session.__aenter__()
    try:
        for number in range(session.step_count + 1, len(fork_demo.STEPS) + 1):
            lease.check()
            await app.run_step(session, number)
    except LeaseLost:
        raise
    except BaseException as exc:
        await session.__aexit__(type(exc), exc, exc.__traceback__)
        return f"crashed ({type(exc).__name__}: {exc})"
    await session.__aexit__(None, None, None)
    return f"completed (steps {session.step_count} of {len(fork_demo.STEPS)}, model {app.state['model']})"


async def run_job(client: ActaeClient, event, args) -> None:
    fork = (event.payload or {}).get("fork_channel_id")
    lease = Lease(client, args.worker_id, args.lease)
    keeper = asyncio.create_task(lease.keep())
    try:
        await asyncio.sleep(args.slow)
        outcome = await resume_fork(client, fork, args, lease) if fork else "skipped (no fork named)"
    except LeaseLost as exc:
        print(f"{args.worker_id}: stopped {fork}: {exc}; another worker takes the job", flush=True)
        return
    finally:
        keeper.cancel()
    await client.ack_work(WORKERS_GROUP, args.worker_id, event.cursor)
    print(f"{args.worker_id}: {fork} {outcome}", flush=True)


async def work(args) -> int:
    async with ActaeClient(endpoint=args.url, api_key=args.key) as client:
        return await serve_jobs(client, args)


async def serve_jobs(client: ActaeClient, args) -> int:
    """Join the group, then claim, run and acknowledge one job at a time."""
    await client.create_group(WORKERS_GROUP, JOBS_CHANNEL, metadata={"purpose": "forks handed to workers"})
    await client.join_group(WORKERS_GROUP, args.worker_id, lease_seconds=args.lease)
    print(f"{args.worker_id}: waiting for jobs on {JOBS_CHANNEL} (group {WORKERS_GROUP})", flush=True)
    done, renewed = 0, time.monotonic()
    while args.jobs is None or done < args.jobs:
        try:
            if time.monotonic() - renewed >= args.lease / 3:
                await client.heartbeat(WORKERS_GROUP, args.worker_id, lease_seconds=args.lease)
                renewed = time.monotonic()
            claimed = await client.claim_work(WORKERS_GROUP, args.worker_id, limit=1)
        except ConsumerError:                       # the lease ran out while idle: join again
            await client.join_group(WORKERS_GROUP, args.worker_id, lease_seconds=args.lease)
            renewed = time.monotonic()
            continue
        if not claimed.events:
            await asyncio.sleep(args.poll)
            continue
        for event in claimed.events:
            await run_job(client, event, args)
            done += 1
        renewed = 0.0                               # renew before the next claim: the job may have been long
    return 0


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=os.environ.get("ACTAE_URL"), help="server URL (env ACTAE_URL)")
    p.add_argument("--key", default=os.environ.get("ACTAE_API_KEY"), help="API key (env ACTAE_API_KEY)")
    p.add_argument("--worker-id", default=f"{socket.gethostname()}-{os.getpid()}",
                   help="this worker's consumer id in the group (default: host-pid)")
    p.add_argument("--lease", type=int, default=30, help="seconds a claimed job stays this worker's unless renewed")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between claims while there is no job")
    p.add_argument("--jobs", type=int, default=None, help="stop after this many jobs (default: run until stopped)")
    p.add_argument("--slow", type=float, default=0.0, help="seconds to wait after a claim, in each step, after a charge")
    p.add_argument("--effects-log", type=Path, default=None, help="append a JSON line per charge made for real")
    args = p.parse_args(argv)
    if not args.url or not args.key:
        p.error("set ACTAE_URL and ACTAE_API_KEY (or pass --url and --key)")
    if args.lease < 1:
        p.error("--lease must be at least 1 second")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    with _connect.plainly("fork_worker.py", args.url):
        try:
            return asyncio.run(work(args))
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    sys.exit(main())
