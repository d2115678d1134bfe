"""The tiny Hugging Face model folders of tests/hf_models.py are shaped like real open-weights
checkpoints: sharded bf16 safetensors with a complete index, a tokenizer with the family's
special tokens and chat template, an EOS list in generation_config.json, weights that plain
transformers loads without missing keys, and a reproducible reference loss."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.hf_models import FAMILIES, make_hf_model, reference_loss, sample_ids, shard_files

EOS_LISTS = {
    "llama": ["<|end_of_text|>", "<|eot_id|>"],
    "qwen3": ["<|im_end|>", "<|endoftext|>"],
    "mistral": ["</s>"],
    "gemma2": ["<eos>", "<end_of_turn>"],
}
CHAT = [{"role": "user", "content": "Where is the mill?"},
        {"role": "assistant", "content": "By the river."}]
RENDERED = {
    "llama": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhere is the mill?<|eot_id|>"
             "<|start_header_id|>assistant<|end_header_id|>\n\nBy the river.<|eot_id|>",
    "qwen3": "<|im_start|>user\nWhere is the mill?<|im_end|>\n<|im_start|>assistant\nBy the river.<|im_end|>\n",
    "mistral": "<s>[INST] Where is the mill? [/INST] By the river.</s>",
    "gemma2": "<bos><start_of_turn>user\nWhere is the mill?<end_of_turn>\n"
              "<start_of_turn>model\nBy the river.<end_of_turn>\n",
}


def _tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("family", FAMILIES)
def test_layout_shards_and_index(hf_model, family):
    from safetensors import safe_open

    folder = hf_model(family)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors.index.json"):
        assert (folder / name).is_file(), name
    assert (folder / "README.md").read_text().startswith("---\nlicense: apache-2.0\n")
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    files = shard_files(folder)
    assert len(files) >= 3
    assert sorted(p.name for p in folder.glob("*.safetensors")) == files
    found = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as shard:
            for key in shard.keys():
                found[key] = name
                assert shard.get_slice(key).get_dtype() == "BF16", key
    assert found == weight_map


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_without_missing_keys(hf_model, family):
    from transformers import AutoModelForCausalLM

    folder = hf_model(family)
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert not info["error_msgs"]
    config = model.config
    tokenizer = _tokenizer(folder)
    assert config.vocab_size % 64 == 0 and len(tokenizer) <= config.vocab_size < len(tokenizer) + 64
    assert 400 <= len(tokenizer) <= 600
    assert (config.eos_token_id, config.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    if family == "qwen3":  # Qwen has no bos token; its config names <|endoftext|>, as the real ones do
        assert tokenizer.bos_token is None
        assert config.bos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    else:
        assert config.bos_token_id == tokenizer.bos_token_id
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == (family in ("qwen3", "gemma2"))
    if family == "llama":
        assert config.rope_parameters["rope_type"] == "llama3"
        assert config.rope_parameters["factor"] == 8.0
    if family in ("mistral", "gemma2"):
        assert config.sliding_window == 16
    if family == "gemma2":
        assert config.attn_logit_softcapping and config.final_logit_softcapping
        assert config.query_pre_attn_scalar != config.head_dim == 16
    if family == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in model.state_dict()


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_and_eos_list(hf_model, family):
    folder = hf_model(family)
    tokenizer = _tokenizer(folder)
    assert tokenizer.apply_chat_template(CHAT, tokenize=False) == RENDERED[family]
    prompt = tokenizer.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.startswith(RENDERED[family][:20])
    if family == "gemma2":
        with pytest.raises(Exception, match="System role not supported"):
            tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}, *CHAT], tokenize=False)
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.convert_tokens_to_ids(t) for t in EOS_LISTS[family]]
    assert generation["pad_token_id"] == tokenizer.pad_token_id


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_loss_near_uniform(hf_model, family):
    folder = hf_model(family)
    ids = sample_ids(folder)
    assert ids.shape == (2, 32) and ids.dtype == torch.int64
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    assert int(ids.max()) < vocab
    loss = reference_loss(folder, ids)
    assert math.isfinite(loss)
    assert 1e-2 < abs(loss - math.log(vocab)) < 1.0
    assert reference_loss(folder, ids) == loss


@pytest.mark.parametrize("family", FAMILIES)
def test_same_seed_same_bytes(hf_model, tmp_path, family):
    first = hf_model(family)
    again = make_hf_model(tmp_path / "again", family)
    other = make_hf_model(tmp_path / "other", family, seed=1)
    files = shard_files(first)
    assert shard_files(again) == files
    for name in [*files, "model.safetensors.index.json", "config.json", "tokenizer.json"]:
        assert (again / name).read_bytes() == (first / name).read_bytes(), name
    assert any((other / name).read_bytes() != (first / name).read_bytes() for name in shard_files(other))
