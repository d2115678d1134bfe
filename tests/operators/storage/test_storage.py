"""trainforge.storage: the local implementation of the interface, the choice by location, and
that importing it pulls neither torch, boto3 nor Airflow (the trainer and DAG parsing both import
it). The S3 implementation runs against moto's server in tests/trainer/test_checkpoint_s3.py,
tests/trainer/test_dataset_cache.py and tests/operators/data/test_data_s3.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainforge.storage import LocalStorage, S3Storage, StorageError, storage_for


def test_storage_for_picks_by_scheme(tmp_path):
    assert isinstance(storage_for(tmp_path), LocalStorage)
    assert isinstance(storage_for(str(tmp_path)), LocalStorage)
    assert isinstance(storage_for("s3://bucket/prefix"), S3Storage)
    s3 = storage_for("s3://bucket/prefix/")
    assert s3.join("s3://bucket/prefix/", "step-1", "x") == "s3://bucket/prefix/step-1/x"
    assert s3.name("s3://bucket/prefix/step-1/") == "step-1" and s3.local_path("s3://b/k") is None


def test_local_storage_round_trip(tmp_path):
    store = LocalStorage()
    root = store.join(tmp_path, "root")
    assert store.list_dirs(root) == [] and not store.is_dir(root) and store.read_bytes(root / "x") is None
    with store.staging_dir(store.join(root, "step-1")) as folder:
        (folder / "a.bin").write_bytes(b"abc")
        store.publish(folder, store.join(root, "step-1"), ["a.bin"])
        store.write_bytes(folder / "manifest.json", b"{}")
    step = store.join(root, "step-1")
    assert store.list_dirs(root) == ["step-1"] and store.list_files(step) == ["a.bin", "manifest.json"]
    assert store.size(step / "a.bin") == 3 and store.size(step / "missing") is None
    assert store.sha256(step / "a.bin") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert not [p for p in step.iterdir() if ".tmp-" in p.name]  # atomic writes leave no temporaries
    with store.local_dir(step, ["a.bin"]) as local:
        assert local == step
    store.move_dir(step, store.join(root, "quarantine", "step-1"), first="manifest.json")
    assert store.list_dirs(root) == ["quarantine"] and store.list_dirs(root / "quarantine") == ["step-1"]
    assert store.delete_dir(root / "quarantine" / "step-1", first="manifest.json") == 2
    assert store.list_dirs(root / "quarantine") == []


def test_local_storage_errors_name_the_location(tmp_path):
    with pytest.raises(StorageError, match=rf"^read {tmp_path} failed: Is a directory"):
        LocalStorage().sha256(tmp_path)  # a folder is no file


def test_importing_storage_pulls_no_heavy_or_airflow_module():
    code = ("import sys, trainforge.storage; "
            "print(sorted(m for m in ('torch', 'boto3', 'botocore', 'airflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[3])
    assert out.stdout.strip() == "[]"
