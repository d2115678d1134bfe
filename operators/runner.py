"""Run one pipeline on this machine through Airflow, the way ``make demo`` does.

Steps: prepare ``AIRFLOW_HOME`` (inside ``TRAINFORGE_HOME``, SQLite metadata DB), start an MLflow
tracking server on loopback unless ``MLFLOW_TRACKING_URI`` is already set (stopped at the end,
also on failure), run ``airflow dags test <dag_id>``, then read back what the run recorded —
Airflow's task states and the MLflow run — and print a summary.

With ``engine`` (``trainforge run SPEC --engine ray``) the spec is run on another engine: a
derived spec with ``training.engine`` switched is written to ``TRAINFORGE_HOME/specs/`` and run
instead. For ``ray``, a local Ray head is started on loopback for the run (and stopped at the
end, also on failure) unless ``RAY_API_SERVER_ADDRESS``, ``RAY_ADDRESS`` or the spec's
``training.ray.address`` already answers the Ray job API.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from trainforge.paths import trainforge_home
from trainforge.pipeline.model import PipelineSpec

_STRUCTLOG = re.compile(r"^\S+Z \[(?P<level>\w+)\s*\] (?P<event>.*?) \[(?P<logger>[\w.]+)\] loc=")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b[\w.]*: \S")
_TASK_START = re.compile(r"\[DAG TEST\] starting task_id=(\S+)")
_TASK_END = re.compile(r"\[DAG TEST\] end task task_id=(\S+)")


# Teardown tasks (operators/teardown.py; its CLOSE_RUN_TASK_ID, written out: importing it would
# import Airflow into the CLI): not pipeline stages, so the summary lists them apart.
TEARDOWN_TASK_IDS = ("close_run",)
_NEW_STATE = re.compile(r"\bTask instance state updated\b.*\bnew_state=(\w+)")
_TASK_ERROR = re.compile(r"\[DAG TEST\] Error running task")
# How a task's final Airflow state reads on the console.
_OUTCOMES = {"success": "success", "failed": "failed", "up_for_retry": "up for retry",
             "upstream_failed": "upstream failed", "skipped": "skipped", "removed": "removed"}


class ConsoleFilter:
    """The part of each `airflow dags test` output line worth showing on the console.

    Shown: task starts and ends with the task's outcome, trainforge's own log lines (operators,
    trigger, trainer rank 0) and every warning or error; Airflow's internal chatter stays in the
    full log file. Stateful: `airflow dags test` runs one task at a time, and the last state
    Airflow's execution API recorded for it (``Task instance state updated ... new_state=X``)
    before its ``[DAG TEST] end task`` line is its outcome.
    """

    def __init__(self) -> None:
        self._state: str | None = None

    def __call__(self, line: str) -> str | None:
        """The console text for ``line`` (one line of output), or None to show nothing."""
        if new_state := _NEW_STATE.search(line):  # key-value fields come before its loc=
            self._state = new_state[1]
            return None
        match = _STRUCTLOG.match(line)
        if not match:
            # Of a traceback, only the exception lines: "package.SomeError: what went wrong".
            if _EXCEPTION_LINE.match(line):
                return f"    !! {line.rstrip()}"
            if line.startswith("  - "):  # the bullet list of a trainforge failure message
                return f"    !! {line.strip()}"
            return None
        level, event, logger = match["level"], match["event"], match["logger"]
        if started := _TASK_START.search(event):
            self._state = None
            return f"==> task {started[1]}"
        if _TASK_ERROR.search(event):
            # dags test marks a task whose run raised (without reporting a state) failed.
            self._state = self._state if self._state in ("success", "up_for_retry") else "failed"
        if ended := _TASK_END.search(event):
            outcome = _OUTCOMES.get(self._state or "", self._state or "ended, state unknown")
            self._state = None
            return f"<== task {ended[1]}: {outcome}"
        if "TrainingJobTrigger" in logger:
            # "[job-key] [default0]:<time> rank0 INFO trainforge.trainer.train: step 10/300 | ..."
            return "    " + re.sub(r"^\[[^\]]+\] (\[default\d+\]:)?(\S+ \S+ )?", "", event)
        if logger.startswith(("airflow.task.operators.trainforge.", "operators.", "trainforge")):
            return f"    {event}"
        if level in ("warning", "error", "critical") and "py.warnings" not in logger:
            return f"    {level.upper()}: {event} [{logger}]"
        return None


def console_line(line: str) -> str | None:
    """:class:`ConsoleFilter` for a single line seen on its own (no task state known)."""
    return ConsoleFilter()(line)


# The DAG file trainforge writes into the Airflow home it runs (the same one line a deployment
# copies into its DAGs folder): it compiles the specs TRAINFORGE_PIPELINES names.
DAG_FILE = '''"""trainforge pipelines (written by trainforge; the specs come from TRAINFORGE_PIPELINES)."""

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


def _json_output(stdout: str) -> Any:
    """The JSON document in an Airflow CLI's output (warnings may precede it on stdout)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(("[", "{")):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def _latest_run(dag_id: str, env: dict[str, str]) -> dict[str, Any] | None:
    out = _airflow(["dags", "list-runs", dag_id, "-o", "json"], env, capture_output=True)
    runs = _json_output(out.stdout)
    if not isinstance(runs, list):
        return None
    runs.sort(key=lambda r: r.get("start_date") or r.get("logical_date") or "")
    return runs[-1] if runs else None


def _task_times(dag_id: str, run_id: str, env: dict[str, str]) -> dict[str, dict[str, Any]]:
    out = _airflow(["tasks", "states-for-dag-run", dag_id, run_id, "-o", "json"], env,
                   capture_output=True)
    rows = _json_output(out.stdout)
    if not isinstance(rows, list):
        return {}
    times = {}
    for row in rows:
        start, end = row.get("start_date"), row.get("end_date")
        seconds = None
        if start and end:
            seconds = (dt.datetime.fromisoformat(end) - dt.datetime.fromisoformat(start)).total_seconds()
        times[row["task_id"]] = {"state": row.get("state"), "seconds": seconds}
    return times


def _stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    import signal

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
    from trainforge.engines.base import JobState
    from trainforge.engines.local.backend import LocalBackend

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


def cancel_running_jobs(home: Path, dag_id: str) -> list[str]:
    """Cancel every still-running local job of ``dag_id``; the keys of those cancelled."""
    return stop_local_jobs(home, dag_id).cancelled


def _count(value: float | None) -> int | None:
    """MLflow stores every metric as a float; counts go back to integers."""
    return None if value is None else int(round(value))


def split_teardown(task_times: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"stages": ..., "teardown": ...}``: the pipeline's stage tasks apart from its teardown
    tasks (``close_run``), which run after them and never decide the run's state."""
    return {"stages": {t: v for t, v in task_times.items() if t not in TEARDOWN_TASK_IDS},
            "teardown": {t: v for t, v in task_times.items() if t in TEARDOWN_TASK_IDS}}


def collect_summary(spec: PipelineSpec, tracking_uri: str, airflow_run: dict[str, Any],
                    task_times: dict[str, Any]) -> dict[str, Any]:
    """What the run recorded in MLflow, gathered for the summary."""
    from trainforge.hooks.mlflow import MlflowHook

    hook = MlflowHook(tracking_uri=tracking_uri)
    run_id = hook.find_run(spec.experiment_name, spec.dag_id, airflow_run["run_id"])
    summary: dict[str, Any] = {
        "dag_id": spec.dag_id,
        "airflow_run_id": airflow_run["run_id"],
        "state": airflow_run.get("state"),
        **split_teardown(task_times),
        "mlflow_run_id": run_id,
    }
    if run_id is None:
        return summary
    run = hook.client.get_run(run_id)
    metrics, tags, params = run.data.metrics, run.data.tags, run.data.params
    summary.update({
        "mlflow_run_url": f"{tracking_uri.rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{run_id}",
        "mlflow_run_status": run.info.status,
        "dataset_digest": tags.get("trainforge.dataset.digest"),
        "dataset_reused": tags.get("trainforge.dataset.reused") == "true",
        "train_tokens": _count(metrics.get("data/train_tokens")),
        "validation_tokens": _count(metrics.get("data/validation_tokens")),
        "train_documents": _count(metrics.get("data/train_documents")),
        "validation_documents": _count(metrics.get("data/validation_documents")),
        "steps_trained": _count(metrics.get("train/final_step")),
        "tokens_trained": _count(metrics.get("train/tokens_seen")),
        "final_train_loss": metrics.get("train/final_loss"),
        "val_loss": metrics.get("val/val_loss"),
        "val_perplexity": metrics.get("val/val_perplexity"),
        "unigram_perplexity": metrics.get("val/unigram_perplexity"),
        "val_bits_per_byte": metrics.get("val/val_bits_per_byte"),
        "checkpoint": tags.get("trainforge.validation.checkpoint"),
        "accounting": {k.split("/", 1)[1]: v for k, v in metrics.items()
                       if k.startswith("accounting/")},
        "currency": spec.cost.currency,
        "registered_model": tags.get("trainforge.registered_model"),
        "model_version": tags.get("trainforge.model_version"),
        "aliases": list(spec.registry.aliases)
        + (["champion"] if tags.get("trainforge.gate.champion_after") == tags.get(
            "trainforge.model_version") and tags.get("trainforge.model_version") else []),
        "gate_decision": tags.get("trainforge.gate.decision"),
        "gate_reason": tags.get("trainforge.gate.reason"),
        "champion_after": tags.get("trainforge.gate.champion_after"),
        "params_logged": len(params),
    })
    _stage_summary(spec, summary, metrics, tags)
    return summary


def _stage_summary(spec: PipelineSpec, summary: dict[str, Any], metrics: dict[str, float],
                   tags: dict[str, str]) -> None:
    """With ``stages`` (docs/stages.md): one entry per training stage, totals over the stages,
    and the leaf stage whose checkpoint was chosen."""
    from trainforge.pipeline.stages import resolve_stages

    names = [s.name for s in resolve_stages(spec) if s.name]
    if not names:
        return
    per = {name: {"steps_trained": _count(metrics.get(f"train/{name}/final_step")),
                  "tokens_trained": _count(metrics.get(f"train/{name}/tokens_seen")),
                  "final_train_loss": metrics.get(f"train/{name}/final_loss"),
                  "val_loss": metrics.get(f"val/{name}/val_loss")} for name in names}
    chosen = tags.get("trainforge.validation.stage")
    usage: dict[str, float] = {}
    for key, value in metrics.items():  # accounting/<stage>/<what>: summed over the stages
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "accounting" and parts[1] in per:
            usage[parts[2]] = usage.get(parts[2], 0.0) + value
    summary.update({
        "training_stages": per,
        "chosen_stage": chosen,
        "steps_trained": sum(p["steps_trained"] or 0 for p in per.values()),
        "tokens_trained": sum(p["tokens_trained"] or 0 for p in per.values()),
        "final_train_loss": per.get(chosen or "", {}).get("final_train_loss"),
        "accounting": usage,
    })


def gate_line(summary: dict[str, Any]) -> str:
    """The summary's eval-gate row: the decision, its reason and where the champion alias is.

    ``gate_decision`` is ``pass``, ``fail`` or ``skipped`` (operators/gate.py); the alias moves
    only on ``pass``. Without a decision the gate did not run, and the row says why.
    """
    decision = summary.get("gate_decision")
    if not decision:
        state = ((summary.get("stages") or {}).get("register_model") or {}).get("state")
        if state == "success":
            return "not run: register_model recorded no gate decision"
        return (f"not run: register_model did not finish"
                f"{f' (state {state})' if state else ''}")
    champion = summary.get("champion_after")
    champion = f"v{champion}" if champion and champion != "none" else None
    reason = summary.get("gate_reason") or "-"
    if decision == "pass":
        return f"pass: {reason}" + (f" (champion is now {champion})" if champion else "")
    return (f"{decision}: {reason} "
            f"({f'champion stays {champion}' if champion else 'no champion: the alias stays unset'})")


def print_summary(summary: dict[str, Any], console: Console) -> None:
    def fmt(value, spec=""):
        if value is None:
            return "-"
        return format(value, spec) if spec else str(value)

    table = Table(title=f"trainforge run: {summary['dag_id']}", show_header=False)
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    rows = [
        ("Airflow DAG run", f"{summary['airflow_run_id']} ({summary.get('state')})"),
        ("dataset digest", fmt(summary.get("dataset_digest"))
         + (" (reused)" if summary.get("dataset_reused") else "")),
        ("tokens train / validation",
         f"{fmt(summary.get('train_tokens'), ',.0f')} / {fmt(summary.get('validation_tokens'), ',.0f')}"),
        ("documents train / validation",
         f"{fmt(summary.get('train_documents'), '.0f')} / {fmt(summary.get('validation_documents'), '.0f')}"),
        ("steps / tokens trained",
         f"{fmt(summary.get('steps_trained'), '.0f')} / {fmt(summary.get('tokens_trained'), ',.0f')}"),
        ("final train loss", fmt(summary.get("final_train_loss"), ".4f")),
        ("validation loss", fmt(summary.get("val_loss"), ".4f")),
        ("validation perplexity", fmt(summary.get("val_perplexity"), ".2f")),
        ("unigram-baseline perplexity", fmt(summary.get("unigram_perplexity"), ".2f")),
        ("validation bits per byte", fmt(summary.get("val_bits_per_byte"), ".3f")),
        ("checkpoint chosen", fmt(summary.get("checkpoint"))),
        ("registered model", (f"{summary['registered_model']} v{summary.get('model_version')} "
                              f"@{', @'.join(summary.get('aliases') or [])}")
         if summary.get("registered_model") else "- (not registered)"),
        ("eval gate", gate_line(summary)),
        ("MLflow run", fmt(summary.get("mlflow_run_url"))),
    ]
    usage = summary.get("accounting") or {}
    if usage:
        rows.append(("training accounting",
                     f"{usage.get('gpu_hours', 0):.4f} GPU-h, {usage.get('cpu_core_hours', 0):.4f} "
                     f"CPU-core-h, {usage.get('energy_kwh', 0):.4f} kWh, "
                     f"{usage.get('cost', 0):.4f} {summary.get('currency', '')}"))
    for name, info in (summary.get("training_stages") or {}).items():
        chosen = " (chosen)" if name == summary.get("chosen_stage") else ""
        rows.append((f"training stage {name}",
                     f"{fmt(info.get('steps_trained'))} steps, final train loss "
                     f"{fmt(info.get('final_train_loss'), '.4f')}, validation loss "
                     f"{fmt(info.get('val_loss'), '.4f')}{chosen}"))
    for task, info in (summary.get("stages") or {}).items():
        rows.append((f"stage {task}", f"{info.get('state')} in {fmt(info.get('seconds'), '.1f')} s"))
    for task, info in (summary.get("teardown") or {}).items():
        rows.append((f"teardown {task}", f"{info.get('state')} in "
                     f"{fmt(info.get('seconds'), '.1f')} s (does not decide the run's state)"))
    for what, value in rows:
        table.add_row(what, value)
    console.print(table)


def derived_spec(spec: PipelineSpec, engine: str, ray_address: str | None = None) -> PipelineSpec:
    """``spec`` with ``training.engine`` switched to ``engine`` (and the Ray address set).

    Raises:
        ValueError: the spec does not fit the engine without made-up values (e.g. the
            kubernetes engine needs a container image the spec does not name).
    """
    from trainforge.cli import for_engine

    switched, placeholders = for_engine(spec, engine)
    if placeholders:
        raise ValueError(f"the spec lacks what engine {engine!r} needs: "
                         f"{'; '.join(placeholders)} (set these fields in the spec)")
    if ray_address and switched.training.engine == "ray":
        raw = switched.model_dump(mode="json")
        raw["training"]["ray"] = {**(raw["training"].get("ray") or {}), "address": ray_address}
        switched = PipelineSpec.model_validate(raw)
    return switched


def write_spec(spec: PipelineSpec, path: Path) -> Path:
    """Write ``spec`` as YAML to ``path`` (atomically); the loader reads it back unchanged."""
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("# Derived by `trainforge run --engine`; edit the original spec instead.\n"
                   + yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
    os.replace(tmp, path)
    return path


def ray_cluster(spec: PipelineSpec, stack: contextlib.ExitStack, console: Console,
                env: dict[str, str]) -> str | None:
    """The job API address the run uses: one that answers, else a local head started here.

    A head started here is stopped when ``stack`` closes; ``RAY_ADDRESS`` and
    ``RAY_API_SERVER_ADDRESS`` are then removed from ``env`` (Ray's client would prefer them).
    None when the spec names an Airflow connection (used as it is).
    """
    import shutil
    import tempfile

    from trainforge.engines.ray.head import LocalRayHead, job_api_ready

    block = spec.training.engine_block
    if block.connection_id:
        return None
    for address in (os.environ.get("RAY_API_SERVER_ADDRESS"), os.environ.get("RAY_ADDRESS"),
                    block.address):
        if address and address.startswith(("http://", "https://")) and job_api_ready(address):
            console.print(f"Ray cluster: {address}")
            return address.rstrip("/")
    resources = spec.training.resources
    cpus = max(os.cpu_count() or 1, resources.processes_per_node * resources.cpus_per_process)
    # Short: Ray's socket paths below it must stay under 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="tf-ray-")
    stack.callback(shutil.rmtree, temp_dir, True)
    console.print(f"Starting a Ray head on loopback ({cpus} CPUs; temp dir {temp_dir})")
    head = stack.enter_context(LocalRayHead(temp_dir, num_cpus=cpus))
    stack.callback(console.print, f"Stopping the Ray head on {head.address}")
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        env.pop(name, None)
    console.print(f"Ray head: {head.address} (job API and dashboard; stopped at the end)")
    return head.address


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
    """While open, SIGTERM and SIGHUP (a closed terminal, ``timeout``, a CI job cancelled) raise
    :class:`KeyboardInterrupt` like Ctrl-C, so they take the same way out: Airflow stopped, this
    run's jobs cancelled and named, the MLflow server and Ray head this run started stopped.
    Outside the main thread (where Python delivers signals) it does nothing."""
    import signal
    import threading

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
            console.print(f"[red]{spec_file}: cannot run on engine {engine!r}: {err}[/]")
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
            from trainforge.mlflow_setup import start_server
            from trainforge.mlflow_setup.errors import ServerStartError

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
        ray_address = None
        if spec.training.engine == "ray":
            from trainforge.engines.ray.head import RayHeadError

            try:
                ray_address = ray_cluster(spec, stack, console, env)
            except RayHeadError as err:
                console.print(f"could not start a local Ray head: {err}", markup=False)
                return False
            if ray_address and ray_address != spec.training.engine_block.address:
                spec = derived_spec(spec, "ray", ray_address)
                stem = spec_file.stem.removesuffix(".ray")
                spec_file = home / "specs" / f"{stem}.ray.yaml"
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
            console_filter = ConsoleFilter()
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
        if summary_json:
            Path(summary_json).write_text(json.dumps(summary, indent=2, default=str))
    ok = airflow_run.get("state") == "success"
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        console.print("The MLflow server of this run has stopped; `make mlflow` serves the same "
                      "store again on http://127.0.0.1:5000 (or `make airflow` for both UIs).")
    console.print(("[green]Pipeline succeeded[/]" if ok else "[red]Pipeline failed[/]")
                  + f" in {time.monotonic() - started:.0f} s")
    return ok
