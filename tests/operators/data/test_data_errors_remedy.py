"""What data preparation tells the user when its output store fails: the store's own remedy
when the cause tells one (throttling), else where to look (URI, credentials, endpoint)."""

from __future__ import annotations

import pytest

from trainforge.data.errors import SourceAccessError
from trainforge.data.remote import prepare_remote
from trainforge.storage.base import StorageError


class _FailingStorage:
    def __init__(self, error: StorageError) -> None:
        self.error = error

    def join(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in parts)

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise self.error
        return fail


@pytest.mark.parametrize("error,expected,absent", [
    (StorageError("s3://bucket/datasets/m.json", "put", "throttled 8 times over 71.4 s "
                  "(last answer SlowDown (HTTP 503))", throttled=8,
                  remedy="the store limits the request rate: retry later"),
     "throttled 8 times over 71.4 s", "check the URI"),
    (StorageError("s3://bucket/datasets/m.json", "put", "AccessDenied (HTTP 403)"),
     "check the URI, the credentials", "throttled"),
])
def test_an_output_store_failure_says_what_happened(tmp_path, error, expected, absent):
    with pytest.raises(SourceAccessError) as err:
        prepare_remote(_FailingStorage(error), "s3://bucket/datasets", tmp_path, "abc123",
                       build=lambda folder: None, started=0.0)
    assert expected in str(err.value) and absent not in str(err.value)
