"""`actae enroll`: an instance links itself to an organisation's gateway, opt-in. The gateway's admin
makes a one-use, expiring enrollment token; the instance enrolls with it and then answers through the
SDK's FleetClient; `unenroll` removes it and the key the gateway held stops working. And a server
that never enrolled, with no collector and no remote, opens no outbound connection at all.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

from conftest import ServerProcess, cli, dashboard_cookie, http, instance_id, org_token, poll, run, using

ORG = "local"


def enrollment(gateway, *flags) -> str:
    done = cli("enrollment", "create", "--name", "edge", *flags, data_dir=gateway.data_dir)
    return next(line for line in done.stdout.splitlines() if line.startswith("en-"))


def enroll(instance, *args, check=True):
    """`actae enroll ...`; a token's enrollment accepts the scopes it prints (--yes: no terminal here)."""
    accept = ("--yes",) if args and not args[0].startswith("--") else ()
    return cli("enroll", *args, *accept, data_dir=instance.data_dir, check=check)


def test_enroll_answer_through_the_gateway_then_unenroll(tmp_path):
    with ServerProcess(tmp_path / "gw").start() as gateway, ServerProcess(tmp_path / "edge").start() as edge:
        assert "Not enrolled" in enroll(edge, "--status").stdout
        token = enrollment(gateway, "--read", "*", "--write", "*")
        done = enroll(edge, token, "--gateway", gateway.url, "--url", edge.url, "--name", "edge-1")
        edge_id = instance_id(edge)
        assert f"as instance {edge_id}" in done.stdout, done.stdout
        assert gateway.url in enroll(edge, "--status").stdout

        # the gateway lists it (its Fleet page too) and reaches it for the SDK's FleetClient
        listed = cli("instance", "list", "--json", data_dir=gateway.data_dir).stdout
        assert edge_id in listed
        _, token_text = org_token(gateway, "--read", "*", "--write", "*")
        from actae_client.fleet import FleetClient

        async def through_the_gateway():
            async with FleetClient(token_text, gateway.url, ORG) as fleet:
                await fleet.call_operation("actae.api.v1.events.record", instance_id=edge_id,
                                           body={"channel_id": "via-gw", "event_type": "step", "payload": {"n": 1}})
                return await fleet.call_operation("actae.api.v1.channels.list", instance_id=edge_id)
        listing = run(through_the_gateway())
        assert "via-gw" in str(listing)
        assert http("GET", edge.url + "/api/v1/events/replay/via-gw", key=edge.key)[2]["events"][0]["payload"] == {"n": 1}
        page = http("GET", gateway.url + "/fleet?format=json", headers={"cookie": dashboard_cookie(gateway)})
        assert page[0] == 200 and edge_id in str(page[2]), page

        # a used token is refused, with why
        again = enroll(edge, token, "--gateway", gateway.url, "--url", edge.url, check=False)
        assert again.returncode != 0 and "already enrolled" in again.stderr, again.stderr

        key_id = re.search(r"holds key (\d+)", done.stdout).group(1)
        keys = cli("key", "list", "--json", data_dir=edge.data_dir).stdout
        assert f'"id": {key_id}' in keys
        gone = cli("unenroll", data_dir=edge.data_dir)
        assert "Unenrolled" in gone.stdout, gone.stdout
        assert edge_id not in cli("instance", "list", "--json", data_dir=gateway.data_dir).stdout
        assert f'"id": {key_id}' not in cli("key", "list", "--json", data_dir=edge.data_dir).stdout
        assert "Not enrolled" in enroll(edge, "--status").stdout


def test_a_used_or_expired_enrollment_token_is_refused_clearly(tmp_path):
    with (ServerProcess(tmp_path / "gw").start() as gateway, ServerProcess(tmp_path / "a").start() as first,
          ServerProcess(tmp_path / "b").start() as second):
        token = enrollment(gateway)
        enroll(first, token, "--gateway", gateway.url, "--url", first.url)
        used = enroll(second, token, "--gateway", gateway.url, "--url", second.url, check=False)
        assert used.returncode != 0 and "was used already" in used.stderr, used.stderr
        short = enrollment(gateway, "--expires-in", "0.01")            # 0.6 s
        time.sleep(1.0)
        expired = enroll(second, short, "--gateway", gateway.url, "--url", second.url, check=False)
        assert expired.returncode != 0 and "expired" in expired.stderr, expired.stderr
        unknown = enroll(second, "en-nope", "--gateway", gateway.url, "--url", second.url, check=False)
        assert unknown.returncode != 0 and "unknown enrollment token" in unknown.stderr
        assert "Not enrolled" in enroll(second, "--status").stdout       # nothing was left half-made


# --- an unlinked instance phones home to nobody -------------------------------------------------------

def sockets_of(pid: int) -> set:
    """The inodes of the process's sockets."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def tcp_connections(pid: int) -> list:
    """(local port, remote address, remote port, state) of the process's TCP sockets, IPv4 and IPv6."""
    mine, found = sockets_of(pid), []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            if parts[9] in mine:
                local, remote = parts[1].split(":"), parts[2].split(":")
                found.append((int(local[1], 16), remote[0], int(remote[1], 16), parts[3]))
    return found


def test_an_unenrolled_server_opens_no_outbound_connection(tmp_path):
    with ServerProcess(tmp_path).start() as server:
        port = int(server.url.rsplit(":", 1)[1])
        database_port = int(re.search(r":(\d+)/", server.database).group(1)) if server.database else None

        async def ordinary(client):
            await client.record("home-1", "step", {"n": 1}, actor="agent", step_number=1)
            await client.save_state("home-1", await client.get_cursor("home-1"), {"status": "running"})
            await client.fork("home-1", "home-1-f", 1)
            await client.replay("home-1")
        using(server, ordinary)
        for path in ("/", "/metrics", "/api/v1/instance", "/fleet", "/experiments", "/openapi.json"):
            http("GET", server.url + path, key=server.key)
        outbound = []
        deadline = time.monotonic() + 3          # watch for a while: a timer or a background task would show
        while time.monotonic() < deadline:
            for local, remote, remote_port, state in tcp_connections(server.proc.pid):
                inbound = local == port           # the listening socket and the connections it accepted
                to_database = database_port is not None and remote_port == database_port
                if not inbound and not to_database and state != "0A":
                    outbound.append((local, remote, remote_port, state))
            time.sleep(0.2)
        assert not outbound, f"outbound connections: {sorted(set(outbound))}"
        assert tcp_connections(server.proc.pid), "the reader finds the server's own sockets"


def test_the_release_notice_says_only_a_newer_gateway():
    import actae
    notice = actae.ReleaseNotice(None)
    assert notice.notice() is None                                     # not asked, or not enrolled
    notice.gateway_version = actae.__version__
    assert notice.notice() is None
    notice.gateway_version = "99.0.0"
    assert "99.0.0" in notice.notice() and actae.__version__ in notice.notice()
