"""The trainer on one CUDA GPU, against the chip's matmul ceiling and two bare loops, in one run.

    # trainforge installed without its dependencies, e.g. on a machine with only torch and transformers:
    pip install --no-deps --no-build-isolation --target DIR . && export PYTHONPATH=DIR
    python bench/gpu_proof.py [--steps 32] [--checkpoint-every 16] [--bare-steps 10]
                              [--out docs/gpu-proof.md] [--log-dir DIR] [--work DIR] [--keep]
    python bench/gpu_proof.py --rehearse-on-cpu    # a tiny model on the CPU: checks the script itself
    python bench/gpu_proof.py --pretrained [...]   # full fine-tuning of a Llama-3.2-1B-shaped open-weights folder
    python bench/gpu_proof.py --lora [...]         # LoRA fine-tuning of the same folder

Measures, each in a process of its own: the bf16 matmul ceiling; the trainer (torchrun) on a
1.1B-parameter Llama, its steady tokens/s, MFU, startup, save seconds, peak memory and energy;
a bare loop of the same model compiled with fused AdamW; the same loop eager. Prints the ratios
trainer / each bare loop and writes them to ``--out``. ``--pretrained``: the model is instead a
folder the script makes (Llama 3.2 1B's config, random bf16 weights in Hugging Face layout, with
bench/pretrained_load.py's `make_checkpoint`), which the trainer loads through its job config's
``pretrained`` section and the bare loops with ``from_pretrained``; every weight trains. ``--lora``:
that folder fine-tuned through LoRA adapters (the job config's ``peft`` section, `LORA`); the bare
loops wrap it with ``peft.get_peft_model`` and AdamW takes the adapters alone. ``--log-dir`` keeps the
figures of each part as it ends. A part that fails is reported and the others still run. What
each part runs and measures: docs/trainer.md, "The GPU measurement (`bench/gpu_proof.py`)".

Needs only torch and transformers (and peft for ``--lora``; trainforge on ``PYTHONPATH``); no
CUDA device: it says so and exits 0. About 4 minutes on an H200.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_proof_inputs import make_dataset, pretrained_folder
from gpu_proof_report import (BARE_WARMUP, FINAL_LINE, PEAK_LINE, STAGED_LINE, STEP_LINE, WARMUP_STEPS, _background_seconds,
                              _line, _save_lines, flops_per_token, report, tokens_per_s, versions)

FULL = {"hidden_size": 2048, "num_layers": 22, "num_heads": 16, "intermediate_size": 5632,
        "vocab_size": 4096, "seq_len": 2048, "micro_batch": 4, "global_batch": 32}
TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128,
        "vocab_size": 512, "seq_len": 64, "micro_batch": 2, "global_batch": 8}
#: Llama 3.2 1B's architecture (its config.json: GQA, tied embeddings, rope llama3 scaling).
LLAMA_3_2_1B = {"hidden_size": 2048, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8, "intermediate_size": 8192,
                "vocab_size": 128256, "tied": True, "max_positions": 131072, "original_max_positions": 8192,
                "seq_len": 2048, "micro_batch": 4, "global_batch": 32}
#: ``--lora``: the job config's ``peft`` section (targets ``auto``: Llama's attention and MLP projections).
LORA = {"method": "lora", "r": 16, "alpha": 32.0, "dropout": 0.05, "target_modules": "auto", "merge": True}
#: What ``auto`` names for Llama, written out for the bare loops' ``peft.LoraConfig``.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TINY_PRETRAINED = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128,
                   "vocab_size": 512, "tied": True, "max_positions": 256, "original_max_positions": 32,
                   "seq_len": 64, "micro_batch": 2, "global_batch": 8}


def job_config(shape: dict, dataset: Path, checkpoints: Path, steps: int, every: int, precision: str,
               compile_: bool | str = "auto", folder: Path | None = None, lora: dict | None = None) -> dict:
    """The trainer's job config (trainforge.job/v1) for ``shape``; with ``folder``, that open-weights
    folder's model (a ``pretrained`` section), and with ``lora`` (`LORA`) its ``peft`` section."""
    model = ({"family": "pretrained", "dropout": None} if folder else
             {"family": "llama", "hidden_size": shape["hidden_size"], "num_layers": shape["num_layers"],
              "num_heads": shape["num_heads"], "num_kv_heads": shape["num_heads"],
              "intermediate_size": shape["intermediate_size"], "rope_theta": 10000.0, "dropout": 0.0,
              "tie_word_embeddings": False})
    return {
        "format": "trainforge.job/v1",
        "identity": {"dag_id": "gpu_proof", "run_id": "bench__1", "task_id": "train", "try_number": 1},
        "data": {"dataset_dir": str(dataset), "sequence_length": shape["seq_len"]},
        "model": model,
        **({"pretrained": {"folder": str(folder), "source": str(folder), "revision": None}} if folder else {}),
        **({"peft": dict(lora)} if lora else {}),
        "optim": {"max_steps": steps, "global_batch_size": shape["global_batch"],
                  "micro_batch_size": shape["micro_batch"], "learning_rate": 3e-4, "min_learning_rate": 3e-5,
                  "warmup_steps": 2, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0,
                  "seed": 1234},
        "precision": precision,
        "checkpoint": {"dir": str(checkpoints), "interval_steps": every, "keep_last": 1},
        "logging": {"log_every_steps": 1},
        "distributed": {"backend": "auto", "collective_timeout_s": 600},
        "framework": {"parallelism": "ddp", "compile": compile_},
    }


def matmul_ceiling(device: str, n: int) -> float:
    """TFLOP/s of an n x n x n bf16 matrix product on ``device``."""
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync(device)
    return 2 * n**3 * 10 / (time.perf_counter() - t0) / 1e12


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def nvml_energy_mj() -> float | None:
    """NVML's total-energy counter of device 0 in millijoules, or None where unsupported."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return float(pynvml.nvmlDeviceGetTotalEnergyConsumption(pynvml.nvmlDeviceGetHandleByIndex(0)))
    except Exception:  # noqa: BLE001 - no NVML, no counter: the figure is left out
        return None


def run_trainer(job: Path, work: Path, timeout_s: float, log_dir: Path | None) -> dict:
    """Launch the real trainer under torchrun; returns its figures."""
    job_dir = work / "job"
    env = {**os.environ, "TRAINFORGE_JOB_DIR": str(job_dir), "TRAINFORGE_RESULT_FILE": str(work / "result.json"),
           "PYTHONUNBUFFERED": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("MLFLOW_")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "-m", "trainforge.trainer.train", "--config", str(job)]
    energy_before, t0 = nvml_energy_mj(), time.time()
    log_file = (log_dir or work) / "trainer.log"
    with open(log_file, "w") as sink:  # written as it runs: a run cut short still leaves its log
        code = _run_group(cmd, sink, env, timeout_s)
    wall = time.time() - t0
    energy_after = nvml_energy_mj()
    out = log_file.read_text()
    if code:
        raise RuntimeError(f"the trainer failed (exit {code}):\n{out[-4000:]}")
    stamps = {int(m[2]): dt.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp() for m in STEP_LINE.finditer(out)}
    records = sorted((job_dir / "ledger").glob("attempt-*.json"))
    record = json.loads(records[-1].read_text()) if records else {}
    seconds = record.get("seconds", {})
    peak = PEAK_LINE.search(out)
    figures = {"wall_s": wall, "stamps": stamps, "record": record,
               "startup_s": seconds.get("startup"), "peak_gib": float(peak[1]) if peak else None,
               "save_blocking_s": seconds.get("save"), "save_background_s": _background_seconds(record),
               "saves": _save_lines(out), "recompile_line": _line(out, "torch.compile: "),
               "optimizer_line": _line(out, " AdamW"), "startup_line": _line(out, "startup: "),
               "mid_run_blocked_s": [float(x) for x in STAGED_LINE.findall(out)],
               "final_awaited_s": [float(x) for x in FINAL_LINE.findall(out)]}
    if record.get("started_at") and stamps:
        figures["first_step_done_s"] = stamps[min(stamps)] - record["started_at"]
    if record.get("energy_j"):
        figures["ledger_energy_j"] = sum(v for k, v in record["energy_j"].items() if k.startswith("gpu"))
    if energy_before is not None and energy_after is not None:
        figures["nvml_energy_j"] = (energy_after - energy_before) / 1000
    return figures


def _run_group(cmd: list[str], sink, env: dict[str, str] | None, timeout_s: float) -> int:
    """Run ``cmd`` in a process group of its own; on timeout SIGTERM the whole group (torchrun and
    its workers), SIGKILL 30 s later, and raise TimeoutError: no orphan keeps the GPU."""
    proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=grace)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        raise TimeoutError(f"{' '.join(cmd[:6])} ... did not finish in {timeout_s:.0f} s; its process group "
                           f"was stopped") from None


def run_bare(kind: str, job: Path, steps: int, timeout_s: float, device: str) -> dict:
    """The bare loop (``eager`` or ``compiled``) in a child process; returns its figures."""
    with tempfile.TemporaryFile("w+") as sink:
        code = _run_group([sys.executable, __file__, "--bare-loop", kind, str(job), str(steps), device], sink, None,
                          timeout_s)
        sink.seek(0)
        out = sink.read()
    if code:
        raise RuntimeError(f"the {kind} bare loop failed (exit {code}):\n{out[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def bare_model(cfg: dict, manifest: dict, device: str):
    """The bare loops' fp32 model on ``device``: the job's pretrained folder as plain transformers
    loads it (with a ``peft`` section, wrapped by ``peft.get_peft_model``: only the adapters train),
    else a fresh ``LlamaForCausalLM`` of the job's model section."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    m = cfg["model"]
    if "pretrained" in cfg:  # the folder's weights, fp32, as plain transformers loads them
        model = AutoModelForCausalLM.from_pretrained(cfg["pretrained"]["folder"], dtype=torch.float32, use_cache=False,
                                                     attn_implementation="sdpa").to(device)  # no accelerate
        if "peft" not in cfg:
            return model
        import peft  # LoRA: the base frozen, adapters on the projections (made on the base's device)

        lora = cfg["peft"]
        return peft.get_peft_model(model, peft.LoraConfig(
            r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], target_modules=LORA_TARGETS,
            bias="none"))
    config = LlamaConfig(vocab_size=manifest["vocab_size"], hidden_size=m["hidden_size"],
                         intermediate_size=m["intermediate_size"], num_hidden_layers=m["num_layers"],
                         num_attention_heads=m["num_heads"], num_key_value_heads=m["num_kv_heads"],
                         max_position_embeddings=cfg["data"]["sequence_length"],
                         tie_word_embeddings=m["tie_word_embeddings"],
                         rope_parameters={"rope_type": "default", "rope_theta": m["rope_theta"]}, use_cache=False)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        return LlamaForCausalLM(config)


def bare_loop(kind: str, job_path: str, steps: int, device: str) -> None:
    """Child: a plain training loop of the job's model and batch; prints JSON figures."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    cfg = json.loads(Path(job_path).read_text())
    o, seq = cfg["optim"], cfg["data"]["sequence_length"]
    data = Path(cfg["data"]["dataset_dir"])
    manifest = json.loads((data / "manifest.json").read_text())
    tokens = np.fromfile(data / manifest["splits"]["train"]["shards"][0]["file"],
                         dtype=manifest["dtype"]).astype(np.int64)
    torch.manual_seed(o["seed"])
    model = bare_model(cfg, manifest, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o["weight_decay"]},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=o["learning_rate"], betas=(o["beta1"], o["beta2"]), eps=1e-8, fused=True if kind == "compiled" else None)
    forward = torch.compile(model) if kind == "compiled" else model
    micro = o["micro_batch_size"]
    accum = o["global_batch_size"] // micro
    rng = np.random.default_rng(o["seed"])
    ends = []
    model.train()
    for _ in range(steps):
        for _ in range(accum):
            starts = rng.integers(0, tokens.size - seq - 1, size=micro)
            window = torch.from_numpy(np.stack([tokens[s:s + seq + 1] for s in starts])).to(device)
            x, y = window[:, :-1], window[:, 1:]
            with torch.autocast(device, dtype=torch.bfloat16, enabled=cfg["precision"] == "bf16"):
                logits = forward(input_ids=x, use_cache=False).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        ends.append(time.perf_counter())
    tokens_per_step = o["global_batch_size"] * seq
    first = min(BARE_WARMUP, steps - 2)
    rate = (len(ends) - 1 - first) * tokens_per_step / (ends[-1] - ends[first])
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    print(json.dumps({"tokens_per_s": rate, "peak_gib": peak, "steps": steps}), flush=True)


# --- the report ------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=32, help="trainer steps (default 32)")
    parser.add_argument("--checkpoint-every", type=int, default=16, help="trainer checkpoint interval (default 16)")
    parser.add_argument("--bare-steps", type=int, default=10, help="steps of each bare loop (default 10)")
    parser.add_argument("--matmul-n", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=None,
                        help="write the page here (the repository keeps it as docs/gpu-proof.md); default: print it")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="also write the trainer's log and the figures (JSON, after each part) here")
    parser.add_argument("--work", type=Path, default=None, help="work folder (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--pretrained", action="store_true",
                        help="the model: a Llama-3.2-1B-shaped open-weights folder the script makes (random weights)")
    parser.add_argument("--lora", action="store_true",
                        help="fine-tune that folder (implies --pretrained) with LoRA adapters, against bare peft loops")
    parser.add_argument("--rehearse-on-cpu", action="store_true",
                        help="no GPU: run every step with a tiny model on the CPU (a rehearsal, not a measurement)")
    args = parser.parse_args()
    args.pretrained = args.pretrained or args.lora
    if args.steps <= WARMUP_STEPS + 1:
        parser.error(f"--steps={args.steps}: expected more than {WARMUP_STEPS + 1} (steps up to {WARMUP_STEPS} warm up)")
    if args.bare_steps <= BARE_WARMUP + 1:
        parser.error(f"--bare-steps={args.bare_steps}: expected more than {BARE_WARMUP + 1} (steps up to "
                     f"{BARE_WARMUP} warm up)")
    if not 1 <= args.checkpoint_every < args.steps:
        parser.error(f"--checkpoint-every={args.checkpoint_every}: expected 1 to {args.steps - 1} (below --steps="
                     f"{args.steps}: the blocking figure is a save during training)")
    if args.matmul_n < 1:
        parser.error(f"--matmul-n={args.matmul_n}: expected a positive matrix size")
    import torch

    if not torch.cuda.is_available() and not args.rehearse_on_cpu:
        print("no CUDA device: nothing measured (bench/gpu_proof.py needs one GPU; --rehearse-on-cpu runs a tiny "
              "model on the CPU to check the script itself)")
        return 0
    device = "cpu" if args.rehearse_on_cpu else "cuda"
    shape = ((TINY_PRETRAINED if args.rehearse_on_cpu else LLAMA_3_2_1B) if args.pretrained
             else TINY if args.rehearse_on_cpu else FULL)
    if args.rehearse_on_cpu:
        args.matmul_n = min(args.matmul_n, 512)
    started = time.monotonic()
    work = args.work or Path(tempfile.mkdtemp(prefix="trainforge-gpu-proof-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    facts: dict = {"versions": versions(), "errors": {}}

    def part(name: str, measure) -> None:
        try:
            facts[name] = measure()
        except Exception as err:  # noqa: BLE001 - one failed part must not cost the others
            facts["errors"][name] = f"{type(err).__name__}: {err}"
            print(f"{name} failed: {err}", flush=True)
        if args.log_dir:
            (args.log_dir / "figures.json").write_text(json.dumps(facts, indent=1, default=str))

    try:
        part("ceiling_tflops", lambda: matmul_ceiling(device, args.matmul_n))
        print(f"{facts['versions']['device']}: bf16 {args.matmul_n}³ matmul {facts.get('ceiling_tflops') or 0:.0f} "
              f"TFLOP/s", flush=True)
        tokens_per_step = shape["global_batch"] * shape["seq_len"]
        dataset = make_dataset(work / "dataset", shape["vocab_size"],
                               train_tokens=max(1 << 20, tokens_per_step * args.steps // 2))
        folder = None
        if args.pretrained:
            t0 = time.monotonic()
            folder = pretrained_folder(work / "model", shape, dataset / "tokenizer.json", device)
            print(f"made the open-weights folder in {time.monotonic() - t0:.0f} s", flush=True)
        job = work / "job.json"
        job.write_text(json.dumps(job_config(shape, dataset, work / "checkpoints", args.steps, args.checkpoint_every,
                                             "bf16", compile_=True if args.rehearse_on_cpu else "auto", folder=folder,
                                             lora=LORA if args.lora else None)))
        part("trainer", lambda: run_trainer(job, work, timeout_s=600, log_dir=args.log_dir))
        print(f"trainer: {args.steps} steps in {(facts.get('trainer') or {}).get('wall_s', 0):.0f} s", flush=True)
        shutil.rmtree(work / "checkpoints", ignore_errors=True)
        for kind in ("compiled", "eager"):
            part(kind, lambda: run_bare(kind, job, args.bare_steps, timeout_s=600, device=device))
            print(f"bare {kind} loop: {(facts.get(kind) or {}).get('tokens_per_s', 0):,.0f} tokens/s", flush=True)
        page, checks = report(facts, shape, args, LORA if args.lora else None)
        print(page)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(page)
            print(f"wrote {args.out}")
        print(f"total {time.monotonic() - started:.0f} s")
        print("goals: " + ", ".join(f"{k} {'met' if ok else 'NOT met'}" for k, (_, ok) in checks.items()))
    finally:
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if facts["errors"] else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--bare-loop"]:
        bare_loop(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        sys.exit(main())
