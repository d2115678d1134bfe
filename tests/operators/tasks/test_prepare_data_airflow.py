"""prepare_data through Airflow itself (``airflow dags test``, SQLite metadata DB): the task
declares the dataset root as its outlet, and the asset event Airflow records carries the
dataset's digest, URI and token counts in its extra."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.airflow, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[3]

DAG_FILE = '''
import datetime as dt

from airflow.sdk import DAG

from trainforge.tasks.prepare_data import PrepareDataOperator
from trainforge.pipeline.loader import load_spec
from trainforge.pipeline.spec import PipelineSpec

raw = load_spec({spec!r}).model_dump(mode="json")
raw["data"].update(sources=["corpus/*.txt"], tokenizer={{"vocab_size": 320}}, encode_workers=2)
spec = PipelineSpec.model_validate(raw)
with DAG(dag_id="prepare_only", schedule=None,
         start_date=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)):
    PrepareDataOperator(task_id="prepare_data", spec=raw,
                        outlets=[PrepareDataOperator.asset_for(spec)])
'''


def test_prepare_data_emits_the_dataset_asset_event(tmp_path, mlflow_server):
    from tests.operators.data.conftest import write_corpus

    home = tmp_path / "home"
    write_corpus(home / "corpus", count=8, lines=30)
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "prepare_only.py").write_text(
        DAG_FILE.format(spec=str(REPO / "tests" / "e2e" / "tiny_shakespeare.yaml")))
    airflow_home = home / "airflow"
    airflow_home.mkdir(parents=True)
    env = {**os.environ, "TRAINFORGE_HOME": str(home), "AIRFLOW_HOME": str(airflow_home),
           "AIRFLOW__CORE__DAGS_FOLDER": str(dags), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{airflow_home / 'airflow.db'}",
           "MLFLOW_TRACKING_URI": mlflow_server, "PYTHONPATH": str(REPO)}
    airflow = str(Path(sys.executable).with_name("airflow"))
    subprocess.run([airflow, "db", "migrate"], env=env, check=True, capture_output=True,
                   timeout=300)
    proc = subprocess.run([airflow, "dags", "test", "prepare_only"], env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]

    with sqlite3.connect(airflow_home / "airflow.db") as db:
        events = db.execute("SELECT a.uri, e.extra FROM asset_event e "
                            "JOIN asset a ON a.id = e.asset_id").fetchall()
    [(uri, extra)] = events
    extra = json.loads(extra)
    datasets = home / "datasets"
    assert uri == datasets.as_uri()
    assert extra["dataset_uri"] == (datasets / extra["digest"]).as_uri()
    assert (datasets / extra["digest"] / "manifest.json").is_file()
    assert extra["tokens_train"] > 0 and extra["tokens_validation"] > 0
    assert extra["reused"] is False
