"""Trainer startup: process start to the first step, against a bare script, measured in the same run.

    .venv/bin/python bench/trainer_startup.py [--rounds 3] [--nproc 1] [--hidden-size 64]
                                              [--num-layers 2] [--seq-len 64] [--keep]

A small generated corpus (bench/data_prep.py's, 0.25 MiB) is prepared once. Then, ``--rounds``
times, in alternating order (ours first in odd rounds, the bare script first in even ones), two
torchrun jobs of ``--nproc`` processes (gloo on CPU, one torch thread each) start the same tiny
model and take one optimizer step:

* ours: ``torchrun -m trainforge.trainer.train`` with a job config of that model (no MLflow, a
  checkpoint only at the end); its figure is ``program_startup``, the ``startup`` seconds of rank
  0's run-ledger record (process start, as the OS records it, to the first step beginning);
* bare: this file under torchrun: imports torch and ``transformers``' ``LlamaForCausalLM``, starts
  the gloo process group, builds the same model, wraps it in DDP, makes AdamW; its figure is the
  same span on the same clock (`trainforge.trainer.startup.process_started_at` to the first forward).

First, ``--rounds`` times each, the CPU and wall seconds of a fresh interpreter that imports the
trainer program and exits (``python -m trainforge.trainer.train --help``) beside one that runs
``import torch`` + ``from transformers import LlamaForCausalLM`` (what any script pays), and
their CPU ratio. Then each round, with the trainer's own startup
phases (its "startup:" and "process group up:" log lines), and the median over rounds of ours /
bare (1.0: the trainer's start costs no more than the bare script's; below: less).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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

#: Seconds one torchrun job may take.
JOB_TIMEOUT_S = 600
#: What each side imports, as a fresh interpreter's arguments: the trainer program up to its
#: argument parsing (``--help`` exits there), and what any script of the model needs.
IMPORTS = {"ours": ("-m", "trainforge.trainer.train", "--help"),
           "bare": ("-c", "import torch; from transformers import LlamaForCausalLM")}


def job_config(args: argparse.Namespace, dataset: Path, checkpoints: Path) -> dict:
    """A trainforge.job/v1 config (docs/contracts.md) of a tiny model, one step."""
    return {
        "format": "trainforge.job/v1",
        "identity": {"dag_id": "bench", "run_id": "bench__1", "task_id": "train", "try_number": 1},
        "data": {"dataset_dir": str(dataset), "sequence_length": args.seq_len},
        "model": {"family": "llama", "hidden_size": args.hidden_size,
                  "num_layers": args.num_layers, "num_heads": 4, "num_kv_heads": 4,
                  "intermediate_size": 4 * args.hidden_size, "rope_theta": 10000.0,
                  "dropout": 0.0, "tie_word_embeddings": True},
        "optim": {"max_steps": 1, "global_batch_size": 4 * args.nproc, "micro_batch_size": 4,
                  "learning_rate": 3e-3, "min_learning_rate": 3e-4, "warmup_steps": 0,
                  "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0,
                  "seed": 1234},
        "precision": "fp32",
        "checkpoint": {"dir": str(checkpoints), "interval_steps": 100, "keep_last": 1},
        "logging": {"log_every_steps": 1},
        "distributed": {"backend": "gloo", "collective_timeout_s": 120},
    }


def torchrun(nproc: int, *argv: str, env: dict[str, str]) -> str:
    """Run a torchrun job of ``nproc`` processes; returns its stdout (exits on failure)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", *argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")} | env
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                              timeout=JOB_TIMEOUT_S, env={**env, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired as err:
        sys.exit(f"{' '.join(argv[:2])} did not finish in {JOB_TIMEOUT_S} s:\n"
                 f"{str(err.stdout or '')[-3000:]}")
    if proc.returncode:
        sys.exit(f"{' '.join(argv[:2])} failed ({proc.returncode}):\n"
                 f"{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout


def ours(args: argparse.Namespace, config: Path, job_dir: Path) -> tuple[float, str]:
    """The trainer's ``program_startup`` seconds (rank 0's ledger record) and its startup line."""
    out = torchrun(args.nproc, "-m", "trainforge.trainer.train", "--config", str(config),
                   env={"TRAINFORGE_JOB_DIR": str(job_dir)})
    [record] = (job_dir / "ledger").glob("attempt-*.json")
    seconds = json.loads(record.read_text())["seconds"]["startup"]
    line = next((ln.split("startup: ", 1)[1] for ln in out.splitlines() if "startup: " in ln), "")
    group = next((ln.rsplit("(", 1)[1].rstrip(")") for ln in out.splitlines() if "process group up:" in ln), "")
    return seconds, f"{line}; process group: {group}" if group else line


def bare(args: argparse.Namespace, config: Path) -> float:
    """The bare script's seconds from process start to its first step."""
    out = torchrun(args.nproc, __file__, "--bare-start", str(config), env={})
    return json.loads(out.strip().splitlines()[-1])["startup_s"]


def bare_start(config_path: str) -> None:
    """Child, under torchrun: the plain start of a DDP training script, then one step."""
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
    optimizer = torch.optim.AdamW(model.parameters(), lr=o["learning_rate"])
    x = torch.randint(0, manifest["vocab_size"], (o["micro_batch_size"], seq + 1))
    first_step_at = time.time()  # the first step begins
    from trainforge.trainer.startup import process_started_at  # the trainer's clock (stdlib only)

    startup_s = first_step_at - process_started_at()
    logits = model(input_ids=x[:, :-1], use_cache=False).logits
    F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).backward()
    optimizer.step()
    if dist.get_rank() == 0:
        print(json.dumps({"startup_s": startup_s}), flush=True)
    dist.barrier()
    del model, optimizer  # gloo can hang at exit when a DDP model outlives the process group
    dist.destroy_process_group()


def import_seconds(argv: tuple[str, ...]) -> tuple[float, float]:
    """(CPU, wall) seconds of a fresh interpreter run with ``argv``, start to exit (CPU time is
    the steadier figure on a shared machine)."""
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run([sys.executable, *argv], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, wall


def prepare(work: Path) -> Path:
    """A small generated corpus, tokenized with the data step; returns the dataset folder."""
    import data_prep

    from trainforge.data import prepare_dataset

    corpus = work / "corpus.jsonl"
    data_prep.write_corpus(corpus, 0.25, seed=3)
    return prepare_dataset(data_prep.settings(str(corpus)), work / "datasets").path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=1, help="processes per torchrun job")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args()
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="trainforge-bench-startup-"))
    try:
        run(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"total {time.monotonic() - started:.0f} s" + (f" (kept {work})" if args.keep else ""))


def run(args: argparse.Namespace, work: Path) -> None:
    dataset = prepare(work)
    imports = {"ours": [], "bare": []}
    for number in range(args.rounds):
        for kind in ("ours", "bare") if number % 2 == 0 else ("bare", "ours"):
            imports[kind].append(import_seconds(IMPORTS[kind]))
    for kind, argv in IMPORTS.items():
        cpu, wall = (statistics.median(x[i] for x in imports[kind]) for i in (0, 1))
        print(f"`python {' '.join(argv)}`: {cpu:.2f} s CPU, {wall:.2f} s wall (median of {args.rounds})")
    cpu_ratio = statistics.median(c for c, _ in imports["ours"]) / statistics.median(c for c, _ in imports["bare"])
    print(f"imports, CPU seconds, trainer / bare script = {cpu_ratio:.3f}")
    ratios = []
    for number in range(args.rounds):
        config = work / f"job-{number}.json"
        config.write_text(json.dumps(job_config(args, dataset, work / f"checkpoints-{number}")))
        seconds, line = {}, ""
        for kind in ("ours", "bare") if number % 2 == 0 else ("bare", "ours"):
            if kind == "ours":
                seconds["ours"], line = ours(args, config, work / f"job-{number}")
            else:
                seconds["bare"] = bare(args, config)
        ratios.append(seconds["ours"] / seconds["bare"])
        print(f"round {number + 1}: ours {seconds['ours']:.2f} s (program_startup), bare script "
              f"{seconds['bare']:.2f} s -> ours/bare {ratios[-1]:.3f}; trainer phases: {line}")
    print(f"process start -> first step, trainer / bare script = {statistics.median(ratios):.3f} "
          f"({args.rounds} round(s), {args.nproc} process(es), gloo on CPU; load average "
          f"{os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--bare-start"]:
        bare_start(sys.argv[2])
    else:
        main()
