"""SIGKILL while a checkpoint is being written: the partial folder never counts.

The trainer saves every step; the test kills it the moment a ``step-N`` folder exists without its
manifest (files being written). Resume must pick the previous valid checkpoint, never the
partial one, rewrite the partial folder, and finish at the planned step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from faultlib import wait_for
from tests.trainer.conftest import REPO_ROOT, make_job, trainer_command, trainer_env, write_job
from trainforge.trainer import checkpoint as ckpt

pytestmark = [pytest.mark.integration]

MAX_STEPS = 40


def _partial(root) -> str | None:
    """A step folder being written, once an earlier checkpoint is complete."""
    dirs = ckpt.list_step_dirs(root)
    if len(dirs) >= 2 and not (dirs[-1][1] / ckpt.MANIFEST).exists() and \
            (dirs[-2][1] / ckpt.MANIFEST).exists():
        return str(dirs[-1][1])
    return None


def test_kill_mid_save_leaves_the_previous_checkpoint_as_newest(tmp_path, tiny_dataset):
    root = tmp_path / "ck"
    job = write_job(tmp_path / "job.json", make_job(
        tiny_dataset, root, optim={"max_steps": MAX_STEPS, "warmup_steps": 2},
        checkpoint={"interval_steps": 1, "keep_last": 3}, logging={"log_every_steps": 10},
    ))
    env = trainer_env(tmp_path / "result.json")
    partial = None
    for _attempt in range(3):  # the save window is short: try again if a save slipped by
        with open(tmp_path / "run.log", "w") as log:
            proc = subprocess.Popen(trainer_command(job), cwd=REPO_ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            partial = wait_for("a checkpoint being written", lambda: proc.poll() is not None
                               or _partial(root), 180, 0.0005)
            os.killpg(proc.pid, signal.SIGKILL)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        partial = _partial(root) if proc.returncode == -signal.SIGKILL else None
        if partial:
            break
    assert partial, "never caught a save in progress"
    assert ckpt.verify(partial)  # damaged / incomplete
    newest = ckpt.newest_valid(root)
    assert newest is not None and str(newest) != partial
    assert int(newest.name.split("-")[1]) < int(partial.rsplit("-", 1)[1])

    resumed = subprocess.run(trainer_command(job), cwd=REPO_ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"resuming from {newest} " in resumed.stdout  # the previous one, not the partial
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["final_step"] == MAX_STEPS
    assert all(not ckpt.verify(p) for _, p in ckpt.list_step_dirs(root))  # the partial was rewritten
