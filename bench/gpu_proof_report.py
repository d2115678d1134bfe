"""bench/gpu_proof.py's figures: the goals, what the trainer's log says (step times, saves, peak
memory), the FLOP count, tokens/s, and the markdown page comparing the trainer with the bare
loops."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re

PEAK_TFLOPS = 989.5
WARMUP_STEPS = 8  # the trainer's steps before the measured window (compile, pinning the save buffers)
BARE_WARMUP = 3
GOALS = {"mfu_percent": 45.0, "vs_compiled": 0.97, "save_blocking_s": 2.0, "startup_s": 10.0}
# "2026-11-29 22:24:19,196 rank0 INFO trainforge.trainer.train: step 70/400 | loss ..."

STEP_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank0 INFO trainforge\.trainer\.train: "
                       r"step (\d+)/\d+ \|")
PEAK_LINE = re.compile(r"peak CUDA memory ([\d.]+) GiB allocated")


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


def flops_per_token(shape: dict, lora: dict | None = None) -> float:
    """6 x non-embedding parameters + 12 x layers x hidden x sequence (torchtitan's count, as the
    trainer's ledger: trainforge.trainer.goodput.flops_per_token). With ``lora`` (a ``peft``
    section on every attention and MLP projection) what runs: 4 x parameters (adapters included)
    + 2 x adapter parameters, frozen weights getting no weight gradients (docs/contracts.md,
    "Run ledger", ``tflops``)."""
    h, L, inter, v = shape["hidden_size"], shape["num_layers"], shape["intermediate_size"], shape["vocab_size"]
    kv = h // shape["num_heads"] * shape.get("num_kv_heads", shape["num_heads"])
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h  # attention (q, o; k, v), MLP, two norms
    non_embedding = L * per_layer + h + (0 if shape.get("tied") else v * h)  # + final norm + an untied lm_head
    attention = 12 * L * h * shape["seq_len"]
    if lora is None:
        return 6 * non_embedding + attention
    # r x (in + out) per projection: q, o (h -> h); k, v (h -> kv); gate, up (h -> inter); down (inter -> h)
    adapters = L * lora["r"] * (2 * (h + h) + 2 * (h + kv) + 3 * (h + inter))
    return 4 * (non_embedding + adapters) + 2 * adapters + attention


# --- the measurements ------------------------------------------------------------------------


def tokens_per_s(stamps: dict[int, float], tokens_per_step: int, first: int) -> float:
    """Tokens/s between the end of step ``first`` and the last step's."""
    last = max(stamps)
    if last <= first:
        raise RuntimeError(f"only {last} steps logged: need more than {first} (--steps)")
    return (last - first) * tokens_per_step / (stamps[last] - stamps[first])


def versions() -> dict[str, str]:
    import importlib.metadata

    import torch
    import transformers

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    try:
        peft = importlib.metadata.version("peft")
    except importlib.metadata.PackageNotFoundError:
        peft = "not installed"
    return {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": device,
            "torch": torch.__version__, "cuda": str(torch.version.cuda), "transformers": transformers.__version__,
            "peft": peft, "python": platform.python_version()}


def report(facts: dict, shape: dict, args: argparse.Namespace, lora: dict | None = None) -> tuple[str, dict]:
    """The markdown page and the goal checks (a part that failed is reported as such); ``lora``: the
    job's ``peft`` section, when the trainer fine-tuned through LoRA adapters."""
    fpt = flops_per_token(shape, lora)
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
    model = ("open weights shaped like Llama 3.2 1B (rope llama3 scaling; random bf16 weights in Hugging Face layout "
             "made by the script, loaded by the trainer through its job config's `pretrained` section and by the bare "
             "loops with `from_pretrained`)" if args.pretrained else "Llama")
    tuning = ""
    if lora:
        tuning = (f" LoRA fine-tuning: adapters of rank {lora['r']}, alpha {lora['alpha']:g}, dropout "
                  f"{lora['dropout']:g} on every attention and MLP projection (the trainer's `peft` section, "
                  f"`target_modules: auto`; the bare loops' `peft.get_peft_model`), the base frozen; the FLOP count "
                  f"is what runs (no weight gradients for frozen weights).")
    elif args.pretrained:
        tuning = " Full fine-tuning: every weight trains."
    flag = " --lora" if lora else " --pretrained" if args.pretrained else ""
    kv = f" ({shape['num_kv_heads']} KV)" if shape.get("num_kv_heads", shape["num_heads"]) != shape["num_heads"] else ""

    def f(x, spec=",.0f"):
        return "n/a" if x is None else format(x, spec)

    def ratio(a, b):
        return f"{a / b:.3f}" if a and b else "n/a"

    failed = [f"- **{part} failed**: {error.splitlines()[0][:300]}" for part, error in facts.get("errors", {}).items()]
    lines = [
        "# The trainer on one GPU: measured" + (" (open weights, LoRA)" if lora else " (open weights)"
                                                if args.pretrained else ""),
        "",
        f"Measured by `python bench/gpu_proof.py{flag}` on {v['date']}: {v['device']}, torch {v['torch']} (CUDA "
        f"{v['cuda']}), transformers {v['transformers']}{', peft ' + v.get('peft', '?') if lora else ''}, Python "
        f"{v['python']}."
        + (" **A CPU rehearsal with a tiny model: not a GPU measurement.**" if args.rehearse_on_cpu else ""),
        "",
        f"Model: {model}, {shape['num_layers']} layers, hidden {shape['hidden_size']}, {shape['num_heads']} heads"
        f"{kv}, intermediate {shape['intermediate_size']}, vocabulary {shape['vocab_size']} "
        f"({'tied' if shape.get('tied') else 'untied'}), sequence "
        f"{shape['seq_len']}, micro-batch {shape['micro_batch']}, global batch {shape['global_batch']}, bf16, DDP on one "
        f"rank; {fpt:.3e} FLOP/token; MFU against {PEAK_TFLOPS} TFLOP/s.{tuning} Trainer: {args.steps} steps, a "
        f"checkpoint ({'the adapters' if lora else 'weights'} and AdamW state) every {args.checkpoint_every}, "
        f"tokens/s from step {WARMUP_STEPS} to the last (the mid-run save and its background write inside); bare "
        f"loops: {args.bare_steps} steps, tokens/s after step {BARE_WARMUP}.",
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
