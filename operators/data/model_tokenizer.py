"""The tokenizer of a pretrained model folder (Hugging Face layout) and the end-of-text token that
model was trained with, so that ``prepare_dataset`` encodes a corpus for that model.

:func:`model_eos` reads, in this order, ``tokenizer_config.json`` ``eos_token`` (a string or
``{"content": ...}``), else ``generation_config.json`` ``eos_token_id`` (an int or a list: its
first), else ``config.json`` ``eos_token_id``. ``eos_ids`` is every EOS id the model declares:
generation_config's ``eos_token_id`` (else config.json's), plus the EOS token's own id when
they do not list it. :func:`load_model_eos` also names the folder's ``tokenizer.json``, ready for
:class:`~trainforge.data.settings.PrepareSettings` (``tokenizer_uri``, ``eos_token``,
``eos_ids``). The folder is local or an ``s3://`` prefix. No ``transformers`` import.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainforge.data import s3
from trainforge.data.errors import SourceAccessError, TokenizerSourceError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
MODEL_CONFIG = "config.json"
#: The files read, tokenizer.json first (the only one required).
MODEL_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG, GENERATION_CONFIG, MODEL_CONFIG)
#: The files a transformers tokenizer loads from, chat template included (transformers 5 keeps
#: it in chat_template.jinja; older folders in tokenizer_config.json or chat_template.json).
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG, "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json")
#: What a pretrained tokenizer error tells the user to do.
REMEDY = ("the model folder of model.pretrained must hold the tokenizer.json the model was "
          "trained with and declare its end-of-text token (tokenizer_config.json eos_token, "
          "generation_config.json or config.json eos_token_id)")


@dataclass(frozen=True)
class ModelEos:
    """A pretrained folder's tokenizer and EOS, as the data settings take them.

    Attributes:
        tokenizer_uri: ``<folder>/tokenizer.json`` (a local path or an ``s3://`` URI).
        eos_token: the token written after every document.
        eos_ids: every EOS id the model declares; includes the id of ``eos_token``.
        declared_in: where ``eos_token`` came from, e.g. ``"tokenizer_config.json eos_token"``.
    """

    tokenizer_uri: str
    eos_token: str
    eos_ids: tuple[int, ...]
    declared_in: str


def model_file_uri(folder: str | Path, name: str) -> str:
    """``folder/name`` for a local folder or an ``s3://`` prefix."""
    folder = str(folder)
    return f"{folder.rstrip('/')}/{name}" if s3.is_s3(folder) else str(Path(folder) / name)


def read_model_files(folder: str | Path, client: Any = None,
                     names: tuple[str, ...] = MODEL_FILES) -> dict[str, bytes | None]:
    """The bytes of ``names`` (:data:`MODEL_FILES`) in ``folder`` (None for a missing optional one).

    ``client``: a boto3 S3 client (an ``s3://`` folder only).

    Raises:
        TokenizerSourceError: no tokenizer.json.
        SourceAccessError: a file exists but cannot be read.
    """
    files: dict[str, bytes | None] = {}
    for name in names:
        uri = model_file_uri(folder, name)
        data = _read_s3(client, uri) if s3.is_s3(uri) else _read_local(uri)
        if data is None and name == TOKENIZER_FILE:
            raise TokenizerSourceError(uri, "the file does not exist", remedy=REMEDY)
        files[name] = data
    return files


def load_model_eos(folder: str | Path, client: Any = None) -> ModelEos:
    """The folder's tokenizer.json URI and the model's EOS (see :func:`model_eos`).

    Raises:
        TokenizerSourceError, SourceAccessError: see :func:`read_model_files`, :func:`model_eos`.
    """
    files = read_model_files(folder, client)
    token, ids, declared_in = _model_eos(files, str(folder))
    return ModelEos(model_file_uri(folder, TOKENIZER_FILE), token, tuple(ids), declared_in)


def model_eos(folder_or_files: str | Path | Mapping[str, bytes | str | None],
              client: Any = None) -> tuple[str, list[int]]:
    """``(eos_token, eos_ids)`` of a pretrained model (rules in the module doc).

    Args:
        folder_or_files: a local folder or ``s3://`` prefix, or its files already read
            (file name -> content, None or absent when missing; tokenizer.json required).
        client: a boto3 S3 client, for an ``s3://`` folder.

    Raises:
        TokenizerSourceError: no EOS declared, a declaration of the wrong type, a file that is
            not JSON, or an EOS token / id that tokenizer.json does not hold; the message names
            the file, the field and the value.
    """
    if isinstance(folder_or_files, Mapping):
        files = {n: folder_or_files.get(n) for n in MODEL_FILES}
        if files[TOKENIZER_FILE] is None:
            raise TokenizerSourceError(TOKENIZER_FILE, "the file is missing", remedy=REMEDY)
        token, ids, _ = _model_eos(files, "")
    else:
        token, ids, _ = _model_eos(read_model_files(folder_or_files, client), str(folder_or_files))
    return token, ids


def _model_eos(files: Mapping[str, bytes | str | None], folder: str) -> tuple[str, list[int], str]:
    from tokenizers import Tokenizer

    def where(name: str) -> str:
        return model_file_uri(folder, name) if folder else name

    def fail(name: str, problem: str) -> TokenizerSourceError:
        return TokenizerSourceError(where(name), problem, remedy=REMEDY)

    text = _text(files[TOKENIZER_FILE], where(TOKENIZER_FILE))
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as err:  # tokenizers raises a bare Exception for bad JSON
        raise fail(TOKENIZER_FILE, f"not a tokenizers JSON file ({err})") from err
    largest = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)

    def token_of(name: str, value: int) -> str:
        token = tokenizer.id_to_token(value)
        if token is None:
            raise fail(name, f"eos_token_id {value} is not an id of {where(TOKENIZER_FILE)} "
                             f"(its ids are 0 ... {largest})")
        return token

    configs = {n: _json(files.get(n), where(n)) for n in MODEL_FILES[1:]}
    declared_ids: list[int] = []
    ids_from = ""
    for name in (GENERATION_CONFIG, MODEL_CONFIG):
        value = configs[name].get("eos_token_id")
        if value is not None:
            declared_ids = _ids(value, fail, name)
            ids_from = name
            break
    for value in declared_ids:
        token_of(ids_from, value)

    value = configs[TOKENIZER_CONFIG].get("eos_token")
    if value is not None:
        token = value.get("content") if isinstance(value, dict) else value
        if not isinstance(token, str) or not token:
            raise fail(TOKENIZER_CONFIG, f"eos_token is {value!r}, expected a token string "
                                         "or {\"content\": <token string>}")
        eos_id = tokenizer.token_to_id(token)
        if eos_id is None:
            raise fail(TOKENIZER_CONFIG, f"eos_token {token!r} is not in the vocabulary of "
                                         f"{where(TOKENIZER_FILE)}")
        declared_in = f"{TOKENIZER_CONFIG} eos_token"
    elif declared_ids:
        eos_id = declared_ids[0]
        token = token_of(ids_from, eos_id)
        declared_in = f"{ids_from} eos_token_id"
    else:
        raise TokenizerSourceError(
            folder or "the model folder", f"no end-of-text token declared: none of "
            f"{TOKENIZER_CONFIG} eos_token, {GENERATION_CONFIG} eos_token_id, {MODEL_CONFIG} "
            "eos_token_id is set", remedy=REMEDY)
    ids = declared_ids + ([eos_id] if eos_id not in declared_ids else [])
    return token, ids, declared_in


def _ids(value: object, fail: Any, name: str) -> list[int]:
    """An ``eos_token_id`` value (an int or a non-empty list of ints), without repeats."""
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                             for v in values):
        raise fail(name, f"eos_token_id is {value!r}, expected a token id (an integer >= 0) "
                         "or a non-empty list of them")
    return list(dict.fromkeys(values))


def _text(data: bytes | str | None, uri: str) -> str:
    if isinstance(data, str) or data is None:
        return data or ""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise TokenizerSourceError(uri, f"not UTF-8 ({err})", remedy=REMEDY) from err


def _json(data: bytes | str | None, uri: str) -> dict[str, Any]:
    """A JSON object file's content; {} for a missing file."""
    if data is None:
        return {}
    try:
        value = json.loads(_text(data, uri))
    except ValueError as err:
        raise TokenizerSourceError(uri, f"not JSON ({err})", remedy=REMEDY) from err
    if not isinstance(value, dict):
        raise TokenizerSourceError(uri, f"holds a JSON {type(value).__name__}, expected an "
                                        "object", remedy=REMEDY)
    return value


def _read_local(path: str) -> bytes | None:
    try:
        return Path(path).expanduser().read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise SourceAccessError(path, "read", str(err.strerror or err),
                                "check the model folder of model.pretrained") from err


def _read_s3(client: Any, uri: str) -> bytes | None:
    if client is None:
        raise SourceAccessError(uri, "read", "no S3 client was given for an s3:// model folder")
    return s3.read_optional(client, uri)
