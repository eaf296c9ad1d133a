"""Team access and audit: scoped keys, user accounts, the hash-chained log, close and instance.

Everything goes through the real SDK (or raw HTTP where the SDK has no method) against real
servers: one for this module, whose data dir the `actae key ...` commands share, and others
started with `--open-signup` or restarted where a test needs it.
"""
from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import statistics
import time
from urllib.parse import urlencode

import pytest
import websockets
from actae_client.errors import APIError, AuthError

from conftest import (BACKEND, ServerProcess, api, cli, dashboard_cookie, get_json, http, ok, poll, query_database,
                      run, using)

KEY_LINE = re.compile(r"^API key:\s+(sk-\S+)")


def create_key(data_dir, *flags):
    """`actae key create --name ... FLAGS`: (id, key) as printed once."""
    out = cli("key", "create", "--name", "t", *flags, data_dir=data_dir).stdout
    (key,) = [m.group(1) for line in out.splitlines() if (m := KEY_LINE.match(line))]
    key_id = int(re.match(r"Key (\d+)", out).group(1))
    return key_id, key


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("team")).start() as srv:
        yield srv


async def status_of(call):
    """200, or the HTTP status the SDK raised with (401 for AuthError)."""
    try:
        await call
        return 200
    except AuthError:
        return 401
    except APIError as exc:
        return exc.status_code


def seed(srv, channel, steps=3):
    """A run with `steps` step events and a state at each, written with the admin key."""
    async def body(client):
        for step in range(1, steps + 1):
            event = await client.record(channel, "agent.step", {"step": step, "note": "é<&>"}, actor="seed",
                                        step_number=step, metadata={"model": "m"})
            await client.save_state(channel, event.cursor, {"done": step})
    using(srv, body)


# --------------------------------------------------------------------------------------------
# 1. Scoped keys
# --------------------------------------------------------------------------------------------

def test_a_read_key_reads_everything_and_writes_nothing(team):
    seed(team, "ro-base")
    seed(team, "ro-other", steps=1)
    _, reader = create_key(team.data_dir, "--read", "*")
    errors = []

    async def body(client):
        client.on_error(errors.append)
        replayed = await client.replay("ro-base")
        assert [e.payload["step"] for e in replayed if e.event_type == "agent.step"] == [1, 2, 3]
        queried = await client.query(channel_ids=["ro-base"], event_type="agent.step")
        assert sorted(e.cursor for e in queried) == [e.cursor for e in replayed if e.event_type == "agent.step"]
        diff = await client.diff_states("ro-base", "ro-other")
        assert diff["left"]["state"] == {"done": 3} and diff["right"]["state"] == {"done": 1}
        await client.connect()
        await client.subscribe("ro-base", cursor=0)
        refused = {
            "record": client.record("ro-base", "x", {}, actor="ci"),
            "save_state": client.save_state("ro-base", 1, {"x": 1}),
            "fork": client.fork("ro-base", "ro-base-fork", 2),
            "claim": client.claim_execution("ro-base", "k1", "charge", {"a": 1}),
            "delete": client.delete_channel("ro-base"),
        }
        statuses = {name: await status_of(call) for name, call in refused.items()}
        assert statuses == dict.fromkeys(refused, 403)
        with pytest.raises(APIError):                 # the SDK waits for an ack that never comes
            await client.publish("ro-base", {"x": 1})
        caps = await client.capabilities()
        return caps, await client.get_cursor("ro-base")

    caps, cursor = using(team, body, key=reader, timeout=3)
    assert any("may not write" in e for e in errors), errors      # the WebSocket's error frame
    assert caps.read == ["*"] and caps.write == [] and caps.delete == [] and caps.admin == []
    assert caps.can_read("ro-base") and not caps.can_write("ro-base") and not caps.can_fork("ro-base")
    assert caps.key_source == "database" and caps.expires_at is None
    assert cursor == 3                                            # the 3 steps, nothing the reader tried
    assert using(team, lambda c: c.get_channel_metadata("ro-base")).channel_id == "ro-base"


def test_a_prefix_write_key_writes_only_what_matches_and_can_write_agrees(team):
    _, writer = create_key(team.data_dir, "--write", "proj-*", "--read", "proj-*")
    _, reader = create_key(team.data_dir, "--read", "*")

    async def attempts(client):
        caps = await client.capabilities()
        cases = {}
        for channel in ("proj-1", "proj-", "other-1", "xproj-1"):
            cases[channel] = (caps.can_write(channel),
                              await status_of(client.record(channel, "t", {"c": channel}, actor="w")))
        return caps, cases

    for key, writable in ((writer, {"proj-1", "proj-"}), (reader, set())):
        caps, cases = using(team, attempts, key=key)
        for channel, (previewed, status) in cases.items():
            assert previewed == (channel in writable), (channel, previewed)
            assert status == (200 if channel in writable else 403), (channel, status)
    assert caps.read == ["*"]

    async def narrow(client):
        listed = await client.list_channels()                     # only what the key may read
        assert set(listed) == {"proj-", "proj-1"}, listed
        return await status_of(client.replay("other-1"))
    assert using(team, narrow, key=writer) == 403


def test_a_write_key_cannot_subscribe_outside_its_read_scope(team):
    _, writer = create_key(team.data_dir, "--write", "*")

    async def scenario():
        async with websockets.connect(team.url.replace("http://", "ws://") + "/ws") as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "auth", "api_key": writer}))
            assert json.loads(await ws.recv())["event"] == "authenticated"
            await ws.send(json.dumps({"type": "subscribe", "topic": "ws-scope", "cursor": 0}))
            refused = json.loads(await ws.recv())
            assert refused["type"] == "error" and refused["status"] == "forbidden", refused
            await ws.send(json.dumps({"type": "broadcast", "topic": "ws-scope", "payload": {"ok": 1},
                                      "request_id": "r1"}))
            ack = json.loads(await ws.recv())
            assert ack["type"] == "ack" and ack["request_id"] == "r1" and ack["channel_id"] == "ws-scope"
    run(scenario())


def test_expired_and_revoked_keys_get_401(team):
    _, short = create_key(team.data_dir, "--read", "*", "--expires-in", "0.00003")   # about 2.6 s
    revoked_id, revoked = create_key(team.data_dir, "--admin")
    caps = using(team, lambda c: c.capabilities(), key=short)
    assert caps.expires_at is not None
    assert using(team, lambda c: c.list_channels(), key=revoked) is not None
    cli("key", "revoke", str(revoked_id), data_dir=team.data_dir)
    # Refused within 2.8 s: the short key has expired by then, and the server re-reads its keys every second.
    poll(lambda: [http("GET", team.url + "/api/v1/channels", key=key)[0] for key in (short, revoked)] == [401, 401],
         2.8, what="the expired and the revoked key to get 401")
    for key in (short, revoked):
        with pytest.raises(AuthError):
            using(team, lambda c: c.list_channels(), key=key)
        assert http("GET", team.url + "/api/v1/channels", key=key)[0] == 401


def test_key_list_shows_scopes_and_use_never_the_key(team):
    key_id, key = create_key(team.data_dir, "--read", "list-*", "--delete", "list-1")
    assert http("GET", team.url + "/api/v1/events/cursor/list-1", key=key)[0] == 200

    def listed_once_used():
        listed = json.loads(cli("key", "list", "--json", data_dir=team.data_dir).stdout)["keys"]
        mine = next(k for k in listed if k["id"] == key_id)
        return (listed, mine) if mine["last_used_at"] else None

    listed, mine = poll(listed_once_used, 5, every=0.2, what="`key list` to show the key's last use")
    assert mine["scopes"] == {"read": ["list-*"], "write": [], "delete": ["list-1"], "admin": []}
    assert mine["last_used_at"] and mine["created_at"] and mine["expires_at"] is None
    table = cli("key", "list", data_dir=team.data_dir).stdout
    assert "read=list-*; delete=list-1" in table
    for text in (table, json.dumps(listed)):
        assert key not in text and team.key not in text
    first = next(k for k in listed if k["id"] == 1)
    assert first["scopes"]["admin"] == ["*"]                      # the first key is admin


def test_admin_only_routes_refuse_other_keys(team):
    _, writer = create_key(team.data_dir, "--write", "*", "--read", "*", "--delete", "*")
    for method, path, body in (("GET", "/api/v1/keys", None),
                               ("POST", "/api/v1/keys", {"name": "x", "scopes": {"read": ["*"]}}),
                               ("DELETE", "/api/v1/keys/1", None)):
        status, headers, answer = http(method, team.url + path, key=writer, body=body)
        assert status == 403 and answer["status"] == "forbidden" and answer["error"], answer
        assert headers["content-type"].startswith("application/json")
    status, _, created = http("POST", team.url + "/api/v1/keys", key=team.key,
                              body={"name": "api", "scopes": {"read": ["a*"]}, "expires_in_days": 1})
    assert status == 200 and created["key"].startswith("sk-") and created["expires_at"]
    assert http("GET", team.url + "/api/v1/auth/capabilities", key=created["key"])[2]["permissions"]["read"] == ["a*"]
    assert http("DELETE", team.url + f"/api/v1/keys/{created['id']}", key=team.key)[2]["revoked_at"]
    assert http("GET", team.url + "/api/v1/auth/capabilities", key=created["key"])[0] == 401


def test_bad_scope_patterns_are_refused(team):
    status, _, answer = http("POST", team.url + "/api/v1/keys", key=team.key,
                             body={"name": "x", "scopes": {"read": ["a/b"]}})
    assert status == 400 and answer["status"] == "bad_request"
    done = cli("key", "create", "--name", "x", "--read", "a*b*", data_dir=team.data_dir, check=False)
    assert done.returncode != 0 and "scopes" in done.stderr


def test_key_rotate_replaces_the_admin_key_and_keeps_scoped_keys(tmp_path):
    with ServerProcess(tmp_path).start() as srv:
        _, scoped = create_key(tmp_path, "--read", "*")
        out = cli("key", "rotate", data_dir=tmp_path).stdout
        (new,) = [m.group(1) for line in out.splitlines() if (m := KEY_LINE.match(line))]
        assert http("GET", srv.url + "/api/v1/channels", key=srv.key)[0] == 401
        assert http("GET", srv.url + "/api/v1/channels", key=scoped)[0] == 200
        assert http("GET", srv.url + "/api/v1/auth/capabilities", key=new)[2]["permissions"]["admin"] == ["*"]


def test_the_environment_key_is_admin(tmp_path):
    env_key = "sk-env-" + "x" * 32
    with ServerProcess(tmp_path, env={"ACTAE_API_KEY": env_key}).start() as srv:
        caps = using(srv, lambda c: c.capabilities(), key=env_key)
        assert caps.admin == ["*"] and caps.key_id == "env" and caps.key_source == "environment"
        assert http("GET", srv.url + "/api/v1/keys", key=env_key)[0] == 200


# --------------------------------------------------------------------------------------------
# 2. Accounts
# --------------------------------------------------------------------------------------------

def test_signup_login_me_logout(team):
    async def body(client):
        signed = await client.signup("Ada@Example.org", "correct horse", name="Ada")
        assert signed.user.email == "Ada@Example.org" and signed.user.name == "Ada" and signed.token
        logged = await client.login("ada@example.org", "correct horse")      # any case of the address
        assert logged.user.id == signed.user.id and logged.token != signed.token
        me = await client.get_me(logged.token)
        assert (me.id, me.email, me.email_verified) == (signed.user.id, "Ada@Example.org", False)
        await client.logout(logged.token)
        with pytest.raises(AuthError):
            await client.get_me(logged.token)
        assert (await client.get_me(signed.token)).id == signed.user.id       # other tokens live on
        with pytest.raises(AuthError) as wrong:
            await client.login("ada@example.org", "wrong horse")
        with pytest.raises(AuthError) as unknown:
            await client.login("nobody@example.org", "correct horse")
        assert str(wrong.value) == str(unknown.value)
        assert await status_of(client.signup("ADA@example.org", "another one")) == 409
    using(team, body)


def test_wrong_password_and_unknown_email_take_the_same_time(team):
    using(team, lambda c: c.signup("timing@example.org", "s3cret-pass"))

    def timed(email):
        started = time.perf_counter()
        status, _, answer = http("POST", team.url + "/api/v1/auth/login", body={"email": email, "password": "nope-nope"})
        assert status == 401 and answer == {"status": "unauthorized", "error": "wrong email or password"}
        return time.perf_counter() - started

    known = statistics.median(timed("timing@example.org") for _ in range(7))
    unknown = statistics.median(timed("ghost@example.org") for _ in range(7))
    assert 0.5 < known / unknown < 2, (known, unknown)            # both run the KDF once


def test_signup_needs_an_admin_key_unless_open(team, tmp_path):
    _, reader = create_key(team.data_dir, "--read", "*")
    assert using(team, lambda c: status_of(c.signup("r@example.org", "password!")), key=reader) == 403
    with pytest.raises(AuthError):
        using(team, lambda c: c.signup("n@example.org", "password!"), key="sk-not-a-key-000000000000000000000000")
    assert http("GET", team.url + "/api/v1/auth/config")[2]["open_signup"] is False

    with ServerProcess(tmp_path, args=["--open-signup"]).start() as srv:
        assert http("GET", srv.url + "/api/v1/auth/config")[2]["signup"] == "open"
        result = using(srv, lambda c: c.signup("open@example.org", "password!"), key="sk-anything-at-all")
        assert result.user.email == "open@example.org"
        caps = using(srv, lambda c: c.capabilities(), key=result.token)
        assert (caps.read, caps.write, caps.admin) == ([], [], [])   # nobody granted it anything yet
        assert using(srv, lambda c: status_of(c.list_channels()), key=result.token) == 403
        status, _, answer = http("POST", srv.url + "/api/v1/auth/signup", key="sk-anything",
                                 body={"email": "greedy@example.org", "password": "password!",
                                       "scopes": {"admin": ["*"]}})
        assert status == 403, answer


def test_a_users_token_carries_the_scopes_an_admin_granted(team):
    status, _, signed = http("POST", team.url + "/api/v1/auth/signup", key=team.key,
                             body={"email": "lin@example.org", "password": "password!",
                                   "scopes": {"read": ["team-*"], "write": ["team-*"]}})
    assert status == 200, signed

    async def body(client):
        caps = await client.capabilities()
        assert caps.auth_method == "jwt" and caps.key_source == "user" and caps.expires_at
        assert caps.can_write("team-1") and not caps.can_write("solo-1")
        assert (await client.record("team-1", "t", {"by": "lin"}, actor="lin")).cursor == 1
        return await status_of(client.record("solo-1", "t", {}, actor="lin"))
    assert using(team, body, key=signed["token"]) == 403

    cli("user", "grant", "lin@example.org", "--read", "*", data_dir=team.data_dir)
    caps = using(team, lambda c: c.capabilities(), key=signed["token"])
    assert (caps.read, caps.write) == (["*"], [])


def test_api_key_login_and_preferences(team):
    _, reader = create_key(team.data_dir, "--read", "pref-*", "--expires-in", "2")
    status, _, exchanged = http("POST", team.url + "/api/v1/auth/api-key-login", body={"api_key": reader})
    assert status == 200 and exchanged["user"]["id"].startswith("key:") and exchanged["token"]
    caps = http("GET", team.url + "/api/v1/auth/capabilities", key=exchanged["token"])[2]
    assert caps["permissions"]["read"] == ["pref-*"] and caps["expires_at"]
    assert http("POST", team.url + "/api/v1/auth/api-key-login", body={"api_key": "sk-wrong"})[0] == 401

    account = using(team, lambda c: c.signup("prefs@example.org", "password!"))
    bearer = {"authorization": f"Bearer {account.token}"}
    path = team.url + "/api/v1/user/preferences"
    assert http("GET", path, key=team.key, headers=bearer)[2]["preferences"] == {}
    stored = http("PUT", path, key=team.key, headers=bearer, body={"preferences": {"theme": "dark", "n": [1]}})[2]
    assert stored["preferences"] == {"theme": "dark", "n": [1]} and stored["updated_at"]
    assert http("GET", path, key=team.key, headers=bearer)[2]["preferences"] == {"theme": "dark", "n": [1]}
    assert http("GET", path, key=team.key)[2]["preferences"] == {}          # the admin key's own document
    assert http("PUT", path, key=team.key, headers=bearer, body={"preferences": [1]})[0] == 400


def test_the_dashboard_logs_in_with_email_and_password(team):
    signup_with_scopes(team, "dash@example.org", {"read": ["*"], "write": ["*"]})
    origin = {"origin": team.url, "content-type": "application/x-www-form-urlencoded"}
    form = urlencode({"email": "dash@example.org", "password": "password!"}).encode()
    status, headers, _ = http("POST", team.url + "/login", raw=form, headers=origin, redirects=False)
    assert status == 303 and "actae_session=" in headers.get("set-cookie", "")
    cookie = headers["set-cookie"].split(";")[0]
    status, _, page = http("GET", team.url + "/", headers={"cookie": cookie})
    assert status == 200 and "Runs" in page and 'href="/keys"' not in page     # not an admin
    assert http("GET", team.url + "/keys", headers={"cookie": cookie})[0] == 403
    bad = urlencode({"email": "dash@example.org", "password": "wrong!!!"}).encode()
    assert http("POST", team.url + "/login", raw=bad, headers=origin, redirects=False)[0] == 401


def signup_with_scopes(srv, email, scopes):
    return ok(api(srv, "POST", "/api/v1/auth/signup",
                  body={"email": email, "password": "password!", "scopes": scopes}))


def test_the_keys_page_creates_lists_and_revokes(team):
    cookie = dashboard_cookie(team, team.key)
    status, _, page = http("GET", team.url + "/keys", headers={"cookie": cookie})
    assert status == 200 and 'href="/keys"' in page
    token = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)
    form = urlencode({"csrf_token": token, "name": "page-key", "read": "page-*, x", "expires_in_days": "3"}).encode()
    status, _, created = http("POST", team.url + "/keys", raw=form, headers={
        "cookie": cookie, "origin": team.url, "content-type": "application/x-www-form-urlencoded"})
    assert status == 200, created
    key = re.search(r"(sk-[A-Za-z0-9_-]{30,})", created).group(1)
    caps = http("GET", team.url + "/api/v1/auth/capabilities", key=key)[2]
    assert caps["permissions"]["read"] == ["page-*", "x"] and caps["expires_at"]
    key_id = caps["key_id"]
    form = urlencode({"csrf_token": token}).encode()
    status, _, _ = http("POST", team.url + f"/keys/{key_id}/revoke", raw=form, redirects=False, headers={
        "cookie": cookie, "origin": team.url, "content-type": "application/x-www-form-urlencoded"})
    assert status == 303
    assert http("GET", team.url + "/api/v1/auth/capabilities", key=key)[0] == 401
    _, reader = create_key(team.data_dir, "--read", "*")
    assert http("GET", team.url + "/keys", headers={"cookie": dashboard_cookie(team, reader)})[0] == 403


# --------------------------------------------------------------------------------------------
# 3. The hash chain
# --------------------------------------------------------------------------------------------

CHAIN_FIELDS = ("actor", "agent_id", "channel_id", "cursor", "depends_on", "id", "metadata", "payload",
                "step_number", "timestamp", "type", "user_id")


def offline_chain(events, previous="0" * 64):
    """The README's algorithm, on a run exported with GET /api/v1/events/replay."""
    hashes = []
    for event in events:
        fields = {name: event[name] for name in CHAIN_FIELDS}
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        previous = hashlib.sha256(previous.encode("ascii") + text.encode("utf-8")).hexdigest()
        hashes.append(previous)
    return hashes


def exported(srv, channel):
    return api(srv, "GET", f"/api/v1/events/replay/{channel}?limit=1000")[2]["events"]


def verify(srv, channel):
    return get_json(srv, f"/api/v1/events/verify/{channel}")


def test_a_run_and_its_fork_verify_online_and_offline(team):
    seed(team, "chain-base", steps=4)                        # step k is cursor k
    using(team, lambda c: c.fork("chain-base", "chain-fork", 3))

    async def tail(client):
        await client.record("chain-fork", "agent.step", {"step": 4, "big": 2**70, "x": 1.5e-7}, actor="fork",
                            step_number=4)
    using(team, tail)
    for channel in ("chain-base", "chain-fork"):
        report = verify(team, channel)
        assert report["ok"] is True and report["first_broken_cursor"] is None, report
    base, fork = exported(team, "chain-base"), exported(team, "chain-fork")
    assert offline_chain(base) == [e["chain_hash"] for e in base]
    assert offline_chain(fork, previous=base[2]["chain_hash"]) == [e["chain_hash"] for e in fork]
    assert verify(team, "chain-fork")["verified_events"] == 3 + len(fork)    # the inherited part too
    assert verify(team, "chain-fork")["head"] == fork[-1]["chain_hash"]


def test_editing_one_stored_byte_is_reported_at_that_cursor(team):
    seed(team, "tamper-base", steps=3)
    using(team, lambda c: c.fork("tamper-base", "tamper-fork", 3))
    using(team, lambda c: c.fork("tamper-base", "tamper-early", 1))
    where = "WHERE channel_id = 'tamper-base' AND cursor = 2"
    ((payload,),) = query_database(team, f"SELECT payload FROM events {where}",
                                   postgresql=f"SELECT payload::text FROM events {where}")
    step = re.compile(r'"step":\s*2(?=[,}])')           # jsonb text has a space after the colon
    assert step.search(payload), payload
    query_database(team, f"UPDATE events SET payload = ? {where}", (step.sub('"step":9', payload, count=1),))
    report = verify(team, "tamper-base")
    assert (report["ok"], report["first_broken_channel_id"],
            report["first_broken_cursor"]) == (False, "tamper-base", 2)
    assert report["verified_events"] == 1
    inherited = verify(team, "tamper-fork")                  # forked after the edited event
    assert (inherited["ok"], inherited["first_broken_channel_id"],
            inherited["first_broken_cursor"]) == (False, "tamper-base", 2)
    assert verify(team, "tamper-early")["ok"] is True        # forked before it


def heads_step() -> int:
    """The step (PRAGMA user_version) of migration 19, which takes the chain head off the channel row."""
    import actae
    return next(number for number, step in enumerate(actae.MIGRATIONS, start=1) if step.schema is actae.heads_from_events)


@pytest.mark.skipif(BACKEND == "postgresql",
                    reason="rewrites an actae.db SQLite file into the pre-chain schema and runs the SQLite "
                           "upgrade step (actae.backfill_chain on a sqlite3 connection); a PostgreSQL "
                           "database never predates the event chain")
def test_the_chain_is_built_for_events_written_before_it_existed(tmp_path):
    """A database from before the chain migration verifies after the upgrade."""
    with ServerProcess(tmp_path).start() as first:
        seed(first, "legacy", steps=2)
        using(first, lambda c: c.fork("legacy", "legacy-fork", 2))
    db = sqlite3.connect(tmp_path / "actae.db")
    with db:                                                  # what the old schema stored: keys unsorted
        for channel, cursor, payload in db.execute("SELECT channel_id, cursor, payload FROM events").fetchall():
            unsorted = json.dumps(dict(reversed(list(json.loads(payload).items()))), ensure_ascii=False,
                                  separators=(",", ":"))
            db.execute("UPDATE events SET chain_hash = NULL, payload = ? WHERE channel_id = ? AND cursor = ?",
                       (unsorted, channel, cursor))
        # and its channel rows kept the chain head and the last cursor (before migration 19)
        db.execute("ALTER TABLE channels RENAME COLUMN chain_base TO chain_head")
        db.execute("ALTER TABLE channels ADD COLUMN last_cursor INTEGER NOT NULL DEFAULT 0")
        db.execute("UPDATE channels SET chain_head = NULL, last_cursor ="
                   " (SELECT COUNT(*) FROM events e WHERE e.channel_id = channels.id)")
        # so the restart runs migration 19 again (and the steps after it, which may run twice)
        db.execute(f"PRAGMA user_version = {heads_step() - 1}")
    db.close()
    import actae                                              # the upgrade step itself, as migrate_sqlite runs it
    conn = sqlite3.connect(tmp_path / "actae.db", isolation_level=None)
    actae.configure_sqlite(conn)
    conn.execute("BEGIN IMMEDIATE")
    actae.backfill_chain(conn)
    conn.execute("COMMIT")
    conn.close()
    with ServerProcess(tmp_path).start() as srv:
        srv.key = first.key                                   # a restart prints no key
        for channel in ("legacy", "legacy-fork"):
            assert verify(srv, channel)["ok"] is True
        legacy = exported(srv, "legacy")
        assert offline_chain(legacy) == [e["chain_hash"] for e in legacy]
        assert legacy[0]["payload"] == {"step": 1, "note": "é<&>"}
        assert using(srv, lambda c: c.record("legacy", "t", {}, actor="a")).cursor == 3
        assert verify(srv, "legacy")["verified_events"] == 3


# --------------------------------------------------------------------------------------------
# 4. Close, instance
# --------------------------------------------------------------------------------------------

def test_a_closed_run_refuses_writes_and_still_reads_forks_and_diffs(team):
    seed(team, "closing", steps=2)
    status, _, closed = http("POST", team.url + "/api/v1/channels/closing/close", key=team.key)
    assert status == 200 and closed["closed_at"] and closed["event"]["type"] == "channel.closed"
    assert http("POST", team.url + "/api/v1/channels/closing/close", key=team.key)[2]["replayed"] is True

    async def body(client):
        with pytest.raises(APIError) as refused:
            await client.record("closing", "agent.step", {"late": True}, actor="a")
        assert refused.value.status_code == 409 and "closed" in str(refused.value)
        assert await status_of(client.save_state("closing", 5, {"late": True})) == 409
        receipt = await client.fork("closing", "closing-fork", 2)
        assert receipt.child_channel_id == "closing-fork" and receipt.resolved_cursor == 2
        assert (await client.record("closing-fork", "agent.step", {"step": 3}, actor="a")).cursor == 2
        diff = await client.diff_states("closing", "closing-fork")
        assert diff["left"]["state"] == {"done": 2}
        return [e.event_type for e in await client.replay("closing")]
    assert using(team, body)[-1] == "channel.closed"
    assert verify(team, "closing")["ok"] is True
    _, raw, answer = http("POST", team.url + "/api/v1/events/record", key=team.key,
                          body={"channel_id": "closing", "event_type": "t", "payload": {}})
    assert answer["status"] == "channel_closed"

    cookie = dashboard_cookie(team, team.key)
    status, _, page = http("GET", team.url + "/runs/closing", headers={"cookie": cookie})
    assert status == 200 and "badge-closed" in page
    status, _, twin = http("GET", team.url + "/runs/closing?format=json", headers={"cookie": cookie})
    assert twin["run"]["closed_at"] == closed["closed_at"]
    assert "badge-closed" not in http("GET", team.url + "/runs/closing-fork", headers={"cookie": cookie})[2]


def test_instance_describes_the_server_and_survives_restarts(tmp_path):
    with ServerProcess(tmp_path).start() as srv:
        status, _, first = http("GET", srv.url + "/api/v1/instance", key=srv.key)
        assert status == 200 and first["backend"] == BACKEND and first["version"]
        assert first["started_at"].endswith("Z") and "event_chain" in first["features"]
        assert http("GET", srv.url + "/healthz")[2]["instance_id"] == first["instance_id"]
        assert http("GET", srv.url + "/api/v1/instance")[0] == 401
    with ServerProcess(tmp_path).start() as srv:
        assert http("GET", srv.url + "/healthz")[2]["instance_id"] == first["instance_id"]


def test_new_routes_are_in_the_openapi_document_with_403(team):
    document = http("GET", team.url + "/openapi.json")[2]
    for method, path in (("get", "/api/v1/instance"), ("post", "/api/v1/channels/{channel_id}/close"),
                         ("get", "/api/v1/events/verify/{channel_id}"), ("post", "/api/v1/auth/signup"),
                         ("post", "/api/v1/auth/api-key-login"), ("get", "/api/v1/auth/config"),
                         ("put", "/api/v1/user/preferences"), ("post", "/api/v1/keys")):
        operation = document["paths"][path][method]
        assert "403" in operation["responses"]
    assert document["paths"]["/api/v1/events/record"]["post"]["x-actae-scopes"] == (
        [{"action": "write", "channel": "body.channel_id"}])
    assert document["paths"]["/api/v1/auth/login"]["post"]["security"] == []
