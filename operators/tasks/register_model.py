"""The ``register_model`` task: one model version per validated checkpoint, then the eval gate.

The checkpoint is exported to a Hugging Face folder by the trainer's exporter (a child process),
logged with the ``transformers`` flavour (so it loads back as a text-generation pipeline with
its tokenizer) into the checkpoint's LoggedModel in the DAG run's MLflow run (made by
``validate_checkpoint``; the version's source is ``models:/<its model id>``) that links the
validation metrics and the ledger's summary and no other metric of the run (`documented_metrics`;
a refused link is a warning and a tag, never a failed registration), registered,
awaited until READY, and given the
spec's aliases (``challenger``). The idempotency key — MLflow run id + checkpoint digest — is
looked up before anything is created, so a retry or a second run of this task never adds a
second version.

Then the eval gate (trainforge.gate, docs/registry.md) decides whether the version also takes
``champion``; comparing with an existing champion runs ``python -m trainforge.trainer.evaluate`` on both
versions, loaded back from the registry, as a child process. A gate failure is a normal outcome:
the task logs it plainly and succeeds. When ``champion`` moves, the task emits an asset event for
``Asset("trainforge-model-<name>")`` through the ``AssetAlias`` outlet that the DAG builder
declares (`champion_outlet`): an ``Asset`` outlet would emit on every success, gate failures
included. With ``registry.approval`` a gate pass moves nothing: ``approve_champion``
(trainforge.tasks.approve_champion) asks a person, then moves ``champion`` and emits the event.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import quote

from airflow.sdk import Asset, AssetAlias

from trainforge.base import TrainforgeStageOperator, fail_permanently
from trainforge.contract import EXIT_CONFIG
from trainforge.approval import upstream_refusal, upstream_states
from trainforge.model_card import airflow_run_url, base_model_tags, model_card
from trainforge.gate import PASS, GateDecision, decide, evaluator_argv
from trainforge.hooks.mlflow import MAX_DATASET_DIGEST_CHARS
from trainforge.hooks.mlflow_model_links import AdapterRegistrationError, MetricLink, adapter_registration_problem
from trainforge.hooks.mlflow_registry import CHAMPION, ModelRegistry
from trainforge.ledger.read import FIGURES as LEDGER_FIGURES
from trainforge.paths import dataset_location
from trainforge.pipeline.stages import stage_spec
from trainforge.task_score import table, table_path, task_options, task_rules
from trainforge.tasks.validate_checkpoint import s3_env, threshold_failures

# Rounds of "evaluate against the champion, then check it did not move meanwhile" before giving up.
MAX_GATE_ROUNDS = 3
GATE_REPORT_ARTIFACT = "gate/evaluation.json"


def model_asset_name(model_name: str) -> str:
    """Name (and URI) of the Airflow asset of a registered model's champion."""
    return f"trainforge-model-{model_name}"


def model_asset(model_name: str):
    """``Asset("trainforge-model-<name>")``: what downstream DAGs schedule on."""
    return Asset(name=model_asset_name(model_name))


def champion_outlet(model_name: str):
    """The ``AssetAlias`` outlet of ``register_model``: it emits an event for `model_asset` only
    when ``champion`` moved (a plain ``Asset`` outlet emits on every success)."""
    return AssetAlias(name=f"{model_asset_name(model_name)}-champion")


def documented_metrics(spec, prepared: dict, validated: dict,
                       run_metrics: dict[str, float]) -> list[MetricLink]:
    """What the registered version's LoggedModel links (docs/registry.md): the validation
    metrics at the checkpoint's step, on the validation dataset, then the ledger's summary
    figures of the run (each stage's too), the latest of each: nothing else the run holds."""
    digest = str(prepared.get("digest") or "")[:MAX_DATASET_DIGEST_CHARS]
    dataset = (f"{spec.dag_id}-dataset", digest) if digest else None  # as validate links them
    step = int(validated.get("step") or 0)
    links = [MetricLink(str(k), float(v), step, dataset)
             for k, v in sorted((validated.get("metrics") or {}).items())]
    ledger = sorted(k for k in run_metrics if k in LEDGER_FIGURES or (
        k.startswith("stage/") and k.split("/", 2)[-1] in LEDGER_FIGURES))
    return links + [MetricLink(k, group="ledger") for k in ledger]


def emit_champion_event(task: Any, context: Any, name: str, version: str,
                        previous: str | None) -> None:
    """Emit the asset event of ``champion`` moving to ``version`` through ``task``'s
    `champion_outlet` (nothing when the task declares none)."""
    alias = champion_outlet(name)
    if not any(getattr(o, "name", None) == alias.name for o in task.outlets or []):
        task.log.info("no outlet %s declared on this task: no asset event emitted", alias.name)
        return
    extra = {"name": name, "version": version, "alias": "champion",
             "model_uri": f"models:/{name}/{version}", "previous_champion": previous}
    context["outlet_events"][alias].add(model_asset(name), extra=extra)
    task.log.info("Asset event for %s: %s", model_asset_name(name), extra)


class RegisterModelOperator(TrainforgeStageOperator):
    """Register the validated checkpoint in the MLflow model registry, then run the eval gate.

    XCom: ``{"name", "version", "aliases", "model_uri", "created", ..., "gate": {"decision",
    "reason", "metric", "method", "candidate_version", "candidate_value", "champion_version",
    "champion_value", "improvement", "min_improvement", "champion_after", "task_score",
    "champion_task_score", "promoted"}}`` (the task scores with ``registry.eval``, else None).
    """

    ui_color = "#ede2f6"
    champion_outlet = staticmethod(champion_outlet)  # for the DAG builder: outlets=[...]

    def __init__(self, *, prepare_task_id: str = "prepare_data",
                 validate_task_id: str = "validate_checkpoint", timeout_s: float = 3600.0,
                 ready_timeout_s: float = 600.0, **kwargs: Any):
        super().__init__(**kwargs)
        self.prepare_task_id = prepare_task_id
        self.validate_task_id = validate_task_id
        self.timeout_s = timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.task_results: dict[str, Any] | None = None  # the candidate's task entry, by the gate

    def execute(self, context: Any) -> dict[str, Any]:
        spec = self.resolved_spec(context)
        ti = context["ti"]
        prepared = ti.xcom_pull(task_ids=self.prepare_task_id) or {}
        validated = ti.xcom_pull(task_ids=self.validate_task_id) or {}
        if validated.get("stage"):  # the chosen leaf stage (docs/stages.md): its settings
            spec = stage_spec(spec, validated["stage"])
        if not validated.get("checkpoint") or not validated.get("checkpoint_digest"):
            fail_permanently(f"no validated checkpoint (validate XCom was {validated!r})")
        run_id = self.mlflow_run_id(context, spec)
        run_url = self._mlflow_run_url(run_id)
        key = f"{run_id}:{validated['checkpoint_digest']}"
        existing = self.mlflow_hook.find_model_version(spec.registry.model_name, key)
        if existing is None:
            self._check_adapter_registration(spec, prepared)
        with tempfile.TemporaryDirectory(prefix="trainforge-export-") as tmp:
            hf_dir = Path(tmp) / "hf"
            if existing is not None:  # a retry: the version exists; aliases and the gate remain
                self.log.info("%s v%s already holds checkpoint digest %s: not exporting again",
                              existing["name"], existing["version"], validated["checkpoint_digest"])
            else:
                rc = self.run_streaming(
                    [self.python(), "-m", "trainforge.trainer.export", "--checkpoint", validated["checkpoint"],
                     "--dataset", dataset_location(prepared), "--out", str(hf_dir)],
                    timeout_s=self.timeout_s, env=s3_env(spec),
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
                **({"trainforge.stage": validated["stage"]} if validated.get("stage") else {}),
                **base_model_tags(prepared, hf_dir),
            }
            try:
                registered = self.mlflow_hook.register_model_version(
                    run_id=run_id,
                    model_dir=str(hf_dir),
                    registered_model_name=spec.registry.model_name,
                    idempotency_key=key,
                    aliases=list(spec.registry.aliases),
                    description=model_card(spec, prepared, validated, context, run_url),
                    tags=tags,
                    ready_timeout_s=self.ready_timeout_s,
                    logged_model_id=validated.get("model_id"),  # the checkpoint's LoggedModel
                    metric_links=documented_metrics(spec, prepared, validated,
                                                    self.mlflow_hook.get_run(run_id).data.metrics),
                    step=int(validated.get("step") or 0),
                )
            except AdapterRegistrationError as err:  # before any version: its upload comes first
                fail_permanently(str(err))
        self.log.info("Model version %s v%s (%s) aliases %s", registered["name"],
                      registered["version"], "created" if registered.get("created") else "reused",
                      ", ".join(registered.get("aliases", [])))
        self._context = context  # the champion invariant reads this DAG run's task states at the move
        gate = self.run_gate(spec, prepared, validated, registered, run_id)
        self._log_decision(gate)
        registry = self._registry
        registry.set_description(registered["name"], registered["version"],
                                 model_card(spec, prepared, validated, context, run_url, gate,
                                            self.task_results))
        self.mlflow_hook.set_tags(run_id, {
            "trainforge.registered_model": registered["name"],
            "trainforge.model_version": str(registered["version"]),
            **gate.tags(),
        })
        awaiting = gate.decision == PASS and gate.champion_after != gate.candidate_version
        if gate.decision == PASS and not awaiting:
            emit_champion_event(self, context, registered["name"], str(registered["version"]),
                                gate.champion_version)
        self.mlflow_hook.end_run(run_id, "FINISHED")
        aliases = registry.aliases_of(registered["name"], registered["version"])
        return {**registered, "aliases": aliases, "gate": gate.as_xcom(),
                "awaiting_approval": awaiting}

    def _check_adapter_registration(self, spec, prepared: dict) -> None:
        """``training.peft.merge: false`` registers the adapter with a reference to its base's
        local folder: refuse it before exporting when this MLflow cannot record one, or the base
        resolved to no local folder (an ``s3://`` one)."""
        peft = getattr(spec.training, "peft", None)
        if peft is None or peft.merge:
            return
        problem = adapter_registration_problem()
        if problem:
            fail_permanently(problem)
        folder = str((prepared.get("pretrained") or {}).get("folder") or "")
        if not folder or folder.startswith("s3://"):
            fail_permanently(f"training.peft.merge: false registers the adapter with a reference to its base "
                             f"model's local folder, and model.pretrained resolved to {folder or 'nothing'!r} "
                             f"(expected a local folder: a local or hf:// model.pretrained, or merge: true)")

    # -- the gate ---------------------------------------------------------------------------
    @property
    def _registry(self):
        return ModelRegistry(self.mlflow_hook)

    def run_gate(self, spec, prepared: dict, validated: dict, registered: dict,
                 run_id: str) -> GateDecision:
        """Decide, and move ``champion`` on a pass (module doc). Returns the decision with
        ``champion_after`` filled in."""
        registry = self._registry
        name, version = registered["name"], str(registered["version"])
        rules = spec.validation.gate
        failures = threshold_failures(spec, validated.get("metrics") or {})
        decision = None
        for _ in range(MAX_GATE_ROUNDS):
            champion = registry.version_with_alias(name, CHAMPION)
            champion_version = champion["version"] if champion else None
            recorded = GateDecision.from_tags(registered.get("tags") or {})
            if champion_version == version and recorded is not None and recorded.decision == PASS:
                decision = recorded  # a retry after the alias moved: keep the original comparison
                break
            evaluation = None
            if rules.enabled and not failures and champion_version != version and (
                    champion_version is not None or spec.registry.eval is not None):
                evaluation = self._evaluate(name, version, champion_version, prepared, spec, run_id)
            decision = decide(enabled=rules.enabled, metric=rules.metric,
                              min_improvement=rules.min_improvement, candidate_version=version,
                              candidate_metrics=validated.get("metrics") or {},
                              threshold_failures=failures, champion_version=champion_version,
                              evaluation=evaluation, task=task_rules(spec))
            if decision.decision != PASS or champion_version == version:
                registry.set_version_tags(name, version, decision.tags(with_champion_after=False))
                break
            now = registry.version_with_alias(name, CHAMPION)
            if (now["version"] if now else None) != champion_version:
                self.log.warning("champion of %s moved from v%s to v%s while the gate ran; "
                                 "comparing again", name, champion_version, now and now["version"])
                continue
            if spec.registry.approval is not None:  # approve_champion moves it after approval
                registry.set_version_tags(name, version, decision.tags(with_champion_after=False))
                break
            refusal = self._refusal_now()  # the champion invariant, checked at the move
            if refusal:
                decision = dataclasses.replace(decision, decision="fail", reason=refusal)
                registry.set_version_tags(name, version, decision.tags(with_champion_after=False))
                fail_permanently(f"not moving champion to {name} v{version}: {refusal}")
            registry.promote(name, version, champion_version,
                             decision.tags(with_champion_after=False))
            break
        else:
            decision = dataclasses.replace(
                decision, decision="fail",
                reason=f"the champion alias moved {MAX_GATE_ROUNDS} times while the gate ran; "
                       "not moving it (retry the task)")
            registry.set_version_tags(name, version, decision.tags(with_champion_after=False))
        after = registry.version_with_alias(name, CHAMPION)
        return dataclasses.replace(decision, champion_after=after["version"] if after else None)

    def _evaluate(self, name: str, version: str, champion_version: str | None, prepared: dict, spec,
                  run_id: str) -> dict[str, Any]:
        """Run trainforge.trainer.evaluate on both versions (the candidate alone when there is no
        champion: only its task score is needed); fail the task when the candidate does not load
        back, evaluate or answer the task prompts (a registered version must be usable)."""
        versions = {"candidate": version, **({"champion": champion_version} if champion_version else {})}
        models = {model: f"models:/{name}/{v}" for model, v in versions.items()}
        base = prepared.get("pretrained") or {}
        if spec.registry.eval is not None and base.get("folder") and not str(base["folder"]).startswith("s3://"):
            models["base"] = str(base["folder"])  # the task score before fine-tuning, for the record
        with tempfile.TemporaryDirectory(prefix="trainforge-gate-") as tmp:
            report_path = Path(tmp) / "evaluation.json"
            argv = evaluator_argv(
                self.python(), dataset_location(prepared), models,
                str(report_path), spec.validation.eval_tokens, task_options(spec),
            )
            env = {**(s3_env(spec) or os.environ),
                   "MLFLOW_TRACKING_URI": self.mlflow_hook.tracking_uri}
            rc = self.run_streaming(argv, timeout_s=self.timeout_s, env=env)
            if rc == EXIT_CONFIG:  # bad arguments: registry.eval's files, named in the log above
                fail_permanently(f"trainforge.trainer.evaluate refused its arguments (exit {rc}; the "
                                 "reason is in the log above): check registry.eval")
            if not report_path.exists():
                raise RuntimeError(f"trainforge.trainer.evaluate wrote no report for {name} v{version} vs "
                                   f"v{champion_version} (exit code {rc}); retrying may help")
            report = json.loads(report_path.read_text(encoding="utf-8"))
        self.mlflow_hook.log_dict_artifact(run_id, report, GATE_REPORT_ARTIFACT)
        candidate = (report.get("models") or {}).get("candidate") or {}
        if not candidate.get("ok"):
            fail_permanently(f"registered version {name} v{version} does not load back from the "
                             f"registry and evaluate: {candidate.get('error')}")
        if spec.registry.eval is not None:
            self._log_task(report, versions, run_id)
        return report

    def _log_task(self, report: dict[str, Any], versions: dict[str, str], run_id: str) -> None:
        """The per-prompt table and ``eval/task_score`` on the run; fail the task when the
        candidate could not answer (a config problem, such as a missing chat template)."""
        entry = report["models"]["candidate"].get("task") or {}
        if not entry.get("ok"):
            fail_permanently(f"registered version v{versions['candidate']} could not answer "
                             f"registry.eval.prompts: {entry.get('error')}")
        self.task_results = entry
        self.mlflow_hook.log_table(run_id, table(report, versions),
                                   table_path(versions["candidate"], versions.get("champion")))
        scores = {"eval/task_score": entry["score"]}
        base = ((report["models"].get("base") or {}).get("task") or {})
        if base.get("ok"):  # the pretrained model the candidate was fine-tuned from
            scores["eval/task_score_base"] = base["score"]
            self.log.info("task score: %.3f after fine-tuning, %.3f for the base model", entry["score"],
                          base["score"])
        self.mlflow_hook.log_metrics(run_id, scores)

    def _refusal_now(self) -> str | None:
        """Why champion must not move now: a task upstream of this one in this DAG run, such as
        validate_checkpoint, is not in state success (marked failed while the gate ran)."""
        context = getattr(self, "_context", None)
        if context is None:
            return None
        ti = context["ti"]
        return upstream_refusal(upstream_states(self, context), f"{ti.dag_id}/{ti.run_id}")

    def _log_decision(self, gate: GateDecision) -> None:
        if gate.decision == PASS and gate.champion_after != gate.candidate_version:
            self.log.info("%s. champion stays %s until a person approves (approve_champion).",
                          gate.summary_line(),
                          f"v{gate.champion_after}" if gate.champion_after else "unset")
        elif gate.decision == PASS:
            self.log.info("%s. champion is now v%s.", gate.summary_line(), gate.champion_after)
        else:
            self.log.warning("%s. v%s keeps its other aliases; champion stays %s. The task "
                             "succeeds: a gate failure is a normal outcome.", gate.summary_line(),
                             gate.candidate_version,
                             f"v{gate.champion_after}" if gate.champion_after else "unset")

    def _mlflow_run_url(self, run_id: str) -> str:
        try:
            experiment_id = self.mlflow_hook.get_run(run_id).info.experiment_id
        except Exception:  # noqa: BLE001 - a link is a convenience
            return ""
        base = self.mlflow_hook.tracking_uri.rstrip("/")
        return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"
