"""Start, stop and wait for a local MLflow tracking server.

The server is ``mlflow server`` (uvicorn, one worker) with a SQLite backend store in
``<home>/mlflow.db`` and artifacts proxied by the server (``--serve-artifacts``) into
``<home>/artifacts``; both can be overridden (``postgresql://...`` and ``s3://bucket/prefix``:
trainforge.mlflow_setup.stores, which checks them before a start and keeps passwords out of argv and files).

The files it keeps in ``home`` (pid file, log, start lock) are described in
:mod:`trainforge.mlflow_setup.home`; stopping the server's process group is
:mod:`trainforge.mlflow_setup.processes`.

    python -m trainforge.mlflow_setup start --home .trainforge/mlflow --port 0   # prints the URL
    python -m trainforge.mlflow_setup stop --home .trainforge/mlflow
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from trainforge.mlflow_setup.errors import HealthTimeoutError, ServerStartError
from trainforge.mlflow_setup.home import (
    LOG_FILE_NAME,
    home_lock,
    read_pid_file,
    record_alive,
    remove_pid_file,
    write_pid_file,
)
from trainforge.mlflow_setup.processes import (
    binds_later,
    free_port,
    group_listens_on,
    port_in_use,
    terminate_group,
)
from trainforge.mlflow_setup.stores import check_stores, driver_uri, has_password, redact

log = logging.getLogger(__name__)


# Environment of the server process. Job execution would start a huey consumer next to the
# web server (only needed for GenAI evaluation jobs); telemetry would try to reach the
# internet. Both are off unless the caller's environment says otherwise.
_SERVER_ENV_DEFAULTS = {
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PYTHONUNBUFFERED": "1",
    # Webhooks (trainforge.mlflow_setup.webhook) reach Airflow's API server next to this server,
    # on loopback or a cluster address, over plain http; MLflow's defaults allow only https to
    # public addresses. A registered webhook is seen within 2 s (MLflow caches the list 60 s).
    "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https",
    "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
    "MLFLOW_WEBHOOK_CACHE_TTL": "2",
}
_LOG_TAIL_LINES = 30


@dataclass(frozen=True)
class ServerConfig:
    """What ``mlflow server`` is started with. ``port=0`` means: pick a free port."""

    home: Path
    host: str = "127.0.0.1"
    port: int = 5000
    backend_store_uri: str | None = None
    artifacts_destination: str | None = None
    workers: int = 1
    allowed_hosts: str | None = None

    @property
    def store_uri(self) -> str:
        return self.backend_store_uri or f"sqlite:///{self.home / 'mlflow.db'}"

    @property
    def artifacts_uri(self) -> str:
        return self.artifacts_destination or str(self.home / "artifacts")


def build_server_command(config: ServerConfig, port: int) -> list[str]:
    """Pure: the exact argv of the server process for ``config`` listening on ``port``.

    A backend store URI with a password is left out: `server_env` passes it in
    ``MLFLOW_BACKEND_STORE_URI`` instead (a command line is visible to every local user).
    """
    store = [] if has_password(config.store_uri) else ["--backend-store-uri", driver_uri(config.store_uri)]
    argv = [
        sys.executable, "-m", "mlflow", "server",
        *store,
        "--serve-artifacts",
        "--artifacts-destination", config.artifacts_uri,
        "--host", config.host,
        "--port", str(port),
        "--workers", str(config.workers),
    ]  # fmt: skip
    if config.allowed_hosts:
        argv += ["--allowed-hosts", config.allowed_hosts]
    return argv


def server_env(base: Mapping[str, str], config: ServerConfig | None = None) -> dict[str, str]:
    """Pure: the server's environment, ``base`` plus defaults that ``base`` does not set, plus
    ``MLFLOW_BACKEND_STORE_URI`` when ``config``'s store URI holds a password."""
    env = {**_SERVER_ENV_DEFAULTS, **base}
    if config is not None and has_password(config.store_uri):
        env["MLFLOW_BACKEND_STORE_URI"] = driver_uri(config.store_uri)
    return env


def client_url(host: str, port: int) -> str:
    """The URL a client on this machine uses to reach a server bound to ``host:port``."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


class ServerExitedError(ServerStartError):
    """The server process exited while we waited for it to become healthy."""

    def __init__(self, home: str, returncode: int, log_tail: str) -> None:
        self.returncode = returncode
        super().__init__(home, f"the server process exited with code {returncode}", log_tail)


def log_tail(log_file: str | os.PathLike[str] | None, lines: int = _LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of ``log_file``, or "" when there is none."""
    if log_file is None:
        return ""
    try:
        with open(log_file, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def wait_healthy(
    url: str,
    timeout_s: float = 60.0,
    interval_s: float = 0.5,
    *,
    log_file: str | os.PathLike[str] | None = None,
    process: subprocess.Popen[bytes] | None = None,
) -> None:
    """Poll ``GET <url>/health`` every ``interval_s`` seconds until it answers 200 OK.

    Raises:
        HealthTimeoutError: not healthy after ``timeout_s`` seconds; the message has the last
            state seen (connection refused, HTTP status, ...) and the tail of ``log_file``.
        ServerExitedError: ``process`` was given and exited before it became healthy.
    """
    health_url = url.rstrip("/") + "/health"
    # Loopback health checks must not go through an HTTP proxy from the environment.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout_s
    last_state = "no answer yet"
    while True:
        if process is not None and (code := process.poll()) is not None:
            home = str(Path(log_file).parent) if log_file else "?"
            raise ServerExitedError(home, code, log_tail(log_file))
        remaining_s = deadline - time.monotonic()
        try:
            with opener.open(health_url, timeout=max(0.1, min(5.0, remaining_s))) as resp:
                body = resp.read(200).decode("utf-8", errors="replace").strip()
                if resp.status == 200:
                    return
                last_state = f"HTTP {resp.status}: {body!r}"
        except urllib.error.HTTPError as err:
            last_state = f"HTTP {err.code}: {err.reason}"
        except urllib.error.URLError as err:
            last_state = f"{type(err.reason).__name__}: {err.reason}"
        except OSError as err:  # timeouts, resets, remote disconnects
            last_state = f"{type(err).__name__}: {err}"
        if time.monotonic() + interval_s > deadline:
            raise HealthTimeoutError(url, timeout_s, last_state, log_tail(log_file))
        time.sleep(interval_s)


class ServerHandle:
    """A running MLflow server: ``.url``, ``.pid``, ``.stop()``; a context manager.

    ``reused`` is True when ``start_server`` found a healthy server of the same home already
    running; leaving the ``with`` block stops only servers this handle started.
    """

    def __init__(
        self,
        *,
        url: str,
        pid: int,
        home: Path,
        reused: bool,
        process: subprocess.Popen[bytes] | None = None,
    ) -> None:
        self.url = url
        self.pid = pid
        self.home = home
        self.reused = reused
        self._process = process

    @property
    def log_file(self) -> Path:
        return self.home / LOG_FILE_NAME

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server's process group, SIGKILL after ``grace_s``; remove the pid file.

        Raises:
            ServerStopError: the group was still alive after SIGKILL.
        """
        terminate_group(self.pid, grace_s, self._process)
        remove_pid_file(self.home, self.pid)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.reused:
            self.stop()

    def __repr__(self) -> str:
        return f"ServerHandle(url={self.url!r}, pid={self.pid}, reused={self.reused})"


def start_server(
    home: str | os.PathLike[str],
    host: str = "127.0.0.1",
    port: int = 5000,
    *,
    backend_store_uri: str | None = None,
    artifacts_destination: str | None = None,
    workers: int = 1,
    allowed_hosts: str | None = None,
    timeout_s: float = 60.0,
    interval_s: float = 0.25,
) -> ServerHandle:
    """Start ``mlflow server`` in the background (own process group) and wait until healthy.

    Idempotent: when the pid file of ``home`` names a live server with the same host, port
    (any port when ``port=0``) and stores, that server is reused (``handle.reused``).

    Raises:
        StoreArgumentError: the backend store or artifact destination has a bad scheme.
        StoreUnreachableError: a PostgreSQL database or S3 bucket did not answer.
        ServerStartError: a different server of this home is running, the port is taken, or
            the process exited early (message has the log tail).
        HealthTimeoutError: not healthy within ``timeout_s`` seconds (the process is stopped).
    """
    home_path = Path(home).resolve()
    home_path.mkdir(parents=True, exist_ok=True)
    config = ServerConfig(
        home=home_path,
        host=host,
        port=port,
        backend_store_uri=backend_store_uri,
        artifacts_destination=artifacts_destination,
        workers=workers,
        allowed_hosts=allowed_hosts,
    )
    check_stores(config.store_uri, config.artifacts_uri, connect=False)
    if "://" not in config.artifacts_uri:
        Path(config.artifacts_uri).mkdir(parents=True, exist_ok=True)
    with home_lock(home_path):
        record = read_pid_file(home_path)
        if record is not None and record_alive(record):
            return _reuse(config, record, timeout_s, interval_s)
        if record is not None:
            log.info("removing stale pid file of dead server pid %s", record.get("pid"))
            remove_pid_file(home_path, record.get("pid"))
        attempts = 3 if port == 0 else 1  # a free port can be taken between pick and bind
        for attempt in range(1, attempts + 1):
            try:
                return _launch(config, timeout_s, interval_s)
            except ServerExitedError as err:
                if attempt < attempts and "address already in use" in err.log_tail.lower():
                    log.warning("picked port was taken, retrying (attempt %d)", attempt)
                    continue
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def stop_server(home: str | os.PathLike[str], grace_s: float = 10.0) -> bool:
    """Stop the server named by ``home``'s pid file. Returns False when none was running.

    Raises:
        ServerStopError: the process group was still alive after SIGKILL.
    """
    home_path = Path(home).resolve()
    record = read_pid_file(home_path)
    if record is None:
        return False
    alive = record_alive(record)
    if alive:
        terminate_group(int(record["pid"]), grace_s, None)
    remove_pid_file(home_path, record.get("pid"))
    return alive


def _reuse(
    config: ServerConfig, record: dict[str, Any], timeout_s: float, interval_s: float
) -> ServerHandle:
    wanted = {"host": config.host, "backend_store_uri": redact(config.store_uri)}
    if config.port != 0:
        wanted["port"] = config.port
    mismatched = {k: (record.get(k), v) for k, v in wanted.items() if record.get(k) != v}
    if mismatched:
        detail = ", ".join(f"{k}: running {a!r}, asked {b!r}" for k, (a, b) in mismatched.items())
        raise ServerStartError(
            str(config.home),
            f"a different server of this home is already running at {record.get('url')} "
            f"(pid {record.get('pid')}; {detail}); stop it first with "
            f"`python -m trainforge.mlflow_setup stop --home {config.home}`",
        )
    url = str(record["url"])
    wait_healthy(url, timeout_s, interval_s, log_file=config.home / LOG_FILE_NAME)
    log.info("reusing MLflow server at %s (pid %s)", url, record["pid"])
    return ServerHandle(url=url, pid=int(record["pid"]), home=config.home, reused=True)


def _launch(config: ServerConfig, timeout_s: float, interval_s: float) -> ServerHandle:
    check_stores(config.store_uri, config.artifacts_uri)  # a wrong database fails here, fast
    port = config.port or free_port(config.host)
    if port_in_use(config.host, port):
        raise ServerStartError(
            str(config.home),
            f"port {port} on {config.host} is already in use; pick another --port (0 = any free)",
        )
    argv = build_server_command(config, port)
    url = client_url(config.host, port)
    log_path = config.home / LOG_FILE_NAME
    with open(log_path, "ab") as log_fh:
        log_fh.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
        log_fh.flush()
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_fh,
            stderr=subprocess.STDOUT,
            cwd=config.home,
            env=server_env(os.environ, config),
            start_new_session=True,  # own process group: stop() signals the whole tree
        )
    record = {
        "pid": process.pid,
        "create_time": psutil.Process(process.pid).create_time(),
        "url": url,
        "host": config.host,
        "port": port,
        "backend_store_uri": redact(config.store_uri),
        "artifacts_destination": config.artifacts_uri,
        "log_file": str(log_path),
        "argv": argv,
    }
    write_pid_file(config.home, record)
    log.info("started MLflow server pid %d at %s (log %s)", process.pid, url, log_path)
    try:
        wait_healthy(url, timeout_s, interval_s, log_file=log_path, process=process)
        if not group_listens_on(process.pid, port) and not binds_later(process, port, timeout_s):
            # Another server bound the port between the check above and this one's start
            # (two runs starting together): what answered is not this home's server.
            raise ServerStartError(
                str(config.home),
                f"port {port} on {config.host} was taken by another server while this one "
                f"started; pick another --port (0 = any free)")
    except ServerExitedError:
        # The `mlflow server` process is gone, but its uvicorn workers share its process group
        # and may outlive it: stop whatever is left so nothing is orphaned.
        terminate_group(process.pid, 5.0, process)
        remove_pid_file(config.home, process.pid)
        raise
    except BaseException:
        terminate_group(process.pid, 5.0, process)
        remove_pid_file(config.home, process.pid)
        raise
    return ServerHandle(url=url, pid=process.pid, home=config.home, reused=False, process=process)
