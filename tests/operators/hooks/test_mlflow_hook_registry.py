"""Model registration through MlflowHook against a real MLflow server on loopback.

One registered model and one DAG-run MLflow run for the module: logging the tiny model takes a
few seconds per version, so the cases build on each other in file order.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from trainforge.hooks.mlflow import MlflowHook
from trainforge.hooks.mlflow_model_links import TAG_IDEMPOTENCY_KEY

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def registry_case(mlflow_server: str) -> dict[str, str]:
    hook = MlflowHook(tracking_uri=mlflow_server)
    suffix = uuid.uuid4().hex[:8]
    run_id = hook.get_or_create_run(f"registry-{suffix}", "tiny.dag", f"manual__{suffix}")
    return {"run_id": run_id, "name": f"tiny-llm-{suffix}"}


def _versions_with_key(hook: MlflowHook, name: str, key: str) -> list[str]:
    found = hook.client.search_model_versions(
        f"name = '{name}' AND tags.`{TAG_IDEMPOTENCY_KEY}` = '{key}'"
    )
    return sorted(mv.version for mv in found)


def test_register_creates_one_version_sets_alias_and_leaves_run_status(
    hook: MlflowHook, registry_case: dict[str, str], tiny_hf_model_dir: Path
) -> None:
    run_id, name = registry_case["run_id"], registry_case["name"]
    before = hook.client.get_run(run_id).info
    result = hook.register_model_version(
        run_id, tiny_hf_model_dir, name, "ckpt-aaa", aliases=["challenger"],
        description="step 300", tags={"trainforge.step": 300},
    )  # fmt: skip
    assert result["created"] is True
    assert result["aliases"] == ["challenger"]
    assert result["model_uri"] == f"models:/{name}/{result['version']}"
    assert result["status"] == "READY"
    assert result["tags"]["trainforge.step"] == "300"
    after = hook.client.get_run(run_id).info
    assert (after.status, after.end_time) == (before.status, before.end_time) == ("RUNNING", None)
    by_alias = hook.get_model_version_by_alias(name, "challenger")
    assert by_alias is not None and by_alias["version"] == result["version"]
    assert by_alias["run_id"] == run_id
    logged = hook.client.get_logged_model(result["model_id"])
    assert (logged.experiment_id, logged.source_run_id) == (before.experiment_id, run_id)


def test_a_retry_before_registration_reuses_the_uploaded_model(
    hook: MlflowHook, registry_case: dict[str, str], tiny_hf_model_dir: Path
) -> None:
    """A crash between upload and create_model_version: the retry finds the READY upload."""
    version = hook.get_model_version_by_alias(registry_case["name"], "challenger")
    assert version is not None
    model_id = hook._logged_model_for_key(
        registry_case["run_id"], tiny_hf_model_dir, "ckpt-aaa", "text-generation", None
    )
    assert model_id == version["model_id"]


def test_same_key_again_reuses_the_version(
    hook: MlflowHook, registry_case: dict[str, str], tiny_hf_model_dir: Path
) -> None:
    run_id, name = registry_case["run_id"], registry_case["name"]
    first = hook.get_model_version_by_alias(name, "challenger")
    again = hook.register_model_version(
        run_id, tiny_hf_model_dir, name, "ckpt-aaa", aliases=["challenger", "candidate"]
    )
    assert first is not None
    assert (again["created"], again["version"]) == (False, first["version"])
    assert again["aliases"] == ["candidate", "challenger"]
    assert _versions_with_key(hook, name, "ckpt-aaa") == [first["version"]]


def test_two_keys_at_once_get_two_versions_on_a_finished_run(
    mlflow_server: str, registry_case: dict[str, str], tiny_hf_model_dir: Path
) -> None:
    run_id, name = registry_case["run_id"], registry_case["name"]
    MlflowHook(tracking_uri=mlflow_server).end_run(run_id, "FINISHED")

    def register(key: str) -> dict[str, Any]:
        return MlflowHook(tracking_uri=mlflow_server).register_model_version(
            run_id, tiny_hf_model_dir, name, key
        )

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(register, ["ckpt-bbb", "ckpt-ccc"]))
    assert all(r["created"] and r["status"] == "READY" for r in results)
    assert len({r["version"] for r in results}) == 2
    hook = MlflowHook(tracking_uri=mlflow_server)
    assert hook.client.get_run(run_id).info.status == "FINISHED"


def test_same_key_at_once_ends_with_one_version(
    mlflow_server: str, registry_case: dict[str, str], tiny_hf_model_dir: Path
) -> None:
    run_id, name = registry_case["run_id"], registry_case["name"]

    def register(_: int) -> dict[str, Any]:
        return MlflowHook(tracking_uri=mlflow_server).register_model_version(
            run_id, tiny_hf_model_dir, name, "ckpt-ddd", aliases=["racer"]
        )

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(register, range(2)))
    assert len({r["version"] for r in results}) == 1
    hook = MlflowHook(tracking_uri=mlflow_server)
    assert _versions_with_key(hook, name, "ckpt-ddd") == [results[0]["version"]]
    assert hook.get_model_version_by_alias(name, "racer")["version"] == results[0]["version"]


def test_missing_alias_or_model_is_none(hook: MlflowHook, registry_case: dict[str, str]) -> None:
    assert hook.get_model_version_by_alias(registry_case["name"], "champion") is None
    assert hook.get_model_version_by_alias(f"no-such-{uuid.uuid4().hex[:6]}", "champion") is None


def test_challenger_loads_back_and_generates(
    mlflow_server: str, registry_case: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow.transformers

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    pipeline = mlflow.transformers.load_model(f"models:/{registry_case['name']}@challenger")
    out = pipeline("ROMEO:", max_new_tokens=8, do_sample=False)
    text = out[0]["generated_text"]
    assert text.startswith("ROMEO:") and len(text) > len("ROMEO:")
