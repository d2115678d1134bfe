"""The ``validate_checkpoint`` task: a checkpoint is registered only after it passes every check.

The checks themselves run in the trainer's own validator (``python -m trainforge.trainer.validate``, the
same code that loads checkpoints for resume), as a child process: Airflow never imports the
trainer. This task tells it what to expect (the job config the ``train`` task ran with, rendered
again from the same spec, so the config digest, architecture and vocabulary must match), which
checkpoint to choose (``validation.policy``) and to move damaged checkpoints aside into
``<checkpoints>/quarantine/`` (never deleted). It then applies the spec's thresholds to the
report, logs the metrics and the report to the DAG run's MLflow run, and fails — naming the
checkpoint and every failed check — when anything is wrong. Each checkpoint that passed becomes a
LoggedModel of that run, pointing at the checkpoint where it lies
(trainforge.hooks.mlflow_logged_models).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from trainforge.engines.base import JobIdentity
from trainforge.base import TrainforgeStageOperator, fail_permanently
from trainforge.hooks.mlflow import MAX_DATASET_DIGEST_CHARS
from trainforge.hooks.mlflow_logged_models import TAG_CHOSEN
from trainforge.hooks.s3 import S3ConnectionError, spec_child_env
from trainforge.jobconfig import render_job_config
from trainforge.paths import dataset_location
from trainforge.pipeline.spec import PipelineSpec
from trainforge.pipeline.stages import stage_spec, stage_task_id

REPORT_ARTIFACT = "validation/report.json"


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


def expected_job_config(spec: PipelineSpec, dataset_dir: str, checkpoint_dir: str,
                        dag_id: str, run_id: str, train_task_id: str,
                        init: dict[str, str] | None = None,
                        pretrained: dict[str, Any] | None = None) -> dict[str, Any]:
    """The job config the ``train`` task handed the trainer (its digest ignores ``identity``;
    ``init`` and ``pretrained``: the blocks it was given, if any)."""
    identity = JobIdentity(dag_id, run_id, train_task_id, 1)
    return render_job_config(spec, dataset_dir, checkpoint_dir, identity, init=init, pretrained=pretrained)


def s3_env(spec: PipelineSpec) -> dict[str, str] | None:
    """The environment of a validator or exporter child process for the spec's S3 access
    (``storage.aws_conn_id`` keys, the S3 endpoint; trainforge.hooks.s3.spec_child_env), or None
    to inherit this process's. A connection that cannot be used fails the task without
    retries, naming it."""
    try:
        return spec_child_env(spec)
    except S3ConnectionError as err:
        fail_permanently(str(err))
        raise  # unreachable


def best_leaf(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The valid leaf result with the lowest ``metrics.val_loss``; on a tie the one listed first
    (declaration order of the stages). None when ``results`` is empty."""
    ranked = [(r["metrics"].get("val_loss", float("inf")), i) for i, r in enumerate(results)]
    return results[min(ranked)[1]] if ranked else None


def validator_argv(python: str, spec: PipelineSpec, checkpoint_dir: str, dataset_dir: str,
                   report_path: str, expect_path: str, final_step: int | None,
                   vocab_size: int | None) -> list[str]:
    """Pure: the exact ``python -m trainforge.trainer.validate`` command line of this task."""
    rules = spec.validation
    argv = [
        python, "-m", "trainforge.trainer.validate",
        "--checkpoints", checkpoint_dir,
        "--dataset", dataset_dir,
        "--report", report_path,
        "--policy", rules.policy,
        "--expect-job-config", expect_path,
        "--expect-world-size", str(spec.training.world_size),
        "--quarantine",
        "--max-eval-tokens", str(rules.eval_tokens),
        "--prompt", rules.sample_prompt,
        "--sample-tokens", str(rules.sample_tokens),
    ]  # fmt: skip
    if vocab_size:
        argv += ["--expect-vocab-size", str(vocab_size)]
    if final_step and rules.policy == "newest":
        argv += ["--step", str(final_step)]
    return argv


class ValidateCheckpointOperator(TrainforgeStageOperator):
    """Validate the ``train`` task's checkpoints by the spec's ``validation.policy``.

    XCom: ``{"checkpoint", "step", "checkpoint_digest", "metrics", "sample", "policy",
    "quarantined": [moved-to paths], "report_uri", "stage", "model_id"}`` (``model_id``: the
    chosen checkpoint's LoggedModel).

    With ``leaf_stages`` (a spec with ``stages``; docs/stages.md) each leaf stage's checkpoints
    (task ``train_<stage>``) are validated by the policy, with that stage's training settings,
    and the valid leaf with the lowest validation loss is chosen (`best_leaf`); the XCom is the
    chosen leaf's, plus ``"leaves": [{"stage", "checkpoint", "val_loss", "ok", "reason"}]``.
    The task fails only when no leaf is valid.
    """

    ui_color = "#e2f0d9"

    def __init__(self, *, prepare_task_id: str = "prepare_data", train_task_id: str = "train",
                 timeout_s: float = 3600.0, leaf_stages: list[str] | None = None,
                 **kwargs: Any):
        super().__init__(**kwargs)
        self.prepare_task_id = prepare_task_id
        self.train_task_id = train_task_id
        self.timeout_s = timeout_s
        self.leaf_stages = list(leaf_stages) if leaf_stages else None

    def execute(self, context: Any) -> dict[str, Any]:
        spec = self.resolved_spec(context)
        if not self.leaf_stages:
            return self._validate_leaf(context, spec, self.train_task_id)
        return self._validate_leaves(context, spec)

    def _validate_leaves(self, context: Any, spec: PipelineSpec) -> dict[str, Any]:
        results, leaves = [], []
        for stage in self.leaf_stages or []:
            try:
                result = self._validate_leaf(context, stage_spec(spec, stage),
                                             stage_task_id(stage), stage)
            except AirflowFailException as err:
                self.log.warning("Leaf stage %s has no valid checkpoint: %s", stage, err)
                leaves.append({"stage": stage, "checkpoint": None, "val_loss": None, "ok": False,
                               "reason": str(err)})
                continue
            results.append(result)
            leaves.append({"stage": stage, "checkpoint": result["checkpoint"],
                           "val_loss": result["metrics"].get("val_loss"), "ok": True,
                           "reason": ""})
        chosen = best_leaf(results)
        if chosen is None:
            fail_permanently("no leaf stage has a valid checkpoint:\n  - " + "\n  - ".join(
                f"{leaf['stage']}: {leaf['reason']}" for leaf in leaves))
        run_id = self.mlflow_run_id(context, spec)
        self.mlflow_hook.log_metrics(
            run_id, {f"val/{k}": v for k, v in chosen["metrics"].items()}, step=chosen["step"])
        self.mlflow_hook.set_tags(run_id, {
            "trainforge.validation.checkpoint": chosen["checkpoint"],
            "trainforge.validation.ok": "true",
            "trainforge.validation.policy": spec.validation.policy,
            "trainforge.validation.stage": chosen["stage"],
            "trainforge.validation.leaves": str(len(leaves)),
        })
        self.log.info("Chose leaf stage %s (val_loss %.4f) of %d: %s", chosen["stage"],
                      chosen["metrics"].get("val_loss", float("nan")), len(leaves),
                      ", ".join(f"{leaf['stage']} "
                                f"{'val_loss %.4f' % leaf['val_loss'] if leaf['ok'] else 'invalid'}"
                                for leaf in leaves))
        return {**chosen, "leaves": leaves}

    def _validate_leaf(self, context: Any, spec: PipelineSpec, train_task_id: str,
                       stage: str | None = None) -> dict[str, Any]:
        """Validate the checkpoints of task ``train_task_id`` trained with ``spec.training``;
        with a ``stage``, its MLflow metrics, tags and report are filed under the stage name."""
        ti = context["ti"]
        prepared = ti.xcom_pull(task_ids=self.prepare_task_id) or {}
        trained = ti.xcom_pull(task_ids=train_task_id) or {}
        if "checkpoint_dir" not in trained or "dataset_dir" not in prepared:
            fail_permanently(
                f"missing inputs: train XCom {trained!r}, prepare_data XCom {prepared!r}"
            )
        run_id = self.mlflow_run_id(context, spec)
        dataset = dataset_location(prepared)  # as the train task handed it to the trainer
        with tempfile.TemporaryDirectory(prefix="trainforge-validate-") as tmp:
            report_path = Path(tmp) / "validation_report.json"
            expect_path = Path(tmp) / "expected_job.json"
            expect_path.write_text(json.dumps(expected_job_config(
                spec, dataset, trained["checkpoint_dir"], ti.dag_id, ti.run_id,
                train_task_id, init=trained.get("init"), pretrained=trained.get("pretrained"),
            )), encoding="utf-8")
            argv = validator_argv(
                self.python(), spec, trained["checkpoint_dir"], dataset,
                str(report_path), str(expect_path), trained.get("final_step"),
                prepared.get("vocab_size"),
            )
            rc = self.run_streaming(argv, timeout_s=self.timeout_s, env=s3_env(spec))
            if not report_path.exists():
                fail_permanently(
                    f"the validator wrote no report for {trained['checkpoint_dir']} (exit code {rc})"
                )
            report = json.loads(report_path.read_text(encoding="utf-8"))
        named = f"{stage}/" if stage else ""  # one report and metric series per stage
        report_uri = self.mlflow_hook.log_dict_artifact(
            run_id, report, REPORT_ARTIFACT.replace("validation/", f"validation/{named}"))
        metrics = {k: float(v) for k, v in (report.get("metrics") or {}).items()
                   if isinstance(v, (int, float))}
        if metrics:
            self.mlflow_hook.log_metrics(run_id, {f"val/{named}{k}": v for k, v in metrics.items()},
                                         step=report.get("step"))
        quarantined = report.get("quarantined") or []
        for moved in quarantined:
            self.log.warning("Quarantined damaged checkpoint %s -> %s: %s", moved["checkpoint"],
                             moved["moved_to"], "; ".join(moved.get("reasons", [])))
        failed = [f"{c['name']}: {c.get('detail', '')}" for c in report.get("checks", [])
                  if not c.get("ok")]
        failed += threshold_failures(spec, metrics) if not failed else []
        checkpoint = report.get("checkpoint") or trained["checkpoint_dir"]
        self.mlflow_hook.set_tags(run_id, {
            f"trainforge.validation.{named.replace('/', '.')}{key}": value for key, value in {
                "checkpoint": checkpoint,
                "ok": str(not failed).lower(),
                "policy": spec.validation.policy,
                "candidates": str(len(report.get("candidates") or [])),
                "quarantined": str(len(quarantined)),
            }.items()
        })
        if failed:
            moved_to = report.get("quarantined_to")
            where = f" (moved to {moved_to})" if moved_to else ""
            fail_permanently(
                f"checkpoint {checkpoint}{where} failed validation:\n  - " + "\n  - ".join(failed)
            )
        model_id = self._log_checkpoint_models(run_id, spec, prepared, report, metrics, stage)
        self.log.info("Checkpoint %s (policy %s, %d candidate(s)) passed every check: "
                      "val_loss=%.4f val_perplexity=%.2f (unigram baseline %.2f)", checkpoint,
                      spec.validation.policy, len(report.get("candidates") or []),
                      metrics.get("val_loss", float("nan")),
                      metrics.get("val_perplexity", float("nan")),
                      metrics.get("unigram_perplexity", float("nan")))
        return {
            "checkpoint": checkpoint,
            "step": report.get("step"),
            "checkpoint_digest": report.get("checkpoint_digest"),
            "metrics": metrics,
            "sample": report.get("sample"),
            "policy": spec.validation.policy,
            "quarantined": [q["moved_to"] for q in quarantined],
            "report_uri": report_uri,
            "stage": stage,
            "model_id": model_id,
        }

    def _log_checkpoint_models(self, run_id: str, spec: PipelineSpec, prepared: dict[str, Any],
                               report: dict[str, Any], metrics: dict[str, float],
                               stage: str | None) -> str:
        """Every checkpoint that passed, as a LoggedModel of the run
        (trainforge.hooks.mlflow_logged_models); the chosen one's model id."""
        digest = str(prepared.get("digest") or "")[:MAX_DATASET_DIGEST_CHARS]
        dataset = (f"{spec.dag_id}-dataset", digest) if digest else None  # prepare_data's input
        chosen = report.get("checkpoint")
        for candidate in report.get("candidates") or []:
            if (candidate.get("ok") and candidate.get("checkpoint") != chosen
                    and candidate.get("val_loss") is not None):
                self.mlflow_hook.log_checkpoint_model(
                    run_id, candidate["checkpoint"], int(candidate["step"]),
                    {"val_loss": float(candidate["val_loss"])}, candidate, dataset, stage,
                    {TAG_CHOSEN: "false"})
        return self.mlflow_hook.log_checkpoint_model(
            run_id, chosen, int(report["step"]), metrics, report, dataset, stage,
            {TAG_CHOSEN: "true", "trainforge.checkpoint_digest": str(report.get("checkpoint_digest"))})
