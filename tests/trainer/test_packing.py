"""Packed examples (trainforge.trainer.packing): no cross-talk between the examples of a row, the
packed sampler's recipe, and training with packing. References: plain transformers on each
example alone and unpadded (loss and every parameter's gradient), the recipe in the sampler's
docstring rebuilt here, `pad_examples` for each example's inputs and targets, and the
uninterrupted run."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import safetensors.torch
import torch

from tests.trainer.chat_examples import build_examples_dataset, conversations
from tests.trainer.test_train_examples import _losses
from trainforge.data.chat import ChatRenderer
from trainforge.trainer import loss as losses
from trainforge.trainer.config import parse_job_config
from trainforge.trainer.data import ExampleIndex, PackedExampleSampler, make_sampler, open_dataset, pad_examples
from trainforge.trainer.errors import ConfigError
from trainforge.trainer.packing import pack_examples, pack_rows

T = 160  # positions per packed row: two or three of the rendered examples
#: (family, the attention kernel transformers runs): Gemma 2's softcapping and sliding window
#: (16 positions in the tiny model) need eager; the others run sdpa as the trainer loads them.
CASES = [("qwen3", "sdpa"), ("qwen3", "eager"), ("llama", "sdpa"), ("gemma2", "eager")]


@pytest.fixture(scope="module")
def family_model(hf_model):
    """``family_model(family, attention) -> (model, examples)``: the tiny fp32 model and ten of
    its family's rendered conversations, as (ids (L,) int64, mask (L,) uint8)."""
    from transformers import AutoModelForCausalLM

    made = {}

    def make(family: str, attention: str):
        if (family, attention) not in made:
            folder = hf_model(family)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attention)
            renderer = ChatRenderer.from_folder(folder)
            rendered = [renderer.render(c) for c in conversations(14, 3)]
            examples = [(np.asarray(r.ids), np.asarray(r.mask, dtype=np.uint8)) for r in rendered
                        if len(r.ids) <= T + 1][:10]
            made[family, attention] = (model.eval(), examples)
        return made[family, attention]

    return make


def _packed(examples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bounds = pack_rows(np.array([len(t) - 1 for t, _ in examples]), T)
    rows = [examples[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
    assert any(len(row) > 1 for row in rows), "no row holds two examples: nothing could attend across"
    return pack_examples(rows, T, pad_id=0)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _alone(model, examples) -> tuple[float, dict[str, torch.Tensor]]:
    """Plain transformers, each example alone and unpadded: its nats summed, and their gradient."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for tokens, mask in examples:
        labels = torch.where(torch.from_numpy(mask.astype(bool)), torch.from_numpy(tokens), -100)
        nats = model(input_ids=torch.from_numpy(tokens)[None], labels=labels[None]).loss * int(mask[1:].sum())
        nats.backward()
        total += float(nats.detach())
    return total, _grads(model)


@pytest.mark.parametrize(("family", "attention"), CASES, ids=[f"{f}-{a}" for f, a in CASES])
def test_a_packed_batch_equals_each_example_run_alone(family_model, family, attention):
    model, examples = family_model(family, attention)
    x, y, positions = _packed(examples)
    assert (y[:, -1] == losses.IGNORE_INDEX).any() and (positions[:, -1] > 0).any()  # padded rows
    reference, reference_grads = _alone(model, examples)
    for chunk_tokens in (0, 64):  # plain and chunked (Gemma 2's softcap: plain both times)
        summed = losses.lm_loss(model, x, y, chunk_tokens=chunk_tokens, reduction="sum", position_ids=positions)
        summed.backward()
        assert float(summed.detach()) == pytest.approx(reference, rel=1e-5)
        grads = _grads(model)
        assert grads.keys() == reference_grads.keys()
        for name, ref in reference_grads.items():  # relative 1e-5 of each tensor's largest gradient
            error = (grads[name] - ref).abs().max().item() / ref.abs().max().item()
            assert error < 1e-5, f"{name}: max |gradient - reference| is {error:.2e} of max |reference|"


def _without_restart(x, y, positions, monkeypatch):
    return x, y, torch.arange(T).expand_as(positions)  # one sequence per row: attends across examples


def _without_mask(x, y, positions, monkeypatch):
    from transformers import masking_utils

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    return x, y, positions  # positions restart, attention is plain causal over the whole row


@pytest.mark.parametrize("broken", [_without_restart, _without_mask], ids=["no-restart", "no-mask"])
@pytest.mark.parametrize(("family", "attention"), CASES[::2], ids=[f"{f}-{a}" for f, a in CASES[::2]])
def test_the_comparison_sees_cross_talk(family_model, family, attention, broken, monkeypatch):
    """What the test above would see if packing let one example attend to another."""
    model, examples = family_model(family, attention)
    x, y, positions = broken(*_packed(examples), monkeypatch)
    reference, _ = _alone(model, examples)
    with torch.no_grad():
        summed = float(losses.lm_loss(model, x, y, reduction="sum", position_ids=positions))
    assert abs(summed - reference) / reference > 1e-4


SEQ = 96  # the dataset's longest example; the sampler packs into rows of 2 x SEQ positions


@pytest.fixture(scope="module")
def examples_dir(tmp_path_factory, hf_model):
    return build_examples_dataset(tmp_path_factory.mktemp("chat") / "ds", hf_model("qwen3"), sequence_length=SEQ)


def _sampler(ds, world: int, accum: int, micro: int = 2, seed: int = 7) -> PackedExampleSampler:
    return PackedExampleSampler(ExampleIndex(ds, "train"), 2 * SEQ, micro, accum, world, seed,
                                ds.examples.sequence_length)


def _recipe(lengths: np.ndarray, seed: int, epochs: int, seq_len: int) -> list[list[list[int]]]:
    """The docstring's recipe, written out: each epoch's permutation, cut greedily in order into
    rows of at most ``seq_len`` positions (L - 1 for an example of L tokens). [epoch][row]: examples."""
    plans = []
    for epoch in range(epochs):
        order = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch]))).permutation(len(lengths))
        rows, row, used = [], [], 0
        for k in order.tolist():
            if used + lengths[k] - 1 > seq_len:
                rows.append(row)
                row, used = [], 0
            row.append(k)
            used += lengths[k] - 1
        plans.append(rows + [row])
    return plans


def test_the_packed_sampler_follows_its_recipe_and_takes_every_example_once_per_epoch(examples_dir):
    ds = open_dataset(examples_dir)
    index = ExampleIndex(ds, "train")
    sampler = _sampler(ds, 1, 2)  # G = 4 rows a step; epochs end mid-step
    plans = _recipe(index.lengths, 7, 4, 2 * SEQ)
    recipe = [row for plan in plans for row in plan]  # the epochs' rows end to end
    drawn = [row.tolist() for s in range(len(recipe) // 4) for row in sampler.rows(s)]
    assert drawn == recipe[:len(drawn)] and len(drawn) > sum(len(plan) for plan in plans[:3])
    for plan in plans:
        assert sorted(k for row in plan for k in row) == list(range(len(index)))  # each example once an epoch
    assert all(sum(int(index.lengths[k]) - 1 for k in row) <= 2 * SEQ for row in drawn)
    assert max(len(row) for row in drawn) > 1


def test_the_packed_sampler_is_a_pure_function_of_seed_and_step(examples_dir):
    ds = open_dataset(examples_dir)
    walked, fresh = _sampler(ds, 1, 2), _sampler(ds, 1, 2)
    for step in range(12):
        walked.micro_batches(step, 0)
    for step in (11, 0, 5, 11):  # a fresh sampler asked for a late step first, as after a resume
        for a, b in zip(walked.micro_batches(step, 0), fresh.micro_batches(step, 0), strict=True):
            assert all(torch.equal(s, t) for s, t in zip(a, b, strict=True))
    assert [r.tolist() for r in walked.rows(0)] != [r.tolist() for r in _sampler(ds, 1, 2, seed=8).rows(0)]


def test_the_same_packed_global_batch_whatever_the_world_size(examples_dir):
    ds = open_dataset(examples_dir)

    def rows(world: int, accum: int, step: int) -> torch.Tensor:
        s = _sampler(ds, world, accum, micro=1)
        return torch.cat([torch.cat([x for x, _, _ in s.micro_batches(step, r)]) for r in range(world)])

    for step in (0, 3, 9):
        one = rows(1, 4, step)
        assert torch.equal(one, rows(2, 2, step)) and torch.equal(one, rows(4, 1, step))


def test_packed_rows_hold_each_examples_padded_inputs_and_targets(examples_dir):
    ds = open_dataset(examples_dir)
    index = ExampleIndex(ds, "train")
    sampler = _sampler(ds, 1, 2)
    for step in (0, 7):
        rows = sampler.rows(step)
        packed = [t for batch in sampler.micro_batches(step, 0) for t in zip(*batch)]  # (x, y, positions) a row
        for row, (x, y, positions) in zip(rows, packed, strict=True):
            at = 0
            for k in row.tolist():
                alone_x, alone_y = pad_examples([index.example(k)], 2 * SEQ, index.pad_id)
                n = int(index.lengths[k]) - 1
                assert torch.equal(x[at:at + n], alone_x[0, :n]) and torch.equal(y[at:at + n], alone_y[0, :n])
                assert positions[at:at + n].tolist() == list(range(n))
                at += n
            assert x[at:].eq(index.pad_id).all() and y[at:].eq(losses.IGNORE_INDEX).all()
            assert positions[at:].tolist() == list(range(2 * SEQ - at))  # the padding: a block of its own
            targets = sum(int(np.count_nonzero(index.example(k)[1][1:])) for k in row.tolist())
            assert int((y != losses.IGNORE_INDEX).sum()) == targets


STEPS = 8
SECTIONS = {"data": {"sequence_length": 2 * SEQ, "packing": True},
            "optim": {"max_steps": STEPS, "warmup_steps": 2, "global_batch_size": 4, "micro_batch_size": 2},
            "checkpoint": {"interval_steps": 4, "keep_last": 2}, "logging": {"log_every_steps": 1}}


@pytest.fixture(scope="module")
def packed_run(tmp_path_factory, examples_dir, tools):
    tmp = tmp_path_factory.mktemp("packed")
    job = tools.write_job(tmp / "job.json", tools.make_job(examples_dir, tmp / "ck", **SECTIONS))
    proc = tools.run_trainer(job, tmp / "result.json")
    assert proc.returncode == 0, proc.stdout[-4000:]
    return {"dir": tmp / "ck", "losses": _losses(proc.stdout)}


def test_training_on_packed_rows_counts_their_loss_tokens_and_the_loss_falls(packed_run, examples_dir):
    ds = open_dataset(examples_dir)
    index = ExampleIndex(ds, "train")
    sampler = _sampler(ds, 1, 2, seed=1234)  # the run's: G = 4 rows of 2 x SEQ positions
    expected = [sum(int(np.count_nonzero(index.example(k)[1][1:])) for row in sampler.rows(s) for k in row.tolist())
                for s in range(STEPS)]
    assert [n for _, n in packed_run["losses"]] == expected  # every packed row's targets, none of the padding
    losses_ = [loss for loss, _ in packed_run["losses"]]
    assert np.mean(losses_[-2:]) < np.mean(losses_[:2]) - 0.5


def test_a_resumed_packed_run_logs_the_uninterrupted_runs_losses(packed_run, tmp_path, examples_dir, tools):
    ck = shutil.copytree(packed_run["dir"], tmp_path / "ck")
    shutil.rmtree(ck / "step-00000008")  # as if killed after the checkpoint of step 4
    job = tools.write_job(tmp_path / "job.json", tools.make_job(examples_dir, ck, **SECTIONS))
    proc = tools.run_trainer(job, tmp_path / "result.json")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert f"resuming from {ck / 'step-00000004'}" in proc.stdout
    assert _losses(proc.stdout) == packed_run["losses"][4:]
    ours = safetensors.torch.load_file(ck / "step-00000008" / "model.safetensors")
    theirs = safetensors.torch.load_file(packed_run["dir"] / "step-00000008" / "model.safetensors")
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


def test_a_packed_checkpoint_is_not_resumed_without_packing(packed_run, tmp_path, examples_dir, tools):
    ck = shutil.copytree(packed_run["dir"], tmp_path / "ck")
    unpacked = {**SECTIONS, "data": {**SECTIONS["data"], "packing": False}}
    job = tools.write_job(tmp_path / "job.json", tools.make_job(examples_dir, ck, **unpacked))
    proc = tools.run_trainer(job, tmp_path / "result.json")
    result = json.loads((tmp_path / "result.json").read_text())
    assert proc.returncode == result["exit_code"] == 78, proc.stdout[-3000:]
    assert "was trained with data.packing True, the job config asks for False" in result["message"]


@pytest.mark.distributed
def test_two_fsdp_ranks_log_the_one_rank_packed_losses(packed_run, tmp_path, examples_dir, tools):
    """position_ids reach the model through FSDP2's root forward: the same losses on two ranks."""
    job = tools.make_job(examples_dir, tmp_path / "ck", **{**SECTIONS, "optim": {**SECTIONS["optim"],
                                                                                "micro_batch_size": 1}})
    job = tools.write_job(tmp_path / "job.json", {**job, "framework": {"parallelism": "fsdp", "compile": False}})
    proc = tools.run_trainer(job, tmp_path / "result.json", nproc=2, timeout_s=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    two = _losses(proc.stdout)
    assert [n for _, n in two] == [n for _, n in packed_run["losses"]]
    assert [loss for loss, _ in two] == pytest.approx([loss for loss, _ in packed_run["losses"]], rel=5e-5)


def test_packing_a_document_stream_is_a_config_error(dataset_dir):
    """What the trainer's start (trainforge.trainer.train, its sampler) raises: exit code 78."""
    with pytest.raises(ConfigError) as err:
        make_sampler(open_dataset(dataset_dir), 32, 2, 1, 1, 0, packing=True)
    assert err.value.exit_code == 78
    assert "data.packing=true but dataset" in str(err.value) and "holds a document stream" in str(err.value)


@pytest.mark.parametrize(("packing", "expected"), [(None, False), (True, True), (False, False)])
def test_the_job_configs_packing_defaults_to_false(tmp_path, dataset_dir, tools, packing, expected):
    job = tools.make_job(dataset_dir, tmp_path / "ck")
    if packing is not None:
        job["data"]["packing"] = packing
    assert parse_job_config(job).data.packing is expected


def test_a_packing_that_is_not_a_boolean_is_refused_naming_the_field(tmp_path, dataset_dir, tools):
    job = tools.make_job(dataset_dir, tmp_path / "ck", data={"packing": "yes"})
    with pytest.raises(ConfigError, match=r"data.packing='yes' \(str\): expected true or false"):
        parse_job_config(job)
