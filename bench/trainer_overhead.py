"""Trainer overhead: our trainer against a bare PyTorch DDP loop, measured in the same run.

    .venv/bin/python bench/trainer_overhead.py [--steps 60] [--rounds 2] [--hidden-size 192]
                                               [--num-layers 4] [--num-heads 6] [--seq-len 128]
                                               [--global-batch 32] [--micro-batch 8]
                                               [--checkpoint-every 20] [--no-mlflow] [--keep]
                                               [--pretrained qwen3] [--lora]

A generated corpus (bench/data_prep.py's, 2 MiB, vocabulary 8192) is prepared once. Then,
``--rounds`` times in alternating order, two torchrun jobs of 2 gloo processes (one torch thread
each) train the same model on it: ours (``-m trainforge.trainer.train`` with the demo's model,
MLflow logging every 10 steps unless ``--no-mlflow``, a checkpoint every ``--checkpoint-every``
steps, as a train task does) and a bare loop (this file: the same transformers model, SDPA, fp32,
DDP, AdamW groups, micro-batch, accumulation and clipping; no logging, no checkpoints).
``--pretrained qwen3``: open weights of another family instead, a Qwen3-shaped folder made here
(random bf16 shards, the dataset's tokenizer; half the KV heads, tied embeddings), which ours
loads through the job config's ``pretrained`` section and the bare loop with ``from_pretrained``.
``--lora``: LoRA on that folder, ours through the job config's ``peft`` section, the bare loop
through ``peft.get_peft_model`` (docs/benchmarks.md). Both loops draw the trainer's batches.

Throughput: tokens/s on rank 0's clock from step 10 to the last (ours: its step log lines' time
stamps, so checkpoints count). Prints each run, then the median of ours / bare and the verdict
on the goal (>= 0.97).
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
GOAL = 0.97
#: ``--lora``: the job config's ``peft`` section (targets ``auto``: the attention and MLP projections).
LORA = {"method": "lora", "r": 16, "alpha": 32.0, "dropout": 0.05, "target_modules": "auto", "merge": True}
#: What ``auto`` names for Qwen3 and Llama, written out for the bare loop's ``peft.LoraConfig``.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# "2026-11-29 22:24:19,196 rank0 INFO trainforge.trainer.train: step 70/400 | loss ..."
STEP_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank0 INFO "
                       r"trainforge\.trainer\.train: step (\d+)/\d+ \|")


def job_config(args: argparse.Namespace, dataset: Path, checkpoints: Path, folder: Path | None = None) -> dict:
    """A trainforge.job/v1 config (docs/contracts.md) for the benchmark's model and batch; with
    ``folder``, the model is that open-weights folder's (a ``pretrained`` section)."""
    config = {
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
    if folder is not None:
        config["model"] = {"family": "pretrained", "dropout": None}
        config["pretrained"] = {"folder": str(folder), "source": str(folder), "revision": None}
    if args.lora:
        config["peft"] = dict(LORA)
    return config


def make_pretrained(family: str, args: argparse.Namespace, dataset: Path, dest: Path) -> Path:
    """An open-weights folder of ``family`` (Qwen3) for the benchmark's shape, with random bf16
    weights (bench/pretrained_load.py's `make_checkpoint`) and the dataset's tokenizer.json, so the
    trainer's tokenizer check holds."""
    import pretrained_load
    from transformers import Qwen3Config

    if family != "qwen3":
        raise ValueError(f"--pretrained {family}: only qwen3")
    manifest = json.loads((dataset / "manifest.json").read_text())
    eos, heads = manifest["eos_id"], args.num_heads
    config = Qwen3Config(
        vocab_size=manifest["vocab_size"], hidden_size=args.hidden_size, intermediate_size=3 * args.hidden_size,
        num_hidden_layers=args.num_layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        head_dim=args.hidden_size // heads, max_position_embeddings=max(args.seq_len, 512),
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    pretrained_load.make_checkpoint(dest, config, shards=3)
    shutil.copyfile(dataset / manifest["tokenizer"]["file"], dest / "tokenizer.json")
    return dest


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


def bare_batches(tokens, cfg: dict, step: int, rank: int, world: int) -> list:
    """This rank's micro-batches of optimizer step ``step`` (0-based), by the trainer's recipe
    (trainforge/trainer/data.py's docstring) over ``tokens``, the train split in order:
    [(x, y)], each (micro_batch, seq_len) int64, y = x shifted left by one."""
    import numpy as np
    import torch

    o, seq = cfg["optim"], cfg["data"]["sequence_length"]
    micro = o["micro_batch_size"]
    per_rank = o["global_batch_size"] // world
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([o["seed"], step])))
    starts = rng.integers(0, tokens.size - seq, size=o["global_batch_size"], dtype=np.int64)
    mine = starts[rank * per_rank:(rank + 1) * per_rank]
    out = []
    for a in range(per_rank // micro):
        window = torch.from_numpy(np.stack([tokens[s:s + seq + 1] for s in mine[a * micro:(a + 1) * micro]]))
        out.append((window[:, :-1], window[:, 1:]))
    return out


def bare_loop(config_path: str) -> None:
    """Child, under torchrun: the plain DDP training loop of the module doc."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    cfg = json.loads(Path(config_path).read_text())
    o = cfg["optim"]
    manifest = json.loads((Path(cfg["data"]["dataset_dir"]) / "manifest.json").read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = np.concatenate([
        np.fromfile(Path(cfg["data"]["dataset_dir"]) / s["file"], dtype=manifest["dtype"])
        for s in manifest["splits"]["train"]["shards"]]).astype(np.int64)
    torch.manual_seed(o["seed"])
    model = DistributedDataParallel(bare_model(cfg, manifest))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o["weight_decay"]},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=o["learning_rate"], betas=(o["beta1"], o["beta2"]), eps=1e-8)
    accum = o["global_batch_size"] // (o["micro_batch_size"] * world)
    step_end_s = []
    model.train()
    for step in range(o["max_steps"]):
        for a, (x, y) in enumerate(bare_batches(tokens, cfg, step, rank, world)):
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


def bare_model(cfg: dict, manifest: dict):
    """The bare loop's fp32 model: the job's pretrained folder loaded by plain transformers (with a
    ``peft`` section, wrapped by ``peft.get_peft_model``: only the adapters train), else a fresh
    ``LlamaForCausalLM`` of the job's model section (the same config as ours builds)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if "pretrained" in cfg:
        model = AutoModelForCausalLM.from_pretrained(cfg["pretrained"]["folder"], dtype=torch.float32,
                                                     attn_implementation="sdpa", use_cache=False)
        if "peft" not in cfg:
            return model
        import peft

        lora = cfg["peft"]
        return peft.get_peft_model(model, peft.LoraConfig(
            r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], target_modules=LORA_TARGETS,
            bias="none"))
    m, eos = cfg["model"], manifest["eos_id"]
    config = LlamaConfig(
        vocab_size=manifest["vocab_size"], hidden_size=m["hidden_size"],
        intermediate_size=m["intermediate_size"], num_hidden_layers=m["num_layers"],
        num_attention_heads=m["num_heads"], num_key_value_heads=m["num_kv_heads"],
        max_position_embeddings=cfg["data"]["sequence_length"],
        rope_parameters={"rope_type": "default", "rope_theta": m["rope_theta"]},
        attention_dropout=m["dropout"], tie_word_embeddings=m["tie_word_embeddings"],
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, use_cache=False)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


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
    parser.add_argument("--pretrained", choices=["qwen3"], default=None,
                        help="train an open-weights folder of this family (made here) instead of the spec's Llama")
    parser.add_argument("--lora", action="store_true",
                        help="fine-tune the open-weights folder (--pretrained, default qwen3) with LoRA adapters, "
                             "against a bare peft loop")
    args = parser.parse_args()
    if args.lora and args.pretrained is None:
        args.pretrained = "qwen3"
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
    folder = make_pretrained(args.pretrained, args, dataset, work / args.pretrained) if args.pretrained else None
    model = f"open weights, {args.pretrained}-shaped (random bf16 shards)" if folder else "the spec's Llama"
    if args.lora:
        model += f", LoRA r={LORA['r']} alpha={LORA['alpha']:g} dropout={LORA['dropout']:g} on {','.join(LORA_TARGETS)}"
    loop = "bare peft DDP loop" if args.lora else "bare DDP loop"
    tokens_per_step = args.global_batch * args.seq_len
    ratios = []
    for number in range(args.rounds):
        checkpoints = work / f"checkpoints-{number}"
        config = work / f"job-{number}.json"
        config.write_text(json.dumps(job_config(args, dataset, checkpoints, folder)))
        env = {} if args.no_mlflow else mlflow_run(work)
        rates = {}
        for kind in ("ours", "bare") if number % 2 == 0 else ("bare", "ours"):
            rates[kind] = (ours(config, env, tokens_per_step) if kind == "ours"
                           else bare(config, tokens_per_step))
        shutil.rmtree(checkpoints, ignore_errors=True)
        ratios.append(rates["ours"] / rates["bare"])
        print(f"round {number + 1}: ours {rates['ours']:,.0f} tokens/s, {loop} "
              f"{rates['bare']:,.0f} tokens/s -> ours/bare {ratios[-1]:.3f}")
    ratio = statistics.median(ratios)
    print(f"trainer tokens/s / {loop} = {ratio:.3f} (goal >= {GOAL}: {'met' if ratio >= GOAL else 'NOT met'}; "
          f"{model}, {args.rounds} round(s), checkpoint every {args.checkpoint_every} steps, "
          f"{'no MLflow' if args.no_mlflow else 'MLflow logging'} every {LOG_EVERY}; "
          f"load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--bare-loop"]:
        bare_loop(sys.argv[2])
    else:
        main()
