"""Open weights: a Hugging Face model folder as the job's model (docs/model.md, "Open weights").

`open_folder` gives a local view of the job config's ``pretrained.folder`` (an ``s3://`` prefix is
downloaded while it is open). `read_config` reads its ``config.json`` with transformers' own
`AutoConfig` and refuses what is not a decoder-only causal LM; `check_shards` reads the safetensors
headers (no tensor data) against the model the config builds; `load_pretrained` then builds it
on the meta device and fills it from the shards straight onto the training device. Every problem is a
`ConfigError` (exit 78, never retried) naming the file and the tensor or field. Under FSDP2,
`build_empty` and `fill_shards` load each rank's rows of each tensor only, after sharding.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trainforge.contract import PRETRAINED_OVERRIDABLE
from trainforge.storage import storage_for
from trainforge.trainer.config import ModelConfig
from trainforge.trainer.errors import ConfigError

log = logging.getLogger(__name__)

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER = "tokenizer.json"
#: Bytes of fp32 rows `fill_shards` converts at a time: a tensor is never held twice in full.
FILL_CHUNK_BYTES = 64 << 20
#: Files of a model folder besides the weights that travel with it (export copies them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


@contextlib.contextmanager
def open_folder(location: str) -> Iterator[Path]:
    """A local folder with the model's files: ``location`` itself, or an ``s3://`` prefix downloaded."""
    store = storage_for(location)
    local = store.local_path(location)
    if local is not None:
        if not (local / CONFIG).is_file():
            raise ConfigError(f"pretrained.folder {local}: no {CONFIG} (expected a Hugging Face model folder)")
        yield local
        return
    names = store.list_files(location)
    if CONFIG not in names:
        raise ConfigError(f"pretrained.folder {location}: no {CONFIG} (expected a Hugging Face model folder)")
    with store.local_dir(location, names) as folder:
        yield folder


def read_config(folder: Path, model: ModelConfig) -> Any:
    """The folder's transformers config, with the job's dropout and allowed overrides applied.

    Raises:
        ConfigError: no or unreadable config.json, an architecture transformers does not know, or
            one that is not a decoder-only causal LM (an encoder, seq2seq or vision model).
    """
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = folder / CONFIG
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: cannot read ({err})") from err
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not isinstance(model_type, str):
        raise ConfigError(f"{path}: no model_type field (expected a transformers config.json)")
    try:
        config = AutoConfig.from_pretrained(str(folder))
    except (ValueError, KeyError, TypeError, OSError) as err:
        raise ConfigError(f"{path}: model_type {model_type!r} is not an architecture this transformers knows "
                          f"({type(err).__name__}: {str(err).splitlines()[0]})") from err
    architectures = [a for a in (raw.get("architectures") or []) if isinstance(a, str)]
    causal = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not getattr(config, "is_encoder_decoder", False)
    if not causal or (architectures and not any(a.endswith("ForCausalLM") for a in architectures)):
        found = ", ".join(architectures) or type(config).__name__
        raise ConfigError(f"{path}: {found} (model_type {model_type!r}) is not a decoder-only causal LM; "
                          f"expected a model AutoModelForCausalLM builds (a *ForCausalLM architecture)")
    unknown = [a for a in architectures if not hasattr(transformers, a)]
    if unknown:  # the model is built from model_type: a class named here but not built is a wrong folder
        built = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
        raise ConfigError(f"{path}: architectures names {', '.join(unknown)}, a class this transformers "
                          f"{transformers.__version__} does not have; expected {built} for model_type "
                          f"{model_type!r}")
    if model.dropout is not None:
        _override(config, path, "attention_dropout", model.dropout, "model.dropout")
    for key, value in model.config_overrides.items():
        if key not in PRETRAINED_OVERRIDABLE:
            raise ConfigError(f"model.config_overrides.{key}: not a key a pretrained model may override "
                              f"(expected one of {sorted(PRETRAINED_OVERRIDABLE)})")
        _override(config, path, key, value, f"model.config_overrides.{key}")
    config.use_cache = False
    # softcapped attention scores exist only in the eager kernel (Gemma 2); sdpa elsewhere
    config._attn_implementation = "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"
    return config


def _override(config: Any, path: Path, key: str, value: Any, field: str) -> None:
    if not hasattr(config, key):
        raise ConfigError(f"{field}={value!r}: {type(config).__name__} of {path} has no {key}")
    setattr(config, key, value)


def shard_shapes(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{tensor name: (shape, shard file)}`` from the safetensors headers (no tensor data read).

    Raises:
        ConfigError: no weights, an index naming a missing shard, or a tensor its shard lacks.
    """
    from safetensors import safe_open

    index_path = folder / INDEX
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"{index_path}: cannot read its weight_map ({err})") from err
    elif (folder / SINGLE).is_file():
        weight_map = None
    else:
        raise ConfigError(f"{folder}: neither {INDEX} nor {SINGLE} (no weights)")
    files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE]
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise ConfigError(f"{index_path}: names shard {name}, which is missing from {folder}")
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    shapes[key] = (tuple(f.get_slice(key).get_shape()), name)
        except Exception as err:  # safetensors raises its own error types for a damaged header
            raise ConfigError(f"{path}: not a readable safetensors file ({type(err).__name__}: {err})") from err
    for key, name in (weight_map or {}).items():
        if key not in shapes or shapes[key][1] != name:
            raise ConfigError(f"{index_path}: tensor {key} is indexed in {name}, which does not hold it")
    return shapes


def check_shards(folder: Path, config: Any) -> None:
    """Refuse shards that do not fill the model ``config`` builds: a parameter missing from every
    shard (tied aliases aside), a tensor the model has no place for, or a shape that differs.

    Raises:
        ConfigError: naming the shard file, the tensor and both shapes.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    expected = {n: tuple(t.shape) for n, t in meta.state_dict().items()}
    persistent = set(expected)
    tied = _tied_names(meta)
    shapes = shard_shapes(folder)
    unexpected = sorted(n for n in shapes if n not in persistent)
    if unexpected:
        name = unexpected[0]
        raise ConfigError(f"{folder / shapes[name][1]}: tensor {name} has no place in {type(meta).__name__} "
                          f"({len(unexpected)} such tensors; config.json describes another model)")
    missing = sorted(n for n in persistent - set(shapes) - tied)
    if missing:
        raise ConfigError(f"{folder}: tensor {missing[0]} of {type(meta).__name__} is in no shard "
                          f"({len(missing)} missing; a shard or index entry lost?)")
    for name, (shape, file) in sorted(shapes.items()):
        if shape != expected[name]:
            raise ConfigError(f"{folder / file}: tensor {name} has shape {list(shape)}, but config.json gives "
                              f"{list(expected[name])}{_sizing_fields(config, shape, expected[name])}")


def _sizing_fields(config: Any, found: tuple, expected: tuple) -> str:
    """The config.json fields whose value is a size the weights disagree with, for the message."""
    sizes = {b for a, b in zip(found, expected) if a != b}
    fields = sorted(key for key, value in config.to_dict().items()
                    if type(value) is int and value in sizes and not key.endswith("_id"))
    return f" (config.json's {', '.join(f'{k}: {getattr(config, k)}' for k in fields)})" if fields else ""


def _tied_names(model: torch.nn.Module) -> set[str]:
    """State-dict names tied to another tensor (``lm_head.weight`` with tied embeddings)."""
    tied = getattr(model, "all_tied_weights_keys", None)
    if isinstance(tied, dict):
        return set(tied)
    return set()


def build_empty(config: Any) -> torch.nn.Module:
    """The model of ``config`` on the meta device (no memory, no initialisation), tied as the
    config says: for FSDP2 to shard before `fill_shards` materialises it and reads each rank's rows."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # from_config does not tie meta parameters
    return model


@torch.no_grad()
def fill_shards(model: torch.nn.Module, folder: Path, device: torch.device | str) -> None:
    """Materialise a `build_empty` model (after ``fully_shard``, or whole) on ``device``: its buffers
    computed from the config by transformers' own initialisation of the modules holding them
    (rotary frequencies with the config's rope type, embedding scales), then each rank's rows of
    every parameter read from the safetensors files (``get_slice``: only those rows), as fp32.
    Call `check_shards` first.

    Raises:
        ConfigError: a parameter no shard holds (tied aliases aside), or a shape that differs.
    """
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    model.to_empty(device=device)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if getattr(model.config, "tie_word_embeddings", False) and head is not None and head.weight is not embed.weight:
        model.tie_weights()  # to_empty gave the tied pair two tensors: one again
    for module in model.modules():  # as from_pretrained does for buffers no checkpoint holds
        if next(module.buffers(recurse=False), None) is not None:
            model._init_weights(module)  # parameters it touches are overwritten below
    params = dict(model.named_parameters())  # one name per tensor: tied aliases are not repeated
    by_file: dict[str, list[str]] = {}
    for name, (_, file) in shard_shapes(folder).items():
        by_file.setdefault(file, []).append(name)
    filled = set()
    for file, names in sorted(by_file.items()):
        with safe_open(str(folder / file), framework="pt", device="cpu") as f:
            for name in names:
                param = params.get(name)
                if param is None:
                    continue  # a tied alias saved anyway: its source fills it
                local, start = (param.to_local(), _row_offset(param)) if isinstance(param, DTensor) else (param, 0)
                _fill_rows(local, f.get_slice(name), start)
                filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        raise ConfigError(f"{folder}: tensor {missing[0]} is in no shard ({len(missing)} missing)")


def _fill_rows(local: torch.Tensor, source: Any, start: int) -> None:
    """Copy rows ``start...`` of a safetensors slice into ``local`` a chunk at a time (`FILL_CHUNK_BYTES`),
    converting to ``local``'s dtype on the way: no full-size copy of the tensor in either dtype."""
    if local.dim() == 0:
        local.copy_(source[...])
        return
    row_bytes = max(1, local[:1].numel() * local.element_size())
    rows = max(1, FILL_CHUNK_BYTES // row_bytes)
    for first in range(0, local.shape[0], rows):
        end = min(first + rows, local.shape[0])
        local[first:end].copy_(source[start + first:start + end])


def _row_offset(param: Any) -> int:
    """The first global row of this rank's shard of a ``Shard(0)`` DTensor (FSDP2's layout)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return int(offset[0])


def load_pretrained(folder: Path, config: Any, device: torch.device | str) -> torch.nn.Module:
    """The model of ``config`` with the folder's weights, in fp32 on ``device``.

    Built on the meta device, materialised on ``device`` and filled there from the memory-mapped
    shards (`fill_shards`; no random initialisation of what is then overwritten, no fp32 copy on
    the host for a GPU). Checked before: the shards against the config; after: nothing left on
    meta, tied weights tied.
    """
    check_shards(folder, config)
    model = build_empty(config)
    fill_shards(model, folder, device)
    check_materialised(model, config)
    return model


def check_materialised(model: torch.nn.Module, config: Any) -> None:
    """Refuse a model with a parameter or buffer still on meta, or untied embeddings the config ties.

    Raises:
        ConfigError: naming the tensor.
    """
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            raise ConfigError(f"{name}: still on the meta device after loading (never filled)")
    if getattr(config, "tie_word_embeddings", False):
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        if head is not None and head.weight.data_ptr() != embed.weight.data_ptr():
            raise ConfigError("lm_head.weight: config.json ties it to the input embedding, but it is a separate "
                              "tensor after loading")


def main(argv: list[str] | None = None) -> int:
    """``python -m trainforge.trainer.pretrained --check FOLDER``: the checks the trainer makes before
    loading (config.json, the shards' headers against it), so ``prepare_data`` can refuse a broken
    folder before any job is launched. Exit 0 and one line when it would load, 78 and the reason."""
    import argparse
    import sys

    from trainforge.contract import EXIT_CONFIG
    from trainforge.trainer.config import PRETRAINED_FAMILY

    parser = argparse.ArgumentParser(prog="python -m trainforge.trainer.pretrained")
    parser.add_argument("--check", required=True, metavar="FOLDER", help="a Hugging Face model folder or s3:// prefix")
    args = parser.parse_args(argv)
    try:
        with open_folder(args.check) as folder:
            config = read_config(folder, ModelConfig(PRETRAINED_FAMILY, *[None] * 8))
            check_shards(folder, config)
            tensors = len(shard_shapes(folder))
    except ConfigError as err:
        print(err, file=sys.stderr)
        return EXIT_CONFIG
    print(f"{args.check}: {config.architectures[0] if config.architectures else type(config).__name__}, "
          f"{tensors} tensors that fill the model config.json describes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
