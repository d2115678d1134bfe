"""The FastAPI app of the Training, run and Cluster pages (mounted at trainforge.plugins.ui.asgi.URL_PREFIX).

Pages (HTML shells filled by ``static/ui.js``) and their JSON:

* ``GET /training`` and ``GET /api/training``: every pipeline (trainforge.plugins.ui.training),
  then ``GET /api/training/totals``: each pipeline's last 30 days, fetched by the page after;
* ``GET /run?dag_id=&run_id=`` and ``GET /api/runs/{dag_id}/{run_id}``: one DAG run
  (trainforge.plugins.ui.runview; 404 for an unknown run);
* ``GET /cluster`` and ``GET /api/cluster``: the live training jobs (trainforge.plugins.ui.cluster);
* ``GET /api/health``: that the plugin loaded and its pages were built, with the versions.

Every route needs Airflow's signed-in user (401) and reads only DAGs the auth manager lets
that user read (403 for one DAG's data; lists leave the others out); a page refused answers a
readable HTML page, a data route JSON (trainforge.plugins.ui.errors). Routes are plain ``def``:
Starlette runs them in its thread pool, never on the API server's event loop. Nothing is
written; responses carry no secret (no connection, no environment, no trigger settings); a
Content-Security-Policy lets only the same origin frame the pages and allows no script, style
or connection from elsewhere.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version as distribution_version
from typing import Any

from fastapi import FastAPI, HTTPException, Query, Request, status
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from airflow.api_fastapi.common.db.common import SessionDep

from trainforge.plugins.ui import cluster, metadata
from trainforge.plugins.ui import static_files
from trainforge.plugins.ui.access import SignedInUser, readable_dag_ids, require_dag_read
from trainforge.plugins.ui.errors import CSP, http_error
from trainforge.plugins.ui.mlflow_reader import MlflowReader, tracking_uri
from trainforge.plugins.ui.runview import RunNotFound, run_view
from trainforge.plugins.ui.training import overview, window_totals

PAGES = ("training", "run", "cluster")
TITLES = {"training": "Training", "run": "Training run", "cluster": "Cluster"}

app = FastAPI(title="trainforge UI", docs_url=None, redoc_url=None, openapi_url=None,
              exception_handlers={StarletteHTTPException: http_error})


@app.middleware("http")
async def security_headers(request: Request, call_next):
    response = await call_next(request)
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "same-origin"
    if "/api/" in request.url.path:
        response.headers["Cache-Control"] = "no-store"
    return response


def _reader() -> MlflowReader | None:
    uri = tracking_uri()
    return MlflowReader(uri) if uri else None


# -- pages --------------------------------------------------------------------------------------
def _page(name: str) -> HTMLResponse:
    html = (static_files.read_text(static_files.PAGE).replace("{{page}}", name)
            .replace("{{title}}", TITLES[name]))
    return HTMLResponse(html)


@app.get("/training", response_class=HTMLResponse)
def training_page(user: SignedInUser) -> HTMLResponse:
    return _page("training")


@app.get("/run", response_class=HTMLResponse)
def run_page(user: SignedInUser, session: SessionDep, dag_id: str = Query(...),
             run_id: str = Query(...)) -> HTMLResponse:
    require_dag_read(user, dag_id, session)
    return _page("run")


@app.get("/cluster", response_class=HTMLResponse)
def cluster_page(user: SignedInUser) -> HTMLResponse:
    return _page("cluster")


@app.get("/static/{name}")
def static_file(name: str, user: SignedInUser) -> Response:
    if name not in static_files.MEDIA_TYPES:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no static file {name!r}")
    return Response(static_files.read_text(name), media_type=static_files.MEDIA_TYPES[name],
                    headers={"Cache-Control": "private, max-age=300"})


# -- JSON ---------------------------------------------------------------------------------------
@app.get("/api/training")
def training_api(user: SignedInUser, session: SessionDep) -> dict[str, Any]:
    return overview(session, readable_dag_ids(user), _reader())


@app.get("/api/training/totals")
def training_totals_api(user: SignedInUser, session: SessionDep) -> dict[str, Any]:
    return window_totals(session, readable_dag_ids(user), _reader())


@app.get("/api/runs/{dag_id}/{run_id:path}")
def run_api(dag_id: str, run_id: str, user: SignedInUser, session: SessionDep
            ) -> dict[str, Any]:
    require_dag_read(user, dag_id, session)
    try:
        return run_view(session, dag_id, run_id, _reader())
    except RunNotFound as err:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(err)) from err


@app.get("/api/health")
def health_api(user: SignedInUser) -> dict[str, str]:
    """``{"status": "ok", "trainforge": <version>, "airflow": <version>}``: the plugin loaded and
    its pages were built (pages that could not be built answer 503, trainforge.plugins.ui.errors;
    without the plugin Airflow answers its own HTML page here, never this JSON)."""
    from airflow import __version__ as airflow_version

    try:
        version = distribution_version("trainforge")
    except PackageNotFoundError:
        version = "unknown (not installed as a distribution)"
    return {"status": "ok", "trainforge": version, "airflow": airflow_version}


@app.get("/api/cluster")
def cluster_api(user: SignedInUser, session: SessionDep) -> dict[str, Any]:
    dag_ids = metadata.pipeline_ids(session, readable_dag_ids(user))
    jobs, unavailable = cluster.live_jobs(metadata.live_train_tasks(session, dag_ids))
    engines = sorted({j["engine"] for j in jobs if j["engine"]})
    return {"jobs": jobs, "engines": engines, "partial": bool(unavailable),
            "unavailable": [{"source": u["engine"], "error": u["error"]} for u in unavailable]}
