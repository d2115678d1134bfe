"""The ``validate_checkpoint`` task: a checkpoint is registered only after it passes every check.

The checks themselves run in the trainer's own validator (``python -m trainer.validate``, the
same code that loads checkpoints for resume), as a child process: Airflow never imports the
trainer. This task applies the spec's thresholds to the report, logs the metrics and the report
to the DAG run's MLflow run, and fails — naming the checkpoint and every failed check — when
anything is wrong.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from operators.base import TrainforgeStageOperator, fail_permanently
from operators.spec.model import PipelineSpec


def threshold_failures(spec: PipelineSpec, metrics: dict[str, float]) -> list[str]:
    """The spec's validation thresholds that ``metrics`` do not meet (empty when all pass)."""
    rules = spec.validation
    failures = []
    loss = metrics.get("val_loss")
    ppl = metrics.get("val_perplexity")
    if rules.max_val_loss is not None and (loss is None or loss > rules.max_val_loss):
        failures.append(f"val_loss {loss} above validation.max_val_loss {rules.max_val_loss}")
    if rules.max_val_perplexity is not None and (ppl is None or ppl > rules.max_val_perplexity):
        failures.append(
            f"val_perplexity {ppl} above validation.max_val_perplexity {rules.max_val_perplexity}"
        )
    unigram = metrics.get("unigram_perplexity")
    if rules.require_beats_unigram and (ppl is None or unigram is None or ppl >= unigram):
        failures.append(
            f"val_perplexity {ppl} does not beat the unigram baseline {unigram} "
            f"(validation.require_beats_unigram)"
        )
    return failures


class ValidateCheckpointOperator(TrainforgeStageOperator):
    """Validate the newest checkpoint of the ``train`` task.

    XCom: ``{"checkpoint", "step", "checkpoint_digest", "metrics", "sample", "report"}``.
    """

    ui_color = "#e2f0d9"

    def __init__(self, *, prepare_task_id: str = "prepare_data", train_task_id: str = "train",
                 timeout_s: float = 3600.0, **kwargs: Any):
        super().__init__(**kwargs)
        self.prepare_task_id = prepare_task_id
        self.train_task_id = train_task_id
        self.timeout_s = timeout_s

    def execute(self, context: Any) -> dict[str, Any]:
        spec = self.resolved_spec(context)
        ti = context["ti"]
        prepared = ti.xcom_pull(task_ids=self.prepare_task_id) or {}
        trained = ti.xcom_pull(task_ids=self.train_task_id) or {}
        if "checkpoint_dir" not in trained or "dataset_dir" not in prepared:
            fail_permanently(
                f"missing inputs: train XCom {trained!r}, prepare_data XCom {prepared!r}"
            )
        run_id = self.mlflow_run_id(context, spec)
        with tempfile.TemporaryDirectory(prefix="trainforge-validate-") as tmp:
            report_path = Path(tmp) / "validation_report.json"
            argv = [
                self.python(), "-m", "trainer.validate",
                "--checkpoints", trained["checkpoint_dir"],
                "--dataset", prepared["dataset_dir"],
                "--report", str(report_path),
                "--max-eval-tokens", str(spec.validation.eval_tokens),
                "--prompt", spec.validation.sample_prompt,
                "--sample-tokens", str(spec.validation.sample_tokens),
            ]
            if trained.get("final_step"):
                argv += ["--step", str(trained["final_step"])]
            rc = self.run_streaming(argv, timeout_s=self.timeout_s)
            if not report_path.exists():
                fail_permanently(
                    f"the validator wrote no report for {trained['checkpoint_dir']} (exit code {rc})"
                )
            report = json.loads(report_path.read_text(encoding="utf-8"))
        self.mlflow_hook.log_dict_artifact(run_id, report, "validation/report.json")
        metrics = {k: float(v) for k, v in (report.get("metrics") or {}).items()
                   if isinstance(v, (int, float))}
        if metrics:
            self.mlflow_hook.log_metrics(run_id, {f"val/{k}": v for k, v in metrics.items()},
                                         step=report.get("step"))
        failed = [f"{c['name']}: {c.get('detail', '')}" for c in report.get("checks", [])
                  if not c.get("ok")]
        failed += threshold_failures(spec, metrics) if not failed else []
        checkpoint = report.get("checkpoint") or trained["checkpoint_dir"]
        self.mlflow_hook.set_tags(run_id, {
            "trainforge.validation.checkpoint": checkpoint,
            "trainforge.validation.ok": str(not failed).lower(),
        })
        if failed:
            fail_permanently(
                f"checkpoint {checkpoint} failed validation:\n  - " + "\n  - ".join(failed)
            )
        self.log.info("Checkpoint %s passed every check: val_loss=%.4f val_perplexity=%.2f "
                      "(unigram baseline %.2f)", checkpoint, metrics.get("val_loss", float("nan")),
                      metrics.get("val_perplexity", float("nan")),
                      metrics.get("unigram_perplexity", float("nan")))
        return {
            "checkpoint": checkpoint,
            "step": report.get("step"),
            "checkpoint_digest": report.get("checkpoint_digest"),
            "metrics": metrics,
            "sample": report.get("sample"),
        }
