"""PowerSGD's per-rank state is part of the checkpoint: a resumed run trains exactly as an uninterrupted one.

One uninterrupted 2-rank run (gloo, PowerSGD rank 2 from step 3, a checkpoint every step so that
every step's full-precision loss is in its meta.json), then resumes of a copy of its step-4
checkpoint: on 2 ranks (losses, weights and PowerSGD state identical to the uninterrupted run's),
and on 1 rank (another world size: started afresh, recorded in meta.json).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from trainforge.trainer import checkpoint as ckpt

pytestmark = pytest.mark.distributed

STEPS, RESUME_AT = 8, 4
FRAMEWORK = {"parallelism": "ddp", "gradient_compression": "powersgd", "powersgd_rank": 2,
             "activation_checkpointing": False}
# 0.5 M parameters (2 MB of fp32 gradients): several DDP buckets (the first holds 1 MiB), as
# real models have; on gloo PowerSGD then needs one bucket at a time (trainer/powersgd.py).
MODEL = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512}
SECTIONS = {"model": MODEL, "optim": {"max_steps": STEPS, "warmup_steps": 2},  # start_powerSGD_iter 2: compressed from step 3
            "checkpoint": {"interval_steps": 1, "keep_last": STEPS}, "logging": {"log_every_steps": 1},
            "distributed": {"backend": "gloo"}}


def _job(tools, root: Path, dataset_dir: Path, ck: Path) -> Path:
    job = tools.make_job(dataset_dir, ck, **SECTIONS)
    job["framework"] = FRAMEWORK
    return tools.write_job(root / "job.json", job)


def _meta(ck: Path, step: int) -> dict:
    return json.loads((ck / ckpt.step_dir_name(step) / "meta.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, dataset_dir, tools) -> Path:
    root = tmp_path_factory.mktemp("powersgd")
    proc = tools.run_trainer(_job(tools, root, dataset_dir, root / "ck"), root / "result.json", nproc=2,
                             timeout_s=240)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return root / "ck"


def _resume(tools, tmp_path: Path, dataset_dir: Path, uninterrupted: Path, nproc: int):
    """Resume a copy of the uninterrupted run's step-4 checkpoint (the only one in its folder)."""
    ck = tmp_path / "ck"
    shutil.copytree(uninterrupted / ckpt.step_dir_name(RESUME_AT), ck / ckpt.step_dir_name(RESUME_AT))
    proc = tools.run_trainer(_job(tools, tmp_path, dataset_dir, ck), tmp_path / "result.json", nproc=nproc,
                             timeout_s=240)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return ck, proc.stdout


def test_each_rank_has_its_powersgd_state_in_the_checkpoint(uninterrupted):
    step_dir = uninterrupted / ckpt.step_dir_name(RESUME_AT)
    assert ckpt.verify(step_dir) == []
    names = [ckpt.powersgd_file(0), ckpt.powersgd_file(1)]
    assert set(names) <= set(ckpt.read_manifest(step_dir)["files"])
    meta = _meta(uninterrupted, RESUME_AT)
    assert meta["powersgd"] == {"files": names, "iteration": RESUME_AT, "restarts": []}
    states = [torch.load(step_dir / name, weights_only=True)["state"] for name in names]
    for state in states:
        assert state["iter"] == RESUME_AT and state["matrix_approximation_rank"] == 2
        assert len(state["error_dict"]) >= 2 and state["q_memory_dict"].keys() == state["error_dict"].keys()
    # error feedback is each rank's own (their gradients differ), the warm-start factors are all-reduced
    assert not torch.equal(states[0]["error_dict"][0], states[1]["error_dict"][0])
    assert torch.equal(states[0]["q_memory_dict"][0], states[1]["q_memory_dict"][0])


def test_a_corrupted_powersgd_file_fails_verification(uninterrupted, tmp_path):
    step_dir = shutil.copytree(uninterrupted / ckpt.step_dir_name(RESUME_AT), tmp_path / ckpt.step_dir_name(RESUME_AT))
    data = bytearray((step_dir / ckpt.powersgd_file(1)).read_bytes())
    data[-100] ^= 0xFF
    (step_dir / ckpt.powersgd_file(1)).write_bytes(bytes(data))
    problems = ckpt.verify(step_dir)
    assert len(problems) == 1 and ckpt.powersgd_file(1) in problems[0] and "SHA-256" in problems[0]


def test_a_resumed_powersgd_run_trains_exactly_as_an_uninterrupted_one(uninterrupted, tmp_path, dataset_dir, tools):
    ck, log = _resume(tools, tmp_path, dataset_dir, uninterrupted, nproc=2)
    ours = [_meta(ck, s)["metrics"]["train_loss"] for s in range(RESUME_AT + 1, STEPS + 1)]
    theirs = [_meta(uninterrupted, s)["metrics"]["train_loss"] for s in range(RESUME_AT + 1, STEPS + 1)]
    assert ours == theirs  # exact: same state, same collectives in the same order
    assert f"PowerSGD state restored from {ck / ckpt.step_dir_name(RESUME_AT)} (iteration {RESUME_AT}" in log
    final = ckpt.step_dir_name(STEPS)
    w_ours = safetensors.torch.load_file(ck / final / "model.safetensors")
    w_theirs = safetensors.torch.load_file(uninterrupted / final / "model.safetensors")
    assert all(torch.equal(w_ours[n], w_theirs[n]) for n in w_theirs)
    for rank in (0, 1):
        s_ours = torch.load(ck / final / ckpt.powersgd_file(rank), weights_only=True)["state"]
        s_theirs = torch.load(uninterrupted / final / ckpt.powersgd_file(rank), weights_only=True)["state"]
        assert s_ours["iter"] == s_theirs["iter"] == STEPS
        for key in ("error_dict", "p_memory_dict", "q_memory_dict"):
            assert s_ours[key].keys() == s_theirs[key].keys()
            assert all(torch.equal(s_ours[key][i], s_theirs[key][i]) for i in s_theirs[key]), (rank, key)
    assert _meta(ck, STEPS)["powersgd"]["restarts"] == []


def test_a_resume_on_another_world_size_starts_powersgd_afresh_and_records_it(uninterrupted, tmp_path, dataset_dir,
                                                                              tools):
    ck, log = _resume(tools, tmp_path, dataset_dir, uninterrupted, nproc=1)
    assert "PowerSGD state not restored" in log and "trained on world size 2, this attempt runs 1 ranks" in log
    meta = _meta(ck, STEPS)
    assert meta["world_size"] == 1 and meta["powersgd"]["files"] == [ckpt.powersgd_file(0)]
    [restart] = meta["powersgd"]["restarts"]
    assert restart["step"] == RESUME_AT and "world size 2" in restart["reason"]
    # afresh: this attempt counted its own iterations (vanilla all-reduce for its first 2 steps)
    assert meta["powersgd"]["iteration"] == STEPS - RESUME_AT
