"""Compile pipeline specs into Airflow DAGs.

One spec gives one DAG whose tasks and edges are those of :func:`trainforge.graph.task_graph`::

    prepare_data >> train >> validate_checkpoint >> register_model

or, with ``stages`` (operators/pipeline/stages.py, docs/stages.md), one training task per stage,
``train_<name>``, where ``validate_checkpoint`` picks the best valid leaf checkpoint for
``register_model``::

    prepare_data >> train_pretrain >> train_finetune >> validate_checkpoint >> register_model

With ``registry.approval`` ``approve_champion`` follows ``register_model`` and carries the
champion's asset outlet: a person approves the gate's pass before ``champion`` moves
(trainforge.tasks.approve_champion). ``pipeline.deadline`` becomes the DAG's deadline alert
(trainforge.deadline).

Every pipeline also ends with the teardown task ``close_run`` (operators/tasks/close_run.py;
docs/faults.md, "The teardown: `close_run`").

Cheap at parse time: reads YAML and builds operators; imports no torch, no MLflow, no engine
client (the operator modules import those inside the methods that run tasks). The tunable
training fields become typed DAG ``params`` so the Airflow trigger form can override them; the
operators validate overrides with the spec model when the run starts.
"""

from __future__ import annotations

import datetime as dt
import logging
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, Asset, Param

from trainforge.base import TUNABLE_PARAMS
from trainforge.callbacks import clear_failure_on_success, close_mlflow_run_on_failure
from trainforge.deadline import deadline_alert
from trainforge.graph import TaskGraph, TaskKind, TaskNode, task_graph, task_timeouts
from trainforge.pipeline.loader import SpecError, SpecIssue, load_spec
from trainforge.pipeline.spec import PipelineSpec
from trainforge.pipeline.pipeline import AssetSchedule
from trainforge.tasks.approve_champion import ApproveChampionOperator
from trainforge.tasks.close_run import CloseRunOperator
from trainforge.tasks.prepare_data import PrepareDataOperator
from trainforge.tasks.register_model import RegisterModelOperator
from trainforge.tasks.train import TrainOperator
from trainforge.tasks.validate_checkpoint import ValidateCheckpointOperator

log = logging.getLogger(__name__)


def _field_info(path: str):
    """The pydantic field of a dotted spec path, and its model class."""
    model: Any = PipelineSpec
    parts = path.split(".")
    for part in parts[:-1]:
        annotation = model.model_fields[part].annotation
        model = annotation
    return model.model_fields[parts[-1]]


def build_params(spec: PipelineSpec) -> dict[str, Any]:
    """Typed Airflow ``Param`` objects for :data:`TUNABLE_PARAMS`, defaults from the spec."""
    data = spec.model_dump(mode="json")
    params = {}
    for name, path in TUNABLE_PARAMS.items():
        value: Any = data
        for part in path.split("."):
            value = value[part]
        info = _field_info(path)
        schema: dict[str, Any] = {"type": "integer" if isinstance(value, int) else "number"}
        for meta in info.metadata:
            for attr, key in (("ge", "minimum"), ("le", "maximum"), ("gt", "exclusiveMinimum"),
                              ("lt", "exclusiveMaximum")):
                bound = getattr(meta, attr, None)
                if bound is not None:
                    schema[key] = bound
        params[name] = Param(
            value, description=f"{info.description or ''} (spec field {path})".strip(),
            title=name.replace("_", " "), **schema,
        )
    return params


def build_dag(spec: PipelineSpec, spec_file: str = ""):
    """The Airflow DAG of one pipeline spec: one operator per node of :func:`task_graph`."""
    p = spec.pipeline
    start = dt.datetime.combine(p.start_date, dt.time(0, 0), tzinfo=dt.timezone.utc)
    dag = DAG(
        dag_id=spec.dag_id,
        description=(p.description.strip().splitlines() or [""])[0][:200] or None,
        doc_md=p.description or None,
        schedule=_schedule(spec),
        start_date=start,
        catchup=p.catchup,
        max_active_runs=p.max_active_runs,
        tags=sorted({"trainforge", *p.tags}),
        default_args=_default_args(spec),
        params=build_params(spec),
        deadline=deadline_alert(spec),
    )
    graph = task_graph(spec)
    with dag:
        tasks = {node.task_id: _operator(spec, spec_file, graph, node, dag)
                 for node in graph.nodes}
        for node in graph.nodes:
            for upstream in node.upstream:
                tasks[upstream] >> tasks[node.task_id]
    _apply_task_settings(dag, spec, graph)
    return dag


def _operator(spec: PipelineSpec, spec_file: str, graph: TaskGraph, node: TaskNode, dag):
    """The operator of one graph node (cheap: the operators keep the spec as plain JSON)."""
    common = {"task_id": node.task_id, "spec": spec.model_dump(mode="json"),
              "spec_file": spec_file}
    if node.kind is TaskKind.PREPARE_DATA:
        return PrepareDataOperator(outlets=[PrepareDataOperator.asset_for(spec)], **common)
    if node.kind is TaskKind.TRAIN:
        return TrainOperator(stage=node.stage, **common)  # execution_timeout: _apply_task_settings
    if node.kind is TaskKind.VALIDATE_CHECKPOINT:
        leaves = [graph.node(task_id) for task_id in node.upstream]
        return ValidateCheckpointOperator(
            train_task_id=leaves[0].task_id,
            leaf_stages=[leaf.stage for leaf in leaves] if spec.stages else None,
            **common,
        )
    champion = [RegisterModelOperator.champion_outlet(spec.registry.model_name)]
    approval = spec.registry.approval
    if node.kind is TaskKind.REGISTER_MODEL:  # with approval, approve_champion moves champion
        return RegisterModelOperator(outlets=[] if approval else champion, **common)
    if node.kind is TaskKind.APPROVE_CHAMPION:
        return ApproveChampionOperator(
            approvers=approval.approvers, timeout_s=approval.timeout,
            on_timeout=approval.on_timeout, outlets=champion,
            notify=approval.notify.model_dump(mode="json") if approval.notify else None, **common)
    # Not the MLflow-closing failure callback: a failed teardown must not end a finished run
    # FAILED. The spec's failure notifications stay.
    return CloseRunOperator(on_failure_callback=_teardown_failure_callbacks(dag),
                            **common).as_teardown()


def _teardown_failure_callbacks(dag) -> list:
    return [cb for cb in dag.default_args.get("on_failure_callback") or []
            if cb is not close_mlflow_run_on_failure]


def _schedule(spec: PipelineSpec) -> Any:
    """The spec's schedule in Airflow's terms: cron/preset string, None, or asset condition."""
    schedule = spec.pipeline.schedule
    if not isinstance(schedule, AssetSchedule):
        return schedule
    assets = [Asset(uri=uri, name=uri) for uri in schedule.assets]
    if schedule.mode == "all":
        return assets
    condition = assets[0]
    for asset in assets[1:]:
        condition = condition | asset
    return condition


def _default_args(spec: PipelineSpec) -> dict[str, Any]:
    p = spec.pipeline
    args: dict[str, Any] = {
        "owner": p.owner,
        "retries": p.defaults.retries,
        "retry_delay": dt.timedelta(seconds=p.defaults.retry_delay),
    }
    if p.defaults.execution_timeout:
        args["execution_timeout"] = dt.timedelta(seconds=p.defaults.execution_timeout)
    args["on_failure_callback"] = [close_mlflow_run_on_failure]
    args["on_success_callback"] = [clear_failure_on_success]
    email = p.notifications.email
    if email is not None:
        from airflow.providers.smtp.notifications.smtp import SmtpNotifier

        subject = f"trainforge {spec.dag_id}: {{{{ ti.task_id }}}} {{{{ ti.state }}}}"
        for outcome, key in (("failure", "on_failure_callback"), ("retry", "on_retry_callback"),
                             ("success", "on_success_callback")):
            if outcome in email.on:
                notifier = SmtpNotifier(to=list(email.to), subject=subject)
                args[key] = [*args.get(key, []), notifier]
    return args


def _apply_task_settings(dag, spec: PipelineSpec, graph: TaskGraph) -> None:
    """Per-task overrides of the pipeline defaults (``pipeline.tasks.<kind>``, the node's
    :class:`TaskKind`): ``pipeline.tasks.train`` applies to every stage's training task. Every
    task's ``execution_timeout`` is the one :func:`task_timeouts` gives."""
    overrides = spec.pipeline.tasks
    timeouts = {t.task_id: t.seconds for t in task_timeouts(spec, graph)}
    for task in dag.tasks:
        seconds = timeouts[task.task_id]
        task.execution_timeout = dt.timedelta(seconds=seconds) if seconds is not None else None
        settings = getattr(overrides, graph.node(task.task_id).kind.value, None)
        if settings is None:
            continue
        if settings.retries is not None:
            task.retries = settings.retries
        if settings.retry_delay is not None:
            task.retry_delay = dt.timedelta(seconds=settings.retry_delay)


def spec_files(paths: str | Path | list) -> list[Path]:
    """Spec files named by ``paths``: files as given, folders by their ``*.yaml``/``*.yml``."""
    out: list[Path] = []
    for item in paths if isinstance(paths, list) else [paths]:
        item = Path(item)
        if item.is_dir():
            out += sorted([*item.glob("*.yaml"), *item.glob("*.yml")])
        else:
            out.append(item)
    return out


def build_dags(paths: str | Path | list) -> tuple[dict[str, Any], dict[str, Exception]]:
    """Compile every spec named by ``paths`` (files, or folders of ``*.yaml`` / ``*.yml``).

    Returns ``(dags by dag_id, errors by file)``: one broken spec never stops the others. An
    error is a :class:`SpecError` (its ``issues`` carry lines) or an ``OSError``; a spec that
    validates but whose DAG cannot be built is a :class:`SpecError` at its line 1.
    """
    dags: dict[str, Any] = {}
    errors: dict[str, Exception] = {}
    files = spec_files(paths)
    seen: dict[str, str] = {}
    for path in files:
        try:
            spec = load_spec(path)
        except (SpecError, OSError) as err:
            errors[str(path)] = err
            continue
        if spec.dag_id in seen:
            errors[str(path)] = SpecError([SpecIssue(
                str(path), 1, 1, "pipeline.name",
                f"dag_id {spec.dag_id!r} is already used by {seen[spec.dag_id]}",
            )])
            continue
        seen[spec.dag_id] = str(path)
        try:
            dags[spec.dag_id] = build_dag(spec, spec_file=str(path))
        except Exception as err:  # noqa: BLE001 - one spec must never hide the others
            errors[str(path)] = SpecError([SpecIssue(
                str(path), 1, 1, "",
                f"no DAG could be built from this spec ({type(err).__name__}: {err})",
            )])
    return dags, errors
