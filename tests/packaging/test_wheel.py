"""The wheel in a fresh venv beside stock Airflow, as a platform engineer installs it.

One venv per module: ``python3.11 -m venv``; the wheel's declared dependencies (apache-airflow
3.3.2 and the rest of its closure) placed into it from this environment's installed files, and
nothing else (tests/packaging/dependencies.py: what ``make venv`` installed from the same
``requirements.lock``, so not downloaded and unpacked again); then
``pip install --no-index -c requirements.lock <wheel>`` (not editable), which must find every
requirement satisfied and install the wheel alone, and ``pip check``. Every command runs from a
temporary folder outside the checkout, with no PYTHONPATH, so nothing of the checkout can be
imported: only what the wheel installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import data_cache
from tests.packaging.dependencies import place_dependencies
from tests.packaging.layout import REPO

pytestmark = [pytest.mark.wheel, pytest.mark.airflow, pytest.mark.integration,
              pytest.mark.distributed]

SPEC = REPO / "tests" / "e2e" / "tiny_shakespeare.yaml"
DAG_ID = "tiny_shakespeare"
#: The smallest whole pipeline, run at both ends of the ranges (here and test_wheel_ranges.py).
TINY = REPO / "tests" / "packaging" / "wheel_tiny.yaml"
# Variables of the calling environment that would point the venv back at the checkout, or at
# another Airflow, MLflow or trainforge home.
_DROPPED = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "MLFLOW_TRACKING_URI", "RAY_ADDRESS")


class Venv:
    """A fresh venv holding the wheel, and a work folder outside the checkout to run in."""

    def __init__(self, root: Path):
        self.root = root
        self.bin = root / "venv" / "bin"
        self.work = root / "work"
        self.home = root / "home"
        self.specs = self.work / "specs"
        self.spec = self.specs / SPEC.name

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in _DROPPED and not k.startswith(("AIRFLOW", "TRAINFORGE"))}
        env.update(
            PATH=os.pathsep.join([str(self.bin), env.get("PATH", "")]),
            TRAINFORGE_HOME=str(self.home),
            AIRFLOW_HOME=str(self.root / "airflow"),
            AIRFLOW__CORE__LOAD_EXAMPLES="False",
        )
        env.update(extra)
        return env

    def run(self, *args: str, timeout_s: float = 300, check: bool = True,
            **extra: str) -> subprocess.CompletedProcess:
        """Run a command of the venv (``trainforge``, ``airflow``, ``python``, ``pip``) in the
        work folder; with ``check``, a non-zero exit fails the test with its output."""
        result = subprocess.run([str(self.bin / args[0]), *args[1:]], cwd=self.work,
                                env=self.env(**extra), capture_output=True, text=True,
                                timeout=timeout_s)
        if check:
            assert result.returncode == 0, (
                f"{' '.join(args)} exited {result.returncode}:\n"
                f"{result.stdout[-6000:]}\n{result.stderr[-6000:]}")
        return result


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, built_wheel: Path, request) -> Venv:
    venv = Venv(tmp_path_factory.mktemp("wheel-venv"))
    subprocess.run(["python3.11", "-m", "venv", str(venv.root / "venv")], check=True, timeout=300)
    venv.work.mkdir()
    venv.specs.mkdir()
    shutil.copy2(SPEC, venv.spec)
    place_dependencies(built_wheel, venv.root / "venv")
    installed = venv.run("pip", "install", "--no-index", "-c", str(REPO / "requirements.lock"),
                         str(built_wheel), timeout_s=600)
    assert "Installing collected packages: trainforge\n" in installed.stdout, installed.stdout
    venv.run("pip", "check")
    # The demo corpus through the installed package; shared with the e2e tests when pytest's
    # cache is on (its SOURCE.json is verified, nothing is fetched twice).
    corpus = data_cache(request.config) / "shakespeare"
    venv.run("python", "-m", "trainforge.data.corpus", "fetch", "--dest", str(corpus),
             timeout_s=600)
    (venv.home / "corpus").mkdir(parents=True)
    (venv.home / "corpus" / "shakespeare").symlink_to(corpus, target_is_directory=True)
    return venv


def test_only_the_wheel_is_importable(venv: Venv):
    out = venv.run("python", "-c", "import json, sys, trainforge, trainforge.trainer; "
                   "print(json.dumps([trainforge.__file__, trainforge.trainer.__file__, sys.path]))")
    package, trainer, path = json.loads(out.stdout)
    site = str(venv.root / "venv" / "lib")
    assert package.startswith(site) and trainer.startswith(site)
    assert not [p for p in path if p and Path(p).resolve().is_relative_to(REPO)], path
    for name in ("operators", "mlflow_setup"):
        probe = venv.run("python", "-c", f"import {name}", check=False)
        assert probe.returncode != 0, f"the wheel installed a top-level {name!r} package"


def _json(out: subprocess.CompletedProcess):
    """The JSON document an Airflow command printed last (Airflow prints warnings before it)."""
    return json.loads(out.stdout.strip().splitlines()[-1])


def _validate_and_render(venv: Venv) -> tuple[str, dict]:
    validated = venv.run("trainforge", "validate", str(venv.specs))
    rendered = venv.run("trainforge", "render", str(venv.spec))
    return validated.stdout, json.loads(rendered.stdout)


def test_validate_and_render(venv: Venv):
    validated, rendered = _validate_and_render(venv)
    assert SPEC.name in validated
    assert rendered["dag_id"] == DAG_ID
    assert rendered["tasks"][0] == "prepare_data" and "train" in rendered["tasks"]


def check_tiny_pipeline(venv: Venv) -> None:
    """validate, render, a tiny run (:data:`TINY`, copied to a folder of its own so the venv's
    specs folder keeps one spec) and ``airflow plugins`` in ``venv``."""
    spec = venv.work / "tiny" / TINY.name
    spec.parent.mkdir(exist_ok=True)
    shutil.copy2(TINY, spec)
    assert "wheel_tiny" in venv.run("trainforge", "validate", str(spec)).stdout
    rendered = json.loads(venv.run("trainforge", "render", str(spec)).stdout)
    assert rendered["dag_id"] == "wheel_tiny"
    summary_path = venv.root / "tiny-summary.json"
    venv.run("trainforge", "run", str(spec), "--summary-json", str(summary_path), timeout_s=900)
    summary = json.loads(summary_path.read_text())
    assert summary["state"] == "success", summary
    plugins_home = venv.root / "plugins-home"
    (plugins_home / "plugins").mkdir(parents=True, exist_ok=True)
    out = venv.run("airflow", "plugins", "--output", "json", AIRFLOW_HOME=str(plugins_home),
                   AIRFLOW__CORE__PLUGINS_FOLDER=str(plugins_home / "plugins"))
    assert [p["name"] for p in _json(out)] == ["trainforge"]


def test_tiny_run(venv: Venv):
    """The lock end of the ranges (issue 27): the same tiny pipeline as at the floors."""
    check_tiny_pipeline(venv)


@pytest.mark.heavy
def test_run_end_to_end(venv: Venv):
    summary_path = venv.root / "summary.json"
    venv.run("trainforge", "run", str(venv.spec), "--summary-json", str(summary_path),
             timeout_s=1800)
    summary = json.loads(summary_path.read_text())
    assert summary["state"] == "success", summary
    assert {t: s["state"] for t, s in summary["stages"].items()} == {
        "prepare_data": "success", "train": "success",
        "validate_checkpoint": "success", "register_model": "success",
    }


def _deployment(venv: Venv, name: str) -> dict[str, str]:
    """Settings of a deployment whose DAGs folder holds a copy of the one-line DAG file."""
    dags = venv.root / name / "dags"
    dags.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / "dags" / "trainforge_pipelines.py", dags)
    plugins = venv.root / name / "plugins"
    plugins.mkdir(exist_ok=True)
    return {"AIRFLOW_HOME": str(venv.root / name), "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(plugins)}


def test_airflow_plugins_lists_the_entry_point_plugin(venv: Venv):
    out = venv.run("airflow", "plugins", "--output", "json", **_deployment(venv, "plugins"))
    plugins = _json(out)
    assert [p["name"] for p in plugins] == ["trainforge"]
    assert "trainforge.plugins.links.MlflowRunLink" in plugins[0]["operator_extra_links"][0]


def test_checkout_plugins_folder_adds_no_second_plugin(venv: Venv):
    """A deployment whose plugins folder is a copy of the checkout's plugins/ (the plugin's own
    code) still has the plugin once, from the entry point, and no plugin import error: the
    folder's .airflowignore keeps the plugins manager from importing its files again."""
    settings = _deployment(venv, "checkout-plugins")
    shutil.copytree(REPO / "plugins", settings["AIRFLOW__CORE__PLUGINS_FOLDER"], dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    assert (Path(settings["AIRFLOW__CORE__PLUGINS_FOLDER"]) / "plugin.py").is_file()
    probe = venv.run("python", "-c",
                     "import json; from airflow import plugins_manager as pm; "
                     "plugins, errors = pm._get_plugins(); "
                     "print(json.dumps([[p.name for p in plugins], list(errors.values())]))",
                     **settings)
    names, errors = _json(probe)
    assert names == ["trainforge"]
    assert errors == []


@pytest.mark.parametrize("setting", ["TRAINFORGE_PIPELINES", "AIRFLOW__TRAINFORGE__PIPELINES"])
def test_airflow_dags_list_shows_the_pipeline(venv: Venv, setting: str):
    settings = _deployment(venv, f"dags-{setting.lower()}")
    venv.run("airflow", "db", "migrate", timeout_s=600, **settings)
    specs = {setting: str(venv.specs)}
    out = venv.run("airflow", "dags", "list", "--local", "--output", "json", timeout_s=600,
                   **settings, **specs)
    assert [d["dag_id"] for d in _json(out)] == [DAG_ID]
    errors = venv.run("airflow", "dags", "list-import-errors", "--local", "--output", "json",
                      timeout_s=600, **settings, **specs)
    assert _json(errors) == []


def _dummy_wheel(root: Path) -> Path:
    """A distribution installing top-level ``operators`` and ``trainer`` packages, the generic
    names this project's folders have in the checkout."""
    source = root / "dummy-src"
    for package in ("operators", "trainer"):
        (source / package).mkdir(parents=True)
        (source / package / "__init__.py").write_text(f'WHO = "dummy {package}"\n')
    (source / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "dummy-generic-names"\nversion = "1.0"\n'
        '[tool.setuptools]\npackages = ["operators", "trainer"]\n')
    dist = root / "dummy-dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(dist), str(source)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = dist.glob("*.whl")
    return wheel


def test_dummy_top_level_packages_change_nothing(venv: Venv):
    before = _validate_and_render(venv)
    venv.run("pip", "install", "--quiet", "--no-deps", str(_dummy_wheel(venv.root)))
    try:
        assert before == _validate_and_render(venv)
        out = venv.run("python", "-c", "import operators, trainer, trainforge.trainer.train, "
                       "trainforge.plugins.plugin; print(operators.WHO, trainer.WHO)")
        assert out.stdout.split() == ["dummy", "operators", "dummy", "trainer"]
    finally:
        venv.run("pip", "uninstall", "--yes", "dummy-generic-names")
