"""Rank 0's MLflow logging into the DAG run's existing run (never creates, ends or re-statuses it).

Reads ``MLFLOW_TRACKING_URI`` and ``MLFLOW_RUN_ID``; without a tracking URI nothing is logged.
MLflow failures are logged as warnings and never stop training; after
`MAX_CONSECUTIVE_FAILURES` failed calls in a row the tracker gives up for the rest of the attempt.

Each step once: a resumed tracker skips the steps of `STEP_KEY`'s history the run already holds
(:meth:`MlflowTracker.skip_logged_steps`), and one step's metrics go in one ``log_batch`` call.
:meth:`MlflowTracker.system_metrics` logs ``system/*`` metrics (the job's own GPUs only, through
trainforge.trainer.gpu_metrics) every `SYSTEM_METRICS_INTERVAL_S` seconds. HTTP limits:
``MLFLOW_HTTP_REQUEST_TIMEOUT`` 10 s and ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` 2 unless set.

Why, and the details: docs/trainer.md, "MLflow from rank 0".
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from trainforge.trainer.gpus import JobGpus

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_FAILURES = 3
STEP_KEY = "train_loss"
"""The metric logged at every logged step; its history says which steps an attempt logged."""
SYSTEM_METRICS_INTERVAL_S = 10.0
"""Seconds between two ``system/*`` samples (MLflow's own default; its env variable overrides it)."""


class MlflowTracker:
    """Logs params and step metrics into one existing MLflow run via `mlflow.MlflowClient`."""

    def __init__(self, tracking_uri: str, run_id: str) -> None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        import mlflow  # heavy: imported only when tracking is on, and only on rank 0

        self._mlflow = mlflow
        self.client = mlflow.MlflowClient(tracking_uri=tracking_uri)
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self.failures = 0
        self.logged_through = 0
        """Steps up to this one are already in the run's history and are not logged again."""

    @classmethod
    def from_env(cls) -> MlflowTracker | None:
        """A tracker for ``$MLFLOW_RUN_ID`` at ``$MLFLOW_TRACKING_URI``, or None when unset."""
        uri, run_id = os.environ.get("MLFLOW_TRACKING_URI"), os.environ.get("MLFLOW_RUN_ID")
        if not uri:
            log.info("MLFLOW_TRACKING_URI is not set: not logging to MLflow")
            return None
        if not run_id:
            log.warning("MLFLOW_TRACKING_URI is set but MLFLOW_RUN_ID is not: not logging to MLflow")
            return None
        return cls(uri, run_id)

    @property
    def enabled(self) -> bool:
        return self.failures < MAX_CONSECUTIVE_FAILURES

    def _call(self, what: str, fn, *args, **kwargs) -> Any:
        if not self.enabled:
            return None
        try:
            out = fn(*args, **kwargs)
        except Exception as err:  # MlflowException, requests errors, sqlite errors...
            self.failures += 1
            log.warning("MLflow %s for run %s failed (%d in a row): %s", what, self.run_id, self.failures, err)
            if not self.enabled:
                log.warning("MLflow logging disabled for the rest of this attempt")
            return None
        self.failures = 0
        return out

    def log_params(self, params: dict[str, Any]) -> None:
        """Log each param the run does not have yet; an existing key keeps its value.

        MLflow rejects re-logging a param with a different value, and a resumed attempt logs
        the same names again, so existing keys are skipped (with a warning if the value differs).
        """
        run = self._call("get_run", self.client.get_run, self.run_id)
        if run is None:
            return
        existing = run.data.params
        new = []
        for key, value in params.items():
            value = str(value)
            if key not in existing:
                new.append(self._mlflow.entities.Param(key, value))
            elif existing[key] != value:
                log.warning("MLflow param %s is already %r in run %s; keeping it (this attempt: %r)",
                            key, existing[key], self.run_id, value)
        for lo in range(0, len(new), 100):  # log_batch takes at most 100 params per call
            self._call("log_batch(params)", self.client.log_batch, self.run_id, params=new[lo:lo + 100])

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set run tags (mutable, unlike params: the world-size history grows on a resume)."""
        batch = [self._mlflow.entities.RunTag(k, str(v)) for k, v in tags.items()]
        self._call("log_batch(tags)", self.client.log_batch, self.run_id, tags=batch)

    def skip_logged_steps(self, resumed_step: int) -> int:
        """Read which steps the run already holds; later :meth:`log_metrics` calls skip them.

        Args:
            resumed_step: the step training resumes after (0 on a fresh start: nothing is read).
        Returns:
            the newest step already logged (0 when none, or when the history cannot be read —
            then a step may appear twice, and a warning says so).
        """
        if resumed_step <= 0:
            return 0
        history = self._call("get_metric_history", self.client.get_metric_history, self.run_id,
                             STEP_KEY)
        if history is None:
            log.warning("could not read the MLflow history of %s in run %s: steps after %d may "
                        "be logged twice", STEP_KEY, self.run_id, resumed_step)
            return 0
        self.logged_through = max((m.step for m in history), default=0)
        if self.logged_through > resumed_step:
            log.info("MLflow run %s already holds steps up to %d: steps %d..%d are trained again "
                     "but not logged again", self.run_id, self.logged_through, resumed_step + 1,
                     self.logged_through)
        return self.logged_through

    def log_at_start(self, metrics: dict[str, float]) -> None:
        """Log ``metrics`` at step 0, before the first optimizer step (``val/loss_at_start``)."""
        now_ms = int(time.time() * 1000)
        batch = [self._mlflow.entities.Metric(k, float(v), now_ms, 0) for k, v in metrics.items()]
        if batch:
            self._call("log_batch(start metrics)", self.client.log_batch, self.run_id, metrics=batch)

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store ``text`` as the run's artifact ``artifact_file`` (a report; a retry overwrites it)."""
        self._call(f"log_text({artifact_file})", self.client.log_text, self.run_id, text, artifact_file)

    def log_metrics(self, step: int, metrics: dict[str, float], tags: dict[str, str] | None = None
                    ) -> None:
        """Log ``metrics`` at optimizer step ``step`` (once per step) and ``tags`` in one
        log_batch call; a step already logged sends only the tags."""
        batch = []
        if step > self.logged_through:
            now_ms = int(time.time() * 1000)
            batch = [self._mlflow.entities.Metric(k, float(v), now_ms, step) for k, v in metrics.items()]
        tag_batch = [self._mlflow.entities.RunTag(k, str(v)) for k, v in (tags or {}).items()]
        if batch or tag_batch:
            self._call("log_batch(metrics)", self.client.log_batch, self.run_id, metrics=batch,
                       tags=tag_batch)

    @contextmanager
    def system_metrics(self, interval_s: float = SYSTEM_METRICS_INTERVAL_S,
                       gpus: JobGpus | None = None) -> Iterator[None]:
        """Log ``system/*`` metrics into the run every ``interval_s`` seconds while open (module
        doc), of the job's ``gpus`` only (None: no GPU of this machine is the job's). A monitor
        that cannot start or stop is logged as a warning: training goes on."""
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        from trainforge.trainer.gpu_metrics import restrict_gpus

        monitor = self._call("start system metrics", SystemMetricsMonitor, self.run_id,
                             sampling_interval=interval_s, resume_logging=True,
                             tracking_uri=self.tracking_uri)
        if monitor is not None:
            restrict_gpus(monitor, gpus or JobGpus.none())
            monitor.start()
            log.info("logging system metrics of rank 0 into run %s every %ss", self.run_id,
                     monitor.sampling_interval)
        try:
            yield
        finally:
            if monitor is not None:
                self._call("stop system metrics", self._finish_monitor, monitor)

    @staticmethod
    def _finish_monitor(monitor: Any) -> None:
        """Stop the monitor's thread, then log the samples of its last, unfinished interval."""
        monitor.finish()
        last = monitor.aggregate_metrics()
        if last:
            monitor.publish_metrics(last)
            monitor.mlflow_logger.flush()
