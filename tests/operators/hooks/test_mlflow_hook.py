"""Unit tests of trainforge.hooks.mlflow: no server; fakes stand in for the MLflow client."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trainforge.hooks.errors import (
    MlflowConfigError,
    MlflowInvalidArgumentError,
    MlflowRegistrationError,
    MlflowTimeoutError,
)
from trainforge.hooks.mlflow import MlflowHook
from trainforge.hooks.mlflow_runs import _run_name
from trainforge.hooks.mlflow_calls import fluent_tracking_uri, quote
from trainforge.hooks.mlflow_model_links import TAG_IDEMPOTENCY_KEY, default_pip_requirements
from trainforge.hooks.mlflow_versions import wait_model_version_ready

CLOSED_URL = "http://127.0.0.1:9"  # nothing listens on the discard port; never contacted here


def test_importing_the_hook_does_not_import_mlflow() -> None:
    code = (
        "import sys, trainforge.hooks.mlflow, trainforge.hooks.mlflow_registry; "
        "heavy = [m for m in ('mlflow', 'torch', 'transformers') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[3])


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({}, "no MLflow tracking URI"),
        ({"tracking_uri": "http://alice:s3cret@mlflow:5000"}, "carries credentials"),
        ({"conn_id": "mlflow_missing"}, "could not be read"),
        ({"conn_id": "mlflow_secret"}, "carries a login or password"),
    ],
)
def test_config_errors(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, str], fragment: str
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("AIRFLOW_CONN_MLFLOW_SECRET", "http://alice:s3cret@mlflow:5000")
    with pytest.raises(MlflowConfigError, match=fragment) as info:
        _ = MlflowHook(**kwargs).tracking_uri
    assert "s3cret" not in str(info.value)


def test_tracking_uri_from_an_airflow_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("AIRFLOW_CONN_MLFLOW_DEFAULT", "https://mlflow.internal:8443")
    assert MlflowHook(conn_id="mlflow_default").tracking_uri == "https://mlflow.internal:8443"


def test_tracking_uri_from_argument_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env-host:5000")
    assert MlflowHook().tracking_uri == "http://env-host:5000"
    assert MlflowHook(tracking_uri="http://arg:1").tracking_uri == "http://arg:1"


@pytest.mark.parametrize(
    ("value", "quoted"),
    [
        ("manual__2024-01-01T00:00:00+00:00", "'manual__2024-01-01T00:00:00+00:00'"),
        ("it's", '"it\'s"'),
    ],
)
def testquote(value: str, quoted: str) -> None:
    assert quote("run_id", value) == quoted


def test_quote_refuses_both_quote_kinds() -> None:
    with pytest.raises(MlflowInvalidArgumentError, match="run_id"):
        quote("run_id", "a'b\"c")


def test_run_name_is_sanitised() -> None:
    assert _run_name("shakespeare.tiny", "manual__2024-01-01T00:00:00+00:00") == (
        "shakespeare.tiny/manual__2024-01-01T00_00_00_00_00"
    )


def test_end_run_rejects_unknown_status_before_any_call() -> None:
    with pytest.raises(MlflowInvalidArgumentError, match="RUNNING"):
        MlflowHook(tracking_uri=CLOSED_URL).end_run("abc", "RUNNING")


def test_log_metrics_rejects_non_numbers_before_any_call() -> None:
    with pytest.raises(MlflowInvalidArgumentError, match="'loss'"):
        MlflowHook(tracking_uri=CLOSED_URL).log_metrics("abc", {"loss": "low"})


def test_default_pip_requirements_are_pinned_without_local_labels() -> None:
    pins = default_pip_requirements()
    assert any(p.startswith("transformers==") for p in pins)
    assert any(p.startswith("torch==") for p in pins)
    assert not any("+" in p or p.startswith("torchvision") for p in pins)


@pytest.mark.parametrize("env_before", [None, "http://from-env:5000"])
def test_fluent_tracking_uri_restores_global_and_environment(
    monkeypatch: pytest.MonkeyPatch, env_before: str | None
) -> None:
    import mlflow
    from mlflow.tracking._tracking_service import utils as tracking_utils

    if env_before is None:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", env_before)
    monkeypatch.setattr(tracking_utils, "_tracking_uri", None)
    with fluent_tracking_uri("http://scoped:1"):
        assert mlflow.get_tracking_uri() == "http://scoped:1"
    assert tracking_utils._tracking_uri is None
    assert os.environ.get("MLFLOW_TRACKING_URI") == env_before


# --- registration waits, with a fake registry client -------------------------------------------


class FakeVersion:
    def __init__(self, name: str, version: str, status: str, message: str | None = None) -> None:
        self.name, self.version, self.status, self.status_message = name, version, status, message
        self.aliases: list[str] = []
        self.tags: dict[str, str] = {}
        self.run_id, self.source, self.model_id = "run-1", "models:/m-1", "m-1"


class FakePage(list):
    token = None


class FakeRegistry:
    """Just the registry calls register_model_version makes; statuses scripted per poll."""

    def __init__(self, statuses: list[str], message: str | None = None) -> None:
        self.statuses = statuses
        self.message = message
        self.versions: dict[str, FakeVersion] = {}
        self.alias_calls: list[tuple[str, str, str]] = []
        self.polls = 0

    def search_model_versions(self, query: str, **_: Any) -> FakePage:
        return FakePage(v for v in self.versions.values() if v.tags.get(TAG_IDEMPOTENCY_KEY))

    def create_registered_model(self, name: str) -> None:
        pass

    def create_model_version(self, name: str, tags: dict[str, str], **_: Any) -> FakeVersion:
        version = FakeVersion(name, str(len(self.versions) + 1), "PENDING_REGISTRATION")
        version.tags = dict(tags)
        self.versions[version.version] = version
        return version

    def get_model_version(self, name: str, version: str) -> FakeVersion:
        status = self.statuses[min(self.polls, len(self.statuses) - 1)]
        self.polls += 1
        current = self.versions.setdefault(version, FakeVersion(name, version, status))
        current.status, current.status_message = status, self.message
        return current

    def set_registered_model_alias(self, name: str, alias: str, version: str) -> None:
        self.alias_calls.append((name, alias, version))


def test_wait_ready_returns_once_ready() -> None:
    client = FakeRegistry(["PENDING_REGISTRATION", "PENDING_REGISTRATION", "READY"])
    mv = wait_model_version_ready(client, "m", "1", timeout_s=5.0, interval_s=0.01)  # type: ignore[arg-type]
    assert (mv.status, client.polls) == ("READY", 3)


def test_wait_ready_times_out_with_last_status() -> None:
    client = FakeRegistry(["PENDING_REGISTRATION"], message="copying artifacts")
    with pytest.raises(
        MlflowTimeoutError, match=r"PENDING_REGISTRATION.*copying artifacts"
    ) as info:
        wait_model_version_ready(client, "m", "3", timeout_s=0.05, interval_s=0.01)  # type: ignore[arg-type]
    assert "m v3 to become READY" in str(info.value)


class FakeHook(MlflowHook):
    """The real registration flow over a FakeRegistry; model logging replaced by a fixed id."""

    def __init__(self, registry: FakeRegistry) -> None:
        super().__init__(tracking_uri=CLOSED_URL)
        self.__dict__["client"] = registry

    def _logged_model_for_key(self, *args: Any) -> str:
        return "m-fake"


def test_failed_registration_raises_and_moves_no_alias(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    registry = FakeRegistry(["FAILED_REGISTRATION"], message="artifact copy failed: disk full")
    with pytest.raises(MlflowRegistrationError, match="disk full") as info:
        FakeHook(registry).register_model_version(
            "run-1", tmp_path, "llm", "key-1", aliases=["challenger"], ready_timeout_s=1.0
        )
    assert info.value.status == "FAILED_REGISTRATION"
    assert registry.alias_calls == []


def test_registration_timeout_moves_no_alias(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    registry = FakeRegistry(["PENDING_REGISTRATION"])
    with pytest.raises(MlflowTimeoutError):
        FakeHook(registry).register_model_version(
            "run-1", tmp_path, "llm", "key-1", aliases=["challenger"],
            ready_timeout_s=0.05, poll_interval_s=0.01,
        )  # fmt: skip
    assert registry.alias_calls == []


def test_register_rejects_a_folder_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(MlflowInvalidArgumentError, match=r"config\.json"):
        FakeHook(FakeRegistry(["READY"])).register_model_version("run-1", tmp_path, "llm", "k")
