#!/usr/bin/env python3
"""Build trainforge's images from the committed Dockerfiles, with this machine's pip configuration.

    python3 docker/build.py                       # airflow, trainer (CPU), mlflow
    python3 docker/build.py airflow mlflow        # some of them
    python3 docker/build.py --trainer-torch cuda  # the trainer with CUDA torch (the default for clusters)
    python3 docker/build.py --local-services      # also the stand-ins of docker/local/ (no registry)

Images: ``trainforge-airflow:VERSION``, ``trainforge-trainer:VERSION`` (CUDA) or
``trainforge-trainer:VERSION-cpu``, ``trainforge-mlflow:VERSION`` (VERSION from pyproject.toml);
``--local-services`` adds ``trainforge-local/postgres``, ``/redis`` and ``/s3``.

pip inside the builds sees what pip here sees: the index URLs, find-links and constraints of
this machine's pip configuration files and ``PIP_*`` variables, and its CA bundle. They are given
as build secrets (never written into a layer); local folders among them (``file://`` indexes,
find-links folders) are served read-only on a loopback port for the build's duration, which is
why builds run with ``--network host``. TLS verification stays on.

Needs a Docker engine with BuildKit: ``docker buildx``, or a Docker 20.10-22.x client (Debian's
docker.io), whose ``docker build`` has BuildKit built in. Only the standard library is used: this
runs before any virtual environment exists. Exit codes: 0 built, 1 a build failed or no usable Docker, 2 bad
usage.
"""

from __future__ import annotations

import argparse
import configparser
import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ("airflow", "trainer", "mlflow")
LOCAL_SERVICES = ("postgres", "redis", "s3")
TORCH_VERSION = "2.13.0"  # the Dockerfiles' TORCH_VERSION


def version() -> str:
    match = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    if not match:
        raise SystemExit("build.py: no version in pyproject.toml")
    return match.group(1)


def image_tag(name: str, trainer_torch: str = "cpu") -> str:
    if name in LOCAL_SERVICES:
        return f"trainforge-local/{name}:{version()}"
    suffix = "-cpu" if name == "trainer" and trainer_torch == "cpu" else ""
    return f"trainforge-{name}:{version()}{suffix}"


# --- Docker with BuildKit ----------------------------------------------------------------------

def _client_version(docker: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([docker, "version", "--format", "{{.Client.Version}}"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    nums = re.findall(r"\d+", out.split("+")[0])
    return tuple(int(n) for n in nums[:2]) if nums else None


def buildkit_command(explicit: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The build command prefix and its extra environment: ``docker buildx build --load``, or
    ``docker build`` of a client with BuildKit built in. Raises SystemExit(2) when neither."""
    candidates = [explicit] if explicit else [shutil.which("docker"), "/usr/bin/docker"]
    tried = []
    for docker in dict.fromkeys(c for c in candidates if c):
        if not Path(docker).exists() and not shutil.which(docker):
            continue
        probe = subprocess.run([docker, "buildx", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return [docker, "buildx", "build", "--load"], {}
        client = _client_version(docker)
        if client is not None and client < (23,):
            return [docker, "build"], {"DOCKER_BUILDKIT": "1"}
        tried.append(f"{docker} (client {'.'.join(map(str, client or ())) or '?'}, no buildx)")
    raise SystemExit("build.py: no Docker client with BuildKit: install the buildx plugin or "
                     f"Debian's docker.io (tried: {', '.join(tried) or 'no docker found'})")


def docker_client(build: list[str]) -> str:
    return build[0]


# --- the machine's pip configuration -------------------------------------------------------------

def pip_config_files() -> list[Path]:
    """pip's configuration files in its own order (global, user, PIP_CONFIG_FILE last)."""
    xdg = os.environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(os.pathsep)
    files = [Path(d) / "pip" / "pip.conf" for d in xdg] + [Path("/etc/pip.conf")]
    home = Path.home()
    files += [home / ".pip" / "pip.conf", home / ".config" / "pip" / "pip.conf"]
    if os.environ.get("PIP_CONFIG_FILE"):
        files.append(Path(os.environ["PIP_CONFIG_FILE"]))
    return [f for f in files if f.is_file()]


def pip_settings() -> dict[str, str]:
    """The [global] and [install] settings of pip's files, overridden by ``PIP_*`` variables."""
    settings: dict[str, str] = {}
    for path in pip_config_files():
        parser = configparser.ConfigParser()
        parser.read(path)
        for section in ("global", "install"):
            if parser.has_section(section):
                settings.update({k.replace("_", "-"): v for k, v in parser.items(section)})
    for key, value in os.environ.items():
        if key.startswith("PIP_") and key not in ("PIP_CONFIG_FILE",):
            settings[key[4:].lower().replace("_", "-")] = value
    return settings


class LocalFolders:
    """Local folders of the pip configuration, served read-only over HTTP on 127.0.0.1; the URL
    path of a file is its absolute path (relative links of a simple index keep working)."""

    def __init__(self) -> None:
        self.roots: list[Path] = []
        self.server: http.server.ThreadingHTTPServer | None = None

    def url(self, location: str, index: bool) -> str | None:
        path = Path(unquote(urlparse(location).path)) if location.startswith("file:") else Path(location)
        if not path.is_dir():
            return None  # pip here ignores it too ("neither a file nor a directory")
        path = path.resolve()
        # A simple index links to files beside it (../../files/...): serve its parent.
        self.roots.append(path.parent if index else path)
        return f"http://127.0.0.1:{{port}}{path.as_posix()}/"

    def has_torch_cpu_wheel(self, torch_version: str) -> bool:
        """Whether a served folder holds the CPU torch wheel (then no CPU index is needed)."""
        return any(any(r.rglob(f"torch-{torch_version}+cpu-*.whl")) for r in self.roots)

    def start(self) -> int:
        roots = tuple(self.roots)

        class Handler(http.server.SimpleHTTPRequestHandler):
            def translate_path(self, path: str) -> str:
                fs = Path(unquote(urlparse(path).path))
                resolved = fs.resolve()
                if not any(resolved == r or r in resolved.parents for r in roots):
                    return "/nonexistent"
                return str(resolved)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory="/"))
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self.server.server_address[1]

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def build_secrets(tmp: Path, folders: LocalFolders) -> list[str]:
    """Write pip.conf, ca.crt and pip-constraints.txt for the builds; the ``--secret`` args."""
    settings = pip_settings()
    lines = ["[global]"]
    urls: list[str] = []
    for key in ("index-url", "extra-index-url"):
        for location in settings.get(key, "").split():
            if location.startswith(("http://", "https://")):
                urls.append(f"{key} = {location}" if key == "index-url" else location)
            else:
                served = folders.url(location, index=True)
                if served:
                    urls.append(f"{key} = {served}" if key == "index-url" else served)
    index = [u for u in urls if u.startswith("index-url")]
    extra = [u for u in urls if not u.startswith("index-url")]
    lines += index
    if extra:
        lines.append("extra-index-url = " + " ".join(extra))
    links = [folders.url(loc, index=False) for loc in settings.get("find-links", "").split()]
    links = [link for link in links if link]
    if links:
        lines.append("find-links = " + " ".join(links))
    # trusted-host is never carried over: TLS verification stays on inside the builds.
    for key in ("timeout", "default-timeout", "retries", "proxy"):
        if key in settings:
            lines.append(f"{key} = {settings[key]}")
    constraints = []
    for name in settings.get("constraint", "").split():
        if Path(name).is_file():
            constraints.append(Path(name).read_text())
    secrets = []
    (tmp / "pip.conf").write_text("\n".join(lines) + "\n")  # {port}: filled in once serving
    secrets += ["--secret", f"id=pip.conf,src={tmp / 'pip.conf'}"]
    (tmp / "pip-constraints.txt").write_text("\n".join(constraints))
    secrets += ["--secret", f"id=pip-constraints.txt,src={tmp / 'pip-constraints.txt'}"]
    ca = settings.get("cert") or os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt"
    if Path(ca).is_file():
        secrets += ["--secret", f"id=ca.crt,src={ca}"]
    return secrets


# --- the builds --------------------------------------------------------------------------------

def build(names: list[str], trainer_torch: str, torch_cpu_index: str | None,
          docker: str | None, quiet: bool) -> dict[str, float]:
    command, extra_env = buildkit_command(docker)
    env = {**os.environ, **extra_env}
    folders = LocalFolders()
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="trainforge-build-") as tmp_name:
        tmp = Path(tmp_name)
        secrets = build_secrets(tmp, folders)
        if torch_cpu_index is None and folders.has_torch_cpu_wheel(TORCH_VERSION):
            torch_cpu_index = ""  # pip's own configuration has the CPU wheel
            print(f"torch {TORCH_VERSION}+cpu: from pip's configured local folders", flush=True)
        port = folders.start() if folders.roots else 0
        conf = tmp / "pip.conf"
        conf.write_text(conf.read_text().replace("{port}", str(port)))
        try:
            for name in names:
                dockerfile = (ROOT / "docker" / "local" / f"{name}.Dockerfile" if name in LOCAL_SERVICES
                              else ROOT / "docker" / f"{name}.Dockerfile")
                args = [*command, "--network", "host", *secrets, "-f", str(dockerfile),
                        "-t", image_tag(name, trainer_torch)]
                if name == "trainer":
                    args += ["--build-arg", f"TORCH_VARIANT={trainer_torch}"]
                if name in ("trainer", "airflow") and torch_cpu_index is not None:
                    args += ["--build-arg", f"TORCH_CPU_INDEX={torch_cpu_index}"]
                if quiet:
                    args.append("--quiet")
                args.append(str(ROOT))
                print(f"building {image_tag(name, trainer_torch)} from {dockerfile.relative_to(ROOT)}", flush=True)
                start = time.monotonic()
                proc = subprocess.run(args, env=env, cwd=ROOT)
                seconds[name] = time.monotonic() - start
                if proc.returncode != 0:
                    raise SystemExit(f"build.py: {dockerfile.relative_to(ROOT)} failed (exit {proc.returncode})")
        finally:
            folders.stop()
    client = docker_client(command)
    for name in names:
        tag = image_tag(name, trainer_torch)
        size = subprocess.run([client, "image", "inspect", "-f", "{{.Size}}", tag],
                              capture_output=True, text=True).stdout.strip()
        print(f"{tag}: {int(size or 0) / 1e6:.0f} MB, built in {seconds[name]:.0f} s", flush=True)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="docker/build.py", description=__doc__.splitlines()[0])
    parser.add_argument("images", nargs="*", metavar="IMAGE",
                        help=f"images to build: {', '.join(IMAGES)} (default: all three)")
    parser.add_argument("--local-services", action="store_true",
                        help="also build the stand-ins of docker/local/ (postgres, redis, s3)")
    parser.add_argument("--trainer-torch", choices=("cpu", "cuda"), default="cpu",
                        help="torch build of the trainer image (default cpu; cuda for GPU clusters)")
    parser.add_argument("--torch-cpu-index", default=None,
                        help="index of the CPU torch wheels (default: the Dockerfiles' "
                             "download.pytorch.org/whl/cpu; '' when pip's configuration has them)")
    parser.add_argument("--docker", default=os.environ.get("DOCKER"),
                        help="the docker client (default: docker on PATH, else /usr/bin/docker)")
    parser.add_argument("--quiet", action="store_true", help="print only each image's result")
    args = parser.parse_args(argv)
    unknown = [n for n in args.images if n not in IMAGES + LOCAL_SERVICES]
    if unknown:
        parser.error(f"unknown image {unknown[0]!r}: expected one of {', '.join(IMAGES + LOCAL_SERVICES)}")
    names = list(args.images or IMAGES)
    if args.local_services:
        names += [n for n in LOCAL_SERVICES if n not in names]
    build(names, args.trainer_torch, args.torch_cpu_index, args.docker, args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
