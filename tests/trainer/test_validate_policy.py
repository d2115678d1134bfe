"""trainforge.trainer.validate beyond one checkpoint: expectations (consistency), policies, quarantine;
trainforge.trainer.evaluate's two methods. Checkpoints come from the session's real training run."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import safetensors.torch
import torch

from trainforge.trainer import checkpoint as ckpt
from trainforge.trainer.config import load_job_config
from trainforge.trainer.evaluate import evaluate_models
from trainforge.trainer.expectations import Expectations, check_consistency, config_digest
from trainforge.storage.files import atomic_write_json, sha256_file
from trainforge.trainer.quarantine import QUARANTINE_DIR, is_quarantined, list_quarantined, quarantine
from trainforge.trainer.validate import main, validate_checkpoint, validate_checkpoints

FAST = {"max_eval_tokens": 256, "max_new_tokens": 1}


def _resign(step_dir, step: int | None = None) -> None:
    """Rewrite the manifest so the folder's current files verify (a damage that hashes fine)."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    for name in manifest["files"]:
        manifest["files"][name] = {"bytes": (step_dir / name).stat().st_size, "sha256": sha256_file(step_dir / name)}
    manifest["step"] = step if step is not None else manifest["step"]
    atomic_write_json(step_dir / "manifest.json", manifest)


def _flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def meta(trained_run) -> dict:
    return json.loads((trained_run["checkpoints"] / "step-00000020" / "meta.json").read_text())


def test_config_digest_is_the_trainers(trained_run, meta):
    assert config_digest(json.loads(trained_run["job"].read_text())) == load_job_config(trained_run["job"]).digest()
    assert meta["config_digest"] == config_digest(meta["job_config"])


def test_consistency_against_the_job_config(trained_run, meta, dataset_dir):
    vocab = meta["dataset"]["vocab_size"]
    expect = Expectations.from_job_config_file(trained_run["job"], vocab_size=vocab, world_size=2)
    ok, detail = check_consistency(meta, expect)
    assert ok, detail
    assert "ddp: world 1 x micro 2 x accum 4 = global batch 8" in detail
    assert "note: trained on world size 1, the pipeline asks for 2" in detail
    assert "checked against the pipeline: config_digest, vocab_size, model, sequence_length" in detail
    report = validate_checkpoint(trained_run["checkpoints"] / "step-00000020", dataset_dir, expect=expect, **FAST)
    assert report["ok"] and [c["name"] for c in report["checks"]][2:4] == ["meta", "consistency"]


def _edited(meta: dict, **changes) -> dict:
    out = copy.deepcopy(meta)
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = out
        for p in parents:
            node = node[p]
        node[leaf] = value
    return out


@pytest.mark.parametrize(("meta_changes", "expect_changes", "fragment"), [
    ({}, {"config_digest": "f" * 64}, "config_digest: checkpoint"),
    ({}, {"vocab_size": 99}, "vocab_size: checkpoint"),
    ({}, {"model": "hidden_size=64"}, "model.hidden_size: checkpoint 32, expected 64"),
    ({}, {"sequence_length": 64}, "data.sequence_length: checkpoint 32, expected 64"),
    ({"config_digest": "0" * 64}, {}, "but meta.json's job_config hashes to"),
    ({"grad_accum_steps": 3}, {}, "micro_batch_size 2 x world_size 1 x grad_accum_steps 3 = 6, expected"),
    ({"world_size": None}, {}, "world_size=None, grad_accum_steps=4: expected positive integers"),
])
def test_consistency_mismatches(trained_run, meta, meta_changes, expect_changes, fragment):
    expect = Expectations.from_job_config_file(trained_run["job"], vocab_size=meta["dataset"]["vocab_size"])
    fields = dict(expect.__dict__)
    for key, value in expect_changes.items():
        if key == "model":
            name, _, number = value.partition("=")
            fields["model"] = {**expect.model, name: int(number)}
        else:
            fields[key] = value
    ok, detail = check_consistency(_edited(meta, **meta_changes), Expectations(**fields))
    assert not ok and fragment in detail, detail


@pytest.fixture
def four_checkpoints(trained_run, tmp_path):
    """step 10 and 20 (real), 30 (step 20 with zeroed weights: valid but worse), 40 (bad hash)."""
    root = tmp_path / "checkpoints"
    for step in (10, 20):
        shutil.copytree(trained_run["checkpoints"] / ckpt.step_dir_name(step), root / ckpt.step_dir_name(step))
    worse = shutil.copytree(root / "step-00000020", root / "step-00000030")
    weights = {k: torch.zeros_like(v) for k, v in safetensors.torch.load_file(worse / "model.safetensors").items()}
    safetensors.torch.save_file(weights, worse / "model.safetensors", metadata={"format": "pt"})
    _resign(worse, step=30)
    damaged = shutil.copytree(root / "step-00000020", root / "step-00000040")
    _resign(damaged, step=40)
    _flip_byte(damaged / "optimizer.pt")
    (root / "step-00000050").mkdir()  # a write in progress: no manifest, never judged nor moved
    return root


def test_best_val_loss_picks_the_lowest_and_quarantines_the_damaged(four_checkpoints, dataset_dir):
    root = four_checkpoints
    report = validate_checkpoints(root, dataset_dir, "best_val_loss", quarantine_damaged=True, **FAST)
    by_step = {c["step"]: c for c in report["candidates"]}
    assert sorted(by_step) == [10, 20, 30, 40]
    passing = {s: c["val_loss"] for s, c in by_step.items() if c["ok"]}
    assert sorted(passing) == [10, 20, 30]
    assert report["ok"] and report["step"] == min(passing, key=passing.get) != 30
    assert by_step[40]["integrity_failures"] == ["file_hashes"] and by_step[30]["quarantined_to"] is None

    moved = root / QUARANTINE_DIR / "step-00000040"
    assert [q["moved_to"] for q in report["quarantined"]] == [str(moved)]
    reason = json.loads((moved / "QUARANTINE_REASON.json").read_text())
    assert reason["failed_checks"] == ["file_hashes"] and reason["step"] == 40
    assert "optimizer.pt: SHA-256" in reason["reasons"][0] and reason["checkpoint"] == str(root / "step-00000040")
    assert [s for s, _ in ckpt.list_step_dirs(root)] == [10, 20, 30, 50]  # 50 untouched
    # Resume never sees a quarantined checkpoint, and one moved back by hand still does not verify.
    assert ckpt.newest_valid(root) == root / "step-00000030"
    back = moved.rename(root / "step-00000040")
    assert any("was quarantined" in p for p in ckpt.verify(back)) and is_quarantined(back)
    assert ckpt.newest_valid(root) == root / "step-00000030"


def test_newest_policy_quarantines_a_damaged_newest_and_fails(four_checkpoints, dataset_dir, tmp_path, capsys):
    root, out = four_checkpoints, tmp_path / "report.json"
    args = ["--checkpoints", str(root), "--dataset", str(dataset_dir), "--report", str(out),
            "--max-eval-tokens", "64", "--sample-tokens", "0", "--quarantine"]
    assert main(args) == 1
    report = json.loads(out.read_text())
    assert report["step"] == 40 and report["quarantined_to"] == str(root / QUARANTINE_DIR / "step-00000040")
    assert "QUARANTINED" in capsys.readouterr().out
    assert main(args) == 0  # the damaged one is gone: step 30 is now the newest, and it is intact
    assert json.loads(out.read_text())["step"] == 30
    assert main(args + ["--policy", "best_val_loss", "--step", "30"]) == 78
    assert [q["step"] for q in list_quarantined(root)] == [40]


def test_quarantine_keeps_both_copies_of_a_step(tmp_path):
    for n in range(2):
        folder = tmp_path / "step-00000010"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"torn")
        quarantine(folder, [f"attempt {n}"])
    assert sorted(p.name for p in (tmp_path / QUARANTINE_DIR).iterdir()) == ["step-00000010", "step-00000010.1"]
    assert [q["reasons"] for q in list_quarantined(tmp_path)] == [["attempt 0"], ["attempt 1"]]
    with pytest.raises(ckpt.CheckpointError, match="not a directory"):
        quarantine(tmp_path / "step-00000010", ["gone"])


@pytest.fixture(scope="module")
def foreign_hf_model(tmp_path_factory):
    """A 1-layer Llama with its own byte-level BPE (a different tokenizer from the dataset's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["KING: O gentle night, speak to me"] * 30, trainers.BpeTrainer(
        vocab_size=290, special_tokens=["<|eos|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    eos = tok.token_to_id("<|eos|>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=48, bos_token_id=eos, eos_token_id=eos,
                                         pad_token_id=eos))
    out = tmp_path_factory.mktemp("foreign_hf")
    model.save_pretrained(out)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>").save_pretrained(out)
    return out


def test_evaluate_tokens_method_matches_the_validator(trained_run, dataset_dir):
    step_dir = trained_run["checkpoints"] / "step-00000020"
    report = evaluate_models({"ckpt": str(step_dir)}, dataset_dir, max_eval_tokens=256)
    assert report["ok"] and report["method"] == "tokens"
    entry = report["models"]["ckpt"]
    assert entry["tokenizer_matches_dataset"] is True and entry["context"] == 32
    validated = validate_checkpoint(step_dir, dataset_dir, **FAST)["metrics"]
    assert entry["metrics"]["val_loss"] == pytest.approx(validated["val_loss"], rel=1e-5)


def test_evaluate_across_tokenizers_compares_bits_per_byte(trained_run, dataset_dir, foreign_hf_model, tmp_path):
    step_dir = trained_run["checkpoints"] / "step-00000020"
    report = evaluate_models({"ckpt": str(step_dir), "foreign": str(foreign_hf_model),
                              "missing": str(tmp_path / "nope")}, dataset_dir, max_eval_tokens=256)
    assert report["method"] == "text" and report["ok"] is False  # "missing" failed, the others ran
    assert report["models"]["foreign"]["tokenizer_matches_dataset"] is False
    assert "model " + str(tmp_path / "nope") + ": cannot be loaded" in report["models"]["missing"]["error"]
    bpb = {n: report["models"][n]["metrics"]["val_bits_per_byte"] for n in ("ckpt", "foreign")}
    assert 0 < bpb["ckpt"] < bpb["foreign"]  # a random 1-layer model is worse per byte
    # The same model measured both ways agrees (estimated vs exact bytes, slightly different windows).
    tokens = evaluate_models({"ckpt": str(step_dir)}, dataset_dir, max_eval_tokens=256)
    assert bpb["ckpt"] == pytest.approx(tokens["models"]["ckpt"]["metrics"]["val_bits_per_byte"], rel=0.1)
