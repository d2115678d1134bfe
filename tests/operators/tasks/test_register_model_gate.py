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
from trainforge.pipeline.spec import PipelineSpec

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
    zero = _with_weights(good, root / "zeroed" / "step-00000010", lambda key, value: torch.zeros_like(value))

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


def _with_weights(step_dir: Path, dest: Path, change) -> Path:
    """A copy of checkpoint ``step_dir`` at ``dest`` whose weights are ``change(key, tensor)``,
    its manifest's digest updated so that it verifies."""
    from trainforge.storage.files import atomic_write_json, sha256_file

    shutil.copytree(step_dir, dest)
    weights = safetensors.torch.load_file(dest / "model.safetensors")
    safetensors.torch.save_file({k: change(k, v) for k, v in weights.items()}, dest / "model.safetensors",
                                metadata={"format": "pt"})
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["files"]["model.safetensors"] = {"bytes": (dest / "model.safetensors").stat().st_size,
                                              "sha256": sha256_file(dest / "model.safetensors")}
    atomic_write_json(dest / "manifest.json", manifest)
    return dest


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


# -- registry.eval: the task score ------------------------------------------------------------

@pytest.fixture(scope="module")
def task_case(case, tmp_path_factory) -> dict[str, Any]:
    """Two checkpoints with bit-equal validation loss but different answers, a prompts file, and
    a spec with registry.eval for a model of their own.

    ``zero`` (all weights 0) predicts uniformly everywhere and greedily says the EOS (id 0) at
    once. ``echo`` is ``zero`` with one embedding row set (tied, so also its output row) and the
    final norm at 1: only where the input is that token is the hidden state non-zero, and there
    the token predicts itself, so ``echo`` repeats it. The token never occurs in the validation
    split, so both models score exactly ln(vocab) there.
    """
    from tokenizers import Tokenizer

    from trainforge.trainer.data import TokenStream, open_dataset

    root = tmp_path_factory.mktemp("task")
    dataset = open_dataset(case["prepared"]["dataset_dir"])
    tokenizer = Tokenizer.from_file(str(dataset.tokenizer_path))
    stream = TokenStream(dataset, "validation")
    seen = set(stream.read(0, stream.num_tokens).tolist())
    char, token = next((c, ids[0]) for c in "~@#^`|{}<>$%&" for ids in [tokenizer.encode(c).ids]
                       if len(ids) == 1 and ids[0] not in seen and ids[0] != dataset.eos_id)

    def echo_weights(key: str, value: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(value)
        if key.endswith("embed_tokens.weight"):
            out[token] = torch.linspace(1.0, 2.0, value.shape[1])
        elif key.endswith("norm.weight") and ".layers." not in key:  # the final norm
            out.fill_(1.0)
        return out

    zero = Path(case["zero"]["checkpoint"])
    echo = _with_weights(zero, root / "echo" / zero.name, echo_weights)
    from trainforge.trainer.validate import validate_checkpoint

    report = validate_checkpoint(echo, case["prepared"]["dataset_dir"], max_eval_tokens=256, max_new_tokens=1)
    assert report["ok"], report["checks"]
    assert report["metrics"]["val_loss"] == case["zero"]["metrics"]["val_loss"]  # bit-equal, by construction
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": char, "expected": char * 3}) + "\n")
    template = root / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    raw = json.loads(json.dumps(case["spec"]))
    raw["registry"]["model_name"] = case["name"] + "-task"
    raw["registry"]["eval"] = {"prompts": str(prompts), "scoring": "exact_match", "max_new_tokens": 3,
                               "chat_template": str(template)}
    spec = PipelineSpec.model_validate(raw).model_dump(mode="json")
    echo_validated = {"checkpoint": report["checkpoint"], "step": report["step"],
                      "checkpoint_digest": report["checkpoint_digest"], "metrics": report["metrics"]}
    return {**case, "name": raw["registry"]["model_name"], "spec": spec, "echo": echo_validated,
            "answer": char * 3}


def _run(case, result: dict[str, Any]):
    hook = MlflowHook(tracking_uri=case["server"])
    return hook, hook.client.get_run(result["run_id"])


def test_the_first_version_is_scored_on_the_task_and_its_card_shows_the_answers(task_case):
    result, events = _register(task_case, "task-1", "echo")
    gate = result["gate"]
    assert (gate["decision"], gate["champion_version"], gate["task_score"]) == ("pass", None, 1.0), gate
    assert "task score 1.00 (1/1)" in gate["reason"] and len(events) == 1
    hook, run = _run(task_case, result)
    assert run.data.metrics["eval/task_score"] == 1.0
    table = json.loads(Path(hook.client.download_artifacts(
        run.info.run_id, f"gate/task_eval-v{result['version']}.json")).read_text())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert rows == [{"model": "candidate", "version": result["version"], "prompt": task_case["answer"][0],
                     "expected": task_case["answer"], "generated": task_case["answer"], "correct": True}]
    card = _version(task_case, result["version"]).description
    assert "## Task score: 1.00 (1/1 correct, exact_match)" in card
    assert f"| {task_case['answer'][0]} | {task_case['answer']} | {task_case['answer']} | yes |" in card
    task_case["results"]["task-first"] = result


def test_a_lower_task_score_at_equal_loss_is_refused(task_case):
    champion = task_case["results"]["task-first"]["version"]
    result, events = _register(task_case, "task-2", "zero")
    gate = result["gate"]
    assert (gate["decision"], gate["champion_after"], events) == ("fail", champion, []), gate
    assert (gate["task_score"], gate["champion_task_score"]) == (0.0, 1.0)
    assert gate["reason"] == ("task score 0.00 (0/1) is below the champion's 1.00 (1/1) "
                              "(registry.eval.require_at_least_champion)")
    hook, run = _run(task_case, result)
    report = json.loads(Path(hook.client.download_artifacts(run.info.run_id, "gate/evaluation.json")).read_text())
    loss = {name: m["metrics"]["val_loss"] for name, m in report["models"].items()}
    assert loss["candidate"] == loss["champion"], loss  # the loss cannot tell them apart; the task can
    assert [r["generated"] for r in report["models"]["candidate"]["task"]["results"]] == [""]
    assert run.data.metrics["eval/task_score"] == 0.0
    assert "| no |" in _version(task_case, result["version"]).description


class StatesTI(FakeTI):
    """A task instance whose DAG run has these task states (what Airflow returns)."""

    def __init__(self, run_id: str, xcoms: dict[str, Any], states: dict[str, str]) -> None:
        super().__init__(run_id, xcoms)
        self.states = states

    def get_task_states(self, dag_id: str, run_ids: list[str]) -> dict[str, Any]:
        assert (dag_id, run_ids) == (self.dag_id, [self.run_id])
        return {self.run_id: dict(self.states)}


@pytest.mark.parametrize("validate_state", ["failed", "success"])
def test_champion_does_not_move_when_validation_was_marked_failed_meanwhile(case, validate_state):
    """The champion invariant without approval (issue 41): read at the move, from this DAG
    run's task states, not assumed from the graph."""
    from airflow.exceptions import AirflowFailException
    from airflow.providers.standard.operators.empty import EmptyOperator
    from airflow.sdk import DAG
    from airflow.sdk.execution_time.context import OutletEventAccessors

    name = f"{case['name']}-marked-{validate_state}"
    spec = {**case["spec"], "registry": {**case["spec"]["registry"], "model_name": name}}
    with DAG("tiny_gate", schedule=None):
        op = RegisterModelOperator(task_id="register_model", spec=spec, mlflow_tracking_uri=case["server"],
                                   outlets=[champion_outlet(name)])
        EmptyOperator(task_id="validate_checkpoint") >> op
    ti = StatesTI("run-marked", {"prepare_data": case["prepared"], "validate_checkpoint": case["zero"]},
                  {"validate_checkpoint": validate_state, "register_model": "running"})
    context = {"ti": ti, "params": {}, "outlet_events": OutletEventAccessors()}
    registry = MlflowHook(tracking_uri=case["server"]).client
    if validate_state == "success":
        assert op.execute(context)["gate"]["champion_after"] == "1"
        assert registry.get_model_version_by_alias(name, "champion").version == "1"
        return
    with pytest.raises(AirflowFailException, match="validate_checkpoint is failed in this DAG run"):
        op.execute(context)
    version = registry.get_model_version(name, "1")
    assert version.tags["trainforge.gate.decision"] == "fail"
    assert "validate_checkpoint is failed" in version.tags["trainforge.gate.reason"]
    assert "champion" not in (registry.get_registered_model(name).aliases or {})
