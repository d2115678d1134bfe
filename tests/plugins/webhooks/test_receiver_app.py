"""The webhook receiver in process (FastAPI TestClient): signatures, replays, unknown models.

The ledger and the pipeline's move markers are in-memory fakes of the Airflow DB and MLflow
stores (trainforge.plugins.webhooks.stores); tests/e2e/test_registry_webhook.py runs the real ones.
Deliveries are signed with MLflow's own signing function, so a change of MLflow's scheme fails
here.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
from fastapi.testclient import TestClient
from mlflow.webhooks.delivery import _generate_hmac_signature

from trainforge.plugins.webhooks.app import ROUTE, create_app
from trainforge.plugins.webhooks.receiver import alias_asset_name

SECRET = "s3cret-for-tests"
MODEL = "tiny-llm"


class FakeLedger:
    def __init__(self, assets: set[str]) -> None:
        self.assets = assets
        self.deliveries: set[str] = set()
        self.events: list[tuple[str, dict]] = []

    def seen(self, delivery_id: str) -> bool:
        return delivery_id in self.deliveries

    def asset_known(self, asset_name: str) -> bool:
        return asset_name in self.assets

    def record(self, delivery_id, asset_name, extra) -> bool:
        if delivery_id in self.deliveries:
            return False
        self.deliveries.add(delivery_id)
        if asset_name is not None:
            self.events.append((asset_name, dict(extra)))
        return True


class FakeMoves:
    def __init__(self) -> None:
        self.markers: set[tuple[str, str, str]] = set()

    def claim(self, name, version, alias) -> bool:
        if (name, version, alias) in self.markers:
            self.markers.discard((name, version, alias))
            return True
        return False


@pytest.fixture
def receiver():
    ledger = FakeLedger({alias_asset_name(MODEL, "champion")})
    moves = FakeMoves()
    client = TestClient(create_app(secret=lambda: SECRET, ledger=lambda: ledger,
                                   moves=lambda: moves))
    return client, ledger, moves


def alias_body(name: str = MODEL, alias: str = "champion", version: str = "3") -> str:
    return json.dumps({"entity": "model_version_alias", "action": "created",
                       "timestamp": "2026-01-01T00:00:00+00:00",
                       "data": {"name": name, "alias": alias, "version": version}})


def post(client, body: str, secret: str = SECRET, delivery_id: str | None = None,
         timestamp: str | None = None):
    delivery_id = delivery_id or str(uuid.uuid4())
    timestamp = timestamp or str(int(time.time()))
    headers = {"Content-Type": "application/json", "X-MLflow-Delivery-Id": delivery_id,
               "X-MLflow-Timestamp": timestamp,
               "X-MLflow-Signature": _generate_hmac_signature(secret, delivery_id, timestamp,
                                                              body)}
    return client.post(ROUTE, content=body.encode(), headers=headers)


def test_good_signature_emits_the_alias_asset_event(receiver):
    client, ledger, _ = receiver
    answer = post(client, alias_body(version="7"), delivery_id="d-1")
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "emitted"
    assert ledger.events == [("trainforge-model-tiny-llm", {
        "name": MODEL, "version": "7", "alias": "champion", "model_uri": "models:/tiny-llm/7",
        "source": "mlflow-webhook", "delivery_id": "d-1"})]


@pytest.mark.parametrize("case", ["wrong secret", "body changed", "no signature", "too old"])
def test_bad_signature_is_401_and_emits_nothing(receiver, case):
    client, ledger, _ = receiver
    body = alias_body()
    if case == "wrong secret":
        answer = post(client, body, secret="guessed")
    elif case == "too old":
        answer = post(client, body, timestamp=str(int(time.time()) - 3600))
    else:
        delivery_id, timestamp = str(uuid.uuid4()), str(int(time.time()))
        headers = {"X-MLflow-Delivery-Id": delivery_id, "X-MLflow-Timestamp": timestamp}
        if case == "body changed":
            headers["X-MLflow-Signature"] = _generate_hmac_signature(SECRET, delivery_id,
                                                                     timestamp, body)
            body = alias_body(version="999")
        answer = client.post(ROUTE, content=body.encode(), headers=headers)
    assert answer.status_code == 401, answer.text
    assert "signature refused" in answer.json()["detail"]
    assert ledger.events == [] and ledger.deliveries == set()


def test_a_replayed_delivery_is_emitted_once(receiver):
    client, ledger, _ = receiver
    body = alias_body()
    statuses = [post(client, body, delivery_id="same").json()["status"] for _ in range(3)]
    assert statuses == ["emitted", "replayed", "replayed"]
    assert len(ledger.events) == 1
    assert post(client, body).json()["status"] == "emitted"  # a new move: a new delivery id
    assert len(ledger.events) == 2


def test_unknown_model_is_acknowledged_and_ignored_with_a_log_line(receiver, caplog):
    client, ledger, _ = receiver
    with caplog.at_level("INFO", logger="trainforge.plugins.webhooks.receiver"):
        answer = post(client, alias_body(name="nobody-knows"))
    assert answer.status_code == 200
    assert answer.json()["status"] == "ignored"
    assert ledger.events == []
    assert "no Airflow asset trainforge-model-nobody-knows" in answer.json()["detail"]
    assert "Airflow has no asset trainforge-model-nobody-knows" in caplog.text


def test_the_pipelines_own_move_is_left_to_its_outlet_once(receiver):
    client, ledger, moves = receiver
    moves.markers.add((MODEL, "3", "champion"))
    assert post(client, alias_body(version="3")).json()["status"] == "ignored"
    assert post(client, alias_body(version="3")).json()["status"] == "emitted"  # a person, later
    assert len(ledger.events) == 1


@pytest.mark.parametrize("body, fragment", [
    ("not json", "malformed delivery"),
    (json.dumps([1]), "expected a JSON object"),
    (json.dumps({"entity": "model_version_alias", "action": "created", "data": {"name": "x"}}),
     "needs name, alias and version"),
])
def test_a_signed_malformed_body_is_400(receiver, body, fragment):
    client, ledger, _ = receiver
    answer = post(client, body)
    assert answer.status_code == 400 and fragment in answer.json()["detail"]
    assert ledger.events == []


def test_other_events_and_missing_secret(receiver):
    client, ledger, _ = receiver
    other = json.dumps({"entity": "model_version", "action": "created",
                        "data": {"name": MODEL, "version": "1"}})
    assert post(client, other).json()["status"] == "ignored"
    def no_secret() -> str:
        raise RuntimeError("connection trainforge_mlflow_webhook not found")
    broken = TestClient(create_app(secret=no_secret, ledger=lambda: ledger, moves=FakeMoves))
    assert post(broken, alias_body()).status_code == 503
    assert ledger.events == []
