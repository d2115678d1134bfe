"""torchrun with 2 CPU processes (gloo) for the job config's ``framework`` keys.

- DDP with each gradient compression hook (fp16, bf16, PowerSGD), one short run each, combined
  with the precisions, activation checkpointing and the learning-rate schedules so that every
  value runs at least once under DDP.
- FSDP2 (fp16 autocast with the sharded gradient scaler, activation checkpointing): the
  checkpoint has the same layout as a DDP one, and a SIGKILLed run resumes to bit-identical
  weights, optimizer state, loss scale and final loss.

Launching torchrun dominates the time (each run imports torch and transformers in three
processes), so every run is a few steps and variants share runs.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import safetensors.torch
import torch

from trainforge.trainer import checkpoint as ckpt
from trainforge.trainer.config import load_job_config
from trainforge.trainer.model import build_model, llama_config, load_weights, weights_state_dict
from trainforge.trainer.schedule import lr_at
from trainforge.trainer.optim import make_optimizer

pytestmark = pytest.mark.distributed

FRAMEWORK = {"parallelism": "ddp", "gradient_compression": "none", "powersgd_rank": 1,
             "activation_checkpointing": False}


def _job(tools, tmp_path: Path, dataset_dir: Path, name: str, framework: dict, **sections) -> Path:
    job = tools.make_job(dataset_dir, tmp_path / name, **sections)
    job["framework"] = FRAMEWORK | framework  # conftest's make_job only updates sections BASE_JOB has
    return tools.write_job(tmp_path / f"{name}.json", job)


def _losses(log: str) -> list[float]:
    return [float(line.split("| loss ")[1].split()[0]) for line in log.splitlines() if " | loss " in line]


def _fresh_model_and_optimizer(job_path: Path, dataset_dir: Path):
    cfg = load_job_config(job_path)
    vocab = json.loads((dataset_dir / "manifest.json").read_text())
    model = build_model(llama_config(cfg.model, vocab["vocab_size"], vocab["eos_id"], cfg.data.sequence_length))
    return model, make_optimizer(model, cfg.optim)


COMPRESSION_ROWS = [
    # (gradient_compression, precision, activation_checkpointing, lr_schedule)
    ("fp16", "fp16", False, "linear"),
    ("bf16", "bf16", True, "constant"),  # gloo: trainforge's bf16 hook; NCCL: torch's
    ("powersgd", "fp32", False, "cosine"),  # rank 2; PowerSGD from step 3 (after 2 warm-up steps)
]


@pytest.mark.parametrize(("compression", "precision", "checkpointing", "schedule"), COMPRESSION_ROWS,
                         ids=[r[0] for r in COMPRESSION_ROWS])
def test_ddp_gradient_compression_runs(tmp_path, dataset_dir, tools, compression, precision, checkpointing,
                                       schedule):
    job = _job(tools, tmp_path, dataset_dir, "ck",
               {"gradient_compression": compression, "powersgd_rank": 2, "activation_checkpointing": checkpointing},
               precision=precision, optim={"max_steps": 8, "warmup_steps": 2, "lr_schedule": schedule},
               checkpoint={"interval_steps": 4}, logging={"log_every_steps": 2})
    proc = tools.run_trainer(job, tmp_path / "result.json", nproc=2, timeout_s=240)
    assert proc.returncode == 0, proc.stdout[-5000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "success" and result["final_step"] == 8
    assert f"DDP gradient compression: {compression}" in proc.stdout
    assert f"ddp, {precision}, {schedule} schedule" in proc.stdout
    losses = _losses(proc.stdout)
    assert len(losses) == 4 and losses[-1] < losses[0]

    final = tmp_path / "ck" / "step-00000008"
    assert ckpt.verify(final) == []
    meta = json.loads((final / "meta.json").read_text())
    assert meta["metrics"]["learning_rate"] == lr_at(7, load_job_config(job).optim)  # the schedule asked for
    model, _ = _fresh_model_and_optimizer(job, dataset_dir)
    weights = safetensors.torch.load_file(final / "model.safetensors")
    load_weights(model, weights)
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in weights.values())
    state = torch.load(final / "trainer_state.pt", weights_only=True)
    assert ("grad_scaler" in state) == (precision == "fp16")


# --- FSDP ---------------------------------------------------------------------------------------

FSDP_STEPS = 12
FSDP_SECTIONS = {"precision": "fp16", "optim": {"max_steps": FSDP_STEPS, "warmup_steps": 2},
                 "checkpoint": {"interval_steps": 4, "keep_last": 3}, "logging": {"log_every_steps": 4}}
FSDP = {"parallelism": "fsdp", "activation_checkpointing": True}


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory, dataset_dir, tools) -> dict:
    """Uninterrupted FSDP run (fp16, activation checkpointing) to FSDP_STEPS."""
    tmp = tmp_path_factory.mktemp("fsdp")
    job = _job(tools, tmp, dataset_dir, "ck", FSDP, **FSDP_SECTIONS)
    proc = tools.run_trainer(job, tmp / "result.json", nproc=2, timeout_s=240)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return {"dir": tmp / "ck", "job": job, "log": proc.stdout,
            "result": json.loads((tmp / "result.json").read_text())}


def test_fsdp_checkpoint_has_the_ddp_layout(fsdp_reference, dataset_dir):
    assert "FSDP2: 2 decoder layers and the root sharded over 2 ranks" in fsdp_reference["log"]
    assert "fsdp, fp16, cosine schedule" in fsdp_reference["log"]
    assert fsdp_reference["result"]["status"] == "success"
    assert [s for s, _ in ckpt.list_step_dirs(fsdp_reference["dir"])] == [4, 8, 12]
    final = fsdp_reference["dir"] / ckpt.step_dir_name(FSDP_STEPS)
    assert ckpt.verify(final) == []
    # Full, unsharded weights under the unwrapped names, the tied head stored once:
    model, optimizer = _fresh_model_and_optimizer(fsdp_reference["job"], dataset_dir)
    weights = safetensors.torch.load_file(final / "model.safetensors")
    assert weights.keys() == weights_state_dict(model).keys() and "lm_head.weight" not in weights
    assert all(weights[n].shape == t.shape for n, t in model.state_dict().items() if n in weights)
    load_weights(model, weights)
    # ...and AdamW state numbered like a plain optimizer's state_dict, which loads as it is:
    saved = torch.load(final / "optimizer.pt", weights_only=True)
    assert sorted(saved["state"]) == list(range(len(list(model.parameters()))))
    optimizer.load_state_dict(saved)
    assert optimizer.state_dict()["param_groups"] == saved["param_groups"]
    state = torch.load(final / "trainer_state.pt", weights_only=True)
    assert state["world_size"] == 2 and state["grad_scaler"]["scale"] > 0


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every worker (workers run in their own sessions, so killpg is not enough)."""
    workers = psutil.Process(proc.pid).children(recursive=True)
    for p in [psutil.Process(proc.pid), *workers]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)
    psutil.wait_procs(workers, timeout=30)


def test_fsdp_killed_run_resumes_to_identical_result(fsdp_reference, tmp_path, dataset_dir, tools):
    job = _job(tools, tmp_path, dataset_dir, "ck", FSDP, **FSDP_SECTIONS)
    ck_dir, result_file = tmp_path / "ck", tmp_path / "result.json"
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(tools.command(job, nproc=2), cwd=tools.repo_root, env=tools.env(result_file),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 180
            while not (ck_dir / "step-00000004" / "manifest.json").exists():
                assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-4000:]
                assert time.monotonic() < deadline, "no first checkpoint after 180 s"
                time.sleep(0.005)
            _kill_tree(proc)
        finally:
            if proc.poll() is None:
                _kill_tree(proc)
    newest = ckpt.newest_valid(ck_dir)
    assert newest is not None and ckpt.list_step_dirs(ck_dir)[-1][0] < FSDP_STEPS, "killed too late to test resume"

    resumed = tools.run_trainer(job, result_file, nproc=2, timeout_s=240)
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    assert f"resuming from {newest}" in resumed.stdout
    result, reference = json.loads(result_file.read_text()), fsdp_reference["result"]
    assert result["final_step"] == reference["final_step"] == FSDP_STEPS
    assert result["final_train_loss"] == reference["final_train_loss"]  # exact
    ours, theirs = ck_dir / ckpt.step_dir_name(FSDP_STEPS), fsdp_reference["dir"] / ckpt.step_dir_name(FSDP_STEPS)
    w_ours = safetensors.torch.load_file(ours / "model.safetensors")
    w_theirs = safetensors.torch.load_file(theirs / "model.safetensors")
    assert w_ours.keys() == w_theirs.keys()
    for name in w_ours:
        assert torch.equal(w_ours[name], w_theirs[name]), name  # bitwise, not just close
    o_ours = torch.load(ours / "optimizer.pt", weights_only=True)
    o_theirs = torch.load(theirs / "optimizer.pt", weights_only=True)
    assert o_ours["state"].keys() == o_theirs["state"].keys()
    for i, state in o_ours["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], o_theirs["state"][i][key]), (i, key)
    scaler_ours = torch.load(ours / "trainer_state.pt", weights_only=True)["grad_scaler"]
    assert scaler_ours == torch.load(theirs / "trainer_state.pt", weights_only=True)["grad_scaler"]
