"""The loader's cache of valid specs: same spec as from YAML, never stale, never for errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainforge.pipeline import SpecError, load_spec
from trainforge.pipeline import loader

DEMO = Path(__file__).resolve().parents[3] / "dags" / "pipelines" / "shakespeare_llm.yaml"


@pytest.fixture
def cache(tmp_path):
    loader.enable_cache(tmp_path / "cache")
    yield tmp_path / "cache"
    loader.enable_cache(None)


def _entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.json")) if cache.exists() else []


def test_a_cached_spec_equals_the_one_read_from_yaml(cache, tmp_path):
    spec_file = tmp_path / "p.yaml"
    spec_file.write_text(DEMO.read_text())
    first = load_spec(spec_file)
    assert len(_entries(cache)) == 1
    spec_file.write_text(DEMO.read_text())  # same bytes, new mtime: still a hit
    assert load_spec(spec_file) == first
    loader.enable_cache(None)
    assert load_spec(spec_file) == first


def test_an_edited_spec_is_read_again(cache, tmp_path):
    spec_file = tmp_path / "p.yaml"
    spec_file.write_text(DEMO.read_text())
    load_spec(spec_file)
    spec_file.write_text(DEMO.read_text().replace("max_steps: 300", "max_steps: 200"))
    assert load_spec(spec_file).training.optimization.max_steps == 200


def test_errors_are_never_cached_and_keep_their_positions(cache, tmp_path):
    spec_file = tmp_path / "p.yaml"
    spec_file.write_text(DEMO.read_text())
    load_spec(spec_file)
    spec_file.write_text(DEMO.read_text().replace("max_steps: 300", "max_stepz: 300"))
    with pytest.raises(SpecError, match=r"p.yaml:\d+:\d+: training.optimization.max_stepz"):
        load_spec(spec_file)
    with pytest.raises(SpecError):  # and again: the old valid entry is not used
        load_spec(spec_file)


def test_another_model_version_or_a_damaged_entry_is_a_miss(cache, tmp_path, monkeypatch):
    spec_file = tmp_path / "p.yaml"
    spec_file.write_text(DEMO.read_text())
    load_spec(spec_file)
    [entry] = _entries(cache)
    entry.write_text('{"key": "x", "spec": {"pipeline": 1}}')
    assert load_spec(spec_file).dag_id == "shakespeare_llm"
    entry.write_text("not json")
    assert load_spec(spec_file).dag_id == "shakespeare_llm"
    before = entry.read_text()
    monkeypatch.setattr(loader, "_code_version", "another-model")
    assert load_spec(spec_file).dag_id == "shakespeare_llm"
    assert entry.read_text() != before  # re-read from YAML and stored under the new key
