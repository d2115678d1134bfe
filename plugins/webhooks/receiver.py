"""What one verified MLflow webhook delivery becomes: an Airflow asset event, or nothing.

An alias set on a model version (``model_version_alias.created``: MLflow sends it for a new
alias and for a moved one) becomes one event of the asset `alias_asset_name` names, so the DAGs
scheduled on it run whoever moved the alias: the pipeline, a person in the MLflow UI, a script.
Nothing is emitted, and the delivery is acknowledged, when

- the delivery id was seen before (MLflow retries a delivery whose answer it did not get, and
  anyone may replay a captured one within the signature's time window): emitted once;
- Airflow has no such asset: no pipeline registers that model and no DAG is scheduled on it
  (logged, so a typo in a model name shows);
- the pipeline moved the alias itself: its ``register_model`` task emits that event through
  its outlet (with the gate's details), and a second one would run the downstream DAGs twice.
  The pipeline marks the version (``trainforge.pipeline_alias_move.<alias>``, unix seconds)
  just before it moves the alias; a marker younger than `PIPELINE_MOVE_WINDOW_S` is consumed
  (deleted) by the delivery it explains, so a later move to the same version by a person
  emits as it should;
- the event is of another kind (registered models, versions, tags, prompts).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from trainforge.hooks.mlflow_registry import CHAMPION

log = logging.getLogger(__name__)

ALIAS_ENTITY, ALIAS_CREATED = "model_version_alias", "created"
PIPELINE_MOVE_WINDOW_S = 600.0
"""How old a pipeline's move marker may be and still explain a delivery, in seconds."""
EMITTED, REPLAYED, IGNORED = "emitted", "replayed", "ignored"


def alias_asset_name(model_name: str, alias: str) -> str:
    """The asset of ``alias`` of a registered model: ``trainforge-model-<name>`` for
    ``champion`` (the asset ``register_model`` emits when its gate moves the champion),
    ``trainforge-model-<name>@<alias>`` for any other alias."""
    base = f"trainforge-model-{model_name}"
    return base if alias == CHAMPION else f"{base}@{alias}"


class DeliveryError(ValueError):
    """A signed delivery whose body is not an MLflow webhook payload: the message says why."""


@dataclass(frozen=True)
class Outcome:
    """What a delivery became: ``status`` (`EMITTED`, `REPLAYED`, `IGNORED`) and why."""

    status: str
    detail: str
    asset: str | None = None


class AssetLedger(Protocol):
    """Where deliveries are remembered and asset events emitted (Airflow's metadata DB)."""

    def seen(self, delivery_id: str) -> bool:
        """Whether ``delivery_id`` was recorded before."""

    def asset_known(self, asset_name: str) -> bool:
        """Whether Airflow has an active asset of that name."""

    def record(self, delivery_id: str, asset_name: str | None,
               extra: Mapping[str, Any]) -> bool:
        """Record ``delivery_id`` and, with an ``asset_name``, emit one event of that asset
        with ``extra``, both or neither; False (nothing done) when the id was recorded before."""


class PipelineMoves(Protocol):
    """The pipeline's own alias moves (marked on the model version in MLflow)."""

    def claim(self, name: str, version: str, alias: str) -> bool:
        """True, consuming the marker, when the pipeline moved ``alias`` to this version
        within `PIPELINE_MOVE_WINDOW_S`."""


def parse(body: Mapping[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """``(entity, action, data)`` of an MLflow webhook payload.

    Raises:
        DeliveryError: a field is missing or of the wrong type.
    """
    entity, action, data = body.get("entity"), body.get("action"), body.get("data")
    if not isinstance(entity, str) or not isinstance(action, str) or not isinstance(data, dict):
        raise DeliveryError(f"expected {{'entity': str, 'action': str, 'data': object}}, got "
                            f"entity {entity!r}, action {action!r}, data {type(data).__name__}")
    return entity, action, data


def handle(delivery_id: str, body: Mapping[str, Any], ledger: AssetLedger,
           moves: PipelineMoves) -> Outcome:
    """Turn one verified delivery into an `Outcome` (module doc).

    Raises:
        DeliveryError: the payload is malformed (an alias event without name, alias, version).
    """
    entity, action, data = parse(body)
    if ledger.seen(delivery_id):
        return Outcome(REPLAYED, f"delivery {delivery_id} was handled before")
    if (entity, action) != (ALIAS_ENTITY, ALIAS_CREATED):
        ledger.record(delivery_id, None, {})
        return Outcome(IGNORED, f"event {entity}.{action} is not an alias change")
    name, alias, version = (data.get(k) for k in ("name", "alias", "version"))
    if not all(isinstance(v, str) and v for v in (name, alias, version)):
        raise DeliveryError(f"alias event data needs name, alias and version strings, got "
                            f"{dict(data)!r}")
    asset = alias_asset_name(name, alias)
    if not ledger.asset_known(asset):
        log.info("MLflow delivery %s: %s@%s -> v%s: Airflow has no asset %s (no pipeline "
                 "registers %s, no DAG is scheduled on it): ignored", delivery_id, name, alias,
                 version, asset, name)
        ledger.record(delivery_id, None, {})
        return Outcome(IGNORED, f"no Airflow asset {asset}: no pipeline knows model {name}")
    if moves.claim(name, version, alias):
        ledger.record(delivery_id, None, {})
        return Outcome(IGNORED, f"the pipeline moved {name}@{alias} to v{version}; its "
                                f"register_model task emits {asset}", asset)
    extra = {"name": name, "version": version, "alias": alias,
             "model_uri": f"models:/{name}/{version}", "source": "mlflow-webhook",
             "delivery_id": delivery_id}
    if not ledger.record(delivery_id, asset, extra):
        return Outcome(REPLAYED, f"delivery {delivery_id} was handled meanwhile")
    log.info("MLflow delivery %s: %s@%s -> v%s: asset event for %s", delivery_id, name, alias,
             version, asset)
    return Outcome(EMITTED, f"{name}@{alias} -> v{version}", asset)
