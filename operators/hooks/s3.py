"""S3 credentials and endpoint from an Airflow connection of type ``aws``.

The spec names a connection (``storage.aws_conn_id``); this hook reads it the way the Amazon
provider's ``AwsBaseHook`` does (the provider itself is not needed): keys from ``login`` and
``password``, ``extra.aws_session_token``, ``extra.region_name`` and the S3 endpoint. A
connection with neither keys nor token leaves the credentials to boto3's standard chain;
``role_arn`` and ``profile_name`` (role assumption, named profiles) are refused with a clear
error: they cannot be handed to the trainer's ranks as environment variables.

The credentials come out as in-process boto3 (:meth:`S3Hook.session`, :meth:`S3Hook.client`),
as environment variables for child processes and ranks (:meth:`S3Hook.env`,
:meth:`S3Hook.child_env`), and split into secret and plain (:meth:`S3Hook.secret_env`,
:meth:`S3Hook.plain_env`). The field table and the variables: docs/storage.md, "Credentials and
endpoint".

The hook never writes ``os.environ`` and never logs a secret; ``repr`` of the credentials hides
them. ``boto3`` and Airflow are imported inside methods only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from trainforge.hooks.errors import HookError

log = logging.getLogger(__name__)

CONN_TYPE = "aws"
#: Environment variables that carry secrets (never rendered, logged or written to a file).
SECRET_ENV_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                    "AWS_SECURITY_TOKEN")
#: botocore's service-specific endpoint variable (boto3 >= 1.28, "service-specific endpoints").
ENDPOINT_ENV = "AWS_ENDPOINT_URL_S3"
REGION_ENV = "AWS_DEFAULT_REGION"
_REFUSED_EXTRAS = ("role_arn", "profile_name", "assume_role_method")


class S3ConnectionError(HookError):
    """The Airflow connection for S3 is missing, of the wrong type or incomplete, or its
    endpoint disagrees with the spec's. The message names the connection id, never a secret."""


@dataclass(frozen=True)
class AwsCredentials:
    """What an ``aws`` connection holds for S3. Secrets are kept out of ``repr``.

    Attributes:
        conn_id: the Airflow connection id they came from.
        access_key_id, secret_access_key, session_token: None leaves them to boto3's chain.
        region_name: AWS region, or None.
        endpoint_url: S3 endpoint of an S3-compatible store, or None for AWS.
    """

    conn_id: str
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    region_name: str | None = None
    endpoint_url: str | None = None

    @property
    def has_keys(self) -> bool:
        return self.access_key_id is not None

    def session_kwargs(self) -> dict[str, str]:
        """Keyword arguments of ``boto3.session.Session`` (only those that are set)."""
        values = {"aws_access_key_id": self.access_key_id,
                  "aws_secret_access_key": self.secret_access_key,
                  "aws_session_token": self.session_token,
                  "region_name": self.region_name}
        return {k: v for k, v in values.items() if v}

    def secret_env(self) -> dict[str, str]:
        """``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN`` and its
        legacy name ``AWS_SECURITY_TOKEN`` (which botocore reads first); empty without keys.
        With keys but no token both token variables are the empty string, so that a token
        inherited from the parent's environment is not sent with these keys (botocore treats
        an empty token as none)."""
        if not self.has_keys:
            return {}
        token = self.session_token or ""
        return dict(zip(SECRET_ENV_NAMES, (self.access_key_id or "",
                                           self.secret_access_key or "", token, token)))


def read_connection(conn_id: str) -> AwsCredentials:
    """Read Airflow connection ``conn_id`` (type ``aws``) as :class:`AwsCredentials`.

    Connections come from wherever Airflow finds them (``AIRFLOW_CONN_<ID>`` variables, a
    secrets backend, the metadata database), through ``airflow.sdk.BaseHook.get_connection``.

    Raises:
        S3ConnectionError: no such connection; its type is not ``aws``; a key without its
            secret (or the reverse); an ``extra`` that is not a JSON object; role assumption or
            a named profile; an endpoint that is not ``http(s)://``.
    """
    from airflow.sdk import BaseHook

    try:
        conn = BaseHook.get_connection(conn_id)
    except Exception as err:  # noqa: BLE001 - Airflow raises several types for "not found"
        raise S3ConnectionError(
            f"Airflow connection {conn_id!r} (storage.aws_conn_id) could not be read: "
            f"{type(err).__name__}: {err} (expected a connection of type 'aws', e.g. "
            f"AIRFLOW_CONN_{conn_id.upper()}='{{\"conn_type\": \"aws\", \"login\": ..., "
            f"\"password\": ...}}')"
        ) from err
    conn_type = (conn.conn_type or "").lower()
    if conn_type != CONN_TYPE:
        raise S3ConnectionError(f"Airflow connection {conn_id!r} has type {conn.conn_type!r}; "
                                f"expected {CONN_TYPE!r} for S3")
    extra = _extra(conn_id, conn)
    refused = [k for k in _REFUSED_EXTRAS if extra.get(k)]
    if refused:
        raise S3ConnectionError(
            f"Airflow connection {conn_id!r} sets {', '.join(refused)} in its extra; trainforge "
            f"passes S3 credentials to the trainer as plain keys and cannot assume roles or read "
            f"profiles (expected login/password, optionally extra.aws_session_token)")
    key = conn.login or extra.get("aws_access_key_id") or None
    secret = conn.password or extra.get("aws_secret_access_key") or None
    if (key is None) != (secret is None):
        have, lack = ("an access key id", "secret access key (password)") if key else (
            "a secret access key", "access key id (login)")
        raise S3ConnectionError(f"Airflow connection {conn_id!r} has {have} but no "
                                f"{lack}; expected both, or neither to use boto3's standard chain")
    token = extra.get("aws_session_token") or None
    if token is not None and key is None:
        raise S3ConnectionError(f"Airflow connection {conn_id!r} has extra.aws_session_token "
                                f"but no access key id and secret; expected all three")
    service = (extra.get("service_config") or {}).get("s3") or {}
    if not isinstance(service, dict):
        raise S3ConnectionError(f"Airflow connection {conn_id!r}: extra.service_config.s3 must "
                                f"be an object (got {type(service).__name__})")
    endpoint = service.get("endpoint_url") or extra.get("endpoint_url") or None
    if endpoint is not None and not str(endpoint).startswith(("http://", "https://")):
        raise S3ConnectionError(f"Airflow connection {conn_id!r}: endpoint_url must be "
                                f"http(s)://host[:port] (got {endpoint!r})")
    region = extra.get("region_name") or None
    return AwsCredentials(conn_id=conn_id, access_key_id=key, secret_access_key=secret,
                          session_token=token, region_name=str(region) if region else None,
                          endpoint_url=str(endpoint).rstrip("/") if endpoint else None)


def _extra(conn_id: str, conn: Any) -> dict[str, Any]:
    raw = conn.extra
    if not raw:
        return {}
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw)
    except ValueError as err:
        raise S3ConnectionError(f"Airflow connection {conn_id!r}: extra is not valid JSON "
                                f"({err.msg} at character {err.pos})") from None
    if not isinstance(value, dict):
        raise S3ConnectionError(f"Airflow connection {conn_id!r}: extra must be a JSON object "
                                f"(got {type(value).__name__})")
    return value


class S3Hook:
    """S3 access for one pipeline: its connection (if any) and its endpoint.

    Args:
        aws_conn_id: Airflow connection of type ``aws`` (``storage.aws_conn_id``); None: boto3's
            standard chain, nothing is read from Airflow.
        endpoint_url: the spec's S3 endpoint (``storage.endpoint_url`` or
            ``data.s3_endpoint_url``); None: the connection's, else the environment's / AWS.

    Raises (on first use of :attr:`credentials`, :attr:`endpoint_url` and the methods):
        S3ConnectionError: see :func:`read_connection`; or the spec and the connection name
            different endpoints.
    """

    def __init__(self, aws_conn_id: str | None = None, endpoint_url: str | None = None) -> None:
        self.aws_conn_id = aws_conn_id
        self._endpoint_arg = endpoint_url.rstrip("/") if endpoint_url else None

    @classmethod
    def for_spec(cls, spec: Any) -> S3Hook:
        """The hook of a ``PipelineSpec`` (``storage.aws_conn_id``, its S3 endpoint)."""
        return cls(spec.storage.aws_conn_id, spec.s3_endpoint_url)

    @cached_property
    def credentials(self) -> AwsCredentials | None:
        """The connection's credentials, or None without a connection."""
        if self.aws_conn_id is None:
            return None
        creds = read_connection(self.aws_conn_id)
        log.info("S3 access through Airflow connection %s (%s, region %s, endpoint %s)",
                 self.aws_conn_id, "access key" if creds.has_keys else "boto3's standard chain",
                 creds.region_name or "default", creds.endpoint_url or "default")
        return creds

    @cached_property
    def endpoint_url(self) -> str | None:
        """The spec's endpoint, else the connection's, else None (environment or AWS)."""
        from_conn = self.credentials.endpoint_url if self.credentials else None
        if self._endpoint_arg and from_conn and self._endpoint_arg.lower() != from_conn.lower():
            raise S3ConnectionError(
                f"the spec's S3 endpoint {self._endpoint_arg!r} and the endpoint_url "
                f"{from_conn!r} of Airflow connection {self.aws_conn_id!r} differ; expected one "
                f"of them, or the same URL in both")
        return self._endpoint_arg or from_conn

    def session(self) -> Any:
        """A ``boto3.session.Session`` with the connection's keys and region (a plain session,
        i.e. boto3's standard chain, without a connection)."""
        import boto3

        kwargs = self.credentials.session_kwargs() if self.credentials else {}
        return boto3.session.Session(**kwargs)

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``session.client("s3", ...)``: the endpoint when there is one."""
        return {"endpoint_url": self.endpoint_url} if self.endpoint_url else {}

    def client(self, config: Any = None) -> Any:
        """An S3 client of :meth:`session` at :attr:`endpoint_url` (botocore ``config``)."""
        return self.session().client("s3", config=config, **self.client_kwargs())

    def secret_env(self) -> dict[str, str]:
        """The connection's keys and token as environment variables; empty without them."""
        return self.credentials.secret_env() if self.credentials else {}

    def plain_env(self) -> dict[str, str]:
        """``AWS_ENDPOINT_URL_S3`` and ``AWS_DEFAULT_REGION`` where known (no secrets)."""
        env = {}
        if self.endpoint_url:
            env[ENDPOINT_ENV] = self.endpoint_url
        if self.credentials and self.credentials.region_name:
            env[REGION_ENV] = self.credentials.region_name
        return env

    def env(self) -> dict[str, str]:
        """:meth:`plain_env` and :meth:`secret_env` together: the environment a child process
        needs to reach S3 as this hook does. Pass it to ``subprocess``; never write it down."""
        return {**self.plain_env(), **self.secret_env()}

    def child_env(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` (e.g. ``os.environ``) with :meth:`env` over it, for a child process."""
        return {**base, **self.env()}

    def secret_source(self) -> str:
        """Where :meth:`secret_env` comes from, in words (``TrainingJob.secret_env_source``)."""
        return f"Airflow connection {self.aws_conn_id}"


def spec_child_env(spec: Any, base: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The environment of a child process that reads a spec's S3 locations (the validator, the
    exporter): ``base`` (default ``os.environ``) with :meth:`S3Hook.env` over it; None (inherit
    the parent's) when the spec names neither a connection nor an endpoint.

    Raises:
        S3ConnectionError: see :class:`S3Hook`.
    """
    import os

    hook = S3Hook.for_spec(spec)
    if hook.aws_conn_id is None and hook.endpoint_url is None:
        return None
    return hook.child_env(os.environ if base is None else base)
