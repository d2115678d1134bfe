"""Fixtures of the Docker tests: the engine, the images (built once per session) and one stack."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import data_cache, skip_without
from tests.docker.stack import (Engine, Stack, build_images, compose_command, compose_config,
                                docker_only_checkout, docker_only_path, example_env, wait_for)


@pytest.fixture(scope="session")
def docker_engine(tmp_path_factory) -> Iterator[Engine]:
    why = Engine.missing()
    if why is None and compose_command() is None:
        why = "no docker compose / docker-compose"
    if why is None and shutil.which("debootstrap") is None:
        why = "no debootstrap for the base image"
    if why is not None:
        skip_without("docker", why)
    engine = Engine.start(tmp_path_factory.mktemp("dockerd"))
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def stack_images(docker_engine, tmp_path_factory) -> dict[str, float]:
    """Every image of docker/ built from the committed Dockerfiles (seconds taken, by step),
    after the compose file passed ``compose config`` (seconds: a broken file or env contract
    fails before the build's minutes)."""
    checked = compose_config(example_env(tmp_path_factory.mktemp("config")))
    assert checked.returncode == 0, f"compose config:\n{checked.stderr[-3000:]}"
    log = tmp_path_factory.mktemp("build") / "build.log"
    times = build_images(log)
    print(f"\nimages built: base {times['base']:.0f} s, images {times['images']:.0f} s")
    return times


def _shared_dir(prefix: str) -> Path:
    """A folder the containers' non-root users can read (pytest's own are private to root)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def stack_dirs(request) -> Iterator[tuple[Path, Path, Path]]:
    """(work, specs, data): data holds the demo corpus, specs the module's SPECS."""
    from trainforge.data.corpus import fetch_corpus

    corpus = Path(fetch_corpus(data_cache(request.config) / "shakespeare",
                               timeout_s=300).dest)
    work, specs, data = _shared_dir("tf-stack-"), _shared_dir("tf-specs-"), _shared_dir("tf-data-")
    shutil.copytree(corpus, data / "shakespeare")
    for path in data.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    for name, text in getattr(request.module, "SPECS", {}).items():
        (specs / name).write_text(text)
        (specs / name).chmod(0o644)
    try:
        yield work, specs, data
    finally:
        for path in (work, specs, data):
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def stack(docker_engine, stack_images, stack_dirs) -> Iterator[Stack]:
    """The compose stack, up and healthy; `down -v` after the module (containers, volumes)."""
    work, specs, data = stack_dirs
    checkout = docker_only_checkout(work / "checkout")
    stack = Stack(docker_engine, work, specs, data, checkout)
    started = time.monotonic()
    try:
        # As a fresh clone's user on a host with Docker and compose only (no venv, no Python on
        # PATH): `make stack-up` checks docker/.env and the images, makes sure of the corpus in
        # a container of the Airflow image, then `compose up -d`.
        up = stack.make("stack-up", docker_only_path(work / "docker-only-bin"))
        assert up.returncode == 0, f"make stack-up: exit {up.returncode}\n{up.stdout[-3000:]}{up.stderr[-3000:]}"
        assert "no venv here: fetching the corpus in a container" in up.stderr, up.stderr[-3000:]
        wait_for("the stack to be healthy", stack.healthy, 420, 3.0, stack.diagnostics)
        stack.up_seconds = time.monotonic() - started
        print(f"\nstack {stack.project} healthy in {stack.up_seconds:.0f} s")
        yield stack
    finally:
        if os.environ.get("TRAINFORGE_KEEP_STACK") != "1":
            stack.compose_run("down", "-v", "--remove-orphans", "--timeout", "30", check=False)
