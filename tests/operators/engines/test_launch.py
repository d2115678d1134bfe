"""The launch every engine shares: torchrun's command line, the ranks' environment, and how a
failed job's exit code and result classify (the job contract's table)."""

from __future__ import annotations

import pytest

from trainforge.contract import FailureKind, failure_kind
from trainforge.engines.base import JobIdentity, TrainingJob
from trainforge.engines.launch import LAUNCH_ENV, python_torchrun, rank_env, torchrun_argv

JOB = TrainingJob(identity=JobIdentity("d", "r", "train", 1), config={}, nodes=1,
                  processes_per_node=4, max_restarts=2, threads_per_process=3)


def test_single_machine_launch_keeps_every_rank_log():
    assert torchrun_argv(JOB, "/j/job.json", log_dir="/j/ranks") == [
        "torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=4", "--max-restarts=2",
        "--log-dir=/j/ranks", "--tee=3", "--local-ranks-filter=0",
        "-m", "trainforge.trainer.train", "--config", "/j/job.json"]


def test_multi_machine_launch_names_its_rendezvous_and_leaves_out_what_the_engine_sets():
    argv = torchrun_argv(JOB, "cfg", launcher=python_torchrun("py"),
                         standalone=False, nnodes='"$N"', rendezvous=("--rdzv-backend=c10d",))
    assert argv == ["py", "-m", "torch.distributed.run", '--nnodes="$N"', "--nproc-per-node=4",
                    "--max-restarts=2", "--rdzv-backend=c10d", "-m", "trainforge.trainer.train",
                    "--config", "cfg"]
    pods = torchrun_argv(JOB, "cfg", standalone=False, nnodes="", max_restarts=0)
    assert pods == ["torchrun", "--nproc-per-node=4", "--max-restarts=0",
                    "-m", "trainforge.trainer.train", "--config", "cfg"]


def test_rank_env():
    assert rank_env(JOB) == {"OMP_NUM_THREADS": "3", **LAUNCH_ENV}
    assert list(rank_env(JOB, "/j/result.json", job_dir="/j")) == [
        "OMP_NUM_THREADS", *LAUNCH_ENV, "TRAINFORGE_JOB_DIR", "TRAINFORGE_RESULT_FILE"]


@pytest.mark.parametrize("exit_code,result,kind", [
    (78, None, FailureKind.PERMANENT),
    (79, None, FailureKind.PERMANENT),
    (1, {"status": "bad_config"}, FailureKind.PERMANENT),
    (1, {"status": "diverged"}, FailureKind.PERMANENT),
    (1, {"status": "error", "exit_code": 78}, FailureKind.PERMANENT),
    (1, {"status": "error", "exit_code": 1}, FailureKind.TRANSIENT),
    (137, None, FailureKind.TRANSIENT),
    (None, None, FailureKind.TRANSIENT),
])
def test_failure_kind(exit_code, result, kind):
    assert failure_kind(exit_code, result) is kind
