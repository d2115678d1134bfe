"""A permanent verdict is recorded only where torchrun may restart the group, and honoured only
by a later attempt of the same torchrun run (trainer/verdict.py)."""

from __future__ import annotations

import pytest

from trainforge.trainer import verdict


def _env(tmp_path, **extra):
    return {"TRAINFORGE_RESULT_FILE": str(tmp_path / "result.json"), "TORCHELASTIC_RUN_ID": "run-a",
            "TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_RESTART_COUNT": "0", "RANK": "1", **extra}


def test_a_permanent_exit_is_recorded_and_a_later_attempt_of_the_run_sees_it(tmp_path):
    assert verdict.recorded(79, _env(tmp_path)) == 79
    seen = verdict.decided(_env(tmp_path, TORCHELASTIC_RESTART_COUNT="1"))
    assert seen["exit_code"] == 79 and seen["status"] == "diverged" and seen["rank"] == 1
    with pytest.raises(SystemExit) as ended:
        verdict.end_if_decided("__main__", _env(tmp_path, TORCHELASTIC_RESTART_COUNT="2"))
    assert ended.value.code == 79
    verdict.end_if_decided("trainforge.trainer.train", _env(tmp_path, TORCHELASTIC_RESTART_COUNT="2"))  # imported


@pytest.mark.parametrize("later", [{"TORCHELASTIC_RESTART_COUNT": "0"}, {"TORCHELASTIC_RUN_ID": "run-b"}])
def test_a_verdict_of_another_run_or_the_same_attempt_is_ignored(tmp_path, later):
    verdict.recorded(78, _env(tmp_path))
    assert verdict.decided(_env(tmp_path, **later)) is None


@pytest.mark.parametrize("code,extra", [(1, {}), (143, {}), (78, {"TORCHELASTIC_MAX_RESTARTS": "0"})])
def test_nothing_is_recorded_for_a_transient_exit_or_without_restarts(tmp_path, code, extra):
    assert verdict.recorded(code, _env(tmp_path, **extra)) == code
    assert not (tmp_path / verdict.VERDICT_FILE).exists()
