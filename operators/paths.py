"""Where trainforge keeps runtime state, and how spec paths resolve.

``TRAINFORGE_HOME`` (environment) is the root of everything a pipeline writes locally: corpus
cache, prepared datasets, job folders, checkpoints; ``~/.trainforge`` without it (``make`` sets
it to ``.trainforge/`` in the checkout). Relative paths in a pipeline spec
(``data.sources``, ``data.output_uri``, ``training.checkpoint.uri``) resolve against it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


def trainforge_home() -> Path:
    """The runtime root (absolute)."""
    home = os.environ.get("TRAINFORGE_HOME")
    if home:
        return Path(home).expanduser().absolute()
    return Path.home() / ".trainforge"


def resolve(path_or_uri: str) -> str:
    """A spec path made absolute against ``TRAINFORGE_HOME``; URIs with a scheme pass through."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.\-]*://", path_or_uri):
        return path_or_uri
    path = Path(path_or_uri).expanduser()
    return str(path if path.is_absolute() else trainforge_home() / path)


def safe_segment(text: str) -> str:
    """A string made safe as one path segment (Airflow run ids contain ':' and '+')."""
    return re.sub(r"[^A-Za-z0-9_.\-]+", "_", text).strip("._") or "_"


def checkpoint_root(spec_uri: str, dag_id: str, run_id: str) -> str:
    """Checkpoint folder of one DAG run: ``<checkpoint.uri>/<dag_id>/<run_id>``.

    A local ``checkpoint.uri`` resolves against ``TRAINFORGE_HOME``; an ``s3://bucket/prefix``
    one stays a URI (``s3://bucket/prefix/<dag_id>/<run_id>``). Shared by every try of the
    ``train`` task, so a retry resumes from the newest valid one.
    """
    root = resolve(spec_uri)
    if root.startswith("s3://"):
        return "/".join([root.rstrip("/"), safe_segment(dag_id), safe_segment(run_id)])
    return str(Path(root) / safe_segment(dag_id) / safe_segment(run_id))


def dataset_location(prepared: dict) -> str:
    """What the trainer, validator and exporter read: the ``s3://.../<digest>`` URI of a dataset
    prepared into S3 (readable from any machine: cluster pods, Ray workers), else its local folder.

    ``prepared`` is the XCom of ``prepare_data`` (``dataset_dir``, ``dataset_uri``). Every task
    of a run uses this one value: it is part of the job config, whose digest the validator checks.
    """
    uri = prepared.get("dataset_uri") or ""
    return uri.rstrip("/") if uri.startswith("s3://") else prepared["dataset_dir"]
