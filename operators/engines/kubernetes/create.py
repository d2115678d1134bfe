"""Creating a job's objects: the ConfigMap and the custom resource, each with strict field
validation, the resource first as a dry run; 409s adopted when the identity matches.

A part of :class:`trainforge.engines.kubernetes.backend.KubernetesBackend` (its ``submit``),
kept apart for size; it uses the backend's API clients, namespace and ``_call``/``_get``.
"""

from __future__ import annotations

import logging
from typing import Any

from trainforge.engines.base import JobIdentity
from trainforge.engines.kubernetes import names as n
from trainforge.engines.kubernetes import render as r
from trainforge.engines.kubernetes.client import api_error, network_errors
from trainforge.errors import BackendError

log = logging.getLogger(__name__)

#: Every create and patch: a field the installed CRD lacks is an error, not silently dropped.
STRICT = "Strict"


class JobCreation:
    """The create calls of the backend's submit (mixed into ``KubernetesBackend``)."""

    namespace: str
    request_timeout_s: float

    def _create_configmap(self, cm: dict[str, Any], identity: JobIdentity) -> None:
        from kubernetes.client.exceptions import ApiException

        name = cm["metadata"]["name"]
        try:
            self._core.create_namespaced_config_map(self.namespace, cm, field_validation=STRICT,
                                                    _request_timeout=self.request_timeout_s)
            return
        except ApiException as err:
            if err.status != 409:
                raise api_error(f"create ConfigMap {self.namespace}/{name}", err) from err
        except network_errors() as err:
            raise BackendError(f"could not reach the Kubernetes API to create ConfigMap "
                               f"{self.namespace}/{name}: {err}") from err
        current = self._call(f"read ConfigMap {self.namespace}/{name}",
                             self._core.read_namespaced_config_map, name, self.namespace, raw=True)
        self._check_identity(current, identity, "ConfigMap")
        # Left by an earlier submission of this identity whose job was not created: refresh it.
        self._call(f"update ConfigMap {self.namespace}/{name}",
                   self._core.patch_namespaced_config_map, name, self.namespace, {"data": cm["data"]},
                   field_validation=STRICT)

    def _create_job(self, api: str, obj: dict[str, Any], identity: JobIdentity,
                    dry_run: bool = False) -> dict[str, Any]:
        """Create the job with strict field validation (``dry_run``: validate only)."""
        from kubernetes.client.exceptions import ApiException

        group, version, plural, kind = r.APIS[api]
        name = obj["metadata"]["name"]
        extra = {"dry_run": "All"} if dry_run else {}
        try:
            return self._custom.create_namespaced_custom_object(
                group, version, self.namespace, plural, obj, field_validation=STRICT,
                _request_timeout=self.request_timeout_s, **extra)
        except ApiException as err:
            if err.status == 409 and dry_run:
                return {}  # exists already (a lagging read missed it): the create adopts it
            if dry_run and err.status == 400 and "does not support dry run" in str(err.body):
                # A webhook registered before admissionregistration/v1 (sideEffects: Unknown)
                # refuses dry runs: validation happens at the create itself.
                log.warning("Cannot validate %s %s/%s by a dry run (%s); creating it directly",
                            kind, self.namespace, name, err.body)
                return {}
            if err.status != 409 or dry_run:
                what = f"{'validate (dry run) ' if dry_run else ''}create {kind} {self.namespace}/{name}"
                raise api_error(what, err, kind) from err
        except network_errors() as err:
            if dry_run:
                raise BackendError(f"could not reach the Kubernetes API to validate {kind} "
                                   f"{self.namespace}/{name}: {err}") from err
            # The request may have reached the server: a job may exist now. Look before failing.
            current = self._get(api, name)
            if current is not None and n.identity_from_annotations(
                    (current.get("metadata") or {}).get("annotations")) == identity:
                return current
            raise BackendError(f"could not reach the Kubernetes API to create {kind} "
                               f"{self.namespace}/{name}: {err}") from err
        # 409: created by an earlier call whose answer was lost, or by a retry racing this one.
        current = self._get(api, name)
        if current is None:
            raise BackendError(f"{kind} {self.namespace}/{name} already exists but cannot be read")
        self._check_identity(current, identity, kind)
        log.info("%s %s/%s already existed (409) with this identity; adopting it", kind,
                 self.namespace, name)
        return current

    def _own_configmap(self, cm_name: str, obj: dict[str, Any], created: dict[str, Any]) -> None:
        """Make the job the ConfigMap's owner, so that deleting the job deletes it too.

        Without ``blockOwnerDeletion``: setting it needs ``update`` on the job's ``finalizers``
        subresource where ``OwnerReferencesPermissionEnforcement`` is on (OpenShift), and it
        would only make a foreground deletion wait for the ConfigMap, which the backend deletes
        itself."""
        meta = created.get("metadata") or {}
        owner = {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": meta.get("name"),
                 "uid": meta.get("uid")}
        self._call(f"set the owner of ConfigMap {self.namespace}/{cm_name}",
                   self._core.patch_namespaced_config_map, cm_name, self.namespace,
                   {"metadata": {"ownerReferences": [owner]}}, field_validation=STRICT)

    def _check_identity(self, obj: dict[str, Any], identity: JobIdentity, kind: str) -> None:
        meta = obj.get("metadata") or {}
        found = n.identity_from_annotations(meta.get("annotations"))
        if found != identity:
            raise BackendError(
                f"{kind} {self.namespace}/{meta.get('name')} exists but belongs to "
                f"{found.to_dict() if found else 'no trainforge job'}, not {identity.to_dict()}; "
                f"delete it or use another namespace"
            )
