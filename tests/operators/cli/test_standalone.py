"""``make airflow`` (``python -m trainforge.cli.standalone``) stopped by SIGTERM or SIGHUP stops
everything it started: airflow standalone with all its parts, and the MLflow server.

A real airflow standalone and MLflow server, on free loopback ports, under a temporary
TRAINFORGE_HOME. Every process of the run carries that home in its environment, which is how
the test finds them all, also those started after it last looked.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.ports import free_ports

pytestmark = pytest.mark.airflow

START_LIMIT_S = 240.0  # MLflow healthy and airflow standalone running its parts
STOP_LIMIT_S = 60.0  # the stop's own grace periods: 30 s for Airflow, 10 s for MLflow


def _answers(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _of_home(home: Path) -> list[psutil.Process]:
    """The live processes whose environment names ``home`` as TRAINFORGE_HOME."""
    found = []
    for proc in psutil.process_iter():
        try:
            mine = proc.environ().get("TRAINFORGE_HOME") == str(home)
            if mine and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _wait_for(condition, limit_s: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert proc.poll() is None, (f"trainforge.cli.standalone exited ({proc.returncode}) "
                                     f"before {what}")
        assert time.monotonic() < deadline, f"no {what} within {limit_s:.0f} s"
        time.sleep(0.5)


# SIGHUP takes SIGTERM's handler: a second route, in the heavy tier.
@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGHUP, marks=pytest.mark.heavy)],
                         ids=lambda s: s.name)
def test_a_termination_signal_stops_airflow_and_mlflow(tmp_path, signum):
    home = tmp_path / "home"
    dags = tmp_path / "dags"
    dags.mkdir()
    airflow_port, mlflow_port, worker_logs, trigger_logs = free_ports(4)  # four distinct ports
    env = {**os.environ, "TRAINFORGE_HOME": str(home),
           # its log servers off Airflow's default ports, which another Airflow may hold
           "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(worker_logs),
           "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(trigger_logs)}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("AIRFLOW_HOME", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainforge.cli.standalone", "--dags-folder", str(dags),
         "--airflow-port", str(airflow_port), "--mlflow-port", str(mlflow_port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: _answers(mlflow_port), START_LIMIT_S, "MLflow server", proc)

        def airflow_has_parts() -> bool:
            standalone = [p for p in _of_home(home) if "standalone" in " ".join(p.cmdline())
                          and p.pid != proc.pid]
            return any(p.children() for p in standalone)

        _wait_for(airflow_has_parts, START_LIMIT_S, "airflow standalone with its parts", proc)
        assert len(_of_home(home)) >= 3
        proc.send_signal(signum)
        deadline = time.monotonic() + STOP_LIMIT_S
        while (_of_home(home) or proc.poll() is None) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [f"{p.pid} {' '.join(p.cmdline())[:80]}" for p in _of_home(home)]
        assert not left, f"alive {STOP_LIMIT_S:.0f} s after {signum.name}: {left}"
        assert proc.returncode == 0
        assert _bindable(mlflow_port) and _bindable(airflow_port)
    finally:
        for leftover in _of_home(home):  # only this test's processes
            try:
                leftover.kill()
            except psutil.Error:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
