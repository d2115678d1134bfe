"""Fixtures shared by every test package."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ray_head import ray_head  # noqa: F401 - the real Ray head on loopback (session)
from tests.kube_apiserver import kube_apiserver  # noqa: F401 - a real kube-apiserver (session)

#: What some tests need beyond the venv, and how to get it on Debian/Ubuntu (`.ci/run` installs
#: the packages). A test that cannot have one skips through :func:`skip_without`, so that its
#: reason, in the summary `-ra` prints and in the section below it, says what to install.
PREREQUISITES = {
    "slurm": ("Slurm and munge (a one-node test cluster: slurmctld, slurmd, munged, sbatch)",
              "sudo apt-get install -y --no-install-recommends slurm-wlm munge"),
    "root": ("root (slurmd starts each job as its user)",
             "run the Slurm tests as root, e.g. sudo -E .venv/bin/pytest tests/operators/engines/slurm"),
    "postgres": ("PostgreSQL server binaries (initdb, pg_ctl)",
                 "sudo apt-get install -y --no-install-recommends postgresql"),
    "postgres-user": ("a 'postgres' or 'nobody' user to own the test cluster (initdb refuses root)",
                      "sudo useradd --system --no-create-home postgres"),
    "docker": ("a Docker engine (Debian's docker.io, dockerd started as root), docker-compose and debootstrap",
               "sudo apt-get install -y --no-install-recommends docker.io docker-compose debootstrap, "
               "then run as root, e.g. sudo -E .venv/bin/pytest -m docker"),
    "envtest": ("a real Kubernetes API server: etcd and kube-apiserver in the folder KUBEBUILDER_ASSETS "
                "names, the upstream CRDs in the folder TRAINFORGE_ENVTEST_CRDS names",
                "sudo apt-get install -y --no-install-recommends etcd-server, put kube-apiserver "
                "(v1.30 or later) beside a link to etcd and export KUBEBUILDER_ASSETS=that folder "
                "(.ci/run does it from an envtest folder beside the checkout, whose assets script "
                "prints that folder: KUBEBUILDER_ASSETS=\"$(../shared/envtest/assets)\"); "
                "export TRAINFORGE_ENVTEST_CRDS=a folder of the CRD files docs/kubernetes.md#tests lists"),
    "cgroup": ("a memory cgroup this test can create (root; cgroup v2 with the memory controller "
               "delegated, or v1's memory hierarchy)",
               "run as root where /sys/fs/cgroup is writable (not in an unprivileged container), "
               "e.g. sudo -E .venv/bin/pytest tests/trainer/test_host_memory.py"),
    "hosts": ("root and iproute2 for test hosts (network namespaces, veth pairs, tc)",
              "sudo apt-get install -y --no-install-recommends iproute2, then run as root, "
              "e.g. sudo -E .venv/bin/pytest -m multihost"),
}
_SKIP_PREFIX = "needs "


def data_cache(config: pytest.Config) -> Path:
    """The folder the demo corpus is fetched into once and shared by every test that needs it:
    pytest's cache (kept between sessions) when its plugin is on, else a folder of this session
    (``-p no:cacheprovider`` works, at the price of one fetch per session)."""
    cache = getattr(config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("trainforge-data"))
    global _SESSION_DATA
    if _SESSION_DATA is None:
        _SESSION_DATA = Path(tempfile.mkdtemp(prefix="trainforge-data-"))
        atexit.register(shutil.rmtree, _SESSION_DATA, True)
    return _SESSION_DATA


_SESSION_DATA: Path | None = None


def skip_without(prerequisite: str, detail: str = "") -> None:
    """Skip the calling test for a missing entry of :data:`PREREQUISITES`, saying what is
    missing (``detail``: e.g. which binaries) and how to install it."""
    what, install = PREREQUISITES[prerequisite]
    found = f" ({detail})" if detail else ""
    pytest.skip(f"{_SKIP_PREFIX}{what}{found}; to run these tests: {install}")


def prerequisite_summary(reasons: list[str]) -> list[str]:
    """One line per missing prerequisite, with how many tests it skipped and how to install it
    (``reasons``: the skip reasons of the session)."""
    lines = []
    for key, (what, install) in PREREQUISITES.items():
        count = sum(1 for reason in reasons if reason.startswith(f"{_SKIP_PREFIX}{what}"))
        if count:
            lines.append(f"{count} skipped: {what}: {install}")
    return lines


#: What one test at a time may use on this machine, and how its tests are recognised (a marker,
#: a fixture or a folder): under pytest-xdist (``make test``) every module that touches one runs
#: on the same worker, one module after another (docs/testing.md, "Two workers").
EXCLUSIVE = (("docker", "marker", "docker"), ("hosts", "marker", "multihost"),
             # Slurm clusters number their jobs from 1 and derive rendezvous ports from the id
             ("hosts", "path", "tests/operators/engines/slurm/"),
             ("wheel", "marker", "wheel"), ("ray", "fixture", "ray_head"),
             ("kube", "fixture", "kube_apiserver"),
             # one airflow standalone for the session, not one per worker
             ("standalone", "fixture", "_standalone_server"))
#: Measured seconds per test module (``python -m tests.durations JUNIT_XML`` writes it).
DURATIONS = Path(__file__).with_name("durations.json")
_GROUPS_KEY = "trainforge_test_groups"  # the workers' input: where they write the groups


class XdistGroups:
    """pytest-xdist's controller side of the units of work (registered only with xdist on)."""

    @staticmethod
    def pytest_configure_node(node) -> None:
        """Each worker writes the unit of work of every test module to one file
        (:func:`pytest_collection_modifyitems`), which the scheduler reads."""
        config = node.config
        if not hasattr(config, "_trainforge_groups"):
            folder = Path(tempfile.mkdtemp(prefix="trainforge-groups-"))
            atexit.register(shutil.rmtree, folder, True)
            config._trainforge_groups = folder / "groups.json"
        node.workerinput[_GROUPS_KEY] = str(config._trainforge_groups)

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        """One unit of work per test module, or for all the modules that use one exclusive
        resource (:data:`EXCLUSIVE`): ``xdist_group`` marks cannot say that under pytest 9
        (the group suffix of a test id is lost)."""
        from xdist.scheduler import LoadScopeScheduling

        class ModuleGroups(LoadScopeScheduling):
            groups: dict[str, str] | None = None

            def _split_scope(self, nodeid: str) -> str:
                if self.groups is None:  # written by every worker before it reports its tests
                    self.groups = json.loads(Path(config._trainforge_groups).read_text())
                module = nodeid.split("::", 1)[0]
                return self.groups.get(module, module)

        return ModuleGroups(config, log)


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.has_plugin("xdist") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(XdistGroups(), "trainforge-xdist-groups")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a pytest-xdist worker: the unit of work of each module (itself, or the exclusive
    resource it uses), written for the controller's scheduler, and the tests ordered longest
    unit first by the measured durations, so that the two workers end together."""
    workerinput = getattr(config, "workerinput", None)
    if not workerinput or _GROUPS_KEY not in workerinput:  # not an xdist worker: pytest's order
        return
    modules: dict[str, str] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        for group, kind, name in EXCLUSIVE:
            hit = (item.get_closest_marker(name) if kind == "marker" else
                   name in item.fixturenames if kind == "fixture" else module.startswith(name))
            if hit and modules.get(module, module) == module:
                modules[module] = group
        modules.setdefault(module, module)
    out = Path(workerinput[_GROUPS_KEY])
    part = out.with_name(f"{out.name}.{os.getpid()}")
    part.write_text(json.dumps(modules))
    os.replace(part, out)  # every worker writes the same map
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    unit_s: dict[str, float] = {}
    for module, group in modules.items():
        unit_s[group] = unit_s.get(group, 0.0) + seconds.get(module, 1.0)
    items.sort(key=lambda item: -unit_s[modules[item.nodeid.split("::", 1)[0]]])  # stable


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """After pytest's own summary: what the skipped tests need, one line per prerequisite."""
    reasons = []
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        if isinstance(longrepr, tuple) and len(longrepr) == 3:
            reasons.append(str(longrepr[2]).removeprefix("Skipped: "))
    lines = prerequisite_summary(reasons)
    if lines:
        terminalreporter.section("tests skipped for missing prerequisites", sep="-")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real MLflow server on loopback for the session (SQLite store, proxied artifacts).

    Started with ``mlflow_setup`` on a free port; stopped (whole process group) at the end.
    """
    from trainforge.mlflow_setup import start_server

    with start_server(tmp_path_factory.mktemp("mlflow"), port=0, timeout_s=120.0) as server:
        yield server.url


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Endpoint URL of a real S3-compatible server on loopback for the session: moto's server
    mode (``python -m moto.server``) on 127.0.0.1 and a free port, stopped at the end.

    Clients need credentials and a region; any values work with moto, e.g.
    ``monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")``.
    """
    import sys

    yield from _serve_s3(tmp_path_factory, [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p"])


@pytest.fixture(scope="session")
def strict_s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Endpoint URL of an S3-compatible server that refuses the flexible checksums of newer AWS
    SDKs, as stores that predate them do: the stack's stand-in store
    (docker/local/s3-server.py, moto behind the refusal) with ``S3_REFUSE_FLEXIBLE_CHECKSUMS=1``."""
    import sys

    script = Path(__file__).resolve().parents[1] / "docker" / "local" / "s3-server.py"
    yield from _serve_s3(tmp_path_factory, [sys.executable, str(script), "127.0.0.1"],
                         {"S3_REFUSE_FLEXIBLE_CHECKSUMS": "1"})


def _serve_s3(tmp_path_factory: pytest.TempPathFactory, command: list[str],
              env: dict[str, str] | None = None) -> Iterator[str]:
    """Run ``command`` + a free port (an S3 server on loopback) until the session ends; yields
    its URL once it answers."""
    import os
    import socket
    import subprocess
    import time
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path_factory.mktemp("s3") / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*command, str(port)], env={**os.environ, **(env or {})},
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60.0
    try:
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"moto server on {url} did not start (exit {proc.poll()}): "
                        + log.read_text(errors="replace")[-2000:]
                    ) from None
                time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


class ThrottlingS3Proxy:
    """A reverse proxy on loopback in front of an S3-compatible server that answers chosen
    requests with a real ``HTTP 503`` and an S3 ``<Error><Code>SlowDown</Code>`` body, the way
    AWS S3 throttles a prefix, and forwards every other request unchanged.

    ``throttle(operation, times, key_suffix="", query_has="")`` makes the next ``times``
    requests of an S3 operation (``PutObject``, ``UploadPart``, ``ListObjectsV2``, ...;
    recognised from the method, path and query as S3's REST API defines them) fail, optionally
    only for keys ending in ``key_suffix`` or queries holding ``query_has`` (e.g.
    ``continuation-token``: a listing's later pages). ``log`` lists every request seen:
    ``(operation, key, status)``.
    """

    SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                b"<Message>Please reduce your request rate.</Message></Error>")

    def __init__(self, upstream: str) -> None:
        import threading
        from http.server import ThreadingHTTPServer
        from urllib.parse import urlsplit

        self.upstream = urlsplit(upstream)
        self.log: list[tuple[str, str, int]] = []
        self._rules: list[list] = []  # [operation, remaining, key_suffix, query_has]
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def throttle(self, operation: str, times: int, key_suffix: str = "", query_has: str = "") -> None:
        with self._lock:
            self._rules.append([operation, times, key_suffix, query_has])

    def throttled(self) -> list[tuple[str, str]]:
        """``(operation, key)`` of every request answered with 503 SlowDown."""
        return [(op, key) for op, key, status in self.log if status == 503]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    @staticmethod
    def operation(method: str, path: str, query: str, headers) -> tuple[str, str]:
        """``(S3 operation, key)`` of a path-style request (``/bucket/key?query``)."""
        from urllib.parse import parse_qs, unquote

        params = parse_qs(query, keep_blank_values=True)
        bucket, _, key = unquote(path).lstrip("/").partition("/")
        if not key:
            if method == "GET" and params.get("list-type") == ["2"]:
                return "ListObjectsV2", ""
            if method == "POST" and "delete" in params:
                return "DeleteObjects", ""
            return f"{method}Bucket", ""
        if method == "PUT" and "partNumber" in params:
            return "UploadPart", key
        if method == "PUT":
            return ("CopyObject" if "x-amz-copy-source" in headers else "PutObject"), key
        if method == "POST":
            return ("CreateMultipartUpload" if "uploads" in params else "CompleteMultipartUpload"), key
        return {"GET": "GetObject", "HEAD": "HeadObject", "DELETE": "DeleteObject"}.get(method, method), key

    def _decide(self, operation: str, key: str, query: str) -> bool:
        with self._lock:
            for rule in self._rules:
                if rule[0] == operation and rule[1] > 0 and key.endswith(rule[2]) and rule[3] in query:
                    rule[1] -= 1
                    return True
        return False

    def _handler_class(self):
        import http.client
        from http.server import BaseHTTPRequestHandler

        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, and Expect: 100-continue as S3 clients use

            def log_message(self, *args) -> None:  # quiet: the test reads proxy.log instead
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self) -> None:
                path, _, query = self.path.partition("?")
                operation, key = proxy.operation(self.command, path, query, self.headers)
                body = self._body()
                if proxy._decide(operation, key, query):
                    proxy.log.append((operation, key, 503))
                    self.send_response(503, "Slow Down")
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(proxy.SLOWDOWN)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(proxy.SLOWDOWN)
                    return
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("transfer-encoding", "connection", "expect")}
                headers["Content-Length"] = str(len(body))
                upstream = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    answer = upstream.getresponse()
                    data = answer.read()
                finally:
                    upstream.close()
                proxy.log.append((operation, key, answer.status))
                self.send_response(answer.status, answer.reason)
                for name, value in answer.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                length = answer.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        return Handler


@pytest.fixture
def throttling_s3_proxy(s3_server: str) -> Iterator[ThrottlingS3Proxy]:
    """A `ThrottlingS3Proxy` in front of the session's moto server (its ``.url`` is the endpoint
    to give clients); nothing is throttled until the test calls ``throttle``."""
    proxy = ThrottlingS3Proxy(s3_server)
    try:
        yield proxy
    finally:
        proxy.close()


def _postgres_bin_dir() -> str | None:
    """Folder holding initdb and pg_ctl: PATH first, then Debian's /usr/lib/postgresql/<v>/bin."""
    import glob
    import os
    import shutil

    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl", path=os.path.dirname(found)):
        return os.path.dirname(found)
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.access(os.path.join(folder, "initdb"), os.X_OK):
            return folder
    return None


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[dict]:
    """A real PostgreSQL server on loopback for the session, in a temporary folder.

    ``initdb`` refuses to run as root, so as root the cluster belongs to the ``postgres`` system
    user (else ``nobody``) and every server command runs through ``runuser``. Listens on
    127.0.0.1 and a free port, its unix socket in the temporary folder; password (SCRAM)
    authentication over TCP. Yields ``{"uri", "password", "host", "port", "user", "database"}``
    with ``uri`` = ``postgresql://mlflow:<password>@127.0.0.1:<port>/mlflow``. Stopped and
    removed at the end. Skips only when no PostgreSQL binaries exist (.ci/run installs them),
    or as root when neither user exists.
    """
    import os
    import pwd
    import shutil
    import socket
    import subprocess
    import tempfile

    bin_dir = _postgres_bin_dir()
    if bin_dir is None:
        skip_without("postgres", "not on PATH nor in /usr/lib/postgresql/*/bin")
    prefix: list[str] = []
    root = tempfile.mkdtemp(prefix="trainforge-pg-")
    owner = None
    if os.geteuid() == 0:
        for name in ("postgres", "nobody"):
            try:
                owner = pwd.getpwnam(name)
                break
            except KeyError:
                continue
        if owner is None:
            skip_without("postgres-user", "running as root, and neither user exists")
        prefix = ["runuser", "-u", owner.pw_name, "--"]
        os.chown(root, owner.pw_uid, owner.pw_gid)
    password = "pg-" + os.urandom(8).hex()
    pwfile = os.path.join(root, "pwfile")
    with open(pwfile, "w") as fh:
        fh.write(password + "\n")
    if owner is not None:
        os.chown(pwfile, owner.pw_uid, owner.pw_gid)
    data = os.path.join(root, "data")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    def run(*argv: str) -> None:
        proc = subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=120, cwd=root)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stdout}{proc.stderr}")

    started = False
    try:
        run(os.path.join(bin_dir, "initdb"), "-D", data, "-U", "mlflow", "--pwfile", pwfile,
            "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--no-sync")
        run(os.path.join(bin_dir, "pg_ctl"), "-D", data, "-l", os.path.join(root, "postgres.log"), "-w",
            "-t", "60", "-o", f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
        started = True
        import psycopg2

        admin = psycopg2.connect(host="127.0.0.1", port=port, user="mlflow", password=password,
                                 dbname="postgres", connect_timeout=10)
        admin.autocommit = True
        with admin.cursor() as cur:
            cur.execute("CREATE DATABASE mlflow")
        admin.close()
        yield {"uri": f"postgresql://mlflow:{password}@127.0.0.1:{port}/mlflow", "password": password,
               "host": "127.0.0.1", "port": port, "user": "mlflow", "database": "mlflow"}
    finally:
        if started:
            subprocess.run([*prefix, os.path.join(bin_dir, "pg_ctl"), "-D", data, "-m", "fast", "-w",
                            "-t", "60", "stop"], capture_output=True, timeout=120, cwd=root)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory: pytest.TempPathFactory):
    """A factory ``hf_model(family) -> Path``: a tiny random-weight Hugging Face model folder
    of ``family`` (one of ``tests.hf_models.FAMILIES``: bf16 shards + index, tokenizer, chat
    template, generation config), made once per session with the default seed and reused."""
    from tests.hf_models import make_hf_model

    root = tmp_path_factory.mktemp("hf-models")
    made: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in made:
            made[family] = make_hf_model(root / family, family)
        return made[family]

    return make
