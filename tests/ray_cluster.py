"""A Ray cluster of one Ray node per test host (tests/hosts.py): the head on host 0, a worker on
each other host, every Ray service bound to its host's own test address.

``with ray_cluster(hosts, temp_dir, cpus_per_node=1) as cluster:`` starts ``ray start --head`` on
host 0 (``--node-ip-address`` and ``--dashboard-host`` its address) and ``ray start --address``
on the others, with this environment's ``bin`` first on their ``PATH`` (so jobs find its
``python`` and ``torchrun``), ``TMPDIR`` inside ``temp_dir`` (jobs' folders go there), and waits
until the job API lists every node alive. ``cluster.address`` is the job API for the submit host
(the root namespace reaches host 0 over the bridge). Each node has its own ``--temp-dir``, as
separate machines would. Leaving the block kills every process on the hosts (the hosts are left
to be removed by their owner) — never ``ray stop``, which stops every Ray on the machine.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

GCS_PORT = 6379
DASHBOARD_PORT = 8265


@dataclass
class RayCluster:
    address: str
    """The job API (dashboard) on host 0, ``http://<host 0>:8265``."""
    gcs_address: str
    job_tmp_dir: Path
    """``TMPDIR`` of every node, so of every job's folders."""
    log: Path

    def alive_nodes(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.address}/nodes?view=summary", timeout=5) as resp:
            summary = json.load(resp)["data"]["summary"]
        return [n for n in summary if n.get("raylet", {}).get("state") == "ALIVE"]

    def state(self, kind: str) -> list[dict]:
        """Ray's state API: ``tasks``, ``placement_groups``, ``jobs`` ... (all, up to 10000)."""
        with urllib.request.urlopen(f"{self.address}/api/v0/{kind}?limit=10000&detail=1",
                                    timeout=10) as resp:
            return json.load(resp)["data"]["result"]["result"]


@contextmanager
def ray_cluster(hosts, temp_dir: Path, cpus_per_node: int = 1,
                start_timeout_s: float = 120.0) -> Iterator[RayCluster]:
    bin_dir = Path(sys.executable).parent
    job_tmp = temp_dir / "tmp"
    job_tmp.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "MLFLOW_TRACKING_URI")}
    env.update({"PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
                "RAY_USAGE_STATS_ENABLED": "0", "TMPDIR": str(job_tmp)})
    head = hosts.address(0)
    cluster = RayCluster(f"http://{head}:{DASHBOARD_PORT}", f"{head}:{GCS_PORT}", job_tmp,
                         temp_dir / "ray-start.log")
    common = ["--num-cpus", str(cpus_per_node), "--num-gpus", "0",
              "--object-store-memory", str(80 * 2**20), "--disable-usage-stats"]
    try:
        for i in range(hosts.count):
            role = (["--head", "--port", str(GCS_PORT), "--dashboard-host", head,
                     "--dashboard-port", str(DASHBOARD_PORT), "--include-dashboard", "true"]
                    if i == 0 else ["--address", cluster.gcs_address])
            argv = [str(bin_dir / "ray"), "start", *role, "--node-ip-address", hosts.address(i),
                    "--temp-dir", str(temp_dir / f"node-{i}"), *common]
            proc = hosts.run(i, argv, env=env, timeout=start_timeout_s)
            with open(cluster.log, "a") as log:
                log.write(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                raise RuntimeError(f"`ray start` on {hosts.name(i)} exited {proc.returncode}:\n"
                                   f"{(proc.stdout + proc.stderr)[-3000:]}")
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                if len(cluster.alive_nodes()) == hosts.count:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray cluster on {hosts.addresses} did not show "
                                   f"{hosts.count} alive nodes within {start_timeout_s:.0f} s")
            time.sleep(0.5)
        yield cluster
    finally:
        for i in range(hosts.count):
            hosts.kill(i)
