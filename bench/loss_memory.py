"""Peak memory and time of the training loss head: plain against chunked, measured in the same run.

    .venv/bin/python bench/loss_memory.py [--vocabs 32000,128256] [--hidden-size H] [--micro-batch B]
                                          [--seq-len T] [--precision fp32|bf16] [--repeat 2]
                                          [--chunk-mib 256] [--device auto|cpu|cuda] [--json]

For each vocabulary, final hidden states ``(B*T, H)`` that require grad and an lm_head weight
``(vocab, H)`` go through one forward and backward of the loss, in alternating order:

* plain: ``F.cross_entropy(F.linear(h, w).float(), y)``, what `plain_lm_loss` does after the decoder;
* chunked: ``trainforge.trainer.loss.linear_cross_entropy`` at ``chunk_tokens_for(vocab, --chunk-mib)``
  tokens (default `CHUNK_LOGITS_MIB`; ``lm_loss`` itself takes the plain path when one chunk holds all).

Peak memory is the most held above what was allocated before the call, gradients included: on
CUDA ``torch.cuda.max_memory_allocated``; on CPU the process's peak resident set (``VmHWM``, reset
through ``/proc/self/clear_refs``, Linux). Time is the median of ``--repeat`` calls after one
warm-up. Defaults: CPU 1 x 4096 tokens, hidden 128, fp32 (75 s on 2 cores); CUDA 8 x 4096
tokens, hidden 2048, bf16 autocast. Prints each figure, then chunked / plain for memory and time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainforge.trainer import loss  # noqa: E402

MIB = 1 << 20
#: (micro_batch, seq_len, hidden_size, precision) when not given.
DEFAULTS = {"cpu": (1, 4096, 128, "fp32"), "cuda": (8, 4096, 2048, "bf16")}


def plain(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), y)


def chunked(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    return loss.linear_cross_entropy(h, w, y, chunk_tokens)


class PeakMemory:
    """Bytes held above the start of a `measure` block at its peak, CUDA or this process's RSS."""

    def __init__(self, device: torch.device):
        self.device = device

    @contextlib.contextmanager
    def measure(self, out: list[int]):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            yield
            torch.cuda.synchronize()
            out.append(torch.cuda.max_memory_allocated() - start)
            return
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        start = self._status_kib("VmRSS")
        yield
        out.append((self._status_kib("VmHWM") - start) * 1024)

    @staticmethod
    def _status_kib(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise RuntimeError(f"/proc/self/status has no {key}: peak memory on CPU needs Linux")


def measure(fn, h, w, y, chunk_tokens: int, precision: str, memory: PeakMemory) -> tuple[int, float]:
    """(peak bytes, seconds) of one forward and backward of ``fn``."""
    h.grad = w.grad = None
    peaks: list[int] = []
    autocast = torch.autocast(h.device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with memory.measure(peaks):
        start = time.perf_counter()
        with autocast:
            value = fn(h, w, y, chunk_tokens)
        value.backward()
        if h.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return peaks[0], seconds


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    micro, seq, hidden, precision = (a if a is not None else d for a, d in
                                     zip((args.micro_batch, args.seq_len, args.hidden_size, args.precision),
                                         DEFAULTS[device.type]))
    tokens = micro * seq
    memory = PeakMemory(device)
    results = {"device": str(device), "tokens": tokens, "micro_batch": micro, "seq_len": seq, "hidden_size": hidden,
               "precision": precision, "vocabs": {}}
    print(f"{device}: {micro} x {seq} = {tokens} tokens, hidden {hidden}, {precision}; median of {args.repeat}")
    for vocab in args.vocabs:
        g = torch.Generator(device=device).manual_seed(0)
        h = torch.randn(tokens, hidden, device=device, generator=g).requires_grad_()
        w = (torch.randn(vocab, hidden, device=device, generator=g) * hidden**-0.5).requires_grad_()
        y = torch.randint(0, vocab, (tokens,), device=device, generator=g)
        chunk = loss.chunk_tokens_for(vocab, args.chunk_mib)
        runs: dict[str, list[tuple[int, float]]] = {"plain": [], "chunked": []}
        for i in range(args.repeat + 1):  # the first round warms up; alternate the order
            order = (("plain", plain), ("chunked", chunked)) if i % 2 == 0 else (("chunked", chunked), ("plain", plain))
            for name, fn in order:
                runs[name].append(measure(fn, h, w, y, chunk, precision, memory))
        row = {name: {"peak_mib": max(p for p, _ in r) / MIB, "seconds": statistics.median(s for _, s in r[1:])}
               for name, r in runs.items()}
        row["chunk_tokens"], row["chunk_mib"] = chunk, args.chunk_mib
        row["logits_fp32_mib"] = tokens * vocab * 4 / MIB
        row["peak_ratio"] = row["chunked"]["peak_mib"] / row["plain"]["peak_mib"]
        row["time_ratio"] = row["chunked"]["seconds"] / row["plain"]["seconds"]
        results["vocabs"][vocab] = row
        plain_path = " (lm_loss would take the plain path)" if tokens <= chunk else ""
        print(f"vocab {vocab} (fp32 logits {row['logits_fp32_mib']:.0f} MiB; chunks of {chunk} tokens{plain_path}):")
        for name in ("plain", "chunked"):
            print(f"  {name:<8} peak {row[name]['peak_mib']:9.1f} MiB  time {row[name]['seconds'] * 1e3:9.1f} ms")
        print(f"  chunked/plain: peak memory {row['peak_ratio']:.3f}, time {row['time_ratio']:.3f}")
        del h, w, y
    return results


def _vocabs(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 32000,128256") from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: every vocabulary needs at least 2 tokens")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocabs", type=_vocabs, default=[32000, 128256], help="comma-separated (default 32000,128256)")
    p.add_argument("--hidden-size", type=int, help="default: CPU 128, CUDA 2048")
    p.add_argument("--micro-batch", type=int, help="sequences per micro-batch (default: CPU 1, CUDA 8)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 4096)")
    p.add_argument("--precision", choices=["fp32", "bf16"], help="default: CPU fp32, CUDA bf16 autocast")
    p.add_argument("--repeat", type=int, default=2, help="timed calls per method after one warm-up (default 2)")
    p.add_argument("--chunk-mib", type=int, default=loss.CHUNK_LOGITS_MIB,
                   help=f"fp32 logits MiB per chunk (default {loss.CHUNK_LOGITS_MIB})")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA when there is one")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON object")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    for name in ("hidden_size", "micro_batch", "seq_len", "repeat", "chunk_mib"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected a positive number")
    results = run(args)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
