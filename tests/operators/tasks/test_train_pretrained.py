"""The ``train`` task's ``pretrained`` block: prepare_data's resolution when its XCom has one,
else resolved by the task itself; a source that cannot be used fails the task without retries."""

from __future__ import annotations

import json

import pytest
from airflow.sdk.exceptions import AirflowFailException

from trainforge.pipeline import parse_spec_text
from trainforge.tasks.train import TrainOperator
from tests.operators.pipeline.test_loader import MINIMAL


def _task(tmp_path, monkeypatch, uri: str):
    monkeypatch.setenv("TRAINFORGE_HOME", str(tmp_path))
    spec = parse_spec_text(MINIMAL + f"model:\n  pretrained: {uri}\n", "spec.yaml")
    op = TrainOperator(task_id="train", spec=spec.model_dump(mode="json"),
                       mlflow_tracking_uri="http://127.0.0.1:9")  # never called
    return op, op.plain_spec()


def test_prepare_datas_section_is_used_as_it_is(tmp_path, monkeypatch):
    op, spec = _task(tmp_path, monkeypatch, "models/qwen3")
    given = {"folder": str(tmp_path / "models" / "qwen3"), "source": "models/qwen3",
             "revision": None}
    assert op._pretrained(spec, {"dataset_dir": "/d", "pretrained": given}) == given


def test_without_it_the_task_resolves_the_source_itself(tmp_path, monkeypatch):
    folder = tmp_path / "models" / "qwen3"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    op, spec = _task(tmp_path, monkeypatch, "models/qwen3")
    assert op._pretrained(spec, {"dataset_dir": "/d"}) == {
        "folder": str(folder), "source": "models/qwen3", "revision": None}


def test_a_source_that_cannot_be_used_fails_permanently_naming_it(tmp_path, monkeypatch):
    op, spec = _task(tmp_path, monkeypatch, "models/missing")
    with pytest.raises(AirflowFailException, match=r"^model.pretrained models/missing: .*"
                                                   r"config.json does not exist"):
        op._pretrained(spec, {"dataset_dir": "/d"})


def test_a_spec_without_pretrained_has_no_block(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_HOME", str(tmp_path))
    spec = parse_spec_text(MINIMAL, "spec.yaml")
    op = TrainOperator(task_id="train", spec=spec.model_dump(mode="json"),
                       mlflow_tracking_uri="http://127.0.0.1:9")
    assert op._pretrained(op.plain_spec(), {"dataset_dir": "/d"}) is None
