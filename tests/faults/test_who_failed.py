"""A failed multi-rank job names the rank that started it, not the first rank that noticed.

The real trainer on 2 gloo ranks under the local engine. A ``sitecustomize`` on the ranks' path
(the test's, not trainforge's) makes rank 1's optimizer raise at step 5; rank 0 then fails in its
next collective ("Connection closed by peer", or a timeout). The task's message must name rank 1,
its host and the raising line, with rank 0 as collateral; torchrun's own summary names rank 0.
A hang (rank 1 stopped with SIGSTOP) is named the same way: the rank that stopped, not the one
that timed out.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from tests.faults.faultlib import wait_for
from trainforge.contract import FailureKind
from trainforge.engines.base import JobIdentity, JobState, TrainingJob
from trainforge.engines.local.backend import LocalBackend
from trainforge.trainer.causes import root_cause

pytestmark = [pytest.mark.distributed]

INJECT = '''
import os
if (os.environ.get("RANK") == "1" and os.environ.get("TF_TEST_RAISE_AT_STEP")
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in os.environ.get("TF_TEST_RAISE_IN", "0123")):
    import torch
    _step, _calls = torch.optim.AdamW.step, [0]

    def step(self, *args, **kwargs):
        _calls[0] += 1
        if _calls[0] == int(os.environ["TF_TEST_RAISE_AT_STEP"]):
            raise ValueError("injected at optimizer step %d" % _calls[0])
        return _step(self, *args, **kwargs)

    torch.optim.AdamW.step = step
'''


def _ended(backend, handle, timeout_s):
    """The job's status once it is terminal."""
    return wait_for(f"job {handle['key']} to end", lambda: (lambda st: st if st.state.terminal else None)(
        backend.status(handle)), timeout_s, 0.3)


def test_a_rank_that_raises_is_named_with_its_host_and_line(tmp_path, tiny_dataset):
    from tests.trainer.conftest import make_job

    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(INJECT)
    config = make_job(tiny_dataset, tmp_path / "checkpoints", optim={"max_steps": 20, "warmup_steps": 2},
                      distributed={"backend": "gloo", "collective_timeout_s": 20})
    backend = LocalBackend(tmp_path / "runs")
    path = os.pathsep.join(p for p in (str(inject), os.environ.get("PYTHONPATH")) if p)
    job = TrainingJob(identity=JobIdentity("d", "r", "train", 1), config=config, processes_per_node=2,
                      env={"HF_HUB_OFFLINE": "1", "PYTHONPATH": path, "TF_TEST_RAISE_AT_STEP": "5"})
    status = _ended(backend, backend.submit(job), timeout_s=240)
    job_dir = Path(backend.job_dir(job.identity))
    log = (job_dir / "job.log").read_text(errors="replace")
    assert status.state is JobState.FAILED and status.failure is FailureKind.TRANSIENT, log[-3000:]
    first = status.message.splitlines()[0]
    host = socket.gethostname()
    assert first.startswith(f"rank 1 on {host} (127.0.0.1) raised ValueError during step 5: "
                            "injected at optimizer step 5"), status.message
    assert 'sitecustomize.py", line 11, in step' in status.message, status.message
    assert f"collateral: rank 0 on {host}" in status.message, status.message
    cause = status.result["root_cause"]
    assert cause["how"] == "raised" and [c["rank"] for c in cause["culprits"]] == [1]
    assert cause["culprits"][0]["step"] == 5 and [c["rank"] for c in cause["collateral"]] == [0]
    # what a retry's failure is compared with (trainforge.repeated_failure): the raising frame
    assert cause["culprits"][0]["origin"] == "inject/sitecustomize.py:11 in step", cause
    assert "rank 0 said" not in status.message  # its view is the collateral line's


def test_a_rank_that_stops_is_named_not_the_rank_that_timed_out_waiting(tmp_path, tiny_dataset):
    import json
    import re
    import signal

    import psutil

    from tests.trainer.conftest import make_job

    config = make_job(tiny_dataset, tmp_path / "checkpoints", optim={"max_steps": 400, "warmup_steps": 2},
                      logging={"log_every_steps": 1}, distributed={"backend": "gloo", "collective_timeout_s": 6})
    backend = LocalBackend(tmp_path / "runs")
    job = TrainingJob(identity=JobIdentity("d", "r", "train", 1), config=config, processes_per_node=2,
                      env={"HF_HUB_OFFLINE": "1"})
    handle = backend.submit(job)
    job_dir = Path(backend.job_dir(job.identity))
    deadline, victim = time.monotonic() + 180, None
    try:
        while victim is None and time.monotonic() < deadline:
            log = (job_dir / "job.log").read_text(errors="replace") if (job_dir / "job.log").exists() else ""
            records = list((job_dir / "rank_records").glob("rank-1-*.json"))
            if records and re.search(r"step 3/400", log):
                victim = psutil.Process(json.loads(records[0].read_text())["pid"])
                victim.send_signal(signal.SIGSTOP)  # alive, silent: rank 0's next collective times out
            time.sleep(0.1)
        assert victim is not None, "rank 1 never reached step 3"
        # Once rank 0 has timed out waiting, the stopped rank is killed (as torchrun does after
        # its grace period: the SIGTERM it sends a stopped process is never handled).
        rank0 = job_dir / "rank_records"
        while time.monotonic() < deadline and not any(
                json.loads(p.read_text()).get("how") for p in rank0.glob("rank-0-*.json")):
            time.sleep(0.2)
        victim.kill()
        status = _ended(backend, handle, timeout_s=120)
    finally:
        if victim is not None and victim.is_running():
            victim.kill()  # our job's rank: torchrun has normally done it already
    assert status.state is JobState.FAILED, status
    host = socket.gethostname()
    assert re.match(rf"rank 1 on {host} \(127\.0\.0\.1\) stopped making progress at step \d+: rank 0 timed "
                    r"out or lost the connection waiting for it", status.message), status.message
    assert "rank 1 was killed by SIGKILL" in status.message  # the last word, not the cause
    cause = root_cause(job_dir)
    assert [c["rank"] for c in cause["culprits"]] == [1] and cause["collateral"][0]["how"] == "waited"


def test_an_in_job_restart_is_counted_once_with_its_cause_in_the_result(tmp_path, tiny_dataset):
    """Rank 1 raises at step 5 in the first attempt only, with ``max_restarts: 1``: torchrun restarts
    the group, which resumes and finishes; the job's result lists the restart (index 1, rank 1
    on this host, its exception) for the try record and the ledger (trainforge.trainer.restarts)."""
    import json

    from tests.trainer.conftest import make_job

    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(INJECT)
    config = make_job(tiny_dataset, tmp_path / "checkpoints", optim={"max_steps": 8, "warmup_steps": 2},
                      checkpoint={"interval_steps": 3, "keep_last": 2},
                      distributed={"backend": "gloo", "collective_timeout_s": 20})
    backend = LocalBackend(tmp_path / "runs")
    path = os.pathsep.join(p for p in (str(inject), os.environ.get("PYTHONPATH")) if p)
    job = TrainingJob(identity=JobIdentity("d", "r", "train", 1), config=config, processes_per_node=2,
                      max_restarts=1, env={"HF_HUB_OFFLINE": "1", "PYTHONPATH": path, "TF_TEST_RAISE_AT_STEP": "5",
                                           "TF_TEST_RAISE_IN": "0"})
    status = _ended(backend, backend.submit(job), timeout_s=240)
    job_dir = Path(backend.job_dir(job.identity))
    log = (job_dir / "job.log").read_text(errors="replace")
    assert status.state is JobState.SUCCEEDED, log[-3000:]
    assert log.count("job restart 1 of 1 (within fault.max_restarts") == 1, log[-3000:]  # rank 0's line
    [restart] = status.result["restarts"]
    assert restart["kind"] == "restart" and restart["index"] == 1 and restart["rank"] == 1, restart
    assert restart["node"] == socket.gethostname() and "raised ValueError during step 5" in restart["cause"], restart
    assert 0 <= restart["detection_s"] < 60, restart
    attempts = json.loads((job_dir / "restarts.json").read_text())["attempts"]
    assert [a["index"] for a in attempts] == [0, 1] and attempts[1]["agent_restart"] == 1, attempts
