"""A retry that raises the same exception at the same line fails permanently (trainforge.repeated_failure).

The jobs' evidence is made the way a failed job leaves it: each rank's record written by the
trainer's own RankRecord (a real exception, its real traceback), read by the engines' root_cause,
kept in the try record by the ledger's try_ended, as the task's MLflow tags hold it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from trainforge.contract import JOB_DIR_ENV
from trainforge.engines.root_cause import told
from trainforge.ledger.tries import encode, try_ended, try_tag
from trainforge.repeated_failure import repeated, signature
from trainforge.trainer.rank_record import RankRecord

LOG = logging.getLogger("test")


def _bad_token(batch):
    raise ValueError(f"bad token id {max(batch)}")


def _bad_shape(batch):
    raise ValueError(f"shape {len(batch)} does not divide")


def _failed_job(folder: Path, raiser=None, waited: bool = False) -> dict:
    """The trigger's event of a 2-rank job whose rank 1 raised in ``raiser`` at step 5 (or, with
    ``waited``, lost its peer), rank 0 failing in the collective after it."""
    folder.mkdir(parents=True)
    ranks = [RankRecord({"RANK": str(r), "WORLD_SIZE": "2", JOB_DIR_ENV: str(folder)}) for r in (0, 1)]
    try:
        if waited:
            raise RuntimeError("[gloo/transport] Connection closed by peer [10.0.0.1]:29500")
        raiser([3, 70000])
    except Exception as err:  # noqa: BLE001 - the rank's own end, as the trainer records it
        ranks[1].ended(err, 1, 5)
    ranks[0].ended(RuntimeError("Connection closed by peer"), 1, 5)
    message, result = told(folder, "job failed (exit code 1)", {"status": "error", "message": "job failed"})
    return {"status": "error", "failure": "transient", "message": message, "result": result, "handle": {}}


def _tags(*events) -> dict[str, str]:
    """The run's tags after tries 1..n ended with ``events`` (the ledger writes each try's record)."""
    return {try_tag(n): encode(try_ended(None, n, 0.0, e, 1.0)) for n, e in enumerate(events, 1)}


def test_the_same_exception_at_the_same_line_on_the_retry_is_permanent_naming_the_try_it_repeats(tmp_path):
    first, second = _failed_job(tmp_path / "1", _bad_token), _failed_job(tmp_path / "2", _bad_token)
    assert repeated(first, lambda: {}, 1, LOG) is first  # a first failure is retried
    event = repeated(second, lambda: _tags(first), 2, LOG)
    assert event["failure"] == "permanent" and event["repeats"] == 1
    exception, origin = signature(second["result"]["root_cause"])
    assert exception == "ValueError" and origin.endswith(f"{Path(__file__).name}:{_bad_token.__code__.co_firstlineno + 1} "
                                                          "in _bad_token")
    assert f"try 2 raised the same ValueError at {origin} as try 1" in event["message"]
    assert event["message"].startswith(second["message"])  # who failed stays first
    record = try_ended(None, 2, 0.0, event, 1.0)  # the try record keeps the cause and what it repeats
    assert record["repeats"] == 1 and record["root_cause"]["culprits"][0]["origin"] == origin


def test_another_line_another_cause_or_a_transport_error_is_retried(tmp_path):
    token, shape = _failed_job(tmp_path / "1", _bad_token), _failed_job(tmp_path / "2", _bad_shape)
    assert repeated(shape, lambda: _tags(token), 2, LOG)["failure"] == "transient"  # same class, other line
    lost = {"status": "error", "failure": "transient", "message": "node lost", "handle": {},
            "result": {"disruption": {"kind": "node_loss", "node": "b"}}}
    assert repeated(token, lambda: _tags(lost), 2, LOG)["failure"] == "transient"
    # the try before the last is not the one retried: try 3 compares with try 2 only
    again = _failed_job(tmp_path / "3", _bad_token)
    assert repeated(again, lambda: _tags(token, lost), 3, LOG)["failure"] == "transient"
    waited = [_failed_job(tmp_path / f"w{n}", waited=True) for n in (1, 2)]
    assert signature(waited[1]["result"].get("root_cause")) is None  # both waited: nothing singled out
    assert repeated(waited[1], lambda: _tags(waited[0]), 2, LOG)["failure"] == "transient"


def test_unreadable_try_records_leave_the_failure_transient(tmp_path, caplog):
    first, second = _failed_job(tmp_path / "1", _bad_token), _failed_job(tmp_path / "2", _bad_token)
    assert repeated(second, lambda: {try_tag(1): "not json"}, 2, LOG)["failure"] == "transient"

    def unreachable():
        raise ConnectionError("MLflow is down")

    assert repeated(second, unreachable, 2, LOG)["failure"] == "transient"
    assert "stays transient" in caplog.text
    permanent = {**second, "failure": "permanent"}
    assert repeated(permanent, lambda: _tags(first), 2, LOG) is permanent
