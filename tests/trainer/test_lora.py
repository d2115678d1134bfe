"""LoRA (``training.peft``) in the trainer: only the adapters train and are checkpointed (their
size checked), a killed run resumes to the result of an uninterrupted one, the checkpoint
validates, a checkpoint on other base weights is refused, and the export holds merged full
weights that plain transformers loads and that generate the tokens the trained model (base plus
adapters) generates. On 2 ranks with DDP and with FSDP2 + activation checkpointing + compile.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tests.trainer.conftest import build_dataset
from tests.trainer.test_pretrained import _eos_token, pretrained_job
from trainforge.trainer import checkpoint as ckpt
from trainforge.trainer.adapters import checkpoint_model
from trainforge.trainer.config import parse_job_config
from trainforge.trainer.data import open_dataset
from trainforge.trainer.export import export_checkpoint
from trainforge.trainer.validate import validate_checkpoint

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.distributed]

STEPS = 8
LORA = {"method": "lora", "r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "auto", "merge": True}
RUNS = {"ddp": [("parallelism", "ddp"), ("compile", False)],
        "fsdp": [("parallelism", "fsdp"), ("activation_checkpointing", True), ("compile", True)]}


@pytest.fixture(scope="module")
def base(hf_model, tmp_path_factory):
    folder = hf_model("qwen3")
    data = build_dataset(tmp_path_factory.mktemp("lora-data") / "ds", n_train=24, n_val=4,
                         tokenizer_file=folder / "tokenizer.json", eos_token=_eos_token(folder))
    return folder, data


def _job(tools, folder: Path, data: Path, run: Path, parallelism: str) -> Path:
    job = pretrained_job(tools, folder, data, run / "ck", framework=RUNS[parallelism],
                         optim={"max_steps": STEPS, "warmup_steps": 2, "learning_rate": 3e-3},
                         checkpoint={"interval_steps": 4, "keep_last": 3})
    job["peft"] = dict(LORA)
    return tools.write_job(run / "job.json", job)


def _killed_after_first_checkpoint(tools, job: Path, run: Path) -> None:
    with open(run / "killed.log", "w") as log:
        proc = subprocess.Popen(tools.command(job, nproc=2), cwd=tools.repo_root, env=tools.env(run / "r.json"),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while not (run / "ck" / ckpt.step_dir_name(4) / ckpt.MANIFEST).exists():
                assert proc.poll() is None, (run / "killed.log").read_text()[-4000:]
                assert time.monotonic() < deadline, "no first checkpoint after 240 s"
                time.sleep(0.005)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this test started
            proc.wait(30)


@pytest.mark.parametrize("parallelism", list(RUNS))
def test_lora_trains_the_adapters_alone_and_resumes_exactly(parallelism, base, tools, tmp_path):
    folder, data = base
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    whole.mkdir(), killed.mkdir()
    proc = tools.run_trainer(_job(tools, folder, data, whole, parallelism), whole / "result.json", nproc=2,
                             timeout_s=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    reference = json.loads((whole / "result.json").read_text())
    assert reference["status"] == "success" and reference["final_step"] == STEPS

    step_dir = whole / "ck" / ckpt.step_dir_name(STEPS)
    weights = safetensors.torch.load_file(step_dir / ckpt.WEIGHTS)
    assert weights and all(".lora_A.default." in n or ".lora_B.default." in n for n in weights)
    config = json.loads((folder / "config.json").read_text())
    d, ff, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    per_layer = sum(4 * (i + o) for i, o in ((d, q), (d, kv), (d, kv), (q, d), (d, ff), (d, ff), (ff, d)))
    assert sum(t.numel() for t in weights.values()) == layers * per_layer  # r=4: A (4 x in) + B (out x 4)
    assert (step_dir / ckpt.WEIGHTS).stat().st_size < 4 * layers * per_layer + 64 * 1024  # adapters only
    assert json.loads((step_dir / "meta.json").read_text())["adapter"]["method"] == "lora"

    _killed_after_first_checkpoint(tools, _job(tools, folder, data, killed, parallelism), killed)
    resumed = tools.run_trainer(killed / "job.json", killed / "result.json", nproc=2, timeout_s=300)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "resuming from" in resumed.stdout
    result = json.loads((killed / "result.json").read_text())
    assert result["final_train_loss"] == reference["final_train_loss"]  # exact
    theirs = safetensors.torch.load_file(killed / "ck" / ckpt.step_dir_name(STEPS) / ckpt.WEIGHTS)
    assert theirs.keys() == weights.keys() and all(torch.equal(theirs[n], weights[n]) for n in weights)

    report = validate_checkpoint(step_dir, data)
    assert report["ok"], report["checks"]
    if parallelism == "ddp":
        _check_merged_export(step_dir, data, tmp_path / "hf")


def _check_merged_export(step_dir: Path, data: Path, out: Path) -> None:
    """The export's merged weights, loaded by plain transformers, generate what the trained
    model (the base with the adapters) generates, greedily."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export_checkpoint(step_dir, data, out)
    c = ckpt.load_checkpoint(step_dir)
    cfg = parse_job_config(c.meta["job_config"])
    tok = AutoTokenizer.from_pretrained(out)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Where does the river start?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with checkpoint_model(cfg, open_dataset(data), c.weights) as trained:
        trained.eval()
        expected = trained.generate(**prompt, max_new_tokens=12, do_sample=False)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert not any("lora" in n for n in merged.state_dict())
    got = merged.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, expected)


def test_adapters_are_refused_on_other_base_weights(base, tools, tmp_path, hf_model):
    folder, data = base
    run = tmp_path / "run"
    run.mkdir()
    job = _job(tools, folder, data, run, "ddp")
    proc = tools.run_trainer(job, run / "result.json", nproc=None, timeout_s=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    moved = json.loads(job.read_text())  # the same spec, its base folder now holding other weights
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    index = other / "model.safetensors.index.json"
    index.write_text(index.read_text().replace("}", ' }', 1))  # another revision's index
    moved["pretrained"]["folder"] = str(other)
    job.write_text(json.dumps(moved))
    refused = tools.run_trainer(job, run / "result.json", nproc=None, timeout_s=240)
    result = json.loads((run / "result.json").read_text())
    assert refused.returncode == result["exit_code"] != 0 and result["status"] != "success"
    assert "adapters load only on the base they were trained on" in result["message"]
