"""The one-file executable: build `dist/actae` with PyInstaller from build.spec, then
run it exactly as users would and check it behaves like `python actae.py`.

Slow (a full PyInstaller build; docs/install.md gives a measured time) but it runs in CI by
default; it is skipped only when PyInstaller is not importable. Build time, file size and startup
time are printed (even without `-s`) and recorded as test-suite properties for junit-xml; they are
figures, never timed assertions.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

from conftest import BACKEND, ROOT, ServerProcess, cli, database_url_for, http, run, run_example

pytest.importorskip("PyInstaller", reason="PyInstaller is not installed (pip install -r requirements-dev.txt)")

pytestmark = pytest.mark.slow

EXE_NAME = "actae.exe" if os.name == "nt" else "actae"
FLAGS = ("--host", "--port", "--data-dir", "--version")
BUILD_TIMEOUT = 900


def say(config, message: str) -> None:
    """Print a line to the real terminal even while pytest captures output (no `-s` needed)."""
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is None:
        print(message, flush=True)
        return
    with capman.global_and_fixture_disabled():
        print(message, flush=True)


def private_tmp_env(tmp: Path) -> dict:
    """Point the onefile bootloader's unpack directory (_MEIxxxxxx) at `tmp` so we can check it is
    cleaned up; TMPDIR is read on POSIX, TEMP/TMP on Windows."""
    tmp.mkdir(parents=True, exist_ok=True)
    return {"TMPDIR": str(tmp), "TEMP": str(tmp), "TMP": str(tmp)}


@pytest.fixture(scope="module")
def build(request, tmp_path_factory, record_testsuite_property):
    """Build the executable from the repo into a temp dist/work path; returns a dict of figures."""
    out = tmp_path_factory.mktemp("pyinstaller")
    dist, work = out / "dist", out / "build"
    cmd = [
        sys.executable, "-m", "PyInstaller", "--noconfirm", "--clean",
        "--distpath", str(dist), "--workpath", str(work), str(ROOT / "build.spec"),
    ]
    say(request.config, f"\n[executable] building: {' '.join(cmd[1:])}")
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=str(ROOT), capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    seconds = time.monotonic() - started
    log = proc.stdout + proc.stderr
    (out / "build.log").write_text(log)
    exe = dist / EXE_NAME
    if proc.returncode != 0 or not exe.is_file():
        pytest.fail(f"PyInstaller failed (exit {proc.returncode}); last lines:\n" + "\n".join(log.splitlines()[-40:]))
    size = exe.stat().st_size
    say(request.config, f"[executable] build time: {seconds:.1f} s")
    say(request.config, f"[executable] binary size: {size / 1e6:.1f} MB ({size} bytes) -> {exe}")
    record_testsuite_property("executable_build_seconds", round(seconds, 1))
    record_testsuite_property("executable_bytes", size)
    yield {"exe": exe, "dist": dist, "seconds": seconds, "size": size}
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="module")
def exe(build) -> Path:
    return build["exe"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """One data dir shared by the first and the second start."""
    return tmp_path_factory.mktemp("actae-exe-data")


@pytest.fixture(scope="module")
def meipass_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("actae-exe-tmp")


@pytest.fixture(scope="module")
def served(request, exe, data_dir, meipass_tmp, record_testsuite_property):
    """The executable running on a fresh data dir (first start: prints a new key)."""
    with ServerProcess(data_dir, command=[str(exe)], env=private_tmp_env(meipass_tmp)).start(timeout=90) as srv:
        say(request.config,
            f"\n[executable] startup to healthy /healthz (first run, fresh data dir): {srv.startup_seconds:.2f} s")
        record_testsuite_property("executable_startup_seconds", round(srv.startup_seconds, 2))
        yield srv


def run_exe(exe: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))


def option_help(help_text: str, flag: str) -> str | None:
    """The explanation argparse prints for `flag` (same line or wrapped onto the next lines)."""
    lines = help_text.splitlines()
    for i, line in enumerate(lines):
        spec = line.strip()
        if not spec.startswith("-") or not re.search(rf"(^|[\s,]){re.escape(flag)}(?![\w-])", spec):
            continue
        parts = re.split(r"\s{2,}", spec, maxsplit=1)
        text = parts[1] if len(parts) == 2 else ""
        for more in lines[i + 1:]:  # wrapped continuation lines are deeply indented, not options
            if not more.strip() or more.strip().startswith("-") or len(more) - len(more.lstrip()) < 4:
                break
            text += " " + more.strip()
        return text.strip()
    return None


# --------------------------------------------------------------------------- the build


def bundle_contents(exe: Path) -> tuple[set[str], set[str]]:
    """(files in the executable's archive, modules in its frozen PYZ)."""
    from PyInstaller.archive.readers import CArchiveReader

    archive = CArchiveReader(str(exe))
    files = {name.replace("\\", "/") for name in archive.toc}
    pyz = next(name for name in archive.toc if name.lower().endswith(".pyz"))
    modules = set(archive.open_embedded_archive(pyz).toc)
    return files, modules


def test_build_produces_one_file(build):
    assert sorted(p.name for p in build["dist"].iterdir()) == [EXE_NAME], "onefile build: dist/ holds one file"
    assert os.access(build["exe"], os.X_OK)


def test_bundle_has_ui_and_the_runtime_modules(exe):
    files, modules = bundle_contents(exe)
    ui_files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "ui").rglob("*") if p.is_file()}
    assert ui_files, "ui/ is empty in the repo"
    assert ui_files <= files, f"ui files not bundled: {sorted(ui_files - files)}"
    assert "actae" in files, "the entry script actae.py is not in the archive"
    # uvicorn picks these by name at run time, so they only get in as hidden imports; each one is
    # required when it imports here (optional ones such as wsproto or uvloop may not be installed)
    candidates = (
        "uvicorn.protocols.http.h11_impl",
        "uvicorn.protocols.http.httptools_impl",
        "uvicorn.protocols.websockets.websockets_impl",
        "uvicorn.protocols.websockets.websockets_sansio_impl",
        "uvicorn.protocols.websockets.wsproto_impl",
        "uvicorn.lifespan.on",
        "uvicorn.loops.auto",
        "uvicorn.loops.asyncio",
        "uvicorn.loops.uvloop",
        "httptools",
        "uvloop",
        "websockets",
        "wsproto",
        "aiosqlite",
        "jinja2",
        "psycopg",
        "psycopg_binary",
        "psycopg_pool",
        "starlette.applications",
        "starlette.staticfiles",
        "prometheus_client",
        "opentelemetry.sdk.trace",
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        "opentelemetry.exporter.http.transport._requests",
    )
    wanted = {name for name in candidates if importlib.util.find_spec(name) is not None}
    assert {"uvicorn.protocols.http.h11_impl", "uvicorn.lifespan.on", "aiosqlite", "jinja2",
            "psycopg", "psycopg_binary", "psycopg_pool", "prometheus_client",
            "opentelemetry.exporter.otlp.proto.http.trace_exporter"} <= wanted
    assert not (wanted - modules), f"missing from the bundle: {sorted(wanted - modules)}"


def test_bundle_leaves_out_tests_and_dev_tools(exe):
    """Nothing from the test tree or dev-only tools is frozen in (CI has them all installed)."""
    _, modules = bundle_contents(exe)
    for top in ("tests", "conftest", "pytest", "_pytest", "playwright", "actae_client", "PyInstaller",
                "tkinter", "numpy"):
        found = sorted(m for m in modules if m == top or m.startswith(top + "."))
        assert not found, f"{top} was bundled: {found[:5]}"


# --------------------------------------------------------------------------- the command line


def test_version_prints_a_version(exe):
    res = run_exe(exe, "--version")
    assert res.returncode == 0, res.stderr
    out = (res.stdout + res.stderr).strip()
    assert re.search(r"\d+\.\d+", out), f"no version number in {out!r}"
    script = cli("--version", check=False)
    assert out == (script.stdout + script.stderr).strip(), "--version differs from `python actae.py --version`"


def test_help_explains_every_flag(exe):
    res = run_exe(exe, "--help")
    assert res.returncode == 0, res.stderr
    for flag in FLAGS:
        text = option_help(res.stdout, flag)
        assert text is not None, f"{flag} missing from --help:\n{res.stdout}"
        assert len(re.findall(r"[A-Za-z]{2,}", text)) >= 2, f"{flag} has no explanation in --help:\n{res.stdout}"


def test_help_matches_the_script(exe):
    """Same CLI as `python actae.py` (only the program name may differ: actae vs actae.py)."""
    frozen = run_exe(exe, "--help").stdout
    script = cli("--help", check=False).stdout

    def norm(text):
        return re.sub(r"\bactae(\.py|\.exe)?\b", "actae", text)

    assert norm(frozen) == norm(script)


# --------------------------------------------------------------------------- the running server


def test_first_start_prints_dashboard_and_key(served):
    assert served.url and re.fullmatch(r"http://127\.0\.0\.1:\d+", served.url), served.lines[:5]
    assert served.key and served.key.startswith("sk-"), served.lines[:5]
    key_line = next(line for line in served.lines if line.startswith("API key:"))
    assert "shown once" in key_line


def test_dashboard_login_page_and_static_files(served):
    status, headers, body = http("GET", served.url + "/login")
    assert status == 200, body
    assert "text/html" in headers.get("content-type", "")
    # the page's own stylesheet/script come out of the bundled ui/static
    assets = re.findall(r'(?:href|src)="(/[^"]+\.(?:css|js))"', body)
    assert assets, "login page references no CSS/JS"
    for asset in assets:
        status, _, _ = http("GET", urllib.parse.urljoin(served.url + "/", asset))
        assert status == 200, f"{asset} -> {status}"


def test_websocket_handshake_with_the_sdk(served):
    from actae_client import ActaeClient

    async def go():
        async with ActaeClient(endpoint=served.url, api_key=served.key) as client:
            # publish travels over the WebSocket only (the ack carries the persisted event)
            event = await client.publish("exe-ws-check", {"via": "websocket"})
            assert event.cursor >= 1
            events = await client.replay("exe-ws-check")
            assert [e.payload for e in events] == [{"via": "websocket"}]

    run(go())


def test_fork_walkthrough(served):
    """The six-step walkthrough against the executable, on the backend this pass of the suite runs
    (SQLite, or PostgreSQL when ACTAE_TEST_DATABASE_URL is set: the bundled psycopg is used then)."""
    status, _, instance = http("GET", served.url + "/api/v1/instance", key=served.key)
    assert status == 200 and instance["backend"] == BACKEND, instance
    demo = ROOT / "examples" / "fork_demo.py"
    assert demo.is_file(), "examples/fork_demo.py is missing"
    res = run_example(served, demo.name)
    assert res.returncode == 0, f"fork_demo.py exited {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"


def test_second_start_keeps_data_and_prints_no_key(request, served, exe, data_dir, meipass_tmp,
                                                    record_testsuite_property):
    from actae_client import ActaeClient

    async def channels(srv, key):
        async with ActaeClient(endpoint=srv.url, api_key=key) as client:
            return set(await client.list_channels())

    before = run(channels(served, served.key))
    assert before, "no channels to carry over (the WebSocket check and the fork demo create some)"
    code = served.stop()  # Ctrl-C; stop() falls back to SIGKILL (-9) only when it hangs
    assert code != -9, "did not stop on Ctrl-C (SIGINT) within 15 s"
    leftovers = list(meipass_tmp.glob("_MEI*"))
    assert not leftovers, f"onefile unpack dir not cleaned up after Ctrl-C: {leftovers}"

    with ServerProcess(data_dir, command=[str(exe)], env=private_tmp_env(meipass_tmp)).start(timeout=90) as again:
        say(request.config, f"\n[executable] startup to healthy /healthz (second run, existing data): {again.startup_seconds:.2f} s")
        record_testsuite_property("executable_restart_seconds", round(again.startup_seconds, 2))
        assert again.key is None
        assert not any("sk-" in line for line in again.lines), "\n".join(again.lines)
        after = run(channels(again, served.key))  # the first key still works
        assert before <= after, f"lost channels: {before - after}"


def test_ctrl_c_exits_cleanly(served):
    """Ctrl-C is the documented way to stop it: exit 0, no traceback (as `python actae.py` should)."""
    code = served.stop()
    output = "\n".join(served.lines)
    assert "Traceback" not in output and code == 0, f"exit {code} after Ctrl-C:\n{output}"


def test_key_rotate(exe, served, data_dir, meipass_tmp):
    """`actae key rotate` on the executable issues a new key; the old one stops working."""
    served.stop()
    database = database_url_for(data_dir)
    res = run_exe(exe, "key", "rotate", "--data-dir", str(data_dir), *(["--database", database] if database else []))
    assert res.returncode == 0, res.stdout + res.stderr
    match = re.search(r"^API key:\s+(sk-\S+)", res.stdout, re.M)
    assert match, res.stdout
    new_key = match.group(1)
    assert new_key != served.key

    with ServerProcess(data_dir, command=[str(exe)], env=private_tmp_env(meipass_tmp)).start(timeout=90) as srv:
        assert srv.key is None
        assert http("GET", srv.url + "/api/v1/channels", key=new_key)[0] == 200
        assert http("GET", srv.url + "/api/v1/channels", key=served.key)[0] == 401
