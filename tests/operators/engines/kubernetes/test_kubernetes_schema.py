"""Offline schema validation of every rendered Kubernetes object.

Core kinds (the ConfigMap, the PyTorchJob's pod templates as core/v1 PodTemplateSpec) are checked
with ``kubernetes-validate`` against the published Kubernetes 1.37 schemas in strict mode (unknown
fields are errors). The custom resources are checked against the vendored TrainJob and PyTorchJob
schemas (``schemas/README.md``: generated from the Kubeflow SDKs' models), whose core types
resolve into the same Kubernetes 1.37 definitions.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
from referencing import Registry, Resource

from trainforge.engines.kubernetes.render import render_objects
from tests.operators.engines.kubernetes.test_kubernetes_common import demo_job, full_job

K8S_VERSION = "1.37"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
CR_SCHEMAS = {"TrainJob": "trainjob-v1alpha1.schema.json", "PyTorchJob": "pytorchjob-v1.schema.json"}
JOBS = {
    "demo-trainjob": lambda: demo_job("trainjob"),
    "demo-pytorchjob": lambda: demo_job("pytorchjob"),
    "full-trainjob": lambda: full_job("trainjob"),
    "full-pytorchjob": lambda: full_job("pytorchjob"),
}


def _k8s_definitions() -> dict:
    folder = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    return json.loads((folder / f"v{K8S_VERSION}.0-local-strict" / "_definitions.json").read_text())


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Resource.from_contents(_k8s_definitions()) @ Registry()


def _validate_cr(obj: dict, registry: Registry) -> None:
    schema = json.loads((SCHEMAS / CR_SCHEMAS[obj["kind"]]).read_text())
    jsonschema.Draft202012Validator(schema, registry=registry).validate(obj)


def _validate_core(obj: dict, definition: str, registry: Registry) -> None:
    ref = {"$ref": f"https://kubernetes.io/api/_definitions.json#/$defs/{definition}"}
    jsonschema.Draft202012Validator(ref, registry=registry).validate(obj)


@pytest.mark.parametrize("case", sorted(JOBS))
def test_configmap_is_a_valid_core_object(case):
    rendered = render_objects(JOBS[case](), "ml-train")
    assert kubernetes_validate.validate(rendered["configmap"], K8S_VERSION, strict=True) == K8S_VERSION


@pytest.mark.parametrize("case", sorted(JOBS))
def test_custom_resource_matches_the_kubeflow_schema(case, registry):
    _validate_cr(render_objects(JOBS[case](), "ml-train")["job"], registry)


@pytest.mark.parametrize("case", ["demo-pytorchjob", "full-pytorchjob"])
def test_pytorchjob_pod_templates_are_core_pod_template_specs(case, registry):
    job = render_objects(JOBS[case](), "ml-train")["job"]
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        _validate_core(replica["template"], "io.k8s.api.core.v1.PodTemplateSpec", registry)


@pytest.mark.parametrize("case", ["demo-trainjob", "full-trainjob"])
def test_trainjob_patch_parts_are_core_types(case, registry):
    """The TrainJob's pod-level patch, taken as a whole pod spec with the trainer container
    completed from ``spec.trainer``, is a valid core/v1 PodTemplateSpec."""
    job = render_objects(JOBS[case](), "ml-train")["job"]
    patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"][0]["template"]["spec"]["template"]
    pod = copy.deepcopy(patch)
    trainer = job["spec"]["trainer"]
    pod["spec"]["containers"][0].update(image=trainer["image"], command=trainer["command"],
                                        env=trainer["env"], resources=trainer["resourcesPerNode"])
    _validate_core(pod, "io.k8s.api.core.v1.PodTemplateSpec", registry)


# Each row breaks one rule; the validators must notice.
BROKEN = [
    ("unknown TrainJob field", "TrainJob", lambda o: o["spec"].update(podTemplateOverrides=[])),
    ("numNodes as text", "TrainJob", lambda o: o["spec"]["trainer"].update(numNodes="2")),
    ("no runtimeRef", "TrainJob", lambda o: o["spec"].pop("runtimeRef")),
    ("env value not a string", "TrainJob", lambda o: o["spec"]["trainer"]["env"].append(
        {"name": "X", "value": 1})),
    ("unknown PyTorchJob field", "PyTorchJob", lambda o: o["spec"].update(elastic={})),
    ("pod spec typo", "PyTorchJob", lambda o: o["spec"]["pytorchReplicaSpecs"]["Master"][
        "template"]["spec"].update(nodeSelectr={})),
    ("no runPolicy", "PyTorchJob", lambda o: o["spec"].pop("runPolicy")),
]


@pytest.mark.parametrize("what,kind,breaks", BROKEN, ids=[row[0] for row in BROKEN])
def test_schemas_reject_broken_objects(what, kind, breaks, registry):
    api = "trainjob" if kind == "TrainJob" else "pytorchjob"
    obj = copy.deepcopy(render_objects(full_job(api), "ml-train")["job"])
    breaks(obj)
    with pytest.raises(jsonschema.ValidationError):
        _validate_cr(obj, registry)


def test_configmap_validation_rejects_a_non_string_value():
    cm = copy.deepcopy(render_objects(demo_job(), "default")["configmap"])
    cm["data"]["job.json"] = {"not": "a string"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(cm, K8S_VERSION, strict=True)
