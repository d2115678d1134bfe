"""Data-preparation benchmark, measured against baselines in the same run.

    .venv/bin/python bench/data_prep.py [--mib 8] [--rounds 3] [--memory-mib 24]
                                        [--budget-mib 16] [--keep]

1. Throughput. A generated JSONL corpus (``--mib``) goes through ``prepare_dataset`` with 1 and
   2 encoding workers (the tokenizer is trained once, then reused, so each run is scan +
   encode). The step's tokenisation throughput is the tokens of its encode phase (starting the
   workers, reading the spool, encoding, writing shards and indexes) per second. The baseline
   is a bare ``tokenizers`` ``encode_batch_fast`` of the same documents with the same tokenizer
   and the same number of threads (``RAYON_NUM_THREADS``, in a fresh process), text already in
   memory. Each of ``--rounds`` rounds measures all four, in alternating order (the second
   round runs them backwards), so that load from elsewhere falls on both sides. Prints each
   round's figures, then the medians over rounds of step / bare per worker count (goal >= 0.8)
   and of the 1 -> 2 scaling of the step over that of the bare encode (goal >= 0.8; the bare
   scaling shows what the machine allows: on shared, busy cores neither scales).
   ``--memory-mib 0`` skips part 2.
2. Memory. A larger corpus (``--memory-mib``, more than ``--budget-mib``, the step's
   ``memory_budget_mib``) and one half its size are prepared in fresh processes with 2
   workers; prints the peak RSS of the step's process and of its largest worker (getrusage),
   next to the RSS right after imports. Bounded memory means: the peaks do not grow with the
   corpus, and the growth over the import baseline stays near the budget.

Not measured here: the tokenizer trainer's memory (its word counts grow with the vocabulary
of the corpus, not its size) and S3 (see tests/operators/data/test_data_s3.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
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

SYLLABLES = ("ka to ri ne mu sa lo vi de pa ta shi ron el an wy th qu or ex ul im ba "
             "ce fo gu hi jo ky ze xi").split()


def write_corpus(path: Path, mib: float, seed: int) -> int:
    """A JSONL file of ~2 KiB documents of Zipf-distributed made-up words (already clean:
    cleaning leaves them as they are). Returns the number of documents."""
    rng = random.Random(seed)
    words = sorted({"".join(rng.choices(SYLLABLES, k=rng.randint(1, 4))) for _ in range(30000)})
    weights = [1.0 / (rank + 1) for rank in range(len(words))]
    target, written, docs = int(mib * 2**20), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            stream = rng.choices(words, weights, k=400)
            lines = [" ".join(stream[i:i + 12]).capitalize() + "." for i in range(0, 400, 12)]
            line = json.dumps({"text": "\n".join(lines)}) + "\n"
            f.write(line)
            written += len(line)
            docs += 1
    return docs


def settings(sources: str, **extra):
    from trainforge.data import PrepareSettings

    return PrepareSettings(sources=[sources], format="jsonl", strip_gutenberg_boilerplate=False,
                           normalize_whitespace=True, unicode_normalization="NFC",
                           min_document_chars=1, vocab_size=8192, validation_fraction=0.05,
                           shard_tokens=1 << 24, **extra)


def bare(tokenizer: str, corpus: str) -> None:
    """Child: encode every document with encode_batch_fast; print tokens and seconds."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    started = time.perf_counter()
    tokens = 0
    for i in range(0, len(texts), 128):
        tokens += sum(len(e.ids) for e in tok.encode_batch_fast(texts[i:i + 128],
                                                                add_special_tokens=False))
    print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - started}))


def memory(corpus: str, tokenizer: str, out: str, budget_mib: int) -> None:
    """Child: prepare with 2 workers; print peak RSS (MiB) of this process and its children."""
    from trainforge.data import prepare_dataset

    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = prepare_dataset(settings(corpus, tokenizer_uri=tokenizer, encode_workers=2,
                                      memory_budget_mib=budget_mib), out)
    print(json.dumps({
        "import_rss_mib": baseline,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "worker_peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "tokens": sum(result.tokens.values()), "seconds": result.elapsed_s}))


def child(*args: str, env: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, check=False)
    if proc.returncode:
        sys.exit(f"child {args[0]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=8.0, help="throughput corpus size, MiB")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds (median)")
    parser.add_argument("--memory-mib", type=float, default=24.0,
                        help="memory corpus, MiB (0: skip the memory part)")
    parser.add_argument("--budget-mib", type=int, default=16, help="memory_budget_mib setting")
    parser.add_argument("--keep", action="store_true", help="keep the generated data")
    args = parser.parse_args()
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="trainforge-bench-data-"))
    try:
        run(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"total {time.monotonic() - started:.0f} s" + (f" (data kept in {work})" if args.keep
                                                         else ""))


def run(args: argparse.Namespace, work: Path) -> None:
    from trainforge.data import prepare_dataset
    from trainforge.data.bpe import train_tokenizer

    corpus = work / "throughput.jsonl"
    docs = write_corpus(corpus, args.mib, seed=1)
    with open(corpus, encoding="utf-8") as f:
        sample = [json.loads(line)["text"] for _, line in zip(range(1000), f)]
    tokenizer = work / "tokenizer.json"
    tokenizer.write_text(train_tokenizer(sample, vocab_size=8192, special_tokens=["<|endoftext|>"])
                         .to_str(), encoding="utf-8")
    print(f"corpus: {docs} documents, {corpus.stat().st_size / 2**20:.1f} MiB; tokenizer "
          f"8192 tokens; cpus: {len(os.sched_getaffinity(0))}")

    text_tokens = None
    rounds: list[dict[tuple[str, int], float]] = []
    for number in range(args.rounds):
        order = [(kind, n) for n in (1, 2) for kind in ("step", "bare")]
        rates: dict[tuple[str, int], float] = {}
        for kind, n in order if number % 2 == 0 else order[::-1]:
            if kind == "step":
                result = prepare_dataset(settings(str(corpus), tokenizer_uri=str(tokenizer),
                                                  encode_workers=n), work / f"out-{number}-{n}")
                tokens = sum(result.tokens.values())
                text_tokens = tokens - docs  # the step also writes one EOS per document
                rates[kind, n] = tokens / result.timings_s["encode"]
                shutil.rmtree(work / f"out-{number}-{n}")
            else:
                base = child("--bare", str(tokenizer), str(corpus),
                             env={"RAYON_NUM_THREADS": str(n)})
                rates[kind, n] = base["tokens"] / base["seconds"]
                if text_tokens is not None:
                    assert base["tokens"] == text_tokens, (base["tokens"], text_tokens)
        rounds.append(rates)
        print(f"round {number + 1}: tokens/s step {rates['step', 1]:,.0f} (1 worker), "
              f"{rates['step', 2]:,.0f} (2); bare {rates['bare', 1]:,.0f} (1 thread), "
              f"{rates['bare', 2]:,.0f} (2) -> step/bare {rates['step', 1] / rates['bare', 1]:.2f}"
              f", {rates['step', 2] / rates['bare', 2]:.2f}")

    def median(f) -> float:
        return statistics.median(f(r) for r in rounds)

    for n in (1, 2):
        print(f"step/bare, {n} worker(s) = {median(lambda r: r['step', n] / r['bare', n]):.2f} "
              "(goal >= 0.80)")
    step_scaling = median(lambda r: r["step", 2] / r["step", 1])
    bare_scaling = median(lambda r: r["bare", 2] / r["bare", 1])
    relative = median(lambda r: (r["step", 2] / r["step", 1]) / (r["bare", 2] / r["bare", 1]))
    print(f"scaling 1 -> 2: step {step_scaling:.2f}x, bare {bare_scaling:.2f}x (what this machine "
          f"gives two threads now; load average {os.getloadavg()[0]:.1f}); step scaling / bare "
          f"scaling = {relative:.2f} (goal >= 0.80)")

    if not args.memory_mib:
        return
    for mib in (args.memory_mib / 2, args.memory_mib):
        path = work / f"memory-{mib:g}.jsonl"
        write_corpus(path, mib, seed=2)
        m = child("--memory", str(path), str(tokenizer), str(work / f"mem-{mib:g}"),
                  str(args.budget_mib))
        print(f"memory, corpus {path.stat().st_size / 2**20:.1f} MiB, budget {args.budget_mib} "
              f"MiB, 2 workers: peak RSS {m['peak_rss_mib']:.0f} MiB (after imports "
              f"{m['import_rss_mib']:.0f} MiB), largest worker {m['worker_peak_rss_mib']:.0f} "
              f"MiB; {m['tokens']} tokens in {m['seconds']:.1f} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--bare"]:
        bare(*sys.argv[2:4])
    elif sys.argv[1:2] == ["--memory"]:
        memory(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        main()
