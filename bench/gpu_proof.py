"""The trainer on one CUDA GPU, against the chip's matmul ceiling and two bare loops, in one run.

    # trainforge installed without its dependencies, e.g. on a machine with only torch and transformers:
    pip install --no-deps --no-build-isolation --target DIR . && export PYTHONPATH=DIR
    python bench/gpu_proof.py [--steps 32] [--checkpoint-every 16] [--bare-steps 10]
                              [--out docs/gpu-proof.md] [--log-dir DIR] [--work DIR] [--keep]
    python bench/gpu_proof.py --rehearse-on-cpu    # a tiny model on the CPU: checks the script itself

Measures, each in a process of its own: the bf16 matmul ceiling; the trainer (torchrun) on a
1.1B-parameter Llama, its steady tokens/s, MFU, startup, save seconds, peak memory and energy;
a bare loop of the same model compiled with fused AdamW; the same loop eager. Prints the ratios
trainer / each bare loop and writes them to ``--out``; ``--log-dir`` keeps the figures of each
part as it ends. A part that fails is reported and the others still run. What each part runs
and measures: docs/trainer.md, "The GPU measurement (`bench/gpu_proof.py`)".

Needs only torch and transformers (and trainforge on ``PYTHONPATH``); no CUDA device: it says
so and exits 0. About 4 minutes on an H200.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Dense bf16 peak of an H100/H200 SXM (NVIDIA datasheet), the MFU denominator.
PEAK_TFLOPS = 989.5
WARMUP_STEPS = 8  # the trainer's steps before the measured window (compile, pinning the save buffers)
BARE_WARMUP = 3
GOALS = {"mfu_percent": 45.0, "vs_compiled": 0.97, "save_blocking_s": 2.0, "startup_s": 10.0}
# "2026-11-29 22:24:19,196 rank0 INFO trainforge.trainer.train: step 70/400 | loss ..."
STEP_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank0 INFO trainforge\.trainer\.train: "
                       r"step (\d+)/\d+ \|")
PEAK_LINE = re.compile(r"peak CUDA memory ([\d.]+) GiB allocated")

FULL = {"hidden_size": 2048, "num_layers": 22, "num_heads": 16, "intermediate_size": 5632,
        "vocab_size": 4096, "seq_len": 2048, "micro_batch": 4, "global_batch": 32}
TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128,
        "vocab_size": 512, "seq_len": 64, "micro_batch": 2, "global_batch": 8}


def make_dataset(root: Path, vocab_size: int, train_tokens: int, seed: int = 0) -> Path:
    """A trainforge.dataset/v1 folder (docs/contracts.md, "Dataset") of random token ids and a
    word-level tokenizer of ``vocab_size`` entries (the last is the EOS)."""
    import numpy as np
    from tokenizers import Tokenizer, models

    root.mkdir(parents=True, exist_ok=True)
    eos = "<|endoftext|>"
    vocab = {f"t{i}": i for i in range(vocab_size - 1)} | {eos: vocab_size - 1}
    Tokenizer(models.WordLevel(vocab, unk_token=eos)).save(str(root / "tokenizer.json"))
    rng = np.random.default_rng(seed)
    splits = {}
    for name, n in (("train", train_tokens), ("validation", max(4096, train_tokens // 100))):
        path = root / f"{name}-00000.bin"
        rng.integers(0, vocab_size, size=n, dtype=np.uint16).tofile(path)
        shard = {"file": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path), "tokens": n}
        splits[name] = {"documents": 1, "tokens": n, "bytes_utf8": 0, "shards": [shard]}
    tok = root / "tokenizer.json"
    manifest = {"format": "trainforge.dataset/v1", "digest": hashlib.sha256(f"gpu-proof-{vocab_size}-{train_tokens}-"
                                                                           f"{seed}".encode()).hexdigest(),
                "dtype": "uint16", "vocab_size": vocab_size, "eos_token": eos, "eos_id": vocab_size - 1,
                "tokenizer": {"file": tok.name, "bytes": tok.stat().st_size, "sha256": _sha256(tok)},
                "splits": splits, "sources": [], "settings": {"generated": "random ids"},
                "stats": {"documents_in": 2, "removed": {"empty": 0, "duplicate": 0}}}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return root


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def job_config(shape: dict, dataset: Path, checkpoints: Path, steps: int, every: int, precision: str,
               compile_: bool | str = "auto") -> dict:
    """The trainer's job config (trainforge.job/v1) for ``shape``."""
    return {
        "format": "trainforge.job/v1",
        "identity": {"dag_id": "gpu_proof", "run_id": "bench__1", "task_id": "train", "try_number": 1},
        "data": {"dataset_dir": str(dataset), "sequence_length": shape["seq_len"]},
        "model": {"family": "llama", "hidden_size": shape["hidden_size"], "num_layers": shape["num_layers"],
                  "num_heads": shape["num_heads"], "num_kv_heads": shape["num_heads"],
                  "intermediate_size": shape["intermediate_size"], "rope_theta": 10000.0, "dropout": 0.0,
                  "tie_word_embeddings": False},
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


def flops_per_token(shape: dict) -> float:
    """6 x non-embedding parameters + 12 x layers x hidden x sequence (torchtitan's count, as the
    trainer's ledger: trainforge.trainer.goodput.flops_per_token)."""
    h, L, inter, v = shape["hidden_size"], shape["num_layers"], shape["intermediate_size"], shape["vocab_size"]
    per_layer = 4 * h * h + 3 * h * inter + 2 * h  # attention (MHA), MLP, two norms
    non_embedding = L * per_layer + h + v * h  # + final norm + untied lm_head
    return 6 * non_embedding + 12 * L * h * shape["seq_len"]


# --- the measurements ------------------------------------------------------------------------


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


def _background_seconds(record: dict) -> float | None:
    """The attempt's background checkpoint-write seconds (docs/contracts.md, "Run ledger")."""
    value = record.get("background_save_s")
    return float(value) if value is not None else None


def _save_lines(out: str) -> list[str]:
    return [line.split(": ", 1)[-1] for line in out.splitlines() if "rank0 INFO" in line and
            ("checkpoint" in line or "pinned" in line) and " in " in line][:8]


#: "checkpoint .../step-00000016 staged: training blocked 0.21s (...)" (a save during training)
STAGED_LINE = re.compile(r"staged: training blocked ([\d.]+)s")
#: "checkpoint .../step-00000032 written: training blocked 20.1s (the final save is awaited)"
FINAL_LINE = re.compile(r"written: training blocked ([\d.]+)s \(the final save is awaited\)")


def _line(out: str, needle: str) -> str | None:
    found = [line.split(": ", 1)[-1] for line in out.splitlines() if needle in line]
    return found[-1] if found else None


def tokens_per_s(stamps: dict[int, float], tokens_per_step: int, first: int) -> float:
    """Tokens/s between the end of step ``first`` and the last step's."""
    last = max(stamps)
    if last <= first:
        raise RuntimeError(f"only {last} steps logged: need more than {first} (--steps)")
    return (last - first) * tokens_per_step / (stamps[last] - stamps[first])


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


def bare_loop(kind: str, job_path: str, steps: int, device: str) -> None:
    """Child: a plain training loop of the job's model and batch; prints JSON figures."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads(Path(job_path).read_text())
    m, o, seq = cfg["model"], cfg["optim"], cfg["data"]["sequence_length"]
    data = Path(cfg["data"]["dataset_dir"])
    manifest = json.loads((data / "manifest.json").read_text())
    tokens = np.fromfile(data / manifest["splits"]["train"]["shards"][0]["file"], dtype=np.uint16).astype(np.int64)
    torch.manual_seed(o["seed"])
    config = LlamaConfig(vocab_size=manifest["vocab_size"], hidden_size=m["hidden_size"],
                         intermediate_size=m["intermediate_size"], num_hidden_layers=m["num_layers"],
                         num_attention_heads=m["num_heads"], num_key_value_heads=m["num_kv_heads"],
                         max_position_embeddings=seq, tie_word_embeddings=m["tie_word_embeddings"],
                         rope_parameters={"rope_type": "default", "rope_theta": m["rope_theta"]}, use_cache=False)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(config)
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


def versions() -> dict[str, str]:
    import torch
    import transformers

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    return {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": device,
            "torch": torch.__version__, "cuda": str(torch.version.cuda), "transformers": transformers.__version__,
            "python": platform.python_version()}


def report(facts: dict, shape: dict, args: argparse.Namespace) -> tuple[str, dict]:
    """The markdown page and the goal checks (a part that failed is reported as such)."""
    fpt = flops_per_token(shape)
    tokens_per_step = shape["global_batch"] * shape["seq_len"]
    t = facts.get("trainer") or {}
    rate = mfu = None
    if t.get("stamps"):
        rate = tokens_per_s(t["stamps"], tokens_per_step, WARMUP_STEPS)
        mfu = 100 * rate * fpt / (PEAK_TFLOPS * 1e12)
    eager = (facts.get("eager") or {}).get("tokens_per_s")
    compiled = (facts.get("compiled") or {}).get("tokens_per_s")
    vs_compiled = rate / compiled if rate and compiled else None
    blocked = max(t["mid_run_blocked_s"]) if t.get("mid_run_blocked_s") else None
    checks = {
        "mfu_percent": (mfu, mfu is not None and mfu >= GOALS["mfu_percent"]),
        "vs_compiled": (vs_compiled, vs_compiled is not None and vs_compiled >= GOALS["vs_compiled"]),
        "save_blocking_s": (blocked, blocked is not None and blocked <= GOALS["save_blocking_s"]),
        "startup_s": (t.get("startup_s"), t.get("startup_s") is not None and t["startup_s"] <= GOALS["startup_s"]),
    }
    v = facts["versions"]

    def f(x, spec=",.0f"):
        return "n/a" if x is None else format(x, spec)

    def ratio(a, b):
        return f"{a / b:.3f}" if a and b else "n/a"

    failed = [f"- **{part} failed**: {error.splitlines()[0][:300]}" for part, error in facts.get("errors", {}).items()]
    lines = [
        "# The trainer on one GPU: measured",
        "",
        f"Measured by `python bench/gpu_proof.py` on {v['date']}: {v['device']}, torch {v['torch']} (CUDA "
        f"{v['cuda']}), transformers {v['transformers']}, Python {v['python']}."
        + (" **A CPU rehearsal with a tiny model: not a GPU measurement.**" if args.rehearse_on_cpu else ""),
        "",
        f"Model: Llama, {shape['num_layers']} layers, hidden {shape['hidden_size']}, {shape['num_heads']} heads, "
        f"intermediate {shape['intermediate_size']}, vocabulary {shape['vocab_size']} (untied), sequence "
        f"{shape['seq_len']}, micro-batch {shape['micro_batch']}, global batch {shape['global_batch']}, bf16, DDP on one "
        f"rank; {fpt:.3e} FLOP/token; MFU against {PEAK_TFLOPS} TFLOP/s. Trainer: {args.steps} steps, a checkpoint "
        f"(weights and AdamW state) every {args.checkpoint_every}, tokens/s from step {WARMUP_STEPS} to the last (the "
        f"mid-run save and its background write inside); bare loops: {args.bare_steps} steps, tokens/s after step "
        f"{BARE_WARMUP}.",
        *([""] + failed if failed else []),
        "",
        "| what | figure |",
        "|---|---|",
        f"| bf16 matmul ceiling ({args.matmul_n}³) | {f(facts.get('ceiling_tflops'), '.0f')} TFLOP/s |",
        f"| trainer, steady tokens/s | {f(rate)} → **MFU {f(mfu, '.1f')} %** |",
        f"| bare loop, `torch.compile` + fused AdamW | {f(compiled)} tokens/s (trainer / it: "
        f"**{ratio(rate, compiled)}**) |",
        f"| bare eager loop (default AdamW) | {f(eager)} tokens/s (trainer / it: {ratio(rate, eager)}) |",
        f"| process start → first step begins (`program_startup`) | **{f(t.get('startup_s'), '.1f')} s** |",
        f"| process start → first step done (compilation inside) | {f(t.get('first_step_done_s'), '.1f')} s |",
        f"| a save during training: training blocked | **{f(blocked, '.2f')} s** |",
        f"| the final save, awaited (training over) | {f((t.get('final_awaited_s') or [None])[-1], '.1f')} s |",
        f"| checkpoint writes in the background (ledger) | {f(t.get('save_background_s'), '.1f')} s in all |",
        f"| peak memory: trainer / compiled / eager | {f(t.get('peak_gib'), '.1f')} / "
        f"{f((facts.get('compiled') or {}).get('peak_gib'), '.1f')} / "
        f"{f((facts.get('eager') or {}).get('peak_gib'), '.1f')} GiB |",
        f"| GPU energy: ledger (NVML) / NVML counter over the whole process | {f(t.get('ledger_energy_j'))} J / "
        f"{f(t.get('nvml_energy_j'))} J |",
        f"| trainer process wall time | {f(t.get('wall_s'), '.1f')} s |",
        "",
        "Goals (the trainer at the GPU's limit):",
        "",
        "| goal | measured | met |",
        "|---|---|---|",
        f"| MFU ≥ {GOALS['mfu_percent']} % | {f(mfu, '.1f')} % | {_yes(checks['mfu_percent'][1])} |",
        f"| trainer ≥ {GOALS['vs_compiled']} × compiled bare loop | {ratio(rate, compiled)} | "
        f"{_yes(checks['vs_compiled'][1])} |",
        f"| a save blocks ≤ {GOALS['save_blocking_s']} s | {f(blocked, '.2f')} s | {_yes(checks['save_blocking_s'][1])} |",
        f"| first step ≤ {GOALS['startup_s']} s after process start | {f(t.get('startup_s'), '.1f')} s | "
        f"{_yes(checks['startup_s'][1])} |",
        "",
        "From the trainer's log:",
        "",
        *[f"- {line}" for line in (t.get("optimizer_line"), t.get("startup_line"), t.get("recompile_line"),
                                   *t.get("saves", [])) if line],
        "",
    ]
    return "\n".join(lines), checks


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


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
    parser.add_argument("--rehearse-on-cpu", action="store_true",
                        help="no GPU: run every step with a tiny model on the CPU (a rehearsal, not a measurement)")
    args = parser.parse_args()
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
    shape = TINY if args.rehearse_on_cpu else FULL
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
        job = work / "job.json"
        job.write_text(json.dumps(job_config(shape, dataset, work / "checkpoints", args.steps, args.checkpoint_every,
                                             "bf16", compile_=True if args.rehearse_on_cpu else "auto")))
        part("trainer", lambda: run_trainer(job, work, timeout_s=600, log_dir=args.log_dir))
        print(f"trainer: {args.steps} steps in {(facts.get('trainer') or {}).get('wall_s', 0):.0f} s", flush=True)
        shutil.rmtree(work / "checkpoints", ignore_errors=True)
        for kind in ("compiled", "eager"):
            part(kind, lambda: run_bare(kind, job, args.bare_steps, timeout_s=600, device=device))
            print(f"bare {kind} loop: {(facts.get(kind) or {}).get('tokens_per_s', 0):,.0f} tokens/s", flush=True)
        page, checks = report(facts, shape, args)
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
