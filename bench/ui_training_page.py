"""The Training page's API, 50 pipelines x 100 runs, against the same listing via Airflow's REST API.

    .venv/bin/python bench/ui_training_page.py [--pipelines 50] [--runs 100] [--repeat 5]

Generates, in a temporary folder, an Airflow metadata database (SQLite; DAGs tagged
``trainforge``, one daily run each for the last ``--runs`` days, five task instances and the
validate/register results per run) and an MLflow store holding each run's MLflow run (params,
curves' last values, accounting) and one registered model per pipeline with a version per ten
runs; then starts an MLflow server on it. It times, in this process through FastAPI's TestClient:

* ``GET /trainforge/api/training`` (trainforge.plugins.ui.app), "the page": pipelines, their last
  5 runs, live training, the champion and trend; cold (the MLflow cache,
  trainforge.plugins.ui.mlflow_cache, emptied before each call: a first visit) and warm
  (within the cache's few seconds: the page's own 5 s poll, or a second user);
* ``GET /trainforge/api/training/totals``, the last 30 days' figures from MLflow that the page
  fetches right after: after a cold overview (a first visit's second call) and warm;
* the same listing through Airflow's REST API (its ``core`` FastAPI app): ``GET /api/v2/dags``
  with ``tags=trainforge``, then the newest 5 runs of each DAG (``GET /api/v2/dags/~/dagRuns``
  with ``dag_id_pattern``: the bench's DAGs are not serialized, so ``/dags/{dag_id}/dagRuns``
  would answer 404) — the Airflow half only, since Airflow's API knows nothing of MLflow.

Prints the median of ``--repeat`` calls of each, the MLflow calls a page load makes, the ratios
page / REST, and whether the Training page's overview meets its goal of at most 1 s, cold and
warm (the exit status follows the cold figure).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.plugins.ui.airflow_db: the metadata fixture the API tests use

GOAL_S = 1.0
TASKS = ("prepare_data", "train", "validate_checkpoint", "register_model", "close_run")


def seed_airflow(pipelines: int, runs: int) -> list[tuple[str, str]]:
    from airflow.utils.session import create_session

    from tests.plugins.ui.airflow_db import seed_dag, seed_run

    today = dt.datetime.now(dt.timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    made = []
    with create_session() as session:
        for p in range(pipelines):
            dag_id = f"bench_pipeline_{p:02d}"
            seed_dag(session, dag_id)
            for r in range(runs):
                start = today - dt.timedelta(days=runs - r)
                run_id = f"scheduled__{start.isoformat()}"
                seed_run(session, dag_id, run_id, start, {t: "success" for t in TASKS}, {
                    "validate_checkpoint": {"checkpoint": f"/ck/{dag_id}/{r}/step_100",
                                            "step": 100, "metrics": {"val_loss": 3 - r / runs}},
                    "register_model": {"name": f"bench-model-{p:02d}", "version": str(r // 10 + 1),
                                       "aliases": ["challenger"], "gate": {"decision": "pass"}}})
                made.append((dag_id, run_id, start))
    return made


def seed_mlflow(store_uri: str, artifacts: str, made) -> None:
    """Straight into the server's store (its SQLAlchemy store): thousands of runs in seconds."""
    from mlflow.entities import Metric, Param, RunStatus, RunTag
    from mlflow.store.model_registry.sqlalchemy_store import SqlAlchemyStore as Registry
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store, registry = SqlAlchemyStore(store_uri, artifacts), Registry(store_uri)
    exp = store.create_experiment("bench-ui")
    models = set()
    for i, (dag_id, run_id, start) in enumerate(made):
        ms = int(start.timestamp() * 1000)
        model = f"bench-model-{dag_id[-2:]}"
        run = store.create_run(exp, "bench", ms, [RunTag("trainforge.dag_id", dag_id),
                                                  RunTag("trainforge.airflow_run_id", run_id),
                                                  RunTag("trainforge.registered_model", model)],
                               run_id[:40])
        rid = run.info.run_id
        metrics = {"train_loss": 2.5, "learning_rate": 1e-4, "tokens_per_s": 5e4,
                   "accounting/gpu_hours": 8.0, "accounting/cost": 20.0,
                   "accounting/energy_kwh": 5.6, "accounting/wall_s": 3600.0,
                   "goodput/percent": 90.0, "badput/checkpoint_save_s": 60.0}
        store.log_batch(rid, [Metric(k, v, ms + 3_600_000, 100) for k, v in metrics.items()],
                        [Param("optim.max_steps", "100")], [])
        store.update_run_info(rid, RunStatus.FINISHED, ms + 3_700_000, None)
        if model not in models:
            registry.create_registered_model(model)
            models.add(model)
        if i % 10 == 9:
            version = registry.create_model_version(model, f"{run.info.artifact_uri}/model", rid)
            registry.set_model_version_tag(model, version.version, _tag("trainforge.gate.metric",
                                                                        "val_loss"))
            registry.set_model_version_tag(model, version.version, _tag(
                "trainforge.gate.candidate_value", str(3 - (i % 100) / 100)))
            registry.set_registered_model_alias(model, "champion", version.version)


def _tag(key: str, value: str):
    from mlflow.entities.model_registry import ModelVersionTag

    return ModelVersionTag(key, value)


def timed(call, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - started)
    return statistics.median(times), out


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--pipelines", type=int, default=50)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="trainforge-bench-ui-") as tmp:
        tmp = Path(tmp)
        os.environ.setdefault("AIRFLOW_HOME", str(tmp / "airflow"))
        from fastapi.testclient import TestClient

        from tests.plugins.ui.airflow_db import airflow_metadata, token
        from trainforge.mlflow_setup import start_server

        with airflow_metadata(tmp / "airflow.db"):
            t0 = time.perf_counter()
            made = seed_airflow(args.pipelines, args.runs)
            print(f"Airflow metadata generated in {time.perf_counter() - t0:.1f} s", flush=True)
            store_uri = f"sqlite:///{tmp / 'mlflow' / 'mlflow.db'}"
            (tmp / "mlflow").mkdir()
            seed_mlflow(store_uri, str(tmp / "mlflow" / "artifacts"), made)
            print(f"generated {args.pipelines} pipelines x {args.runs} runs in "
                  f"{time.perf_counter() - t0:.1f} s")
            with start_server(tmp / "mlflow", port=0, timeout_s=180.0,
                              backend_store_uri=store_uri) as mlflow:
                os.environ["MLFLOW_TRACKING_URI"] = mlflow.url
                from airflow.api_fastapi.app import create_app

                from trainforge.plugins.ui.app import app as ui

                headers = {"Authorization": f"Bearer {token('admin', 'admin')}"}
                ours = TestClient(ui)
                airflow = TestClient(create_app("core"))

                from trainforge.plugins.ui import mlflow_cache
                from trainforge.plugins.ui.mlflow_reader import MlflowReader

                calls = []
                plain_call = MlflowReader._call

                def counted(reader, method, path, *args, **kwargs):
                    calls.append(path)
                    return plain_call(reader, method, path, *args, **kwargs)

                MlflowReader._call = counted

                def training_page():
                    resp = ours.get("/api/training", headers=headers)
                    resp.raise_for_status()
                    return resp.json()

                def cold_page():
                    mlflow_cache.CACHE.clear()
                    return training_page()

                def totals():
                    resp = ours.get("/api/training/totals", headers=headers)
                    resp.raise_for_status()
                    return resp.json()

                def totals_after_cold_page():
                    cold_page()
                    started = time.perf_counter()
                    out = totals()
                    return time.perf_counter() - started, out

                def through_airflow_rest():
                    dags = airflow.get("/api/v2/dags", params={"tags": "trainforge",
                                                               "limit": 100}, headers=headers)
                    dags.raise_for_status()
                    out = {}
                    for d in dags.json()["dags"]:
                        runs = airflow.get("/api/v2/dags/~/dagRuns", params={
                            "dag_id_pattern": d["dag_id"], "order_by": "-run_after",
                            "limit": 5}, headers=headers)
                        runs.raise_for_status()
                        out[d["dag_id"]] = runs.json()["dag_runs"]
                    return out

                cold_page()  # warm imports and connection pools, not the cache
                calls.clear()
                cold_page()
                cold_calls = len(calls)
                calls.clear()
                training_page()
                warm_calls = len(calls)
                cold_s, page = timed(cold_page, args.repeat)
                training_page()
                warm_s, _ = timed(training_page, args.repeat)
                calls.clear()
                totals_after_cold_page()
                totals_calls = len(calls) - cold_calls
                after_cold = [totals_after_cold_page() for _ in range(args.repeat)]
                totals_cold_s = statistics.median(t for t, _ in after_cold)
                totals_data = after_cold[-1][1]
                totals_warm_s, _ = timed(totals, args.repeat)
                rest_s, rest = timed(through_airflow_rest, args.repeat)
    assert len(page["pipelines"]) == args.pipelines and not page["partial"], page["unavailable"]
    assert len(totals_data["last_30d"]) == args.pipelines and not totals_data["partial"]
    assert len(rest) == args.pipelines and all(len(r) == min(5, args.runs) for r in rest.values())
    print(f"Training page API, cold: {cold_s * 1000:7.0f} ms (median of {args.repeat}; "
          f"{args.pipelines} pipelines, last 5 runs each, champion and trend; "
          f"{cold_calls} MLflow calls)")
    print(f"Training page API, warm: {warm_s * 1000:7.0f} ms (within the cache's "
          f"{mlflow_cache.TTL_S:g} s; {warm_calls} MLflow calls)")
    print(f"30-day totals (fetched after), after a cold page: {totals_cold_s * 1000:7.0f} ms "
          f"(MLflow figures of {sum(t['runs'] for t in totals_data['last_30d'].values())} "
          f"runs; {totals_calls} MLflow calls), warm: {totals_warm_s * 1000:7.0f} ms")
    print(f"Airflow REST (1 + {args.pipelines} calls): {rest_s * 1000:7.0f} ms "
          f"(DAGs and last 5 runs only)")
    print(f"ratio Training page / Airflow REST: cold {cold_s / rest_s:.2f}, "
          f"warm {warm_s / rest_s:.2f}")
    for name, took in (("cold", cold_s), ("warm", warm_s)):
        print(f"goal <= {GOAL_S:.0f} s, the page (overview) {name}: {'met' if took <= GOAL_S else 'NOT met'}")
    return 0 if cold_s <= GOAL_S else 1


if __name__ == "__main__":
    sys.exit(main())
