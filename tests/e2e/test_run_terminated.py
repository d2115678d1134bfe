"""SIGTERM to `trainforge run` (a closed terminal, `timeout`, a cancelled CI job) takes Ctrl-C's
way out: Airflow is stopped, the run's training job is cancelled and named, and the MLflow server
the run started is stopped — nothing of the run is left running.

Real `trainforge run` of the tiny demo spec (made long) through `airflow dags test`, with the
MLflow server it starts itself and torchrun on the local engine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.faults.faultlib import wait_for

HERE = Path(__file__).resolve().parent
SPEC = HERE / "tiny_shakespeare.yaml"

pytestmark = [pytest.mark.airflow, pytest.mark.integration]


def _processes_naming(text: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and any(
                    text in part for part in proc.info["cmdline"] or ()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _steps_logged(home: Path) -> bool:
    return any(re.search(r"step \d+/", p.read_text(errors="replace"))
               for p in (home / "runs").glob("*/job.log"))


def test_sigterm_stops_airflow_cancels_the_job_and_stops_the_mlflow_server(
        tmp_path, shakespeare_corpus):
    home = tmp_path / "home"
    (home / "corpus").mkdir(parents=True)
    (home / "corpus" / "shakespeare").symlink_to(shakespeare_corpus, target_is_directory=True)
    text = SPEC.read_text()
    assert "max_steps: 200\n" in text
    spec = tmp_path / "long_tiny.yaml"
    spec.write_text(text.replace("max_steps: 200\n", "max_steps: 200000\n")
                    .replace("name: tiny_shakespeare", "name: long_tiny"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["TRAINFORGE_HOME"] = str(home)  # no MLFLOW_TRACKING_URI: the run starts its own server
    log = open(tmp_path / "run.log", "w")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen([str(Path(sys.executable).with_name("trainforge")), "run", str(spec)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for("rank 0's first step line", lambda: proc.poll() is not None or _steps_logged(home),
                 900)
        assert proc.poll() is None, (tmp_path / "run.log").read_text()[-4000:]
        [job] = list((home / "runs").glob("*/job.log"))
        key = job.parent.name
        assert _processes_naming(str(job.parent)), "the job runs"
        assert _processes_naming(str(home / "mlflow")), "the run's MLflow server runs"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    output = (tmp_path / "run.log").read_text(errors="replace")
    assert rc != 0, output[-4000:]
    assert "Interrupted: stopping Airflow and cancelling this pipeline's jobs" in output
    assert key in output.split("Interrupted:", 1)[1], output[-3000:]  # the job is named
    wait_for("no process of the job", lambda: not _processes_naming(str(job.parent)), 60)
    wait_for("no process of the run (Airflow, MLflow server)",
          lambda: not _processes_naming(str(home)), 60)
    record = json.loads((job.parent / "exit.json").read_text())
    assert record["cancelled"] is True, record
