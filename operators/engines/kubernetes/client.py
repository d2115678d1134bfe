"""How the Kubernetes engine reaches the cluster: an Airflow connection, a kubeconfig, or in-cluster.

Order (the first that applies):

1. ``conn_id``: an Airflow connection of the Kubernetes provider's type (``kubernetes``). Its
   extras are read under the names apache-airflow-providers-cncf-kubernetes gives them (with or
   without the old ``extra__kubernetes__`` prefix): ``in_cluster`` (bool), ``kube_config_path``
   (a file), ``kube_config`` (the kubeconfig inline, as JSON or YAML text or an object),
   ``cluster_context``, ``disable_verify_ssl``. The provider itself is not needed.
2. ``kubeconfig`` (a path) and ``context`` from the spec.
3. The default kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``) when it exists, else the
   in-cluster service account (Airflow running in the cluster).

``kubernetes`` is imported inside the functions: importing this module costs nothing at DAG
parse time. The namespace always comes from the spec (``training.kubernetes.namespace``).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from trainforge.errors import BackendError, JobRefusedError

log = logging.getLogger(__name__)

_PREFIX = "extra__kubernetes__"


def _extra(extras: dict[str, Any], name: str) -> Any:
    value = extras.get(name)
    if value in (None, ""):
        value = extras.get(_PREFIX + name)
    return None if value == "" else value


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def connection_settings(conn_id: str) -> dict[str, Any]:
    """The cluster settings of Airflow connection ``conn_id``:
    ``{"in_cluster", "kubeconfig_path", "kubeconfig_dict", "context", "verify_ssl"}``.

    Raises:
        BackendError: the connection cannot be read, or its inline kubeconfig does not parse.
    """
    from airflow.sdk import BaseHook

    try:
        conn = BaseHook.get_connection(conn_id)
    except Exception as err:  # noqa: BLE001 - Airflow raises several types for a missing conn
        raise BackendError(
            f"Airflow connection {conn_id!r} for the kubernetes engine could not be read: {err} "
            f"(expected a connection of type 'kubernetes'; see docs/kubernetes.md)"
        ) from err
    extras = conn.extra_dejson or {}
    inline = _extra(extras, "kube_config")
    config_dict = None
    if isinstance(inline, dict):
        config_dict = inline
    elif isinstance(inline, str):
        try:
            config_dict = json.loads(inline)
        except json.JSONDecodeError:
            import yaml

            try:
                config_dict = yaml.safe_load(inline)
            except yaml.YAMLError as err:
                raise BackendError(
                    f"Airflow connection {conn_id!r}: extra 'kube_config' is neither JSON nor "
                    f"YAML ({type(err).__name__}); expected a kubeconfig document"
                ) from err
        if not isinstance(config_dict, dict):
            raise BackendError(f"Airflow connection {conn_id!r}: extra 'kube_config' is not a "
                               f"kubeconfig mapping (got {type(config_dict).__name__})")
    return {
        "in_cluster": _truthy(_extra(extras, "in_cluster")),
        "kubeconfig_path": _extra(extras, "kube_config_path"),
        "kubeconfig_dict": config_dict,
        "context": _extra(extras, "cluster_context"),
        "verify_ssl": not _truthy(_extra(extras, "disable_verify_ssl")),
    }


def api_client(conn_id: str | None = None, kubeconfig: str | None = None,
               context: str | None = None) -> Any:
    """A ``kubernetes.client.ApiClient`` for the cluster (see the module docstring for the order).

    Never touches the ``kubernetes`` package's global default configuration.

    Raises:
        BackendError: no configuration found, or it does not load.
    """
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    settings: dict[str, Any] = {"in_cluster": False, "kubeconfig_path": kubeconfig,
                                "kubeconfig_dict": None, "context": context, "verify_ssl": True}
    source = f"kubeconfig {kubeconfig}" if kubeconfig else "the default kubeconfig"
    if conn_id:
        settings = connection_settings(conn_id)
        settings["context"] = settings["context"] or context
        source = f"Airflow connection {conn_id!r}"
    cfg = client.Configuration()
    try:
        if settings["kubeconfig_dict"] is not None:
            config.load_kube_config_from_dict(settings["kubeconfig_dict"], context=settings["context"],
                                              client_configuration=cfg)
        elif settings["kubeconfig_path"]:
            path = os.path.expanduser(settings["kubeconfig_path"])
            if not Path(path).is_file():
                raise BackendError(f"{source}: kubeconfig file {path} does not exist")
            config.load_kube_config(config_file=path, context=settings["context"],
                                    client_configuration=cfg)
        elif settings["in_cluster"] or not _default_kubeconfig_exists():
            config.load_incluster_config(client_configuration=cfg)
            source = "the in-cluster service account"
        else:
            config.load_kube_config(context=settings["context"], client_configuration=cfg)
    except ConfigException as err:
        raise BackendError(f"could not load the Kubernetes configuration from {source}: {err}") from err
    if not settings["verify_ssl"]:
        cfg.verify_ssl = False
    api = client.ApiClient(cfg)
    log.info("Kubernetes engine: cluster %s from %s", api.configuration.host, source)
    return api


def _default_kubeconfig_exists() -> bool:
    paths = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    return any(Path(p).is_file() for p in paths.split(os.pathsep) if p)


def network_errors() -> tuple[type[BaseException], ...]:
    """Errors of a request that did not get an HTTP answer (refused, reset, timed out)."""
    import urllib3

    return (OSError, urllib3.exceptions.HTTPError)


#: A field the installed CRD does not have (``fieldValidation=Strict``), as the API words it.
_UNKNOWN_FIELD = re.compile(r'unknown field "([^"]+)"')
#: RBAC's refusal: ``User "..." cannot VERB resource "RESOURCE" in API group "GROUP"``.
_FORBIDDEN = re.compile(r'cannot (\w+) resource "([^"]+)"(?: in API group "([^"]*)")?')
#: Fields of the objects trainforge renders that older operator releases lack: what the
#: cluster runs when its CRD refuses them, and what to do (docs/kubernetes.md, versions).
FIELDS_SINCE = {
    ("TrainJob", "spec.runtimePatches"): "Kubeflow Trainer v2.2",
    ("TrainJob", "spec.activeDeadlineSeconds"): "Kubeflow Trainer v2.2",
}


def unknown_fields(detail: str) -> list[str]:
    """The fields a strict create or patch refused as unknown to the CRD (empty: none)."""
    return _UNKNOWN_FIELD.findall(detail) if "strict decoding error" in detail else []


def missing_permission(detail: str) -> str | None:
    """``"VERB on RESOURCE (API group G)"`` when an HTTP 403 is RBAC's refusal, else None."""
    found = _FORBIDDEN.search(detail)
    if found is None:
        return None
    verb, resource, group = found.groups()
    return f"{verb} on {resource} (API group {group or 'core'!r})"


def api_error(what: str, err: Any, kind: str | None = None) -> BackendError:
    """A one-line error from an ``ApiException``: what failed, the HTTP status and the API's
    reason. A :class:`JobRefusedError` (permanent) when the API refuses the object as invalid,
    when the installed CRD (of ``kind``) lacks a field the object has, or when RBAC denies a
    verb the documented Role grants."""
    detail = err.reason or ""
    try:
        body = json.loads(err.body or "{}")
        detail = body.get("message") or detail
    except (TypeError, ValueError, AttributeError):
        pass
    from trainforge.engines.kubernetes.status import is_refusal

    fields = unknown_fields(detail)
    if err.status == 400 and fields:
        since = sorted({FIELDS_SINCE[kind, f] for f in fields if (kind, f) in FIELDS_SINCE})
        version = re.search(r'in version "([^"]+)"', detail)
        crd = f"the installed {kind or 'custom resource'} CRD" + (
            f" ({version.group(1)})" if version else "")
        hint = (f"; these fields arrived in {', '.join(since)}: the cluster runs an older release "
                f"(upgrade it, or see docs/kubernetes.md for what works with it)" if since else
                "; the CRD is older or newer than trainforge expects (docs/kubernetes.md)")
        return JobRefusedError(f"Kubernetes API refused to {what}: {crd} has no field "
                               f"{', '.join(fields)}{hint}")
    if err.status == 403:
        permission = missing_permission(detail)
        if permission is not None:
            return JobRefusedError(
                f"Kubernetes API refused to {what}: HTTP 403, the connection's identity lacks "
                f"{permission}: {detail} (grant it in the Role of docs/kubernetes.md; a retry "
                f"would be refused too)")
    if err.status == 422 or (err.status in (400, 403) and is_refusal(detail)):
        return JobRefusedError(f"Kubernetes API refused to {what}: HTTP {err.status} {detail} "
                               f"(the object is invalid; a retry would be refused too)")
    hint = ""
    if err.status == 404:
        hint = " (is the custom resource's operator installed? see docs/kubernetes.md)"
    elif err.status in (401, 403):
        hint = " (check the credentials and RBAC of the connection)"
    return BackendError(f"Kubernetes API refused to {what}: HTTP {err.status} {detail}{hint}")
