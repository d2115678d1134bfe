"""Regenerate the vendored custom-resource schemas in this folder (see README.md).

    pip download --no-deps -d wheels kubeflow-trainer-api==2.3.0 kubeflow-training==1.9.4
    (cd wheels && for w in *.whl; do unzip -qo "$w"; done)
    PYTHONPATH=wheels python tests/operators/engines/kubernetes/schemas/generate.py

Both SDKs are generated from the operators' OpenAPI specs. Kubeflow-specific types are written
out here, strict (no unknown fields, like the API server's strict field validation); every
Kubernetes core type is a ``$ref`` into the Kubernetes JSON schema definitions
(``https://kubernetes.io/api/_definitions.json``), which the tests resolve with the copy
shipped by ``kubernetes-validate`` for a recent Kubernetes version.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
K8S_DEFS = "https://kubernetes.io/api/_definitions.json#/$defs/"


def _k8s_names() -> dict[str, str]:
    import kubernetes_validate

    defs = json.loads((Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
                       / "v1.37.0-local-strict" / "_definitions.json").read_text())["$defs"]
    return {"".join(p[:1].upper() + p[1:] for p in name.split(".")): name for name in defs}


def _strict(node, rename, k8s):
    """Drop nulls/titles/defaults, point core types at the Kubernetes definitions, forbid extras."""
    if isinstance(node, list):
        return [_strict(n, rename, k8s) for n in node]
    if not isinstance(node, dict):
        return node
    if "anyOf" in node and len(node["anyOf"]) == 2 and {"type": "null"} in node["anyOf"]:
        inner = next(n for n in node["anyOf"] if n != {"type": "null"})
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        node = {**rest, **inner}
    out = {}
    for key, value in node.items():
        if key in ("title", "default"):
            continue
        if key == "$ref":
            name = value.rsplit("/", 1)[-1]
            out[key] = K8S_DEFS + k8s[name] if name in k8s else f"#/$defs/{rename(name)}"
            continue
        if key == "$defs":
            out[key] = {rename(k): _strict(v, rename, k8s) for k, v in value.items() if k not in k8s}
            continue
        if key == "properties":
            out[key] = {k: _strict(v, rename, k8s) for k, v in value.items()}
            continue
        out[key] = _strict(value, rename, k8s)
    if out.get("type") == "object" and "properties" in out:
        out["additionalProperties"] = False
    return out


def trainjob_schema(k8s: dict[str, str]) -> dict:
    from kubeflow_trainer_api.models.trainer_v1alpha1_train_job import TrainerV1alpha1TrainJob

    raw = TrainerV1alpha1TrainJob.model_json_schema(by_alias=True)
    raw["properties"].pop("status", None)  # submitted objects carry no status
    schema = _strict(raw, lambda n: n.removeprefix("TrainerV1alpha1"), k8s)
    used = set(re.findall(r'"#/\$defs/([A-Za-z0-9]+)"', json.dumps(schema)))
    while True:  # keep only the definitions reachable from the TrainJob
        more = set(re.findall(r'"#/\$defs/([A-Za-z0-9]+)"',
                              json.dumps([schema["$defs"][n] for n in used])))
        if more <= used:
            break
        used |= more
    schema["$defs"] = {k: v for k, v in schema["$defs"].items() if k in used}
    return schema


def _openapi_type(t: str, k8s: dict[str, str], defs: dict) -> dict:
    if t == "str":
        return {"type": "string"}
    if t == "int":
        return {"type": "integer"}
    if t == "bool":
        return {"type": "boolean"}
    if t == "datetime":
        return {"type": "string"}
    if t.startswith("list["):
        return {"type": "array", "items": _openapi_type(t[5:-1], k8s, defs)}
    if t.startswith("dict(str, "):
        return {"type": "object", "additionalProperties": _openapi_type(t[10:-1], k8s, defs)}
    if t == "Quantity":
        return {"$ref": K8S_DEFS + "io.k8s.apimachinery.pkg.api.resource.Quantity"}
    if t == "V1ObjectMeta":
        return {"$ref": K8S_DEFS + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
    if t.startswith("V1"):
        return {"$ref": K8S_DEFS + "io.k8s.api.core.v1." + t[2:]}
    if t.startswith("K8sIoApi"):
        return {"$ref": K8S_DEFS + k8s["IoK8sApi" + t.removeprefix("K8sIoApi")]}
    if t.startswith("KubeflowOrgV1"):
        short = t.removeprefix("KubeflowOrgV1")
        if short not in defs:
            defs[short] = {}
            defs[short] = _openapi_class(t, k8s, defs)
        return {"$ref": f"#/$defs/{short}"}
    raise ValueError(f"unknown OpenAPI type {t!r}")


def _openapi_class(class_name: str, k8s: dict[str, str], defs: dict) -> dict:
    import importlib
    import inspect

    import kubeflow.training.models as models

    folder = Path(models.__file__).parent
    module = next(p.stem for p in folder.glob("*.py") if p.stem.replace("_", "") == class_name.lower())
    cls = getattr(importlib.import_module(f"kubeflow.training.models.{module}"), class_name)
    src = inspect.getsource(cls)
    props = {cls.attribute_map[a]: _openapi_type(t, k8s, defs) for a, t in cls.openapi_types.items()}
    required = sorted(cls.attribute_map[a] for a in cls.openapi_types
                      if f"Invalid value for `{a}`, must not be `None`" in src)
    out = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = required
    return out


def pytorchjob_schema(k8s: dict[str, str]) -> dict:
    defs: dict = {}
    root = _openapi_class("KubeflowOrgV1PyTorchJob", k8s, defs)
    root["properties"].pop("status", None)
    defs.pop("JobStatus", None)
    for name in [n for n in defs if n in ("JobCondition", "ReplicaStatus")]:
        defs.pop(name)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **root, "$defs": defs}


def main() -> int:
    k8s = _k8s_names()
    for name, schema in (("trainjob-v1alpha1.schema.json", trainjob_schema(k8s)),
                         ("pytorchjob-v1.schema.json", pytorchjob_schema(k8s))):
        (HERE / name).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
        print(f"wrote {HERE / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
