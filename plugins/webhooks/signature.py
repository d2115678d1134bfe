"""Verifying an MLflow webhook delivery: HMAC-SHA256 over ``<delivery id>.<timestamp>.<body>``.

MLflow signs each delivery (``mlflow.webhooks.delivery``, Standard Webhooks conventions) with the
webhook's secret and sends ``X-MLflow-Signature: v1,<base64 HMAC>``, ``X-MLflow-Timestamp``
(unix seconds) and ``X-MLflow-Delivery-Id`` (a UUID). A delivery is accepted only when the
signature matches and the timestamp lies within `TOLERANCE_S` of now: an older delivery,
replayed by whoever captured it, is refused however it is signed.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

SIGNATURE_HEADER = "X-MLflow-Signature"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
DELIVERY_ID_HEADER = "X-MLflow-Delivery-Id"
SIGNATURE_VERSION = "v1"
TOLERANCE_S = 300.0
"""How far a delivery's timestamp may lie from now, in seconds (Standard Webhooks' 5 minutes)."""


class SignatureError(ValueError):
    """A delivery that is not proven to come from MLflow: the message says why."""


def sign(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    """``v1,<base64 HMAC-SHA256>`` of one delivery, as MLflow computes it."""
    content = f"{delivery_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret.encode(), content, hashlib.sha256).digest()
    return f"{SIGNATURE_VERSION},{base64.b64encode(digest).decode()}"


def verify(secret: str, delivery_id: str | None, timestamp: str | None, body: bytes,
           signature: str | None, now_s: float, tolerance_s: float = TOLERANCE_S) -> None:
    """Accept one delivery or raise.

    Args:
        secret: the webhook's secret (never logged).
        delivery_id, timestamp, signature: the three ``X-MLflow-*`` headers as received.
        body: the raw request body (the signature covers its exact bytes).
        now_s: the receiver's clock, unix seconds.

    Raises:
        SignatureError: a header is missing, the timestamp is not a number or lies more than
            ``tolerance_s`` seconds from ``now_s``, or the signature does not match.
    """
    missing = [name for name, value in ((DELIVERY_ID_HEADER, delivery_id),
                                        (TIMESTAMP_HEADER, timestamp),
                                        (SIGNATURE_HEADER, signature)) if not value]
    if missing:
        raise SignatureError(f"missing header(s) {', '.join(missing)}")
    try:
        sent_s = float(timestamp)  # type: ignore[arg-type]
    except ValueError:
        raise SignatureError(f"{TIMESTAMP_HEADER} {timestamp!r} is not unix seconds") from None
    if abs(now_s - sent_s) > tolerance_s:
        raise SignatureError(f"{TIMESTAMP_HEADER} {timestamp} is {now_s - sent_s:.0f} s from "
                             f"now; accepted: within {tolerance_s:.0f} s")
    expected = sign(secret, delivery_id, timestamp, body)  # type: ignore[arg-type]
    if not hmac.compare_digest(expected.encode(), signature.encode()):  # type: ignore[union-attr]
        raise SignatureError(f"{SIGNATURE_HEADER} does not match the body signed with the secret")
