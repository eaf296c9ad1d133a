"""Multi-instance reads never hide a failure; keyset pages yield every event once, in order.

A gateway and two remotes. `query_many` over the three with one remote stopped answers the other two's
events and one error naming the stopped instance (`require_complete()` raises); the same remote, slow
(a socket that accepts and never answers, on its port, with `instance add --timeout 0.5`), is an error
`timeout` within its bound. `iter_query` over 250 events with `limit=100` yields each event exactly once,
in the direct query's order, on the local and on a remote instance. `instance remove` run by another
process is seen by the running gateway within a second.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import time
import uuid

import pytest

from conftest import ServerProcess, cli, http, instance_id, poll, run, start_fleet


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A gateway and two remotes, each registered with a 0.5-second timeout; `.token` reads everything."""
    with start_fleet(tmp_path_factory.mktemp("pq"), 2, add_args=["--timeout", "0.5"], token=("--read", "*")) as f:
        yield f


def record_many(srv: ServerProcess, channels: list, count: int) -> None:
    """`count` events spread over `channels`, eight writers at once (so many share a millisecond)."""
    def one(n):
        status = http("POST", srv.url + "/api/v1/events/record", key=srv.key, body={
            "channel_id": channels[n % len(channels)], "event_type": "bulk", "payload": {"n": n}})[0]
        assert status == 200
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(count)))


@pytest.mark.parametrize("which", [0, 1])
def test_iter_query_over_250_events_yields_each_once_in_order(fleet, which):
    srv, instance = fleet.servers[which], fleet.ids[which]
    tag = "it" + uuid.uuid4().hex[:8]
    channels = [f"{tag}-a", f"{tag}-b", f"{tag}-c"]
    record_many(srv, channels, 250)

    async def body():
        async with fleet.client() as f:
            pages, token = [], None
            while True:
                page = await f.query_page(instance, page_token=token, limit=100, channel_ids=channels)
                pages.append(len(page.items))
                if not page.next_page_token:
                    break
                token = page.next_page_token
            walked = [e async for e in f.iter_query(instance, limit=100, channel_ids=channels)]
            return pages, walked
    pages, walked = run(body())
    stored = http("POST", srv.url + "/api/v1/events/query", key=srv.key,
                  body={"channel_ids": channels, "limit": 1000})[2]["events"]
    assert len(stored) == 250
    assert [e["id"] for e in walked] == [e["id"] for e in stored]          # each once, the direct order
    assert len({e["id"] for e in walked}) == 250
    assert pages[:3] == [100, 100, 50] and sum(pages) == 250


def test_query_many_names_a_stopped_and_a_slow_instance_beside_the_others_events(fleet):
    from actae_client.errors import APIError
    tag = "pm" + uuid.uuid4().hex[:8]
    servers = fleet.servers
    for srv in servers:
        record_many(srv, [tag], 3)
    ids = fleet.ids
    stopped = fleet.remotes[1]
    port = int(stopped.url.rsplit(":", 1)[1])
    stopped.stop()

    async def body():
        async with fleet.client() as f:
            down = await f.query_many(instance_ids=ids, channel_ids=[tag])
            with pytest.raises(APIError) as incomplete:
                down.require_complete()
            silent = socket.socket()
            silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            silent.bind(("127.0.0.1", port))
            silent.listen(16)                            # accepts, never answers: a hung server
            try:
                started = time.monotonic()
                slow = await f.query_many(instance_ids=ids, channel_ids=[tag])
                slow_seconds = time.monotonic() - started
            finally:
                silent.close()
            return down, incomplete.value, slow, slow_seconds
    down, incomplete, slow, slow_seconds = run(body())
    for result in (down, slow):
        got = {(e["instance_id"], e["id"]) for e in result.items}
        want = {(i, e["id"]) for i, srv in zip(ids[:2], servers[:2])
                for e in http("POST", srv.url + "/api/v1/events/query", key=srv.key,
                              body={"channel_ids": [tag]})[2]["events"]}
        assert got == want and len(got) == 6
        assert [e.instance_id for e in result.errors] == [ids[2]]
    assert down.errors[0].code == "unreachable" and down.errors[0].retryable
    assert slow.errors[0].code == "timeout" and slow.errors[0].retryable and slow_seconds < 3
    assert incomplete.status_code == 502 and ids[2] in str(incomplete)


def test_instance_remove_from_another_process_is_seen_within_a_second(fleet, tmp_path):
    with ServerProcess(tmp_path / "extra").start() as extra:
        cli("instance", "add", extra.url, "--key", extra.key, "--name", "extra", data_dir=fleet.gateway)
        extra_id = instance_id(extra)

        async def listed(f) -> set:
            return {i["instance_id"] for i in (await f.instances())["instances"]}

        async def body():
            async with fleet.client() as f:
                async def shown():
                    return extra_id in await listed(f)

                async def gone():
                    return extra_id not in await listed(f)
                await poll(shown, 1.5, what="the gateway to list the added instance")
                added = extra_id in await listed(f)
                await asyncio.to_thread(cli, "instance", "remove", extra_id, data_dir=fleet.gateway)
                started = time.monotonic()
                await poll(gone, 3, what="the gateway to drop the removed instance")
                return added, time.monotonic() - started, extra_id in await listed(f)
        added, seconds, still = run(body())
        assert added and not still and seconds < 1.5
