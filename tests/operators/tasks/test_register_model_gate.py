"""register_model end to end against a real MLflow server on loopback: registration, the eval
gate against the champion (trainforge.trainer.evaluate as a child process), aliases, tags, the asset event,
and loading ``models:/<name>@champion`` back to generate text.

The operator runs outside Airflow's DB: its context is a small fake task instance, which is all
``execute`` reads. Checkpoints come from a real 10-step trainer run; a copy with zeroed weights
is a valid but clearly worse model (uniform predictions). The cases build on each other in file
order (one registered model for the module).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from trainforge.hooks.mlflow import MlflowHook
from trainforge.tasks.register_model import RegisterModelOperator, champion_outlet, model_asset_name
from trainforge.pipeline.loader import load_spec
from trainforge.pipeline.model import PipelineSpec

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]


class FakeTI:
    """What RegisterModelOperator.execute reads from its task instance."""

    def __init__(self, run_id: str, xcoms: dict[str, Any]) -> None:
        self.dag_id, self.run_id, self.task_id, self.try_number = "tiny_gate", run_id, "register_model", 1
        self.xcoms, self.pushed = xcoms, {}

    def xcom_pull(self, task_ids: str, key: str = "return_value") -> Any:
        return self.xcoms.get(task_ids)

    def xcom_push(self, key: str, value: Any) -> None:
        self.pushed[key] = value


@pytest.fixture(scope="module")
def case(tmp_path_factory, mlflow_server) -> dict[str, Any]:
    from tests.trainer.conftest import build_dataset, make_job, run_trainer, write_job
    from trainforge.trainer.validate import validate_checkpoint

    root = tmp_path_factory.mktemp("gate")
    dataset = build_dataset(root / "dataset")
    job = make_job(dataset, root / "checkpoints", optim={"max_steps": 10, "warmup_steps": 2},
                   checkpoint={"interval_steps": 10, "keep_last": 1})
    proc = run_trainer(write_job(root / "job.json", job), root / "result.json")
    assert proc.returncode == 0, proc.stdout[-3000:]
    good = root / "checkpoints" / "step-00000010"
    zero = shutil.copytree(good, root / "zeroed" / "step-00000010")
    weights = safetensors.torch.load_file(zero / "model.safetensors")
    safetensors.torch.save_file({k: torch.zeros_like(v) for k, v in weights.items()}, zero / "model.safetensors",
                                metadata={"format": "pt"})
    manifest = json.loads((zero / "manifest.json").read_text())
    from trainforge.storage.files import atomic_write_json, sha256_file

    manifest["files"]["model.safetensors"] = {"bytes": (zero / "model.safetensors").stat().st_size,
                                              "sha256": sha256_file(zero / "model.safetensors")}
    atomic_write_json(zero / "manifest.json", manifest)

    def validated(step_dir: Path) -> dict[str, Any]:
        report = validate_checkpoint(step_dir, dataset, max_eval_tokens=256, max_new_tokens=1)
        assert report["ok"], report["checks"]
        return {"checkpoint": report["checkpoint"], "step": report["step"],
                "checkpoint_digest": report["checkpoint_digest"], "metrics": report["metrics"]}

    raw = load_spec(REPO / "tests" / "e2e" / "tiny_shakespeare.yaml").model_dump(mode="json")
    name = f"gate-{uuid.uuid4().hex[:8]}"
    raw["registry"]["model_name"] = name
    raw["validation"].update(require_beats_unigram=False, eval_tokens=256, sample_prompt="ROMEO:")
    spec = PipelineSpec.model_validate(raw).model_dump(mode="json")
    return {"name": name, "spec": spec, "prepared": {"dataset_dir": str(dataset), "digest": "d" * 64},
            "good": validated(good), "zero": validated(zero), "server": mlflow_server, "results": {}}


def _register(case: dict[str, Any], run_id: str, which: str) -> tuple[dict[str, Any], Any]:
    from airflow.sdk.execution_time.context import OutletEventAccessors

    op = RegisterModelOperator(task_id="register_model", spec=case["spec"], mlflow_tracking_uri=case["server"],
                               outlets=[champion_outlet(case["name"])])
    ti = FakeTI(run_id, {"prepare_data": case["prepared"], "validate_checkpoint": case[which]})
    context = {"ti": ti, "params": {}, "outlet_events": OutletEventAccessors()}
    result = op.execute(context)
    events = context["outlet_events"][champion_outlet(case["name"])].asset_alias_events
    return result, events


def _version(case, version: str):
    return MlflowHook(tracking_uri=case["server"]).client.get_model_version(case["name"], version)


def test_first_version_meets_the_thresholds_and_becomes_champion(case):
    result, events = _register(case, "run-1", "zero")
    gate = result["gate"]
    assert (gate["decision"], gate["method"], gate["champion_version"]) == ("pass", "thresholds", None)
    assert result["aliases"] == ["challenger", "champion"] and gate["champion_after"] == result["version"]
    assert len(events) == 1 and events[0].dest_asset_key.name == model_asset_name(case["name"])
    assert events[0].extra == {"name": case["name"], "version": result["version"], "alias": "champion",
                               "model_uri": f"models:/{case['name']}/{result['version']}",
                               "previous_champion": None}
    mv = _version(case, result["version"])
    assert mv.tags["trainforge.gate.decision"] == "pass" and mv.tags["trainforge.previous_champion"] == "none"
    assert "eval gate PASSED" in mv.description and "MLflow run: http" in mv.description
    case["results"]["first"] = result


def test_a_better_version_takes_champion_and_records_the_previous(case):
    first = case["results"]["first"]["version"]
    result, events = _register(case, "run-2", "good")
    gate = result["gate"]
    assert (gate["decision"], gate["method"], gate["champion_version"]) == ("pass", "tokens", first), gate
    assert gate["metric"] == "val_bits_per_byte" and gate["candidate_value"] < gate["champion_value"]
    assert gate["champion_after"] == result["version"] and "champion" in result["aliases"]
    assert [e.extra["previous_champion"] for e in events] == [first]
    assert _version(case, result["version"]).tags["trainforge.previous_champion"] == first
    old = _version(case, first)
    assert old.tags["trainforge.superseded_by"] == result["version"] and "champion" not in old.aliases
    run = MlflowHook(tracking_uri=case["server"]).client.get_run(result["run_id"])
    assert run.data.tags["trainforge.gate.decision"] == "pass"
    assert run.data.tags["trainforge.gate.champion_after"] == result["version"]
    case["results"]["second"] = result


def test_a_retry_keeps_the_version_and_the_recorded_comparison(case):
    second = case["results"]["second"]
    result, events = _register(case, "run-2", "good")
    assert (result["version"], result["created"]) == (second["version"], False)
    assert result["gate"]["reason"] == second["gate"]["reason"] and result["gate"]["decision"] == "pass"
    assert len(events) == 1  # the failed first try emitted nothing, so a retry announces it


def test_a_worse_version_fails_the_gate_and_the_task_succeeds(case):
    champion = case["results"]["second"]["version"]
    result, events = _register(case, "run-3", "zero")
    gate = result["gate"]
    assert gate["decision"] == "fail" and gate["champion_after"] == champion and not gate["promoted"]
    assert "relative improvement; needs any improvement" in gate["reason"]
    assert result["aliases"] == ["challenger"] and events == []
    mv = _version(case, result["version"])
    assert mv.tags["trainforge.gate.decision"] == "fail" and mv.tags["trainforge.gate.reason"] == gate["reason"]
    assert "eval gate FAILED" in mv.description


def test_champion_loads_back_and_generates(case, monkeypatch):
    import mlflow.transformers

    monkeypatch.setenv("MLFLOW_TRACKING_URI", case["server"])
    generator = mlflow.transformers.load_model(f"models:/{case['name']}@champion")
    text = generator("ROMEO:", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert text.startswith("ROMEO:") and len(text) > len("ROMEO:")
    # The example downstream DAG's task does the same through its own helper.
    spec = importlib.util.spec_from_file_location("handoff", REPO / "dags" / "model_handoff_example.py")
    handoff = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(handoff)
    smoke = handoff.smoke_generate(case["name"], "ROMEO:", max_new_tokens=4, event_version="1")
    assert smoke["version"] == case["results"]["second"]["version"] and smoke["text"].startswith("ROMEO:")


def test_checkpoints_as_logged_models_the_best_found_and_registered_from(case):
    """Both checkpoints become external LoggedModels of the run; search_logged_models by
    val_loss finds the better one; the version is created from it."""
    import mlflow.artifacts

    hook = MlflowHook(tracking_uri=case["server"])
    spec = PipelineSpec.model_validate(case["spec"])
    run_id = hook.get_or_create_run(spec.experiment_name, "tiny_gate", "run-4")
    dataset = ("tiny-dataset", "d" * 36)
    hook.log_dataset_input(run_id, "tiny-dataset", "d" * 64, case["prepared"]["dataset_dir"])
    ids = {which: hook.log_checkpoint_model(run_id, case[which]["checkpoint"], case[which]["step"],
                                            case[which]["metrics"], {"ok": True, "which": which},
                                            dataset)
           for which in ("zero", "good")}
    assert hook.log_checkpoint_model(run_id, case["good"]["checkpoint"], case["good"]["step"],
                                     case["good"]["metrics"], {}, dataset) == ids["good"]  # a retry
    client = hook.client
    model = client.get_logged_model(ids["good"])
    assert model.tags["trainforge.checkpoint"] == case["good"]["checkpoint"]  # where it lies
    assert model.tags["mlflow.model.isExternal"] == "true" and model.source_run_id == run_id
    assert model.params["step"] == str(case["good"]["step"])
    linked = {m.key: m for m in model.metrics}
    assert linked["val_loss"].value == pytest.approx(case["good"]["metrics"]["val_loss"])
    assert (linked["val_loss"].dataset_name, linked["val_loss"].step) == ("tiny-dataset", 10)
    report = json.loads(Path(mlflow.artifacts.download_artifacts(
        f"{model.artifact_location}/validation_report.json", tracking_uri=case["server"])).read_text())
    assert report == {"ok": True, "which": "good"}
    assert case["zero"]["metrics"]["val_loss"] > case["good"]["metrics"]["val_loss"]
    best = hook.best_checkpoint_model(run_id, "val_loss")
    assert (best["model_id"], best["checkpoint"]) == (ids["good"], case["good"]["checkpoint"])
    assert hook.best_checkpoint_model(run_id, "val_loss", lowest=False)["model_id"] == ids["zero"]

    case["good_model"] = {**case["good"], "model_id": ids["good"]}  # validate_checkpoint's XCom
    result, _ = _register(case, "run-4", "good_model")
    mv = _version(case, result["version"])
    assert mv.source == f"models:/{ids['good']}" and result["model_id"] == ids["good"]
    assert "mlflow.model.isExternal" not in client.get_logged_model(ids["good"]).tags
    again, _ = _register(case, "run-4", "good_model")  # a retry: same version, same model
    assert (again["version"], again["created"], again["model_id"]) == (result["version"], False,
                                                                         ids["good"])
