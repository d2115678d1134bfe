"""Chat and prompt/completion data prepared into an examples dataset (issue 39, items 1 and 7):
the dataset verifies, every stored example's masked tokens decode to its answers and end-of-turn
tokens (the reference: the template's own rendering, through transformers), the split is by
conversation, over-length examples are dropped or truncated and counted, and each bad record
names file, line or row, and field. A tiny qwen3-family folder (ChatML) and a gemma2 one (no
system role); no network.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.hf_models import make_hf_model
from trainforge.data import MalformedRecordError, TokenizerSourceError, load_model_eos, prepare_dataset, verify_dataset
from trainforge.data.settings import PrepareSettings

QUESTIONS = [f"How long is bridge number {i}?" for i in range(40)]


def _conversation(i: int) -> dict:
    return {"messages": [{"role": "user", "content": QUESTIONS[i]},
                         {"role": "assistant", "content": f"It is {i * 3 + 4} metres long."},
                         {"role": "user", "content": "And the river?"},
                         {"role": "assistant", "content": "Wide and calm."}]}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-chat")
    return {family: make_hf_model(root / family, family, shards=1) for family in ("qwen3", "gemma2")}


def _settings(pattern: Path, folder: Path, **overrides) -> PrepareSettings:
    eos = load_model_eos(folder)
    values = dict(sources=(str(pattern),), strip_gutenberg_boilerplate=False, normalize_whitespace=False,
                  unicode_normalization="none", min_document_chars=1, vocab_size=None, validation_fraction=0.2,
                  shard_tokens=4096, format="chat", tokenizer_uri=eos.tokenizer_uri, eos_token=eos.eos_token,
                  eos_ids=eos.eos_ids, sequence_length=128, encode_workers=1)
    return PrepareSettings(**{**values, **overrides})


def _write_jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _examples(dataset: Path, manifest: dict, split: str) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for shard in manifest["splits"][split]["shards"]:
        ids = np.fromfile(dataset / shard["file"], dtype=np.dtype(manifest["dtype"]).newbyteorder("<"))
        mask = np.fromfile(dataset / shard["loss_mask"]["file"], dtype=np.uint8)
        offsets = np.fromfile(dataset / shard["examples"]["file"], dtype="<i8")
        out += [(ids[a:b], mask[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]
    return out


def test_a_chat_dataset_holds_each_conversation_with_the_mask_of_its_answers(tmp_path, folders):
    from transformers import AutoTokenizer

    records = [_conversation(i) for i in range(40)]
    source = _write_jsonl(tmp_path / "chat" / "talks.jsonl", records + [records[3]])  # one duplicate
    prepared = prepare_dataset(_settings(tmp_path / "chat" / "*.jsonl", folders["qwen3"]), tmp_path / "out")
    dataset, manifest = prepared.path, prepared.manifest
    assert verify_dataset(dataset) == []
    tok = AutoTokenizer.from_pretrained(str(folders["qwen3"]))
    assert manifest["examples"]["kind"] == "chat" and manifest["examples"]["pad_id"] == tok.pad_token_id
    assert manifest["stats"]["removed"]["duplicate"] == 1
    summary = prepared.summary()  # what the prepare_data task logs to MLflow and passes on
    assert summary["loss_tokens"] == {s: manifest["splits"][s]["loss_tokens"] for s in ("train", "validation")}
    assert summary["examples"]["kind"] == "chat" and summary["documents_in"] == 41
    by_text = {tok.apply_chat_template(r["messages"], tokenize=False): r for r in records}
    seen = []
    for split in ("train", "validation"):
        stored = _examples(dataset, manifest, split)
        assert manifest["splits"][split]["documents"] == len(stored) > 0
        assert manifest["splits"][split]["loss_tokens"] == sum(int(m.sum()) for _, m in stored)
        for ids, mask in stored:
            record = by_text[tok.decode(ids, skip_special_tokens=False)]  # the whole conversation, rendered
            answers = "".join(m["content"] + "<|im_end|>" for m in record["messages"] if m["role"] == "assistant")
            assert tok.decode(ids[mask == 1], skip_special_tokens=False) == answers
            seen.append((split, record["messages"][0]["content"]))
    assert sorted(q for _, q in seen) == sorted(QUESTIONS)  # each conversation once, whole, in one split
    again = prepare_dataset(_settings(tmp_path / "chat" / "*.jsonl", folders["qwen3"]), tmp_path / "out")
    assert again.reused and again.digest == prepared.digest
    source.write_text(source.read_text() + json.dumps(_conversation(0) | {"messages": [
        {"role": "user", "content": "new"}, {"role": "assistant", "content": "one"}]}) + "\n")
    assert prepare_dataset(_settings(tmp_path / "chat" / "*.jsonl", folders["qwen3"]), tmp_path / "out").digest \
        != prepared.digest


def test_prompt_completion_parquet_with_named_fields(tmp_path, folders):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "pc").mkdir()
    table = pa.table({"question": QUESTIONS[:10], "answer": [f"Answer {i}." for i in range(10)]})
    pq.write_table(table, tmp_path / "pc" / "pairs.parquet", row_group_size=4)
    prepared = prepare_dataset(_settings(tmp_path / "pc" / "*.parquet", folders["gemma2"], format="prompt_completion",
                                         prompt_field="question", completion_field="answer"), tmp_path / "out")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folders["gemma2"]))
    answers = sorted(tok.decode(ids[mask == 1], skip_special_tokens=False)
                     for split in ("train", "validation") for ids, mask in _examples(
                         prepared.path, prepared.manifest, split))
    assert answers == sorted(f"Answer {i}.<end_of_turn>" for i in range(10))


def test_a_compressed_parquet_reads_like_the_plain_one_and_a_broken_one_is_named(tmp_path, folders):
    """Chat Parquet goes through the data step's Parquet reader: a gzip file is decompressed to a
    temporary file first; a truncated one is a malformed file, named, and nothing is written."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"question": QUESTIONS[:10], "answer": [f"Answer {i}." for i in range(10)]})
    pq.write_table(table, tmp_path / "plain.parquet", row_group_size=4)
    data = (tmp_path / "plain.parquet").read_bytes()
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "pairs.parquet.gz").write_bytes(gzip.compress(data))
    settings = dict(format="prompt_completion", prompt_field="question", completion_field="answer")
    folder = folders["gemma2"]
    packed = prepare_dataset(_settings(tmp_path / "gz" / "*.parquet.gz", folder, **settings), tmp_path / "o1")
    (tmp_path / "pl").mkdir()
    (tmp_path / "pl" / "pairs.parquet").write_bytes(data)
    plain = prepare_dataset(_settings(tmp_path / "pl" / "*.parquet", folder, **settings), tmp_path / "o2")
    assert [ids.tolist() for ids, _ in _examples(packed.path, packed.manifest, "train")] == [
        ids.tolist() for ids, _ in _examples(plain.path, plain.manifest, "train")]

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "pairs.parquet.gz").write_bytes(gzip.compress(data)[:-40])
    with pytest.raises(MalformedRecordError, match=r"pairs\.parquet\.gz' at file: cannot decompress"):
        prepare_dataset(_settings(tmp_path / "bad" / "*.parquet.gz", folder, **settings), tmp_path / "o3")
    assert not (tmp_path / "o3").exists() or not any((tmp_path / "o3").iterdir())


@pytest.mark.parametrize(("policy", "kept"), [("drop", 0), ("truncate", 1)])
def test_over_length_examples_are_dropped_or_truncated_and_counted(tmp_path, folders, policy, kept):
    long = {"messages": [{"role": "user", "content": "Tell me."},
                         {"role": "assistant", "content": "the river " * 60}]}
    _write_jsonl(tmp_path / "c" / "a.jsonl", [_conversation(i) for i in range(6)] + [long])
    prepared = prepare_dataset(_settings(tmp_path / "c" / "*.jsonl", folders["qwen3"], sequence_length=96,
                                         over_length=policy), tmp_path / "out")
    over = prepared.manifest["examples"]["over_length"]
    assert over == {"policy": policy, "dropped": 1 - kept, "truncated": kept}
    lengths = [len(ids) for split in ("train", "validation")
               for ids, _ in _examples(prepared.path, prepared.manifest, split)]
    assert len(lengths) == 6 + kept and max(lengths) <= 96 and (96 in lengths) == bool(kept)


@pytest.mark.parametrize(("line", "where"), [
    ({"messages": [{"role": "user", "content": "hi"}]}, "field messages: no assistant turn"),
    ({"messages": [{"role": "narrator", "content": "so"}, {"role": "assistant", "content": "x"}]},
     "field messages[0].role: str 'narrator' is not a known role"),
    ({"messages": [{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "x"}]},
     "field messages[0].content: list ['a'] is not a string"),
    ("{not json", "not JSON (Expecting property name enclosed in double quotes at column 2)"),
])
def test_a_bad_record_names_file_line_and_field_or_is_skipped_and_counted(tmp_path, folders, line, where):
    source = _write_jsonl(tmp_path / "bad" / "talks.jsonl", [_conversation(0), _conversation(1), line])
    with pytest.raises(MalformedRecordError) as caught:
        prepare_dataset(_settings(tmp_path / "bad" / "*.jsonl", folders["qwen3"]), tmp_path / "out")
    assert caught.value.uri.endswith("talks.jsonl") and caught.value.location == "line 3"
    assert where in caught.value.reason
    skipped = prepare_dataset(_settings(tmp_path / "bad" / "*.jsonl", folders["qwen3"], on_malformed="skip"),
                              tmp_path / "out")
    assert skipped.manifest["stats"]["malformed"]["count"] == 1
    listed = skipped.manifest["stats"]["malformed"]["examples"]
    assert len(listed) == 1 and listed[0].startswith(f"{caught.value.uri}: line 3: ") and where in listed[0]


def test_a_template_the_conversation_breaks_and_a_template_without_end_of_turn(tmp_path, folders):
    system = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "hello"}]}
    _write_jsonl(tmp_path / "g" / "a.jsonl", [_conversation(0), system])
    with pytest.raises(MalformedRecordError, match="System role not supported") as caught:
        prepare_dataset(_settings(tmp_path / "g" / "*.jsonl", folders["gemma2"]), tmp_path / "out")
    assert caught.value.location == "line 2"
    plain = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(TokenizerSourceError, match="never learns to stop") as caught:
        prepare_dataset(_settings(tmp_path / "g" / "*.jsonl", folders["qwen3"], chat_template=plain), tmp_path / "out")
    assert "a.jsonl at line 1" in str(caught.value) and "fix data.chat_template" in str(caught.value)
    assert str(caught.value).startswith("'data.chat_template': ")  # the spec's template, not the tokenizer
    assert "train a new tokenizer" not in str(caught.value)


def test_a_changed_chat_template_in_the_model_folder_is_a_new_dataset(tmp_path, folders):
    import shutil

    folder = shutil.copytree(folders["qwen3"], tmp_path / "qwen3")
    _write_jsonl(tmp_path / "c" / "a.jsonl", [_conversation(i) for i in range(6)])
    first = prepare_dataset(_settings(tmp_path / "c" / "*.jsonl", folder), tmp_path / "out")
    template = folder / "chat_template.jinja"  # a new revision: the same tokenizer.json, another template
    template.write_text(template.read_text().replace("<|im_start|>", "<|im_start|> "))
    second = prepare_dataset(_settings(tmp_path / "c" / "*.jsonl", folder), tmp_path / "out")
    assert not second.reused and second.digest != first.digest
    assert second.manifest["examples"]["chat_template_sha256"] != first.manifest["examples"]["chat_template_sha256"]
