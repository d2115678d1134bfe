"""What the Training page reads from MLflow, fetched in few calls and kept for a few seconds.

Entries hold MLflow data of one DAG (its runs since the window's start), the registry (every
model's aliases and versions) or the experiment ids: never an answer assembled for a user. The
page asks Airflow on every request which DAGs the user may read and takes only those DAGs'
entries, so a cached entry never puts a DAG in the answer of a user who may not read it. A
failed or late call caches nothing. Every call runs in the UI's threads (pool.POOL) within the
caller's deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from trainforge.plugins.ui.mlflow_reader import MlflowReader
from trainforge.plugins.ui.pool import POOL

TTL_S = 10.0  # longer than the Training page's poll (5 s, static/ui.js POLL_MS): a polling tab hits
TAG_DAG_ID = "trainforge.dag_id"
WINDOW_RUNS_MAX = 10_000


class TtlCache:
    """Values by key, each for ``ttl_s`` seconds of ``clock`` (seconds; tests pass one they
    advance). Thread-safe; expired entries are dropped when met and on every ``put``."""

    def __init__(self, ttl_s: float = TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.clock = ttl_s, clock
        self._entries: dict[Any, tuple[float, Any]] = {}
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any | None:
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and self.clock() - hit[0] >= self.ttl_s:
                del self._entries[key]
                return None
            return hit[1] if hit is not None else None

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            now = self.clock()
            for old in [k for k, (at, _) in self._entries.items() if now - at >= self.ttl_s]:
                del self._entries[old]
            self._entries[key] = (now, value)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


CACHE = TtlCache()


def _within(deadline: float, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)`` in the UI's threads; TimeoutError when it has not answered by
    ``deadline`` (time.monotonic)."""
    return POOL.submit(call, *args).result(timeout=max(0.1, deadline - time.monotonic()))


def _experiment_ids(reader: MlflowReader, deadline: float, cache: TtlCache) -> list[str]:
    key = ("experiments", reader.base_url)
    found = cache.get(key)
    if found is None:
        found = _within(deadline, reader.experiment_ids)
        cache.put(key, found)
    return found


def _start_ms(run: dict[str, Any]) -> int:
    return int(run["info"].get("start_time") or 0)


def window_runs(reader: MlflowReader, dag_ids: list[str], since_ms: int, deadline: float,
                cache: TtlCache | None = None) -> dict[str, list[dict[str, Any]]]:
    """Each DAG's MLflow runs (MlflowReader.search_runs form) started at ``since_ms`` (epoch
    ms) or later, newest first, by DAG id. The DAGs not in the cache are fetched with one search
    (a call per 1,000 runs): of one DAG's runs when only one is missing (a user's first visit
    after another's), else of every run of the window, each DAG's kept for the next request.
    Raises MlflowUnavailable or TimeoutError (at ``deadline``, time.monotonic)."""
    cache = CACHE if cache is None else cache
    out: dict[str, list[dict[str, Any]]] = {}
    missing = []
    for dag_id in dag_ids:
        hit = cache.get(("runs", reader.base_url, dag_id))
        if hit is None or hit[0] > since_ms:
            missing.append(dag_id)
        else:
            out[dag_id] = [r for r in hit[1] if _start_ms(r) >= since_ms]
    if not missing:
        return out
    experiments = _experiment_ids(reader, deadline, cache)
    window = f"attributes.start_time >= {since_ms}"
    if len(missing) == 1:  # its runs only; two or more: one search (tags know no IN, no OR)
        window += f" and tags.`{TAG_DAG_ID}` = '{_quoted(missing[0])}'"
    fetched: dict[str, list[dict[str, Any]]] = {dag_id: [] for dag_id in missing}
    found = _within(deadline, reader.search_runs, window, WINDOW_RUNS_MAX, experiments
                    ) if experiments else []
    for run in found:
        dag_id = run["tags"].get(TAG_DAG_ID)
        if dag_id is not None:
            fetched.setdefault(dag_id, []).append(run)
    for dag_id, runs in fetched.items():  # every DAG the search covered, not only this user's
        key = ("runs", reader.base_url, dag_id)
        if dag_id in missing or (cache.get(key) or (since_ms + 1,))[0] > since_ms:
            cache.put(key, (since_ms, runs))  # never a wider entry replaced by a narrower one
    return out | {dag_id: fetched[dag_id] for dag_id in missing}


def _quoted(value: str) -> str:
    return value.replace("\\", "\\\\").replace("'", "\\'")


class Registry:
    """Every registered model's aliases (name -> alias -> version) and every model version
    (MlflowReader.model_versions form): two calls started in the UI's threads when made (none
    while cached), so that the caller can search runs meanwhile, then :meth:`result`."""

    def __init__(self, reader: MlflowReader, cache: TtlCache | None = None) -> None:
        self._cache = CACHE if cache is None else cache
        self._key = ("registry", reader.base_url)
        self._found = self._cache.get(self._key)
        if self._found is None:
            self._models = POOL.submit(reader.registered_models)
            self._versions = POOL.submit(reader.model_versions)

    def result(self, deadline: float) -> tuple[dict[str, dict[str, str]], list[dict[str, Any]]]:
        """Aliases and versions. Raises MlflowUnavailable or TimeoutError (at ``deadline``,
        time.monotonic)."""
        if self._found is None:
            models = self._models.result(timeout=max(0.1, deadline - time.monotonic()))
            aliases = {m["name"]: {a["alias"]: a["version"] for a in m.get("aliases", [])}
                       for m in models if m.get("name")}
            versions = self._versions.result(timeout=max(0.1, deadline - time.monotonic()))
            self._found = (aliases, versions)
            self._cache.put(self._key, self._found)
        return self._found
