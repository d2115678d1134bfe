"""``fault.max_restarts`` on a two-node Slurm job, for real: two test hosts (tests/hosts.py), a
slurmd on each, the trainer under srun + torchrun with one rank per node (gloo).

Past the first checkpoint the rank on the second host is SIGKILLed (its torchrun agent lives on):

* with ``max_restarts: 1`` torchrun restarts the worker group on both nodes inside the same Slurm
  job (one job, one script run), the ranks resume from the newest checkpoint, and the job ends
  at ``max_steps``;
* with ``max_restarts: 0`` the agent gives up, srun ends the step, and the job fails as before;
* with ``max_restarts: 1`` but the second host's torchrun agent killed with its rank (the node's
  processes gone), srun ends the step at once (``--kill-on-bad-exit``): the first host's agent
  does not wait in a new rendezvous for a node that will not come;
* with ``max_restarts: 1`` and a rank raising on each host in turn, the job fails after one
  restart, not two (each agent's own count would allow one each): both nodes say the same
  restart, and the job's result names the restart's cause (trainforge.trainer.restarts);
* a rank on the second host stopped (SIGSTOP) before a collective: the failure names it, not the
  rank on the first host that timed out waiting (trainforge.trainer.causes);
* a bad config (exit 78) or a divergence (exit 79) with ``max_restarts: 2``: no restart at all,
  each node's torchrun agent stopped by its first rank at the verdict; permanent (trainer/verdict.py).

Nothing of a job is left running on either host after each.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from trainforge.engines.base import JobIdentity, JobState, TrainingJob
from trainforge.engines.slurm.backend import SlurmBackend
from tests.faults.faultlib import wait_for
from tests.slurm_cluster import JOB_WORDS, job_logs, newest_step, two_host_slurm
from tests.trainer.conftest import build_dataset, make_job

pytestmark = [pytest.mark.multihost, pytest.mark.integration, pytest.mark.distributed]

MAX_STEPS = 300
KILL_AFTER_STEP = 12


@pytest.fixture(scope="module")
def cluster():
    with two_host_slurm("tf-slurm-rs-") as (hosts, slurm):
        yield hosts, slurm


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return build_dataset(tmp_path_factory.mktemp("data") / "tiny")


def _job(tmp_path: Path, dataset: Path, key: str, max_restarts: int, env: dict | None = None) -> TrainingJob:
    config = make_job(dataset, tmp_path / "checkpoints",
                      optim={"max_steps": MAX_STEPS, "warmup_steps": 1},
                      checkpoint={"interval_steps": 10, "keep_last": 2},
                      logging={"log_every_steps": 1},
                      distributed={"collective_timeout_s": 20})
    return TrainingJob(identity=JobIdentity("restarts", key, "train", 1), config=config,
                       module="trainforge.trainer.train", nodes=2, processes_per_node=1,
                       engine_options={"python": sys.executable}, max_runtime_s=600.0,
                       startup_timeout_s=60.0, max_restarts=max_restarts, env=env or {})




def _rank(hosts, i: int) -> psutil.Process | None:
    """The trainer rank on host ``i`` (a child of torchrun's agent), if one runs."""
    ranks = [p for p in hosts.processes(i, "trainforge.trainer.train")
             if "torch.distributed.run" not in " ".join(p.cmdline())]
    return ranks[0] if ranks else None




def _kill_a_rank_on_the_second_host(backend, handle, job, hosts) -> int:
    """SIGKILL host 1's rank past the first checkpoint; the step it was at."""
    log = backend.job_dir(job.identity) / "job.log"
    wait_for("the job past its step-10 checkpoint", lambda: newest_step(log) >= KILL_AFTER_STEP
             or backend.status(handle).state.terminal, 240, 0.2)
    assert not backend.status(handle).state.terminal, job_logs(backend, job)[-3000:]
    rank = wait_for("the rank on the second host", lambda: _rank(hosts, 1), 30, 0.2)
    step = newest_step(log)
    os.kill(rank.pid, signal.SIGKILL)
    return step




def test_a_killed_rank_is_restarted_inside_the_same_job(tmp_path, cluster, dataset):
    hosts, _ = cluster
    backend = SlurmBackend(tmp_path / "runs")
    job = _job(tmp_path, dataset, "restart", max_restarts=1)
    handle = backend.submit(job)
    killed_at = _kill_a_rank_on_the_second_host(backend, handle, job, hosts)
    status = wait_for("the job to end", lambda: (s := backend.status(handle)).state.terminal and s,
                      300, 0.5)
    text = job_logs(backend, job)
    assert status.state is JobState.SUCCEEDED, (status, text[-4000:])
    # One job, one run of its script: the restart happened inside the step.
    assert len(re.findall(r"trainforge: Slurm job \d+ on", text)) == 1, text[-4000:]
    assert "failed (exitcode: -9) local_rank: 0" in text, text[-4000:]  # the agent saw the kill
    resumed = re.findall(r"resuming from \S*step-(\d+)", text)
    # The log is read through srun's forwarded output, which may trail the ranks by a few steps:
    # the rank can be past the next checkpoint when the kill lands, never past two.
    assert resumed and int(resumed[-1]) % 10 == 0, (resumed, text[-4000:])
    assert 10 <= int(resumed[-1]) <= killed_at + 10, (resumed, killed_at, text[-4000:])
    assert f"step {MAX_STEPS}/{MAX_STEPS} |" in text
    hosts.wait_nothing_left(JOB_WORDS)


def test_without_restarts_a_killed_rank_fails_the_job(tmp_path, cluster, dataset):
    hosts, _ = cluster
    backend = SlurmBackend(tmp_path / "runs")
    job = _job(tmp_path, dataset, "no-restart", max_restarts=0)
    handle = backend.submit(job)
    _kill_a_rank_on_the_second_host(backend, handle, job, hosts)
    status = wait_for("the job to end", lambda: (s := backend.status(handle)).state.terminal and s,
                      120, 0.5)
    text = job_logs(backend, job)
    assert status.state is JobState.FAILED, (status, text[-4000:])
    assert f"step {MAX_STEPS}/{MAX_STEPS} |" not in text
    hosts.wait_nothing_left(JOB_WORDS)


def test_a_lost_agent_still_ends_the_job_at_once_with_restarts_left(tmp_path, cluster, dataset):
    hosts, _ = cluster
    backend = SlurmBackend(tmp_path / "runs")
    job = _job(tmp_path, dataset, "agent-lost", max_restarts=1)
    handle = backend.submit(job)
    log = backend.job_dir(job.identity) / "job.log"
    wait_for("the job past its step-10 checkpoint", lambda: newest_step(log) >= KILL_AFTER_STEP
             or backend.status(handle).state.terminal, 240, 0.2)
    agents = hosts.processes(1, "torch.distributed.run")
    assert agents, job_logs(backend, job)[-3000:]
    for proc in [p for a in agents for p in a.children(recursive=True)] + agents:
        proc.kill()
    killed = time.monotonic()
    status = wait_for("the job to end", lambda: (s := backend.status(handle)).state.terminal and s,
                      60, 0.25)
    took = time.monotonic() - killed
    text = job_logs(backend, job)
    assert status.state is JobState.FAILED, (status, text[-4000:])
    # Well before the 60 s rendezvous join timeout a new round would wait for the lost node.
    assert took < 20, (took, text[-4000:])
    assert f"step {MAX_STEPS}/{MAX_STEPS} |" not in text
    hosts.wait_nothing_left(JOB_WORDS)


# On the ranks' path (a sitecustomize): the rank on the first host in TF_TEST_HOSTS without a mark
# in TF_TEST_MARKS when the rank starts raises at its 5th optimizer step, leaving its mark: h1 in
# the first attempt, h0 in the next (decided at start: the ranks step together, so h0's 5th step
# may come after h1's mark is made).
IN_TURN = '''
import os
import socket
if os.environ.get("RANK") is not None and os.environ.get("TF_TEST_MARKS"):
    import torch
    _step, _calls, _host = torch.optim.AdamW.step, [0], socket.gethostname()

    def _due():
        for host in os.environ["TF_TEST_HOSTS"].split(","):
            if not os.path.exists(os.path.join(os.environ["TF_TEST_MARKS"], host)):
                return host == _host
        return False

    _raises = _due()

    def step(self, *args, **kwargs):
        _calls[0] += 1
        if _calls[0] == 5 and _raises:
            open(os.path.join(os.environ["TF_TEST_MARKS"], _host), "w").close()
            raise ValueError("injected on " + _host)
        return _step(self, *args, **kwargs)

    torch.optim.AdamW.step = step
'''


def test_one_restart_budget_for_the_whole_job_when_each_host_fails_in_turn(tmp_path, cluster, dataset):
    hosts, _ = cluster
    inject, marks = tmp_path / "inject", tmp_path / "marks"
    inject.mkdir(), marks.mkdir()
    (inject / "sitecustomize.py").write_text(IN_TURN)
    path = os.pathsep.join(p for p in (str(inject), os.environ.get("PYTHONPATH")) if p)
    backend = SlurmBackend(tmp_path / "runs")
    job = _job(tmp_path, dataset, "in-turn", max_restarts=1,
               env={"PYTHONPATH": path, "TF_TEST_MARKS": str(marks), "TF_TEST_HOSTS": f"{hosts.name(1)},{hosts.name(0)}"})
    handle = backend.submit(job)
    status = wait_for("the job to end", lambda: (s := backend.status(handle)).state.terminal and s, 300, 0.5)
    text = job_logs(backend, job)
    assert status.state is JobState.FAILED, (status, text[-4000:])
    assert sorted(p.name for p in marks.iterdir()) == [hosts.name(0), hosts.name(1)], text[-4000:]  # each raised
    for i in (0, 1):  # both nodes say the same restart: the job's, not their agent's
        assert re.search(rf"rank \d on {hosts.name(i)}: job restart 1 of 1 \(within", text), text[-4000:]
    # no second restart trained: an agent with a count of its own left (one whose rank was torn
    # down for the new round, not failed) starts one, which ends at once, past the budget
    assert "job restart 2 of 1 (within" not in text, text[-4000:]
    assert len(re.findall(r"rank \d on \S+: job restart 1 of 1 \(within", text)) == 2, text[-4000:]  # one per node
    assert f"step {MAX_STEPS}/{MAX_STEPS} |" not in text
    # the failure is attempt 1's: the rank on h0 raised; attempt 2 left no record of its own
    assert f"on {hosts.name(0)} " in status.message.splitlines()[0] and "raised ValueError" in status.message, status
    line = next(n for n, text in enumerate(IN_TURN.split("\n"), 1) if "raise ValueError" in text)
    assert f'sitecustomize.py", line {line}, in step' in status.message, status.message  # the raising line
    assert f"collateral: rank {1 - status.result['root_cause']['culprits'][0]['rank']} on {hosts.name(1)}" \
        in status.message, status.message  # the other node's rank: torn down, or its collective failed
    [restart] = status.result["restarts"]  # for the try record and the ledger
    assert restart["index"] == 1 and restart["node"] == hosts.name(1), restart
    assert f"injected on {hosts.name(1)}" in restart["cause"], restart
    hosts.wait_nothing_left(JOB_WORDS)


def test_a_rank_that_stops_on_the_second_host_is_named_not_the_one_that_timed_out(tmp_path, cluster, dataset):
    hosts, _ = cluster
    backend = SlurmBackend(tmp_path / "runs")
    job = _job(tmp_path, dataset, "stopped", max_restarts=0)
    job.config["distributed"]["collective_timeout_s"] = 8
    handle = backend.submit(job)
    log = backend.job_dir(job.identity) / "job.log"
    wait_for("the job past step 3", lambda: newest_step(log) >= 3 or backend.status(handle).state.terminal, 240, 0.2)
    rank = wait_for("the rank on the second host", lambda: _rank(hosts, 1), 30, 0.2)
    rank.send_signal(signal.SIGSTOP)  # alive and silent: the first host's rank times out waiting
    try:
        status = wait_for("the job to end", lambda: (s := backend.status(handle)).state.terminal and s, 120, 0.5)
    finally:
        if rank.is_running():
            rank.kill()  # our job's rank on our test host: srun or torchrun has normally done it
    text = job_logs(backend, job)
    assert status.state is JobState.FAILED, (status, text[-4000:])
    first = status.message.splitlines()[0]
    assert re.search(rf"rank \d on {hosts.name(1)} \(\S+\) stopped making progress at step \d+: rank \d timed "
                     r"out or lost the connection waiting for it", first), status.message
    [culprit] = status.result["root_cause"]["culprits"]
    assert culprit["host"] == hosts.name(1)
    assert [r["host"] for r in status.result["root_cause"]["collateral"]] == [hosts.name(0)]
    hosts.wait_nothing_left(JOB_WORDS)


@pytest.mark.parametrize("verdict", ["bad_config", "diverged"])
def test_a_permanent_verdict_is_not_restarted_on_either_host(tmp_path, cluster, dataset, verdict):
    from trainforge.contract import FailureKind

    hosts, _ = cluster
    backend = SlurmBackend(tmp_path / "runs")
    job = _job(tmp_path, dataset, verdict, max_restarts=2)
    optim = job.config["optim"]
    if verdict == "bad_config":  # 6 does not divide over micro-batch 2 x 2 ranks
        optim.update(global_batch_size=6, micro_batch_size=2)
    else:
        optim.update(learning_rate=1e30, min_learning_rate=1e29, warmup_steps=0)
    handle = backend.submit(job)
    status = wait_for("the job to end", lambda: (s := backend.status(handle)).state.terminal and s, 180, 0.5)
    text = job_logs(backend, job)
    assert status.state is JobState.FAILED and status.failure is FailureKind.PERMANENT, (status, text[-4000:])
    assert status.result["status"] == verdict, status
    assert len(re.findall(r"process group up", text)) == 1, text[-4000:]  # rank 0's line: one attempt
    assert "stopping this node's torchrun agent" in text, text[-4000:]
    assert "exiting without training" not in text and "job restart" not in text, text[-4000:]
    hosts.wait_nothing_left(JOB_WORDS)


def test_a_rank_raising_on_the_second_host_is_named_and_a_retry_raising_the_same_is_not_retried(
        tmp_path, cluster, dataset, mlflow_server):
    """Rank on h1 raises at step 5 (no in-job restarts): the failure names it, its host and line,
    the rank on h0 as collateral. The same job as the task's second try raises the same: the
    train task, given the trigger's real events of both Slurm jobs and a real MLflow server,
    retries the first and fails the second permanently (trainforge.repeated_failure)."""
    from airflow.sdk.exceptions import AirflowFailException

    from tests.e2e.test_ray_two_nodes import RAISE_ON_HOST
    from tests.operators.tasks.test_train_outcomes import _raw, _task
    from trainforge.triggers import TrainingJobTrigger

    hosts, _ = cluster
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(RAISE_ON_HOST)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(inject), os.environ.get("PYTHONPATH")) if p),
           "TF_TEST_RAISE_ON": hosts.name(1)}
    backend, events = SlurmBackend(tmp_path / "runs"), []
    for try_number in (1, 2):
        job = _job(tmp_path, dataset, "raise-b", max_restarts=0, env=env)
        job = dataclasses.replace(job, identity=JobIdentity("restarts", "raise-b", "train", try_number))
        trigger = TrainingJobTrigger("slurm", {"runs_root": str(tmp_path / "runs")}, backend.submit(job),
                                     poll_interval_s=0.5)
        events.append(trigger.wait_here())
        hosts.wait_nothing_left(JOB_WORDS)
    first = events[0]
    assert first["status"] == "error" and first["failure"] == "transient", first["message"]
    assert re.search(rf"rank \d on {hosts.name(1)} \({re.escape(hosts.address(1))}\) raised ValueError during "
                     r"step 5: injected at optimizer step 5", first["message"]), first["message"]
    assert 'sitecustomize.py", line 11, in step' in first["message"], first["message"]
    assert re.search(rf"collateral: rank \d on {hosts.name(0)} ", first["message"]), first["message"]
    raw = _raw()
    op, context = _task(raw, mlflow_server)
    with pytest.raises(RuntimeError, match="transient failure: retry resumes"):
        op.execute_complete(context, events[0])
    op, context = _task(raw, mlflow_server)
    context["ti"].try_number = 2
    with pytest.raises(AirflowFailException, match=r"try 2 raised the same ValueError at "
                                                   r"inject/sitecustomize\.py:11 in step as try 1"):
        op.execute_complete(context, events[1])
