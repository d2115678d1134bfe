"""What a registered version's LoggedModel holds: the model files, and the documented metrics
linked to it, nothing more (docs/registry.md, "Checkpoints as logged models").

``mlflow.<flavor>.log_model(run_id=...)`` links *every* metric the run has at the model's step
(``Model.log`` calls ``log_model_metrics_for_step``: ledger, data and system metrics included, a
thousand and more at step 0) and marks the LoggedModel FAILED when anything in it raises. Here
the files are written with the flavour's ``save_model`` and uploaded with
``log_model_artifacts`` (:func:`upload_hf_model`), and only the chosen metrics are linked, by
model id, in batches far below MLflow's 1,000 metrics per ``log_batch`` (:func:`link_metrics`).
A batch the server refuses (a per-model metric quota answers ``RESOURCE_LIMIT_EXCEEDED``) is a
warning in the :class:`LinkReport`, whose tags go on the model version: never a failure.

:class:`VersionModels` (a part of :class:`~trainforge.hooks.mlflow.MlflowHook` through
``ModelVersions``) finds or fills the LoggedModel of an idempotency key. ``mlflow`` is imported
inside the functions only.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from trainforge.hooks.mlflow_calls import mlflow_errors, quote

log = logging.getLogger(__name__)

TAG_IDEMPOTENCY_KEY = "trainforge.idempotency_key"
TAG_STATUS = "trainforge.model_metrics.status"
"""``complete``: every documented metric the run has is linked; ``partial``: some are not."""
TAG_LINKED = "trainforge.model_metrics.linked"
TAG_MISSING = "trainforge.model_metrics.missing"
TAG_ERROR = "trainforge.model_metrics.error"
LINK_BATCH_SIZE = 100
"""Metrics per ``log_batch`` request (MLflow accepts up to 1,000)."""
QUOTA_ERROR = "RESOURCE_LIMIT_EXCEEDED"
_TAG_TEXT = 500  # characters of a list or message kept in a tag
_EXTERNAL = "mlflow.model.isExternal"
_PIN_PACKAGES = ("transformers", "torch", "tokenizers", "safetensors")
ADAPTER_CONFIG = "adapter_config.json"
"""peft's adapter config: an export of ``training.peft.merge: false`` (the adapter alone)."""
EXPORT_INFO = "trainforge_export.json"


class AdapterRegistrationError(Exception):
    """An adapter-only folder that cannot be registered here: this MLflow cannot reference a local
    base folder, or the export names none. Permanent: a retry does not change either."""


def adapter_registration_problem(save_model: Any = None) -> str | None:
    """Why an adapter alone (``training.peft.merge: false``) cannot be registered with this
    MLflow, or None when it can: ``save_model`` (default ``mlflow.transformers.save_model``)
    must take ``base_model_path``, the reference to the base's local folder."""
    if save_model is None:
        import mlflow.transformers

        save_model = mlflow.transformers.save_model
    if "base_model_path" in inspect.signature(save_model).parameters:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("mlflow")
    except PackageNotFoundError:
        installed = "unknown"
    return (f"training.peft.merge: false registers the LoRA adapter alone with a reference to its base "
            f"model's local folder, which needs an MLflow whose mlflow.transformers.save_model takes "
            f"base_model_path (MLflow 3.12.0 or later); the installed "
            f"mlflow {installed} does not: upgrade mlflow where register_model runs and where the model is "
            f"loaded, or set training.peft.merge: true")


@dataclasses.dataclass(frozen=True)
class MetricLink:
    """One metric to link to a LoggedModel: the run's metric ``key``.

    With ``value`` (and ``step``): that value at that step, reusing the run's own entry when it
    has one with that value there (so the run never gets a second value at one step), else
    logged now. Without: the run's latest entry (none: nothing to link). ``group``: batches
    never mix groups, and the groups are linked in the order given, so a quota refusal of a
    later group never takes an earlier one with it.
    """

    key: str
    value: float | None = None
    step: int = 0
    dataset: tuple[str, str] | None = None
    group: str = "validation"


@dataclasses.dataclass
class LinkReport:
    """What :func:`link_metrics` linked: ``linked`` (now or before), ``missing`` (refused or
    failed), ``absent`` (no such metric on the run), and the last refusal as ``error``."""

    linked: list[str] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)
    absent: list[str] = dataclasses.field(default_factory=list)
    error: str | None = None

    @property
    def complete(self) -> bool:
        return not self.missing and self.error is None

    def tags(self) -> dict[str, str]:
        """The ``trainforge.model_metrics.*`` tags of the model version (and LoggedModel)."""
        tags = {TAG_STATUS: "complete" if self.complete else "partial",
                TAG_LINKED: str(len(self.linked))}
        if not self.complete:
            tags[TAG_MISSING] = _clip(", ".join(self.missing) or "-")
            tags[TAG_ERROR] = _clip(self.error or "-")
        return tags

    def warning(self, model_id: str) -> str:
        """The log line of an incomplete link."""
        return (f"LoggedModel {model_id}: {len(self.missing)} documented metric(s) not linked "
                f"({_clip(', '.join(self.missing))}): {self.error}; registration goes on "
                f"(tag {TAG_STATUS}=partial)")


class VersionModels:
    """The LoggedModel a model version is made from (needs ``self.client``)."""

    client: Any

    def _logged_model_for_key(
        self,
        run_id: str,
        model_path: Path,
        key: str,
        task: str,
        pip_requirements: Sequence[str] | None,
        logged_model_id: str | None = None,
        step: int = 0,
    ) -> str:
        """Model id of a READY LoggedModel of ``run_id`` tagged ``trainforge.idempotency_key`` =
        ``key``, with the files of the Hugging Face folder ``model_path`` in it.

        Found READY: reused as it is (a retry after the upload). Else the files go into
        ``logged_model_id`` (the validated checkpoint's external LoggedModel: its MLmodel stub
        is replaced by the ``transformers`` flavour), else into a PENDING or FAILED one an
        earlier try left for the key, else into a new one, created in the run's experiment with
        the key. It is then READY; the checkpoint's model gets the key last, so a crash before
        that uploads again. A model this call created whose upload fails is deleted; one it found
        stays for the next try (a caller of the same key may be uploading into it at once, and
        both then finish it READY).
        """
        from mlflow.entities import LoggedModelStatus

        with mlflow_errors("get_run", f"run {run_id}"):
            experiment_id = self.client.get_run(run_id).info.experiment_id
        query = (
            f"tags.`{TAG_IDEMPOTENCY_KEY}` = {quote('idempotency_key', key)} "
            f"AND source_run_id = {quote('run_id', run_id)}"
        )
        with mlflow_errors("search_logged_models", f"run {run_id} key {key}"):
            found = sorted(self.client.search_logged_models(
                [experiment_id], filter_string=query, max_results=50),
                key=lambda m: m.creation_timestamp)
        ready = [m for m in found if m.status == LoggedModelStatus.READY]
        created = None
        if ready:
            log.info("reusing logged model %s of run %s for key %s", ready[0].model_id, run_id, key)
            return str(ready[0].model_id)
        if logged_model_id is not None:
            with mlflow_errors("get_logged_model", f"logged model {logged_model_id}"):
                model = self.client.get_logged_model(logged_model_id)
        elif found:
            model = found[0]
            log.info("uploading again into logged model %s (%s) of key %s", model.model_id,
                     model.status, key)
        else:
            with mlflow_errors("create_logged_model", f"run {run_id}"):
                model = self.client.create_logged_model(
                    experiment_id=experiment_id, name="model", source_run_id=run_id,
                    tags={TAG_IDEMPOTENCY_KEY: key})
            created = model.model_id
        for extra in found:
            if extra.model_id != model.model_id:
                self._delete_logged_model(extra.model_id)
        try:
            with mlflow_errors("log_model_artifacts", f"run {run_id} model {model.model_id}"):
                upload_hf_model(self.client, run_id, model, model_path, task,
                                pip_requirements or default_pip_requirements(), step)
                if model.status != LoggedModelStatus.READY:
                    self.client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        except BaseException:
            if model.model_id == created:  # one found may be a concurrent caller's upload
                self._delete_logged_model(model.model_id)
            raise
        if logged_model_id is not None:  # the key last: a crash before it logs the files again
            with mlflow_errors("set_logged_model_tags", f"logged model {model.model_id}"):
                self.client.set_logged_model_tags(model.model_id, {TAG_IDEMPOTENCY_KEY: key})
        return str(model.model_id)

    def _delete_logged_model(self, model_id: str) -> None:
        """Delete a LoggedModel of ours that holds no usable files; a failure is logged."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.delete_logged_model(model_id)
        except MlflowException as err:
            log.warning("could not delete the unfinished logged model %s: %s", model_id, err)


def default_pip_requirements() -> list[str]:
    """Pinned requirements of a logged HF model: the installed versions, without local labels.

    Passed explicitly because mlflow.transformers' own default list adds ``torchvision``
    whenever torch is the engine and fails when torchvision is not installed.
    """
    from importlib.metadata import PackageNotFoundError, version

    pins = []
    for package in _PIN_PACKAGES:
        try:
            pins.append(f"{package}=={version(package).split('+')[0]}")
        except PackageNotFoundError:
            continue
    return pins


def link_metrics(client: Any, run_id: str, model_id: str, links: Sequence[MetricLink],
                 batch_size: int = LINK_BATCH_SIZE) -> LinkReport:
    """Link ``links`` to LoggedModel ``model_id`` of run ``run_id`` (those it does not link yet),
    group by group, in batches of ``batch_size``. Never raises for the server's answer: a refused
    or failed call is in the report; after a quota refusal nothing more is asked."""
    from mlflow.exceptions import MlflowException

    report = LinkReport()
    if not links:
        return report
    try:
        have = {m.key for m in client.get_logged_model(model_id).metrics or []}
        groups: dict[str, list[Any]] = {}
        for link in links:
            if link.key in have:
                report.linked.append(link.key)
            elif (metric := _entity(client, run_id, model_id, link)) is None:
                report.absent.append(link.key)
            else:
                groups.setdefault(link.group, []).append(metric)
    except MlflowException as err:
        report.missing = [link.key for link in links]
        report.error = f"{err.error_code}: {err.message}"
        return report
    refused = False
    for metrics in groups.values():
        for batch in _chunks(metrics, batch_size):
            keys = [m.key for m in batch]
            if refused:
                report.missing += keys
                continue
            try:
                client.log_batch(run_id, metrics=batch)
                report.linked += keys
            except MlflowException as err:
                report.missing += keys
                report.error = f"{err.error_code}: {err.message}"
                refused = err.error_code == QUOTA_ERROR
    return report


def upload_hf_model(client: Any, run_id: str, model: Any, model_path: Path, task: str,
                    pip_requirements: Sequence[str], step: int = 0) -> None:
    """Write the Hugging Face folder ``model_path`` as an MLflow ``transformers`` model into
    LoggedModel ``model`` and record it as an output of run ``run_id`` at ``step``: what
    ``mlflow.transformers.log_model(model_id=...)`` does, less its metric sweep and its status
    changes (the caller finalizes). An external model's ``mlflow.model.isExternal`` tag is
    dropped once its files are in, as MLflow does.

    A folder with `ADAPTER_CONFIG` (an export of ``training.peft.merge: false``) is logged as
    a PEFT model: the adapter and the tokenizer, and ``base_model_path`` = the base's local
    folder its export info names (``load_model`` loads the base from there and applies the
    adapter). Raises `AdapterRegistrationError` before anything is uploaded when this MLflow
    cannot (`adapter_registration_problem`) or the export names no local base folder."""
    import mlflow
    from mlflow.entities import LoggedModelOutput
    from mlflow.models import Model

    with tempfile.TemporaryDirectory(prefix="trainforge-mlmodel-") as tmp:
        local = Path(tmp) / "model"
        mlflow_model = Model(artifact_path=model.artifact_location, model_uuid=model.model_id,
                             run_id=run_id, model_id=model.model_id)
        if (Path(model_path) / ADAPTER_CONFIG).is_file():
            transformers_model, extra = adapter_model(Path(model_path))
        else:
            transformers_model, extra = str(model_path), {}
        mlflow.transformers.save_model(transformers_model=transformers_model, path=str(local),
                                       task=task, mlflow_model=mlflow_model,
                                       pip_requirements=list(pip_requirements), **extra)
        for pycache in list(local.rglob("__pycache__")):  # save_model's load check leaves them
            shutil.rmtree(pycache, ignore_errors=True)
        client.log_model_artifacts(model.model_id, str(local))
    if (model.tags or {}).get(_EXTERNAL, "false").lower() == "true":
        client.delete_logged_model_tag(model.model_id, _EXTERNAL)
    _log_output_once(client, run_id, LoggedModelOutput(model.model_id, step))


def adapter_model(folder: Path, save_model: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(transformers_model, save_model keywords)`` of an adapter-only export: the base (fp32,
    from the local folder its export info names) with the adapter applied as a
    ``peft.PeftModel``, and its tokenizer; ``{"base_model_path": <that folder>}``.

    Raises:
        AdapterRegistrationError: MLflow's ``save_model`` takes no ``base_model_path``, or the
            export names no local base folder (an ``s3://`` base).
    """
    problem = adapter_registration_problem(save_model)
    if problem:
        raise AdapterRegistrationError(problem)
    try:
        base = (json.loads((folder / EXPORT_INFO).read_text(encoding="utf-8")).get("base_model") or {}).get("folder")
    except (OSError, ValueError):
        base = None
    if not base or not (Path(base) / "config.json").is_file():
        raise AdapterRegistrationError(
            f"{folder}: an adapter-only export (training.peft.merge: false) whose {EXPORT_INFO} names no local "
            f"base model folder with config.json (got {base!r}): the registered adapter refers to its base by a "
            f"local folder; use a local or hf:// model.pretrained, or training.peft.merge: true")
    import torch
    from mlflow.transformers.peft import get_model_with_peft_adapter  # peft stays out of trainforge.hooks
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    # What load_model does with the files: PeftModel.from_pretrained(base, adapter folder).
    wrapped = get_model_with_peft_adapter(base_model, str(folder)).eval()
    return {"model": wrapped, "tokenizer": AutoTokenizer.from_pretrained(str(folder))}, {"base_model_path": base}


def _log_output_once(client: Any, run_id: str, output: Any) -> None:
    """Record ``output`` on run ``run_id`` unless it is there already (an earlier try, or a
    concurrent caller of the same key, recorded it; MLflow refuses a second record)."""
    from mlflow.exceptions import MlflowException

    def recorded() -> bool:
        outputs = client.get_run(run_id).outputs
        return any(o.model_id == output.model_id and o.step == output.step
                   for o in (outputs.model_outputs if outputs else []) or [])

    if recorded():
        return
    try:
        client.log_outputs(run_id, [output])
    except MlflowException:
        if not recorded():
            raise


def _entity(client: Any, run_id: str, model_id: str, link: MetricLink) -> Any:
    """The ``Metric`` that links ``link``: the run's own entry where one fits, else new."""
    from mlflow.entities import Metric

    history = client.get_metric_history(run_id, link.key)
    name, digest = link.dataset or (None, None)
    if link.value is None:
        if not history:
            return None
        last = max(history, key=lambda m: (m.step, m.timestamp))
        return Metric(last.key, last.value, last.timestamp, last.step, model_id=model_id,
                      dataset_name=name, dataset_digest=digest)
    same = [m for m in history if m.step == link.step and _equal(m.value, link.value)]
    stamp = same[0].timestamp if same else int(time.time() * 1000)
    return Metric(link.key, float(link.value), stamp, link.step, model_id=model_id,
                  dataset_name=name, dataset_digest=digest)


def _equal(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _chunks(items: list[Any], size: int) -> Iterable[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _clip(text: str) -> str:
    return text if len(text) <= _TAG_TEXT else text[:_TAG_TEXT - 3] + "..."
