"""The ray engine without a cluster: the rendered request (golden), the entrypoint run by a real
``sh`` against a stand-in torchrun, the Airflow connection, and errors for an unreachable API."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from trainforge.engines.base import JobIdentity, TrainingJob
from trainforge.engines.ray.backend import RayBackend
from trainforge.engines.ray.render import CONFIG_ENV, RESULT_MARKER, parse_result
from trainforge.engines.ray.head import free_port
from trainforge.engines.ray import launcher
from trainforge.errors import BackendError

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden" / "ray_render.json"
GOLDEN_NODES = HERE / "golden" / "ray_render_nodes2.json"


def _job(**overrides) -> TrainingJob:
    values = dict(
        identity=JobIdentity("shakespeare_llm", "manual__2026-01-01T00:00:00+00:00", "train", 1),
        config={"format": "trainforge.job/v1", "checkpoint": {"dir": "s3://bucket/ckpt"}},
        processes_per_node=2,
        threads_per_process=3,
        env={"MLFLOW_TRACKING_URI": "http://mlflow:5000", "MLFLOW_RUN_ID": "r1"},
        max_restarts=1,
        memory_gib=8,
        engine_options={"address": "http://ray-head:8265", "env_vars": {"HF_HOME": "/cache"},
                        "pip": ["sentencepiece==0.2.0"], "working_dir": None,
                        "entrypoint_num_cpus": 0.0, "entrypoint_num_gpus": 0.0},
        startup_timeout_s=600.0,
    )
    values.update(overrides)
    return TrainingJob(**values)


def test_render_is_pure_and_matches_golden():
    backend = RayBackend(address="http://ray-head:8265")
    rendered = backend.render(_job())
    assert rendered == backend.render(_job())
    assert backend._client_obj is None  # nothing was contacted
    if os.environ.get("TRAINFORGE_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(rendered, indent=2, sort_keys=True) + "\n")
    assert rendered == json.loads(GOLDEN.read_text())
    submit = rendered["submit_job"]
    assert submit["submission_id"] == _job().identity.key
    assert json.loads(submit["runtime_env"]["env_vars"][CONFIG_ENV]) == _job().config
    assert submit["entrypoint_num_cpus"] == 6.0  # 2 ranks x 3 threads
    assert submit["entrypoint_memory"] == 8 * 2**30


def test_two_nodes_render_the_launcher_and_match_golden():
    job = _job(nodes=2, gpus_per_node=4)
    rendered = RayBackend(address="http://ray-head:8265").render(job)
    if os.environ.get("TRAINFORGE_UPDATE_GOLDEN"):
        GOLDEN_NODES.write_text(json.dumps(rendered, indent=2, sort_keys=True) + "\n")
    assert rendered == json.loads(GOLDEN_NODES.read_text())
    submit = rendered["submit_job"]
    # The entrypoint only coordinates: the nodes' CPUs, GPUs and memory are the bundles'.
    assert (submit["entrypoint_num_cpus"], submit["entrypoint_num_gpus"]) == (0.0, 0.0)
    assert "entrypoint_memory" not in submit
    assert submit["metadata"]["trainforge.nodes"] == "2"
    argv = shlex.split(submit["entrypoint"])
    assert argv[:3] == ["python", "-m", launcher.MODULE]
    args = launcher.parse_args(argv[3:])
    assert (args.nodes, args.cpus_per_node, args.gpus_per_node) == (2, 6.0, 4.0)
    assert (args.memory_bytes, args.startup_timeout_s) == (8 * 2**30, 600.0)
    assert launcher.bundle(args.cpus_per_node, args.gpus_per_node, args.memory_bytes) == {
        "CPU": 6.0, "GPU": 4.0, "memory": float(8 * 2**30)}
    filled = launcher.fill(args.torchrun, {
        launcher.JOB_DIR: "/tmp/d", launcher.RDZV_ENDPOINT: "10.0.0.5:29400",
        launcher.LOCAL_ADDR: "10.0.0.7", launcher.IS_HOST: "false"})
    assert filled[0] == "torchrun" and "--standalone" not in filled
    for option in ("--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
                   "--rdzv-endpoint=10.0.0.5:29400", f"--rdzv-id={job.identity.key}",
                   "--rdzv-conf=is_host=false", "--local-addr=10.0.0.7",
                   "--log-dir=/tmp/d/ranks"):
        assert option in filled, filled
    assert filled[-4:] == ["-m", "trainforge.trainer.train", "--config", "/tmp/d/job.json"]
    # One node keeps today's request exactly.
    assert RayBackend(address="http://ray-head:8265").render(_job(nodes=1)) == json.loads(
        GOLDEN.read_text())


def test_spec_values_override_the_resource_defaults():
    job = _job(engine_options={"entrypoint_num_cpus": 1.5, "entrypoint_num_gpus": 2.0,
                               "working_dir": "/src/app", "env_vars": {"OMP_NUM_THREADS": "8"}},
               gpus_per_node=4)
    submit = RayBackend().render(job)["submit_job"]
    assert (submit["entrypoint_num_cpus"], submit["entrypoint_num_gpus"]) == (1.5, 2.0)
    assert submit["runtime_env"]["working_dir"] == "/src/app"
    assert submit["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "8"
    assert _job(gpus_per_node=4, engine_options={}).gpus_per_node == 4
    assert RayBackend().render(_job(gpus_per_node=4, engine_options={}))["submit_job"][
        "entrypoint_num_gpus"] == 4.0


def test_a_config_too_large_for_the_environment_is_refused():
    with pytest.raises(BackendError, match="TRAINFORGE_JOB_CONFIG, at most"):
        RayBackend().render(_job(config={"blob": "x" * 200_000}))


@pytest.mark.parametrize("exit_code,result", [(0, {"status": "success", "exit_code": 0}),
                                              (1, {"status": "bad_config", "exit_code": 78}),
                                              (7, None)])
def test_entrypoint_runs_in_sh_and_reports_the_result_line(tmp_path, exit_code, result):
    """The rendered entrypoint, run by /bin/sh with a stand-in `torchrun` on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torchrun = bin_dir / "torchrun"
    write = (f"printf '%s' '{json.dumps(result)}' > \"$TRAINFORGE_RESULT_FILE\"\n"
             if result else "")
    # Echo the config it was handed (last argument), write a result, exit with a code.
    torchrun.write_text("#!/bin/sh\nfor a; do cfg=$a; done\necho \"config: $(cat \"$cfg\")\"\n"
                        f"{write}exit {exit_code}\n")
    torchrun.chmod(0o755)
    job = _job(config={"quote": "it's \"odd\" $HOME `x`"})
    submit = RayBackend().render(job)["submit_job"]
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "TMPDIR": str(tmp_path),
           **submit["runtime_env"]["env_vars"]}
    proc = subprocess.run(submit["entrypoint"], shell=True, env=env, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == exit_code, proc.stderr
    assert f'config: {json.dumps(job.config, sort_keys=True, separators=(",", ":"))}' \
        in proc.stdout
    assert parse_result(proc.stdout) == result
    assert (RESULT_MARKER in proc.stdout) is (result is not None)
    folders = list(tmp_path.glob(f"trainforge-{job.identity.key}.*"))
    assert len(folders) == 1 and (folders[0] / "job.json").is_file()


def test_address_from_an_airflow_connection(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_RAY_PROD", json.dumps({
        "conn_type": "https", "host": "ray.example.com", "port": 443, "password": "tok",
        "extra": {"verify": False, "headers": {"X-Team": "ml"}}}))
    backend = RayBackend(address="http://127.0.0.1:8265", conn_id="ray_prod")
    address, headers, verify = backend._resolve()
    assert address == "https://ray.example.com:443"
    assert headers == {"X-Team": "ml", "Authorization": "Bearer tok"}
    assert verify is False
    monkeypatch.setenv("AIRFLOW_CONN_RAY_DEFAULT_PORT", json.dumps({"conn_type": "http",
                                                                    "host": "ray-head"}))
    assert RayBackend(conn_id="ray_default_port")._resolve()[0] == "http://ray-head:8265"


@pytest.mark.parametrize("conn,fragment", [
    (None, "could not be read"),
    (json.dumps({"conn_type": "http"}), "has no host"),
])
def test_a_bad_connection_is_a_clear_error(monkeypatch, conn, fragment):
    if conn:
        monkeypatch.setenv("AIRFLOW_CONN_RAY_BAD", conn)
    with pytest.raises(BackendError, match=fragment):
        RayBackend(conn_id="ray_bad")._resolve()


def test_an_unreachable_job_api_is_a_backend_error(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    address = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(BackendError, match=f"cannot reach the Ray job API at {address}"):
        RayBackend(address=address).find(JobIdentity("d", "r", "train", 1))


@pytest.mark.parametrize("address,endpoint", [
    ("10.0.0.7", "10.0.0.7:29500"), ("fd00:213::10", "[fd00:213::10]:29500"),
    ("head.example", "head.example:29500"),
])
def test_the_rendezvous_endpoint_brackets_an_ipv6_address(address, endpoint):
    from trainforge.engines.ray.launcher import host_port

    assert host_port(address, 29500) == endpoint
