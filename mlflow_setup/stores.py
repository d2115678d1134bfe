"""The server's two stores, checked before it starts: backend store (runs, registry) and the
artifact store the server proxies (``--serve-artifacts``).

Backend store: ``sqlite:///ABS/PATH.db`` (the default, one file in the home) or a PostgreSQL
database, ``postgresql://USER:PASSWORD@HOST:PORT/DB`` (also ``postgresql+psycopg2://``;
``?host=/socket/dir`` for a unix socket). MLflow creates and migrates its tables itself on the
first start; the database must exist and accept the user. A PostgreSQL URI is tried once
(`CONNECT_TIMEOUT_S`) before the server starts, so a wrong host, port, database or password
fails fast with a message that names the URI, its password replaced by ``***``. A URI holding a
password reaches the server through the ``MLFLOW_BACKEND_STORE_URI`` environment variable, not
its command line (which ``ps`` shows to every user), and is never written to the pid file or log.

Artifact store: a local folder (created), ``file:///...``, or ``s3://bucket[/prefix]``. For S3
the server uses boto3's standard credential chain and the endpoint in ``MLFLOW_S3_ENDPOINT_URL``
(else ``AWS_ENDPOINT_URL``, else AWS); the bucket is checked with one HeadBucket call first.
"""

from __future__ import annotations

import os
import re
from urllib.parse import SplitResult, urlsplit, urlunsplit

from trainforge.contract import S3_URI
from trainforge.mlflow_setup.errors import StoreArgumentError, StoreUnreachableError

CONNECT_TIMEOUT_S = 5
_SQLITE = re.compile(r"^sqlite:///.+")
_POSTGRES_SCHEMES = ("postgresql", "postgresql+psycopg2", "postgres")  # all run on psycopg2


def redact(uri: str) -> str:
    """``uri`` with the password of its user info replaced by ``***`` (other URIs unchanged)."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(SplitResult(parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def driver_uri(uri: str) -> str:
    """The URI the server's SQLAlchemy engine gets: a PostgreSQL URI names the psycopg2 driver
    (``postgresql+psycopg2://``; SQLAlchemy 2.1 would pick psycopg 3, which is not installed)."""
    for scheme in ("postgresql://", "postgres://"):
        if uri.startswith(scheme):
            return "postgresql+psycopg2://" + uri[len(scheme):]
    return uri


def has_password(uri: str) -> bool:
    return urlsplit(uri).password is not None


def check_backend_store_uri(uri: str) -> str:
    """The scheme family of ``uri``: ``"sqlite"`` or ``"postgresql"``.

    Raises:
        StoreArgumentError: any other scheme, or a PostgreSQL URI without a database name.
    """
    if _SQLITE.match(uri):
        return "sqlite"
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if scheme in _POSTGRES_SCHEMES:
        if not urlsplit(uri).path.strip("/"):
            raise StoreArgumentError("--backend-store-uri", redact(uri),
                                     "a database name: postgresql://USER:PASSWORD@HOST:PORT/DATABASE")
        return "postgresql"
    raise StoreArgumentError("--backend-store-uri", redact(uri),
                             "sqlite:///ABSOLUTE/PATH.db or postgresql://USER:PASSWORD@HOST:PORT/DATABASE")


def check_postgres_reachable(uri: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Open and close one connection to the PostgreSQL database of ``uri`` (psycopg2).

    Raises:
        StoreUnreachableError: the server did not answer or refused the user or database; the
            message names the redacted URI and libpq's reason (the password scrubbed from it).
    """
    import psycopg2

    parts = urlsplit(uri)
    dsn = urlunsplit(parts._replace(scheme="postgresql"))
    try:
        psycopg2.connect(dsn, connect_timeout=max(1, int(timeout_s))).close()
    except psycopg2.Error as err:
        reason = " ".join(str(err).split())
        if parts.password:
            reason = reason.replace(parts.password, "***")
        raise StoreUnreachableError(redact(uri), reason) from None


def check_artifacts_destination(destination: str) -> str:
    """The kind of ``destination``: ``"local"`` (a path or ``file://``) or ``"s3"``.

    Raises:
        StoreArgumentError: another scheme, or a malformed ``s3://`` URI.
    """
    if "://" not in destination:
        return "local"
    scheme = destination.split("://", 1)[0]
    if scheme == "file":
        return "local"
    if scheme == "s3":
        if not S3_URI.match(destination):
            raise StoreArgumentError("--artifacts-destination", destination,
                                     "s3://BUCKET[/PREFIX] with a bucket name of 3-63 lower-case "
                                     "letters, digits, '.' or '-'")
        return "s3"
    raise StoreArgumentError("--artifacts-destination", destination,
                             "a local folder, file:///ABSOLUTE/PATH or s3://BUCKET[/PREFIX]")


def s3_endpoint_url() -> str | None:
    """The endpoint the MLflow server's S3 client uses (module doc)."""
    return os.environ.get("MLFLOW_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL") or None


def check_s3_bucket(destination: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """One HeadBucket call on the bucket of ``destination`` (boto3, the server's endpoint).

    Raises:
        StoreUnreachableError: no such bucket, access denied, or the endpoint did not answer.
    """
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    bucket = S3_URI.match(destination).group(1)  # type: ignore[union-attr]
    config = Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"total_max_attempts": 2})
    endpoint = s3_endpoint_url()
    try:
        boto3.session.Session().client("s3", endpoint_url=endpoint, config=config).head_bucket(Bucket=bucket)
    except ClientError as err:
        error = err.response.get("Error", {})
        raise StoreUnreachableError(destination, f"HeadBucket {bucket} at {endpoint or 'AWS'}: "
                                                 f"{error.get('Code')} {error.get('Message', '')}".strip()) from None
    except BotoCoreError as err:
        raise StoreUnreachableError(destination, f"S3 endpoint {endpoint or 'AWS'}: {err}") from None


def check_stores(backend_store_uri: str, artifacts_destination: str, *, connect: bool = True) -> None:
    """Check both stores' arguments, and (``connect``) that a PostgreSQL database and an S3
    bucket answer. SQLite files and local folders are created by the server.

    Raises:
        StoreArgumentError: a bad scheme or shape.
        StoreUnreachableError: the database or bucket cannot be reached.
    """
    backend = check_backend_store_uri(backend_store_uri)
    artifacts = check_artifacts_destination(artifacts_destination)
    if connect and backend == "postgresql":
        check_postgres_reachable(backend_store_uri)
    if connect and artifacts == "s3":
        check_s3_bucket(artifacts_destination)
