"""The module's shape: one home per SQL statement, and a docstring map that matches its sections.

Both read actae.py as text (its AST and its banners); neither starts a server.
"""
from __future__ import annotations

import ast
import collections
import itertools
import re
from collections import defaultdict

from conftest import ROOT

SOURCE = (ROOT / "actae.py").read_text(encoding="utf-8")
TREE = ast.parse(SOURCE)            # parsed once: the tests only read it
SQL_START = re.compile(r"\s*(SELECT|INSERT|UPDATE|DELETE|WITH|CREATE|ALTER|DROP|PRAGMA|BEGIN|COMMIT|ROLLBACK|SAVEPOINT"
                       r"|RELEASE|LISTEN|NOTIFY|VACUUM|SET|SHOW)\b")
TRANSACTION_WORDS = {"BEGIN", "COMMIT", "ROLLBACK"}      # statements of one word


def rendered(node: ast.AST) -> str:
    """A string literal's text; an f-string's with `{}` where its expressions go."""
    if isinstance(node, ast.Constant):
        return node.value
    return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)


def sql_statements(tree: ast.AST) -> dict:
    """{statement text with white space folded: [line, ...]} for every SQL string in the module's `tree`."""
    inside_fstrings = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    found = defaultdict(list)
    for node in ast.walk(tree):
        if id(node) in inside_fstrings:
            continue
        if not (isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))):
            continue
        text = " ".join(rendered(node).split())
        if not SQL_START.match(text):
            continue
        if " " not in text and text not in TRANSACTION_WORDS:
            continue                      # a lone word ("DELETE" as an HTTP method) is no statement
        found[text].append(node.lineno)
    return found


def test_the_collector_finds_statements_and_repeats():
    sample = ('a = "SELECT * FROM t WHERE id = ?"\nb = f"SELECT * FROM t{w} LIMIT 1"\nc = "SELECT * FROM t WHERE id = ?"\n'
              'd = ("UPDATE t SET x = ?"\n     " WHERE id = ?")\nmethod = "DELETE"\n')
    found = sql_statements(ast.parse(sample))
    assert found["SELECT * FROM t WHERE id = ?"] == [1, 3]
    assert found["SELECT * FROM t{} LIMIT 1"] == [2]
    assert found["UPDATE t SET x = ? WHERE id = ?"] == [4]
    assert "DELETE" not in found
    assert len(sql_statements(TREE)) > 150          # the module's own: it does find them


def test_no_sql_statement_text_appears_twice():
    repeated = {text: lines for text, lines in sql_statements(TREE).items() if len(lines) > 1}
    assert not repeated, "\n".join(f"lines {lines}: {text[:160]}" for text, lines in sorted(repeated.items()))


BANNER = re.compile(r"^# =+\n# (.+)\n# =+$", re.M)


def banners(source: str) -> list:
    return BANNER.findall(source)


def banner_titles(source: str) -> list:
    """Each section's banner title up to any colon or parenthesis, in file order."""
    return [re.split(r"[:(]", title, maxsplit=1)[0].strip() for title in banners(source)]


def map_lines(tree: ast.Module) -> list:
    """The map's lines: after its opening paragraph, every line but the two headings."""
    doc = ast.get_docstring(tree)
    listing = doc.split("The map:", 1)[1].split("\n\n", 1)[1]
    return [line for line in listing.splitlines() if line.strip() and line not in ("Kernel", "Regions")]


def test_the_docstring_map_lists_every_section_in_file_order():
    titles, lines = banner_titles(SOURCE), map_lines(TREE)
    assert len(titles) >= 20
    assert len(lines) == len(titles), (titles, lines)
    for title, banner, line in zip(titles, banners(SOURCE), lines):
        assert line.startswith(title), f"map line {line!r} should begin with the banner title {title!r}"
        head = line.split(" — ", 1)[0]
        assert banner.startswith(head), f"map line {line!r} names more than its banner {banner!r}"


def test_related_sections_sit_together():
    titles = banner_titles(SOURCE)
    full = banners(SOURCE)
    at = {title: i for i, title in enumerate(full)}
    principals = next(i for t, i in at.items() if t.startswith("Principals: API keys"))
    assert titles[principals + 1] == "Authentication"
    handlers = next(i for t, i in at.items() if t.startswith("HTTP API: the kernel's handlers"))
    assert full[handlers + 1].startswith("HTTP API: the route table")
    # each region's banners are one run: a region is read in one place
    owners = [region_of(title) for title in full]
    runs = [owner for owner, _ in itertools.groupby(owners) if owner is not None]
    assert runs == list(REGIONS), runs
    # a record only one region decodes or answers is that region's, beside its other records
    for region, record in (("Runs", "RunsPageQuery"), ("Diff and outcome", "DiffPageQuery"),
                           ("Ledger", "LedgerPageQuery"), ("Experiments", "ExperimentPageQuery")):
        records = SOURCE.split(f"# {region}: ", 1)[1].split("\n# =====", 2)[1]
        assert f"\nclass {record}(" in records, (region, record)


# --- the core in layers, each capability in a region of its own -----------------------------------

REGIONS = ("Runs", "Forks", "Diff and outcome", "Ledger", "Wake-ups", "Groups", "Experiments", "Model calls",
           "Fork plans", "Hand-offs", "Many runs", "MCP", "Moving runs", "Observability", "Ingest", "Fleet")
# The names that say which capability a definition belongs to.
CAPABILITY_NAMES = {
    "Wake-ups": re.compile(r"wakeup|Wakeup|WAKEUP|Scheduler"),
    "Groups": re.compile(r"consumer_group|ConsumerGroup|execution_group|ExecutionGroup|group_message|GroupMessage"
                         r"|group_fork|GroupFork"),
    # experiment_metadata is the SDK's metadata of every run (experiment_of reads it), not the region's.
    "Experiments": re.compile(r"[Ee]xperiment(?!_metadata|_of$)|EXPERIMENT"),
    "Fleet": re.compile(r"fleet|Fleet|FLEET|org_token|OrgToken|ORG_TOKEN|RemoteInstance|FleetInstance"),
    "Many runs": re.compile(r"approval|Approval|APPROVAL|bulk|Bulk|BULK|prune|Prune|PRUNE|retention|Retention"
                            r"|RETENTION"),
    "Observability": re.compile(r"span|Span|SPAN|otel|Otel|OTEL|otlp|Otlp|OTLP|metric|Metric|METRIC"),
    "Hand-offs": re.compile(r"hand_off|HandOff|HAND_OFF|fork_job|FORK_JOB"),
    "Ingest": re.compile(r"ingest|Ingest|INGEST|span|Span|SPAN|otlp|Otlp|OTLP"),
}
# What the kernel declares for the regions: the record, the list, and the hooks built from it.
REGION_KERNEL = {"Region", "REGIONS", "declare", "SchemaPart", "EventHook", "Installed", "Hooks", "hooks_of",
                 "StoreHooks", "store_hooks"}


def defined_names(node: ast.AST) -> list:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(node, ast.If):
        return [name for child in node.body for name in defined_names(child)]
    return []


def sections_of(source: str, tree: ast.Module) -> list:
    """[(banner title, [top-level nodes under it])] in file order (`tree` is `source` parsed)."""
    starts = [(source.count("\n", 0, m.start()) + 1, m.group(1)) for m in BANNER.finditer(source)]
    found = [(title, []) for _, title in starts]
    for node in tree.body:
        at = [i for i, (line, _) in enumerate(starts) if line <= node.lineno]
        if at:
            found[at[-1]][1].append(node)
    return found


def region_of(title: str):
    return next((region for region in REGIONS if title.startswith(region)), None)


def test_the_map_lists_the_core_then_the_regions():
    titles = [region_of(title) for title in banners(SOURCE)]
    first = titles.index(next(t for t in titles if t is not None))
    assert all(t is None for t in titles[:first]) and all(t is not None for t in titles[first:]), titles
    assert [t for t in dict.fromkeys(titles[first:])] == list(REGIONS)
    doc = ast.get_docstring(TREE)
    assert doc.index("Command line —") < doc.index("Experiments —") < doc.index("Model calls:")
    assert doc.index("Model calls:") < doc.index("Many runs:") < doc.index("Fleet: records")


def test_every_definition_of_a_capability_lies_in_its_region():
    misplaced = []
    for title, nodes in sections_of(SOURCE, TREE):
        if title.startswith("Constants and vocabulary"):     # the states a schema CHECK lists are the kernel's
            continue
        for node in nodes:
            for name in defined_names(node):
                # OpenTelemetry's words (span, otlp) are two regions': traces out (Observability), spans in (Ingest)
                owners = [capability for capability, pattern in CAPABILITY_NAMES.items() if pattern.search(name)]
                if owners and region_of(title) not in owners:
                    misplaced.append(f"{name} ({' or '.join(owners)}) is under {title!r}")
    assert not misplaced, "\n".join(misplaced)


def test_the_core_names_no_region_and_each_region_plugs_in_by_one_declaration():
    sections = sections_of(SOURCE, TREE)
    regional = {name for title, nodes in sections if region_of(title) for node in nodes
                for name in defined_names(node)}
    assert len(regional) > 300 and not (regional & REGION_KERNEL)
    leaks = []
    for title, nodes in sections:
        if region_of(title):
            continue
        for node in nodes:
            used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & regional
            if used:
                leaks.append(f"{defined_names(node)} under {title!r} uses {sorted(used)}")
    assert not leaks, "\n".join(leaks)
    kernel = dict(sections)["Regions: the one declaration by which a capability plugs into the kernel"]
    assert REGION_KERNEL <= {name for node in kernel for name in defined_names(node)}
    # A region's one tie: `NAME = declare(Region(...))`, once per region, and nothing assigned onto
    # the kernel's objects (no `db.x = ...`, `services.x = ...`, `app.x = ...`) outside the kernel.
    declared, assigned = collections.Counter(), []
    for title, nodes in sections:
        for node in nodes:
            if region_of(title) and isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                    and getattr(node.value.func, "id", None) == "declare":
                declared[region_of(title)] += 1
            for inner in ast.walk(node):
                if region_of(title) and isinstance(inner, (ast.Assign, ast.AugAssign)):
                    targets = inner.targets if isinstance(inner, ast.Assign) else [inner.target]
                    for target in targets:
                        while isinstance(target, ast.Subscript):
                            target = target.value
                        if isinstance(target, ast.Attribute) and isinstance(target.value, (ast.Name, ast.Attribute)) \
                                and ast.unparse(target.value).split(".")[-1] in ("db", "app", "services", "hub"):
                            assigned.append(f"{ast.unparse(target)} assigned under {title!r}")
            if not region_of(title):
                continue
            calls = {n.func.id for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
            assert not ({"schema_step", "on_events"} & calls), f"{defined_names(node)} plugs in outside its Region"
    assert declared == {region: 1 for region in REGIONS}, declared
    assert not assigned, "\n".join(assigned)
    # Every field of Region is read by the kernel (a hook nobody calls is a region's silent no-op).
    region_class = next(n for n in TREE.body if isinstance(n, ast.ClassDef) and n.name == "Region")
    fields = [n.target.id for n in region_class.body if isinstance(n, ast.AnnAssign)]
    kernel_text = "\n".join(ast.unparse(node) for title, nodes in sections if not region_of(title) for node in nodes)
    unread = [f for f in fields if f != "name" and f"'{f}'" not in kernel_text and f"\"{f}\"" not in kernel_text
              and f".{f}" not in kernel_text]
    assert not unread, unread


# --- one request path --------------------------------------------------------------------------------

def functions_named(name: str) -> list:
    return [n for n in ast.walk(TREE) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name == name]


def calls_in(function: ast.AST) -> set:
    return {n.func.id if isinstance(n.func, ast.Name) else n.func.attr for n in ast.walk(function)
            if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}


def test_each_concern_of_a_request_is_defined_once_and_on_every_route():
    for concern in ("host_refusal", "accepts_gzip", "gzipped", "error_response", "note_request"):
        assert len(functions_named(concern)) == 1, concern
    # the Host header is read in one place, gzip is written in one place, the histogram observed in one
    assert SOURCE.count('k == b"host"') == 1 and SOURCE.count("gzip.compress(") == 1
    assert SOURCE.count(".observe_request(") == 1
    (respond,), (answer_http,), (answer_ws,), (reply,) = (functions_named(n) for n in (
        "respond", "answer_http", "answer_websocket", "reply"))
    assert {"host_refusal", "error_response", "find", "reply"} <= calls_in(respond)
    assert {"host_refusal", "note_request", "find"} <= calls_in(answer_ws)
    assert "note_request" in calls_in(answer_http) and "gzipped" in calls_in(reply)
    # nothing answers HTTP beside it: no Starlette app, router or middleware, no protocol of our own that answers
    for gone in ("Starlette(", "GZipMiddleware", "Middleware(", "RequestResponseCycle", "HEADER_RE"):
        assert gone not in SOURCE, gone


# --- dependencies through their public interfaces ---------------------------------------------------

# One function per dependency may use its private names; requirements.txt bounds each such dependency.
PRIVATE_USERS = {"aiosqlite_internals": "aiosqlite", "bundle_dir": None, "otel_queue_length": "opentelemetry-sdk",
                 "uvicorn_http_protocol": "uvicorn"}


def test_private_names_of_dependencies_are_used_in_one_named_function_each():
    owner = {}
    for node in ast.walk(TREE):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for child in ast.walk(node):
                owner.setdefault(id(child), node.name)
    found = []
    for node in ast.walk(TREE):
        private = None
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                private = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and str(node.args[1].value).startswith("_") and not str(node.args[1].value).startswith("__")):
            private = node.args[1].value
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
            if any(part.startswith("_") and part != "__future__" for m in modules for part in m.split(".")) or any(
                    n.startswith("_") for n in names):
                private = ast.unparse(node)
            if any("protocols" in m or "httptools_impl" in m for m in modules):
                private = ast.unparse(node)
        if private is not None:
            found.append((owner.get(id(node)), private))
    assert found, "the collector finds the module's own uses"
    outside = [f"{name!r} in {function}" for function, name in found if function not in PRIVATE_USERS]
    assert not outside, outside
    requirements = (ROOT / "requirements.txt").read_text()
    for dependency in filter(None, PRIVATE_USERS.values()):
        line = next(l for l in requirements.splitlines() if re.match(rf"{re.escape(dependency)}\b", l))
        assert ">=" in line and "<" in line.replace("<=", "<"), f"{dependency} is not bounded both ways: {line}"


# --- readable lines, a public surface ----------------------------------------------------------------

def test_no_backslash_continuations_and_a_public_surface():
    assert not [n for n, line in enumerate(SOURCE.splitlines(), 1) if line.endswith("\\")]
    declared = next(node for node in TREE.body if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets))
    public = ast.literal_eval(declared.value)
    tests_and_examples = "\n".join(p.read_text() for p in [*ROOT.glob("tests/*.py"), *ROOT.glob("examples/*.py")])
    used = set(re.findall(r"\bactae\.([A-Za-z_]\w*)\s*[(\[.,)\s]", tests_and_examples))
    defined = {name for node in TREE.body for name in defined_names(node)}
    assert not [name for name in used if name.startswith("_") and name != "__version__"]
    assert {name for name in used if name in defined} <= set(public)


# --- the app is plain ASGI ---------------------------------------------------------------------------

def test_the_app_inside_an_asgi_middleware_passes_the_sdk_tests():
    """tests/wrapped_server.py wraps create_app() in a request logger under plain uvicorn (h11); the
    SDK's ledger, group and fork tests run against it unchanged."""
    import os
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_ledger.py",
                           "tests/test_groups.py", "tests/test_fork.py"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "ACTAE_TEST_WRAPPED": "1"}, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"\b1[0-9]{2} passed", done.stdout), done.stdout[-2000:]


def test_the_wrapped_server_is_the_middleware_s(tmp_path):
    from conftest import ServerProcess, api, ok
    import sys
    with ServerProcess(tmp_path, command=[sys.executable, str(ROOT / "tests" / "wrapped_server.py")]).start() as srv:
        ok(api(srv, "POST", "/api/v1/events/record", body={"channel_id": "wrapped-1", "event_type": "agent.step",
                                                           "payload": {"n": 1}}))
        assert "agent.step" in str(ok(api(srv, "GET", "/api/v1/events/replay/wrapped-1")))
        assert api(srv, "GET", "/healthz", key=None)[0] == 200
    assert any(line.startswith("wrapped: POST /api/v1/events/record 200") for line in srv.lines), srv.lines[-20:]


# --- the vocabulary once -------------------------------------------------------------------------------

def test_the_schema_s_check_lists_are_the_vocabulary_constants(tmp_path):
    import actae
    conn = actae.connect_sync(actae.Location(tmp_path))
    tables = {name: sql for name, sql in conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'")}
    checks = {}
    for table, sql in tables.items():
        for column, values in re.findall(r"\b(\w+)\s+TEXT\b[^,]*?CHECK \(\1 IN \(([^)]*)\)\)", sql):
            checks[(table, column)] = tuple(re.findall(r"'([^']*)'", values))
    assert checks == {
        ("channels", "reproducibility"): actae.REPRODUCIBILITY_GRADES, ("channels", "outcome"): actae.OUTCOMES,
        ("executions", "status"): actae.EXECUTION_STATES, ("wakeups", "status"): actae.WAKEUP_STATUSES,
        ("execution_groups", "status"): actae.EXECUTION_GROUP_STATUSES,
        ("group_messages", "status"): actae.GROUP_MESSAGE_STATUSES,
        ("approvals", "status"): actae.APPROVAL_STATUSES, ("approvals", "decision"): actae.APPROVAL_DECISIONS,
        ("llm_calls", "status"): actae.LLM_CALL_STATES,
    }, checks
    # each vocabulary is spelled once in the module: its constant
    for vocabulary in (actae.EXECUTION_STATES, actae.REPRODUCIBILITY_GRADES, actae.LEDGER_OUTCOMES[4:],
                       actae.APPROVAL_STATUSES, actae.OUTCOMES):
        spelled = ", ".join(f'"{value}"' for value in vocabulary)
        assert SOURCE.count(spelled) == 1, spelled
    assert actae.LEDGER_OUTCOMES[:4] == actae.CLAIM_OUTCOMES and actae.FAILURE_STATES == ("failed", "crashed")


def test_no_name_is_defined_twice_at_the_top_level():
    """A second definition replaces the first for every caller, the first's region included (an ingest
    helper once took the name of the trace export's backfill)."""
    seen = collections.Counter(name for node in TREE.body for name in defined_names(node)
                               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
    assert not [name for name, count in seen.items() if count > 1]
