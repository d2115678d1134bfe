"""``trainforge`` — the command line.

    trainforge validate PATH...     check pipeline specs; exit 1 and list every error if any
    trainforge render FILE          the DAG's tasks and the exact request the engine would get
    trainforge schema               the JSON Schema of a pipeline spec
    trainforge run FILE             run one pipeline on this machine through `airflow dags test`
    trainforge report PIPELINE      every run of a pipeline in the MLflow store: goodput, cost, energy
    trainforge doctor [SPEC]        the installed packages against what trainforge (and SPEC) needs
"""

from __future__ import annotations

import json
import sys
from difflib import get_close_matches
from pathlib import Path

import typer
from pydantic import ValidationError
from rich.console import Console

from trainforge import doctor as checks
from trainforge.broker import environment_broker, visibility_warnings
from trainforge.cli.engine_switch import for_engine
from trainforge.cli.report import (StoreError, UnknownPipelineError, collect_report,
                                   default_tracking_uri, print_report)
from trainforge.cli.runner import run_pipeline
from trainforge.engines.base import JobIdentity
from trainforge.engines.descriptors import backend_kwargs, engine_names, get_backend
from trainforge.graph import task_graph
from trainforge.jobconfig import build_training_job, init_block
from trainforge.ledger.catalog import CatalogError, choose_price
from trainforge.paths import checkpoint_root, resolve, trainforge_home
from trainforge.pipeline import SpecError, load_spec
from trainforge.pipeline import schema as published
from trainforge.pipeline.durations import parse_duration
from trainforge.pipeline.loader import name_position, value_position
from trainforge.pipeline.stages import resolve_stages, stage_folder

app = typer.Typer(add_completion=False, no_args_is_help=True,  # the commands list themselves below
                  help="trainforge: one YAML pipeline spec, one Airflow DAG that trains, validates and "
                       "registers a model.")
# Piped or captured output gets wide lines, so paths and URLs stay whole for copy and grep.
console = Console(width=None if sys.stdout.isatty() else 200)


def _load_or_exit(file: Path):
    """The spec in ``file``, or exit 1 with its errors (never a traceback for user mistakes)."""
    try:
        return load_spec(file)
    except SpecError as err:
        typer.echo(str(err), err=True)
    except OSError as err:
        typer.echo(f"{file}: cannot read: {err.strerror or err}", err=True)
    raise typer.Exit(1)


def _price_error(file: Path, spec) -> str | None:
    """Where the spec's ``cost`` names no row of the price catalog, located in ``file``: the
    train task would refuse the job when it starts, so validate and run say so before."""
    try:
        choose_price(spec)
    except CatalogError as err:
        key = "instance_type" if spec.cost.instance_type else "cloud"
        line, column = value_position(file, ("cost", key))
        return f"{file}:{line}:{column}: cost.{key}: {err}"
    return None


def _visibility_timeout(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None


def _real(path: Path) -> Path:
    """``path`` resolved; as given where it cannot be (a symlink loop: reading it says why)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return path.absolute()


def _plain_location(uri: str) -> bool:
    """Whether a ``model.pretrained`` URI is a folder or ``s3://`` prefix (no revision to resolve)."""
    return not uri.startswith(("hf://", "models:/"))


@app.command()
def validate(
    paths: list[Path] = typer.Argument(..., help="Spec files or folders."),
    visibility_timeout: str = typer.Option(
        None, "--visibility-timeout", callback=_visibility_timeout, metavar="DURATION",
        help="The Celery broker's visibility timeout of the deployment (e.g. 7d); default: "
        "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT, else Airflow's 24h. "
        "A task that may hold a worker slot longer is warned about."),
) -> None:
    """Validate pipeline specs. Exit 0 when all are valid, 1 otherwise; warnings (a task that
    outlives the Celery broker's visibility timeout) do not change the exit code."""
    try:
        broker = environment_broker(visibility_timeout)
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    files: list[Path] = []
    for path in paths:
        files += sorted([*path.glob("*.yaml"), *path.glob("*.yml")]) if path.is_dir() else [path]
    # A file named twice (as itself and through its folder) is one spec, not a duplicate dag_id.
    seen: set[Path] = set()
    files = [f for f in files if not (_real(f) in seen or seen.add(_real(f)))]
    bad = 0
    first_use: dict[str, tuple[Path, int]] = {}  # dag_id -> (file, line) of its first spec
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
            line, column = name_position(file)
            if spec.dag_id in first_use:
                bad += 1
                other, other_line = first_use[spec.dag_id]
                typer.echo(f"{file}:{line}:{column}: pipeline.name: dag_id {spec.dag_id!r} is also "
                           f"used by {other}:{other_line} (each pipeline needs its own name)",
                           err=True)
                continue
            first_use[spec.dag_id] = (file, line)
            price_error = _price_error(file, spec)
            if price_error:
                bad += 1
                typer.echo(price_error, err=True)
                continue
            typer.echo(f"{file}: ok (dag_id {spec.dag_id})")
            for warning in visibility_warnings(spec, broker):
                line, column = value_position(file, warning.keys)
                typer.echo(f"{file}:{line}:{column}: {warning.field}: warning: {warning.message}",
                           err=True)
    if not files:
        typer.echo(f"no pipeline specs (*.yaml, *.yml) in {', '.join(map(str, paths))}", err=True)
    raise typer.Exit(1 if bad or not files else 0)


@app.command()
def schema(
    markdown: bool = typer.Option(False, help="Print the field reference table instead."),
    write: bool = typer.Option(False, help="Regenerate the committed schema and reference."),
) -> None:
    """Print the JSON Schema of a pipeline spec (or its Markdown reference)."""
    if write:
        try:
            written = published.write_published(Path.cwd())
        except FileNotFoundError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(1) from None
        for path in written:
            typer.echo(f"wrote {path}")
        return
    print(published.reference_markdown() if markdown else published.schema_text(), end="")


@app.command()
def render(file: Path, engine: str = typer.Option(None, help="Engine to render for.")) -> None:
    """Dry run: the DAG's tasks and the exact request the engine would receive."""
    spec = _load_or_exit(file)
    engine = engine or spec.training.engine
    if engine not in engine_names():
        close = get_close_matches(engine, engine_names(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        typer.echo(f"unknown engine {engine!r} (expected one of: {', '.join(engine_names())}){hint}",
                   err=True)
        raise typer.Exit(1)
    try:
        spec, placeholders = for_engine(spec, engine)
    except ValidationError as err:
        typer.echo(f"{file}: does not fit engine {engine!r}: "
                   f"{err.errors()[0]['msg'].removeprefix('Value error, ')}", err=True)
        raise typer.Exit(1)
    if placeholders:
        typer.echo(f"note: {file} is written for another engine; rendering for {engine!r} with "
                   f"placeholders for what it lacks:", err=True)
        for line in placeholders:
            typer.echo(f"  spec field {line}", err=True)
    requests = {}
    stages = resolve_stages(spec)
    for stage in stages:
        if stage.training.engine != engine:
            typer.echo(f"note: stage {stage.name!r} sets its own engine "
                       f"{stage.training.engine!r} and keeps it (--engine switches the "
                       f"pipeline's training.engine only); its request below is for "
                       f"{stage.training.engine!r}", err=True)
    for stage in stages:  # one training task per stage (docs/stages.md); `train` without stages
        identity = JobIdentity(spec.dag_id, "<run_id>", stage.task_id, 1)
        init = None
        if stage.init_from:
            init = init_block(f"<final checkpoint of {stage.init_task_id}>",
                              f"stage:{stage.init_from}")
        job = build_training_job(
            spec.model_copy(update={"training": stage.training}),
            dataset_dir=f"{resolve(spec.data.output_uri).rstrip('/')}/<dataset digest>",
            checkpoint_dir=stage_folder(
                checkpoint_root(stage.training.checkpoint.uri, spec.dag_id, "<run_id>"),
                stage.name),
            identity=identity,
            env={"MLFLOW_TRACKING_URI": "<tracking uri>",
                 "MLFLOW_RUN_ID": f"<mlflow run id{' of stage ' + stage.name if stage.name else ''}>"},
            init=init,
            pretrained=None if spec.model.pretrained is None else {
                "folder": "<the folder model.pretrained resolves to>", "source": spec.model.pretrained,
                "revision": "<what it resolves to>" if not _plain_location(spec.model.pretrained) else None},
        )
        backend = get_backend(
            stage.training.engine,
            **backend_kwargs(stage.training, runs_root=str(trainforge_home() / "runs")),
        )
        requests[stage.task_id] = backend.render(job)
    graph = task_graph(spec)
    out = {
        "dag_id": spec.dag_id,
        "engine": engine,
        "tasks": graph.task_ids,
        "teardown": graph.teardown.task_id,
        "edges": graph.edges(),
    }
    if spec.stages:
        out["train_requests"] = requests
    else:
        out["train_request"] = requests["train"]
    print(json.dumps(out, indent=2))


@app.command()
def run(
    file: Path,
    summary_json: Path = typer.Option(None, help="Also write the summary as JSON here."),
    engine: str = typer.Option(
        None, help="Run on this engine instead of the spec's (ray: a local Ray head is started "
        "unless RAY_ADDRESS or the spec's address answers)."),
) -> None:
    """Run one pipeline on this machine through `airflow dags test` and print a summary."""
    if engine is not None and engine not in engine_names():
        typer.echo(f"unknown engine {engine!r} (expected one of: {', '.join(engine_names())})", err=True)
        raise typer.Exit(1)
    spec = _load_or_exit(file)
    price_error = _price_error(file, spec)
    if price_error:
        typer.echo(price_error, err=True)
        raise typer.Exit(1)
    ok = run_pipeline(spec, file.absolute(), console=console, summary_json=summary_json,
                      engine=engine)
    raise typer.Exit(0 if ok else 1)


@app.command()
def report(
    pipeline: str = typer.Argument(..., help="The pipeline's name (its DAG id)."),
    tracking_uri: str = typer.Option(
        None, help="MLflow store to read (default: $MLFLOW_TRACKING_URI, else the demo's "
        "store, sqlite:///$TRAINFORGE_HOME/mlflow/mlflow.db)."),
    plot: Path = typer.Option(None, help="Also draw goodput, GPU-hours and cost per run and the "
                              "validation loss per version into this PNG file."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON instead."),
) -> None:
    """Every run of one pipeline: goodput, GPU-hours, cost, energy, disruptions, status."""
    uri = tracking_uri or default_tracking_uri()
    try:
        found = collect_report(pipeline, uri)
    except (UnknownPipelineError, StoreError) as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(1) from None
    if plot is not None:
        if plot.suffix.lower() != ".png":
            typer.echo(f"--plot {plot}: expected a file name ending in .png", err=True)
            raise typer.Exit(2)
        from trainforge.cli.report_plot import plot_report

        try:
            found["plot"] = str(plot_report(found, plot))
        except ImportError as err:
            typer.echo(str(err), err=True)
            raise typer.Exit(1) from None
        except OSError as err:
            typer.echo(f"--plot {plot}: cannot write the plot ({err.strerror or err})", err=True)
            raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(found, indent=2))
        return
    print_report(found, console)
    if plot is not None:
        console.print(f"plot: {found['plot']}")


@app.command()
def doctor(
    spec: Path = typer.Argument(None, help="A pipeline spec: also check the torch features it "
                                "asks for (FSDP2 and DCP for fsdp, torch.compile)."),
    feature: list[str] = typer.Option(None, "--feature", help="Also check this torch feature: "
                                      f"{', '.join(checks.FEATURES)} (repeatable)."),
) -> None:
    """Check the installed packages against what trainforge needs (docs/install.md): print one
    line per problem and exit 1, else an ok line with the versions found."""
    unknown = sorted(set(feature or ()) - set(checks.FEATURES))
    if unknown:
        typer.echo(f"unknown --feature {', '.join(unknown)} (expected one of: "
                   f"{', '.join(checks.FEATURES)})", err=True)
        raise typer.Exit(2)
    asked = checks.spec_features(_load_or_exit(spec)) if spec is not None else {}
    for name in feature or ():
        asked.setdefault(name, f"--feature {name}")
    found = checks.problems(asked)
    for line in [*found, checks.flavour_note(checks.Installed())]:
        if line:
            typer.echo(line)
    if found:
        raise typer.Exit(1)
    typer.echo(checks.summary(asked=asked))


if __name__ == "__main__":
    sys.exit(app())
