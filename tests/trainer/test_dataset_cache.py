"""Datasets read from S3 (trainforge.trainer.dataset_cache) against a real S3-compatible server on loopback (moto
in server mode): downloaded once into a cache keyed by the digest, verified before use, never a
half-downloaded or tampered copy."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from trainforge.storage import s3
from trainforge.trainer.data import open_dataset
from trainforge.trainer.errors import DatasetError

pytestmark = pytest.mark.integration


@pytest.fixture
def s3_dataset(s3_server, monkeypatch, dataset_dir, tmp_path) -> str:
    """The trainer tests' dataset uploaded to ``s3://<bucket>/datasets/<digest>`` (manifest last)."""
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("TRAINFORGE_DATASET_CACHE", str(tmp_path / "cache"))
    bucket = f"data-{uuid.uuid4().hex[:10]}"
    s3.client().create_bucket(Bucket=bucket)
    digest = json.loads((dataset_dir / "manifest.json").read_text())["digest"]
    uri = f"s3://{bucket}/datasets/{digest}"
    for path in sorted(dataset_dir.iterdir(), key=lambda p: p.name == "manifest.json"):
        s3.upload_file(path, f"{uri}/{path.name}")
    return uri


def test_s3_dataset_is_downloaded_once_and_verified(s3_dataset, dataset_dir, tmp_path):
    local = open_dataset(dataset_dir)
    remote = open_dataset(s3_dataset)
    assert remote.digest == local.digest
    assert remote.dir == tmp_path / "cache" / local.digest
    assert {n: (s.tokens, s.sha256) for n, sp in remote.splits.items() for s in sp.shards} == \
        {n: (s.tokens, s.sha256) for n, sp in local.splits.items() for s in sp.shards}
    assert {p.name for p in (tmp_path / "cache").iterdir()} == {local.digest, f".{local.digest}.lock"}
    # Second open: the cached copy is used (nothing downloaded: the S3 objects may even be gone).
    for key in list(s3.list_keys(s3_dataset + "/")):
        if not key.endswith("manifest.json"):
            s3.delete_keys(s3_dataset, [key])
    assert open_dataset(s3_dataset).dir == remote.dir


def test_tampered_s3_dataset_is_never_used(s3_dataset, tmp_path):
    manifest = json.loads(s3.get_bytes(f"{s3_dataset}/manifest.json"))
    shard = manifest["splits"]["train"]["shards"][0]["file"]
    size = s3.size_of(f"{s3_dataset}/{shard}")
    s3.put_bytes(f"{s3_dataset}/{shard}", b"\x01" * size)  # same size, other bytes
    with pytest.raises(DatasetError, match=rf"does not match its manifest once downloaded: .*{shard}: SHA-256"):
        open_dataset(s3_dataset)
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []  # no half-verified copy, no temporary folder


def test_cached_copy_that_no_longer_verifies_is_downloaded_again(s3_dataset):
    first = open_dataset(s3_dataset)
    shard = first.splits["validation"].shards[0].path
    shard.write_bytes(b"\x02" * shard.stat().st_size)  # the disk copy rots
    again = open_dataset(s3_dataset)
    assert again.dir == first.dir and open_dataset(again.dir).digest == first.digest


def test_s3_dataset_without_manifest_does_not_exist(s3_dataset, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_S3_SETTLE_S", "0.5")  # the read-after-write allowance
    s3.delete_keys(s3_dataset, [s3.split(f"{s3_dataset}/manifest.json")[1]])
    with pytest.raises(DatasetError, match=r"manifest.json: missing.*; a dataset without a manifest does not exist"):
        open_dataset(s3_dataset)


def test_trainer_reads_s3_dataset_and_resumes_from_s3_checkpoints(s3_dataset, tmp_path, tools, monkeypatch):
    """The trainer with ``data.dataset_dir`` and ``checkpoint.dir`` both on S3: checkpoints are
    written manifest last and pruned on S3, and a second launch resumes from the newest step
    whose manifest verifies, ignoring a torn upload."""
    from trainforge.trainer import checkpoint as ckpt

    bucket = s3.split(s3_dataset)[0]
    root = f"s3://{bucket}/checkpoints/tiny/manual__1"
    env = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                      "AWS_ENDPOINT_URL", "TRAINFORGE_DATASET_CACHE")}
    first = tools.make_job(s3_dataset, root, optim={"max_steps": 10}, checkpoint={"interval_steps": 5, "keep_last": 1})
    proc = tools.run_trainer(tools.write_job(tmp_path / "a.json", first), tmp_path / "a.result.json", **env)
    assert proc.returncode == 0, proc.stdout[-4000:]
    result = json.loads((tmp_path / "a.result.json").read_text())
    assert result["last_checkpoint"] == f"{root}/step-00000010"
    assert ckpt.list_step_dirs(root) == [(10, f"{root}/step-00000010")]  # step 5 pruned on S3
    s3.put_bytes(f"{root}/step-00000015/{ckpt.WEIGHTS}", b"torn")  # a killed upload: no manifest

    second = tools.make_job(s3_dataset, root, optim={"max_steps": 20}, checkpoint={"interval_steps": 5, "keep_last": 1})
    proc = tools.run_trainer(tools.write_job(tmp_path / "b.json", second), tmp_path / "b.result.json", **env)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert f"resuming from {root}/step-00000010 (step 10)" in proc.stdout
    assert "using the cached copy" in proc.stdout
    result = json.loads((tmp_path / "b.result.json").read_text())
    assert result["final_step"] == 20 and result["last_checkpoint"] == f"{root}/step-00000020"
    assert ckpt.list_step_dirs(root) == [(20, f"{root}/step-00000020")]  # torn step 15 and step 10 pruned
    assert ckpt.verify(f"{root}/step-00000020") == []
