"""The Ray engine's development cluster for ``trainforge run``, where no head has to start: a
job API that already answers (a small HTTP server on loopback playing its job listing) is used,
and a spec that names an Airflow connection keeps it."""

from __future__ import annotations

import contextlib
import http.server
import threading

import pytest

from trainforge.engines.descriptors import get_engine
from trainforge.pipeline.spec import TrainingSection

BASE = {"optimization": {"max_steps": 2, "global_batch_size": 2, "micro_batch_size": 1,
                         "learning_rate": 1e-3},
        "checkpoint": {"interval_steps": 1}, "resources": {"processes_per_node": 1},
        "engine": "ray"}


class _JobList(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/api/jobs/" else 404)
        self.end_headers()
        self.wfile.write(b"[]")

    def log_message(self, *args):
        pass


@pytest.fixture
def job_api():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _JobList)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_an_answering_job_api_is_used(job_api, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    training = TrainingSection.model_validate({**BASE, "ray": {"address": job_api + "/"}})
    said: list[str] = []
    with contextlib.ExitStack() as stack:
        values = get_engine("ray").dev_cluster_starter()(training, stack, said.append, {})
    assert values == {"address": job_api}
    assert said == [f"Ray cluster: {job_api}"]


def test_a_spec_with_a_connection_keeps_it():
    training = TrainingSection.model_validate({**BASE, "ray": {"connection_id": "ray_prod"}})
    with contextlib.ExitStack() as stack:
        assert get_engine("ray").dev_cluster_starter()(training, stack, print, {}) is None


def test_several_nodes_are_refused_rather_than_started_as_one_local_head(monkeypatch, free_addr):
    from trainforge.errors import BackendError

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    training = TrainingSection.model_validate(
        {**BASE, "resources": {"nodes": 2, "processes_per_node": 1}, "ray": {"address": free_addr}})
    with contextlib.ExitStack() as stack, pytest.raises(BackendError, match="is one Ray node"):
        get_engine("ray").dev_cluster_starter()(training, stack, print, {})


@pytest.fixture
def free_addr() -> str:
    """A job API address where nothing answers."""
    from trainforge.engines.ray.head import free_port

    return f"http://127.0.0.1:{free_port()}"
