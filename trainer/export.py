"""Export a checkpoint as a Hugging Face model folder (docs/contracts.md, "Model export").

    python -m trainforge.trainer.export --checkpoint STEP_DIR --dataset DIR --out HF_DIR

HF_DIR gets ``config.json``, ``model*.safetensors``, ``generation_config.json``, the tokenizer
files and ``trainforge_export.json`` (where it came from). A model trained from open weights keeps
its base folder's tokenizer files, chat template and generation config (every EOS id), and the
export info names the base (`base_model_info`); a model built from the spec's fields gets a
`PreTrainedTokenizerFast` over the dataset's tokenizer.json (EOS = BOS = PAD = its end-of-text token). It loads with
``AutoModelForCausalLM`` / ``AutoTokenizer`` / ``pipeline("text-generation")`` and is what
``mlflow.transformers.log_model(transformers_model=HF_DIR, task="text-generation")`` takes.
A LoRA checkpoint of ``training.peft.merge: false`` exports the adapter alone instead of
full weights: peft's ``adapter_config.json`` + ``adapter_model.safetensors`` beside the
tokenizer files, the export info naming the base's local folder (``base_model.folder``) and
the digest of the base weights the adapter belongs to (``adapter.base_sha256``).

The folder is written next to HF_DIR under a temporary name and renamed into place, so HF_DIR
is either absent or complete. Exit 0 on success, 1 when the checkpoint does not verify or
load, 78 for bad arguments (HF_DIR exists and is not empty, dataset does not verify).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from trainforge.trainer.startup import import_llama

if __name__ == "__main__":  # the program only: transformers without what it never uses (trainer/startup.py)
    import_llama()

import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast

from trainforge.contract import EXIT_CONFIG, EXIT_ERROR
from trainforge.storage import storage_for
from trainforge.storage.files import chmod_like_umask, sha256_file
from trainforge.trainer import checkpoint as ckpt
from trainforge.trainer.config import PretrainedSource, parse_job_config
from trainforge.trainer.data import open_dataset
from trainforge.trainer.dataset import Dataset
from trainforge.trainer.errors import CheckpointError, ConfigError
from trainforge.trainer.adapters import ADAPTER, checkpoint_model, merged_weights
from trainforge.trainer.model import job_model, load_weights
from trainforge.trainer.pretrained import INDEX, SINGLE, TOKENIZER_FILES, open_folder

EXPORT_INFO = "trainforge_export.json"
#: The file of an adapter-only export (``training.peft.merge: false``): peft's adapter config.
ADAPTER_CONFIG = "adapter_config.json"


def export_checkpoint(step_dir: str | Path, dataset_dir: str | Path, out_dir: str | Path,
                      source: str | None = None, merge: bool | None = None) -> Path:
    """Write the HF folder for ``step_dir`` (a folder, or an ``s3://`` step downloaded first) at
    ``out_dir``; returns ``out_dir``. ``source`` names the checkpoint in trainforge_export.json
    (default: ``step_dir`` resolved). ``merge``: of a LoRA checkpoint, full weights (True) or
    the adapter alone (False, `ADAPTER_CONFIG` and its weights); None: the checkpoint's own
    ``training.peft.merge``.

    Raises:
        ConfigError: ``out_dir`` exists and is not empty.
        DatasetError: the dataset does not verify.
        CheckpointError: the checkpoint does not verify, cannot be loaded, or was trained with
            another tokenizer than the dataset's.
    """
    # A checkpoint the trainer wrote: its files get the store's read-after-write allowance.
    with ckpt.local_copy(step_dir, written=True) as local:
        return _export(local, dataset_dir, Path(out_dir), source or storage_for(step_dir).absolute(step_dir), merge)


def _export(step_dir: Path, dataset_dir: str | Path, out_dir: Path, source: str, merge: bool | None = None) -> Path:
    """`export_checkpoint` of the local folder ``step_dir``."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(f"--out {out_dir}: exists and is not an empty directory")
    problems = ckpt.verify(step_dir)
    if problems:
        raise CheckpointError(f"{step_dir} does not verify: {'; '.join(problems)}")
    dataset = open_dataset(dataset_dir)
    c = ckpt.load_checkpoint(step_dir)
    if c.meta.get("dataset", {}).get("tokenizer_sha256") != dataset.tokenizer_sha256:
        raise CheckpointError(f"{step_dir} was trained with tokenizer sha256 "
                              f"{c.meta.get('dataset', {}).get('tokenizer_sha256')}, {dataset.tokenizer_path} has "
                              f"{dataset.tokenizer_sha256}: export with the dataset it was trained on")
    try:
        cfg = parse_job_config(c.meta["job_config"])
    except (KeyError, ConfigError) as err:
        raise CheckpointError(f"{step_dir / ckpt.META}: no valid job_config ({err})") from err

    adapter_only = cfg.peft is not None and not (cfg.peft.merge if merge is None else merge)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with contextlib.ExitStack() as stack:
            base = None if cfg.pretrained is None else stack.enter_context(open_folder(cfg.pretrained.folder))
            try:
                model = stack.enter_context(checkpoint_model(cfg, dataset, c.weights, folder=base))
            except ValueError as err:
                raise CheckpointError(f"{step_dir}: {err}") from err
            if adapter_only:  # LoRA, merge: false: peft's adapter files over the unchanged base
                model = _adapter_model(model, cfg, dataset, base, c.weights)
            elif cfg.peft is not None:  # LoRA: the adapters folded into the base, saved as full weights
                merged = merged_weights(model)
                model = stack.enter_context(job_model(cfg, dataset, folder=base))
                load_weights(model, merged)
                del merged
            model.config.use_cache = True  # inference default; training ran without the KV cache
            info = {"checkpoint": source, "step": c.step,
                    "checkpoint_digest": hashlib.sha256((step_dir / ckpt.MANIFEST).read_bytes()).hexdigest(),
                    "dataset_digest": dataset.digest, "config_digest": c.meta.get("config_digest")}
            if base is None:
                _save_scratch(model, dataset, cfg.data.sequence_length, tmp)
            else:
                model.save_pretrained(tmp)  # a PeftModel saves ADAPTER_CONFIG and its weights alone
                for name in TOKENIZER_FILES:  # the base's own tokenizer, chat template and EOS ids
                    if (base / name).is_file():
                        shutil.copyfile(base / name, tmp / name)
                if dataset.examples is not None and dataset.examples.chat_template_path is not None:
                    _set_chat_template(tmp, dataset.examples.chat_template_path.read_text(encoding="utf-8"))
                info["base_model"] = base_model_info(base, cfg.pretrained)
                if adapter_only:
                    local = storage_for(cfg.pretrained.folder).local_path(cfg.pretrained.folder)
                    info["base_model"]["folder"] = None if local is None else str(local.resolve())
                    info["adapter"] = {"method": "lora", "r": cfg.peft.r, "alpha": cfg.peft.alpha,
                                       "base_sha256": (c.meta.get("adapter") or {}).get("base_sha256")}
        for path in tmp.iterdir():
            chmod_like_umask(path)
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _adapter_model(trained: torch.nn.Module, cfg, dataset: Dataset, base: Path,
                   weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A ``peft.PeftModel`` over a fresh load of the base holding the checkpoint's adapters
    (``trained``: the base with them applied in place, which names the targets): what peft's
    ``save_pretrained`` writes as `ADAPTER_CONFIG` + ``adapter_model.safetensors``, and what
    ``PeftModel.from_pretrained(base, folder)`` loads back."""
    import peft

    settings, targets = trained._trainforge_lora  # noqa: SLF001 - set by apply_lora
    config = peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                             target_modules=list(targets), bias="none", task_type="CAUSAL_LM")
    with job_model(cfg, dataset, weights=True, folder=base) as fresh:
        wrapped = peft.get_peft_model(fresh, config, adapter_name=ADAPTER)
    names = {f"base_model.model.{name}": tensor for name, tensor in weights.items()}
    expected = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    if set(names) != expected:
        raise CheckpointError(f"the checkpoint's adapters are not peft's for this base: missing "
                              f"{sorted(expected - set(names))[:3]}, unknown {sorted(set(names) - expected)[:3]}")
    wrapped.load_state_dict(names, strict=False)
    local = storage_for(cfg.pretrained.folder).local_path(cfg.pretrained.folder)
    wrapped.peft_config[ADAPTER].base_model_name_or_path = (str(local.resolve()) if local is not None
                                                            else cfg.pretrained.source)
    return wrapped.eval()


def _set_chat_template(folder: Path, template: str) -> None:
    """Give the exported tokenizer the chat template its examples were rendered with (the spec's
    data.chat_template, or the base's own): the model answers in the format it was trained on."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if tokenizer.chat_template != template:
        tokenizer.chat_template = template
        tokenizer.save_pretrained(str(folder))


def _save_scratch(model: torch.nn.Module, dataset: Dataset, sequence_length: int, out: Path) -> None:
    """Save a model built from the spec's fields with a tokenizer over the dataset's tokenizer.json."""
    model.generation_config = GenerationConfig(bos_token_id=dataset.eos_id, eos_token_id=dataset.eos_id,
                                               pad_token_id=dataset.eos_id)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(dataset.tokenizer_path), eos_token=dataset.eos_token,
                                        bos_token=dataset.eos_token, pad_token=dataset.eos_token,
                                        model_max_length=sequence_length,
                                        clean_up_tokenization_spaces=False)  # it would eat spaces in BPE text
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def base_model_info(folder: Path, source: PretrainedSource) -> dict[str, str | None]:
    """Lineage of a model trained from open weights: the base URI, what it resolved to, a digest
    of its weights index (or single weights file) and the licence its model card declares."""
    index = folder / INDEX if (folder / INDEX).is_file() else folder / SINGLE
    return {"source": source.source, "revision": source.revision,
            "weights_index_sha256": sha256_file(index) if index.is_file() else None,
            "license": model_card_license(folder)}


def model_card_license(folder: Path) -> str | None:
    """The ``license:`` of the folder's README.md front matter (the Hub's model card), if any."""
    try:
        text = (folder / "README.md").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not text.startswith("---"):
        return None
    for line in text.split("\n")[1:]:
        if line.strip() == "---":
            break
        key, _, value = line.partition(":")
        if key.strip() == "license" and value.strip():
            return value.strip().strip("'\"")
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainforge.trainer.export",
                                description="Export a checkpoint as a Hugging Face model folder.")
    p.add_argument("--checkpoint", required=True, help="a step-XXXXXXXX/ folder")
    p.add_argument("--dataset", required=True, help="the dataset folder it was trained on (for the tokenizer)")
    p.add_argument("--out", required=True, help="HF model folder to create (must not exist, or be empty)")
    args = p.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.dataset, args.out)
    except ConfigError as err:
        print(f"trainforge.trainer.export: {err}", file=sys.stderr)
        return EXIT_CONFIG
    except CheckpointError as err:
        print(f"trainforge.trainer.export: {err}", file=sys.stderr)
        return EXIT_ERROR
    print(f"exported {args.checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
