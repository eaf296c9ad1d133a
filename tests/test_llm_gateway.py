"""The model-call gateway: the official `openai` and `anthropic` clients pointed at
/llm/runs/{run}/{upstream}/v1 with only a base URL and the Actae key, against the tiny model server
of examples/ on loopback. Every call is an `llm.call` event of its run with usage and cost; a fork
re-running from the start, or a run re-entered through AgentSession, is answered from the record
(byte for byte, a stream event by event) until its first changed call; the fork tool policy `llm`
(live, replay, block); identical concurrent calls reach the upstream once; the faults (upstream
down, slow, garbage, a body too large, a client gone mid-stream) each answered in the provider's
shape while the server goes on serving. On SQLite, and on PostgreSQL on that pass.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import socket
import uuid

import anthropic
import httpx
import openai
import pytest

from conftest import ServerProcess, api, cli, fork, import_example, poll, record, save_state, using

TINY = import_example("tiny_model_server.py")


@pytest.fixture(scope="module")
def upstream():
    server, stats = TINY.serve()
    yield f"http://127.0.0.1:{server.server_address[1]}", stats
    server.shutdown()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, upstream):
    url, _ = upstream
    args = ["--llm-upstream", f"openai={url}", "--llm-upstream", f"anthropic={url}", "--llm-upstream",
            f"local={url}/v1", "--llm-upstream", f"down=http://127.0.0.1:{closed_port()}", "--llm-timeout", "2"]
    with ServerProcess(tmp_path_factory.mktemp("llm"), args=args).start() as srv:
        yield srv


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_id(prefix: str = "llm") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def base(srv, run: str, upstream: str = "openai") -> str:
    return f"{srv.url}/llm/runs/{run}/{upstream}/v1"


def chat_client(srv, run: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=base(srv, run), api_key=srv.key, max_retries=0, **kw)


def calls_of(srv, run: str) -> list:
    status, _, answer = api(srv, "GET", f"/api/v1/events/replay/{run}?cursor=0&limit=1000")
    assert status == 200, answer
    return [e["payload"] for e in answer["events"] if e["type"] == "llm.call"]


def calls_made(stats) -> int:
    return stats.calls


def calls_when(srv, run: str, count: int) -> list:
    """The run's llm.call payloads once there are `count` (a stream is recorded as it ends)."""
    return poll(lambda: (lambda calls: calls if len(calls) == count else None)(calls_of(srv, run)), timeout=15,
                what=lambda: f"{count} llm.call events on {run}: {calls_of(srv, run)}")


def latest(srv, run: str) -> int:
    return api(srv, "GET", f"/api/v1/events/cursor/{run}")[2]["latest_cursor"]


def post(srv, run: str, path: str, body: dict, upstream: str = "openai", headers: dict | None = None):
    return httpx.post(f"{base(srv, run, upstream)}/{path}", json=body, timeout=30,
                      headers={"authorization": f"Bearer {srv.key}", **(headers or {})})


def chat_body(text: str, model: str = "gpt-4o-mini", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


# --- the official clients ------------------------------------------------------------------------

def test_the_official_clients_work_through_the_gateway_and_each_call_is_recorded(gateway):
    run = run_id()
    client = chat_client(gateway, run)
    chat = client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hello there"}])
    assert chat.choices[0].message.content == "echo: hello there"
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "a stream"}], stream=True,
        stream_options={"include_usage": True}) if chunk.choices)
    assert streamed.strip() == "echo: a stream"
    response = client.responses.create(model="gpt-4o-mini", input="what now")
    assert response.output_text == "echo: what now"
    events = [e.type for e in client.responses.create(model="gpt-4o-mini", input="stream it", stream=True)]
    assert events[0] == "response.created" and events[-1] == "response.completed"
    claude = anthropic.Anthropic(base_url=f"{gateway.url}/llm/runs/{run}/anthropic", api_key=gateway.key,
                                 max_retries=0)
    message = claude.messages.create(model="claude-3-5-haiku-latest", max_tokens=64,
                                     messages=[{"role": "user", "content": "hi claude"}])
    assert message.content[0].text == "echo: hi claude"
    with claude.messages.stream(model="claude-3-5-haiku-latest", max_tokens=64,
                                messages=[{"role": "user", "content": "stream claude"}]) as stream:
        assert "".join(stream.text_stream).strip() == "echo: stream claude"
    calls = calls_when(gateway, run, 6)
    assert [(c["api"], c["streamed"]) for c in calls] == [
        ("chat.completions", False), ("chat.completions", True), ("responses", False), ("responses", True),
        ("messages", False), ("messages", True)]
    for call in calls:
        assert call["status"] == "completed" and not call["replayed"], call
        assert call["usage"]["input_tokens"] > 0 and call["usage"]["output_tokens"] > 0, call
        assert call["cost"] is not None and call["cost"] > 0, call
        assert len(call["request_sha256"]) == 64 and call["latency_ms"] >= 0, call
    assert calls[0]["usage"] == {"input_tokens": 2, "output_tokens": 3, "cached_input_tokens": None}
    assert calls[5]["usage"]["input_tokens"] == 2 and calls[5]["usage"]["output_tokens"] == 3, calls[5]


def test_a_model_the_price_table_does_not_know_has_an_unknown_cost(gateway):
    run = run_id()
    answer = post(gateway, run, "chat/completions", chat_body("x", model="tiny-local-model"), upstream="local")
    assert answer.status_code == 200, answer.text
    (call,) = calls_when(gateway, run, 1)
    assert call["cost"] is None and call["usage"]["output_tokens"] == 2 and call["upstream"] == "local"


# --- replay ----------------------------------------------------------------------------------------

def step(srv, run: str, n: int) -> None:
    """The application's step n, and its state (a fork point)."""
    event = record(srv, run, "step", {"n": n}, step=n)
    save_state(srv, run, event["cursor"], {"n": n})


def record_three_calls(srv, run: str, last: str = "third") -> list:
    answers = []
    for n, text in enumerate(("first", "second", last), start=1):
        answers.append(post(srv, run, "chat/completions", chat_body(text)))
        step(srv, run, n)
    return answers


def test_a_fork_re_running_from_the_start_replays_the_kept_calls_then_goes_live(gateway, upstream):
    _, stats = upstream
    run, child = run_id(), run_id("fork")
    originals = record_three_calls(gateway, run)
    events = api(gateway, "GET", f"/api/v1/events/replay/{run}?cursor=0&limit=100")[2]["events"]
    second_step = next(e["cursor"] for e in events if e["type"] == "step" and e["payload"]["n"] == 2)
    fork(gateway, run, child, second_step)              # kept: the first two calls (and their steps)
    before = calls_made(stats)
    again = [post(gateway, child, "chat/completions", chat_body(text)) for text in ("first", "second")]
    assert calls_made(stats) == before, "the kept calls are answered from the record"
    for replayed, original in zip(again, originals):
        assert replayed.headers["x-actae-replayed"] == "true"
        assert replayed.content == original.content
    changed = post(gateway, child, "chat/completions", chat_body("something else"))
    later = post(gateway, child, "chat/completions", chat_body("third"))
    assert changed.headers["x-actae-replayed"] == "false" and later.headers["x-actae-replayed"] == "false"
    assert calls_made(stats) == before + 2, "the first changed call and every one after it go upstream"
    calls = calls_of(gateway, child)[-4:]
    assert [c["replayed"] for c in calls] == [True, True, False, False]
    assert calls[0]["saved"]["output_tokens"] == 2 and "usage" not in calls[0]
    # What the fork saved, measured: the kept calls and the replayed ones are the same two calls, each
    # counted once, with the usage the gateway recorded when they were paid for.
    kept = calls_of(gateway, run)[:2]
    status, _, savings = api(gateway, "GET", f"/api/v1/channels/{child}/savings")
    assert status == 200, savings
    measured = savings["fork"]["measured"]
    assert measured["calls"] == 2
    assert measured["input_tokens"] == sum(c["usage"]["input_tokens"] for c in kept)
    assert measured["output_tokens"] == sum(c["usage"]["output_tokens"] for c in kept)
    assert measured["cost"] == pytest.approx(sum(c["cost"] for c in kept))
    # the steps reported nothing, and the calls' own usage is not a step's: nothing counted twice
    assert savings["fork"]["saved"]["input_tokens"] == 0 and savings["fork"]["saved"]["steps"] == 2
    status, _, parent = api(gateway, "GET", f"/api/v1/channels/{run}/savings")
    assert parent["forks_measured"]["calls"] == 2


def test_a_stream_is_replayed_event_by_event(gateway, upstream):
    _, stats = upstream
    run, child = run_id(), run_id("fork")
    body = chat_body("stream me", stream=True)
    with httpx.stream("POST", f"{base(gateway, run)}/chat/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {gateway.key}"}) as first:
        original = b"".join(first.iter_raw())
    calls_when(gateway, run, 1)
    step(gateway, run, 1)
    fork(gateway, run, child, latest(gateway, run))
    before = calls_made(stats)
    with httpx.stream("POST", f"{base(gateway, child)}/chat/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {gateway.key}"}) as again:
        assert again.headers["x-actae-replayed"] == "true"
        pieces = list(again.iter_raw())
    assert b"".join(pieces) == original and calls_made(stats) == before
    assert len(pieces) > 1, "sent event by event, as recorded"


@pytest.mark.parametrize("policy", ["live", "replay", "block"])
def test_the_fork_tool_policy_llm(gateway, upstream, policy):
    _, stats = upstream
    run, child = run_id(), run_id("fork")
    record_three_calls(gateway, run)
    fork(gateway, run, child, latest(gateway, run), tool_policies={"llm": policy})
    before = calls_made(stats)
    same = post(gateway, child, "chat/completions", chat_body("first"))
    other = post(gateway, child, "chat/completions", chat_body("not recorded"))
    if policy == "live":
        assert same.status_code == other.status_code == 200
        assert same.headers["x-actae-replayed"] == "false" and calls_made(stats) == before + 2
    elif policy == "replay":
        assert same.status_code == 200 and same.headers["x-actae-replayed"] == "true"
        assert other.status_code == 403 and "not an exact replay" in other.json()["error"]["message"]
        assert calls_made(stats) == before
    else:
        assert same.status_code == other.status_code == 403 and calls_made(stats) == before
        assert "no model call on this fork" in same.json()["error"]["message"]
        with pytest.raises(openai.PermissionDeniedError):
            chat_client(gateway, child).chat.completions.create(**chat_body("first"))


def test_a_run_re_entered_through_agent_session_replays_its_own_completed_calls(gateway, upstream):
    from actae_client import AgentSession
    _, stats = upstream
    run = run_id("session")

    async def enter(client, texts):
        async with AgentSession(client, run) as session:
            answers = [await asyncio.to_thread(post, gateway, run, "chat/completions", chat_body(t)) for t in texts]
            await session.step("worked", output={"n": len(texts)})
            return answers
    first = using(gateway, lambda client: enter(client, ["one", "two"]))
    before = calls_made(stats)
    second = using(gateway, lambda client: enter(client, ["one", "two", "three"]))
    assert [a.headers["x-actae-replayed"] for a in second] == ["true", "true", "false"]
    assert [a.content for a in second[:2]] == [a.content for a in first]
    assert calls_made(stats) == before + 1


def test_a_failed_call_is_recorded_and_never_replayed(gateway, upstream):
    _, stats = upstream
    run, child = run_id(), run_id("fork")
    failed = post(gateway, run, "chat/completions", chat_body("boom", model="fail-500"))
    assert failed.status_code == 500
    step(gateway, run, 1)
    (call,) = calls_when(gateway, run, 1)
    assert call["status"] == "failed" and call["http_status"] == 500 and call["cost"] is None
    fork(gateway, run, child, latest(gateway, run))
    before = calls_made(stats)
    assert post(gateway, child, "chat/completions", chat_body("boom", model="fail-500")).status_code == 500
    assert calls_made(stats) == before + 1, "a failed call is not a position: its retry goes upstream"


def test_forced_live_goes_upstream(gateway, upstream):
    _, stats = upstream
    run, child = run_id(), run_id("fork")
    record_three_calls(gateway, run)
    fork(gateway, run, child, latest(gateway, run))
    before = calls_made(stats)
    forced = post(gateway, child, "chat/completions", chat_body("first"), headers={"x-actae-llm": "live"})
    assert forced.headers["x-actae-replayed"] == "false" and calls_made(stats) == before + 1
    replayed = post(gateway, child, "chat/completions", chat_body("second"))
    assert replayed.headers["x-actae-replayed"] == "true", "forcing one call does not change the others"


def test_identical_concurrent_calls_at_one_position_reach_the_upstream_once(gateway, upstream):
    _, stats = upstream
    run = run_id()
    before = calls_made(stats)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: post(gateway, run, "chat/completions", chat_body("same", model="slow-0.5")),
                                range(4)))
    assert {a.status_code for a in answers} == {200} and len({a.content for a in answers}) == 1
    assert calls_made(stats) == before + 1


# --- who may call, and faults ----------------------------------------------------------------------

def test_a_key_that_may_not_write_the_run_is_answered_as_for_no_run(gateway):
    from conftest import new_key
    run = run_id()
    post(gateway, run, "chat/completions", chat_body("mine"))
    other = new_key(gateway, read=["*"], write=["elsewhere-*"])
    refused = httpx.post(f"{base(gateway, run)}/chat/completions", json=chat_body("x"),
                         headers={"authorization": f"Bearer {other}"}, timeout=30)
    missing = httpx.post(f"{base(gateway, run_id('nothing'))}/chat/completions", json=chat_body("x"),
                         headers={"authorization": f"Bearer {other}"}, timeout=30)
    assert refused.status_code == missing.status_code == 404
    assert refused.json()["error"]["message"] == f"run {run} not found"
    assert missing.json()["error"]["message"].startswith("run nothing-")
    assert httpx.post(f"{base(gateway, run)}/chat/completions", json=chat_body("x"), timeout=30).status_code == 401


def test_faults_are_answered_in_the_provider_s_shape_while_the_server_serves(gateway, upstream):
    _, stats = upstream
    run = run_id()
    unknown = post(gateway, run, "chat/completions", chat_body("x"), upstream="nowhere")
    assert unknown.status_code == 404 and "nowhere" in unknown.json()["error"]["message"]
    other_path = httpx.get(f"{base(gateway, run)}/models", headers={"authorization": f"Bearer {gateway.key}"})
    assert other_path.status_code == 404 and other_path.json()["error"]["type"] == "not_found_error"
    down = post(gateway, run, "chat/completions", chat_body("x"), upstream="down")
    assert down.status_code == 502 and down.json()["error"]["message"].startswith("the upstream down")
    slow = post(gateway, run, "chat/completions", chat_body("x", model="slow-4"))
    assert slow.status_code == 504
    garbage = post(gateway, run, "chat/completions", chat_body("x", model="garbage"))
    assert garbage.status_code == 502 and "not JSON" in garbage.json()["error"]["message"]
    before = calls_made(stats)
    huge = post(gateway, run, "chat/completions", chat_body("x" * (5 * 1024 * 1024)))
    assert huge.status_code == 413 and calls_made(stats) == before
    claude = httpx.post(f"{gateway.url}/llm/runs/{run}/nowhere/v1/messages", json={"model": "m"},
                        headers={"x-api-key": gateway.key})
    assert claude.status_code == 404 and claude.json()["type"] == "error"
    assert api(gateway, "GET", "/healthz", key=None)[0] == 200
    assert [c["status"] for c in calls_when(gateway, run, 3)] == ["failed", "failed", "failed"]


def test_a_client_gone_mid_stream_is_recorded_incomplete_and_the_upstream_let_go(gateway, upstream):
    _, stats = upstream
    run = run_id()
    aborted = stats.aborted
    with httpx.stream("POST", f"{base(gateway, run)}/chat/completions", json=chat_body("x", model="drip", stream=True),
                      headers={"authorization": f"Bearer {gateway.key}"}, timeout=30) as answer:
        for n, _ in enumerate(answer.iter_raw()):
            if n == 2:
                break
    assert api(gateway, "GET", "/healthz", key=None)[0] == 200
    (call,) = calls_when(gateway, run, 1)
    assert call["status"] == "incomplete"
    poll(lambda: stats.aborted > aborted, timeout=15, what="the upstream's stream broken off")


# --- the dashboard ------------------------------------------------------------------------------------

def test_the_run_page_lists_a_step_s_calls_and_a_call_s_page_shows_its_messages(gateway, browser):
    from conftest import logged_in, shot
    run = run_id("page")
    client = chat_client(gateway, run)
    client.chat.completions.create(model="gpt-4o-mini", messages=[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "what is two plus two"}])
    step(gateway, run, 1)
    claude = anthropic.Anthropic(base_url=f"{gateway.url}/llm/runs/{run}/anthropic", api_key=gateway.key, max_retries=0)
    with claude.messages.stream(model="claude-3-5-haiku-latest", max_tokens=64, system="Be kind.",
                                messages=[{"role": "user", "content": "say hi"}]) as stream:
        stream.until_done()
    step(gateway, run, 2)
    calls_when(gateway, run, 2)
    context, page = logged_in(browser, gateway)
    try:
        page.goto(f"{gateway.url}/runs/{run}")
        rows = page.locator("#model-calls tr.llm-call")
        assert rows.count() == 2
        assert [rows.nth(n).locator("td[data-label=Step]").inner_text() for n in range(2)] == ["1", "2"]
        assert rows.nth(0).locator("td[data-label=Model]").inner_text() == "gpt-4o-mini"
        shot(page, "run-model-calls")
        rows.nth(1).locator("td[data-label=Model] a").click()
        page.wait_for_url(f"**/runs/{run}/calls/*")
        asked = page.locator("#asked .llm-message")
        assert [asked.nth(n).locator(".llm-role").inner_text().lower() for n in range(asked.count())] == ["system", "user"]
        assert asked.nth(1).locator(".llm-text").inner_text() == "say hi"
        answered = page.locator("#answered .llm-message")
        assert answered.count() == 1 and answered.first.locator(".llm-text").inner_text().strip() == "echo: say hi"
        shot(page, "llm-call")
    finally:
        context.close()
    from conftest import login
    first = calls_of(gateway, run)[0]
    with contextlib.closing(login(gateway)) as admin:
        twin = admin.get(f"/runs/{run}/calls/{first['call_id']}?format=json").json()
        assert [m["role"] for m in twin["asked"]] == ["system", "user"]
        assert twin["answered"][0]["text"] == "echo: what is two plus two"
        assert admin.get(f"/runs/{run_id('other')}/calls/{first['call_id']}").status_code == 404


def test_metrics_count_the_calls_spent_and_saved(gateway):
    from conftest import metric_values, value
    run, child = run_id(), run_id("fork")
    before = metric_values(gateway)
    post(gateway, run, "chat/completions", chat_body("count me"))
    step(gateway, run, 1)
    fork(gateway, run, child, latest(gateway, run))
    post(gateway, child, "chat/completions", chat_body("count me"))
    after = metric_values(gateway)

    def grew(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)
    assert grew("actae_llm_calls_total", status="completed", replayed="false") == 1
    assert grew("actae_llm_calls_total", status="completed", replayed="true") == 1
    assert grew("actae_llm_tokens_total", direction="output", kind="spent") == 3
    assert grew("actae_llm_tokens_total", direction="output", kind="saved") == 3
    assert grew("actae_llm_cost_total", kind="saved") > 0


def test_a_body_that_is_no_json_object_is_refused_before_any_upstream_call(gateway, upstream):
    _, stats = upstream
    run, before = run_id(), upstream[1].calls
    for raw in (b"{not json", b"[1, 2]", b'{"model": NaN}', b"[" * 5000 + b"]" * 5000,
                b'{"model": "m", "messages": ' + b"[" * 200 + b"]" * 200 + b"}"):
        answer = httpx.post(f"{base(gateway, run)}/chat/completions", content=raw, timeout=30,
                            headers={"authorization": f"Bearer {gateway.key}", "content-type": "application/json"})
        assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error", raw[:40]
    assert stats.calls == before and calls_of(gateway, run) == []
    assert api(gateway, "GET", "/healthz", key=None)[0] == 200


# --- upstreams kept by `actae llm add` --------------------------------------------------------------

def test_an_upstream_kept_by_llm_add_is_called_with_its_key_which_is_stored_encrypted(tmp_path, upstream):
    url, stats = upstream
    data, secret = tmp_path / "kept", "sk-upstream-" + uuid.uuid4().hex
    (tmp_path / "key").write_text(secret + "\n")
    added = cli("llm", "add", "kept", "--url", url, "--key-file", str(tmp_path / "key"), data_dir=data)
    assert "its key stored encrypted" in added.stdout and secret not in added.stdout
    listed = json.loads(cli("llm", "list", "--json", data_dir=data).stdout)["upstreams"]
    assert [(u["name"], u["url"], u["has_key"]) for u in listed] == [("kept", url, True)], listed
    assert secret not in json.dumps(listed)
    cli("llm", "add", "plain", "--url", url, data_dir=data, input="")          # a local server needs no key
    with ServerProcess(data).start() as srv:
        if srv.database is None:                 # SQLite: the key is nowhere in the database's files
            stored = b"".join(path.read_bytes() for path in data.glob("actae.db*"))
            assert secret.encode() not in stored and (data / "fleet_key").exists()
        run = run_id("kept")
        answer = post(srv, run, "chat/completions", chat_body("through a kept upstream"), upstream="kept")
        assert answer.status_code == 200, answer.text
        assert stats.last_key == f"Bearer {secret}"
        assert post(srv, run, "chat/completions", chat_body("no key"), upstream="plain").status_code == 200
        assert stats.last_key is None
        assert [c["upstream"] for c in calls_of(srv, run)] == ["kept", "plain"]
        cli("llm", "remove", "kept", data_dir=data)
        gone = poll(lambda: (lambda a: a if a.status_code == 404 else None)(
            post(srv, run, "chat/completions", chat_body("after remove"), upstream="kept")), timeout=10,
            what="a removed upstream answered 404")
        assert "no upstream named 'kept'" in gone.json()["error"]["message"]
        assert not any(secret in line for line in srv.lines)
    bad = cli("llm", "add", "no good", "--url", "ftp://x", data_dir=data, check=False)
    assert bad.returncode != 0 and "NAME=URL" in bad.stderr and "Traceback" not in bad.stderr
    missing = cli("llm", "remove", "never", data_dir=data, check=False)
    assert missing.returncode != 0 and "no upstream named 'never'" in missing.stderr
