"""torch.compile accounted: recompilations after warm-up warned about once per reason and counted,
compile seconds out of the step's time into the ``compile`` bucket, and Dynamo's recompile limit
an error by default (``framework.compile_fallback: error``) or a run that says it went partly
eager (``warn``).

The limit is forced with ``torch._dynamo.config.recompile_limit = 0``: the first compile hits it,
so the trainer runs in this process without compiling anything (a few seconds each). The
recompilation test uses Dynamo's ``eager`` backend on a one-linear module: Dynamo's guards and
recompilations without Inductor's C++ build. A real compiled run's figures: tests/trainer/test_compile.py.
"""

from __future__ import annotations

import json
import logging
import signal
import time

import pytest
import torch
import torch._dynamo

from trainforge.contract import FailureKind, failure_kind
from trainforge.trainer import state
from trainforge.trainer.compile import RecompileWatch
from trainforge.trainer.goodput import AttemptClock
from trainforge.trainer.train import main


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).relu()


def test_a_recompilation_after_warm_up_is_warned_about_once_per_reason_and_counted(caplog):
    torch._dynamo.reset()
    model = _Tiny()
    model.compile(backend="eager", dynamic=False)
    caplog.set_level(logging.INFO, logger="trainforge.trainer.compile")
    with RecompileWatch() as watch:
        for step, rows in [(1, 2), (2, 2), (3, 3), (4, 4), (5, 4), (6, 5)]:  # new sizes at 3, 4 and 6
            watch.begin_step(step)
            model(torch.randn(rows, 8)).sum().backward()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned  # one kind: the size of x
    assert "during step 3" in warned[0] and "tensor 'x' size mismatch at index 0. expected 2, actual 3" in warned[0]
    assert (watch.recompiles, watch.after_warmup, watch.mode) == (3, 3, "compiled")
    assert watch.metrics() == {"compile/seconds": watch.seconds, "compile/graphs": 4.0, "compile/recompiles": 3.0}
    assert watch.seconds > 0 and watch.take_seconds() == watch.seconds and watch.take_seconds() == 0
    assert watch.summary().startswith("torch.compile: ") and "4 graph(s), 3 recompilation(s), 3 after warm-up" \
        in watch.summary()


def test_compile_seconds_are_taken_out_of_the_step_into_their_own_bucket():
    clock = AttemptClock(world_size=1, tokens_per_step=8, flops_per_token=10, device="cpu",
                         started_at=time.time(), compiled="compiled")
    clock.restored(0.0, resumed_step=0, reached_step=0)
    clock.loop_started()
    clock.step_started()
    time.sleep(0.05)
    clock.step_done(1, compile_s=0.03)
    clock.step_started()
    clock.step_done(2, compile_s=5.0)  # never more than the step took
    rec = clock.record()
    assert rec["seconds"]["compile"] >= 0.03 and rec["seconds"]["compile"] < 0.03 + 0.02
    assert 0.015 <= rec["seconds"]["productive"] < 0.05 and rec["productive_steps"] == 2
    assert rec["compiled"] == "compiled"


@pytest.fixture
def run_main(tmp_path, dataset_dir, tools, monkeypatch):
    """``run_main(fallback) -> (exit code, result, attempt record or None)``: the trainer's
    ``main()`` in this process with ``framework.compile: true`` and Dynamo's recompile limit 0."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "TORCH_LOGS"):
        monkeypatch.delenv(name, raising=False)  # MLflow: a test sets its own
    monkeypatch.setenv("TRAINFORGE_RESULT_FILE", str(tmp_path / "result.json"))
    monkeypatch.setenv("TRAINFORGE_JOB_DIR", str(tmp_path / "job"))
    handler, handlers, level = signal.getsignal(signal.SIGTERM), logging.root.handlers[:], logging.root.level

    def run(fallback: str | None):
        job = tools.make_job(dataset_dir, tmp_path / "checkpoints", optim={"max_steps": 3, "warmup_steps": 1},
                             checkpoint={"interval_steps": 3}, logging={"log_every_steps": 1})
        job["framework"] = {"compile": True} | ({"compile_fallback": fallback} if fallback else {})
        job = tools.write_job(tmp_path / "job.json", job)
        torch._dynamo.reset()
        with torch._dynamo.config.patch(recompile_limit=0):
            code = main(["--config", str(job)])
        records = sorted((tmp_path / "job" / "ledger").glob("attempt-*.json"))
        record = json.loads(records[-1].read_text()) if records else None
        return code, json.loads((tmp_path / "result.json").read_text()), record

    yield run
    signal.signal(signal.SIGTERM, handler)
    logging.root.handlers[:], logging.root.level = handlers, level
    state.abandon_pending_write()


def test_hitting_the_recompile_limit_fails_the_run_for_good_naming_the_limit_and_the_function(run_main):
    code, result, _ = run_main(None)  # compile_fallback: error when absent
    assert code == 78 and result["status"] == "bad_config", result
    message = result["message"]
    assert message.startswith("during step 1 torch.compile hit torch._dynamo.config.recompile_limit (0) compiling "
                              "'forward' ("), message
    assert "modeling_llama.py" in message
    assert "compile_fallback: warn" in message and result["final_step"] == 0
    assert failure_kind(code, result) is FailureKind.PERMANENT


def test_with_compile_fallback_warn_the_run_trains_on_and_says_it_went_partly_eager(run_main, capsys, tmp_path,
                                                                                  monkeypatch):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # a real run in a local store, as the DAG's would be
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("compile")).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    code, result, record = run_main("warn")
    out = capsys.readouterr().out
    assert code == 0 and result["final_step"] == 3, out[-3000:]
    warned = [line for line in out.splitlines() if "WARNING trainforge.trainer.compile" in line]
    assert len(warned) == 1 and "this run is partly eager (tag compile/mode=partly_eager" in warned[0], warned
    assert "recompile_limit (0) compiling 'forward'" in warned[0]
    assert "0 recompilation(s), 0 after warm-up; partly eager: torch._dynamo.config.recompile_limit (0)" in out
    assert record["compiled"] == "partly_eager" and record["step"] == 3
    run = client.get_run(run_id)
    assert run.data.tags["compile/mode"] == "partly_eager"  # what tokens_per_s measured
    assert run.data.params["framework.compile_fallback"] == "warn"
    for name in ("compile/seconds", "compile/graphs", "compile/recompiles", "tokens_per_s"):
        assert [m.step for m in client.get_metric_history(run_id, name)] == [1, 2, 3], name
    assert client.get_metric_history(run_id, "compile/graphs")[-1].value == 0  # the limit hit before any graph
