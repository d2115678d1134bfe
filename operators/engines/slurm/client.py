"""Slurm's own command-line tools (``sbatch``, ``squeue``, ``sacct``, ``scancel``) as the backend
calls them: each with a timeout, its errors as :class:`~trainforge.errors.BackendError` with
Slurm's message, and a missing tool named with the remedy."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from trainforge.errors import BackendError

log = logging.getLogger(__name__)

_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S"
# How far back sacct looks for a job by name (it shows only today's jobs without --starttime).
SACCT_WINDOW = "now-60days"


class SlurmCommands:
    """The Slurm commands of this submit node.

    Args:
        bin_dir: folder of the Slurm commands; default: looked up on ``PATH``.
        timeout_s: timeout of each command, seconds.
    """

    def __init__(self, bin_dir: str | None = None, timeout_s: float = 30.0):
        self.bin_dir = bin_dir
        self.timeout_s = float(timeout_s)

    def observe(self, job_id: str) -> dict[str, Any] | None:
        """``{"state", "reason", "start", "end", "exit_code"}`` from squeue, else sacct; None
        when neither knows the job."""
        proc = self.run_raw("squeue", "--jobs", job_id, "--states=all", "--noheader",
                             "--format=%T|%S|%e|%r")
        if proc.returncode == 0 and proc.stdout.strip():
            state, start, end, reason = proc.stdout.strip().splitlines()[0].split("|", 3)
            return {"state": state.strip(), "reason": reason.strip(), "start": epoch(start),
                    "end": epoch(end), "exit_code": None}
        if proc.returncode != 0 and "invalid job id" not in proc.stderr.lower():
            raise BackendError(f"squeue failed for Slurm job {job_id}: {last_error(proc.stderr)}")
        rows = self.sacct("--jobs", job_id, "--format=State,ExitCode,Start,End,Reason")
        if not rows:
            return None
        state, exit_code, start, end, reason = rows[-1][:5]
        code = exit_code.split(":")[0]
        return {"state": state.split()[0] if state else "UNKNOWN", "reason": reason,
                "start": epoch(start), "end": epoch(end),
                "exit_code": int(code) if code.isdigit() else None}

    def sacct(self, *args: str) -> list[list[str]]:
        """sacct rows (``-X -n -P``); empty when the cluster keeps no accounting."""
        proc = self.run_raw("sacct", "-X", "--noheader", "--parsable2", *args)
        if proc.returncode != 0:
            text = proc.stderr.lower()
            if "accounting storage is disabled" in text or "slurmdbd" in text:
                return []
            raise BackendError(f"sacct failed: {last_error(proc.stderr)}")
        return [line.split("|") for line in proc.stdout.splitlines() if line.strip()]

    def scancel(self, job_id: str, *options: str) -> None:
        """``scancel OPTIONS JOB_ID``; a job that has just ended is not an error."""
        proc = self.run_raw("scancel", *options, job_id)
        # scancel of a job that has just ended is not an error for us.
        if proc.returncode != 0 and "already completing or completed" not in proc.stderr \
                and "invalid job id" not in proc.stderr.lower():
            raise BackendError(f"scancel {' '.join(options)} {job_id} failed: "
                               f"{last_error(proc.stderr)}")

    def scancel_quietly(self, job_id: str) -> None:
        """:meth:`scancel`, logging a failure instead of raising it."""
        try:
            self.scancel(job_id)
        except BackendError as err:
            log.warning("Could not cancel Slurm job %s: %s", job_id, err)

    def command(self, name: str) -> str:
        """The path of Slurm command ``name``. Raises BackendError when it is missing."""
        path = (str(Path(self.bin_dir) / name) if self.bin_dir else shutil.which(name))
        if not path or not os.access(path, os.X_OK):
            where = f"in {self.bin_dir} (training.slurm.bin_dir)" if self.bin_dir else "on PATH"
            raise BackendError(
                f"the Slurm command {name!r} was not found {where}: run trainforge on a Slurm "
                f"submit node, or install Slurm's client tools (Debian/Ubuntu: apt-get install "
                f"slurm-client, part of slurm-wlm) configured for your cluster")
        return path

    def run_raw(self, name: str, *args: str) -> subprocess.CompletedProcess:
        """Run ``name ARGS`` and return what it did, whatever its exit code. Raises
        BackendError when it cannot run or does not answer within ``timeout_s``."""
        argv = [self.command(name), *args]
        try:
            return subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                  timeout=self.timeout_s, check=False)
        except subprocess.TimeoutExpired as err:
            raise BackendError(f"{name} {' '.join(args)} did not answer within "
                               f"{self.timeout_s:.0f} s (is slurmctld reachable?)") \
                from err
        except OSError as err:
            raise BackendError(f"could not run {argv[0]}: {err}") from err

    def run(self, name: str, *args: str) -> str:
        """The output of ``name ARGS``. Raises BackendError with Slurm's message when it fails."""
        proc = self.run_raw(name, *args)
        if proc.returncode != 0:
            raise BackendError(last_error(proc.stderr) or f"{name} exited {proc.returncode}")
        return proc.stdout


def epoch(text: str | None) -> float | None:
    """Seconds since the epoch of a Slurm time (local time, as squeue and sacct print it)."""
    if not text or not text.strip() or text.strip() in ("N/A", "Unknown", "None"):
        return None
    try:
        return time.mktime(time.strptime(text.strip(), _TIME_FORMAT))
    except ValueError:
        return None


def last_error(text: str) -> str:
    """The last non-empty line of a Slurm command's stderr, without its "cmd: error: " prefix."""
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    # sbatch prefixes its errors with "sbatch: error: "; keep the message.
    return lines[-1].split("error: ", 1)[-1][:500] if lines else ""


def slurm_phases(handle: dict[str, Any], started: float | None) -> dict[str, float | str]:
    """The ledger's engine buckets of a Slurm job: its pending time, from submission to the
    start Slurm reports."""
    submitted = handle.get("submitted_at_epoch_s")
    return {"queue_wait": round(max(0.0, started - submitted), 3) if started and submitted else
            "unknown: Slurm reported no start time (the controller forgot the job and there is "
            "no accounting)",
            "image_pull": "not applicable: the Slurm engine runs no container image"}
