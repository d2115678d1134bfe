"""The model of a job: the one place that turns the job config into a network (docs/model.md).

`job_model` is what every program (train, validate, evaluate, export) calls: a model from the
spec's fields (`llama_config`: a small Llama with fresh weights from torch's global RNG, so seed
first), or a pretrained Hugging Face folder's architecture, with its weights for training
(trainforge.trainer.pretrained). `decoder_layers` and `flops_per_token_of` read the decoder layers
and sizes from the model itself, whatever its family.

`load_initial_weights` starts a run from existing weights (the job config's ``init`` section):
a trainer checkpoint (another stage's) or a Hugging Face model folder (a registered model).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from trainforge.storage import Storage, storage_for
from trainforge.storage.files import sha256_file
from trainforge.trainer import checkpoint as ckpt
from trainforge.trainer.config import JobConfig, ModelConfig, parse_job_config
from trainforge.trainer.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

#: LlamaConfig keys `llama_config` sets from first-class fields; an override may not touch them
#: (the spec refuses them first: operators/pipeline/llama_keys.py).
FIRST_CLASS_KEYS = frozenset({
    "attention_dropout", "bos_token_id", "eos_token_id", "hidden_size", "intermediate_size",
    "max_position_embeddings", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
    "pad_token_id", "rope_parameters", "rope_theta", "tie_word_embeddings", "use_cache", "vocab_size",
})
#: What must agree between a model and the weights it is initialised from.
ARCHITECTURE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                     "hidden_act", "attention_bias", "mlp_bias", "rms_norm_eps", "rope_theta")


def llama_config(model: ModelConfig, vocab_size: int, eos_id: int, max_positions: int) -> LlamaConfig:
    """The `LlamaConfig` for a job's model section.

    Args:
        vocab_size: rows of the embedding, from the dataset manifest.
        eos_id: used as the EOS, BOS and padding id (the datasets have one special token).
        max_positions: ``data.sequence_length``; rotary embeddings extrapolate past it but
            the model was never trained there.

    ``model.config_overrides`` are passed on as further keyword arguments.

    Raises:
        ConfigError: an override names a key LlamaConfig does not have, or one set above.
    """
    known = LlamaConfig().to_dict()
    for key in model.config_overrides:
        if key in FIRST_CLASS_KEYS or key not in known:
            raise ConfigError(f"model.config_overrides.{key}: not a LlamaConfig key an override may "
                              f"set (first-class keys come from the model section; unknown keys are refused)")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_kv_heads,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta},
        attention_dropout=model.dropout,
        tie_word_embeddings=model.tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        use_cache=False,
        **model.config_overrides,
    )


def build_model(config: Any, device: torch.device | str = "cpu") -> torch.nn.Module:
    """A freshly initialised fp32 causal LM of ``config`` on ``device``, initialised there.

    Built on the meta device (no memory), materialised on ``device`` and initialised in place by
    transformers' own ``init_weights`` (normal(0, initializer_range) matrices, unit norms, the
    rotary frequencies recomputed, tied embeddings tied again): no copy of the weights on the host
    and no single-threaded CPU initialisation. The values come from ``device``'s generator, so
    seed it first; the same seed gives the same weights on every rank (docs/model.md, "Initial
    weights").
    """
    if getattr(config, "_attn_implementation", None) is None:
        config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = (LlamaForCausalLM(config) if isinstance(config, LlamaConfig)
                 else AutoModelForCausalLM.from_config(config, dtype=torch.float32))  # not the saved dtype
    model.to_empty(device=device)
    model.init_weights()  # initialise every parameter and buffer, then tie the embeddings again
    return model


@contextlib.contextmanager
def job_model(cfg: JobConfig, dataset: Any, device: torch.device | str = "cpu", *,
              weights: bool | str = False, folder: Path | None = None) -> Iterator[torch.nn.Module]:
    """The job's model on ``device``, fp32: the one way every program builds it.

    Without ``cfg.pretrained``: `build_model` of `llama_config` (fresh weights). With it: the
    pretrained folder's architecture, and its weights when ``weights`` (the trainer's start;
    validate and export load a checkpoint into fresh ones instead); ``weights="shards"``: the
    parameters left on meta for FSDP2 to shard, then `pretrained.fill_shards` (the shards checked
    here first). The pretrained folder stays
    open (an ``s3://`` one downloaded) while the context lasts; ``folder``: one already opened
    with `trainforge.trainer.pretrained.open_folder`.

    Raises:
        ConfigError: the pretrained folder is unusable, or the dataset was encoded with another
            tokenizer than the folder's (a retry cannot fix either).
    """
    if cfg.pretrained is None:
        yield build_model(llama_config(cfg.model, dataset.vocab_size, dataset.eos_id, cfg.data.sequence_length),
                          device=device)
        return
    from trainforge.trainer import pretrained

    with (contextlib.nullcontext(folder) if folder is not None
          else pretrained.open_folder(cfg.pretrained.folder)) as folder:
        config = pretrained.read_config(folder, cfg.model)
        _check_dataset_tokenizer(folder, config, dataset, cfg.pretrained.source)
        if weights == "shards":
            pretrained.check_shards(folder, config)
            model = pretrained.build_empty(config)
        elif weights:
            model = pretrained.load_pretrained(folder, config, device)
            log.info("loaded %s (%s) from %s: %s, %d parameters", cfg.pretrained.source,
                     cfg.pretrained.revision or "unversioned", cfg.pretrained.folder, type(model).__name__,
                     sum(p.numel() for p in model.parameters()))
        else:
            model = build_model(config, device=device)
        yield model


def _check_dataset_tokenizer(folder: Path, config: Any, dataset: Any, source: str) -> None:
    """The dataset must be encoded with the folder's tokenizer.json, and its ids must fit the embedding."""
    tok = folder / "tokenizer.json"
    if not tok.is_file():
        raise ConfigError(f"pretrained {source}: no tokenizer.json in {folder}")
    if sha256_file(tok) != dataset.tokenizer_sha256:
        raise ConfigError(f"pretrained {source}: the dataset was encoded with another tokenizer "
                          f"(sha256 {dataset.tokenizer_sha256[:12]}, the model's tokenizer.json "
                          f"{sha256_file(tok)[:12]}): prepare the data with the model's tokenizer")
    if dataset.vocab_size > config.vocab_size:
        raise ConfigError(f"pretrained {source}: the dataset's vocabulary ({dataset.vocab_size} ids) does not fit "
                          f"the model's embedding (config.json vocab_size {config.vocab_size})")


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's list of decoder layers, found from the model itself: the `ModuleList` of the
    classes it declares in ``_no_split_modules`` (every transformers decoder does), else the
    decoder's ``layers``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and all(
                type(m).__name__ in names for m in module):
            return module
    layers = getattr(model.get_decoder(), "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        return layers
    raise ConfigError(f"{type(model).__name__}: no list of decoder layers found (no ModuleList of "
                      f"{sorted(names) or 'its _no_split_modules'})")


def attention_shape(config: Any) -> tuple[int, int, int]:
    """``(layers, attention heads, head size)`` of a transformers config, for the FLOP count."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, heads, head_dim


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean",
            position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy in nats per token.

    Args:
        x: (b, T) int64 input ids.
        y: (b, T) int64 targets (x shifted left by one; -100: not a target).
        reduction: ``mean``, or ``sum`` of the targets' nats (0 when none; trainforge.trainer.loss).
        position_ids: (b, T) int64 of packed rows, restarting per example (trainforge.trainer.packing);
            None: 0 .. T-1 in every row.
    Returns:
        scalar float32 tensor (computed in fp32 even under bf16 autocast).

    Large logits are never held whole: the lm_head matmul and the log-softmax run a chunk of
    tokens at a time in the forward and a slice of the vocabulary at a time in the backward
    (`trainforge.trainer.loss`, which also says when the plain path is taken). ``model`` may be
    wrapped in DDP or sharded with FSDP2.
    """
    from trainforge.trainer import loss  # here, not at the top: this function is all of model.py that uses it

    return loss.lm_loss(model, x, y, reduction=reduction, position_ids=position_ids)


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass instead of storing them.

    Uses transformers' own wrapping of the decoder layers with non-reentrant
    `torch.utils.checkpoint` (``use_reentrant=False``: works with DDP and FSDP2, with inputs
    that do not require grad, and recomputes with the same RNG state, so dropout matches).
    Active only in ``model.train()`` mode. Call before wrapping the model in DDP or FSDP.
    """
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """``{alias: name}`` for state-dict names whose tensor is an earlier name's (tied weights).

    E.g. ``{"lm_head.weight": "model.embed_tokens.weight"}`` with ``tie_word_embeddings``.
    Call on an unsharded model (it compares storage pointers; on meta, the tensor objects).
    """
    seen: dict[int, str] = {}
    aliases = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        ptr = id(tensor) if tensor.is_meta else tensor.data_ptr()  # meta tensors have no storage to compare
        if ptr in seen:
            aliases[name] = seen[ptr]
        else:
            seen[ptr] = name
    return aliases


def tied_parameter_names(model: torch.nn.Module) -> set[str]:
    """State-dict names that alias an earlier tensor (e.g. ``lm_head.weight`` when tied).

    safetensors refuses aliased tensors, so checkpoints store each storage once; loading
    tolerates exactly these names being absent.
    """
    return set(tied_aliases(model))


def weights_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors without aliases, detached, contiguous, on the CPU."""
    skip = tied_parameter_names(model)
    return {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items() if name not in skip}


def load_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` (as written by `weights_state_dict`) into ``model`` in place.

    Raises:
        ValueError: a name is unknown or missing (other than a tied alias), or a shape differs.
    """
    check_weights({n: t.shape for n, t in model.state_dict().items()}, tied_parameter_names(model), tensors)
    model.load_state_dict(tensors, strict=False)


def check_weights(expected: dict[str, torch.Size], tied: set[str], tensors: dict[str, torch.Tensor]) -> None:
    """Check ``tensors`` has every name of ``expected`` (but the ``tied`` aliases) with its shape.

    Raises:
        ValueError: a name is unknown or missing (other than a tied alias), or a shape differs.
    """
    missing = sorted(set(expected) - set(tensors) - tied)
    unknown = sorted(set(tensors) - set(expected))
    wrong = sorted(n for n in set(tensors) & set(expected) if tensors[n].shape != expected[n])
    if missing or unknown or wrong:
        shapes = ", ".join(f"{n}: {tuple(tensors[n].shape)} vs model {tuple(expected[n])}" for n in wrong[:5])
        raise ValueError(f"weights do not match the model: missing {missing[:5]}, unknown {unknown[:5]}, "
                         f"shape mismatch [{shapes}]")


#: The pipeline spec field that sets each of `ARCHITECTURE_KEYS` (see `llama_config`), so that an
#: architecture mismatch names what the user edits. Keys without a first-class field come from
#: ``model.config_overrides``; ``vocab_size`` comes from the dataset's tokenizer.
SPEC_FIELD_OF_KEY = {
    "vocab_size": "data.tokenizer.vocab_size",
    "hidden_size": "model.hidden_size",
    "intermediate_size": "model.intermediate_size",
    "num_hidden_layers": "model.num_layers",
    "num_attention_heads": "model.num_heads",
    "num_key_value_heads": "model.num_kv_heads",
    "head_dim": "model.hidden_size / model.num_heads (head_dim)",
    "tie_word_embeddings": "model.tie_word_embeddings",
    "rope_theta": "model.rope_theta",
}


def architecture_differences(model: LlamaConfig, source: LlamaConfig) -> list[str]:
    """``"field: model X, source Y"`` for each of `ARCHITECTURE_KEYS` on which two configs differ.

    ``field`` is the spec field of the key (`SPEC_FIELD_OF_KEY`, e.g. ``model.num_layers`` for
    ``num_hidden_layers``), else ``model.config_overrides.<key>``.
    """
    def value(config: LlamaConfig, key: str) -> Any:
        if key == "rope_theta":
            return (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
        if key == "head_dim":  # None means hidden_size // num_attention_heads
            return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return getattr(config, key, None)

    return [f"{SPEC_FIELD_OF_KEY.get(key, f'model.config_overrides.{key}')}: "
            f"model {value(model, key)!r}, source {value(source, key)!r}"
            for key in ARCHITECTURE_KEYS if value(model, key) != value(source, key)]


def load_initial_weights(model: LlamaForCausalLM, location: str, tokenizer_path: str | Path,
                         tokenizer_sha256: str) -> str:
    """Copy the weights at ``location`` into ``model`` (unsharded, before DDP/FSDP); nothing else.

    The optimizer, scheduler, step count and RNG state are not taken: training starts at step 0
    with a fresh optimizer. ``location`` (a local folder or an ``s3://`` prefix) is one of:

    * a trainer checkpoint ``step-XXXXXXXX/`` (verified against its manifest first);
    * a checkpoint root holding ``step-*`` folders: its newest valid one;
    * a Hugging Face model folder: ``config.json`` and ``model*.safetensors`` (what model
      registration uploads; ``trainforge.trainer.export`` writes the same names as ``build_model``).

    The source must have ``model``'s architecture (`ARCHITECTURE_KEYS`) and the dataset's
    tokenizer (``tokenizer_path`` / ``tokenizer_sha256``: the same file, or the same vocabulary).

    Returns:
        the folder or URI the weights were read from.
    Raises:
        ConfigError: architecture or tokenizer differ (exit 78: a retry cannot fix it).
        CheckpointError: nothing loadable at ``location``, or it does not verify.
    """
    store = storage_for(location)
    if _has(store, location, "config.json") and not _has(store, location, ckpt.MANIFEST):
        with store.local_dir(location, store.list_files(location)) as folder:  # S3: downloaded
            source, tensors, vocab_ok = _hf_folder(folder, tokenizer_path, tokenizer_sha256)
        where = location
    else:
        where, source, tensors, vocab_ok = _trainer_checkpoint(location, tokenizer_sha256)
    problems = architecture_differences(model.config, source)
    if problems:
        raise ConfigError(f"init {where}: its architecture differs from the job config's model "
                          f"({'; '.join(problems)}): set the spec's model fields to the source's values")
    if not vocab_ok:
        raise ConfigError(f"init {where}: trained with another tokenizer than the dataset's "
                          f"({tokenizer_path}): encode the data with the source's tokenizer")
    try:
        load_weights(model, tensors)
    except ValueError as err:
        raise CheckpointError(f"init {where}: {err}") from err
    log.info("initialised the weights from %s (optimizer and step start fresh)", where)
    return str(where)


def _has(store: Storage, folder: str | Path, name: str) -> bool:
    return store.size(store.join(folder, name)) is not None


def _same_vocabulary(path_a: str | Path, path_b: str | Path) -> bool:
    return Tokenizer.from_file(str(path_a)).get_vocab() == Tokenizer.from_file(str(path_b)).get_vocab()


def _hf_folder(folder: Path, tokenizer_path: str | Path, tokenizer_sha256: str
               ) -> tuple[LlamaConfig, dict[str, torch.Tensor], bool]:
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"init {folder}: config.json but no model*.safetensors weights")
    try:
        source = LlamaConfig.from_json_file(str(folder / "config.json"))
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            tensors.update(safetensors.torch.load_file(file, device="cpu"))
    except Exception as err:  # JSON and safetensors each raise their own types
        raise CheckpointError(f"init {folder}: cannot read the model ({type(err).__name__}: {err})") from err
    tok = folder / "tokenizer.json"
    vocab_ok = tok.is_file() and (sha256_file(tok) == tokenizer_sha256 or _same_vocabulary(tok, tokenizer_path))
    return source, tensors, vocab_ok


def _trainer_checkpoint(location: str | Path, tokenizer_sha256: str
                        ) -> tuple[str, LlamaConfig, dict[str, torch.Tensor], bool]:
    step_dir: Any = location
    if not _has(storage_for(location), location, ckpt.MANIFEST):
        step_dir = ckpt.newest_valid(location)
        if step_dir is None:
            raise CheckpointError(f"init {location}: neither a checkpoint (manifest.json), a folder of valid "
                                  f"step-* checkpoints, nor a model folder (config.json)")
    problems = ckpt.verify(step_dir)
    if problems:
        raise CheckpointError(f"init {step_dir} does not verify: {'; '.join(problems)}")
    c = ckpt.load_checkpoint(step_dir)
    try:
        saved = parse_job_config(c.meta["job_config"])
        dataset = c.meta["dataset"]
        source = llama_config(saved.model, int(dataset["vocab_size"]), int(dataset["eos_id"]),
                              saved.data.sequence_length)
    except (KeyError, TypeError, ValueError, ConfigError) as err:
        raise CheckpointError(f"init {step_dir}: meta.json has no usable job_config/dataset ({err})") from err
    return str(step_dir), source, c.weights, dataset.get("tokenizer_sha256") == tokenizer_sha256
