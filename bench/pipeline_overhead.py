"""Pipeline overhead: the demo's stages as bare scripts against the same stages through Airflow.

    .venv/bin/python bench/pipeline_overhead.py [--max-steps 60] [--corpus-mib 2] [--keep]

A bench-local tiny spec (tests/e2e/tiny_shakespeare.yaml's model and stages, on a generated
JSONL corpus so nothing is downloaded) runs twice in this process's time, against one MLflow
server started here:

* bare: each stage as the plain program the pipeline's task runs, one after the other, inputs
  rendered beforehand by the product's own functions (untimed): data preparation
  (``prepare_dataset`` in a fresh process), ``torchrun -m trainforge.trainer.train`` (the command
  line and environment of the local engine, logging to an MLflow run), the validator
  (``python -m trainforge.trainer.validate``, the task's argv) and registration (the exporter,
  then ``MlflowHook.register_model_version`` in a fresh process);
* pipeline: ``trainforge run SPEC --summary-json`` (``airflow dags test``), with its own
  TRAINFORGE_HOME, so nothing the bare run prepared is reused. Per task: Airflow's start to end.

Prints, per task, bare seconds, pipeline seconds, their difference and ratio against the goal
(pipeline at most 5% more than bare, or 3 s more, whichever is larger), the same for the sum
over the stage tasks, and beside each the orchestration overhead the run ledger logged for it
(``badput/orchestration_s``, ``badput/queue_wait_s`` on the DAG run's MLflow run; "n/a" where
the run has none). The teardown task (``close_run``) has no bare counterpart and is listed
apart; ``trainforge run``'s own wall time (Airflow start-up, DAG parsing) is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

STAGES = ("prepare_data", "train", "validate_checkpoint", "register_model")
#: The ledger's per-task figures shown beside the measurement (docs/contracts.md, "Run ledger").
LEDGER_METRICS = ("badput/orchestration_s", "badput/queue_wait_s")
GOAL_RATIO = 1.05
GOAL_SECONDS = 3.0

SPEC = """\
pipeline:
  name: {name}
  description: pipeline-overhead benchmark (tiny model, generated corpus)
  schedule: null
  defaults:
    retries: 0
data:
  sources: [{corpus}]
  format: jsonl
  cleaning:
    strip_gutenberg_boilerplate: false
  tokenizer:
    vocab_size: 1024
  sequence_length: 64
  validation_fraction: 0.1
model:
  hidden_size: 64
  num_layers: 2
  num_heads: 2
training:
  engine: local
  resources:
    nodes: 1
    processes_per_node: 2
    cpus_per_process: 1
  optimization:
    max_steps: {steps}
    global_batch_size: 16
    micro_batch_size: 4
    learning_rate: 5e-3
    warmup_steps: 10
  checkpoint:
    interval_steps: {checkpoint_every}
    keep_last: 2
  fault:
    run_timeout: 15m
    poll_interval: 1s
  log_every_steps: 10
validation:
  eval_tokens: 8192
  sample_tokens: 10
  require_beats_unigram: false
registry:
  model_name: {name}
  aliases: [challenger]
"""


def timed(argv: list[str], env: dict[str, str], log: Path) -> float:
    """Run ``argv`` (output to ``log``); its wall seconds. Exits with the log tail on failure."""
    started = time.monotonic()
    with open(log, "w") as out:
        code = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                              check=False).returncode
    seconds = time.monotonic() - started
    if code:
        sys.exit(f"{' '.join(argv[:4])} failed ({code}):\n{log.read_text()[-3000:]}")
    return seconds


def bare(spec_file: Path, home: Path, tracking_uri: str) -> dict[str, float]:
    """The stages as bare programs; seconds per stage (task ids as keys)."""
    os.environ["TRAINFORGE_HOME"] = str(home)  # resolve() of the product's functions reads it
    from trainforge.engines.base import JobIdentity
    from trainforge.engines.launch import python_torchrun, rank_env, torchrun_argv
    from trainforge.hooks.mlflow import MlflowHook
    from trainforge.jobconfig import build_training_job
    from trainforge.paths import resolve
    from trainforge.pipeline.loader import load_spec
    from trainforge.tasks.prepare_data import prepare_settings
    from trainforge.tasks.validate_checkpoint import expected_job_config, validator_argv

    spec = load_spec(spec_file)
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri}
    seconds: dict[str, float] = {}
    out = home / "bare"
    out.mkdir(parents=True)

    (out / "settings.pickle").write_bytes(pickle.dumps(prepare_settings(spec)))
    seconds["prepare_data"] = timed(
        [sys.executable, __file__, "--bare-prepare", str(out / "settings.pickle"),
         resolve(spec.data.output_uri), str(out / "prepared.json")], env, out / "prepare.log")
    prepared = json.loads((out / "prepared.json").read_text())

    hook = MlflowHook(tracking_uri=tracking_uri)
    run_id = hook.get_or_create_run(spec.experiment_name, spec.dag_id, "bare")
    identity = JobIdentity(spec.dag_id, "bare", "train", 1)
    checkpoints = str(out / "checkpoints")
    job = build_training_job(spec, prepared["dataset_dir"], checkpoints, identity,
                             {"MLFLOW_RUN_ID": run_id, "MLFLOW_TRACKING_URI": tracking_uri})
    (out / "job.json").write_text(json.dumps(job.config))
    argv = torchrun_argv(job, str(out / "job.json"), launcher=python_torchrun(sys.executable))
    seconds["train"] = timed(argv, {**env, **rank_env(job, str(out / "result.json")), **job.env},
                             out / "train.log")
    final_step = json.loads((out / "result.json").read_text())["final_step"]

    (out / "expected.json").write_text(json.dumps(expected_job_config(
        spec, prepared["dataset_dir"], checkpoints, spec.dag_id, "bare", "train")))
    argv = validator_argv(sys.executable, spec, checkpoints, prepared["dataset_dir"],
                          str(out / "report.json"), str(out / "expected.json"), final_step,
                          prepared["vocab_size"])
    seconds["validate_checkpoint"] = timed(argv, env, out / "validate.log")
    report = json.loads((out / "report.json").read_text())

    started = time.monotonic()
    timed([sys.executable, "-m", "trainforge.trainer.export", "--checkpoint",
           report["checkpoint"], "--dataset", prepared["dataset_dir"], "--out", str(out / "hf")],
          env, out / "export.log")
    timed([sys.executable, __file__, "--bare-register", tracking_uri, run_id, str(out / "hf"),
           spec.registry.model_name + "-bare", report["checkpoint_digest"]],
          env, out / "register.log")
    seconds["register_model"] = time.monotonic() - started
    return seconds


def bare_prepare(settings_file: str, output_root: str, result_file: str) -> None:
    """Child: the data step alone."""
    from trainforge.data.prepare import prepare_dataset

    prepared = prepare_dataset(pickle.loads(Path(settings_file).read_bytes()), output_root)
    Path(result_file).write_text(json.dumps({"dataset_dir": str(prepared.path),
                                             "vocab_size": prepared.manifest["vocab_size"]}))


def bare_register(tracking_uri: str, run_id: str, model_dir: str, name: str, digest: str) -> None:
    """Child: the registration call alone."""
    from trainforge.hooks.mlflow import MlflowHook

    MlflowHook(tracking_uri=tracking_uri).register_model_version(
        run_id=run_id, model_dir=model_dir, registered_model_name=name,
        idempotency_key=f"{run_id}:{digest}", aliases=["challenger"])


def pipeline(spec_file: Path, home: Path, tracking_uri: str) -> dict:
    """``trainforge run``; its summary with ``wall_seconds`` and per-task seconds."""
    home.mkdir(parents=True)
    summary = home / "summary.json"
    env = {**os.environ, "TRAINFORGE_HOME": str(home), "MLFLOW_TRACKING_URI": tracking_uri}
    cli = Path(sys.executable).with_name("trainforge")
    timed([str(cli), "run", str(spec_file), "--summary-json", str(summary)], env,
          home / "run.log")
    return json.loads(summary.read_text())


def ledger_figures(tracking_uri: str, run_id: str | None) -> dict[str, float]:
    """The ledger metrics of :data:`LEDGER_METRICS` on the DAG run's MLflow run, if logged."""
    if run_id is None:
        return {}
    import mlflow

    metrics = mlflow.MlflowClient(tracking_uri).get_run(run_id).data.metrics
    return {k: v for k, v in metrics.items() if k in LEDGER_METRICS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--corpus-mib", type=float, default=2.0)
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args()
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="trainforge-bench-pipeline-"))
    try:
        run(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"total {time.monotonic() - started:.0f} s" + (f" (kept {work})" if args.keep else ""))


def run(args: argparse.Namespace, work: Path) -> None:
    import data_prep

    from trainforge.mlflow_setup import start_server

    corpus = work / "corpus.jsonl"
    data_prep.write_corpus(corpus, args.corpus_mib, seed=4)
    spec_file = work / "bench_pipeline.yaml"
    spec_file.write_text(SPEC.format(name="bench_pipeline", corpus=corpus, steps=args.max_steps,
                                     checkpoint_every=args.checkpoint_every))
    with start_server(work / "mlflow", host="127.0.0.1", port=0, timeout_s=300) as server:
        seconds = bare(spec_file, work / "home-bare", server.url)
        print("bare: " + ", ".join(f"{task} {s:.1f} s" for task, s in seconds.items()),
              flush=True)
        summary = pipeline(spec_file, work / "home-pipeline", server.url)
        ledger = ledger_figures(server.url, summary.get("mlflow_run_id"))
    report(seconds, summary, ledger)


def report(bare_s: dict[str, float], summary: dict, ledger: dict[str, float]) -> None:
    stages = summary.get("stages", {})
    if summary.get("state") != "success":
        sys.exit(f"the pipeline run did not succeed: {summary.get('state')}; tasks {stages}")

    def allowed(base: float, tasks: int) -> float:
        return max(base * GOAL_RATIO, base + GOAL_SECONDS * tasks)

    def ledger_of(task: str) -> str:
        if task != "train":
            return "n/a"
        found = [f"{k.split('/')[1]} {ledger[k]:.1f} s" for k in LEDGER_METRICS if k in ledger]
        return ", ".join(found) or "n/a"

    print(f"{'task':22s} {'bare s':>8s} {'pipeline s':>11s} {'extra s':>8s} {'ratio':>6s} "
          f"{'goal':>9s}  ledger")
    total_bare = total_pipe = 0.0
    for task in STAGES:
        base, piped = bare_s[task], stages[task]["seconds"]
        total_bare, total_pipe = total_bare + base, total_pipe + piped
        verdict = "ok" if piped <= allowed(base, 1) else "MISSED"
        print(f"{task:22s} {base:8.1f} {piped:11.1f} {piped - base:8.1f} {piped / base:6.2f} "
              f"{verdict:>9s}  {ledger_of(task)}")
    verdict = "ok" if total_pipe <= allowed(total_bare, len(STAGES)) else "MISSED"
    print(f"{'stage tasks':22s} {total_bare:8.1f} {total_pipe:11.1f} "
          f"{total_pipe - total_bare:8.1f} {total_pipe / total_bare:6.2f} {verdict:>9s}")
    for task, entry in summary.get("teardown", {}).items():
        print(f"{task:22s} {'-':>8s} {entry['seconds']:11.1f}   (teardown, no bare counterpart)")
    print(f"pipeline / bare over the stage tasks = {total_pipe / total_bare:.2f} (goal: at most "
          f"{GOAL_RATIO:.2f}, or {GOAL_SECONDS:.0f} s per task more, whichever is larger); "
          f"trainforge run wall {summary.get('wall_seconds')} s (Airflow start-up and parsing "
          f"included) against {total_bare:.1f} s bare; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--bare-prepare"]:
        bare_prepare(*sys.argv[2:5])
    elif sys.argv[1:2] == ["--bare-register"]:
        bare_register(*sys.argv[2:7])
    else:
        main()
