"""The receiver's state, where the Airflow API server keeps it: seen deliveries and asset events
in Airflow's metadata DB, the secret in an Airflow connection, pipeline move markers in MLflow.

The receiver runs inside the API server process, which holds a metadata DB session factory: an
event is registered there with Airflow's own ``asset_manager.register_asset_change`` (what
``POST /api/v2/assets/events`` calls) in the same transaction that records the delivery id. The
REST route would need a token minted for some user, and a second transaction for the id.

Seen delivery ids are Airflow Variables ``trainforge.mlflow_webhook.delivery.<id>`` (value: unix
seconds received). The Variable key is unique, so of two concurrent copies of a delivery only one
commits, whichever API server worker gets it. Ids older than twice the signature's time window are
deleted on the next delivery: a copy that old is refused by its timestamp anyway.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from trainforge.hooks.mlflow_registry import TAG_PIPELINE_ALIAS_MOVE
from trainforge.plugins.webhooks.receiver import PIPELINE_MOVE_WINDOW_S
from trainforge.plugins.webhooks.signature import TOLERANCE_S

log = logging.getLogger(__name__)

SECRET_CONN_ID = "trainforge_mlflow_webhook"
"""The Airflow connection whose password is the webhook's secret."""
DELIVERY_PREFIX = "trainforge.mlflow_webhook.delivery."
KEEP_DELIVERIES_S = 2 * TOLERANCE_S


class SecretMissingError(RuntimeError):
    """The webhook secret cannot be read: the message names the connection."""


def webhook_secret(conn_id: str = SECRET_CONN_ID) -> str:
    """The password of Airflow connection ``conn_id`` (env, secrets backend or DB).

    Raises:
        SecretMissingError: no such connection, or it has no password.
    """
    from airflow.models.connection import Connection

    try:
        conn = Connection.get_connection_from_secrets(conn_id)
    except Exception as err:  # noqa: BLE001 - AirflowNotFoundException and backend errors
        raise SecretMissingError(f"Airflow connection {conn_id!r} (the MLflow webhook secret) "
                                 f"cannot be read: {err}") from err
    if not conn.password:
        raise SecretMissingError(f"Airflow connection {conn_id!r} has no password: set it to "
                                 "the secret the MLflow webhook was registered with")
    return conn.password


class AirflowAssetLedger:
    """`~trainforge.plugins.webhooks.receiver.AssetLedger` on Airflow's metadata DB (module doc)."""

    def seen(self, delivery_id: str) -> bool:
        from airflow.models.variable import Variable
        from airflow.utils.session import create_session
        from sqlalchemy import select

        with create_session() as session:
            key = DELIVERY_PREFIX + delivery_id
            return session.scalar(select(Variable.id).where(Variable.key == key)) is not None

    def asset_known(self, asset_name: str) -> bool:
        from airflow.models.asset import AssetActive
        from airflow.utils.session import create_session
        from sqlalchemy import select

        with create_session() as session:
            found = select(AssetActive.name).where(AssetActive.name == asset_name).limit(1)
            return session.scalar(found) is not None

    def record(self, delivery_id: str, asset_name: str | None,
               extra: Mapping[str, Any]) -> bool:
        from airflow.assets.manager import asset_manager
        from airflow.models.asset import AssetModel
        from airflow.models.variable import Variable
        from airflow.utils.session import create_session
        from sqlalchemy import select
        from sqlalchemy.exc import IntegrityError

        now_s = time.time()
        try:
            with create_session() as session:
                self._prune(session, now_s)
                session.add(Variable(key=DELIVERY_PREFIX + delivery_id, val=f"{now_s:.0f}",
                                     description="MLflow webhook delivery seen (trainforge)"))
                session.flush()  # the unique key: a second copy of the delivery stops here
                if asset_name is not None:
                    asset = session.scalar(select(AssetModel).where(
                        AssetModel.name == asset_name, AssetModel.active.has()))
                    if asset is None:
                        raise LookupError(f"Airflow asset {asset_name!r} vanished")
                    asset_manager.register_asset_change(
                        asset=asset, extra=dict(extra), source_is_api=True, api_user_teams=set(),
                        session=session)
        except IntegrityError:
            return False
        return True

    @staticmethod
    def _prune(session: Any, now_s: float) -> None:
        from airflow.models.variable import Variable
        from sqlalchemy import delete, select

        rows = session.execute(select(Variable.key, Variable._val).where(
            Variable.key.startswith(DELIVERY_PREFIX, autoescape=True))).all()
        old = [key for key, value in rows if _seconds(value) < now_s - KEEP_DELIVERIES_S]
        if old:
            session.execute(delete(Variable).where(Variable.key.in_(old)))
            log.info("forgot %d MLflow webhook delivery id(s) older than %.0f s", len(old),
                     KEEP_DELIVERIES_S)


def _seconds(value: str | None) -> float:
    try:
        return float(value or 0)
    except ValueError:
        return 0.0


class MlflowPipelineMoves:
    """`~trainforge.plugins.webhooks.receiver.PipelineMoves` reading the version's tags in MLflow
    (tracking URI: ``$MLFLOW_TRACKING_URI``, as the hook reads it)."""

    def __init__(self, clock=time.time) -> None:
        self.clock = clock

    def claim(self, name: str, version: str, alias: str) -> bool:
        from trainforge.hooks.mlflow import MlflowHook
        from trainforge.hooks.mlflow_calls import mlflow_errors

        client = MlflowHook().client
        key = f"{TAG_PIPELINE_ALIAS_MOVE}.{alias}"
        with mlflow_errors("get_model_version", f"{name} v{version}"):
            tags = client.get_model_version(name, version).tags or {}
        if key not in tags:
            return False
        with mlflow_errors("delete_model_version_tag", f"{name} v{version} tag {key}"):
            client.delete_model_version_tag(name, version, key)
        age_s = self.clock() - _seconds(tags[key])
        log.info("%s v%s: pipeline move marker %s (%.0f s old) consumed", name, version, key, age_s)
        return 0 <= age_s <= PIPELINE_MOVE_WINDOW_S
