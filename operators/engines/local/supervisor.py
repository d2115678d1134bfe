"""Supervisor of one local training job: ``python -m trainforge.engines.local.supervisor DIR``.

The local engine starts this small process in a session of its own, detached from the Airflow
task that submitted the job, so the job outlives the task's deferral. It runs the command of
``DIR/request.json`` with stdout and stderr appended to ``DIR/job.log`` and, whatever happens,
records how it ended in ``DIR/exit.json`` (written atomically) so that a status check from any
other process — the trigger, a retry — can tell success from failure without being its parent.

SIGTERM or SIGINT to the supervisor is forwarded to the job (torchrun stops its ranks), and the
exit record says the job was cancelled.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainforge.contract import cgroup_memory
from trainforge.storage.files import atomic_write_json


def main(job_dir: str) -> int:
    root = Path(job_dir)
    request = json.loads((root / "request.json").read_text(encoding="utf-8"))
    env = dict(os.environ)
    # Secret variables are listed by name with a placeholder value; their values are in this
    # process's own environment (LocalBackend.submit), never in the request file.
    secret = set(request.get("secret_env", ()))
    env.update({k: v for k, v in request.get("env", {}).items() if k not in secret})
    cancelled = {"signal": None}
    started = time.time()
    cgroup = cgroup_memory(os.getpid())  # its OOM kills while the job runs name a rank's end
    with open(root / "job.log", "ab", buffering=0) as log:
        child = subprocess.Popen(
            request["argv"],
            cwd=request.get("cwd") or None,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

        def forward(signum, _frame):
            cancelled["signal"] = signum
            try:
                child.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        rc = child.wait()
    atomic_write_json(
        root / "exit.json",
        {
            "exit_code": rc,
            "cancelled": cancelled["signal"] is not None,
            "signal": cancelled["signal"],
            "started_at": started,
            "ended_at": time.time(),
            **_oom_kills(cgroup),
        }, sort_keys=True)
    return 0


def _oom_kills(before: dict | None) -> dict:
    """``{"oom_kills", "cgroup"}``: the OOM kills counted in this process's cgroup since ``before``."""
    after = cgroup_memory(os.getpid())
    if before is None or after is None or None in (before["oom_kills"], after["oom_kills"]):
        return {}
    return {"oom_kills": after["oom_kills"] - before["oom_kills"], "cgroup": after["dir"]}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m trainforge.engines.local.supervisor JOB_DIR", file=sys.stderr)
        sys.exit(64)
    sys.exit(main(sys.argv[1]))
