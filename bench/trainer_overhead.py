"""Trainer overhead: our trainer against a bare PyTorch DDP loop, measured in the same run.

    .venv/bin/python bench/trainer_overhead.py [--steps 60] [--rounds 2] [--hidden-size 192]
                                               [--num-layers 4] [--num-heads 6] [--seq-len 128]
                                               [--global-batch 32] [--micro-batch 8]
                                               [--checkpoint-every 20] [--no-mlflow] [--keep]

A generated corpus (bench/data_prep.py's, 2 MiB, vocabulary 8192) is prepared once. Then, ``--rounds`` times, in
alternating order (ours first in odd rounds, the bare loop first in even ones), two torchrun
jobs of 2 processes (gloo on CPU, one torch thread each) train the same model on it:

* ours: ``torchrun -m trainforge.trainer.train`` with a job config of the demo's model
  (dags/pipelines/shakespeare_llm.yaml by default), logging every 10 steps to an MLflow run
  (a SQLite store in the work folder; ``--no-mlflow``: none) and writing a checkpoint every
  ``--checkpoint-every`` steps, as a pipeline's train task does;
* bare: this file under torchrun: the same ``transformers`` ``LlamaForCausalLM`` (same config,
  SDPA attention, fp32), DDP over gloo, AdamW with the same groups and hyper-parameters, the
  same micro-batch, gradient accumulation (``no_sync``) and clipping, random windows of the same
  token shards; no logging, no checkpoints, no per-step collective beyond DDP's.

Throughput is tokens per second from rank 0's clock between step 10 (after warm-up) and the
last step: for ours the time stamps of its step log lines (so the checkpoints written in
between count), for the bare loop its own ``perf_counter`` per step. Prints each run, then the
median over rounds of ours / bare (goal >= 0.97).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

#: The first step of the measured window (earlier steps warm up allocators and caches).
WARMUP_STEPS = 10
LOG_EVERY = 10
#: Seconds one torchrun job may take.
JOB_TIMEOUT_S = 1800
# "2026-11-29 22:24:19,196 rank0 INFO trainforge.trainer.train: step 70/400 | loss ..."
STEP_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank0 INFO "
                       r"trainforge\.trainer\.train: step (\d+)/\d+ \|")


def job_config(args: argparse.Namespace, dataset: Path, checkpoints: Path) -> dict:
    """A trainforge.job/v1 config (docs/contracts.md) for the benchmark's model and batch."""
    return {
        "format": "trainforge.job/v1",
        "identity": {"dag_id": "bench", "run_id": "bench__1", "task_id": "train", "try_number": 1},
        "data": {"dataset_dir": str(dataset), "sequence_length": args.seq_len},
        "model": {"family": "llama", "hidden_size": args.hidden_size,
                  "num_layers": args.num_layers, "num_heads": args.num_heads,
                  "num_kv_heads": args.num_heads, "intermediate_size": 4 * args.hidden_size,
                  "rope_theta": 10000.0, "dropout": 0.0, "tie_word_embeddings": True},
        "optim": {"max_steps": args.steps, "global_batch_size": args.global_batch,
                  "micro_batch_size": args.micro_batch, "learning_rate": 3e-3,
                  "min_learning_rate": 3e-4, "warmup_steps": 5, "weight_decay": 0.1,
                  "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0, "seed": 1234},
        "precision": "fp32",
        "checkpoint": {"dir": str(checkpoints), "interval_steps": args.checkpoint_every,
                       "keep_last": 2},
        "logging": {"log_every_steps": LOG_EVERY},
        "distributed": {"backend": "gloo", "collective_timeout_s": 120},
    }


def torchrun(*argv: str, env: dict[str, str]) -> str:
    """Run a 2-process torchrun job; returns its stdout (exits with its stderr on failure)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           *argv]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                              timeout=JOB_TIMEOUT_S,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    except subprocess.TimeoutExpired as err:
        sys.exit(f"{' '.join(argv[:2])} did not finish in {JOB_TIMEOUT_S} s:\n"
                 f"{str(err.stdout or '')[-3000:]}")
    if proc.returncode:
        sys.exit(f"{' '.join(argv[:2])} failed ({proc.returncode}):\n"
                 f"{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout


def ours(config: Path, env: dict[str, str], tokens_per_step: int) -> float:
    """Our trainer's tokens/s between step WARMUP_STEPS and the last, from its log lines."""
    out = torchrun("-m", "trainforge.trainer.train", "--config", str(config), env=env)
    stamps = {int(m[2]): dt.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
              for m in STEP_LINE.finditer(out)}
    last = max(stamps)
    return (last - WARMUP_STEPS) * tokens_per_step / (stamps[last] - stamps[WARMUP_STEPS])


def bare(config: Path, tokens_per_step: int) -> float:
    """The bare loop's tokens/s over the same steps."""
    out = torchrun(__file__, "--bare-loop", str(config), env={})
    times = json.loads(out.strip().splitlines()[-1])["step_end_s"]
    return (len(times) - WARMUP_STEPS) * tokens_per_step / (times[-1] - times[WARMUP_STEPS - 1])


def bare_loop(config_path: str) -> None:
    """Child, under torchrun: the plain DDP training loop of the module doc."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads(Path(config_path).read_text())
    m, o, seq = cfg["model"], cfg["optim"], cfg["data"]["sequence_length"]
    manifest = json.loads((Path(cfg["data"]["dataset_dir"]) / "manifest.json").read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = np.concatenate([
        np.fromfile(Path(cfg["data"]["dataset_dir"]) / s["file"], dtype=manifest["dtype"])
        for s in manifest["splits"]["train"]["shards"]]).astype(np.int64)
    eos = manifest["eos_id"]
    torch.manual_seed(o["seed"])
    config = LlamaConfig(
        vocab_size=manifest["vocab_size"], hidden_size=m["hidden_size"],
        intermediate_size=m["intermediate_size"], num_hidden_layers=m["num_layers"],
        num_attention_heads=m["num_heads"], num_key_value_heads=m["num_kv_heads"],
        max_position_embeddings=seq,
        rope_parameters={"rope_type": "default", "rope_theta": m["rope_theta"]},
        attention_dropout=m["dropout"], tie_word_embeddings=m["tie_word_embeddings"],
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, use_cache=False)
    config._attn_implementation = "sdpa"
    model = DistributedDataParallel(LlamaForCausalLM(config))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o["weight_decay"]},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=o["learning_rate"], betas=(o["beta1"], o["beta2"]), eps=1e-8)
    micro = o["micro_batch_size"]
    accum = o["global_batch_size"] // (micro * world)
    rng = np.random.default_rng(o["seed"] + rank)
    step_end_s = []
    model.train()
    for _ in range(o["max_steps"]):
        for a in range(accum):
            starts = rng.integers(0, tokens.size - seq - 1, size=micro)
            window = torch.from_numpy(np.stack([tokens[s:s + seq + 1] for s in starts]))
            x, y = window[:, :-1], window[:, 1:]
            # gradients are reduced on the last micro-batch only, as the trainer does
            with model.no_sync() if a < accum - 1 else contextlib.nullcontext():
                logits = model(input_ids=x, use_cache=False).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / accum
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_end_s.append(time.perf_counter())
    if rank == 0:
        print(json.dumps({"step_end_s": step_end_s}), flush=True)
    dist.barrier()
    del model, optimizer  # gloo can hang at exit when a DDP model outlives the process group
    dist.destroy_process_group()


def prepare(work: Path, seq_len: int) -> Path:
    """A generated corpus, tokenized with the data step; returns the dataset folder."""
    import data_prep

    from trainforge.data import prepare_dataset

    corpus = work / "corpus.jsonl"
    data_prep.write_corpus(corpus, 2.0, seed=3)
    result = prepare_dataset(data_prep.settings(str(corpus)), work / "datasets")
    print(f"dataset: {result.tokens['train']} train tokens, vocab "
          f"{result.manifest['vocab_size']}, sequences of {seq_len}")
    return result.path


def mlflow_run(work: Path) -> dict[str, str]:
    """A new MLflow run in a SQLite store under ``work``, as the train task's environment names
    it."""
    import mlflow

    uri = f"sqlite:///{work / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    found = client.get_experiment_by_name("bench-trainer-overhead")
    experiment = found.experiment_id if found else client.create_experiment(
        "bench-trainer-overhead", artifact_location=str(work / "artifacts"))
    run = client.create_run(experiment)
    return {"MLFLOW_TRACKING_URI": uri, "MLFLOW_RUN_ID": run.info.run_id}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=192)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--no-mlflow", action="store_true", help="ours logs to no MLflow run")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args()
    if args.steps < WARMUP_STEPS + LOG_EVERY:
        parser.error(f"--steps must be at least {WARMUP_STEPS + LOG_EVERY}")
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="trainforge-bench-trainer-"))
    try:
        run(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"total {time.monotonic() - started:.0f} s" + (f" (kept {work})" if args.keep else ""))


def run(args: argparse.Namespace, work: Path) -> None:
    dataset = prepare(work, args.seq_len)
    tokens_per_step = args.global_batch * args.seq_len
    ratios = []
    for number in range(args.rounds):
        checkpoints = work / f"checkpoints-{number}"
        config = work / f"job-{number}.json"
        config.write_text(json.dumps(job_config(args, dataset, checkpoints)))
        env = {} if args.no_mlflow else mlflow_run(work)
        rates = {}
        for kind in ("ours", "bare") if number % 2 == 0 else ("bare", "ours"):
            rates[kind] = (ours(config, env, tokens_per_step) if kind == "ours"
                           else bare(config, tokens_per_step))
        shutil.rmtree(checkpoints, ignore_errors=True)
        ratios.append(rates["ours"] / rates["bare"])
        print(f"round {number + 1}: ours {rates['ours']:,.0f} tokens/s, bare DDP loop "
              f"{rates['bare']:,.0f} tokens/s -> ours/bare {ratios[-1]:.3f}")
    print(f"trainer tokens/s / bare DDP loop = {statistics.median(ratios):.3f} (goal >= 0.97; "
          f"{args.rounds} round(s), checkpoint every {args.checkpoint_every} steps, "
          f"{'no MLflow' if args.no_mlflow else 'MLflow logging'} every {LOG_EVERY}; "
          f"load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--bare-loop"]:
        bare_loop(sys.argv[2])
    else:
        main()
