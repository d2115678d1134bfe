"""End to end: a two-stage pipeline (pretrain 20 steps -> finetune 20 steps from pretrain's final
weights) through `airflow dags test`, with real torchrun and a real MLflow server on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SPEC = HERE / "tiny_stages.yaml"

pytestmark = [pytest.mark.airflow, pytest.mark.integration, pytest.mark.distributed, pytest.mark.heavy]


@pytest.fixture(scope="module")
def staged_run(tmp_path_factory, shakespeare_corpus, mlflow_server):
    home = tmp_path_factory.mktemp("trainforge-home")
    (home / "corpus").mkdir()
    (home / "corpus" / "shakespeare").symlink_to(shakespeare_corpus, target_is_directory=True)
    env = {**os.environ, "TRAINFORGE_HOME": str(home), "MLFLOW_TRACKING_URI": mlflow_server}
    summary_path = home / "summary.json"
    trainforge = Path(sys.executable).with_name("trainforge")
    proc = subprocess.run(
        [str(trainforge), "run", str(SPEC), "--summary-json", str(summary_path)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return home, json.loads(summary_path.read_text()), output


def _loss_by_step(client, run_id: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, "train_loss")}


def test_every_stage_task_succeeds_in_order(staged_run):
    _, summary, _ = staged_run
    assert summary["state"] == "success"
    assert {t: s["state"] for t, s in summary["stages"].items()} == {
        "prepare_data": "success", "train_pretrain": "success", "train_finetune": "success",
        "validate_checkpoint": "success", "register_model": "success"}
    assert {t: s["state"] for t, s in summary["teardown"].items()} == {"close_run": "success"}
    assert summary["training_stages"]["pretrain"]["steps_trained"] == 20
    assert summary["training_stages"]["finetune"]["steps_trained"] == 20
    assert summary["steps_trained"] == 40


def test_finetune_started_from_pretrains_final_weights(staged_run, mlflow_server):
    from mlflow import MlflowClient

    from trainforge.trainer.checkpoint import verify

    home, summary, _ = staged_run
    chosen = Path(summary["checkpoint"])
    run_root = chosen.parent.parent
    pretrain_final = run_root / "pretrain" / "step-00000020"
    assert chosen == run_root / "finetune" / "step-00000020"  # own folder; steps count from 0
    assert verify(chosen) == [] and verify(pretrain_final) == []
    meta = json.loads((chosen / "meta.json").read_text())
    assert meta["job_config"]["init"] == {"checkpoint": str(pretrain_final),
                                          "source": "stage:pretrain"}
    # Each stage logs into its own child run of the DAG run's MLflow run.
    client = MlflowClient(mlflow_server)
    parent = client.get_run(summary["mlflow_run_id"])
    children = {
        r.data.tags["trainforge.stage"]: r for r in client.search_runs(
            [parent.info.experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    }
    assert set(children) == {"pretrain", "finetune"}
    assert all(r.info.status == "FINISHED" for r in children.values())
    # each stage ended its own run; the close_run teardown found nothing to close
    assert not any("trainforge.closed_by" in r.data.tags for r in children.values())
    pre = _loss_by_step(client, children["pretrain"].info.run_id)
    fine = _loss_by_step(client, children["finetune"].info.run_id)
    assert sorted(pre) == sorted(fine) == list(range(1, 21))
    # From random weights the first loss is near ln(vocab); from pretrain's it starts where
    # pretrain ended, far below pretrain's own start.
    assert fine[1] < (pre[1] + pre[20]) / 2, (pre, fine)
    assert children["finetune"].data.params["optim.learning_rate"] == "0.001"


def test_the_registered_version_is_the_best_leafs_checkpoint(staged_run, mlflow_server):
    from mlflow import MlflowClient

    _, summary, _ = staged_run
    assert summary["chosen_stage"] == "finetune"
    client = MlflowClient(mlflow_server)
    (version,) = client.search_model_versions("name='tiny-stages'")
    assert version.version == summary["model_version"]
    assert version.tags["trainforge.stage"] == "finetune"
    assert version.tags["trainforge.checkpoint"] == summary["checkpoint"]
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.tags["trainforge.validation.stage"] == "finetune"
    assert run.data.metrics["val/val_loss"] == pytest.approx(
        run.data.metrics["val/finetune/val_loss"])
