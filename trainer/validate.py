"""Validate one checkpoint and write a report (docs/contracts.md, "Validation report").

    python -m trainer.validate --checkpoints DIR [--step N] --dataset DIR --report OUT.json

Single process, no torchrun. Every check runs and is reported, even after an earlier one failed
(a check that cannot run says so and counts as failed). Exit 0 when all pass, 1 otherwise, 78
for bad arguments (missing folders, a dataset that does not verify).

Checks, in report order: ``manifest`` (present, trainforge.checkpoint/v1), ``file_hashes``
(sizes + SHA-256), ``meta`` (meta.json readable, its job config valid, vocabulary / EOS /
tokenizer equal to the dataset's), ``weights_load`` (safetensors decodes; no pickle),
``shapes`` (names and shapes equal to the model the job config describes), ``finite`` (every
tensor), ``eval`` (validation loss is finite), ``sample`` (greedy generation ran).

Metrics, over the first ``max_eval_tokens`` target tokens of the validation split, read as
consecutive non-overlapping windows of ``sequence_length``:

    val_loss           = total nats / val_tokens
    val_perplexity     = exp(val_loss)
    val_bits_per_byte  = total nats / ln 2 / bytes, where bytes is ESTIMATED as
                         val_tokens x (bytes_utf8 / tokens) of the validation split's manifest
                         entry (the evaluated windows are not decoded back to text)
    unigram_perplexity = exp(mean -ln p(y)) on the same targets, p the add-one smoothed unigram
                         distribution counted over the whole train split (a floor to beat)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from torch.nn import functional as F

from trainer import checkpoint as ckpt
from trainer.config import parse_job_config
from trainer.data import Dataset, TokenStream, open_dataset, validation_windows
from trainer.errors import EXIT_CONFIG, CheckpointError, ConfigError, TrainerError
from trainer.fsutil import atomic_write_json
from trainer.model import build_model, llama_config, load_weights

REPORT_FORMAT = "trainforge.validation/v1"
DEFAULT_PROMPT = "ROMEO:"


class _Report:
    def __init__(self) -> None:
        self.checks: list[dict[str, Any]] = []

    def add(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        return ok

    def skip(self, name: str, why: str) -> bool:
        return self.add(name, False, f"not run: {why}")


def pick_checkpoint(checkpoints_dir: str | Path, step: int | None = None) -> Path | None:
    """``step-N`` when ``step`` is given, else the newest step folder that has a manifest.json.

    Returns None when no folder has a manifest. Raises ConfigError when ``checkpoints_dir`` or
    the requested step folder does not exist.
    """
    root = Path(checkpoints_dir)
    if not root.is_dir():
        raise ConfigError(f"--checkpoints {root}: not a directory")
    if step is not None:
        path = root / ckpt.step_dir_name(step)
        if not path.is_dir():
            raise ConfigError(f"--step {step}: {path} does not exist")
        return path
    with_manifest = [p for _, p in ckpt.list_step_dirs(root) if (p / ckpt.MANIFEST).is_file()]
    return with_manifest[-1] if with_manifest else None


def validate_checkpoint(step_dir: str | Path, dataset_dir: str | Path, max_eval_tokens: int = 65536,
                        eval_batch_size: int = 8, prompt: str = DEFAULT_PROMPT, max_new_tokens: int = 32,
                        device: str = "cpu") -> dict[str, Any]:
    """Run every check on ``step_dir`` against ``dataset_dir``; returns the report dict.

    Raises:
        DatasetError: the dataset folder does not verify (the report would be meaningless).
    """
    dataset = open_dataset(dataset_dir)
    step_dir = Path(step_dir).resolve()
    r = _Report()
    report: dict[str, Any] = {"format": REPORT_FORMAT, "ok": False, "checkpoint": str(step_dir), "step": None,
                              "checkpoint_digest": None, "dataset_digest": dataset.digest, "checks": r.checks,
                              "metrics": {}, "sample": None}

    manifest_ok = False
    try:
        manifest = ckpt.read_manifest(step_dir)
        report["step"] = manifest["step"]
        report["checkpoint_digest"] = hashlib.sha256((step_dir / ckpt.MANIFEST).read_bytes()).hexdigest()
        manifest_ok = r.add("manifest", True, f"{ckpt.CHECKPOINT_FORMAT}, step {manifest['step']}, "
                                              f"{len(manifest['files'])} files")
    except CheckpointError as err:
        r.add("manifest", False, str(err))
    if manifest_ok:
        problems = ckpt.verify(step_dir)
        r.add("file_hashes", not problems, "; ".join(problems) or "sizes and SHA-256 of every file match")
    else:
        r.skip("file_hashes", "no readable manifest")

    cfg = _check_meta(r, step_dir, dataset)
    weights = None
    try:
        weights = safetensors.torch.load_file(step_dir / ckpt.WEIGHTS, device="cpu")
        r.add("weights_load", True, f"{len(weights)} tensors, {sum(t.numel() for t in weights.values())} values")
    except Exception as err:  # missing file, truncated header, bad JSON header...
        r.add("weights_load", False, f"{ckpt.WEIGHTS}: {type(err).__name__}: {err}")

    model = None
    if weights is None or cfg is None:
        r.skip("shapes", "needs loaded weights and a valid meta.json")
    else:
        model = build_model(llama_config(cfg.model, dataset.vocab_size, dataset.eos_id, cfg.data.sequence_length))
        try:
            load_weights(model, weights)
            r.add("shapes", True, f"{len(weights)} tensors match the {cfg.model.family} config")
        except ValueError as err:
            r.add("shapes", False, str(err))
            model = None
    if weights is None:
        r.skip("finite", "weights did not load")
    else:
        bad = [n for n, t in weights.items() if t.is_floating_point() and not torch.isfinite(t).all()]
        r.add("finite", not bad, f"non-finite values in {bad[:5]}{' ...' if len(bad) > 5 else ''}" if bad
              else "every tensor is finite")

    if model is None:
        r.skip("eval", "no model with the checkpoint's weights")
        r.skip("sample", "no model with the checkpoint's weights")
    else:
        model.to(device).eval()
        try:
            metrics = evaluate(model, dataset, cfg.data.sequence_length, max_eval_tokens, eval_batch_size, device)
            # JSON has no NaN/Infinity: a non-finite metric is reported as null.
            report["metrics"] = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
            r.add("eval", math.isfinite(metrics["val_loss"]),
                  f"val_loss {metrics['val_loss']:.4f} nats/token over {metrics['val_tokens']} tokens "
                  f"(unigram baseline perplexity {metrics['unigram_perplexity']:.1f}); bits/byte uses "
                  "bytes estimated from the split's bytes_utf8/tokens ratio")
        except TrainerError as err:
            r.add("eval", False, str(err))
        try:
            report["sample"] = {"prompt": prompt, "text": greedy_sample(model, dataset, prompt, max_new_tokens,
                                                                        cfg.data.sequence_length, device)}
            r.add("sample", True, f"greedy, up to {max_new_tokens} new tokens; 'text' is the continuation")
        except Exception as err:  # tokenizer or generation failure must not hide the other checks
            r.add("sample", False, f"{type(err).__name__}: {err}")
    report["ok"] = all(c["ok"] for c in r.checks)
    return report


def _check_meta(r: _Report, step_dir: Path, dataset: Dataset):
    """The checkpoint's JobConfig when meta.json is readable and matches the dataset, else None."""
    try:
        meta = json.loads((step_dir / ckpt.META).read_text(encoding="utf-8"))
        cfg = parse_job_config(meta["job_config"])
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as err:
        r.add("meta", False, f"{ckpt.META}: {type(err).__name__}: {err}")
        return None
    saved = meta.get("dataset", {})
    expected = {"vocab_size": dataset.vocab_size, "eos_id": dataset.eos_id,
                "tokenizer_sha256": dataset.tokenizer_sha256}
    wrong = [f"{k}: checkpoint {saved.get(k)!r}, dataset {v!r}" for k, v in expected.items() if saved.get(k) != v]
    note = "" if meta.get("dataset_digest") == dataset.digest else (
        f"; note: trained on dataset {meta.get('dataset_digest')}, evaluating on {dataset.digest}")
    r.add("meta", not wrong, ("; ".join(wrong) if wrong else
                              f"step {meta.get('step')}, vocab {dataset.vocab_size}, same tokenizer") + note)
    return cfg if not wrong else None


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: Dataset, seq_len: int, max_tokens: int, batch_size: int,
             device: str = "cpu") -> dict[str, float]:
    """Validation loss, perplexity, bits per byte and the unigram baseline (formulas: module doc)."""
    split = dataset.splits["validation"]
    counts = np.zeros(dataset.vocab_size, dtype=np.float64)
    for chunk in TokenStream(dataset, "train").iter_chunks():
        counts += np.bincount(chunk, minlength=dataset.vocab_size)[: dataset.vocab_size]
    unigram_nll = torch.from_numpy(-np.log((counts + 1.0) / (counts.sum() + dataset.vocab_size)))  # (vocab,)

    total_nats, unigram_nats, n = 0.0, 0.0, 0
    for x, y in validation_windows(TokenStream(dataset, "validation"), seq_len, max_tokens, batch_size):
        logits = model(input_ids=x.to(device), use_cache=False).logits.float()  # (b, T, vocab)
        total_nats += F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(), reduction="sum").item()
        unigram_nats += unigram_nll[y].sum().item()
        n += y.numel()
    if n == 0:
        raise TrainerError(f"validation split has {split.tokens} tokens, fewer than sequence_length + 1")
    loss = total_nats / n
    est_bytes = n * split.bytes_utf8 / split.tokens
    return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0)),
            "val_bits_per_byte": total_nats / math.log(2) / est_bytes, "val_tokens": n,
            "unigram_perplexity": math.exp(unigram_nats / n)}


@torch.no_grad()
def greedy_sample(model: torch.nn.Module, dataset: Dataset, prompt: str, max_new_tokens: int, context: int,
                  device: str = "cpu") -> str:
    """Greedy continuation of ``prompt`` (at most ``max_new_tokens``, stops at EOS), decoded text."""
    from tokenizers import Tokenizer

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.validate", description="Validate a trainforge checkpoint.")
    p.add_argument("--checkpoints", required=True, help="folder holding step-XXXXXXXX/ checkpoints")
    p.add_argument("--step", type=int, help="validate this step (default: newest with a manifest)")
    p.add_argument("--dataset", required=True, help="prepared dataset folder (its validation split is evaluated)")
    p.add_argument("--report", required=True, help="where to write the JSON report")
    p.add_argument("--max-eval-tokens", type=int, default=65536, help="cap on evaluated target tokens")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt of the greedy sample")
    p.add_argument("--sample-tokens", type=int, default=32, help="new tokens of the greedy sample (0: none)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    try:
        step_dir = pick_checkpoint(args.checkpoints, args.step)
        if step_dir is None:
            report = {"format": REPORT_FORMAT, "ok": False, "checkpoint": None, "step": None,
                      "checkpoint_digest": None, "metrics": {}, "sample": None,
                      "checks": [{"name": "manifest", "ok": False,
                                  "detail": f"no step-* folder with a manifest.json under {args.checkpoints}"}]}
        else:
            report = validate_checkpoint(step_dir, args.dataset, max_eval_tokens=args.max_eval_tokens,
                                         prompt=args.prompt, max_new_tokens=args.sample_tokens,
                                         device=args.device)
    except ConfigError as err:  # includes DatasetError
        print(f"trainer.validate: {err}", file=sys.stderr)
        return EXIT_CONFIG
    atomic_write_json(args.report, report)
    for c in report["checks"]:
        print(f"{'PASS' if c['ok'] else 'FAIL'} {c['name']}: {c['detail']}")
    if report["metrics"]:
        print("metrics: " + ", ".join(f"{k}={v}" for k, v in report["metrics"].items()))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
