"""trainforge.trainer.data: dataset manifest checks, cross-shard reads, deterministic sampling, eval windows."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from trainforge.trainer.data import BatchSampler, TokenStream, open_dataset, validation_windows
from trainforge.trainer.errors import DatasetError


def _all_tokens(ds, split: str) -> np.ndarray:
    return np.concatenate(
        [np.fromfile(s.path, dtype=np.uint16) for s in ds.splits[split].shards]
    ).astype(np.int64)


def test_open_dataset_reads_the_manifest(dataset_dir):
    ds = open_dataset(dataset_dir)
    manifest = json.loads((dataset_dir / "manifest.json").read_text())
    assert ds.vocab_size == manifest["vocab_size"] and ds.eos_id == manifest["eos_id"] == 0
    assert len(ds.splits["train"].shards) == 2
    assert TokenStream(ds, "train").num_tokens == manifest["splits"]["train"]["tokens"]


def _corrupt(root, how: str) -> None:
    manifest_path = root / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    if how == "no_manifest":
        manifest_path.unlink()
    elif how == "flip_byte":
        shard = root / manifest["splits"]["train"]["shards"][1]["file"]
        data = bytearray(shard.read_bytes())
        data[10] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif how == "truncate":
        shard = root / manifest["splits"]["validation"]["shards"][0]["file"]
        shard.write_bytes(shard.read_bytes()[:-2])
    elif how == "format":
        manifest["format"] = "other/v9"
        manifest_path.write_text(json.dumps(manifest))
    elif how == "no_validation":
        del manifest["splits"]["validation"]
        manifest_path.write_text(json.dumps(manifest))
    elif how == "token_count":
        manifest["splits"]["train"]["tokens"] += 1
        manifest_path.write_text(json.dumps(manifest))
    elif how == "token_range":  # a re-signed shard holding an id past the vocabulary
        entry = manifest["splits"]["train"]["shards"][0]
        tokens = np.fromfile(root / entry["file"], dtype=np.uint16)
        tokens[3] = 65535
        tokens.tofile(root / entry["file"])
        entry["sha256"] = hashlib.sha256((root / entry["file"]).read_bytes()).hexdigest()
        manifest_path.write_text(json.dumps(manifest))
    elif how == "path_escape":
        manifest["splits"]["train"]["shards"][0]["file"] = "../elsewhere.bin"
        manifest_path.write_text(json.dumps(manifest))
    elif how == "eos_range":
        manifest["eos_id"] = manifest["vocab_size"]
        manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("how", "fragment"),
    [
        ("no_manifest", "manifest.json: missing"),
        ("flip_byte", "train-00001.bin: SHA-256"),
        ("truncate", "bytes on disk, manifest says"),
        ("format", "format='other/v9', expected 'trainforge.dataset/v1'"),
        ("no_validation", "split 'validation' is missing"),
        ("token_count", "splits.train: tokens="),
        ("eos_range", "eos_id=320, expected 0 <= eos_id < vocab_size=320"),
    ("token_range", "holds token id 65535, outside vocab_size=320"),
    ("path_escape", "file '../elsewhere.bin' must be a plain file name"),
    ],
)
def test_dataset_errors(tmp_path, dataset_builder, how, fragment):
    root = dataset_builder(tmp_path / "ds")
    _corrupt(root, how)
    with pytest.raises(DatasetError) as info:
        open_dataset(root)
    assert fragment in str(info.value)
    assert info.value.exit_code == 78


def test_token_stream_reads_across_shards(dataset_dir):
    ds = open_dataset(dataset_dir)
    stream, tokens = TokenStream(ds, "train"), _all_tokens(ds, "train")
    boundary = ds.splits["train"].shards[0].tokens
    np.testing.assert_array_equal(
        stream.read(boundary - 5, 12), tokens[boundary - 5 : boundary + 7]
    )
    np.testing.assert_array_equal(stream.read(0, 3), tokens[:3])
    with pytest.raises(IndexError):
        stream.read(len(tokens) - 2, 3)


def _sampler(ds, world: int, accum: int, seed: int = 1234) -> BatchSampler:
    return BatchSampler(
        TokenStream(ds, "train"),
        seq_len=32,
        micro_batch=2,
        accum_steps=accum,
        world_size=world,
        seed=seed,
    )


def test_sampling_is_a_function_of_seed_and_step(dataset_dir):
    ds = open_dataset(dataset_dir)
    a, b = _sampler(ds, 2, 2), _sampler(ds, 2, 2)  # two independent samplers, as after a restart
    for (xa, ya), (xb, yb) in zip(a.micro_batches(7, 1), b.micro_batches(7, 1), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not np.array_equal(a.starts(7), a.starts(8))
    assert not np.array_equal(a.starts(7), _sampler(ds, 2, 2, seed=1).starts(7))


def test_batches_shapes_targets_and_rank_slices(dataset_dir):
    ds = open_dataset(dataset_dir)
    tokens = _all_tokens(ds, "train")
    sampler = _sampler(ds, world=2, accum=2)
    starts = sampler.starts(3)  # (global_batch = 2 x 2 x 2 = 8,)
    per_rank = [sampler.micro_batches(3, r) for r in (0, 1)]
    rows = []
    for batches in per_rank:
        assert len(batches) == 2
        for x, y in batches:
            assert x.shape == y.shape == (2, 32) and x.dtype == y.dtype == torch.int64
            assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
            rows.extend(x)
    # rank 0 holds positions 0..3 of the global batch, rank 1 positions 4..7: disjoint, complete
    for row, start in zip(rows, starts, strict=True):
        np.testing.assert_array_equal(row.numpy(), tokens[start : start + 32])


def test_global_batch_does_not_depend_on_world_size(dataset_dir):
    ds = open_dataset(dataset_dir)
    one = torch.cat([x for x, _ in _sampler(ds, world=1, accum=4).micro_batches(5, 0)])
    two = torch.cat(
        [x for r in (0, 1) for x, _ in _sampler(ds, world=2, accum=2).micro_batches(5, r)]
    )
    assert torch.equal(one, two)


def test_sampler_rejects_a_split_shorter_than_a_sequence(dataset_dir):
    ds = open_dataset(dataset_dir)
    with pytest.raises(DatasetError, match="fewer than data.sequence_length"):
        BatchSampler(
            TokenStream(ds, "validation"),
            seq_len=10**6,
            micro_batch=1,
            accum_steps=1,
            world_size=1,
            seed=0,
        )


def test_validation_windows_are_consecutive_and_capped(dataset_dir):
    ds = open_dataset(dataset_dir)
    tokens = _all_tokens(ds, "validation")
    windows = list(
        validation_windows(
            TokenStream(ds, "validation"), seq_len=32, max_tokens=32 * 5, batch_size=2
        )
    )
    x = torch.cat([w[0] for w in windows])
    y = torch.cat([w[1] for w in windows])
    assert [w[0].shape[0] for w in windows] == [2, 2, 1] and x.shape == (5, 32)
    np.testing.assert_array_equal(x.flatten().numpy(), tokens[:160])
    np.testing.assert_array_equal(y.flatten().numpy(), tokens[1:161])
    everything = list(validation_windows(TokenStream(ds, "validation"), 32, 10**9, 64))
    assert sum(w[0].shape[0] for w in everything) == (len(tokens) - 1) // 32
