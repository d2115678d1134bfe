"""Parse benchmark: 100 generated pipeline specs compiled by the DAG file, against a hand-written
DAG file that builds the same 100 DAGs in Python, in the same run.

    .venv/bin/python bench/parse_dags.py [--pipelines 100] [--repeats 5]

"The same DAGs" is checked, not assumed: before timing, every DAG of the hand-written file is
compared with the YAML-built one (DAG arguments, params with their schema, default args, tasks,
their settings, outlets, dependencies and the spec each operator carries); the run stops on any
difference. The hand-written file carries each pipeline's settings as a Python literal, as a
person would have to.

Prints the median wall and CPU time of the DAG file with the spec cache off (every spec read
from YAML) and warm (each unchanged spec read from its cached validated JSON, as on every Airflow
re-parse after the first), of the hand-written file, their ratios (goal <= 1.2x) and milliseconds
per DAG (goal <= 50 ms). The three take turns within each repeat; on a busy machine the CPU-time
ratio is the steadier one. All are parsed in this process after a warm-up parse, so imports are not
counted; each parse executes the module afresh, as Airflow's DAG processor does.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "dags" / "pipelines" / "shakespeare_llm.yaml"

HAND_WRITTEN_HEADER = '''\
import datetime as dt
from airflow.sdk import DAG
from airflow.sdk import Asset, AssetAlias, Param
from trainforge.callbacks import clear_failure_on_success, close_mlflow_run_on_failure
from trainforge.tasks.close_run import CloseRunOperator
from trainforge.tasks.prepare_data import PrepareDataOperator
from trainforge.tasks.register_model import RegisterModelOperator
from trainforge.tasks.train import TrainOperator
from trainforge.tasks.validate_checkpoint import ValidateCheckpointOperator
'''

HAND_WRITTEN_DAG = '''
SPEC_{i} = {spec!r}
with DAG(dag_id={dag_id!r}, description={description!r}, doc_md={doc_md!r}, schedule=None,
         start_date=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc), catchup=False,
         max_active_runs=1, tags={tags!r}, params={params},
         default_args={{"owner": "trainforge", "retries": 1, "retry_delay": dt.timedelta(seconds=30),
                       "on_failure_callback": [close_mlflow_run_on_failure],
                       "on_success_callback": [clear_failure_on_success]}}) as dag_{i}:
    a = PrepareDataOperator(task_id="prepare_data", spec=SPEC_{i}, spec_file={spec_file!r},
                            outlets=[Asset(uri=DATASET_URI, name=DATASET_URI)])
    b = TrainOperator(task_id="train", spec=SPEC_{i}, spec_file={spec_file!r},
                      execution_timeout=dt.timedelta(seconds=4200))
    c = ValidateCheckpointOperator(task_id="validate_checkpoint", spec=SPEC_{i},
                                   spec_file={spec_file!r})
    d = RegisterModelOperator(task_id="register_model", spec=SPEC_{i}, spec_file={spec_file!r},
                              outlets=[AssetAlias(name=MODEL_ALIAS)])
    e = CloseRunOperator(task_id="close_run", spec=SPEC_{i}, spec_file={spec_file!r},
                         on_failure_callback=[]).as_teardown()
    a >> b >> c >> d
    [a, b, c, d] >> e
'''


def write_inputs(folder: Path, count: int) -> tuple[Path, Path]:
    """``count`` spec files (the demo, renamed) and the hand-written DAG file of the same DAGs."""
    from trainforge.dag_builder import build_params
    from trainforge.tasks.prepare_data import PrepareDataOperator
    from trainforge.tasks.register_model import RegisterModelOperator
    from trainforge.pipeline import load_spec

    specs = folder / "pipelines"
    specs.mkdir()
    text = DEMO.read_text()
    body = [HAND_WRITTEN_HEADER]
    for i in range(count):
        path = specs / f"bench_{i}.yaml"
        path.write_text(text.replace("name: shakespeare_llm", f"name: bench_{i}"))
        spec = load_spec(path)
        if i == 0:
            dataset_asset = PrepareDataOperator.asset_for(spec)
            model_alias = RegisterModelOperator.champion_outlet(spec.registry.model_name)
            body.append(f"DATASET_URI = {dataset_asset.uri!r}\nMODEL_ALIAS = {model_alias.name!r}\n")
        # What a person would write by hand: a Param literal per tunable field, per DAG.
        params = "{" + ", ".join(
            f"{name!r}: Param({p.value!r}, "
            + ", ".join(f"{k}={v!r}" for k, v in p.schema.items()) + ")"
            for name, p in build_params(spec).items()
        ) + "}"
        description = spec.pipeline.description
        body.append(HAND_WRITTEN_DAG.format(
            i=i, spec=spec.model_dump(mode="json"), dag_id=spec.dag_id,
            description=(description.strip().splitlines() or [""])[0][:200] or None,
            doc_md=description or None, tags=sorted({"trainforge", *spec.pipeline.tags}),
            params=params, spec_file=str(path)))
    hand = folder / "hand_written_dags.py"
    hand.write_text("".join(body))
    return specs, hand


def _fingerprint(dag: Any) -> dict[str, Any]:
    """What makes two DAGs the same for Airflow: arguments, params, default args and tasks."""
    def plain(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if callable(value) and hasattr(value, "__qualname__"):
            return f"{value.__module__}.{value.__qualname__}"
        return value

    out: dict[str, Any] = {k: getattr(dag, k) for k in (
        "dag_id", "description", "doc_md", "tags", "start_date", "catchup", "max_active_runs")}
    out["timetable"] = type(dag.timetable).__name__
    out["params"] = {k: (p.value, p.schema) for k, p in dag.params.items()}
    out["default_args"] = {k: plain(v) for k, v in dag.default_args.items()}
    for task in dag.tasks:
        out[task.task_id] = {
            "type": type(task).__name__, "upstream": sorted(task.upstream_task_ids),
            **{k: plain(getattr(task, k, None)) for k in (
                "owner", "retries", "retry_delay", "execution_timeout", "outlets", "spec",
                "spec_file", "on_failure_callback", "trigger_rule")},
        }
    return out


def check_same_dags(yaml_dags: dict[str, Any], hand_dags: dict[str, Any]) -> None:
    """Raise AssertionError naming the first difference between the two files' DAGs."""
    assert sorted(yaml_dags) == sorted(hand_dags), (sorted(yaml_dags), sorted(hand_dags))
    for dag_id, dag in yaml_dags.items():
        a, b = _fingerprint(dag), _fingerprint(hand_dags[dag_id])
        for key in a.keys() | b.keys():
            assert a.get(key) == b.get(key), (
                f"{dag_id}: {key} differs between the YAML-built and the hand-written DAG:\n"
                f"  yaml: {a.get(key)!r}\n  hand: {b.get(key)!r}")


def _dags_of(module: Any) -> dict[str, Any]:
    return {v.dag_id: v for v in vars(module).values() if type(v).__name__ == "DAG"}


def parse_file(path: Path, name: str) -> Any:
    """Execute the DAG file ``path`` as a fresh module named ``name``; returns the module."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(variants: dict[str, tuple[Path, str]], repeats: int, expected: int
          ) -> dict[str, tuple[float, float]]:
    """Median ``(wall s, CPU s)`` per variant ``{label: (DAG file, TRAINFORGE_SPEC_CACHE)}``.

    The variants take turns within each repeat, so a change in machine load during the run
    weighs on all of them alike; CPU time (this process's) is printed too, as it barely moves
    when other processes compete for the cores.
    """
    samples: dict[str, list[tuple[float, float]]] = {label: [] for label in variants}
    for r in range(repeats):
        for label, (path, cache) in variants.items():
            os.environ["TRAINFORGE_SPEC_CACHE"] = cache
            # The previous parse's DAGs are garbage (reference cycles): collect them now, so
            # that no variant pays for a collection of another's leftovers.
            gc.collect()
            wall, cpu = time.perf_counter(), time.process_time()
            module = parse_file(path, f"bench_mod_{label}_{r}")
            samples[label].append((time.perf_counter() - wall, time.process_time() - cpu))
            count = len(_dags_of(module))
            assert count == expected, f"{path} gave {count} DAGs, expected {expected}"
            del module
    return {label: (statistics.median(w for w, _ in values), statistics.median(c for _, c in values))
            for label, values in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TRAINFORGE_SPEC_CACHE"] = "off"
        specs, hand = write_inputs(Path(tmp), args.pipelines)
        os.environ["TRAINFORGE_PIPELINES"] = str(specs)
        dag_file = ROOT / "dags" / "trainforge_pipelines.py"
        # warm-up parses import airflow, pydantic, croniter once (and compile the hand file)
        check_same_dags(_dags_of(parse_file(dag_file, "warmup_yaml")),
                        _dags_of(parse_file(hand, "warmup_hand")))
        cache = str(Path(tmp) / "spec-cache")
        os.environ["TRAINFORGE_SPEC_CACHE"] = cache
        check_same_dags(_dags_of(parse_file(dag_file, "fill_cache")),
                        _dags_of(parse_file(hand, "check_hand")))
        times = timed({"cold": (dag_file, "off"), "warm": (dag_file, cache), "hand": (hand, "off")},
                      args.repeats, args.pipelines)
        cold, warm, by_hand = times["cold"], times["warm"], times["hand"]
    n = args.pipelines
    print(f"pipelines: {n}, repeats: {args.repeats} (median); the two files build identical DAGs")
    print(f"{'':34s} {'wall ms':>9s} {'CPU ms':>9s}  wall ms per DAG (goal <= 50)")
    for label, (wall, cpu) in (("DAG file, spec cache off (YAML):", cold),
                               ("DAG file, spec cache warm:", warm),
                               ("hand-written DAG file:", by_hand)):
        print(f"{label:34s} {wall * 1000:9.1f} {cpu * 1000:9.1f}  {1000 * wall / n:.2f}")
    for label, (wall, cpu) in (("cache off", cold), ("cache warm", warm)):
        print(f"ratio, {label} / hand-written:{'':6s} wall {wall / by_hand[0]:.2f}x, CPU "
              f"{cpu / by_hand[1]:.2f}x (goal <= 1.2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
