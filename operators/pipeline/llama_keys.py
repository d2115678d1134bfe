"""Which ``transformers.LlamaConfig`` keys ``model.config_overrides`` may set, and their types.

Committed as data so that reading a spec never imports transformers; a test compares it with
the installed ``LlamaConfig`` (tests/operators/pipeline/test_model_section.py), so a transformers
upgrade that adds, renames or retypes a key fails that test until this file is updated.

Every key of ``LlamaConfig().to_dict()`` is in exactly one of the three tables below.
"""

from __future__ import annotations

#: Keys an override may set -> JSON types accepted ("int", "float", "bool", "str", "null").
#: "float" also accepts an integer (YAML reads ``1`` as one).
OVERRIDABLE: dict[str, tuple[str, ...]] = {
    "attention_bias": ("bool",),
    "head_dim": ("int", "null"),
    "hidden_act": ("str",),
    "initializer_range": ("float",),
    "mlp_bias": ("bool",),
    "pretraining_tp": ("int",),
    "rms_norm_eps": ("float",),
}

#: Keys trainforge sets itself -> where the value comes from (an override would clash).
FIRST_CLASS: dict[str, str] = {
    "attention_dropout": "model.dropout",
    "bos_token_id": "the tokenizer's end-of-text token",
    "eos_token_id": "the tokenizer's end-of-text token",
    "hidden_size": "model.hidden_size",
    "intermediate_size": "model.intermediate_size",
    "max_position_embeddings": "data.sequence_length",
    "num_attention_heads": "model.num_heads",
    "num_hidden_layers": "model.num_layers",
    "num_key_value_heads": "model.num_kv_heads",
    "pad_token_id": "the tokenizer's end-of-text token",
    "rope_parameters": "model.rope_theta",
    "tie_word_embeddings": "model.tie_word_embeddings",
    "use_cache": "the trainer (off in training, on in the exported model)",
    "vocab_size": "the dataset's tokenizer (data.tokenizer)",
}

#: Keys that describe no architecture (bookkeeping of transformers' ``PretrainedConfig``).
NOT_ARCHITECTURE: frozenset[str] = frozenset({
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "id2label",
    "is_encoder_decoder", "label2id", "model_type", "output_attentions", "output_hidden_states",
    "problem_type", "return_dict", "transformers_version",
})

#: Aliases users write for first-class keys (transformers accepts them too).
FIRST_CLASS_ALIASES: dict[str, str] = {"rope_theta": "model.rope_theta"}
