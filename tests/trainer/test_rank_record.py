"""A training rank's record is its sign of life: its modification time, renewed while it trains,
is what the Slurm engine reads as a lost node's last one (ranks other than 0 print nothing)."""

from __future__ import annotations

import json
import os

from trainforge.contract import JOB_DIR_ENV, RANK_RECORDS_DIR
from trainforge.trainer import rank_record
from trainforge.trainer.causes import last_alive
from trainforge.trainer.rank_record import RankRecord


def _record(tmp_path, rank: int) -> RankRecord:
    return RankRecord({JOB_DIR_ENV: str(tmp_path), "RANK": str(rank), "WORLD_SIZE": "2"})


def test_alive_renews_the_records_time_at_most_once_per_interval(tmp_path, monkeypatch):
    record = _record(tmp_path, 1)
    os.utime(record.path, (1000.0, 1000.0))
    record.alive()  # just written: within the interval, nothing is touched
    assert os.stat(record.path).st_mtime == 1000.0
    monkeypatch.setattr(rank_record, "ALIVE_EVERY_S", 0.0)
    record.alive()
    assert os.stat(record.path).st_mtime > 1000.0
    assert json.loads(open(record.path, encoding="utf-8").read())["rank"] == 1  # content kept


def test_last_alive_is_the_newest_record_of_that_host_only(tmp_path):
    folder = tmp_path / RANK_RECORDS_DIR
    folder.mkdir()
    for name, host, mtime in [("rank-1-h1-10.json", "h1", 1005.0), ("rank-2-h1-11.json", "h1", 1009.0),
                              ("rank-0-h0-12.json", "h0", 1050.0)]:
        (folder / name).write_text(json.dumps({"rank": 0, "host": host}))
        os.utime(folder / name, (mtime, mtime))
    (folder / "rank-3-h1-13.json").write_text("{not json")
    assert last_alive(tmp_path, "h1") == 1009.0
    assert last_alive(tmp_path, "h0") == 1050.0
    assert last_alive(tmp_path, "h2") is None
    assert last_alive(tmp_path / "none", "h1") is None
