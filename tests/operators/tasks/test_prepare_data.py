"""The prepare_data operator: spec -> settings, the data spec's errors, the dataset asset, and
``execute`` against a real MLflow server on loopback (lineage, asset event extra, a tokenizer
reused from a registered model ``models:/name@alias``).

``execute`` runs outside Airflow's DB: its context is a small fake task instance plus the Task
SDK's own ``OutletEventAccessors``, which is all it reads.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from trainforge.tasks.prepare_data import (
    PrepareDataOperator, dataset_asset, dataset_root_uri, fetch_registered_tokenizer,
    prepare_settings, staging_root,
)
from trainforge.pipeline.data import DataSection
from trainforge.pipeline.loader import load_spec
from trainforge.pipeline.spec import PipelineSpec

REPO = Path(__file__).resolve().parents[3]


def tiny_spec(**data: Any) -> dict[str, Any]:
    raw = load_spec(REPO / "tests" / "e2e" / "tiny_shakespeare.yaml").model_dump(mode="json")
    raw["data"].update(data)
    return raw


class FakeTI:
    """What PrepareDataOperator.execute reads from its task instance."""

    def __init__(self, run_id: str) -> None:
        self.dag_id, self.run_id, self.task_id, self.try_number = "tiny_shakespeare", run_id, \
            "prepare_data", 1
        self.pushed: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.pushed[key] = value


def test_every_data_field_reaches_the_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINFORGE_HOME", str(tmp_path))
    spec = PipelineSpec.model_validate(tiny_spec(
        sources=["corpus/*.jsonl.zst", "s3://bkt/x/**/*.parquet"], format="auto",
        compression="zstd", text_field="body", on_malformed="skip",
        s3_endpoint_url="http://127.0.0.1:9000", encode_workers=3, memory_budget_mib=256,
        shard_tokens=4096, cleaning={"min_document_chars": 5, "max_document_chars": 500,
                                     "deduplicate": False, "unicode_normalization": "NFKC"},
        tokenizer={"vocab_size": 2048, "source": "tok/tokenizer.json"}))
    settings = prepare_settings(spec)
    assert settings.sources == (str(tmp_path / "corpus/*.jsonl.zst"), "s3://bkt/x/**/*.parquet")
    assert (settings.format, settings.compression, settings.text_field, settings.on_malformed) \
        == ("auto", "zstd", "body", "skip")
    assert (settings.min_document_chars, settings.max_document_chars, settings.deduplicate,
            settings.unicode_normalization) == (5, 500, False, "NFKC")
    assert settings.vocab_size == 2048
    assert settings.tokenizer_uri == str(tmp_path / "tok/tokenizer.json")
    assert (settings.encode_workers, settings.memory_budget_mib, settings.shard_tokens,
            settings.s3_endpoint_url) == (3, 256, 4096, "http://127.0.0.1:9000")
    assert prepare_settings(spec, "/dl/tokenizer.json").tokenizer_uri == "/dl/tokenizer.json"


def test_defaults_keep_the_demo_as_it_was():
    data = DataSection(sources=["corpus/*.txt"])
    assert (data.format, data.compression, data.on_malformed, data.encode_workers) == \
        ("text", "auto", "fail", 0)
    assert data.cleaning.deduplicate and data.tokenizer.source is None


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"sources": ["http://host/x.txt"]}, "must be a local path or an s3:// URI (got 'http"),
        ({"sources": ["s3://B/x"]}, "not an s3://bucket/key URI (got 's3://B/x'"),
        ({"sources": ["   "]}, "may not be empty"),
        ({"output_uri": "gs://b/x"}, "output_uri must be a local path or an s3:// URI"),
        ({"s3_endpoint_url": "http://key:secret@minio:9000"}, "without user or password"),
        ({"tokenizer": {"source": "models:/name"}}, "'models:/<name>@<alias>'"),
        ({"cleaning": {"min_document_chars": 10, "max_document_chars": 5}},
         "max_document_chars must be >= min_document_chars (got 5 < 10)"),
        ({"format": "csv"}, "Input should be 'text', 'jsonl', 'parquet', 'auto', 'chat' or 'prompt_completion'"),
        ({"encode_workers": -1}, "greater than or equal to 0"),
        ({"on_malformed": "ignore"}, "'fail' or 'skip'"),
        ({"text_fild": "body"}, "Extra inputs are not permitted"),
    ],
)
def test_bad_data_specs_name_the_field_and_value(data, fragment):
    with pytest.raises(ValidationError) as info:
        DataSection.model_validate({"sources": ["corpus/*.txt"], **data})
    assert fragment in str(info.value)


def test_the_dataset_asset_is_the_dataset_root(monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINFORGE_HOME", str(tmp_path))
    local = PipelineSpec.model_validate(tiny_spec())
    assert dataset_root_uri(local) == (tmp_path / "datasets").as_uri()
    assert dataset_asset(local).uri == (tmp_path / "datasets").as_uri()
    remote = PipelineSpec.model_validate(tiny_spec(output_uri="s3://bkt/team/datasets/"))
    assert dataset_asset(remote).uri == "s3://bkt/team/datasets"
    assert staging_root("s3://bkt/team/datasets") == tmp_path / "staging/datasets/bkt/team/datasets"


def test_the_dag_declares_the_asset_as_prepare_data_outlet(monkeypatch, tmp_path):
    from trainforge.dag_builder import build_dag

    monkeypatch.setenv("TRAINFORGE_HOME", str(tmp_path))
    dag = build_dag(PipelineSpec.model_validate(tiny_spec()))
    assert [a.uri for a in dag.get_task("prepare_data").outlets] == \
        [(tmp_path / "datasets").as_uri()]


# -- against a real MLflow server -------------------------------------------------------------


def register_tokenizer(url: str, name: str, tokenizer_json: bytes, tmp_path: Path) -> str:
    """Register a model version whose artifacts hold components/tokenizer/tokenizer.json (the
    layout of mlflow.transformers models); alias it ``champion``. Returns the version."""
    from mlflow import MlflowClient

    client = MlflowClient(url, registry_uri=url)
    experiment = client.create_experiment(f"tok-{uuid.uuid4().hex[:8]}")
    run = client.create_run(experiment)
    model = client.create_logged_model(experiment_id=experiment, name="model",
                                       source_run_id=run.info.run_id)
    folder = tmp_path / f"model-{name}"
    (folder / "components" / "tokenizer").mkdir(parents=True)
    (folder / "components" / "tokenizer" / "tokenizer.json").write_bytes(tokenizer_json)
    (folder / "config.json").write_text("{}")
    client.log_model_artifacts(model.model_id, str(folder))
    client.finalize_logged_model(model.model_id, "READY")
    client.create_registered_model(name)
    version = client.create_model_version(name, source=f"models:/{model.model_id}",
                                          run_id=run.info.run_id, model_id=model.model_id)
    client.set_registered_model_alias(name, "champion", version.version)
    return str(version.version)


@pytest.mark.integration
def test_fetch_registered_tokenizer_by_alias_and_version(mlflow_server, tmp_path):
    from trainforge.hooks.mlflow import MlflowHook

    name = f"tok-{uuid.uuid4().hex[:8]}"
    version = register_tokenizer(mlflow_server, name, b'{"tokenizer": 1}', tmp_path)
    hook = MlflowHook(tracking_uri=mlflow_server)
    path, resolved = fetch_registered_tokenizer(hook, f"models:/{name}@champion",
                                                tmp_path / "dl")
    assert resolved == f"models:/{name}/{version}" and path.read_bytes() == b'{"tokenizer": 1}'
    again, _ = fetch_registered_tokenizer(hook, f"models:/{name}/{version}",
                                          tmp_path / "dl")
    assert again == path
    from trainforge.data import TokenizerSourceError

    with pytest.raises(TokenizerSourceError, match="the registry has no such version"):
        fetch_registered_tokenizer(hook, f"models:/{name}@nope", tmp_path / "dl")


@pytest.mark.integration
def test_execute_logs_lineage_and_sets_the_asset_event(mlflow_server, tmp_path, monkeypatch):
    from mlflow import MlflowClient
    from tokenizers import Tokenizer

    from airflow.sdk.execution_time.context import OutletEventAccessors

    from tests.operators.data.conftest import write_corpus

    monkeypatch.setenv("TRAINFORGE_HOME", str(tmp_path))
    write_corpus(tmp_path / "corpus" / "shakespeare", count=8, lines=40)
    (tmp_path / "corpus" / "shakespeare" / "dup_gut.txt").write_text(
        (tmp_path / "corpus" / "shakespeare" / "doc-03.txt").read_text())
    spec = tiny_spec(sources=["corpus/shakespeare/*.txt"], tokenizer={"vocab_size": 320},
                     encode_workers=1)
    asset = dataset_asset(PipelineSpec.model_validate(spec))
    operator = PrepareDataOperator(task_id="prepare_data", spec=spec, outlets=[asset],
                                   mlflow_tracking_uri=mlflow_server)
    events = OutletEventAccessors()
    ti = FakeTI(f"manual__{uuid.uuid4().hex[:8]}")
    summary = operator.execute({"ti": ti, "params": {}, "outlet_events": events})

    assert summary["documents_in"] == 9 and summary["removed"]["duplicate"] == 1
    assert summary["dataset_uri"] == Path(summary["dataset_dir"]).as_uri()
    assert events[asset].extra == {
        "digest": summary["digest"], "dataset_uri": summary["dataset_uri"],
        "tokens_train": summary["tokens"]["train"],
        "tokens_validation": summary["tokens"]["validation"], "reused": False}
    run = MlflowClient(mlflow_server).get_run(summary["mlflow_run_id"])
    [dataset_input] = run.inputs.dataset_inputs
    tags = {t.key: t.value for t in dataset_input.tags}
    assert tags["trainforge.dataset_digest"] == summary["digest"]
    assert tags["removed.duplicate"] == "1" and tags["documents_in"] == "9"
    assert tags["tokens.train"] == str(summary["tokens"]["train"])
    assert "doc-00.txt" in tags["sources"] and tags["source_patterns"] == "corpus/shakespeare/*.txt"
    assert run.data.metrics["data/removed_duplicate"] == 1
    assert run.data.params["data.tokenizer_source"] == "trained"

    # Continued training: a second pipeline reuses the tokenizer of a registered model.
    name = f"tok-{uuid.uuid4().hex[:8]}"
    tokenizer = (Path(summary["dataset_dir"]) / "tokenizer.json").read_bytes()
    version = register_tokenizer(mlflow_server, name, tokenizer, tmp_path)
    spec2 = tiny_spec(sources=["corpus/shakespeare/doc-0[0-5].txt"],
                      tokenizer={"vocab_size": 320, "source": f"models:/{name}@champion"})
    operator2 = PrepareDataOperator(task_id="prepare_data", spec=spec2, outlets=[asset],
                                    mlflow_tracking_uri=mlflow_server)
    summary2 = operator2.execute({"ti": FakeTI(f"manual__{uuid.uuid4().hex[:8]}"), "params": {},
                                  "outlet_events": OutletEventAccessors()})
    assert summary2["tokenizer_source"] == f"models:/{name}/{version}"
    assert (Path(summary2["dataset_dir"]) / "tokenizer.json").read_bytes() == tokenizer
    assert Tokenizer.from_file(str(Path(summary2["dataset_dir"]) / "tokenizer.json"))
