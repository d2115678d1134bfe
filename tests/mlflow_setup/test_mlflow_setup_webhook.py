"""trainforge.mlflow_setup.webhook against the session's real MLflow server (SQL store)."""

from __future__ import annotations

import pytest

from trainforge.mlflow_setup.errors import MlflowSetupError
from trainforge.mlflow_setup.webhook import ALIAS_EVENT, WEBHOOK_NAME, register_webhook

pytestmark = pytest.mark.integration


def test_registering_twice_updates_the_one_webhook(mlflow_server: str) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server, mlflow_server)
    first = register_webhook(mlflow_server, "http://127.0.0.1:9/first", "secret-1")
    try:
        again = register_webhook(mlflow_server, "http://127.0.0.1:9/second", "secret-2")
        assert again == first
        hooks = [h for h in client.list_webhooks() if h.name == WEBHOOK_NAME]
        assert len(hooks) == 1 and hooks[0].url == "http://127.0.0.1:9/second"
        assert [str(e) for e in hooks[0].events] == [ALIAS_EVENT]
    finally:  # later tests of the session move aliases: nothing should be posted to port 9
        client.delete_webhook(first)


@pytest.mark.parametrize("url, secret, fragment", [
    ("http://127.0.0.1:9/x", "", "the secret is empty"),
    ("ftp://127.0.0.1/x", "s", "scheme"),
])
def test_refusals_name_the_webhook_and_the_cause(mlflow_server, url, secret, fragment) -> None:
    with pytest.raises(MlflowSetupError, match=fragment) as err:
        register_webhook(mlflow_server, url, secret)
    assert WEBHOOK_NAME in str(err.value) and url in str(err.value)
