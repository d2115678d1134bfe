"""`trainforge doctor` (trainforge.doctor) and the trainer's side of it (trainforge.trainer.env_check):
ranges read from the distribution's metadata, transformers seeing torch, MLflow's transformers
flavour, torch features, the command's exit codes, the DAG files' and the trainer's refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainforge import doctor
from trainforge.cli.main import app
from trainforge.contract import FailureKind, failure_kind
from trainforge.errors import EnvironmentConflict
from trainforge.trainer import env_check

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "dags" / "pipelines" / "shakespeare_llm.yaml"
REQUIRES = [
    "apache-airflow<4,>=3.2.0", "mlflow<4,>=3.11.1", "torch<3,>=2.6", "transformers<5.23,>=5.0.0",
    "pydantic<3,>=2.11.5", 'ray[default]<3,>=2.40.0; extra == "ray"', 'peft<1,>=0.18.0; extra == "lora"',
    'pywin32>=300; sys_platform == "win32"',
]
GOOD = {"trainforge": "0.1.0", "apache-airflow": "3.3.2", "mlflow": "3.11.1", "torch": "2.6.0",
        "transformers": "5.3.0", "pydantic": "2.11.10"}


class Fake(doctor.Installed):
    """An installed set: ``versions`` by name, trainforge's REQUIRES, transformers needing torch>=2.6."""

    def __init__(self, flavour=("4.45.2", "5.3.0"), sees=True, **versions):
        self.versions = {**GOOD, **{k.replace("_", "-"): v for k, v in versions.items()}}
        self.flavour, self.sees = flavour, sees

    def version(self, name):
        return self.versions.get(name)

    def requires(self, name):
        listed = {"trainforge": REQUIRES, "transformers": ['torch>=2.6; extra == "torch"']}
        return listed.get(name, []) if name in self.versions else None

    def flavour_range(self, flavour):
        return self.flavour

    def sees_torch(self):
        return self.sees


def test_each_requirement_outside_its_declared_range_is_one_line():
    found = doctor.requirement_problems(Fake(apache_airflow="3.1.0", pydantic=None, peft="0.17.0",
                                             pywin32="200"))
    assert found == ["apache-airflow 3.1.0 is installed; trainforge needs apache-airflow>=3.2.0,<4",
                     "pydantic is not installed; trainforge needs pydantic>=2.11.5,<3",
                     # lora's packages are installed: its range counts; ray's are not; pywin32's
                     # marker does not apply here
                     "peft 0.17.0 is installed; trainforge[lora] needs peft>=0.18.0,<1"]
    assert doctor.requirement_problems(Fake()) == []


def test_the_ranges_are_the_installed_distributions_own():
    installed = doctor.Installed()
    assert installed.requires("trainforge") == metadata.requires("trainforge")
    assert installed.version("torch") == metadata.version("torch")
    assert installed.requires("no-such-distribution") is None


def test_a_transformers_that_does_not_see_torch_names_both_versions():
    line = "transformers 5.25.0 does not see torch 2.5.1 (it needs torch>=2.6)"
    installed = Fake(transformers="5.25.0", torch="2.5.1", sees=False)
    assert line in env_check.transformers_torch_problem(installed)
    assert env_check.transformers_torch_problem(Fake()) is None
    # inside transformers' declared range yet refused: transformers' own answer is named
    assert "(transformers.utils.is_torch_available() is False)" in env_check.transformers_torch_problem(
        Fake(sees=False))
    # from metadata alone (DAG parsing), transformers asked nothing: same finding
    assert line in env_check.transformers_torch_problem(Fake(transformers="5.25.0", torch="2.5.1"),
                                                        runtime=False)
    assert env_check.transformers_torch_problem(Fake(), runtime=False) is None


def test_a_transformers_newer_than_mlflow_tested_is_a_note_and_an_older_one_a_problem():
    # MLflow 3.11.1 tested its flavour up to 5.3.0; 5.22.2 registers with it (inside our range)
    newer = Fake(transformers="5.22.2")
    assert doctor.flavour_problem(newer) is None
    assert doctor.flavour_note(newer) == (
        "note: transformers 5.22.2 is newer than MLflow 3.11.1's transformers flavour was tested with "
        "(up to 5.3.0); trainforge's range excludes the releases known to fail to register")
    older = Fake(transformers="4.40.0")
    assert doctor.flavour_problem(older).startswith(
        "transformers 4.40.0 is installed; MLflow 3.11.1's transformers flavour supports "
        "transformers>=4.45.2,<=5.3.0")
    assert doctor.flavour_note(older) is None
    for inside in ("5.3.0", "4.45.2"):  # the bounds themselves
        assert doctor.flavour_problem(Fake(transformers=inside)) is None
        assert doctor.flavour_note(Fake(transformers=inside)) is None
    assert doctor.flavour_problem(Fake(flavour=None)) is None  # no table: nothing to compare
    doctor.require_environment(newer)  # a note never stops a DAG file


def test_mlflows_table_is_read_as_mlflow_writes_it(tmp_path):
    import ast
    import importlib.util

    real = doctor.Installed().flavour_range("transformers")
    path = Path(importlib.util.find_spec("mlflow").submodule_search_locations[0]) / doctor.FLAVOUR_TABLE
    table = next(ast.literal_eval(n.value) for n in ast.parse(path.read_text()).body
                 if isinstance(n, ast.Assign) and n.targets[0].id == "_ML_PACKAGE_VERSIONS")
    assert real == (table["transformers"]["models"]["minimum"], table["transformers"]["models"]["maximum"])
    python_only = tmp_path / "table.py"  # not JSON (a trailing comma): Python's parse
    python_only.write_text('X = 1\n_ML_PACKAGE_VERSIONS = {"transformers": {"models": '
                           '{"minimum": "1.0", "maximum": "2.0",},},}\n')
    assert doctor._flavour_table(python_only)["transformers"]["models"]["maximum"] == "2.0"


def test_a_torch_feature_the_spec_asks_for_and_torch_lacks_names_the_setting(tmp_path):
    from trainforge.pipeline import load_spec

    spec = tmp_path / "fsdp.yaml"
    spec.write_text(DEMO.read_text().replace("parallelism: ddp", "parallelism: fsdp"))
    asked = doctor.spec_features(load_spec(spec))
    assert asked == {"compile": "training.framework.compile: auto",
                     "fsdp2": "training.framework.parallelism: fsdp",
                     "dcp": "training.framework.parallelism: fsdp"}

    def old_torch(module):
        raise ImportError(f"cannot import {module}")

    found = env_check.feature_problems(asked, Fake(torch="2.4.0"), import_module=old_torch)
    assert ("FSDP2 (torch.distributed.fsdp.fully_shard) is not available with torch 2.4.0 (ImportError: "
            "cannot import torch.distributed.fsdp); training.framework.parallelism: fsdp needs it") in found
    assert len(found) == 3
    assert env_check.feature_problems(asked, doctor.Installed()) == []  # the venv's torch has them


def test_the_command_prints_one_line_per_problem_and_exits_1(monkeypatch):
    installed = Fake(apache_airflow="3.1.0", transformers="5.25.0", torch="2.5.1", sees=False)
    monkeypatch.setattr(doctor, "Installed", lambda: installed)
    monkeypatch.setattr(doctor, "plugin_problem", lambda: "the trainforge plugin (x) does not import: boom")
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert len(lines) == 6, result.output
    assert lines[0] == "apache-airflow 3.1.0 is installed; trainforge needs apache-airflow>=3.2.0,<4"
    assert lines[1] == "torch 2.5.1 is installed; trainforge needs torch>=2.6,<3"
    # the pair that fails registration (MLflow 3.11.1, transformers 5.25.0) is outside our range
    assert lines[2] == "transformers 5.25.0 is installed; trainforge needs transformers>=5.0.0,<5.23"
    assert lines[3].startswith("transformers 5.25.0 does not see torch 2.5.1")
    assert lines[4].endswith("does not import: boom")
    assert lines[5].startswith("note: transformers 5.25.0 is newer than MLflow 3.11.1's")
    unknown = CliRunner().invoke(app, ["doctor", "--feature", "fp4"])
    assert unknown.exit_code == 2 and "unknown --feature fp4" in unknown.output


def test_the_venv_passes_the_doctor_with_a_spec_asking_for_fsdp(tmp_path):
    spec = tmp_path / "fsdp.yaml"
    spec.write_text(DEMO.read_text().replace("parallelism: ddp", "parallelism: fsdp"))
    result = CliRunner().invoke(app, ["doctor", str(spec)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"ok: trainforge {metadata.version('trainforge')} with apache-airflow ")
    assert "transformers sees torch; torch features: compile, dcp, fsdp2" in result.output


def test_a_dag_file_raises_the_conflict_as_its_import_error(monkeypatch, tmp_path):
    from trainforge import dag_files

    monkeypatch.setattr(dag_files, "require_plugin", lambda: None)
    monkeypatch.setattr(doctor, "Installed", lambda: Fake(transformers="5.25.0", torch="2.5.1"))
    (tmp_path / "demo.yaml").write_text(DEMO.read_text())
    with pytest.raises(EnvironmentConflict) as raised:
        dag_files.companion_dags(str(tmp_path / "demo.py"))
    assert "transformers 5.25.0 is installed; trainforge needs transformers>=5.0.0,<5.23" in str(raised.value)
    assert "transformers 5.25.0 does not see torch 2.5.1 (it needs torch>=2.6)" in str(raised.value)
    monkeypatch.undo()
    doctor.require_environment()  # the venv itself: nothing raised


def test_the_trainer_refuses_a_conflict_with_exit_78_permanently(tmp_path):
    config = tmp_path / "job.json"
    config.write_text(json.dumps({"framework": {"parallelism": "fsdp", "compile": False}}))
    result = tmp_path / "result.json"
    env = {"RANK": "0", "TRAINFORGE_RESULT_FILE": str(result)}
    with pytest.raises(SystemExit) as exited:
        env_check.refuse_conflicts(["--config", str(config)], env,
                                   Fake(transformers="5.25.0", torch="2.5.1", sees=False))
    assert exited.value.code == 78
    written = json.loads(result.read_text())
    assert written["status"] == "bad_config" and written["exit_code"] == 78
    assert "transformers 5.25.0 does not see torch 2.5.1 (it needs torch>=2.6)" in written["message"]
    assert failure_kind(exited.value.code, written) is FailureKind.PERMANENT
    env_check.refuse_conflicts(["--config", str(config)], env, Fake())  # nothing wrong: returns


def test_the_trainer_program_checks_before_importing_the_model(tmp_path):
    """The issue's environment: the real transformers with a torch it disables (metadata 2.4.0)."""
    fake = tmp_path / "site" / "torch-2.4.0.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.4.0\n")
    config = tmp_path / "job.json"
    config.write_text("{}")
    env = {**os.environ, "PYTHONPATH": str(fake.parent), "TRAINFORGE_RESULT_FILE": str(tmp_path / "r.json")}
    done = subprocess.run([sys.executable, "-m", "trainforge.trainer.train", "--config", str(config)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 78, done.stderr[-3000:]
    message = json.loads((tmp_path / "r.json").read_text())["message"]
    assert f"transformers {metadata.version('transformers')} does not see torch 2.4.0" in message
    assert "NameError" not in done.stderr
