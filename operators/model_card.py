"""A registered model version's card and lineage: the description `register_model` writes (data,
config, metrics, gate decision, task answers, links) and the tags of a model fine-tuned from open
weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

from trainforge.gate import GateDecision
from trainforge.task_score import card_lines


def model_card(spec, prepared: dict, validated: dict, context: Any, mlflow_run_url: str = "",
               gate: GateDecision | None = None, task: dict | None = None) -> str:
    """The model version's description: data, config, metrics, gate decision, links, and with
    ``task`` (the candidate's task entry of the gate's evaluation) a few generations (Markdown)."""
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
        f"digest `{validated.get('checkpoint_digest')}`, "
        f"policy {validated.get('policy', 'newest')})",
        _model_line(spec, prepared),
        f"- optimisation: {spec.training.optimization.max_steps} steps, global batch "
        f"{spec.training.optimization.global_batch_size} x {spec.data.sequence_length} tokens, "
        f"lr {spec.training.optimization.learning_rate}",
        "- validation: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())),
    ]
    if gate is not None:
        lines.append(f"- {gate.summary_line()}")
    airflow_url = airflow_run_url(ti.dag_id, ti.run_id)
    if airflow_url:
        lines.append(f"- Airflow DAG run: {airflow_url}")
    if mlflow_run_url:
        lines.append(f"- MLflow run: {mlflow_run_url}")
    if spec.registry.eval is not None:
        lines += card_lines(task, spec.registry.eval.scoring)
    return "\n".join(lines)


def _model_line(spec, prepared: dict) -> str:
    base = prepared.get("pretrained")
    if base:  # open weights: the architecture is the base's config.json
        line = f"- model: fine-tuned from `{base['source']}` (revision `{base.get('revision') or 'unversioned'}`)"
        peft = getattr(spec.training, "peft", None)
        if peft is not None and not peft.merge:
            line += (f"; registered as the LoRA adapter alone (training.peft.merge: false): loading it needs the "
                     f"base model folder `{base.get('folder')}` where it is loaded (tags trainforge.base_model.folder "
                     f"and trainforge.adapter.base_sha256, the digest of the base weights it belongs to)")
        return line
    return (f"- model: {spec.model.family}, d_model {spec.model.hidden_size}, "
            f"{spec.model.num_layers} layers, {spec.model.num_heads} heads")


def base_model_tags(prepared: dict, hf_dir: Path) -> dict[str, str]:
    """The version's lineage when it was fine-tuned from open weights: the base URI and its resolved
    revision (from ``prepare_data``), the digest of its weights index and its licence (from the
    export's ``trainforge_export.json``); none for a model trained from the spec's fields. An
    adapter registered alone (``training.peft.merge: false``) adds what it needs to load:
    ``trainforge.registered_weights`` = ``adapter``, the base's local folder and the digest of the
    base weights the adapter belongs to (``trainforge.adapter.base_sha256``)."""
    base = prepared.get("pretrained")
    if not base:
        return {}
    tags = {"trainforge.base_model": str(base["source"]),
            "trainforge.base_model.revision": str(base.get("revision") or "")}
    try:
        export = json.loads((hf_dir / "trainforge_export.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # a retry whose version exists: nothing was exported
        export = {}
    info = export.get("base_model") or {}
    tags.update({f"trainforge.base_model.{key}": str(info[key])
                 for key in ("weights_index_sha256", "license") if info.get(key)})
    adapter = export.get("adapter")
    if adapter:
        tags.update({"trainforge.registered_weights": "adapter",
                     "trainforge.base_model.folder": str(info.get("folder") or ""),
                     "trainforge.adapter.base_sha256": str(adapter.get("base_sha256") or "")})
    return tags


def airflow_run_url(dag_id: str, run_id: str) -> str:
    """The DAG run's page in the Airflow UI (``[api] base_url``), or "" when none is set."""
    try:
        from airflow.configuration import conf

        base = (conf.get("api", "base_url", fallback="") or "").rstrip("/")
    except Exception:  # noqa: BLE001 - a link is a convenience
        base = ""
    return f"{base}/dags/{quote(dag_id)}/runs/{quote(run_id, safe='')}" if base else ""
