"""The ``local`` engine: torchrun on the Airflow worker's own machine.

CPU ranks talk over gloo, GPUs over nccl (the trainer chooses from ``distributed.backend``).
Each job lives in a folder ``<runs_root>/<identity key>/`` (the request, the job config, the
supervisor's pid, torchrun's console, every rank's log, rank 0's ``result.json`` and the
supervisor's ``exit.json``); its state is read from ``exit.json`` and whether the supervisor is
alive. The folder's files and the state mapping: docs/adding-an-engine.md, "4. The backend".
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
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
from trainforge.engines import root_cause as who_failed
from trainforge.engines.host_oom import describe
from trainforge.engines.jobfiles import read_json
from trainforge.storage.files import atomic_write_json
from trainforge.engines.launch import python_torchrun, rank_env, torchrun_argv
from trainforge.errors import BackendError, JobNotFoundError

log = logging.getLogger(__name__)



def local_phases(handle: JobHandle, exit_record: dict[str, Any]) -> dict[str, float | str]:
    """The ledger's engine buckets of a local job: no queue (the wait is the supervisor's own
    start, measured), no container image."""
    started, submitted = exit_record.get("started_at"), handle.get("submitted_at_epoch_s")
    return {"queue_wait": round(max(0.0, started - submitted), 3) if started and submitted else
            "unknown: the job folder records no submission or start time",
            "image_pull": "not applicable: the local engine runs no container image"}

class LocalBackend(Backend):
    """torchrun on this machine, one supervised process group per job.

    Args:
        runs_root: folder that holds one sub-folder per job.
        python: interpreter that runs torchrun and the trainer (default: this one).
        cwd: working directory of the job (default: the runs folder of the job).
    """

    engine = "local"

    def __init__(self, runs_root: str | os.PathLike, python: str | None = None, cwd: str | None = None):
        self.runs_root = Path(runs_root).absolute()
        self.python = python or sys.executable
        self.cwd = cwd

    # -- pure -------------------------------------------------------------------------------
    def job_dir(self, identity: JobIdentity) -> Path:
        return self.runs_root / identity.key

    def render(self, job: TrainingJob) -> dict[str, Any]:
        job_dir = self.job_dir(job.identity)
        argv = torchrun_argv(job, str(job_dir / "job.json"),
                             launcher=python_torchrun(self.python),
                             log_dir=str(job_dir / "ranks"))
        env = {
            **rank_env(job, str(job_dir / "result.json"), job_dir=str(job_dir)),
            **job.env,
            **job.secret_placeholders(),
        }
        request = {
            "engine": self.engine,
            "job_dir": str(job_dir),
            "argv": argv,
            "env": env,
            "cwd": self.cwd or str(job_dir),
            "config": job.config,
            "identity": job.identity.to_dict(),
        }
        if job.secret_env:
            # Names only: the values reach the ranks through the supervisor's process
            # environment (submit), never through this request or any file.
            request["secret_env"] = sorted(job.secret_env)
        return request

    # -- remote calls (here: processes and files) --------------------------------------------
    def submit(self, job: TrainingJob) -> JobHandle:
        existing = self.find(job.identity)
        if existing is not None:
            log.info("Job %s already exists in %s; not submitting again", job.identity.key,
                     existing["job_dir"])
            return existing
        request = self.render(job)
        job_dir = Path(request["job_dir"])
        job_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(job_dir / "job.json", job.config, sort_keys=True)
        (job_dir / "job.log").touch()
        # request.json is written last: it is what makes the job exist for find().
        atomic_write_json(job_dir / "request.json",
                          {k: v for k, v in request.items() if k != "config"}, sort_keys=True)
        try:
            proc = subprocess.Popen(
                [self.python, "-m", "trainforge.engines.local.supervisor", str(job_dir)],
                cwd=request["cwd"],
                env={**os.environ, **job.secret_env} if job.secret_env else None,
                stdin=subprocess.DEVNULL,
                stdout=open(job_dir / "supervisor.log", "ab"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as err:
            raise BackendError(
                f"could not start the local supervisor for job {job.identity.key} in {job_dir}: "
                f"{err}"
            ) from err
        import psutil

        try:
            created = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            created = None
        atomic_write_json(job_dir / "supervisor.json", {"pid": proc.pid, "create_time": created},
                          sort_keys=True)
        log.info("Submitted local job %s (supervisor pid %s) in %s", job.identity.key, proc.pid, job_dir)
        return self._handle(job.identity, job_dir)

    def find(self, identity: JobIdentity) -> JobHandle | None:
        job_dir = self.job_dir(identity)
        if (job_dir / "request.json").is_file():
            return self._handle(identity, job_dir)
        return None

    def status(self, handle: JobHandle) -> JobStatus:
        job_dir = self._dir(handle)
        result = who_failed.with_restarts(job_dir, read_json(job_dir / "result.json"))  # and its in-job restarts
        exit_record = read_json(job_dir / "exit.json")
        if exit_record is not None:
            rc = int(exit_record["exit_code"])
            wall_s = None
            if exit_record.get("started_at") and exit_record.get("ended_at"):
                wall_s = round(exit_record["ended_at"] - exit_record["started_at"], 3)
            if rc == 0 and not exit_record.get("cancelled"):
                return JobStatus(JobState.SUCCEEDED, "training finished", rc, None, result, wall_s,
                                 exit_record.get("ended_at"), local_phases(handle, exit_record))
            if exit_record.get("cancelled"):
                return JobStatus(JobState.CANCELLED, "job was cancelled", rc, None, result, wall_s)
            message = (result or {}).get("message") or f"torchrun exited with code {rc}"
            killed = describe(job_dir, [job_dir / "job.log"], exit_record.get("oom_kills"))
            if killed and (exit_record.get("oom_kills") or who_failed.root_cause(job_dir) is None):
                # a rank the OOM killer (or another SIGKILL) ended: rank 0 may have said nothing
                message = killed + (f"; the trainer said: {result['message']}" if (result or {}).get("message") else "")
            else:  # the rank that started it, not rank 0's view of it; a SIGKILL of its as the last word
                message, result = who_failed.told(job_dir, message, result)
                message += f"\n  {killed}" if killed else ""
            return JobStatus(JobState.FAILED, message, rc, failure_kind(rc, result), result,
                             wall_s)
        if self._supervisor_alive(job_dir):
            return JobStatus(JobState.RUNNING, "running", None, None, result)
        # The exit record may have landed between the two reads above.
        if (job_dir / "exit.json").exists():
            return self.status(handle)
        return JobStatus(
            JobState.FAILED,
            f"the supervisor of job {handle['key']} is gone without an exit record "
            f"(killed or machine restarted)",
            None,
            FailureKind.TRANSIENT,
            result,
        )

    def read_logs(self, handle: JobHandle, offset: int, max_bytes: int = 65_536) -> LogChunk:
        path = self._dir(handle) / "job.log"
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read(max_bytes)
        except FileNotFoundError:
            return LogChunk([], offset)
        return whole_lines(data, offset, max_bytes)

    def cancel(self, handle: JobHandle, grace_s: float = 30.0) -> JobStatus:
        job_dir = self._dir(handle)
        current = self.status(handle)
        if current.state.terminal:
            return current
        info = read_json(job_dir / "supervisor.json") or {}
        pid = info.get("pid")
        if pid:
            # torchrun starts its ranks in sessions of their own, so signalling our process
            # group does not reach them: remember every descendant now, and make sure each one
            # is gone at the end.
            tree = _process_tree(pid)
            log.info("Cancelling local job %s: SIGTERM to supervisor group %s (%d processes)",
                     handle["key"], pid, len(tree))
            _signal_group(pid, signal.SIGTERM)
            import psutil

            _, alive = psutil.wait_procs(tree, timeout=grace_s)
            if alive:
                log.warning("Job %s: %d processes still alive after %.0f s; SIGKILL",
                            handle["key"], len(alive), grace_s)
                _signal_group(pid, signal.SIGKILL)
                for proc in alive:
                    try:
                        proc.kill()
                    except psutil.Error:
                        pass
                psutil.wait_procs(alive, timeout=10)
        if not (job_dir / "exit.json").exists():
            atomic_write_json(
                job_dir / "exit.json",
                {"exit_code": -signal.SIGKILL, "cancelled": True, "signal": int(signal.SIGKILL),
                 "ended_at": time.time()}, sort_keys=True)
        return self.status(handle)

    # -- helpers ----------------------------------------------------------------------------
    def _handle(self, identity: JobIdentity, job_dir: Path) -> JobHandle:
        # request.json is written once, when the job is created: its time is the submission's.
        try:
            submitted = (job_dir / "request.json").stat().st_mtime
        except OSError:
            submitted = time.time()
        return {"engine": self.engine, "key": identity.key, "job_dir": str(job_dir),
                "identity": identity.to_dict(), "submitted_at_epoch_s": submitted}

    def _dir(self, handle: JobHandle) -> Path:
        job_dir = Path(handle["job_dir"])
        if not (job_dir / "request.json").is_file():
            raise JobNotFoundError(
                f"local job {handle.get('key')!r} not found: {job_dir} has no request.json"
            )
        return job_dir

    @staticmethod
    def _supervisor_alive(job_dir: Path) -> bool:
        import psutil

        info = read_json(job_dir / "supervisor.json")
        if not info:
            # Submitted but not yet recorded: the submitter is between Popen and the write.
            return (job_dir / "request.json").exists() and not (job_dir / "exit.json").exists()
        try:
            proc = psutil.Process(info["pid"])
            if info.get("create_time") and abs(proc.create_time() - info["create_time"]) > 1.0:
                return False  # the pid was reused by another process
            return proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


def _process_tree(pid: int) -> list:
    """The process ``pid`` and all its descendants (psutil processes); empty if it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _signal_group(pid: int, sig: int) -> None:
    # The supervisor was started with start_new_session=True: its pid is its group's id, and
    # torchrun with every rank is in that group even when the supervisor itself is gone.
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
