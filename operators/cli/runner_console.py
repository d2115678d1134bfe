"""What ``trainforge run`` shows on the console of the ``airflow dags test`` it runs.

Airflow's output is structlog lines (``<time>Z [level] event [logger] loc=...``); the console
gets task starts and ends with their outcomes, trainforge's own log lines, every warning or
error, and one line per wait. The full output goes to the run's log file (trainforge.cli.runner);
when the run fails, :func:`failed_task_tracebacks` gives each failed task's traceback from it.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

_STRUCTLOG = re.compile(r"^\S+Z \[(?P<level>\w+)\s*\] (?P<event>.*?) \[(?P<logger>[\w.]+)\] loc=")
_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z ")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b[\w.]*: \S")
_TASK_START = re.compile(r"\[DAG TEST\] starting task_id=(\S+)")
_TASK_END = re.compile(r"\[DAG TEST\] end task task_id=(\S+)")

_NEW_STATE = re.compile(r"\bTask instance state updated\b.*\bnew_state=(\w+)")
_TASK_ERROR = re.compile(r"\[DAG TEST\] Error running task")
# The polling loop of `dags test` (airflow.sdk.definitions.dag.DAG.test) while no task is
# scheduled: once a second, with the repr of every unfinished task instance.
_NO_TASKS = re.compile(r"^No tasks to run\. unrunnable tasks: ")
_UNRUNNABLE = re.compile(r"<TaskInstance: (?P<ti>\S+) \S+ (?:map_index=\S+ )?\[(?P<state>[^\]]+)\]")
_AWAITING_INPUT = re.compile(r"^Waiting for Human-in-the-loop input for tasks: \[(?P<ids>[^\]]*)\]")
# How a task's final Airflow state reads on the console.
_OUTCOMES = {"success": "success", "failed": "failed", "up_for_retry": "up for retry",
             "upstream_failed": "upstream failed", "skipped": "skipped", "removed": "removed"}


def retry_delays(spec) -> dict[str, float]:
    """Each task id of ``spec``'s DAG with its ``retry_delay`` in seconds, as the DAG builder
    sets it (``pipeline.tasks.<kind>.retry_delay``, else ``pipeline.defaults.retry_delay``)."""
    from trainforge.graph import task_graph

    overrides, default = spec.pipeline.tasks, spec.pipeline.defaults.retry_delay
    delays = {}
    for node in task_graph(spec).nodes:
        own = getattr(getattr(overrides, node.kind.value, None), "retry_delay", None)
        delays[node.task_id] = float(default if own is None else own)
    return delays


class ConsoleFilter:
    """The part of each `airflow dags test` output line worth showing on the console.

    Shown: task starts and ends with the task's outcome, trainforge's own log lines (operators,
    trigger, trainer rank 0), every warning or error, and one line per wait. Airflow's internal
    chatter stays in the full log file. Stateful: `airflow dags test` runs one task at a time,
    and the last state Airflow's execution API recorded for it (``Task instance state updated
    ... new_state=X``) before its ``[DAG TEST] end task`` line is its outcome.

    A wait is `dags test` polling while no task can start: a retry delay, an approval waiting
    for a person, or a task no state change will ever schedule. Airflow logs it once a second
    (the "No tasks to run" warning lists every unfinished task instance); the console gets one
    line when the wait begins or what it waits for changes. For a retry delay that line says
    when the next try starts: Airflow retries at the end of the failed try (the time of its
    ``new_state=up_for_retry`` line) plus the task's ``retry_delay`` (``retry_delays``, from
    :func:`retry_delays`; without it the line says no time).
    """

    def __init__(self, retry_delays: Mapping[str, float] | None = None) -> None:
        self._state: str | None = None
        self._task: str | None = None
        self._delays = dict(retry_delays or {})
        self._failed_at: dict[str, dt.datetime] = {}  # task id -> end of its up_for_retry try
        self._wait: object = None  # what the current wait's line was about

    def __call__(self, line: str) -> str | None:
        """The console text for ``line`` (one line of output), or None to show nothing."""
        if new_state := _NEW_STATE.search(line):  # key-value fields come before its loc=
            self._state = new_state[1]
            if self._state == "up_for_retry" and self._task and (at := _line_time(line)):
                self._failed_at[self._task] = at
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
            self._state, self._task, self._wait = None, started[1], None
            return f"==> task {started[1]}"
        if _TASK_ERROR.search(event):
            # dags test marks a task whose run raised (without reporting a state) failed.
            self._state = self._state if self._state in ("success", "up_for_retry") else "failed"
        if ended := _TASK_END.search(event):
            outcome = _OUTCOMES.get(self._state or "", self._state or "ended, state unknown")
            self._state = None
            return f"<== task {ended[1]}: {outcome}"
        if _NO_TASKS.match(event):
            return self._no_tasks(event)
        if awaiting := _AWAITING_INPUT.match(event):
            ids = ", ".join(re.findall(r"'([^']+)'", awaiting["ids"])) or awaiting["ids"]
            return self._once(("input", ids), f"    waiting for a person's answer to {ids} "
                                              "(Airflow UI or REST API: docs/registry.md)")
        if "TrainingJobTrigger" in logger:
            # "[job-key] [default0]:<date> <time> rank0 INFO trainforge.trainer.train: step 10/..."
            # loses its key, local rank and time; any other line (a traceback) stays whole.
            return "    " + re.sub(r"^\[[^\]]+\] (\[default\d+\]:)?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d+ )?",
                                 "", event)
        # The operators log through Airflow's task logger (airflow.task.operators.<module>.<class>
        # with modules under trainforge), everything else of ours through trainforge.* loggers.
        if logger.startswith(("airflow.task.operators.trainforge.", "trainforge.")):
            return f"    {event}"
        if level in ("warning", "error", "critical") and "py.warnings" not in logger:
            return f"    {level.upper()}: {event} [{logger}]"
        return None

    def _no_tasks(self, event: str) -> str | None:
        """The one line of a "No tasks to run" wait (None for its repeats)."""
        waiting = sorted((self._task_id(m["ti"]), _state(m["state"]))
                         for m in _UNRUNNABLE.finditer(event))
        retrying = [task for task, state in waiting if state == "up_for_retry"]
        if retrying:
            return self._once(("retry", tuple(retrying)),
                              "    " + "; ".join(self._next_try(task) for task in retrying))
        stuck = ", ".join(f"{task} ({'not scheduled' if state == 'none' else state})"
                          for task, state in waiting) or event
        return self._once(("stuck", tuple(waiting)),
                          f"    WARNING: no task can start; waiting on {stuck}")

    def _next_try(self, task: str) -> str:
        at, delay = self._failed_at.get(task), self._delays.get(task)
        if at is None or delay is None:
            return f"{task} is up for retry: the next try starts when its retry_delay has passed"
        start = at + dt.timedelta(seconds=delay)
        return (f"{task} is up for retry: the next try starts at {start:%H:%M:%S} UTC "
                f"(retry_delay {_duration(delay)})")

    def _once(self, wait: object, text: str) -> str | None:
        if wait == self._wait:
            return None
        self._wait = wait
        return text

    def _task_id(self, ti: str) -> str:
        """The task id in ``<dag_id>.<task_id>`` (dag ids may hold dots too)."""
        known = [t for t in self._delays if ti.endswith(f".{t}")]
        return max(known, key=len) if known else ti.rsplit(".", 1)[-1]


def _line_time(line: str) -> dt.datetime | None:
    """The UTC time a structlog line was written (naive), or None."""
    match = _TIME.match(line)
    return dt.datetime.fromisoformat(match[1]) if match else None


def _state(text: str) -> str:
    """``up_for_retry`` from ``up_for_retry`` or ``TaskInstanceState.UP_FOR_RETRY``."""
    return text.rsplit(".", 1)[-1].lower()


def _duration(seconds: float) -> str:
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{hours}h" if hours else "", f"{minutes}m" if minutes else "",
             f"{secs}s" if secs or not (hours or minutes) else ""]
    return "".join(parts)


def console_line(line: str) -> str | None:
    """:class:`ConsoleFilter` for a single line seen on its own (no task state known)."""
    return ConsoleFilter()(line)


TRACEBACK_LINES = 20
"""How many lines of a failed task's traceback ``trainforge run`` prints (its end)."""
_TRACEBACK_START = "Traceback (most recent call last):"
_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line \d+')
_CARETS = re.compile(r"^\s*[\^~]+\s*$")  # Python 3.11's markers under a frame's source line


def task_tracebacks(lines: Iterable[str]) -> dict[str, list[str]]:
    """``{task_id: lines}``: the last traceback Airflow printed while each task ran, with its
    chained exceptions ("During handling of the above exception...").

    A traceback is the plain lines from ``Traceback (most recent call last):`` to the next
    structlog line; the task is the one whose ``[DAG TEST] starting task_id=`` came last (`dags
    test` runs one task at a time). A later try's traceback replaces an earlier try's.
    """
    found: dict[str, list[str]] = {}
    task: str | None = None
    block: list[str] | None = None
    for line in lines:
        line = line.rstrip("\n")
        if match := _STRUCTLOG.match(line):
            block = None
            if started := _TASK_START.search(match["event"]):
                task = started[1]
            continue
        if line == _TRACEBACK_START and block is None and task is not None:
            block = found[task] = []
        if block is not None:
            block.append(line)
    return found


def _airflow_folders() -> tuple[str, ...]:
    """The folders of the installed ``airflow`` package (its task runner's frames live there)."""
    spec = importlib.util.find_spec("airflow")
    return tuple(os.path.join(folder, "") for folder in spec.submodule_search_locations or ()
                 ) if spec else ()


def traceback_tail(block: list[str], max_lines: int = TRACEBACK_LINES) -> list[str]:
    """The last ``max_lines`` lines of a traceback, without Python's ``^^^^`` marker lines and
    without the frames inside Airflow's own package (the task runner's, the same for every
    task), which it counts in one line where it leaves them out."""
    airflow = _airflow_folders()
    kept: list[str] = []
    skipped, in_airflow = 0, False
    for line in block:
        frame = _FRAME.match(line)
        if frame:
            in_airflow = bool(airflow) and frame["file"].startswith(airflow)
        elif not line.startswith("    "):  # not a frame's source line: the frame has ended
            in_airflow = False
        if in_airflow:
            skipped += bool(frame)
            continue
        if skipped:
            kept.append(f"  ... {skipped} frame(s) inside Airflow left out")
            skipped = 0
        if not _CARETS.match(line):
            kept.append(line)
    return kept[-max_lines:]


def failed_task_tracebacks(log_path: Path, failed: Iterable[str]) -> list[str]:
    """What ``trainforge run`` prints after a failed run: for each task of ``failed`` (task ids),
    the end of its last traceback in the run's full log ``log_path``, or a line saying the log
    holds none."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as handle:
            found = task_tracebacks(handle)
    except OSError as err:
        return [f"The failed tasks' tracebacks cannot be read from {log_path}: {err}"]
    out: list[str] = []
    for task in sorted(failed, key=lambda t: list(found).index(t) if t in found else len(found)):
        if task not in found:
            out.append(f"Task {task} failed with no traceback in the log ({log_path})")
            continue
        out.append(f"Task {task} failed; the end of its traceback ({log_path} has it whole):")
        out.extend(f"  {line}" for line in traceback_tail(found[task]))
    return out
