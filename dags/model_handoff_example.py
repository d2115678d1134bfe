"""Example downstream DAG: the serving team's side of the hand-off, one per pipeline spec.

When a pipeline's eval gate moves the ``champion`` alias, its ``register_model`` task emits an
event for ``Asset("trainforge-model-<registered model name>")`` with extra ``{"name", "version",
"alias": "champion", "model_uri", "previous_champion"}``; a person's move reaches the same asset
through the MLflow webhook. The DAG ``<pipeline>_model_handoff`` below is built by
``trainforge.handoff.handoff_dag``: it re-reads ``champion`` from MLflow (tracking URI from
``MLFLOW_TRACKING_URI``), loads that version and runs a short greedy generation from the
pipeline's sample prompt (a smoke test a deployment step would follow), once per move, one run
at a time, and requeues itself when events came after its own so none is left unconsumed
(docs/registry.md, "Consumers of the champion asset").

Parsing this file reads the specs (like ``trainforge_pipelines.py``) and imports no MLflow, no
torch; a spec that does not load is skipped here (``trainforge_pipelines.py`` reports it).
Airflow's DAG processor (safe mode) reads only files that name "airflow" and "dag": this does.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from trainforge.dag_builder import spec_files
from trainforge.handoff import handoff_dag
from trainforge.pipeline.loader import SpecError, load_spec

log = logging.getLogger("trainforge.handoff")


def smoke_generate(model_name: str, prompt: str, max_new_tokens: int = 20,
                   event_version: str | None = None,
                   version: str | None = None) -> dict[str, Any]:
    """Load ``version`` of ``model_name`` (default: the one ``champion`` points at now) and
    generate greedily from ``prompt``.

    Returns ``{"model_uri", "version", "event_version", "prompt", "text"}``; without
    ``version``, it is the version ``champion`` points at now (it may have moved since the event).

    Raises:
        RuntimeError: the generation is empty (the model does not work).
        mlflow.exceptions.MlflowException: no champion, or the model cannot be loaded.
    """
    import mlflow
    import mlflow.transformers

    if version is None:
        version = mlflow.MlflowClient().get_model_version_by_alias(model_name, "champion").version
    uri = f"models:/{model_name}/{version}"
    generator = mlflow.transformers.load_model(uri)
    text = generator(prompt, max_new_tokens=max_new_tokens, do_sample=False)[0]["generated_text"]
    if len(text) <= len(prompt):
        raise RuntimeError(f"{uri} (v{version}) generated nothing after {prompt!r}")
    if event_version is not None and str(event_version) != str(version):
        log.warning("the event announced v%s, champion is now v%s: smoke-tested v%s",
                    event_version, version, version)
    return {"model_uri": uri, "version": str(version), "event_version": event_version,
            "prompt": prompt, "text": text}


def build_handoff_dag(dag_id: str, model_name: str, prompt: str):
    """The example DAG for one registered model: smoke-test each new champion (module doc)."""

    def smoke(name: str, version: str) -> dict[str, Any]:
        result = smoke_generate(name, prompt, version=version)
        log.info("%s: %r", result["model_uri"], result["text"])
        return result

    return handoff_dag(dag_id, model_name, smoke,
                       description=f"Smoke-test {model_name}@champion whenever it moves",
                       tags=("trainforge", "example", "handoff"))


def _build_all() -> dict[str, Any]:
    sources = os.environ.get("TRAINFORGE_PIPELINES")
    paths = sources.split(os.pathsep) if sources else [Path(__file__).parent / "pipelines"]
    dags: dict[str, Any] = {}
    for path in spec_files(paths):
        try:
            spec = load_spec(path)
        except (SpecError, OSError):
            continue  # reported by trainforge_pipelines.py
        dag_id = f"{spec.dag_id}_model_handoff"
        dags[dag_id] = build_handoff_dag(dag_id, spec.registry.model_name,
                                         spec.validation.sample_prompt)
    return dags


globals().update(_build_all())
