"""trainforge.trainer.checkpoint: layout, verification (tamper detection), newest valid, retention, loading."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch

from trainforge.trainer import checkpoint as ckpt


def _write(root, step: int, value: float = 1.0):
    weights = {"w": torch.full((4, 3), value), "b": torch.arange(5, dtype=torch.float32)}
    optimizer = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(4, 3)}},
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}],
    }
    state = {
        "step": step,
        "tokens_seen": step * 256,
        "world_size": 1,
        "scheduler": {"step": step},
        "rng": [ckpt.capture_rng_state()],
    }
    return ckpt.write_checkpoint(
        root, step, weights, optimizer, state, {"step": step, "metrics": {"train_loss": 1.5}}
    )


def test_layout_and_manifest(tmp_path):
    path = _write(tmp_path, 100)
    assert path == tmp_path / "step-00000100"
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json",
        "meta.json",
        "model.safetensors",
        "optimizer.pt",
        "trainer_state.pt",
    ]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "trainforge.checkpoint/v1" and manifest["step"] == 100
    assert set(manifest["files"]) == set(ckpt.REQUIRED_FILES)
    assert (
        manifest["files"]["model.safetensors"]["bytes"]
        == (path / "model.safetensors").stat().st_size
    )
    assert ckpt.verify(path) == []
    assert not list(path.glob("*.tmp-*"))  # the atomic write left no temporary file


def test_load_round_trip_is_weights_only(tmp_path):
    random.seed(5)
    c = ckpt.load_checkpoint(_write(tmp_path, 7, value=2.5))
    assert c.step == 7 and torch.equal(c.weights["w"], torch.full((4, 3), 2.5))
    assert c.optimizer["param_groups"][0]["betas"] == (0.9, 0.95)
    assert c.meta["metrics"]["train_loss"] == 1.5
    expected = random.random()
    ckpt.restore_rng_state(c.trainer_state["rng"][0])  # back to the state captured at write time
    assert random.random() == expected


def test_rng_state_round_trip():
    state = ckpt.capture_rng_state()
    first = (torch.rand(3), np.random.rand(2), random.random())
    ckpt.restore_rng_state(state)
    again = (torch.rand(3), np.random.rand(2), random.random())
    assert (
        torch.equal(first[0], again[0])
        and np.array_equal(first[1], again[1])
        and first[2] == again[2]
    )


def _flip_byte(path, offset: int = -3) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        (lambda p: _flip_byte(p / "model.safetensors"), "model.safetensors: SHA-256"),
        (lambda p: _flip_byte(p / "optimizer.pt", 40), "optimizer.pt: SHA-256"),
        (lambda p: (p / "meta.json").write_text("{}"), "meta.json: 2 bytes on disk, manifest says"),
        (
            lambda p: (p / "trainer_state.pt").unlink(),
            "trainer_state.pt: listed in the manifest but missing",
        ),
        (
            lambda p: (p / "manifest.json").unlink(),
            "manifest.json: missing (a folder without a manifest is not",
        ),
        (lambda p: (p / "manifest.json").write_text('{"format": "x"}'), "format='x'"),
        (lambda p: (p / "manifest.json").write_text("{trunc"), "unreadable"),
    ],
)
def test_verify_reports_damage(tmp_path, damage, fragment):
    path = _write(tmp_path, 10)
    damage(path)
    problems = ckpt.verify(path)
    assert any(fragment in p for p in problems), problems


def test_manifest_step_must_match_folder(tmp_path):
    path = _write(tmp_path, 10)
    moved = path.rename(tmp_path / "step-00000020")
    assert any("does not match the folder name" in p for p in ckpt.verify(moved))


def test_newest_valid_skips_broken_and_partial_folders(tmp_path):
    for step in (10, 20, 30):
        _write(tmp_path, step)
    _flip_byte(tmp_path / "step-00000030" / "model.safetensors")
    (tmp_path / "step-00000040").mkdir()  # a killed write: no manifest
    (tmp_path / "not-a-step").mkdir()
    assert ckpt.newest_valid(tmp_path) == tmp_path / "step-00000020"
    assert ckpt.newest_valid(tmp_path / "missing") is None


def test_retention_keeps_newest_valid_and_never_touches_newer_folders(tmp_path):
    for step in (10, 20, 30, 40):
        _write(tmp_path, step)
    (tmp_path / "step-00000015").mkdir()  # partial write older than the newest valid: garbage
    _flip_byte(tmp_path / "step-00000040" / "model.safetensors")  # newest folder is corrupt
    (tmp_path / "step-00000050").mkdir()  # newer than the newest valid: maybe being written
    deleted = ckpt.apply_retention(tmp_path, keep_last=1)
    left = [p.name for _, p in ckpt.list_step_dirs(tmp_path)]
    assert left == ["step-00000030", "step-00000040", "step-00000050"]
    assert sorted(p.name for p in deleted) == ["step-00000010", "step-00000015", "step-00000020"]
    assert ckpt.newest_valid(tmp_path) == tmp_path / "step-00000030"


def test_retention_keep_last_two(tmp_path):
    for step in (10, 20, 30):
        _write(tmp_path, step)
    ckpt.apply_retention(tmp_path, keep_last=2)
    assert [s for s, _ in ckpt.list_step_dirs(tmp_path)] == [20, 30]
    assert ckpt.apply_retention(tmp_path / "missing", keep_last=2) == []


def test_rewrite_replaces_a_partial_folder_and_keeps_a_valid_one(tmp_path):
    partial = tmp_path / "step-00000010"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    _write(tmp_path, 10, value=1.0)
    assert ckpt.verify(partial) == []
    _write(tmp_path, 10, value=9.0)  # same step again: the valid folder is kept as it is
    assert torch.equal(ckpt.load_checkpoint(partial).weights["w"], torch.full((4, 3), 1.0))


def test_load_refuses_pickled_objects(tmp_path):
    path = _write(tmp_path, 10)
    torch.save({"step": 10, "evil": shutil.rmtree}, path / "trainer_state.pt")  # arbitrary object
    with pytest.raises(
        ckpt.CheckpointError, match="trainer_state|Weights only load failed|weights_only"
    ):
        ckpt.load_checkpoint(path)


def test_retention_checks_the_trusted_folder_by_size_and_the_others_by_hash(tmp_path, monkeypatch):
    for step in (10, 20, 30):
        _write(tmp_path, step)
    hashed = []
    real = ckpt.verify
    monkeypatch.setattr(ckpt, "verify", lambda p, hashes=True, **kw: hashed.append((p.name, hashes)) or real(p, hashes, **kw))
    deleted = ckpt.apply_retention(tmp_path, keep_last=2, trusted=tmp_path / "step-00000030")
    assert [p.name for p in deleted] == ["step-00000010"]
    assert dict(hashed) == {"step-00000030": False, "step-00000020": True, "step-00000010": True}
