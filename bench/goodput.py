"""Goodput under injected failures, next to the analytic bound measured in the same run.

    .venv/bin/python bench/goodput.py [--kill-every-s 60] [--max-steps 120]
                                      [--checkpoint-every 10] [--collective-timeout-s 30]
                                      [--hidden-size N --num-layers N] [--corpus DIR] [--json]

The demo pipeline's model and data are trained by the real ``local`` engine while one worker
process, chosen at random, is SIGKILLed every ``--kill-every-s`` seconds; every restart resumes
from the newest valid checkpoint. From rank 0's step lines and the kill times it measures step
time, checkpoint stall ``delta``, interval ``T``, restart time ``R``, recovery time and
``MTBF``, and prints goodput (productive step time / wall time) beside the first-order bound
(Young 1974, Daly 2006)::

    goodput_bound = 1 - delta/T - (R + T/2)/MTBF

with their ratio (goal >= 0.95), and the run ledger's own account of the same job beside them.
Exits 1 when the run itself failed. About ten minutes on two busy CPU cores with the defaults.
Every term, the goals and the measured figures: docs/faults.md, "Measured".
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEMO_SPEC = ROOT / "dags" / "pipelines" / "shakespeare_llm.yaml"
# "[default0]:2026-11-29 22:24:19,196 rank0 INFO trainforge.trainer.train: step 70/400 | loss ..."
STEP_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank0 INFO "
                       r"trainforge\.trainer\.train: step (\d+)/\d+ \|(?:.*\| tok/s (\d+) \|)?")
# "... model: 6451200 parameters; 400 steps of 8 sequences x 128 tokens (micro ..."
ATTEMPT_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank0 INFO "
                          r"trainforge\.trainer\.train: model: \d+ parameters"
                          r"(?:; \d+ steps of (\d+) sequences x (\d+) tokens)?")


@dataclass
class StepEvent:
    t: float  # UNIX seconds when rank 0 logged the step (the step's end)
    step: int
    attempt: int
    own_s: float | None = None
    """The step's own time from its ``tok/s`` (steps logged every step): what the step took
    after the previous line's logging or checkpoint, where the gap between lines says more."""


def parse_log(text: str) -> list[StepEvent]:
    """Rank 0's step lines, numbered by attempt (a new attempt starts at each ``model:`` line)."""
    events, attempt, tokens_per_step = [], 0, None
    for line in text.splitlines():
        started = ATTEMPT_LINE.search(line)
        if started:
            attempt += 1
            tokens_per_step = int(started[2]) * int(started[3]) if started[2] else None
            continue
        match = STEP_LINE.search(line)
        if match:
            stamp = dt.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            rate = int(match[3]) if match[3] else 0
            own = tokens_per_step / rate if tokens_per_step and rate > 0 else None
            events.append(StepEvent(stamp, int(match[2]), attempt, own))
    return events


def measure(events: list[StepEvent], kills: list[float], checkpoint_every: int) -> dict:
    """The numbers of the module docstring from step events and kill times (UNIX seconds)."""
    gaps, stalls = [], []
    for prev, cur in zip(events, events[1:]):
        if cur.attempt != prev.attempt or cur.step != prev.step + 1:
            continue
        (stalls if prev.step % checkpoint_every == 0 else gaps).append(cur.t - prev.t)
    step_s = statistics.median(gaps)
    delta = max(0.0, statistics.mean(stalls) - step_s) if stalls else 0.0
    interval = checkpoint_every * step_s

    restarts, recoveries = [], []
    for kill in kills:
        before = [e for e in events if e.t <= kill]
        after = [e for e in events if e.t > kill]
        if not before or not after:
            continue
        newest = max(e.step for e in before)
        first_after = after[0]
        if first_after.attempt == before[-1].attempt:
            continue  # the kill landed after the last step (the job was ending)
        restarts.append(first_after.t - _unmeasured(first_after, step_s) - kill)
        beyond = next((e for e in after if e.step > newest), None)
        if beyond is not None:
            recoveries.append(beyond.t - kill)

    # Productive time: each step's surviving execution (the last one logged), line to line as
    # the run ledger counts it (a step slowed by a busy machine is still step time). A step that
    # followed a checkpoint or a restart has no gap to measure: its own time from its tok/s, or
    # one step time when its line has none.
    last_of: dict[int, StepEvent] = {}
    for e in events:
        last_of[e.step] = e
    productive = 0.0
    for step, e in last_of.items():
        prev = last_of.get(step - 1)
        if prev is not None and prev.attempt == e.attempt and prev.step % checkpoint_every:
            productive += e.t - prev.t
        else:
            productive += _unmeasured(e, step_s)
    wall = events[-1].t - (events[0].t - _unmeasured(events[0], step_s))
    n_kills = len(restarts)
    mtbf = wall / n_kills if n_kills else float("inf")
    restart_s = statistics.mean(restarts) if restarts else 0.0
    bound = 1.0 - delta / interval - (restart_s + interval / 2) / mtbf
    goodput = productive / wall
    return {
        "steps": len(last_of), "final_step": events[-1].step, "attempts": events[-1].attempt,
        "kills": n_kills, "step_s": step_s, "checkpoint_stall_delta_s": delta,
        "checkpoint_interval_T_s": interval, "restart_R_s": restart_s,
        "recovery_mean_s": statistics.mean(recoveries) if recoveries else None,
        "recovery_max_s": max(recoveries) if recoveries else None,
        "mtbf_s": mtbf, "wall_s": wall, "productive_s": productive,
        "goodput": goodput, "goodput_bound": bound,
        "ratio": goodput / bound if bound > 0 else None,
    }


def _unmeasured(event: StepEvent, step_s: float) -> float:
    """The time of a step no gap between lines measures (the first of an attempt, the one after a
    checkpoint): its own time from its line, else the median step time. The first step of an
    attempt warms up (first collectives, allocations) and often takes several step times."""
    return event.own_s if event.own_s is not None else step_s


def ledger_side(job_dir: Path, measured: dict) -> dict:
    """The run ledger's figures for the job (its attempt records in ``job_dir``), next to the
    benchmark's ``measured`` ones."""
    from trainforge.ledger.attempts import attempt_records, job_dir_records, sum_attempts

    records = attempt_records(job_dir_records(job_dir))
    books = sum_attempts(records)
    own_wall = (books.last_record - books.first_start) if records else None
    goodput = books.productive_s / measured["wall_s"]
    recoveries = books.recoveries_s
    return {
        "ledger_attempts": len(records), "ledger_disruptions": max(0, len(records) - 1),
        "ledger_productive_s": books.productive_s,
        "ledger_goodput_same_window": goodput,
        "ledger_goodput_pp_off": 100.0 * (goodput - measured["goodput"]),
        "ledger_goodput_own_window": books.productive_s / own_wall if own_wall else None,
        "ledger_recovery_mean_s": sum(recoveries) / len(recoveries) if recoveries else None,
        "ledger_recovery_max_s": max(recoveries) if recoveries else None,
        "ledger_buckets_s": books.buckets,
    }


def rank_processes(job_dir: Path) -> list:
    """The live trainer ranks of a local job (children of its torchrun running trainforge.trainer.train)."""
    import psutil

    info = json.loads((job_dir / "supervisor.json").read_text())
    try:
        tree = psutil.Process(info["pid"]).children(recursive=True)
    except psutil.Error:
        return []
    ranks = []
    for proc in tree:
        try:
            cmd = proc.cmdline()
            if "trainforge.trainer.train" in cmd and "torch.distributed.run" not in cmd and \
                    proc.status() != psutil.STATUS_ZOMBIE:
                ranks.append(proc)
        except psutil.Error:
            continue
    return ranks


def prepare(args: argparse.Namespace, home: Path):
    """The demo spec with the benchmark's overrides, and its prepared dataset folder."""
    import os

    os.environ["TRAINFORGE_HOME"] = str(home)
    from trainforge.data import prepare_dataset
    from trainforge.data.corpus import fetch_corpus
    from trainforge.tasks.prepare_data import prepare_settings
    from trainforge.pipeline.loader import load_spec, validate_overrides

    corpus = home / "corpus" / "shakespeare"
    if args.corpus:
        corpus.parent.mkdir(parents=True, exist_ok=True)
        if not corpus.exists():
            corpus.symlink_to(Path(args.corpus).absolute(), target_is_directory=True)
    else:
        fetch_corpus(corpus)
    overrides = {
        "training.optimization.max_steps": args.max_steps,
        "training.checkpoint.interval_steps": args.checkpoint_every,
        "training.checkpoint.keep_last": 2,
        "training.fault.max_restarts": 100,
        "training.fault.collective_timeout": f"{args.collective_timeout_s:g}s",
        "training.log_every_steps": 1,
    }
    if args.hidden_size:
        overrides["model.hidden_size"] = args.hidden_size
    if args.num_layers:
        overrides["model.num_layers"] = args.num_layers
    spec = validate_overrides(load_spec(DEMO_SPEC), overrides)
    dataset = prepare_dataset(prepare_settings(spec), home / "datasets")
    return spec, str(dataset.path)


def run(args: argparse.Namespace) -> dict:
    from trainforge.engines.base import JobIdentity, JobState
    from trainforge.engines.local.backend import LocalBackend
    from trainforge.jobconfig import build_training_job

    with tempfile.TemporaryDirectory(prefix="trainforge-goodput-") as tmp:
        home = Path(tmp)
        spec, dataset_dir = prepare(args, home)
        identity = JobIdentity("goodput", f"bench-{int(time.time())}", "train", 1)
        job = build_training_job(spec, dataset_dir, str(home / "checkpoints"), identity, {})
        backend = LocalBackend(home / "runs", cwd=str(ROOT))
        handle = backend.submit(job)
        job_dir = Path(handle["job_dir"])
        rng = random.Random(args.seed)
        kills: list[float] = []
        started = time.monotonic()
        next_kill = None
        try:
            while True:
                status = backend.status(handle)
                if status.state.terminal:
                    break
                if time.monotonic() - started > args.timeout_s:
                    raise TimeoutError(f"the job was still {status.state.value} after "
                                       f"{args.timeout_s:.0f} s")
                text = (job_dir / "job.log").read_text(errors="replace")
                if next_kill is None and STEP_LINE.search(text):
                    next_kill = time.monotonic() + args.kill_every_s  # from the first step on
                if next_kill is not None and time.monotonic() >= next_kill:
                    ranks = rank_processes(job_dir)
                    if ranks:
                        victim = rng.choice(ranks)
                        victim.send_signal(signal.SIGKILL)
                        kills.append(time.time())
                        print(f"  kill {len(kills)}: SIGKILL rank process {victim.pid} at "
                              f"{time.monotonic() - started:.0f} s", flush=True)
                    next_kill = time.monotonic() + args.kill_every_s
                time.sleep(0.2)
        finally:
            backend.cancel(handle, grace_s=10)
        text = (job_dir / "job.log").read_text(errors="replace")
        if status.state != JobState.SUCCEEDED:
            print(text[-3000:], file=sys.stderr)
            raise SystemExit(f"the training job ended {status.state.value}: {status.message}")
        out = measure(parse_log(text), kills, args.checkpoint_every)
        out["kill_every_s"] = args.kill_every_s
        out.update(ledger_side(job_dir, out))
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill-every-s", type=float, default=60.0,
                        help="seconds between worker SIGKILLs")
    parser.add_argument("--max-steps", type=int, default=120)
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps")
    parser.add_argument("--collective-timeout-s", type=float, default=30.0)
    parser.add_argument("--hidden-size", type=int, help="model width (default: the demo's)")
    parser.add_argument("--num-layers", type=int, help="model depth (default: the demo's)")
    parser.add_argument("--corpus", help="an already fetched Shakespeare corpus folder")
    parser.add_argument("--seed", type=int, default=0, help="which rank each kill picks")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    def stop(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")  # unwinds through run(): the job is cancelled

    signal.signal(signal.SIGTERM, stop)
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"steps {out['steps']} (final {out['final_step']}) in {out['attempts']} attempts, "
          f"{out['kills']} kills (one every {out['kill_every_s']:.0f} s)")
    print(f"step time            {fmt(out['step_s'])} s")
    print(f"checkpoint stall     delta = {fmt(out['checkpoint_stall_delta_s'])} s")
    print(f"checkpoint interval  T     = {fmt(out['checkpoint_interval_T_s'])} s")
    print(f"restart time         R     = {fmt(out['restart_R_s'])} s")
    print(f"recovery (kill -> first new step): mean {fmt(out['recovery_mean_s'])} s, "
          f"max {fmt(out['recovery_max_s'])} s")
    print(f"MTBF                       = {fmt(out['mtbf_s'])} s")
    print(f"goodput (productive/wall)  = {fmt(out['goodput'])}  "
          f"({fmt(out['productive_s'])} s of {fmt(out['wall_s'])} s)")
    print(f"bound 1 - delta/T - (R + T/2)/MTBF = {fmt(out['goodput_bound'])}")
    print(f"goodput / bound            = {fmt(out['ratio'])}  (goal >= 0.95)")
    print("the run ledger, from the job's attempt records:")
    print(f"  goodput, same window     = {fmt(out['ledger_goodput_same_window'])}  "
          f"({fmt(out['ledger_productive_s'])} s productive; "
          f"{out['ledger_goodput_pp_off']:+.2f} pp from the measured goodput, goal within 2)")
    print(f"  goodput, process start to last record = {fmt(out['ledger_goodput_own_window'])}")
    print(f"  disruptions              = {out['ledger_disruptions']} "
          f"({out['ledger_attempts']} attempts; {out['kills']} kills)")
    print(f"  recovery (last record -> first step): mean {fmt(out['ledger_recovery_mean_s'])} s, "
          f"max {fmt(out['ledger_recovery_max_s'])} s  (R above: {fmt(out['restart_R_s'])} s)")
    print("  badput (s): " + ", ".join(f"{k} {v:.1f}" for k, v in
                                       out["ledger_buckets_s"].items() if v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
