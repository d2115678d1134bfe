"""Byte-level BPE tokenizer (HF ``tokenizers``), trained on the train split only.

Pipeline: NFC normalizer, ByteLevel pre-tokenizer (GPT-2 regex, no prefix space), BPE model,
ByteLevel decoder, no post-processor (the EOS token is written by the shard writer, not by
``encode``, so prompts encode without it). Special tokens come first: the EOS token is id 0.

Determinism: with ``tokenizers`` 0.23.3 BPE training is deterministic: the same texts give a
byte-identical ``tokenizer.json`` across processes (Rust's per-process hash seeds) and across
thread counts (``RAYON_NUM_THREADS``=1 or many); ``tests/operators/data/test_bpe.py`` checks it
in fresh subprocesses. ``min_frequency=0`` and the full 256-byte initial alphabet are set
explicitly so the vocabulary never depends on which bytes the corpus happens to contain.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from trainforge.data.errors import DataPrepError, TokenizerSourceError


def new_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE tokenizer with the pipeline described in the module doc."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_tokenizer(texts: Iterable[str], *, vocab_size: int, special_tokens: Sequence[str],
                    length: int | None = None) -> Tokenizer:
    """Train on ``texts`` (the train split, any iterable: it is streamed) up to ``vocab_size``
    tokens, specials first. ``length`` is the number of texts when ``texts`` has no ``len``.

    The result may hold fewer than ``vocab_size`` tokens when the texts offer fewer merges;
    every id is still ``< vocab_size``.

    Raises:
        DataPrepError: the EOS (first special) token did not get id 0.
    """
    tokenizer = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if length is None and isinstance(texts, Sequence):
        length = len(texts)
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    eos_id = tokenizer.token_to_id(special_tokens[0])
    if eos_id != 0:
        raise DataPrepError(
            f"tokenizer training gave the EOS token {special_tokens[0]!r} id {eos_id}, "
            "expected 0 (docs/contracts.md); this is a bug in trainforge.data.bpe"
        )
    return tokenizer


def load_tokenizer(text: str, *, uri: str, vocab_size: int | None, eos_token: str,
                   remedy: str | None = None) -> Tokenizer:
    """A reused ``tokenizer.json`` (its content ``text``), checked against the dataset.

    ``vocab_size`` None: a pretrained model's tokenizer, whose ids set the size; ``remedy``:
    the advice its errors give (see :class:`TokenizerSourceError`).

    Raises:
        TokenizerSourceError: not a tokenizer, no ``eos_token``, or more ids than ``vocab_size``.
    """
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as err:  # tokenizers raises a bare Exception for bad JSON
        raise TokenizerSourceError(uri, f"not a tokenizers JSON file ({err})", remedy) from err
    if tokenizer.token_to_id(eos_token) is None:
        raise TokenizerSourceError(uri, f"it has no EOS token {eos_token!r}", remedy)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and size > vocab_size:
        raise TokenizerSourceError(
            uri, f"it has {size} tokens but data.tokenizer.vocab_size is {vocab_size} "
            f"(set vocab_size >= {size}, usually the vocab_size it was trained with)")
    return tokenizer
