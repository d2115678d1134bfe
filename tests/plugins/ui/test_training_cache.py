"""The Training page's MLflow cache (trainforge.plugins.ui.mlflow_cache) through the UI's API:
it never puts a DAG in the answer of a user who may not read it, its entries expire, and a page
load makes a bounded number of MLflow calls, counted against the session's real MLflow server.

Which DAGs a user may read comes from a table here (the Simple auth manager knows only roles);
the cache's clock is one the tests advance.
"""

from __future__ import annotations

import datetime as dt
import time

import pytest

from tests.plugins.ui.airflow_db import TASKS, airflow_metadata, seed_dag, seed_run, token

A, B = "cache_pipe_a", "cache_pipe_b"
ACCESS = {"alice": {A, B}, "bob": {B}}
RUN = "manual__2026-02-01T00:00:00+00:00"


class Clock:
    """time.monotonic's stand-in: seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def api(tmp_path_factory, mlflow_server):
    from airflow.utils.session import create_session
    from fastapi.testclient import TestClient
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server)
    exp = client.create_experiment(f"ui-cache-{time.time_ns()}")
    for dag_id in (A, B):
        run = client.create_run(exp, tags={"trainforge.dag_id": dag_id,
                                           "trainforge.airflow_run_id": RUN,
                                           "trainforge.registered_model": f"{dag_id}-model"})
        client.log_metric(run.info.run_id, "accounting/gpu_hours", 2.0 if dag_id == A else 3.0)
        client.create_registered_model(f"{dag_id}-model")
    with airflow_metadata(tmp_path_factory.mktemp("ui-cache") / "airflow.db"):
        with create_session() as session:
            for dag_id in (A, B):
                seed_dag(session, dag_id)
                seed_run(session, dag_id, RUN,
                         dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1),
                         {t: "success" for t in TASKS})
        from trainforge.plugins.ui.app import app

        with TestClient(app) as test_client:
            yield test_client


@pytest.fixture
def clock(monkeypatch, mlflow_server):
    """A fresh, empty cache on a clock the test advances; each user reads ACCESS's DAGs."""
    from trainforge.plugins.ui import app, mlflow_cache

    now = Clock()
    monkeypatch.setattr(mlflow_cache, "CACHE", mlflow_cache.TtlCache(clock=now))
    monkeypatch.setattr(app, "readable_dag_ids", lambda user: ACCESS[user.get_name()])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    return now


@pytest.fixture
def calls(monkeypatch):
    """The paths of the MLflow calls made, in order (the reader's transport, wrapped)."""
    from trainforge.plugins.ui.mlflow_reader import MlflowReader

    made: list[str] = []
    plain = MlflowReader._call

    def counted(reader, method, path, *args, **kwargs):
        made.append(path.rsplit("/mlflow/", 1)[-1])
        return plain(reader, method, path, *args, **kwargs)

    monkeypatch.setattr(MlflowReader, "_call", counted)
    return made


def _get(api, user: str, path: str) -> dict:
    resp = api.get(path, headers={"Authorization": f"Bearer {token(user, 'viewer')}"})
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert not data["partial"], data["unavailable"]
    return data


def _overview(api, user: str) -> dict:
    return _get(api, user, "/api/training")


def _page(api, user: str) -> dict:
    """What the page fetches: the overview, then the window's totals (returned)."""
    _overview(api, user)
    return _get(api, user, "/api/training/totals")


def _gpu_hours(totals: dict) -> dict[str, float]:
    return {dag_id: t["gpu_hours"] for dag_id, t in totals["last_30d"].items()}


def test_a_cached_dag_is_served_only_to_users_who_may_read_it(api, clock, calls):
    assert _gpu_hours(_page(api, "alice")) == {A: 2.0, B: 3.0}
    assert calls, "alice's first visit asks MLflow"
    calls.clear()
    bob = _overview(api, "bob")
    assert _gpu_hours(_get(api, "bob", "/api/training/totals")) == {B: 3.0}  # A left out
    assert [p["model"] for p in bob["pipelines"]] == [f"{B}-model"]
    assert calls == []


def test_a_dag_missing_from_the_cache_is_searched_alone(api, clock, calls):
    assert _gpu_hours(_page(api, "bob")) == {B: 3.0}
    calls.clear()
    assert _gpu_hours(_get(api, "alice", "/api/training/totals")) == {A: 2.0, B: 3.0}
    assert calls == ["runs/search"]  # A's runs only: B and the experiments are cached


def test_the_overview_holds_no_totals_and_searches_only_since_its_shown_runs(
        api, clock, calls, monkeypatch):
    from trainforge.plugins.ui.mlflow_reader import MlflowReader

    filters: list[str] = []
    plain = MlflowReader.search_runs

    def recorded(reader, filter_string, *args, **kwargs):
        filters.append(filter_string)
        return plain(reader, filter_string, *args, **kwargs)

    monkeypatch.setattr(MlflowReader, "search_runs", recorded)
    data = _overview(api, "alice")
    assert all("last_30d" not in p for p in data["pipelines"])
    [since] = [int(f.split(">= ")[1].split()[0]) for f in filters]
    shown = min(dt.datetime.fromisoformat(r["start_date"]) for p in data["pipelines"]
                for r in p["runs"])
    assert since > (shown - dt.timedelta(minutes=11)).timestamp() * 1000  # not 30 days back
    assert [p["champion"] is None and p["model"] for p in data["pipelines"]] == [
        f"{A}-model", f"{B}-model"]
    calls.clear()
    assert _gpu_hours(_get(api, "alice", "/api/training/totals")) == {A: 2.0, B: 3.0}
    assert calls == ["runs/search"]  # the window's: the overview's entries are narrower


def test_cached_entries_expire_after_the_ttl(api, clock, calls):
    from trainforge.plugins.ui.mlflow_cache import TTL_S

    _page(api, "alice")
    calls.clear()
    clock.now += TTL_S - 0.5
    _page(api, "alice")
    assert calls == []
    clock.now += 1.0
    assert _gpu_hours(_page(api, "alice")) == {A: 2.0, B: 3.0}
    assert sorted(calls) == ["experiments/search", "model-versions/search",
                             "registered-models/search", "runs/search", "runs/search"]


def test_a_page_load_makes_at_most_four_mlflow_calls_and_none_when_cached(api, clock, calls):
    _overview(api, "alice")
    assert len(calls) <= 4, calls  # experiments, one runs search, registry's models, versions
    calls.clear()
    _get(api, "alice", "/api/training/totals")
    assert len(calls) <= 1, calls  # the window's runs search
    calls.clear()
    for user in ("alice", "bob", "alice"):
        _page(api, user)
    assert calls == []


def test_a_failed_mlflow_call_caches_nothing(clock):
    from tests.faults.faultlib import free_port
    from trainforge.plugins.ui import mlflow_cache
    from trainforge.plugins.ui.mlflow_reader import MlflowReader, MlflowUnavailable

    reader = MlflowReader(f"http://127.0.0.1:{free_port()}", timeout_s=2.0)
    with pytest.raises(MlflowUnavailable, match="did not answer"):
        mlflow_cache.window_runs(reader, [A], 0, time.monotonic() + 5.0)
    with pytest.raises(MlflowUnavailable, match="did not answer"):
        mlflow_cache.Registry(reader).result(time.monotonic() + 5.0)
    assert mlflow_cache.CACHE._entries == {}
