"""One reading of ``s3://bucket/key`` (trainforge.contract.split_s3_uri) behind the storage
layer's and data preparation's splitters: the same parts, and each its own error for a string
that is no S3 location."""

from __future__ import annotations

import pytest

from trainforge.contract import split_s3_uri
from trainforge.data import s3 as data_s3
from trainforge.data.errors import SourceAccessError
from trainforge.storage import s3 as storage_s3
from trainforge.storage.base import StorageError


@pytest.mark.parametrize("uri,parts", [
    ("s3://bkt/k/e/y", ("bkt", "k/e/y")),
    ("s3://bkt", ("bkt", "")),
    ("s3://bkt/", ("bkt", "")),
    ("s3://Not_A_Valid_Bucket/x/", ("Not_A_Valid_Bucket", "x/")),  # read, not judged
])
def test_both_splitters_read_one_pattern(uri, parts):
    assert split_s3_uri(uri) == storage_s3.split(uri) == data_s3.split_uri(uri) == parts


@pytest.mark.parametrize("uri", ["s3://", "s3:///key", "http://bkt/key", "/local/path"])
def test_each_splitter_keeps_its_error(uri):
    assert split_s3_uri(uri) is None
    with pytest.raises(StorageError, match="expected s3://bucket/key"):
        storage_s3.split(uri)
    with pytest.raises(SourceAccessError, match="not an s3://bucket/key URI"):
        data_s3.split_uri(uri)
