"""Where one attempt's time went, on rank 0's own clocks: the record the run's ledger is built from.

An attempt is one start of the trainer (a torchrun restart or a new job is a new attempt). Rank 0
times, with local ``perf_counter`` readings and no collective:

* ``startup``: process start (the kernel's, `process_started_at`) to the first step, less restore;
* ``restore``: loading the newest checkpoint (`trainforge.trainer.train.resume`);
* ``data_wait``: waiting for the next micro-batch;
* ``save``: a checkpoint's blocking part (the write before, the copy to host, the barrier);
* ``eval``: evaluation inside the training loop (none today: validation is its own stage);
* ``compile``: compiling inside a step (trainforge.trainer.compile), out of that step's time;
* ``wasted``: the step time of steps this run had reached before (``reached``: the newest step
  the MLflow run already holds when the attempt starts) and trains again after resuming from
  an older checkpoint;
* ``productive``: the step time of every other step.

Beside the buckets, not one of them (the step time goes on meanwhile): ``background_save_s``, the
seconds rank 0's writer thread spent writing checkpoints (trainforge.trainer.checkpoint_writer);
and ``compiled``, how the steps ran (`trainforge.contract.COMPILE_MODES`).

:meth:`AttemptClock.snapshot` is the record: the MLflow tag ``trainforge.ledger.attempt.<ms>``
and the same JSON under ``$TRAINFORGE_JOB_DIR/ledger/`` and ``$TRAINFORGE_LEDGER_DIR`` (every try's
folder), flushed at log intervals, every :data:`FLUSH_EVERY_S`, after checkpoints and at the end.
How a step is timed, when records are written and what a kill loses: docs/contracts.md, "Run
ledger".
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from trainforge.contract import LEDGER_DIR, LEDGER_DIR_ENV, LEDGER_TAG_PREFIX
from trainforge.storage import StorageError, is_s3, storage_for
from trainforge.storage.files import atomic_write_bytes
from trainforge.trainer.energy import EnergyMeter
from trainforge.trainer.startup import process_started_at

log = logging.getLogger(__name__)
RECORD_VERSION = 1
FLUSH_EVERY_S = 5.0
"""The longest a record goes unwritten while steps run (seconds): what a SIGKILL can lose."""
T = TypeVar("T")


def flops_per_token(non_embedding_params: int, layers: int, heads: int, head_dim: int,
                    seq_len: int, trainable_non_embedding: int | None = None) -> int:
    """Training FLOPs per token as torchtitan counts them, with frozen weights counted for what
    runs (docs/contracts.md, "MFU"): 2 x parameters forward, 2 x parameters for the activations'
    gradients, 2 x trainable parameters for the weights' gradients (embeddings left out, they
    are a lookup), + 12 x layers x heads x head_dim x sequence length (the attention scores and
    their use, forward and backward). All parameters trainable (None): the familiar 6 x N."""
    trainable = non_embedding_params if trainable_non_embedding is None else trainable_non_embedding
    return 4 * non_embedding_params + 2 * trainable + 12 * layers * heads * head_dim * seq_len


class AttemptClock:
    """Rank 0's buckets of this attempt; see the module docstring."""

    def __init__(self, *, world_size: int, tokens_per_step: int, flops_per_token: int,
                 device: str, energy: EnergyMeter | None = None,
                 started_at: float | None = None, job_dir: str | None = None,
                 ledger_dir: str | None = None, compiled: str = "eager") -> None:
        self.started_at = process_started_at() if started_at is None else started_at
        self.world_size, self.tokens_per_step = world_size, tokens_per_step
        self.flops_per_token, self.device, self.energy = flops_per_token, device, energy
        name = f"attempt-{int(self.started_at * 1000)}.json"
        self.file = Path(job_dir) / LEDGER_DIR / name if job_dir else None
        # the task's folder of every try's records: $TRAINFORGE_LEDGER_DIR unless given
        ledger_dir = ledger_dir if ledger_dir is not None else os.environ.get(LEDGER_DIR_ENV)
        self.shared = storage_for(ledger_dir) if ledger_dir else None
        self.shared_dir: str | Path | None = (
            (ledger_dir if is_s3(ledger_dir) else Path(ledger_dir)) if ledger_dir else None)
        self.shared_file = self.shared.join(self.shared_dir, name) if self.shared else None
        self.seconds = {"startup": 0.0, "restore": 0.0, "data_wait": 0.0, "save": 0.0,
                        "eval": 0.0, "compile": 0.0, "wasted": 0.0, "productive": 0.0}
        self.compiled = compiled  # how the steps run; "partly_eager" once a compile limit was hit
        self.resumed_step = self.reached_step = self.step = 0
        self.productive_steps = self.wasted_steps = 0
        self.first_step_at: float | None = None
        self.background_save_s = 0.0  # not a bucket: it overlaps the steps
        self.staging: dict[str, Any] | None = None  # the checkpoint staging choice (trainer/host_memory.py)
        self._step_wait = self._mark = 0.0
        self._open: tuple[str, float] | None = None  # (bucket, perf_counter) of the step running on
        self._flushed = time.monotonic()  # when the record was last taken

    def restored(self, seconds: float, resumed_step: int, reached_step: int) -> None:
        """The checkpoint load took ``seconds``; training goes on after ``resumed_step`` and the
        run had already reached ``reached_step`` (steps up to it are trained again)."""
        self.seconds["restore"] += seconds
        self.resumed_step = self.step = resumed_step
        self.reached_step = max(reached_step, resumed_step, self._reached_in_job_folder())

    def _reached_in_job_folder(self) -> int:
        """The newest step an earlier attempt recorded in the job folder or in the task's
        ledger folder (earlier tries, on other job folders): a job without MLflow (or whose run
        was not reachable) still counts re-trained steps as wasted. An unreadable record is
        left out."""
        texts = []
        if self.file is not None:
            for path in self.file.parent.glob("attempt-*.json"):
                if path != self.file:
                    try:
                        texts.append(path.read_text())
                    except OSError:
                        continue
        if self.shared is not None:
            try:
                for name in self.shared.list_files(self.shared_dir):
                    if name.startswith("attempt-") and name.endswith(".json"):
                        location = self.shared.join(self.shared_dir, name)
                        if location != self.shared_file:
                            texts.append((self.shared.read_bytes(location) or b"").decode())
            except (StorageError, UnicodeDecodeError) as err:
                log.warning("could not read the earlier attempts' records in %s (%s): steps "
                            "trained again count as wasted only as far as MLflow knows them",
                            self.shared_dir, err)
        newest = 0
        for text in texts:
            try:
                newest = max(newest, int(json.loads(text)["step"]))
            except (ValueError, KeyError, TypeError):
                continue
        return newest

    def loop_started(self) -> None:
        """The first step begins: everything since process start that is not restore is startup."""
        self.first_step_at = time.time()
        self.seconds["startup"] = max(0.0, self.first_step_at - self.started_at - self.seconds["restore"])

    def step_started(self) -> None:
        self._close_step()
        self._step_wait = 0.0

    def _close_step(self) -> None:
        """The previous step's time since it ended (its logging) goes to its bucket."""
        now = time.perf_counter()
        if self._open is not None:
            bucket, since = self._open
            self.seconds[bucket] += max(0.0, now - since)
        self._open = None
        self._mark = now

    def batches(self, items: Iterable[T]) -> Iterator[T]:
        """``items``, with the time spent waiting for each counted as ``data_wait``."""
        it = iter(items)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                self._step_wait += time.perf_counter() - t0
                return
            self._step_wait += time.perf_counter() - t0
            yield item

    def step_done(self, step: int, compile_s: float = 0.0) -> None:
        """Optimizer step ``step`` ended: its time is productive, or wasted when trained before,
        less the ``compile_s`` it spent compiling (the ``compile`` bucket)."""
        now = time.perf_counter()
        bucket = "wasted" if step <= self.reached_step else "productive"
        step_s = max(0.0, now - self._mark - self._step_wait)
        compile_s = min(max(0.0, compile_s), step_s)
        self.seconds["compile"] += compile_s
        self.seconds[bucket] += step_s - compile_s
        self.seconds["data_wait"] += self._step_wait
        if bucket == "wasted":
            self.wasted_steps += 1
        else:
            self.productive_steps += 1
        self.step = step
        self._open = (bucket, now)

    def saved(self, seconds: float) -> None:
        """A checkpoint took ``seconds`` after the step that just ended; that step's time stops."""
        self.seconds["save"] += seconds
        if self._open is not None:
            bucket, since = self._open
            self.seconds[bucket] += max(0.0, time.perf_counter() - since - seconds)
            self._open = (bucket, time.perf_counter())

    def flush(self, tracker: Any = None, saved_s: float | None = None) -> None:
        """The record as of now to the job folder and to ``tracker``'s run (``set_tags``). After a
        checkpoint, ``saved_s`` its blocking seconds: writing its record is checkpoint time too."""
        t0 = time.perf_counter()
        if saved_s is not None:
            self.saved(saved_s)
        tags = self.snapshot()
        if tracker is not None:
            tracker.set_tags(tags)
        if saved_s is not None:
            self.saved(time.perf_counter() - t0)

    def loop_ended(self) -> None:
        """The steps are over: what follows (stopping the loop's helpers) is no step's time."""
        self._close_step()

    def saved_in_background(self, seconds: float) -> None:
        """A checkpoint write on the writer thread took ``seconds`` (called on that thread)."""
        self.background_save_s += seconds

    def flush_due(self, every_s: float = FLUSH_EVERY_S) -> bool:
        """Whether ``every_s`` have passed since the record was last taken (:meth:`snapshot`)."""
        return time.monotonic() - self._flushed >= every_s

    def record(self, final: bool = False) -> dict[str, Any]:
        """This attempt's record as of now (docs/contracts.md, "Run ledger")."""
        if self._open is not None:  # the step running on is counted up to now
            bucket, since = self._open
            now = time.perf_counter()
            self.seconds[bucket] += max(0.0, now - since)
            self._open = (bucket, now)
        record: dict[str, Any] = {
            "v": RECORD_VERSION, "started_at": round(self.started_at, 3),
            "first_step_at": None if self.first_step_at is None else round(self.first_step_at, 3),
            "recorded_at": round(time.time(), 3), "final": final,
            "resumed_step": self.resumed_step, "reached_step": self.reached_step,
            "step": self.step, "productive_steps": self.productive_steps,
            "wasted_steps": self.wasted_steps, "tokens_per_step": self.tokens_per_step,
            "world_size": self.world_size, "device": self.device,
            "flops_per_token": self.flops_per_token, "compiled": self.compiled,
            "seconds": {k: round(v, 4) for k, v in self.seconds.items()},
            "background_save_s": round(self.background_save_s, 4),
        }
        if self.staging is not None:
            record["checkpoint_staging"] = self.staging
        if self.energy is not None:  # per kind and per GPU device (trainforge.trainer.energy)
            record.update(self.energy.record())
        return record

    def snapshot(self, final: bool = False) -> dict[str, str]:
        """The record as of now: written to the job folder's file (when there is one) and
        returned as its MLflow tag. A file that cannot be written is a warning, not a failure."""
        text = json.dumps(self.record(final), separators=(",", ":"))
        self._flushed = time.monotonic()
        if self.file is not None:
            try:
                self.file.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(self.file, text.encode("utf-8"))
            except OSError as err:
                log.warning("could not write the ledger record %s (%s): from now on only MLflow "
                            "holds it", self.file, err)
                self.file = None
        if self.shared is not None and self.shared_file is not None:
            try:
                if isinstance(self.shared_dir, Path):
                    self.shared_dir.mkdir(parents=True, exist_ok=True)
                self.shared.write_bytes(self.shared_file, text.encode("utf-8"))
            except (OSError, StorageError) as err:
                log.warning("could not write the ledger record %s (%s): a later try sees this "
                            "attempt only through MLflow or this job's folder", self.shared_file,
                            err)
                self.shared = None
        return {f"{LEDGER_TAG_PREFIX}{int(self.started_at * 1000)}": text}
