"""What ``trainforge run`` shows on the console of the ``airflow dags test`` it runs.

Airflow's output is structlog lines (``<time>Z [level] event [logger] loc=...``); the console
gets task starts and ends with their outcomes, trainforge's own log lines and every warning or
error. The full output goes to the run's log file (trainforge.runner).
"""

from __future__ import annotations

import re

_STRUCTLOG = re.compile(r"^\S+Z \[(?P<level>\w+)\s*\] (?P<event>.*?) \[(?P<logger>[\w.]+)\] loc=")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b[\w.]*: \S")
_TASK_START = re.compile(r"\[DAG TEST\] starting task_id=(\S+)")
_TASK_END = re.compile(r"\[DAG TEST\] end task task_id=(\S+)")

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
        # The operators log through Airflow's task logger (airflow.task.operators.<module>.<class>
        # with modules under trainforge), everything else of ours through trainforge.* loggers.
        if logger.startswith(("airflow.task.operators.trainforge.", "trainforge.")):
            return f"    {event}"
        if level in ("warning", "error", "critical") and "py.warnings" not in logger:
            return f"    {level.upper()}: {event} [{logger}]"
        return None


def console_line(line: str) -> str | None:
    """:class:`ConsoleFilter` for a single line seen on its own (no task state known)."""
    return ConsoleFilter()(line)
