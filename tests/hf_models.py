"""Tiny random-weight causal LMs saved in Hugging Face layout, for the open-weights tests.

`make_hf_model` writes a folder shaped like a real open-weights checkpoint of one of four
families (config.json, bf16 ``*.safetensors`` shards + ``model.safetensors.index.json``,
tokenizer.json + tokenizer_config.json with the family's special tokens and chat template,
generation_config.json with its EOS list, a README.md model card), all built locally: no
network, nothing downloaded. `reference_loss` is what plain transformers computes on such a
folder, the number a trainer's loss is compared to; `sample_ids` cuts token ids to feed it.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch

FAMILIES = ("llama", "qwen3", "mistral", "gemma2")

#: The built-in corpus: the BPE tokenizer is trained on it and `sample_ids` encodes it.
TEXT = """\
The river starts high in the hills, where snow melts slowly in the spring and runs down through
the pines. By the time it reaches the valley it is wide and calm, and the farmers along its banks
use the water for their fields of wheat, barley and beans. In the summer the children swim near
the old stone bridge, and in the autumn the leaves of the willows turn yellow and fall into the
current, which carries them past the mill and on towards the sea.

A small town grew up around the mill more than three hundred years ago. Its market square still
has the same cobbles, and every Saturday the traders set out their stalls: bread and cheese,
apples and pears, honey in glass jars, wool from the sheep on the northern slopes. People come
from the villages nearby to buy, to sell and to talk, and the talk is mostly about the weather,
the price of grain and who is going to marry whom.

The school stands at the top of the hill behind the church. It has four classrooms, a library
with a few thousand books and a garden where the pupils grow tomatoes and sunflowers. The
teachers say that the best lessons happen outside, when the class walks down to the river to
measure how fast the water flows, to count the birds on the far bank or to draw the shapes of
the clouds before a storm.

In the evening the lights come on in the windows one by one. Someone plays the piano in the
house by the bakery, a dog barks twice and is quiet, and the last bus leaves for the city at ten
past nine. Later, when the streets are empty, you can hear the river again, the same steady sound
it has made for thousands of years, long before the mill, the market or the school were built.

Numbers matter too: the bridge is 42 metres long, the mill wheel turns 12 times a minute, and in
the flood of 1897 the water rose 3.5 metres above the path. Questions? Ask the keeper; she knows.
"""

#: Byte-level BPE size before special tokens (256 byte symbols + merges).
_BPE_VOCAB = 512
_PAD_MULTIPLE = 64
_STD = 0.1

# Per family: special tokens (in id order), where they go (start of the vocabulary, as
# Mistral/Gemma put them, or after the BPE vocabulary, as Llama 3/Qwen do), the tokenizer's
# bos/eos/pad, whether encoding prepends bos, the generation EOS list, and the chat template.
_LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
_CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set system_message = none %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system_message %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- else %}{{- ' ' + message['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}"
)
_GEMMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- raise_exception('System role not supported') }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

_TOKENS = {
    "llama": dict(
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>", "<|finetune_right_pad_id|>"],
        specials_first=False, bos="<|begin_of_text|>", eos="<|end_of_text|>",
        pad="<|finetune_right_pad_id|>", add_bos=True,
        generation_eos=["<|end_of_text|>", "<|eot_id|>"], template=_LLAMA3_TEMPLATE),
    # Qwen tokenizers have no bos token (bos_token null); config.json's bos_token_id is
    # <|endoftext|> there, as in the real Qwen3 checkpoints.
    "qwen3": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        specials_first=False, bos=None, eos="<|im_end|>", pad="<|endoftext|>", add_bos=False,
        config_bos="<|endoftext|>",
        generation_eos=["<|im_end|>", "<|endoftext|>"], template=_CHATML_TEMPLATE),
    "mistral": dict(
        specials=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
        specials_first=True, bos="<s>", eos="</s>", pad="<unk>", add_bos=True,
        generation_eos=["</s>"], template=_MISTRAL_TEMPLATE),
    "gemma2": dict(
        specials=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
        specials_first=True, bos="<bos>", eos="<eos>", pad="<pad>", add_bos=True,
        generation_eos=["<eos>", "<end_of_turn>"], template=_GEMMA_TEMPLATE),
}

_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=256)


def _build_tokenizer(family: str):
    """A byte-level BPE trained on :data:`TEXT` with the family's special tokens, wrapped as a
    transformers fast tokenizer with bos/eos/pad and the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    spec = _TOKENS[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    first = spec["specials"] if spec["specials_first"] else []
    trainer = trainers.BpeTrainer(vocab_size=_BPE_VOCAB + len(first), special_tokens=first,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([p for p in TEXT.split("\n\n")], trainer=trainer)
    if not spec["specials_first"]:
        tok.add_special_tokens(spec["specials"])
    if spec["add_bos"]:
        bos = spec["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=spec["bos"], eos_token=spec["eos"],
        pad_token=spec["pad"], chat_template=spec["template"], model_max_length=_TINY[
            "max_position_embeddings"], clean_up_tokenization_spaces=False)


def _config(family: str, vocab_size: int, ids: dict[str, int | None]):
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen3Config

    common = dict(_TINY, vocab_size=vocab_size, bos_token_id=ids["bos"],
                  eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    if family == "llama":
        # transformers 5 spells RoPE settings as `rope_parameters` (rope_theta inside it);
        # `rope_scaling` / top-level `rope_theta` are the 4.x spelling, converted on load.
        return LlamaConfig(**common, tie_word_embeddings=False, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=64))
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=16, tie_word_embeddings=True,
                           rope_parameters=dict(rope_type="default", rope_theta=1000000.0))
    if family == "mistral":
        return MistralConfig(**common, sliding_window=16, tie_word_embeddings=False,
                             rope_parameters=dict(rope_type="default", rope_theta=1000000.0))
    if family == "gemma2":
        # Softcaps far below the real 50/30 and a query_pre_attn_scalar != head_dim, so that
        # each changes the loss of these small-logit random weights measurably.
        return Gemma2Config(**common, head_dim=16, tie_word_embeddings=True,
                            attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
                            query_pre_attn_scalar=32, sliding_window=16,
                            hidden_activation="gelu_pytorch_tanh",
                            rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def _randomise(model: torch.nn.Module, family: str, seed: int) -> None:
    """Matrices ~ N(0, 0.1) (large enough for peaked attention and logits of std ~1); norm
    weights random around their neutral value (1, or 0 for Gemma's ``1 + weight`` norms), so
    that a wrongly loaded tensor or a missed family feature changes the loss visibly."""
    # The family goes into the seed too: two families of the same shapes (llama, mistral)
    # must not have the same bytes, or a folder mix-up would go unseen.
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(family.encode()))
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.dim() >= 2:
                param.copy_(noise * _STD)
            else:
                neutral = float(param.detach().float().mean().round())
                param.copy_(neutral + noise * 0.1)


#: Per family, the text that closes an assistant turn (the end-of-turn token).
END_OF_TURN = {"llama": "<|eot_id|>", "qwen3": "<|im_end|>", "mistral": "</s>", "gemma2": "<end_of_turn>"}


def save_tokenizer(dest: Path, family: str) -> Path:
    """Only the tokenizer of `make_hf_model` (tokenizer.json, tokenizer_config.json with the
    chat template), saved into ``dest``: for tests of rendering that need no weights."""
    _build_tokenizer(family).save_pretrained(dest)
    return Path(dest)


def make_hf_model(dest: Path, family: str, *, shards: int = 3, seed: int = 0) -> Path:
    """Save a tiny random ``family`` causal LM in Hugging Face layout into ``dest`` (created)
    and return it: bf16 weights in at least ``shards`` safetensors shards with an index, the
    tokenizer, generation_config.json and a README.md model card. Same arguments, same bytes."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    spec = _TOKENS[family]

    tokenizer = _build_tokenizer(family)
    ids = {key: tokenizer.convert_tokens_to_ids(spec[key]) if spec[key] else None
           for key in ("bos", "eos", "pad")}
    if "config_bos" in spec:
        ids["bos"] = tokenizer.convert_tokens_to_ids(spec["config_bos"])
    vocab_size = math.ceil(len(tokenizer) / _PAD_MULTIPLE) * _PAD_MULTIPLE
    config = _config(family, vocab_size, ids)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, family, seed)
    model = model.to(torch.bfloat16)

    total = sum(p.numel() * p.element_size() for p in model.state_dict().values()
                if p is not None)
    model.save_pretrained(dest, max_shard_size=total // (shards + 1))
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= shards, f"{family}: {len(files)} shards, wanted >= {shards}"
    assert all((dest / name).is_file() for name in files), files

    tokenizer.save_pretrained(dest)
    eos_list = [tokenizer.convert_tokens_to_ids(t) for t in spec["generation_eos"]]
    GenerationConfig(bos_token_id=ids["bos"], eos_token_id=eos_list,
                     pad_token_id=ids["pad"]).save_pretrained(dest)
    (dest / "README.md").write_text(
        f"---\nlicense: apache-2.0\nlibrary_name: transformers\npipeline_tag: text-generation\n---\n\n"
        f"# tiny-random-{family}\n\nRandom weights for tests; not a trained model.\n")
    return dest


def shard_files(folder: Path) -> list[str]:
    """The shard file names ``model.safetensors.index.json`` names, sorted."""
    index = json.loads((Path(folder) / "model.safetensors.index.json").read_text())
    return sorted(set(index["weight_map"].values()))


def reference_loss(folder: Path, input_ids: torch.Tensor) -> float:
    """Mean next-token cross-entropy of ``input_ids`` (labels = input_ids, transformers' own
    shift) from the folder loaded by plain ``AutoModelForCausalLM.from_pretrained`` in fp32.

    Uses ``attn_implementation="eager"``: the straightforward matmul-softmax path every family
    has, which applies Gemma 2's attention-logit softcapping (transformers recommends eager for
    Gemma 2) and the sliding-window mask explicitly, so it is the reference for all four."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        out = model(input_ids=input_ids, labels=input_ids)
    return float(out.loss)


def sample_ids(folder: Path, batch: int = 2, length: int = 32, seed: int = 0) -> torch.Tensor:
    """A (batch, length) int64 tensor of :data:`TEXT` encoded with the folder's tokenizer:
    ``batch`` windows at seeded random offsets."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor(tokenizer(TEXT, verbose=False)["input_ids"], dtype=torch.int64)
    if ids.numel() < length:
        raise ValueError(f"{folder}: text encodes to {ids.numel()} tokens, fewer than {length}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - length + 1, (batch,), generator=gen)
    return torch.stack([ids[int(s):int(s) + length] for s in starts])


if __name__ == "__main__":  # a tiny model to try open weights without network: python -m tests.hf_models DEST FAMILY
    import sys

    if len(sys.argv) != 3 or sys.argv[2] not in FAMILIES:
        sys.exit(f"usage: python -m tests.hf_models DEST FAMILY (FAMILY one of {', '.join(FAMILIES)})")
    print(f"saved a tiny random-weight {sys.argv[2]} in Hugging Face layout at {make_hf_model(Path(sys.argv[1]), sys.argv[2])}")
