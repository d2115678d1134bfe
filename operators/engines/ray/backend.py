"""The ``ray`` engine: torchrun as the entrypoint of a job on a Ray cluster's job API.

The request is :func:`trainforge.engines.ray.render.render_request`; the job config travels inside
it and the result comes back through the job's log, so the cluster needs no file system shared
with the Airflow worker. Ray's ``JobStatus`` maps onto :class:`~trainforge.engines.base.JobState`
(PENDING past the startup deadline fails transient and requests a stop; FAILED is permanent for
a ``bad_config`` or ``diverged`` result): the table is in docs/ray.md, "What happens".

``ray`` is imported inside the methods that talk to the cluster: parsing a DAG never imports it.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

from trainforge.contract import FailureKind, failure_kind
from trainforge.engines import root_cause as who_failed
from trainforge.engines.base import (
    Backend,
    JobHandle,
    JobIdentity,
    JobState,
    JobStatus,
    LogChunk,
    TrainingJob,
    whole_lines,
)
from trainforge.engines.ray.client import connection_settings, timeout_client_class
from trainforge.engines.ray.node_loss import describe
from trainforge.engines.ray.render import parse_result, render_request
from trainforge.errors import BackendError, JobNotFoundError
from trainforge.trainer.causes import cause_of, newest

log = logging.getLogger(__name__)

_RESUBMIT = re.compile(r"-r(\d+)$")
_MAX_RESUBMITS = 100



RAY_PHASES: dict[str, float | str] = {
    "queue_wait": "unknown: Ray's job API reports when a job was submitted and ended, not when "
                  "it left PENDING",
    "image_pull": "unknown: Ray's job API does not report how long the runtime environment or "
                  "image took to set up"}
"""The ledger's engine buckets of a Ray job: neither is reported."""

class RayBackend(Backend):
    """Jobs on a Ray cluster through its job submission API (the dashboard's HTTP port).

    Args:
        address: the dashboard address, e.g. ``http://127.0.0.1:8265`` (``training.ray.address``).
        conn_id: an Airflow connection whose host and port give the dashboard address instead
            (type ``http`` or ``https``; its password, if any, is sent as a Ray token
            ``Authorization: Bearer`` header; extras ``headers`` (dict) and ``verify`` (bool or
            CA bundle path) are passed to the client).
        request_timeout_s: timeout of each HTTP call to the job API, seconds.

    Ray's own rule applies: ``RAY_API_SERVER_ADDRESS`` or ``RAY_ADDRESS`` in the environment of
    the process that submits override the address (a warning is logged when they differ).
    """

    engine = "ray"

    def __init__(self, address: str = "http://127.0.0.1:8265", conn_id: str | None = None,
                 request_timeout_s: float = 30.0):
        self.address = address.rstrip("/")
        self.conn_id = conn_id
        self.request_timeout_s = float(request_timeout_s)
        self._client_obj = None
        self._resolved: tuple[str, dict[str, str], bool | str] | None = None

    # -- pure -------------------------------------------------------------------------------
    def render(self, job: TrainingJob) -> dict[str, Any]:
        """The request :meth:`submit` sends (:func:`~trainforge.engines.ray.render.render_request`).

        Raises:
            BackendError: the job config is too large for an environment variable.
        """
        return render_request(job, self.address, self.conn_id)

    # -- remote calls -----------------------------------------------------------------------
    def submit(self, job: TrainingJob) -> JobHandle:
        """Submit the job, or return the job this identity already has.

        An earlier submission of the same identity that is pending, running or succeeded is
        returned as it is (adopted; a succeeded one is not run again); after a failed or stopped
        one, the job is submitted again as ``<key>-r<N>`` (the trainer resumes from the newest
        valid checkpoint). A submit call that errored on our side but created the job on the
        cluster counts as created.

        Raises:
            BackendError: the job API cannot be reached or refused the job.
        """
        request = self.render(job)["submit_job"]
        if job.secret_env:  # the values go into the job API call only, never into render()
            runtime_env = request["runtime_env"]
            request = {**request, "runtime_env": {
                **runtime_env, "env_vars": {**runtime_env["env_vars"], **job.secret_env}}}
        client = self._client()
        key = job.identity.key
        latest = self._latest(client, key)
        if latest is not None:
            sid, info = latest
            state = str(info.status)
            deadline = self._handle_from_info(job.identity, sid, info)["startup_deadline_epoch_s"]
            if state == "PENDING" and deadline is not None and time.time() > deadline:
                self._stop_quietly(client, sid)  # failed by its startup timeout: never adopted
                state = "PENDING past its startup deadline"
            elif state in ("PENDING", "RUNNING", "SUCCEEDED"):
                log.info("Ray job %s already exists (%s); adopting it instead of submitting again",
                         sid, state)
                return self._handle_from_info(job.identity, sid, info)
            attempt = _attempt(sid) + 1
            request = {**request, "submission_id": f"{key}-r{attempt}",
                       "metadata": {**request["metadata"], "trainforge.attempt": str(attempt)}}
            log.info("Ray job %s ended %s; submitting it again as %s (resumes from the newest "
                     "valid checkpoint)", sid, state, request["submission_id"])
        sid = request["submission_id"]
        submitted_at = time.time()
        try:
            client.submit_job(**request)
        except Exception as err:  # noqa: BLE001 - the SDK raises RuntimeError, requests errors, ...
            info = self._info_or_none(client, sid)
            if info is None:
                raise BackendError(
                    f"the Ray job API at {self._resolve()[0]} refused job {sid}: "
                    f"{_first_line(str(err))}"
                ) from err
            log.warning("Submitting Ray job %s raised %s, but the cluster has it: counting it as "
                        "submitted", sid, _first_line(str(err)))
            return self._handle_from_info(job.identity, sid, info)
        log.info("Submitted Ray job %s to %s (%s nodes x %s ranks; %s)", sid,
                 self._resolve()[0], job.nodes, job.processes_per_node,
                 request["metadata"]["trainforge.resources"])
        deadline = (submitted_at + job.startup_timeout_s
                    if job.startup_timeout_s is not None else None)
        return self._handle(job.identity, sid, submitted_at, deadline)

    def find(self, identity: JobIdentity) -> JobHandle | None:
        """The handle of this identity's latest submission (``<key>`` or ``<key>-r<N>``)."""
        client = self._client()
        latest = self._latest(client, identity.key)
        if latest is None:
            return None
        return self._handle_from_info(identity, *latest)

    def status(self, handle: JobHandle) -> JobStatus:
        """Observe the job once (see the module's state mapping table).

        A job still PENDING after its startup deadline is stopped and reported FAILED with the
        reason Ray gives.

        Raises:
            JobNotFoundError: the cluster does not know the job (e.g. the cluster was replaced).
            BackendError: the job API cannot be reached.
        """
        client = self._client()
        sid = handle["submission_id"]
        info = self._call(client.get_job_info, sid)
        state = str(info.status)
        deadline = handle.get("startup_deadline_epoch_s")
        late = deadline is not None and time.time() > float(deadline)
        if state == "PENDING":
            if late:
                log.warning("Ray job %s still PENDING after its startup deadline: stopping it", sid)
                self._stop_quietly(client, sid)
                return JobStatus(JobState.FAILED, _startup_message(sid, handle, info), None,
                                 FailureKind.TRANSIENT)
            return JobStatus(JobState.PENDING, info.message or "pending")
        if state == "RUNNING":
            return JobStatus(JobState.RUNNING, info.message or "running")
        wall_s = None
        if info.start_time and info.end_time:
            wall_s = round((info.end_time - info.start_time) / 1000.0, 3)
        if state == "STOPPED":
            return JobStatus(JobState.CANCELLED, f"Ray job {sid} was stopped", None, None, None,
                             wall_s)
        result = self._result(client, sid, info)
        if state == "SUCCEEDED":
            message = (result or {}).get("message") or "training finished"
            return JobStatus(JobState.SUCCEEDED, message, 0, None, result, wall_s,
                             info.end_time / 1000.0 if info.end_time else None, RAY_PHASES)
        # FAILED
        exit_code = (result or {}).get("exit_code", info.driver_exit_code)
        kind = failure_kind(exit_code, result)
        reason = (result or {}).get("message") or _first_line(info.message or "")
        loss = (result or {}).get("disruption")
        records = (result or {}).get("rank_records")  # every node's, brought back by the launcher
        if records is not None:
            result = {k: v for k, v in result.items() if k != "rank_records"}
        if isinstance(loss, dict) and loss.get("node"):  # the lost node (node_loss.py)
            said = describe(loss)
            reason = said if reason == said else f"{said}; the trainer said: {reason}"
        elif isinstance(records, list):  # the rank that started it, not rank 0's view of it
            reason, result = who_failed.tell(cause_of(newest(records)), reason, result)
        error_type = getattr(info.error_type, "value", info.error_type)
        message = f"Ray job {sid} failed ({error_type or 'FAILED'}, exit code {exit_code}): {reason}"
        return JobStatus(JobState.FAILED, message, exit_code, kind, result, wall_s)

    def read_logs(self, handle: JobHandle, offset: int, max_bytes: int = 65_536) -> LogChunk:
        """Whole log lines after byte ``offset`` of the job's log (at most ``max_bytes``).

        Ray's job API returns the whole log on every call (``get_job_logs``); the offset selects
        what is new. Raises :class:`BackendError` when the job API cannot be reached.
        """
        client = self._client()
        text = self._call(client.get_job_logs, handle["submission_id"]) or ""
        data = text.encode("utf-8")[offset: offset + max_bytes]
        return whole_lines(data, offset, max_bytes)

    def cancel(self, handle: JobHandle, grace_s: float = 30.0) -> JobStatus:
        """Stop the job and wait until Ray reports it terminal.

        ``stop_job`` makes Ray send SIGTERM to the entrypoint and all its descendants, and
        SIGKILL after ``RAY_JOB_STOP_WAIT_TIME_S`` (3 s by default, a setting of the cluster). If
        the job is not terminal after ``grace_s``, a second stop is sent and the wait repeats
        once. Idempotent: a job already ended is left as it is.

        A job still PENDING (its entrypoint never started) cannot be ended through the job API:
        the stop request waits in Ray's queue and stops the job the moment it is scheduled
        (Ray fails it by itself after ``RAY_JOB_START_TIMEOUT_SECONDS``, 15 min by default).
        Such a job is reported CANCELLED with that explanation.

        Raises:
            BackendError: a started job is still not terminal after both waits, or the API
                fails.
        """
        client = self._client()
        sid = handle["submission_id"]
        info = self._call(client.get_job_info, sid)
        if info.status.is_terminal():
            return self.status(handle)
        log.info("Stopping Ray job %s (%s)", sid, info.status)
        waited = 0.0
        for round_ in (1, 2):
            self._call(client.stop_job, sid)
            started = time.monotonic()
            never_started = str(info.status) == "PENDING" and info.driver_node_id is None
            wait_s = min(grace_s, 5.0) if never_started else (
                grace_s if round_ == 1 else max(grace_s, 10.0))
            final = self._wait_terminal(client, sid, wait_s)
            waited += time.monotonic() - started
            if final is not None:
                return self.status(handle)
            info = self._call(client.get_job_info, sid)
            if str(info.status) == "PENDING" and info.driver_node_id is None:
                message = (f"Ray job {sid} never started; the stop request is queued: Ray stops "
                           f"it the moment it is scheduled, or fails it after its start "
                           f"timeout (RAY_JOB_START_TIMEOUT_SECONDS)")
                log.info("%s", message)
                return JobStatus(JobState.CANCELLED, message)
            log.warning("Ray job %s still %s %.0f s after a stop request; sending another", sid,
                        info.status, waited)
        raise BackendError(
            f"Ray job {sid} is still {info.status} {waited:.0f} s after two stop requests; "
            f"check the cluster (ray job status {sid})"
        )

    # -- helpers ----------------------------------------------------------------------------
    def _handle(self, identity: JobIdentity, sid: str, submitted_at: float | None,
                deadline: float | None) -> JobHandle:
        return {"engine": self.engine, "key": identity.key, "submission_id": sid,
                "identity": identity.to_dict(), "address": self._resolve()[0],
                "submitted_at_epoch_s": submitted_at, "startup_deadline_epoch_s": deadline}

    def _handle_from_info(self, identity: JobIdentity, sid: str, info: Any) -> JobHandle:
        submitted_at = info.start_time / 1000.0 if info.start_time else None
        timeout = (info.metadata or {}).get("trainforge.startup_timeout_s")
        deadline = None
        if submitted_at is not None and timeout is not None:
            deadline = submitted_at + float(timeout)
        return self._handle(identity, sid, submitted_at, deadline)

    def _latest(self, client: Any, key: str) -> tuple[str, Any] | None:
        """``(submission_id, JobDetails)`` of the newest submission of ``key``, or None."""
        info = self._info_or_none(client, key)
        if info is None:
            return None
        latest = (key, info)
        for attempt in range(2, _MAX_RESUBMITS + 1):
            sid = f"{key}-r{attempt}"
            info = self._info_or_none(client, sid)
            if info is None:
                break
            latest = (sid, info)
        return latest

    def _info_or_none(self, client: Any, sid: str) -> Any:
        try:
            return self._call(client.get_job_info, sid)
        except JobNotFoundError:
            return None

    def _result(self, client: Any, sid: str, info: Any) -> dict[str, Any] | None:
        """The trainer's result from the job's result line (the failure message carries the last
        log lines; otherwise the log is read)."""
        found = parse_result(info.message or "")
        if found is None:
            found = parse_result(self._call(client.get_job_logs, sid) or "")
        return found

    def _stop_quietly(self, client: Any, sid: str) -> None:
        try:
            self._call(client.stop_job, sid)
        except BackendError as err:
            log.warning("Could not stop Ray job %s: %s", sid, err)

    def _wait_terminal(self, client: Any, sid: str, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            info = self._call(client.get_job_info, sid)
            if info.status.is_terminal():
                return info
            if time.monotonic() > deadline:
                return None
            time.sleep(0.5)

    def _call(self, fn: Any, *args: Any) -> Any:
        """Call the SDK; map its errors to :class:`JobNotFoundError` / :class:`BackendError`."""
        try:
            return fn(*args)
        except RuntimeError as err:
            text = str(err)
            if "status code 404" in text or "does not exist" in text:
                raise JobNotFoundError(
                    f"Ray job {args[0] if args else ''} not found on {self._resolve()[0]}"
                ) from err
            raise BackendError(f"Ray job API at {self._resolve()[0]}: {_first_line(text)}") from err
        except OSError as err:  # requests' ConnectionError and Timeout are OSErrors
            raise BackendError(
                f"Ray job API at {self._resolve()[0]} did not answer "
                f"(timeout {self.request_timeout_s:.0f} s): {err}"
            ) from err

    def _resolve(self) -> tuple[str, dict[str, str], bool | str]:
        """(address, headers, verify): from the Airflow connection when one is named."""
        if self._resolved is None:
            self._resolved = (self.address, {}, True)
            if self.conn_id:
                self._resolved = connection_settings(self.conn_id)
        return self._resolved

    def _client(self) -> Any:
        if self._client_obj is not None:
            return self._client_obj
        address, headers, verify = self._resolve()
        for name in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
            value = os.environ.get(name)
            if value and value.rstrip("/") != address:
                log.warning("%s=%s is set: Ray's client uses it instead of %s", name, value,
                            address)
                break
        client_cls = timeout_client_class()
        try:
            self._client_obj = client_cls(address, headers=headers or None, verify=verify,
                                          timeout_s=self.request_timeout_s)
        except Exception as err:  # noqa: BLE001 - ConnectionError, RuntimeError, ValueError
            raise BackendError(
                f"cannot reach the Ray job API at {address}: {_first_line(str(err))} (is the "
                f"cluster up and its dashboard reachable? see docs/ray.md)"
            ) from err
        return self._client_obj


def _startup_message(sid: str, handle: JobHandle, info: Any) -> str:
    """Why a job failed to start: Ray's PENDING message and the resources it asked for."""
    waited = ""
    if handle.get("submitted_at_epoch_s") and handle.get("startup_deadline_epoch_s"):
        waited = (f" within the startup timeout "
                  f"({handle['startup_deadline_epoch_s'] - handle['submitted_at_epoch_s']:.0f} s)")
    wanted = (info.metadata or {}).get("trainforge.resources")
    return (f"Ray job {sid} did not start{waited}; Ray says: "
            f"{_first_line(info.message or 'pending')}"
            + (f" (requested {wanted})" if wanted else "")
            + "; a stop request is queued, so it ends the moment Ray schedules it")


def _attempt(sid: str) -> int:
    match = _RESUBMIT.search(sid)
    return int(match[1]) if match else 1


def _first_line(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0][:500] if text else ""
