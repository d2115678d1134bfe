"""The task's ledger folder: every try's attempt records in one place, beside the checkpoints,
found by the next try's trainer (its wasted steps) and by the ledger (its attempts), with or
without MLflow. Pure: local folders only, no Airflow, no MLflow."""

from __future__ import annotations

import json
import time

from trainforge.contract import LEDGER_DIR_ENV, LEDGER_TAG_PREFIX
from trainforge.ledger.attempts import attempt_records, folder_records, merge_records
from trainforge.train_ledger import ledger_dir, ledger_env, task_records
from trainforge.trainer.goodput import AttemptClock


def _clock(started_at: float, job_dir, ledger) -> AttemptClock:
    return AttemptClock(world_size=1, tokens_per_step=8, flops_per_token=10, device="cpu",
                        started_at=started_at, job_dir=str(job_dir), ledger_dir=str(ledger))


def test_the_ledger_folder_is_beside_the_checkpoints_and_reaches_the_ranks(tmp_path):
    assert ledger_dir(str(tmp_path / "ck")) == str(tmp_path / "ck" / "ledger")
    assert ledger_dir("s3://bucket/ck/dag/run") == "s3://bucket/ck/dag/run/ledger"
    assert ledger_env("s3://bucket/ck/dag/run") == {LEDGER_DIR_ENV: "s3://bucket/ck/dag/run/ledger"}


def test_a_retry_on_a_new_job_folder_counts_the_killed_trys_steps_as_wasted(tmp_path):
    ledger = tmp_path / "ck" / "ledger"
    killed = _clock(time.time() - 60, tmp_path / "job-try1", ledger)
    killed.restored(0.1, resumed_step=0, reached_step=0)
    killed.step = 37
    killed.snapshot()  # SIGKILLed after this flush
    retry = _clock(time.time(), tmp_path / "job-try2", ledger)
    retry.restored(0.1, resumed_step=30, reached_step=30)  # no MLflow: it knows only its checkpoint
    assert retry.reached_step == 37
    retry.snapshot(final=True)
    records = attempt_records(folder_records(ledger))
    assert [r["step"] for r in records] == [37, 30]
    assert len(list((tmp_path / "job-try2" / "ledger").glob("attempt-*.json"))) == 1


def test_the_ledger_takes_each_attempt_once_the_newest_copy_of_it(tmp_path):
    key = f"{LEDGER_TAG_PREFIX}1000"
    older = json.dumps({"started_at": 1.0, "recorded_at": 5.0, "seconds": {}, "step": 3})
    newer = json.dumps({"started_at": 1.0, "recorded_at": 9.0, "seconds": {}, "step": 7})
    other = json.dumps({"started_at": 20.0, "recorded_at": 25.0, "seconds": {}, "step": 9})
    merged = merge_records({key: newer, "mlflow.user": "x"}, {key: older, f"{LEDGER_TAG_PREFIX}20000": other})
    assert [r["step"] for r in attempt_records(merged)] == [7, 9]
    assert merged["mlflow.user"] == "x"
    assert merge_records({key: older}, {key: newer})[key] == newer


def test_a_missing_or_unreadable_ledger_folder_is_no_record(tmp_path, caplog):
    assert task_records(str(tmp_path / "none")) == {}
    assert task_records(None) == {}
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "attempt-1.json").write_bytes(b"\xff\xfe")
    assert task_records(str(tmp_path / "bad")) == {}
    assert f"could not read the attempt records in {tmp_path / 'bad'}" in caplog.text
