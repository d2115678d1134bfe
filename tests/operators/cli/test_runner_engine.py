"""`trainforge run --engine`: the derived spec, the engine check, and stopping Ray jobs.

Which Ray cluster a run uses is the engine's development cluster:
tests/operators/engines/ray/test_ray_dev_cluster.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainforge.cli.engine_switch import derived_spec, write_spec
from trainforge.cli.main import app
from trainforge.pipeline import load_spec

SPEC = Path(__file__).resolve().parents[2] / "e2e" / "tiny_shakespeare.yaml"


def test_derived_spec_switches_the_engine_and_sets_the_ray_address(tmp_path):
    spec = load_spec(SPEC)
    ray = derived_spec(spec, "ray", {"address": "http://127.0.0.1:18265"})
    assert ray.training.engine == "ray"
    assert ray.training.engine_block.address == "http://127.0.0.1:18265"
    assert ray.dag_id == spec.dag_id and ray.training.resources == spec.training.resources
    path = write_spec(ray, tmp_path / "specs" / "tiny.ray.yaml")
    assert load_spec(path) == ray
    assert not list(path.parent.glob(".*.tmp"))
    assert "approval" not in path.read_text()  # unset: no empty key, which a file may not hold


def test_a_derived_spec_keeps_its_approval_block(tmp_path):
    spec = load_spec(SPEC.parents[1] / "faults" / "approval_tiny.yaml")
    assert spec.registry.approval is not None
    ray = derived_spec(spec, "ray", {"address": "http://127.0.0.1:18265"})
    assert load_spec(write_spec(ray, tmp_path / "approval.ray.yaml")) == ray


def test_an_engine_the_spec_does_not_fit_is_refused_with_what_is_missing():
    with pytest.raises(ValueError, match="training.resources.image"):
        derived_spec(load_spec(SPEC), "kubernetes")


def test_run_rejects_an_unknown_engine_without_a_traceback():
    result = CliRunner().invoke(app, ["run", str(SPEC), "--engine", "raay"])
    assert result.exit_code == 1
    assert "unknown engine 'raay'" in result.output and "Traceback" not in result.output


@pytest.mark.integration
def test_ray_jobs_make_their_folders_inside_the_heads_temp_folder(ray_head):
    import time

    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(ray_head.address)
    # The first step of the Ray engine's entrypoint (operators/engines/ray/render.py).
    job_id = client.submit_job(
        entrypoint='echo "folder=$(mktemp -d "${TMPDIR:-/tmp}/trainforge-tmpdir-check.XXXXXX")"')
    deadline = time.monotonic() + 60
    # The job's log can lag its end by a moment: wait for the line too.
    while not (client.get_job_status(job_id).is_terminal()
               and "\nfolder=" in "\n" + client.get_job_logs(job_id)):
        assert time.monotonic() < deadline, "the Ray job did not end and log within 60 s"
        time.sleep(0.5)
    assert client.get_job_status(job_id) == JobStatus.SUCCEEDED
    line = next(x for x in client.get_job_logs(job_id).splitlines() if x.startswith("folder="))
    folder = Path(line.removeprefix("folder="))
    assert folder.parent == ray_head.job_tmp_dir and folder.is_dir()
    assert str(ray_head.job_tmp_dir).startswith(str(ray_head.temp_dir))


@pytest.mark.integration
def test_an_interrupted_ray_run_names_the_jobs_stopped_before_it_looked(ray_head):
    import time

    from ray.job_submission import JobSubmissionClient

    from trainforge.cli.runner import cancel_ray_jobs

    client = JobSubmissionClient(ray_head.address)
    since = time.time()
    meta = {"trainforge.dag_id": "interrupted_dag", "trainforge.key": "k"}
    stopped_first = client.submit_job(entrypoint="sleep 120", metadata=meta)
    running = client.submit_job(entrypoint="sleep 120", metadata=meta)
    deadline = time.monotonic() + 60
    while any(client.get_job_status(j).value == "PENDING" for j in (stopped_first, running)):
        assert time.monotonic() < deadline, "the Ray jobs did not start within 60 s"
        time.sleep(0.5)
    client.stop_job(stopped_first)  # what the task's on_kill does when Airflow stops
    while not client.get_job_status(stopped_first).is_terminal():
        assert time.monotonic() < deadline, "the stopped Ray job did not end within 60 s"
        time.sleep(0.5)
    stopped = cancel_ray_jobs(ray_head.address, "interrupted_dag", since)
    assert stopped.cancelled == [running]
    assert stopped.already_cancelled == [stopped_first]
    assert client.get_job_status(running).is_terminal()


def test_the_dag_file_it_writes_is_one_airflow_parses_in_safe_mode(tmp_path):
    """Airflow's safe-mode parsing skips a Python file that does not name both "airflow" and
    "dag"; `airflow dags test` would then not find the pipeline."""
    from airflow.utils.file import might_contain_dag

    from trainforge.cli.runner import airflow_env

    env = airflow_env(tmp_path, [tmp_path / "spec.yaml"])
    dag_file = Path(env["AIRFLOW__CORE__DAGS_FOLDER"]) / "trainforge_pipelines.py"
    assert might_contain_dag(str(dag_file), safe_mode=True)
