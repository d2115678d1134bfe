"""Read-only calls to the MLflow server's REST API, each bounded by a timeout.

The UI talks to MLflow over plain HTTP rather than through the ``mlflow`` client: one request
per call, no client-side retries, a timeout in seconds, and nothing imported that the API
server does not already have. Any failure is an :class:`MlflowUnavailable` naming the call.

Tracking URI: ``$MLFLOW_TRACKING_URI`` (what the tasks' hook uses), else the host of the Airflow
connection :data:`MLFLOW_CONN_ID` (trainforge.hooks.mlflow_calls.tracking_uri_from_connection).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

MLFLOW_CONN_ID = "mlflow_default"
SEARCH_PAGE = 1000  # MLflow's largest page of runs.search
MAX_PAGES = 10


class MlflowUnavailable(Exception):
    """The MLflow server did not answer a call (down, slow, or an error status)."""


def tracking_uri() -> str | None:
    """The MLflow server's base URL, without credentials, or None when none is configured."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        from trainforge.hooks.errors import MlflowConfigError
        from trainforge.hooks.mlflow_calls import tracking_uri_from_connection

        try:
            uri = tracking_uri_from_connection(MLFLOW_CONN_ID)
        except MlflowConfigError:
            return None
    parsed = urllib.parse.urlsplit(uri)
    if parsed.scheme not in ("http", "https"):
        return None
    host = parsed.hostname or ""
    netloc = f"{host}:{parsed.port}" if parsed.port else host  # never userinfo
    return urllib.parse.urlunsplit((parsed.scheme, netloc, parsed.path.rstrip("/"), "", ""))


class MlflowReader:
    """The few MLflow REST calls the pages need.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:5000``.
        timeout_s: the limit of each HTTP request, seconds.
    """

    def __init__(self, base_url: str, timeout_s: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    # -- transport ------------------------------------------------------------------------------
    def _call(self, method: str, path: str, params: dict[str, Any] | None = None,
              body: dict[str, Any] | None = None) -> dict[str, Any]:
        url = f"{self.base_url}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as err:
            if err.code == 404:
                return {}
            raise MlflowUnavailable(f"MLflow {path} answered HTTP {err.code}") from err
        except (OSError, ValueError) as err:  # refused, timed out, not JSON
            raise MlflowUnavailable(f"MLflow at {self.base_url} did not answer {path} within "
                                    f"{self.timeout_s:g} s: {err}") from err

    # -- runs -------------------------------------------------------------------------------------
    def experiment_ids(self) -> list[str]:
        out = self._call("POST", "/api/2.0/mlflow/experiments/search",
                         body={"max_results": 1000})
        return [e["experiment_id"] for e in out.get("experiments", [])]

    def search_runs(self, filter_string: str, max_runs: int = SEARCH_PAGE,
                    experiment_ids: list[str] | None = None) -> list[dict[str, Any]]:
        """Runs matching ``filter_string`` in ``experiment_ids`` (None: every experiment, one
        call more), newest first, as ``{"info", "tags", "params", "metrics": {key: latest
        value}, "metric_steps", "metric_times"}``: a call per 1,000 runs."""
        experiments = self.experiment_ids() if experiment_ids is None else experiment_ids
        if not experiments:
            return []
        runs: list[dict[str, Any]] = []
        token = None
        for _ in range(MAX_PAGES):
            body = {"experiment_ids": experiments, "filter": filter_string,
                    "max_results": min(SEARCH_PAGE, max_runs - len(runs)),
                    "order_by": ["attributes.start_time DESC"], "run_view_type": "ACTIVE_ONLY"}
            if token:
                body["page_token"] = token
            out = self._call("POST", "/api/2.0/mlflow/runs/search", body=body)
            runs += [_flat_run(r) for r in out.get("runs", [])]
            token = out.get("next_page_token")
            if not token or len(runs) >= max_runs:
                break
        return runs

    def metric_history(self, run_id: str, key: str) -> list[dict[str, Any]]:
        out = self._call("GET", "/api/2.0/mlflow/metrics/get-history",
                         params={"run_id": run_id, "metric_key": key, "max_results": 25000})
        return sorted(({"step": int(m.get("step", 0)), "value": m.get("value"),
                        "timestamp": m.get("timestamp")} for m in out.get("metrics", [])),
                      key=lambda m: (m["step"], m["timestamp"] or 0))

    def artifact_json(self, run_id: str, path: str) -> Any:
        """A JSON artifact of a run through the server's artifact proxy, or None when absent."""
        url_params = {"path": path, "run_uuid": run_id}
        return self._call("GET", "/get-artifact", params=url_params) or None

    # -- registry ---------------------------------------------------------------------------------
    def registered_model(self, name: str) -> dict[str, Any]:
        out = self._call("GET", "/api/2.0/mlflow/registered-models/get", params={"name": name})
        return out.get("registered_model") or {}

    def registered_models(self, max_results: int = 1000) -> list[dict[str, Any]]:
        """Every registered model with its aliases (one call)."""
        out = self._call("GET", "/api/2.0/mlflow/registered-models/search",
                         params={"max_results": max_results})
        return out.get("registered_models", [])

    def model_versions(self, name: str | None = None, max_results: int = 10_000
                       ) -> list[dict[str, Any]]:
        """The versions of one registered model, or of all of them (one call), by version."""
        params: dict[str, Any] = {"max_results": max_results}
        if name is not None:
            params["filter"] = "name='{}'".format(name.replace("'", "\\'"))
        out = self._call("GET", "/api/2.0/mlflow/model-versions/search", params=params)
        versions = []
        for v in out.get("model_versions", []):
            versions.append({**v, "tags": {t["key"]: t.get("value") for t in v.get("tags", [])}})
        return sorted(versions, key=lambda v: int(v.get("version", 0)))

    # -- links ------------------------------------------------------------------------------------
    def run_url(self, experiment_id: str, run_id: str) -> str:
        return f"{self.base_url}/#/experiments/{experiment_id}/runs/{run_id}"

    def version_url(self, name: str, version: str) -> str:
        return f"{self.base_url}/#/models/{urllib.parse.quote(name)}/versions/{version}"


def _flat_run(run: dict[str, Any]) -> dict[str, Any]:
    data = run.get("data") or {}
    metrics = data.get("metrics", [])
    return {"info": run.get("info") or {},
            "tags": {t["key"]: t.get("value") for t in data.get("tags", [])},
            "params": {p["key"]: p.get("value") for p in data.get("params", [])},
            "metrics": {m["key"]: m.get("value") for m in metrics},
            "metric_steps": {m["key"]: int(m.get("step", 0)) for m in metrics},
            "metric_times": {m["key"]: m.get("timestamp") for m in metrics}}
