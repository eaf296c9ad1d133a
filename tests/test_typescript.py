"""TypeScript types generated from the server's own /openapi.json, used strictly by a real script.

At test time: GET /openapi.json from the shared server -> `openapi-typescript` (npm,
not ours; its default flags, so --default-non-nullable is on) -> api.ts -> a record/replay/fork
script written against its `paths` types (no casts, no `any`):

A. the generated types are what a client writing requests needs: a request member with a default
   is optional, a free-form object is an open map (not `Record<string, never>`), a nullable member
   is `T | null`;
B. the script records two events, saves a state, replays, forks after step 1 and reads the fork's
   metadata; `tsc --noEmit --strict` (target es2022, lib es2022 + dom for fetch) accepts it, then
   it is compiled and run with Node against the server, and what it prints is checked;
C. the types are not vacuous: the same calls with a wrong member type, an unknown member and a
   missing required member are refused by tsc.

The tools are not installed at test time: .ci/run installs Node (Debian's nodejs and npm) when it
is missing, and `npm install --prefix .ci/node openapi-typescript typescript` (or the folder in
ACTAE_TS_TOOLS). Without node or the tools the tests skip, saying so.

Run:  python -m pytest tests/test_typescript.py -q -s
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from conftest import ROOT, ServerProcess, http

TOOLS = Path(os.environ.get("ACTAE_TS_TOOLS") or ROOT / ".ci" / "node")
OPENAPI_TYPESCRIPT = TOOLS / "node_modules" / "openapi-typescript" / "bin" / "cli.js"
TSC = TOOLS / "node_modules" / "typescript" / "bin" / "tsc"
STRICT = ["--strict", "--target", "es2022", "--lib", "es2022,dom", "--module", "commonjs"]


def node_major(node: str) -> int:
    out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    m = re.match(r"v(\d+)\.", out)
    return int(m.group(1)) if m else 0


def missing_tools() -> str | None:
    node = shutil.which("node")
    if node is None:
        return "node is not installed (.ci/run installs Debian's nodejs and npm)"
    if node_major(node) < 18:
        return "node is older than 18 (no fetch)"
    for tool in (OPENAPI_TYPESCRIPT, TSC):
        if not tool.is_file():
            return (f"{tool} is missing: run `npm install --no-audit --no-fund --prefix {TOOLS} "
                    f"openapi-typescript typescript` (as .ci/run does)")
    return None


pytestmark = pytest.mark.skipif(missing_tools() is not None, reason=str(missing_tools()))


def run(command: list, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=timeout, cwd=str(cwd))


def tsc(where: Path, *args) -> subprocess.CompletedProcess:
    return run(["node", TSC, *STRICT, *args], where)


@pytest.fixture(scope="module")
def project(server, tmp_path_factory) -> Path:
    """A folder with api.ts: openapi-typescript's types for the server's /openapi.json."""
    status, _, doc = http("GET", server.url + "/openapi.json")
    assert status == 200 and isinstance(doc, dict), (status, str(doc)[:300])
    where = tmp_path_factory.mktemp("typescript")
    (where / "openapi.json").write_text(json.dumps(doc))
    out = run(["node", OPENAPI_TYPESCRIPT, "openapi.json", "--output", "api.ts"], where)
    assert out.returncode == 0 and (where / "api.ts").is_file(), (
        f"openapi-typescript failed (exit {out.returncode}):\n{out.stdout}\n{out.stderr}")
    return where


def schema_type(api_ts: str, name: str) -> str:
    """The text of `components.schemas[name]` in the generated file."""
    m = re.search(rf"^        {re.escape(name)}: (\{{.*?^        \}}|[^\n]*);$", api_ts, re.M | re.S)
    assert m, f"no schema {name} in the generated types"
    return m.group(1)


# --------------------------------------------------------------------------------------------
# A. What the generator makes of the document
# --------------------------------------------------------------------------------------------

def test_request_defaults_are_optional_and_free_form_objects_are_open(project):
    api_ts = (project / "api.ts").read_text()
    record = schema_type(api_ts, "RecordEvent")
    for member in ("operation_id", "payload", "metadata", "step_number", "dependencies"):
        assert re.search(rf"^\s*{member}\?: ", record, re.M), f"RecordEvent.{member} is not optional:\n{record}"
    for member in ("channel_id", "event_type"):
        assert re.search(rf"^\s*{member}: ", record, re.M), f"RecordEvent.{member} is not required:\n{record}"
    fork = schema_type(api_ts, "Fork")
    assert re.search(r"^\s*at_cursor\?: number;", fork, re.M), fork          # default 0: optional to send
    assert re.search(r"^\s*manifest\?: \{\s*\[key: string\]: unknown;\s*\} \| null;", fork, re.M), fork
    meta = schema_type(api_ts, "EventMeta")
    assert re.search(r"^\s*metadata\?: \{\s*\[key: string\]: unknown;\s*\} \| null;", meta, re.M), meta
    # Nullable answer members are `T | null`, always present.
    receipt = schema_type(api_ts, "Receipt")
    assert re.search(r"^\s*source_state_sha256: string \| null;", receipt, re.M), receipt
    assert re.search(r"^\s*ok: boolean;", schema_type(api_ts, "Done"), re.M)
    # The only closed empty objects left: the record that takes no fields, and the generator's own.
    closed = re.findall(r"^\s*(\S+?)\??: Record<string, never>", api_ts, re.M)
    assert set(closed) <= {"Empty"}, f"objects typed as empty: {sorted(set(closed))}"


# --------------------------------------------------------------------------------------------
# B. A strict record/replay/fork script, type-checked, compiled and run
# --------------------------------------------------------------------------------------------

# The generic `call` is the one place wire JSON enters typed code (JSON.parse): the path template
# and method pick the parameter, body and answer types from `paths`.
PRELUDE = """import type { paths } from "./api";

const BASE: string = __BASE__;
const KEY: string = __KEY__;
const CHANNEL: string = __CHANNEL__;
const FORK: string = __FORK__;

type Method = "get" | "post";
type Json<R> = R extends { content: { "application/json": infer T } } ? T : never;
type Body<O> = O extends { requestBody: infer R } ? Json<R> : undefined;
type Answer<O> = O extends { responses: { 200: infer R } } ? Json<R> : never;
type Params<O> = O extends { parameters: infer P } ? P : never;
type Scalar = string | number | boolean | null | undefined;
interface Where {
    path?: { [name: string]: Scalar };
    query?: { [name: string]: Scalar };
}

async function call<P extends keyof paths, M extends Method>(
    method: M, path: P, params: Params<paths[P][M]> & Where, body: Body<paths[P][M]>,
): Promise<Answer<paths[P][M]>> {
    let url: string = path;
    for (const [name, value] of Object.entries(params.path ?? {})) {
        url = url.replace(`{${name}}`, encodeURIComponent(String(value)));
    }
    const query = new URLSearchParams();
    for (const [name, value] of Object.entries(params.query ?? {})) {
        if (value !== undefined && value !== null) query.set(name, String(value));
    }
    const search = query.toString();
    const response = await fetch(BASE + url + (search ? `?${search}` : ""), {
        method: method.toUpperCase(),
        headers: { "x-api-key": KEY, "content-type": "application/json" },
        body: body === undefined ? undefined : JSON.stringify(body),
    });
    const text = await response.text();
    if (response.status !== 200) throw new Error(`${method} ${url} answered ${response.status}: ${text}`);
    return JSON.parse(text);
}
"""

FLOW = PRELUDE + """
async function main(): Promise<void> {
    const first = await call("post", "/api/v1/events/record", {}, {
        channel_id: CHANNEL, event_type: "agent.step", step_number: 1, payload: { answer: "draft" },
        metadata: { actor: "ts-script", metadata: { language: "typescript" } },
    });
    const second = await call("post", "/api/v1/events/record", {}, {
        channel_id: CHANNEL, event_type: "agent.step", step_number: 2, payload: { answer: "final" },
    });
    const saved = await call("post", "/api/v1/state/{channel_id}", { path: { channel_id: CHANNEL } }, {
        cursor: first.event.cursor, state: { memory: ["draft"] },
    });
    const replay = await call("get", "/api/v1/events/replay/{channel_id}",
        { path: { channel_id: CHANNEL }, query: { cursor: 0, limit: 100 } }, undefined);
    const receipt = await call("post", "/api/v1/channels/fork", {}, {
        source_channel_id: CHANNEL, new_channel_id: FORK, at_cursor: first.event.cursor,
        reason: "retry after step 1", manifest: { model: "m-2" },
    });
    const metadata = await call("get", "/api/v1/channels/{channel_id}/metadata",
        { path: { channel_id: FORK } }, undefined);
    const parent: string = metadata.parent_channel_id ?? "(none)";
    const forkedAt: number = metadata.forked_at_cursor ?? -1;
    const sha256: string = receipt.source_state_sha256 ?? "";
    console.log(JSON.stringify({
        cursors: [first.event.cursor, second.event.cursor],
        actor: first.event.actor,
        state_version: saved.version,
        replayed: replay.events.map((event) => [event.type, event.step_number ?? 0]),
        fork: receipt.child_channel_id,
        resolved_cursor: receipt.resolved_cursor ?? -1,
        restorable: receipt.restorable,
        sha256,
        parent,
        forked_at: forkedAt,
        reason: metadata.reason ?? "",
        manifest: metadata.manifest,
    }));
}

main().catch((error: unknown) => {
    console.error(error);
    process.exitCode = 1;
});
"""

# Without @types/node, `process` is declared here (the one thing the script needs from Node).
NODE_GLOBALS = "declare const process: { exitCode?: number };\n"

# Each call below is wrong in one way tsc must catch (line -> what).
WRONG = PRELUDE + """
async function wrong(): Promise<void> {
    await call("post", "/api/v1/events/record", {}, { channel_id: CHANNEL, event_type: "x", step_number: "one" });
    await call("post", "/api/v1/channels/fork", {}, { source_channel_id: CHANNEL, new_channel_id: FORK, at_step: 1 });
    await call("post", "/api/v1/channels/fork", {}, { new_channel_id: FORK });
    await call("get", "/api/v1/events/replay/{channel_id}", { path: { channel: CHANNEL } }, undefined);
    const receipt = await call("get", "/api/v1/channels/{channel_id}/receipt", { path: { channel_id: FORK } }, undefined);
    const sha256: string = receipt.source_state_sha256;
}
"""


def script(template: str, srv: ServerProcess, channel: str) -> str:
    source = (template.replace("__BASE__", json.dumps(srv.url)).replace("__KEY__", json.dumps(srv.key))
              .replace("__CHANNEL__", json.dumps(channel)).replace("__FORK__", json.dumps(channel + "-fork")))
    return NODE_GLOBALS + source


def test_a_record_replay_fork_script_type_checks_strictly_and_runs(project, server):
    channel = f"ts-{uuid.uuid4().hex[:8]}"
    source = script(FLOW, server, channel)
    code = re.sub(r"//[^\n]*|\"[^\"\n]*\"|`[^`]*`", "", source)        # the code, without comments and strings
    assert not re.search(r"\bas\b|\bany\b|@ts-|<\w+>\s*\w", code), "the script must use no casts and no any"
    (project / "flow.ts").write_text(source)

    checked = tsc(project, "--noEmit", "flow.ts")
    assert checked.returncode == 0, f"tsc --noEmit --strict refused the script:\n{checked.stdout}{checked.stderr}"
    built = tsc(project, "--outDir", "out", "flow.ts")
    assert built.returncode == 0, f"tsc could not compile the script:\n{built.stdout}{built.stderr}"
    ran = run(["node", project / "out" / "flow.js"], project, timeout=120)
    assert ran.returncode == 0, f"the script failed (exit {ran.returncode}):\n{ran.stdout}\n{ran.stderr}"
    printed = json.loads(ran.stdout.strip().splitlines()[-1])
    print("\n" + json.dumps(printed))

    first, second = printed["cursors"]
    assert isinstance(first, int) and 0 < first < second, printed
    assert printed["actor"] == "ts-script"
    assert printed["state_version"] >= 1
    assert printed["replayed"] == [["agent.step", 1], ["agent.step", 2]]
    assert printed["fork"] == channel + "-fork"
    assert printed["resolved_cursor"] == first
    assert printed["restorable"] is True
    assert re.fullmatch(r"[0-9a-f]{64}", printed["sha256"]), printed
    assert printed["parent"] == channel
    assert printed["forked_at"] == first
    assert printed["reason"] == "retry after step 1"
    assert printed["manifest"] == {"model": "m-2"}


# --------------------------------------------------------------------------------------------
# C. The types refuse what is wrong
# --------------------------------------------------------------------------------------------

def test_the_generated_types_refuse_wrong_calls(project, server):
    source = script(WRONG, server, "ts-wrong")
    (project / "wrong.ts").write_text(source)
    checked = tsc(project, "--noEmit", "wrong.ts")
    assert checked.returncode != 0, "tsc accepted calls that do not match the document"
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines, 1) if line.startswith("async function wrong"))
    flagged = {int(m.group(1)) - start for m in re.finditer(r"wrong\.ts\((\d+),\d+\): error", checked.stdout)}
    # 1 a string step_number, 2 an unknown member, 3 a missing source_channel_id, 4 a wrong path
    # parameter, 6 a nullable member used as a string.
    assert {1, 2, 3, 4, 6} <= flagged, f"tsc flagged lines {sorted(flagged)} of wrong():\n{checked.stdout}"
