"""Evaluate language models on a dataset's validation split, comparably across tokenizers.

    python -m trainforge.trainer.evaluate --dataset DIR --model NAME=URI [--model NAME=URI ...] \
        --report OUT.json [--max-eval-tokens 65536] [--device cpu]

URI: a registered model (``models:/...``), a Hugging Face model folder, or a checkpoint
``step-XXXXXXXX/`` folder, local or ``s3://``. This is what the eval gate of ``register_model``
runs as a child process: the candidate and the champion in one process, one method, one
validation split. Method ``tokens`` when every model's tokenizer equals the dataset's (the
dataset's token ids, the validation report's metrics), else ``text`` (the same documents
re-encoded by each model's tokenizer; only ``val_bits_per_byte`` is comparable, so the gate
compares that). Exit 0 when every model was evaluated, 1 when one failed, 78 for bad arguments.

The URI forms, both methods, the formulas and the report's fields: docs/contracts.md, "Trainer
details", **Evaluation report**.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
import logging
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.nn import functional as F
from transformers import PreTrainedTokenizerFast

from trainforge.contract import EXIT_CONFIG
from trainforge.storage import storage_for
from trainforge.storage.files import atomic_write_json
from trainforge.trainer import checkpoint as ckpt
from trainforge.trainer.config import parse_job_config
from trainforge.trainer.data import ExampleIndex, TokenStream, open_dataset, validation_examples, validation_windows
from trainforge.trainer.dataset import Dataset
from trainforge.trainer.errors import ConfigError, TrainerError
from trainforge.trainer.loss import IGNORE_INDEX
from trainforge.trainer.model import job_model, load_weights

EVAL_FORMAT = "trainforge.evaluation/v1"
_SAMPLE_CHARS = 2000  # text encoded by both tokenizers to confirm they agree

log = logging.getLogger(__name__)


_UNIGRAM_CACHE: dict[tuple[str, str], torch.Tensor] = {}


def unigram_nll(dataset: Dataset) -> torch.Tensor:
    """-ln p(token) of the add-one smoothed unigram distribution of the train split: (vocab,) float64.

    Computed once per dataset (folder + digest) per process: the validator evaluates several
    checkpoints on one dataset.
    """
    key = (str(dataset.dir), dataset.digest)
    if key not in _UNIGRAM_CACHE:
        counts = np.zeros(dataset.vocab_size, dtype=np.float64)
        for chunk in TokenStream(dataset, "train").iter_chunks():
            counts += np.bincount(chunk, minlength=dataset.vocab_size)[: dataset.vocab_size]
        _UNIGRAM_CACHE[key] = torch.from_numpy(-np.log((counts + 1.0) / (counts.sum() + dataset.vocab_size)))
    return _UNIGRAM_CACHE[key]


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: Dataset, seq_len: int, max_tokens: int, batch_size: int,
             device: str = "cpu") -> dict[str, float]:
    """Validation loss, perplexity, bits per byte and the unigram baseline (formulas: module doc).

    An examples dataset counts its loss tokens only (what the assistant says): its validation
    examples in order, padded (`validation_examples`), nats summed over their targets / their
    number; ``val_tokens`` is that number.

    Raises:
        TrainerError: the validation split is shorter than ``seq_len + 1`` tokens, or (examples)
            holds no loss token.
    """
    split = dataset.splits["validation"]
    nll = unigram_nll(dataset)
    total_nats, unigram_nats, n = 0.0, 0.0, 0
    batches = (validation_examples(ExampleIndex(dataset, "validation"), seq_len, max_tokens, batch_size)
               if dataset.examples is not None else
               validation_windows(TokenStream(dataset, "validation"), seq_len, max_tokens, batch_size))
    for x, y in batches:
        logits = model(input_ids=x.to(device), use_cache=False).logits.float()  # (b, T, vocab)
        total_nats += F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(), reduction="sum",
                                      ignore_index=IGNORE_INDEX).item()
        targets = y[y != IGNORE_INDEX] if dataset.examples is not None else y  # a stream: every y a target
        unigram_nats += nll[targets].sum().item()
        n += targets.numel()
    if n == 0 and dataset.examples is not None:
        raise TrainerError(f"validation split has {split.documents} examples and no loss token among "
                           f"their first {max_tokens} to evaluate")
    if n == 0:
        raise TrainerError(f"validation split has {split.tokens} tokens, fewer than sequence_length + 1 = "
                           f"{seq_len + 1}")
    loss = total_nats / n
    est_bytes = n * split.bytes_utf8 / split.tokens
    return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0)),
            "val_bits_per_byte": total_nats / math.log(2) / est_bytes if est_bytes else math.nan, "val_tokens": n,
            "unigram_perplexity": math.exp(unigram_nats / n)}


#: Validation tokens `loss_at_start` evaluates: enough for a stable figure, a second or two on a CPU.
START_EVAL_TOKENS = 16_384


@torch.no_grad()
def loss_at_start(model: torch.nn.Module, dataset: Dataset, seq_len: int, device: Any = "cpu") -> float:
    """The validation loss of a pretrained model before its first step (``val/loss_at_start``),
    over the first `START_EVAL_TOKENS` validation tokens: what fine-tuning starts from, and
    proof that the weights loaded (a random model scores about ln(vocab))."""
    was_training = model.training
    model.eval()
    try:
        loss = evaluate(model, dataset, seq_len, START_EVAL_TOKENS, 4, device)["val_loss"]
    finally:
        model.train(was_training)
    log.info("val/loss_at_start %.4f nats/token (the pretrained model before step 1)", loss)
    return loss


def validation_documents(dataset: Dataset, max_tokens: int) -> list[str]:
    """The validation documents (decoded text) that the first ``max_tokens + 1`` tokens cover,
    the last one cut where the tokens end. EOS separates documents and is not part of any."""
    stream = TokenStream(dataset, "validation")
    ids = stream.read(0, min(max_tokens + 1, stream.num_tokens))
    tok = Tokenizer.from_file(str(dataset.tokenizer_path))
    docs, start = [], 0
    for end in [*np.flatnonzero(ids == dataset.eos_id).tolist(), len(ids)]:
        if end > start:
            docs.append(tok.decode(ids[start:end].tolist()))
        start = end + 1
    return [d for d in docs if d]


@torch.no_grad()
def evaluate_text(model: torch.nn.Module, tokenizer: Any, documents: list[str], context: int, batch_size: int,
                  device: str = "cpu") -> dict[str, float]:
    """Bits per byte of ``documents`` under ``model`` with its own ``tokenizer`` (module doc, ``text``).

    Each document is encoded, followed by the tokenizer's EOS; the ids are read as consecutive
    non-overlapping windows of ``context`` tokens (window i predicts ids ``[i*T+1, (i+1)*T+1)``).

    Raises:
        TrainerError: the documents give fewer than ``context + 1`` tokens.
    """
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for doc in documents:
        ids += tokenizer.encode(doc, add_special_tokens=False) + ([eos] if eos is not None else [])
    windows = (len(ids) - 1) // context
    if windows < 1:
        raise TrainerError(f"{len(ids)} tokens of validation text, fewer than the model's context + 1 = "
                           f"{context + 1}")
    tokens = torch.tensor(ids[: windows * context + 1])  # (windows*T + 1,)
    total_nats, n = 0.0, 0
    for lo in range(0, windows, batch_size):
        hi = min(lo + batch_size, windows)
        rows = torch.stack([tokens[i * context: (i + 1) * context + 1] for i in range(lo, hi)])  # (b, T+1)
        x, y = rows[:, :-1].to(device), rows[:, 1:].to(device)  # (b, T) int64 each
        logits = model(input_ids=x, use_cache=False).logits.float()  # (b, T, vocab)
        total_nats += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        n += y.numel()
    predicted = tokenizer.decode(ids[1: n + 1], skip_special_tokens=True)
    n_bytes = max(1, len(predicted.encode("utf-8")))
    loss = total_nats / n
    return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0)),
            "val_bits_per_byte": total_nats / math.log(2) / n_bytes, "val_tokens": n, "val_bytes": n_bytes}


@torch.no_grad()
def greedy_sample(model: torch.nn.Module, dataset: Dataset, prompt: str, max_new_tokens: int, context: int,
                  device: str = "cpu") -> str:
    """Greedy continuation of ``prompt`` (at most ``max_new_tokens``, stops at EOS), decoded text."""
    tok = Tokenizer.from_file(str(dataset.tokenizer_path))
    ids = tok.encode(prompt).ids or [dataset.eos_id]
    new: list[int] = []
    for _ in range(max_new_tokens):
        x = torch.tensor([(ids + new)[-context:]], device=device)  # (1, <= context)
        nxt = int(model(input_ids=x, use_cache=False).logits[0, -1].argmax())
        if nxt == dataset.eos_id:
            break
        new.append(nxt)
    return tok.decode(new)


def load_model(uri: str, dataset: Dataset) -> tuple[torch.nn.Module, Any]:
    """``(model in eval mode on the CPU, tokenizer)`` for a models:/ URI, HF folder or checkpoint.

    Raises:
        TrainerError: the model cannot be loaded (message names the URI and the cause).
    """
    try:
        if uri.startswith(("models:/", "runs:/")):
            import mlflow.transformers

            parts = mlflow.transformers.load_model(uri, return_type="components")
            model, tokenizer = parts["model"], parts["tokenizer"]
        elif _is_checkpoint(uri):
            with ckpt.local_copy(uri) as local:
                model, tokenizer = _from_checkpoint(local, dataset)
        else:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            model, tokenizer = AutoModelForCausalLM.from_pretrained(uri), AutoTokenizer.from_pretrained(uri)
    except TrainerError:
        raise
    except Exception as err:  # mlflow, transformers and safetensors each raise their own types
        raise TrainerError(f"model {uri}: cannot be loaded ({type(err).__name__}: {err})") from err
    return model.to("cpu").float().eval(), tokenizer


def _is_checkpoint(uri: str) -> bool:
    """Whether ``uri`` (a folder or an ``s3://`` prefix) holds a checkpoint's manifest.json."""
    store = storage_for(uri)
    return store.size(store.join(uri, ckpt.MANIFEST)) is not None


def _from_checkpoint(step_dir: Path, dataset: Dataset) -> tuple[torch.nn.Module, Any]:
    problems = ckpt.verify(step_dir)
    if problems:
        raise TrainerError(f"checkpoint {step_dir} does not verify: {'; '.join(problems)}")
    c = ckpt.load_checkpoint(step_dir)
    cfg = parse_job_config(c.meta["job_config"])
    with job_model(cfg, dataset) as model:
        load_weights(model, c.weights)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(dataset.tokenizer_path), eos_token=dataset.eos_token,
                                        clean_up_tokenization_spaces=False)
    return model, tokenizer


def tokenizer_matches(tokenizer: Any, dataset: Dataset, sample: str) -> bool:
    """True when ``tokenizer`` maps tokens to the dataset's ids and encodes ``sample`` the same way."""
    ref = Tokenizer.from_file(str(dataset.tokenizer_path))
    try:
        same_vocab = tokenizer.get_vocab() == ref.get_vocab(with_added_tokens=True)
        same_ids = tokenizer.encode(sample, add_special_tokens=False) == ref.encode(sample).ids
        return bool(same_vocab and same_ids and tokenizer.eos_token_id == dataset.eos_id)
    except Exception:  # a tokenizer without get_vocab/encode cannot be shown to match
        return False


def evaluate_models(uris: dict[str, str], dataset_dir: str | Path, max_eval_tokens: int = 65536,
                    batch_size: int = 8, device: str = "cpu", task: Any = None) -> dict[str, Any]:
    """Evaluate every ``{name: uri}`` on ``dataset_dir``'s validation split; returns the report.

    A model that fails to load or evaluate is reported with ``ok: false`` and its ``error``.
    ``task`` (a trainforge.trainer.task_eval.TaskEval) also scores each loaded model on its
    prompts, under the model's ``task`` key (ok false with an error when it cannot).

    Raises:
        DatasetError: the dataset does not verify.
    """
    dataset = open_dataset(dataset_dir)
    docs = validation_documents(dataset, max_eval_tokens)
    sample = next((d for d in docs if d), "")[:_SAMPLE_CHARS]
    report: dict[str, Any] = {"format": EVAL_FORMAT, "ok": False, "method": None, "reason": None,
                              "dataset_digest": dataset.digest, "max_eval_tokens": max_eval_tokens,
                              "models": {}}
    loaded = {}
    for name, uri in uris.items():
        entry = report["models"][name] = {"uri": uri, "ok": False, "error": None, "tokenizer_matches_dataset": None,
                                          "context": None, "metrics": {}}
        try:
            model, tokenizer = load_model(uri, dataset)
        except TrainerError as err:
            entry["error"] = str(err)
            continue
        entry["tokenizer_matches_dataset"] = tokenizer_matches(tokenizer, dataset, sample)
        entry["context"] = int(getattr(model.config, "max_position_embeddings", 0) or 0) or 128
        loaded[name] = (model.to(device), tokenizer)
    same = all(report["models"][n]["tokenizer_matches_dataset"] for n in loaded)
    report["method"] = "tokens" if same else "text"
    report["reason"] = ("every tokenizer equals the dataset's: token-level metrics" if same else
                        "tokenizers differ: compare val_bits_per_byte over the same text")
    for name, (model, tokenizer) in loaded.items():
        entry = report["models"][name]
        if task is not None:
            entry["task"] = task.score(model, tokenizer, device)
        try:
            if same:
                metrics = evaluate(model, dataset, entry["context"], max_eval_tokens, batch_size, device)
            else:
                metrics = evaluate_text(model, tokenizer, docs, entry["context"], batch_size, device)
        except (TrainerError, RuntimeError, ValueError) as err:
            entry["error"] = f"evaluation failed: {type(err).__name__}: {err}"
            continue
        entry["metrics"] = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        entry["ok"] = all(v is not None for v in entry["metrics"].values())
        if not entry["ok"]:
            entry["error"] = "non-finite metrics"
    report["ok"] = bool(uris) and all(m["ok"] for m in report["models"].values())
    return report


def _model_arg(text: str) -> tuple[str, str]:
    name, sep, uri = text.partition("=")
    if not sep or not name or not uri:
        raise argparse.ArgumentTypeError(f"--model {text!r}: expected NAME=URI")
    return name, uri


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainforge.trainer.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("--dataset", required=True, help="prepared dataset folder (its validation split)")
    p.add_argument("--model", type=_model_arg, action="append", required=True, metavar="NAME=URI")
    p.add_argument("--report", required=True, help="where to write the JSON report")
    p.add_argument("--max-eval-tokens", type=int, default=65536)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    from trainforge.trainer import task_eval

    task_eval.add_arguments(p)
    args = p.parse_args(argv)
    try:
        task = task_eval.from_args(args)
        report = evaluate_models(dict(args.model), args.dataset, args.max_eval_tokens, device=args.device,
                                 task=task)
    except ConfigError as err:  # includes DatasetError
        print(f"trainforge.trainer.evaluate: {err}", file=sys.stderr)
        return EXIT_CONFIG
    atomic_write_json(args.report, report)
    print(f"method: {report['method']} ({report['reason']})")
    for name, m in report["models"].items():
        print(f"{'OK  ' if m['ok'] else 'FAIL'} {name} {m['uri']}: " +
              (", ".join(f"{k}={v:.4g}" for k, v in m["metrics"].items() if v is not None) or m["error"] or ""))
        if "task" in m:
            print(f"     {name} task score: {task_eval.summary(m['task'])}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
