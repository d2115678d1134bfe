"""The spec refuses exactly the spec-built model sections the trainer refuses: both apply
trainforge.contract's one definition of the attention rules. A grid of shapes is walked through
both: `trainforge validate`'s loader (an error at the field's line) and the trainer's job-config
parser (the job config the spec renders, or, for a refused spec, the same fields as given)."""

from __future__ import annotations

import itertools

import pytest

from trainforge.engines.base import JobIdentity
from trainforge.jobconfig import render_job_config
from trainforge.pipeline import SpecError, parse_spec_text
from trainforge.trainer.config import parse_job_config
from trainforge.trainer.errors import ConfigError
from tests.operators.pipeline.test_loader import MINIMAL
from tests.trainer.conftest import make_job

IDENTITY = JobIdentity("tiny", "manual__1", "train", 1)
SHAPES = list(itertools.product((30, 32, 60, 64, 96, 100), (1, 2, 3, 4, 5, 20), (None, 1, 2, 3)))


def _spec(hidden: int, heads: int, kv: int | None) -> tuple[str, dict[str, int]]:
    fields = {"hidden_size": hidden, "num_layers": 1, "num_heads": heads, "intermediate_size": 64}
    if kv is not None:
        fields["num_kv_heads"] = kv
    block = "model:\n" + "".join(f"  {k}: {v}\n" for k, v in fields.items())
    return MINIMAL.replace("training:\n", block + "training:\n", 1), fields


def _trainer_refuses(job: dict) -> str | None:
    try:
        parse_job_config(job)
    except ConfigError as err:
        return str(err)
    return None


@pytest.mark.parametrize(("hidden", "heads", "kv"), SHAPES, ids=[f"{h}-{n}-{k}" for h, n, k in SHAPES])
def test_the_spec_and_the_trainer_refuse_the_same_shapes(hidden, heads, kv):
    text, fields = _spec(hidden, heads, kv)
    try:
        spec = parse_spec_text(text, "shape.yaml")
    except SpecError as err:
        spec, issues = None, err.issues
    if spec is not None:  # what the spec accepts renders a job config the trainer accepts
        job = render_job_config(spec, "/data/ds", "/ckpt", IDENTITY)
        assert _trainer_refuses(job) is None, (fields, _trainer_refuses(job))
        return
    model = {**make_job("/data/ds", "/ckpt")["model"], "num_kv_heads": kv or heads,
             **{k: v for k, v in fields.items() if k != "num_kv_heads"}}
    refused = _trainer_refuses(make_job("/data/ds", "/ckpt", model=model))
    assert refused, (fields, [str(i) for i in issues])
    lines = {name: 1 + text.splitlines().index(f"  {name}: {value}") for name, value in fields.items()}
    for issue in issues:  # each refusal at the line of the field it names, with the trainer's words
        field = issue.path.rsplit(".", 1)[-1]
        assert issue.path.startswith("model.") and issue.line == lines.get(field, issue.line), str(issue)
        assert issue.message.split(" (")[0] in refused, (issue.message, refused)


def test_hidden_60_with_20_heads_is_refused_by_validate_at_the_heads_line():
    text, _ = _spec(60, 20, None)
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "shape.yaml")
    issue, = info.value.issues
    assert (issue.path, issue.line) == ("model.num_heads", text.splitlines().index("  num_heads: 20") + 1)
    assert "into an even head size" in issue.message and "shape.yaml" in str(info.value)


@pytest.mark.parametrize(("field", "value"), [("num_layers", 0), ("num_heads", 0), ("num_kv_heads", 0),
                                               ("rope_theta", 0.0), ("dropout", 1.0), ("dropout", -0.1),
                                               ("intermediate_size", 0)])
def test_the_trainers_other_refusals_are_the_specs_at_their_line(field, value):
    text = MINIMAL.replace("training:\n", f"model:\n  {field}: {value}\ntraining:\n", 1)
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "edge.yaml")
    assert [(i.path, i.line) for i in info.value.issues] == [
        (f"model.{field}", text.splitlines().index(f"  {field}: {value}") + 1)], str(info.value)
    model = {**make_job("/data/ds", "/ckpt")["model"], field: value}
    assert _trainer_refuses(make_job("/data/ds", "/ckpt", model=model)), (field, value)
