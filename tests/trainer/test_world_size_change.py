"""A resume on another world size: recorded in meta.json's world_size_history, or refused (exit 78).

One real 2-rank run (gloo, 4 steps), then single-process resumes of copies of its checkpoints.
"""

from __future__ import annotations

import json
import shutil

import pytest

from trainforge.trainer import checkpoint as ckpt

pytestmark = [pytest.mark.distributed]


def test_history_starts_with_the_first_world_size_and_grows_on_a_change():
    assert ckpt.world_size_history(None, 2) == [{"from_step": 0, "world_size": 2}]
    same = {"step": 10, "world_size": 2, "world_size_history": [{"from_step": 0, "world_size": 2}]}
    assert ckpt.world_size_history(same, 2) == [{"from_step": 0, "world_size": 2}]
    assert ckpt.world_size_history(same, 1) == [{"from_step": 0, "world_size": 2},
                                                {"from_step": 10, "world_size": 1}]
    older = {"step": 20, "world_size": 4}  # written before the history existed
    assert ckpt.world_size_history(older, 2) == [{"from_step": 0, "world_size": 4},
                                                 {"from_step": 20, "world_size": 2}]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory, dataset_dir, tools):
    root = tmp_path_factory.mktemp("two_ranks")
    job = tools.write_job(root / "job.json", tools.make_job(
        dataset_dir, root / "ck", optim={"max_steps": 4, "warmup_steps": 1},
        checkpoint={"interval_steps": 4}, distributed={"backend": "gloo"}))
    proc = tools.run_trainer(job, root / "result.json", nproc=2, timeout_s=240)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return root / "ck"


def _resume(tools, tmp_path, dataset_dir, ck, **distributed):
    copy = shutil.copytree(ck, tmp_path / "ck")
    job = tools.write_job(tmp_path / "job.json", tools.make_job(
        dataset_dir, copy, optim={"max_steps": 6, "warmup_steps": 1},
        checkpoint={"interval_steps": 2}, distributed=distributed))
    return copy, tools.run_trainer(job, tmp_path / "result.json")


def test_a_resume_on_one_rank_continues_and_records_the_change(two_rank_run, tmp_path, dataset_dir,
                                                               tools):
    meta = json.loads((two_rank_run / "step-00000004" / "meta.json").read_text())
    assert meta["world_size_history"] == [{"from_step": 0, "world_size": 2}]
    ck, proc = _resume(tools, tmp_path, dataset_dir, two_rank_run)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "trained on world size 2, this attempt runs 1 ranks: resharding" in proc.stdout
    meta = json.loads((ck / "step-00000006" / "meta.json").read_text())
    assert meta["world_size"] == 1
    assert meta["world_size_history"] == [{"from_step": 0, "world_size": 2},
                                          {"from_step": 4, "world_size": 1}]


def test_a_resume_on_one_rank_is_refused_with_exit_78(two_rank_run, tmp_path, dataset_dir, tools):
    ck, proc = _resume(tools, tmp_path, dataset_dir, two_rank_run, world_size_change="refuse")
    assert proc.returncode == 78, proc.stdout[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "bad_config"
    assert "trained on world size 2, this attempt runs 1 ranks" in result["message"]
    assert "world_size_change is 'refuse'" in result["message"]
    assert not (ck / "step-00000006").exists()
