"""End to end: the demo pipeline on a small config, through `airflow dags test`, against a real
MLflow server on loopback, with real torchrun (2 ranks, gloo) — the path `make demo` takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SPEC = HERE / "tiny_shakespeare.yaml"

pytestmark = [pytest.mark.airflow, pytest.mark.integration, pytest.mark.distributed]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, shakespeare_corpus, mlflow_server):
    home = tmp_path_factory.mktemp("trainforge-home")
    (home / "corpus").mkdir()
    (home / "corpus" / "shakespeare").symlink_to(shakespeare_corpus, target_is_directory=True)
    env = {**os.environ, "TRAINFORGE_HOME": str(home), "MLFLOW_TRACKING_URI": mlflow_server}
    summary_path = home / "summary.json"
    trainforge = Path(sys.executable).with_name("trainforge")
    proc = subprocess.run(
        [str(trainforge), "run", str(SPEC), "--summary-json", str(summary_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return home, json.loads(summary_path.read_text()), output


def test_dag_run_succeeds_with_every_stage(demo_run):
    _, summary, output = demo_run
    assert summary["state"] == "success"
    assert {t: s["state"] for t, s in summary["stages"].items()} == {
        "prepare_data": "success",
        "train": "success",
        "validate_checkpoint": "success",
        "register_model": "success",
    }
    # The close_run teardown ran after them and found nothing left open.
    assert {t: s["state"] for t, s in summary["teardown"].items()} == {"close_run": "success"}
    assert "<== task close_run: success" in output
    # The train task deferred and rank 0's step lines reached the task log through the trigger.
    assert (
        "running trigger in line"
        in (demo_run[0] / "logs")
        .joinpath(next(p.name for p in (demo_run[0] / "logs").iterdir()))
        .read_text()
    )
    assert summary["steps_trained"] == 200 and isinstance(summary["steps_trained"], int)
    assert summary["dataset_reused"] is False
    # No error-level line on a successful run: every task has the MLflow link Airflow reads
    # at its end (a missing one was logged as "XCom not found" by the task runner).
    logs = [path.read_text(errors="replace") for path in (demo_run[0] / "logs").rglob("*")
            if path.is_file()]
    assert not [line for text in (output, *logs) for line in text.splitlines()
                if "XCom not found" in line]


def test_model_learned_something_real(demo_run):
    _, summary, _ = demo_run
    assert summary["val_perplexity"] < 0.8 * summary["unigram_perplexity"], summary


def test_mlflow_run_has_params_metrics_tags_and_dataset(demo_run, mlflow_server):
    from mlflow import MlflowClient

    _, summary, _ = demo_run
    client = MlflowClient(mlflow_server)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert "trainforge.closed_by" not in run.data.tags  # registration ended it, not close_run
    assert run.data.tags["trainforge.dag_id"] == "tiny_shakespeare"
    assert run.data.tags["trainforge.airflow_run_id"] == summary["airflow_run_id"]
    assert run.data.params["data.vocab_size"] == "1024"
    assert any(k.startswith("optim") or "learning_rate" in k for k in run.data.params)
    history = client.get_metric_history(run.info.run_id, "train_loss")
    steps = [m.step for m in history]
    assert steps == sorted(set(steps)) and steps[-1] == 200 and len(steps) >= 20
    assert history[-1].value < history[0].value
    for key in ("val/val_loss", "val/val_perplexity", "val/unigram_perplexity",
                "system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"):
        assert key in run.data.metrics
    # MLflow caps a dataset digest at 36 characters; the full SHA-256 is in the input's tags.
    inputs = run.inputs.dataset_inputs
    assert any(summary["dataset_digest"].startswith(d.dataset.digest) for d in inputs)
    full = {t.value for d in inputs for t in d.tags if t.key == "trainforge.dataset_digest"}
    assert summary["dataset_digest"] in full


def test_exactly_one_model_version_with_the_alias(demo_run, mlflow_server):
    from mlflow import MlflowClient

    _, summary, _ = demo_run
    client = MlflowClient(mlflow_server)
    versions = client.search_model_versions("name='tiny-shakespeare'")
    assert len(versions) == 1
    by_alias = client.get_model_version_by_alias("tiny-shakespeare", "challenger")
    assert by_alias.version == versions[0].version == summary["model_version"]
    assert by_alias.status == "READY"
    assert by_alias.run_id == summary["mlflow_run_id"]
    # made from the chosen checkpoint's LoggedModel, which names where the checkpoint lies
    model_id = by_alias.source.removeprefix("models:/")
    assert model_id.startswith("m-"), by_alias.source
    model = client.get_logged_model(model_id)
    assert model.tags["trainforge.checkpoint"] == summary["checkpoint"]
    assert model.tags["trainforge.validation.chosen"] == "true" and model.params["step"] == "200"
    assert {m.key for m in model.metrics} >= {"val_loss", "val_perplexity"}


def test_checkpoint_chosen_has_a_verifying_manifest(demo_run):
    from trainforge.trainer.checkpoint import verify

    _, summary, _ = demo_run
    chosen = Path(summary["checkpoint"])
    assert chosen.name == "step-00000200"
    manifest = json.loads((chosen / "manifest.json").read_text())
    assert manifest["step"] == 200
    assert verify(chosen) == []
    # keep_last: 2 — older checkpoints were pruned, the newest valid one kept.
    assert sorted(p.name for p in chosen.parent.glob("step-*")) == [
        "step-00000150",
        "step-00000200",
    ]


def test_the_run_has_its_ledger_and_trainforge_report_reads_it(demo_run, mlflow_server, tmp_path):
    from mlflow import MlflowClient
    from typer.testing import CliRunner

    from trainforge.cli.main import app
    from trainforge.ledger import names as n

    _, summary, output = demo_run
    run = MlflowClient(mlflow_server).get_run(summary["mlflow_run_id"])
    m, tags = run.data.metrics, run.data.tags
    parts = m[n.PRODUCTIVE_S] + sum(m[n.badput(b)] for b in n.BUCKETS if n.badput(b) in m)
    assert parts == pytest.approx(m[n.WALL_S], rel=0.01) and m[n.badput("other")] >= 0
    assert 0 < m[n.GOODPUT] < 100 and m[n.DISRUPTIONS] == 0
    assert m[n.badput("program_startup")] > 0 and m[n.badput("queue_wait")] >= 0
    assert tags[n.unknown_tag("image_pull")].startswith("not applicable:")
    assert tags[n.energy_source_tag("cpu")] in ("measured-rapl", "estimated")
    assert tags["cost/price_source"].startswith("catalog v1: local/localhost")
    assert m[n.TPS] > 0 and n.MFU_PCT not in m  # CPU: no peak, so no MFU
    assert summary["ledger"][""]["figures"][n.GOODPUT] == pytest.approx(m[n.GOODPUT])
    assert "ledger" in output and "goodput" in output

    report = CliRunner().invoke(app, ["report", "tiny_shakespeare", "--tracking-uri", mlflow_server,
                                      "--json", "--plot", str(tmp_path / "r.png")])
    assert report.exit_code == 0, report.output[-3000:]
    rows = {r["mlflow_run_id"]: r for r in json.loads(report.output)["runs"]}
    assert rows[summary["mlflow_run_id"]]["figures"][n.GOODPUT] == pytest.approx(m[n.GOODPUT])
    assert (tmp_path / "r.png").stat().st_size > 0
