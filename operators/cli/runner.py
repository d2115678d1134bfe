"""Run one pipeline on this machine through Airflow, the way ``make demo`` does.

Steps: prepare ``AIRFLOW_HOME`` (inside ``TRAINFORGE_HOME``, SQLite metadata DB), start an MLflow
tracking server on loopback unless ``MLFLOW_TRACKING_URI`` is already set (stopped at the end,
also on failure), run ``airflow dags test <dag_id>``, then read back what the run recorded —
Airflow's task states and the MLflow run — and print a summary. What the console shows of
Airflow's output is trainforge.cli.runner_console's; the summary is trainforge.cli.runner_summary's.

With ``engine`` (``trainforge run SPEC --engine ray``) the spec is run on another engine: a
derived spec with ``training.engine`` switched (trainforge.cli.engine_switch) is written to
``TRAINFORGE_HOME/specs/`` and run instead. For ``ray``, a local Ray head is started on loopback
for the run (and stopped at the end, also on failure) unless ``RAY_API_SERVER_ADDRESS``,
``RAY_ADDRESS`` or the spec's ``training.ray.address`` already answers the Ray job API.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from trainforge.cli.engine_switch import derived_spec, write_spec
from trainforge.cli.runner_console import ConsoleFilter, failed_task_tracebacks, retry_delays
from trainforge.cli.runner_summary import collect_summary, print_summary
from trainforge.engines.base import JobState
from trainforge.engines.local.backend import LocalBackend
from trainforge.engines.descriptors import get_engine
from trainforge.errors import BackendError
from trainforge.mlflow_setup import start_server
from trainforge.mlflow_setup.errors import ServerStartError
from trainforge.paths import trainforge_home
from trainforge.pipeline.spec import PipelineSpec

log = logging.getLogger(__name__)

# The DAG file trainforge writes into the Airflow home it runs (the same one line a deployment
# copies into its DAGs folder): it compiles the specs TRAINFORGE_PIPELINES names. Its text names
# both "airflow" and "dag": Airflow's safe-mode parsing skips a Python file that lacks either.
DAG_FILE = '''"""Airflow DAGs of the trainforge pipelines (written by trainforge; the specs come from
TRAINFORGE_PIPELINES)."""

from trainforge.dag_files import folder_dags

globals().update(folder_dags(__file__))
'''


def airflow_env(home: Path, pipelines: list[Path] | None = None,
                dags_folder: Path | None = None) -> dict[str, str]:
    """Environment for Airflow commands run by trainforge on this machine.

    ``dags_folder`` is the DAGs folder to serve; without it, ``AIRFLOW_HOME/dags`` holding
    :data:`DAG_FILE` (compiling ``pipelines``). The plugin comes from the installed package's
    entry point; the plugins folder is an empty one inside ``AIRFLOW_HOME``.
    """
    airflow_home = home / "airflow"
    airflow_home.mkdir(parents=True, exist_ok=True)
    if dags_folder is None:
        dags_folder = airflow_home / "dags"
        dags_folder.mkdir(exist_ok=True)
        dag_file = dags_folder / "trainforge_pipelines.py"
        if not dag_file.is_file() or dag_file.read_text() != DAG_FILE:
            tmp = dag_file.with_name(f".{dag_file.name}.tmp-{os.getpid()}")
            tmp.write_text(DAG_FILE)
            os.replace(tmp, dag_file)
    plugins_folder = airflow_home / "plugins"
    plugins_folder.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.update({
        "TRAINFORGE_HOME": str(home),
        "AIRFLOW_HOME": str(airflow_home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(plugins_folder),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{airflow_home / 'airflow.db'}",
        "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "120",
        "AIRFLOW__LOGGING__COLORED_CONSOLE_LOG": "False",
        "NO_COLOR": "1",
        "PYTHONUNBUFFERED": "1",
    })
    if pipelines:
        env["TRAINFORGE_PIPELINES"] = os.pathsep.join(str(p) for p in pipelines)
    return env


def _airflow(args: list[str], env: dict[str, str], **kwargs) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("airflow")
    return subprocess.run([str(exe), *args], env=env, text=True, **kwargs)


def _metadata_db(env: dict[str, str]) -> Path:
    """The SQLite metadata DB of this run's Airflow home (:func:`airflow_env` names it)."""
    return Path(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].removeprefix("sqlite:///"))


def _query(env: dict[str, str], sql: str, params: tuple[Any, ...]) -> list[sqlite3.Row]:
    """Rows of a read-only query on the run's metadata DB; none when it cannot be read.

    ``airflow dags test`` has exited by now, so the DB is at rest. Reading it directly costs
    milliseconds where each Airflow CLI start costs seconds of imports.
    """
    db = _metadata_db(env)
    if not db.is_file():
        return []
    try:
        with contextlib.closing(sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True, timeout=30)) as conn:
            conn.row_factory = sqlite3.Row
            return conn.execute(sql, params).fetchall()
    except sqlite3.Error as exc:
        log.warning("cannot read the DAG run from %s: %s", db, exc)
        return []


def _utc(value: str | None) -> dt.datetime | None:
    """A datetime column of the metadata DB (naive UTC in SQLite) as an aware datetime."""
    if not value:
        return None
    parsed = dt.datetime.fromisoformat(value)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)


def _latest_run(dag_id: str, env: dict[str, str]) -> dict[str, Any] | None:
    """The DAG's most recently started run: run_id, state and its times (ISO 8601, UTC)."""
    rows = _query(env, "SELECT run_id, state, logical_date, start_date, end_date FROM dag_run "
                       "WHERE dag_id = ? ORDER BY COALESCE(start_date, logical_date) DESC LIMIT 1",
                  (dag_id,))
    if not rows:
        return None
    run = dict(rows[0])
    for key in ("logical_date", "start_date", "end_date"):
        when = _utc(run[key])
        run[key] = when.isoformat() if when else None
    return {"dag_id": dag_id, **run}


def _task_times(dag_id: str, run_id: str, env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each task's state and duration in seconds (None while it has no start or end)."""
    rows = _query(env, "SELECT task_id, state, start_date, end_date FROM task_instance "
                       "WHERE dag_id = ? AND run_id = ? AND map_index = -1", (dag_id, run_id))
    times = {}
    for row in rows:
        start, end = _utc(row["start_date"]), _utc(row["end_date"])
        seconds = (end - start).total_seconds() if start and end else None
        times[row["task_id"]] = {"state": row["state"], "seconds": seconds}
    return times


def _stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


@dataclasses.dataclass
class StoppedJobs:
    """What stopping an interrupted run found: job keys (or Ray submission ids) per outcome.

    ``cancelled``: still running, cancelled by the runner. ``already_cancelled``: submitted by
    this run and already cancelled when the runner looked, usually by its task's ``on_kill``
    when Airflow was stopped.
    """

    cancelled: list[str] = dataclasses.field(default_factory=list)
    already_cancelled: list[str] = dataclasses.field(default_factory=list)

    def __iadd__(self, other: StoppedJobs) -> StoppedJobs:
        self.cancelled += other.cancelled
        self.already_cancelled += other.already_cancelled
        return self

    def message(self) -> str:
        """One console line saying which jobs were cancelled, and by whom."""
        parts = []
        if self.cancelled:
            parts.append(f"cancelled {len(self.cancelled)} running job(s): "
                         f"{', '.join(self.cancelled)}")
        if self.already_cancelled:
            parts.append(f"{len(self.already_cancelled)} job(s) already cancelled by their task "
                         f"when Airflow stopped: {', '.join(self.already_cancelled)}")
        if not parts:
            return "No training job of this run was running."
        text = "; ".join(parts)
        return text[0].upper() + text[1:]


def stop_local_jobs(home: Path, dag_id: str, since_epoch_s: float | None = None) -> StoppedJobs:
    """Cancel every still-running local job of ``dag_id`` (after the user interrupted a run).

    Jobs of ``dag_id`` submitted at or after ``since_epoch_s`` (the run's start, Unix seconds)
    that are already cancelled are listed as ``already_cancelled``; without it none are.
    """
    backend = LocalBackend(home / "runs")
    stopped = StoppedJobs()
    for request in sorted((home / "runs").glob("*/request.json")):
        try:
            identity = json.loads(request.read_text()).get("identity", {})
            submitted = request.stat().st_mtime
        except (OSError, json.JSONDecodeError):
            continue
        if identity.get("dag_id") != dag_id:
            continue
        handle = {"engine": "local", "key": request.parent.name, "job_dir": str(request.parent),
                  "identity": identity}
        state = backend.status(handle).state
        if not state.terminal:
            backend.cancel(handle, grace_s=15)
            stopped.cancelled.append(request.parent.name)
        elif (state is JobState.CANCELLED and since_epoch_s is not None
              and submitted >= since_epoch_s):
            stopped.already_cancelled.append(request.parent.name)
    return stopped


def cancel_ray_jobs(address: str, dag_id: str, since_epoch_s: float | None = None) -> StoppedJobs:
    """Stop every unfinished Ray job of ``dag_id`` on ``address`` (after an interrupted run).

    Jobs of ``dag_id`` started at or after ``since_epoch_s`` that are already stopped are
    listed as ``already_cancelled``.
    """
    from ray.job_submission import JobStatus

    from trainforge.engines.ray.backend import RayBackend

    backend = RayBackend(address=address)
    stopped = StoppedJobs()
    for info in backend._client().list_jobs():
        meta = info.metadata or {}
        if meta.get("trainforge.dag_id") != dag_id:
            continue
        if not info.status.is_terminal():
            backend.cancel({"submission_id": info.submission_id, "key": meta.get("trainforge.key")},
                           grace_s=15)
            stopped.cancelled.append(info.submission_id)
        elif (info.status == JobStatus.STOPPED and since_epoch_s is not None
              and (info.start_time or 0) / 1000 >= since_epoch_s):
            stopped.already_cancelled.append(info.submission_id)
    return stopped


@contextlib.contextmanager
def termination_as_interrupt() -> Iterator[None]:
    """While open, SIGTERM and SIGHUP (a closed terminal, ``timeout``, a CI job cancelled, a
    service manager) raise :class:`KeyboardInterrupt` like Ctrl-C, so they take the same way out:
    for ``trainforge run``, Airflow stopped, this run's jobs cancelled and named, the MLflow
    server and Ray head this run started stopped; for ``make airflow``
    (:mod:`trainforge.cli.standalone`), airflow standalone's process tree and the MLflow server
    stopped. Outside the main thread (where Python delivers signals) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"{signal.Signals(signum).name} received")

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_pipeline(spec: PipelineSpec, spec_file: Path, console: Console,
                 summary_json: Path | None = None, engine: str | None = None) -> bool:
    """Run ``spec`` through ``airflow dags test``; print and return whether the run succeeded.

    ``engine``: run on this engine instead of the spec's (see the module docstring).
    """
    home = trainforge_home()
    if engine and engine != spec.training.engine:
        try:
            spec = derived_spec(spec, engine)
        except ValueError as err:
            console.print(Text(f"{spec_file}: cannot run on engine {engine!r}: {err}", style="red"))
            return False
        spec_file = home / "specs" / f"{spec_file.stem}.{engine}.yaml"
        console.print(f"Engine {engine}: running the derived spec {spec_file}")
    env = airflow_env(home, [spec_file])
    log_dir = home / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    console.print(f"[bold]trainforge[/]: home {home}")
    migrate = _airflow(["db", "migrate"], env, capture_output=True)
    if migrate.returncode != 0:
        console.print(migrate.stdout[-4000:], migrate.stderr[-4000:], markup=False)
        return False
    with contextlib.ExitStack() as stack:
        stack.enter_context(termination_as_interrupt())
        tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not tracking_uri:
            # Port 5000 when free, so the run URLs printed below stay valid later under
            # `make mlflow` (same store, same port); any free port otherwise.
            try:
                server = stack.enter_context(
                    start_server(home / "mlflow", host="127.0.0.1", port=5000))
            except ServerStartError:
                server = stack.enter_context(
                    start_server(home / "mlflow", host="127.0.0.1", port=0))
            tracking_uri = server.url
            console.print(f"MLflow tracking server: {tracking_uri}")
        env["MLFLOW_TRACKING_URI"] = tracking_uri
        # An engine with a development cluster (Ray: a head on loopback) gets one for the run,
        # unless the spec's own cluster answers; the spec then runs with its address.
        engine = get_engine(spec.training.engine)
        start_cluster = engine.dev_cluster_starter()
        cluster_values = None
        if start_cluster is not None:
            try:
                cluster_values = start_cluster(
                    spec.training, stack, lambda line: console.print(line, markup=False), env)
            except BackendError as err:
                console.print(str(err), markup=False)
                return False
            block = spec.training.engine_block
            if cluster_values and any(getattr(block, key) != value
                                      for key, value in cluster_values.items()):
                spec = derived_spec(spec, engine.name, cluster_values)
                stem = spec_file.stem.removesuffix(f".{engine.name}")
                spec_file = home / "specs" / f"{stem}.{engine.name}.yaml"
        ray_address = (cluster_values or {}).get("address") if engine.name == "ray" else None
        if spec_file.parent == home / "specs":
            write_spec(spec, spec_file)
            env["TRAINFORGE_PIPELINES"] = str(spec_file)
        log_path = log_dir / f"{spec.dag_id}-{dt.datetime.now():%Y%m%d-%H%M%S}.log"
        console.print(f"Running DAG {spec.dag_id} through `airflow dags test` "
                      f"(full log: {log_path})", soft_wrap=True)
        run_started = time.time()
        with open(log_path, "w", encoding="utf-8", buffering=1) as full_log:
            proc = subprocess.Popen(
                [str(Path(sys.executable).with_name("airflow")), "dags", "test", spec.dag_id],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True,
            )
            assert proc.stdout is not None
            console_filter = ConsoleFilter(retry_delays(spec))
            try:
                for line in proc.stdout:
                    full_log.write(line)
                    shown = console_filter(line)
                    if shown is not None:
                        console.print(shown, markup=False, highlight=False, soft_wrap=True)
                rc = proc.wait()
            except KeyboardInterrupt:
                console.print("Interrupted: stopping Airflow and cancelling this pipeline's jobs")
                _stop_group(proc)
                stopped = stop_local_jobs(home, spec.dag_id, since_epoch_s=run_started)
                if ray_address:
                    stopped += cancel_ray_jobs(ray_address, spec.dag_id, run_started)
                console.print(stopped.message(), markup=False)
                raise
        airflow_run = _latest_run(spec.dag_id, env)
        if airflow_run is None:
            console.print(f"[red]no DAG run recorded for {spec.dag_id} (airflow exit code {rc})[/]")
            return False
        times = _task_times(spec.dag_id, airflow_run["run_id"], env)
        summary = collect_summary(spec, tracking_uri, airflow_run, times)
        summary["wall_seconds"] = round(time.monotonic() - started, 1)
        print_summary(summary, console)
        failed = [task for task, info in times.items() if info["state"] == "failed"]
        for line in failed_task_tracebacks(log_path, failed) if failed else ():
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        if summary_json:
            Path(summary_json).write_text(json.dumps(summary, indent=2, default=str))
    ok = airflow_run.get("state") == "success"
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        console.print(f"The MLflow server of this run has stopped; `{sys.executable} -m "
                      f"trainforge.mlflow_setup serve --home {home / 'mlflow'} --port 5000` "
                      "serves the same store again on http://127.0.0.1:5000 (in the checkout: "
                      "`make mlflow`, or `make airflow` for both UIs).", soft_wrap=True)
    console.print(("[green]Pipeline succeeded[/]" if ok else "[red]Pipeline failed[/]")
                  + f" in {time.monotonic() - started:.0f} s")
    return ok
