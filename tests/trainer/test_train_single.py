"""``python -m trainforge.trainer.train`` as one process (no torchrun): exit paths and resume rules."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time

import safetensors.torch
import torch

from trainforge.trainer import checkpoint as ckpt


def _job(tools, tmp_path, dataset_dir, checkpoint_dir=None, **sections):
    job = tools.make_job(dataset_dir, checkpoint_dir or tmp_path / "ck", **sections)
    return tools.write_job(tmp_path / "job.json", job)


def test_bad_config_exits_78_with_result_file(tmp_path, dataset_dir, tools):
    job = _job(tools, tmp_path, dataset_dir, optim={"micro_batch_size": 3})  # 8 % 3 != 0
    result_file = tmp_path / "result.json"
    result_file.write_text('{"status": "success"}')  # a stale result from an earlier attempt
    proc = tools.run_trainer(job, result_file)
    assert proc.returncode == 78, proc.stdout[-3000:]
    result = json.loads(result_file.read_text())
    assert result["status"] == "bad_config" and result["exit_code"] == 78
    assert "optim.global_batch_size=8 must be a multiple of optim.micro_batch_size=3" in result["message"]
    assert result["final_step"] == 0 and result["last_checkpoint"] is None


def test_bf16_autocast_run(tmp_path, dataset_dir, tools):
    job = _job(tools, tmp_path, dataset_dir, precision="bf16", optim={"max_steps": 4, "warmup_steps": 1},
               checkpoint={"interval_steps": 2})
    proc = tools.run_trainer(job, tmp_path / "result.json")
    assert proc.returncode == 0, proc.stdout[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "success" and result["final_step"] == 4 and result["final_train_loss"] > 0
    weights = safetensors.torch.load_file(tmp_path / "ck" / "step-00000004" / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in weights.values())  # autocast: fp32 master weights


def test_rerun_of_a_finished_run_changes_nothing(trained_run, tmp_path, tools):
    ck = trained_run["checkpoints"]
    before = {p: p.stat().st_mtime_ns for p in ck.rglob("*")}
    proc = tools.run_trainer(trained_run["job"], tmp_path / "result.json")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"resuming from {ck / 'step-00000020'}" in proc.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["final_step"] == 20 and result["last_checkpoint"] == str(ck / "step-00000020")
    assert result["final_train_loss"] == trained_run["result"]["final_train_loss"]
    assert {p: p.stat().st_mtime_ns for p in ck.rglob("*")} == before


def test_resume_refuses_a_checkpoint_of_another_model(trained_run, tmp_path, dataset_dir, tools):
    ck = shutil.copytree(trained_run["checkpoints"], tmp_path / "ck")
    job = _job(tools, tmp_path, dataset_dir, checkpoint_dir=ck, model={"hidden_size": 64})
    proc = tools.run_trainer(job, tmp_path / "result.json")
    assert proc.returncode == 78, proc.stdout[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "bad_config" and "use a new checkpoint.dir" in result["message"]


def test_sigterm_writes_an_error_result(tmp_path, dataset_dir, tools):
    job = _job(tools, tmp_path, dataset_dir, optim={"max_steps": 5000}, checkpoint={"interval_steps": 5})
    result_file = tmp_path / "result.json"
    proc = subprocess.Popen(tools.command(job), cwd=tools.repo_root, env=tools.env(result_file),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ck" / "step-00000005" / "manifest.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out[-3000:]
    result = json.loads(result_file.read_text())
    assert result["status"] == "error" and result["exit_code"] == 143 and "SIGTERM" in result["message"]
    assert result["final_step"] >= 5 and result["last_checkpoint"] is not None
    assert ckpt.verify(result["last_checkpoint"]) == []
