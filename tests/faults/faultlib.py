"""Helpers of the fault-injection suite: a real ``airflow standalone`` driven over REST, polling.

:class:`AirflowStandalone` runs ``airflow standalone`` (scheduler, DAG processor, triggerer, API
server) on loopback, with this checkout's ``dags/`` compiling the given specs, and talks to it
through Airflow's public REST API the way the UI does (mark failed, mark success, clear).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
from tests.ports import free_port, free_ports  # noqa: F401 - free_port: the fault tests' name for it


def make_home(root: Path, corpus: Path) -> Path:
    """A ``TRAINFORGE_HOME`` whose ``corpus/shakespeare`` is the cached corpus."""
    (root / "corpus").mkdir(parents=True, exist_ok=True)
    link = root / "corpus" / "shakespeare"
    if not link.exists():
        link.symlink_to(corpus, target_is_directory=True)
    return root


def wait_for(what: str, check, timeout_s: float, interval_s: float = 0.5):
    """Poll ``check()`` until it returns a truthy value; fail the test with ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what} (last: {last!r})")



# -- helpers of the fault tests (job folders, Airflow logs, MLflow runs) --------------------

CANCEL_WITHIN_S = 90  # trigger cancellation + the local engine's cancel grace, on a busy machine


def job_processes(path: Path) -> list[psutil.Process]:
    """Live processes whose command line names this job's folder (supervisor, torchrun, ranks)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(str(path) in part for part in proc.info["cmdline"] or ()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def steps_logged(path: Path) -> int:
    """The newest ``step N/M`` rank 0 printed into the job log (0 when none yet)."""
    try:
        text = (path / "job.log").read_text(errors="replace")
    except OSError:
        return 0
    found = re.findall(r"step (\d+)/\d+", text)
    return int(found[-1]) if found else 0


def exit_record(path: Path) -> dict | None:
    try:
        return json.loads((path / "exit.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def airflow_logs(server, run_id: str, dag_id: str) -> str:
    """Every task and trigger log of one DAG run (the trigger's lines land in the task's log)."""
    root = Path(server.env["AIRFLOW_HOME"]) / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}"
    return "\n".join(p.read_text(errors="replace") for p in root.rglob("*.log*"))


def mlflow_steps(mlflow_url: str, run_id: str) -> list[int]:
    """Steps of ``train_loss`` in the DAG run's MLflow run, in logging order."""
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_url)
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        f"tags.`trainforge.airflow_run_id` = '{run_id}'",
    )
    assert len(runs) == 1, runs
    return [m.step for m in client.get_metric_history(runs[0].info.run_id, "train_loss")]


def has_dag(server, dag_id: str) -> bool:
    import urllib.error

    try:
        return server.api("GET", f"/api/v2/dags/{dag_id}").get("dag_id") == dag_id
    except urllib.error.HTTPError:
        return False


def task_process(ti_id: str) -> psutil.Process | None:
    """The Task SDK child running one task instance (``airflow worker -- <id>``), not its
    supervisor (``airflow worker -- LocalExecutor: <id>``, which forwards SIGTERM but dies of
    SIGKILL alone): the process naming the id whose parent names it too."""
    named = {}
    for proc in psutil.process_iter(["cmdline", "status", "ppid"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            title = " ".join(proc.info["cmdline"] or ())
        except psutil.Error:
            continue
        if "airflow worker" in title and ti_id in title:
            named[proc.pid] = proc
    children = [p for p in named.values() if p.info["ppid"] in named]
    return children[0] if len(children) == 1 else None


def mlflow_run(mlflow_url: str, run_id: str):
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_url)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              f"tags.`trainforge.airflow_run_id` = '{run_id}'")
    assert len(runs) == 1, runs
    return runs[0]


def wait_run_end(server, dag_id: str, run_id: str, timeout_s: float = 900) -> str:
    return wait_for("the run to end", lambda: server.run_state(dag_id, run_id)
                    in ("success", "failed") and server.run_state(dag_id, run_id), timeout_s, 0.5)


def wait_job_cancelled(path: Path) -> dict:
    """Wait until the local job in ``path`` has ended cancelled and none of its processes is
    left; its exit record."""
    record = wait_for("the job to be cancelled", lambda: exit_record(path), CANCEL_WITHIN_S)
    assert record["cancelled"] is True, record
    wait_for("no process of the job", lambda: not job_processes(path), 30)
    return record


def _airflow_itself(proc: psutil.Process) -> bool:
    """A process of Airflow's own (a component, an idle worker), not a task's."""
    cmd = proc.cmdline()
    if len(cmd) >= 3 and cmd[1].endswith("airflow"):
        return cmd[2] in ("standalone", "scheduler", "triggerer", "dag-processor")
    return " ".join(cmd).startswith(("airflow api_server", "airflow serve-logs",
                                      "airflow worker -- LocalExecutor: <idle>"))


class AirflowStandalone:
    """``airflow standalone`` on loopback with the suite's pipeline; REST calls as ``admin``."""

    def __init__(self, home: Path, mlflow_url: str, pipelines: list[Path]):
        from trainforge.cli.runner import airflow_env

        self.home = home
        # the API server's port and the scheduler's and triggerer's log servers' (8793 and 8794
        # by default, which another Airflow on this machine, the other test worker's, may hold)
        self.port, worker_logs, trigger_logs = free_ports(3)
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = airflow_env(home, pipelines)
        airflow_home = Path(self.env["AIRFLOW_HOME"])
        passwords = airflow_home / "passwords.json"
        passwords.write_text(json.dumps({"admin": "admin"}))
        self.env.update({
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), self.env.get("PATH", "")]),
            "MLFLOW_TRACKING_URI": mlflow_url,
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(worker_logs),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(trigger_logs),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__PARALLELISM": "2",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        })
        self.proc: subprocess.Popen | None = None
        self.extra: list[subprocess.Popen] = []
        self._token: str | None = None
        self.log_path = home / "standalone.log"

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, timeout_s: float = 300.0, ready_dag: str = "fault_tiny") -> None:
        """Start it; ready once the API serves DAG ``ready_dag``."""
        exe = str(Path(sys.executable).with_name("airflow"))
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen([exe, "standalone"], env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

        def ready():
            if self.proc.poll() is not None:
                pytest.fail(f"airflow standalone exited {self.proc.returncode}: {self.tail()}")
            try:
                self._token = None
                return self.api("GET", f"/api/v2/dags/{ready_dag}").get("dag_id") == ready_dag
            except (OSError, urllib.error.HTTPError):
                return False

        wait_for(f"airflow standalone to serve the {ready_dag} DAG", ready, timeout_s)

    def stop(self) -> None:
        """SIGTERM, a running task's processes given up to 30 s to end (and their job); then
        SIGKILL: Airflow's own processes are not waited for (the API server alone took 6 s,
        idle workers ignored SIGINT and SIGTERM: a stop took 30 s)."""
        from tests.proctree import stop_tree

        stop_tree([*self.extra, self.proc], grace_s=30, no_grace=_airflow_itself)

    def tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # -- components -----------------------------------------------------------------------------
    def component_processes(self, name: str) -> list:
        """Live processes of one Airflow component (``triggerer``, ``scheduler``...)."""
        import psutil

        roots = [p.pid for p in [self.proc, *self.extra] if p is not None]
        found = []
        for root in roots:
            try:
                procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
            except psutil.Error:
                continue
            for proc in procs:
                try:
                    cmd = proc.cmdline()
                except psutil.Error:
                    continue
                if len(cmd) >= 3 and cmd[1].endswith("airflow") and cmd[2] == name:
                    found.append(proc)
        return found

    def restart_triggerer(self) -> None:
        """Stop the triggerer (SIGTERM, like a rolling deploy) and start a fresh one."""
        import psutil

        old = self.component_processes("triggerer")
        assert old, "no triggerer process found"
        for proc in old:
            proc.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(old, timeout=60)
        for proc in alive:
            proc.kill()
        exe = str(Path(sys.executable).with_name("airflow"))
        with open(self.home / "triggerer.log", "ab") as out:
            self.extra.append(subprocess.Popen([exe, "triggerer"], env=self.env, stdout=out,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               start_new_session=True))

    # -- REST -------------------------------------------------------------------------------------
    def token(self) -> str:
        if self._token is None:
            out = self._request("POST", "/auth/token", {"username": "admin", "password": "admin"},
                                auth=False)
            self._token = out["access_token"]
        return self._token

    def _request(self, method: str, path: str, body: Any = None, auth: bool = True) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if auth:
            req.add_header("Authorization", f"Bearer {self.token()}")
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else {}

    def api(self, method: str, path: str, body: Any = None) -> Any:
        return self._request(method, path, body)

    def trigger(self, dag_id: str, conf: dict[str, Any] | None = None) -> str:
        run = self.api("POST", f"/api/v2/dags/{dag_id}/dagRuns",
                       {"logical_date": None, "conf": conf or {}})
        return run["dag_run_id"]

    def ti(self, dag_id: str, run_id: str, task_id: str) -> dict[str, Any]:
        from urllib.parse import quote

        return self.api("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id)}/taskInstances/"
                               f"{task_id}")

    def set_state(self, dag_id: str, run_id: str, task_id: str, new_state: str,
                  downstream: bool = False) -> None:
        """What the UI's "mark failed" / "mark success" does (``downstream``: "with
        downstream")."""
        from urllib.parse import quote

        body: dict[str, Any] = {"new_state": new_state}
        if downstream:
            body["include_downstream"] = True
        self.api("PATCH", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id)}/taskInstances/"
                          f"{task_id}", body)

    def clear(self, dag_id: str, run_id: str, task_id: str) -> None:
        """What the UI's "clear" does for one task (downstream not included)."""
        self.api("POST", f"/api/v2/dags/{dag_id}/clearTaskInstances",
                 {"dag_run_id": run_id, "task_ids": [task_id], "dry_run": False,
                  "only_failed": False, "reset_dag_runs": True})

    def end_leftovers(self) -> None:
        """After a test: fail every unfinished DAG run and cancel every job still running, so
        that one failed test neither blocks the next run (``max_active_runs``) nor leaves a
        training process behind."""
        from urllib.parse import quote

        from trainforge.engines.local.backend import LocalBackend

        for dag in self.api("GET", "/api/v2/dags?limit=100").get("dags", []):
            runs = self.api("GET", f"/api/v2/dags/{dag['dag_id']}/dagRuns?limit=100")
            for run in runs.get("dag_runs", []):
                if run["state"] in ("queued", "running"):
                    self.api("PATCH", f"/api/v2/dags/{dag['dag_id']}/dagRuns/"
                                      f"{quote(run['dag_run_id'])}", {"state": "failed"})
        backend = LocalBackend(self.home / "runs")
        for job_dir in sorted((self.home / "runs").glob("*/request.json")):
            handle = {"engine": "local", "key": job_dir.parent.name,
                      "job_dir": str(job_dir.parent), "identity": {}}
            backend.cancel(handle, grace_s=10)

    def run_state(self, dag_id: str, run_id: str) -> str:
        from urllib.parse import quote

        return self.api("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id)}")["state"]

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> str:
        from urllib.parse import quote

        out = self.api("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id)}/taskInstances/"
                              f"{task_id}/logs/{try_number}?full_content=true")
        content = out.get("content", "")
        if isinstance(content, list):
            return "\n".join(c.get("event", "") if isinstance(c, dict) else str(c) for c in content)
        return str(content)


class SmtpSink:
    """A minimal SMTP server on loopback that keeps every message it is sent, for Airflow's
    SMTP connection (``smtp_default``) to mail to: enough of RFC 5321 for smtplib and
    aiosmtplib without TLS or authentication (EHLO/HELO, MAIL, RCPT, DATA, RSET, NOOP, QUIT)."""

    def __init__(self) -> None:
        import socketserver
        import threading

        self.messages: list[str] = []
        sink = self

        class Session(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                self.wfile.write(b"220 127.0.0.1 test sink\r\n")
                for raw in self.rfile:
                    verb = raw.decode(errors="replace").strip().split(" ", 1)[0].upper()
                    if verb == "EHLO":
                        self.wfile.write(b"250-127.0.0.1\r\n250 8BITMIME\r\n")
                    elif verb == "DATA":
                        self.wfile.write(b"354 end with <CRLF>.<CRLF>\r\n")
                        lines = []
                        for line in self.rfile:
                            if line in (b".\r\n", b".\n"):
                                break
                            lines.append(line.decode(errors="replace"))
                        sink.messages.append("".join(lines))
                        self.wfile.write(b"250 queued\r\n")
                    elif verb == "QUIT":
                        self.wfile.write(b"221 bye\r\n")
                        return
                    else:  # HELO, MAIL, RCPT, RSET, NOOP
                        self.wfile.write(b"250 ok\r\n")

        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Session)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def connection(self) -> str:
        """``AIRFLOW_CONN_SMTP_DEFAULT`` for this sink."""
        return json.dumps({"conn_type": "smtp", "host": "127.0.0.1", "port": self.port,
                           "extra": {"disable_tls": True, "disable_ssl": True,
                                     "from_email": "airflow@example.org"}})

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
