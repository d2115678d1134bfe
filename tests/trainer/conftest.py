"""Fixtures for the trainer tests: a tiny dataset folder built per docs/contracts.md, job configs.

`build_dataset` plays prepare_data's part: it generates a small play-like corpus, trains a
byte-level BPE tokenizer on it (tokenizers library), writes uint16 token shards with EOS after
every document, and writes manifest.json last (tmp file + os.replace).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trainforge.engines.launch import LAUNCH_ENV

EOS = "<|endoftext|>"
WORDS = (
    "the love of my heart doth make thee fair and sweet night day king queen lord lady speak "
    "thou art not what I say to you come go here there now never ever sword crown blood fire "
    "rose gentle noble brave false true good ill wind sea star"
).split()
SPEAKERS = ("ROMEO", "JULIET", "HAMLET", "KING", "NURSE")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_documents(n_docs: int, seed: int) -> list[str]:
    """Play-like documents: lines of ``SPEAKER: words.``, about 1.5 KiB each."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        lines = []
        for _ in range(rng.randint(20, 30)):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10)))
            lines.append(f"{rng.choice(SPEAKERS)}: {words[0].upper()}{words[1:]}.")
        docs.append("\n".join(lines))
    return docs


def build_dataset(
    root: Path,
    vocab_size: int = 320,
    n_train: int = 40,
    n_val: int = 4,
    seed: int = 0,
    train_shards: int = 2,
    tokenizer_file: Path | None = None,
    eos_token: str = EOS,
) -> Path:
    """Write a trainforge.dataset/v1 folder under ``root`` and return it.

    ``tokenizer_file``: encode with this tokenizer.json (a pretrained model's, copied byte for
    byte; its post-processor's special tokens left out) and ``eos_token`` instead of training one.
    """
    root.mkdir(parents=True, exist_ok=True)
    docs = make_documents(n_train + n_val, seed)
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, root / "tokenizer.json")
        tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    else:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(docs, trainer=trainer)
        tokenizer.save(str(root / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(eos_token)

    splits = {}
    for name, split_docs, n_shards in (
        ("train", docs[:n_train], train_shards),
        ("validation", docs[n_train:], 1),
    ):
        ids = []
        for doc in split_docs:
            ids.extend(tokenizer.encode(doc, add_special_tokens=False).ids + [eos_id])
        tokens = np.asarray(ids, dtype=np.uint16)
        shards = []
        for i, part in enumerate(np.array_split(tokens, n_shards)):
            path = root / f"{name}-{i:05d}.bin"
            part.tofile(path)
            shards.append(
                {
                    "file": path.name,
                    "bytes": path.stat().st_size,
                    "sha256": _sha256(path),
                    "tokens": int(len(part)),
                }
            )
        splits[name] = {
            "documents": len(split_docs),
            "tokens": int(len(tokens)),
            "bytes_utf8": sum(len(d.encode("utf-8")) for d in split_docs),
            "shards": shards,
        }
    sources = [
        {
            "uri": f"generated://plays?seed={seed}",
            "bytes": sum(len(d) for d in docs),
            "sha256": "0" * 64,
        }
    ]
    settings = {"vocab_size": vocab_size, "seed": seed, "validation_documents": n_val}
    digest = hashlib.sha256(
        json.dumps(
            {"sources": sources, "settings": settings}, sort_keys=True, separators=(",", ":")
        ).encode()
    ).hexdigest()
    manifest = {
        "format": "trainforge.dataset/v1",
        "digest": digest,
        "dtype": "uint16",
        "vocab_size": tokenizer.get_vocab_size(),
        "eos_token": eos_token,
        "eos_id": eos_id,
        "tokenizer": {
            "file": "tokenizer.json",
            "bytes": (root / "tokenizer.json").stat().st_size,
            "sha256": _sha256(root / "tokenizer.json"),
        },
        "splits": splits,
        "sources": sources,
        "settings": settings,
        "stats": {"documents_in": len(docs), "removed": {"empty": 0, "duplicate": 0}},
    }
    tmp = root / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, root / "manifest.json")
    return root


BASE_JOB = {
    "format": "trainforge.job/v1",
    "identity": {"dag_id": "tiny", "run_id": "manual__1", "task_id": "train", "try_number": 1},
    "data": {"dataset_dir": "/set/by/fixture", "sequence_length": 32},
    "model": {
        "family": "llama",
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 64,
        "rope_theta": 10000.0,
        "dropout": 0.0,
        "tie_word_embeddings": True,
    },
    "optim": {
        "max_steps": 20,
        "global_batch_size": 8,
        "micro_batch_size": 2,
        "learning_rate": 0.01,
        "min_learning_rate": 0.001,
        "warmup_steps": 4,
        "weight_decay": 0.1,
        "beta1": 0.9,
        "beta2": 0.95,
        "grad_clip": 1.0,
        "seed": 1234,
    },
    "precision": "fp32",
    "checkpoint": {"dir": "/set/by/fixture", "interval_steps": 10, "keep_last": 2},
    "logging": {"log_every_steps": 5},
    "distributed": {"backend": "auto", "collective_timeout_s": 60},
}


def make_job(dataset_dir: Path, checkpoint_dir: Path, **sections) -> dict:
    """A valid job config dict; ``sections`` update whole keys, e.g. ``optim={"max_steps": 4}``."""
    job = copy.deepcopy(BASE_JOB)
    job["data"]["dataset_dir"] = str(dataset_dir)
    job["checkpoint"]["dir"] = str(checkpoint_dir)
    for key, value in sections.items():
        if isinstance(value, dict):
            job[key].update(value)
        else:
            job[key] = value
    return job


def write_job(path: Path, job: dict) -> Path:
    path.write_text(json.dumps(job, indent=2))
    return path


@pytest.fixture(scope="session")
def dataset_dir(tmp_path_factory) -> Path:
    """One tiny dataset shared by the whole session (read-only for tests)."""
    return build_dataset(tmp_path_factory.mktemp("data") / "datasets" / "tiny")


@pytest.fixture
def job_file(tmp_path, dataset_dir):
    """``job_file(**sections) -> Path``: writes a job config (checkpoints under tmp_path) and returns it."""

    def make(name: str = "job.json", checkpoint_dir: Path | None = None, **sections) -> Path:
        job = make_job(dataset_dir, checkpoint_dir or tmp_path / "checkpoints", **sections)
        return write_job(tmp_path / name, job)

    return make


@pytest.fixture
def dataset_builder():
    """`build_dataset` itself, for tests that need a dataset of their own (e.g. to corrupt it)."""
    return build_dataset


@pytest.fixture
def valid_job(tmp_path, dataset_dir) -> dict:
    """A valid job config dict (fresh copy per test), checkpoints under tmp_path."""
    return make_job(dataset_dir, tmp_path / "checkpoints")


REPO_ROOT = Path(__file__).resolve().parents[2]


def trainer_command(job_path: Path, nproc: int | None = None) -> list[str]:
    """argv of ``python -m trainforge.trainer.train`` (nproc None) or torchrun with ``nproc`` processes."""
    if nproc is None:
        return [sys.executable, "-m", "trainforge.trainer.train", "--config", str(job_path)]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "trainforge.trainer.train",
        "--config",
        str(job_path),
    ]


def trainer_env(result_file: Path, **extra: str) -> dict[str, str]:
    """The launcher's environment: result file, 1 thread per process, the engines' launch
    variables, no MLflow unless given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(
        TRAINFORGE_RESULT_FILE=str(result_file),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
    )
    env.update(LAUNCH_ENV)  # what every engine sets for torchrun (operators/engines/launch.py)
    env.update(extra)
    return env


def run_trainer(
    job_path: Path, result_file: Path, nproc: int | None = None, timeout_s: float = 180, **env: str
) -> subprocess.CompletedProcess:
    """Run the trainer to completion (stdout+stderr captured as text) under a timeout."""
    return subprocess.run(
        trainer_command(job_path, nproc),
        cwd=REPO_ROOT,
        env=trainer_env(result_file, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout_s,
        check=False,
    )


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, dataset_dir) -> dict:
    """One real single-process training run (20 steps, checkpoints at 10 and 20), shared read-only.

    Returns {"checkpoints": Path, "result": dict, "job": Path}.
    """
    root = tmp_path_factory.mktemp("trained")
    job = write_job(root / "job.json", make_job(dataset_dir, root / "checkpoints"))
    proc = run_trainer(job, root / "result.json")
    assert proc.returncode == 0, proc.stdout[-4000:]
    return {
        "checkpoints": root / "checkpoints",
        "result": json.loads((root / "result.json").read_text()),
        "job": job,
    }


@pytest.fixture(scope="session")
def run_trainer_fixture():
    """`run_trainer(job_path, result_file, nproc=None, timeout_s=180, **env)` for tests."""
    return run_trainer


@pytest.fixture(scope="session")
def tools() -> SimpleNamespace:
    """The helpers above for tests that drive the trainer themselves (conftest is not imported)."""
    return SimpleNamespace(make_job=make_job, write_job=write_job, run_trainer=run_trainer,
                           command=trainer_command, env=trainer_env, repo_root=REPO_ROOT)
