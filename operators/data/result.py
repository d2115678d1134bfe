"""What data preparation hands back: :class:`PreparedDataset`, a dataset folder that verifies."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainforge.data.manifest import SPLITS


@dataclass(frozen=True)
class PreparedDataset:
    """A dataset folder that verifies, and what it holds.

    Attributes:
        path: absolute ``output_root/<digest>``.
        digest: dataset digest (the folder name).
        manifest: the parsed ``manifest.json``.
        reused: True when the folder existed and verified; nothing was rewritten.
        elapsed_s: wall time of :func:`prepare_dataset`, seconds.
        uri: where the dataset lives: ``s3://.../<digest>`` or ``file:///.../<digest>``.
        reuse: ``""`` (prepared now), ``"local"`` (the folder verified) or ``"remote"`` (the
            S3 copy existed; fetched or matched locally).
        timings_s: seconds per phase (``scan``, ``tokenizer``, ``encode``, ``upload``, ...).
    """

    path: Path
    digest: str
    manifest: dict[str, Any]
    reused: bool
    elapsed_s: float
    uri: str = ""
    reuse: str = ""
    timings_s: dict[str, float] = field(default_factory=dict)

    @property
    def documents(self) -> dict[str, int]:
        return {s: self.manifest["splits"][s]["documents"] for s in SPLITS}

    @property
    def tokens(self) -> dict[str, int]:
        return {s: self.manifest["splits"][s]["tokens"] for s in SPLITS}

    def summary(self) -> dict[str, Any]:
        """Small JSON-able summary (XCom, MLflow params, the task log)."""
        splits = self.manifest["splits"]
        stats = self.manifest["stats"]
        return {
            "dataset_dir": str(self.path),
            "dataset_uri": self.uri or self.path.as_uri(),
            "digest": self.digest,
            "reused": self.reused,
            "reuse": self.reuse,
            "vocab_size": self.manifest["vocab_size"],
            "dtype": self.manifest["dtype"],
            "documents": self.documents,
            "tokens": self.tokens,
            "bytes_utf8": {s: splits[s]["bytes_utf8"] for s in SPLITS},
            "shards": {s: len(splits[s]["shards"]) for s in SPLITS},
            "documents_in": stats["documents_in"],
            "removed": stats["removed"],
            "malformed": stats.get("malformed", {}).get("count", 0),
            "cleaning": stats["cleaning"],
            **({"loss_tokens": {s: splits[s]["loss_tokens"] for s in SPLITS},
                "examples": self.manifest["examples"]} if "examples" in self.manifest else {}),
            "timings_s": {k: round(v, 3) for k, v in self.timings_s.items()},
        }
