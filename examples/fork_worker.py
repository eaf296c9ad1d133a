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
out: the worker was paused or cut off), it cancels the job at once and writes nothing more (not even
the fork's end), since another worker may hold the job now. A worker that dies stops renewing: once its lease has run out
the next worker's claim gets the job and resumes the fork where it stands. The steps recorded stay
recorded; a step run again after its side effect finds that effect completed in the ledger and
does not run it again.

Before it runs a job it asks the server whether the event is the fork's current job (GET
/api/v1/channels/{fork}/hand-off): an event that is no fork.job, a job replaced by a later hand-off,
or a fork its key may not read is acknowledged and skipped. Stopped from outside (Ctrl-C), it
acknowledges nothing: its lease runs out and the next worker takes the job.

The key needs read and write on actae.fork-jobs and on the forks it runs. The jobs channel names every
handed-off fork: a key that reads it learns those names, so give it to workers trusted with them.
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
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Optional

from actae_client import ActaeClient, AgentSession, APIError, ConsumerError, SessionError

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
    """This worker's hold on a job: renewed every third of the lease while the job runs; the job is
    cancelled the moment a renewal is refused (another worker may hold it now)."""

    def __init__(self, client: ActaeClient, worker: str, seconds: int, since: float):
        self.client, self.worker, self.seconds = client, worker, seconds
        self.renewed = since                       # when the server last counted the lease from (or later)
        self.lost = False

    async def keep(self, job: asyncio.Task) -> None:
        while not job.done():
            await asyncio.sleep(self.seconds / 3)
            asked = time.monotonic()               # the server counts from no earlier than this
            try:
                await self.client.heartbeat(WORKERS_GROUP, self.worker, lease_seconds=self.seconds)
            except ConsumerError:
                self.lost = True
                job.cancel()
                return
            except Exception:  # noqa: BLE001 - the server may be back before the lease runs out
                log.warning("could not renew the lease; trying again")
                if time.monotonic() - self.renewed >= self.seconds:
                    self.lost = True
                    job.cancel()
                    return
            else:
                self.renewed = asked

    def check(self) -> None:
        if self.lost or time.monotonic() - self.renewed >= self.seconds:
            self.lost = True
            raise LeaseLost(f"worker {self.worker}'s lease ran out")


async def resume_fork(client: ActaeClient, fork: str, args, lease: Lease) -> str:
    """Run the fork's tail with the application's step function; what became of it."""
    app = Application(client, "fast", args.slow, args.effects_log, args.worker_id)
    try:
        session = await AgentSession.resume(client, fork, state_fn=app.snapshot)
    except (SessionError, APIError) as exc:        # deleted, completed, or not this key's to run
        return f"skipped ({exc})"
    inherited = session.inherited_state or {}
    app.state["model"] = (session.intervention or {}).get("model") or inherited.get("model") or "fast"
    app.restore(inherited)
    # The session is entered and left by hand: a worker that lost its lease (or is stopped) leaves the
    # fork as it is for the next worker, where leaving `async with` would mark it crashed.
    await session.__aenter__()
    try:
        for number in range(session.step_count + 1, len(fork_demo.STEPS) + 1):
            lease.check()
            await app.run_step(session, number)
    except Exception as exc:  # noqa: BLE001 - the application's step failed: the fork crashed
        lease.check()                              # unless the job is no longer this worker's
        await session.__aexit__(type(exc), exc, exc.__traceback__)
        return f"crashed ({type(exc).__name__}: {exc})"
    await session.__aexit__(None, None, None)
    return f"completed (steps {session.step_count} of {len(fork_demo.STEPS)}, model {app.state['model']})"


def job_of(event) -> Optional[str]:
    """The fork a claimed event hands off, or None: an event of the jobs channel that is no fork.job."""
    payload = event.payload if isinstance(event.payload, dict) else {}
    fork = payload.get("fork_channel_id")
    return fork if event.event_type == "fork.job" and isinstance(fork, str) else None


def current_job(args, fork: str) -> Optional[int]:
    """The cursor of the fork's current job, as the server says (GET /api/v1/channels/{fork}/hand-off;
    the SDK has no call for it yet), or None: not handed off, or not this key's to read."""
    request = urllib.request.Request(f"{args.url.rstrip('/')}/api/v1/channels/{urllib.parse.quote(fork)}/hand-off",
                                     headers={"x-api-key": args.key})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.loads(answer.read())["job_cursor"]
    except urllib.error.HTTPError as exc:
        if exc.code in (403, 404):
            return None
        raise


async def run_job(client: ActaeClient, event, args, claimed_at: float) -> None:
    """One claimed job: run it while this worker holds it, then acknowledge it (a job that is no
    fork's current one is acknowledged at once: it was handed off again, or it is no job)."""
    fork = job_of(event)
    if fork is None or await asyncio.to_thread(current_job, args, fork) != event.cursor:
        outcome = "skipped (not a fork's current job)"
    else:
        lease = Lease(client, args.worker_id, args.lease, claimed_at)
        job = asyncio.create_task(slowly(resume_fork(client, fork, args, lease), args.slow))
        keeper = asyncio.create_task(lease.keep(job))
        try:
            outcome = await job
        except (LeaseLost, asyncio.CancelledError):
            if not lease.lost:
                raise                               # stopped from outside (Ctrl-C): no ack, the lease runs out
            print(f"{args.worker_id}: stopped {fork}: its lease ran out; another worker takes the job", flush=True)
            return
        finally:
            keeper.cancel()
    try:
        await client.ack_work(WORKERS_GROUP, args.worker_id, event.cursor)
    except (ConsumerError, APIError) as exc:        # the lease ran out just now: the job comes back, finds it done
        print(f"{args.worker_id}: could not acknowledge {fork}'s job ({exc})", flush=True)
    print(f"{args.worker_id}: {fork} {outcome}", flush=True)


async def slowly(work, seconds: float):
    await asyncio.sleep(seconds)
    return await work


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
            asked = time.monotonic()                # the claim's lease runs from no earlier than this
            claimed = await client.claim_work(WORKERS_GROUP, args.worker_id, limit=1)
        except ConsumerError:                       # the lease ran out while idle: join again
            await client.join_group(WORKERS_GROUP, args.worker_id, lease_seconds=args.lease)
            renewed = time.monotonic()
            continue
        if not claimed.events:
            await asyncio.sleep(args.poll)
            continue
        for event in claimed.events:
            await run_job(client, event, args, asked)
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
