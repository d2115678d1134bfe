"""The ``register_model`` task: one model version per validated checkpoint, then aliases.

The checkpoint is exported to a Hugging Face folder by the trainer's exporter (a child process),
logged into the DAG run's MLflow run with the ``transformers`` flavour (so it loads back as a
text-generation pipeline with its tokenizer), registered, awaited until READY, and given the
spec's aliases. The idempotency key — MLflow run id + checkpoint digest — is looked up before
anything is created, so a retry or a second run of this task never adds a second version.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from operators.base import TrainforgeStageOperator, fail_permanently


def model_card(spec, prepared: dict, validated: dict, context: Any) -> str:
    """The model version's description: data, config, metrics, links (Markdown)."""
    ti = context["ti"]
    metrics = validated.get("metrics", {})
    lines = [
        f"# {spec.registry.model_name}",
        "",
        f"Trained by trainforge pipeline `{spec.dag_id}`, DAG run `{ti.run_id}`.",
        "",
        f"- dataset digest: `{prepared.get('digest')}`",
        f"- sources: {', '.join(spec.data.sources)}",
        f"- checkpoint: `{validated.get('checkpoint')}` (step {validated.get('step')}, "
        f"digest `{validated.get('checkpoint_digest')}`)",
        f"- model: {spec.model.family}, d_model {spec.model.hidden_size}, "
        f"{spec.model.num_layers} layers, {spec.model.num_heads} heads",
        f"- optimisation: {spec.training.optimization.max_steps} steps, global batch "
        f"{spec.training.optimization.global_batch_size} x {spec.data.sequence_length} tokens, "
        f"lr {spec.training.optimization.learning_rate}",
        f"- validation: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())),
    ]
    return "\n".join(lines)


class RegisterModelOperator(TrainforgeStageOperator):
    """Register the validated checkpoint in the MLflow model registry.

    XCom: ``{"name", "version", "aliases", "model_uri", "created"}``.
    """

    ui_color = "#ede2f6"

    def __init__(self, *, prepare_task_id: str = "prepare_data",
                 validate_task_id: str = "validate_checkpoint", timeout_s: float = 3600.0,
                 ready_timeout_s: float = 600.0, **kwargs: Any):
        super().__init__(**kwargs)
        self.prepare_task_id = prepare_task_id
        self.validate_task_id = validate_task_id
        self.timeout_s = timeout_s
        self.ready_timeout_s = ready_timeout_s

    def execute(self, context: Any) -> dict[str, Any]:
        spec = self.resolved_spec(context)
        ti = context["ti"]
        prepared = ti.xcom_pull(task_ids=self.prepare_task_id) or {}
        validated = ti.xcom_pull(task_ids=self.validate_task_id) or {}
        if not validated.get("checkpoint") or not validated.get("checkpoint_digest"):
            fail_permanently(f"no validated checkpoint (validate XCom was {validated!r})")
        run_id = self.mlflow_run_id(context, spec)
        key = f"{run_id}:{validated['checkpoint_digest']}"
        with tempfile.TemporaryDirectory(prefix="trainforge-export-") as tmp:
            hf_dir = Path(tmp) / "hf"
            rc = self.run_streaming(
                [self.python(), "-m", "trainer.export", "--checkpoint", validated["checkpoint"],
                 "--dataset", prepared["dataset_dir"], "--out", str(hf_dir)],
                timeout_s=self.timeout_s,
            )
            if rc != 0:
                fail_permanently(
                    f"exporting checkpoint {validated['checkpoint']} failed with exit code {rc}"
                )
            tags = {
                **spec.registry.tags,
                "trainforge.dag_id": ti.dag_id,
                "trainforge.airflow_run_id": ti.run_id,
                "trainforge.checkpoint": validated["checkpoint"],
                "trainforge.checkpoint_step": str(validated.get("step")),
                "trainforge.dataset_digest": str(prepared.get("digest")),
            }
            registered = self.mlflow_hook.register_model_version(
                run_id=run_id,
                model_dir=str(hf_dir),
                registered_model_name=spec.registry.model_name,
                idempotency_key=key,
                aliases=list(spec.registry.aliases),
                description=model_card(spec, prepared, validated, context),
                tags=tags,
                ready_timeout_s=self.ready_timeout_s,
            )
        self.log.info("Model version %s v%s (%s) aliases %s", registered["name"],
                      registered["version"], "created" if registered.get("created") else "reused",
                      ", ".join(registered.get("aliases", [])))
        self.mlflow_hook.set_tags(run_id, {
            "trainforge.registered_model": registered["name"],
            "trainforge.model_version": str(registered["version"]),
        })
        self.mlflow_hook.end_run(run_id, "FINISHED")
        return registered
