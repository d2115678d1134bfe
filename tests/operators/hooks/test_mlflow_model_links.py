"""A registered version's LoggedModel links the documented metrics only, also under a per-model
metric quota, against a real MLflow server on loopback.

The run holds what a real one does at registration: system, data and training metrics at step
0 and at the checkpoint's step, the ledger's summary, the validation series. ``mlflow.<flavor>
.log_model`` would link every one of them at its step; registration links the validation
metrics and the ledger summary. ``MetricQuotaProxy`` stands where a managed MLflow service
enforces a per-model metric quota.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from trainforge.hooks.mlflow import MlflowHook
from trainforge.hooks.mlflow_model_links import LINK_BATCH_SIZE, TAG_ERROR, TAG_MISSING, TAG_STATUS
from trainforge.pipeline.loader import load_spec
from trainforge.tasks.register_model import documented_metrics

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
VALIDATION = {"val_loss": 2.5, "val_perplexity": 12.18, "val_bits_per_byte": 1.1,
              "unigram_perplexity": 80.0}
LEDGER = {"goodput/percent": 71.5, "energy/kwh": 0.002, "cost/allocated": 0.04}
STEP = 10


class MetricQuotaProxy:
    """A reverse proxy on loopback in front of an MLflow server that enforces a per-LoggedModel
    metric quota as managed MLflow services do: a ``runs/log-batch`` request that would leave
    more than ``limit`` metric names linked to one LoggedModel (those the server already links,
    read from it, and the request's) is answered ``HTTP 400`` with MLflow's error JSON,
    ``RESOURCE_LIMIT_EXCEEDED``, and nothing of it is stored. ``fail_uploads`` artifact uploads
    are answered ``HTTP 400`` too. Everything else is forwarded unchanged. ``refused`` lists
    ``(model id, metric names)`` of each refused request."""

    def __init__(self, upstream: str, limit: int) -> None:
        self.upstream = urlsplit(upstream)
        self.limit = limit
        self.fail_uploads = 0
        self.refused: list[tuple[str, list[str]]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _call(self, method: str, path: str, body: bytes, headers: dict[str, str]):
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers=headers)
            answer = conn.getresponse()
            return answer, answer.read()
        finally:
            conn.close()

    def _linked(self, model_id: str) -> set[str]:
        _, data = self._call("GET", f"/api/2.0/mlflow/logged-models/{model_id}", b"", {})
        return {m["key"] for m in json.loads(data)["model"].get("data", {}).get("metrics", [])}

    def refusal(self, method: str, path: str, body: bytes) -> dict[str, str] | None:
        """MLflow's error JSON for a request over the quota (or a failing upload), else None."""
        if method == "PUT" and "/mlflow-artifacts/artifacts/" in path:
            with self._lock:
                if self.fail_uploads > 0:
                    self.fail_uploads -= 1
                    return {"error_code": "PERMISSION_DENIED", "message": "uploads refused"}
            return None
        if not (method == "POST" and path.endswith("/mlflow/runs/log-batch")):
            return None
        by_model: dict[str, set[str]] = {}
        for metric in json.loads(body or b"{}").get("metrics", []):
            if metric.get("model_id"):
                by_model.setdefault(metric["model_id"], set()).add(metric["key"])
        with self._lock:
            for model_id, keys in by_model.items():
                if len(self._linked(model_id) | keys) > self.limit:
                    self.refused.append((model_id, sorted(keys)))
                    return {"error_code": "RESOURCE_LIMIT_EXCEEDED",
                            "message": f"a logged model may have at most {self.limit} metrics"}
        return None

    def _handler_class(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                refusal = proxy.refusal(self.command, self.path, body)
                if refusal is not None:
                    status, data = 400, json.dumps(refusal).encode()
                    headers = [("Content-Type", "application/json")]
                else:
                    sent = {k: v for k, v in self.headers.items()
                            if k.lower() not in ("connection", "transfer-encoding", "expect")}
                    sent["Content-Length"] = str(len(body))
                    answer, data = proxy._call(self.command, self.path, body, sent)
                    status = answer.status
                    headers = [(k, v) for k, v in answer.getheaders() if k.lower() not in
                               ("connection", "transfer-encoding", "content-length")]
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

        return Handler


@pytest.fixture
def quota_proxy(mlflow_server: str):
    proxy = MetricQuotaProxy(mlflow_server, limit=len(VALIDATION) + 1)
    try:
        yield proxy
    finally:
        proxy.close()


def _busy_run(hook: MlflowHook) -> str:
    """A DAG run's run as registration finds it: 60 system metrics and the ledger summary at
    step 0, training and validation series at the checkpoint's step."""
    suffix = uuid.uuid4().hex[:8]
    run_id = hook.get_or_create_run(f"links-{suffix}", "tiny.dag", f"manual__{suffix}")
    hook.log_metrics(run_id, {f"system/gpu_{i}_utilization_percentage": 50.0 for i in range(60)},
                     step=0)
    hook.log_metrics(run_id, {**LEDGER, "data/tokens_train": 1e6, "badput/other_s": 3.0}, step=0)
    hook.log_metrics(run_id, {"train/loss": 2.4, "train/tps": 9e3}, step=STEP)
    hook.log_metrics(run_id, {f"val/{k}": v for k, v in VALIDATION.items()}, step=STEP)
    return run_id


def _register(hook: MlflowHook, run_id: str, model_dir: Path) -> dict[str, Any]:
    """register_model's calls: the checkpoint's LoggedModel (validate_checkpoint), then the
    version from it with the documented metrics."""
    spec = load_spec(REPO / "tests" / "e2e" / "tiny_shakespeare.yaml")
    dataset = (f"{spec.dag_id}-dataset", "d1g3st")
    model_id = hook.log_checkpoint_model(run_id, f"/ckpt/{run_id}/step-{STEP}", STEP, VALIDATION,
                                         {"step": STEP}, dataset)
    links = documented_metrics(spec, {"digest": "d1g3st"}, {"metrics": VALIDATION, "step": STEP},
                               hook.client.get_run(run_id).data.metrics)
    return hook.register_model_version(run_id, model_dir, f"links-{run_id[:8]}", f"{run_id}:d1g3st",
                                       logged_model_id=model_id, metric_links=links, step=STEP)


def _linked(hook: MlflowHook, model_id: str) -> list[Any]:
    return list(hook.client.get_logged_model(model_id).metrics or [])


def test_the_version_links_exactly_the_validation_metrics_and_the_ledger_summary(
        hook: MlflowHook, tiny_hf_model_dir: Path) -> None:
    run_id = _busy_run(hook)
    result = _register(hook, run_id, tiny_hf_model_dir)

    assert result["status"] == "READY"
    linked = _linked(hook, result["model_id"])
    assert sorted(m.key for m in linked) == sorted([*VALIDATION, *LEDGER])  # each once
    for metric in linked:
        if metric.key in VALIDATION:
            assert (metric.step, metric.value, metric.dataset_digest) == (
                STEP, VALIDATION[metric.key], "d1g3st")
        else:
            assert (metric.step, metric.value) == (0, LEDGER[metric.key])
    assert result["tags"][TAG_STATUS] == "complete"
    # Linking reused the run's own entries: no metric has a second value at one step.
    for key in [*VALIDATION, *LEDGER]:
        assert len(hook.client.get_metric_history(run_id, key)) == 1, key
    assert LINK_BATCH_SIZE <= 1000  # MLflow's limit of metrics per log_batch


def test_a_metric_quota_leaves_the_version_ready_with_the_validation_metrics_and_a_warning(
        mlflow_server: str, quota_proxy: MetricQuotaProxy, tiny_hf_model_dir: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    hook = MlflowHook(tracking_uri=quota_proxy.url)
    run_id = _busy_run(hook)
    with caplog.at_level(logging.WARNING, logger="trainforge.hooks"):
        result = _register(hook, run_id, tiny_hf_model_dir)

    assert result["status"] == "READY" and result["created"] is True
    assert sorted(m.key for m in _linked(hook, result["model_id"])) == sorted(VALIDATION)
    # The ledger's batch went over the quota: refused whole, said, and tagged on the version.
    assert quota_proxy.refused == [(result["model_id"], sorted(LEDGER))]
    assert result["tags"][TAG_STATUS] == "partial"
    assert result["tags"][TAG_MISSING] == ", ".join(sorted(LEDGER))
    assert result["tags"][TAG_ERROR].startswith("RESOURCE_LIMIT_EXCEEDED: ")
    [warning] = [r for r in caplog.records if "not linked" in r.getMessage()]
    assert warning.levelno == logging.WARNING and "RESOURCE_LIMIT_EXCEEDED" in warning.getMessage()

    # The retry reuses the version and its LoggedModel; nothing is left PENDING or FAILED.
    again = _register(hook, run_id, tiny_hf_model_dir)
    assert (again["version"], again["model_id"], again["created"]) == (
        result["version"], result["model_id"], False)
    models = _run_models(hook, run_id)
    assert [str(m.status) for m in models] == ["READY"]


def test_a_failed_upload_leaves_no_unfinished_logged_model(
        quota_proxy: MetricQuotaProxy, tiny_hf_model_dir: Path) -> None:
    hook = MlflowHook(tracking_uri=quota_proxy.url)
    run_id = _busy_run(hook)
    quota_proxy.fail_uploads = 1
    with pytest.raises(Exception, match="uploads refused|PERMISSION_DENIED|400"):
        hook.register_model_version(run_id, tiny_hf_model_dir, f"up-{run_id[:8]}", "k-1")
    assert _run_models(hook, run_id) == []

    result = hook.register_model_version(run_id, tiny_hf_model_dir, f"up-{run_id[:8]}", "k-1")
    assert result["status"] == "READY"
    assert [m.model_id for m in _run_models(hook, run_id)] == [result["model_id"]]
    assert _linked(hook, result["model_id"]) == []  # no metric asked for, none linked


def _run_models(hook: MlflowHook, run_id: str) -> list[Any]:
    experiment_id = hook.client.get_run(run_id).info.experiment_id
    return list(hook.client.search_logged_models(
        [experiment_id], filter_string=f"source_run_id = '{run_id}'", max_results=100))


def test_a_retry_finishes_the_upload_a_crashed_try_left_pending(
        hook: MlflowHook, tiny_hf_model_dir: Path) -> None:
    """A try that recorded the model as the run's output and died before finishing it: the
    retry uploads into the same LoggedModel (recorded once) and finishes it READY."""
    from trainforge.hooks.mlflow_model_links import TAG_IDEMPOTENCY_KEY, upload_hf_model

    run_id = _busy_run(hook)
    experiment_id = hook.client.get_run(run_id).info.experiment_id
    left = hook.client.create_logged_model(experiment_id=experiment_id, name="model",
                                           source_run_id=run_id, tags={TAG_IDEMPOTENCY_KEY: "k-9"})
    upload_hf_model(hook.client, run_id, left, tiny_hf_model_dir, "text-generation", [])

    result = hook.register_model_version(run_id, tiny_hf_model_dir, f"re-{run_id[:8]}", "k-9")
    assert (result["status"], result["model_id"]) == ("READY", left.model_id)
    assert [(m.model_id, str(m.status)) for m in _run_models(hook, run_id)] == [
        (left.model_id, "READY")]
    outputs = hook.client.get_run(run_id).outputs.model_outputs
    assert [o.model_id for o in outputs].count(left.model_id) == 1
