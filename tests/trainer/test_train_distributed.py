"""torchrun with 2 CPU processes (gloo): a full run, a SIGKILLed run resumed, a divergence.

The full run logs into a real MLflow server on loopback over HTTP (the session fixture
``mlflow_server`` of tests/conftest.py).

The resumed run must end bit-identical to the uninterrupted one: same final step, same final
loss and the same weights, compared exactly (torch.equal). That holds because batches are a
function of (seed, step), the learning rate of step, and AdamW/RNG state is restored from the
checkpoint; with one thread per process, CPU kernels and the 2-rank gloo all-reduce are
deterministic.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import psutil
import pytest
import safetensors.torch
import torch

from trainforge.trainer import checkpoint as ckpt

pytestmark = pytest.mark.distributed

MAX_STEPS = 40
OPTIM = {"max_steps": MAX_STEPS, "global_batch_size": 8, "micro_batch_size": 2, "warmup_steps": 5}


def _job(tools, tmp_path, dataset_dir, name: str, **sections):
    return tools.write_job(tmp_path / f"{name}.json", tools.make_job(dataset_dir, tmp_path / name, **sections))


@pytest.fixture(scope="module")
def mlflow_run(mlflow_server):
    """A RUNNING run on the real MLflow server (tests/conftest.py), as the DAG would have made it."""
    import mlflow

    client = mlflow.MlflowClient(mlflow_server)
    run = client.create_run(client.create_experiment(f"trainer-tests-{time.time_ns()}"))
    client.log_param(run.info.run_id, "optim.seed", "999")  # logged earlier with another value
    return mlflow_server, run.info.run_id


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, dataset_dir, mlflow_run, tools):
    """Uninterrupted 2-process run to MAX_STEPS, logging into MLflow."""
    tmp = tmp_path_factory.mktemp("full")
    job = _job(tools, tmp, dataset_dir, "ck", optim=OPTIM)
    uri, run_id = mlflow_run
    start = time.monotonic()
    proc = tools.run_trainer(job, tmp / "result.json", nproc=2, MLFLOW_TRACKING_URI=uri, MLFLOW_RUN_ID=run_id)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return {"dir": tmp / "ck", "result": json.loads((tmp / "result.json").read_text()), "log": proc.stdout,
            "seconds": time.monotonic() - start}


@pytest.mark.integration
def test_full_run(full_run, mlflow_run):
    result = full_run["result"]
    assert result["status"] == "success" and result["exit_code"] == 0
    assert result["final_step"] == MAX_STEPS and result["tokens_seen"] == MAX_STEPS * 8 * 32
    assert result["last_checkpoint"] == str(full_run["dir"] / "step-00000040")
    # interval 10, keep_last 2: only the two newest survive, both valid
    assert [s for s, _ in ckpt.list_step_dirs(full_run["dir"])] == [30, 40]
    assert all(not ckpt.verify(p) for _, p in ckpt.list_step_dirs(full_run["dir"]))
    meta = json.loads((full_run["dir"] / "step-00000040" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["grad_accum_steps"] == 2 and meta["step"] == 40
    # only rank 0 logs: one line per log_every_steps (5)
    lines = [line for line in full_run["log"].splitlines() if " | loss " in line]
    assert len(lines) == MAX_STEPS // 5 and all(" rank0 " in line for line in lines)
    first_loss, last_loss = (float(line.split("| loss ")[1].split()[0]) for line in (lines[0], lines[-1]))
    assert last_loss < first_loss

    import mlflow

    uri, run_id = mlflow_run
    client = mlflow.MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING"  # the trainer never ends the DAG's run
    assert run.data.params["model.hidden_size"] == "32" and run.data.params["world_size"] == "2"
    assert run.data.params["optim.seed"] == "999"  # MLflow params are immutable: kept, with a warning
    assert run.data.tags["trainforge.world_size_history"] == '[{"from_step":0,"world_size":2}]'
    assert "MLflow param optim.seed is already '999'" in full_run["log"]
    history = client.get_metric_history(run_id, "train_loss")
    assert [m.step for m in history] == list(range(5, MAX_STEPS + 1, 5))
    assert history[-1].value == pytest.approx(result["final_train_loss"])
    assert {"learning_rate", "tokens_per_s", "grad_norm"} <= set(run.data.metrics)
    # rank 0's machine, sampled by MLflow's monitor; a run shorter than one interval still has one
    # sample (the last interval is logged when training ends), and no rank's node prefix
    system = {k for k in run.data.metrics if k.startswith("system/")}
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes",
            "system/disk_usage_percentage", "system/network_receive_megabytes"} <= system, system
    assert not any(k.startswith("system/node") for k in system)


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every worker (workers run in their own sessions, so killpg is not enough)."""
    workers = psutil.Process(proc.pid).children(recursive=True)
    for p in [psutil.Process(proc.pid), *workers]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)  # reap torchrun through Popen so its return code stays readable
    psutil.wait_procs(workers, timeout=30)


def test_killed_run_resumes_to_identical_result(full_run, tmp_path, dataset_dir, tools):
    job = _job(tools, tmp_path, dataset_dir, "ck", optim=OPTIM)
    ck_dir, result_file = tmp_path / "ck", tmp_path / "result.json"
    log_path = tmp_path / "killed.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(tools.command(job, nproc=2), cwd=tools.repo_root, env=tools.env(result_file),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while not (ck_dir / "step-00000010" / "manifest.json").exists():
                assert proc.poll() is None, log_path.read_text()[-4000:]
                assert time.monotonic() < deadline, "no first checkpoint after 120 s"
                time.sleep(0.005)
            _kill_tree(proc)
        finally:
            if proc.poll() is None:
                _kill_tree(proc)
    assert proc.returncode == -signal.SIGKILL
    newest = ckpt.newest_valid(ck_dir)
    assert newest is not None and ckpt.list_step_dirs(ck_dir)[-1][0] < MAX_STEPS, "killed too late to test resume"
    assert not result_file.exists()  # SIGKILL: no result; the orchestrator treats that as transient

    proc2 = tools.run_trainer(job, result_file, nproc=2)
    assert proc2.returncode == 0, proc2.stdout[-5000:]
    assert f"resuming from {newest}" in proc2.stdout
    result, reference = json.loads(result_file.read_text()), full_run["result"]
    assert result["final_step"] == reference["final_step"] == MAX_STEPS
    assert result["tokens_seen"] == reference["tokens_seen"]
    assert result["final_train_loss"] == reference["final_train_loss"]  # exact
    ours = safetensors.torch.load_file(ck_dir / "step-00000040" / "model.safetensors")
    theirs = safetensors.torch.load_file(full_run["dir"] / "step-00000040" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name  # exact, not just close
    opt_ours = torch.load(ck_dir / "step-00000040" / "optimizer.pt", weights_only=True)
    opt_theirs = torch.load(full_run["dir"] / "step-00000040" / "optimizer.pt", weights_only=True)
    for i, state in opt_ours["state"].items():
        assert torch.equal(state["exp_avg_sq"], opt_theirs["state"][i]["exp_avg_sq"])


def test_huge_learning_rate_diverges_with_exit_79(tmp_path, dataset_dir, tools):
    job = _job(tools, tmp_path, dataset_dir, "ck", optim=OPTIM | {"learning_rate": 1e30, "min_learning_rate": 1e29,
                                                              "warmup_steps": 0})
    proc = tools.run_trainer(job, tmp_path / "result.json", nproc=2)
    assert proc.returncode != 0  # torchrun reports 1; the worker's code is in the result file and log
    assert "exitcode  : 79" in proc.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "diverged" and result["exit_code"] == 79
    assert "not finite" in result["message"] or "nan" in result["message"].lower()
    assert result["final_step"] < MAX_STEPS and result["last_checkpoint"] is None
    assert ckpt.list_step_dirs(tmp_path / "ck") == []  # no checkpoint after divergence

