"""The slurm engine without a cluster: the sbatch script (golden, byte for byte), the spec's
``training.slurm`` block and its errors, ``trainforge render --engine slurm`` (golden), and the
error when Slurm's commands are missing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainforge.engines.descriptors import backend_kwargs, get_backend
from trainforge.engines.base import JobIdentity, TrainingJob
from trainforge.engines.slurm.backend import SlurmBackend
from trainforge.engines.slurm.script import time_limit
from trainforge.cli.main import app
from trainforge.errors import BackendError
from trainforge.pipeline import SpecError, parse_spec_text
from trainforge.engines.slurm.spec import SlurmEngine
from tests.operators.pipeline.test_loader import MINIMAL

HERE = Path(__file__).resolve().parent
GOLDEN_SCRIPT = HERE / "golden" / "slurm_render.sbatch"
GOLDEN_REQUEST = HERE / "golden" / "slurm_render.json"
ROOT = HERE.parents[3]
CLI_GOLDEN = ROOT / "tests" / "operators" / "cli" / "golden"
PIPELINES = sorted((ROOT / "dags" / "pipelines").glob("*.yaml"))
UPDATE = bool(os.environ.get("TRAINFORGE_UPDATE_GOLDEN"))


def _job(**overrides) -> TrainingJob:
    block = SlurmEngine(partition="gpu", account="llm-team", qos="high", constraint="h100&ib",
                        gpu_type="h100", python="/shared/venvs/trainforge/bin/python",
                        setup=["module load cuda/12.4", "source /shared/env.sh"],
                        env_vars={"HF_HOME": "/shared/cache/hf"})
    values = dict(
        identity=JobIdentity("shakespeare_llm", "manual__2026-01-01T00:00:00+00:00", "train", 1),
        config={"format": "trainforge.job/v1", "checkpoint": {"dir": "/shared/ckpt"}},
        nodes=2,
        processes_per_node=4,
        gpus_per_node=4,
        threads_per_process=8,
        memory_gib=240,
        env={"MLFLOW_TRACKING_URI": "http://mlflow:5000", "MLFLOW_RUN_ID": "r1"},
        max_restarts=1,
        engine_options=block.model_dump(mode="json"),
        max_runtime_s=6 * 3600.0,
        startup_timeout_s=600.0,
    )
    values.update(overrides)
    return TrainingJob(**values)


def test_render_is_pure_and_matches_golden_byte_for_byte():
    backend = SlurmBackend("/shared/trainforge/runs")
    rendered = backend.render(_job())
    assert rendered == backend.render(_job())
    assert not Path("/shared/trainforge").exists()
    request = {k: v for k, v in rendered.items() if k != "script"}
    if UPDATE:
        GOLDEN_SCRIPT.write_text(rendered["script"])
        GOLDEN_REQUEST.write_text(json.dumps(request, indent=2, sort_keys=True) + "\n")
    assert rendered["script"] == GOLDEN_SCRIPT.read_text()
    assert request == json.loads(GOLDEN_REQUEST.read_text())
    job_dir = "/shared/trainforge/runs/" + _job().identity.key
    assert rendered["argv"] == ["sbatch", "--parsable", f"{job_dir}/job.sbatch"]
    script = rendered["script"]
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --cpus-per-task=32",  # 4 ranks x 8 threads
                 "#SBATCH --gpus-per-node=h100:4", "#SBATCH --mem=245760M",
                 "#SBATCH --time=0-06:00:00", f"#SBATCH --output={job_dir}/job.log",
                 f"#SBATCH --job-name={_job().identity.key}", "#SBATCH --no-requeue",
                 "#SBATCH --partition=gpu", "#SBATCH --constraint=h100&ib",
                 "export HF_HOME=/shared/cache/hf", "module load cuda/12.4",
                 f"--config {job_dir}/job.json"):
        assert line in script.splitlines() or f"    {line}" in script.splitlines(), line


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash: sudo apt-get install -y bash")
def test_rendered_script_is_valid_bash():
    proc = subprocess.run(["bash", "-n"], input=SlurmBackend("/r").render(_job())["script"],
                          text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr


def test_optional_directives_appear_only_when_set():
    script = SlurmBackend("/r").render(_job(gpus_per_node=0, processes_per_node=2, memory_gib=None,
                                            engine_options={}))["script"]
    assert "--gpus-per-node" not in script and "--mem=" not in script
    assert "--partition" not in script and "--exclusive" not in script
    assert "python3 -m torch.distributed.run" in script
    assert "rdzv_port=$(( 29500 + SLURM_JOB_ID % 10000 ))" in script
    fixed = SlurmBackend("/r").render(_job(engine_options={"rendezvous_port": 41000,
                                                           "exclusive": True}))["script"]
    assert "rdzv_port=41000" in fixed and "#SBATCH --exclusive" in fixed


def test_comment_carries_the_identity_without_breaking_the_directive():
    job = _job(identity=JobIdentity("d", 'manual "quoted" run', "train", 3))
    line = next(x for x in SlurmBackend("/r").render(job)["script"].splitlines()
                if x.startswith("#SBATCH --comment="))
    assert line.count('"') == 2 and "run_id=manual__quoted__run" in line and "try=3" in line


@pytest.mark.parametrize("seconds,expected", [
    (1, "0-00:01:00"), (60, "0-00:01:00"), (61, "0-00:02:00"), (6 * 3600, "0-06:00:00"),
    (3 * 86400 + 90, "3-00:02:00"),
])
def test_time_limit_rounds_up_to_whole_minutes(seconds, expected):
    assert time_limit(seconds) == expected


def _slurm_spec(block: str, **replace: str) -> str:
    text = MINIMAL.replace("training:\n", f"training:\n  engine: slurm\n{block}", 1)
    for old, new in replace.items():
        text = text.replace(old, new)
    return text


def test_spec_with_a_slurm_block_runs_on_several_nodes():
    text = _slurm_spec("  resources: {nodes: 2, processes_per_node: 1}\n"
                       "  slurm:\n    partition: gpu\n    setup: [module load cuda]\n",
                       **{"global_batch_size: 4": "global_batch_size: 8"})
    spec = parse_spec_text(text, "s.yaml")
    assert spec.training.engine == "slurm" and spec.training.resources.nodes == 2
    assert spec.training.engine_block.partition == "gpu"
    kwargs = backend_kwargs(spec.training, runs_root="/srv/runs")
    assert kwargs == {"runs_root": "/srv/runs", "bin_dir": None}
    assert isinstance(get_backend("slurm", **kwargs), SlurmBackend)


@pytest.mark.parametrize("block,path,fragment", [
    ("  slurm:\n    partition: 'gpu; rm -rf /'\n", "training.slurm.partition",
     "partition must be a Slurm name"),
    ("  slurm:\n    constraint: 'a100 && ib'\n", "training.slurm.constraint",
     "constraint must be a Slurm feature expression"),
    ("  slurm:\n    setup: [\"module load cuda\\nrm x\"]\n", "training.slurm.setup",
     "must be one line"),
    ("  slurm:\n    env_vars: {MLFLOW_RUN_ID: x}\n", "training.slurm.env_vars",
     "env_vars may not set MLFLOW_RUN_ID"),
    ("  slurm:\n    rendezvous_port: 80\n", "training.slurm.rendezvous_port",
     "greater than or equal to 1024"),
    ("  slurm:\n    sbatch_args: [--mem=1]\n", "training.slurm.sbatch_args", ""),
])
def test_bad_slurm_blocks_name_the_field(block, path, fragment):
    with pytest.raises(SpecError) as info:
        parse_spec_text(_slurm_spec(block), "bad.yaml")
    issues = [i for i in info.value.issues if i.path == path]
    assert issues, [str(i) for i in info.value.issues]
    assert fragment in issues[0].message


def test_a_slurm_block_with_another_engine_is_an_error():
    text = MINIMAL.replace("training:\n", "training:\n  slurm:\n    partition: gpu\n", 1)
    with pytest.raises(SpecError, match="configures engine 'slurm', but engine is 'local'"):
        parse_spec_text(text, "bad.yaml")


def test_missing_slurm_commands_are_one_clear_error(tmp_path):
    backend = SlurmBackend(tmp_path / "runs", bin_dir=str(tmp_path / "no-slurm"))
    job = _job(identity=JobIdentity("d", "r", "train", 1))
    with pytest.raises(BackendError, match=r"'sbatch' was not found in .*no-slurm.*slurm-wlm"):
        backend.submit(job)
    assert not (tmp_path / "runs").exists()  # nothing half-written


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.stem)
def test_cli_render_for_slurm_matches_golden(path, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_HOME", "/trainforge-home")
    result = CliRunner().invoke(app, ["render", str(path), "--engine", "slurm"])
    assert result.exit_code == 0, result.output
    rendered = json.loads(result.stdout.replace(sys.executable, "{python}"))
    golden = CLI_GOLDEN / f"{path.stem}.slurm.json"
    if UPDATE:
        golden.write_text(json.dumps(rendered, indent=2, sort_keys=True) + "\n")
    assert rendered == json.loads(golden.read_text())
    request = rendered["train_request"]
    assert request["job_dir"].startswith("/trainforge-home/runs/")
    assert f"--config {request['job_dir']}/job.json" in request["script"]
