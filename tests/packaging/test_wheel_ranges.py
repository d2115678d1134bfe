"""The wheel's dependency ranges, tested at both ends and beside an Airflow already installed.

- Its METADATA holds ranges, no exact pins.
- **Floor** (:func:`floor`): on Python 3.12 (not the lock's 3.11), a fresh venv holding the wheel
  with the lowest release of every range that matters pinned exactly: apache-airflow, mlflow,
  transformers and torch (the lower bounds read from the wheel itself, so a raised floor is
  tested at once). There ``validate``, ``render``, a tiny ``run`` (tests/packaging/wheel_tiny.yaml,
  :func:`~tests.packaging.test_wheel.check_tiny_pipeline`:
  one rank, 20 steps, every stage) and ``airflow plugins`` must work, and every module imports.
  The other requirements resolve to what pip picks inside their ranges, except two held back
  (:data:`HELD`): Airflow's releases expect their constraints file (their own requirements are
  open-ended; raw.githubusercontent.com is not reachable from CI), and with the newest FastAPI
  (0.163) Airflow 3.2.0's execution API fails every task (pydantic: "TITerminalStatePayload
  needs a discriminator field"); fastapi 0.136.3 is the lock's. structlog 25.4.0: Airflow 3.1's
  logging does not import with structlog 26 (kept from that check, not shown needed for 3.2).
- **Lock**: tests/packaging/test_wheel.py, Python 3.11, ``-c requirements.lock``, with the same
  tiny run (``test_tiny_run``).
- **Beside Airflow 3.3.2 with PyYAML 6.0.3**: ``pip install --dry-run --report`` of the wheel
  would change no installed distribution (it only adds).

What the floor venv costs, and what is cached: PyPI's Linux torch wheels for Python 3.12 are CUDA
builds (torch 2.6.0: 767 MB; installed with its nvidia-* packages 4.3 GB, 4.9 GB with triton); this
machine's pip keeps no HTTP cache and PyTorch's CPU index (download.pytorch.org) is not reachable
from CI. So the floor's dependencies are installed with pip from PyPI once per floor set into
``$TRAINFORGE_TEST_CACHE/floor-<python>-<hash>`` (default ``~/.cache/trainforge-tests``; 6.3
minutes the first time on 2 shared cores, then the whole module takes about 4.3 minutes), and each run makes a fresh venv that sees them through a ``.pth`` file
(console scripts rewritten to its own interpreter), then installs the wheel into it with
``pip install --no-index``: pip must find every requirement met at the floor. The torch there is
the CUDA build running on CPU; the CPU build at the floor is not tested.
"""

from __future__ import annotations

import hashlib
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

FLOOR_PYTHONS = ("python3.12", "/root/.pyenv/versions/3.12.1/bin/python3.12")
#: The ranges whose lower bound the floor venv pins (the features that set them: pyproject.toml).
FLOORED = ("apache-airflow", "mlflow", "transformers", "torch")
#: Held below what pip would pick, with the reason in the module docstring.
HELD = ("fastapi==0.136.3", "structlog==25.4.0")


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
    for candidate in FLOOR_PYTHONS:
        found = shutil.which(candidate)
        if found and subprocess.run([found, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"],
                                    capture_output=True, timeout=60).returncode == 0:
            return found
    pytest.skip(f"no Python 3.12 for the floor venv: install one, e.g. pyenv install 3.12 "
                f"(looked for {', '.join(FLOOR_PYTHONS)})")


def _cache_root() -> Path:
    import os
    return Path(os.environ.get("TRAINFORGE_TEST_CACHE", Path.home() / ".cache" / "trainforge-tests"))


def _floor_environment(python: str, wheel: Path) -> Path:
    """The cached environment holding the wheel's runtime requirements at the floor (built once
    per floor set and Python, by pip from the package index)."""
    runtime = _runtime(wheel)
    pins = [f"{r.name}=={lower_bound(r)}" for r in runtime if canonicalize_name(r.name) in FLOORED]
    assert len(pins) == len(FLOORED), pins
    lines = sorted(str(r) for r in runtime) + sorted(pins) + list(HELD)
    version = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    key = hashlib.sha256("\n".join([version, *lines]).encode()).hexdigest()[:16]
    env = _cache_root() / f"floor-py{version}-{key}"
    if (env / "complete").is_file():
        return env
    shutil.rmtree(env, ignore_errors=True)
    env.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([python, "-m", "venv", str(env)], check=True, timeout=300)
    (env / "requirements.txt").write_text("\n".join(str(r) for r in runtime) + "\n")
    (env / "floors.txt").write_text("\n".join(pins + list(HELD)) + "\n")
    result = subprocess.run(
        [str(env / "bin" / "pip"), "install", "--progress-bar", "off", "-r",
         str(env / "requirements.txt"), "-c", str(env / "floors.txt")],
        capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, f"floor install failed:\n{result.stdout[-4000:]}{result.stderr[-4000:]}"
    (env / "complete").write_text("\n".join(pins) + "\n")
    return env


def _site(venv: Path) -> Path:
    (site,) = (venv / "lib").glob("python3.*/site-packages")
    return site


@pytest.fixture(scope="module")
def floor(tmp_path_factory: pytest.TempPathFactory, built_wheel: Path, request) -> Venv:
    python = _floor_python()
    cached = _floor_environment(python, built_wheel)
    venv = Venv(tmp_path_factory.mktemp("wheel-floor"))
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
    installed = venv.run("pip", "install", "--no-index", str(built_wheel), timeout_s=600)
    assert "Installing collected packages: trainforge\n" in installed.stdout, installed.stdout
    venv.run("pip", "check")
    corpus = data_cache(request.config) / "shakespeare"
    venv.run("python", "-m", "trainforge.data.corpus", "fetch", "--dest", str(corpus), timeout_s=600)
    (venv.home / "corpus").mkdir(parents=True)
    (venv.home / "corpus" / "shakespeare").symlink_to(corpus, target_is_directory=True)
    return venv


def test_floor_versions_are_the_lower_bounds(floor: Venv, built_wheel: Path):
    out = floor.run("python", "-c", "import json, importlib.metadata as m, sys; print(json.dumps("
                    "[sys.version_info[:2], {n: m.version(n) for n in sys.argv[1:]}]))", *FLOORED)
    version, versions = json.loads(out.stdout)
    assert version != [3, 11]
    bounds = {canonicalize_name(r.name): lower_bound(r) for r in _runtime(built_wheel)}
    # Compared as versions: the range says torch>=2.6, the release is 2.6.0.
    assert {canonicalize_name(n): Version(Version(v).base_version) for n, v in versions.items()} == {
        n: Version(bounds[n]) for n in FLOORED}


def test_floor_imports_every_module(floor: Venv):
    out = floor.run("python", "-c", """
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


def test_floor_validate_render_run_and_plugins(floor: Venv):
    check_tiny_pipeline(floor)


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
