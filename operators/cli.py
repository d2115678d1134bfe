"""``trainforge`` — the command line.

    trainforge validate PATH...     check pipeline specs; exit 1 and list every error if any
    trainforge render FILE          the DAG's tasks and the exact request the engine would get
    trainforge schema               the JSON Schema of a pipeline spec
    trainforge run FILE             run one pipeline on this machine through `airflow dags test`
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
# Piped or captured output gets wide lines, so paths and URLs stay whole for copy and grep.
console = Console(width=None if sys.stdout.isatty() else 200)


def _load_or_exit(file: Path):
    """The spec in ``file``, or exit 1 with its errors (never a traceback for user mistakes)."""
    from operators.spec import SpecError, load_spec

    try:
        return load_spec(file)
    except SpecError as err:
        typer.echo(str(err), err=True)
    except OSError as err:
        typer.echo(f"{file}: cannot read: {err.strerror or err}", err=True)
    raise typer.Exit(1)


@app.command()
def validate(paths: list[Path] = typer.Argument(..., help="Spec files or folders.")) -> None:
    """Validate pipeline specs. Exit 0 when all are valid, 1 otherwise."""
    from operators.spec import SpecError, load_spec

    files: list[Path] = []
    for path in paths:
        files += sorted([*path.glob("*.yaml"), *path.glob("*.yml")]) if path.is_dir() else [path]
    bad = 0
    for file in files:
        try:
            spec = load_spec(file)
        except SpecError as err:
            bad += 1
            typer.echo(str(err), err=True)
        except OSError as err:
            bad += 1
            typer.echo(f"{file}: cannot read: {err.strerror or err}", err=True)
        else:
            typer.echo(f"{file}: ok (dag_id {spec.dag_id})")
    if not files:
        typer.echo(f"no pipeline specs (*.yaml, *.yml) in {', '.join(map(str, paths))}", err=True)
    raise typer.Exit(1 if bad or not files else 0)


@app.command()
def schema(
    markdown: bool = typer.Option(False, help="Print the field reference table instead."),
    write: bool = typer.Option(False, help="Regenerate the committed schema and reference."),
) -> None:
    """Print the JSON Schema of a pipeline spec (or its Markdown reference)."""
    from operators.spec import schema as published

    if write:
        for path in published.write_published():
            typer.echo(f"wrote {path}")
        return
    print(published.reference_markdown() if markdown else published.schema_text(), end="")


@app.command()
def render(file: Path, engine: str = typer.Option(None, help="Engine to render for.")) -> None:
    """Dry run: the DAG's tasks and the exact request the engine would receive."""
    from operators.backends import ENGINES, get_backend
    from operators.backends.base import JobIdentity
    from operators.jobconfig import build_training_job
    from operators.paths import checkpoint_root, resolve, trainforge_home

    spec = _load_or_exit(file)
    engine = engine or spec.training.engine
    if engine not in ENGINES:
        typer.echo(f"unknown engine {engine!r} (expected one of: {', '.join(ENGINES)})", err=True)
        raise typer.Exit(1)
    identity = JobIdentity(spec.dag_id, "<run_id>", "train", 1)
    job = build_training_job(
        spec,
        dataset_dir=str(Path(resolve(spec.data.output_uri)) / "<dataset digest>"),
        checkpoint_dir=checkpoint_root(spec.training.checkpoint.uri, spec.dag_id, "<run_id>"),
        identity=identity,
        env={"MLFLOW_TRACKING_URI": "<tracking uri>", "MLFLOW_RUN_ID": "<mlflow run id>"},
    )
    backend = get_backend(engine, runs_root=str(trainforge_home() / "runs"))
    out = {
        "dag_id": spec.dag_id,
        "tasks": ["prepare_data", "train", "validate_checkpoint", "register_model"],
        "train_request": backend.render(job),
    }
    print(json.dumps(out, indent=2))


@app.command()
def run(
    file: Path,
    summary_json: Path = typer.Option(None, help="Also write the summary as JSON here."),
) -> None:
    """Run one pipeline on this machine through `airflow dags test` and print a summary."""
    from operators.runner import run_pipeline

    spec = _load_or_exit(file)
    ok = run_pipeline(spec, file.absolute(), console=console, summary_json=summary_json)
    raise typer.Exit(0 if ok else 1)


if __name__ == "__main__":
    sys.exit(app())
