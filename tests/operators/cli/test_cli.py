"""The trainforge command line: validate exit codes, render goldens, schema output."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainforge.cli.main import app

ROOT = Path(__file__).resolve().parents[3]
PIPELINES = sorted((ROOT / "dags" / "pipelines").glob("*.yaml"))
GOLDEN = Path(__file__).resolve().parent / "golden"
from trainforge.engines.descriptors import engine_names  # noqa: E402

ENGINES = engine_names()  # every engine that exists

runner = CliRunner()


def test_validate_exit_codes(tmp_path):
    ok = runner.invoke(app, ["validate", str(ROOT / "dags" / "pipelines")])
    assert ok.exit_code == 0, ok.output
    bad = tmp_path / "bad.yaml"
    demo = ROOT / "dags" / "pipelines" / "shakespeare_llm.yaml"
    bad.write_text(demo.read_text().replace("max_steps: 300", "max_steps: many"))
    result = runner.invoke(app, ["validate", str(bad), str(demo)])
    assert result.exit_code == 1
    assert f"{bad}:" in result.output and "training.optimization.max_steps" in result.output
    assert "ok (dag_id" in result.output


def test_validate_reports_a_missing_file_without_a_traceback(tmp_path):
    result = runner.invoke(app, ["validate", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 1
    assert "cannot read" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.stem)
def test_render_matches_golden(path, engine, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_HOME", "/trainforge-home")
    result = runner.invoke(app, ["render", str(path), "--engine", engine])
    assert result.exit_code == 0, result.output
    # stdout only: a spec written for another engine gets a placeholder note on stderr.
    rendered = json.loads(result.stdout.replace(sys.executable, "{python}"))
    golden = GOLDEN / f"{path.stem}.{engine}.json"
    if os.environ.get("TRAINFORGE_UPDATE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        golden.write_text(json.dumps(rendered, indent=2, sort_keys=True) + "\n")
    assert rendered == json.loads(golden.read_text())
    if engine == "kubernetes":
        assert "placeholders" in result.stderr  # the demo spec is written for 'local'
        assert rendered["train_request"]["job"]["kind"] == "TrainJob"
    if engine == "local":
        request = rendered["train_request"]
        assert request["argv"][-4:] == ["-m", "trainforge.trainer.train", "--config",
                                        request["job_dir"] + "/job.json"]
    if engine == "ray":
        submit = rendered["train_request"]["submit_job"]
        assert '-m trainforge.trainer.train --config "$d/job.json"' in submit["entrypoint"]
        job_config = json.loads(submit["runtime_env"]["env_vars"]["TRAINFORGE_JOB_CONFIG"])
        assert job_config["identity"]["dag_id"] == rendered["dag_id"]


def test_schema_prints_the_committed_schema():
    from trainforge.pipeline.schema import SCHEMA_PATH

    result = runner.invoke(app, ["schema"])
    assert result.exit_code == 0
    assert json.loads(result.output) == json.loads(SCHEMA_PATH.read_text())


def test_a_cost_that_names_no_catalog_row_is_refused_by_validate_and_run_at_its_line(tmp_path):
    spec = tmp_path / "priced.yaml"
    text = (ROOT / "dags" / "pipelines" / "shakespeare_llm.yaml").read_text().rstrip("\n")
    spec.write_text(text + "\ncost:\n  cloud: aws\n  instance_type: p9.mega\n")
    line = len(text.splitlines()) + 3  # cost:, cloud:, instance_type:
    for command in (["validate", str(spec)], ["run", str(spec)]):
        result = runner.invoke(app, command)
        assert result.exit_code == 1, result.output
        assert f"{spec}:{line}:18: cost.instance_type: cost.cloud 'aws', cost.instance_type " \
               "'p9.mega': no rows of the price catalog" in result.output
        assert "aws/p5.48xlarge" in result.output and "Traceback" not in result.output


def test_validate_names_a_symlink_loop_without_a_traceback(tmp_path):
    loop = tmp_path / "loop.yaml"
    loop.symlink_to(loop)
    result = runner.invoke(app, ["validate", str(loop)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"{loop}: cannot read" in result.output
