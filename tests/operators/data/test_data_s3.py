"""S3 sources, tokenizer and output through a real S3-compatible server on loopback (moto's
server mode, the ``s3_server`` fixture); plus the stream-resume logic against a small fake."""

from __future__ import annotations

import io
import json

import pytest
from tests.operators.data.conftest import compress, corpus_texts, jsonl_bytes, parquet_bytes

from trainforge.data import (
    SourceAccessError, SourceChangedError, SourceNotFoundError, prepare_dataset, verify_dataset,
)
from trainforge.data import prepare as prepare_mod
from trainforge.data import s3
from trainforge.storage import s3 as storage_s3

pytestmark = pytest.mark.integration


def put(client, bucket: str, key: str, data: bytes) -> None:
    client.put_object(Bucket=bucket, Key=key, Body=data)


def shards(result) -> bytes:
    return b"".join((result.path / s["file"]).read_bytes()
                    for split in ("train", "validation")
                    for s in result.manifest["splits"][split]["shards"])


def test_s3_sources_match_the_same_files_on_disk(s3_env, s3_server, bucket, tmp_path,
                                                 make_settings):
    texts = corpus_texts()
    files = {"corpus/part-0.jsonl.gz": compress(jsonl_bytes(texts[:4]), "gzip"),
             "corpus/sub/part-1.jsonl.zst": compress(jsonl_bytes(texts[4:8]), "zstd"),
             "corpus/sub/part-2.parquet": parquet_bytes(texts[8:]),
             "corpus/README.md": b"not matched"}
    for key, data in files.items():
        put(s3_env, bucket, key, data)
        if key.endswith(("gz", "zst", "parquet")):
            (tmp_path / "local" / key).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "local" / key).write_bytes(data)
    remote = prepare_dataset(
        make_settings(f"s3://{bucket}/corpus/**/part-*", format="auto", s3_endpoint_url=s3_server),
        tmp_path / "o1")
    local = prepare_dataset(make_settings(tmp_path / "local" / "corpus/**/part-*", format="auto"),
                            tmp_path / "o2")
    assert shards(remote) == shards(local)
    sources = remote.manifest["sources"]
    assert [s["name"] for s in sources] == ["part-0.jsonl.gz", "sub/part-1.jsonl.zst",
                                            "sub/part-2.parquet"]
    assert all(s["uri"].startswith(f"s3://{bucket}/corpus/") and s["etag"] for s in sources)
    streamed = {s["name"]: s["sha256"] for s in sources}
    assert streamed["part-0.jsonl.gz"] == {s["name"]: s["sha256"] for s in
                                           local.manifest["sources"]}["part-0.jsonl.gz"]
    again = prepare_dataset(
        make_settings(f"s3://{bucket}/corpus/**/part-*", format="auto", s3_endpoint_url=s3_server),
        tmp_path / "o1")
    assert again.reused and again.digest == remote.digest  # listing only, nothing re-read


def test_listing_follows_pages_past_1000_objects(s3_env, bucket, tmp_path, make_settings,
                                                 monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    keys = [f"many/doc-{i:05d}.txt" for i in range(1100)] + ["many/skip.json"]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: put(s3_env, bucket, k, f"text of {k} " .encode() * 3), keys))
    objects = s3.list_matching(s3_env, f"s3://{bucket}/many/*.txt")
    assert len(objects) == 1100 and objects[-1].key == "many/doc-01099.txt"
    pages = list(s3_env.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="many/"))
    assert len(pages) >= 2  # the server really paginated
    # The pattern's fixed prefix is many/: the step lists all 1101 keys (2 pages) and keeps the
    # last page's matches; the endpoint comes from the environment this time.
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.meta.endpoint_url)
    result = prepare_dataset(make_settings(f"s3://{bucket}/many/doc-0109*.txt", vocab_size=280,
                                           min_document_chars=5), tmp_path / "o")
    assert [s["name"] for s in result.manifest["sources"]][-1] == "doc-01099.txt"
    assert result.manifest["stats"]["documents_in"] == 10 == sum(result.documents.values())


def test_tokenizer_from_s3(s3_env, s3_server, bucket, tmp_path, make_settings, corpus):
    first = prepare_dataset(make_settings(corpus / "*.txt", vocab_size=320), tmp_path / "a")
    put(s3_env, bucket, "tok/tokenizer.json", (first.path / "tokenizer.json").read_bytes())
    reused = prepare_dataset(
        make_settings(corpus / "*.txt", vocab_size=320, s3_endpoint_url=s3_server,
                      tokenizer_uri=f"s3://{bucket}/tok/tokenizer.json"), tmp_path / "b")
    assert (reused.path / "tokenizer.json").read_bytes() == \
        (first.path / "tokenizer.json").read_bytes()


def test_s3_output_uploads_manifest_last_and_is_reused(s3_env, s3_server, bucket, tmp_path,
                                                      make_settings, corpus, monkeypatch):
    settings = make_settings(corpus / "*.txt", s3_endpoint_url=s3_server)
    uploads: list[str] = []
    real_upload, real_put = storage_s3.upload_file, storage_s3.put_bytes
    monkeypatch.setattr(storage_s3, "upload_file",
                        lambda path, uri, using=None: (uploads.append(uri), real_upload(path, uri, using)))
    monkeypatch.setattr(storage_s3, "put_bytes",
                        lambda uri, data, using=None: (uploads.append(uri), real_put(uri, data, using)))
    out = f"s3://{bucket}/datasets"
    first = prepare_dataset(settings, out, staging_root=tmp_path / "stage")
    remote_dir = f"{out}/{first.digest}"
    assert first.uri == remote_dir and not first.reused
    assert first.path == tmp_path / "stage" / first.digest and verify_dataset(first.path) == []
    assert uploads[-1] == f"{remote_dir}/manifest.json" and len(uploads) >= 6
    assert first.summary()["dataset_uri"] == remote_dir
    keys = sorted(storage_s3.list_keys(f"s3://{bucket}/datasets/", s3_env))
    assert sorted(f"datasets/{first.digest}/{p.name}" for p in first.path.iterdir()) == keys

    uploads.clear()
    second = prepare_dataset(settings, out, staging_root=tmp_path / "stage")
    assert second.reused and second.reuse == "remote" and uploads == []

    fresh = prepare_dataset(settings, out, staging_root=tmp_path / "other-machine")
    assert fresh.reuse == "remote" and verify_dataset(fresh.path) == []
    assert {p.name: p.read_bytes() for p in fresh.path.iterdir()} == \
        {p.name: p.read_bytes() for p in first.path.iterdir()}


def test_an_interrupted_upload_is_not_a_dataset(s3_env, s3_server, bucket, tmp_path,
                                                make_settings, corpus):
    settings = make_settings(corpus / "*.txt", s3_endpoint_url=s3_server)
    out = f"s3://{bucket}/datasets"
    first = prepare_dataset(settings, out, staging_root=tmp_path / "stage")
    s3_env.delete_object(Bucket=bucket, Key=f"datasets/{first.digest}/manifest.json")
    s3_env.delete_object(Bucket=bucket, Key=f"datasets/{first.digest}/validation-00000.bin")
    again = prepare_dataset(settings, out, staging_root=tmp_path / "stage")
    assert again.reuse == "local"  # the S3 copy did not count; the local one was uploaded
    assert storage_s3.size_of(f"{out}/{first.digest}/validation-00000.bin", s3_env) is not None
    assert storage_s3.size_of(f"{out}/{first.digest}/manifest.json", s3_env) is not None


def test_an_object_replaced_while_reading_fails(s3_env, s3_server, bucket, tmp_path,
                                                make_settings, monkeypatch):
    for i, text in enumerate(corpus_texts(4)):
        put(s3_env, bucket, f"c/doc-{i}.txt", text.encode())
    real = prepare_mod.resolve_sources

    def resolve_then_replace(patterns, client):
        found = real(patterns, client)
        put(s3_env, bucket, "c/doc-2.txt", b"replaced after listing")
        return found

    monkeypatch.setattr(prepare_mod, "resolve_sources", resolve_then_replace)
    with pytest.raises(SourceChangedError, match=r"doc-2\.txt' changed while preparing"):
        prepare_dataset(make_settings(f"s3://{bucket}/c/*.txt", s3_endpoint_url=s3_server),
                        tmp_path / "o")


@pytest.mark.parametrize(
    ("pattern", "error", "fragment"),
    [
        ("s3://{bucket}/nothing/*.txt", SourceNotFoundError, "no files match source pattern"),
        ("s3://no-such-bucket-tf/x/*.txt", SourceAccessError, "cannot list 's3://no-such-bucket"),
    ],
)
def test_s3_errors_name_the_location(s3_env, s3_server, bucket, tmp_path, make_settings,
                                     pattern, error, fragment):
    with pytest.raises(error, match=fragment):
        prepare_dataset(make_settings(pattern.format(bucket=bucket), s3_endpoint_url=s3_server),
                        tmp_path / "o")


class _FlakyBody:
    """A GetObject body that breaks after ``fail_after`` bytes (once)."""

    def __init__(self, data: bytes, fail_after: int | None) -> None:
        self.stream, self.fail_after, self.sent = io.BytesIO(data), fail_after, 0

    def read(self, n: int) -> bytes:
        if self.fail_after is not None and self.sent >= self.fail_after:
            raise ConnectionResetError("connection reset by peer")
        chunk = self.stream.read(n if self.fail_after is None else
                                 min(n, self.fail_after - self.sent))
        self.sent += len(chunk)
        return chunk

    def close(self) -> None:
        pass


class _FakeClient:
    """Serves one object; the first GET breaks mid-stream (a fake, not a mock)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.calls = data, []

    def get_object(self, Bucket, Key, IfMatch, Range=None):  # noqa: N803 - boto3's names
        self.calls.append(Range)
        start = int(Range.split("=")[1].rstrip("-")) if Range else 0
        return {"Body": _FlakyBody(self.data[start:], 1000 if not self.calls[:-1] else None)}


def test_a_broken_stream_resumes_where_it_stopped():
    data = bytes(range(256)) * 40
    client = _FakeClient(data)
    reader = s3.S3StreamReader(client, s3.S3Object("b", "k", len(data), '"etag"'))
    assert io.BufferedReader(reader).read() == data
    assert client.calls == [None, "bytes=1000-"]


def test_glob_semantics_of_s3_patterns():
    regex = s3.glob_regex("a/**/x-?.json[l]")
    assert regex.match("a/x-1.jsonl") and regex.match("a/b/c/x-2.jsonl")
    assert not regex.match("a/x-12.jsonl") and not regex.match("b/x-1.jsonl")
    assert s3.glob_regex("a/*.txt").match("a/f.txt") and not s3.glob_regex("a/*.txt").match(
        "a/b/f.txt")
    assert s3.fixed_prefix("data/2024-*/part-*.gz") == "data/"
    assert json.dumps(s3.split_uri("s3://bkt/k/e/y")) == '["bkt", "k/e/y"]'
