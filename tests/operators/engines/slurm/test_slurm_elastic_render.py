"""An elastic Slurm job without a cluster: its batch script, the nodes a retry is kept off, and
when the survivors noticed a lost node (the real runs: test_slurm_elastic.py)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from trainforge.engines.base import JobIdentity, TrainingJob
from trainforge.storage.files import atomic_write_json
from trainforge.engines.slurm.backend import SlurmBackend
from trainforge.engines.slurm.node_loss import (
    RECORD_NAME,
    lost_by_earlier_tries,
    survivors_noticed,
)
from trainforge.engines.slurm.script import render_script


def _job(min_nodes: int | None, try_number: int = 1) -> TrainingJob:
    return TrainingJob(identity=JobIdentity("d", "r", "train", try_number), config={},
                       nodes=4, min_nodes=min_nodes, processes_per_node=2, max_restarts=1)


def test_an_elastic_script_asks_for_a_range_and_outlives_a_lost_node(tmp_path):
    script = render_script(_job(2), tmp_path, exclude=("h3",))
    sbatch = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --nodes=2-4" in sbatch
    assert "#SBATCH --no-kill" in sbatch and "#SBATCH --exclude=h3" in sbatch
    # With --ntasks-per-node Slurm would give the fewest nodes, not as many as it can.
    assert not any("--ntasks-per-node" in line for line in sbatch)
    assert '--nnodes=2:"$SLURM_NNODES"' in script
    assert "  --no-kill \\" in script and "--kill-on-bad-exit" not in script
    assert "training finished on the surviving nodes" in script


def test_a_fixed_script_is_unchanged_by_elastic_support(tmp_path):
    for job in (_job(None), _job(4)):  # {min: 4, max: 4} is four nodes
        script = render_script(job, tmp_path)
        assert "#SBATCH --nodes=4" in script and "#SBATCH --ntasks-per-node=1" in script
        assert "--no-kill" not in script and "--exclude" not in script
        assert "  --kill-on-bad-exit=1 \\" in script and '--nnodes="$SLURM_NNODES"' in script
        assert "surviving nodes" not in script


def test_a_retry_is_kept_off_the_node_the_last_try_lost(tmp_path):
    backend = SlurmBackend(tmp_path)
    first = _job(2)
    folder = backend.job_dir(first.identity)
    folder.mkdir(parents=True)
    assert lost_by_earlier_tries(replace(first, identity=replace(first.identity, try_number=2)),
                                 backend.job_dir) == ()  # the first try lost nothing
    atomic_write_json(folder / RECORD_NAME, {"kind": "node_loss", "node": "h0"}, sort_keys=True)
    second = _job(2, try_number=2)
    assert lost_by_earlier_tries(second, backend.job_dir) == ("h0",)
    assert lost_by_earlier_tries(_job(None, try_number=2), backend.job_dir) == ()  # fixed size
    assert lost_by_earlier_tries(first, backend.job_dir) == ()  # no earlier try
    # Try 3 looks at try 2 (which lost nothing), not back to try 1.
    backend.job_dir(second.identity).mkdir()
    assert lost_by_earlier_tries(_job(2, try_number=3), backend.job_dir) == ()
    assert "--exclude=h0" in backend.render(second, ("h0",))["script"]


def _console(path: Path, mtime: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x")
    os.utime(path, (mtime, mtime))


def test_the_survivors_noticed_when_their_attempt_ended(tmp_path):
    ranks = tmp_path / "ranks"
    _console(ranks / "1_a" / "attempt_0" / "0" / "stdout.log", 1000.0)  # lost node: one attempt
    _console(ranks / "1_b" / "attempt_0" / "0" / "stdout.log", 1002.5)  # survivor: failed ...
    _console(ranks / "1_b" / "attempt_0" / "1" / "stderr.log", 1002.0)
    _console(ranks / "1_b" / "attempt_1" / "0" / "stdout.log", 1090.0)  # ... and went on
    assert survivors_noticed(tmp_path, 999.0) == 1002.5
    assert survivors_noticed(tmp_path, 1003.0) is None  # no attempt ended after the loss
    assert survivors_noticed(tmp_path / "none", 0.0) is None
