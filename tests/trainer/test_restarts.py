"""One restart budget per job (trainforge.trainer.restarts), without torch: the attempts counted in
the job folder, and an attempt past ``max_restarts`` that leaves the failure of the one before.
The two-node case, where each torchrun agent keeps its own count, runs on two Slurm hosts
(tests/operators/engines/slurm/test_slurm_restarts.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from trainforge.contract import RESULT_FILE_ENV
from trainforge.trainer.restarts import begin_attempt


def _env(tmp_path, agent_restart: int, max_restarts: int = 1, run_id: str = "7") -> dict[str, str]:
    return {RESULT_FILE_ENV: str(tmp_path / "result.json"), "TORCHELASTIC_RUN_ID": run_id, "RANK": "0",
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts), "TORCHELASTIC_RESTART_COUNT": str(agent_restart)}


# One attempt of rank 0, as its own process (a torchrun restart is a new process): begin it, then
# fail at step 5 with exit 3 when asked (its rank record and result file, as the trainer leaves them).
ATTEMPT = """
import json, sys
from trainforge.trainer.rank_record import RankRecord
from trainforge.trainer.restarts import begin_attempt
record = RankRecord()
attempt = begin_attempt(False, 0, None, record)
if sys.argv[1] == "fail" and not attempt.over_budget:
    try:
        raise ValueError("bad token id 70000")
    except ValueError as err:
        record.ended(err, 3, 5)
    open(sys.argv[2], "w").write(json.dumps({"status": "error", "exit_code": 3}))
print("ATTEMPT", json.dumps([attempt.index, attempt.over_budget, attempt.exit_code]))
"""


def _attempt(env: dict[str, str], fail: bool = True) -> tuple[list, str]:
    out = subprocess.run([sys.executable, "-c", ATTEMPT, "fail" if fail else "ok", env[RESULT_FILE_ENV]],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out.split("ATTEMPT ", 1)[1]), out


def test_the_job_counts_its_attempts_whatever_each_agent_counts_and_ends_past_the_budget(tmp_path):
    env = _env(tmp_path, agent_restart=0)  # the agent restarting the group may have counted nothing
    assert _attempt(env)[0] == [0, False, 1]
    counted, said = _attempt(env)
    assert counted == [1, False, 3]
    assert "job restart 1 of 1 (within fault.max_restarts; this node's torchrun agent counts 0), after: rank 0 on " in said
    assert "raised ValueError during step 5: bad token id 70000" in said  # the run log names the cause
    entry = json.loads((tmp_path / "restarts.json").read_text())["attempts"][1]
    assert entry["cause"].startswith("rank 0 on ") and "raised ValueError during step 5" in entry["cause"], entry
    assert entry["after"]["culprits"][0]["origin"] == "<string>:9 in <module>", entry
    counted, said = _attempt(env)
    assert counted == [2, True, 3]  # past the budget: the exit code of the attempt that spent it
    assert "job restart 2 of 1 (past fault.max_restarts" in said
    assert json.loads((tmp_path / "result.json").read_text())["exit_code"] == 3  # its result kept
    records = [json.loads(p.read_text()) for p in (tmp_path / "rank_records").glob("*.json")]
    assert sorted(r["job_restart"] for r in records) == [0, 1]  # the third left none
    assert [a["index"] for a in json.loads((tmp_path / "restarts.json").read_text())["attempts"]] == [0, 1]


def test_a_restart_removes_the_stale_result_within_the_budget(tmp_path):
    env = _env(tmp_path, 0, max_restarts=2)
    _attempt(env)
    assert (tmp_path / "result.json").exists()
    _attempt(env, fail=False)
    assert not (tmp_path / "result.json").exists()  # the attempt before's no longer speaks for the job


def test_another_torchrun_run_starts_counting_again(tmp_path):
    env = _env(tmp_path, 0, run_id="7")
    begin_attempt(False, 0, None, None, env)
    begin_attempt(False, 0, None, None, env)
    assert begin_attempt(False, 0, None, None, _env(tmp_path, 0, run_id="8")).index == 0
    outside = {RESULT_FILE_ENV: str(tmp_path / "result.json")}  # not under torchrun: no count
    assert begin_attempt(False, 0, None, None, outside).index == 0
