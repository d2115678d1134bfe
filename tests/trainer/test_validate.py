"""trainforge.trainer.validate on checkpoints of a real (single-process) training run: good, NaN, tampered."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import safetensors.torch

from trainforge.trainer import checkpoint as ckpt
from trainforge.storage.files import atomic_write_json, sha256_file
from trainforge.trainer.validate import main, pick_checkpoint, validate_checkpoint

CHECK_NAMES = ["manifest", "file_hashes", "meta", "consistency", "weights_load", "shapes", "finite", "eval", "sample"]


def _copy_step(trained_run, tmp_path, step: int = 20):
    src = trained_run["checkpoints"] / ckpt.step_dir_name(step)
    return shutil.copytree(src, tmp_path / "checkpoints" / src.name)


def _checks(report) -> dict[str, bool]:
    return {c["name"]: c["ok"] for c in report["checks"]}


def test_good_checkpoint_passes_every_check(trained_run, dataset_dir):
    step_dir = trained_run["checkpoints"] / "step-00000020"
    report = validate_checkpoint(step_dir, dataset_dir, max_eval_tokens=32 * 40)
    assert [c["name"] for c in report["checks"]] == CHECK_NAMES
    assert report["ok"] is True, report["checks"]
    assert report["step"] == 20 and report["checkpoint"] == str(step_dir.resolve())
    assert report["checkpoint_digest"] == sha256_file(step_dir / "manifest.json")
    m = report["metrics"]
    assert m["val_tokens"] == 32 * 40
    assert m["val_perplexity"] == pytest.approx(math.exp(m["val_loss"]))
    split = json.loads((dataset_dir / "manifest.json").read_text())["splits"]["validation"]
    est_bytes = m["val_tokens"] * split["bytes_utf8"] / split["tokens"]
    assert m["val_bits_per_byte"] == pytest.approx(m["val_loss"] * m["val_tokens"] / math.log(2) / est_bytes)
    # 20 steps on a 320-token vocabulary beat the uniform guess by far; the unigram floor is finite
    assert m["val_perplexity"] < 320 and 1 < m["unigram_perplexity"] < 320
    assert report["sample"]["prompt"] == "ROMEO:" and isinstance(report["sample"]["text"], str)


def test_nan_weights_fail_finite_and_eval_only(trained_run, dataset_dir, tmp_path):
    step_dir = _copy_step(trained_run, tmp_path)
    weights = safetensors.torch.load_file(step_dir / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    safetensors.torch.save_file(weights, step_dir / "model.safetensors", metadata={"format": "pt"})
    manifest = json.loads((step_dir / "manifest.json").read_text())  # re-sign: a NaN that hashes fine
    manifest["files"]["model.safetensors"] = {"bytes": (step_dir / "model.safetensors").stat().st_size,
                                              "sha256": sha256_file(step_dir / "model.safetensors")}
    atomic_write_json(step_dir / "manifest.json", manifest)

    report = validate_checkpoint(step_dir, dataset_dir, max_eval_tokens=32 * 8)
    checks = _checks(report)
    assert report["ok"] is False
    assert not checks["finite"] and not checks["eval"]
    assert all(checks[n] for n in ("manifest", "file_hashes", "meta", "weights_load", "shapes"))
    detail = next(c["detail"] for c in report["checks"] if c["name"] == "finite")
    assert "model.layers.1.mlp.down_proj.weight" in detail
    assert report["metrics"]["val_loss"] is None  # JSON has no NaN: non-finite metrics are null


def test_tampered_and_unmanifested_checkpoints(trained_run, dataset_dir, tmp_path):
    step_dir = _copy_step(trained_run, tmp_path)
    data = bytearray((step_dir / "optimizer.pt").read_bytes())
    data[100] ^= 0xFF
    (step_dir / "optimizer.pt").write_bytes(bytes(data))
    checks = _checks(validate_checkpoint(step_dir, dataset_dir, max_eval_tokens=64))
    assert checks["file_hashes"] is False and checks["eval"] is True  # every check still ran

    (step_dir / "manifest.json").unlink()
    report = validate_checkpoint(step_dir, dataset_dir, max_eval_tokens=64)
    checks = _checks(report)
    assert report["ok"] is False and checks["manifest"] is False and checks["file_hashes"] is False
    assert report["checkpoint_digest"] is None and checks["weights_load"] is True


def test_pick_checkpoint(trained_run, tmp_path):
    root = trained_run["checkpoints"]
    assert pick_checkpoint(root) == root / "step-00000020"
    assert pick_checkpoint(root, 10) == root / "step-00000010"
    empty = tmp_path / "empty"
    (empty / "step-00000030").mkdir(parents=True)  # no manifest: not picked
    assert pick_checkpoint(empty) is None


def test_cli_exit_codes(trained_run, dataset_dir, tmp_path, capsys):
    report = tmp_path / "report.json"
    args = ["--checkpoints", str(trained_run["checkpoints"]), "--dataset", str(dataset_dir), "--report", str(report),
            "--max-eval-tokens", "256"]
    assert main(args) == 0
    assert json.loads(report.read_text())["format"] == "trainforge.validation/v1"
    assert main(args + ["--step", "15"]) == 78
    assert "--step 15" in capsys.readouterr().err
    assert main(["--checkpoints", str(tmp_path / "nope"), "--dataset", str(dataset_dir), "--report", str(report)]) == 78
    assert main(["--checkpoints", str(trained_run["checkpoints"]), "--dataset", str(tmp_path), "--report",
                 str(report)]) == 78  # a folder without a dataset manifest
    (tmp_path / "empty").mkdir()
    assert main(["--checkpoints", str(tmp_path / "empty"), "--dataset", str(dataset_dir), "--report", str(report)]) == 1
    assert json.loads(report.read_text())["ok"] is False


def test_the_program_says_what_the_validation_cost_beside_its_evaluation(trained_run, dataset_dir,
                                                                          tmp_path):
    import subprocess
    import sys

    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "trainforge.trainer.validate", "--checkpoints",
                           str(trained_run["checkpoints"]), "--dataset", str(dataset_dir), "--report",
                           str(report), "--max-eval-tokens", str(32 * 40)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    s = json.loads(report.read_text())["seconds"]
    assert s["imports"] > 0 and s["evaluation"] > 0 and s["sample"] > 0 and s["other"] > 0
    assert s["total"] == pytest.approx(s["imports"] + s["evaluation"] + s["sample"] + s["other"],
                                       abs=0.01)
    assert f"time: {s['total']:.1f}s from process start: imports {s['imports']:.1f}s, " \
           f"evaluation {s['evaluation']:.1f}s" in done.stdout
