"""``training.resources.nodes: {min, max}``: an elastic job's node range, its rules (engine, fault
policy, global batch at every node count), and the job it becomes."""

from __future__ import annotations

import jsonschema
import pytest

from trainforge.engines.base import JobIdentity
from trainforge.engines.descriptors import engines
from trainforge.jobconfig import build_training_job
from trainforge.pipeline import SpecError, parse_spec_text
from trainforge.pipeline import schema as published
from trainforge.pipeline.spec import ResourcesSection as ReExported
from trainforge.pipeline.resources import NodeRange, ResourcesSection
from tests.operators.pipeline.test_loader import MINIMAL

IDENTITY = JobIdentity("tiny", "manual__1", "train", 1)
# Line 5 is `training:`; below it: 6 engine, 7 resources:, 8 nodes, 9 fault:, 10 max_restarts,
# (11 world_size_change when written), then optimization, with global_batch_size at line 13.
_OK_FAULT = "  fault:\n    max_restarts: 1\n"


def _text(nodes: str, engine: str = "slurm", fault: str = _OK_FAULT, batch: int = 8,
          extra: str = "") -> str:
    """MINIMAL (micro_batch_size 2, processes_per_node 2: 4 sequences a node) on ``engine``."""
    head = f"  engine: {engine}\n  resources:\n    nodes: {nodes}\n" + fault + extra
    text = MINIMAL.replace("training:\n", "training:\n" + head, 1)
    return text.replace("global_batch_size: 4", f"global_batch_size: {batch}")


def _issues(text: str) -> list:
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "bad.yaml")
    return info.value.issues


def _one(text: str, path: str):
    issues = _issues(text)
    match = [i for i in issues if i.path == path]
    assert match, [str(i) for i in issues]
    return match[0]


# -- the value itself: one clean line each, at the line (and key) that is wrong -----------------
@pytest.mark.parametrize(("nodes", "path", "column", "fragment"), [
    ("{min: 0, max: 2}", "training.resources.nodes.min", 18,
     "greater than or equal to 1 (got 0)"),
    ("{min: 3, max: 2}", "training.resources.nodes.max", 26,
     "nodes.max must be at least nodes.min (got min 3, max 2; expected max 3 or more)"),
    ("{min: 1}", "training.resources.nodes.max", 5, "required field is missing"),
    ("{min: 1, max: 2, foo: 1}", "training.resources.nodes.foo", 29,
     "unknown field (got 'foo'; expected one of: max, min)"),
    ("{min: 1, max: 5000}", "training.resources.nodes.max", 26, "less than or equal to 4096"),
    ('"two"', "training.resources.nodes", 12,
     "wrong kind of value (got 'two'; expected a node count or {min, max})"),
    ('"2"', "training.resources.nodes", 12, "write the number without quotes"),
    ("0", "training.resources.nodes", 12, "greater than or equal to 1 (got 0)"),
    ("true", "training.resources.nodes", 12,
     "a boolean is not a node count (got True; expected a node count or {min, max})"),
    ("[1, 2]", "training.resources.nodes", 5, "(got a list; expected a node count or {min, max})"),
    ("{min: true, max: 2}", "training.resources.nodes.min", 18, "not a boolean"),
])
def test_a_bad_node_value_is_one_line_at_its_place(nodes, path, column, fragment):
    issues = _issues(_text(nodes))
    assert len(issues) == 1, [str(i) for i in issues]  # no union noise, no follow-on rule
    issue = issues[0]
    assert (issue.path, issue.line, issue.column) == (path, 8, column), str(issue)
    assert fragment in issue.message and "\n" not in issue.message, str(issue)
    assert "Input should be a valid" not in issue.message, str(issue)


def test_the_range_and_its_properties():
    spec = parse_spec_text(_text("{min: 2, max: 4}", batch=48), "ok.yaml")
    res = spec.training.resources
    assert res.nodes == NodeRange(min=2, max=4) and str(res.nodes) == "{min: 2, max: 4}"
    assert (res.min_nodes, res.max_nodes, res.elastic) == (2, 4, True)
    assert spec.training.world_size == 8  # at the most nodes
    assert ReExported is ResourcesSection  # model.py still exports it


@pytest.mark.parametrize("nodes", ["3", "{min: 3, max: 3}"])
def test_a_count_and_an_equal_range_are_not_elastic(nodes):
    spec = parse_spec_text(_text(nodes, fault="", batch=12), "ok.yaml")
    res = spec.training.resources
    assert (res.min_nodes, res.max_nodes, res.elastic) == (3, 3, False)
    job = build_training_job(spec, "/data", "/ckpt", IDENTITY, {})
    assert (job.nodes, job.min_nodes, job.elastic) == (3, None, False)


def test_an_elastic_range_becomes_the_jobs_min_nodes():
    spec = parse_spec_text(_text("{min: 1, max: 2}"), "ok.yaml")
    job = build_training_job(spec, "/data", "/ckpt", IDENTITY, {})
    assert (job.nodes, job.min_nodes, job.elastic) == (2, 1, True)


# -- rules across sections ------------------------------------------------------------------
def test_only_an_elastic_engine_takes_a_range():
    assert [e.name for e in engines() if e.elastic] == ["slurm"]
    ray = "  ray:\n    address: http://h:8265\n"
    issue = _one(_text("{min: 1, max: 2}", engine="ray", extra=ray), "training.resources.nodes")
    assert issue.line == 8, str(issue)
    assert ("the ray engine runs a fixed number of nodes (got resources.nodes {min: 1, max: 2}; "
            "expected a node count, or the slurm engine for an elastic job)") in issue.message


@pytest.mark.parametrize("nodes", ["{min: 1, max: 2}", "{min: 2, max: 2}"])
def test_the_local_engine_refuses_a_range_of_more_than_one_node(nodes):
    issues = _issues(_text(nodes, engine="local", batch=8))
    assert [i.path for i in issues] == ["training.resources.nodes"], [str(i) for i in issues]
    assert issues[0].line == 8
    assert (f"runs one torchrun group on one machine (got resources.nodes {nodes}"
            in issues[0].message)


def test_the_local_engine_takes_a_range_of_one():
    spec = parse_spec_text(_text("{min: 1, max: 1}", engine="local", fault=""), "ok.yaml")
    assert spec.training.resources.max_nodes == 1 and not spec.training.resources.elastic


def test_an_elastic_job_needs_a_restart():
    fault = "  fault:\n    max_restarts: 0\n"
    issue = _one(_text("{min: 1, max: 2}", fault=fault), "training.fault.max_restarts")
    assert issue.line == 10, str(issue)
    assert "spends one restart (got fault.max_restarts 0 with resources.nodes {min: 1, max: 2}; " \
           "expected 1 or more" in issue.message


def test_a_restart_not_written_points_at_the_nodes():
    issue = _one(_text("{min: 1, max: 2}", fault=""), "training.fault.max_restarts")
    assert issue.line == 8, str(issue)


def test_an_elastic_job_cannot_refuse_a_world_size_change():
    fault = _OK_FAULT + "    world_size_change: refuse\n"
    issues = _issues(_text("{min: 1, max: 2}", fault=fault))
    assert [(i.path, i.line) for i in issues] == [("training.fault.world_size_change", 11)]
    assert "losing a node changes the world size" in issues[0].message
    assert "(got 'refuse' with resources.nodes {min: 1, max: 2}; expected 'continue'" \
        in issues[0].message


def test_a_fixed_count_keeps_the_fault_defaults():
    spec = parse_spec_text(_text("2", fault="  fault:\n    world_size_change: refuse\n", batch=8),
                           "ok.yaml")
    assert spec.training.fault.max_restarts == 0


@pytest.mark.parametrize(("nodes", "batch", "fragment"), [
    # world sizes 2, 4, 6 (2 ranks a node), micro 2: per step 4, 8, 12
    ("{min: 1, max: 3}", 16, "(got 16; 2 x 6 = 12 at 3 nodes; expected a multiple of 24, or "
     "resources.nodes {min: 1, max: 2})"),
    ("{min: 2, max: 5}", 40, "(got 40; 2 x 6 = 12 at 3 nodes, and at 4 nodes; expected a "
     "multiple of 240, or resources.nodes 5)"),
    ("{min: 3, max: 4}", 4, "2 x 6 = 12 at 3 nodes, and at 4 nodes; expected a multiple of 48)"),
])
def test_the_global_batch_divides_at_every_node_count(nodes, batch, fragment):
    issue = _one(_text(nodes, batch=batch), "training.optimization.global_batch_size")
    assert issue.line == 13, str(issue)
    assert ("divisible by micro_batch_size x world size at every node count of resources.nodes "
            f"{nodes}") in issue.message
    assert fragment in issue.message, issue.message


@pytest.mark.parametrize(("nodes", "batch"), [("{min: 1, max: 3}", 24), ("{min: 2, max: 4}", 48)])
def test_a_global_batch_that_divides_everywhere_passes(nodes, batch):
    parse_spec_text(_text(nodes, batch=batch), "ok.yaml")


def test_the_fixed_count_batch_message_is_unchanged():
    issue = _one(_text("3", fault="", batch=8), "training.optimization.global_batch_size")
    assert "divisible by micro_batch_size x world size (got 8; 2 x 6 = 12)" in issue.message


def test_loopback_socket_check_reads_the_most_nodes():
    env = "  slurm:\n    env_vars: {GLOO_SOCKET_IFNAME: lo}\n"
    issue = _one(_text("{min: 1, max: 2}", extra=env), "training.slurm.env_vars")
    assert "with resources.nodes {min: 1, max: 2}" in issue.message
    parse_spec_text(_text("{min: 1, max: 1}", fault="", extra=env), "ok.yaml")


def test_a_stage_may_set_a_range_and_its_rules_apply():
    stage = ("stages:\n  - name: a\n    training:\n      engine: slurm\n"
             "      fault: {max_restarts: 1}\n      resources:\n        nodes: {min: 1, max: 2}\n")
    base = MINIMAL.replace("global_batch_size: 4", "global_batch_size: 8")
    spec = parse_spec_text(base + stage, "ok.yaml")
    from trainforge.pipeline.stages import resolve_stages

    (only,) = resolve_stages(spec)
    assert only.training.resources.elastic
    issues = _issues(base + stage.replace("max_restarts: 1", "max_restarts: 0"))
    assert any(i.path == "stages.0.training.fault.max_restarts" for i in issues), \
        [str(i) for i in issues]


# -- the published forms ---------------------------------------------------------------------
def test_schema_and_reference_show_the_union():
    schema = published.json_schema()
    nodes = schema["$defs"]["ResourcesSection"]["properties"]["nodes"]
    assert {"$ref": "#/$defs/NodeRange"} in nodes["oneOf"]
    assert schema["$defs"]["NodeRange"]["required"] == ["min", "max"]
    data = {"nodes": {"min": 1, "max": 2}}
    sub = {"$defs": schema["$defs"], **schema["$defs"]["ResourcesSection"]}
    jsonschema.validate(data, sub)
    for bad in ({"min": 1}, {"min": 0, "max": 2}, "two", {"min": 1, "max": 2, "foo": 1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"nodes": bad}, sub)
    assert ("| `training.resources.nodes` | integer or mapping (min, max) | 1 | Machines in the "
            "training job: a count, or {min, max}") in published.reference_markdown()


def test_an_elastic_job_is_accounted_on_its_most_nodes():
    from trainforge.accounting import account

    spec = parse_spec_text(_text("{min: 1, max: 2}"), "ok.yaml")
    # 1 h x 2 nodes x 2 ranks x 1 core
    assert account(spec, 3600.0)["cpu_core_hours"] == pytest.approx(4.0)
