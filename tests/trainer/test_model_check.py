"""The trainer's startup check (trainer/model_check.py): a broken model is refused before step 1 as a
permanent error (exit 78) naming the tensor, never trained into "diverged" (79) or to a success.

Faults reach the trainer the way a user's would: a copy of a tiny Hugging Face folder
(tests/hf_models.py) with a NaN in its config.json or its safetensors. The rotary reference is
transformers' own RoPE initialisation; the wrong-frequency, untied and meta cases are made on a
model loaded by the trainer's own loading path and checked in process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tests.hf_models import FAMILIES
from tests.trainer.conftest import build_dataset
from trainforge.trainer import pretrained
from trainforge.trainer.config import ModelConfig, parse_job_config
from trainforge.trainer.distributed import Dist
from trainforge.trainer.errors import ConfigError
from trainforge.trainer.model_check import check_model, model_problems

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ONE_PROCESS = Dist(enabled=False, rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def llama(hf_model, tmp_path_factory) -> tuple[Path, Path]:
    """(the tiny llama folder, a dataset encoded with its tokenizer)."""
    from transformers import AutoTokenizer

    folder = hf_model("llama")
    eos = AutoTokenizer.from_pretrained(folder).eos_token
    data = build_dataset(tmp_path_factory.mktemp("data-llama") / "ds", n_train=24, n_val=4,
                         tokenizer_file=folder / "tokenizer.json", eos_token=eos)
    return folder, data


def _job(tools, folder: Path, data: Path, checkpoints: Path, **sections) -> dict:
    job = tools.make_job(data, checkpoints, optim={"max_steps": 2, "warmup_steps": 0},
                         **{k: v for k, v in sections.items() if k != "framework"})
    job["framework"] = dict(sections.get("framework", {}))
    job["model"] = {"family": "pretrained", "dropout": None}
    job["pretrained"] = {"folder": str(folder), "source": str(folder), "revision": None}
    return job


def _loaded(folder: Path) -> torch.nn.Module:
    """The folder's model as the trainer loads it (config, shards checked, filled on the CPU)."""
    return pretrained.load_pretrained(folder, pretrained.read_config(folder, ModelConfig("pretrained", *[None] * 8)),
                                      "cpu")


def _run(tools, job: dict, tmp_path: Path, nproc: int | None = None) -> tuple[int, dict, str]:
    proc = tools.run_trainer(tools.write_job(tmp_path / "job.json", job), tmp_path / "result.json", nproc=nproc)
    return proc.returncode, json.loads((tmp_path / "result.json").read_text()), proc.stdout


def test_a_nan_rotary_buffer_from_config_json_is_refused_at_startup_naming_it(llama, tools, tmp_path):
    """config.json's rope_theta NaN makes every rotary frequency but the first NaN (today: trained,
    "diverged at step 1", exit 79)."""
    folder, data = llama
    broken = shutil.copytree(folder, tmp_path / "model")
    config = json.loads((broken / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = float("nan")  # written as JSON's NaN, which transformers reads
    (broken / "config.json").write_text(json.dumps(config))
    code, result, out = _run(tools, _job(tools, broken, data, tmp_path / "ck"), tmp_path)
    assert code == 78, out[-3000:]
    assert result["status"] == "bad_config" and result["final_step"] == 0
    assert "startup check" in result["message"]
    assert "model.rotary_emb.inv_freq: 7 of 8 values are not finite (first: nan)" in result["message"]
    assert "diverged" not in result["message"]


@pytest.mark.distributed
def test_a_nan_in_one_ranks_fsdp_shard_fails_every_rank_naming_the_weight(llama, tools, tmp_path):
    """A NaN in the last row of a weight reaches rank 1's FSDP2 shard only; both ranks exit 78
    together (no hang), and rank 0's result names the tensor and the rank that holds it."""
    folder, data = llama
    broken = shutil.copytree(folder, tmp_path / "model")
    name = "model.layers.1.mlp.down_proj.weight"
    shard = broken / json.loads((broken / pretrained.INDEX).read_text())["weight_map"][name]
    tensors = safetensors.torch.load_file(shard)
    tensors[name][-1, -1] = float("nan")
    safetensors.torch.save_file(tensors, shard, metadata={"format": "pt"})
    job = _job(tools, broken, data, tmp_path / "ck", framework={"parallelism": "fsdp", "compile": False})
    _, result, out = _run(tools, job, tmp_path, nproc=2)  # torchrun itself exits 1 when its workers fail
    assert result["exit_code"] == 78 and result["status"] == "bad_config", out[-3000:]
    assert f"{name}: 1 of " in result["message"] and "(rank 1)" in result["message"], result["message"]
    for rank in (0, 1):  # each rank raised it (rank 1 logs errors too)
        assert f"rank{rank} ERROR trainforge.trainer.train: ConfigError (exit 78): startup check" in out


def test_a_wrong_finite_rotary_frequency_is_refused_naming_the_buffer(llama):
    model = _loaded(llama[0])
    model.model.rotary_emb.inv_freq[-1] = 7e-18
    with pytest.raises(ConfigError, match=r"model\.rotary_emb\.inv_freq: 1 of 8 rotary inverse frequencies differ "
                                          r"from what the config implies \(rope_type 'llama3'\): index 7 is 7e-18"):
        check_model(model, ONE_PROCESS)


def test_untied_embeddings_of_a_tied_config_are_refused(hf_model):
    model = _loaded(hf_model("qwen3"))  # tie_word_embeddings: true
    assert model_problems(model) == []
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with pytest.raises(ConfigError, match=r"lm_head\.weight: the config ties it to model\.embed_tokens\.weight "
                                          r"\(tie_word_embeddings\), but it is a separate tensor"):
        check_model(model, ONE_PROCESS)


def test_a_parameter_left_on_meta_is_refused(llama):
    model = _loaded(llama[0])
    norm = model.model.layers[0].input_layernorm
    norm.weight = torch.nn.Parameter(torch.empty_like(norm.weight, device="meta"))
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.input_layernorm\.weight: still on the meta device"):
        check_model(model, ONE_PROCESS)


def test_lora_adapters_are_checked_too(llama):
    from trainforge.trainer.adapters import apply_lora
    from trainforge.trainer.config import LoraSettings

    lora = LoraSettings(r=4, alpha=8.0, dropout=0.0, target_modules=("q_proj",), merge=False)
    model = apply_lora(_loaded(llama[0]), lora)
    assert model_problems(model) == []
    model.model.layers[1].self_attn.q_proj.lora_A["default"].weight.data[0, 0] = float("inf")
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.self_attn\.q_proj\.lora_A\.default\.weight: 1 of "
                                          r"\d+ values are not finite \(first: inf\)"):
        check_model(model, ONE_PROCESS)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_as_loaded_passes(family, hf_model):
    """No false alarm on what loads correctly: each family's rotary type and ties as transformers builds them."""
    assert model_problems(_loaded(hf_model(family))) == []


def test_the_spec_model_as_built_passes(valid_job, dataset_dir):
    from trainforge.trainer.data import open_dataset
    from trainforge.trainer.model import job_model

    with job_model(parse_job_config(valid_job), open_dataset(dataset_dir)) as model:
        assert model_problems(model) == []
