"""Names and labels of the Kubernetes engine: at most 63 characters, lowercase DNS-safe,
deterministic, unique; the full identifiers in annotations."""

from __future__ import annotations

import re

import pytest

from trainforge.engines.base import JobIdentity
from trainforge.engines.kubernetes.render import (
    configmap_name,
    identity_annotations,
    identity_from_annotations,
    identity_labels,
    label_value,
    render_objects,
    resource_name,
)
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
