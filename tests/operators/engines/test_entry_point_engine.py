"""An engine trainforge has never heard of, added the way a third party adds one: a distribution
whose ``trainforge.engines`` entry point names its :class:`~trainforge.engines.descriptors.Engine`.

The engine (``entry_point/toy_engine``) is mentioned by no trainforge source file; the
distribution's metadata is written here into a temporary folder. Each check runs in a fresh
interpreter with that folder and the engine's package on ``PYTHONPATH``, as an installed plugin
would be: ``trainforge validate`` and ``trainforge render`` accept ``engine: toy`` with its own
``training.toy`` block, and its backend is driven through the registry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
DEMO = ROOT / "dags" / "pipelines" / "shakespeare_llm.yaml"


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A folder holding the toy distribution's metadata, as pip would install it."""
    info = tmp_path / "site" / "trainforge_toy-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: trainforge-toy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[trainforge.engines]\ntoy = toy_engine:ENGINE\n")
    return info.parent


def _python(args: list[str], site: Path | None, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRAINFORGE_HOME": str(cwd / "home")}
    paths = [str(site), str(HERE / "entry_point")] if site else [str(HERE / "entry_point")]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def _spec(tmp_path: Path, block: dict) -> Path:
    raw = yaml.safe_load(DEMO.read_text())
    raw["training"]["engine"] = "toy"
    raw["training"]["toy"] = block
    raw["training"]["resources"]["nodes"] = 2
    path = tmp_path / "toy_pipeline.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_validate_and_render_a_spec_for_an_entry_point_engine(site, tmp_path):
    spec = _spec(tmp_path, {"queue": "gold"})
    checked = _python(["-m", "trainforge.cli", "validate", str(spec)], site, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    rendered = _python(["-m", "trainforge.cli", "render", str(spec)], site, tmp_path)
    assert rendered.returncode == 0, rendered.stdout + rendered.stderr
    request = json.loads(rendered.stdout)["train_request"]
    assert request["engine"] == "toy" and request["queue"] == "gold"
    # the launch line every engine shares, sized by the spec (2 nodes x 2 ranks)
    assert request["argv"][:4] == ["torchrun", "--standalone", "--nnodes=2",
                                   "--nproc-per-node=2"]
    assert request["argv"][-4:-2] == ["-m", "trainforge.trainer.train"]
    assert request["env"]["PYTHONUNBUFFERED"] == "1"


@pytest.mark.parametrize("block,fragment", [
    ({"queue": ""}, "training.toy.queue"),
    ({"queues": "gold"}, "training.toy.queues"),
])
def test_the_entry_point_engines_block_is_validated_like_a_built_in_one(site, tmp_path, block,
                                                                         fragment):
    checked = _python(["-m", "trainforge.cli", "validate", str(_spec(tmp_path, block))], site,
                      tmp_path)
    assert checked.returncode == 1
    assert fragment in checked.stdout + checked.stderr


def test_without_the_distribution_the_engine_is_unknown(tmp_path):
    checked = _python(["-m", "trainforge.cli", "validate", str(_spec(tmp_path, {}))], None,
                      tmp_path)
    assert checked.returncode == 1
    out = checked.stdout + checked.stderr
    assert "training.engine" in out and "'slurm'" in out and "toy" in out


DRIVE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from trainforge.contract import FailureKind
    from trainforge.engines.base import JobIdentity, JobState, TrainingJob
    from trainforge.engines.descriptors import backend_kwargs, engine_names, get_backend, get_engine
    from trainforge.pipeline import load_spec

    spec = load_spec(Path(sys.argv[1]))
    runs = sys.argv[2]
    engine = get_engine("toy")
    backend = get_backend("toy", **backend_kwargs(spec.training, runs))
    job = TrainingJob(identity=JobIdentity("toy", "manual__1", "train", 1), config={"a": 1},
                      nodes=2, processes_per_node=2, engine_options={"queue": "gold"})
    handle = backend.submit(job)
    first = backend.status(handle)
    assert backend.submit(job) == handle == backend.find(job.identity)
    folder = Path(runs) / handle["key"]
    (folder / "exit.json").write_text(json.dumps({"exit_code": 78}))
    ended = backend.status(handle)
    print(json.dumps({"names": engine_names(), "multi_node": engine.multi_node,
                      "first": first.state.value, "ended": ended.state.value,
                      "failure": ended.failure.value,
                      "request": json.loads((folder / "request.json").read_text())}))
""")


def test_its_backend_is_driven_through_the_registry(site, tmp_path):
    spec = _spec(tmp_path, {"queue": "gold"})
    runs = tmp_path / "spool"
    driven = _python(["-c", DRIVE, str(spec), str(runs)], site, tmp_path)
    assert driven.returncode == 0, driven.stdout + driven.stderr
    out = json.loads(driven.stdout)
    assert out["names"] == ["local", "kubernetes", "ray", "slurm", "toy"]
    assert out["multi_node"] is True
    assert (out["first"], out["ended"], out["failure"]) == ("pending", "failed", "permanent")
    assert out["request"]["queue"] == "gold"
