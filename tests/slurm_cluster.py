"""A real one-node Slurm cluster on loopback for tests: munged, slurmctld and slurmd.

:class:`SlurmCluster` writes a ``slurm.conf`` into a temporary folder (state, spool, logs, the
munge key and socket all live there too), starts ``munged``, ``slurmctld -D`` and
``slurmd -D -N localhost`` as background processes on free ports, and waits until the node is
idle. Commands find the cluster through ``SLURM_CONF``, which :meth:`SlurmCluster.env` returns
and the ``slurm_cluster`` fixture sets for the test session.

The cluster keeps no accounting database (no slurmdbd): ``sacct`` reports "accounting storage
is disabled", and the backend reads outcomes from ``squeue`` while the controller remembers the
job and from the job folder's exit record afterwards, as on any cluster without accounting.
Job completion records go to a text file (``JobCompType=jobcomp/filetxt``, ``sacct -c``) for
debugging.

Needs the Debian packages ``slurm-wlm`` and ``munge``, and root (slurmd launches jobs as their
user). The node declares ``cpus`` CPUs (default 2) whatever the machine has
(``SlurmdParameters=config_overrides``), and tests run only sleeping or tiny workloads on it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from tests.ports import free_ports

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo")


def missing_binaries() -> list[str]:
    """The Slurm and munge programs not found on PATH (or in /usr/sbin)."""
    return [name for name in BINARIES if _which(name) is None]


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


class SlurmCluster:
    """One controller and one compute node named ``localhost``, partition ``debug``; or, given
    test ``hosts`` (:class:`tests.hosts.TestHosts`), slurmctld on the first host and one slurmd
    per host, nodes named as the hosts (``h0``, ``h1``, ...) at their test addresses. munged runs
    on the machine: its socket is a file, which every host sees, as is the cluster's folder (the
    shared file system of the job folders).

    Args:
        root: an empty, short folder (unix socket paths must stay under 108 bytes).
        cpus: CPUs each node declares.
        memory_mib: memory each node declares, MiB (``DefMemPerCPU`` is 100 MiB).
        hosts: several test hosts to run the nodes on; None: one node on loopback.
        slurmd_timeout_s: how long the controller waits for an unresponsive node before it marks
            the node DOWN and fails its jobs (``SlurmdTimeout``; Slurm's default is 300 s).
    """

    def __init__(self, root: Path, cpus: int = 2, memory_mib: int = 2000, hosts=None,
                 slurmd_timeout_s: int = 300):
        self.root = Path(root)
        self.cpus = cpus
        self.memory_mib = memory_mib
        self.hosts = hosts
        self.slurmd_timeout_s = slurmd_timeout_s
        self.conf = self.root / "slurm.conf"
        self._procs: list[subprocess.Popen] = []

    @property
    def node_names(self) -> list[str]:
        if self.hosts is None:
            return ["localhost"]
        return [self.hosts.name(i) for i in range(self.hosts.count)]

    def _nodes_lines(self) -> list[str]:
        if self.hosts is None:
            return [f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} "
                    f"RealMemory={self.memory_mib} State=UNKNOWN"]
        return [f"NodeName={self.hosts.name(i)} NodeAddr={self.hosts.address(i)} CPUs={self.cpus} "
                f"RealMemory={self.memory_mib} State=UNKNOWN" for i in range(self.hosts.count)]

    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def write_config(self) -> None:
        r = self.root
        for sub in ("state", "log", "munge", *(
                ["spool"] if self.hosts is None else [f"spool-{n}" for n in self.node_names])):
            (r / sub).mkdir(parents=True, exist_ok=True)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ctld_port, d_port = free_ports(2)
        nodes = ",".join(self.node_names)
        ctld = ("localhost" if self.hosts is None
                else f"{self.hosts.name(0)}({self.hosts.address(0)})")
        per_node = "" if self.hosts is None else "-%n"
        self.conf.write_text("\n".join([
            "ClusterName=trainforge-test",
            f"SlurmctldHost={ctld}",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={d_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r}/munge/sock",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool{per_node}",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd{per_node}.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd{per_node}.log",
            f"SlurmdTimeout={self.slurmd_timeout_s}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU_Memory",
            "DefMemPerCPU=100",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={r}/jobcomp.txt",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            # Scheduling every second keeps the tests quick; KillWait bounds a forced cancel.
            "SchedulerParameters=sched_interval=1",
            "KillWait=5",
            *self._nodes_lines(),
            f"PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP",
            # A partition whose jobs may run at most a minute: longer ones can never start.
            f"PartitionName=short Nodes={nodes} MaxTime=1 State=UP",
            "",
        ]))

    def start(self, timeout_s: float = 60.0) -> None:
        self.write_config()
        r = self.root
        env = {**os.environ, **self.env()}
        self._spawn([_which("munged"), "--foreground", "--force", f"--socket={r}/munge/sock",
                     f"--key-file={r}/munge/munge.key", f"--pid-file={r}/munge/munged.pid",
                     f"--log-file={r}/munge/munged.log", f"--seed-file={r}/munge/seed"],
                    r / "log" / "munged.out", env)
        self._wait(lambda: (r / "munge" / "sock").exists(), 15.0, "munged's socket")
        self._spawn(self._on(0, [_which("slurmctld"), "-D", "-i"]), r / "log" / "slurmctld.out", env)
        for i, node in enumerate(self.node_names):
            self._spawn(self._on(i, [_which("slurmd"), "-D", "-N", node]),
                        r / "log" / f"slurmd-{node}.out", env)
        self._wait(self._node_idle, timeout_s, "every node to become idle (sinfo)")

    def _on(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run on host ``i`` (as it is without test hosts)."""
        return argv if self.hosts is None else self.hosts.argv(i, argv)

    def _node_idle(self) -> bool:
        proc = subprocess.run([_which("sinfo"), "-h", "-N", "-o", "%t"], capture_output=True,
                              text=True, env={**os.environ, **self.env()}, timeout=10)
        # one line per node and partition it is in
        states = set(proc.stdout.split())
        return proc.returncode == 0 and states == {"idle"}

    def _spawn(self, argv: list[str], log: Path, env: dict[str, str]) -> None:
        with open(log, "ab") as out:
            self._procs.append(subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True))

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [p.args[0] for p in self._procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"Slurm test cluster: waited {timeout_s:.0f} s for {what}; "
                                   f"exited: {dead or 'none'}\n{self.logs()}")
            time.sleep(0.3)

    def logs(self, tail_chars: int = 3000) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail_chars:]}")
        return "\n".join(parts)

    def run(self, *argv: str) -> subprocess.CompletedProcess:
        """A Slurm command against this cluster (``check=True``)."""
        return subprocess.run([_which(argv[0]), *argv[1:]], capture_output=True, text=True,
                              check=True, timeout=30, env={**os.environ, **self.env()})

    def stop(self) -> None:
        """Cancel every job, then stop slurmd, slurmctld and munged (SIGTERM, then SIGKILL)."""
        if self._procs and all(p.poll() is None for p in self._procs):
            try:
                subprocess.run([_which("scancel"), "--partition=debug,short"], timeout=15,
                               env={**os.environ, **self.env()}, capture_output=True)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and self.run(
                        "squeue", "-h", "-o", "%i").stdout.strip():
                    time.sleep(0.3)
            except (subprocess.SubprocessError, OSError):
                pass
        for proc in reversed(self._procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._procs = []


_shared: dict[str, object] = {"cluster": None, "users": 0, "previous_conf": None}


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A started :class:`SlurmCluster`; ``SLURM_CONF`` points at it for the session.

    Test modules import this fixture; pytest then holds one instance per importing module, so
    they share one cluster, started by the first and stopped when the last is torn down.
    """
    from tests.conftest import skip_without

    missing = missing_binaries()
    if missing:
        skip_without("slurm", f"missing: {', '.join(missing)}")
    if os.geteuid() != 0:
        skip_without("root")
    if _shared["cluster"] is None:
        root = Path(tempfile.mkdtemp(prefix="tf-slurm-"))
        cluster = SlurmCluster(root)
        _shared["previous_conf"] = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(cluster.conf)
        try:
            cluster.start()
        except BaseException:
            _stop(cluster)
            raise
        _shared["cluster"] = cluster
    _shared["users"] += 1
    try:
        yield _shared["cluster"]
    finally:
        _shared["users"] -= 1
        if _shared["users"] == 0:
            cluster, _shared["cluster"] = _shared["cluster"], None
            _stop(cluster)


def _stop(cluster: SlurmCluster) -> None:
    cluster.stop()
    previous = _shared["previous_conf"]
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous
    shutil.rmtree(cluster.root, ignore_errors=True)


@contextmanager
def two_host_slurm(prefix: str, prepare=None, **options) -> Iterator[tuple[object, SlurmCluster]]:
    """A Slurm cluster of two test hosts (tests/hosts.py): yields ``(hosts, cluster)`` with
    ``SLURM_CONF`` pointing at it, and restores both afterwards. ``prepare(hosts)`` runs before
    the cluster starts (a hosts file to rewrite, say); ``options`` go to :class:`SlurmCluster`.
    Skips without Slurm's binaries or the hosts' needs."""
    from tests import hosts as test_hosts
    from tests.conftest import skip_without

    if missing_binaries():
        skip_without("slurm", f"missing: {', '.join(missing_binaries())}")
    test_hosts.skip_if_unavailable()
    before = os.environ.get("SLURM_CONF")
    with test_hosts.test_hosts(2) as hosts:
        if prepare is not None:
            prepare(hosts)
        cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix=prefix)), hosts=hosts, **options)
        try:
            cluster.start()
            os.environ["SLURM_CONF"] = str(cluster.conf)
            yield hosts, cluster
        finally:
            cluster.stop()
            if before is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = before


#: What runs a rank or its node's launch on a test host: none of it may outlive a job.
JOB_WORDS = ("trainforge.trainer.train", "node_preflight", "torch.distributed.run")


def job_logs(backend, job) -> str:
    """A Slurm job's log and every other node's console (``ranks/node-<N>.log``), joined."""
    folder = backend.job_dir(job.identity)
    parts = [folder / "job.log", *sorted((folder / "ranks").glob("node-*.log"))]
    return "\n".join(p.read_text(errors="replace") for p in parts if p.exists())


def newest_step(log: Path) -> int:
    """The newest step the trainer's log lines in ``log`` show (0: none yet)."""
    found = re.findall(r"step (\d+)/\d+ \|", log.read_text(errors="replace")) if log.exists() else []
    return int(found[-1]) if found else 0
