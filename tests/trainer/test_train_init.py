"""The job config's ``init`` section: training starts from existing weights, nothing else.

One single-process run of the trainer each: the session's ``trained_run`` (20 steps) provides
the weights; a new run in a fresh checkpoint folder starts from them. With a learning rate of
1e-12 the one step taken moves no fp32 weight measurably, so the new run's checkpoint holds the
initial weights: they must equal the source's, where a random start would be far away.
"""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from trainforge.trainer import checkpoint as ckpt


def _init_job(tools, tmp_path, dataset_dir, source, **sections):
    job = tools.make_job(dataset_dir, tmp_path / "ck", **sections)
    job["init"] = {"checkpoint": str(source), "source": "stage:pretrain"}
    return tools.write_job(tmp_path / "job.json", job)


def test_a_run_starts_from_the_init_weights_with_a_fresh_optimizer(tmp_path, dataset_dir, tools,
                                                                     trained_run):
    source = trained_run["checkpoints"] / ckpt.step_dir_name(20)
    job = _init_job(tools, tmp_path, dataset_dir, source,
                    optim={"max_steps": 1, "warmup_steps": 0, "learning_rate": 1e-12,
                           "min_learning_rate": 0.0, "weight_decay": 0.0},
                    checkpoint={"interval_steps": 1})
    proc = tools.run_trainer(job, tmp_path / "result.json")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"initialised the weights from {source}" in proc.stdout
    expected = safetensors.torch.load_file(source / ckpt.WEIGHTS)
    got = safetensors.torch.load_file(tmp_path / "ck" / ckpt.step_dir_name(1) / ckpt.WEIGHTS)
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.allclose(got[name], tensor, rtol=0, atol=1e-9), name
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["final_step"] == 1  # step 0 + one step: neither step nor optimizer were taken
    state = torch.load(tmp_path / "ck" / ckpt.step_dir_name(1) / ckpt.OPTIMIZER, weights_only=True)
    assert all(int(s["step"]) == 1 for s in state["state"].values())


def test_another_architecture_fails_as_a_bad_config(tmp_path, dataset_dir, tools, trained_run):
    source = trained_run["checkpoints"] / ckpt.step_dir_name(20)
    job = _init_job(tools, tmp_path, dataset_dir, source, model={"num_layers": 3},
                    optim={"max_steps": 1, "warmup_steps": 0})
    proc = tools.run_trainer(job, tmp_path / "result.json")
    assert proc.returncode == 78, proc.stdout[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert "model.num_layers: model 3, source 2" in result["message"]
    assert "num_hidden_layers" not in result["message"]


@pytest.mark.parametrize(("change", "named"), [
    ({"num_hidden_layers": 3}, "model.num_layers: model 3, source 2"),
    ({"num_attention_heads": 2, "num_key_value_heads": 2}, "model.num_heads: model 2, source 4"),
    ({"hidden_act": "gelu"}, "model.config_overrides.hidden_act: model 'gelu', source 'silu'"),
])
def test_an_architecture_difference_names_the_spec_field(change, named):
    from transformers import LlamaConfig

    from trainforge.trainer.model import architecture_differences

    base = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}
    problems = architecture_differences(LlamaConfig(**{**base, **change}), LlamaConfig(**base))
    assert named in problems
    assert not any(key in " ".join(problems) for key in change if key != "hidden_act")


def test_a_checkpoint_of_its_own_wins_over_init(tmp_path, dataset_dir, tools, trained_run):
    own = tmp_path / "ck"
    own.mkdir()
    import shutil

    shutil.copytree(trained_run["checkpoints"] / ckpt.step_dir_name(10), own / ckpt.step_dir_name(10))
    job = _init_job(tools, tmp_path, dataset_dir, tmp_path / "no-such-weights",
                    optim={"max_steps": 11})
    proc = tools.run_trainer(job, tmp_path / "result.json")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "resuming from" in proc.stdout and "initialised the weights" not in proc.stdout
