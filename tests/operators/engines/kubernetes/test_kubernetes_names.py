"""Names and labels of the Kubernetes engine: at most 63 characters, lowercase DNS-safe,
deterministic, unique; the full identifiers in annotations."""

from __future__ import annotations

import re

import pytest

from trainforge.engines.base import JobIdentity
from trainforge.engines.kubernetes.names import (
    configmap_name,
    identity_annotations,
    identity_from_annotations,
    identity_labels,
    label_value,
    resource_name,
)
from trainforge.engines.kubernetes.render import render_objects
from tests.operators.engines.kubernetes.test_kubernetes_common import demo_job

RFC1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

IDENTITIES = [
    JobIdentity("shakespeare_llm", "manual__2026-01-01T00:00:00+00:00", "train", 1),
    JobIdentity("A" * 250, "scheduled__2026-01-01T00:00:00+00:00", "Train.Task" * 20, 12),
    JobIdentity("123_starts_with_digit", "r", "t", 1),
    JobIdentity("___", "r", "---", 3),
    JobIdentity("ünïcode dag", "r ün", "tâsk", 1),
    JobIdentity("team.group.pipeline", "asset_triggered__2026", "train", 999_999),
]


@pytest.mark.parametrize("identity", IDENTITIES, ids=lambda i: i.dag_id[:20])
def test_names_and_labels_are_valid(identity):
    name = resource_name(identity)
    assert RFC1035.match(name) and len(name) <= 63, name
    assert len(configmap_name(name)) <= 63
    for key, value in identity_labels(identity).items():
        assert LABEL_VALUE.match(value) and len(value) <= 63, (key, value)
        assert len(key.split("/")[-1]) <= 63
    assert identity_from_annotations(identity_annotations(identity)) == identity


@pytest.mark.parametrize("identity", IDENTITIES, ids=lambda i: i.dag_id[:20])
def test_names_are_deterministic(identity):
    assert resource_name(identity) == resource_name(JobIdentity(**identity.to_dict()))
    assert identity_labels(identity) == identity_labels(JobIdentity(**identity.to_dict()))


def test_colliding_sanitised_ids_get_different_names_and_labels():
    a = JobIdentity("team_a.train", "r", "train", 1)
    b = JobIdentity("team-a-train", "r", "train", 1)
    c = JobIdentity("team_a.train", "r2", "train", 1)
    d = JobIdentity("team_a.train", "r", "train", 2)
    names = {resource_name(i) for i in (a, b, c, d)}
    assert len(names) == 4
    long_a, long_b = "x" * 70 + "a", "x" * 70 + "b"
    assert label_value(long_a) != label_value(long_b)
    assert len(label_value(long_a)) <= 63


def test_label_value_keeps_valid_values_and_marks_changed_ones():
    assert label_value("shakespeare_llm") == "shakespeare_llm"
    changed = label_value("ünïcode dag")
    assert LABEL_VALUE.match(changed) and changed != label_value("ünïcode_dag")


def test_annotations_carry_the_full_identifiers():
    identity = IDENTITIES[1]
    job = render_objects(demo_job(identity=identity), "default")["job"]
    annotations = job["metadata"]["annotations"]
    assert annotations["trainforge.io/dag-id"] == identity.dag_id
    assert annotations["trainforge.io/run-id"] == identity.run_id
    assert annotations["trainforge.io/task-id"] == identity.task_id
    assert annotations["trainforge.io/try-number"] == "12"
    assert job["metadata"]["name"] == resource_name(identity)


# The worst cases a spec allows: a 50-character pipeline name, a 40-character task id, try 20,
# 64 nodes; and a name that needs the `tf-` prefix (a digit first).
WORST = [
    JobIdentity("p" * 49 + "e", "scheduled__2026-01-01T00:00:00+00:00", "t" * 40, 20),
    JobIdentity("9" + "a" * 49, "r", "train_" + "x" * 34, 20),
    JobIdentity("team_" + "n" * 45, "r", "train", 10),
]


def derived_names(obj: dict) -> list[str]:
    """Every name the controllers derive from the rendered job, as they form it."""
    name = obj["metadata"]["name"]
    if obj["kind"] == "TrainJob":
        # JobSet's webhook checks `<jobset>-<replicatedJob>-<maxJobIdx>-<maxPodIdx>-<5 random>`;
        # the torch runtime's `node` replicated job is one Job of numNodes pods.
        nodes = obj["spec"]["trainer"]["numNodes"]
        return [name, f"{name}-node-0", f"{name}-node-0-{nodes - 1}-abcde", f"{name}-config"]
    workers = obj["spec"]["pytorchReplicaSpecs"].get("Worker", {}).get("replicas", 0)
    return [name, f"{name}-master-0", *(f"{name}-worker-{i}" for i in range(workers)),
            f"{name}-config"]


@pytest.mark.parametrize("api", ["trainjob", "pytorchjob"])
@pytest.mark.parametrize("nodes", [1, 64, 4096])
@pytest.mark.parametrize("identity", WORST, ids=lambda i: f"{len(i.dag_id)}-{len(i.task_id)}")
def test_every_name_the_controllers_derive_fits_63_characters(api, nodes, identity):
    from tests.operators.engines.kubernetes.test_kubernetes_common import job_for, spec_for

    spec = spec_for(api, resources={"nodes": nodes, "processes_per_node": 1},
                    optimization={"micro_batch_size": 1, "global_batch_size": nodes})
    job = job_for(spec, identity)
    obj = render_objects(job, "default")["job"]
    assert obj["metadata"]["name"] == resource_name(identity, api)
    assert obj["metadata"]["labels"]["trainforge.io/job"] == obj["metadata"]["name"]
    for derived in derived_names(obj):
        assert RFC1035.match(derived) and len(derived) <= 63, (derived, len(derived))
    # Still readable and unique: the ids' start, the try, the digest over the full identity.
    assert obj["metadata"]["name"].endswith(identity.key[-(len(str(identity.try_number)) + 13):])


def test_shortened_names_stay_unique_and_short_ones_are_unchanged():
    a, b = WORST[0], JobIdentity(WORST[0].dag_id, "other_run", WORST[0].task_id, 20)
    assert resource_name(a) != resource_name(b)
    demo = JobIdentity("shakespeare_llm", "manual__2026-01-01T00:00:00+00:00", "train", 1)
    assert resource_name(demo, "trainjob") == resource_name(demo, "pytorchjob") == demo.key


def test_more_nodes_than_the_names_are_budgeted_for_is_refused_at_render():
    import dataclasses

    job = dataclasses.replace(demo_job(), nodes=10_001)
    with pytest.raises(ValueError, match="at most 10000 nodes"):
        render_objects(job, "default")
