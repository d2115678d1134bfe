"""Examples datasets on the trainer side: reading and checking one (trainforge.trainer.dataset),
the example sampler and padding (trainforge.trainer.data), and the loss per loss token of the
global batch (trainforge.trainer.train.micro_batch_loss). References: the chat renderer's own
ids and masks, the sampler recipe in docs/trainer.md, plain transformers on each example
unpadded, and the gradient of the whole batch at once."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from tests.trainer.chat_examples import build_examples_dataset, conversations
from trainforge.data.chat import ChatRenderer
from trainforge.storage.files import sha256_file
from trainforge.trainer import loss as losses
from trainforge.trainer.data import ExampleIndex, ExampleSampler, open_dataset, pad_examples, validation_examples
from trainforge.trainer.dataset import read_dataset
from trainforge.trainer.errors import DatasetError
from trainforge.trainer.train import micro_batch_loss

SEQ = 96


@pytest.fixture(scope="module")
def chat_model(hf_model):
    return hf_model("qwen3")  # ChatML template; pad token <|endoftext|> (its EOS is <|im_end|>)


@pytest.fixture(scope="module")
def examples_dir(tmp_path_factory, chat_model):
    return build_examples_dataset(tmp_path_factory.mktemp("chat") / "ds", chat_model, sequence_length=SEQ)


@pytest.fixture(scope="module")
def rendered(chat_model):
    """What the chat renderer makes of the conversations the dataset was built from, in order."""
    renderer = ChatRenderer.from_folder(chat_model)
    out = [renderer.render(c) for c in conversations(48 + 8, 0)]
    return [r for r in out if len(r.ids) <= SEQ]


@pytest.fixture(scope="module")
def model(chat_model):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32, attn_implementation="eager")
    return m.eval()


def test_an_examples_dataset_reads_back(examples_dir, rendered):
    ds = open_dataset(examples_dir)
    manifest = json.loads((examples_dir / "manifest.json").read_text())
    assert ds.examples is not None and ds.examples.pad_id == manifest["examples"]["pad_id"]
    assert ds.examples.sequence_length == SEQ and ds.examples.kind == "chat"
    assert ds.splits["train"].loss_tokens == manifest["splits"]["train"]["loss_tokens"]
    got = [ExampleIndex(ds, split).example(k) for split in ("train", "validation")
           for k in range(len(ExampleIndex(ds, split)))]
    assert len(got) == len(rendered)
    for (ids, mask), r in zip(got, rendered):
        assert ids.tolist() == r.ids and mask.tolist() == r.mask


def _rewrite(folder, name, change):
    """Apply ``change`` to the file's bytes and list its new size and hash in the manifest."""
    path = folder / name
    path.write_bytes(change(path.read_bytes()))
    manifest = json.loads((folder / "manifest.json").read_text())
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            for entry in (shard["loss_mask"], shard["examples"]):
                if entry["file"] == name:
                    entry.update(bytes=path.stat().st_size, sha256=sha256_file(path))
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _offsets(change):
    def apply(raw: bytes) -> bytes:
        offsets = np.frombuffer(raw, dtype="<i8").copy()
        change(offsets)
        return offsets.tobytes()
    return apply


def _manifest(change):
    def apply(folder):
        manifest = json.loads((folder / "manifest.json").read_text())
        change(manifest)
        (folder / "manifest.json").write_text(json.dumps(manifest))
    return apply


def _set_byte(raw: bytes, at: int, value: int) -> bytes:
    return raw[:at] + bytes([value]) + raw[at + 1:]


def _flip(raw: bytes, at: int) -> bytes:
    return _set_byte(raw, at, raw[at] ^ 1)


CORRUPTIONS = [
    ("mask holds 2", lambda f: _rewrite(f, "train-00000.mask", lambda b: _set_byte(b, 5, 2)),
     "train-00000.mask: holds the value 2"),
    ("mask truncated", lambda f: (f / "train-00000.mask").write_bytes((f / "train-00000.mask").read_bytes()[:-1]),
     "train-00000.mask: "),
    ("mask bytes changed", lambda f: (f / "train-00000.mask").write_bytes(
        _flip((f / "train-00000.mask").read_bytes(), 0)), "train-00000.mask: SHA-256"),
    ("offsets not rising", lambda f: _rewrite(f, "train-00000.idx", _offsets(lambda o: o.__setitem__(2, o[1]))),
     "train-00000.idx: offsets must rise"),
    ("offsets end short", lambda f: _rewrite(f, "train-00000.idx", _offsets(lambda o: o.__setitem__(-1, o[-1] - 1))),
     "train-00000.idx: offsets must rise from 0 to the shard's tokens"),
    ("offsets bytes changed", lambda f: (f / "validation-00000.idx").write_bytes(
        _flip((f / "validation-00000.idx").read_bytes(), 8)), "validation-00000.idx: SHA-256"),
    ("example too long", _manifest(lambda m: m["examples"].update(sequence_length=20)),
     "more than examples.sequence_length=20"),
    ("loss tokens miscounted", _manifest(lambda m: m["splits"]["train"].update(loss_tokens=1)),
     "splits.train: loss_tokens=1 but its loss masks hold"),
    ("examples miscounted", _manifest(lambda m: m["splits"]["validation"].update(documents=99)),
     "splits.validation: documents=99 but its shards hold"),
    ("no pad_id", _manifest(lambda m: m["examples"].pop("pad_id")), "examples: field 'pad_id'=None is missing"),
    ("no mask entry", _manifest(lambda m: m["splits"]["train"]["shards"][0].pop("loss_mask")),
     "shards[0]: field 'loss_mask'=None is missing"),
]


@pytest.mark.parametrize(("name", "corrupt", "message"), CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_a_corrupted_mask_or_offsets_file_is_refused_naming_it(tmp_path, examples_dir, name, corrupt, message):
    folder = shutil.copytree(examples_dir, tmp_path / "ds")
    corrupt(folder)
    with pytest.raises(DatasetError) as err:
        read_dataset(folder)
    assert message in str(err.value)


def _sampler(ds, world: int, accum: int, micro: int = 2, seed: int = 7) -> ExampleSampler:
    return ExampleSampler(ExampleIndex(ds, "train"), SEQ, micro, accum, world, seed, ds.examples.sequence_length)


def test_the_sampler_is_a_pure_function_of_seed_and_step(examples_dir):
    ds = open_dataset(examples_dir)
    first, again = _sampler(ds, 1, 4), _sampler(ds, 1, 4)
    for step in (9, 0, 3, 9):  # any order, fresh or not
        for (x1, y1), (x2, y2) in zip(first.micro_batches(step, 0), again.micro_batches(step, 0)):
            assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not np.array_equal(first.examples(0), first.examples(1))
    assert not np.array_equal(first.examples(0), _sampler(ds, 1, 4, seed=8).examples(0))


def test_every_train_example_once_per_epoch_in_the_documented_order(examples_dir):
    ds = open_dataset(examples_dir)
    sampler = _sampler(ds, 1, 4)  # G = 8; E = 45 examples: steps straddle epochs
    n = len(ExampleIndex(ds, "train"))
    drawn = np.concatenate([sampler.examples(s) for s in range(3 * n // 8 + 1)])
    for epoch in range(3):
        order = drawn[epoch * n:(epoch + 1) * n]
        assert sorted(order.tolist()) == list(range(n))
        recipe = np.random.Generator(np.random.PCG64(np.random.SeedSequence([7, epoch]))).permutation(n)
        assert order.tolist() == recipe.tolist()


def test_the_same_global_batch_whatever_the_world_size(examples_dir):
    ds = open_dataset(examples_dir)

    def rows(world: int, accum: int, step: int) -> torch.Tensor:
        s = _sampler(ds, world, accum)
        return torch.cat([torch.cat([x for x, _ in s.micro_batches(step, r)]) for r in range(world)])

    for step in (0, 5, 11):
        one = rows(1, 4, step)
        assert torch.equal(one, rows(2, 2, step)) and torch.equal(one, rows(4, 1, step))


def test_padded_rows_hold_the_examples_inputs_and_masked_targets(rendered):
    r = rendered[0]
    x, y = pad_examples([(np.asarray(r.ids), np.asarray(r.mask, dtype=np.uint8))], SEQ, pad_id=7)
    n = len(r.ids) - 1
    assert x[0, :n].tolist() == r.ids[:-1] and x[0, n:].eq(7).all()
    expected = [t if m else losses.IGNORE_INDEX for t, m in zip(r.ids[1:], r.mask[1:])]
    assert y[0, :n].tolist() == expected and y[0, n:].eq(losses.IGNORE_INDEX).all()


def _labels(r) -> torch.Tensor:
    """transformers' labels of one example: its ids, -100 where the mask is 0 (the model shifts)."""
    return torch.tensor([t if m else -100 for t, m in zip(r.ids, r.mask)])


def _reference_batch(examples, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch for transformers: (b, SEQ + 1) ids right-padded with pad_id, labels -100 there."""
    ids = torch.full((len(examples), SEQ + 1), pad_id)
    labels = torch.full((len(examples), SEQ + 1), -100)
    for i, r in enumerate(examples):
        ids[i, :len(r.ids)] = torch.tensor(r.ids)
        labels[i, :len(r.ids)] = _labels(r)
    return ids, labels


@pytest.mark.parametrize("chunk_tokens", [0, 64], ids=["plain", "chunked"])
def test_a_padded_micro_batch_loss_equals_plain_transformers(model, rendered, chunk_tokens):
    batch = rendered[:4]
    assert len({r.loss_tokens for r in batch}) > 1  # unequal counts: a mean of means would differ
    x, y = pad_examples([(np.asarray(r.ids), np.asarray(r.mask)) for r in batch], SEQ, pad_id=0)
    with torch.no_grad():
        # reference: each example alone, unpadded, weighted by its targets
        nats = [float(model(input_ids=torch.tensor([r.ids]), labels=_labels(r)[None]).loss) * sum(r.mask[1:])
                for r in batch]
        total = sum(r.mask[1:].count(1) for r in batch)
        summed = losses.lm_loss(model, x, y, chunk_tokens=chunk_tokens, reduction="sum")
        mean = losses.lm_loss(model, x, y, chunk_tokens=chunk_tokens)
    assert float(summed) == pytest.approx(sum(nats), rel=1e-5)
    assert float(mean) == pytest.approx(sum(nats) / total, rel=1e-5)


@pytest.mark.parametrize("chunk_tokens", [0, 64], ids=["plain", "chunked"])
def test_targets_all_ignored_give_a_zero_sum_and_zero_gradients(model, chunk_tokens):
    x = torch.randint(0, 100, (2, SEQ))
    y = torch.full((2, SEQ), losses.IGNORE_INDEX)
    model.zero_grad(set_to_none=True)
    out = losses.lm_loss(model, x, y, chunk_tokens=chunk_tokens, reduction="sum")
    out.backward()
    assert float(out.detach()) == 0.0
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("chunk_tokens", [0, 64], ids=["plain", "chunked"])
def test_accumulated_gradients_equal_the_whole_batch_at_once(model, rendered, chunk_tokens, monkeypatch):
    """Micro-batches of unequal loss-token counts, on one rank and split over two: the gradient
    is the whole batch's (transformers' mean over every target), so normalisation is per token."""
    monkeypatch.setattr(losses, "CHUNK_LOGITS_MIB", 0 if chunk_tokens == 0 else 1)
    monkeypatch.setattr(losses, "chunk_tokens_for", lambda vocab, mib=0: chunk_tokens)
    batch = rendered[:8]
    micro = [pad_examples([(np.asarray(r.ids), np.asarray(r.mask)) for r in batch[i:i + 2]], SEQ, 0)
             for i in range(0, 8, 2)]
    counts = [int((y != losses.IGNORE_INDEX).sum()) for _, y in micro]
    assert len(set(counts)) > 1
    n = sum(counts)

    model.zero_grad(set_to_none=True)
    ids, labels = _reference_batch(batch, pad_id=0)
    model(input_ids=ids, labels=labels).loss.backward()
    reference = _grads(model)

    for x, y in micro:  # one rank, 4 accumulation steps
        micro_batch_loss(model, x, y, accum=4, loss_tokens=n, world_size=1).backward()
    one_rank = _grads(model)
    ranks = []
    for rank in range(2):  # two ranks, 2 accumulation steps each; DDP averages the ranks' gradients
        for x, y in micro[2 * rank:2 * rank + 2]:
            micro_batch_loss(model, x, y, accum=2, loss_tokens=n, world_size=2).backward()
        ranks.append(_grads(model))
    assert reference.keys() == one_rank.keys()
    for name, ref in reference.items():  # relative 1e-5 of each tensor's largest gradient
        for got in (one_rank[name], (ranks[0][name] + ranks[1][name]) / 2):
            error = (got - ref).abs().max().item() / ref.abs().max().item()
            assert error < 1e-5, f"{name}: max |gradient - reference| is {error:.2e} of max |reference|"


def test_validation_examples_are_in_order_and_capped_by_loss_tokens(examples_dir):
    ds = open_dataset(examples_dir)
    index = ExampleIndex(ds, "validation")
    everything = list(validation_examples(index, SEQ, 10**9, batch_size=3))
    assert sum(len(x) for x, _ in everything) == len(index)
    assert torch.equal(everything[0][0][1], pad_examples([index.example(1)], SEQ, index.pad_id)[0][0])
    first = int(np.count_nonzero(index.example(0)[1][1:]))
    capped = list(validation_examples(index, SEQ, first, batch_size=3))
    assert sum(len(x) for x, _ in capped) == 1
