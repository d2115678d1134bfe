"""The MLflow server's process group and ports: find a free port, tell a port in use, stop the
whole group (uvicorn and its workers) with SIGTERM, then SIGKILL."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time

import psutil

from trainforge.mlflow_setup.errors import ServerStopError

log = logging.getLogger(__name__)


def free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # Same option as the server's own bind, so TIME_WAIT leftovers do not count as in use.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def group_members(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of process group ``pgid``."""
    members = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def group_listens_on(pgid: int, port: int) -> bool:
    """Whether a process of group ``pgid`` listens on TCP ``port``: the server that answered
    on the port is the one started, not another that took the port first."""
    for proc in group_members(pgid):
        try:
            if any(conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port
                   for conn in proc.net_connections("tcp")):
                return True
        except psutil.Error:
            continue
    return False


def binds_later(process: subprocess.Popen[bytes], port: int, timeout_s: float) -> bool:
    """Another server answered on ``port``: wait until ``process``'s group listens there (True)
    or it exits (False). An MLflow server migrates its store before it binds, so it is left to
    fail its bind on its own, not killed mid-migration (a SQLite store would stay half-migrated
    for the next start)."""
    deadline = time.monotonic() + max(timeout_s, 60.0)
    while process.poll() is None and time.monotonic() < deadline:
        if group_listens_on(process.pid, port):
            return True
        time.sleep(0.25)
    return False


def terminate_group(pgid: int, grace_s: float, process: subprocess.Popen[bytes] | None) -> None:
    def wait_gone(budget_s: float) -> bool:
        deadline = time.monotonic() + budget_s
        while True:
            if process is not None:
                process.poll()  # reap our own child so it does not linger as a zombie
            if not group_members(pgid):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)

    for sig, budget_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        if wait_gone(budget_s):
            return
        log.warning("MLflow server group %d still alive %.1f s after %s", pgid, budget_s, sig.name)
    raise ServerStopError(pgid, grace_s + 5.0)
