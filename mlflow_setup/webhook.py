"""Register the MLflow webhook that tells Airflow about alias changes, idempotently.

    python -m trainforge.mlflow_setup webhook --tracking-uri http://127.0.0.1:5000 \
        --url http://airflow-api:8080/trainforge-webhooks/mlflow --secret-env WEBHOOK_SECRET

One webhook named `WEBHOOK_NAME` on ``model_version_alias.created``: created when missing,
else updated to the given URL, secret and event (a rotated secret takes effect at once). The
secret is read from an environment variable, never from the command line (visible to every
local user), and must equal the password of the Airflow connection the receiver reads
(``trainforge_mlflow_webhook``). The MLflow server delivers only to schemes listed in its
``MLFLOW_WEBHOOK_ALLOWED_SCHEMES`` and, unless ``MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS`` is true, only
to public addresses (the server `trainforge.mlflow_setup.server` starts allows ``http`` and
private addresses: it lives next to Airflow on loopback or inside one cluster).
"""

from __future__ import annotations

import logging

from trainforge.mlflow_setup.errors import MlflowSetupError

log = logging.getLogger(__name__)

WEBHOOK_NAME = "trainforge-airflow-assets"
ALIAS_EVENT = "model_version_alias.created"


class WebhookSetupError(MlflowSetupError):
    """The webhook could not be listed, created or updated."""

    def __init__(self, tracking_uri: str, url: str, cause: str) -> None:
        super().__init__(f"could not register webhook {WEBHOOK_NAME!r} -> {url} on "
                         f"{tracking_uri}: {cause}")


def register_webhook(tracking_uri: str, url: str, secret: str) -> str:
    """Create or update the webhook; its id.

    Raises:
        WebhookSetupError: an empty secret, or the server refused a call (e.g. a URL scheme it
            does not allow, a file store that has no webhooks).
    """
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    if not secret:
        raise WebhookSetupError(tracking_uri, url, "the secret is empty")
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    try:
        existing = [hook for hook in client.list_webhooks(max_results=1000)
                    if hook.name == WEBHOOK_NAME]
        if existing:
            hook = client.update_webhook(existing[0].webhook_id, url=url, events=[ALIAS_EVENT],
                                         secret=secret, status="ACTIVE")
            log.info("updated MLflow webhook %s (%s) -> %s", WEBHOOK_NAME, hook.webhook_id, url)
        else:
            hook = client.create_webhook(
                WEBHOOK_NAME, url, [ALIAS_EVENT], secret=secret,
                description="alias changes -> Airflow asset events (trainforge)")
            log.info("created MLflow webhook %s (%s) -> %s", WEBHOOK_NAME, hook.webhook_id, url)
    except MlflowException as err:
        raise WebhookSetupError(tracking_uri, url, err.message) from err
    return str(hook.webhook_id)
