"""docs/schema.md: every table of each backend whole, as the migrations leave a new database.

The schema is written as one CREATE and many later steps (ALTERs, rebuilt tables, indexes added by
regions), so no one can read a table whole in the code. This test migrates a new database of the
backend the suite runs on, renders what is there (tables with their columns, types, defaults and
constraints, then their indexes; SQLite's and PostgreSQL's own catalog, not the migrations' text)
and compares it with that backend's section of docs/schema.md. Stale: it fails and says how to
write the file anew:

    ACTAE_WRITE_SCHEMA=1 python -m pytest tests/test_schema_doc.py                     # SQLite's section
    ACTAE_WRITE_SCHEMA=1 ACTAE_TEST_DATABASE_URL=... python -m pytest tests/test_schema_doc.py   # PostgreSQL's

CI runs the suite once per backend, so each pass checks its own section.
"""
from __future__ import annotations

import os
import re
import sys

from conftest import BACKEND, ROOT, fresh_database_url

sys.path.insert(0, str(ROOT))
import actae  # noqa: E402

DOC = ROOT / "docs" / "schema.md"
HEADINGS = {"sqlite": "## SQLite", "postgresql": "## PostgreSQL"}
PREAMBLE = """# The schema

Every table of each backend as a new database has it after every migration (the step count is
`PRAGMA user_version` on SQLite, the highest version in `actae_migrations` on PostgreSQL, where
steps 1-5 are version 1 and step n is version n - 4). Written by `tests/test_schema_doc.py` from
each backend's own catalog; the suite fails when this file no longer matches the migrations
(`ACTAE_WRITE_SCHEMA=1 python -m pytest tests/test_schema_doc.py` writes it, once per backend).
The migrations themselves are `MIGRATIONS` in `actae.py` (one numbering: a step's number is its
place there) and the `SchemaPart`s each region's `Region` declaration adds to a step by number.
"""


def sqlite_schema(tmp_path) -> str:
    conn = actae.connect_sync(actae.Location(tmp_path, None))
    try:
        steps = conn.execute("PRAGMA user_version").fetchone()[0]
        lines = [f"{steps} migration steps.", ""]
        tables = [r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name")]
        for table in tables:
            lines += [f"### {table}", "", "```sql", normalised(conn.execute(
                "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone()[0]) + ";"]
            lines += [normalised(sql) + ";" for (sql,) in conn.execute(
                "SELECT sql FROM sqlite_master WHERE tbl_name = ? AND type IN ('index', 'trigger') AND sql IS NOT NULL"
                " ORDER BY type, name", (table,))]
            lines += ["```", ""]
        views = list(conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'view' ORDER BY name"))
        for name, sql in views:
            lines += [f"### {name} (view)", "", "```sql", normalised(sql) + ";", "```", ""]
        return "\n".join(lines).rstrip() + "\n"
    finally:
        conn.close()


def normalised(sql: str) -> str:
    """SQLite keeps each statement's text as written: the same layout, whatever the indentation of the
    template it came from, and no trailing spaces."""
    lines = [line.rstrip() for line in sql.strip().splitlines()]
    body = [line for line in lines[1:] if line.strip()]
    indent = min((len(line) - len(line.lstrip()) for line in body), default=0)
    return "\n".join([lines[0], *("    " + line[indent:] for line in body)])


POSTGRES_COLUMNS = """
SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
       pg_get_expr(d.adbin, d.adrelid), a.attgenerated
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p')
ORDER BY c.relname, a.attnum
"""
POSTGRES_CONSTRAINTS = """
SELECT c.relname, k.conname, pg_get_constraintdef(k.oid)
FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = current_schema()
ORDER BY c.relname, k.contype, k.conname
"""
POSTGRES_INDEXES = """
SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema()
AND indexname NOT IN (SELECT conname FROM pg_constraint) ORDER BY tablename, indexname
"""
POSTGRES_TRIGGERS = """
SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid)
FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = current_schema() AND NOT t.tgisinternal ORDER BY c.relname, t.tgname
"""
POSTGRES_FUNCTIONS = """
SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_function_result(p.oid)
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = current_schema() ORDER BY p.proname, 2
"""
POSTGRES_DOMAINS = """
SELECT t.typname, format_type(t.typbasetype, t.typtypmod), pg_get_constraintdef(k.oid)
FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace LEFT JOIN pg_constraint k ON k.contypid = t.oid
WHERE n.nspname = current_schema() AND t.typtype = 'd' ORDER BY t.typname, 3
"""


def postgres_schema() -> str:
    import psycopg

    url = fresh_database_url("schema")
    actae.connect_sync(actae.Location(ROOT, url)).close()          # migrated
    with psycopg.connect(url) as conn:
        steps = conn.execute("SELECT MAX(version) FROM actae_migrations").fetchone()[0]
        columns, constraints, indexes, triggers = ({} for _ in range(4))
        for table, name, kind, not_null, default, generated in conn.execute(POSTGRES_COLUMNS):
            text = f"{name} {kind}"
            if generated:
                text += f" GENERATED ALWAYS AS ({default}) STORED"
            elif default is not None:
                text += f" DEFAULT {default}"
            columns.setdefault(table, []).append(text + (" NOT NULL" if not_null else ""))
        for table, name, definition in conn.execute(POSTGRES_CONSTRAINTS):
            constraints.setdefault(table, []).append(f"CONSTRAINT {name} {definition}")
        for table, _, definition in conn.execute(POSTGRES_INDEXES):
            indexes.setdefault(table, []).append(definition.replace(" public.", " "))
        for table, _, definition in conn.execute(POSTGRES_TRIGGERS):
            triggers.setdefault(table, []).append(definition.replace(" public.", " "))
        functions = [f"{name}({arguments}) RETURNS {result}" for name, arguments, result in conn.execute(POSTGRES_FUNCTIONS)]
        domains = [f"{name} {base}" + (f" {check}" if check else "") for name, base, check in conn.execute(POSTGRES_DOMAINS)]
    lines = [f"Migration version {steps}.", ""]
    for table in sorted(columns):
        body = ",\n".join(f"    {part}" for part in columns[table] + constraints.get(table, []))
        lines += [f"### {table}", "", "```sql", f"CREATE TABLE {table} (\n{body}\n);"]
        lines += [f"{statement};" for statement in indexes.get(table, []) + triggers.get(table, [])]
        lines += ["```", ""]
    if domains:
        lines += ["### Domains", "", "```sql", *(f"CREATE DOMAIN {domain};" for domain in domains), "```", ""]
    if functions:
        lines += ["### Functions", "", "```sql", *(f"FUNCTION {function};" for function in functions), "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def sections(text: str) -> dict:
    """{backend: its section's text} of docs/schema.md."""
    found = {}
    for backend, heading in HEADINGS.items():
        match = re.search(rf"^{re.escape(heading)}\n\n(.*?)(?=^## |\Z)", text, re.S | re.M)
        if match:
            found[backend] = match.group(1).rstrip() + "\n"
    return found


def written(found: dict) -> str:
    parts = [PREAMBLE]
    for backend, heading in HEADINGS.items():
        parts.append(f"{heading}\n\n{found.get(backend, '(not written yet: run this test on that backend)' + chr(10))}")
    return "\n".join(parts)


def test_docs_schema_md_is_the_migrated_schema_of_this_backend(tmp_path):
    current = sqlite_schema(tmp_path) if BACKEND == "sqlite" else postgres_schema()
    found = sections(DOC.read_text(encoding="utf-8")) if DOC.exists() else {}
    if os.environ.get("ACTAE_WRITE_SCHEMA"):
        found[BACKEND] = current
        DOC.write_text(written(found), encoding="utf-8")
    assert found.get(BACKEND) == current, (
        f"docs/schema.md's {HEADINGS[BACKEND][3:]} section is not the schema the migrations make: write it anew with "
        f"ACTAE_WRITE_SCHEMA=1 python -m pytest tests/test_schema_doc.py (on {BACKEND})")


def test_the_sqlite_schema_is_read_from_the_database_not_the_migrations(tmp_path):
    """What the section shows is what a database has: a column added by a later ALTER is inside its
    table's CREATE (SQLite rewrites the stored text), never a separate step."""
    text = sqlite_schema(tmp_path)
    assert "ALTER TABLE" not in text
    channels = re.search(r"### channels\n\n```sql\n(.*?)```", text, re.S).group(1)
    for column in ("closed_at", "run_state", "chain_base"):
        assert column in channels
