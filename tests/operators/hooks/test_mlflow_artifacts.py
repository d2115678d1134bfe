"""Unit tests of trainforge.hooks.mlflow_artifacts: a model version's files, searched and
downloaded through a fake artifact repository (no server)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from trainforge.hooks.errors import MlflowModelSourceError
from trainforge.hooks.mlflow import MlflowHook
from trainforge.hooks.mlflow_artifacts import ModelVersionFiles


@dataclass
class Entry:
    path: str
    is_dir: bool


class FakeRepository:
    """Artifacts as ``{path: bytes}``; folders are implied by the paths."""

    artifact_uri = "s3://bucket/artifacts"

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    def list_artifacts(self, folder: str | None) -> list[Entry]:
        prefix = f"{folder}/" if folder else ""
        children: dict[str, bool] = {}
        for path in self.files:
            if path.startswith(prefix):
                head, _, rest = path[len(prefix):].partition("/")
                children[prefix + head] = bool(rest)
        return [Entry(path, is_dir) for path, is_dir in sorted(children.items())]

    def download_artifacts(self, path: str, dst_path: str) -> str:
        local = Path(dst_path) / path
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(self.files[path])
        return str(local)


FILES = {"model/tokenizer.json": b"deep", "a/b/c/tokenizer.json": b"deeper",
         "model/model.safetensors": b"w", "model/config.json": b"{}",
         "model/sub/extra.bin": b"x"}


@pytest.mark.parametrize(("files", "depth", "found"), [
    (FILES, 4, "model/tokenizer.json"),  # the shallowest wins
    ({"a/b/c/tokenizer.json": b""}, 2, None),  # deeper than the search goes
    ({"tokenizer.json": b"", "z/tokenizer.json": b""}, 0, "tokenizer.json"),
    ({}, 4, None),
])
def test_find_returns_the_shallowest_match(files, depth, found):
    assert ModelVersionFiles(FakeRepository(files), "m v1").find("tokenizer.json", depth) == found


def test_a_folder_download_takes_its_direct_files_only(tmp_path):
    files = ModelVersionFiles(FakeRepository(FILES), "m v1")
    folder = files.download_folder_files("model", tmp_path)
    assert folder == tmp_path / "model"
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json"]
    assert files.root_uri == "s3://bucket/artifacts"


@pytest.mark.parametrize("uri", ["models:/name", "runs:/abc/model", "models:/a/b/c"])
def test_a_uri_of_another_form_is_refused_before_any_call(uri):
    hook = MlflowHook(tracking_uri="http://127.0.0.1:9")  # never contacted
    with pytest.raises(MlflowModelSourceError, match="expected models:/<name>@<alias>"):
        hook.resolve_model_version(uri)
