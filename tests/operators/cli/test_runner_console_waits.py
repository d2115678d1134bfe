"""One console line per wait of `trainforge run`: a retry delay says when the next try starts;
and a failed run ends with the failed task's traceback.

`airflow dags test` logs a "No tasks to run" warning, listing every unfinished task instance,
once a second while no task can start. The first test runs Airflow itself on a DAG whose task
fails its first try, and feeds the real output through the console filter. The second runs
`trainforge run` on a pipeline whose data preparation fails (its corpus is missing).
"""

from __future__ import annotations

import datetime as dt
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainforge.cli.runner_console import ConsoleFilter, retry_delays, task_tracebacks
from trainforge.pipeline.loader import load_spec
from trainforge.pipeline.spec import PipelineSpec

REPO = Path(__file__).resolve().parents[3]

DAG_FILE = '''
import datetime as dt
from pathlib import Path

from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk import DAG


def flaky():
    marker = Path(__file__).with_name("tried")
    if not marker.exists():
        marker.write_text("1")
        raise RuntimeError("the first try fails")


with DAG(dag_id="retry_once", schedule=None,
         start_date=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)):
    PythonOperator(task_id="flaky", python_callable=flaky, retries=1,
                   retry_delay=dt.timedelta(seconds={delay})) >> PythonOperator(
        task_id="after", python_callable=lambda: None)
'''
DELAY_S = 4


def _time(line: str) -> dt.datetime:
    return dt.datetime.fromisoformat(line.split(" ", 1)[0].removesuffix("Z"))


@pytest.mark.airflow
def test_a_retry_delay_is_one_line_saying_when_the_next_try_starts(tmp_path):
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "retry_once.py").write_text(DAG_FILE.format(delay=DELAY_S))
    home = tmp_path / "airflow"
    home.mkdir()
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__LOGGING__COLORED_CONSOLE_LOG": "False", "NO_COLOR": "1",
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}"}
    airflow = str(Path(sys.executable).with_name("airflow"))
    subprocess.run([airflow, "db", "migrate"], env=env, check=True, capture_output=True,
                   timeout=300)
    proc = subprocess.run([airflow, "dags", "test", "retry_once"], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    lines = proc.stdout.splitlines(keepends=True)
    polls = [line for line in lines if "No tasks to run" in line]
    assert len(polls) >= 2, "Airflow no longer polls through a retry delay: " + proc.stdout[-4000:]

    console = ConsoleFilter({"flaky": DELAY_S, "after": 300.0})
    shown = [text for text in map(console, lines) if text is not None]

    assert not [text for text in shown if "No tasks to run" in text], shown
    [wait] = [text for text in shown if "up for retry: the next try starts" in text]
    assert shown.index(wait) == shown.index("<== task flaky: up for retry") + 1, shown
    assert shown.count("==> task flaky") == 2, shown
    # The time said is the failed try's end plus the retry delay; the retry starts then.
    said = re.search(r"starts at (\d\d:\d\d:\d\d) UTC \(retry_delay 4s\)", wait)
    assert said, wait
    [failed] = [line for line in lines if "new_state=up_for_retry" in line]
    expected = _time(failed) + dt.timedelta(seconds=DELAY_S)
    assert said[1] == f"{expected:%H:%M:%S}"
    restarted = [_time(line) for line in lines if "starting task_id=flaky" in line][1]
    assert expected - dt.timedelta(seconds=1) <= restarted <= expected + dt.timedelta(seconds=3)
    # The failed try's traceback, as Python printed it into Airflow's output, is flaky's.
    tracebacks = task_tracebacks(lines)
    assert list(tracebacks) == ["flaky"], tracebacks
    assert tracebacks["flaky"][0] == "Traceback (most recent call last):"
    assert tracebacks["flaky"][-1] == "RuntimeError: the first try fails"
    line = DAG_FILE.splitlines().index('        raise RuntimeError("the first try fails")') + 1
    assert f'  File "{dags / "retry_once.py"}", line {line}, in flaky' in tracebacks["flaky"]


@pytest.mark.airflow
@pytest.mark.integration
def test_a_failed_run_prints_the_failed_tasks_traceback(tmp_path, mlflow_server):
    """The traceback lines of the task that failed, after the summary: the frame that raised
    is the one Python's source says, not only the exception's one line."""
    from trainforge.data import sources

    spec = tmp_path / "no_corpus.yaml"
    spec.write_text((REPO / "tests" / "e2e" / "tiny_shakespeare.yaml").read_text()
                    .replace("name: tiny_shakespeare", "name: no_corpus"))
    env = {**os.environ, "TRAINFORGE_HOME": str(tmp_path / "home"),
           "MLFLOW_TRACKING_URI": mlflow_server}  # the home has no corpus: prepare_data fails
    proc = subprocess.run([str(Path(sys.executable).with_name("trainforge")), "run", str(spec)],
                          env=env, text=True, capture_output=True, timeout=600)
    out = proc.stdout.splitlines()
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    source, first = inspect.getsourcelines(sources.resolve_sources)
    raised = first + next(i for i, text in enumerate(source)
                          if "raise SourceNotFoundError(pattern, absolute)" in text)
    header = next(i for i, line in enumerate(out) if line.startswith("Task prepare_data failed"))
    shown = out[header + 1:next(i for i, line in enumerate(out) if "Pipeline failed" in line)]
    assert header > next(i for i, line in enumerate(out) if "trainforge run: no_corpus" in line)
    assert 0 < len(shown) <= 20, shown
    assert f'    File "{sources.__file__}", line {raised}, in resolve_sources' in shown, out
    assert "      raise SourceNotFoundError(pattern, absolute)" in shown, shown
    assert any(line.startswith("  trainforge.data.errors.SourceNotFoundError: no files match")
               for line in shown), shown


_POLL = ("2026-12-05T02:48:0{s}.866037Z [warning  ] No tasks to run. unrunnable tasks: "
         "{{<TaskInstance: p.v2.after manual__2026-12-05T02:48:04.078297+00:00 [None] "
         "ti_id=01a24419-ff0e-7231-b6f6-07a26fb0ea87>, <TaskInstance: p.v2.train "
         "manual__2026-12-05T02:48:04.078297+00:00 [{state}] ti_id=01a2441a-0da5-7e02-8169-"
         "bb718c6770e3>}} [airflow.sdk.definitions.dag] loc=dag.py:1424")


def test_a_wait_no_retry_explains_is_one_warning_until_what_it_waits_for_changes():
    console = ConsoleFilter({"train": 60.0, "after": 60.0})
    shown = [console(_POLL.format(s=s, state="up_for_reschedule")) for s in range(5)]
    assert shown[0] == ("    WARNING: no task can start; waiting on after (not scheduled), "
                        "train (up_for_reschedule)")
    assert shown[1:] == [None] * 4
    # Without the failed try's time (a filter started late) the line still names the retry.
    assert console(_POLL.format(s=6, state="up_for_retry")) == (
        "    train is up for retry: the next try starts when its retry_delay has passed")
    assert console(_POLL.format(s=7, state="up_for_retry")) is None


def test_an_approval_wait_is_one_line():
    console = ConsoleFilter()
    line = ("2026-12-05T02:48:0{}.1Z [info     ] Waiting for Human-in-the-loop input for tasks: "
            "['approve_champion'] [airflow.sdk.definitions.dag] loc=dag.py:1415")
    shown = [console(line.format(s)) for s in range(3)]
    assert shown == ["    waiting for a person's answer to approve_champion (Airflow UI or REST "
                     "API: docs/registry.md)", None, None]


def test_each_task_gets_the_retry_delay_the_dag_builder_sets():
    raw = load_spec(REPO / "tests" / "e2e" / "tiny_shakespeare.yaml").model_dump(mode="json")
    raw["pipeline"]["defaults"]["retry_delay"] = "2m"
    raw["pipeline"].setdefault("tasks", {})["train"] = {"retry_delay": "0s"}
    delays = retry_delays(PipelineSpec.model_validate(raw))
    assert delays == {"prepare_data": 120.0, "train": 0.0, "validate_checkpoint": 120.0,
                      "register_model": 120.0, "close_run": 120.0}
