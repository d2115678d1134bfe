"""The toy engine's backend: render → submit → status → logs → cancel on a spool folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainforge.contract import failure_kind
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
from trainforge.engines.launch import rank_env, torchrun_argv
from trainforge.errors import JobNotFoundError


class ToyBackend(Backend):
    """Jobs are folders under ``spool``; a job ends when ``exit.json`` appears in its folder."""

    engine = "toy"

    def __init__(self, spool: str):
        self.spool = Path(spool)

    def _folder(self, key: str) -> Path:
        return self.spool / key

    def render(self, job: TrainingJob) -> dict[str, Any]:
        folder = self._folder(job.identity.key)
        return {
            "engine": self.engine,
            "queue": job.engine_options.get("queue", "default"),
            "argv": torchrun_argv(job, f"{folder}/job.json"),
            "env": {**rank_env(job, f"{folder}/result.json"), **job.env},
        }

    def submit(self, job: TrainingJob) -> JobHandle:
        found = self.find(job.identity)
        if found:
            return found
        folder = self._folder(job.identity.key)
        folder.mkdir(parents=True)
        (folder / "job.json").write_text(json.dumps(job.config))
        (folder / "request.json").write_text(json.dumps(self.render(job)))
        return {"engine": self.engine, "key": job.identity.key}

    def find(self, identity: JobIdentity) -> JobHandle | None:
        if (self._folder(identity.key) / "request.json").exists():
            return {"engine": self.engine, "key": identity.key}
        return None

    def status(self, handle: JobHandle) -> JobStatus:
        folder = self._folder(handle["key"])
        if not folder.exists():
            raise JobNotFoundError(f"toy job {handle['key']} not found in {self.spool}")
        if (folder / "cancelled").exists():
            return JobStatus(JobState.CANCELLED, "cancelled")
        if not (folder / "exit.json").exists():
            return JobStatus(JobState.PENDING, f"queued in {self.spool}")
        end = json.loads((folder / "exit.json").read_text())
        code, result = end.get("exit_code"), end.get("result")
        if code == 0:
            return JobStatus(JobState.SUCCEEDED, "training finished", 0, None, result)
        return JobStatus(JobState.FAILED, f"exit code {code}", code, failure_kind(code, result),
                         result)

    def read_logs(self, handle: JobHandle, offset: int, max_bytes: int = 65_536) -> LogChunk:
        path = self._folder(handle["key"]) / "job.log"
        if not path.exists():
            return LogChunk([], offset)
        with open(path, "rb") as fh:
            fh.seek(offset)
            return whole_lines(fh.read(max_bytes), offset, max_bytes)

    def cancel(self, handle: JobHandle, grace_s: float = 30.0) -> JobStatus:
        (self._folder(handle["key"]) / "cancelled").touch()
        return self.status(handle)
