"""The wheel's dependency ranges, resolved without the lock, and beside an Airflow already installed.

- Its METADATA holds ranges, no exact pins.
- **Three resolutions** (:data:`RESOLUTIONS`), each on Python 3.12 (not the lock's 3.11) from the
  wheel's own requirements by uv, with no constraints beyond the floors themselves: ``floors``
  (apache-airflow, mlflow, transformers, torch and pydantic at their lower bounds, read from the
  wheel, so a raised floor is tested at once), ``lowest-direct`` (what a user's resolver picks when
  asked for the lowest direct versions) and ``highest`` (what it picks today). In each, every
  module imports, and ``validate``, ``render``, a tiny ``run`` (tests/packaging/wheel_tiny.yaml,
  :func:`~tests.packaging.test_wheel.check_tiny_pipeline`: one rank, 20 steps, every stage) and
  ``airflow plugins`` work. Nothing is pinned to make them pass: a pair that fails is excluded in
  pyproject.toml, with its reason.
- **Lock**: tests/packaging/test_wheel.py, Python 3.11, ``-c requirements.lock``, the same tiny run.
- **Beside Airflow 3.3.2 with PyYAML 6.0.3**: ``pip install --dry-run --report`` of the wheel
  would change no installed distribution (it only adds).

What is cached: PyPI's Linux torch wheels are CUDA builds (torch 2.6.0 with its nvidia-* packages:
4.3 GB installed) and PyTorch's CPU index is not reachable from CI, so each resolution's answer is
kept for the day (``$TRAINFORGE_TEST_CACHE/resolved``, default ``~/.cache/trainforge-tests``) and
each exact set is installed by uv once into ``env-<python>-<hash>`` there (minutes the first
time). Each run makes a fresh venv that sees it through a ``.pth`` file (console scripts rewritten
to its own interpreter) and installs the wheel into it with ``pip install --no-index``: pip must
find every requirement met. The torch there is the CUDA build running on CPU.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.conftest import data_cache
from tests.packaging.dependencies import place_requirements, wheel_requirements
from tests.packaging.test_wheel import Venv, check_tiny_pipeline

pytestmark = [pytest.mark.wheel, pytest.mark.airflow, pytest.mark.integration]

def _floor_pythons() -> list[str]:
    """python3.12 on PATH, then pyenv's 3.12 builds (``$PYENV_ROOT``, else ``~/.pyenv``), newest first."""
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    return ["python3.12", *(str(p) for p in sorted(root.glob("versions/3.12*/bin/python3.12"), reverse=True))]
#: The ranges whose lower bound the floor venv pins (the features that set them: pyproject.toml).
FLOORED = ("apache-airflow", "mlflow", "transformers", "torch", "pydantic")
#: How each environment is resolved from the wheel's runtime requirements, by uv: ``floors`` pins
#: :data:`FLOORED` at their lower bounds (the rest as high as they allow), ``lowest-direct`` is what
#: a user's resolver picks asked for the lowest direct versions, ``highest`` what it picks today.
RESOLUTIONS = ("floors", "lowest-direct", "highest")


def _runtime(wheel: Path) -> list[Requirement]:
    return [r for r in wheel_requirements(wheel) if r.marker is None]


def lower_bound(requirement: Requirement) -> str:
    (bound,) = [s.version for s in requirement.specifier if s.operator == ">="]
    return bound


def test_requires_dist_holds_ranges_not_pins(built_wheel: Path):
    requirements = wheel_requirements(built_wheel)
    assert requirements
    pinned = [str(r) for r in requirements if any(s.operator in ("==", "===") for s in r.specifier)]
    assert pinned == []
    for requirement in requirements:
        operators = {s.operator for s in requirement.specifier}
        assert operators == {">=", "<"}, f"{requirement}: not a range from a floor to below a cap"


def _floor_python() -> str:
    """The first candidate that runs and is 3.12 (a pyenv shim is on PATH even where pyenv has no
    3.12 selected, and then exits 127)."""
    candidates = _floor_pythons()
    for candidate in candidates:
        found = shutil.which(candidate)
        if found and subprocess.run([found, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"],
                                    capture_output=True, timeout=60).returncode == 0:
            return found
    pytest.skip(f"no Python 3.12 for the floor venv: install one, e.g. pyenv install 3.12 "
                f"(looked for {', '.join(candidates)})")


def _cache_root() -> Path:
    return Path(os.environ.get("TRAINFORGE_TEST_CACHE", Path.home() / ".cache" / "trainforge-tests"))


def _uv() -> str:
    """uv of the test environment (the ``test`` extra), else on PATH."""
    found = Path(sys.executable).with_name("uv")
    return str(found) if found.is_file() else shutil.which("uv") or pytest.fail(
        "uv is not installed: it is in the test extra (make venv)")


def _resolve(python: str, wheel: Path, resolution: str) -> list[str]:
    """The exact set ``resolution`` gives the wheel's runtime requirements on ``python``: resolved
    by uv against the package index once a day (the answer is kept for that day)."""
    runtime = sorted(str(r) for r in _runtime(wheel))
    floors = sorted(f"{r.name}=={lower_bound(r)}" for r in _runtime(wheel)
                    if canonicalize_name(r.name) in FLOORED) if resolution == "floors" else []
    assert len(floors) == (len(FLOORED) if resolution == "floors" else 0), floors
    key = hashlib.sha256("\n".join([python, resolution, *runtime, *floors]).encode()).hexdigest()[:16]
    answer = _cache_root() / "resolved" / f"{resolution}-{datetime.date.today()}-{key}.txt"
    if answer.is_file():
        return answer.read_text().split()
    work = answer.parent / f".{answer.name}.work"
    work.mkdir(parents=True, exist_ok=True)
    (work / "requirements.in").write_text("\n".join(runtime) + "\n")
    (work / "constraints.txt").write_text("\n".join(floors) + "\n")
    command = [_uv(), "pip", "compile", "--quiet", "--no-header", "--no-annotate", "--python", python,
               str(work / "requirements.in"), "-c", str(work / "constraints.txt"), "-o", str(work / "out.txt")]
    if resolution == "lowest-direct":
        command += ["--resolution", "lowest-direct"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"uv could not resolve {resolution}:\n{result.stderr[-6000:]}"
    pins = [line.strip() for line in (work / "out.txt").read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
    answer.write_text("\n".join(pins) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return pins


def _environment(python: str, pins: list[str]) -> Path:
    """The cached environment holding exactly ``pins`` (installed by uv once per set and Python)."""
    version = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    key = hashlib.sha256("\n".join([version, *pins]).encode()).hexdigest()[:16]
    env = _cache_root() / f"env-py{version}-{key}"
    if (env / "complete").is_file():
        _bytecode(env)
        return env
    shutil.rmtree(env, ignore_errors=True)
    env.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([_uv(), "venv", "--quiet", "--python", python, str(env)], check=True, timeout=300)
    (env / "requirements.txt").write_text("\n".join(pins) + "\n")
    result = subprocess.run([_uv(), "pip", "install", "--quiet", "--python", str(env / "bin" / "python"),
                             "--no-deps", "--compile-bytecode", "-r", str(env / "requirements.txt")],
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, f"install of {env.name} failed:\n{result.stderr[-6000:]}"
    (env / BYTECODE_MARK).write_text("uv --compile-bytecode\n")
    (env / "complete").write_text("\n".join(pins) + "\n")
    return env


BYTECODE_MARK = "bytecode"


def _bytecode(env: Path) -> None:
    """Compile a cached environment's modules once, as pip does at install and uv only when asked:
    where PYTHONDONTWRITEBYTECODE is set, every process would compile torch, transformers, Airflow
    and MLflow again (19 s against 6 s to import the four)."""
    if (env / BYTECODE_MARK).is_file():
        return
    subprocess.run([str(env / "bin" / "python"), "-m", "compileall", "-q", "-j", "0", str(_site(env))],
                   capture_output=True, timeout=1800)  # a file that does not compile stays source
    (env / BYTECODE_MARK).write_text("compileall\n")


def _site(venv: Path) -> Path:
    (site,) = (venv / "lib").glob("python3.*/site-packages")
    return site


def _venv_over(cached: Path, python: str, wheel: Path, root: Path, request) -> Venv:
    """A fresh venv seeing ``cached``'s packages (a ``.pth`` file; console scripts rewritten to its
    own interpreter) with the wheel installed by pip from no index: every requirement must be met."""
    venv = Venv(root)
    subprocess.run([python, "-m", "venv", str(venv.root / "venv")], check=True, timeout=300)
    (_site(venv.root / "venv") / "trainforge-floor-deps.pth").write_text(f"{_site(cached)}\n")
    own_python = str(venv.bin / "python")
    for script in (cached / "bin").iterdir():
        target = venv.bin / script.name
        if target.exists() or not script.is_file():
            continue
        head, _, rest = script.read_bytes().partition(b"\n")
        if head.startswith(b"#!") and b"python" in head:
            target.write_bytes(b"#!" + own_python.encode() + b"\n" + rest)
            target.chmod(0o755)
    venv.work.mkdir()
    # A machine's pip configuration (a global constraints file, extra indexes) plays no part:
    # no configuration file (PIP_CONFIG_FILE=os.devnull) and no PIP_* variable (--isolated).
    installed = venv.run("pip", "install", "--isolated", "--no-index", str(wheel), timeout_s=600,
                         PIP_CONFIG_FILE=os.devnull)
    assert "Installing collected packages: trainforge\n" in installed.stdout, installed.stdout
    venv.run("pip", "check", "--isolated", PIP_CONFIG_FILE=os.devnull)
    corpus = data_cache(request.config) / "shakespeare"
    venv.run("python", "-m", "trainforge.data.corpus", "fetch", "--dest", str(corpus), timeout_s=600)
    (venv.home / "corpus").mkdir(parents=True)
    (venv.home / "corpus" / "shakespeare").symlink_to(corpus, target_is_directory=True)
    return venv


@pytest.fixture(scope="module", params=RESOLUTIONS)
def resolved(tmp_path_factory: pytest.TempPathFactory, built_wheel: Path, request) -> Venv:
    """The wheel in a fresh venv over the cached environment of one resolution."""
    python = _floor_python()
    cached = _environment(python, _resolve(python, built_wheel, request.param))
    venv = _venv_over(cached, python, built_wheel, tmp_path_factory.mktemp(f"wheel-{request.param}"),
                      request)
    venv.resolution = request.param
    return venv


def test_the_versions_are_what_the_resolution_asked(resolved: Venv, built_wheel: Path):
    """Every direct requirement inside its range; at the floors, :data:`FLOORED` at the bound."""
    runtime = {canonicalize_name(r.name): r for r in _runtime(built_wheel)}
    out = resolved.run("python", "-c", "import json, importlib.metadata as m, sys; print(json.dumps("
                       "[sys.version_info[:2], {n: m.version(n) for n in sys.argv[1:]}]))", *runtime)
    version, versions = json.loads(out.stdout)
    assert version != [3, 11]
    print(resolved.resolution, versions)  # what each resolution gave, in the test's output
    for name, found in versions.items():
        assert runtime[canonicalize_name(name)].specifier.contains(found, prereleases=True), (name, found)
    if resolved.resolution == "floors":
        # Compared as versions: the range says torch>=2.6, the release is 2.6.0.
        assert {n: Version(Version(versions[n]).base_version) for n in FLOORED} == {
            n: Version(lower_bound(runtime[n])) for n in FLOORED}


def test_imports_every_module(resolved: Venv):
    out = resolved.run("python", "-c", """
import importlib, json, pkgutil, trainforge
failed = {}
for module in pkgutil.walk_packages(trainforge.__path__, "trainforge."):
    if module.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(module.name)
    except Exception as err:
        failed[module.name] = repr(err)
print(json.dumps(failed))""")
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


def test_validate_render_run_and_plugins(resolved: Venv):
    """At the floors, at uv's lowest-direct and at the highest versions the index serves."""
    check_tiny_pipeline(resolved)


def test_the_resolver_refuses_the_mlflow_floor_with_a_transformers_that_cannot_register(
        built_wheel: Path, tmp_path: Path):
    """MLflow's transformers flavour fails to save any model with transformers 5.23 and later (every
    MLflow up to 3.17.2): the wheel's ranges must make that pair unresolvable, not a late failure
    of register_model. The same request with the last release that saves resolves."""
    mlflow = next(r for r in _runtime(built_wheel) if canonicalize_name(r.name) == "mlflow")

    def resolve(transformers: str) -> subprocess.CompletedProcess:
        wanted = tmp_path / f"requirements-{transformers}.in"
        wanted.write_text("\n".join([str(built_wheel), f"mlflow=={lower_bound(mlflow)}",
                                     f"transformers=={transformers}"]) + "\n")
        return subprocess.run([_uv(), "pip", "compile", "--quiet", "--no-header", "--python",
                               _floor_python(), str(wanted)], capture_output=True, text=True, timeout=900)

    refused = resolve("5.23.0")
    assert refused.returncode != 0 and "unsatisfiable" in refused.stderr, refused.stdout + refused.stderr
    assert "transformers" in refused.stderr
    accepted = resolve("5.22.2")
    assert accepted.returncode == 0, accepted.stderr[-4000:]


def test_beside_airflow_332_with_pyyaml_603_installs_without_changing_anything(
        tmp_path: Path, built_wheel: Path):
    """A venv with apache-airflow 3.3.2 (placed from this environment, which holds it at the
    lock) and PyYAML 6.0.3 (which Airflow allows; from the index): pip's plan for the wheel adds
    distributions and changes none of those installed."""
    root = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=300)
    place_requirements([Requirement("apache-airflow==3.3.2")], root)
    pip = str(root / "bin" / "pip")
    subprocess.run([pip, "install", "--quiet", "PyYAML==6.0.3"], check=True, timeout=600)
    # Python 3.11's venv seeds setuptools 65 (3.12's seeds none), which torch's requirements
    # would upgrade: a seed of the test's venv, not part of the Airflow install.
    subprocess.run([pip, "uninstall", "--quiet", "--yes", "setuptools"], check=True, timeout=120)
    before = _freeze(pip)
    assert before["pyyaml"] == "6.0.3" and before["apache-airflow"] == "3.3.2"
    report = tmp_path / "report.json"
    result = subprocess.run([pip, "install", "--dry-run", "--quiet", "--report", str(report),
                             str(built_wheel)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    planned = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
               for item in json.loads(report.read_text())["install"]}
    assert "trainforge" in planned
    assert {n: v for n, v in planned.items() if n in before} == {}
    assert _freeze(pip) == before


def _freeze(pip: str) -> dict[str, str]:
    out = subprocess.run([pip, "list", "--format", "json"], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    return {canonicalize_name(d["name"]): d["version"] for d in json.loads(out)}
