"""The names and labels of the Kubernetes engine's objects, budgeted for every name the
controllers derive from them (pods, services, the JobSet's jobs), and the job identity kept in
annotations in full. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import re

from trainforge.engines.base import JobIdentity

# The runtime's replicated job of the training nodes (Kubeflow Trainer's torch runtimes).
TRAINJOB_REPLICATED_JOB = "node"

LABEL_PREFIX = "trainforge.io/"
LABEL_JOB = LABEL_PREFIX + "job"
ANNOTATIONS = {
    "dag_id": LABEL_PREFIX + "dag-id",
    "run_id": LABEL_PREFIX + "run-id",
    "task_id": LABEL_PREFIX + "task-id",
    "try_number": LABEL_PREFIX + "try-number",
}

# RFC 1035 label: what TrainJob names must match (a letter first), at most 63 characters.
_RFC1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
# Label values: at most 63 characters, alphanumerics with '-', '_', '.' inside.
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


# Names the controllers derive from the job's name, each a DNS label of at most 63 characters.
# The pod index is budgeted for 4 digits, which covers any resources.nodes the spec accepts
# (≤ 4096); render_objects refuses a job with more nodes than that rather than let the
# controller refuse its pods.
POD_INDEX_DIGITS = 4
MAX_POD_INDEX = "9" * POD_INDEX_DIGITS
DERIVED_NAMES = {
    # TrainJob: the JobSet has the TrainJob's name; JobSet names the Job of a replicated job
    # `<jobset>-<replicatedJob>-<jobIdx>` and the Job controller names its pods
    # `<job>-<podIdx>-<5 random>`; JobSet's webhook refuses a JobSet whose longest pod name
    # would pass 63 characters. The torch runtime has one Job (index 0) of numNodes pods.
    "trainjob": (f"-{TRAINJOB_REPLICATED_JOB}-0-{MAX_POD_INDEX}-abcde", "-config"),
    # PyTorchJob: the training operator names pods and services `<name>-master-0` and
    # `<name>-worker-<i>`, i < nodes - 1.
    "pytorchjob": ("-master-0", f"-worker-{MAX_POD_INDEX}", "-config"),
}
NAME_BUDGET = {api: 63 - max(len(suffix) for suffix in suffixes)
               for api, suffixes in DERIVED_NAMES.items()}


def resource_name(identity: JobIdentity, api: str = "trainjob") -> str:
    """The custom resource's name for ``api``: the identity key when it is an RFC 1035 label
    (lowercase, a letter first) that leaves room for every name the controllers derive from it
    (:data:`NAME_BUDGET`: 45 characters for a TrainJob, 51 for a PyTorchJob). Otherwise the
    readable part is shortened; the try number and the key's 10 hex digits of SHA-256 over the
    full identity are always kept, so the name stays deterministic and unique."""
    budget = NAME_BUDGET[api]
    key = identity.key
    if len(key) <= budget and _RFC1035.match(key):
        return key
    slug, try_part, digest = key.rsplit("-", 2)
    tail = f"-{try_part}-{digest}"
    head = re.sub(r"[^a-z0-9-]+", "-", slug.lower()).strip("-")
    if not head[:1].isalpha():
        head = ("tf-" + head).rstrip("-")
    return head[: budget - len(tail)].rstrip("-") + tail


def configmap_name(name: str) -> str:
    """The ConfigMap holding ``job.json`` of the job ``name`` (≤ 63 characters)."""
    return f"{name}-config"


def label_value(value: str) -> str:
    """``value`` as a valid label value: unchanged when it already is one; otherwise sanitised,
    and when that changed or shortened it, suffixed with 8 hex digits of its SHA-256 so that two
    different values never share a label. At most 63 characters."""
    if len(value) <= 63 and _LABEL_VALUE.match(value):
        return value
    digest = hashlib.sha256(value.encode()).hexdigest()[:8]
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", value).strip("-_.")
    return f"{safe[:54].rstrip('-_.')}-{digest}".lstrip("-")


def identity_labels(identity: JobIdentity, api: str = "trainjob") -> dict[str, str]:
    """Labels for selecting a job's objects (full identifiers are in :func:`identity_annotations`)."""
    return {
        "app.kubernetes.io/name": "trainforge",
        "app.kubernetes.io/component": "trainer",
        "app.kubernetes.io/managed-by": "trainforge",
        LABEL_JOB: resource_name(identity, api),
        LABEL_PREFIX + "dag-id": label_value(identity.dag_id),
        LABEL_PREFIX + "task-id": label_value(identity.task_id),
        LABEL_PREFIX + "try-number": str(identity.try_number),
    }


def identity_annotations(identity: JobIdentity) -> dict[str, str]:
    """The full, unshortened identifiers of the job."""
    return {ann: str(getattr(identity, field)) for field, ann in ANNOTATIONS.items()}


def identity_from_annotations(annotations: dict[str, str] | None) -> JobIdentity | None:
    """The identity an object's annotations name, or None when they name none."""
    annotations = annotations or {}
    try:
        return JobIdentity(
            annotations[ANNOTATIONS["dag_id"]], annotations[ANNOTATIONS["run_id"]],
            annotations[ANNOTATIONS["task_id"]], int(annotations[ANNOTATIONS["try_number"]]),
        )
    except (KeyError, ValueError):
        return None
