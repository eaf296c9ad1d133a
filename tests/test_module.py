"""The module's shape: one home per SQL statement, and a docstring map that matches its sections.

Both read actae.py as text (its AST and its banners); neither starts a server.
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict

from conftest import ROOT

SOURCE = (ROOT / "actae.py").read_text(encoding="utf-8")
SQL_START = re.compile(r"\s*(SELECT|INSERT|UPDATE|DELETE|WITH|CREATE|ALTER|DROP|PRAGMA|BEGIN|COMMIT|ROLLBACK|SAVEPOINT"
                       r"|RELEASE|LISTEN|NOTIFY|VACUUM|SET|SHOW)\b")
TRANSACTION_WORDS = {"BEGIN", "COMMIT", "ROLLBACK"}      # statements of one word


def rendered(node: ast.AST) -> str:
    """A string literal's text; an f-string's with `{}` where its expressions go."""
    if isinstance(node, ast.Constant):
        return node.value
    return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)


def sql_statements(source: str) -> dict:
    """{statement text with white space folded: [line, ...]} for every SQL string in the module."""
    tree = ast.parse(source)
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
    found = sql_statements(sample)
    assert found["SELECT * FROM t WHERE id = ?"] == [1, 3]
    assert found["SELECT * FROM t{} LIMIT 1"] == [2]
    assert found["UPDATE t SET x = ? WHERE id = ?"] == [4]
    assert "DELETE" not in found
    assert len(sql_statements(SOURCE)) > 150          # the module's own: it does find them


def test_no_sql_statement_text_appears_twice():
    repeated = {text: lines for text, lines in sql_statements(SOURCE).items() if len(lines) > 1}
    assert not repeated, "\n".join(f"lines {lines}: {text[:160]}" for text, lines in sorted(repeated.items()))


BANNER = re.compile(r"^# =+\n# (.+)\n# =+$", re.M)


def banners(source: str) -> list:
    return BANNER.findall(source)


def banner_titles(source: str) -> list:
    """Each section's banner title up to any colon or parenthesis, in file order."""
    return [re.split(r"[:(]", title, maxsplit=1)[0].strip() for title in banners(source)]


def map_lines(source: str) -> list:
    doc = ast.get_docstring(ast.parse(source))
    return [line for line in doc.split("The map:", 1)[1].splitlines()[3:] if line.strip()]


def test_the_docstring_map_lists_every_section_in_file_order():
    titles, lines = banner_titles(SOURCE), map_lines(SOURCE)
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
    principals = next(i for t, i in at.items() if t.startswith("Domain: principals, API keys"))
    assert titles[principals + 1] == "Authentication"
    assert titles[next(i for t, i in at.items() if t.startswith("Domain: scheduled wake-ups")) + 1] == "Scheduler"
    assert any(t.startswith("Dashboard: page handlers") for t in full)
    # the dashboard's query records are request records like the others
    request_section = SOURCE.split("# Request records", 1)[1].split("# Response records", 1)[0]
    assert "class RunPageQuery(" in request_section and "class RunsPageQuery(" in request_section
