"""What a pipeline expects of a checkpoint, and the validator's ``consistency`` check against it.

The ``validate_checkpoint`` task renders the job config the ``train`` task ran with (same spec,
dataset and checkpoint folder) and hands it over as ``--expect-job-config``; from it come the
expected config digest, model section (architecture) and sequence length. ``meta.json`` must
agree with all of them, with itself (its ``config_digest`` is the digest of its ``job_config``)
and must record a world size and gradient accumulation that multiply out to the global batch.
A different world size from the expected one is only noted: an elastic restart may change it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainforge.contract import DIGEST_EXCLUDED, RETRY_SECTION
from trainforge.trainer.errors import ConfigError


def config_digest(job_config: dict[str, Any]) -> str:
    """SHA-256 hex of the canonical JSON of a job config without ``identity`` and ``retry``.

    The formula of `trainforge.trainer.config.JobConfig.digest` (a test keeps the two equal), applied to a
    raw dict so that a job config this trainer version cannot parse still gets a digest.
    """
    body = {k: v for k, v in job_config.items() if k not in DIGEST_EXCLUDED}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Expectations:
    """Expected facts about a checkpoint; ``None`` fields are not checked."""

    config_digest: str | None = None
    vocab_size: int | None = None
    model: dict[str, Any] | None = None  # the job config's "model" section
    sequence_length: int | None = None
    world_size: int | None = None  # noted when it differs, never a failure

    @classmethod
    def from_job_config_file(cls, path: str | Path, vocab_size: int | None = None,
                             world_size: int | None = None) -> Expectations:
        """Expectations from a rendered job config JSON file.

        Raises:
            ConfigError: the file is missing, not JSON, or not a job config object.
        """
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ConfigError(f"--expect-job-config {path}: cannot read a JSON job config ({err})") from err
        if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
            raise ConfigError(f"--expect-job-config {path}: expected a job config object with a 'model' "
                              "section")
        return cls(config_digest=config_digest(raw), vocab_size=vocab_size, model=raw["model"],
                   sequence_length=(raw.get("data") or {}).get("sequence_length"), world_size=world_size)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_consistency(meta: dict[str, Any], expect: Expectations) -> tuple[bool, str]:
    """``(ok, detail)`` of meta.json against itself and ``expect`` (module doc lists the rules)."""
    problems, notes = [], []
    job = meta.get("job_config") if isinstance(meta.get("job_config"), dict) else {}
    world, accum = meta.get("world_size"), meta.get("grad_accum_steps")
    optim = job.get("optim") or {}
    micro, global_batch = optim.get("micro_batch_size"), optim.get("global_batch_size")
    micro = (job.get(RETRY_SECTION) or {}).get("micro_batch_size", micro)  # a retry's, after an out of memory
    if not (_positive_int(world) and _positive_int(accum)):
        problems.append(f"world_size={world!r}, grad_accum_steps={accum!r}: expected positive integers "
                        "recorded in meta.json")
    elif _positive_int(micro) and micro * world * accum != global_batch:
        problems.append(f"micro_batch_size {micro} x world_size {world} x grad_accum_steps {accum} = "
                        f"{micro * world * accum}, expected optim.global_batch_size {global_batch}")
    else:
        parallelism = (job.get("framework") or {}).get("parallelism", "ddp")
        notes.append(f"{parallelism}: world {world} x micro {micro} x accum {accum} = global batch {global_batch}")
    recorded = meta.get("config_digest")
    if job and recorded != config_digest(job):
        problems.append(f"config_digest={str(recorded)[:12]}... but meta.json's job_config hashes to "
                        f"{config_digest(job)[:12]}... (meta.json edited, or written by another trainer)")
    if expect.config_digest is not None and recorded != expect.config_digest:
        problems.append(f"config_digest: checkpoint {str(recorded)[:12]}..., expected "
                        f"{expect.config_digest[:12]}... (trained with another job config)")
    vocab = (meta.get("dataset") or {}).get("vocab_size")
    if expect.vocab_size is not None and vocab != expect.vocab_size:
        problems.append(f"vocab_size: checkpoint {vocab!r}, expected {expect.vocab_size}")
    if expect.model is not None:
        saved = job.get("model") or {}
        for key in sorted(set(saved) | set(expect.model)):
            if saved.get(key) != expect.model.get(key):
                problems.append(f"model.{key}: checkpoint {saved.get(key)!r}, expected {expect.model.get(key)!r}")
    seq_len = (job.get("data") or {}).get("sequence_length")
    if expect.sequence_length is not None and seq_len != expect.sequence_length:
        problems.append(f"data.sequence_length: checkpoint {seq_len!r}, expected {expect.sequence_length}")
    if expect.world_size is not None and _positive_int(world) and world != expect.world_size:
        notes.append(f"note: trained on world size {world}, the pipeline asks for {expect.world_size}")
    checked = ", ".join(k for k in ("config_digest", "vocab_size", "model", "sequence_length")
                        if getattr(expect, k) is not None) or "nothing expected"
    if problems:
        return False, "; ".join(problems)
    return True, f"{'; '.join(notes)}; checked against the pipeline: {checked}"
