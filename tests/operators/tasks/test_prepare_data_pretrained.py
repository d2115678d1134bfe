"""The prepare_data task with ``model.pretrained``: the model is resolved once, the dataset is
encoded with its folder's tokenizer and EOS, the XCom carries the job config's ``pretrained``
section and the lineage names the model; an unusable source fails permanently, naming the URI
and the file. MLflow is a recording fake here (tests/operators/tasks/test_prepare_data.py runs
the task against a real server); the model is a tiny HF-layout folder (tests/hf_models.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from airflow.exceptions import AirflowFailException

from tests.hf_models import make_hf_model
from tests.operators.data.conftest import write_corpus
from trainforge.storage.files import sha256_file
from trainforge.pipeline.loader import load_spec
from trainforge.paths import resolve
from trainforge.pipeline.spec import PipelineSpec
from trainforge.tasks.prepare_data import PrepareDataOperator, prepare_settings

REPO = Path(__file__).resolve().parents[3]


class FakeHook:
    """The MlflowHook calls prepare_data makes, recorded."""

    tracking_uri = "http://mlflow.invalid"

    def __init__(self) -> None:
        self.params: dict[str, Any] = {}
        self.inputs: list[dict[str, Any]] = []

    def get_or_create_run(self, **_: Any) -> str:
        return "run-1"

    def get_run(self, run_id: str) -> Any:
        raise RuntimeError("no server")  # the run link is optional

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        self.params.update(params)

    def log_dataset_input(self, run_id: str, **kwargs: Any) -> None:
        self.inputs.append(kwargs)

    def log_metrics(self, *_: Any) -> None: ...

    def set_tags(self, *_: Any) -> None: ...

    def log_dict_artifact(self, *_: Any) -> None: ...


class FakeTI:
    dag_id, run_id, task_id, try_number = "pretrained", "manual__1", "prepare_data", 1

    def xcom_push(self, key: str, value: Any) -> None: ...


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TRAINFORGE_HOME", str(tmp_path))
    write_corpus(tmp_path / "corpus", count=8, lines=30)
    return tmp_path


def pretrained_spec(folder: Path | str) -> dict[str, Any]:
    raw = load_spec(REPO / "tests" / "e2e" / "tiny_shakespeare.yaml").model_dump(mode="json")
    raw["model"] = {"pretrained": str(folder)}
    raw["data"].pop("tokenizer")
    raw["data"].update(sources=["corpus/*.txt"], encode_workers=1)
    return raw


def run(spec: dict[str, Any]) -> tuple[dict[str, Any], FakeHook]:
    operator = PrepareDataOperator(task_id="prepare_data", spec=spec)
    hook = FakeHook()
    operator.__dict__["mlflow_hook"] = hook  # the cached_property's slot
    return operator.execute({"ti": FakeTI(), "params": {}}), hook


def test_prepare_data_encodes_with_the_pretrained_folders_tokenizer(home):
    folder = make_hf_model(home / "models" / "tiny-qwen3", "qwen3")
    summary, hook = run(pretrained_spec(folder))
    assert summary["pretrained"] == {"folder": str(folder), "source": str(folder),
                                     "revision": None}
    assert summary["tokenizer_source"] == str(folder)
    manifest = json.loads((Path(summary["dataset_dir"]) / "manifest.json").read_text())
    assert manifest["eos_token"] == "<|im_end|>" and len(manifest["eos_ids"]) == 2
    assert manifest["tokenizer"]["sha256"] == sha256_file(folder / "tokenizer.json")
    assert hook.params["data.tokenizer_source"] == str(folder)
    assert hook.params["data.vocab_size"] == manifest["vocab_size"] == summary["vocab_size"]
    assert hook.inputs[0]["extra_tags"]["tokenizer"] == str(folder)
    # A relative folder resolves against TRAINFORGE_HOME; same tokenizer, same dataset.
    again, _ = run(pretrained_spec("models/tiny-qwen3"))
    assert again["digest"] == summary["digest"] and again["reused"]


def test_the_settings_take_the_models_tokenizer_and_not_vocab_size(home):
    from trainforge.data import load_model_eos

    folder = make_hf_model(home / "m", "mistral")
    spec = PipelineSpec.model_validate(pretrained_spec(folder))
    settings = prepare_settings(spec, model_eos=load_model_eos(folder))
    assert (settings.tokenizer_uri, settings.eos_token, settings.eos_ids, settings.vocab_size) \
        == (str(folder / "tokenizer.json"), "</s>", (2,), None)


def test_a_folder_without_an_eos_fails_permanently_naming_uri_and_file(home):
    folder = make_hf_model(home / "m", "mistral")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|not-there|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(AirflowFailException) as info:
        run(pretrained_spec(folder))
    message = str(info.value)
    assert f"model.pretrained {str(folder)!r}" in message
    assert str(folder / "tokenizer_config.json") in message and "'<|not-there|>'" in message


def test_a_source_that_does_not_resolve_fails_permanently_naming_it(home):
    folder = make_hf_model(home / "m", "llama")
    shutil.rmtree(folder)
    (home / "m").mkdir()
    with pytest.raises(AirflowFailException) as info:
        run(pretrained_spec(folder))
    assert str(folder) in str(info.value) and "config.json" in str(info.value)


def test_a_folder_the_trainer_could_not_load_fails_here_before_any_job(home):
    """The trainer's own folder checks run here (their variants are tested in process in
    tests/trainer/test_pretrained.py): a missing shard fails the task before anything is encoded."""
    folder = make_hf_model(home / "m", "llama")
    next(folder.glob("model-00002-of-*.safetensors")).unlink()
    spec = pretrained_spec(folder)
    with pytest.raises(AirflowFailException, match=r"names shard model-00002-of-\d+\.safetensors, which is "
                                                   r"missing") as info:
        run(spec)
    assert str(info.value).startswith("data preparation for ")
    output = Path(resolve(PipelineSpec.model_validate(spec).data.output_uri))
    assert not output.exists() or not any(output.iterdir())  # nothing encoded
