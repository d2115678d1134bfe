"""Every field the trainer reads from a job config is documented in docs/contracts.md's "Job
config" section: the trainer's reader (trainforge.trainer.config) is walked on configs holding
every optional section, and each field it reads must appear there by name."""

from __future__ import annotations

import re
from pathlib import Path

from tests.operators.pipeline.test_loader import MINIMAL
from trainforge.engines.base import JobIdentity
from trainforge.jobconfig import render_job_config
from trainforge.pipeline import parse_spec_text
from trainforge.trainer import config_fields
from trainforge.trainer.config import parse_job_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "contracts.md"
IDENTITY = JobIdentity("tiny", "manual__1", "train", 1)
PRETRAINED = {"folder": "/models/qwen3", "source": "models/qwen3", "revision": None}


def _job_config_section() -> str:
    text = DOC.read_text()
    start = text.index("## Job config")
    return text[start:text.index("\n## ", start + 1)]


def _fields_read(monkeypatch, configs: list[dict]) -> set[str]:
    read: set[str] = set()
    real = config_fields.Section._get

    def recording(self, key, default=None):
        read.add(f"{self.path}.{key}" if self.path else key)
        return real(self, key, default)

    monkeypatch.setattr(config_fields.Section, "_get", recording)
    for config in configs:
        parse_job_config(config)
    return read


def test_every_field_the_trainer_reads_is_documented(monkeypatch):
    scratch = parse_spec_text(MINIMAL.replace("training:\n", "training:\n  fault: {world_size_change: refuse}\n", 1)
                              .replace("model:\n", "model:\n  config_overrides: {rms_norm_eps: 1.0e-6}\n", 1),
                              "ok.yaml")
    with_init = render_job_config(scratch, "/data/ds", "/ckpt", IDENTITY,
                                  init={"checkpoint": "/ckpt/old", "source": "models:/m/1"})
    lora = parse_spec_text(MINIMAL.replace("training:\n", "training:\n  peft: {r: 8}\n", 1)
                           + "model:\n  pretrained: models/qwen3\n", "ok.yaml")
    with_lora = render_job_config(lora, "/data/ds", "/ckpt", IDENTITY, pretrained=PRETRAINED)
    with_lora["data"]["packing"] = True
    read = _fields_read(monkeypatch, [with_init, with_lora])
    assert {"peft.r", "pretrained.folder", "init.checkpoint", "data.packing", "model.config_overrides",
            "distributed.world_size_change"} <= read, sorted(read)
    doc = _job_config_section()
    missing = [name for name in sorted(read)  # by its key in the JSON example, or by its dotted name
               if not re.search(rf'["`]({re.escape(name)}|{re.escape(name.rsplit(".", 1)[-1])})["`]', doc)]
    assert missing == [], f"job config fields the trainer reads but docs/contracts.md does not name: {missing}"
