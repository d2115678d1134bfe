"""Loading open weights: the trainer's load of a sharded bf16 checkpoint against a raw read of the
same files, and the peak host memory per rank when the loaded model is sharded with FSDP2.

    .venv/bin/python bench/pretrained_load.py [--size-gb 1.0] [--rounds 5] [--threads N] [--dir DIR]

Makes (once per shape, kept in ``--dir``; default a temporary folder) a Llama-shaped model of
about ``--size-gb`` GB of random bf16 weights in Hugging Face layout (config.json, safetensors
shards and their index). Then, in one run:

* ``--rounds`` times in alternating order: the trainer's load (`read_config` + `load_pretrained`,
  fp32 on the CPU) and a raw read of the same shards (safetensors ``load_file`` of each, every
  tensor converted to fp32: what any loader must at least do); the median of trainer / raw
  throughput (goal >= 0.8);
* under torchrun, 2 gloo ranks on the CPU, FSDP2 ``fully_shard`` of each decoder layer and the
  root (as trainer/parallel.py does): each rank's peak resident memory (``ru_maxrss``: the
  memory-mapped shards' pages count too) less its RSS once torch and transformers are imported
  (what the model costs, not the interpreter), over the model's fp32 size (goal <= 0.6), for each
  path the trainer has: ``load-then-shard`` (`load_pretrained`, then ``fully_shard``) and, where
  trainforge.trainer.pretrained has ``fill_shards``, ``shard-then-fill`` (``build_empty`` on
  meta, ``fully_shard``, then each rank reads its rows: the trainer's FSDP2 start). The goal is
  judged on the last path measured.

About a minute at the default size on 2 cores. `make_checkpoint` is also what bench/gpu_proof.py
and bench/trainer_overhead.py make their pretrained folders with.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GOAL_RATIO = 0.8
GOAL_MEMORY = 0.6
INDEX = "model.safetensors.index.json"
VOCAB = 32000
CHILD_TIMEOUT_S = 900


def pretrained_model():
    """The model section of a job whose model is a pretrained folder's: ``{"family": "pretrained",
    "dropout": null}``."""
    from trainforge.trainer.config import ModelConfig

    return ModelConfig(family="pretrained", hidden_size=None, num_layers=None, num_heads=None, num_kv_heads=None,
                       intermediate_size=None, rope_theta=None, dropout=None, tie_word_embeddings=None)


def llama_shape(size_gb: float) -> dict:
    """A Llama shape (head size 64, 4 query heads per KV head, untied, vocabulary 32000) of about
    ``size_gb`` GB in bf16: the widest hidden size (2048 down to 128) that gives at least 4
    layers, with as many layers as the size allows."""
    target = size_gb * 1e9 / 2  # parameters
    for hidden in (2048, 1536, 1024, 768, 512, 384, 256, 128):
        inter = math.ceil(2.75 * hidden / 64) * 64
        kv_dim = hidden // 4
        per_layer = 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * inter + 2 * hidden
        layers = round((target - 2 * VOCAB * hidden - hidden) / per_layer)
        if layers >= 4 or hidden == 128:
            return {"hidden_size": hidden, "num_layers": max(1, layers), "num_heads": hidden // 64,
                    "num_kv_heads": hidden // 256 or 1, "intermediate_size": inter, "vocab_size": VOCAB}
    raise AssertionError("unreachable")


def llama_config(shape: dict):
    """The `LlamaConfig` of a `llama_shape`."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                       intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_layers"],
                       num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
                       max_position_embeddings=4096, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0})


def make_checkpoint(dest: Path, config, *, shards: int = 4, device: str = "cpu", seed: int = 0) -> Path:
    """Save a causal LM of ``config`` with random bf16 weights (matrices N(0, 0.02), vectors 1) in
    Hugging Face layout into ``dest``: config.json, ``shards`` or more safetensors files and their
    index. Built on the meta device and filled on ``device`` (no fp32 copy); no tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                param.normal_(0.0, 0.02, generator=gen)
            else:
                param.fill_(1.0)
    model.tie_weights()  # to_empty gives each parameter its own storage: tied ones again
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(dest, max_shard_size=max(1, total // shards))
    return dest


def ensure_checkpoint(root: Path, shape: dict) -> Path:
    """The checkpoint of ``shape`` under ``root``, made once (a later run with the same shape
    reuses it)."""
    name = "llama-h{hidden_size}-l{num_layers}-a{num_heads}-k{num_kv_heads}-i{intermediate_size}-v{vocab_size}".format(
        **shape)
    folder = root / name
    if (folder / INDEX).is_file():
        return folder
    partial = root / f"{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    started = time.perf_counter()
    make_checkpoint(partial, llama_config(shape), shards=5)
    partial.rename(folder)
    print(f"made {folder.name} in {time.perf_counter() - started:.0f} s", flush=True)
    return folder


def shards_of(folder: Path) -> list[Path]:
    weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
    return [folder / name for name in sorted(set(weight_map.values()))]


def fp32_bytes(folder: Path) -> int:
    """Bytes of the checkpoint's tensors in fp32 (from the safetensors headers)."""
    from trainforge.trainer.pretrained import shard_shapes

    return 4 * sum(math.prod(shape) for shape, _ in shard_shapes(folder).values())


def load_model(folder: Path):
    """The trainer's load of ``folder`` onto the CPU, as `job_model` runs it (no FSDP2)."""
    from trainforge.trainer.pretrained import load_pretrained, read_config

    return load_pretrained(folder, read_config(folder, pretrained_model()), "cpu")


def trainer_load(folder: Path) -> float:
    """Seconds of `load_model`."""
    t0 = time.perf_counter()
    model = load_model(folder)
    seconds = time.perf_counter() - t0
    del model
    gc.collect()
    return seconds


def raw_read(folder: Path) -> float:
    """Seconds to read every shard with safetensors and convert each tensor to fp32 (all kept
    until the end, as a loaded model keeps them)."""
    import torch
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    tensors = {}
    for path in shards_of(folder):
        tensors.update({k: v.to(torch.float32) for k, v in load_file(path).items()})
    seconds = time.perf_counter() - t0
    del tensors
    gc.collect()
    return seconds


def measure_throughput(folder: Path, rounds: int) -> float:
    """Median over ``rounds`` of trainer / raw throughput, alternating which goes first."""
    size = sum(p.stat().st_size for p in shards_of(folder))
    trainer_load(folder), raw_read(folder)  # warm-up: lazy imports, the page cache
    ratios = []
    for number in range(rounds):
        seconds = {}
        for kind in ("trainer", "raw") if number % 2 == 0 else ("raw", "trainer"):
            seconds[kind] = trainer_load(folder) if kind == "trainer" else raw_read(folder)
        ratios.append(seconds["raw"] / seconds["trainer"])
        print(f"round {number + 1}: trainer {size / seconds['trainer'] / 1e6:,.0f} MB/s "
              f"({seconds['trainer']:.2f} s), raw read {size / seconds['raw'] / 1e6:,.0f} MB/s "
              f"({seconds['raw']:.2f} s) -> trainer/raw {ratios[-1]:.3f}", flush=True)
    return statistics.median(ratios)


def fsdp_paths() -> list[str]:
    """The FSDP2 load paths this trainforge has (module doc)."""
    from trainforge.trainer import pretrained

    return ["load-then-shard"] + (["shard-then-fill"] if hasattr(pretrained, "fill_shards") else [])


def measure_fsdp_memory(folder: Path, path: str) -> list[dict]:
    """Each rank's figures from the FSDP2 child (2 gloo ranks under torchrun) loading by ``path``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           "--fsdp-child", str(folder), path]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env, check=False)
    if proc.returncode:
        sys.exit(f"the FSDP2 child failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fsdp_child(folder: str, path: str) -> None:
    """Child, under torchrun: the model loaded and sharded with FSDP2 by ``path``; rank 0 prints
    every rank's peak and current RSS (bytes), the RSS after imports, and its local parameter bytes."""
    import resource

    import psutil
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import transformers.models.auto.modeling_auto  # noqa: F401 - imported before the baseline
    from trainforge.trainer import pretrained
    from trainforge.trainer.model import decoder_layers
    from trainforge.trainer.pretrained import read_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    baseline = psutil.Process().memory_info().rss
    if path == "load-then-shard":
        model = load_model(Path(folder))
    else:
        config = read_config(Path(folder), pretrained_model())
        pretrained.check_shards(Path(folder), config)
        model = pretrained.build_empty(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if path == "shard-then-fill":
        pretrained.fill_shards(model, Path(folder), "cpu")
        pretrained.check_materialised(model, model.config)
    gc.collect()
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    mine = {"rank": dist.get_rank(), "baseline_rss": baseline, "rss_after": psutil.Process().memory_info().rss,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "local_param_bytes": local}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        print(json.dumps(everyone), flush=True)
    dist.barrier()
    del model
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="bf16 checkpoint size (default 1.0)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of the two reads (default 5)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of the in-process rounds (default: torch's own; 1 on a busy machine)")
    parser.add_argument("--dir", type=Path, default=None, help="keep the checkpoint here (default: a temporary folder)")
    args = parser.parse_args()
    if not 0 < args.size_gb <= 64:
        parser.error(f"--size-gb={args.size_gb}: expected more than 0 and at most 64")
    if args.rounds < 1:
        parser.error(f"--rounds={args.rounds}: expected at least 1")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads={args.threads}: expected at least 1")
    started = time.monotonic()
    root = args.dir or Path(tempfile.mkdtemp(prefix="trainforge-bench-load-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        shape = llama_shape(args.size_gb)
        folder = ensure_checkpoint(root, shape)
        size, full = sum(p.stat().st_size for p in shards_of(folder)), fp32_bytes(folder)
        print(f"checkpoint: Llama, {shape['num_layers']} layers, hidden {shape['hidden_size']}, vocabulary "
              f"{shape['vocab_size']}; {len(shards_of(folder))} bf16 shards, {size / 1e9:.2f} GB "
              f"({full / 1e9:.2f} GB in fp32)", flush=True)
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        ratio = measure_throughput(folder, args.rounds)
        print(f"trainer/raw throughput = {ratio:.3f} (goal >= {GOAL_RATIO}: "
              f"{'met' if ratio >= GOAL_RATIO else 'goal not met'}; median of {args.rounds} round(s), "
              f"{torch.get_num_threads()} torch thread(s), load average {os.getloadavg()[0]:.1f})", flush=True)
        paths = fsdp_paths()
        for path in paths:
            ranks = measure_fsdp_memory(folder, path)
            for r in ranks:
                print(f"{path}, rank {r['rank']}: peak RSS {r['peak_rss'] / 1e9:.2f} GB (after imports "
                      f"{r['baseline_rss'] / 1e9:.2f} GB, after sharding {r['rss_after'] / 1e9:.2f} GB), its "
                      f"parameter shards {r['local_param_bytes'] / 1e9:.2f} GB", flush=True)
            worst = max(r["peak_rss"] for r in ranks) / full
            above = max(r["peak_rss"] - r["baseline_rss"] for r in ranks) / full
            verdict = ("met" if above <= GOAL_MEMORY else "goal not met") if path == paths[-1] else "not judged"
            print(f"FSDP2 on 2 ranks, {path}: peak host memory per rank for the model (above the RSS after "
                  f"imports) / fp32 model = {above:.2f} (goal <= {GOAL_MEMORY}: {verdict}; "
                  f"{worst:.2f} with the interpreter and libraries)", flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--fsdp-child"]:
        fsdp_child(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
