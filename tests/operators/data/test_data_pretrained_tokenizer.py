"""A pretrained model's own tokenizer (issue 38, item 2): the model's EOS as its folder declares
it (``model_eos``), shards holding exactly that tokenizer's ids with the model's EOS after each
document, uint32 shards for a large vocabulary, the tokenizer and its EOS in the digest, and the
errors a folder without a usable EOS gets. Tiny HF-layout folders (tests/hf_models.py), no
network.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.hf_models import make_hf_model
from trainforge.data import (
    InvalidSettingsError, TokenizerSourceError, load_model_eos, model_eos, prepare_dataset,
    verify_dataset,
)
from trainforge.storage.files import sha256_file

#: family -> (EOS token the folder declares, the generation_config EOS tokens, in order).
FAMILIES = {
    "llama": ("<|end_of_text|>", ["<|end_of_text|>", "<|eot_id|>"]),
    "qwen3": ("<|im_end|>", ["<|im_end|>", "<|endoftext|>"]),
    "mistral": ("</s>", ["</s>"]),
    "gemma2": ("<eos>", ["<eos>", "<end_of_turn>"]),
}


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {family: make_hf_model(root / family, family) for family in FAMILIES}


def pretrained_settings(make_settings, pattern, folder, **overrides):
    eos = load_model_eos(folder)
    return make_settings(pattern, vocab_size=None, tokenizer_uri=eos.tokenizer_uri,
                         eos_token=eos.eos_token, eos_ids=eos.eos_ids, **overrides)


def read_split(dataset: Path, manifest: dict, split: str) -> np.ndarray:
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    return np.concatenate([np.fromfile(dataset / s["file"], dtype=dtype)
                           for s in manifest["splits"][split]["shards"]])


def copy_folder(src: Path, dest: Path, **json_edits) -> Path:
    """A copy of a model folder; ``json_edits``: file stem -> dict of fields to set (None
    deletes the field), or None to delete the file."""
    shutil.copytree(src, dest)
    for stem, edits in json_edits.items():
        path = dest / f"{stem}.json"
        if edits is None:
            path.unlink()
            continue
        data = json.loads(path.read_text())
        for key, value in edits.items():
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
        path.write_text(json.dumps(data))
    return dest


@pytest.mark.parametrize("family", list(FAMILIES))
def test_shards_hold_the_models_ids_and_its_eos_after_each_document(
        family, hf_folders, corpus, tmp_path, make_settings):
    folder = hf_folders[family]
    eos_token, generation_eos = FAMILIES[family]
    reference = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos_id = reference.token_to_id(eos_token)
    result = prepare_dataset(pretrained_settings(make_settings, corpus / "*.txt", folder),
                             tmp_path / "out")
    manifest = result.manifest
    assert (manifest["eos_token"], manifest["eos_id"]) == (eos_token, eos_id)
    assert manifest["eos_ids"] == [reference.token_to_id(t) for t in generation_eos]
    largest = max(reference.get_vocab(with_added_tokens=True).values())
    assert (manifest["vocab_size"], manifest["dtype"]) == (largest + 1, "uint16")
    assert manifest["tokenizer"]["sha256"] == sha256_file(folder / "tokenizer.json")
    assert (result.path / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    for split in ("train", "validation"):
        names = manifest["splits"][split]["document_names"]
        texts = [(corpus / n).read_text().strip("\n") for n in names]
        # The post-processor's BOS (llama, mistral, gemma2 add one) is not written.
        expected = [i for t in texts
                    for i in reference.encode(t, add_special_tokens=False).ids + [eos_id]]
        ids = read_split(result.path, manifest, split)
        assert ids.tolist() == expected
        ends = np.flatnonzero(ids == eos_id)
        starts = np.concatenate([[0], ends[:-1] + 1])
        assert [reference.decode(ids[s:e].tolist()) for s, e in zip(starts, ends)] == texts
    assert verify_dataset(result.path) == []


def test_the_trainer_reads_a_pretrained_dataset(hf_folders, corpus, tmp_path, make_settings):
    from trainforge.trainer.dataset import read_dataset

    result = prepare_dataset(
        pretrained_settings(make_settings, corpus / "*.txt", hf_folders["qwen3"]), tmp_path / "o")
    dataset = read_dataset(result.path)
    assert (dataset.eos_token, dataset.eos_id, dataset.vocab_size) == (
        "<|im_end|>", result.manifest["eos_id"], result.manifest["vocab_size"])
    assert dataset.tokenizer_sha256 == sha256_file(hf_folders["qwen3"] / "tokenizer.json")


def big_vocabulary_folder(dest: Path, corpus: Path, size: int = 70_000) -> Path:
    """A WordLevel tokenizer with ``size`` entries (the corpus's words first, the EOS last, id
    ``size - 1``) and a tokenizer_config.json naming the EOS."""
    words = sorted({w for p in corpus.iterdir() for w in p.read_text().split()})
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    vocab.update({f"filler{i}": i for i in range(len(vocab), size - 1)})
    vocab["<eos>"] = size - 1
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    dest.mkdir()
    tokenizer.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<eos>"}}))
    return dest


def test_a_vocabulary_over_65536_ids_gives_uint32_shards(corpus, tmp_path, make_settings):
    folder = big_vocabulary_folder(tmp_path / "big", corpus)
    assert model_eos(folder) == ("<eos>", [69_999])
    result = prepare_dataset(pretrained_settings(make_settings, corpus / "*.txt", folder),
                             tmp_path / "out")
    manifest = result.manifest
    assert (manifest["dtype"], manifest["vocab_size"], manifest["eos_id"]) == (
        "uint32", 70_000, 69_999)
    reference = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for split in ("train", "validation"):
        texts = [(corpus / n).read_text().strip("\n")
                 for n in manifest["splits"][split]["document_names"]]
        expected = [i for t in texts for i in reference.encode(t).ids + [69_999]]
        assert read_split(result.path, manifest, split).tolist() == expected
    assert verify_dataset(result.path) == []


def test_the_tokenizer_and_its_eos_are_in_the_digest(hf_folders, corpus, tmp_path,
                                                     make_settings):
    def digest(folder: Path) -> str:
        return prepare_dataset(pretrained_settings(make_settings, corpus / "*.txt", folder),
                               tmp_path / "out").digest

    llama, mistral = digest(hf_folders["llama"]), digest(hf_folders["mistral"])
    assert llama != mistral
    # Same tokenizer.json, another EOS: another dataset.
    other_eos = copy_folder(hf_folders["llama"], tmp_path / "eot",
                            tokenizer_config={"eos_token": "<|eot_id|>"})
    assert model_eos(other_eos)[0] == "<|eot_id|>"
    assert digest(other_eos) not in (llama, mistral)
    # The folder's location is not in it; the content is.
    moved = shutil.copytree(hf_folders["llama"], tmp_path / "moved")
    again = prepare_dataset(pretrained_settings(make_settings, corpus / "*.txt", moved),
                            tmp_path / "out")
    assert again.reused and again.digest == llama


def test_our_own_tokenizers_keep_their_digest_settings(corpus, make_settings):
    settings = make_settings(corpus / "*.txt")
    assert "eos_ids" not in settings.output_settings()  # earlier datasets are still reused
    assert settings.output_settings()["vocab_size"] == 300


# -- model_eos: where the EOS comes from, and what is refused -----------------------------------


def test_eos_falls_back_from_tokenizer_config_to_generation_config_to_config(hf_folders,
                                                                             tmp_path):
    llama = hf_folders["llama"]
    ids = Tokenizer.from_file(str(llama / "tokenizer.json")).token_to_id
    end, eot = ids("<|end_of_text|>"), ids("<|eot_id|>")
    assert model_eos(llama) == ("<|end_of_text|>", [end, eot])
    no_token = copy_folder(llama, tmp_path / "a", tokenizer_config={"eos_token": None},
                           generation_config={"eos_token_id": [eot, end]})
    assert model_eos(no_token) == ("<|eot_id|>", [eot, end])
    only_config = copy_folder(llama, tmp_path / "b", tokenizer_config={"eos_token": None},
                              generation_config=None, config={"eos_token_id": end})
    assert model_eos(only_config) == ("<|end_of_text|>", [end])
    # A token missing from the declared list is added to it.
    extra = copy_folder(llama, tmp_path / "c", tokenizer_config={"eos_token": "<|eot_id|>"},
                        generation_config={"eos_token_id": end})
    assert model_eos(extra) == ("<|eot_id|>", [end, eot])
    # Files already read (e.g. from S3) work the same.
    files = {p.name: p.read_bytes() for p in no_token.iterdir() if p.suffix == ".json"}
    assert model_eos(files) == ("<|eot_id|>", [eot, end])


def test_a_folder_without_an_eos_declaration_is_refused(hf_folders, tmp_path):
    bare = copy_folder(hf_folders["mistral"], tmp_path / "bare",
                       tokenizer_config={"eos_token": None}, generation_config=None,
                       config={"eos_token_id": None})
    with pytest.raises(TokenizerSourceError) as info:
        model_eos(bare)
    message = str(info.value)
    assert str(bare) in message and "no end-of-text token declared" in message
    for field in ("tokenizer_config.json eos_token", "generation_config.json eos_token_id",
                  "config.json eos_token_id"):
        assert field in message


@pytest.mark.parametrize(
    ("edits", "file", "fragments"),
    [
        ({"tokenizer_config": {"eos_token": "<|nope|>"}}, "tokenizer_config.json",
         ["eos_token '<|nope|>' is not in the vocabulary of", "tokenizer.json"]),
        ({"tokenizer_config": {"eos_token": {"text": "</s>"}}}, "tokenizer_config.json",
         ["eos_token is {'text': '</s>'}, expected a token string or {\"content\""]),
        ({"generation_config": {"eos_token_id": [2, 99999]}}, "generation_config.json",
         ["eos_token_id 99999 is not an id of", "(its ids are 0 ... "]),
        ({"tokenizer_config": {"eos_token": None}, "generation_config": None,
          "config": {"eos_token_id": "</s>"}}, "config.json",
         ["eos_token_id is '</s>', expected a token id"]),
    ],
)
def test_unusable_eos_declarations_name_the_file_field_and_value(hf_folders, tmp_path, edits,
                                                                 file, fragments):
    folder = copy_folder(hf_folders["mistral"], tmp_path / "m", **edits)
    with pytest.raises(TokenizerSourceError) as info:
        load_model_eos(folder)
    assert info.value.uri == str(folder / file)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert "model.pretrained" in str(info.value)  # the remedy


def test_a_folder_without_tokenizer_json_is_refused(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(TokenizerSourceError, match="does not exist") as info:
        load_model_eos(tmp_path / "m")
    assert info.value.uri == str(tmp_path / "m" / "tokenizer.json")


def test_pretrained_settings_are_checked(corpus, make_settings, hf_folders):
    tokenizer = str(hf_folders["mistral"] / "tokenizer.json")
    with pytest.raises(InvalidSettingsError, match="tokenizer_uri=None"):
        make_settings(corpus / "*.txt", vocab_size=None, eos_ids=(2,))
    with pytest.raises(InvalidSettingsError, match="vocab_size=4096: expected null"):
        make_settings(corpus / "*.txt", vocab_size=4096, eos_ids=(2,), tokenizer_uri=tokenizer)
    for bad in ((), (2, 2), (-1,), ("2",), "2"):
        with pytest.raises(InvalidSettingsError, match="eos_ids"):
            make_settings(corpus / "*.txt", vocab_size=None, eos_ids=bad, tokenizer_uri=tokenizer)
    with pytest.raises(InvalidSettingsError, match="vocab_size=None"):
        make_settings(corpus / "*.txt", vocab_size=None)


def test_eos_ids_must_hold_the_eos_tokens_id(corpus, make_settings, hf_folders, tmp_path):
    tokenizer = str(hf_folders["mistral"] / "tokenizer.json")
    settings = make_settings(corpus / "*.txt", vocab_size=None, tokenizer_uri=tokenizer,
                             eos_token="</s>", eos_ids=(1,))
    with pytest.raises(TokenizerSourceError, match=r"do not hold the id 2 of the EOS token"):
        prepare_dataset(settings, tmp_path / "o")


def test_manifest_eos_ids_are_optional_and_checked(hf_folders, corpus, tmp_path,
                                                   make_settings):
    result = prepare_dataset(
        pretrained_settings(make_settings, corpus / "*.txt", hf_folders["gemma2"]),
        tmp_path / "o")
    path = result.path / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["eos_ids"]  # a manifest written before eos_ids existed
    path.write_text(json.dumps(manifest))
    assert verify_dataset(result.path) == []
    manifest["eos_ids"] = [manifest["eos_id"] + 1]
    path.write_text(json.dumps(manifest))
    assert any("eos_ids" in p for p in verify_dataset(result.path))


@pytest.mark.integration
def test_an_s3_model_folder(hf_folders, bucket, s3_env, corpus, tmp_path, make_settings):
    folder = hf_folders["gemma2"]
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):  # no generation
        s3_env.put_object(Bucket=bucket, Key=f"models/g/{name}", Body=(folder / name).read_bytes())
    eos = load_model_eos(f"s3://{bucket}/models/g", s3_env)
    assert (eos.tokenizer_uri, eos.eos_token, eos.declared_in) == (
        f"s3://{bucket}/models/g/tokenizer.json", "<eos>", "tokenizer_config.json eos_token")
    assert eos.eos_ids == (1,)  # config.json's eos_token_id (<eos> is id 1 in gemma2's)
    settings = make_settings(corpus / "*.txt", vocab_size=None, tokenizer_uri=eos.tokenizer_uri,
                             eos_token=eos.eos_token, eos_ids=eos.eos_ids)
    local = prepare_dataset(settings, tmp_path / "o", s3_client=s3_env)
    assert local.manifest["tokenizer"]["sha256"] == sha256_file(folder / "tokenizer.json")
    with pytest.raises(TokenizerSourceError, match="does not exist"):
        load_model_eos(f"s3://{bucket}/models/none", s3_env)
