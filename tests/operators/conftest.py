"""Fixtures of the hook and task tests: a tiny Hugging Face Llama folder and an MLflow hook."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from trainforge.hooks.mlflow import MlflowHook

_CORPUS = [
    "ROMEO: But soft, what light through yonder window breaks?",
    "JULIET: O Romeo, Romeo, wherefore art thou Romeo?",
    "MERCUTIO: A plague o' both your houses!",
] * 20


@pytest.fixture(scope="session")
def tiny_hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face model folder: 1-layer Llama (hidden 16) + byte-level BPE tokenizer (300).

    Built from scratch in the test (no hub download); what ``trainforge.trainer.export`` writes, in small:
    config.json, generation_config.json, model.safetensors, tokenizer files.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    eos = "<|endoftext|>"
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=eos, bos_token=eos, unk_token=eos, pad_token=eos
    )
    eos_id = tokenizer.token_to_id(eos)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    out = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


@pytest.fixture
def unique_name() -> str:
    """A name no other test uses (experiments and registered models live for the session)."""
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def hook(mlflow_server: str) -> MlflowHook:
    """A hook on the session's MLflow server."""
    return MlflowHook(tracking_uri=mlflow_server)
