"""``precision: fp8`` in the trainer (trainer/float8.py): the filter, the conversion and its report
on a model with an unaligned linear and an ``lm_head``, a short training run under torchao's CPU
emulation (report logged and stored in MLflow), the config's token-count refusal and the
divergence message. On a GPU the same code runs torchao's float8 matmuls (bench/gpu_proof.py)."""

from __future__ import annotations

import json
import logging
import math
import signal

import pytest
import torch

pytest.importorskip("torchao.float8")  # the fp8 extra (make venv installs it)

from trainforge.trainer import float8, state  # noqa: E402
from trainforge.trainer.config import ConfigError, load_job_config  # noqa: E402
from trainforge.trainer.env_check import asked_features  # noqa: E402
from trainforge.trainer.errors import DivergedError  # noqa: E402
from trainforge.trainer.train import main  # noqa: E402


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 128, bias=False)  # aligned, large enough (with small=(32, 32))
        self.down = torch.nn.Linear(128, 40, bias=False)  # out_features 40: unaligned
        self.gate = torch.nn.Linear(32, 32, bias=False)  # too small
        self.lm_head = torch.nn.Linear(40, 96, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.down(self.up(x)))


def test_the_filter_converts_only_aligned_large_enough_linears_and_keeps_the_head():
    torch.manual_seed(0)
    model = Tiny()
    decisions = float8.convert(model, torch.device("cpu"), small=(32, 32))
    assert [(d.name, d.converted) for d in decisions] == [
        ("up", True), ("down", False), ("gate", False), ("lm_head", False)]
    from torchao.float8.float8_linear import Float8Linear

    assert [type(m) is Float8Linear for m in (model.up, model.down, model.gate, model.lm_head)] == [
        True, False, False, False]
    assert set(model.state_dict()) == {"up.weight", "down.weight", "gate.weight", "lm_head.weight"}  # checkpoints
    assert float8.report(decisions).splitlines() == [
        "float8: 1 of 4 linears converted, 3 kept in bf16",
        "  up (64 -> 128): float8, converted",
        "  down (128 -> 40): bf16, out_features 40 not divisible by 16",
        "  gate (32 -> 32): bf16, too small to gain (in_features <= 32 and out_features <= 32)",
        "  lm_head (40 -> 96): bf16, LM head: its logits feed the loss",
    ]
    x = torch.randn(32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # forward and backward run (emulated float8)
        loss = model(x).float().pow(2).mean()
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(model.up.weight.grad).all()


def test_the_default_threshold_and_frozen_linears():
    on_meta = torch.device("meta")
    assert "too small to gain (in_features <= 4096 and out_features <= 1024)" in float8.decide(
        "mlp.down_proj", torch.nn.Linear(4096, 1024, device=on_meta)).reason
    assert float8.decide("mlp.up_proj", torch.nn.Linear(4096, 2048, device=on_meta)).converted
    frozen = torch.nn.Linear(8192, 8192, device=on_meta).requires_grad_(False)
    assert float8.decide("base_layer", frozen).reason == "frozen (not trained)"
    assert float8.decide("model.lm_head", torch.nn.Linear(8192, 8192, device=on_meta)).converted is False


def test_a_job_config_with_micro_batch_tokens_not_divisible_by_16_is_refused(job_file):
    with pytest.raises(ConfigError, match=r"precision 'fp8' needs micro-batch tokens divisible by 16 "
                                          r"\(got optim.micro_batch_size=1 x data.sequence_length=30\)"):
        load_job_config(job_file(precision="fp8", data={"sequence_length": 30}, optim={"micro_batch_size": 1}))
    assert load_job_config(job_file(precision="fp8")).precision == "fp8"  # 2 x 32


def test_the_environment_check_asks_for_torchao_float8():
    assert asked_features({"precision": "fp8", "compile": False}, "training.framework") == {
        "float8": "training.framework.precision: fp8"}


def test_the_divergence_note_is_for_fp8_divergences_only():
    fp8, bf16 = type("Cfg", (), {"precision": "fp8"}), type("Cfg", (), {"precision": "bf16"})
    assert "under precision fp8" in float8.divergence_note(DivergedError("x"), fp8)
    assert float8.divergence_note(DivergedError("x"), bf16) == ""
    assert float8.divergence_note(ConfigError("x"), fp8) == ""


@pytest.fixture
def run_main(tmp_path, job_file, monkeypatch):
    """``run_main(**sections) -> (code, result)``: ``main()`` in this process, precision fp8, every
    aligned linear of the tiny model converted (no size threshold)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRAINFORGE_RESULT_FILE", str(tmp_path / "result.json"))
    monkeypatch.setattr(float8, "SMALL", (0, 0))
    handler, handlers, level = signal.getsignal(signal.SIGTERM), logging.root.handlers[:], logging.root.level

    def run(**sections):
        sections = {"optim": {"max_steps": 2, "warmup_steps": 0}, "checkpoint": {"interval_steps": 1},
                    "logging": {"log_every_steps": 1}, **sections}
        code = main(["--config", str(job_file(precision="fp8", **sections))])
        return code, json.loads((tmp_path / "result.json").read_text())

    yield run
    signal.signal(signal.SIGTERM, handler)
    logging.root.handlers[:], logging.root.level = handlers, level
    state.abandon_pending_write()


def test_an_fp8_run_trains_and_logs_its_report_to_the_log_and_mlflow(run_main, capsys, tmp_path, monkeypatch):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("fp8")).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    code, result = run_main()
    out = capsys.readouterr().out
    assert code == 0 and result["final_step"] == 2 and math.isfinite(result["final_train_loss"]), out[-3000:]
    assert "float8: 14 of 15 linears converted, 1 kept in bf16" in out  # 2 layers x 7, and the head
    assert "  lm_head (32 -> " in out and "bf16, LM head: its logits feed the loss" in out
    assert "  model.layers.0.self_attn.k_proj (32 -> 16): float8, converted" in out
    stored = client.download_artifacts(run_id, float8.ARTIFACT, str(tmp_path))
    report = open(stored).read()
    assert report.startswith("float8: 14 of 15") and "model.layers.1.mlp.down_proj (64 -> 32): float8" in report
    assert client.get_run(run_id).data.params["precision"] == "fp8"


def test_a_non_finite_loss_under_fp8_stops_the_run_saying_fp8(run_main, tmp_path, monkeypatch):
    from trainforge.trainer import train as train_mod

    real = train_mod.should_step
    monkeypatch.setattr(train_mod, "should_step", lambda step, loss, *rest: real(
        step, float("nan") if step == 2 else loss, *rest))
    code, result = run_main()
    assert code == 79 and result["status"] == "diverged", result
    assert result["message"].startswith("step 2: train loss nan"), result["message"]
    assert "no checkpoint written after step 1; under precision fp8 (float8 linears" in result["message"]
    assert "resume from the last checkpoint with precision 'bf16'" in result["message"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-")) == [
        "step-00000001"]
