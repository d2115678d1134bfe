"""Validate checkpoints and write a report (docs/contracts.md "Validation report", docs/registry.md).

    python -m trainforge.trainer.validate --checkpoints DIR [--step N] --dataset DIR --report OUT.json \
        [--policy newest|best_val_loss] [--expect-job-config JOB.json] [--expect-vocab-size N] \
        [--expect-world-size N] [--quarantine]

Single process, no torchrun. Every check runs and is reported, even after an earlier one failed
(a check that cannot run says so and counts as failed). Exit 0 when the chosen checkpoint passes
every check, 1 otherwise, 78 for bad arguments (missing folders, a dataset that does not verify).

Checks, in report order: ``manifest``, ``file_hashes``, ``meta``, ``consistency`` (see
trainforge.trainer.expectations), ``weights_load``, ``shapes``, ``finite``, ``eval``,
``sample``. Policy ``newest`` or ``best_val_loss``; with ``--quarantine`` a damaged checkpoint
(``integrity_failures``) is moved aside (trainforge.trainer.quarantine), one that is intact but
not what the pipeline expects stays where it is. What each check, the policy and quarantine do:
docs/registry.md, "The validation report"; the metrics (``val_loss``, ``val_perplexity``, an
estimated ``val_bits_per_byte``, ``unigram_perplexity``): docs/contracts.md, "Trainer details",
**Validation report**.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from trainforge.trainer.startup import import_llama, process_started_at

if __name__ == "__main__":  # the program only: transformers without what it never uses (trainer/startup.py)
    import_llama()

import safetensors.torch
import torch

from trainforge.contract import EXIT_CONFIG
from trainforge.storage import Location, storage_for
from trainforge.storage.files import atomic_write_json
from trainforge.trainer import checkpoint as ckpt
from trainforge.trainer.config import parse_job_config
from trainforge.trainer.data import open_dataset
from trainforge.trainer.dataset import Dataset
from trainforge.trainer.errors import CheckpointError, ConfigError, TrainerError
from trainforge.trainer.evaluate import evaluate, greedy_sample
from trainforge.trainer.expectations import Expectations, check_consistency
from trainforge.trainer.adapters import checkpoint_model
from trainforge.trainer.quarantine import quarantine

REPORT_FORMAT = "trainforge.validation/v1"
DEFAULT_PROMPT = "ROMEO:"
POLICIES = ("newest", "best_val_loss")

__all__ = ["POLICIES", "REPORT_FORMAT", "evaluate", "greedy_sample", "main", "pick_checkpoint",
           "validate_checkpoint", "validate_checkpoints"]


class _Report:
    def __init__(self) -> None:
        self.checks: list[dict[str, Any]] = []
        self.integrity_failures: list[str] = []  # failed checks that show the checkpoint is damaged

    def add(self, name: str, ok: bool, detail: str, damaged: bool = False) -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        if not ok and damaged:
            self.integrity_failures.append(name)
        return ok

    def skip(self, name: str, why: str) -> bool:
        return self.add(name, False, f"not run: {why}")


def pick_checkpoint(checkpoints_dir: str | Path, step: int | None = None) -> Location | None:
    """``step-N`` when ``step`` is given, else the newest step folder that has a manifest.json
    (a local folder or an ``s3://`` prefix).

    Returns None when no folder has a manifest. Raises ConfigError when ``checkpoints_dir`` or
    the requested step folder does not exist.
    """
    store = storage_for(checkpoints_dir)
    root = store.join(checkpoints_dir)
    if not store.is_dir(root):
        raise ConfigError(f"--checkpoints {root}: not a directory")
    if step is not None:
        path = store.join(root, ckpt.step_dir_name(step))
        if not store.is_dir(path):
            raise ConfigError(f"--step {step}: {path} does not exist")
        return path
    with_manifest = candidate_dirs(root)
    return with_manifest[-1] if with_manifest else None


def candidate_dirs(checkpoints_dir: str | Path) -> list[Location]:
    """Step folders directly under ``checkpoints_dir`` that have a manifest.json, oldest first.

    Folders without one are writes in progress or killed writes: not checkpoints, not judged.
    """
    store = storage_for(checkpoints_dir)
    return [p for _, p in ckpt.list_step_dirs(checkpoints_dir)
            if store.size(store.join(p, ckpt.MANIFEST)) is not None]


def validate_checkpoint(step_dir: str | Path, dataset_dir: str | Path, max_eval_tokens: int = 65536,
                        eval_batch_size: int = 8, prompt: str = DEFAULT_PROMPT, max_new_tokens: int = 32,
                        device: str = "cpu", expect: Expectations | None = None) -> dict[str, Any]:
    """Run every check on ``step_dir`` against ``dataset_dir``; returns the report dict.

    Pure: reads the checkpoint and the dataset, changes nothing. ``report["integrity_failures"]``
    lists the failed checks that show the checkpoint itself is damaged (grounds for quarantine).

    Raises:
        DatasetError: the dataset folder does not verify (the report would be meaningless).
    """
    dataset = open_dataset(dataset_dir)
    step_dir = Path(step_dir).resolve()
    r = _Report()
    report: dict[str, Any] = {"format": REPORT_FORMAT, "ok": False, "checkpoint": str(step_dir), "step": None,
                              "checkpoint_digest": None, "dataset_digest": dataset.digest, "checks": r.checks,
                              "metrics": {}, "sample": None, "integrity_failures": r.integrity_failures,
                              "seconds": {"evaluation": 0.0, "sample": 0.0}}

    manifest_ok = False
    try:
        manifest = ckpt.read_manifest(step_dir)
        report["step"] = manifest["step"]
        report["checkpoint_digest"] = hashlib.sha256((step_dir / ckpt.MANIFEST).read_bytes()).hexdigest()
        manifest_ok = r.add("manifest", True, f"{ckpt.CHECKPOINT_FORMAT}, step {manifest['step']}, "
                                              f"{len(manifest['files'])} files")
    except CheckpointError as err:
        r.add("manifest", False, str(err), damaged=True)
    if manifest_ok:
        problems = ckpt.verify(step_dir)
        r.add("file_hashes", not problems, "; ".join(problems) or "sizes and SHA-256 of every file match",
              damaged=True)
    else:
        r.skip("file_hashes", "no readable manifest")

    cfg, meta = _check_meta(r, step_dir, dataset)
    if meta is None:
        r.skip("consistency", "meta.json is unreadable")
    else:
        r.add("consistency", *check_consistency(meta, expect or Expectations()))
    weights = None
    try:
        weights = safetensors.torch.load_file(step_dir / ckpt.WEIGHTS, device="cpu")
        r.add("weights_load", True, f"{len(weights)} tensors, {sum(t.numel() for t in weights.values())} values")
    except Exception as err:  # missing file, truncated header, bad JSON header...
        r.add("weights_load", False, f"{ckpt.WEIGHTS}: {type(err).__name__}: {err}", damaged=True)

    model = None
    if weights is None or cfg is None:
        r.skip("shapes", "needs loaded weights and a valid meta.json")
    else:
        try:
            with checkpoint_model(cfg, dataset, weights) as model:  # LoRA: the base, then the adapters
                pass
            what = "LoRA adapter tensors fit the base" if cfg.peft is not None else "tensors match the"
            r.add("shapes", True, f"{len(weights)} {what} {type(model.config).__name__} of the job")
        except ConfigError as err:  # the pretrained folder the job names cannot build its model
            r.add("shapes", False, f"cannot build the job's model: {err}")
            model = None
        except ValueError as err:
            r.add("shapes", False, str(err), damaged=True)
            model = None
    if weights is None:
        r.skip("finite", "weights did not load")
    else:
        bad = [n for n, t in weights.items() if t.is_floating_point() and not torch.isfinite(t).all()]
        r.add("finite", not bad, f"non-finite values in {bad[:5]}{' ...' if len(bad) > 5 else ''}" if bad
              else "every tensor is finite", damaged=True)

    if model is None:
        r.skip("eval", "no model with the checkpoint's weights")
        r.skip("sample", "no model with the checkpoint's weights")
    else:
        model.to(device).eval()
        t0 = time.perf_counter()
        try:
            metrics = evaluate(model, dataset, cfg.data.sequence_length, max_eval_tokens, eval_batch_size, device)
            # JSON has no NaN/Infinity: a non-finite metric is reported as null.
            report["metrics"] = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
            r.add("eval", math.isfinite(metrics["val_loss"]),
                  f"val_loss {metrics['val_loss']:.4f} nats/token over {metrics['val_tokens']} tokens "
                  f"(unigram baseline perplexity {metrics['unigram_perplexity']:.1f}); bits/byte uses "
                  "bytes estimated from the split's bytes_utf8/tokens ratio", damaged=True)
        except TrainerError as err:  # the split is too short: the dataset's fault, not the checkpoint's
            r.add("eval", False, str(err))
        t1 = time.perf_counter()
        try:
            report["sample"] = {"prompt": prompt, "text": greedy_sample(model, dataset, prompt, max_new_tokens,
                                                                        cfg.data.sequence_length, device)}
            r.add("sample", True, f"greedy, up to {max_new_tokens} new tokens; 'text' is the continuation")
        except Exception as err:  # tokenizer or generation failure must not hide the other checks
            r.add("sample", False, f"{type(err).__name__}: {err}")
        report["seconds"] = {"evaluation": round(t1 - t0, 3), "sample": round(time.perf_counter() - t1, 3)}
    report["ok"] = all(c["ok"] for c in r.checks)
    return report


def _check_meta(r: _Report, step_dir: Path, dataset: Dataset):
    """``(JobConfig or None, meta dict or None)``: the config when meta.json is readable, its job
    config valid and its vocabulary the dataset's; the raw meta whenever it is a JSON object."""
    try:
        meta = json.loads((step_dir / ckpt.META).read_text(encoding="utf-8"))
        if not isinstance(meta, dict):
            raise ValueError(f"expected a JSON object, got {type(meta).__name__}")
    except (OSError, ValueError) as err:
        r.add("meta", False, f"{ckpt.META}: {type(err).__name__}: {err}")
        return None, None
    try:
        cfg = parse_job_config(meta["job_config"])
    except (KeyError, TypeError, ConfigError) as err:
        r.add("meta", False, f"{ckpt.META}: job_config: {type(err).__name__}: {err}")
        return None, meta
    saved = meta.get("dataset") or {}
    expected = {"vocab_size": dataset.vocab_size, "eos_id": dataset.eos_id,
                "tokenizer_sha256": dataset.tokenizer_sha256}
    wrong = [f"{k}: checkpoint {saved.get(k)!r}, dataset {v!r}" for k, v in expected.items() if saved.get(k) != v]
    note = "" if meta.get("dataset_digest") == dataset.digest else (
        f"; note: trained on dataset {meta.get('dataset_digest')}, evaluating on {dataset.digest}")
    r.add("meta", not wrong, ("; ".join(wrong) if wrong else
                              f"step {meta.get('step')}, vocab {dataset.vocab_size}, same tokenizer") + note)
    return (cfg if not wrong else None), meta


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    return {"checkpoint": report["checkpoint"], "step": report["step"], "ok": report["ok"],
            "val_loss": (report.get("metrics") or {}).get("val_loss"),
            "failed": [c["name"] for c in report["checks"] if not c["ok"]],
            "integrity_failures": list(report.get("integrity_failures") or []), "quarantined_to": None}


def validate_checkpoints(checkpoints_dir: str | Path, dataset_dir: str | Path, policy: str = "newest",
                         step: int | None = None, expect: Expectations | None = None,
                         quarantine_damaged: bool = False, **kwargs: Any) -> dict[str, Any]:
    """Apply ``policy`` to the checkpoints under ``checkpoints_dir``; returns the chosen one's
    report plus ``policy``, ``candidates`` (one summary per checkpoint judged) and
    ``quarantined`` (``[{"checkpoint", "moved_to", "reasons"}]``).

    ``kwargs`` go to `validate_checkpoint` (``max_eval_tokens``, ``prompt``, ...). When no
    checkpoint has a manifest the report says so with ``ok: false`` and ``checkpoint: null``.

    Raises:
        ConfigError: unknown policy, ``step`` with ``best_val_loss``, missing folders.
        DatasetError: the dataset does not verify.
        CheckpointError: a damaged checkpoint could not be moved aside.
    """
    if policy not in POLICIES:
        raise ConfigError(f"--policy {policy!r}: expected one of {', '.join(POLICIES)}")
    if policy == "best_val_loss" and step is not None:
        raise ConfigError(f"--step {step} with --policy best_val_loss: the policy chooses the step; drop one")
    if policy == "newest":
        chosen_dir = pick_checkpoint(checkpoints_dir, step)
        dirs = [chosen_dir] if chosen_dir is not None else []
    else:
        pick_checkpoint(checkpoints_dir)  # ConfigError when the folder is missing
        dirs = candidate_dirs(checkpoints_dir)
    reports = [_validate_one(d, dataset_dir, expect, kwargs) for d in dirs]
    summaries = [_summary(rep) for rep in reports]
    moved = []
    for rep, summary in zip(reports, summaries):
        if quarantine_damaged and rep["integrity_failures"]:
            reasons = [f"{c['name']}: {c['detail']}" for c in rep["checks"] if c["name"] in rep["integrity_failures"]]
            target = quarantine(rep["checkpoint"], reasons, rep["integrity_failures"], rep["step"])
            summary["quarantined_to"] = str(target)
            moved.append({"checkpoint": rep["checkpoint"], "moved_to": str(target), "reasons": reasons})
    if not reports:
        top: dict[str, Any] = {"format": REPORT_FORMAT, "ok": False, "checkpoint": None, "step": None,
                               "checkpoint_digest": None, "metrics": {}, "sample": None, "integrity_failures": [],
                               "checks": [{"name": "manifest", "ok": False,
                                           "detail": f"no step-* folder with a manifest.json under {checkpoints_dir}"}]}
    else:
        passing = [i for i, rep in enumerate(reports) if rep["ok"]]
        if policy == "best_val_loss" and passing:  # lowest loss; on a tie the newer (later) one
            best = min(passing, key=lambda i: (reports[i]["metrics"]["val_loss"], -i))
        else:
            best = passing[-1] if passing else len(reports) - 1
        top = dict(reports[best])
        top["quarantined_to"] = summaries[best]["quarantined_to"]
        top["seconds"] = {k: round(sum(rep["seconds"][k] for rep in reports), 3)  # every candidate's
                          for k in ("evaluation", "sample")}
    top.update(policy=policy, candidates=summaries, quarantined=moved,
               expectations=(expect or Expectations()).as_dict())
    return top


def _validate_one(step_dir: Location, dataset_dir: str | Path, expect: Expectations | None,
                  kwargs: dict[str, Any]) -> dict[str, Any]:
    """`validate_checkpoint` of a local copy of ``step_dir`` (an S3 step is downloaded first),
    reported under ``step_dir``'s own name."""
    # A checkpoint the trainer wrote: its files get the store's read-after-write allowance.
    with ckpt.local_copy(step_dir, written=True) as local:
        report = validate_checkpoint(local, dataset_dir, expect=expect, **kwargs)
    report["checkpoint"] = storage_for(step_dir).absolute(step_dir)
    return report


def main(argv: list[str] | None = None) -> int:
    entered = time.time()
    p = argparse.ArgumentParser(prog="python -m trainforge.trainer.validate", description="Validate trainforge checkpoints.")
    p.add_argument("--checkpoints", required=True, help="folder holding step-XXXXXXXX/ checkpoints")
    p.add_argument("--step", type=int, help="validate this step (policy newest; default: newest with a manifest)")
    p.add_argument("--dataset", required=True, help="prepared dataset folder (its validation split is evaluated)")
    p.add_argument("--report", required=True, help="where to write the JSON report")
    p.add_argument("--policy", choices=POLICIES, default="newest", help="which checkpoint to choose")
    p.add_argument("--expect-job-config", help="job config JSON the checkpoints must have been trained with")
    p.add_argument("--expect-vocab-size", type=int, help="vocabulary size the checkpoints must have")
    p.add_argument("--expect-world-size", type=int, help="world size the pipeline asks for (a difference is noted)")
    p.add_argument("--quarantine", action="store_true",
                   help="move damaged checkpoints to <checkpoints>/quarantine/ (never deletes)")
    p.add_argument("--max-eval-tokens", type=int, default=65536, help="cap on evaluated target tokens")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt of the greedy sample")
    p.add_argument("--sample-tokens", type=int, default=32, help="new tokens of the greedy sample (0: none)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    try:
        expect = (Expectations.from_job_config_file(args.expect_job_config, args.expect_vocab_size,
                                                    args.expect_world_size) if args.expect_job_config
                  else Expectations(vocab_size=args.expect_vocab_size, world_size=args.expect_world_size))
        report = validate_checkpoints(args.checkpoints, args.dataset, args.policy, args.step, expect,
                                      quarantine_damaged=args.quarantine, max_eval_tokens=args.max_eval_tokens,
                                      prompt=args.prompt, max_new_tokens=args.sample_tokens, device=args.device)
    except ConfigError as err:  # includes DatasetError
        print(f"trainforge.trainer.validate: {err}", file=sys.stderr)
        return EXIT_CONFIG
    except CheckpointError as err:  # quarantine failed: report what we know, fail
        print(f"trainforge.trainer.validate: {err}", file=sys.stderr)
        return 1
    _account(report, entered)
    atomic_write_json(args.report, report)
    for c in report["checks"]:
        print(f"{'PASS' if c['ok'] else 'FAIL'} {c['name']}: {c['detail']}")
    if report["metrics"]:
        print("metrics: " + ", ".join(f"{k}={v}" for k, v in report["metrics"].items()))
    for q in report["quarantined"]:
        print(f"QUARANTINED {q['checkpoint']} -> {q['moved_to']}")
    if len(report["candidates"]) > 1:
        print(f"policy {report['policy']}: chose {report['checkpoint']} of {len(report['candidates'])} checkpoints")
    print(_time_line(report["seconds"]))
    return 0 if report["ok"] else 1


def _account(report: dict[str, Any], entered: float) -> None:
    """``report["seconds"]``: the program's time from process start, split into importing,
    evaluating, sampling and the rest (reading the manifest, hashing, loading, S3 copies)."""
    seconds = report.setdefault("seconds", {"evaluation": 0.0, "sample": 0.0})
    seconds["imports"] = round(max(0.0, entered - process_started_at()), 3)
    seconds["total"] = round(max(0.0, time.time() - process_started_at()), 3)
    seconds["other"] = round(max(0.0, seconds["total"] - seconds["imports"] - seconds["evaluation"]
                                 - seconds["sample"]), 3)


def _time_line(seconds: dict[str, float]) -> str:
    return (f"time: {seconds['total']:.1f}s from process start: imports {seconds['imports']:.1f}s, "
            f"evaluation {seconds['evaluation']:.1f}s, sample {seconds['sample']:.1f}s, checks and "
            f"loading {seconds['other']:.1f}s")


if __name__ == "__main__":
    sys.exit(main())
