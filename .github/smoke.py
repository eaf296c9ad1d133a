"""Smoke-test a release archive the way a user meets it: check, unpack, run, drive the walkthrough.

    python .github/smoke.py dist/actae-VERSION-PLATFORM.tar.gz     (or .zip on Windows)

Checks the archive against the SHA256SUMS beside it, unpacks it into a fresh folder (it must hold
exactly `actae`, or `actae.exe`), runs `actae --version` (it must print the VERSION in the archive's
name), starts `actae --port 0 --data-dir <fresh dir>`, reads the printed URL and key, and runs the
fork walkthrough (examples/fork_demo.py, plain and with --resume) against it with the SDK installed
beside this Python. Then it stops the server with Ctrl-C. The release workflow runs this on every
platform before it uploads anything; tests/test_release.py runs it here.

Exits 0 when everything holds; otherwise prints what failed, with the server's output, and exits 1.
Needs only the standard library (and actae-client for the walkthrough).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "fork_demo.py"
ARCHIVE_NAME = re.compile(r"^actae-(?P<version>.+)-(?P<platform>(linux|macos|windows)-(x86_64|arm64))\.(tar\.gz|zip)$")
URL_LINE = re.compile(r"^Dashboard:\s+(http://\S+)")
KEY_LINE = re.compile(r"^API key:\s+(sk-\S+)")
START_TIMEOUT = 90      # the first start of a onefile build unpacks ~30 MB; slow runners take a while
DEMO_TIMEOUT = 300


class Failed(Exception):
    """A check did not hold; the message says which."""


def check_sum(archive: Path) -> None:
    """The archive's SHA-256 is the one its line in SHA256SUMS (same folder) names."""
    sums = archive.parent / "SHA256SUMS"
    if not sums.is_file():
        raise Failed(f"no {sums}")
    wanted = [line.split()[0] for line in sums.read_text(encoding="utf-8").splitlines()
              if len(line.split()) == 2 and line.split()[1].lstrip("*") == archive.name]
    if len(wanted) != 1:
        raise Failed(f"{sums} has {len(wanted)} lines for {archive.name}, not 1")
    actual = hashlib.sha256(archive.read_bytes()).hexdigest()
    if actual != wanted[0].lower():
        raise Failed(f"{archive.name}: sha256 {actual}, SHA256SUMS says {wanted[0]}")
    print(f"ok: {archive.name} matches SHA256SUMS ({actual})")


def unpack(archive: Path, into: Path) -> Path:
    """Extract `archive` into the empty folder `into`; return the executable, the one file in it."""
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            z.extractall(into)
    else:
        with tarfile.open(archive) as t:
            t.extractall(into, filter="data" if hasattr(tarfile, "data_filter") else None)
    names = sorted(p.name for p in into.iterdir())
    exe = "actae.exe" if archive.name.endswith(".zip") else "actae"
    if names != [exe]:
        raise Failed(f"{archive.name} holds {names}, not just {exe}")
    path = into / exe
    if os.name != "nt" and not os.access(path, os.X_OK):
        raise Failed(f"{exe} from {archive.name} is not executable")
    print(f"ok: {archive.name} holds one file, {exe}")
    return path


def check_version(exe: Path, version: str) -> None:
    res = subprocess.run([str(exe), "--version"], capture_output=True, text=True, errors="replace", timeout=60)
    out = (res.stdout + res.stderr).strip()
    if res.returncode != 0 or out != f"actae {version}":
        raise Failed(f"`{exe.name} --version` exited {res.returncode} printing {out!r}, not 'actae {version}'")
    print(f"ok: {exe.name} --version prints {out!r}")


class Server:
    """`exe --port 0 --data-dir DIR` running, with its printed URL and key and all its output."""

    def __init__(self, exe: Path, data_dir: Path):
        env = {k: v for k, v in os.environ.items() if k not in ("ACTAE_API_KEY", "ACTAE_DATA_DIR", "ACTAE_DATABASE_URL")}
        self.lines: list[str] = []
        self.url = self.key = None
        self._header = threading.Event()
        self.proc = subprocess.Popen(
            [str(exe), "--port", "0", "--data-dir", str(data_dir)], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, encoding="utf-8", errors="replace", env=env,
            # a group of its own, so Ctrl-Break reaches the server and not this script (Windows)
            creationflags=subprocess.CREATE_NEW_PROCESS_GROUP if os.name == "nt" else 0)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\r\n")
            self.lines.append(line)
            if m := URL_LINE.match(line):
                self.url = m.group(1).rstrip("/")
            elif m := KEY_LINE.match(line):
                self.key = m.group(1)
            if self.url and self.key:
                self._header.set()
        self._header.set()

    def output(self) -> str:
        return "\n".join(self.lines[-60:])

    def wait_ready(self) -> None:
        started = time.monotonic()
        if not self._header.wait(START_TIMEOUT) or not (self.url and self.key):
            raise Failed("the server printed no dashboard URL and API key")
        while True:
            if self.proc.poll() is not None:
                raise Failed(f"the server exited {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - started > START_TIMEOUT:
                raise Failed(f"{self.url}/healthz never answered 200")
            time.sleep(0.1)
        print(f"ok: serving at {self.url} after {time.monotonic() - started:.1f} s")

    def stop(self) -> int:
        """Ctrl-C (Ctrl-Break on Windows); after 15 s a kill. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.CTRL_BREAK_EVENT if os.name == "nt" else signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def walkthrough(server: Server, *args: str) -> None:
    """examples/fork_demo.py against `server`; it exits 0 only when every check it prints passes."""
    env = {**os.environ, "ACTAE_URL": server.url, "ACTAE_API_KEY": server.key, "PYTHONUTF8": "1"}
    res = subprocess.run([sys.executable, str(DEMO), *args], env=env, capture_output=True, text=True,
                         encoding="utf-8", errors="replace", timeout=DEMO_TIMEOUT)
    print(res.stdout, end="")
    if res.returncode != 0 or "FAIL" in res.stdout or "PASS" not in res.stdout:
        raise Failed(f"fork_demo.py {' '.join(args)} exited {res.returncode}\n{res.stderr[-3000:]}")
    print(f"ok: the fork walkthrough{' ' + ' '.join(args) if args else ''} passes")


def smoke(archive: Path) -> None:
    m = ARCHIVE_NAME.match(archive.name)
    if not m:
        raise Failed(f"{archive.name} is not named actae-VERSION-PLATFORM.tar.gz (or .zip)")
    if not archive.is_file():
        raise Failed(f"no {archive}")
    check_sum(archive)
    # ignore_cleanup_errors: on Windows a server that had to be killed may hold its folder a while
    with tempfile.TemporaryDirectory(prefix="actae-smoke-", ignore_cleanup_errors=True) as tmp:
        exe = unpack(archive, Path(tmp) / "unpacked")
        check_version(exe, m["version"])
        server = Server(exe, Path(tmp) / "data")
        try:
            server.wait_ready()
            walkthrough(server)
            walkthrough(server, "--resume")
        except Failed as exc:
            server.stop()
            raise Failed(f"{exc}\n--- server output\n{server.output()}") from None
        code = server.stop()
        # On Windows, Ctrl-Break may end the onefile bootloader before the server: no exit code to check
        if os.name != "nt" and (code != 0 or any("Traceback" in line for line in server.lines)):
            raise Failed(f"the server exited {code} after Ctrl-C\n--- server output\n{server.output()}")
        print("ok: stopped cleanly")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("archive", type=Path, help="dist/actae-VERSION-PLATFORM.tar.gz or .zip")
    args = p.parse_args(argv)
    try:
        smoke(args.archive)
    except Failed as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"smoke test passed: {args.archive.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
