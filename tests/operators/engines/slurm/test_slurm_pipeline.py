"""End to end on the Slurm engine: the demo pipeline on the small config, `trainforge run
--engine slurm` through `airflow dags test`, with the train task submitted by sbatch to a real
Slurm cluster, real srun + torchrun (world size 2, gloo) and a real MLflow server:

* on the session's one-node cluster (the ``slurm_cluster`` fixture): 2 ranks on one node;
* on a two-node cluster of two test hosts (tests/hosts.py: network namespaces on a bridge,
  slurmctld and a slurmd on the first, a slurmd on the second; the job folders on the file system
  both see): ``resources.nodes: 2``, one rank per node, the rendezvous on the first node's test
  address, DDP across the hosts, and the second node 15 s slower to start its torchrun than the
  first. With the same global batch, world size and seed as the one-node run, its loss curve
  equals that run's at every logged step, to the 4 decimals the step lines print.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.e2e.conftest import shakespeare_corpus  # noqa: F401 - the demo corpus (session)
from tests import hosts as test_hosts
from tests.conftest import skip_without
from tests.slurm_cluster import SlurmCluster, missing_binaries
from tests.slurm_cluster import slurm_cluster  # noqa: F401 - the session's Slurm cluster

SPEC = Path(__file__).resolve().parents[3] / "e2e" / "tiny_shakespeare.yaml"

pytestmark = [pytest.mark.airflow, pytest.mark.integration, pytest.mark.distributed]


@pytest.fixture(scope="module")
def slurm_run(tmp_path_factory, shakespeare_corpus, slurm_cluster):  # noqa: F811
    home = tmp_path_factory.mktemp("trainforge-home-slurm")
    (home / "corpus").mkdir()
    (home / "corpus" / "shakespeare").symlink_to(shakespeare_corpus, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    # The derived spec's training.slurm.python is the default `python3`: the job inherits the
    # submitter's PATH (sbatch --export=ALL), so this environment's Python runs the trainer.
    env.update({"TRAINFORGE_HOME": str(home), **slurm_cluster.env(),
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"})
    summary_path = home / "summary.json"
    trainforge = Path(sys.executable).with_name("trainforge")
    proc = subprocess.run(
        [str(trainforge), "run", str(SPEC), "--engine", "slurm", "--summary-json",
         str(summary_path)],
        env=env, capture_output=True, text=True, timeout=1500,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return home, json.loads(summary_path.read_text()), output


def test_the_pipeline_succeeds_with_training_as_a_slurm_job(slurm_run, slurm_cluster):  # noqa: F811
    home, summary, _ = slurm_run
    assert summary["state"] == "success"
    assert {t: s["state"] for t, s in summary["stages"].items()} == {
        "prepare_data": "success", "train": "success",
        "validate_checkpoint": "success", "register_model": "success",
    }
    assert summary["steps_trained"] == 200
    assert summary["val_perplexity"] < 0.8 * summary["unigram_perplexity"], summary
    assert "engine: slurm" in (home / "specs" / "tiny_shakespeare.slurm.yaml").read_text()
    (job_dir,) = (home / "runs").iterdir()
    record = json.loads((job_dir / "slurm_job.json").read_text())
    state = slurm_cluster.run("squeue", "-j", record["job_id"], "--states=all", "-h",
                              "-o", "%T|%j").stdout.strip()
    assert state == f"COMPLETED|{job_dir.name}"
    assert json.loads((job_dir / "exit.json").read_text())["exit_code"] == 0


def test_the_slurm_jobs_log_reached_the_task_log(slurm_run):
    home, summary, _ = slurm_run
    full_log = next((home / "logs").iterdir()).read_text()
    # the node named localhost has NodeAddr 127.0.0.1: the rendezvous takes its address
    assert "trainforge: Slurm job" in full_log and "rendezvous 127.0.0.1:" in full_log
    assert "step 200/200" in full_log, full_log[-3000:]


def _losses(log_text: str) -> dict[int, str]:
    """Rank 0's ``step N/M | loss X`` lines: step -> the loss as printed (4 decimals)."""
    return {int(m[1]): m[2] for m in re.finditer(r"step (\d+)/\d+ \| loss ([0-9.]+)", log_text)}


SLOW_PYTHON = """#!/bin/sh
# The second node starts torchrun 15 s after the first: a node slower to start (a cold cache,
# a slow shared file system) must still join the rendezvous.
if [ "${SLURMD_NODENAME:-}" = h1 ] && [ "${1:-}" = -m ]; then sleep 15; fi
exec %s "$@"
"""


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory, shakespeare_corpus):  # noqa: F811
    with test_hosts.test_hosts(2) if not _two_hosts_missing() else _skip() as hosts:
        yield from _two_node_run(tmp_path_factory, shakespeare_corpus, hosts)


def _two_hosts_missing() -> str | None:
    if missing_binaries():
        return f"Slurm and munge (missing: {', '.join(missing_binaries())})"
    return test_hosts.unavailable()


def _skip():
    if missing_binaries():
        skip_without("slurm", f"missing: {', '.join(missing_binaries())}")
    test_hosts.skip_if_unavailable()


def _two_node_run(tmp_path_factory, shakespeare_corpus, hosts):
    from trainforge.mlflow_setup import start_server

    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="tf-slurm2-")), hosts=hosts)
    home = tmp_path_factory.mktemp("trainforge-home-slurm-2n")
    (home / "corpus").mkdir()
    (home / "corpus" / "shakespeare").symlink_to(shakespeare_corpus, target_is_directory=True)
    spec_text = SPEC.read_text()
    one_node = "    nodes: 1\n    processes_per_node: 2\n"
    assert one_node in spec_text
    spec = home / "tiny_shakespeare.yaml"
    assert "  engine: local\n" in spec_text
    spec.write_text(spec_text.replace(one_node, "    nodes: 2\n    processes_per_node: 1\n")
                    .replace("  engine: local\n", "  engine: slurm\n"))
    bin_dir = home / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(SLOW_PYTHON % sys.executable)
    (bin_dir / "python3").chmod(0o755)
    try:
        cluster.start()
        # The ranks on the hosts log to MLflow: it listens on the submit host's test address.
        with start_server(home / "mlflow", host=hosts.submit_address, port=0,
                          allowed_hosts=f"{hosts.submit_address}:*", timeout_s=120.0) as server:
            env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
            env.update({"TRAINFORGE_HOME": str(home), **cluster.env(),
                        "MLFLOW_TRACKING_URI": server.url,
                        "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}"
                                f"{env.get('PATH', '')}"})
            summary_path = home / "summary.json"
            trainforge = Path(sys.executable).with_name("trainforge")
            proc = subprocess.run(
                [str(trainforge), "run", str(spec), "--summary-json", str(summary_path)], env=env, capture_output=True, text=True, timeout=1500)
            output = proc.stdout + proc.stderr
            assert proc.returncode == 0, output[-6000:] + cluster.logs()
            yield home, json.loads(summary_path.read_text()), cluster
    finally:
        cluster.stop()


@pytest.mark.multihost
def test_two_nodes_on_two_hosts_train_the_pipeline_like_one_node(two_node_run, slurm_run):
    home, summary, cluster = two_node_run
    assert summary["state"] == "success"
    assert {t: s["state"] for t, s in summary["stages"].items()} == {
        "prepare_data": "success", "train": "success",
        "validate_checkpoint": "success", "register_model": "success",
    }
    assert summary["steps_trained"] == 200
    (job_dir,) = (home / "runs").iterdir()
    log = next((home / "logs").iterdir()).read_text()
    # Both hosts ran a torchrun: the first node's console is the task log, the second's its own
    # file; the rendezvous is the first host's test address, never loopback.
    assert "Slurm job" in log and "on h[0-1]; rendezvous 10." in log, log[-3000:]
    assert "process group up: backend=gloo world_size=2" in log
    assert (job_dir / "ranks" / "node-1.log").exists()
    # one torchrun agent per node, each with its own folder of rank logs on the shared disk
    assert len(list((job_dir / "ranks").glob("*/attempt_0/0"))) == 2, list((job_dir / "ranks").rglob("*"))
    metas = [json.loads(p.read_text()) for p in (home / "checkpoints").rglob("step-*/meta.json")]
    assert metas and all(m["world_size"] == 2 for m in metas), metas
    one_home, one_summary, _ = slurm_run
    one_log = next((one_home / "logs").iterdir()).read_text()
    two, one = _losses(log), _losses(one_log)
    assert sorted(two) == sorted(one) and max(two) == 200, (sorted(two), sorted(one))
    assert two == one, [(s, one[s], two[s]) for s in sorted(one) if one[s] != two[s]]
