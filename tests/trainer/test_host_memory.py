"""Checkpoint staging under a host-memory budget (trainforge.trainer.host_memory, trainer/state.py).

The choice from the state's bytes and the budget; the trainer under ``checkpoint.max_host_bytes``
(pageable, then synchronous, one log line each, the checkpoint equal either way); and the budget
read from a memory cgroup the test makes, in a child process it moves there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch

from trainforge.contract import cgroup_memory
from trainforge.trainer import checkpoint as ckpt
from trainforge.trainer.host_memory import choose, staging_bytes

from tests.trainer.test_checkpoint_background import run_main  # noqa: F401 - the fixture

MiB = 2**20


def test_pinned_when_it_fits_pageable_when_only_that_fits_else_synchronous():
    # a CUDA buffer of 5 MiB takes 8 MiB pinned (the caching host allocator's power of two)
    assert choose(5 * MiB, 8 * MiB, 8 * MiB, cuda=True) == "pinned"
    assert choose(5 * MiB, 8 * MiB, 6 * MiB, cuda=True) == "pageable"
    assert choose(5 * MiB, 8 * MiB, 4 * MiB, cuda=True) == "synchronous"
    assert choose(5 * MiB, 5 * MiB, 8 * MiB, cuda=False) == "pageable"  # nothing to pin without CUDA
    assert choose(5 * MiB, 5 * MiB, 4 * MiB, cuda=False) == "synchronous"
    assert choose(5 * MiB, 8 * MiB, None, cuda=True) == "pinned"  # an unknown budget keeps the background save
    tree = {"w": torch.zeros(3, 5), "opt": [{"m": torch.zeros(7, dtype=torch.float64)}], "step": 3}
    assert staging_bytes(tree) == (3 * 5 * 4 + 7 * 8,) * 2  # CPU tensors: never rounded
    assert staging_bytes(tree, copies=lambda t: t.dtype == torch.float64) == (56, 56)


def _staging_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "trainforge.trainer.host_memory: checkpoint staging:" in line]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(folder / ckpt.WEIGHTS)


def test_a_small_max_host_bytes_saves_synchronously_and_the_checkpoints_are_equal(run_main, tmp_path, capsys):  # noqa: F811
    runs = {}
    for name, limit in (("pageable", 2**40), ("synchronous", 1000)):
        capsys.readouterr()
        code, result, job_dir = run_main(checkpoint={"interval_steps": 4, "keep_last": 2, "max_host_bytes": limit,
                                                     "dir": str(tmp_path / name)})
        assert code == 0, result
        (line,) = _staging_lines(capsys.readouterr().out)  # once per process, not once per save
        assert "(checkpoint.max_host_bytes)" in line and ("no copy" in line) == (name == "synchronous"), line
        records = [json.loads(p.read_text()) for p in sorted((job_dir / "ledger").glob("attempt-*.json"))]
        staging = records[-1]["checkpoint_staging"]
        assert staging["mode"] == name and staging["budget_bytes"] == limit
        assert staging["source"] == "checkpoint.max_host_bytes" and staging["state_bytes"] > 1000
        phase = (job_dir / "phase" / "rank-0").read_text()
        assert phase == "training after checkpoint step 12", phase
        folder = Path(result["last_checkpoint"])
        assert ckpt.verify(folder) == [] and [s for s, _ in ckpt.list_step_dirs(folder.parent)] == [8, 12]
        runs[name] = folder
        for p in (job_dir / "ledger").glob("attempt-*.json"):
            p.unlink()
    pageable, synchronous = (_weights(runs[n]) for n in ("pageable", "synchronous"))
    assert pageable.keys() == synchronous.keys()
    assert all(torch.equal(pageable[k], synchronous[k]) for k in pageable)
    loaded = ckpt.load_checkpoint(runs["synchronous"])
    assert loaded.step == 12 and loaded.optimizer["state"]


IN_CGROUP = textwrap.dedent("""
    import json, logging, sys
    from pathlib import Path
    import torch
    from trainforge.contract import cgroup_memory
    from trainforge.trainer import checkpoint as ckpt, host_memory
    from trainforge.trainer.checkpoint_writer import CheckpointWriter

    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s: %(message)s")
    limit, root = Path(sys.argv[1]), Path(sys.argv[2])
    model = torch.nn.Linear(1024, 2048)  # 8 MiB of weights, 16 MiB of AdamW state
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    tree = {"weights": dict(model.state_dict()), "optimizer": optimizer.state_dict(),
            "state": {"step": 1, "rng": [ckpt.capture_rng_state()]}, "rank_files": {}}
    # 4 MiB of room: writing the limit reclaims the page cache down to it
    limit.write_text(str(cgroup_memory()["usage"] + 4 * 2**20))
    writer = CheckpointWriter()
    mode = host_memory.decide(writer, None, tree, None, None, 1)
    limit.write_text(str(4 * 2**30))  # room again for the write and the read back
    staged = host_memory.unstaged(tree) if mode == "synchronous" else writer.stage(tree)
    writer.submit(root, 1, staged["weights"], staged["optimizer"], staged["state"], {"step": 1}, {}, 1)
    writer.join()
    result = writer.wait()
    loaded = ckpt.load_checkpoint(result.path)
    equal = all(torch.equal(loaded.weights[k], v) for k, v in model.state_dict().items())
    print(json.dumps({"mode": mode, "plan": writer.plan.record(), "equal": equal, "verify": ckpt.verify(result.path)}))
""")


def test_a_cgroup_with_little_room_makes_the_save_synchronous(tmp_path):
    from tests.cgroups import limit_file, memory_cgroup

    with memory_cgroup(4 * 2**30) as folder:
        proc = subprocess.run(
            [sys.executable, "-c", IN_CGROUP, str(limit_file(folder)), str(tmp_path / "ck")],
            preexec_fn=lambda: (folder / "cgroup.procs").write_text(str(os.getpid())),
            capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("trainforge.trainer.host_memory: checkpoint staging:")]
    assert out["mode"] == "synchronous" and "no copy" in line and f"of {folder}, less" in line, line
    assert out["plan"]["budget_bytes"] < out["plan"]["state_bytes"] and out["plan"]["source"].startswith("cgroup v")
    assert out["equal"] and out["verify"] == []
