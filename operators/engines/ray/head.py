"""A single-machine Ray cluster on loopback: ``ray start --head``, for tests and ``trainforge run``.

:class:`LocalRayHead` starts a head node bound to 127.0.0.1 with its own temporary folder and
free ports (so it never collides with another Ray on the machine), waits until the job
submission API answers, and on exit stops exactly the processes it started: the ``ray start``
process group, every descendant of it (Ray workers and the jobs they run live in process groups
of their own) and any process whose command line names its temporary folder. It does not call
``ray stop``, which would stop every Ray instance of the user on this machine.

Jobs run with ``TMPDIR`` set to ``<temp dir>/tmp`` (and ``RAY_TMPDIR`` to the temp dir), so the
folders they make (the Ray engine's ``trainforge-<key>.*`` job folders) live inside the head's
temporary folder and go when the owner removes it, not in the system's temporary folder.

``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` and ``--node-ip-address 127.0.0.1`` keep every Ray
service on loopback. The head's ``PATH`` starts with this interpreter's ``bin`` folder, so a job
entrypoint that calls ``torchrun`` finds the one of this environment.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

log = logging.getLogger(__name__)


class RayHeadError(RuntimeError):
    """The local Ray head did not start (the message carries the end of its log)."""


# The ports `ray start --head` is given, one per component (its option names). Ray refuses a
# port named twice, or one inside the workers' range ("Ray component X is trying to use a port
# number N that is used by other components").
RAY_PORT_OPTIONS = (
    "port", "dashboard-port", "ray-client-server-port", "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port",
    "node-manager-port", "object-manager-port",
)
# Ray's default range of worker ports (`--min-worker-port`, `--max-worker-port`), passed
# explicitly so that the component ports can stay out of it.
WORKER_PORTS = range(10002, 20000)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    return free_ports(1)[0]


def free_ports(count: int, avoid: range = range(0), max_tries: int = 1000) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1, free a moment ago and none in ``avoid``.

    Every socket stays bound until all are chosen: a port is only the caller's while its socket
    is open, and the kernel hands a just-closed port out again, so choosing them one after
    another (bind, close, bind again) can name one port twice.

    Raises:
        RayHeadError: no ``count`` such ports after ``max_tries`` binds.
    """
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(max_tries):
            if len(ports) == count:
                break
            sock = socket.socket()
            held.append(sock)
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            if port not in avoid and port not in ports:
                ports.append(port)
        if len(ports) < count:
            raise RayHeadError(f"found {len(ports)} of {count} free ports on 127.0.0.1 outside "
                               f"{avoid.start}-{avoid.stop - 1} after {max_tries} tries")
        return ports
    finally:
        for sock in held:
            sock.close()


def ray_ports() -> dict[str, int]:
    """A free, distinct port for each of :data:`RAY_PORT_OPTIONS`, outside :data:`WORKER_PORTS`."""
    return dict(zip(RAY_PORT_OPTIONS, free_ports(len(RAY_PORT_OPTIONS), avoid=WORKER_PORTS)))


def job_api_ready(address: str, timeout_s: float = 3.0) -> bool:
    """Whether ``address`` (``http://host:port``) answers the Ray job API's job listing."""
    try:
        with urllib.request.urlopen(f"{address.rstrip('/')}/api/jobs/", timeout=timeout_s) as resp:
            return resp.status == 200
    except (OSError, ValueError):
        return False


class LocalRayHead:
    """A Ray head node on 127.0.0.1, as a context manager (``with LocalRayHead(dir) as head``).

    Args:
        temp_dir: Ray's ``--temp-dir`` (sessions, logs, sockets); created if missing. Keep it
            short: Ray's socket paths must stay under 107 bytes.
        num_cpus: logical CPUs the head offers to jobs (``--num-cpus``).
        object_store_mib: size of the object store in MiB (``--object-store-memory``); jobs
            here pass no objects, so it stays small.
        start_timeout_s: how long to wait for ``ray start`` and then the job API, seconds.
        stop_grace_s: SIGTERM, then SIGKILL after this many seconds.

    Attributes:
        job_tmp_dir: ``TMPDIR`` of the head and every job it runs, ``<temp_dir>/tmp``.

    Attributes (after start):
        address: the dashboard / job API address, ``http://127.0.0.1:<port>``.
        gcs_address: ``127.0.0.1:<port>`` of the head's GCS.

    Raises:
        RayHeadError: from :meth:`start`, when ``ray start`` fails or the job API does not
            answer within ``start_timeout_s`` (everything started is stopped first).
    """

    def __init__(self, temp_dir: str | os.PathLike, num_cpus: int = 2, object_store_mib: int = 200,
                 start_timeout_s: float = 120.0, stop_grace_s: float = 10.0):
        self.temp_dir = Path(temp_dir).absolute()
        self.job_tmp_dir = self.temp_dir / "tmp"
        self.num_cpus = int(num_cpus)
        self.object_store_mib = int(object_store_mib)
        self.start_timeout_s = float(start_timeout_s)
        self.stop_grace_s = float(stop_grace_s)
        self.address = ""
        self.gcs_address = ""
        self._pgid: int | None = None

    def start(self) -> LocalRayHead:
        """Start the head; when another process took one of the chosen ports before Ray bound
        it, start again on fresh ports (at most :data:`START_ATTEMPTS` times)."""
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        self.job_tmp_dir.mkdir(exist_ok=True)
        log_path = self.temp_dir / "ray-start.log"
        for attempt in range(1, START_ATTEMPTS + 1):
            seen = log_path.stat().st_size if log_path.exists() else 0
            try:
                return self._start_once(log_path)
            except RayHeadError:
                if attempt == START_ATTEMPTS or not _port_taken(log_path, seen):
                    raise
                log.warning("A port chosen for the Ray head in %s was taken before Ray bound "
                            "it; starting again on other ports (attempt %d of %d)",
                            self.temp_dir, attempt + 1, START_ATTEMPTS)
        raise AssertionError("unreachable")

    def _start_once(self, log_path: Path) -> LocalRayHead:
        bin_dir = str(Path(sys.executable).parent)
        ports = ray_ports()
        argv = [str(Path(bin_dir) / "ray"), "start", "--head", "--node-ip-address", "127.0.0.1",
                "--dashboard-host", "127.0.0.1", "--include-dashboard", "true",
                "--num-cpus", str(self.num_cpus), "--num-gpus", "0",
                "--object-store-memory", str(self.object_store_mib * 1024 * 1024),
                "--temp-dir", str(self.temp_dir), "--disable-usage-stats",
                "--min-worker-port", str(WORKER_PORTS.start),
                "--max-worker-port", str(WORKER_PORTS.stop - 1)]
        for name, port in ports.items():
            argv += [f"--{name}", str(port)]
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
               "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
               "RAY_USAGE_STATS_ENABLED": "0",
               # Inherited by the raylet and so by every job: their temporary files stay here.
               "TMPDIR": str(self.job_tmp_dir), "RAY_TMPDIR": str(self.temp_dir)}
        # A RAY_ADDRESS of the caller would make `ray start` join that cluster's checks.
        for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
            env.pop(name, None)
        self.address = f"http://127.0.0.1:{ports['dashboard-port']}"
        self.gcs_address = f"127.0.0.1:{ports['port']}"
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self._pgid = proc.pid
        deadline = time.monotonic() + self.start_timeout_s
        try:
            try:
                rc = proc.wait(timeout=self.start_timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
            if rc != 0:
                raise RayHeadError(
                    f"`ray start --head` in {self.temp_dir} "
                    f"{'did not finish' if rc is None else f'exited with code {rc}'} within "
                    f"{self.start_timeout_s:.0f} s; its log ends:\n{_tail(log_path)}")
            while not job_api_ready(self.address):
                if time.monotonic() > deadline:
                    raise RayHeadError(
                        f"the Ray job API on {self.address} did not answer within "
                        f"{self.start_timeout_s:.0f} s; `ray start` log ends:\n{_tail(log_path)}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        log.info("Ray head on %s (GCS %s, temp dir %s)", self.address, self.gcs_address,
                 self.temp_dir)
        return self

    def stop(self) -> list[int]:
        """Stop every process of this head; returns the pids that had to be SIGKILLed."""
        import psutil

        procs = self._processes()
        for proc in procs:
            _signal(proc, signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=self.stop_grace_s)
        for proc in alive:
            _signal(proc, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=10)
        # A process forked while we were stopping (a worker restarting) gets the same treatment.
        late = self._processes()
        for proc in late:
            _signal(proc, signal.SIGKILL)
        psutil.wait_procs(late, timeout=10)
        if procs:
            log.info("Ray head %s stopped (%d processes, %d killed)", self.address, len(procs),
                     len(alive) + len(late))
        return [p.pid for p in [*alive, *late]]

    def _processes(self) -> list:
        """This head's processes and all their descendants (psutil processes)."""
        import psutil

        marker = str(self.temp_dir)
        found: dict[int, psutil.Process] = {}
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                in_group = self._pgid is not None and os.getpgid(proc.pid) == self._pgid
                names_dir = any(marker in part for part in (proc.info["cmdline"] or []))
            except (psutil.Error, ProcessLookupError, PermissionError):
                continue
            if (in_group or names_dir) and proc.pid != os.getpid():
                found[proc.pid] = proc
        for proc in list(found.values()):
            try:
                for child in proc.children(recursive=True):
                    if child.pid != os.getpid():
                        found.setdefault(child.pid, child)
            except psutil.Error:
                continue
        return list(found.values())

    def __enter__(self) -> LocalRayHead:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal(proc, sig: int) -> None:
    import psutil

    try:
        proc.send_signal(sig)
    except psutil.Error:
        pass


# How `ray start` and its components say a port was taken by someone else.
_PORT_TAKEN = re.compile(r"address already in use|already in use|failed to bind", re.IGNORECASE)
START_ATTEMPTS = 3


def _port_taken(log_path: Path, offset: int) -> bool:
    """Whether the log written after ``offset`` says a port was taken."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            return bool(_PORT_TAKEN.search(f.read().decode(errors="replace")))
    except OSError:
        return False


def _tail(path: Path, max_chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-max_chars:]
    except OSError:
        return "(no log)"
