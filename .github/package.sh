#!/usr/bin/env bash
# Build the one-file executable from build.spec with VERSION stamped in, pack it as
# dist/actae-VERSION-PLATFORM.tar.gz (a .zip holding actae.exe on Windows) and append its line to
# dist/SHA256SUMS. The release workflow runs this on every platform and tests/test_release.py runs
# it here, so what is tested is what is shipped.
#
#   bash .github/package.sh VERSION PLATFORM
#
# PLATFORM is linux-x86_64, linux-arm64, macos-arm64, macos-x86_64 or windows-x86_64, and must be
# the machine's own (PyInstaller does not cross-compile). $PYTHON is the interpreter that builds
# (default: python, else python3; it needs requirements.txt and pyinstaller installed). $ACTAE_DIST
# is where the archive and SHA256SUMS go (default: dist; relative to the checkout). Prints the
# archive's path last. Runs under Git Bash on Windows.
#
# Two runs on the same checkout, machine and environment write byte-identical archives (see
# docs/install.md, "Reproducible builds"): every timestamp is $SOURCE_DATE_EPOCH (default: the
# commit's time, `git log -1 --format=%ct`), PyInstaller runs with a fixed PYTHONHASHSEED, and the
# archive is written with fixed mtime, owner, mode and gzip header.
set -euo pipefail

usage() {
  echo "usage: $0 VERSION PLATFORM   (PLATFORM: linux-x86_64 linux-arm64 macos-arm64 macos-x86_64 windows-x86_64)" >&2
  exit 2
}
[ $# -eq 2 ] || usage
version=$1
platform=$2

case "$platform" in
  linux-x86_64 | linux-arm64 | macos-arm64 | macos-x86_64) exe=actae archive=actae-$version-$platform.tar.gz ;;
  windows-x86_64) exe=actae.exe archive=actae-$version-$platform.zip ;;
  *) usage ;;
esac
# The version ends up in a file name and in `actae --version`: a tag such as v1.2.0 or v1.2.0-rc.1
# minus its v, never a path or anything with spaces.
# (The pattern sits in a variable: the way bash 3.2, macOS's own, reads it too.)
pattern='^[0-9]+(\.[0-9]+)*([-+.][0-9A-Za-z]+)*$'
if ! [[ $version =~ $pattern ]]; then
  echo "package.sh: bad VERSION '$version' (expected e.g. 1.2.0 or 1.2.0-rc.1)" >&2
  exit 2
fi

cd "$(dirname "$0")/.."
python=${PYTHON:-}
if [ -z "$python" ]; then
  if command -v python >/dev/null 2>&1; then python=python; else python=python3; fi
fi

# The platform of the interpreter that builds, named the way the archives are.
host=$("$python" -c '
import platform, sys
system = {"Linux": "linux", "Darwin": "macos", "Windows": "windows"}.get(platform.system(), platform.system())
machine = {"amd64": "x86_64", "x86_64": "x86_64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine().lower(), platform.machine())
sys.stdout.write(f"{system}-{machine}")')
if [ "$host" != "$platform" ]; then
  echo "package.sh: this machine builds $host, not $platform (PyInstaller does not cross-compile)" >&2
  exit 2
fi

# Reproducible builds. Every timestamp that ends up in the archive is SOURCE_DATE_EPOCH
# (https://reproducible-builds.org/specs/source-date-epoch/): the caller's, else the time of the
# commit being built, so any build of one commit stamps the same time whenever it runs.
if [ -z "${SOURCE_DATE_EPOCH:-}" ]; then
  SOURCE_DATE_EPOCH=$(git log -1 --format=%ct 2>/dev/null) || SOURCE_DATE_EPOCH=
  SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH//$'\r'/}    # should a git on Windows end its line with CRLF
  if [ -z "$SOURCE_DATE_EPOCH" ]; then
    echo "package.sh: not a git checkout; set SOURCE_DATE_EPOCH (seconds since 1970) to build" >&2
    exit 2
  fi
fi
digits='^[0-9]+$'
if ! [[ $SOURCE_DATE_EPOCH =~ $digits ]]; then
  echo "package.sh: bad SOURCE_DATE_EPOCH '$SOURCE_DATE_EPOCH' (expected seconds since 1970)" >&2
  exit 2
fi
export SOURCE_DATE_EPOCH
# PyInstaller's own advice for reproducible builds. With a random seed, two builds differed in
# base_library.zip: the same .pyc files, written in the order of a Python set (and a seed also
# orders the frozensets in marshalled code).
export PYTHONHASHSEED=0

dist=${ACTAE_DIST:-dist}
work=build/package-$platform    # build/ is git-ignored
rm -rf "$work"
mkdir -p "$work" "$dist"

echo "package.sh: building actae $version for $platform" >&2
# The work dir starts empty, so no --clean: that would also empty PyInstaller's per-user cache,
# which another build on the same machine may be reading.
ACTAE_VERSION=$version "$python" -m PyInstaller --noconfirm --log-level WARN \
  --distpath "$work/dist" --workpath "$work/build" build.spec
[ -f "$work/dist/$exe" ] || { echo "package.sh: PyInstaller wrote no $work/dist/$exe" >&2; exit 1; }

# The archive holds the one file at its top level, executable, so the first step for a user is
# `tar -xzf actae-VERSION-PLATFORM.tar.gz && ./actae`. Python writes both kinds the same way on
# every runner (Git Bash has no zip), with mode 755 and no build user's name in the tar. Nothing
# of the build machine or the moment goes in: the member's mtime (and the gzip header's) is
# SOURCE_DATE_EPOCH, owner 0:0 with no names, the gzip header carries no file name (`gzip -n`),
# and the zip entry's date is SOURCE_DATE_EPOCH in UTC.
"$python" - "$work/dist/$exe" "$dist/$archive" "$SOURCE_DATE_EPOCH" <<'PY'
import gzip, shutil, sys, tarfile, time, zipfile

exe, out, epoch = sys.argv[1], sys.argv[2], int(sys.argv[3])
name = exe.replace("\\", "/").rsplit("/", 1)[-1]
if out.endswith(".zip"):
    # a zip entry's date has no zone, counts in 2 s steps and starts in 1980
    stamp = time.gmtime(max(epoch, 315532800))[:6]
    info = zipfile.ZipInfo(name, date_time=stamp)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.create_system = 3                       # "Unix", so that the mode below is read
    info.external_attr = (0o100755 << 16)
    with zipfile.ZipFile(out, "w") as z, open(exe, "rb") as src, z.open(info, "w") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
else:
    with open(exe, "rb") as src:
        src.seek(0, 2)
        info = tarfile.TarInfo(name)
        info.size = src.tell()
        src.seek(0)
        info.mtime = epoch
        info.mode = 0o755
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        with open(out, "wb") as raw, \
                gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=epoch) as gz, \
                tarfile.open(fileobj=gz, mode="w", format=tarfile.USTAR_FORMAT) as t:
            t.addfile(info, src)
PY

# `HASH  NAME`, two spaces, LF: the line `sha256sum -c SHA256SUMS` (or `shasum -a 256 -c`) checks.
# A line for the same archive from an earlier run is replaced, not repeated.
hash=$("$python" -c '
import hashlib, sys
with open(sys.argv[1], "rb") as f:
    sys.stdout.write(hashlib.sha256(f.read()).hexdigest())' "$dist/$archive")
sums=$dist/SHA256SUMS
if [ -f "$sums" ]; then
  awk -v name="$archive" '$2 != name' "$sums" >"$sums.new"
  mv "$sums.new" "$sums"
fi
printf '%s  %s\n' "$hash" "$archive" >>"$sums"
rm -rf "$work"
rmdir build 2>/dev/null || true    # only if nothing else lives there
echo "$dist/$archive"
