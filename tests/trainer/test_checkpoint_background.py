"""Checkpoints written in the background (trainforge.trainer.checkpoint_writer, trainer/state.py).

The staging copies, the writer's rules (retention, abandon, failures), and the trainer around it:
run in this process (``main()``) with a write held or failing where a test needs it, and once as
its own process SIGKILLed while a write is held.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from trainforge.trainer import checkpoint as ckpt
from trainforge.trainer import state
from trainforge.trainer.checkpoint_writer import CheckpointWriter, HostStager, storage_addresses
from trainforge.trainer.train import main

SHORT = {"optim": {"max_steps": 12, "warmup_steps": 2}, "checkpoint": {"interval_steps": 4, "keep_last": 2}}


def _state(step: int, value: float = 1.0) -> dict:
    return {"weights": {"w": torch.full((4, 3), value)},
            "optimizer": {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.ones(4, 3)}},
                          "param_groups": [{"lr": 0.1, "params": [0]}]},
            "trainer_state": {"step": step, "tokens_seen": 0, "world_size": 1, "scheduler": {"step": step},
                              "rng": [ckpt.capture_rng_state()]},
            "meta": {"step": step}, "rank_files": {}}


def _submit(writer: CheckpointWriter, root: Path, step: int, keep_last: int = 1, **callbacks):
    s = writer.stage(_state(step))
    return writer.submit(root, step, s["weights"], s["optimizer"], s["trainer_state"], s["meta"], s["rank_files"],
                         keep_last, **callbacks)


@pytest.fixture
def held(monkeypatch):
    """``held(folder_name)``: the write of that step folder stops after its files are written and
    before they are hashed (no manifest yet) until ``.release`` is set; ``.entered`` is set then."""
    real = ckpt._digests

    class Hold:
        def __init__(self, name: str) -> None:
            self.name, self.entered, self.release = name, threading.Event(), threading.Event()

    holds: list[Hold] = []

    def digests(folder, names):
        for hold in holds:
            if Path(folder).name == hold.name:
                hold.entered.set()
                assert hold.release.wait(60), f"{hold.name}: never released"
        return real(folder, names)

    monkeypatch.setattr(ckpt, "_digests", digests)

    def make(name: str) -> Hold:
        holds.append(Hold(name))
        return holds[-1]

    yield make
    for hold in holds:
        hold.release.set()


def test_staging_copies_what_training_changes_and_keeps_private_copies():
    live = torch.zeros(3)
    gathered = torch.ones(2)  # as FSDP's full state on rank 0: nothing else holds it
    tree = {"live": live, "gathered": gathered, "nested": [{"n": 7}, (live,)]}
    staged = HostStager().stage(tree, shared=storage_addresses(iter([live])))
    live.add_(5)  # training goes on
    assert torch.equal(staged["live"], torch.zeros(3)) and torch.equal(staged["nested"][1][0], torch.zeros(3))
    assert staged["gathered"] is gathered and staged["nested"][0] == {"n": 7}
    assert isinstance(staged["nested"][1], tuple) and staged["nested"] is not tree["nested"]
    copied = HostStager().stage({"t": live[::2]})["t"]  # shared=None: every tensor copied, contiguous
    assert copied.is_contiguous() and torch.equal(copied, torch.full((2,), 5.0))
    assert not copied.is_pinned()  # no pinning without CUDA


@pytest.mark.gpu
def test_cuda_state_is_staged_into_pinned_buffers_reused_across_saves():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (install a CUDA build of torch and the NVIDIA driver)")
    stager = HostStager()
    w = torch.randn(1024, 1024, device="cuda")
    step = torch.tensor(3.0, device="cuda")  # fused AdamW keeps its step on the device
    first = stager.stage({"w": w, "opt": {"step": step}})
    assert first["w"].is_pinned() and torch.equal(first["w"], w.cpu()) and first["opt"]["step"].item() == 3.0
    address = first["w"].data_ptr()
    w.mul_(2)
    second = stager.stage({"w": w, "opt": {"step": step}})
    assert second["w"].data_ptr() == address and torch.equal(second["w"], w.cpu())  # the same buffer
    assert stager.pinned_bytes == w.numel() * 4 + 4


def test_retention_keeps_the_last_complete_checkpoint_while_a_newer_one_is_written(tmp_path, held):
    writer = CheckpointWriter()
    for step in (1, 2):
        _submit(writer, tmp_path, step)
        assert writer.wait().error is None
    hold = held("step-00000003")
    folder = _submit(writer, tmp_path, 3)
    assert hold.entered.wait(30)
    assert [s for s, _ in ckpt.list_step_dirs(tmp_path)] == [2, 3]  # retention took step 1 after step 2
    assert ckpt.newest_valid(tmp_path) == tmp_path / "step-00000002"
    assert any("manifest.json: missing" in p for p in ckpt.verify(folder))
    with pytest.raises(RuntimeError, match="step 3 still holds the staging buffers"):
        writer.stage(_state(4))
    hold.release.set()
    result = writer.wait()
    assert result.error is None and result.path == folder and result.deleted == 1
    assert [s for s, _ in ckpt.list_step_dirs(tmp_path)] == [3] and not ckpt.verify(folder)


def test_an_abandoned_write_never_publishes_its_manifest(tmp_path, held):
    writer, ended = CheckpointWriter(), []
    hold = held("step-00000005")
    folder = _submit(writer, tmp_path, 5, on_ended=ended.append)
    assert hold.entered.wait(30)
    writer.abandon()  # the process is exiting
    hold.release.set()
    result = writer.wait()
    assert isinstance(result.error, ckpt.CheckpointError) and "abandoned" in str(result.error)
    assert not (folder / ckpt.MANIFEST).exists() and ckpt.newest_valid(tmp_path) is None
    assert ended == [result]


def test_a_manifest_being_published_is_reported_before_abandon_returns(tmp_path):
    """What the trainer's result names on SIGTERM: abandon waits for a manifest being written
    and for its report, so a checkpoint on disk is never missing from the result."""
    writer, reported, in_report, release = CheckpointWriter(), [], threading.Event(), threading.Event()

    def on_written(folder):
        in_report.set()
        assert release.wait(30)
        reported.append(folder)

    folder = _submit(writer, tmp_path, 5, on_written=on_written)
    assert in_report.wait(30) and (folder / ckpt.MANIFEST).exists()  # published, not reported yet
    abandoning = threading.Thread(target=writer.abandon)
    abandoning.start()
    abandoning.join(0.5)
    assert abandoning.is_alive() and reported == []  # abandon waits for the report
    release.set()
    abandoning.join(30)
    assert not abandoning.is_alive() and reported[0] == folder
    result = writer.wait()
    assert result.error is None and result.path == folder and not ckpt.verify(folder)


@pytest.fixture
def run_main(tmp_path, job_file, monkeypatch):
    """``run_main(**sections) -> (exit code, result, job dir)``: the trainer's ``main()`` in this
    process (one rank, no MLflow); the signal handler and logging it changes are put back."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRAINFORGE_RESULT_FILE", str(tmp_path / "result.json"))
    monkeypatch.setenv("TRAINFORGE_JOB_DIR", str(tmp_path / "job"))
    handler, handlers, level = signal.getsignal(signal.SIGTERM), logging.root.handlers[:], logging.root.level

    def run(**sections):
        code = main(["--config", str(job_file(**{**SHORT, **sections}))])
        return code, json.loads((tmp_path / "result.json").read_text()), tmp_path / "job"

    yield run
    signal.signal(signal.SIGTERM, handler)
    logging.root.handlers[:], logging.root.level = handlers, level
    state.abandon_pending_write()  # a failed test's write must not outlive it


def test_the_final_save_is_awaited_and_recorded_in_the_ledger(run_main, tmp_path, held, monkeypatch):
    real_wait, awaited = CheckpointWriter.wait, threading.Event()

    def wait(self):
        if self._step == 12:  # waiting on the final write itself, not on the one before it
            awaited.set()
        return real_wait(self)

    monkeypatch.setattr(CheckpointWriter, "wait", wait)
    hold = held("step-00000012")
    threading.Thread(target=lambda: awaited.wait(60) and hold.release.set(), daemon=True).start()
    code, result, job_dir = run_main()
    assert code == 0 and awaited.is_set() and hold.entered.is_set()  # the write went on only once awaited
    final = tmp_path / "checkpoints" / "step-00000012"
    assert result["status"] == "success" and result["last_checkpoint"] == str(final)
    assert ckpt.verify(final) == [] and [s for s, _ in ckpt.list_step_dirs(final.parent)] == [8, 12]
    assert not [t for t in threading.enumerate() if t.name == "checkpoint-writer"]
    (record,) = [json.loads(p.read_text()) for p in (job_dir / "ledger").glob("attempt-*.json")]
    assert record["final"] and record["background_save_s"] > 0  # three writes' seconds, in no bucket
    assert "background_save_s" not in record["seconds"]


@pytest.mark.parametrize(("failing", "last_checkpoint"), [
    ("step-00000004", None),  # raised at the next save (step 8)
    ("step-00000012", "step-00000008"),  # raised at the final await
])
def test_a_failed_background_write_fails_the_attempt_as_a_checkpoint_error(
        run_main, tmp_path, monkeypatch, failing, last_checkpoint):
    real = safetensors.torch.save_file

    def save_file(tensors, filename, metadata=None):
        if Path(filename).parent.name == failing:
            raise OSError(28, "No space left on device")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    code, result, _ = run_main()
    assert code == 1 and result["status"] == "error"
    step = int(failing.split("-")[1])
    assert result["message"].startswith(f"writing checkpoint step {step} in the background failed: CheckpointError")
    assert "No space left on device" in result["message"]
    root = tmp_path / "checkpoints"
    assert result["last_checkpoint"] == (str(root / last_checkpoint) if last_checkpoint else None)
    assert ckpt.verify(root / failing)  # the failed folder never counts
    assert result["final_step"] == (8 if step == 4 else 12)


HELD_TRAINER = textwrap.dedent("""
    import sys, threading
    from pathlib import Path
    from trainforge.trainer import checkpoint as ckpt
    from trainforge.trainer.train import main

    job, held, marker = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    real = ckpt._digests

    def digests(folder, names):  # the write of `held` stops, files written, no manifest
        if Path(folder).name == held:
            marker.write_text("held")
            threading.Event().wait()
        return real(folder, names)

    ckpt._digests = digests
    sys.exit(main(["--config", job]))
""")


def test_sigkill_during_a_background_write_resumes_from_the_previous_checkpoint(tmp_path, dataset_dir, tools):
    root = tmp_path / "ck"
    job = tools.write_job(tmp_path / "job.json", tools.make_job(
        dataset_dir, root, optim=SHORT["optim"], checkpoint=SHORT["checkpoint"], logging={"log_every_steps": 1}))
    script, marker, log = tmp_path / "held_trainer.py", tmp_path / "held", tmp_path / "held.log"
    script.write_text(HELD_TRAINER)
    env = tools.env(tmp_path / "result.json")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(script), str(job), "step-00000008", str(marker)],
                                cwd=tools.repo_root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (marker.exists() and "step 10/12" in log.read_text()):  # held, and training went on
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    partial = root / "step-00000008"
    assert any("manifest.json: missing" in p for p in ckpt.verify(partial))
    assert ckpt.newest_valid(root) == root / "step-00000004"

    resumed = tools.run_trainer(job, tmp_path / "result.json")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"resuming from {root / 'step-00000004'} " in resumed.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["final_step"] == 12 and result["last_checkpoint"] == str(root / "step-00000012")
    assert [s for s, _ in ckpt.list_step_dirs(root)] == [8, 12]
    assert all(not ckpt.verify(p) for _, p in ckpt.list_step_dirs(root))  # the partial one was rewritten


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_the_adamw_state_reserved_before_the_first_step_has_the_paths_and_shapes_it_will_have(fused):
    """The saves' buffers are reserved before AdamW has any state: by the shapes it will have."""
    from trainforge.trainer.state import _adamw_state_to_come

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.AdamW([{"params": [model[0].weight]},
                                   {"params": [model[0].bias, model[1].weight, model[1].bias]}], fused=fused or None)
    expected = _adamw_state_to_come(optimizer)["state"]
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    real = optimizer.state_dict()["state"]
    assert set(real) == set(expected) == {0, 1, 2, 3}
    for index, entry in real.items():
        assert set(entry) == set(expected[index])
        for key, tensor in entry.items():
            want = expected[index][key]
            assert (tensor.shape, tensor.dtype, tensor.device) == (want.shape, want.dtype, want.device), (index, key)


def test_a_divergence_while_a_write_is_in_flight_completes_that_checkpoint_first(
        run_main, tmp_path, held, monkeypatch):
    """Training diverges at step 6 while the step-4 checkpoint is still being written: the write
    finishes (it precedes the divergence) before the result names it, instead of being abandoned
    at exit with no manifest."""
    from trainforge.trainer import train as train_mod

    hold = held("step-00000004")
    real = train_mod.should_step

    def should_step(step, loss, grad_norm, lr, scale):
        if step == 6:
            assert hold.entered.wait(60)  # the step-4 write is in flight, its manifest not written
            threading.Timer(0.5, hold.release.set).start()
            loss = float("nan")
        return real(step, loss, grad_norm, lr, scale)

    monkeypatch.setattr(train_mod, "should_step", should_step)
    code, result, _ = run_main()
    assert code == 79 and result["status"] == "diverged", result
    step4 = tmp_path / "checkpoints" / "step-00000004"
    assert result["last_checkpoint"] == str(step4) and ckpt.verify(step4) == []
    assert ckpt.newest_valid(step4.parent) == step4
    assert not [t for t in threading.enumerate() if t.name == "checkpoint-writer"]
