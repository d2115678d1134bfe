"""The ``slurm`` engine: an ``sbatch`` script that runs torchrun on every allocated node.

The Airflow worker is a Slurm submit node: this backend calls Slurm's own commands (``sbatch``,
``squeue``, ``sacct``, ``scancel``) with a timeout each. Every job has a folder on a file system
shared with the compute nodes, ``<runs_root>/<identity key>/``:

======================  ========================================================================
``job.sbatch``          the batch script (``script.render_script``)
``job.json``            the trainer's job config (docs/contracts.md)
``request.json``        argv, identity, startup timeout, min_nodes and excluded nodes (sbatch)
``slurm_job.json``      Slurm's job id and the submission time, written after sbatch answers
``job.log``             the batch script's output (``--output``), the first node's torchrun
``ranks/``              every rank's output (torchrun ``--log-dir``), other nodes' consoles
``result.json``         written by trainer rank 0
``exit.json``           written by the script when srun ends: its exit code
``cancel.json``         written by :meth:`SlurmBackend.cancel` before it signals the job
``start_failure.json``  why a job that could not start was cancelled (startup timeout, ...)
``node_loss.json``      the node a failed job lost and when (``node_loss``), decided once
======================  ========================================================================

The outcome comes from ``squeue`` while the controller knows the job, then ``sacct`` (with
slurmdbd), then the folder's ``exit.json``: a cluster without accounting is fully supported.
States map through :data:`~trainforge.engines.slurm.script.STATES` and ``NEVER_RUNS``; what is
permanent and what transient: docs/slurm.md, "What happens".
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from trainforge.contract import FailureKind, failure_kind
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
from trainforge.engines import host_oom, root_cause as who_failed
from trainforge.engines.jobfiles import read_json
from trainforge.storage.files import atomic_write_json
from trainforge.engines.slurm.client import (
    SACCT_WINDOW,
    SlurmCommands,
    epoch,
    last_error,
    slurm_phases,
)
from trainforge.engines.slurm.node_loss import (
    describe,
    elastic_node_loss,
    job_node_loss,
    lost_by_earlier_tries,
)
from trainforge.engines.slurm.script import (
    LOG_NAME,
    NEVER_RUNS,
    SCRIPT_NAME,
    STATES,
    reason_text,
    render_script,
)
from trainforge.errors import BackendError, JobNotFoundError

log = logging.getLogger(__name__)

# Files of an earlier, never-submitted attempt that must not leak into a new submission.
_STALE = ("exit.json", "result.json", "cancel.json", "slurm_job.json", "start_failure.json",
          "node_loss.json")
START_FAILURE = "start_failure.json"  # why we cancelled a job that could not start


class SlurmBackend(Backend):
    """Jobs on a Slurm cluster through its command-line tools on this (submit) node.

    Args:
        runs_root: folder on the shared file system holding one folder per job; the same path
            on this machine and on the compute nodes.
        bin_dir: folder of the Slurm commands; default: looked up on ``PATH``.
        command_timeout_s: timeout of each Slurm command, seconds.

    ``SLURM_CONF`` in the environment selects the cluster, as for any Slurm command.
    """

    engine = "slurm"

    def __init__(self, runs_root: str | os.PathLike, bin_dir: str | None = None,
                 command_timeout_s: float = 30.0):
        self.runs_root = Path(runs_root).absolute()
        self._slurm = SlurmCommands(bin_dir, command_timeout_s)

    # -- pure -------------------------------------------------------------------------------
    def job_dir(self, identity: JobIdentity) -> Path:
        return self.runs_root / identity.key

    def render(self, job: TrainingJob, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
        """``{"engine", "job_dir", "argv", "script", "config", "identity"}``: ``argv`` is the
        sbatch command, ``script`` the batch script it submits (``job_dir/job.sbatch``, kept
        off the ``exclude`` nodes) and ``config`` the ``job.json`` written next to it. Pure."""
        job_dir = self.job_dir(job.identity)
        return {
            "engine": self.engine,
            "job_dir": str(job_dir),
            "argv": ["sbatch", "--parsable", str(job_dir / SCRIPT_NAME)],
            "script": render_script(job, job_dir, exclude),
            "config": job.config,
            "identity": job.identity.to_dict(),
        }

    # -- remote calls -----------------------------------------------------------------------
    def submit(self, job: TrainingJob) -> JobHandle:
        """Write the job folder and ``sbatch`` the script, or return this identity's job.

        A job Slurm already has under this identity's name is adopted, also when an earlier
        sbatch call failed or timed out on our side after Slurm had accepted the job.

        Raises:
            BackendError: the Slurm commands are missing or sbatch refused the job (with
                sbatch's message, e.g. an unknown partition or a request no node can satisfy).
        """
        for name in ("sbatch", "squeue", "scancel"):
            self._slurm.command(name)  # a missing tool is reported before anything is written
        existing = self.find(job.identity)
        if existing is not None:
            log.info("Slurm job %s (%s) already exists; not submitting again",
                     existing["job_id"], job.identity.key)
            return existing
        exclude = lost_by_earlier_tries(job, self.job_dir)
        if exclude:  # elastic: the retry moves off what the last try lost (node_loss.py)
            log.info("Slurm job %s is kept off %s, lost by the last try", job.identity.key,
                     ", ".join(exclude))
        request = self.render(job, exclude)
        job_dir = Path(request["job_dir"])
        (job_dir / "ranks").mkdir(parents=True, exist_ok=True)
        for name in _STALE:
            (job_dir / name).unlink(missing_ok=True)
        atomic_write_json(job_dir / "job.json", job.config, sort_keys=True)
        script = job_dir / SCRIPT_NAME
        tmp = job_dir / f".{SCRIPT_NAME}.tmp"
        tmp.write_text(request["script"], encoding="utf-8")
        os.replace(tmp, script)
        (job_dir / LOG_NAME).touch()
        atomic_write_json(job_dir / "request.json", {
            "argv": request["argv"], "identity": request["identity"],
            "startup_timeout_s": job.startup_timeout_s, "min_nodes": job.min_nodes,
            "excluded": list(exclude)}, sort_keys=True)
        submitted_at = time.time()
        try:
            out = self._slurm.run("sbatch", "--parsable", str(script))
        except BackendError as err:
            # sbatch may have been accepted although we saw an error (timeout, lost answer).
            found = self._find_by_name(job.identity, job_dir)
            if found is not None:
                log.warning("sbatch for %s reported %s, but Slurm has job %s: counting it as "
                            "submitted", job.identity.key, err, found["job_id"])
                return found
            raise BackendError(f"sbatch refused Slurm job {job.identity.key}: {err}") from err
        job_id = out.strip().split(";")[0]
        if not job_id.isdigit():
            raise BackendError(f"sbatch --parsable answered {out.strip()!r} for job "
                               f"{job.identity.key}; expected a job id")
        handle = self._record(job.identity, job_dir, job_id, submitted_at, job.startup_timeout_s)
        log.info("Submitted Slurm job %s (%s): %d node(s) x %d rank(s)", job_id,
                 job.identity.key, job.nodes, job.processes_per_node)
        return handle

    def find(self, identity: JobIdentity) -> JobHandle | None:
        """This identity's job: from its folder's record, else by job name (``squeue``, then
        ``sacct``). Raises :class:`BackendError` when the Slurm commands fail."""
        job_dir = self.job_dir(identity)
        record = read_json(job_dir / "slurm_job.json")
        if record is not None:
            return self._handle(identity, job_dir, record)
        return self._find_by_name(identity, job_dir)

    def status(self, handle: JobHandle) -> JobStatus:
        """Observe the job once (see the module's docstring for the sources and mapping).

        Raises:
            JobNotFoundError: neither Slurm nor the job folder knows the job.
            BackendError: a Slurm command failed or timed out.
        """
        job_id = str(handle["job_id"])
        job_dir = Path(handle["job_dir"])
        seen = self._slurm.observe(job_id)
        exit_record = read_json(job_dir / "exit.json")
        result = who_failed.with_restarts(job_dir, read_json(job_dir / "result.json"))  # and its in-job restarts
        cancelled = (job_dir / "cancel.json").exists()
        start_failure = read_json(job_dir / START_FAILURE)
        if seen is None:
            if start_failure is not None:
                return JobStatus(JobState.FAILED, start_failure["message"], None,
                                 FailureKind(start_failure["failure"]), result)
            if exit_record is None:
                if not (job_dir / "request.json").exists():
                    raise JobNotFoundError(f"Slurm job {job_id} ({handle.get('key')}) is unknown "
                                           f"to Slurm and has no job folder at {job_dir}")
                if cancelled:
                    return JobStatus(JobState.CANCELLED, f"Slurm job {job_id} was cancelled")
                return JobStatus(
                    JobState.FAILED, f"Slurm job {job_id} is no longer known to Slurm (purged "
                    f"from the controller, no accounting) and left no exit record in {job_dir}: "
                    f"its batch script was killed", None, FailureKind.TRANSIENT, result)
            rc = int(exit_record.get("exit_code", 1))
            seen = {"state": "COMPLETED" if rc == 0 else "FAILED", "reason": "",
                    "start": None, "end": exit_record.get("ended_at"), "exit_code": rc}
        state = seen["state"]
        mapped = STATES.get(state)
        if mapped is None:
            log.warning("Slurm job %s has state %s, which trainforge does not know; treating it "
                        "as running", job_id, state)
            mapped = JobState.RUNNING
        if mapped is JobState.PENDING:
            return self._pending(handle, seen)
        if mapped is JobState.RUNNING:
            return JobStatus(JobState.RUNNING, f"Slurm job {job_id} {state}")
        wall_s = None
        if seen["start"] and seen["end"]:
            wall_s = round(max(0.0, seen["end"] - seen["start"]), 3)
        exit_code = exit_record.get("exit_code") if exit_record else seen["exit_code"]
        if start_failure is not None and mapped is JobState.CANCELLED:
            # We cancelled it because it could not start: it stays the failure it was.
            return JobStatus(JobState.FAILED, start_failure["message"], None,
                             FailureKind(start_failure["failure"]), result, wall_s)
        if mapped is JobState.CANCELLED or (cancelled and mapped is not JobState.SUCCEEDED):
            return JobStatus(JobState.CANCELLED, f"Slurm job {job_id} was cancelled", exit_code,
                             None, result, wall_s)
        if mapped is JobState.SUCCEEDED:
            message = (result or {}).get("message") or "training finished"
            loss = elastic_node_loss(job_dir, seen.get("end"), exit_record, self._slurm)
            if loss is not None:  # an elastic job went on without a node, and finished
                result = {**(result or {}), "disruption": loss}
                message += f"; on the surviving nodes after {describe(loss)}"
            return JobStatus(JobState.SUCCEEDED, message, exit_code or 0, None, result, wall_s,
                             seen["end"], slurm_phases(handle, seen["start"]))
        kind = failure_kind(exit_code, result)
        loss = job_node_loss(job_dir, seen.get("end"), exit_record, self._slurm)
        if loss is not None:  # the lost node, never the survivor (node_loss.py)
            said = (result or {}).get("message")
            result = {**(result or {}), "disruption": loss}
            return JobStatus(JobState.FAILED, f"Slurm job {job_id} {state} (exit code "
                             f"{exit_code}): {describe(loss)}"
                             + (f"; the trainer said: {said}" if said else ""),
                             exit_code, kind, result, wall_s)
        oom = host_oom.describe(job_dir, [job_dir / LOG_NAME, *sorted((job_dir / "ranks").glob("node-*.log"))],
                       oom_state=state if state == "OUT_OF_MEMORY" else None)  # a rank the OOM killer ended
        said = (result or {}).get("message")
        if not oom and (said or state == "FAILED"):  # the rank that started it, not rank 0's view
            said, result = who_failed.told(job_dir, said or f"see {job_dir / LOG_NAME}", result)
        detail = oom or said or {
            "TIMEOUT": "it reached its time limit (fault.run_timeout)",
            "NODE_FAIL": "a node failed under it",
            "PREEMPTED": "it was preempted by a higher-priority job",
            "BOOT_FAIL": "a node failed to boot",
        }.get(state) or f"see {job_dir / LOG_NAME}"
        return JobStatus(JobState.FAILED, f"Slurm job {job_id} {state} (exit code {exit_code}): "
                         f"{detail}", exit_code, kind, result, wall_s)

    def read_logs(self, handle: JobHandle, offset: int, max_bytes: int = 65_536) -> LogChunk:
        """Whole lines of the job log (``--output``, shared storage) after byte ``offset``."""
        try:
            with open(Path(handle["job_dir"]) / LOG_NAME, "rb") as fh:
                fh.seek(offset)
                data = fh.read(max_bytes)
        except FileNotFoundError:
            return LogChunk([], offset)
        return whole_lines(data, offset, max_bytes)

    def cancel(self, handle: JobHandle, grace_s: float = 30.0) -> JobStatus:
        """Stop the job; idempotent (an ended job is left as it is).

        A pending job is removed with ``scancel``. A running one gets SIGTERM first
        (``scancel --signal=TERM``, delivered to its job steps: srun passes it to torchrun,
        which stops its ranks, and the script records the exit); if it is still running after
        ``grace_s``, plain ``scancel`` ends it (Slurm sends SIGTERM, then SIGKILL after the
        cluster's ``KillWait``).

        Raises:
            BackendError: the job is still not ended after both steps, or scancel failed.
        """
        job_id = str(handle["job_id"])
        job_dir = Path(handle["job_dir"])
        current = self.status(handle)
        if current.state.terminal:
            return current
        if job_dir.is_dir():
            atomic_write_json(job_dir / "cancel.json", {"requested_at": time.time()}, sort_keys=True)
        if current.state is JobState.PENDING:
            log.info("Cancelling pending Slurm job %s (%s)", job_id, handle.get("key"))
            self._slurm.scancel(job_id)
        else:
            log.info("Stopping Slurm job %s (%s): SIGTERM, %.0f s grace", job_id,
                     handle.get("key"), grace_s)
            self._slurm.scancel(job_id, "--signal=TERM")
            final = self._wait_terminal(handle, grace_s)
            if final is not None:
                return final
            log.warning("Slurm job %s still running %.0f s after SIGTERM: scancel", job_id,
                        grace_s)
            self._slurm.scancel(job_id)
        final = self._wait_terminal(handle, max(grace_s, 60.0))
        if final is None:
            raise BackendError(f"Slurm job {job_id} is still not ended after scancel; check "
                               f"the cluster (squeue -j {job_id})")
        return final

    # -- helpers ----------------------------------------------------------------------------
    def _pending(self, handle: JobHandle, seen: dict[str, Any]) -> JobStatus:
        job_id = str(handle["job_id"])
        reason = seen["reason"] or "None"
        code = reason.split(",")[0].strip()
        if code in NEVER_RUNS:
            log.warning("Slurm job %s can never start (%s): cancelling it", job_id, reason)
            return self._fail_start(handle, f"Slurm job {job_id} can never start: "
                                    f"{reason_text(reason)}; it was cancelled",
                                    FailureKind.PERMANENT)
        deadline = handle.get("startup_deadline_epoch_s")
        if deadline is not None and time.time() > float(deadline):
            waited = float(deadline) - float(handle.get("submitted_at_epoch_s") or deadline)
            log.warning("Slurm job %s still %s after its startup timeout: cancelling it", job_id,
                        seen["state"])
            return self._fail_start(handle, f"Slurm job {job_id} did not start within the "
                                    f"startup timeout ({waited:.0f} s); Slurm's reason: "
                                    f"{reason_text(reason)}; it was cancelled",
                                    FailureKind.TRANSIENT)
        return JobStatus(JobState.PENDING,
                         f"Slurm job {job_id} {seen['state']}: {reason_text(reason)}")

    def _fail_start(self, handle: JobHandle, message: str, kind: FailureKind) -> JobStatus:
        """Record why the job failed to start (later polls see it so, not as CANCELLED), then
        scancel it."""
        job_dir = Path(handle["job_dir"])
        if job_dir.is_dir():
            atomic_write_json(job_dir / START_FAILURE, {"message": message,
                                                        "failure": kind.value}, sort_keys=True)
        self._slurm.scancel_quietly(str(handle["job_id"]))
        return JobStatus(JobState.FAILED, message, None, kind)

    def _find_by_name(self, identity: JobIdentity, job_dir: Path) -> JobHandle | None:
        """The newest job named after ``identity`` whose batch script is this job folder's
        (squeue), or, once the controller has forgotten it, that was submitted after the
        folder's request was written (sacct). None when there is none."""
        key = identity.key
        try:
            written = (job_dir / "request.json").stat().st_mtime
        except OSError:
            return None  # no folder, no request: nothing of ours was ever submitted
        script = str(job_dir / SCRIPT_NAME)
        proc = self._slurm.run_raw("squeue", f"--name={key}", "--states=all", "--noheader",
                             "--format=%i|%V|%o")
        if proc.returncode != 0:
            raise BackendError(f"squeue --name={key} failed: {last_error(proc.stderr)}")
        rows = [line.split("|", 2) for line in proc.stdout.splitlines() if line.strip()]
        # Another folder's job of the same identity (another runs_root) is not ours.
        rows = [r for r in rows if len(r) == 3 and r[2].strip() == script]
        if not rows:
            rows = [row[:2] for row in self._slurm.sacct(f"--name={key}", f"--starttime={SACCT_WINDOW}",
                                                   "--format=JobID,Submit")
                    if (epoch(row[1] if len(row) > 1 else None) or 0) >= written - 5]
        rows = [(int(r[0]), r[1]) for r in rows if r and r[0].strip().isdigit()]
        if not rows:
            return None
        job_id, submitted = max(rows)  # the newest, should there be several
        request = read_json(job_dir / "request.json") or {}
        return self._record(identity, job_dir, str(job_id), epoch(submitted) or time.time(),
                            request.get("startup_timeout_s"))

    def _record(self, identity: JobIdentity, job_dir: Path, job_id: str, submitted_at: float,
                startup_timeout_s: float | None) -> JobHandle:
        record = {"job_id": job_id, "submitted_at_epoch_s": submitted_at,
                  "startup_timeout_s": startup_timeout_s}
        atomic_write_json(job_dir / "slurm_job.json", record, sort_keys=True)
        return self._handle(identity, job_dir, record)

    def _handle(self, identity: JobIdentity, job_dir: Path, record: dict[str, Any]) -> JobHandle:
        submitted = record.get("submitted_at_epoch_s")
        timeout = record.get("startup_timeout_s")
        deadline = submitted + float(timeout) if submitted and timeout is not None else None
        return {"engine": self.engine, "key": identity.key, "job_id": str(record["job_id"]),
                "job_dir": str(job_dir), "identity": identity.to_dict(),
                "submitted_at_epoch_s": submitted, "startup_deadline_epoch_s": deadline}

    def _wait_terminal(self, handle: JobHandle, timeout_s: float) -> JobStatus | None:
        deadline = time.monotonic() + timeout_s
        while True:
            current = self.status(handle)
            if current.state.terminal:
                return current
            if time.monotonic() > deadline:
                return None
            time.sleep(0.5)
