"""Parse benchmark: 100 generated pipeline specs compiled by the DAG file, against a hand-written
DAG file that builds the same 100 DAGs (same operators, params, outlets and callbacks) in
Python, in the same run.

    .venv/bin/python bench/parse_dags.py [--pipelines 100] [--repeats 5]

Prints the median wall time of each, their ratio (goal <= 1.2x) and milliseconds per DAG (goal
<= 50 ms). Both are parsed in this process after a warm-up parse, so imports are not counted.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "dags" / "pipelines" / "shakespeare_llm.yaml"

HAND_WRITTEN_HEADER = '''\
import datetime as dt
from airflow.sdk import DAG
from airflow.sdk import Asset, AssetAlias, Param
from operators.callbacks import close_mlflow_run_on_failure
from operators.prepare import PrepareDataOperator
from operators.registration import RegisterModelOperator
from operators.training import TrainingLaunchOperator
from operators.validation import ValidateCheckpointOperator
from operators.spec.model import PipelineSpec
'''

HAND_WRITTEN_DAG = '''
spec_{i} = PipelineSpec.model_construct_from = None
with DAG(dag_id="bench_{i}", schedule=None, start_date=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
         catchup=False, max_active_runs=1, tags=["trainforge"], params={params},
         default_args={{"owner": "trainforge", "retries": 1, "retry_delay": dt.timedelta(seconds=30),
                       "on_failure_callback": [close_mlflow_run_on_failure]}}) as dag_{i}:
    a = PrepareDataOperator(task_id="prepare_data", spec=SPEC, spec_file="bench_{i}.yaml",
                            outlets=[Asset(uri=DATASET_URI, name=DATASET_URI)])
    b = TrainingLaunchOperator(task_id="train", spec=SPEC, spec_file="bench_{i}.yaml",
                               execution_timeout=dt.timedelta(seconds=4200))
    c = ValidateCheckpointOperator(task_id="validate_checkpoint", spec=SPEC, spec_file="bench_{i}.yaml")
    d = RegisterModelOperator(task_id="register_model", spec=SPEC, spec_file="bench_{i}.yaml",
                              outlets=[AssetAlias(name=MODEL_ALIAS)])
    a >> b >> c >> d
'''


def write_inputs(folder: Path, count: int) -> tuple[Path, Path]:
    specs = folder / "pipelines"
    specs.mkdir()
    text = DEMO.read_text()
    for i in range(count):
        (specs / f"bench_{i}.yaml").write_text(text.replace("name: shakespeare_llm", f"name: bench_{i}"))
    from operators.spec import load_spec

    spec = load_spec(DEMO)
    hand = folder / "hand_written_dags.py"
    from operators.dag_builder import build_params

    # What a person would write by hand: a Param literal per tunable field, per DAG.
    params = "{" + ", ".join(
        f"{name!r}: Param({p.value!r}, description={p.description!r}, "
        + ", ".join(f"{k}={v!r}" for k, v in p.schema.items() if k not in ("description", "title"))
        + ")"
        for name, p in build_params(spec).items()
    ) + "}"
    from operators.prepare import PrepareDataOperator
    from operators.registration import RegisterModelOperator

    dataset_asset = PrepareDataOperator.asset_for(spec)
    model_alias = RegisterModelOperator.champion_outlet(spec.registry.model_name)
    body = [HAND_WRITTEN_HEADER, f"SPEC = {spec.model_dump(mode='json')!r}\n",
            f"DATASET_URI = {dataset_asset.uri!r}\nMODEL_ALIAS = {model_alias.name!r}\n"]
    body += [HAND_WRITTEN_DAG.format(i=i, params=params) for i in range(count)]
    hand.write_text("".join(body).replace("spec_{i} = PipelineSpec.model_construct_from = None\n", ""))
    return specs, hand


def parse_file(path: Path, name: str) -> int:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return sum(1 for v in vars(module).values() if type(v).__name__ == "DAG")


def timed(path: Path, repeats: int, expected: int) -> float:
    samples = []
    for r in range(repeats):
        started = time.perf_counter()
        count = parse_file(path, f"bench_mod_{path.stem}_{r}")
        samples.append(time.perf_counter() - started)
        assert count == expected, f"{path} gave {count} DAGs, expected {expected}"
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        specs, hand = write_inputs(Path(tmp), args.pipelines)
        os.environ["TRAINFORGE_PIPELINES"] = str(specs)
        dag_file = ROOT / "dags" / "trainforge_pipelines.py"
        parse_file(dag_file, "warmup_yaml")  # imports airflow, pydantic, croniter once
        parse_file(hand, "warmup_hand")
        yaml_s = timed(dag_file, args.repeats, args.pipelines)
        hand_s = timed(hand, args.repeats, args.pipelines)
    ratio = yaml_s / hand_s
    per_dag_ms = 1000 * yaml_s / args.pipelines
    print(f"pipelines: {args.pipelines}, repeats: {args.repeats} (median)")
    print(f"YAML specs through the DAG file: {yaml_s * 1000:8.1f} ms  ({per_dag_ms:.1f} ms per DAG; goal <= 50)")
    print(f"hand-written DAG file:           {hand_s * 1000:8.1f} ms  ({1000 * hand_s / args.pipelines:.1f} ms per DAG)")
    print(f"ratio YAML / hand-written:       {ratio:8.2f}x (goal <= 1.2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
