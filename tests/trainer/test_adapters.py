"""LoRA adapters (trainforge.trainer.adapters) on the tiny open-weights families: the targets
`auto` picks, the errors for targets that match nothing, a model unchanged until the first step,
and merged weights equal to peft's own ``merge_and_unload`` (the reference)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.hf_models import FAMILIES
from trainforge.trainer.adapters import adapter_weights, apply_lora, merged_weights, targets_for
from trainforge.trainer.config import LoraSettings
from trainforge.trainer.errors import ConfigError

AUTO = LoraSettings(r=4, alpha=8.0, dropout=0.0, target_modules=None, merge=True)


def _model(hf_model, family: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_model(family)), dtype=torch.float32)


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_wraps_every_attention_and_mlp_projection_and_only_they_train(hf_model, family):
    model = _model(hf_model, family)
    layers = model.config.num_hidden_layers
    before = copy.deepcopy(model)
    apply_lora(model, AUTO)
    names = list(adapter_weights(model))  # the adapters a LoRA checkpoint holds, in model order
    assert len(names) == layers * 7 * 2  # q k v o gate up down, A and B each
    assert all(".lora_A.default." in n or ".lora_B.default." in n for n in names)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == names
    ids = torch.randint(0, 300, (2, 12))
    with torch.no_grad():  # B starts at zero: the model answers as before until it trains
        assert torch.equal(model(input_ids=ids).logits, before(input_ids=ids).logits)


def test_merged_weights_equal_peft_merge_and_unload(hf_model):
    import peft

    model = _model(hf_model, "llama")
    reference = copy.deepcopy(model)
    apply_lora(model, LoraSettings(r=4, alpha=16.0, dropout=0.0, target_modules=("q_proj", "down_proj"), merge=True))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.normal_(std=0.05)
    config = peft.LoraConfig(r=4, lora_alpha=16.0, target_modules=["q_proj", "down_proj"], lora_dropout=0.0)
    wrapped = peft.get_peft_model(reference, config)
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if p.requires_grad:
                p.copy_(adapters[name.removeprefix("base_model.model.")])
    expected = wrapped.merge_and_unload().state_dict()
    merged = merged_weights(model)
    assert set(merged) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=1e-6, atol=1e-7, msg=name)


def test_targets_that_match_nothing_are_refused_naming_the_model_layers(hf_model):
    model = _model(hf_model, "qwen3")
    with pytest.raises(ConfigError, match=r"\['qkv'\] match no linear layer of this qwen3 model.*q_proj"):
        targets_for(model, LoraSettings(4, 8.0, 0.0, ("q_proj", "qkv"), True))
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ConfigError, match="target_modules=auto knows no targets for model_type 'gpt2'"):
        targets_for(gpt2, AUTO)


def test_frozen_weights_are_counted_without_weight_gradients():
    from trainforge.trainer.goodput import flops_per_token

    attention = 12 * 2 * 4 * 16 * 64
    assert flops_per_token(1000, 2, 4, 16, 64) == 6 * 1000 + attention  # every weight trains
    assert flops_per_token(1000, 2, 4, 16, 64, trainable_non_embedding=10) == 4 * 1000 + 2 * 10 + attention
