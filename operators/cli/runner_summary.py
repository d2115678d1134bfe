"""The summary ``trainforge run`` prints after a run: what Airflow and MLflow recorded.

:func:`collect_summary` reads the DAG run's MLflow run (metrics, tags, params) into one JSON-able
dict; :func:`print_summary` prints it as a table.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from trainforge.graph import REGISTER_MODEL_TASK_ID, TaskGraph, task_graph
from trainforge.hooks.mlflow import TAG_FAILED_TRY, MlflowHook
from trainforge.ledger.read import ledger_figures, ledger_line, stage_names
from trainforge.pipeline.spec import PipelineSpec


def _count(value: float | None) -> int | None:
    """MLflow stores every metric as a float; counts go back to integers."""
    return None if value is None else int(round(value))


def split_teardown(graph: TaskGraph, task_times: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"stages": ..., "teardown": ...}``: the pipeline's stage tasks apart from its teardown
    tasks (``close_run``), which run after them and never decide the run's state."""
    teardown = graph.teardown_ids
    return {"stages": {t: v for t, v in task_times.items() if t not in teardown},
            "teardown": {t: v for t, v in task_times.items() if t in teardown}}


def failed_tries(tags: dict[str, str]) -> list[dict[str, Any]]:
    """Every failed try the run recorded (``trainforge.failed_try.<task_id>.<try>`` tags, set by
    the ``train`` task), ``[{"task", "try", "reason"}]`` by task and try: a task that succeeded
    on a retry shows its earlier failures too."""
    found = []
    for key, reason in tags.items():
        if not key.startswith(TAG_FAILED_TRY + "."):
            continue
        task, _, number = key[len(TAG_FAILED_TRY) + 1:].rpartition(".")
        if task and number.isdigit():
            found.append({"task": task, "try": int(number), "reason": reason})
    return sorted(found, key=lambda t: (t["task"], t["try"]))


def collect_summary(spec: PipelineSpec, tracking_uri: str, airflow_run: dict[str, Any],
                    task_times: dict[str, Any]) -> dict[str, Any]:
    """What the run recorded in MLflow, gathered for the summary."""
    hook = MlflowHook(tracking_uri=tracking_uri)
    run_id = hook.find_run(spec.experiment_name, spec.dag_id, airflow_run["run_id"])
    summary: dict[str, Any] = {
        "dag_id": spec.dag_id,
        "airflow_run_id": airflow_run["run_id"],
        "state": airflow_run.get("state"),
        **split_teardown(task_graph(spec), task_times),
        "mlflow_run_id": run_id,
    }
    if run_id is None:
        return summary
    run = hook.get_run(run_id)
    metrics, tags, params = run.data.metrics, run.data.tags, run.data.params
    summary.update({
        "mlflow_run_url": f"{tracking_uri.rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{run_id}",
        "mlflow_run_status": run.info.status,
        "dataset_digest": tags.get("trainforge.dataset.digest"),
        "dataset_reused": tags.get("trainforge.dataset.reused") == "true",
        "train_tokens": _count(metrics.get("data/train_tokens")),
        "validation_tokens": _count(metrics.get("data/validation_tokens")),
        "train_documents": _count(metrics.get("data/train_documents")),
        "validation_documents": _count(metrics.get("data/validation_documents")),
        "steps_trained": _count(metrics.get("train/final_step")),
        "tokens_trained": _count(metrics.get("train/tokens_seen")),
        "final_train_loss": metrics.get("train/final_loss"),
        "val_loss": metrics.get("val/val_loss"),
        "val_perplexity": metrics.get("val/val_perplexity"),
        "unigram_perplexity": metrics.get("val/unigram_perplexity"),
        "val_bits_per_byte": metrics.get("val/val_bits_per_byte"),
        "checkpoint": tags.get("trainforge.validation.checkpoint"),
        "accounting": {k.split("/", 1)[1]: v for k, v in metrics.items()
                       if k.startswith("accounting/")},
        "currency": tags.get("cost/currency") or spec.cost.currency,  # the price's own
        "registered_model": tags.get("trainforge.registered_model"),
        "model_version": tags.get("trainforge.model_version"),
        "aliases": list(spec.registry.aliases)
        + (["champion"] if tags.get("trainforge.gate.champion_after") == tags.get(
            "trainforge.model_version") and tags.get("trainforge.model_version") else []),
        "gate_decision": tags.get("trainforge.gate.decision"),
        "gate_reason": tags.get("trainforge.gate.reason"),
        "task_score": metrics.get("eval/task_score"),
        "base_task_score": metrics.get("eval/task_score_base"),
        "champion_after": tags.get("trainforge.gate.champion_after"),
        "params_logged": len(params),
        "failed_tries": failed_tries(tags),
        "ledger": ({"": found} if (found := ledger_figures(metrics, tags)) else
                   {s: ledger_figures(metrics, tags, s) for s in stage_names(metrics)}),
    })
    _stage_summary(spec, summary, metrics, tags)
    return summary


def _stage_summary(spec: PipelineSpec, summary: dict[str, Any], metrics: dict[str, float],
                   tags: dict[str, str]) -> None:
    """With ``stages`` (docs/stages.md): one entry per training stage (its task's state; a
    failed stage counts the steps it reached), totals over every stage, and the leaf stage
    whose checkpoint was chosen."""
    nodes = {node.stage: node.task_id for node in task_graph(spec).train_nodes if node.stage}
    if not nodes:
        return
    states = {**summary.get("stages", {}), **summary.get("teardown", {})}
    per = {name: {"state": (states.get(task_id) or {}).get("state"),
                  "steps_trained": _count(metrics.get(f"train/{name}/final_step")),
                  "tokens_trained": _count(metrics.get(f"train/{name}/tokens_seen")),
                  "final_train_loss": metrics.get(f"train/{name}/final_loss"),
                  "val_loss": metrics.get(f"val/{name}/val_loss")}
           for name, task_id in nodes.items()}
    chosen = tags.get("trainforge.validation.stage")
    usage: dict[str, float] = {}
    for key, value in metrics.items():  # accounting/<stage>/<what>: summed over the stages
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "accounting" and parts[1] in per:
            usage[parts[2]] = usage.get(parts[2], 0.0) + value
    summary.update({
        "training_stages": per,
        "chosen_stage": chosen,
        "steps_trained": sum(p["steps_trained"] or 0 for p in per.values()),
        "tokens_trained": sum(p["tokens_trained"] or 0 for p in per.values()),
        "final_train_loss": per.get(chosen or "", {}).get("final_train_loss"),
        "accounting": usage,
    })


def gate_line(summary: dict[str, Any]) -> str:
    """The summary's eval-gate row: the decision, its reason and where the champion alias is.

    ``gate_decision`` is ``pass``, ``fail`` or ``skipped`` (operators/gate.py); the alias moves
    only on ``pass``. Without a decision the gate did not run, and the row says why.
    """
    decision = summary.get("gate_decision")
    if not decision:
        state = ((summary.get("stages") or {}).get(REGISTER_MODEL_TASK_ID) or {}).get("state")
        if state == "success":
            return "not run: register_model recorded no gate decision"
        return (f"not run: register_model did not finish"
                f"{f' (state {state})' if state else ''}")
    champion = summary.get("champion_after")
    champion = f"v{champion}" if champion and champion != "none" else None
    reason = summary.get("gate_reason") or "-"
    if decision == "pass":
        return f"pass: {reason}" + (f" (champion is now {champion})" if champion else "")
    return (f"{decision}: {reason} "
            f"({f'champion stays {champion}' if champion else 'no champion: the alias stays unset'})")


def task_line(summary: dict[str, Any]) -> str:
    """The registered version's score on registry.eval.prompts, and the base model's before
    fine-tuning when it was scored."""
    line = f"{summary['task_score']:.3f}"
    if summary.get("base_task_score") is not None:
        line += f" after fine-tuning; {summary['base_task_score']:.3f} before (the base model)"
    return line


def print_summary(summary: dict[str, Any], console: Console) -> None:
    def fmt(value, spec=""):
        if value is None:
            return "-"
        return format(value, spec) if spec else str(value)

    table = Table(title=f"trainforge run: {summary['dag_id']}", show_header=False)
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    rows = [
        ("Airflow DAG run", f"{summary['airflow_run_id']} ({summary.get('state')})"),
        ("dataset digest", fmt(summary.get("dataset_digest"))
         + (" (reused)" if summary.get("dataset_reused") else "")),
        ("tokens train / validation",
         f"{fmt(summary.get('train_tokens'), ',.0f')} / {fmt(summary.get('validation_tokens'), ',.0f')}"),
        ("documents train / validation",
         f"{fmt(summary.get('train_documents'), '.0f')} / {fmt(summary.get('validation_documents'), '.0f')}"),
        ("steps / tokens trained",
         f"{fmt(summary.get('steps_trained'), '.0f')} / {fmt(summary.get('tokens_trained'), ',.0f')}"),
        ("final train loss", fmt(summary.get("final_train_loss"), ".4f")),
        ("validation loss", fmt(summary.get("val_loss"), ".4f")),
        ("validation perplexity", fmt(summary.get("val_perplexity"), ".2f")),
        ("unigram-baseline perplexity", fmt(summary.get("unigram_perplexity"), ".2f")),
        ("validation bits per byte", fmt(summary.get("val_bits_per_byte"), ".3f")),
        ("checkpoint chosen", fmt(summary.get("checkpoint"))),
        ("registered model", (f"{summary['registered_model']} v{summary.get('model_version')} "
                              f"@{', @'.join(summary.get('aliases') or [])}")
         if summary.get("registered_model") else "- (not registered)"),
        ("eval gate", gate_line(summary)),
        *([("task score", task_line(summary))] if summary.get("task_score") is not None else []),
        ("MLflow run", fmt(summary.get("mlflow_run_url"))),
    ]
    usage = summary.get("accounting") or {}
    if usage:
        rows.append(("training accounting",
                     f"{usage.get('gpu_hours', 0):.4f} GPU-h, {usage.get('cpu_core_hours', 0):.4f} "
                     f"CPU-core-h, {usage.get('energy_kwh', 0):.4f} kWh, "
                     f"{usage.get('cost', 0):.4f} {summary.get('currency', '')}"))
    for name, ledger in (summary.get("ledger") or {}).items():
        rows.append((f"ledger{f' {name}' if name else ''}", ledger_line(ledger)))
    for name, info in (summary.get("training_stages") or {}).items():
        chosen = " (chosen)" if name == summary.get("chosen_stage") else ""
        if info.get("state") and info["state"] != "success":
            chosen += f" ({info['state']})"
        rows.append((f"training stage {name}",
                     f"{fmt(info.get('steps_trained'))} steps, final train loss "
                     f"{fmt(info.get('final_train_loss'), '.4f')}, validation loss "
                     f"{fmt(info.get('val_loss'), '.4f')}{chosen}"))
    for task, info in (summary.get("stages") or {}).items():
        rows.append((f"stage {task}", f"{info.get('state')} in {fmt(info.get('seconds'), '.1f')} s"))
    for failed in summary.get("failed_tries") or []:
        rows.append((f"failed try {failed['task']} #{failed['try']}", failed["reason"]))
    for task, info in (summary.get("teardown") or {}).items():
        rows.append((f"teardown {task}", f"{info.get('state')} in "
                     f"{fmt(info.get('seconds'), '.1f')} s (does not decide the run's state)"))
    for what, value in rows:  # plain text: a reason may hold "[/path:553]", not markup
        table.add_row(Text(str(what)), Text(str(value)))
    console.print(table)
