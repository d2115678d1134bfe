"""The trainer on an examples dataset (chat data rendered with a real chat template): the loss
falls, a resumed run logs the uninterrupted run's losses and ends on its weights, two ranks log
the one-rank run's losses (the loss is per loss token of the global batch, whatever the world
size and accumulation), and the checkpoint's validation counts the assistant's tokens only."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import safetensors.torch
import torch

from tests.trainer.chat_examples import build_examples_dataset
from trainforge.trainer.data import ExampleIndex, open_dataset
from trainforge.trainer.validate import validate_checkpoint

STEPS = 8
SECTIONS = {"data": {"sequence_length": 96},
            "optim": {"max_steps": STEPS, "warmup_steps": 2, "global_batch_size": 8, "micro_batch_size": 2},
            "checkpoint": {"interval_steps": 4, "keep_last": 2}, "logging": {"log_every_steps": 1}}


def _losses(log: str) -> list[tuple[float, int]]:
    """(loss, loss_tokens) of each logged step, from rank 0's step lines."""
    return [(float(line.split("| loss ")[1].split()[0]), int(line.split("| loss_tokens ")[1].split()[0]))
            for line in log.splitlines() if " | loss " in line]


@pytest.fixture(scope="module")
def chat_dataset(tmp_path_factory, hf_model):
    return build_examples_dataset(tmp_path_factory.mktemp("chat") / "ds", hf_model("qwen3"), sequence_length=96)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, chat_dataset, tools):
    tmp = tmp_path_factory.mktemp("one")
    job = tools.write_job(tmp / "job.json", tools.make_job(chat_dataset, tmp / "ck", **SECTIONS))
    proc = tools.run_trainer(job, tmp / "result.json")
    assert proc.returncode == 0, proc.stdout[-4000:]
    return {"dir": tmp / "ck", "job": job, "losses": _losses(proc.stdout),
            "result": json.loads((tmp / "result.json").read_text())}


def test_the_loss_falls_and_counts_the_loss_tokens_of_each_step(one_rank):
    losses = one_rank["losses"]
    assert len(losses) == STEPS
    assert np.mean([loss for loss, _ in losses[-2:]]) < np.mean([loss for loss, _ in losses[:2]]) - 0.5
    counts = {n for _, n in losses}
    assert len(counts) > 1 and all(0 < n < 8 * 96 for n in counts)  # loss tokens, not padded positions
    meta = json.loads((one_rank["dir"] / "step-00000008" / "meta.json").read_text())
    assert meta["metrics"]["loss_tokens"] == losses[-1][1]
    assert one_rank["result"]["tokens_seen"] == STEPS * 8 * 96  # positions processed, padding included


def test_a_resumed_run_logs_the_uninterrupted_runs_losses(one_rank, tmp_path, chat_dataset, tools):
    ck = shutil.copytree(one_rank["dir"], tmp_path / "ck")
    shutil.rmtree(ck / "step-00000008")  # as if killed after the checkpoint of step 4
    job = tools.write_job(tmp_path / "job.json", tools.make_job(chat_dataset, ck, **SECTIONS))
    proc = tools.run_trainer(job, tmp_path / "result.json")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert f"resuming from {ck / 'step-00000004'}" in proc.stdout
    assert _losses(proc.stdout) == one_rank["losses"][4:]
    ours = safetensors.torch.load_file(ck / "step-00000008" / "model.safetensors")
    theirs = safetensors.torch.load_file(one_rank["dir"] / "step-00000008" / "model.safetensors")
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


@pytest.mark.distributed
def test_two_ranks_log_the_one_rank_losses(one_rank, tmp_path, chat_dataset, tools):
    sections = {**SECTIONS, "optim": {**SECTIONS["optim"], "micro_batch_size": 4}}  # 1 x 4 per rank, not 4 x 2
    job = tools.write_job(tmp_path / "job.json", tools.make_job(chat_dataset, tmp_path / "ck", **sections))
    proc = tools.run_trainer(job, tmp_path / "result.json", nproc=2, timeout_s=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    two = _losses(proc.stdout)
    assert [n for _, n in two] == [n for _, n in one_rank["losses"]]  # the same global batches
    # micro-batches of 2 examples on one rank, of 4 on two: a mean of micro-batch means would differ
    assert [loss for loss, _ in two] == pytest.approx([loss for loss, _ in one_rank["losses"]], rel=5e-5)


def test_validation_counts_the_assistant_tokens_only(one_rank, chat_dataset):
    report = validate_checkpoint(one_rank["dir"] / "step-00000008", chat_dataset, max_new_tokens=4)
    index = ExampleIndex(open_dataset(chat_dataset), "validation")
    targets = sum(int(np.count_nonzero(index.example(k)[1][1:])) for k in range(len(index)))
    assert report["metrics"]["val_tokens"] == targets
    assert report["metrics"]["val_loss"] < one_rank["losses"][0][0]
