"""Checkpoints on S3 against a real S3-compatible server on loopback (moto in server mode):
manifest last, verify, resume, retention, multipart with throttling retries, listings past 1000
objects, and the validator quarantining on S3."""

from __future__ import annotations

import json
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from trainforge.storage import StorageError, s3
from trainforge.trainer import checkpoint as ckpt

pytestmark = pytest.mark.integration


@pytest.fixture
def bucket(s3_server, monkeypatch) -> str:
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    name = f"ckpt-{uuid.uuid4().hex[:10]}"
    s3.client().create_bucket(Bucket=name)
    return f"s3://{name}"


def _write(root: str, step: int, values: int = 12, fill: float = 1.0):
    weights = {"w": torch.full((values,), fill), "b": torch.arange(5, dtype=torch.float32)}
    state = {"step": step, "tokens_seen": step, "world_size": 1, "scheduler": {"step": step},
             "rng": [ckpt.capture_rng_state()]}
    return ckpt.write_checkpoint(root, step, weights, {"state": {}, "param_groups": []}, state, {"step": step})


@pytest.fixture
def calls():
    """Every S3 operation the client sends, in order: [(operation, key)]."""
    seen: list[tuple[str, str]] = []

    def record(params, model, **_):
        seen.append((model.name, params.get("Key", "")))

    s3.client().meta.events.register("before-parameter-build.s3", record)
    yield seen
    s3.client().meta.events.unregister("before-parameter-build.s3", record)


def test_manifest_is_written_last_and_the_checkpoint_round_trips(bucket, calls):
    root = f"{bucket}/runs/a"
    uri = _write(root, 10, fill=2.5)
    assert uri == f"{root}/step-00000010"
    writes = [key.rsplit("/", 1)[-1] for op, key in calls if op in ("PutObject", "CreateMultipartUpload")]
    assert writes[-1] == "manifest.json" and set(writes[:-1]) == set(ckpt.REQUIRED_FILES)
    assert ckpt.verify(uri) == [] and ckpt.list_step_dirs(root) == [(10, uri)]
    _write(root, 20)
    assert ckpt.newest_valid(root) == f"{root}/step-00000020"
    loaded = ckpt.load_checkpoint(uri)
    assert loaded.step == 10 and torch.equal(loaded.weights["w"], torch.full((12,), 2.5))
    assert str(loaded.path) == uri


def test_tampering_partial_uploads_and_retention(bucket):
    root = f"{bucket}/runs/b"
    for step in (10, 20, 30):
        _write(root, step)
    bucket_name, key = s3.split(f"{root}/step-00000030/{ckpt.OPTIMIZER}")
    size = s3.size_of(f"{root}/step-00000030/{ckpt.OPTIMIZER}")
    s3.client().put_object(Bucket=bucket_name, Key=key, Body=b"x" * size)  # same size, other bytes
    assert any("optimizer.pt: SHA-256" in p for p in ckpt.verify(f"{root}/step-00000030"))
    s3.put_bytes(f"{root}/step-00000040/{ckpt.WEIGHTS}", b"half an upload")  # killed before the manifest
    assert "missing (a folder without a manifest" in ckpt.verify(f"{root}/step-00000040")[0]
    assert ckpt.newest_valid(root) == f"{root}/step-00000020"
    deleted = ckpt.apply_retention(root, keep_last=1)
    assert deleted == [f"{root}/step-00000010"]
    assert [s for s, _ in ckpt.list_step_dirs(root)] == [20, 30, 40]  # newer than the newest valid: kept


def test_multipart_upload_survives_server_side_503_slowdown(bucket, throttling_s3_proxy, monkeypatch):
    """Real HTTP 503 SlowDown answers from a throttling proxy in front of the S3 server: the
    first two UploadPart requests of the weights and the manifest's PutObject are refused, and
    botocore's retries (trainforge.storage.s3.RETRY_MODE, MAX_ATTEMPTS) send them again after a back-off."""
    proxy = throttling_s3_proxy
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    assert s3.client().meta.endpoint_url == proxy.url
    assert s3.client().meta.config.retries == {"total_max_attempts": s3.MAX_ATTEMPTS, "mode": s3.RETRY_MODE}
    proxy.throttle("UploadPart", 2)
    proxy.throttle("PutObject", 1, key_suffix="/" + ckpt.MANIFEST)
    uri = _write(f"{bucket}/runs/c", 10, values=3 * (1 << 20))  # 12 MiB of weights: 2 parts
    weights_key = s3.split(f"{uri}/{ckpt.WEIGHTS}")[1]
    manifest_key = s3.split(f"{uri}/{ckpt.MANIFEST}")[1]
    assert sorted(proxy.throttled()) == [("PutObject", manifest_key), ("UploadPart", weights_key),
                                         ("UploadPart", weights_key)]
    parts = [status for op, key, status in proxy.log if op == "UploadPart" and key == weights_key]
    assert parts.count(503) == 2 and parts.count(200) == 2  # each refused part was sent again
    manifest = [status for op, key, status in proxy.log if op == "PutObject" and key == manifest_key]
    assert manifest == [503, 200]
    writes = [key.rsplit("/", 1)[-1] for op, key, status in proxy.log
              if op in ("PutObject", "CompleteMultipartUpload") and status == 200]
    assert writes[-1] == ckpt.MANIFEST  # still the commit point, after the retries
    assert ckpt.verify(uri) == []


def test_listing_more_than_1000_objects_survives_server_side_503_slowdown(bucket, throttling_s3_proxy, monkeypatch):
    prefix = f"{bucket}/many"
    with ThreadPoolExecutor(16) as pool:  # written straight to the server (moto endpoint)
        list(pool.map(lambda i: s3.put_bytes(f"{prefix}/step-{i:08d}/x", b"."), range(1003)))
    proxy = throttling_s3_proxy
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    proxy.throttle("ListObjectsV2", 1, query_has="continuation-token")  # the second page
    proxy.throttle("ListObjectsV2", 1)  # the first page
    assert len(list(s3.list_keys(prefix + "/"))) == 1003
    listed = [status for op, _, status in proxy.log if op == "ListObjectsV2"]
    assert listed == [503, 200, 503, 200]
    proxy.throttle("ListObjectsV2", 1)
    assert len(ckpt.list_step_dirs(prefix)) == 1003  # delimiter listing, all pages
    proxy.throttle("DeleteObjects", 1)
    assert s3.delete_prefix(prefix) == 1003 and list(s3.list_keys(prefix + "/")) == []
    assert [op for op, _ in proxy.throttled()].count("DeleteObjects") == 1


def test_s3_error_after_the_last_attempt_names_the_object(bucket, throttling_s3_proxy, monkeypatch):
    proxy = throttling_s3_proxy
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setattr(s3, "MAX_ATTEMPTS", 2)
    s3._CLIENTS.pop(proxy.url, None)
    proxy.throttle("PutObject", 2)
    with pytest.raises(StorageError, match=rf"S3 put {bucket}/x/meta.json failed: throttled 2 times "
                       rf"over [\d.]+ s \(last answer SlowDown \(HTTP 503\)"):
        s3.put_bytes(f"{bucket}/x/meta.json", b"{}")
    s3._CLIENTS.pop(proxy.url, None)
    assert [status for op, _, status in proxy.log if op == "PutObject"] == [503, 503]


def test_validator_quarantines_on_s3_and_export_reads_from_s3(bucket, trained_run, dataset_dir, tmp_path):
    from trainforge.trainer.export import export_checkpoint
    from trainforge.trainer.validate import validate_checkpoints

    root = f"{bucket}/runs/v"
    for step in (10, 20):
        local = trained_run["checkpoints"] / ckpt.step_dir_name(step)
        for path in local.iterdir():
            s3.upload_file(path, f"{root}/{local.name}/{path.name}")
    bad = f"{root}/step-00000020/{ckpt.OPTIMIZER}"
    data = bytearray((trained_run["checkpoints"] / "step-00000020" / ckpt.OPTIMIZER).read_bytes())
    data[len(data) // 2] ^= 0xFF
    s3.put_bytes(bad, bytes(data))

    report = validate_checkpoints(root, dataset_dir, "best_val_loss", quarantine_damaged=True,
                                  max_eval_tokens=128, max_new_tokens=1)
    assert report["ok"] and report["checkpoint"] == f"{root}/step-00000010"
    assert [q["moved_to"] for q in report["quarantined"]] == [f"{root}/quarantine/step-00000020"]
    reason = json.loads(s3.get_bytes(f"{root}/quarantine/step-00000020/{ckpt.QUARANTINE_REASON}"))
    assert reason["failed_checks"] == ["file_hashes"] and reason["checkpoint"] == f"{root}/step-00000020"
    assert ckpt.list_step_dirs(root) == [(10, f"{root}/step-00000010")]
    assert ckpt.newest_valid(root) == f"{root}/step-00000010"

    out = export_checkpoint(f"{root}/step-00000010", dataset_dir, tmp_path / "hf")
    info = json.loads((out / "trainforge_export.json").read_text())
    assert info["checkpoint"] == f"{root}/step-00000010" and (out / "config.json").is_file()
    shutil.rmtree(out)
