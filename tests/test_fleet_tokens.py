"""Organisation tokens, fleet tokens, stream tickets and the remote key at rest, with the real SDK.

A gateway started with short lifetimes (`--fleet-token-ttl 1 --fleet-ticket-ttl 1`) and one remote:
a revoked or unknown organisation token is the SDK's AuthError (a revoke made by another process is
seen within a second); another organisation is 403; a read-only grant gets 403 `forbidden` on record
and fork (and reads); a fleet token held past its `expires_in` is refused by the gateway and the SDK
exchanges again by itself; a used or expired stream ticket opens nothing; a copy of the database
alone does not hold the remote's key, and the fleet_key file beside it is what decrypts it.
"""
from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from conftest import BACKEND, cli, http, org_token, poll, query_database, run, start_fleet

ORG = "local"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A gateway with short fleet-token and ticket lifetimes, and one remote."""
    with start_fleet(tmp_path_factory.mktemp("tk"), 1, names="remote",
                     gateway_args=["--fleet-token-ttl", "1", "--fleet-ticket-ttl", "1"]) as f:
        yield f


def test_unknown_and_revoked_organisation_tokens_are_auth_errors(fleet):
    from actae_client.errors import AuthError
    token_id, token = org_token(fleet.gateway, "--admin")

    async def body():
        async with fleet.client("ot-not-a-token") as f:
            with pytest.raises(AuthError):
                await f.instances()
        async with fleet.client(token) as f:
            assert (await f.instances())["organization_id"] == ORG
            held = f._fleet_token
            cli("org-token", "revoke", str(token_id), data_dir=fleet.gateway)      # another process
            started = time.monotonic()

            async def refused():
                status, _, answer = await asyncio.to_thread(
                    http, "GET", fleet.gateway.url + f"/v1/organizations/{ORG}/instances",
                    headers={"authorization": f"Bearer {held}"})
                return (status, answer) if status == 401 else None
            # the running gateway sees it within a second
            status, answer = await poll(refused, 3, what="the gateway to refuse the revoked token's fleet token")
            seen_after = time.monotonic() - started
            with pytest.raises(AuthError):               # its fleet tokens end with it, and it exchanges no more
                await f.instances()
            return status, answer, seen_after
    status, answer, seen_after = run(body())
    assert status == 401 and answer["message"] == answer["error"] and seen_after < 1.5
    listed = cli("org-token", "list", data_dir=fleet.gateway).stdout
    assert f"\n{token_id:>4}  " not in listed


def test_another_organisation_is_forbidden(fleet):
    from actae_client.errors import APIError
    _, token = org_token(fleet.gateway, "--admin")

    async def body():
        async with fleet.client(token, organization="someone-else") as f:
            with pytest.raises(APIError) as refused:
                await f.instances()
            return refused.value
    refused = run(body())
    assert refused.status_code == 403
    status, _, answer = http("POST", fleet.gateway.url + "/api/v1/fleet/token", headers={
        "authorization": f"Bearer {token}"}, body={"purpose": "fleet_access", "organization_id": "other", "scopes": [""]})
    assert status == 403 and answer["status"] == "forbidden"


def test_a_read_only_grant_reads_but_gets_403_forbidden_on_record_and_fork(fleet):
    from actae_client.errors import APIError
    remote, remote_id = fleet.remotes[0], fleet.remote_ids[0]
    ch = "ro" + uuid.uuid4().hex[:8]
    http("POST", remote.url + "/api/v1/events/record", key=remote.key, body={"channel_id": ch, "event_type": "x",
                                                                              "payload": {}})
    http("POST", remote.url + f"/api/v1/state/{ch}", key=remote.key, body={"cursor": 1, "state": {}})
    _, token = org_token(fleet.gateway, "--read", "*")

    async def body():
        async with fleet.client(token) as f:
            replayed = await f.replay(remote_id, ch)
            refusals = []
            for call in (lambda: f.record(remote_id, ch, "x", {}),
                         lambda: f.fork(remote_id, ch, f"{ch}-f", 1),
                         lambda: f.for_instance(remote_id).record(ch, "x", {}, actor="a"),
                         lambda: f.for_instance(remote_id).fork(ch, f"{ch}-f2", 1)):
                with pytest.raises(APIError) as refused:
                    await call()
                refusals.append(refused.value)
            exchanged = await f._request("POST", "/api/v1/fleet/token", auth=False, body={
                "purpose": "fleet_access", "organization_id": ORG, "scopes": ["events:read", "events:write"]},
                headers={"Authorization": f"Bearer {token}"})
            return replayed, refusals, exchanged
    replayed, refusals, exchanged = run(body())
    assert [e["channel_id"] for e in replayed["events"]] == [ch]
    assert [r.status_code for r in refusals] == [403] * 4
    assert all("events:write" in str(r) or "forks:create" in str(r) for r in refusals)
    assert exchanged["scopes"] == ["events:read"]          # asked for write too: only what it grants
    events = http("GET", remote.url + f"/api/v1/events/replay/{ch}", key=remote.key)[2]["events"]
    assert len(events) == 1                                # nothing written
    assert http("GET", remote.url + f"/api/v1/channels/{ch}-f/metadata", key=remote.key)[0] == 404
    status, _, answer = http("POST", fleet.gateway.url + "/api/v1/fleet/token", headers={
        "authorization": f"Bearer {token}"}, body={"scopes": ["events:write"]})
    assert status == 403 and answer["status"] == "forbidden"


def test_a_fleet_token_past_its_expires_in_is_refused_and_the_sdk_exchanges_again(fleet):
    _, token = org_token(fleet.gateway, "--admin")
    url = fleet.gateway.url

    async def body():
        async with fleet.client(token) as f:
            first = await f.instances()
            held = f._fleet_token
            # Pretend this client's clock says the token is still fresh: the gateway decides.
            f._fleet_token_expires_at = time.monotonic() + 3600
            await asyncio.sleep(1.2)     # time itself must pass: --fleet-token-ttl 1 (the gateway's clock decides)
            status = (await asyncio.to_thread(http, "GET", url + f"/v1/organizations/{ORG}/instances",
                                              headers={"authorization": f"Bearer {held}"}))[0]
            second = await f.instances()                 # 401, then a fresh exchange, transparently
            return first, held, status, second, f._fleet_token
    first, held, status, second, renewed = run(body())
    assert status == 401
    assert second == first and renewed and renewed != held
    status, _, exchanged = http("POST", url + "/api/v1/fleet/token", headers={"authorization": f"Bearer {token}"},
                                body={"purpose": "fleet_access", "organization_id": ORG, "scopes": [""]})
    assert status == 200 and exchanged["expires_in"] == 1 and "forks:create" in exchanged["scopes"]


def test_used_and_expired_stream_tickets_are_refused(fleet):
    from actae_client.errors import ActaeConnectionError
    remote, remote_id = fleet.remotes[0], fleet.remote_ids[0]
    ch = "tk" + uuid.uuid4().hex[:8]
    http("POST", remote.url + "/api/v1/events/record", key=remote.key, body={"channel_id": ch, "event_type": "x",
                                                                              "payload": {"n": 1}})
    _, token = org_token(fleet.gateway, "--admin")

    async def mint(f):
        return (await f._request("POST", f"/v1/organizations/{ORG}/events/stream/tickets",
                                 body={"instance_id": remote_id, "channel_id": ch}))["ticket"]

    async def body():
        async with fleet.client(token) as f:
            ticket = await mint(f)
            stream = f.stream(ticket=ticket, resume_cursor=0)
            first = await asyncio.wait_for(stream.__anext__(), 10)
            await stream.aclose()
            with pytest.raises(ActaeConnectionError):
                await asyncio.wait_for(f.stream(ticket=ticket, resume_cursor=0).__anext__(), 10)
            stale = await mint(f)
            await asyncio.sleep(1.2)     # time itself must pass: --fleet-ticket-ttl 1
            with pytest.raises(ActaeConnectionError):
                await asyncio.wait_for(f.stream(ticket=stale, resume_cursor=0).__anext__(), 10)
            with pytest.raises(ActaeConnectionError):
                await asyncio.wait_for(f.stream(ticket="tk-never-minted", resume_cursor=0).__anext__(), 10)
            return first
    assert run(body())["event"]["payload"] == {"n": 1}


def test_a_copy_of_the_database_does_not_reveal_a_remote_key(fleet):
    from cryptography.fernet import Fernet
    gateway, remote = fleet.gateway, fleet.remotes[0]
    rows = query_database(gateway, "SELECT id, key_ciphertext, key_prefix FROM fleet_instances")
    assert [r[0] for r in rows] == fleet.remote_ids
    ciphertext = rows[0][1]
    assert remote.key not in ciphertext and remote.key[8:] not in ciphertext
    if BACKEND == "sqlite":                          # the whole file, WAL included, holds no copy of it
        for name in ("actae.db", "actae.db-wal"):
            path = gateway.data_dir / name
            if path.exists():
                data = path.read_bytes()
                assert remote.key.encode() not in data and remote.key[8:].encode() not in data
    key_file = gateway.data_dir / "fleet_key"
    assert (key_file.stat().st_mode & 0o777) == 0o600
    assert Fernet(key_file.read_bytes().strip()).decrypt(ciphertext.encode()).decode() == remote.key
    with pytest.raises(Exception):
        Fernet(Fernet.generate_key()).decrypt(ciphertext.encode())
