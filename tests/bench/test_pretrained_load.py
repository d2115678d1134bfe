"""bench/pretrained_load.py at a tiny size: the shapes it picks, the checkpoint it makes (sharded
bf16, Hugging Face layout), both of its reads giving the same fp32 tensors, its arguments, and
(heavy) a whole run printing its two ratios."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import pretrained_load  # noqa: E402


def _params(shape: dict) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(pretrained_load.llama_config(shape))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("size_gb", [1.0, 0.25, 0.05])
def test_the_shape_is_about_the_size_asked_for(size_gb):
    shape = pretrained_load.llama_shape(size_gb)
    assert shape["num_layers"] >= 4 and shape["hidden_size"] % shape["num_heads"] == 0
    assert 2 * _params(shape) == pytest.approx(size_gb * 1e9, rel=0.15)
    if size_gb == 1.0:
        assert shape["hidden_size"] == 2048 and 8 <= shape["num_layers"] <= 10


def test_the_checkpoint_is_sharded_bf16_and_both_reads_give_its_tensors_in_fp32(tmp_path):
    from safetensors import safe_open

    shape = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128,
             "vocab_size": 320}
    folder = pretrained_load.make_checkpoint(tmp_path / "m", pretrained_load.llama_config(shape), shards=4)
    shards = pretrained_load.shards_of(folder)
    assert len(shards) >= 3 and json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    with safe_open(str(shards[0]), "pt") as f:
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())
    assert pretrained_load.fp32_bytes(folder) == 4 * _params(shape)

    model = pretrained_load.load_model(folder)
    loaded = model.state_dict()
    from safetensors.torch import load_file

    raw = {k: v.float() for path in shards for k, v in load_file(path).items()}
    assert set(raw) <= set(loaded) and all(torch.equal(loaded[k], raw[k]) for k in raw)
    assert all(t.dtype == torch.float32 for t in loaded.values())
    assert pretrained_load.trainer_load(folder) > 0 and pretrained_load.raw_read(folder) > 0


@pytest.mark.parametrize(("args", "message"), [
    (["--size-gb", "0"], "--size-gb=0.0: expected more than 0"),
    (["--rounds", "0"], "--rounds=0: expected at least 1"),
    (["--threads", "0"], "--threads=0: expected at least 1"),
])
def test_bad_arguments_are_refused(args, message):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "pretrained_load.py"), *args], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.heavy
@pytest.mark.distributed
def test_a_small_run_prints_both_ratios(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "pretrained_load.py"), "--size-gb", "0.02",
                           "--rounds", "1", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "trainer/raw throughput = " in proc.stdout and "(goal >= 0.8" in proc.stdout
    line = next(x for x in proc.stdout.splitlines() if x.startswith("FSDP2 on 2 ranks"))
    assert math.isfinite(float(line.split("= ")[1].split()[0])) and "(goal <= 0.6" in line
    assert len(list(tmp_path.glob("llama-*/model-*.safetensors"))) >= 3  # --dir keeps it for the next run
