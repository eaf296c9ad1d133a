"""The README and docs/ stay true to the repository and to the program they describe.

- every relative link in README.md and docs/*.md names a file that exists, and a `#anchor` names a
  heading of that file (GitHub's slugs: lower case, punctuation dropped, spaces to hyphens, a
  repeated heading gets -1, -2, ...);
- every `actae ...` / `./actae ...` / `python actae.py ...` command shown in a code block (or in
  inline code) names subcommands and flags that the real `--help` lists: the help of the program
  and of each subcommand is read from `python actae.py [SUB ...] --help`, run as a subprocess;
- README.md is a front page: at most 160 lines, with the two command lines CI and users rely on,
  and the SDK's pip line before the walkthrough that imports it;
- each docs page starts with a title and a summary paragraph, and docs/README.md lists every page.

The checks are plain functions over text (`broken_links`, `bad_commands`), so a test can feed
them a broken page too and see them fail.
"""
from __future__ import annotations

import functools
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

import pytest

from conftest import ROOT, cli

README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
SERVE = "pip install -r requirements.txt && python actae.py"
TEST = "pip install -r requirements-dev.txt && python -m pytest"
SDK = "pip install actae-client==1.3.0"

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)")
SHELL_LANGS = {"", "sh", "bash", "shell", "console", "text"}
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
PROGRAM = re.compile(r"(?:\.?/)?(?:dist/)?actae(?:\.exe)?")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
REDIRECT = re.compile(r"^\d*[<>]")


# --------------------------------------------------------------------------------------------
# Reading Markdown: code blocks apart from prose, headings, links
# --------------------------------------------------------------------------------------------


@dataclass
class Page:
    prose: list[str] = field(default_factory=list)                 # lines outside fenced blocks
    blocks: list[tuple[str, list[str]]] = field(default_factory=list)  # (language, lines)


def split_page(text: str) -> Page:
    page, fence, lang, lines = Page(), None, "", []
    for line in text.splitlines():
        opened = FENCE.match(line)
        if fence is None:
            if opened:
                fence, lang, lines = opened.group(1), opened.group(2).lower(), []
            else:
                page.prose.append(line)
        elif line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
            page.blocks.append((lang, lines))
            fence = None
        else:
            lines.append(line)
    assert fence is None, "a fenced code block is never closed"
    return page


def without_inline_code(line: str) -> str:
    return INLINE_CODE.sub("", line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (github-slugger): rendered text, lower case, every
    character that is not a letter, digit, `_`, `-` or space dropped, spaces to hyphens."""
    text = INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)       # a link's text
    text = re.sub(r"<[^>]+>", "", text)                           # inline HTML
    text = re.sub(r"(\*\*|__|\*|(?<!\w)_|_(?!\w))", "", text)       # emphasis markers
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in split_page(text).prose:
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(text: str) -> list[str]:
    found = []
    for line in split_page(text).prose:
        line = without_inline_code(line)
        found += [m.group(1) for m in LINK.finditer(line)]
        ref = REFERENCE.match(line)
        if ref:
            found.append(ref.group(1))
    return found


def broken_links(path: Path, text: str) -> list[str]:
    """Every relative link of the page at `path` (whose text is `text`) that does not resolve."""
    problems = []
    for target in links(text):
        if SCHEME.match(target) or target.startswith("//"):
            continue                                   # http(s), mailto: not ours to check here
        file_part, _, anchor = target.partition("#")
        where = path if not file_part else (path.parent / unquote(file_part)).resolve()
        if not file_part and not anchor:
            problems.append(f"{path.name}: empty link {target!r}")
            continue
        if ROOT not in where.parents and where != ROOT:
            problems.append(f"{path.name}: {target!r} leaves the repository")
        elif not where.exists():
            problems.append(f"{path.name}: {target!r}: no such file {where.relative_to(ROOT)}")
        elif anchor:
            if where.suffix.lower() != ".md":
                problems.append(f"{path.name}: {target!r}: an anchor into a file that is not Markdown")
                continue
            heads = anchors(text if where == path else where.read_text(encoding="utf-8"))
            if unquote(anchor).lower() not in heads:
                problems.append(f"{path.name}: {target!r}: {where.name} has no heading #{anchor}"
                                f" (it has: {', '.join(sorted(heads))})")
    return problems


# --------------------------------------------------------------------------------------------
# The program's real command line, from its --help
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Help:
    flags: dict          # --name -> takes a value
    subcommands: frozenset


@functools.lru_cache(maxsize=None)
def real_help(path: tuple) -> Help:
    """`python actae.py *path --help`, parsed: its option lines (two spaces, then `-`) and the
    `{a,b,c}` of its positional arguments."""
    text = cli(*path, "--help").stdout
    flags, subcommands, section = {}, frozenset(), ""
    for line in text.splitlines():
        if line and not line.startswith(" "):
            section = line
            continue
        if section.startswith("positional") and (m := re.match(r"^  \{([\w,-]+)\}", line)):
            subcommands = frozenset(m.group(1).split(","))
        if re.match(r"^  -", line):
            declared = re.split(r"\s{2,}", line.strip())[0]
            for option in declared.split(", "):
                words = option.split()
                flags[words[0]] = len(words) > 1
    assert "--help" in flags, f"no options read from the help of {path}:\n{text}"
    return Help(flags, subcommands)


def command_lines(text: str) -> list[str]:
    """The text of every code block's line (continuations joined) and every inline code span."""
    page = split_page(text)
    found = []
    for line in page.prose:
        found += [m.group(2) for m in INLINE_CODE.finditer(line)]
    for lang, lines in page.blocks:
        joined = "\n".join(lines).replace("\\\n", " ")
        for line in joined.splitlines():
            found += [m.group(2) for m in INLINE_CODE.finditer(line)]   # `actae ...` in a comment
            if lang in SHELL_LANGS:
                found.append(line)
    return found


def invocations(line: str) -> list[list[str]]:
    """The argument lists of every run of the program in one shell line (after `&&`, `;`, `|`)."""
    line = line.replace("\\|", "/").replace("\\", "/")      # a table's escaped |, Windows paths
    runs = []
    for segment in re.split(r"&&|\|\||;|\|", line):
        try:
            words = shlex.split(segment, comments=True)
        except ValueError:
            words = segment.split("#", 1)[0].split()
        while words and ENV_ASSIGNMENT.match(words[0]):
            words = words[1:]
        if not words:
            continue
        if words[0] in ("python", "python3") and len(words) > 1 and Path(words[1]).name == "actae.py":
            runs.append(words[2:])
        elif PROGRAM.fullmatch(words[0]):
            runs.append(words[1:])
    return runs


def bad_arguments(words: list[str]) -> list[str]:
    """What in one run's arguments the real command line does not have ([] when all is known)."""
    path: tuple = ()
    spec = real_help(path)
    descended = False
    words = iter(words)
    for raw in words:
        if REDIRECT.match(raw):
            break                                   # > run.jsonl, 2>&1: the rest is the shell's
        word = raw.lstrip("[").rstrip("]…")             # [--read P]…: an optional, repeatable flag
        if not word.strip(".…"):
            continue                                # `...`: the rest of a command, elided
        if word.startswith("-") and len(word) > 1:
            name, eq, _ = word.partition("=")
            if name not in spec.flags:
                return [f"{' '.join(('actae',) + path)} has no option {name}"]
            if spec.flags[name] and not eq:
                next(words, None)                   # its value
        elif spec.subcommands and not descended:
            if word not in spec.subcommands:
                return [f"{' '.join(('actae',) + path)} has no command {word!r}"
                        f" (it has {', '.join(sorted(spec.subcommands))})"]
            path += (word,)
            spec = real_help(path)
            descended = not spec.subcommands
        else:
            continue                                # a positional argument: CHANNEL, FILE, ID, URL
    return []


def bad_commands(name: str, text: str) -> tuple[list[str], int]:
    """Problems with the program's runs shown in a page, and how many runs were checked."""
    problems, checked = [], 0
    for line in command_lines(text):
        for words in invocations(line):
            checked += 1
            problems += [f"{name}: `{line.strip()}`: {p}" for p in bad_arguments(words)]
    return problems, checked


# --------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------


def test_the_pages_exist():
    assert README.exists() and (DOCS / "README.md").exists()
    assert len(PAGES) > 5, PAGES


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page, page.read_text(encoding="utf-8")) == []


def test_every_command_shown_exists_in_the_real_help():
    problems, checked = [], 0
    for page in PAGES:
        found, count = bad_commands(str(page.relative_to(ROOT)), page.read_text(encoding="utf-8"))
        problems += found
        checked += count
    assert problems == []
    assert checked >= 40, f"only {checked} commands found: the parser is missing them"


def test_the_command_line_page_lists_every_command_and_flag():
    """docs/cli.md's table keeps up with the program: every command and flag of the real --help."""
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    missing = []

    def walk(path: tuple):
        spec = real_help(path)
        if path and not re.search(r"actae(?:\.py)? " + re.escape(" ".join(path)) + r"(?![\w-])", text):
            missing.append(" ".join(path))
        missing.extend(f"{' '.join(path) or 'actae'} {flag}" for flag in spec.flags
                       if flag != "-h" and not re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", text))
        for sub in sorted(spec.subcommands):
            walk(path + (sub,))

    walk(())
    assert missing == [], f"docs/cli.md does not mention {missing}"


def test_the_checks_catch_a_broken_link_and_a_misspelled_flag():
    """The two checks above fail where they should (not only pass on good pages)."""
    page = DOCS / "cli.md"
    assert broken_links(page, "See [ops](operations.md#backups).") == []
    assert broken_links(page, "See [ops](operation.md).")                  # no such file
    assert broken_links(page, "See [ops](operations.md#backup).")          # no such heading
    assert broken_links(page, "[here](#commands-and-flags)\n\n## Commands and flags\n") == []
    assert bad_commands("x", "```\npython actae.py key create --name ci --read '*'\n```")[0] == []
    assert bad_commands("x", "```\npython actae.py key create --nmae ci\n```")[0]      # misspelled flag
    assert bad_commands("x", "```\n./actae prune --older-than 3 --dryrun\n```")[0]
    assert bad_commands("x", "run `actae key rotat` now")[0]                          # misspelled command
    assert bad_commands("x", "`actae --port 0 --data-dirr x`")[0]


def test_slugs_follow_github():
    assert slug("Team access: keys, scopes and accounts") == "team-access-keys-scopes-and-accounts"
    assert slug("Crash consistency (`examples/durability_benchmark.py`)") == (
        "crash-consistency-examplesdurability_benchmarkpy")
    assert slug("B5: many runs") == "b5-many-runs"
    assert anchors("## Notes\n\n## Notes\n") == {"notes", "notes-1"}


def test_the_readme_is_a_front_page():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines (at most 160)"
    assert any(line.strip() == SERVE for line in lines), "the command that starts the server"
    assert any(line.strip() == TEST for line in lines), "the command that runs every test"
    assert SDK in text and "fork_demo.py" in text
    assert text.index(SDK) < text.index("fork_demo.py"), "pip install the SDK before the demo that imports it"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_page_has_a_title_and_a_summary(page):
    lines = page.read_text(encoding="utf-8").splitlines()
    assert lines and re.match(r"^# \S", lines[0]), f"{page.name} must start with a title"
    rest = lines[1:]
    first = next(i for i, line in enumerate(rest) if line.strip())
    assert not rest[first].startswith(("#", "```", "|", "-", "    ")), (
        f"{page.name}: a summary paragraph after the title")
    assert "\u00a7" not in "\n".join(lines), f"{page.name} cites sections by number"
    for name in ("CONTRACT", "PRODUCT"):          # the specs written for the developers, not for users
        assert f"{name}.md" not in "\n".join(lines), f"{page.name} mentions {name}.md"


def test_the_docs_index_lists_every_page():
    index = DOCS / "README.md"
    targets = [t for t in links(index.read_text(encoding="utf-8")) if not SCHEME.match(t)]
    listed = {(index.parent / target.partition("#")[0]).resolve() for target in targets}
    missing = [p.name for p in PAGES if p.parent == DOCS and p != index and p.resolve() not in listed]
    assert missing == [], f"docs/README.md does not list {missing}"
