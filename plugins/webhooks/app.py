"""The FastAPI app of the MLflow webhook receiver, mounted by the plugin at `URL_PREFIX`.

MLflow posts registry events to ``<Airflow API server>/trainforge-webhooks/mlflow``
(``python -m trainforge.mlflow_setup webhook`` registers that URL). MLflow cannot send an
Airflow token, so the route is not behind Airflow's auth: the HMAC signature with the secret
of Airflow connection ``trainforge_mlflow_webhook``, checked by the route's dependency
(:class:`SignedDelivery`), is what admits a delivery. Answers:

- 200 ``{"status": "emitted" | "replayed" | "ignored", "detail", "asset"}``: handled
  (trainforge.plugins.webhooks.receiver says which deliveries emit);
- 400: signed, but the body is not an MLflow webhook payload (MLflow does not retry a 4xx);
- 401: not signed with the secret, or outside the time window: nothing is emitted;
- 503: the secret, Airflow's DB or MLflow cannot be reached now: MLflow retries the delivery.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from trainforge.plugins.webhooks.receiver import AssetLedger, DeliveryError, PipelineMoves, handle
from trainforge.plugins.webhooks.signature import (
    DELIVERY_ID_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    SignatureError,
    verify,
)

log = logging.getLogger(__name__)

URL_PREFIX = "/trainforge-webhooks"
ROUTE = "/mlflow"


def _airflow_ledger() -> AssetLedger:
    from trainforge.plugins.webhooks.stores import AirflowAssetLedger

    return AirflowAssetLedger()


def _mlflow_moves() -> PipelineMoves:
    from trainforge.plugins.webhooks.stores import MlflowPipelineMoves

    return MlflowPipelineMoves()


def _connection_secret() -> str:
    from trainforge.plugins.webhooks.stores import webhook_secret

    return webhook_secret()


class SignedDelivery:
    """The route's dependency that admits a delivery: HMAC signature and time window checked
    (trainforge.plugins.webhooks.signature) before the route sees the body.

    Answers 503 when the secret cannot be read (MLflow retries), 401 when the signature or the
    timestamp is refused; otherwise gives the route ``(delivery id, raw body)``."""

    def __init__(self, secret: Callable[[], str], clock: Callable[[], float]) -> None:
        self.secret = secret
        self.clock = clock

    async def __call__(self, request: Request) -> tuple[str | None, bytes]:
        body = await request.body()
        headers = request.headers
        delivery_id = headers.get(DELIVERY_ID_HEADER)
        try:
            key = self.secret()
        except Exception as err:  # noqa: BLE001 - answered 503: MLflow retries
            log.error("MLflow webhook delivery %s not handled: %s", delivery_id, err)
            raise HTTPException(503, "the webhook secret cannot be read") from err
        try:
            verify(key, delivery_id, headers.get(TIMESTAMP_HEADER), body,
                   headers.get(SIGNATURE_HEADER), self.clock())
        except SignatureError as err:
            log.warning("MLflow webhook delivery %s refused: %s", delivery_id, err)
            raise HTTPException(401, f"signature refused: {err}") from err
        return delivery_id, body


def create_app(secret: Callable[[], str] = _connection_secret,
               ledger: Callable[[], AssetLedger] = _airflow_ledger,
               moves: Callable[[], PipelineMoves] = _mlflow_moves,
               clock: Callable[[], float] = time.time) -> FastAPI:
    """The receiver app; its parts are read per delivery (a rotated secret takes effect at
    once). The defaults are the API server's: connection, metadata DB, MLflow."""
    app = FastAPI(title="trainforge MLflow webhooks", docs_url=None, redoc_url=None,
                  openapi_url=None)
    signed = SignedDelivery(secret, clock)

    @app.post(ROUTE)
    # a default, not Annotated: the closure's `signed` cannot be resolved from a string annotation
    async def receive(delivery: tuple = Depends(signed)) -> JSONResponse:  # noqa: B008
        delivery_id, body = delivery
        try:
            payload = json.loads(body)
            if not isinstance(payload, dict):
                raise DeliveryError(f"expected a JSON object, got {type(payload).__name__}")
            outcome = handle(str(delivery_id), payload, ledger(), moves())
        except (json.JSONDecodeError, UnicodeDecodeError, DeliveryError) as err:
            log.warning("MLflow webhook delivery %s is malformed: %s", delivery_id, err)
            return JSONResponse({"detail": f"malformed delivery: {err}"}, status_code=400)
        except Exception as err:  # noqa: BLE001 - answered 503: MLflow retries
            log.exception("MLflow webhook delivery %s failed", delivery_id)
            return JSONResponse({"detail": f"delivery not handled: {err}"}, status_code=503)
        return JSONResponse({"status": outcome.status, "detail": outcome.detail,
                             "asset": outcome.asset})

    return app


app = create_app()
